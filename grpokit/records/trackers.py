"""External experiment trackers of a run: TensorBoard, Weights & Biases, MLflow, trackio.

MetricLogger (sinks.py) opens the ones the config turns on (`logging.tensorboard`, `logging.wandb`,
`logging.mlflow`, `logging.trackio`) and hands each the same scalars. One class per tracker, behind
one small interface:

    tracker = TRACKERS["mlflow"](out_dir, run_name, project, record)  # opens its run; record = config +
                                                                      # run_info
    tracker.log(step, {"reward/mean": 0.4})                   # finite or not; each tracker decides
    tracker.log_samples(step, samples)                        # where the tracker has tables (W&B)
    tracker.truncate_after(step)                              # on resume (TensorBoard purges)
    tracker.close()

Every tracker run records the resolved config and `run_info` (run_info(): the versions of grpokit,
torch and transformers, and the git commit of the working directory when it is in a repository).
Where each one's data lands and how to read it back: docs/metrics.md, "Trackers".
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from grpokit.config import ConfigError

TENSORBOARD_DIR = "tensorboard"
RUN_INFO = "run_info"
# W&B project, MLflow experiment and trackio project when neither logging.project nor an env var names one
PROJECT = "grpokit"


class TrackerNotInstalled(ConfigError, ImportError):
    """logging.<tracker>=true, but its package is missing (a user mistake: one line, exit 2)."""


def not_installed(key: str) -> TrackerNotInstalled:
    return TrackerNotInstalled(
        f"logging.{key}=true but {key} is not installed; pip install 'grpokit[{key}]' "
        f"or set logging.{key}=false"
    )


# ---------------------------------------------------------------------------------------------
# What every tracker run records besides the config


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):  # no git on PATH, or a hung filesystem
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_info() -> dict[str, Any]:
    """The versions of grpokit, torch and transformers, and the git commit of the working directory
    (with git_dirty: whether tracked files differ from it); no git keys outside a repository."""
    info: dict[str, Any] = {
        "grpokit_version": _version("grpokit"),  # the installed distribution's (pyproject.toml), as for torch
        "torch_version": _version("torch"),
        "transformers_version": _version("transformers"),
    }
    commit = _git("rev-parse", "HEAD")
    if commit:
        info["git_commit"] = commit
        info["git_dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return info


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _table_cell(value: Any) -> Any:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else value


# ---------------------------------------------------------------------------------------------
# The interface


class Tracker(ABC):
    """One external tracker's run. __init__ opens it in `project` (None: the tracker's env var, else
    grpokit) and stores `record` (the config + run_info); `record` and the samples are JSON-safe
    already (MetricLogger converts them)."""

    key: ClassVar[str]  # the logging.<key> switch and the pip extra grpokit[<key>]

    @abstractmethod
    def __init__(
        self, out_dir: Path, run_name: str, project: str | None, record: Mapping[str, Any]
    ) -> None: ...

    @abstractmethod
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:  # noqa: B027 (optional: a no-op by default)
        """Only W&B shows tables of samples; the others keep scalars (samples.jsonl has them all)."""

    def truncate_after(self, step: int) -> None:  # noqa: B027 (optional: a no-op by default)
        """Resume from `step`: a tracker that appends to the previous run's store forgets later steps.
        W&B, MLflow and trackio start a new run of the same name instead."""

    @abstractmethod
    def close(self) -> None: ...


def _import(key: str, module: str | None = None) -> Any:
    try:
        return importlib.import_module(module or key)
    except ImportError as e:
        raise not_installed(key) from e


# ---------------------------------------------------------------------------------------------
# TensorBoard: OUT/tensorboard/events.out.tfevents.*


def tensorboard_error() -> Exception | None:
    """Why torch.utils.tensorboard cannot write event files, or None when it can (~1 s the first time)."""
    if importlib.util.find_spec("tensorboard") is None:
        return ModuleNotFoundError("No module named 'tensorboard'")
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401 (only whether it imports)
    except Exception as e:  # a broken install (e.g. a protobuf clash) is "not available", not a crash
        return e
    return None


def tensorboard_available() -> bool:
    return tensorboard_error() is None


class TensorBoardTracker(Tracker):
    """Scalars under their own names; the config and run_info as text at the first step written."""

    key = "tensorboard"

    def __init__(self, out_dir: Path, run_name: str, project: str | None, record: Mapping[str, Any]) -> None:
        error = tensorboard_error()
        if error is not None:
            raise not_installed(self.key) from error
        self.log_dir = Path(out_dir) / TENSORBOARD_DIR
        self.record = dict(record)
        # The writer opens on first use, so that truncate_after() on resume can tell it which of the
        # previous run's steps to purge from the event files.
        self._writer = None
        self._purge_step: int | None = None

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: ~1 s, so only here

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
            config = {k: v for k, v in self.record.items() if k != RUN_INFO}
            first = self._purge_step or 0
            if config:
                self._writer.add_text("config", _markdown_json(config), global_step=first)
            self._writer.add_text(RUN_INFO, _markdown_json(self.record.get(RUN_INFO, {})), global_step=first)
        return self._writer

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        writer = self._open()
        for name, value in scalars.items():
            writer.add_scalar(name, value, global_step=step)
        writer.flush()

    def truncate_after(self, step: int) -> None:
        self._purge_step = int(step) + 1
        if self._writer is not None:  # already open: reopen so the purge applies
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _markdown_json(value: Any) -> str:
    return "```\n" + json.dumps(value, indent=2, default=str) + "\n```"


# ---------------------------------------------------------------------------------------------
# Weights & Biases: OUT/wandb/ (or $WANDB_DIR/wandb/); WANDB_MODE=offline writes only there


class WandbTracker(Tracker):
    """A wandb run (project: logging.project, else $WANDB_PROJECT, else grpokit) whose config is `record`; the
    samples go to a `samples` table. Offline runs: `wandb sync OUT/wandb/offline-run-*` uploads them later."""

    key = "wandb"

    def __init__(self, out_dir: Path, run_name: str, project: str | None, record: Mapping[str, Any]) -> None:
        self._wandb = _import(self.key)
        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(out_dir)}
        # create_new: our own run object, whatever wandb.run the user's code holds.
        self._run = self._wandb.init(
            project=project or os.environ.get("WANDB_PROJECT", PROJECT),
            name=run_name,
            config=dict(record),
            reinit="create_new",
            **where,
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        columns = sorted({k for s in samples for k in s})
        rows = [[_table_cell(s.get(c)) for c in columns] for s in samples]
        self._run.log({"samples": self._wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self._run.finish()


# ---------------------------------------------------------------------------------------------
# MLflow: $MLFLOW_TRACKING_URI, else MLflow's default store


def mlflow_name(name: str) -> str:
    # MLflow accepts only [A-Za-z0-9_ ./:-] in metric and parameter names: eval/pass@1 -> eval/pass_at_1.
    name = name.replace("@", "_at_")
    return "".join(c if c.isalnum() or c in "_-./: " else "_" for c in name)


class MlflowTracker(Tracker):
    """An MLflow run in experiment logging.project (else $MLFLOW_EXPERIMENT_ID or $MLFLOW_EXPERIMENT_NAME,
    else grpokit): the flattened record as
    parameters (run_info.torch_version, ...), the commit also as the tag mlflow.source.git.commit,
    finite scalars as metrics. MlflowClient, not the fluent API: the user's active run is left alone."""

    key = "mlflow"

    def __init__(self, out_dir: Path, run_name: str, project: str | None, record: Mapping[str, Any]) -> None:
        mlflow = _import(self.key)
        self._entities = importlib.import_module("mlflow.entities")
        self._client = (
            mlflow.MlflowClient()
        )  # the tracking URI as MLflow resolves it (MLFLOW_TRACKING_URI, ...)
        experiment_id = None if project else os.environ.get("MLFLOW_EXPERIMENT_ID")
        if not experiment_id:
            name = project or os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
            experiment = self._client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        tags = {}
        commit = record.get(RUN_INFO, {}).get("git_commit")
        if commit:
            tags["mlflow.source.git.commit"] = commit
        self._run_id = self._client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        # MLflow takes at most 100 parameters per batch, and caps a value at 500 characters on old servers.
        params = [self._entities.Param(mlflow_name(k), str(v)[:500]) for k, v in _flatten(record).items()]
        for i in range(0, len(params), 100):
            self._client.log_batch(self._run_id, params=params[i : i + 100])

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        # MLflow rejects NaN and infinities; metrics.jsonl has them as null.
        metrics = [
            self._entities.Metric(mlflow_name(k), v, now, step)
            for k, v in scalars.items()
            if math.isfinite(v)
        ]
        for i in range(0, len(metrics), 1000):  # at most 1000 metrics per batch
            self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


# ---------------------------------------------------------------------------------------------
# trackio: $TRACKIO_DIR/<project>.db (default ~/.cache/huggingface/trackio), local unless a Space is named


class TrackioTracker(Tracker):
    """A trackio run in project logging.project (default grpokit) whose config is `record`.
    trackio reads TRACKIO_DIR when it is first imported: set it before the run starts."""

    key = "trackio"

    def __init__(self, out_dir: Path, run_name: str, project: str | None, record: Mapping[str, Any]) -> None:
        trackio = _import(self.key)
        self._run = trackio.init(project=project or PROJECT, name=run_name, config=dict(record))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


TRACKERS: dict[str, type[Tracker]] = {
    t.key: t for t in (TensorBoardTracker, WandbTracker, MlflowTracker, TrackioTracker)
}
