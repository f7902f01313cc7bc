"""Rollout engines behind one interface (base.RolloutEngine)."""

from __future__ import annotations

from grpokit.rollout.base import Completions, RolloutEngine, SamplingParams
from grpokit.rollout.episodes import ToolRollout, generate_groups, with_tools
from grpokit.rollout.mismatch import SamplerCorrection, sampler_logprobs


def make_engine(
    name: str, model, tokenizer, *, batch_size: int = 0, compile: bool = False, rollout=None
) -> RolloutEngine:
    """The engine named in rollout.engine, generating with `model` (pi_old); compile: the fast engine's
    forward through torch.compile (the hf engine ignores it); rollout: the RolloutConfig, for vllm's settings
    (vllm_mode=server: a client of the `grpokit serve` process at vllm_server_url, grpokit/rollout/server.py)."""
    if name == "hf":
        from grpokit.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, batch_size=batch_size)
    if name == "fast" and rollout is not None and rollout.async_sampler == "process":
        import torch

        from grpokit.rollout.process import ProcessEngine

        return ProcessEngine(model, tokenizer, batch_size=batch_size, threads=torch.get_num_threads())
    if name == "fast":
        from grpokit.rollout.fast import FastEngine

        return FastEngine(model, tokenizer, batch_size=batch_size, compile=compile)
    if name == "vllm" and rollout is not None and rollout.vllm_mode == "server":
        from grpokit.rollout.server import VLLMServerEngine

        return VLLMServerEngine(
            model, tokenizer, url=rollout.vllm_server_url, timeout=rollout.vllm_server_timeout
        )
    if name == "vllm":
        from grpokit.rollout.vllm import VLLMEngine

        seqs = (
            (batch_size or rollout.prompts_per_step * rollout.num_generations) if rollout is not None else 256
        )
        return VLLMEngine(
            model,
            tokenizer,
            max_seqs=seqs,
            kv_cache_mb=rollout.vllm_kv_cache_mb if rollout is not None else 0,
            gpu_memory_utilization=rollout.vllm_gpu_memory_utilization if rollout is not None else 0.3,
        )
    raise ValueError(f"unknown rollout.engine {name!r}; allowed: hf, fast, vllm")


__all__ = [
    "Completions",
    "RolloutEngine",
    "SamplerCorrection",
    "SamplingParams",
    "sampler_logprobs",
    "ToolRollout",
    "generate_groups",
    "make_engine",
    "with_tools",
]
