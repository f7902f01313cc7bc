"""The clipped policy-gradient loss of GRPO and its family: a pure function of log-probs.

    loss, metrics = policy_loss(logp, old_logp, advantages, mask, ref_logp=..., beta=..., loss_type=...)

Per token (DeepSeekMath eq. 3, with the DAPO / Dr. GRPO / GSPO variants):
    rho   = pi_theta / pi_old                                (token) or GSPO's sequence ratio
    obj   = min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
    obj   = max(obj, dual_clip * A)       where A < 0, only if dual_clip is set (Ye et al. 2020)
    loss  = -obj + beta * KL_k(pi_theta || pi_ref)          KL added after clipping
The per-token losses are then reduced by one of AGGREGATIONS (docs/algorithm.md lists each
normalizer and its paper). Every reduction is a sum divided by a batch-level constant, so the
gradient of one big batch equals the sum of the gradients of its minibatches when the caller
passes the whole batch's `num_sequences` / `num_tokens` (gradient accumulation and several ranks
do not change the math).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpokit.algo.kl import kl_penalty
from grpokit.algo.ops import masked_mean, masked_sum, pick

# Each aggregation: (per-token loss [N, T], mask [N, T], normalizers) -> scalar.
Aggregation = Callable[[Tensor, Tensor, "Normalizers"], Tensor]


class Normalizers:
    """The batch-level constants a loss divides by. Defaults: this call's own batch."""

    def __init__(
        self,
        mask: Tensor,
        num_sequences: int | None,
        num_tokens: int | float | None,
        max_completion_length: int | None,
    ):
        self.num_sequences = num_sequences if num_sequences is not None else mask.shape[0]
        self.num_tokens = num_tokens if num_tokens is not None else mask.sum()
        # Dr. GRPO's constant; without one, the padded width stands in for it.
        self.max_completion_length = (
            max_completion_length if max_completion_length is not None else mask.shape[1]
        )


def _seq_mean_token_mean(loss: Tensor, mask: Tensor, norm: Normalizers) -> Tensor:
    # DeepSeekMath: 1/G sum_i 1/|o_i| sum_t.  Each sequence weighs the same, so tokens of
    # long completions weigh less (the length bias Dr. GRPO and DAPO point out).
    per_seq = masked_sum(loss, mask, dim=-1) / mask.sum(-1).clamp_min(1)  # [N]
    return per_seq.sum() / norm.num_sequences


def _token_mean(loss: Tensor, mask: Tensor, norm: Normalizers) -> Tensor:
    # DAPO eq. (12): 1/sum_i |o_i| sum_i sum_t.  Every token weighs the same.
    return masked_sum(loss, mask) / torch.as_tensor(norm.num_tokens, dtype=loss.dtype).clamp_min(1)


def _constant_normalizer(loss: Tensor, mask: Tensor, norm: Normalizers) -> Tensor:
    # Dr. GRPO (Liu et al. 2025, §3.2): divide by a constant, N x max_completion_length, not by lengths.
    return masked_sum(loss, mask) / (norm.num_sequences * norm.max_completion_length)


AGGREGATIONS: dict[str, Aggregation] = {
    "grpo": _seq_mean_token_mean,
    "bnpo": _token_mean,
    "dapo": _token_mean,
    "dr_grpo": _constant_normalizer,
}


def _token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    return logp - old_logp  # [N, T]


def _sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    # GSPO (Zheng et al. 2025, eq. 7): s_i = (pi_theta(y_i) / pi_old(y_i)) ** (1 / |y_i|),
    # i.e. exp of the length-normalized sum of token log-ratios; one ratio per sequence.
    per_seq = masked_mean(logp - old_logp, mask, dim=-1)  # [N]
    return per_seq.unsqueeze(-1).expand_as(logp)  # [N, T]


RATIO_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    loss_type: str = "grpo",
    ratio_level: str = "token",
    max_completion_length: int | None = None,
    kl_estimator: str = "k3",
    dual_clip: float | None = None,
    num_sequences: int | None = None,
    num_tokens: int | float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """-J for one batch (or a minibatch of it).

    logp, old_logp, ref_logp, mask: [N, T] (mask = 1 on completion tokens).
    advantages: [N] (outcome, broadcast to every token) or [N, T] (process / per-token).
    eps_high None means eps_low. dual_clip: the lower bound c > 1 on the objective of A < 0 tokens.
    num_sequences, num_tokens: the whole batch's counts when this call sees a minibatch of it.
    is_weights: [N, T] importance weights against the sampler-trainer mismatch (grpokit.algo.importance, TRL's
    vllm_importance_sampling_*): they multiply each token's surrogate loss, after clipping, before the KL
    term. Returns the scalar loss and metrics (python floats): clip fractions, ratio, KL, per-token loss.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} must "
            "match"
        )
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (log-probs of the reference policy)")
    if eps_low < 0 or (eps_high is not None and eps_high < 0):
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    aggregate = pick(AGGREGATIONS, loss_type, "loss_type")
    log_ratio_fn = pick(RATIO_LEVELS, ratio_level, "ratio_level")
    eps_high = eps_low if eps_high is None else eps_high

    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # [N, 1] or [N, T]

    log_ratio = log_ratio_fn(logp, old_logp.detach(), mask)
    # Masked positions get ratio 1 so that garbage in padding never produces inf * 0 = NaN.
    ratio = torch.exp(torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio)))  # [N, T]
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    obj = torch.minimum(ratio * adv, clipped * adv)  # [N, T]
    if dual_clip is not None:
        obj = torch.where(adv < 0, torch.maximum(obj, dual_clip * adv), obj)
    per_token = -obj
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    kl = None
    if ref_logp is not None:
        # Same for the KL: padding compares 0 with 0, so garbage there (e.g. logp = -inf) cannot make
        # an inf that the masked sum hides in the forward pass but turns into 0 * inf = NaN in backward.
        on = mask.bool()
        kl = kl_penalty(
            torch.where(on, logp, torch.zeros_like(logp)),
            torch.where(on, ref_logp, torch.zeros_like(ref_logp)),
            kind=kl_estimator,
        )
        if beta != 0.0:
            per_token = per_token + beta * kl

    norm = Normalizers(mask, num_sequences, num_tokens, max_completion_length)
    loss = aggregate(per_token, mask, norm)
    return loss, _loss_metrics(ratio, adv, mask, eps_low, eps_high, kl, per_token)


@torch.no_grad()
def _loss_metrics(
    ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    kl: Tensor | None,
    per_token: Tensor,
) -> dict[str, float]:
    """policy_loss's metrics (python floats): clip fractions (low: ratio < 1 - eps_low where A < 0; high:
    ratio > 1 + eps_high where A > 0), mean ratio, mean KL and mean per-token loss over the masked tokens."""
    r = ratio.detach()
    a = adv.expand_as(r)
    low = (r < 1.0 - eps_low) & (a < 0)
    high = (r > 1.0 + eps_high) & (a > 0)
    return {
        "clip_frac_low": masked_mean(low.to(r.dtype), mask).item(),
        "clip_frac_high": masked_mean(high.to(r.dtype), mask).item(),
        "clip_frac": masked_mean((low | high).to(r.dtype), mask).item(),
        "ratio_mean": masked_mean(r, mask).item(),
        "kl": masked_mean(kl.detach(), mask).item() if kl is not None else 0.0,
        "token_loss": masked_mean(per_token.detach(), mask).item(),
    }
