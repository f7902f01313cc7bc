"""Metric sinks and the terminal progress display of a training run.

    log = MetricLogger("runs/x", config=cfg.model_dump())  # JSONL always; TensorBoard when installed
    log.truncate_after(resumed_step)                       # on resume: forget steps that will be redone
    with TrainProgress(total_steps, start_step=resumed_step) as prog:
        for step in range(resumed_step + 1, total_steps + 1):
            metrics = ...                                  # {"reward/mean": 0.4, "policy/kl": 0.002, ...}
            log.log(step, metrics)
            prog.update(step, metrics)
    log.close()

Every metric name is defined in docs/metrics.md. Only the main process should hold a MetricLogger
(the JSONL files are appended to without locking).

This module is `grpokit.logging`; the package uses absolute imports, so `import logging` here and in
every other grpokit module is the standard library's module.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging as pylogging  # the standard library's, not this module (absolute imports)
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

_log = pylogging.getLogger("grpokit")

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
DEFAULT_PROGRESS_KEYS = ("reward/mean", "policy/kl", "eval/pass@1")


# ---------------------------------------------------------------------------------------------
# JSON values


def _plain(value: Any) -> Any:
    """A JSON-safe copy of a metric or sample value: tensors and numpy scalars become Python numbers,
    non-finite floats become None (JSON has no NaN; `json.loads` of our files must work everywhere)."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and len(getattr(value, "shape", (1,))) == 0:
        return _plain(value.item())  # numpy scalar or 0-d tensor (for a CUDA tensor: a device sync)
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    return str(value)


def _number(value: Any) -> float | None:
    """A metric as a float for the scalar sinks (NaN kept: a NaN loss should show as one), or None."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _json_line(record: Mapping[str, Any]) -> str:
    return json.dumps(_plain(record), allow_nan=False, ensure_ascii=False) + "\n"


def _append(path: Path, text: str) -> None:
    # Open, write, close per call: each line reaches the OS at once (a crash loses at most the line
    # being written) and truncate_after can replace the file without a stale handle.
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def _line_step(line: str) -> int | float | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _truncate_jsonl(path: Path, step: int) -> int:
    """Keep the lines of `path` whose "step" is <= step; rewrite atomically. Returns lines dropped.

    Lines that do not parse (a line cut short by a crash) are dropped too."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            s = _line_step(line)
            if s is not None and s <= step and line.endswith("\n"):
                kept.append(line)
            elif line.strip():
                dropped += 1
    if dropped == 0:
        return 0
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dropped


# ---------------------------------------------------------------------------------------------
# Optional sinks


def _missing(package: str, extra: str) -> ImportError:
    return ImportError(f"{package} logging is enabled but {package} is not installed: pip install 'grpokit[{extra}]'")


def _tensorboard_error() -> Exception | None:
    """Why torch.utils.tensorboard cannot write event files, or None when it can (~1 s the first time)."""
    if importlib.util.find_spec("tensorboard") is None:
        return ModuleNotFoundError("No module named 'tensorboard'")
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception as e:  # a broken install (e.g. a protobuf clash) is "not available", not a crash
        return e
    return None


def tensorboard_available() -> bool:
    return _tensorboard_error() is None


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _mlflow_name(name: str) -> str:
    # MLflow accepts only [A-Za-z0-9_ ./:-] in metric names: eval/pass@1 -> eval/pass_at_1.
    name = name.replace("@", "_at_")
    return "".join(c if c.isalnum() or c in "_-./: " else "_" for c in name)


def _table_cell(value: Any) -> Any:
    value = _plain(value)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else value


# ---------------------------------------------------------------------------------------------
# MetricLogger


