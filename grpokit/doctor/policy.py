"""Checks of the update: the trainer-sampler ratio, clipping, the KL to pi_ref, the entropy."""

from __future__ import annotations

import numpy as np

from grpokit.doctor.run import Finding, Run
from grpokit.doctor.stats import (
    percent,
    rolling_median,
    rounded,
    start_level,
    sustained,
    true_stretches,
    window,
)
from grpokit.doctor.thresholds import (
    CLIP_FRAC_ERROR,
    CLIP_FRAC_MAX,
    ENTROPY_COLLAPSE_FRAC,
    KL_GROWTH,
    KL_GROWTH_FLOOR,
    KL_GROWTH_WINDOWS,
    KL_MAX,
    KL_ZERO,
    MIN_STEPS,
    RATIO_TOL,
)
from grpokit.metrics.compute import (
    POLICY_CLIP_FRAC,
    POLICY_ENTROPY,
    POLICY_GRAD_NORM,
    POLICY_KL,
    POLICY_LR,
    POLICY_RATIO_MEAN,
)
from grpokit.values import finite_number


def check_ratio(run: Run) -> list[Finding]:
    ratio = run.series(POLICY_RATIO_MEAN)
    if ratio is None:
        return []
    return [
        Finding(
            "ratio_mismatch",
            "warning",
            ratio.span(st.first, st.last),
            f"policy/ratio_mean {rounded(float(np.median(st.smoothed)))} (should stay near 1: the mean "
            "importance ratio over sampled tokens is 1 in expectation): the trainer's policy and the "
            "sampler's disagree",
            "check that the rollout engine gets the new weights after every optimizer step and computes "
            "log-probs at the same temperature and dtype as the trainer; lower optim.learning_rate"
            f"{run.current('optim.learning_rate')}",
        )
        for st in sustained(ratio, above=1 + RATIO_TOL, below=1 - RATIO_TOL)
    ]


def check_clip(run: Run) -> list[Finding]:
    clip = run.series(POLICY_CLIP_FRAC)
    if clip is None:
        return []
    out = []
    for st in sustained(clip, above=CLIP_FRAC_MAX):
        raw = clip.values[st.first : st.last + 1]
        median = float(np.median(raw))
        out.append(
            Finding(
                "clip_high",
                "error" if median > CLIP_FRAC_ERROR else "warning",
                clip.span(st.first, st.last),
                f"policy/clip_frac median {percent(median)} (max {percent(float(raw.max()))}): the update "
                "moves far past the trust region, so most of its gradient is clipped away",
                f"lower optim.learning_rate{run.current('optim.learning_rate')}; fewer optimizer steps per "
                f"rollout batch: algorithm.num_iterations{run.current('algorithm.num_iterations')} or "
                f"optim.num_minibatches{run.current('optim.num_minibatches')} (each later step is further "
                "from pi_old)",
            )
        )
    return out


def _beta(run: Run) -> float | None:
    return finite_number(run.setting("algorithm.beta"))


def check_kl_high(run: Run) -> list[Finding]:
    kl = run.series(POLICY_KL)
    beta = _beta(run)
    if kl is None or len(kl) < MIN_STEPS or beta == 0.0:
        return []
    w = window(len(kl))
    smoothed = rolling_median(kl.values, w)
    lag = KL_GROWTH_WINDOWS * w
    # The smoothed KL lag steps earlier (floored, so that growth from ~0 is measured from the floor).
    earlier = np.concatenate([np.full(lag, np.inf), np.maximum(smoothed[:-lag], KL_GROWTH_FLOOR / KL_GROWTH)])
    growing = (smoothed >= KL_GROWTH_FLOOR) & (smoothed >= KL_GROWTH * earlier)
    high = smoothed > KL_MAX
    stretches = true_stretches(growing | high, w, merge_gap=w // 2)
    if not stretches:
        return []
    first, last = stretches[0][0], stretches[-1][1]
    first_growing = np.flatnonzero(growing[first : last + 1])
    if len(first_growing):  # start where the rise began: the last point at a fifth of the first alarm's level
        alarm = first + int(first_growing[0])
        before = np.flatnonzero(smoothed[: alarm + 1] <= smoothed[alarm] / KL_GROWTH)
        first = int(before[-1]) if len(before) else first
    peak = float(smoothed[first : last + 1].max())
    what = f"policy/kl rose from {rounded(float(smoothed[first]))} to {rounded(peak)} nats/token"
    if high.any():
        what += f" (above {KL_MAX:g})"
    return [
        Finding(
            "kl_high",
            "error" if high.any() else "warning",
            kl.span(first, last),
            what + ": the policy drifts from pi_ref faster than the KL term holds it",
            f"lower optim.learning_rate{run.current('optim.learning_rate')}; raise "
            f"algorithm.beta{run.current('algorithm.beta')}; check eval/* over the same steps: if they fall, "
            "resume from a checkpoint before the rise",
        )
    ]


def check_kl_zero(run: Run) -> list[Finding]:
    kl = run.series(POLICY_KL)
    grad_norm = run.series(POLICY_GRAD_NORM)
    lr = run.series(POLICY_LR, optional=True)
    beta = _beta(run)
    if kl is None or len(kl) < MIN_STEPS or beta is None or beta <= 0:
        return []
    w = window(len(kl))
    if float(np.max(np.abs(kl.values[w:]))) >= KL_ZERO:
        return []
    moving = (
        grad_norm is not None
        and float(np.median(grad_norm.values)) > 0
        and (lr is None or float(np.median(lr.values)) > 0)
    )
    if not moving:
        return []
    assert grad_norm is not None  # moving
    return [
        Finding(
            "kl_zero",
            "error",
            (kl.step(w), kl.step(len(kl) - 1)),
            f"policy/kl stayed below {KL_ZERO:g} with algorithm.beta={beta:g} while the policy was updated "
            f"(median policy/grad_norm {rounded(float(np.median(grad_norm.values)))}): pi_ref moves with "
            "pi_theta, so the KL term does nothing",
            "check that pi_ref is a separate frozen copy of the starting weights (not the trained model, not "
            "shared LoRA weights with the adapter on); or set algorithm.beta=0 on purpose",
        )
    ]


def check_entropy(run: Run) -> list[Finding]:
    entropy = run.series(POLICY_ENTROPY)
    if entropy is None or len(entropy) < MIN_STEPS:
        return []
    start = start_level(entropy)
    if start <= 0:
        return []
    return [
        Finding(
            "entropy_collapse",
            "warning",
            entropy.span(st.first, st.last),
            f"policy/entropy fell from {rounded(start)} to {rounded(float(np.median(st.smoothed)))} "
            f"({percent(float(np.median(st.smoothed)) / start)} "
            "of its start): the policy stopped exploring; expect eval/pass@k to sink toward eval/pass@1",
            f"raise rollout.temperature{run.current('rollout.temperature')}; clip-higher: "
            f"algorithm.epsilon_high=0.28{run.current('algorithm.epsilon_high')}; lower "
            f"optim.learning_rate{run.current('optim.learning_rate')}; check that samples are still diverse "
            "within a group",
        )
        for st in sustained(entropy, below=ENTROPY_COLLAPSE_FRAC * start)
    ]
