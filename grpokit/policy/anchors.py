"""The log-probs a rollout batch is trained against: pi_old (the ratio's anchor) and pi_ref (the KL's).

    old, ref, kl_old = anchor_logprobs(cfg, policy, tokens, sampler_logp, kl_shaping=kl)  # [N, T] or None

pi_old is what sampled the batch. It is pi_theta itself (no pass: the loss uses pi_theta detached) when no
optimizer step falls inside the batch's updates and the samples are on-policy. The trainer recomputes it when
one does (algorithm.num_iterations > 1 or optim.num_minibatches > 1), or with asynchronous rollouts under
importance correction (decoupled PPO: our own log-probs anchor the ratio, corrected by pi_old / pi_sampler).
With asynchronous rollouts and no correction it is the engine's own sampling log-probs (the behaviour
policy). docs/rollout.md has the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from torch import Tensor

from grpokit.config import Config
from grpokit.data.batch import PackedBatch
from grpokit.data.micro_batches import MicroBatching
from grpokit.distributed.handle import PolicyHandle
from grpokit.distributed.sequence import SequenceGroup
from grpokit.distributed.sequence_turns import sequence_parallel_batched_logprobs
from grpokit.policy import batched_logprobs


def pi_old_source(cfg: Config) -> Literal["sampler", "policy", "none"]:
    """Where pi_old's log-probs come from: the engine's ("sampler"), a pass of the policy ("policy"), or
    nowhere ("none": pi_old = pi_theta)."""
    lagged, correct = cfg.rollout.off_policy, cfg.rollout.importance_correction != "none"
    if lagged and not correct:
        return "sampler"
    if cfg.algorithm.num_iterations > 1 or cfg.optim.num_minibatches > 1 or lagged:
        return "policy"
    return "none"


def anchor_logprobs(
    cfg: Config,
    policy: PolicyHandle,
    tokens: PackedBatch,
    sampler_logp: Tensor | None,
    *,
    kl_shaping: bool,
    most: Callable[[int], int] | None = None,
    sp: SequenceGroup | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(pi_old, pi_ref, the pi_old of PPO's KL shaping) log-probs [N, T] of the batch, None where not needed.
    kl_shaping: the critic puts a KL into the reward, which needs pi_old's log-probs even at one pass. most:
    World.most, so that every rank runs as many micro-batches (optim.max_tokens_per_micro_batch). sp: the
    sequence group, whose members run each other's micro-batches split over the group."""

    def logprobs(model) -> Tensor:
        batching, temperature = MicroBatching.of(cfg), cfg.rollout.temperature
        if sp is not None:
            return sequence_parallel_batched_logprobs(
                model, tokens, batching, sp, temperature=temperature, most=most or (lambda n: n)
            )
        return batched_logprobs(model, tokens, batching, temperature=temperature, most=most)

    source = pi_old_source(cfg)
    old = sampler_logp if source == "sampler" else None
    if source == "policy":
        old = logprobs(policy.forward)
    ref = logprobs(policy.ref_forward) if policy.ref_forward is not None else None
    kl_old = old
    if old is None and kl_shaping:  # PPO's KL shaping, at mu = 1 too
        kl_old = logprobs(policy.module)
    return old, ref, kl_old
