"""The math of the PPO baseline's critic: pure functions of tensors, no model, no I/O.

    r = token_rewards(scores, mask, kl=old_logp - ref_logp, kl_coef=beta)     # [N, T]
    adv, ret = gae_advantages(r, values, mask, gamma=1.0, lam=0.95)          # [N, T], [N, T]
    adv = masked_whiten(adv, mask)                                           # batch z-score
    loss, metrics = value_loss(new_values, values, ret, mask, clip_range=0.2)

A completion is an episode whose states are its prefixes: the state before completion token t
has value V_t (the critic's output at the position that predicts token t), the action is token
t, and the only environment reward is the sequence score, on the last token (InstructGPT,
Ouyang et al. 2022; TRL's PPOTrainer). Optionally every token also gets -beta * KL shaping.
GAE (Schulman et al. 2016, eq. 16), with V = 0 after the last token (every completion ends):
    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}          R_t = A_t + V_t  (the critic's target)
gamma = lam = 1 gives A_t = (sum of the rewards from t on) - V_t: the Monte-Carlo return minus V.

Masks: positions where mask = 0 are not part of the episode. The recursion skips them (it carries
A and V across a hole), so right padding of ragged lengths, and any hole, is handled; outputs are 0
there. This is where PPO's advantages differ from GRPO's (DeepSeekMath §4.1): GRPO's baseline is the group
mean reward and needs no critic; here the baseline is a learned V, per token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpokit.algo.ops import masked_mean, masked_sum


def token_rewards(scores: Tensor, mask: Tensor, *, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards [N, T]: the sequence score on each row's last masked token, minus kl_coef * kl.

    scores: [N]; mask: [N, T]; kl: [N, T] per-token KL estimate (e.g. old_logp - ref_logp, k1).
    A row with no masked token gets no reward (there is no action to credit).
    """
    N, T = mask.shape
    on = mask.bool()
    rewards = torch.zeros((N, T), dtype=torch.float32, device=mask.device)
    positions = torch.arange(T, device=mask.device).expand(N, T)
    last = torch.where(on, positions, torch.full_like(positions, -1)).amax(-1)  # [N], -1 when empty
    rows = (last >= 0).nonzero().squeeze(-1)
    rewards[rows, last[rows]] = scores.float()[rows]
    if kl is not None and kl_coef != 0.0:
        rewards = rewards - kl_coef * torch.where(on, kl.float(), torch.zeros_like(rewards))
    return rewards


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns (the value targets), both [N, T], 0 where mask = 0.

    rewards, values, mask: [N, T]. Values at masked positions are ignored (may be garbage).
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} must "
            "match"
        )
    on = mask.bool()
    r = torch.where(on, rewards.float(), torch.zeros_like(rewards, dtype=torch.float32))
    v = torch.where(on, values.float(), torch.zeros_like(values, dtype=torch.float32))
    N, T = r.shape
    adv = torch.zeros_like(r)
    next_value = torch.zeros(N, dtype=r.dtype, device=r.device)  # V after the last token: 0 (terminal)
    next_adv = torch.zeros(N, dtype=r.dtype, device=r.device)
    # A loop over T, vectorized over N: T is the completion length (hundreds), each step is O(N).
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        m = on[:, t]
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_adv = torch.where(m, a, next_adv)  # a hole carries the next real token's values through
        next_value = torch.where(m, v[:, t], next_value)
    returns = torch.where(on, adv + v, torch.zeros_like(adv))
    return adv, returns


def masked_whiten(x: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) over the masked positions of the whole tensor; 0 where mask = 0.

    The population std (as the group z-score uses), over every masked token of the batch: the usual
    PPO advantage normalization (TRL's `whiten`, which uses the unbiased variance; the difference is
    a factor sqrt(n / (n - 1)) over thousands of tokens).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) / (var.sqrt() + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over masked tokens: 1 = the critic predicts the returns, <= 0 = no better than
    a constant."""
    err = returns - values
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    var_e = masked_mean((err - masked_mean(err, mask)) ** 2, mask)
    if var_r.item() == 0.0:
        return float("nan")
    return (1.0 - var_e / var_r).item()


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range: float | None = 0.2,
    num_tokens: int | float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), token mean over the mask.

    values (with gradient), old_values (the critic at rollout time), returns, mask: [N, T].
    clip_range: c; None or 0 = no clipping (plain 0.5 * (V - R)^2).
    num_tokens: the whole minibatch's token count when this call sees a micro-batch of it, so that
    gradient accumulation gives the gradient of the minibatch's token mean.
    The pessimistic max is PPO2's (baselines, cleanrl `clip_vloss`; TRL's PPOTrainer).
    """
    if values.shape != old_values.shape or values.shape != returns.shape or values.shape != mask.shape:
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must match"
        )
    v = values.float()
    old = old_values.detach().float()
    ret = returns.detach().float()
    unclipped = (v - ret) ** 2
    if clip_range:
        v_clipped = old + (v - old).clamp(-clip_range, clip_range)
        clipped = (v_clipped - ret) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
    else:
        clipped = unclipped
        per_token = 0.5 * unclipped
    count = mask.sum() if num_tokens is None else num_tokens
    loss = masked_sum(per_token, mask) / torch.as_tensor(count, dtype=per_token.dtype).clamp_min(1)
    with torch.no_grad():
        metrics = {
            "loss": masked_mean(per_token.detach(), mask).item(),  # this call's own token mean
            "clip_frac": masked_mean((clipped > unclipped).float(), mask).item(),
            "new_mean": masked_mean(v.detach(), mask).item(),  # V under update (value/mean is V_old)
        }
    return loss, metrics
