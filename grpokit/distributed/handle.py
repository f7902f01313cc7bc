"""The policy, one handle: what the optimizer steps, what the log-prob passes call, pi_ref, the whole weights.

    policy = world.wrap(model, ref)     # grpokit/distributed/: FSDP2 / DDP under torchrun; the model alone
    policy.compile()                    # model.compile: the training and pi_ref forwards, compiled
    policy.module                       # the parameters the optimizer steps (FSDP2: sharded in place)
    policy.forward                      # what the training and pi_old passes call (DDP: the wrapper)
    policy.ref, policy.ref_forward      # pi_ref (frozen; None when the run has no KL term)
    policy.full()                       # the whole weights, current: the engine's
    policy.release()                    # the rollout is done: the engine's copy (FSDP2) frees its weights
    policy.saved()                      # the whole weights to save (FSDP2: gathered in their own dtype)
    policy.gathered()                   # those weights in one module on rank 0 (FSDP2: gathered), else None
    policy.reset_reference()            # pi_ref <- pi_theta (algorithm.ref_policy=reset)

One process: module, forward, full() and saved() are the model itself, and release() does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class PolicyHandle:
    def __init__(
        self,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        ref: Any,  # a frozen Module, policy.AdapterOff (LoRA: the adapter-off base), or None
        *,
        whole: torch.nn.Module,
        full: Callable[[], torch.nn.Module],
        reset_reference: Callable[[], None],
        release: Callable[[], None] = lambda: None,
        saved: Callable[[], torch.nn.Module] | None = None,
    ):
        self.module, self.forward, self.ref = module, forward, ref
        self.ref_forward: Callable[..., Any] | None = ref
        self.whole = (
            whole  # the module with whole weights that the engine generates with (full() refreshes it)
        )
        self._full, self._reset = full, reset_reference
        self._release, self._saved = release, saved or full

    def compile(self) -> None:
        """The training forward and pi_ref's through torch.compile (model.compile)."""
        # Several graphs of one forward (rollout, pi_ref, training); dynamo's default limit is 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        self.forward = torch.compile(self.forward)
        if self.ref is not None:
            self.ref_forward = torch.compile(self.ref)

    def full(self) -> torch.nn.Module:
        """The policy with whole weights, current (FSDP2: refreshed from the shards; every rank calls it).
        FSDP2 with rollout.engine=vllm: the sharded module itself, which the engine gathers from as it pushes
        and the final save gathers (Parallel.whole_copy)."""
        return self._full()

    def release(self) -> None:
        """This step's rollouts are done: until the next full(), the engine's weights are not needed (FSDP2
        with fast / hf: its whole copy gives its memory back for the update, Parallel.release_engine_copy)."""
        self._release()

    def saved(self) -> torch.nn.Module:
        """The policy to save whole, current: full() where it holds the training weights; FSDP2 with a bf16
        engine copy or none, the sharded module (records.save_final gathers it on rank 0)."""
        return self._saved()

    def gathered(self) -> torch.nn.Module | None:
        """saved(), whole in one module on rank 0 (FSDP2: the shards gathered, checkpoint.whole_module; every
        rank calls it); the others get None. One process and DDP: the module itself."""
        from grpokit.checkpoint.whole import whole_module  # a save's business: not loaded with the policy

        return whole_module(self.saved())

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta (DeepSeekMath §4.1.4 iterative RL)."""
        self._reset()
