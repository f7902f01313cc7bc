"""Checks of the optimizer: gradient-norm spikes, non-finite values and skipped updates."""

from __future__ import annotations

import math

import numpy as np

from grpokit.doctor.run import Finding, Run, Series, row_step
from grpokit.doctor.stats import rounded
from grpokit.doctor.thresholds import (
    GRAD_HISTORY,
    GRAD_MIN_HISTORY,
    GRAD_SPIKE_FACTOR,
    GRAD_SPIKE_Z,
    NONFINITE_KEYS,
)
from grpokit.metrics.compute import (
    POLICY_GRAD_NORM,
    POLICY_SKIPPED_UPDATES,
)
from grpokit.values import finite_number


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
            f"{len(spikes)} step(s) with policy/grad_norm > {rounded(math.exp(log_bar))}x the median of the "
            f"previous {GRAD_HISTORY}; largest {rounded(worst_ratio)}x at step {grad_norm.step(worst)} "
            f"({rounded(float(norms[worst]))})",
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
            problems_at.setdefault(row_step(r), []).extend(bad)
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
