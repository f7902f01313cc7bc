"""The clipped policy-gradient loss of GRPO and its family: a pure function of log-probs.

    loss, metrics = policy_loss(logp, old_logp, advantages, mask, ref_logp=..., beta=..., loss_type=...)
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, ref_logp=..., options=LossOptions(...))

LossOptions holds how the objective is configured (clip ranges, loss type, KL, the switches below), built
once and handed to every call; the call passes only its tensors and the whole batch's counts.

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
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from grpokit.algo.kl import KL_ESTIMATORS, kl_penalty
from grpokit.algo.ops import masked_mean, masked_sum, pick

# ------------------------------------------------------------ per-token objectives (docs/algorithm.md §10)


@dataclass(frozen=True)
class LossOptions:
    """How the objective is configured: every setting of policy_loss that is neither a tensor of the call nor
    a count of the whole batch. Built once (grpokit.algorithm.loss_options, from algorithm.*) and handed to
    every call, so a new knob is a field here and a field of the same name in the config, nothing between.
    Frozen: a per-call value (the adaptive entropy coefficient) is a dataclasses.replace. Checked on
    construction, so a bad combination fails where it is made, not at the first micro-batch."""

    beta: float = 0.0
    """KL coefficient against pi_ref, the KL added after clipping; beta > 0 needs ref_logp."""
    eps_low: float = 0.2
    """The ratio's lower clip range: r >= 1 - eps_low (GMPO: log r >= -eps_low)."""
    eps_high: float | None = None
    """The upper clip range (DAPO's clip-higher); None means eps_low (clip_high is the value used)."""
    loss_type: str = "grpo"
    """A name in AGGREGATIONS: the normalizer, and through SURROGATE_OF the per-token objective."""
    ratio_level: str = "token"
    """A name in RATIO_LEVELS: token (GRPO) or sequence (GSPO)."""
    max_completion_length: int | None = None
    """Dr. GRPO's constant; None: the padded width of the call."""
    kl_estimator: str = "k3"
    """A name in grpokit.algo.kl.KL_ESTIMATORS."""
    dual_clip: float | None = None
    """Ye et al.'s lower bound c > 1 on the objective of A < 0 tokens; None: off."""
    delta: float | None = None
    """INTELLECT-2's bound on the unclipped ratio of A < 0 tokens, above 1 + clip_high; None: off."""
    sapo_temperature_pos: float = 1.0
    """SAPO's gate temperature for A > 0."""
    sapo_temperature_neg: float = 1.05
    """SAPO's gate temperature for A < 0."""
    top_entropy_quantile: float = 1.0
    """rho in (0, 1]: the policy gradient only on the top rho quantile of token entropies (needs entropy)."""
    entropy_coef: float = 0.0
    """c of the entropy bonus J + c H (needs entropy, which then carries the gradient); 0: off."""
    clip_cov_ratio: float = 0.0
    """Clip-Cov's fraction of the tokens whose gradient is dropped; 0: off."""
    clip_cov_lb: float = 1.0
    """Clip-Cov's lower covariance bound."""
    clip_cov_ub: float = 5.0
    """Clip-Cov's upper covariance bound."""
    kl_cov_ratio: float = 0.0
    """KL-Cov's fraction of the tokens, those of largest covariance, that get kappa |log r|; 0: off."""
    kl_cov_coef: float = 1.0
    """KL-Cov's kappa."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's delta: A < 0 sequences with mean_t log(pi_old / pi_theta) above it get no policy
    gradient; None: off."""
    use_bias_correction_kl: bool = False
    """DeepSeek-V3.2's unbiased KL: each token's KL estimate times pi_theta / pi_old, with its gradient."""

    def __post_init__(self) -> None:
        if self.eps_low < 0 or (self.eps_high is not None and self.eps_high < 0):
            raise ValueError(
                f"clip ranges must be >= 0, got eps_low={self.eps_low}, eps_high={self.eps_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.delta is not None and self.delta <= 1.0 + self.clip_high:
            raise ValueError(f"delta must be > 1 + eps_high = {1.0 + self.clip_high}, got {self.delta}")
        if (self.dual_clip is not None or self.delta is not None) and self.loss_type in SURROGATE_OF:
            raise ValueError(
                f"dual_clip and delta bound the clipped objective; loss_type={self.loss_type!r} has none"
            )
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile}")
        pick(AGGREGATIONS, self.loss_type, "loss_type")
        pick(RATIO_LEVELS, self.ratio_level, "ratio_level")
        pick(KL_ESTIMATORS, self.kl_estimator, "KL estimator")

    @property
    def clip_high(self) -> float:
        """The upper clip range in use: eps_high, or eps_low where it is None (a symmetric clip)."""
        return self.eps_low if self.eps_high is None else self.eps_high

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss reads pi_theta's entropy: the top-entropy selection, or the bonus."""
        return self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0