class MetricLogger:
    """Writes each step's metrics to out_dir/metrics.jsonl and to the enabled sinks.

    out_dir/metrics.jsonl  one line per log() call: {"step": int, "time": unix seconds, **metrics};
                           non-finite values are written as null. Always on.
    out_dir/samples.jsonl  one line per sample completion: {"step": int, **sample}.
    out_dir/tensorboard/   TensorBoard scalars; tensorboard=None uses it when tensorboard is installed.
    wandb, mlflow          off by default; imported only when enabled (pip install 'grpokit[wandb]').
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        tensorboard: bool | None = None,
        wandb: bool = False,
        mlflow: bool = False,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / METRICS_FILE
        self.samples_path = self.out_dir / SAMPLES_FILE
        self.run_name = run_name or self.out_dir.resolve().name
        self.config = dict(config) if config is not None else None
        self._closed = False

        if tensorboard is None or tensorboard:
            error = _tensorboard_error()
            if tensorboard and error is not None:
                raise _missing("tensorboard", "tensorboard") from error
            tensorboard = error is None
        self.tensorboard = bool(tensorboard)
        # The writer is opened on first use, so that truncate_after() on resume can tell it which
        # steps to purge from the previous run's event files.
        self._tb = None
        self._tb_purge_step: int | None = None

        self._wandb = None
        if wandb:
            try:
                self._wandb = importlib.import_module("wandb")
            except ImportError as e:
                raise _missing("wandb", "wandb") from e
            self._wandb.init(
                project=os.environ.get("WANDB_PROJECT", "grpokit"),
                name=self.run_name,
                config=_plain(self.config) if self.config else None,
                dir=str(self.out_dir),
            )

        self._mlflow = None
        if mlflow:
            try:
                self._mlflow = importlib.import_module("mlflow")
            except ImportError as e:
                raise _missing("mlflow", "mlflow") from e
            self._mlflow.start_run(run_name=self.run_name)
            if self.config:
                # MLflow caps a parameter value at 500 characters.
                params = {k: str(v)[:500] for k, v in _flatten(self.config).items()}
                self._mlflow.log_params(params)

    # -- the sinks --------------------------------------------------------------------------

    def _writer(self):
        if self._tb is None and self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: ~1 s, so only here

            self._tb = SummaryWriter(log_dir=str(self.out_dir / TENSORBOARD_DIR), purge_step=self._tb_purge_step)
            if self.config and self._tb_purge_step is None:
                text = json.dumps(_plain(self.config), indent=2, default=str)
                self._tb.add_text("config", "```\n" + text + "\n```", global_step=0)
        return self._tb

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append {"step", "time", **metrics} to metrics.jsonl (flushed) and send the scalars to the sinks."""
        self._check_open()
        reserved = {"step", "time"} & set(metrics)
        if reserved:
            raise ValueError(f"metric names {sorted(reserved)} are reserved for the record's own fields")
        step = int(step)
        _append(self.metrics_path, _json_line({"step": step, "time": time.time(), **metrics}))

        scalars = {k: v for k, v in ((k, _number(v)) for k, v in metrics.items()) if v is not None}
        writer = self._writer()
        if writer is not None:
            for name, value in scalars.items():
                writer.add_scalar(name, value, global_step=step)
            writer.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._mlflow is not None:
            finite = {_mlflow_name(k): v for k, v in scalars.items() if math.isfinite(v)}
            self._mlflow.log_metrics(finite, step=step)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]], *, show: int = 4) -> None:
        """Append one line per sample to samples.jsonl and print the first `show` as a table.

        A sample holds prompt, completion, reward (float) and optionally more: per-function rewards
        (as "reward/<fn>" keys or a "rewards" dict), the answer, the finish reason.
        """
        self._check_open()
        step = int(step)
        if samples:
            _append(self.samples_path, "".join(_json_line({"step": step, **s}) for s in samples))
        if show > 0 and samples:
            print_samples(step, samples[:show])
        if self._wandb is not None and samples:
            columns = sorted({k for s in samples for k in s})
            rows = [[_table_cell(s.get(c)) for c in columns] for s in samples]
            self._wandb.log({"samples": self._wandb.Table(columns=columns, data=rows)}, step=step)

    def truncate_after(self, step: int) -> None:
        """On resume from a checkpoint at `step`: drop every record with a larger step, so that the
        steps the resumed run redoes are not in the files twice. TensorBoard purges them too."""
        self._check_open()
        for path in (self.metrics_path, self.samples_path):
            dropped = _truncate_jsonl(path, int(step))
            if dropped:
                _log.info("resume: dropped %d line(s) after step %d from %s", dropped, step, path)
        self._tb_purge_step = int(step) + 1
        if self._tb is not None:  # already open: reopen so the purge applies
            self._tb.close()
            self._tb = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricLogger is closed")

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Console output


def _console():
    from rich.console import Console

    return Console()  # no file given: writes to whatever sys.stdout is at print time


def _fmt(value: Any) -> str:
    x = _number(value)
    if x is None:
        return "-" if value is None else str(value)
    if math.isfinite(x) and x == int(x) and abs(x) < 1e6:
        return str(int(x))
    return f"{x:.4g}"  # nan, inf and everything else


def _clip_text(text: Any, limit: int) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def print_samples(step: int, samples: Sequence[Mapping[str, Any]], *, width: int = 300) -> None:
    """A small rich table of sample completions: prompt (its end), completion, reward, per-function rewards."""
    from rich.table import Table
    from rich.text import Text  # model output is not rich markup: "[/b]" or "[1, 2]" must print as is

    extra: list[str] = []
    for s in samples:
        for k in s:
            if k.startswith("reward/") and k not in extra:
                extra.append(k)
        for k in s.get("rewards") or {}:
            if f"reward/{k}" not in extra:
                extra.append(f"reward/{k}")

    table = Table(title=f"samples at step {step}", show_lines=True)
    table.add_column("prompt", overflow="fold", ratio=2)
    table.add_column("completion", overflow="fold", ratio=3)
    table.add_column("reward", justify="right")
    for name in extra:
        table.add_column(name.removeprefix("reward/"), justify="right")
    for s in samples:
        prompt = s.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1], Mapping):
            prompt = prompt[-1].get("content", "")  # chat messages: the last one is the question
        prompt = str(prompt)
        prompt = prompt if len(prompt) <= width else "…" + prompt[-(width - 1):]  # the end is the question
        per_fn = s.get("rewards") or {}
        cells = [s.get(k, per_fn.get(k.removeprefix("reward/"))) for k in extra]
        table.add_row(
            Text(prompt),
            Text(_clip_text(s.get("completion", ""), width)),
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
        self._progress = None
        self._task = None
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
        pct = 100.0 * self.step / self.total_steps if self.total_steps > 0 else 100.0
        parts = [
            f"step {self.step}/{self.total_steps} ({pct:.0f}%)",
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
            self._task = self._progress.add_task("train", total=self.total_steps, completed=self.start_step, metrics="")
        return self

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        if self._t0 is None:  # used without `with`
            self.__enter__()
        self.step = int(step)
        for k in self.keys:
            if metrics and k in metrics and metrics[k] is not None:
                self.latest[k] = metrics[k]
        if self._progress is not None:
            self._progress.update(self._task, completed=min(self.step, self.total_steps), metrics=self._metrics_text())
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
