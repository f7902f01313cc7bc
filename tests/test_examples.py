"""The README's copy-paste example and examples/extending.py work as written (with fewer steps)."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import read_metrics

ROOT = Path(__file__).resolve().parents[1]
GRPOKIT = str(Path(sys.executable).with_name("grpokit"))


def run(*cmd, cwd=ROOT):
    r = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_readme_example(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "grpokit train examples/config.yaml" in readme and "examples.my_rewards:exact_answer" in readme
    model = tmp_path / "tiny-model"
    run(sys.executable, "examples/make_data.py")
    run(sys.executable, "examples/make_tiny_model.py", str(model))
    assert "grpokit sft examples/sft.yaml" in readme and "model.name_or_path=runs/sft/final" in readme
    sft = tmp_path / "sft"
    r = run(
        GRPOKIT,
        "sft",
        "examples/sft.yaml",
        f"model.name_or_path={model}",
        f"output_dir={sft}",
        "sft.max_steps=20",
    )
    assert (
        "threads:" in r.stdout
        and "held-out exact_match" in r.stdout
        and (sft / "final" / "model.safetensors").is_file()
    )
    out = tmp_path / "run"
    r = run(
        GRPOKIT,
        "train",
        "examples/config.yaml",
        f"model.name_or_path={sft / 'final'}",
        f"output_dir={out}",
        "optim.learning_rate=2e-4",
        "optim.max_steps=3",
        "eval.every=0",
    )
    assert "threads:" in r.stdout
    assert (out / "final" / "model.safetensors").is_file()
    metrics = (out / "metrics.jsonl").read_text()
    assert "reward/exact_answer" in metrics and "reward/is_a_number" in metrics
    r = run(
        GRPOKIT,
        "train",
        "examples/config.yaml",
        f"model.name_or_path={sft / 'final'}",
        f"output_dir={out}",
        "optim.learning_rate=2e-4",
        "optim.max_steps=3",
        "eval.every=0",
    )  # the same command
    assert "resum" in (r.stdout + r.stderr).lower()
    r = run(
        GRPOKIT, "eval", str(out / "final"), "-c", "examples/config.yaml", f"output_dir={tmp_path / 'ev'}"
    )
    assert "pass@1" in r.stdout


def test_extending_example(tmp_path, tiny_model_dir):
    """examples/extending.py (docs/extending.md's worked example) runs end to end on the tiny model."""
    assert "examples/extending.py" in (ROOT / "docs" / "extending.md").read_text()
    out = tmp_path / "run"
    r = run(sys.executable, "examples/extending.py", "--model", str(tiny_model_dir), "--out", str(out))
    metrics = read_metrics(out)
    steps = [m for m in metrics if "reward/correct_sum" in m]
    assert len(steps) == 2 and all("reward/used_a_tool" in m for m in steps)
    assert (out / "final" / "model.safetensors").is_file()
    assert "total(12, 7) as a tool call: 19" in r.stdout
    assert "PlainSampler: 4 completions" in r.stdout and "PlainSampler with the tool: 2 episodes" in r.stdout


@pytest.mark.slow  # importing vLLM's attention backends takes 20 s here
def test_the_readme_example_model_has_a_head_size_every_engine_runs(tmp_path, monkeypatch):
    """The model the README builds runs with rollout.engine=vllm too: vLLM's CPU attention takes its head
    size (checked as VLLMEngine checks it, without starting vLLM)."""
    import runpy

    from transformers import AutoConfig

    from tests.helpers import require

    require("vllm")
    from grpokit.rollout.vllm import check_head_size, head_size

    command = "python examples/make_tiny_model.py runs/tiny-model"
    assert command in (ROOT / "README.md").read_text()
    monkeypatch.setattr(sys, "argv", [command.split()[1], str(tmp_path / "tiny-model")])
    runpy.run_path(str(ROOT / "examples" / "make_tiny_model.py"), run_name="__main__")
    model = SimpleNamespace(config=AutoConfig.from_pretrained(tmp_path / "tiny-model"))
    assert head_size(model) == 32
    check_head_size(model)  # raises ConfigError on a size vLLM's CPU kernel lacks (the "test" preset's 24)
