"""`grpokit doctor RUN_DIR`: read a run's metrics.jsonl and say what a GRPO instability checklist
finds in it, with the step range and the fix.

    grpokit doctor runs/x        # table of findings; exit 0 healthy, 1 findings, 2 no readable run

    from grpokit.doctor import diagnose
    from grpokit.metrics import read_metrics
    findings = diagnose(read_metrics("runs/x/metrics.jsonl"), config_dict_or_None)

Each check is a small function of the run, listed in CHECKS in the order one debugs a run:
first the reward and advantage distributions, then ratio / clip / KL, then the hyperparameters,
then reward hacking and held-out accuracy. Thresholds are the
named constants below; docs/doctor.md gives each one's value, reason and fix. Every level check
looks at a centered rolling median and needs the condition to hold for a whole window of logged
steps, so one noisy step never fires; trend checks compare means of blocks of steps (and the
least-squares slope) against the run's own step-to-step noise. Metrics a run did not log are skipped,
never an error: a check asks the Run for its series, and the Run notes each metric it was asked for
and no row has, so the report can list the checks that had nothing to read.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from grpokit.metrics import (
    ADVANTAGE_MEAN,
    EVAL_PASS_AT_1,
    METRICS_FILE,
    POLICY_CLIP_FRAC,
    POLICY_ENTROPY,
    POLICY_GRAD_NORM,
    POLICY_KL,
    POLICY_LOSS,
    POLICY_LR,
    POLICY_RATIO_MEAN,
    POLICY_SKIPPED_UPDATES,
    REWARD_ERROR_FRAC,
    REWARD_MEAN,
    REWARD_NONE_FRAC,
    REWARD_STD,
    REWARD_ZERO_STD_FRAC,
    ROLLOUT_COMPLETION_LEN_MEAN,
    ROLLOUT_TOOLS_CALLS_PER_EPISODE,
    ROLLOUT_TRUNCATED_FRAC,
    failed_fractions,
    no_learning_signal,
    read_metrics,
    record_step,
    reward_timeouts,
)
from grpokit.values import finite_number

CONFIG_FILE = "config.yaml"

# ------------------------------------------------------------------ thresholds (docs/doctor.md)
# Smoothing: a rolling window of n / WINDOW_DIVISOR logged steps, clamped to [MIN_WINDOW, MAX_WINDOW]
# and made odd; "sustained" means for at least one window of consecutive logged steps.
WINDOW_DIVISOR = 20
MIN_WINDOW = 5
MAX_WINDOW = 25
MIN_STEPS = 20  # logged steps a windowed check needs before it says anything

# reward: is it sparse or noisy, are groups all equal
FLAT_MIN_STEPS = 30  # logged steps before "no trend" means anything
FLAT_BLOCKS = 8  # the run is cut into this many blocks of steps for trend tests
FLAT_Z = 3.0  # a rise counts when it exceeds FLAT_Z standard errors (block means, or the run's slope)
DROP_Z = 4.0  # a fall from the best block counts when it exceeds DROP_Z standard errors ...
DROP_FRAC = 0.5  # ... and gives back at least this fraction of the rise
NONE_FRAC_MAX = 0.5  # reward/none_frac: no reward function applied to most completions
ZERO_STD_MAX = 0.5  # reward/zero_std_frac: most groups carry no gradient
ZERO_STD_ERROR = 0.9
NO_SIGNAL_MIN_STEPS = 5  # logged steps in a row where every group was tied (or the whole run, when shorter)
ERROR_FRAC_MAX = (
    0.5  # reward/error_frac: a function failed on most of a step (config reward_error_fraction wins)
)
ERROR_FRAC_ERROR_STEPS = 0.1  # ... at more than this fraction of the logged steps: an error, else a warning
# ratio / clip / KL
RATIO_TOL = 0.1  # |policy/ratio_mean - 1|: trainer and sampler disagree
CLIP_FRAC_MAX = 0.2  # policy/clip_frac
CLIP_FRAC_ERROR = 0.3
KL_MAX = 0.5  # policy/kl in nats per token: far from pi_ref
KL_GROWTH = 5.0  # policy/kl multiplied by this within KL_GROWTH_WINDOWS windows ...
KL_GROWTH_WINDOWS = 2
KL_GROWTH_FLOOR = 0.1  # ... and above this: exploding (below it, the early rise from 0 is normal)
KL_ZERO = 1e-6  # policy/kl this small with beta > 0 and a moving policy: pi_ref is pi_theta
# rollouts: did rollout length and diversity change
ENTROPY_COLLAPSE_FRAC = 0.25  # policy/entropy below this fraction of its start
LEN_COLLAPSE_FRAC = 0.25  # rollout/completion_len_mean below this fraction of its start
LEN_BLOWUP_FACTOR = 4.0  # ... or above this multiple of its start
TRUNC_MAX = 0.2  # rollout/truncated_frac
TRUNC_ERROR = 0.5
# numerics
GRAD_SPIKE_FACTOR = 10.0  # policy/grad_norm above this multiple of the median of ...
GRAD_HISTORY = 20  # ... the previous GRAD_HISTORY logged steps
GRAD_MIN_HISTORY = 10  # (needs at least this many before it)
GRAD_SPIKE_Z = 5.0  # ... and above this many of the run's step-to-step spreads of log(grad_norm)
NONFINITE_KEYS = (
    REWARD_MEAN,
    REWARD_STD,
    ADVANTAGE_MEAN,
    POLICY_LOSS,
    POLICY_KL,
    POLICY_GRAD_NORM,
    POLICY_ENTROPY,
)
# reward hacking: training reward up, held-out pass@1 not
HACK_MIN_EVALS = 3
HACK_Z = 3.0  # the training-reward rise must be this many standard errors ...
HACK_TRAIN_GAIN_STD = 0.5  # ... and at least this many reward/std (the within-step spread)
HACK_EVAL_MIN_GAIN = 0.02  # eval/pass@1 must rise at least this much (absolute) ...
HACK_EVAL_DROP = 0.05  # ... and a fall of this much is an error
# tool spam: calls per episode up, held-out pass@1 not (same evaluation rules as reward hacking)
SPAM_MIN_RISE = 0.5  # rollout/tools/calls_per_episode rose by at least this many calls per episode ...
SPAM_Z = 3.0  # ... and by more than this many standard errors of its step-to-step noise


@dataclass(frozen=True)
class Finding:
    """One problem: which check, how bad, over which logged steps, what was seen, what to do."""

    check: str
    severity: Literal["warning", "error"]
    steps: tuple[int, int]  # first and last step (inclusive) where it was seen
    message: str
    fix: str


# ------------------------------------------------------------------ reading the run
@dataclass(frozen=True)
class Series:
    """One metric over the run: finite values only, sorted by step, one value per step (the last)."""

    steps: np.ndarray  # [n] int
    values: np.ndarray  # [n] float

    def __len__(self) -> int:
        return len(self.steps)

    def step(self, i: int) -> int:
        return int(self.steps[i])

    def span(self, first: int, last: int) -> tuple[int, int]:
        """The steps at two indices: a finding's step range."""
        return (self.step(first), self.step(last))


