"""Rollout engines behind one interface (base.RolloutEngine)."""
from __future__ import annotations

from grpokit.rollout.base import Completions, RolloutEngine, SamplingParams
from grpokit.rollout.mismatch import SamplerCorrection, sampler_logprobs
from grpokit.rollout.episodes import ToolRollout, generate_groups, with_tools


def make_engine(name: str, model, tokenizer, *, batch_size: int = 0, compile: bool = False) -> RolloutEngine:
    """The engine named in rollout.engine, generating with `model` (pi_old); compile: the fast engine's
    forward through torch.compile (the hf engine ignores it)."""
    if name == "hf":
        from grpokit.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, batch_size=batch_size)
    if name == "fast":
        from grpokit.rollout.fast import FastEngine

        return FastEngine(model, tokenizer, batch_size=batch_size, compile=compile)
    raise ValueError(f"unknown rollout.engine {name!r}; allowed: hf, fast")


__all__ = ["Completions", "RolloutEngine", "SamplerCorrection", "SamplingParams", "sampler_logprobs", "ToolRollout", "generate_groups", "make_engine", "with_tools"]
