"""Checks of the rewards and the advantages: failing or absent rewards, groups without a learning signal, a
reward that stays flat or falls back."""

from __future__ import annotations

import numpy as np

from grpokit.doctor.run import Finding, Run, row_step
from grpokit.doctor.stats import (
    blocks,
    mean_diff_se,
    percent,
    rounded,
    slope_t,
    step_noise,
    sustained,
    true_stretches,
)
from grpokit.doctor.thresholds import (
    DROP_FRAC,
    DROP_MIN_BLOCK,
    DROP_MIN_STEPS,
    DROP_Z,
    ERROR_FRAC_ERROR_STEPS,
    ERROR_FRAC_MAX,
    FLAT_MIN_STEPS,
    FLAT_Z,
    NO_SIGNAL_MIN_STEPS,
    NONE_FRAC_MAX,
    ZERO_STD_ERROR,
    ZERO_STD_MAX,
)
from grpokit.metrics.compute import (
    REWARD_ERROR_FRAC,
    REWARD_MEAN,
    REWARD_NONE_FRAC,
    REWARD_ZERO_STD_FRAC,
    failed_fractions,
    no_learning_signal,
    reward_timeouts,
)
from grpokit.values import finite_number


def check_reward_none(run: Run) -> list[Finding]:
    none_frac = run.series(REWARD_NONE_FRAC)
    if none_frac is None:
        return []
    return [
        Finding(
            "reward_none",
            "error",
            none_frac.span(st.first, st.last),
            f"reward/none_frac median {percent(float(np.median(st.smoothed)))}: no reward function returned "
            "a value for most completions, so their reward is 0 by convention and carries no information",
            "check that the dataset columns match the reward functions' arguments (e.g. `answer`) and "
            "that each function recognizes this task's completions; run them on a few samples by hand",
        )
        for st in sustained(none_frac, above=NONE_FRAC_MAX)
    ]


def check_reward_errors(run: Run) -> list[Finding]:
    error_frac = run.series(REWARD_ERROR_FRAC)
    if error_frac is None:
        return []
    limit = run.setting("reward_error_fraction")
    limit = (
        float(limit) if isinstance(limit, (int, float)) and not isinstance(limit, bool) else ERROR_FRAC_MAX
    )
    flagged = np.flatnonzero(error_frac.values > limit)
    if not len(flagged):
        return []
    steps = set(error_frac.steps[flagged].tolist())
    worst: dict[str, float] = {}
    timed_out: set[str] = set()
    for r in run.rows:
        if row_step(r) in steps:
            for name, fraction in failed_fractions(r).items():
                worst[name] = max(worst.get(name, 0.0), fraction)
                if (finite_number(r.get(reward_timeouts(name))) or 0) > 0:
                    timed_out.add(name)
    names = ", ".join(
        f"{name!r} (up to {percent(f)})"
        for name, f in sorted(worst.items(), key=lambda kv: -kv[1])
        if f > limit
    )
    slow = f"; timed out: {', '.join(map(repr, sorted(timed_out)))}" if timed_out else ""
    return [
        Finding(
            "reward_errors",
            "error" if len(flagged) > ERROR_FRAC_ERROR_STEPS * len(error_frac) else "warning",
            error_frac.span(int(flagged[0]), int(flagged[-1])),
            f"at {len(flagged)} of {len(error_frac)} logged steps a reward function failed (raised, timed "
            f"out or returned bad values) on more than {percent(limit)} of the completions: "
            f"{names or 'reward/error_frac'}{slow}; those completions got 0 from it in the total, "
            "not a score",
            "read the function's first error in the training log (logger grpokit.rewards, once, with its "
            "traceback) and run it by hand on completions from samples.jsonl; one that times out: make it "
            f"faster or raise reward_timeout{run.current('reward_timeout')} (or its own `timeout`); "
            "reward_errors=raise stops at the first failure",
        )
    ]


def check_no_signal(run: Run) -> list[Finding]:
    if run.series(REWARD_ZERO_STD_FRAC) is None:  # notes the metric as absent for the report
        return []
    by_step = {
        row_step(r): no_learning_signal(r)
        for r in run.rows
        if finite_number(r.get(REWARD_ZERO_STD_FRAC)) is not None
    }
    steps = sorted(by_step)
    mask = np.array([by_step[s] for s in steps])
    return [
        Finding(
            "no_signal",
            "error",
            (steps[first], steps[last]),
            f"no learning signal at {_how_many(first, last, len(steps))}: in every group all G completions "
            "got the same reward (reward/zero_std_frac = 1), so every advantage was 0 and the policy had no "
            "gradient",
            f"raise rollout.temperature{run.current('rollout.temperature')} or rollout.num_generations"
            f"{run.current('rollout.num_generations')}; train on prompts the policy solves sometimes, not "
            "always or never (an SFT warm start, easier data); give the reward partial credit; "
            "algorithm.dynamic_sampling=true draws other groups; the trainer stops such a run after "
            f"stop_after_bad_steps{run.current('stop_after_bad_steps')} steps in a row",
        )
        for first, last in true_stretches(mask, min(NO_SIGNAL_MIN_STEPS, len(steps)))
    ]


