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

# The shared containers, defined at the bottom layer and re-exported for the engines.
from grpokit.types import Completions as Completions
from grpokit.types import SamplingParams as SamplingParams


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
    kept_sets: bool = False
    """Records the set of tokens its top-k / top-p sampler kept at each step (Completions.kept), which the
    log-prob passes replay (rollout.replay_truncation)."""
    whole_copy: bool = True
    """Under FSDP2, samples from a whole copy of the policy that the trainer refills from the shards after
    each update (distributed.engine_copy: its dtype). False: takes the weights from the shards itself as it
    pushes (each tensor gathered), so no whole copy is kept, and a background sampler would have none."""
    lag_at_ranks: bool = True
    """Samples ahead of the trainer (max_policy_lag > 0) under torchrun: a background sampler per rank whose
    pushes run beside the training's collectives (a server cannot take them)."""


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


def cache_kwarg(model: torch.nn.Module) -> str:
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