# Each surrogate: (logp, log_ratio, adv, mask, options) -> the objective per token [N, T]. log_ratio is 0 on
# padding (ratio 1), logp is not: a surrogate that uses logp itself zeroes it there. A surrogate reads its
# settings from the options (o.clip_high, o.dual_clip, ...), so its own knob is a LossOptions field.
Surrogate = Callable[[Tensor, Tensor, Tensor, Tensor, LossOptions], Tensor]


def clip_surrogate(logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, o: LossOptions) -> Tensor:
    # DeepSeekMath eq. 3; INTELLECT-2's two-sided clip bounds the unclipped ratio by delta, so a token with
    # A < 0 whose ratio exploded contributes delta * A with no gradient (for A > 0 and delta > 1 + eps_high
    # the min already picks the clipped term: no change).
    ratio = torch.exp(log_ratio)
    unclipped = ratio if o.delta is None else ratio.clamp(max=o.delta)
    obj = torch.minimum(unclipped * adv, ratio.clamp(1.0 - o.eps_low, 1.0 + o.clip_high) * adv)
    if o.dual_clip is not None:
        obj = torch.where(adv < 0, torch.maximum(obj, o.dual_clip * adv), obj)
    return obj


def cispo_surrogate(logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, o: LossOptions) -> Tensor:
    # MiniMax-M1 (2506.13585) eq. 4: the IS weight is clipped and detached, the gradient is the REINFORCE one
    # times it, so a clipped token keeps its gradient (only its weight is capped). The token mask M of the
    # paper's unified form (eq. 6) is its default M = 1.
    weight = torch.exp(log_ratio).clamp(1.0 - o.eps_low, 1.0 + o.clip_high).detach()
    return weight * adv * torch.where(mask.bool(), logp, torch.zeros_like(logp))


def sapo_surrogate(logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, o: LossOptions) -> Tensor:
    # SAPO (2511.20347): f(r) = sigmoid(tau (r - 1)) 4 / tau; d f / d log pi = 4 sigma (1 - sigma) r, which
    # is 1 at r = 1 (the vanilla gradient) and decays smoothly away from it.
    pos = torch.full_like(log_ratio, o.sapo_temperature_pos)
    tau = torch.where(adv > 0, pos, torch.full_like(log_ratio, o.sapo_temperature_neg))
    return torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau) * adv


def gmpo_surrogate(logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, o: LossOptions) -> Tensor:
    # GMPO (2507.20673) eq. 5: the geometric mean of the token ratios, each clipped in log space and
    # sign-aware (the pessimistic side for the sign of A), times A: one value per sequence.
    sign = torch.sign(adv).expand_as(log_ratio)
    clipped = log_ratio.clamp(-o.eps_low, o.clip_high)
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
    options: LossOptions | None = None,
    num_sequences: int | None = None,
    num_tokens: int | float | None = None,
    is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    generator: torch.Generator | None = None,
    **knobs: Any,
) -> tuple[Tensor, dict[str, float]]:
    """-J for one batch (or a minibatch of it).

    logp, old_logp, ref_logp, mask: [N, T] (mask = 1 on completion tokens).
    advantages: [N] (outcome, broadcast to every token) or [N, T] (process / per-token).
    beta ... max_completion_length (docs/algorithm.md §3) and knobs (dual_clip=1.5, ...): LossOptions fields
    as keywords; or options: every setting of the objective at once (then leave the keywords out).
    num_sequences, num_tokens: the whole batch's counts when this call sees a minibatch of it.
    is_weights: [N, T] importance weights against the sampler-trainer mismatch (grpokit.algo.importance, TRL's
    vllm_importance_sampling_*), times each token's surrogate loss after clipping, before the KL term.
    entropy: [N, T] pi_theta's entropy, for top_entropy_quantile and entropy_coef (with the bonus it carries
    the gradient). generator: draws Clip-Cov's tokens.
    Returns the scalar loss and metrics (python floats): clip fractions, ratio, KL, per-token loss."""
    o = _options(options, beta, eps_low, eps_high, loss_type, ratio_level, max_completion_length, knobs)
    _check_tensors(logp, old_logp, mask, ref_logp, entropy, o)

    mask = mask.to(logp.dtype)
    on = mask.bool()
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # [N, 1] or [N, T]

    # Masked positions get ratio 1 so that garbage in padding never produces inf * 0 = NaN.
    log_ratio_fn = RATIO_LEVELS[o.ratio_level]
    log_ratio = torch.where(on, log_ratio_fn(logp, old_logp.detach(), mask), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)  # [N, T]
    surrogate = SURROGATES[SURROGATE_OF.get(o.loss_type, "clip")]
    obj = surrogate(logp, log_ratio, adv, mask, o)
    obj = _token_selections(obj, logp, old_logp, adv, mask, entropy, o, generator)
    per_token = -obj
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    kl = _kl(logp, old_logp, ref_logp, on, o.kl_estimator, o.use_bias_correction_kl)
    if kl is not None and o.beta != 0.0:
        per_token = per_token + o.beta * kl
    if o.entropy_coef != 0.0 and entropy is not None:  # the entropy bonus: J + c H
        per_token = per_token - o.entropy_coef * torch.where(on, entropy, torch.zeros_like(entropy))

    norm = Normalizers(mask, num_sequences, num_tokens, o.max_completion_length)
    loss = AGGREGATIONS[o.loss_type](per_token, mask, norm)
    return loss, _loss_metrics(ratio, adv, mask, o.eps_low, o.clip_high, kl, per_token)


