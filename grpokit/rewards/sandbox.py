"""Moved: the sandbox is its own package, grpokit.sandbox (the code_tests reward and the python tool both use
it). This old import path keeps working, with a DeprecationWarning; import from grpokit.sandbox instead."""

import warnings

from grpokit.sandbox import (
    UID_BASE,
    UID_COUNT,
    Isolation,
    Limits,
    SandboxResult,
    isolation_mode,
    run_many,
    run_python,
)

warnings.warn(
    "grpokit.rewards.sandbox moved to grpokit.sandbox; import Limits, run_python and run_many from there",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "UID_BASE",
    "UID_COUNT",
    "Isolation",
    "Limits",
    "SandboxResult",
    "isolation_mode",
    "run_many",
    "run_python",
]
