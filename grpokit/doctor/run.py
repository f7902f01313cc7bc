"""The run as the checks read it: its metric rows and config, one metric's finite values by step on demand
(Series), and what a check reports (Finding)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from grpokit.metrics.compute import (
    record_step,
)
from grpokit.values import finite_number

CONFIG_FILE = "config.yaml"


@dataclass(frozen=True)
class Finding:
    """One problem: which check, how bad, over which logged steps, what was seen, what to do."""

    check: str
    severity: Literal["warning", "error"]
    steps: tuple[int, int]  # first and last step (inclusive) where it was seen
    message: str
    fix: str


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


def row_step(row: dict) -> int:
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
                    by_step[row_step(r)] = x  # a later line for the same step wins
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
