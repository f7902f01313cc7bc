"""Rank 0's duties in a training run, in one object made once: the run lock, config.yaml, the metric log (and
the trackers), the progress bar, the final model and the plots. On other ranks (torchrun) each does nothing.

    records = RunRecords(out, cfg, main=world.is_main)
    with records.locked():                             # one run per output_dir
        records.write_config()
        with records.open(step, resumed):              # metrics.jsonl (+ trackers) and the progress bar
            records.log_step(step, metrics, samples)   # as logging.* says; the progress bar follows
        records.save_final(full_model, tokenizer)      # output_dir/final
    records.plot()                                     # output_dir/plots

Every logging.doctor_every steps, log_step runs the doctor's checks on the steps so far and prints each new
finding as one line (grpokit/doctor/live.py, docs/doctor.md).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from grpokit.checkpoint import RunLock, list_checkpoints, save_final
from grpokit.checkpoint.whole import whole_module
from grpokit.config import Config
from grpokit.doctor.live import LiveDoctor
from grpokit.metrics.compute import read_metrics
from grpokit.records.plots import plot_run
from grpokit.records.progress import TrainProgress
from grpokit.records.sinks import MetricLogger


class StepUnderWay(logging.Filter):
    """Starts each line of the reward functions' log (logger grpokit.rewards: a failure reported once, a slow
    or timed-out call) with the step under way, which the reward functions' manager does not know."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("step "):
            record.msg = f"step {self.step}: {record.msg}"
        return True


class RunRecords:
    def __init__(self, out: Path, cfg: Config, *, main: bool, plot: Callable[[Path], Any] = plot_run) -> None:
        self.out, self.cfg, self.main, self._plot = Path(out), cfg, main, plot
        self._log: MetricLogger | None = None
        self._progress: TrainProgress | None = None
        self._under_way = StepUnderWay(1)
        self._doctor: LiveDoctor | None = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One run per output_dir: a second one stops here, naming this one (checkpoint.RunLock)."""
        with RunLock(self.out) if self.main else contextlib.nullcontext():
            yield

    def write_config(self) -> None:
        if self.main:
            (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.model_dump(), sort_keys=False))

    @contextlib.contextmanager
    def open(self, step: int, resumed: int | None) -> Iterator[None]:
        """The metric log from `step` on (a fresh run never appends to an old log) and the progress bar; a
        resumed run says where from. Closed on the way out, whatever happens. Meanwhile the reward functions'
        log lines name the step under way (every rank's)."""
        self._under_way.step = step + 1
        rewards_log = logging.getLogger("grpokit.rewards")
        rewards_log.addFilter(self._under_way)
        try:
            with self._opened(step, resumed):
                yield
        finally:
            rewards_log.removeFilter(self._under_way)

    @contextlib.contextmanager
    def _opened(self, step: int, resumed: int | None) -> Iterator[None]:
        if not self.main:
            yield
            return
        cfg = self.cfg
        self._log = MetricLogger(self.out, **cfg.logging.trackers(), config=cfg.model_dump())
        try:
            with TrainProgress(cfg.optim.max_steps, start_step=step) as self._progress:
                self._log.truncate_after(step if resumed is not None else -1)
                if cfg.logging.doctor_every:  # a resumed run's checks see its earlier steps too
                    earlier = read_metrics(self._log.metrics_path) if resumed is not None else []
                    self._doctor = LiveDoctor(cfg.model_dump(), cfg.logging.doctor_every, earlier)
                if resumed is not None:
                    self.print(f"resuming from checkpoint step {resumed} in {self.out / 'checkpoints'}")
                yield
        finally:
            self._progress = self._doctor = None
            self._log.close()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Metrics outside a training step (the evaluation at step 0)."""
        if self._log is not None and self._progress is not None:
            self._log.log(step, metrics)
            self._progress.update(step, metrics)
        if self._doctor is not None:
            self._doctor.note(step, metrics)

    def log_step(self, step: int, metrics: Mapping[str, float], samples: Sequence[Mapping[str, Any]]) -> None:
        self._under_way.step = step + 1
        if self._log is None or self._progress is None:
            return
        settings = self.cfg.logging
        self._log.log_step(
            step,
            metrics,
            samples,
            last=step == self.cfg.optim.max_steps,
            every=settings.log_every,
            samples_every=settings.sample_every,
        )
        self._progress.update(step, metrics)
        if self._doctor is not None:  # the doctor's checks on the steps so far (docs/doctor.md)
            for line in self._doctor.add(step, metrics, last=step == self.cfg.optim.max_steps):
                self.print(line)

    def print(self, message: str) -> None:
        if self._progress is not None:
            self._progress.print(message)

    def stopped(self, signal: str) -> None:
        """The line of a run a second signal stopped at once (no save of its step): the newest checkpoint and
        how to resume, as the first signal's save says it."""
        found = list_checkpoints(self.out)
        self.print(
            f"{signal}: saved step {found[-1][0]} to {found[-1][1]}; run the same command to resume"
            if found
            else f"{signal}: stopped before the first checkpoint; run the same command to start again"
        )

    def save_final(self, model: Any, tokenizer: Any) -> None:
        """output_dir/final (and final/merged under model.lora.merge_on_save). Every rank calls it: an FSDP2
        module (the vllm engine's runs keep no whole copy) is gathered here for rank 0 to save."""
        model = whole_module(model)
        if self.main:
            lora = self.cfg.model.lora
            save_final(model, tokenizer, self.out / "final", merge=bool(lora and lora.merge_on_save))

    def plot(self) -> None:
        if self.main:
            self._plot(self.out)
