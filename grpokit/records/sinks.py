"""Metric sinks of a training run: metrics.jsonl and samples.jsonl always, TensorBoard when
installed, Weights & Biases, MLflow and trackio when asked for (their classes: trackers.py).

    log = MetricLogger("runs/x", config=cfg.model_dump())  # JSONL always; TensorBoard when installed
    log.truncate_after(resumed_step)                       # on resume: forget steps that will be redone
    log.log(step, {"reward/mean": 0.4, "policy/kl": 0.002})
    log.log_samples(step, [{"prompt": ..., "completion": ..., "reward": 1.0}])
    log.close()

Every metric name is defined in docs/metrics.md and grpokit/metrics/compute.py. Only the main process should
hold a MetricLogger (the JSONL files are appended to without locking).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpokit.metrics.compute import (
    METRICS_FILE,
    RECORD_FIELDS,
    SAMPLES_FILE,
    STEP,
    TIME,
    as_number,
    parse_record,
    record_step,
)
from grpokit.records.progress import print_samples
from grpokit.records.trackers import RUN_INFO, TRACKERS, Tracker, run_info, tensorboard_error

_log = logging.getLogger("grpokit")


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


def _json_line(record: Mapping[str, Any]) -> str:
    return json.dumps(_plain(record), allow_nan=False, ensure_ascii=False) + "\n"


def _append(path: Path, text: str) -> None:
    # Open, write, close per call: each line reaches the OS at once (a crash loses at most the line
    # being written) and truncate_after can replace the file without a stale handle. Whole lines or
    # nothing: a write that fails part way (a full disk: ENOSPC after a short write) is cut back to the
    # file's previous end before the error goes on, so no line is ever left half-written.
    data = text.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        end = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def _truncate_jsonl(path: Path, step: int) -> int:
    """Keep the lines of `path` whose "step" is <= step; rewrite atomically. Returns lines dropped.

    Lines that do not parse (a line cut short by a crash), lack a newline or have no numeric step
    are dropped too."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = parse_record(line)
            line_step = record_step(record) if record is not None else None
            if line_step is not None and line_step <= step and line.endswith("\n"):
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
# MetricLogger


class MetricLogger:
    """Writes each step's metrics to out_dir/metrics.jsonl and to the enabled sinks.

    out_dir/metrics.jsonl  one line per log() call: {"step": int, "time": unix seconds, **metrics};
                           non-finite values are written as null. Always on.
    out_dir/samples.jsonl  one line per sample completion: {"step": int, **sample}.
    out_dir/tensorboard/   TensorBoard scalars; tensorboard=None uses it when tensorboard is installed.
    wandb, mlflow, trackio off by default; imported only when enabled (pip install 'grpokit[wandb]').
                           Each tracker run records the config and run_info (versions, git commit).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        tensorboard: bool | None = None,
        wandb: bool = False,
        mlflow: bool = False,
        trackio: bool = False,
        run_name: str | None = None,
        project: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / METRICS_FILE
        self.samples_path = self.out_dir / SAMPLES_FILE
        self.run_name = run_name or self.out_dir.resolve().name
        self.config = dict(config) if config is not None else None
        self._closed = False

        if tensorboard is None:
            tensorboard = tensorboard_error() is None
        self.tensorboard = bool(tensorboard)
        enabled = {"tensorboard": self.tensorboard, "wandb": wandb, "mlflow": mlflow, "trackio": trackio}
        self.run_info = run_info() if any(enabled.values()) else {}
        record = _plain({**(self.config or {}), RUN_INFO: self.run_info})
        self._trackers: list[Tracker] = []
        try:
            for key, on in enabled.items():
                if on:
                    self._trackers.append(TRACKERS[key](self.out_dir, self.run_name, project, record))
        except BaseException:
            self._close_trackers()  # the ones already open: a failed start leaves no run half-open
            raise

    # -- the sinks --------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append {"step", "time", **metrics} to metrics.jsonl (flushed) and send the scalars to the sinks."""
        self._check_open()
        reserved = set(RECORD_FIELDS) & set(metrics)
        if reserved:
            raise ValueError(f"metric names {sorted(reserved)} are reserved for the record's own fields")
        step = int(step)
        _append(self.metrics_path, _json_line({STEP: step, TIME: time.time(), **metrics}))

        scalars = {k: v for k, v in ((k, as_number(v)) for k, v in metrics.items()) if v is not None}
        for tracker in self._trackers:
            tracker.log(step, scalars)

    def log_step(
        self,
        step: int,
        metrics: Mapping[str, Any],
        samples: Sequence[Mapping[str, Any]],
        *,
        last: bool,
        every: int,
        samples_every: int,
    ) -> None:
        """A training step's metrics every `every` steps and at the `last` one; its samples every
        `samples_every` steps and at the `last` one (0: never), so a run shorter than `samples_every` still
        has completions to show."""
        if step % every == 0 or last:
            self.log(step, metrics)
        if samples_every and (step % samples_every == 0 or last) and samples:
            self.log_samples(step, samples)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]], *, show: int = 4) -> None:
        """Append one line per sample to samples.jsonl and print the first `show` as a table.

        A sample holds prompt, completion, reward (float) and optionally more: per-function rewards
        (as "reward/<fn>" keys or a "rewards" dict), the answer, the finish reason. The same rows go to
        completions.parquet (records/table.py); the table printed shows the first sample of each "group".
        """
        from grpokit.records.table import append_step, first_of_each_group

        self._check_open()
        step = int(step)
        if samples:
            _append(self.samples_path, "".join(_json_line({STEP: step, **s}) for s in samples))
            append_step(self.out_dir, step, samples)
        if show > 0 and samples:
            print_samples(step, first_of_each_group(samples)[:show])
        if samples:
            plain = _plain(list(samples))
            for tracker in self._trackers:
                tracker.log_samples(step, plain)

    def truncate_after(self, step: int) -> None:
        """On resume from a checkpoint at `step`: drop every record with a larger step, so that the
        steps the resumed run redoes are not in the files twice. TensorBoard purges them too."""
        self._check_open()
        for path in (self.metrics_path, self.samples_path):
            dropped = _truncate_jsonl(path, int(step))
            if dropped:
                _log.info("resume: dropped %d line(s) after step %d from %s", dropped, step, path)
        for tracker in self._trackers:
            tracker.truncate_after(int(step))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_trackers()

    def _close_trackers(self) -> None:
        trackers, self._trackers = self._trackers, []
        errors = []
        for tracker in trackers:  # every one gets closed even when one fails
            try:
                tracker.close()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricLogger is closed")

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
