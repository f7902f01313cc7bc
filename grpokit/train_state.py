"""What a training checkpoint holds beside the weights, and the resume that puts it back.

    state = TrainState(cfg, world, policy, optimizer, sampler, critic)
    state.state_dict(sampler_state)    # the optimizer and its schedule, the data position, pi_ref, the
                                       # critic, the adaptive entropy coefficient (state.entropy)
    state.resume(out)                  # (the checkpoint's step, the trainer's step), or None: nothing there

The weights, optimizer moments and RNGs go through World.save_checkpoint / load_checkpoint (one process, or
every rank's shards); checkpoint.resume compares the checkpoint's config with this run's first.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from grpokit.algorithm import EntropyControl
from grpokit.checkpoint import checkpoint_dir, resume
from grpokit.config import Config
from grpokit.critic import Critic
from grpokit.data import PromptSampler
from grpokit.distributed import World
from grpokit.optim import Optimizer
from grpokit.policy_handle import PolicyHandle


class TrainState:
    def __init__(
        self,
        cfg: Config,
        world: World,
        policy: PolicyHandle,
        optimizer: Optimizer,
        sampler: PromptSampler,
        critic: Critic | None,
    ) -> None:
        self.cfg, self.world, self.policy = cfg, world, policy
        self.optimizer, self.sampler, self.critic = optimizer, sampler, critic
        self.entropy = EntropyControl(cfg.algorithm)  # the entropy bonus coefficient of the next step

    def state_dict(self, sampler_state: dict) -> dict[str, Any]:
        """sampler_state: the prompt sampler's position of the next batch to train (with
        rollout.max_policy_lag, batches generated ahead are drawn again after a resume)."""
        state = {
            **self.optimizer.state_dict(),
            **self.entropy.state_dict(),
            "sampler": sampler_state,
            "config": self.cfg.model_dump(),
        }
        if self.cfg.algorithm.ref_policy == "reset" and self.policy.ref is not None:
            state["ref_model"] = self.policy.ref.state_dict()  # no longer the initial weights
        return {**state, **(self.critic.state_dict() if self.critic is not None else {})}

    def resume(self, out: Path) -> tuple[int, int] | None:
        """Continue from the newest checkpoint in `out` (checkpoint.resume): weights, optimizer, schedule,
        data position, RNGs, pi_ref (when reset) and the critic. Returns (its step, the trainer's step), or
        None."""
        if not self.cfg.checkpoint.resume:
            return None
        load = functools.partial(
            self.world.load_checkpoint,
            model=self.policy.module,
            adamw=self.optimizer.adamw,
            seed=self.cfg.seed,
        )
        found = resume(
            out, self.policy.module, self.cfg.model_dump(), self.cfg.checkpoint.allow_changes, load
        )
        if found is None:
            return None
        step, state, _ = found  # resume printed the changes that checkpoint.allow_changes let through
        self.optimizer.load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self.entropy.load_state_dict(state)
        if "ref_model" in state and self.policy.ref is not None:
            self.policy.ref.load_state_dict(state["ref_model"])
        if self.critic is not None:
            self.critic.load_state_dict(state, str(checkpoint_dir(out, step)))
        return step, state["step"]