def _step(row: dict) -> int:
    """The step of a row the Run kept (record_step is not None for those)."""
    step = record_step(row)
    assert step is not None
    return int(step)


class Run:
    """The rows of a metrics.jsonl that have a numeric step, and the run's config, with per-metric
    series on demand. `absent` collects the metrics asked for with series() that no row has."""

    def __init__(self, rows: Sequence[dict], config: dict | None = None):
        self.rows = [r for r in rows if isinstance(r, dict) and record_step(r) is not None]
        self.config = config if isinstance(config, dict) else {}
        self.logged = {key for r in self.rows for key in r}  # every metric name in some row
        self.absent: set[str] = set()
        self._cache: dict[str, Series | None] = {}

    def series(self, key: str, *, optional: bool = False) -> Series | None:
        """The metric's finite values by step, or None when it has none. A metric the run did not log
        at all is noted in `absent` unless optional (the check can still judge without it)."""
        if not optional and key not in self.logged:
            self.absent.add(key)
        if key not in self._cache:
            by_step: dict[int, float] = {}
            for r in self.rows:
                x = finite_number(r.get(key))
                if x is not None:
                    by_step[_step(r)] = x  # a later line for the same step wins
            if by_step:
                steps = np.array(sorted(by_step), dtype=np.int64)
                self._cache[key] = Series(steps, np.array([by_step[s] for s in steps], dtype=np.float64))
            else:
                self._cache[key] = None
        return self._cache[key]

    def setting(self, dotted: str) -> Any:
        """config value at 'section.key', or None when the run has no config or not that key."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def current(self, dotted: str) -> str:
        """' (now X)' for a fix text, or '' when the config does not say."""
        value = self.setting(dotted)
        return "" if value is None else f" (now {value})"


# ------------------------------------------------------------------ robust statistics
def window(n: int) -> int:
    """The rolling window, in logged steps, for a series of n logged steps (odd)."""
    w = int(min(MAX_WINDOW, max(MIN_WINDOW, n // WINDOW_DIVISOR)))
    return w if w % 2 else w + 1


def rolling_median(x: np.ndarray, w: int) -> np.ndarray:
    """Centered rolling median over w points; the window shrinks at the ends."""
    half = w // 2
    padded = np.concatenate([np.full(half, np.nan), x, np.full(half, np.nan)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, w)  # [n, w]
    return np.nanmedian(windows, axis=1)


def step_noise(x: np.ndarray) -> float:
    """Std of one step's value around the trend: std of first differences / sqrt(2). Differences cancel a
    slow trend; a plain std (not a MAD) because rewards of small batches take few distinct values."""
    if len(x) < 3:
        return 0.0
    return float(np.std(np.diff(x)) / math.sqrt(2))


def mean_diff_se(sigma: float, m: int) -> float:
    """Standard error of the difference of two means of m points with noise sigma."""
    return sigma * math.sqrt(2.0 / m)


def slope_t(x: np.ndarray, sigma: float) -> float:
    """t statistic of the least-squares slope of x against its index, with per-step noise sigma."""
    i = np.arange(len(x), dtype=np.float64)
    i -= i.mean()
    slope = float(i @ (x - x.mean()) / (i @ i))
    return slope / (sigma / math.sqrt(float(i @ i))) if sigma > 0 else (math.inf if slope > 0 else 0.0)


def true_stretches(mask: np.ndarray, min_len: int, merge_gap: int = 0) -> list[tuple[int, int]]:
    """Inclusive index ranges of consecutive True values, gaps of <= merge_gap merged, >= min_len long."""
    out: list[list[int]] = []
    for i in np.flatnonzero(mask):
        if out and i - out[-1][1] <= merge_gap + 1:
            out[-1][1] = int(i)
        else:
            out.append([int(i), int(i)])
    return [(first, last) for first, last in out if last - first + 1 >= min_len]


class Stretch(NamedTuple):
    """Consecutive logged steps where a smoothed series crossed a bound."""

    first: int  # index into the series
    last: int  # (inclusive)
    smoothed: np.ndarray  # the rolling median over first..last


def _sustained(s: Series, above: float | None = None, below: float | None = None) -> list[Stretch]:
    """Stretches where the rolling median is above / below a bound for at least one window."""
    if len(s) < MIN_STEPS:
        return []
    w = window(len(s))
    smoothed = rolling_median(s.values, w)
    mask = np.zeros(len(s), dtype=bool)
    if above is not None:
        mask |= smoothed > above
    if below is not None:
        mask |= smoothed < below
    return [Stretch(a, b, smoothed[a : b + 1]) for a, b in true_stretches(mask, w, merge_gap=w // 2)]


def _start_level(s: Series) -> float:
    """Median of the first window of a series: its level before training changed it."""
    return float(np.median(s.values[: window(len(s))]))


def _blocks(x: np.ndarray) -> tuple[int, np.ndarray]:
    """Block size b and the means of consecutive blocks of b points (the last block is the last b points)."""
    b = max(MIN_WINDOW, len(x) // FLAT_BLOCKS)
    means = [np.mean(x[i : i + b]) for i in range(0, len(x) - b + 1, b)]
    if len(x) % b:
        means.append(np.mean(x[-b:]))
    return b, np.array(means)


def _rounded(x: float) -> str:
    """A number with 3 significant digits."""
    return f"{x:.3g}"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


# ------------------------------------------------------------------ checks, in the order one debugs a run
def check_reward_none(run: Run) -> list[Finding]:
    none_frac = run.series(REWARD_NONE_FRAC)
    if none_frac is None:
        return []
    return [
        Finding(
            "reward_none",
            "error",
            none_frac.span(st.first, st.last),
            f"reward/none_frac median {_percent(float(np.median(st.smoothed)))}: no reward function returned "
            "a value for most completions, so their reward is 0 by convention and carries no information",
            "check that the dataset columns match the reward functions' arguments (e.g. `answer`) and "
            "that each function recognizes this task's completions; run them on a few samples by hand",
        )
        for st in _sustained(none_frac, above=NONE_FRAC_MAX)
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
        if _step(r) in steps:
            for name, fraction in failed_fractions(r).items():
                worst[name] = max(worst.get(name, 0.0), fraction)
                if (finite_number(r.get(reward_timeouts(name))) or 0) > 0:
                    timed_out.add(name)
    names = ", ".join(
        f"{name!r} (up to {_percent(f)})"
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
            f"out or returned bad values) on more than {_percent(limit)} of the completions: "
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
        _step(r): no_learning_signal(r)
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
    block, block_means = _blocks(reward.values)
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
            f"reward/mean {_rounded(block_means[0])} over the first {block} steps, "
            f"{_rounded(block_means[-1])} over the last {block}; trend t = {_rounded(trend_t)}, best stretch "
            f"{_rounded(best_rise)} above the start (noise ±{_rounded(sigma)} per step; a rise needs "
            f"{FLAT_Z:g} standard errors = {_rounded(FLAT_Z * stderr)})",
            "read samples.jsonl and score known-good completions with the reward function (is it "
            f"ever > 0?); raise rollout.temperature{run.current('rollout.temperature')}; easier prompts or "
            "an SFT warm-start (`grpokit sft`) so some completions succeed; try optim.learning_rate"
            f"{run.current('optim.learning_rate')} a few times larger",
        )
    ]


def check_reward_drop(run: Run) -> list[Finding]:
    reward = run.series(REWARD_MEAN)
    if reward is None or len(reward) < FLAT_MIN_STEPS:
        return []
    block, block_means = _blocks(reward.values)
    stderr = mean_diff_se(step_noise(reward.values), block)
    best = int(np.argmax(block_means[:-1]))  # the best block before the last
    peak, last = float(block_means[best]), float(block_means[-1])
    drop, swing = peak - last, peak - min(float(block_means[0]), last)
    if drop <= DROP_Z * stderr or drop < DROP_FRAC * swing:
        return []
    peak_first, peak_last = best * block, min(best * block + block, len(reward)) - 1
    return [
        Finding(
            "reward_drop",
            "error",
            (reward.step(peak_first), reward.step(len(reward) - 1)),
            f"reward/mean fell from {_rounded(peak)} (mean of steps "
            f"{reward.step(peak_first)}-{reward.step(peak_last)}) to {_rounded(last)} (last {block} steps), "
            f"{_rounded(drop / stderr) if stderr > 0 else 'inf'} standard errors: training became unstable",
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
    for st in _sustained(zero_std, above=ZERO_STD_MAX):
        raw = zero_std.values[st.first : st.last + 1]
        median = float(np.median(raw))
        out.append(
            Finding(
                "zero_std",
                "error" if median > ZERO_STD_ERROR else "warning",
                zero_std.span(st.first, st.last),
                f"reward/zero_std_frac median {_percent(median)} (max {_percent(float(raw.max()))}): that "
                "share of groups got all-equal rewards, so advantage 0 and no policy gradient; the prompts "
                "are too easy or too hard for the policy",
                f"raise rollout.num_generations{run.current('rollout.num_generations')} or "
                f"rollout.temperature{run.current('rollout.temperature')}; keep prompts of medium difficulty "
                f"(filter by the current pass rate); {sampling}",
            )
        )
    return out


def check_ratio(run: Run) -> list[Finding]:
    ratio = run.series(POLICY_RATIO_MEAN)
    if ratio is None:
        return []
    return [
        Finding(
            "ratio_mismatch",
            "warning",
            ratio.span(st.first, st.last),
            f"policy/ratio_mean {_rounded(float(np.median(st.smoothed)))} (should stay near 1: the mean "
            "importance ratio over sampled tokens is 1 in expectation): the trainer's policy and the "
            "sampler's disagree",
            "check that the rollout engine gets the new weights after every optimizer step and computes "
            "log-probs at the same temperature and dtype as the trainer; lower optim.learning_rate"
            f"{run.current('optim.learning_rate')}",
        )
        for st in _sustained(ratio, above=1 + RATIO_TOL, below=1 - RATIO_TOL)
    ]


def check_clip(run: Run) -> list[Finding]:
    clip = run.series(POLICY_CLIP_FRAC)
    if clip is None:
        return []
    out = []
    for st in _sustained(clip, above=CLIP_FRAC_MAX):
        raw = clip.values[st.first : st.last + 1]
        median = float(np.median(raw))
        out.append(
            Finding(
                "clip_high",
                "error" if median > CLIP_FRAC_ERROR else "warning",
                clip.span(st.first, st.last),
                f"policy/clip_frac median {_percent(median)} (max {_percent(float(raw.max()))}): the update "
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
    what = f"policy/kl rose from {_rounded(float(smoothed[first]))} to {_rounded(peak)} nats/token"
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
            f"(median policy/grad_norm {_rounded(float(np.median(grad_norm.values)))}): pi_ref moves with "
            "pi_theta, so the KL term does nothing",
            "check that pi_ref is a separate frozen copy of the starting weights (not the trained model, not "
            "shared LoRA weights with the adapter on); or set algorithm.beta=0 on purpose",
        )
    ]


def check_entropy(run: Run) -> list[Finding]:
    entropy = run.series(POLICY_ENTROPY)
    if entropy is None or len(entropy) < MIN_STEPS:
        return []
    start = _start_level(entropy)
    if start <= 0:
        return []
    return [
        Finding(
            "entropy_collapse",
            "warning",
            entropy.span(st.first, st.last),
            f"policy/entropy fell from {_rounded(start)} to {_rounded(float(np.median(st.smoothed)))} "
            f"({_percent(float(np.median(st.smoothed)) / start)} "
            "of its start): the policy stopped exploring; expect eval/pass@k to sink toward eval/pass@1",
            f"raise rollout.temperature{run.current('rollout.temperature')}; clip-higher: "
            f"algorithm.epsilon_high=0.28{run.current('algorithm.epsilon_high')}; lower "
            f"optim.learning_rate{run.current('optim.learning_rate')}; check that samples are still diverse "
            "within a group",
        )
        for st in _sustained(entropy, below=ENTROPY_COLLAPSE_FRAC * start)
    ]


def check_length(run: Run) -> list[Finding]:
    length = run.series(ROLLOUT_COMPLETION_LEN_MEAN)
    if length is None or len(length) < MIN_STEPS:
        return []
    start = _start_level(length)
    if start <= 0:
        return []
    out = []
    for st in _sustained(length, below=LEN_COLLAPSE_FRAC * start):
        level = float(np.median(st.smoothed))
        out.append(
            Finding(
                "length_collapse",
                "warning",
                length.span(st.first, st.last),
                f"rollout/completion_len_mean fell from {_rounded(start)} to {_rounded(level)} tokens "
                f"({_percent(level / start)} of its start)",
                "read samples.jsonl: short answers that still earn reward mean the reward pays for the form, "
                "not the work; the grpo loss's 1/|o_i| favors short correct answers: algorithm.loss_type="
                f"dr_grpo or dapo{run.current('algorithm.loss_type')}; lower optim.learning_rate",
            )
        )
    for st in _sustained(length, above=LEN_BLOWUP_FACTOR * start):
        level = float(np.median(st.smoothed))
        out.append(
            Finding(
                "length_blowup",
                "warning",
                length.span(st.first, st.last),
                f"rollout/completion_len_mean grew from {_rounded(start)} to {_rounded(level)} tokens "
                f"({_rounded(level / start)}x its start); fine if the answers got better, not if they repeat",
                "read samples.jsonl for repetition; overlong shaping (algorithm.overlong_buffer_frac=0.2, "
                "DAPO's soft punishment, or the overlong reward) and "
                "algorithm.mask_truncated_completions=true; algorithm.loss_type=dr_grpo or "
                f"dapo{run.current('algorithm.loss_type')} (the grpo loss's 1/|o_i| penalizes long wrong "
                "answers less); raise "
                f"rollout.max_completion_length{run.current('rollout.max_completion_length')} if long "
                "answers are right",
            )
        )
    return out


def check_truncation(run: Run) -> list[Finding]:
    truncated = run.series(ROLLOUT_TRUNCATED_FRAC)
    if truncated is None:
        return []
    out = []
    for st in _sustained(truncated, above=TRUNC_MAX):
        median = float(np.median(truncated.values[st.first : st.last + 1]))
        out.append(
            Finding(
                "truncation",
                "error" if median > TRUNC_ERROR else "warning",
                truncated.span(st.first, st.last),
                f"rollout/truncated_frac median {_percent(median)}: that share of completions hit "
                "max_completion_length without EOS; they usually score 0 and bias the length",
                f"raise rollout.max_completion_length{run.current('rollout.max_completion_length')}; "
                "overlong shaping "
                f"(algorithm.overlong_buffer_frac=0.2{run.current('algorithm.overlong_buffer_frac')}, or the "
                "overlong reward); "
                "algorithm.mask_truncated_completions=true"
                f"{run.current('algorithm.mask_truncated_completions')}; "
                "algorithm.loss_type=dr_grpo or dapo against the grpo loss's length bias",
            )
        )
    return out


def check_grad_spikes(run: Run) -> list[Finding]:
    grad_norm = run.series(POLICY_GRAD_NORM)
    if grad_norm is None or len(grad_norm) <= GRAD_MIN_HISTORY:
        return []
    norms = grad_norm.values
    # A run whose gradient norm routinely swings by x4 needs more than x10 to call a step a spike:
    # the bar is also GRAD_SPIKE_Z of the run's own step-to-step spread in log space.
    log_diffs = np.diff(np.log(np.maximum(norms, 1e-12)))
    spread = (
        1.4826 * float(np.median(np.abs(log_diffs - np.median(log_diffs)))) / math.sqrt(2)
    )  # robust: spikes do not count
    log_bar = max(math.log(GRAD_SPIKE_FACTOR), GRAD_SPIKE_Z * spread)
    padded = np.concatenate([np.full(GRAD_HISTORY, np.nan), norms])
    history = np.lib.stride_tricks.sliding_window_view(padded[:-1], GRAD_HISTORY)[GRAD_MIN_HISTORY:]
    before = np.nanmedian(history, axis=1)  # before[j]: median of the steps before j
    ratio = norms[GRAD_MIN_HISTORY:] / np.where(before > 0, before, np.inf)
    spikes = [(GRAD_MIN_HISTORY + int(j), float(ratio[j])) for j in np.flatnonzero(ratio > math.exp(log_bar))]
    if not spikes:
        return []
    worst, worst_ratio = max(spikes, key=lambda spike: spike[1])
    return [
        Finding(
            "grad_spikes",
            "warning",
            (grad_norm.step(spikes[0][0]), grad_norm.step(spikes[-1][0])),
            f"{len(spikes)} step(s) with policy/grad_norm > {_rounded(math.exp(log_bar))}x the median of the "
            f"previous {GRAD_HISTORY}; largest {_rounded(worst_ratio)}x at step {grad_norm.step(worst)} "
            f"({_rounded(float(norms[worst]))})",
            f"lower optim.learning_rate{run.current('optim.learning_rate')}; keep optim.max_grad_norm"
            f"{run.current('optim.max_grad_norm')} at 1 or below; read samples.jsonl at those steps for "
            "degenerate completions; model.dtype=float32 if it is bf16/fp16",
        )
    ]


def _new_skips(s: Series) -> np.ndarray:
    """Skipped optimizer steps per logged step, whether the metric is logged per step or as a running total
    (a non-decreasing series is read as a running total)."""
    v = s.values
    if len(v) > 1 and np.all(np.diff(v) >= 0):
        return np.diff(v, prepend=0.0)
    return v


def check_nonfinite(run: Run) -> list[Finding]:
    problems_at: dict[int, list[str]] = {}  # step -> what was wrong there
    skipped_series = run.series(POLICY_SKIPPED_UPDATES, optional=True)  # the null check runs without it
    skipped = 0
    if skipped_series is not None:
        new = _new_skips(skipped_series)
        for i in np.flatnonzero(new > 0):
            problems_at.setdefault(skipped_series.step(int(i)), []).append("skipped updates")
        skipped = int(new[new > 0].sum())
    null_keys: set[str] = set()
    for r in run.rows:
        bad = [k for k in NONFINITE_KEYS if k in r and finite_number(r[k]) is None]
        if bad:
            problems_at.setdefault(_step(r), []).extend(bad)
            null_keys.update(bad)
    if not problems_at:
        return []
    steps = sorted(problems_at)
    parts = []
    if skipped:
        parts.append(f"{skipped} optimizer step(s) skipped for a non-finite loss or gradient")
    if null_keys:
        parts.append(f"NaN/inf (null) in {', '.join(sorted(null_keys))}")
    return [
        Finding(
            "nonfinite",
            "error",
            (steps[0], steps[-1]),
            "; ".join(parts) + f", at {len(steps)} logged step(s)",
            f"lower optim.learning_rate{run.current('optim.learning_rate')}; check the reward functions for "
            f"NaN/inf (reward/errors/*); model.dtype=float32{run.current('model.dtype')}; "
            "optim.max_grad_norm=1",
        )
    ]


def check_reward_hacking(run: Run) -> list[Finding]:
    held_out = run.series(EVAL_PASS_AT_1)
    reward = run.series(REWARD_MEAN)
    if held_out is None or reward is None or len(held_out) < HACK_MIN_EVALS or len(reward) < MIN_STEPS:
        return []
    first_eval, last_eval = held_out.step(0), held_out.step(len(held_out) - 1)
    inside = reward.values[(reward.steps >= first_eval) & (reward.steps <= last_eval)]
    w = window(len(reward))
    if len(inside) < 2 * w:
        return []
    early, late = float(np.mean(inside[:w])), float(np.mean(inside[-w:]))
    gain = late - early
    stderr = mean_diff_se(step_noise(reward.values), w)
    spread = run.series(REWARD_STD, optional=True)
    need = max(
        HACK_Z * stderr, HACK_TRAIN_GAIN_STD * float(np.median(spread.values)) if spread is not None else 0.0
    )
    if gain <= need:
        return []
    third = max(1, len(held_out) // 3)
    eval_early, eval_late = float(np.mean(held_out.values[:third])), float(np.mean(held_out.values[-third:]))
    if eval_late - eval_early >= HACK_EVAL_MIN_GAIN:
        return []
    return [
        Finding(
            "reward_hacking",
            "error" if eval_late - eval_early <= -HACK_EVAL_DROP else "warning",
            (first_eval, last_eval),
            f"training reward/mean rose {_rounded(early)} -> {_rounded(late)} while eval/pass@1 went "
            f"{_rounded(eval_early)} -> {_rounded(eval_late)} "
            f"({len(held_out)} evaluations): the policy learns what the reward pays for, not the task",
            "read samples.jsonl at the late steps: does high-reward text solve the task? tighten the "
            "verifier (strict answer extraction, one answer only); add format or other rewards; check "
            "the reward's parts (reward/<fn>) and evaluate on unseen tasks",
        )
    ]


def _eval_change(held_out: Series) -> tuple[float, float]:
    """Mean eval/pass@1 of the first and of the last third of the evaluations."""
    third = max(1, len(held_out) // 3)
    return float(np.mean(held_out.values[:third])), float(np.mean(held_out.values[-third:]))


def check_tool_spam(run: Run) -> list[Finding]:
    calls = run.series(ROLLOUT_TOOLS_CALLS_PER_EPISODE, optional=True)  # runs without tools: nothing to check
    if calls is None or len(calls) < MIN_STEPS:
        return []
    held_out = run.series(EVAL_PASS_AT_1)
    if held_out is None or len(held_out) < HACK_MIN_EVALS:
        return []
    w = window(len(calls))
    early, late = float(np.mean(calls.values[:w])), float(np.mean(calls.values[-w:]))
    if late - early <= max(SPAM_MIN_RISE, SPAM_Z * mean_diff_se(step_noise(calls.values), w)):
        return []
    eval_early, eval_late = _eval_change(held_out)
    if eval_late - eval_early >= HACK_EVAL_MIN_GAIN:
        return []
    return [
        Finding(
            "tool_spam",
            "error" if eval_late - eval_early <= -HACK_EVAL_DROP else "warning",
            (calls.step(0), calls.step(len(calls) - 1)),
            f"tool calls per episode rose {_rounded(early)} -> {_rounded(late)} while eval/pass@1 went "
            f"{_rounded(eval_early)} -> {_rounded(eval_late)} ({len(held_out)} evaluations): the policy is "
            "paid for calling tools, not for solving the task",
            "pay per call only for objective evidence and charge for it: a step_cost reward (kwargs.cost), "
            "tool_result_used instead of tool_call_valid, a task reward that dominates the process rewards; "
            "lower rollout.max_turns; read samples.jsonl for repeated calls (docs/agentic.md)",
        )
    ]


@dataclass(frozen=True)
class Check:
    fn: Callable[[Run], list[Finding]]
    seed: str  # the part of a run it reads (reward, advantages, ratio, clip, KL, rollouts, ...)


#: name -> check, in the order one debugs a run, then reward hacking.
CHECKS: dict[str, Check] = {
    "reward_errors": Check(check_reward_errors, "reward"),
    "reward_none": Check(check_reward_none, "reward"),
    "reward_flat": Check(check_reward_flat, "reward, held-out"),
    "reward_drop": Check(check_reward_drop, "reward"),
    "no_signal": Check(check_no_signal, "advantages"),
    "zero_std": Check(check_zero_std, "advantages"),
    "ratio_mismatch": Check(check_ratio, "ratio"),
    "clip_high": Check(check_clip, "clip"),
    "kl_high": Check(check_kl_high, "KL"),
    "kl_zero": Check(check_kl_zero, "KL"),
    "entropy_collapse": Check(check_entropy, "rollouts"),
    "length": Check(check_length, "rollouts"),
    "truncation": Check(check_truncation, "rollouts"),
    "grad_spikes": Check(check_grad_spikes, "optimizer"),
    "nonfinite": Check(check_nonfinite, "optimizer"),
    "reward_hacking": Check(check_reward_hacking, "reward hacking, held-out"),
    "tool_spam": Check(check_tool_spam, "tool use, held-out"),
}


def run_checks(run: Run) -> tuple[list[Finding], list[str]]:
    """Every finding of every check, in CHECKS order, and the names of the checks that asked for a
    metric the run did not log (they said nothing, for want of data)."""
    findings, not_checked = [], []
    for name, check in CHECKS.items():
        run.absent.clear()
        findings += check.fn(run)
        if run.absent:
            not_checked.append(name)
    return findings, not_checked


def diagnose(rows: list[dict], config: dict | None = None) -> list[Finding]:
    """Every finding of every check on a run's metrics rows (as read from metrics.jsonl), in CHECKS order.
    config is the run's config as a nested dict (config.yaml), or None; it sharpens some checks
    (the KL checks run only when algorithm.beta > 0) and fills the fixes with the current values."""
    return run_checks(Run(rows, config))[0]


# ------------------------------------------------------------------ the command
def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _load_config(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        import yaml

        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception:  # a broken config only costs the config-aware parts of the checks
        return None
    return data if isinstance(data, dict) else None


def doctor_main(run_dir: str) -> int:
    """Print the report for the run in run_dir (an output_dir, or a metrics.jsonl itself).
    Returns 0 when no check fires, 1 when some do, 2 (after one line on stderr) when there is no readable
    run."""
    path = Path(run_dir)
    metrics = path if path.is_file() else path / METRICS_FILE
    if not path.exists():
        return _error(f"no run at {run_dir}: no such file or directory")
    if not metrics.is_file():
        return _error(f"{run_dir} has no {METRICS_FILE} (is it a grpokit output_dir?)")
    try:
        rows = read_metrics(metrics)
    except (OSError, UnicodeDecodeError) as exc:
        return _error(f"cannot read {metrics}: {exc}")
    run = Run(rows, _load_config(metrics.parent / CONFIG_FILE))
    if not run.rows:
        return _error(f'{metrics} has no metric lines (a line needs a numeric "step")')
    findings, not_checked = run_checks(run)
    _print_report(run, findings, not_checked, str(run_dir))
    return 1 if findings else 0


def _print_report(run: Run, findings: list[Finding], not_checked: list[str], name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    steps = sorted({_step(r) for r in run.rows})
    console.print(
        f"[bold]grpokit doctor[/bold] {name}: {len(steps)} logged steps ({steps[0]}-{steps[-1]}), "
        f"config {'read' if run.config else 'not found (config-aware checks skipped)'}"
    )
    if len(steps) < MIN_STEPS:
        console.print(
            f"only {len(steps)} logged steps: most checks need {MIN_STEPS} or more, so little can be judged "
            "yet"
        )
    if not_checked:
        console.print(f"not checked (metrics not logged): {', '.join(not_checked)}")
    if not findings:
        console.print("[green]no problems found[/green]")
        return
    table = Table(show_lines=True)
    table.add_column("check")
    table.add_column("steps", no_wrap=True)
    table.add_column("what was seen", overflow="fold")
    table.add_column("suggested fix", overflow="fold")
    for f in findings:
        color = "red" if f.severity == "error" else "yellow"
        table.add_row(
            f"[{color}]{f.check}[/{color}]\n{f.severity}", f"{f.steps[0]}-{f.steps[1]}", f.message, f.fix
        )
    console.print(table)
    n_err = sum(f.severity == "error" for f in findings)
    console.print(f"{len(findings)} finding(s): {n_err} error(s), {len(findings) - n_err} warning(s)")
