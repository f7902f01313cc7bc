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

The per-token objective is one of SURROGATES:

    clip    PPO / GRPO:  min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with dual clip (Ye et al. 2020) and
            the two-sided bound of INTELLECT-2 (r -> min(r, delta) in the unclipped term)
    cispo   MiniMax-M1:  sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta  (every token has a gradient)
    sapo    SAPO:        sigmoid(tau (r - 1)) 4 / tau A,  tau = tau_pos (A > 0) or tau_neg (A < 0)
    gmpo    GMPO:        A exp(mean_t sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps_low, eps_high)))
                         one value per sequence, on each of its tokens

Token selections (bool [N, T], pure functions of detached tensors):

    top_entropy_tokens(entropy, mask, rho)       tokens whose entropy is in the top rho quantile ("80/20")
    token_covariance(logp, adv, mask)            (log pi_t - mean log pi) (A_t - mean A), over the tokens
    clip_cov_tokens(cov, mask, ratio, lb, ub)    Clip-Cov: ratio x tokens drawn at random from lb <= cov <= ub
    kl_cov_tokens(cov, mask, ratio)              KL-Cov: the ratio x tokens with the largest cov
    off_policy_sequences(logp, old, adv, mask, delta)   DeepSeek-V3.2: A < 0, mean_t log(pi_old / pi) > delta
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpokit.algo.kl import kl_penalty
from grpokit.algo.ops import masked_mean, masked_sum, pick

# ------------------------------------------------------------ per-token objectives (docs/algorithm.md §10)


@dataclass(frozen=True)
class ClipRange:
    """The bounds a surrogate uses. eps_*: the ratio range [1 - eps_low, 1 + eps_high] (GMPO: the log-ratio
    range [-eps_low, eps_high]); dual_clip: Ye et al.'s c; delta: INTELLECT-2's bound on r for A < 0;
    tau_pos / tau_neg: SAPO's gate temperatures."""

    eps_low: float
    eps_high: float
    dual_clip: float | None = None
    delta: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05


# Each surrogate: (logp, log_ratio, adv, mask, clip) -> the objective per token [N, T]. log_ratio is 0 on
# padding (ratio 1), logp is not: a surrogate that uses logp itself zeroes it there.
Surrogate = Callable[[Tensor, Tensor, Tensor, Tensor, ClipRange], Tensor]


def clip_surrogate(logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, c: ClipRange) -> Tensor:
    # DeepSeekMath eq. 3; INTELLECT-2's two-sided clip bounds the unclipped ratio by delta, so a token with
    # A < 0 whose ratio exploded contributes delta * A with no gradient (for A > 0 and delta > 1 + eps_high
    # the min already picks the clipped term: no change).
    ratio = torch.exp(log_ratio)
    unclipped = ratio if c.delta is None else ratio.clamp(max=c.delta)
    obj = torch.minimum(unclipped * adv, ratio.clamp(1.0 - c.eps_low, 1.0 + c.eps_high) * adv)
    if c.dual_clip is not None:
        obj = torch.where(adv < 0, torch.maximum(obj, c.dual_clip * adv), obj)
    return obj


def cispo_surrogate(logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, c: ClipRange) -> Tensor:
    # MiniMax-M1 (2506.13585) eq. 4: the IS weight is clipped and detached, the gradient is the REINFORCE one
    # times it, so a clipped token keeps its gradient (only its weight is capped). The token mask M of the
    # paper's unified form (eq. 6) is its default M = 1.
    weight = torch.exp(log_ratio).clamp(1.0 - c.eps_low, 1.0 + c.eps_high).detach()
    return weight * adv * torch.where(mask.bool(), logp, torch.zeros_like(logp))


