"""Sampler-trainer mismatch: how far the rollout engine's log-probs are from the trainer's, and truncated
importance sampling that corrects for it. Pure functions of tensors.

    stats = sampler_mismatch(old_logp, sampler_logp, mask)        # mean |diff|, k3 KL, max |diff|
    w = importance_weights(old_logp, sampler_logp, mask, "token_truncate", c_min=None, c_max=3.0)   # [N, T]
    loss, _ = policy_loss(..., is_weights=w)                      # each token's surrogate loss times w

The engine samples from pi_sampler (vLLM's kernels, another dtype, stale weights under async rollouts); the
ratio of the loss is taken against pi_old as the trainer computes it. The samples are then off-policy for
pi_old by rho = pi_old(y_t) / pi_sampler(y_t) (Yao et al. 2025, "Your efficient RL framework secretly brings
you off-policy RL training", truncated importance sampling). The four modes are TRL 1.16's
(`vllm_importance_sampling_mode`, bounds `vllm_importance_sampling_clip_min` / `_clip_max`), so a TRL user
finds the same switches; their definitions, as TRL 1.16 applies them:

    d_t = (log pi_old(y_t) - log pi_sampler(y_t)) on completion tokens, 0 elsewhere
    token_*:    rho_t = exp(d_t)                    one weight per token
    sequence_*: rho   = exp(sum_t d_t)              one weight per sequence (the product of token ratios,
                                                    not GSPO's length-normalized mean), on all its tokens
    geometric_mask: g = exp(mean_t d_t)         the geometric mean of the token ratios, one per sequence:
                                                    weight 0 outside [C_min, C_max], else 1 (a rejection
                                                    mask, as verl / SkyRL / OpenRLHF / NeMo-RL have it)
    *_truncate: rho <- clamp(rho, C_min, C_max)     (a missing bound does not clamp)
    *_mask:     rho <- 0 where rho < C_min or rho > C_max   (the token / sequence gets no loss)

The weight multiplies the per-token surrogate loss (after PPO clipping, before the KL term is added) and
carries no gradient. NaN sampler log-probs (none from our engines) count as d = 0: no correction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpokit.algo.kl import kl_penalty
from grpokit.algo.ops import masked_mean

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask")


def _log_diff(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> Tensor:
    """[N, T] log pi_old - log pi_sampler on masked tokens, 0 elsewhere (and where either is NaN)."""
    d = torch.where(mask.bool(), old_logp.detach() - sampler_logp, torch.zeros_like(old_logp))
    return torch.nan_to_num(d, nan=0.0)


def _token_ratio(d: Tensor, mask: Tensor) -> Tensor:
    return torch.exp(d)  # [N, T]


def _sequence_ratio(d: Tensor, mask: Tensor) -> Tensor:
    return torch.exp(d.sum(-1, keepdim=True)).expand_as(d)  # [N, T]: each row's one ratio on all its tokens


def _geometric_ratio(d: Tensor, mask: Tensor) -> Tensor:
    # the geometric mean of the token ratios, exp(mean_t d_t): the length-normalized sequence ratio
    return torch.exp(masked_mean(d, mask, dim=-1).unsqueeze(-1)).expand_as(d)  # [N, T]


def _truncate(rho: Tensor, c_min: float | None, c_max: float | None) -> Tensor:
    return rho.clamp(min=c_min, max=c_max)


def _mask(rho: Tensor, c_min: float | None, c_max: float | None) -> Tensor:
    lo = float("-inf") if c_min is None else c_min
    hi = float("inf") if c_max is None else c_max
    return rho.masked_fill((rho < lo) | (rho > hi), 0.0)


LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": _token_ratio,
    "sequence": _sequence_ratio,
    "geometric": _geometric_ratio,
}
BOUNDS: dict[str, Callable[[Tensor, float | None, float | None], Tensor]] = {
    "truncate": _truncate,
    "mask": _mask,
}


def importance_weights(
    old_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    mode: str,
    *,
    c_min: float | None = None,
    c_max: float | None = 3.0,
) -> Tensor:
    """[N, T] detached weights rho (see the module docstring); 1 on tokens outside the mask.

    old_logp: the trainer's log pi_old [N, T]; sampler_logp: the engine's [N, T]; mask: completion tokens [N,
    T].
    mode: one of MODES. c_min / c_max: the bounds (None: that side unbounded); c_min < c_max."""
    if mode not in MODES:
        raise ValueError(f"unknown importance correction mode {mode!r}; allowed: {', '.join(MODES)}")
    if c_min is not None and c_max is not None and not c_min < c_max:
        raise ValueError(f"importance weight bounds need c_min < c_max, got c_min={c_min}, c_max={c_max}")
    if old_logp.shape != sampler_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} and mask "
            f"{tuple(mask.shape)} must match"
        )
    level, bound = mode.split("_")
    with torch.no_grad():
        rho = BOUNDS[bound](LEVELS[level](_log_diff(old_logp, sampler_logp, mask), mask), c_min, c_max)
        if level == "geometric":  # a rejection mask only: a kept sequence keeps weight 1
            rho = (rho > 0).to(rho.dtype)
        return torch.where(mask.bool(), rho, torch.ones_like(rho))


def sampler_mismatch(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the sampler is from the trainer on the sampled tokens (masked), as python floats:
    abs_diff_mean = mean |log pi_old - log pi_sampler|, abs_diff_max = its max, and
    kl_k3 = mean of k3 = rho - 1 - log rho with rho = pi_old / pi_sampler: an unbiased, non-negative estimate
    of KL(pi_sampler || pi_old) from samples of pi_sampler (Schulman's k3; 0 iff the two agree on every
    token)."""
    on = mask.bool()
    with torch.no_grad():
        d = _log_diff(old_logp, sampler_logp, mask)  # [N, T]
        k3 = kl_penalty(torch.zeros_like(d), d, kind="k3")  # exp(d) - d - 1
        return {
            "abs_diff_mean": masked_mean(d.abs(), mask).item() if on.any() else 0.0,
            "abs_diff_max": d.abs()[on].max().item() if on.any() else 0.0,
            "kl_k3": masked_mean(k3, mask).item() if on.any() else 0.0,
        }


def weight_stats(
    weights: Tensor, raw_ratio_mode: str, old_logp: Tensor, sampler_logp: Tensor, mask: Tensor
) -> dict[str, float]:
    """Of the importance weights actually applied: their mean over masked tokens, and clip_frac, the fraction
    of masked tokens whose weight differs from the raw ratio rho (truncated or masked out)."""
    level = raw_ratio_mode.split("_")[0]
    with torch.no_grad():
        raw = LEVELS[level](_log_diff(old_logp, sampler_logp, mask), mask)
        changed = ((weights == 0) if level == "geometric" else (weights != raw)).to(weights.dtype)
        return {
            "weight_mean": masked_mean(weights, mask).item(),
            "clip_frac": masked_mean(changed, mask).item(),
        }
