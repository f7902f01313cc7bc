"""The rollout interface: every engine turns prompt token ids into G completions each.

    engine.generate(prompt_token_ids, n, sampling) -> Completions

Output order is prompt-major: completions [i*n, (i+1)*n) belong to prompt i, so groups are
contiguous as group_advantages expects. The engine plays pi_old: `sync_weights(model)` is called
after every optimizer step that precedes a rollout.

An engine class says what it can do in `caps` (an EngineCaps), read without building it: the start-up check
(grpokit/rollout/engines.py) compares the config against it, and docs/rollout.md's engine table is made from
it. `close()`, `sleep()` and `wake_up()` are part of the interface; an engine that subclasses RolloutEngine
inherits them as no-ops. The pipeline that owns an engine closes it (grpokit/rollout/pipeline.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    """Max new tokens per completion."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""
    greedy: bool = False
    """Argmax decoding (temperature, top_p and top_k are ignored)."""
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end a completion as EOS does (kept in it): the fast engine stops a row there; an
    engine without them (hf) generates on and the caller cuts (multi-turn episodes stop a turn at a tool call
    this way)."""
    generator: torch.Generator | None = None
    """The random stream that draws the samples; None = torch's global generator (the run's, which a resume
    restores). Asynchronous rollouts give their background sampler one of its own, so that the trainer's draws
    in the other thread never interleave with it (the same seed then gives the same samples). The hf engine
    has none."""


@dataclass
class Completions:
    token_ids: list[list[int]]  # [N][len_i] completion tokens, EOS included when the model stopped
    texts: list[str]  # [N] decoded without special tokens
    finish_reasons: list[str]  # [N] "stop" (EOS) | "length" (hit max_tokens: truncated)
    # [N][len_i] sampler log-probs (after temperature), if the engine has them (fast, vllm: yes; hf: no). The
    # loop measures the sampler-trainer mismatch with them and, with rollout.importance_correction, corrects
    # for it (rollout/mismatch.py, docs/rollout.md); tests: test_rollout_fast.py, test_rollout_vllm.py,
    # test_importance.py.
    logprobs: list[list[float]] | None = None
    # Multi-turn episodes with tools (grpokit/rollout/episodes.py); None for one-turn completions. token_ids
    # then interleave the model's turns with tool results: model_mask [N][len_i] is 1 on tokens the model
    # sampled and 0 on tool-result / template tokens, which are context only (never trained on, never counted
    # in a normalizer).
    model_mask: list[list[int]] | None = None
    episodes: list | None = None  # [N] grpokit.tools.Episode: messages, tool calls and results, turns
    # [N] the policy version (optimizer steps taken) whose weights sampled each completion; None when the
    # engine does not say (the loop then knows it: synchronous rollouts are always the current version). The
    # server engine reports it per sample; asynchronous rollouts (rollout.max_policy_lag) fill it and log the
    # lag.
    versions: list[int] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def truncated(self) -> list[bool]:
        return [r == "length" for r in self.finish_reasons]


@dataclass(frozen=True)
class EngineCaps:
    """What an engine can do: a typed declaration on its class (`caps`), read without building the engine."""

    sampling_logprobs: bool = False
    """Returns the sampler's log-probs (Completions.logprobs): importance correction and asynchronous rollouts
    (pi_old of samples from older weights) need them."""
    several_ranks: bool = True
    """Runs under torchrun, one engine per rank."""
    lora: bool = True
    """Samples from a policy with LoRA adapters (model.lora)."""
    stop_sequences: bool = False
    """Stops a row at SamplingParams.stop_token_ids itself (else the caller cuts the completion there)."""
    sleep: bool = False
    """sleep() frees accelerator memory while the trainer updates, and wake_up() brings it back."""
    own_process: bool = False
    """Samples in a process of its own (a server, or a child process) rather than in the trainer's."""
    compiles: bool = False
    """Puts its forward through torch.compile when model.compile is set."""


class RolloutEngine(Protocol):
    """The interface of every engine. Subclassing it (a Protocol used as a base class) gives the no-op close,
    sleep and wake_up; `caps` says what the engine can do."""

    @property
    def caps(self) -> EngineCaps:
        """What the engine can do; an engine class sets it as a class attribute (read without an instance)."""
        return EngineCaps()

    def generate(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams
    ) -> Completions: ...

    def sync_weights(self, model: torch.nn.Module, version: int | None = None) -> None:
        """The engine samples from `model`'s weights from now on; `version`: which policy version they are
        (optimizer steps), for an engine that reports it per sample (the server); the others ignore it."""

    def close(self) -> None:
        """Free what the engine holds (a process, a server connection, vLLM's state); nothing by default."""
        return None

    def sleep(self) -> None:
        """Free accelerator memory until wake_up() (caps.sleep); nothing by default."""
        return None

    def wake_up(self) -> None:
        """Undo sleep(); nothing by default."""
        return None


def cut_at_eos(ids: list[int], eos_ids: set[int], max_tokens: int) -> tuple[list[int], str]:
    """Keep tokens up to and including the first EOS; 'length' when there is none within max_tokens."""
    for j, t in enumerate(ids[:max_tokens]):
        if t in eos_ids:
            return ids[: j + 1], "stop"
    return ids[:max_tokens], "length"


def cache_kwarg(model) -> str:
    """The name of the cache argument of the model's forward: `cache` in recent transformers,
    `past_key_values` before."""
    for m in (model, getattr(model, "get_base_model", lambda: None)()):
        if m is None:
            continue
        params = inspect.signature(m.forward).parameters
        for name in ("cache", "past_key_values"):
            if name in params:
                return name
    return "past_key_values"