def sapo_surrogate(logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, c: ClipRange) -> Tensor:
    # SAPO (2511.20347): f(r) = sigmoid(tau (r - 1)) 4 / tau; d f / d log pi = 4 sigma (1 - sigma) r, which
    # is 1 at r = 1 (the vanilla gradient) and decays smoothly away from it.
    pos = torch.full_like(log_ratio, c.tau_pos)
    tau = torch.where(adv > 0, pos, torch.full_like(log_ratio, c.tau_neg))
    return torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau) * adv


def gmpo_surrogate(logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, c: ClipRange) -> Tensor:
    # GMPO (2507.20673) eq. 5: the geometric mean of the token ratios, each clipped in log space and
    # sign-aware (the pessimistic side for the sign of A), times A: one value per sequence.
    sign = torch.sign(adv).expand_as(log_ratio)
    clipped = log_ratio.clamp(-c.eps_low, c.eps_high)
    per_token = sign * torch.minimum(sign * log_ratio, sign * clipped)
    return adv * torch.exp(masked_mean(per_token, mask, dim=-1)).unsqueeze(-1)


def adaptive_entropy_coef(
    coef: float, entropy: float, target: float, delta: float, low: float, high: float
) -> tuple[float, bool]:
    """Skywork-OR1's adaptive entropy control, one step: the coefficient c moves by delta toward keeping the
    measured entropy at the target, clipped to [low, high]; and whether the next step's loss has the bonus
    (only after a step whose entropy was below the target). Returns (c', on): the next loss uses c' x on."""
    below = entropy < target
    return min(high, max(low, coef + delta if below else coef - delta)), below


SURROGATES: dict[str, Surrogate] = {
    "clip": clip_surrogate,
    "cispo": cispo_surrogate,
    "sapo": sapo_surrogate,
    "gmpo": gmpo_surrogate,
}


@torch.no_grad()
def top_entropy_tokens(entropy: Tensor, mask: Tensor, rho: float) -> Tensor:
    """[N, T] bool: masked tokens whose entropy is at least the (1 - rho) quantile of the masked tokens'
    entropies (torch.quantile, linear interpolation): the top rho fraction ("Beyond the 80/20 rule",
    2506.01939). rho = 1 keeps every token."""
    on = mask.bool()
    if rho >= 1.0 or not on.any():
        return on
    threshold = torch.quantile(entropy[on].double(), 1.0 - rho)
    return on & (entropy.double() >= threshold)


