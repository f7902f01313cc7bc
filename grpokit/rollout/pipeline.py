"""Rollouts for the loop: one interface, one class per timeline (rollout.max_policy_lag = k).

    pipeline = make_pipeline(engine, rollout_cfg, max_lag=k, version=step, model=policy, seed=seed)
    rows, comps, timings = pipeline.batch(step, draw, end)  # draw(b) -> rows of batch b; comps.versions set
    comps = pipeline.extra(rows, timings)               # dynamic sampling's further rounds, version b
    pipeline.idle()                                     # before the update: the engine may free its memory
    pipeline.publish(step + 1, policy)                  # after the update: pi_old <- pi_theta (version b + 1)
    with pipeline.exclusive(policy): evaluate(...)      # the engine on the trainer's current weights
    pipeline.close()                                    # the sampler, then the engine (the pipeline owns it)
    state = pipeline.state_dict()                       # a checkpoint's: the batches in flight (per rank)
    pipeline.load_state_dict(state)                     # a resume's, before the first batch

`RolloutPipeline` is the interface the loop (trainer.py) calls; make_pipeline builds the timeline max_lag
names, `SyncPipeline` (k = 0) or `LaggedPipeline` (k > 0). Weight pushes and the metrics are the interface's,
shared.

The policy version is the number of optimizer steps (trainer steps) behind a set of weights. Batch b trains at
version b and is sampled, with k = max_policy_lag, at version max(v0, b - k) (v0: the version the run started
or resumed at): exactly, not "at most", so a run is the same every time for a seed.

SyncPipeline, k = 0, the synchronous loop (DeepSeekMath Algorithm 1): `batch` generates in the caller's thread
with the engine at the current weights and the run's own random stream, as the loop always did (exact resume
holds).

LaggedPipeline, k > 0: one background thread (the sampler) owns the engine and a copy of the policy.
`batch(b)` first hands it the rows of every batch up to b + k (drawn in the caller's thread, in order), then
waits for batch b. The sampler takes the requests in order (batch b + k is asked for at step b, with version
b), loads that snapshot into its copy (engine.sync_weights(copy): for vllm a push, for fast / hf the copy is
what they run), and generates with a torch.Generator of its own. So while the trainer updates on batch b at
version b, the sampler generates batch b + k with version b. Timeline for k = 1:

    trainer  | (waits)      | train b=0 (v0) | train b=1 (v1) | train b=2 (v2) |
    sampler  | gen b=0 (v0) | gen b=1 (v0)   | gen b=2 (v1)   | gen b=3 (v2)   |

Torch ops release the GIL while they compute: the threads overlap when ops are large (a tiny CPU model's
forward is mostly Python holding it: docs/rollout.md has the numbers; a server sampler overlaps). Metrics:
rollout/version_lag (mean over the batch's samples of trainer version - sample version) and its max,
perf/rollout_wait_time (the trainer waiting for its batch), perf/weights_wait_time (the sampler idle, waiting
for the step that publishes the version of its next batch). What pi_old means at k > 0 is the loop's
(trainer.py, docs/rollout.md).

GPU memory: at k = 0 a colocated engine that can sleep (vLLM on CUDA) is put to sleep before the update
(`sleep()`) and woken before the next push (`wake_up()`); at k > 0 it generates during the update and stays
awake.

Checkpoints: the pipeline is a per-rank stateful part of the checkpoint (state_dict / load_state_dict, handed
to the checkpointer as a rank state: each rank's sampler holds its own batches). The synchronous one holds
nothing. The lagged one, at the checkpoint after step s (version s published), holds the batches in flight: s
.. s + k - 1, already asked for at versions max(v0, i - k). state_dict() waits until the sampler has finished
every batch asked for (only at checkpoint steps: the overlap elsewhere is unchanged) and returns them whole
(rows, completions with their tokens, log-probs, versions and kept sets, timings), the next batch to ask for,
and the sampler's two generators. The sampler then needs only version s for its next batch, s + k: the
trainer's weights, which the resume publishes. Resumed, batch(s) returns the saved batch and the sampler goes
on with batch s + k at version s from the saved generator states, as the uninterrupted run does: the weights
at the end are the same, bit for bit (tests/test_async_resume.py). A checkpoint without that state (written
before it existed, at another lag, or at another world size) is resumed as before: the batches ahead are
generated again at the checkpoint's weights, their prompts drawn again (data/sampler.py's SamplerBookmarks
rewinds), with a logged line.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from grpokit.metrics.compute import (
    PERF_ROLLOUT_TIME,
    PERF_ROLLOUT_WAIT,
    PERF_WEIGHTS_WAIT,
    ROLLOUT_PUSH_CHECKS,
    ROLLOUT_PUSH_ERROR,
    ROLLOUT_SERVERS,
    ROLLOUT_VERSION_LAG,
    ROLLOUT_VERSION_LAG_MAX,
)
from grpokit.rollout.base import Completions, EngineCaps, RolloutEngine, SamplingParams
from grpokit.rollout.episodes import generate_groups

if TYPE_CHECKING:
    from grpokit.config import RolloutConfig

logger = logging.getLogger("grpokit.rollout")
#: seeds of the sampler's own generators: the background batches, and the extra rounds of dynamic sampling
_SAMPLER_SEED, _EXTRA_SEED = 7_919, 104_729


def sampling_params(rollout_cfg, generator: torch.Generator | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=rollout_cfg.max_completion_length,
        temperature=rollout_cfg.temperature,
        top_p=rollout_cfg.top_p,
        top_k=rollout_cfg.top_k,
        record_kept=rollout_cfg.replay_truncation,
        generator=generator,
    )


def truncation_note(rollout_cfg, caps: EngineCaps) -> str | None:
    """The line said at start when the sampler truncates (top-k / top-p) and rollout.replay_truncation asks
    for its kept sets, but the engine cannot record them: the log-prob passes then use the full
    distribution."""
    truncates = rollout_cfg.top_k > 0 or rollout_cfg.top_p < 1.0
    if not (truncates and rollout_cfg.replay_truncation) or caps.kept_sets:
        return None
    return (
        f"rollout.engine={rollout_cfg.engine} does not record the tokens top_k / top_p kept: the trainer's "
        "log-probs use the untruncated distribution (the sampler's differ by the log of the kept mass); "
        "rollout.engine=fast replays the truncation"
    )


class RolloutPipeline(abc.ABC):
    """The engine as pi_old, behind the calls the loop makes (every timeline implements them all).
    make_pipeline(...) builds the timeline that max_lag names, from the same parts whichever it is (the
    synchronous one uses no model or seed)."""

    def __init__(
        self,
        engine: RolloutEngine,
        rollout_cfg: RolloutConfig,
        *,
        max_lag: int,
        version: int,
        model: torch.nn.Module,
        seed: int,
    ) -> None:
        self.engine = engine  # the pipeline's: close() closes it
        self.cfg, self.G = rollout_cfg, rollout_cfg.num_generations
        if (note := truncation_note(rollout_cfg, getattr(engine, "caps", EngineCaps()))) is not None:
            logger.warning(note)
        self.version = version  # the trainer's: weights published so far
        self._closed = False

    @abc.abstractmethod
    def batch(
        self, b: int, draw: Callable[[int], Sequence[Any]], end: int
    ) -> tuple[Sequence[Any], Completions, dict[str, float]]:
        """Rows, completions (comps.versions set) and timings of batch b; draw(i) gives the rows of batch i;
        batches from `end` on (the run's max_steps) are never asked for."""

    @abc.abstractmethod
    def extra(self, rows: Sequence[Any], timings: dict[str, float]) -> Completions:
        """Completions of more rows now, at the current version (dynamic sampling's further rounds)."""

    @abc.abstractmethod
    def idle(self) -> None:
        """This step's rollouts are done: the update comes next."""

    @abc.abstractmethod
    def publish(self, version: int, model: torch.nn.Module) -> None:
        """The trainer's weights after `version` optimizer steps: pi_old of the batches asked for from now."""

    @abc.abstractmethod
    def exclusive(
        self, current_model: Callable[[], torch.nn.Module]
    ) -> contextlib.AbstractContextManager[RolloutEngine]:
        """The engine on the trainer's current weights (current_model() gives them), nothing else generating
        (held-out evaluation)."""

    @abc.abstractmethod
    def close(self, timeout: float = 60.0) -> None:
        """Stop generating, then close the engine (the pipeline owns it). Closing twice does nothing."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The work in flight that a checkpoint after the last published version keeps ({}: none)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back a checkpoint's work in flight ({}: none, or a checkpoint from before it was kept), before
        the first batch."""

    # ------------------------------------------------------------------ shared by the timelines
    def _sync(self, model: torch.nn.Module, version: int) -> None:
        # an engine that reports versions (the server) uses it
        self.engine.sync_weights(model, version=version)

    def _generate(
        self, rows, version: int, sampling: SamplingParams, timings: dict[str, float]
    ) -> Completions:
        t = time.perf_counter()
        comps = generate_groups(self.engine, rows, self.G, sampling, timings)  # tools: rollout/tools/ metrics
        timings[PERF_ROLLOUT_TIME] = timings.get(PERF_ROLLOUT_TIME, 0.0) + time.perf_counter() - t
        timings.update(push_metrics(self.engine))
        return replace(comps, versions=[version] * len(comps)) if comps.versions is None else comps


class SyncPipeline(RolloutPipeline):
    """k = 0: each batch generated when the loop asks for it, in its thread, with the run's random stream."""

    def batch(
        self, b: int, draw: Callable[[int], Sequence[Any]], end: int
    ) -> tuple[Sequence[Any], Completions, dict[str, float]]:
        rows, timings = draw(b), dict[str, float]()  # timings: as the lagged sampler's
        comps = self._generate(rows, self.version, sampling_params(self.cfg), timings)
        timings[PERF_ROLLOUT_WAIT] = timings[PERF_ROLLOUT_TIME]
        return rows, comps, timings

    def extra(self, rows: Sequence[Any], timings: dict[str, float]) -> Completions:
        return self._generate(rows, self.version, sampling_params(self.cfg), timings)

    def idle(self) -> None:
        # a colocated engine that can sleep frees its GPU memory for the update
        self.engine.sleep()

    def publish(self, version: int, model: torch.nn.Module) -> None:
        self.version = version
        self.engine.wake_up()
        self._sync(model, version)

    @contextlib.contextmanager
    def exclusive(self, current_model: Callable[[], torch.nn.Module]) -> Iterator[RolloutEngine]:
        # the engine runs the trainer's weights already: publish pushed them after the update
        yield self.engine

    def close(self, timeout: float = 60.0) -> None:
        if not self._closed:
            self._closed = True
            self.engine.close()

    def state_dict(self) -> dict[str, Any]:
        return {}  # each batch is generated when it is asked for: nothing ahead

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("batches"):
            logger.warning(
                "the checkpoint holds %d batches generated ahead (rollout.max_policy_lag=%d); at "
                "max_policy_lag=0 they are generated again, their prompts drawn again",
                len(state["batches"]),
                state["max_lag"],
            )


class LaggedPipeline(RolloutPipeline):
    """k > 0: a sampler thread generates batch b + k with version b while the trainer updates on batch b."""

    def __init__(
        self,
        engine: RolloutEngine,
        rollout_cfg: RolloutConfig,
        *,
        max_lag: int,
        version: int,
        model: torch.nn.Module,
        seed: int,
    ) -> None:
        super().__init__(engine, rollout_cfg, max_lag=max_lag, version=version, model=model, seed=seed)
        self.max_lag = max_lag
        device = next(model.parameters()).device
        # The sampler's weights, a version behind. requires_grad stays as the policy's: engines that push
        # weights (vllm) send the trainable tensors only.
        self._copy = copy.deepcopy(model).eval()
        self._gen = torch.Generator(device).manual_seed(seed + _SAMPLER_SEED)
        self._extra_gen = torch.Generator(device).manual_seed(seed + _EXTRA_SEED)
        self._snapshots = {version: _snapshot(model)}  # version -> weights, until the sampler loaded it
        self._loaded: int | None = None  # the version in the engine (None: another, e.g. after an evaluation)
        self._engine_lock = threading.Lock()
        self._requests: queue.Queue = queue.Queue()
        self._results: dict[int, Any] = {}  # batch -> (rows, completions, timings) or the sampler's error
        self._done = threading.Condition()
        self._next: int | None = None  # the next batch to hand the sampler, from the first batch() on
        self._finished: int | None = None  # the sampler has finished every batch before this one
        # The run's thread count: OpenMP's count is per thread, and a new thread gets the default.
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._sampler, name="grpokit-sampler", daemon=True)

    # ------------------------------------------------------------------ the trainer's side
    def batch(
        self, b: int, draw: Callable[[int], Sequence[Any]], end: int
    ) -> tuple[Sequence[Any], Completions, dict[str, float]]:
        if self._thread.ident is None:  # the first batch of the run, or of a resume: the sampler starts
            self._next = self._start(b)
        assert self._next is not None
        # In order, in this thread: the data order does not depend on timing. Batch b + k: this step's weights
        while self._next <= min(b + self.max_lag, end - 1):
            self._requests.put((self._next, draw(self._next), self.version))
            self._next += 1
        t = time.perf_counter()
        with self._done:
            self._done.wait_for(lambda: b in self._results or self._closed)
            out = self._results.pop(b, None)
        if isinstance(out, BaseException):
            raise out
        if out is None:
            raise RuntimeError("the rollout sampler thread stopped")
        rows, comps, timings = out
        timings[PERF_ROLLOUT_WAIT] = time.perf_counter() - t
        return rows, comps, timings

    def extra(self, rows: Sequence[Any], timings: dict[str, float]) -> Completions:
        with self._engine_lock:
            self._load(self.version, self._snapshots[self.version])
            return self._sample(rows, self.version, self._extra_gen, timings)

    def idle(self) -> None:
        pass  # the sampler generates during the update: the engine stays awake

    def publish(self, version: int, model: torch.nn.Module) -> None:
        self.version = version
        self._snapshots[version] = _snapshot(model)

    @contextlib.contextmanager
    def exclusive(self, current_model: Callable[[], torch.nn.Module]) -> Iterator[RolloutEngine]:
        # the sampler paused; it reloads its version afterwards
        with self._engine_lock:
            self._copy.load_state_dict(current_model().state_dict())
            self._sync(self._copy, self.version)
            self._loaded = None
            yield self.engine

    def close(self, timeout: float = 60.0) -> None:
        """Stop the sampler after the generation under way (batches asked for and not taken are dropped), then
        close the engine. A sampler that does not stop within `timeout` seconds is left behind with a warning,
        and its engine open (a daemon thread: it never keeps the process from exiting, and a run that failed
        keeps its own error). Closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._stop_sampler(timeout):
            self.engine.close()

    def state_dict(self) -> dict[str, Any]:
        """The batches asked for and not yet taken, once the sampler has finished them all (this waits for
        it), the next batch to ask for and the sampler's generators: {} before the first batch or once closed
        (nothing in flight to keep)."""
        if self._next is None or self._closed:
            return {}
        with self._done:
            self._done.wait_for(lambda: self._finished == self._next or self._closed or self._failed())
            batches = dict(self._results)
        if self._closed:
            return {}
        for out in batches.values():
            if isinstance(out, BaseException):  # the run fails with the sampler's error, not a checkpoint
                raise out
        return {
            "max_lag": self.max_lag,
            "next": self._next,
            "batches": batches,
            "generator": self._gen.get_state(),
            "extra_generator": self._extra_gen.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            logger.warning(
                "the checkpoint holds no batches generated ahead (written at max_policy_lag=0, at another "
                "world size, or before checkpoints kept them): the sampler starts again at the checkpoint's "
                "weights and their prompts are drawn again, so the run is not the uninterrupted run's"
            )
            return
        if state["max_lag"] != self.max_lag:
            logger.warning(
                "the checkpoint's %d batches generated ahead were sampled at rollout.max_policy_lag=%d, "
                "this run's is %d: they are generated again at the checkpoint's weights, their prompts "
                "drawn again",
                len(state["batches"]),
                state["max_lag"],
                self.max_lag,
            )
            return
        self._results, self._next = dict(state["batches"]), state["next"]
        self._finished = self._next  # all finished: a save before the first batch keeps them as they are
        self._gen.set_state(state["generator"])
        self._extra_gen.set_state(state["extra_generator"])

    def _failed(self) -> bool:
        """Whether the sampler stopped on an error (it hands the error over as a batch's result)."""
        return any(isinstance(out, BaseException) for out in self._results.values())

    def _start(self, b: int) -> int:
        """Start the sampler at batch b: after the batches a checkpoint gave back when b is the first of them
        (a resume), else at b (the run's first batch, or a checkpoint without them)."""
        if self._next is not None and b not in self._results and self._next != b:
            logger.warning(
                "the checkpoint's batches generated ahead (%s) do not follow batch %d; generating again "
                "from it",
                sorted(self._results),
                b,
            )
            self._results, self._next = {}, None
        self._finished = b if self._next is None else self._next
        self._thread.start()
        return self._finished

    def _stop_sampler(self, timeout: float) -> bool:
        """Whether the sampler thread stopped (or never started)."""
        self._requests.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning(
                    "the rollout sampler thread did not stop within %g s after training; left running",
                    timeout,
                )
                return False
        return True

    # ------------------------------------------------------------------ the sampler's side
    def _sampler(self) -> None:
        torch.set_num_threads(self._threads)  # vLLM's CPU attention checks that its metadata and kernel agree
        while True:
            t = time.perf_counter()
            # Batch b + k is asked for once version b is published: until then the sampler waits for weights.
            if (req := self._requests.get()) is None or self._closed:
                return
            b, rows, version = req
            timings = {PERF_WEIGHTS_WAIT: time.perf_counter() - t}
            try:
                with self._engine_lock:
                    self._load(version, self._snapshots[version])
                    out: Any = (rows, self._sample(rows, version, self._gen, timings), timings)
            except BaseException as exc:  # handed to the trainer, which raises it; the sampler stops
                out = exc
            with self._done:
                self._results[b], self._finished = out, b + 1
                self._done.notify_all()
            if isinstance(out, BaseException):
                return
            self._forget_before(version)

    def _sample(
        self, rows, version: int, generator: torch.Generator, timings: dict[str, float]
    ) -> Completions:
        comps = self._generate(rows, version, sampling_params(self.cfg, generator), timings)
        if comps.logprobs is None:  # pi_old of lagged samples is the sampler's: no ratio without them
            raise ValueError(
                f"rollout.max_policy_lag={self.max_lag} needs the engine's sampling log-probs, and "
                f"{type(self.engine).__name__} returned none; use rollout.engine=fast or vllm"
            )
        return comps

    def _load(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        if self._loaded != version:
            self._copy.load_state_dict(weights)
            self._sync(self._copy, version)
            self._loaded = version

    def _forget_before(self, version: int) -> None:
        for v in [v for v in list(self._snapshots) if v < min(version, self.version)]:
            self._snapshots.pop(v, None)


def push_metrics(engine: RolloutEngine) -> dict[str, float]:
    """rollout/push_error and rollout/push_checks of an engine that checks its weight pushes (vllm: its
    last_push_error, the check of the weights it sampled with; a fleet of servers: the max over them, and how
    many), and rollout/servers of a server engine, through a ToolRollout around it; {} for the others."""
    inner = getattr(engine, "engine", engine)
    err = getattr(inner, "last_push_error", None)
    if err is None:
        return {}
    out = {ROLLOUT_PUSH_ERROR: float(err), ROLLOUT_PUSH_CHECKS: float(getattr(inner, "push_checks", 1))}
    if (servers := getattr(inner, "fleet_size", None)) is not None:
        out[ROLLOUT_SERVERS] = float(servers)
    return out


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lag_metrics(comps: Completions, version: int) -> dict[str, float]:
    lags = [version - v for v in comps.versions or []]
    if not lags:
        return {}
    return {ROLLOUT_VERSION_LAG: sum(lags) / len(lags), ROLLOUT_VERSION_LAG_MAX: float(max(lags))}


def make_pipeline(
    engine: RolloutEngine,
    rollout_cfg: RolloutConfig,
    *,
    max_lag: int,
    version: int,
    model: torch.nn.Module,
    seed: int,
) -> RolloutPipeline:
    """The timeline rollout.max_policy_lag = max_lag names: SyncPipeline at 0, LaggedPipeline above."""
    timeline = LaggedPipeline if max_lag else SyncPipeline
    return timeline(engine, rollout_cfg, max_lag=max_lag, version=version, model=model, seed=seed)