def _options(
    options: LossOptions | None,
    beta: float,
    eps_low: float,
    eps_high: float | None,
    loss_type: str,
    ratio_level: str,
    max_completion_length: int | None,
    knobs: dict[str, Any],
) -> LossOptions:
    """policy_loss's options: those passed, or the LossOptions of its keywords (the documented ones and any
    other field); not both, since which of the two should win would be a guess."""
    unknown = sorted(set(knobs) - {f.name for f in fields(LossOptions)})
    if unknown:
        raise TypeError(
            f"policy_loss got unknown keywords {unknown}; the objective's settings are LossOptions'"
        )
    keywords = LossOptions(
        beta=beta,
        eps_low=eps_low,
        eps_high=eps_high,
        loss_type=loss_type,
        ratio_level=ratio_level,
        max_completion_length=max_completion_length,
        **knobs,
    )
    if options is None:
        return keywords
    if keywords != LossOptions():
        raise ValueError(
            "policy_loss takes the objective's settings as keywords or as options=, not both: put "
            "beta, eps_low, eps_high, loss_type, ratio_level and max_completion_length into the LossOptions"
        )
    return options


def _token_selections(
    obj: Tensor,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    entropy: Tensor | None,
    o: LossOptions,
    generator: torch.Generator | None,
) -> Tensor:
    """The objective [N, T] after the token selections of docs/algorithm.md §10: no policy gradient below the
    entropy quantile or on DeepSeek-V3.2's off-policy negatives; Clip-Cov's and KL-Cov's tokens."""
    on = mask.bool()
    keep = on
    if entropy is not None and o.top_entropy_quantile < 1.0:
        keep = top_entropy_tokens(entropy, mask, o.top_entropy_quantile)
    if o.off_policy_mask_threshold is not None:
        keep = keep & ~off_policy_sequences(logp, old_logp, adv, mask, o.off_policy_mask_threshold)
    obj = torch.where(keep, obj, torch.zeros_like(obj))
    if o.clip_cov_ratio > 0 or o.kl_cov_ratio > 0:
        cov = token_covariance(logp, adv, mask)
        if o.clip_cov_ratio > 0:  # Clip-Cov: the drawn tokens keep their value, lose their gradient
            detached = clip_cov_tokens(cov, mask, o.clip_cov_ratio, o.clip_cov_lb, o.clip_cov_ub, generator)
            obj = torch.where(detached, obj.detach(), obj)
        if o.kl_cov_ratio > 0:  # KL-Cov: kappa |log r| on the tokens of largest covariance
            token_lr = torch.where(on, logp - old_logp.detach(), torch.zeros_like(logp))
            penalized = kl_cov_tokens(cov, mask, o.kl_cov_ratio).to(obj.dtype)
            obj = obj - o.kl_cov_coef * token_lr.abs() * penalized
    return obj


def _check_tensors(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    ref_logp: Tensor | None,
    entropy: Tensor | None,
    o: LossOptions,
) -> None:
    """The rules that join the options to this call's tensors (the options' own are LossOptions')."""
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} must "
            "match"
        )
    if o.beta != 0.0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (log-probs of the reference policy)")
    if o.needs_entropy and entropy is None:
        raise ValueError("top_entropy_quantile < 1 and entropy_coef need the per-token entropy")


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
