"""`grpokit demo --model tiny --quick` produces the same outputs as the tiny model's full demo."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import read_metrics

GRPOKIT = str(Path(sys.executable).with_name("grpokit"))


@pytest.mark.slow
def test_demo_quick_outputs(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run(
        [GRPOKIT, "demo", "--model", "tiny", "--quick", "--out", str(out)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SFT warm-start" in r.stdout and "after GRPO" in r.stdout  # the before / after table
    for name in ("report.md", "report.html", "reward.png", "eval.png", "kl.png", "clip.png", "lengths.png"):
        assert (out / name).is_file(), name
    rows = read_metrics(out / "grpo")
    evals = [row for row in rows if "eval/pass@1" in row]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == rows[-1]["step"]  # before and after
    assert (out / "grpo" / "final" / "model.safetensors").is_file()
    report = (out / "report.md").read_text()
    assert "pass@1" in report and "reward.png" in report
    page = (
        out / "report.html"
    ).read_text()  # grpokit report's page (rendered in a browser: tests/test_report.py)
    assert page.count('<figure class="plot"') >= 6 and "Sample completions" in page and "Doctor" in page
    assert (out / "grpo" / "completions.parquet").is_file()


@pytest.mark.slow
def test_tools_demo_quick_outputs(tmp_path):
    """`grpokit demo --task tools --quick` (a --task means the tiny model): SFT, GRPO with the calculator,
    held-out success with tools before and after."""
    out = tmp_path / "tools"
    r = subprocess.run(
        [GRPOKIT, "demo", "--task", "tools", "--quick", "--out", str(out)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out multiply with the calculator" in r.stdout and "pass@1" in r.stdout
    rows = read_metrics(out / "grpo")
    evals = [row for row in rows if "eval/pass@1" in row]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == rows[-1]["step"]
    assert all(
        "eval/tools/calls_per_episode" in e for e in evals
    )  # tool use measured on the held-out episodes
    train = [row for row in rows if "rollout/tools/calls_per_episode" in row]
    assert len(train) == 4 and all("reward/step_cost" in row and "reward/multiply" in row for row in train)
    config = (out / "grpo" / "config.yaml").read_text()
    assert "calculator" in config and "max_turns: 3" in config
    assert (out / "report.md").is_file() and (out / "grpo" / "final" / "model.safetensors").is_file()
