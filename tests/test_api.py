"""The Python API (grpokit/api.py): docs/api.md's example runs as written, and bad input is the CLI's one-line
error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import grpokit
from grpokit.config import Config, ConfigError, SFTConfig
from tests.helpers import read_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_documented_example_runs(tmp_path):
    """The python block of docs/api.md, in an empty folder: SFT, GRPO, evaluation and the report, all real."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S).group(1)
    (tmp_path / "example.py").write_text(block)
    r = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=1200
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"reward at the last step: [0-9.]+", r.stdout), r.stdout[-2000:]
    assert re.search(r"held-out pass@1: [0-9.]+", r.stdout), r.stdout[-2000:]
    assert (tmp_path / "runs/api/sft/final/model.safetensors").is_file()
    assert (tmp_path / "runs/api/grpo/final/model.safetensors").is_file()
    steps = [row for row in read_metrics(tmp_path / "runs/api/grpo") if "reward/mean" in row]
    assert len(steps) == 4
    page = (tmp_path / "runs/api/grpo/report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") or "<html" in page[:500]


def test_the_api_is_the_package_namespace():
    """grpokit.evaluate and grpokit.sft are the calls, also after their modules of the same name have
    loaded."""
    import sys

    import grpokit.evaluate  # the modules; the import system sets package attributes for them
    import grpokit.sft
    from grpokit import api

    assert (grpokit.train, grpokit.evaluate, grpokit.sft, grpokit.report) == (
        api.train,
        api.evaluate,
        api.sft,
        api.report,
    )
    assert sys.modules["grpokit.evaluate"].__file__.endswith("evaluate.py") and hasattr(
        sys.modules["grpokit.sft"], "train_sft"
    )
    with pytest.raises(AttributeError, match="trian"):
        grpokit.trian  # noqa: B018 (the attribute access is what raises)


def test_config_in_every_form_and_its_errors(tmp_path):
    from grpokit.api import _config

    path = tmp_path / "c.yaml"
    path.write_text("model: {name_or_path: m}\noptim: {max_steps: 7}\n")
    from_path = _config(path, ["optim.learning_rate=0.5"], Config)
    from_dict = _config(
        {"model": {"name_or_path": "m"}, "optim": {"max_steps": 7}}, ["optim.learning_rate=0.5"], Config
    )
    from_object = _config(
        Config.model_validate({"model": {"name_or_path": "m"}, "optim": {"max_steps": 7}}),
        ["optim.learning_rate=0.5"],
        Config,
    )
    for cfg in (from_path, from_dict, from_object):
        assert (cfg.model.name_or_path, cfg.optim.max_steps, cfg.optim.learning_rate) == ("m", 7, 0.5)
    with pytest.raises(ConfigError, match="optim.max_stepz"):
        grpokit.train({"optim": {"max_stepz": 3}})
    with pytest.raises(ConfigError, match="a SFTConfig was given where a Config is needed"):
        grpokit.train(SFTConfig())
    with pytest.raises(ConfigError, match="not found"):
        grpokit.sft(tmp_path / "missing.yaml")