@torch.no_grad()
def token_covariance(logp: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """[N, T] (log pi_t - mean log pi) (A_t - mean A), means over the masked tokens; 0 elsewhere (Cui et al.
    2025, 2505.22617, eq. 11)."""
    a = adv.expand_as(logp)
    lp = torch.where(mask.bool(), logp, torch.zeros_like(logp))
    cov = (lp - masked_mean(lp, mask)) * (a - masked_mean(a, mask))
    return torch.where(mask.bool(), cov, torch.zeros_like(cov))


def _count(ratio: float, mask: Tensor) -> int:
    # ratio x the number of tokens, at least one when ratio > 0 (the papers' fractions are 2e-4 / 2e-3,
    # which rounds to none on a small batch)
    return 0 if ratio <= 0 else max(1, math.floor(ratio * int(mask.sum().item())))


@torch.no_grad()
def clip_cov_tokens(
    cov: Tensor,
    mask: Tensor,
    ratio: float,
    lb: float,
    ub: float,
    generator: torch.Generator | None = None,
) -> Tensor:
    """[N, T] bool: Clip-Cov's tokens, max(1, floor(ratio x tokens)) drawn uniformly without replacement
    (torch.randperm over the candidates in row-major order) from the masked tokens with lb <= cov <= ub."""
    candidates = (mask.bool() & (cov >= lb) & (cov <= ub)).reshape(-1).nonzero().squeeze(-1)
    n = min(_count(ratio, mask), candidates.numel())
    out = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    if n > 0:
        pick = torch.randperm(candidates.numel(), generator=generator, device="cpu")[:n]
        out[candidates[pick.to(candidates.device)]] = True
    return out.view_as(cov)


@torch.no_grad()
def kl_cov_tokens(cov: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """[N, T] bool: KL-Cov's tokens, the max(1, floor(ratio x tokens)) masked tokens with the largest cov."""
    n = _count(ratio, mask)
    out = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    if n > 0:
        scores = torch.where(mask.bool(), cov, torch.full_like(cov, -math.inf)).reshape(-1)
        out[scores.topk(n).indices] = True
    return out.view_as(cov) & mask.bool()


@torch.no_grad()
def off_policy_sequences(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, delta: float) -> Tensor:
    """[N, T] bool: the tokens DeepSeek-V3.2 (DeepSeek-AI 2025) masks out: those with A < 0 in sequences
    whose mean_t log(pi_old / pi_theta) exceeds delta (a negative sample the policy has moved far from)."""
    diverged = masked_mean((old_logp - logp).detach(), mask, dim=-1) > delta  # [N]
    return mask.bool() & (adv < 0) & diverged.unsqueeze(-1)


# ---------------------------------------------------------------- the reductions

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
    "cispo": _token_mean,  # MiniMax-M1 eq. 4: 1 / sum_i |o_i|
    "sapo": _seq_mean_token_mean,  # SAPO eq. 3: 1/G sum_i 1/|y_i| sum_t
    "gmpo": _seq_mean_token_mean,  # GMPO eq. 5: 1/G sum_i of one term per sequence
}

# The per-token objective of each loss type (below); the others use the clipped one.
SURROGATE_OF: dict[str, str] = {"cispo": "cispo", "sapo": "sapo", "gmpo": "gmpo"}


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
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    entropy: Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    clip_cov_ratio: float = 0.0,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 0.0,
    kl_cov_coef: float = 1.0,
    off_policy_mask_threshold: float | None = None,
    use_bias_correction_kl: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """-J for one batch (or a minibatch of it).

    logp, old_logp, ref_logp, mask: [N, T] (mask = 1 on completion tokens).
    advantages: [N] (outcome, broadcast to every token) or [N, T] (process / per-token).
    eps_high None means eps_low. dual_clip: the lower bound c > 1 on the objective of A < 0 tokens.
    loss_type: the normalizer (grpo, bnpo, dapo, dr_grpo), or an objective with its paper's normalizer:
    cispo (MiniMax-M1), sapo (SAPO, temperatures sapo_temperature_pos / _neg), gmpo (GMPO; eps in log space).
    num_sequences, num_tokens: the whole batch's counts when this call sees a minibatch of it.
    is_weights: [N, T] importance weights against the sampler-trainer mismatch (grpokit.algo.importance, TRL's
    vllm_importance_sampling_*): they multiply each token's surrogate loss, after clipping, before the KL
    term. The switches of docs/algorithm.md §10: delta (INTELLECT-2's two-sided clip), entropy [N, T] with
    top_entropy_quantile (policy gradient on the top quantile only) and entropy_coef (bonus + c H; entropy
    then carries the gradient), clip_cov_* / kl_cov_* (Cui et al. 2025; generator draws Clip-Cov's tokens),
    off_policy_mask_threshold and use_bias_correction_kl (DeepSeek-V3.2).
    Returns the scalar loss and metrics (python floats): clip fractions, ratio, KL, per-token loss.
    """
    _check_args(logp, old_logp, mask, ref_logp, beta, eps_low, eps_high, dual_clip, delta, loss_type)
    if (top_entropy_quantile < 1.0 or entropy_coef != 0.0) and entropy is None:
        raise ValueError("top_entropy_quantile < 1 and entropy_coef need the per-token entropy")
    if not 0.0 < top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}")
    aggregate = pick(AGGREGATIONS, loss_type, "loss_type")
    log_ratio_fn = pick(RATIO_LEVELS, ratio_level, "ratio_level")
    eps_high = eps_low if eps_high is None else eps_high
    clip = ClipRange(eps_low, eps_high, dual_clip, delta, sapo_temperature_pos, sapo_temperature_neg)

    mask = mask.to(logp.dtype)
    on = mask.bool()
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # [N, 1] or [N, T]

    # Masked positions get ratio 1 so that garbage in padding never produces inf * 0 = NaN.
    log_ratio = torch.where(on, log_ratio_fn(logp, old_logp.detach(), mask), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)  # [N, T]
    obj = SURROGATES[SURROGATE_OF.get(loss_type, "clip")](logp, log_ratio, adv, mask, clip)
    # Tokens without policy gradient: below the entropy quantile, or DeepSeek-V3.2's off-policy negatives.
    keep = top_entropy_tokens(entropy, mask, top_entropy_quantile) if entropy is not None else on
    if off_policy_mask_threshold is not None:
        keep = keep & ~off_policy_sequences(logp, old_logp, adv, mask, off_policy_mask_threshold)
    obj = torch.where(keep, obj, torch.zeros_like(obj))
    if clip_cov_ratio > 0 or kl_cov_ratio > 0:
        cov = token_covariance(logp, adv, mask)
        if clip_cov_ratio > 0:  # Clip-Cov: the drawn tokens keep their value, lose their gradient
            detached = clip_cov_tokens(cov, mask, clip_cov_ratio, clip_cov_lb, clip_cov_ub, generator)
            obj = torch.where(detached, obj.detach(), obj)
        if kl_cov_ratio > 0:  # KL-Cov: kappa |log r| on the tokens of largest covariance
            token_lr = torch.where(on, logp - old_logp.detach(), torch.zeros_like(logp))
            obj = obj - kl_cov_coef * token_lr.abs() * kl_cov_tokens(cov, mask, kl_cov_ratio).to(obj.dtype)
    per_token = -obj
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    kl = _kl(logp, old_logp, ref_logp, on, kl_estimator, use_bias_correction_kl)
    if kl is not None and beta != 0.0:
        per_token = per_token + beta * kl
    if entropy_coef != 0.0 and entropy is not None:  # the entropy bonus: J + c H
        per_token = per_token - entropy_coef * torch.where(on, entropy, torch.zeros_like(entropy))

    norm = Normalizers(mask, num_sequences, num_tokens, max_completion_length)
    loss = aggregate(per_token, mask, norm)
    return loss, _loss_metrics(ratio, adv, mask, eps_low, eps_high, kl, per_token)


