"""The terminal side of a training run: the progress display and the table of sample completions.

    with TrainProgress(total_steps, start_step=resumed_step) as prog:
        for step in range(resumed_step + 1, total_steps + 1):
            metrics = ...                          # {"reward/mean": 0.4, "policy/kl": 0.002, ...}
            prog.update(step, metrics)             # a live bar on a terminal, a compact line elsewhere
            prog.print("checkpoint saved")         # above the bar
    print_samples(step, [{"prompt": "2+3=", "completion": "5", "reward": 1.0}])

Output goes to whatever sys.stdout is at print time (rich, imported on first use).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from grpokit.metrics.compute import (
    EVAL_PASS_AT_1,
    POLICY_KL,
    REWARD_MEAN,
    REWARD_PREFIX,
    as_number,
    reward_fn,
)
from grpokit.values import shorten

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

DEFAULT_PROGRESS_KEYS = (REWARD_MEAN, POLICY_KL, EVAL_PASS_AT_1)


def _console():
    from rich.console import Console

    return Console()  # no file given: writes to whatever sys.stdout is at print time


def _fmt(value: Any) -> str:
    x = as_number(value)
    if x is None:
        return "-" if value is None else str(value)
    if math.isfinite(x) and x == int(x) and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.4g}"  # nan, inf and everything else


def print_samples(step: int, samples: Sequence[Mapping[str, Any]], *, width: int = 300) -> None:
    """A small rich table of sample completions: prompt (its end), completion, reward, per-function
    rewards."""
    from rich.table import Table
    from rich.text import Text  # model output is not rich markup: "[/b]" or "[1, 2]" must print as is

    extra: list[str] = []
    for s in samples:
        for k in s:
            if k.startswith(REWARD_PREFIX) and k not in extra:
                extra.append(k)
        for k in s.get("rewards") or {}:
            if reward_fn(k) not in extra:
                extra.append(reward_fn(k))

    table = Table(title=f"samples at step {step}", show_lines=True)
    table.add_column("prompt", overflow="fold", ratio=2)
    table.add_column("completion", overflow="fold", ratio=3)
    table.add_column("reward", justify="right")
    for name in extra:
        table.add_column(name.removeprefix(REWARD_PREFIX), justify="right")
    for s in samples:
        prompt = s.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1], Mapping):
            prompt = prompt[-1].get("content", "")  # chat messages: the last one is the question
        prompt = str(prompt)
        prompt = prompt if len(prompt) <= width else "…" + prompt[-(width - 1) :]  # the end is the question
        per_fn = s.get("rewards") or {}
        cells = [s.get(k, per_fn.get(k.removeprefix(REWARD_PREFIX))) for k in extra]
        table.add_row(
            Text(prompt),
            Text(shorten(s.get("completion", ""), width)),
            _fmt(s.get("reward")),
            *(_fmt(c) for c in cells),
        )
    _console().print(table)


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class TrainProgress:
    """Progress of a run: step/total, elapsed, ETA and the latest values of a few metrics.

    On a terminal, a live rich progress bar (prog.print writes above it). Elsewhere (CI logs, a pipe,
    a notebook's captured output) one compact line every `every` steps, and at the last step:

        step 40/200 (20%) | elapsed 0:01:12 | eta 0:04:48 | reward/mean 0.4125 | policy/kl 0.0031

    step is the number of steps done (the step just finished, counted from 1); start_step is where a
    resumed run starts, so the ETA uses only this process's pace. A key absent from a step's metrics
    keeps its last value (eval/* appear only every eval.every steps).
    live None detects a terminal; every None is about a twentieth of the run.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        keys: Iterable[str] = DEFAULT_PROGRESS_KEYS,
        *,
        every: int | None = None,
        live: bool | None = None,
        console=None,
    ) -> None:
        self.total_steps = int(total_steps)
        self.start_step = int(start_step)
        self.keys = tuple(keys)
        remaining = max(self.total_steps - self.start_step, 1)
        self.every = max(1, int(every) if every is not None else remaining // 20)
        self._console = console
        if live is None:
            c = console or _console()
            live = c.is_terminal and not c.is_dumb_terminal
        self.live = bool(live)
        self.latest: dict[str, Any] = {}
        self.step = self.start_step
        self._t0: float | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._last_printed: int | None = None

    # -- the text ---------------------------------------------------------------------------

    def _metrics_text(self) -> str:
        return " | ".join(f"{k} {_fmt(self.latest[k])}" for k in self.keys if k in self.latest)

    def _elapsed(self) -> float:
        return 0.0 if self._t0 is None else time.monotonic() - self._t0

    def eta(self) -> float:
        """Seconds left at this process's pace so far (inf before the first step is done)."""
        done = self.step - self.start_step
        if done <= 0:
            return math.inf
        return self._elapsed() / done * max(self.total_steps - self.step, 0)

    def line(self) -> str:
        percent = 100.0 * self.step / self.total_steps if self.total_steps > 0 else 100.0
        parts = [
            f"step {self.step}/{self.total_steps} ({percent:.0f}%)",
            f"elapsed {_hms(self._elapsed())}",
            f"eta {_hms(self.eta())}",
        ]
        metrics = self._metrics_text()
        return " | ".join(parts + ([metrics] if metrics else []))

    # -- the display ------------------------------------------------------------------------

    def __enter__(self) -> TrainProgress:
        self._t0 = time.monotonic()
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
                console=self._console or _console(),
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=self.total_steps, completed=self.start_step, metrics=""
            )
        return self

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        if self._t0 is None:  # used without `with`
            self.__enter__()
        self.step = int(step)
        for k in self.keys:
            if metrics and k in metrics and metrics[k] is not None:
                self.latest[k] = metrics[k]
        if self._progress is not None:
            assert self._task is not None  # added when the bar started
            self._progress.update(
                self._task, completed=min(self.step, self.total_steps), metrics=self._metrics_text()
            )
            return
        done = self.step - self.start_step
        if self._last_printed is None or done % self.every == 0 or self.step >= self.total_steps:
            self._emit(self.line())
            self._last_printed = self.step

    def print(self, msg: Any) -> None:
        """Print a message above the progress bar: a string as plain text (no rich markup, so model
        output prints as is), or any rich renderable (a Table)."""
        if isinstance(msg, str):
            self._emit(msg)
        else:
            (self._progress.console if self._progress is not None else self._console or _console()).print(msg)

    def _emit(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        elif self._console is not None:
            self._console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        elif not self.live and self._last_printed is not None and self._last_printed != self.step:
            self._emit(self.line())  # the last step done, when it fell between two lines
            self._last_printed = self.step

    def __exit__(self, *exc) -> None:
        self.close()
