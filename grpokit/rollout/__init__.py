"""Rollout engines behind one interface (base.RolloutEngine); which one a config runs: engines.py."""

from __future__ import annotations

from grpokit.rollout.base import Completions, EngineCaps, RolloutEngine, SamplingParams
from grpokit.rollout.engines import check_engine, make_engine
from grpokit.rollout.mismatch import SamplerCorrection, sampler_logprobs

__all__ = [
    "Completions",
    "EngineCaps",
    "RolloutEngine",
    "SamplerCorrection",
    "SamplingParams",
    "check_engine",
    "sampler_logprobs",
    "make_engine",
]