def _how_many(first: int, last: int, n: int) -> str:
    k = last - first + 1
    return f"every one of the run's {n} logged steps" if k == n else f"{k} logged steps in a row"


def check_reward_flat(run: Run) -> list[Finding]:
    reward = run.series(REWARD_MEAN)
    if reward is None or len(reward) < FLAT_MIN_STEPS:
        return []
    block, block_means = blocks(reward.values)
    sigma = step_noise(reward.values)
    stderr = mean_diff_se(sigma, block)
    best_rise = float(block_means.max() - block_means[0])
    trend_t = slope_t(reward.values, sigma)
    if (
        trend_t > FLAT_Z or best_rise > FLAT_Z * stderr
    ):  # a trend over the run, or one stretch well above the start
        return []
    return [
        Finding(
            "reward_flat",
            "warning",
            (reward.step(0), reward.step(len(reward) - 1)),
            f"reward/mean {rounded(block_means[0])} over the first {block} steps, "
            f"{rounded(block_means[-1])} over the last {block}; trend t = {rounded(trend_t)}, best stretch "
            f"{rounded(best_rise)} above the start (noise ±{rounded(sigma)} per step; a rise needs "
            f"{FLAT_Z:g} standard errors = {rounded(FLAT_Z * stderr)})",
            "read samples.jsonl and score known-good completions with the reward function (is it "
            f"ever > 0?); raise rollout.temperature{run.current('rollout.temperature')}; easier prompts or "
            "an SFT warm-start (`grpokit sft`) so some completions succeed; try optim.learning_rate"
            f"{run.current('optim.learning_rate')} a few times larger",
        )
    ]


def check_reward_drop(run: Run) -> list[Finding]:
    """A fall after a rise: the last block DROP_Z standard errors below the best earlier one, which rose
    FLAT_Z standard errors above the first (a rise as reward_flat counts one). From DROP_MIN_STEPS logged
    steps on, in blocks of at least DROP_MIN_BLOCK steps, so that a short run (16 steps), or the live doctor
    on a run so far, can show one."""
    reward = run.series(REWARD_MEAN)
    if reward is None or len(reward) < DROP_MIN_STEPS:
        return []
    block, block_means = blocks(reward.values, DROP_MIN_BLOCK)
    stderr = mean_diff_se(step_noise(reward.values), block)
    best = int(np.argmax(block_means[:-1]))  # the best block before the last
    peak, last = float(block_means[best]), float(block_means[-1])
    drop, swing = peak - last, peak - min(float(block_means[0]), last)
    rise = peak - float(block_means[0])  # a flat run's noise is no fall: it must have risen first
    if drop <= DROP_Z * stderr or rise <= FLAT_Z * stderr or drop < DROP_FRAC * swing:
        return []
    peak_first, peak_last = best * block, min(best * block + block, len(reward)) - 1
    return [
        Finding(
            "reward_drop",
            "error",
            (reward.step(peak_first), reward.step(len(reward) - 1)),
            f"reward/mean fell from {rounded(peak)} (mean of steps "
            f"{reward.step(peak_first)}-{reward.step(peak_last)}) to {rounded(last)} (last {block} steps), "
            f"{rounded(drop / stderr) if stderr > 0 else 'inf'} standard errors: training became unstable",
            f"lower optim.learning_rate{run.current('optim.learning_rate')}; raise "
            f"algorithm.beta{run.current('algorithm.beta')}; look at policy/kl, clip_frac, entropy and "
            "grad_norm around the peak; resume from the checkpoint before the fall",
        )
    ]


def check_zero_std(run: Run) -> list[Finding]:
    zero_std = run.series(REWARD_ZERO_STD_FRAC)
    if zero_std is None:
        return []
    if run.setting("algorithm.dynamic_sampling") is True:  # it ran and still could not fill the batch
        sampling = (
            "dynamic sampling is on but ran out of rounds: raise algorithm.max_sampling_rounds"
            f"{run.current('algorithm.max_sampling_rounds')}"
        )
    else:
        sampling = (
            "DAPO dynamic sampling drops such groups: algorithm.dynamic_sampling=true (or "
            "algorithm.preset=dapo)"
        )
    out = []
    for st in sustained(zero_std, above=ZERO_STD_MAX):
        raw = zero_std.values[st.first : st.last + 1]
        median = float(np.median(raw))
        out.append(
            Finding(
                "zero_std",
                "error" if median > ZERO_STD_ERROR else "warning",
                zero_std.span(st.first, st.last),
                f"reward/zero_std_frac median {percent(median)} (max {percent(float(raw.max()))}): that "
                "share of groups got all-equal rewards, so advantage 0 and no policy gradient; the prompts "
                "are too easy or too hard for the policy",
                f"raise rollout.num_generations{run.current('rollout.num_generations')} or "
                f"rollout.temperature{run.current('rollout.temperature')}; keep prompts of medium difficulty "
                f"(filter by the current pass rate); {sampling}",
            )
        )
    return out
