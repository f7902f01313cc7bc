"""Metric sinks of a training run: metrics.jsonl and samples.jsonl always, TensorBoard when
installed, Weights & Biases and MLflow when asked for.

    log = MetricLogger("runs/x", config=cfg.model_dump())  # JSONL always; TensorBoard when installed
    log.truncate_after(resumed_step)                       # on resume: forget steps that will be redone
    log.log(step, {"reward/mean": 0.4, "policy/kl": 0.002})
    log.log_samples(step, [{"prompt": ..., "completion": ..., "reward": 1.0}])
    log.close()

Every metric name is defined in docs/metrics.md and grpokit/metrics.py. Only the main process should
hold a MetricLogger (the JSONL files are appended to without locking).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from grpokit.metrics import METRICS_FILE, RECORD_FIELDS, SAMPLES_FILE, STEP, TIME, as_number, parse_record, record_step
from grpokit.records.progress import print_samples

_log = logging.getLogger("grpokit")

TENSORBOARD_DIR = "tensorboard"


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
    # being written) and truncate_after can replace the file without a stale handle.
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


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
        reserved = set(RECORD_FIELDS) & set(metrics)
        if reserved:
            raise ValueError(f"metric names {sorted(reserved)} are reserved for the record's own fields")
        step = int(step)
        _append(self.metrics_path, _json_line({STEP: step, TIME: time.time(), **metrics}))

        scalars = {k: v for k, v in ((k, as_number(v)) for k, v in metrics.items()) if v is not None}
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
