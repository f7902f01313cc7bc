"""Advantage estimators: pure functions of reward tensors.

    group_advantages(rewards, group_size, scale=..., estimator=...)  outcome rewards, one per completion
    step_advantages(step_rewards, step_ends, ...)                    process rewards, DeepSeekMath §4.1.3
    decoupled_advantages(per_reward, weights, group_size)            GDPO: each reward z-scored in its
                                                                     group, the weighted sum over the batch

Groups are contiguous: rewards[g*G:(g+1)*G] are the G completions of prompt g.
See docs/algorithm.md for the formulas and where each comes from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpokit.algo.ops import pick


def _check_groups(n: int, group_size: int) -> int:
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 to compare completions within a group, got {group_size} "
            "(set rollout.num_generations >= 2)"
        )
    if n % group_size != 0:
        raise ValueError(f"number of rewards ({n}) is not a multiple of group_size ({group_size})")
    return n // group_size


# Baselines: each maps grouped rewards [B, G] to the baseline subtracted from each reward [B, G].
def _grpo_baseline(r: Tensor) -> Tensor:
    return r.mean(dim=1, keepdim=True).expand_as(r)


def _rloo_baseline(r: Tensor) -> Tensor:
    # Leave-one-out (Ahmadian et al. 2024): the mean of the other G-1 rewards.
    G = r.shape[1]
    return (r.sum(dim=1, keepdim=True) - r) / (G - 1)


BASELINES: dict[str, Callable[[Tensor], Tensor]] = {"grpo": _grpo_baseline, "rloo": _rloo_baseline}


def _spread(r: Tensor) -> Tensor:
    return r.amax(dim=1, keepdim=True) - r.amin(dim=1, keepdim=True)  # [B, 1]


def _zero_if_tiny(adv: Tensor, r: Tensor, denom: Tensor | None = None) -> Tensor:
    # A group whose rewards are all equal carries no signal: its advantage is exactly
    # 0 whatever the scale. Tested on max - min, not on the std: torch's std of equal rewards can be
    # ~1e-16 instead of 0 (e.g. three times 5/3), and float noise in `centered` over it is O(1).
    # Applied after the division, so eps = 0 gives 0 there too (not 0/0), and so does a std that
    # underflows to 0 (not x/0 = inf).
    keep = _spread(r) > 0  # [B, 1]
    if denom is not None:
        keep = keep & (denom > 0)
    return torch.where(keep, adv, torch.zeros_like(adv))


def _scale_group(centered: Tensor, r: Tensor, eps: float) -> Tensor:
    std = r.std(dim=1, correction=0, keepdim=True)  # population std (1/G), not the sample std
    return _zero_if_tiny(centered / (std + eps), r, std + eps)


def _scale_batch(centered: Tensor, r: Tensor, eps: float) -> Tensor:
    # REINFORCE++-baseline / Dr. GRPO-style batch normalizer: one std over all N rewards.
    std = r.std(correction=0)
    return _zero_if_tiny(centered / (std + eps), r, std + eps)


def _scale_batch_centered(centered: Tensor, r: Tensor, eps: float) -> Tensor:
    # REINFORCE++-baseline (Hu et al. 2025, 2501.03262): the group-centered values A' are whitened
    # over the whole batch, (A' - mean_batch A') / std_batch A'. The std is that of A', not of the raw
    # rewards as in "batch" (TRL's scale_rewards=batch): removing each group's mean first leaves
    # only the within-group spread. mean_batch A' is 0 up to rounding with either baseline.
    std = centered.std(correction=0)
    return _zero_if_tiny((centered - centered.mean()) / (std + eps), r, std + eps)


def _scale_none(centered: Tensor, r: Tensor, eps: float) -> Tensor:
    return _zero_if_tiny(centered, r)


SCALES: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "group": _scale_group,
    "batch": _scale_batch,
    "batch_centered": _scale_batch_centered,
    "none": _scale_none,
}


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    scale: str = "group",
    estimator: str = "grpo",
    eps: float = 1e-6,
) -> Tensor:
    """Outcome advantages, one per completion: (r - baseline) / (std + eps).

    rewards: [N], N = groups x group_size, groups contiguous. Returns [N] (float32 or rewards' dtype).
    scale: "group" (population std of the group), "batch" (population std of all N rewards),
           "batch_centered" (REINFORCE++-baseline: whiten the centered values over all N), "none".
    estimator: "grpo" (baseline = group mean) | "rloo" (baseline = mean of the other G-1).
    Zero-variance groups get exactly 0.  Example: [1, 0, 0] -> [1.414, -0.707, -0.707].
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    B = _check_groups(rewards.numel(), group_size)
    baseline_fn = pick(BASELINES, estimator, "advantage estimator")
    scale_fn = pick(SCALES, scale, "reward scale")
    r = rewards.float() if not rewards.is_floating_point() else rewards
    r = r.view(B, group_size)  # [B, G]
    centered = r - baseline_fn(r)  # [B, G]
    return scale_fn(centered, r, eps).reshape(-1)


def step_advantages(
    step_rewards: list[Tensor],
    step_ends: list[Tensor],
    group_size: int,
    num_tokens: int,
    *,
    eps: float = 1e-6,
) -> Tensor:
    """Process-supervision advantages (DeepSeekMath §4.1.3), one per completion token.

    step_rewards[i]: [K_i] rewards of completion i's steps; step_ends[i]: [K_i] index (in the
    completion, 0-based, inclusive) of the last token of each step, increasing.
    The rewards of all steps of all G completions of a group are normalized together:
    r~ = (r - mean) / (std + eps), population std. A token's advantage is the sum of the
    normalized rewards of the steps that end at or after it. Tokens after the last step get 0.
    Returns [N, num_tokens].
    """
    n = len(step_rewards)
    if len(step_ends) != n:
        raise ValueError(f"{n} step reward lists but {len(step_ends)} step boundary lists")
    B = _check_groups(n, group_size)
    out = torch.zeros(n, num_tokens)
    for g in range(B):
        idx = range(g * group_size, (g + 1) * group_size)
        flat = torch.cat([step_rewards[i].float().reshape(-1) for i in idx])
        if flat.numel() == 0:
            continue
        mean, std = flat.mean(), flat.std(correction=0)
        for i in idx:
            r, ends = step_rewards[i].float().reshape(-1), step_ends[i].long().reshape(-1)
            if r.numel() != ends.numel():
                raise ValueError(f"completion {i}: {r.numel()} step rewards but {ends.numel()} step ends")
            if r.numel() == 0:
                continue
            if (ends.diff() <= 0).any() or ends.min() < 0:
                raise ValueError(
                    f"completion {i}: step ends must be increasing and >= 0, got {ends.tolist()}"
                )
            norm = (r - mean) / (std + eps) if std > 0 else torch.zeros_like(r)
            # Suffix sums over steps: step k's tokens get sum_{j>=k} norm_j.
            suffix = norm.flip(0).cumsum(0).flip(0)  # [K]
            starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
            for s, e, v in zip(starts.tolist(), ends.tolist(), suffix.tolist(), strict=True):
                out[i, s : min(e + 1, num_tokens)] = v
    return out


def decoupled_advantages(
    per_reward: Tensor,
    weights: Tensor,
    group_size: int,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
) -> Tensor:
    """GDPO's decoupled normalization of several rewards: [K, N] rewards (one row per reward function) and
    [K] weights -> [N] advantages.

        A_k = group_advantages(r_k, scale="group")         each reward's own group z-score
        S   = sum_k w_k A_k
        A   = (S - mean_batch S) / (std_batch S + eps)     population std over all N

    so a reward on a scale 100x another's weighs by its weight only, not by its scale (the sum of the raw
    rewards, then one z-score, lets the larger reward decide the sign of nearly every advantage). A NaN reward
    (None or failed) counts as 0, as in the weighted total. A batch whose S is constant gets 0.
    """
    if per_reward.dim() != 2 or per_reward.shape[0] == 0 or weights.shape != per_reward.shape[:1]:
        raise ValueError(
            f"per_reward must be [K, N] (K >= 1) and weights [K], got {tuple(per_reward.shape)} and "
            f"{tuple(weights.shape)}"
        )
    r = torch.nan_to_num(per_reward.float() if not per_reward.is_floating_point() else per_reward, nan=0.0)
    summed = sum(
        (w * group_advantages(r_k, group_size, scale="group", estimator=estimator, eps=eps))
        for w, r_k in zip(weights.to(r.dtype), r, strict=True)
    )
    assert isinstance(summed, Tensor)  # K >= 1
    std = summed.std(correction=0)
    if not bool(std > 0):
        return torch.zeros_like(summed)
    return (summed - summed.mean()) / (std + eps)
