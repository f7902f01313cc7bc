"""Per-token KL estimators of KL(pi_theta || pi_ref) from log-probs of sampled tokens (Schulman, 2020).

With log_ratio = ref_logp - logp (tokens sampled from pi_theta, or pi_old close to it):
    k1 = -log_ratio                         unbiased, high variance, can be negative
    k2 = log_ratio**2 / 2                   biased, low variance
    k3 = exp(log_ratio) - log_ratio - 1     unbiased, low variance, always >= 0 (DeepSeekMath's)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _k1(log_ratio: Tensor) -> Tensor:
    return -log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: Tensor) -> Tensor:
    # DeepSeekMath eq. (4): pi_ref/pi_theta - log(pi_ref/pi_theta) - 1.
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate, same shape as logp. Gradients flow through logp only."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; allowed: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](ref_logp.detach() - logp)
