"""Robust statistics the checks share: window sizes, rolling medians, step-to-step noise, standard errors of
block means and slopes, sustained stretches, and how numbers are written in a finding."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from grpokit.doctor.run import Series
from grpokit.doctor.thresholds import FLAT_BLOCKS, MAX_WINDOW, MIN_STEPS, MIN_WINDOW, WINDOW_DIVISOR


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


def sustained(s: Series, above: float | None = None, below: float | None = None) -> list[Stretch]:
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


def start_level(s: Series) -> float:
    """Median of the first window of a series: its level before training changed it."""
    return float(np.median(s.values[: window(len(s))]))


def blocks(x: np.ndarray, min_block: int = MIN_WINDOW) -> tuple[int, np.ndarray]:
    """Block size b (n / FLAT_BLOCKS, at least min_block) and the means of consecutive blocks of b points (the
    last block is the last b points)."""
    b = max(min_block, len(x) // FLAT_BLOCKS)
    means = [np.mean(x[i : i + b]) for i in range(0, len(x) - b + 1, b)]
    if len(x) % b:
        means.append(np.mean(x[-b:]))
    return b, np.array(means)


def rounded(x: float) -> str:
    """A number with 3 significant digits."""
    return f"{x:.3g}"


def percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"
