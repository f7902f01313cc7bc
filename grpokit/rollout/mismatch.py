"""The sampler-trainer mismatch in the loop: metrics for every engine that returns log-probs, and
rollout.importance_correction's weights (the math: grpokit/algo/importance.py).

    batch = RolloutBatch(..., sampler_logp=sampler_logprobs(comps, tokens))   # [N, T] or None (hf)
    correction = SamplerCorrection(cfg.rollout)
    is_weights = correction(batch.rows(idx), logp, mask, acc, first_pass)   # per micro-batch; None = off
    metrics = correction.pop_metrics()                                  # the max |diff|, once per step

pi_old is what the ratio of the loss divides by: the trainer's log-probs of the batch before any update
(batch.old_logp when the loop computed them, else the first pass's own log-probs, which are pi_old then).
The mismatch is measured against those on the first pass over the batch (every row once), on the loss mask.
With rollout.max_policy_lag > 0 and no correction, pi_old is the sampler's own log-probs (batch.old_logp holds
batch.sampler_logp); the mismatch is then measured against the first pass's log-probs, the policy being
trained: the policy lag and the engine's differences together.
Metrics: rollout/logp_diff_mean, rollout/logp_diff_max, rollout/sampler_kl (k3), and with a correction on
rollout/is_weight_mean, rollout/is_clip_frac (docs/metrics.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpokit.algo.importance import importance_weights, sampler_mismatch, weight_stats
from grpokit.metrics.compute import (
    ROLLOUT_IS_CLIP_FRAC,
    ROLLOUT_IS_WEIGHT_MEAN,
    ROLLOUT_LOGP_DIFF_MAX,
    ROLLOUT_LOGP_DIFF_MEAN,
    ROLLOUT_SAMPLER_KL,
    MeanAccumulator,
)


def sampler_logprobs(comps, tokens) -> Tensor | None:
    """[N, T] the engine's log-probs of the sampled tokens laid out like tokens.completion_ids (0 past each
    completion's end), or None when the engine returns none (hf)."""
    if comps.logprobs is None:
        return None
    out = torch.zeros(tokens.completion_ids.shape, dtype=torch.float32)  # [N, T]
    for i, lp in enumerate(comps.logprobs):
        out[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out


class SamplerCorrection:
    """Per micro-batch: the mismatch metrics (first pass) and the importance weights
    (rollout.importance_correction)."""

    def __init__(self, rollout_cfg) -> None:
        self.mode = rollout_cfg.importance_correction
        self.c_min, self.c_max = rollout_cfg.importance_c_min, rollout_cfg.importance_c_max
        # pi_old is the sampler itself with rollout.max_policy_lag or partial rollouts and no correction:
        # measure against the policy trained.
        self.old_is_sampler = rollout_cfg.off_policy and self.mode == "none"
        self._max: float | None = None

    def __call__(
        self, mb, logp: Tensor, mask: Tensor, acc: MeanAccumulator, first_pass: bool
    ) -> Tensor | None:
        """[n, T] weights for the micro-batch mb (a RolloutBatch.rows; None: no correction). logp: pi_theta's
        [n, T], which is pi_old when the batch has no old_logp; mask: the micro-batch's loss mask [n, T]."""
        if mb.sampler_logp is None:
            return None
        own = mb.old_logp is not None and not self.old_is_sampler
        old = mb.old_logp if own else logp.detach()  # [n, T]
        sampler = mb.sampler_logp.to(old.dtype)  # [n, T]
        n = mask.sum().item()
        if first_pass and n > 0:
            stats = sampler_mismatch(old, sampler, mask)
            acc.add({ROLLOUT_LOGP_DIFF_MEAN: stats["abs_diff_mean"], ROLLOUT_SAMPLER_KL: stats["kl_k3"]}, n)
            self._max = max(self._max or 0.0, stats["abs_diff_max"])
        if self.mode == "none":
            return None
        weights = importance_weights(old, sampler, mask, self.mode, c_min=self.c_min, c_max=self.c_max)
        if first_pass and n > 0:
            w = weight_stats(weights, self.mode, old, sampler, mask)
            acc.add({ROLLOUT_IS_WEIGHT_MEAN: w["weight_mean"], ROLLOUT_IS_CLIP_FRAC: w["clip_frac"]}, n)
        return weights

    def pop_metrics(self) -> dict[str, float]:
        """rollout/logp_diff_max of the step (a max, which a weighted mean over micro-batches cannot give);
        resets."""
        out = {} if self._max is None else {ROLLOUT_LOGP_DIFF_MAX: self._max}
        self._max = None
        return out