def _check_args(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    ref_logp: Tensor | None,
    beta: float,
    eps_low: float,
    eps_high: float | None,
    dual_clip: float | None,
    delta: float | None,
    loss_type: str,
) -> None:
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
    high = eps_low if eps_high is None else eps_high
    if delta is not None and delta <= 1.0 + high:
        raise ValueError(f"delta must be > 1 + eps_high = {1.0 + high}, got {delta}")
    if (dual_clip is not None or delta is not None) and loss_type in SURROGATE_OF:
        raise ValueError(f"dual_clip and delta bound the clipped objective; loss_type={loss_type!r} has none")


def _kl(
    logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, on: Tensor, kind: str, importance_weighted: bool
) -> Tensor | None:
    """The per-token KL estimate against pi_ref, or None without ref_logp. importance_weighted: times the
    token ratio pi_theta / pi_old with its gradient (DeepSeek-V3.2's unbiased KL from off-policy samples)."""
    if ref_logp is None:
        return None
    # Padding compares 0 with 0, so garbage there (e.g. logp = -inf) cannot make an inf that the masked sum
    # hides in the forward pass but turns into 0 * inf = NaN in backward.
    zero = torch.zeros_like(logp)
    kl = kl_penalty(torch.where(on, logp, zero), torch.where(on, ref_logp, zero), kind=kind)
    if importance_weighted:
        kl = torch.exp(torch.where(on, logp - old_logp.detach(), zero)) * kl
    return kl


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
