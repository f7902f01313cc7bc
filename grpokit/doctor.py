"""`grpokit doctor RUN_DIR`: read a run's metrics.jsonl and say what the seed's instability
checklist (Q24) finds in it, with the step range and the fix.

    grpokit doctor runs/x        # table of findings; exit 0 healthy, 1 findings, 2 no readable run

    from grpokit.doctor import diagnose
    from grpokit.plots import read_metrics
    findings = diagnose(read_metrics("runs/x/metrics.jsonl"), config_dict_or_None)

Each check is a small function of the run, listed in CHECKS in the order the seed debugs a run
(Q24: "first the reward and advantage distributions, then ratio / clip / KL, then the
hyperparameters"), then reward hacking (Q25) and held-out accuracy (Q26). Thresholds are the
named constants below; docs/doctor.md gives each one's value, reason and fix. Every level check
looks at a centered rolling median and needs the condition to hold for a whole window of logged
steps, so one noisy step never fires; trend checks compare means of blocks of steps (and the
least-squares slope) against the run's own step-to-step noise. Metrics a run did not log are skipped, never an error.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"

# ------------------------------------------------------------------ thresholds (docs/doctor.md)
# Smoothing: a rolling window of n / WINDOW_DIVISOR logged steps, clamped to [MIN_WINDOW, MAX_WINDOW]
# and made odd; "sustained" means for at least one window of consecutive logged steps.
WINDOW_DIVISOR = 20
MIN_WINDOW = 5
MAX_WINDOW = 25
MIN_STEPS = 20  # logged steps a windowed check needs before it says anything

# reward (Q24: "is the reward sparse or noisy, are groups all equal")
FLAT_MIN_STEPS = 30  # logged steps before "no trend" means anything
FLAT_BLOCKS = 8  # the run is cut into this many blocks of steps for trend tests
FLAT_Z = 3.0  # a rise counts when it exceeds FLAT_Z standard errors (block means, or the run's slope)
DROP_Z = 4.0  # a fall from the best block counts when it exceeds DROP_Z standard errors ...
DROP_FRAC = 0.5  # ... and gives back at least this fraction of the rise
NONE_FRAC_MAX = 0.5  # reward/none_frac: no reward function applied to most completions
ZERO_STD_MAX = 0.5  # reward/zero_std_frac: most groups carry no gradient (Q15)
ZERO_STD_ERROR = 0.9
# ratio / clip / KL
RATIO_TOL = 0.1  # |policy/ratio_mean - 1|: trainer and sampler disagree
CLIP_FRAC_MAX = 0.2  # policy/clip_frac
CLIP_FRAC_ERROR = 0.3
KL_MAX = 0.5  # policy/kl in nats per token: far from pi_ref
KL_GROWTH = 5.0  # policy/kl multiplied by this within KL_GROWTH_WINDOWS windows ...
KL_GROWTH_WINDOWS = 2
KL_GROWTH_FLOOR = 0.1  # ... and above this: exploding (below it, the early rise from 0 is normal)
KL_ZERO = 1e-6  # policy/kl this small with beta > 0 and a moving policy: pi_ref is pi_theta
# rollouts (Q24: "did rollout length and diversity change")
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
    "reward/mean",
    "reward/std",
    "advantage/mean",
    "policy/loss",
    "policy/kl",
    "policy/grad_norm",
    "policy/entropy",
)
# reward hacking (Q25, Q26): training reward up, held-out pass@1 not
HACK_MIN_EVALS = 3
HACK_Z = 3.0  # the training-reward rise must be this many standard errors ...
HACK_TRAIN_GAIN_STD = 0.5  # ... and at least this many reward/std (the within-step spread)
HACK_EVAL_MIN_GAIN = 0.02  # eval/pass@1 must rise at least this much (absolute) ...
HACK_EVAL_DROP = 0.05  # ... and a fall of this much is an error


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


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def _row_step(row: dict) -> int | None:
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return int(step)


class Run:
    """The rows of a metrics.jsonl and the run's config, with per-metric series on demand."""

    def __init__(self, rows: Sequence[dict], config: dict | None = None):
        self.rows = [r for r in rows if isinstance(r, dict) and _row_step(r) is not None]
        self.config = config if isinstance(config, dict) else {}
        self._cache: dict[str, Series | None] = {}

    def has(self, key: str) -> bool:
        return any(key in r for r in self.rows)

    def series(self, key: str) -> Series | None:
        if key not in self._cache:
            by_step: dict[int, float] = {}
            for r in self.rows:
                x = _finite(r.get(key))
                if x is not None:
                    by_step[_row_step(r)] = x  # a later line for the same step wins
            if by_step:
                steps = np.array(sorted(by_step), dtype=np.int64)
                self._cache[key] = Series(steps, np.array([by_step[s] for s in steps], dtype=np.float64))
            else:
                self._cache[key] = None
        return self._cache[key]

    def conf(self, dotted: str) -> Any:
        """config value at 'section.key', or None when the run has no config or not that key."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def now(self, dotted: str) -> str:
        """' (now X)' for a fix text, or '' when the config does not say."""
        value = self.conf(dotted)
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


def runs(mask: np.ndarray, min_len: int, merge_gap: int = 0) -> list[tuple[int, int]]:
    """Inclusive index ranges of consecutive True values, gaps of <= merge_gap merged, >= min_len long."""
    out: list[list[int]] = []
    for i in np.flatnonzero(mask):
        if out and i - out[-1][1] <= merge_gap + 1:
            out[-1][1] = int(i)
        else:
            out.append([int(i), int(i)])
    return [(a, b) for a, b in out if b - a + 1 >= min_len]


def _sustained(s: Series, above: float | None = None, below: float | None = None) -> list[tuple[int, int, np.ndarray]]:
    """Stretches where the rolling median is above / below a bound for at least one window:
    (first index, last index, the smoothed values there)."""
    if len(s) < MIN_STEPS:
        return []
    w = window(len(s))
    sm = rolling_median(s.values, w)
    mask = np.zeros(len(s), dtype=bool)
    if above is not None:
        mask |= sm > above
    if below is not None:
        mask |= sm < below
    return [(a, b, sm[a : b + 1]) for a, b in runs(mask, w, merge_gap=w // 2)]


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


def f3(x: float) -> str:
    """A number with 3 significant digits."""
    return f"{x:.3g}"


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _span(s: Series, a: int, b: int) -> tuple[int, int]:
    return (s.step(a), s.step(b))


# ------------------------------------------------------------------ checks, in the seed's order (Q24)
def check_reward_none(run: Run) -> list[Finding]:
    s = run.series("reward/none_frac")
    if s is None:
        return []
    return [
        Finding(
            "reward_none",
            "error",
            _span(s, a, b),
            f"reward/none_frac median {pct(float(np.median(sm)))}: no reward function returned a value "
            f"for most completions, so their reward is 0 by convention and carries no information",
            "check that the dataset columns match the reward functions' arguments (e.g. `answer`) and "
            "that each function recognizes this task's completions; run them on a few samples by hand",
        )
        for a, b, sm in _sustained(s, above=NONE_FRAC_MAX)
    ]


def check_reward_flat(run: Run) -> list[Finding]:
    s = run.series("reward/mean")
    if s is None or len(s) < FLAT_MIN_STEPS:
        return []
    b, means = _blocks(s.values)
    sigma = step_noise(s.values)
    se = mean_diff_se(sigma, b)
    best_rise = float(means.max() - means[0])
    t = slope_t(s.values, sigma)
    if t > FLAT_Z or best_rise > FLAT_Z * se:  # a trend over the run, or one stretch well above the start
        return []
    return [
        Finding(
            "reward_flat",
            "warning",
            (s.step(0), s.step(len(s) - 1)),
            f"reward/mean {f3(means[0])} over the first {b} steps, {f3(means[-1])} over the last {b}; "
            f"trend t = {f3(t)}, best stretch {f3(best_rise)} above the start (noise ±{f3(sigma)} per step; "
            f"a rise needs {FLAT_Z:g} standard errors = {f3(FLAT_Z * se)})",
            "read samples.jsonl and score known-good completions with the reward function (is it "
            f"ever > 0?); raise rollout.temperature{run.now('rollout.temperature')}; easier prompts or an SFT "
            f"warm-start (`grpokit sft`) so some completions succeed; try optim.learning_rate"
            f"{run.now('optim.learning_rate')} a few times larger",
        )
    ]


def check_reward_drop(run: Run) -> list[Finding]:
    s = run.series("reward/mean")
    if s is None or len(s) < FLAT_MIN_STEPS:
        return []
    b, means = _blocks(s.values)
    se = mean_diff_se(step_noise(s.values), b)
    k = int(np.argmax(means[:-1]))  # the best block before the last
    peak, last = float(means[k]), float(means[-1])
    drop, swing = peak - last, peak - min(float(means[0]), last)
    if drop <= DROP_Z * se or drop < DROP_FRAC * swing:
        return []
    a, z = k * b, min(k * b + b, len(s)) - 1
    return [
        Finding(
            "reward_drop",
            "error",
            (s.step(a), s.step(len(s) - 1)),
            f"reward/mean fell from {f3(peak)} (mean of steps {s.step(a)}-{s.step(z)}) to {f3(last)} "
            f"(last {b} steps), {f3(drop / se) if se > 0 else 'inf'} standard errors: training became unstable",
            f"lower optim.learning_rate{run.now('optim.learning_rate')}; raise algorithm.beta{run.now('algorithm.beta')}; "
            "look at policy/kl, clip_frac, entropy and grad_norm around the peak; resume from the "
            "checkpoint before the fall",
        )
    ]


def check_zero_std(run: Run) -> list[Finding]:
    s = run.series("reward/zero_std_frac")
    if s is None:
        return []
    if run.conf("algorithm.dynamic_sampling") is True:  # it ran and still could not fill the batch
        sampling = ("dynamic sampling is on but ran out of rounds: raise algorithm.max_sampling_rounds"
                    f"{run.now('algorithm.max_sampling_rounds')}")
    else:
        sampling = "DAPO dynamic sampling drops such groups: algorithm.dynamic_sampling=true (or algorithm.preset=dapo)"
    out = []
    for a, b, sm in _sustained(s, above=ZERO_STD_MAX):
        med = float(np.median(s.values[a : b + 1]))
        out.append(
            Finding(
                "zero_std",
                "error" if med > ZERO_STD_ERROR else "warning",
                _span(s, a, b),
                f"reward/zero_std_frac median {pct(med)} (max {pct(float(s.values[a : b + 1].max()))}): that share of "
                "groups got all-equal rewards, so advantage 0 and no policy gradient (Q15); the prompts are "
                "too easy or too hard for the policy",
                f"raise rollout.num_generations{run.now('rollout.num_generations')} or rollout.temperature"
                f"{run.now('rollout.temperature')}; keep prompts of medium difficulty (filter by the current "
                f"pass rate); {sampling}",
            )
        )
    return out


def check_ratio(run: Run) -> list[Finding]:
    s = run.series("policy/ratio_mean")
    if s is None:
        return []
    return [
        Finding(
            "ratio_mismatch",
            "warning",
            _span(s, a, b),
            f"policy/ratio_mean {f3(float(np.median(sm)))} (should stay near 1: the mean importance ratio over "
            f"sampled tokens is 1 in expectation): the trainer's policy and the sampler's disagree",
            "check that the rollout engine gets the new weights after every optimizer step and computes "
            "log-probs at the same temperature and dtype as the trainer; lower optim.learning_rate"
            f"{run.now('optim.learning_rate')}",
        )
        for a, b, sm in _sustained(s, above=1 + RATIO_TOL, below=1 - RATIO_TOL)
    ]


def check_clip(run: Run) -> list[Finding]:
    s = run.series("policy/clip_frac")
    if s is None:
        return []
    out = []
    for a, b, sm in _sustained(s, above=CLIP_FRAC_MAX):
        med = float(np.median(s.values[a : b + 1]))
        out.append(
            Finding(
                "clip_high",
                "error" if med > CLIP_FRAC_ERROR else "warning",
                _span(s, a, b),
                f"policy/clip_frac median {pct(med)} (max {pct(float(s.values[a : b + 1].max()))}): the update "
                "moves far past the trust region, so most of its gradient is clipped away",
                f"lower optim.learning_rate{run.now('optim.learning_rate')}; fewer optimizer steps per rollout "
                f"batch: algorithm.num_iterations{run.now('algorithm.num_iterations')} or optim.num_minibatches"
                f"{run.now('optim.num_minibatches')} (each later step is further from pi_old)",
            )
        )
    return out


def _beta(run: Run) -> float | None:
    beta = _finite(run.conf("algorithm.beta"))
    return beta


def check_kl_high(run: Run) -> list[Finding]:
    s = run.series("policy/kl")
    beta = _beta(run)
    if s is None or len(s) < MIN_STEPS or beta == 0.0:
        return []
    w = window(len(s))
    sm = rolling_median(s.values, w)
    g = KL_GROWTH_WINDOWS * w
    ref = np.concatenate([np.full(g, np.inf), np.maximum(sm[:-g], KL_GROWTH_FLOOR / KL_GROWTH)])
    growing = (sm >= KL_GROWTH_FLOOR) & (sm >= KL_GROWTH * ref)
    high = sm > KL_MAX
    stretches = runs(growing | high, w, merge_gap=w // 2)
    if not stretches:
        return []
    a, b = stretches[0][0], stretches[-1][1]
    first_grow = np.flatnonzero(growing[a : b + 1])
    if len(first_grow):  # start where the rise began: the last point at a fifth of the first alarm's level
        i0 = a + int(first_grow[0])
        before = np.flatnonzero(sm[: i0 + 1] <= sm[i0] / KL_GROWTH)
        a = int(before[-1]) if len(before) else a
    peak = float(sm[a : b + 1].max())
    what = f"policy/kl rose from {f3(float(sm[a]))} to {f3(peak)} nats/token"
    if high.any():
        what += f" (above {KL_MAX:g})"
    return [
        Finding(
            "kl_high",
            "error" if high.any() else "warning",
            _span(s, a, b),
            what + ": the policy drifts from pi_ref faster than the KL term holds it",
            f"lower optim.learning_rate{run.now('optim.learning_rate')}; raise algorithm.beta{run.now('algorithm.beta')}; "
            "check eval/* over the same steps: if they fall, resume from a checkpoint before the rise",
        )
    ]


def check_kl_zero(run: Run) -> list[Finding]:
    s = run.series("policy/kl")
    beta = _beta(run)
    if s is None or len(s) < MIN_STEPS or beta is None or beta <= 0:
        return []
    w = window(len(s))
    if float(np.max(np.abs(s.values[w:]))) >= KL_ZERO:
        return []
    g = run.series("policy/grad_norm")
    lr = run.series("policy/lr")
    moving = g is not None and float(np.median(g.values)) > 0 and (lr is None or float(np.median(lr.values)) > 0)
    if not moving:
        return []
    return [
        Finding(
            "kl_zero",
            "error",
            (s.step(w), s.step(len(s) - 1)),
            f"policy/kl stayed below {KL_ZERO:g} with algorithm.beta={beta:g} while the policy was updated "
            f"(median policy/grad_norm {f3(float(np.median(g.values)))}): pi_ref moves with pi_theta, so the KL term does nothing",
            "check that pi_ref is a separate frozen copy of the starting weights (not the trained model, not "
            "shared LoRA weights with the adapter on); or set algorithm.beta=0 on purpose",
        )
    ]


def check_entropy(run: Run) -> list[Finding]:
    s = run.series("policy/entropy")
    if s is None or len(s) < MIN_STEPS:
        return []
    start = _start_level(s)
    if start <= 0:
        return []
    return [
        Finding(
            "entropy_collapse",
            "warning",
            _span(s, a, b),
            f"policy/entropy fell from {f3(start)} to {f3(float(np.median(sm)))} ({pct(float(np.median(sm)) / start)} "
            "of its start): the policy stopped exploring; expect eval/pass@k to sink toward eval/pass@1",
            f"raise rollout.temperature{run.now('rollout.temperature')}; clip-higher: algorithm.epsilon_high=0.28"
            f"{run.now('algorithm.epsilon_high')}; lower optim.learning_rate{run.now('optim.learning_rate')}; "
            "check that samples are still diverse within a group",
        )
        for a, b, sm in _sustained(s, below=ENTROPY_COLLAPSE_FRAC * start)
    ]


def check_length(run: Run) -> list[Finding]:
    s = run.series("rollout/completion_len_mean")
    if s is None or len(s) < MIN_STEPS:
        return []
    start = _start_level(s)
    if start <= 0:
        return []
    out = []
    for a, b, sm in _sustained(s, below=LEN_COLLAPSE_FRAC * start):
        out.append(
            Finding(
                "length_collapse",
                "warning",
                _span(s, a, b),
                f"rollout/completion_len_mean fell from {f3(start)} to {f3(float(np.median(sm)))} tokens "
                f"({pct(float(np.median(sm)) / start)} of its start)",
                "read samples.jsonl: short answers that still earn reward mean the reward pays for the form, "
                "not the work (Q25); the grpo loss's 1/|o_i| favors short correct answers: algorithm.loss_type="
                f"dr_grpo or dapo{run.now('algorithm.loss_type')}; lower optim.learning_rate",
            )
        )
    for a, b, sm in _sustained(s, above=LEN_BLOWUP_FACTOR * start):
        out.append(
            Finding(
                "length_blowup",
                "warning",
                _span(s, a, b),
                f"rollout/completion_len_mean grew from {f3(start)} to {f3(float(np.median(sm)))} tokens "
                f"({f3(float(np.median(sm)) / start)}x its start); fine if the answers got better, not if they repeat",
                "read samples.jsonl for repetition; overlong shaping (algorithm.overlong_buffer_frac=0.2, DAPO's "
                "soft punishment, or the overlong reward) and algorithm.mask_truncated_completions=true; algorithm.loss_type=dr_grpo or dapo"
                f"{run.now('algorithm.loss_type')} (the grpo loss's 1/|o_i| penalizes long wrong answers less); raise "
                f"rollout.max_completion_length{run.now('rollout.max_completion_length')} if long answers are right",
            )
        )
    return out


def check_truncation(run: Run) -> list[Finding]:
    s = run.series("rollout/truncated_frac")
    if s is None:
        return []
    out = []
    for a, b, sm in _sustained(s, above=TRUNC_MAX):
        med = float(np.median(s.values[a : b + 1]))
        out.append(
            Finding(
                "truncation",
                "error" if med > TRUNC_ERROR else "warning",
                _span(s, a, b),
                f"rollout/truncated_frac median {pct(med)}: that share of completions hit "
                "max_completion_length without EOS; they usually score 0 and bias the length",
                f"raise rollout.max_completion_length{run.now('rollout.max_completion_length')}; overlong shaping "
                f"(algorithm.overlong_buffer_frac=0.2{run.now('algorithm.overlong_buffer_frac')}, or the overlong reward); "
                "algorithm.mask_truncated_completions=true"
                f"{run.now('algorithm.mask_truncated_completions')}; algorithm.loss_type=dr_grpo or dapo against "
                "the grpo loss's length bias",
            )
        )
    return out


def check_grad_spikes(run: Run) -> list[Finding]:
    s = run.series("policy/grad_norm")
    if s is None or len(s) <= GRAD_MIN_HISTORY:
        return []
    x = s.values
    # A run whose gradient norm routinely swings by x4 needs more than x10 to call a step a spike:
    # the bar is also GRAD_SPIKE_Z of the run's own step-to-step spread in log space.
    logx = np.log(np.maximum(x, 1e-12))
    d = np.diff(logx)
    spread = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2)  # robust: spikes do not count
    bar = max(math.log(GRAD_SPIKE_FACTOR), GRAD_SPIKE_Z * spread)
    padded = np.concatenate([np.full(GRAD_HISTORY, np.nan), x])
    ref = np.nanmedian(np.lib.stride_tricks.sliding_window_view(padded[:-1], GRAD_HISTORY)[GRAD_MIN_HISTORY:], axis=1)
    ratio = x[GRAD_MIN_HISTORY:] / np.where(ref > 0, ref, np.inf)  # ref[j]: median of the steps before j
    spikes = [(GRAD_MIN_HISTORY + int(j), float(ratio[j])) for j in np.flatnonzero(ratio > math.exp(bar))]
    if not spikes:
        return []
    worst = max(spikes, key=lambda t: t[1])
    return [
        Finding(
            "grad_spikes",
            "warning",
            (s.step(spikes[0][0]), s.step(spikes[-1][0])),
            f"{len(spikes)} step(s) with policy/grad_norm > {f3(math.exp(bar))}x the median of the previous "
            f"{GRAD_HISTORY}; largest {f3(worst[1])}x at step {s.step(worst[0])} ({f3(float(x[worst[0]]))})",
            f"lower optim.learning_rate{run.now('optim.learning_rate')}; keep optim.max_grad_norm"
            f"{run.now('optim.max_grad_norm')} at 1 or below; read samples.jsonl at those steps for "
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
    seen: dict[int, list[str]] = {}
    s = run.series("policy/skipped_updates")
    skipped = 0
    if s is not None:
        new = _new_skips(s)
        for i in np.flatnonzero(new > 0):
            seen.setdefault(s.step(int(i)), []).append("skipped updates")
        skipped = int(new[new > 0].sum())
    null_keys: set[str] = set()
    for r in run.rows:
        bad = [k for k in NONFINITE_KEYS if k in r and _finite(r[k]) is None]
        if bad:
            seen.setdefault(_row_step(r), []).extend(bad)
            null_keys.update(bad)
    if not seen:
        return []
    steps = sorted(seen)
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
            f"lower optim.learning_rate{run.now('optim.learning_rate')}; check the reward functions for NaN/inf "
            f"(reward/errors/*); model.dtype=float32{run.now('model.dtype')}; optim.max_grad_norm=1",
        )
    ]


def check_reward_hacking(run: Run) -> list[Finding]:
    e = run.series("eval/pass@1")
    r = run.series("reward/mean")
    if e is None or r is None or len(e) < HACK_MIN_EVALS or len(r) < MIN_STEPS:
        return []
    t0, t1 = e.step(0), e.step(len(e) - 1)
    inside = r.values[(r.steps >= t0) & (r.steps <= t1)]
    w = window(len(r))
    if len(inside) < 2 * w:
        return []
    early, late = float(np.mean(inside[:w])), float(np.mean(inside[-w:]))
    gain = late - early
    se = mean_diff_se(step_noise(r.values), w)
    spread = run.series("reward/std")
    need = max(HACK_Z * se, HACK_TRAIN_GAIN_STD * float(np.median(spread.values)) if spread is not None else 0.0)
    if gain <= need:
        return []
    q = max(1, len(e) // 3)
    e0, e1 = float(np.mean(e.values[:q])), float(np.mean(e.values[-q:]))
    if e1 - e0 >= HACK_EVAL_MIN_GAIN:
        return []
    return [
        Finding(
            "reward_hacking",
            "error" if e1 - e0 <= -HACK_EVAL_DROP else "warning",
            (t0, t1),
            f"training reward/mean rose {f3(early)} -> {f3(late)} while eval/pass@1 went {f3(e0)} -> {f3(e1)} "
            f"({len(e)} evaluations): the policy learns what the reward pays for, not the task (Q25)",
            "read samples.jsonl at the late steps: does high-reward text solve the task? tighten the "
            "verifier (strict answer extraction, one answer only); add format or other rewards; check "
            "the reward's parts (reward/<fn>) and evaluate on unseen tasks (Q26)",
        )
    ]


@dataclass(frozen=True)
class Check:
    fn: Callable[[Run], list[Finding]]
    needs: tuple[str, ...]  # metrics it reads (all must be logged for it to run)
    seed: str  # the seed question it comes from


#: name -> check, in the seed's order of debugging (Q24), then Q25.
CHECKS: dict[str, Check] = {
    "reward_none": Check(check_reward_none, ("reward/none_frac",), "Q24"),
    "reward_flat": Check(check_reward_flat, ("reward/mean",), "Q24, Q26"),
    "reward_drop": Check(check_reward_drop, ("reward/mean",), "Q24"),
    "zero_std": Check(check_zero_std, ("reward/zero_std_frac",), "Q15, Q24"),
    "ratio_mismatch": Check(check_ratio, ("policy/ratio_mean",), "Q24"),
    "clip_high": Check(check_clip, ("policy/clip_frac",), "Q10, Q18, Q24"),
    "kl_high": Check(check_kl_high, ("policy/kl",), "Q12, Q23, Q24"),
    "kl_zero": Check(check_kl_zero, ("policy/kl", "policy/grad_norm"), "Q12, Q13, Q24"),
    "entropy_collapse": Check(check_entropy, ("policy/entropy",), "Q24"),
    "length": Check(check_length, ("rollout/completion_len_mean",), "Q24"),
    "truncation": Check(check_truncation, ("rollout/truncated_frac",), "Q24"),
    "grad_spikes": Check(check_grad_spikes, ("policy/grad_norm",), "Q24"),
    "nonfinite": Check(check_nonfinite, (), "Q24"),
    "reward_hacking": Check(check_reward_hacking, ("reward/mean", "eval/pass@1"), "Q25, Q26"),
}


def diagnose(rows: list[dict], config: dict | None = None) -> list[Finding]:
    """Every finding of every check on a run's metrics rows (as read from metrics.jsonl), in CHECKS order.
    config is the run's config as a nested dict (config.yaml), or None; it sharpens some checks
    (the KL checks run only when algorithm.beta > 0) and fills the fixes with the current values."""
    run = Run(rows, config)
    return [f for check in CHECKS.values() for f in check.fn(run)]


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
    Returns 0 when no check fires, 1 when some do, 2 (after one line on stderr) when there is no readable run."""
    from grpokit.plots import read_metrics

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
    run = Run(rows)
    if not run.rows:
        return _error(f"{metrics} has no metric lines (a line needs a numeric \"step\")")
    config = _load_config(metrics.parent / CONFIG_FILE)
    findings = diagnose(run.rows, config)
    _print_report(run, config, findings, str(run_dir))
    return 1 if findings else 0


def _print_report(run: Run, config: dict | None, findings: list[Finding], name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    steps = sorted({_row_step(r) for r in run.rows})
    console.print(
        f"[bold]grpokit doctor[/bold] {name}: {len(steps)} logged steps ({steps[0]}-{steps[-1]}), "
        f"config {'read' if config else 'not found (config-aware checks skipped)'}"
    )
    if len(steps) < MIN_STEPS:
        console.print(f"only {len(steps)} logged steps: most checks need {MIN_STEPS} or more, so little can be judged yet")
    skipped = [n for n, c in CHECKS.items() if not all(run.has(k) for k in c.needs)]
    if skipped:
        console.print(f"not checked (metrics not logged): {', '.join(skipped)}")
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
        table.add_row(f"[{color}]{f.check}[/{color}]\n{f.severity}", f"{f.steps[0]}-{f.steps[1]}", f.message, f.fix)
    console.print(table)
    n_err = sum(f.severity == "error" for f in findings)
    console.print(f"{len(findings)} finding(s): {n_err} error(s), {len(findings) - n_err} warning(s)")
