"""Partial rollouts (rollout.partial_rollouts): a step trains on the groups that finished, and the completions
still going keep their tokens and go on under the next weights.

    pipeline = PartialPipeline(engine, rollout_cfg, max_lag=0, version=step, model=policy, seed=seed)
    rows, comps, metrics = pipeline.batch(b, draw, end)   # the rank's share of prompts_per_step groups

The pipeline holds K = rollout.partial_in_flight x S groups, S being the rank's share of
rollout.prompts_per_step (the rows one draw gives): groups in flight, and complete ones waiting. A step runs
rounds at the current weights, at least one. Before each, the pipeline is topped up to K groups with fresh
prompts (draw(None): the prompt stream's next S rows); the round then gives every unfinished completion
at most C = rollout.partial_chunk_tokens more tokens: a fresh group as G samples of its prompt, a completion
under way as one sample of its prompt and its tokens so far (prefilled again under the new weights). A
completion is finished at EOS or at rollout.max_completion_length tokens; a group is complete when its G
completions are. Rounds repeat until S groups are complete; the step takes the first S completed, the
others wait. So a step ends when S groups have finished, not when its slowest completion has. With K = S
and C >= max_completion_length every group completes in its first round: the synchronous loop's prompts and
samples (tests/test_partial_rollouts.py).

Each token keeps the policy version that sampled it and its sampler log-prob: that log-prob is the token's
pi_old (the asynchronous rule of the loop: the behaviour policy; with rollout.importance_correction, the
trainer's own pass corrected by pi_old / pi_sampler token by token). A completion may span at most
rollout.max_staleness versions after its first token's: before each round, and before a step takes a complete
group, a completion whose first token is older than that is restarted from its prompt, its tokens dropped
(rollout/partial_restarted counts them). Group statistics are computed over complete groups only, since only
complete groups are trained.

Metrics (the step's batch): rollout/partial_frac (share of completions that took more than one round),
rollout/versions_spanned and its max (newest - oldest token version + 1), rollout/tokens_carried (tokens
sampled in an earlier step), rollout/partial_restarted, rollout/partial_rounds; perf/rollout_wait_time is the
whole rollout here (it runs in the loop's thread).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from grpokit.metrics.compute import PERF_ROLLOUT_TIME, PERF_ROLLOUT_WAIT
from grpokit.metrics.names import (
    ROLLOUT_PARTIAL_FRAC,
    ROLLOUT_PARTIAL_RESTARTED,
    ROLLOUT_PARTIAL_ROUNDS,
    ROLLOUT_TOKENS_CARRIED,
    ROLLOUT_VERSIONS_SPANNED,
    ROLLOUT_VERSIONS_SPANNED_MAX,
)
from grpokit.rollout.base import Completions, RolloutEngine
from grpokit.rollout.pipeline import SyncPipeline, push_metrics, sampling_params

logger = logging.getLogger("grpokit.rollout")


@dataclass
class Sample:
    """One completion under way: its tokens so far, each token's sampler log-prob, version and kept set."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)  # per round, [len, W] (top-k / top-p recorded)
    finish: str | None = None  # "stop" | "length" once finished
    rounds: int = 0

    def restart(self) -> None:
        self.tokens, self.logprobs, self.versions, self.kept = [], [], [], []
        self.finish, self.rounds = None, 0


@dataclass
class Group:
    """A prompt's G completions, in flight or complete."""

    row: Any
    samples: list[Sample]

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    def oldest(self) -> int | None:
        return min((s.versions[0] for s in self.samples if s.versions), default=None)


def chunk_tokens(rollout_cfg) -> int:
    """C: tokens a completion may add in one round (rollout.partial_chunk_tokens; 0: the smallest chunk with
    which the longest completion finishes within rollout.max_staleness versions)."""
    if rollout_cfg.partial_chunk_tokens:
        return rollout_cfg.partial_chunk_tokens
    return -(-rollout_cfg.max_completion_length // (rollout_cfg.max_staleness + 1))


class PartialPipeline(SyncPipeline):
    """The partial-rollout timeline: rounds of at most C tokens per completion in the loop's thread, with
    the run's random stream (so a run is the same every time for a seed). The rest is the synchronous
    timeline's: dynamic sampling's extra rounds generate whole completions at the current version, the engine
    sleeps during the update and gets each version's weights after it."""

    def __init__(
        self,
        engine: RolloutEngine,
        rollout_cfg,
        *,
        max_lag: int,
        version: int,
        model: torch.nn.Module,
        seed: int,
        most: Callable[[int], int] = lambda n: n,
    ) -> None:
        super().__init__(engine, rollout_cfg, max_lag=max_lag, version=version, model=model, seed=seed)
        self.most = most  # World.most: the max over the ranks (one process: n itself)
        self.chunk, self.max_staleness = chunk_tokens(rollout_cfg), rollout_cfg.max_staleness
        self.in_flight = rollout_cfg.partial_in_flight  # groups in flight or waiting, in steps' worth
        self.flying: list[Group] = []  # groups with a completion under way, oldest first
        self.done: list[Group] = []  # complete groups not yet trained, first completed first
        self.share: int | None = None  # groups a step takes: the rows one draw gives (the rank's share)

    # ------------------------------------------------------------------ the loop's calls
    def batch(
        self, b: int, draw: Callable[[Any], Sequence[Any]], end: int
    ) -> tuple[Sequence[Any], Completions, dict[str, float]]:
        timings: dict[str, float] = {}
        t = time.perf_counter()
        restarted = self._restart_stale(self.done) + self._restart_stale(self.flying)
        rounds, share = 0, self.share
        # Under torchrun every rank draws as often (a draw is every rank's share of one global batch, so the
        # prompt stream stays one stream) and runs as many rounds: each decision is the max over the ranks.
        while True:
            while self.most(int(share is None or len(self.flying) + len(self.done) < self.in_flight * share)):
                rows = draw(None)  # fresh prompts
                share = self.share = share or len(rows)  # the rank's share of prompts_per_step
                self.flying += [Group(r, [Sample() for _ in range(self.G)]) for r in rows]
            assert share is not None
            if rounds and not self.most(int(len(self.done) < share)):
                break
            self._round(timings)  # at least one a step: every completion under way goes on at each version
            rounds += 1
        groups, self.done = self.done[:share], self.done[share:]
        rows, comps = [g.row for g in groups], self._completions(groups)
        timings[PERF_ROLLOUT_WAIT] = time.perf_counter() - t
        timings.update(self._metrics(groups, restarted, rounds))
        return rows, comps, timings

    def state_dict(self) -> dict[str, Any]:
        """The groups in flight and waiting, each completion with its tokens, log-probs, versions and kept
        sets: a checkpoint keeps them, so a resumed run goes on with them (the rounds draw from the run's own
        random stream, which the checkpoint keeps too)."""
        return {"partial": {"flying": self.flying, "done": self.done, "share": self.share}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "partial" not in state:
            logger.warning(
                "the checkpoint holds no partial rollouts in flight (written by another timeline, or before "
                "checkpoints kept them): the pipeline starts empty, and the prompts that were in flight are "
                "not drawn again, so the run is not the uninterrupted run's"
            )
            return
        kept = copy.deepcopy(state["partial"])
        self.flying, self.done, self.share = kept["flying"], kept["done"], kept["share"]

    # ------------------------------------------------------------------ rounds
    def _restart_stale(self, groups: list[Group]) -> int:
        """Restart every completion of `groups` whose first token is more than max_staleness versions old
        (a complete group goes back in flight); the number restarted."""
        n = 0
        for g in list(groups):
            stale = [s for s in g.samples if s.versions and self.version - s.versions[0] > self.max_staleness]
            for s in stale:
                s.restart()
            n += len(stale)
            if stale and g in self.done:
                self.done.remove(g)
                self.flying.append(g)
        return n

    def _round(self, timings: dict[str, float]) -> None:
        """Every unfinished completion in flight gets at most C more tokens at the current version."""
        t = time.perf_counter()
        fresh = [g for g in self.flying if all(not s.tokens and s.finish is None for s in g.samples)]
        going = [(g, s) for g in self.flying if g not in fresh for s in g.samples if s.finish is None]
        limit = self.cfg.max_completion_length
        if fresh:
            comps = self._sample([g.row.prompt_ids for g in fresh], self.G, min(self.chunk, limit))
            for i, g in enumerate(fresh):
                for j, s in enumerate(g.samples):
                    self._extend(s, comps, i * self.G + j)
        by_size: dict[int, list[tuple[Group, Sample]]] = {}
        for g, s in going:  # one call per chunk size: a completion never passes max_completion_length
            by_size.setdefault(min(self.chunk, limit - len(s.tokens)), []).append((g, s))
        for size, pairs in sorted(by_size.items()):
            comps = self._sample([g.row.prompt_ids + s.tokens for g, s in pairs], 1, size)
            for i, (_, s) in enumerate(pairs):
                self._extend(s, comps, i)
        for g in [g for g in self.flying if g.complete]:
            self.flying.remove(g)
            self.done.append(g)
        timings[PERF_ROLLOUT_TIME] = timings.get(PERF_ROLLOUT_TIME, 0.0) + time.perf_counter() - t
        timings.update(push_metrics(self.engine))

    def _sample(self, prompts: list[list[int]], n: int, max_tokens: int) -> Completions:
        sampling = replace(sampling_params(self.cfg), max_tokens=max_tokens)
        comps = self.engine.generate(prompts, n, sampling)
        if comps.logprobs is None:
            raise ValueError(
                "rollout.partial_rollouts needs the engine's sampling log-probs (each token's pi_old), and "
                f"{type(self.engine).__name__} returned none; use rollout.engine=fast or vllm"
            )
        return comps

    def _extend(self, s: Sample, comps: Completions, i: int) -> None:
        assert comps.logprobs is not None
        tokens = comps.token_ids[i]
        s.tokens += tokens
        s.logprobs += comps.logprobs[i]
        s.versions += [self.version] * len(tokens)
        if comps.kept is not None:
            s.kept.append(comps.kept[i])
        s.rounds += 1
        if comps.finish_reasons[i] == "stop":
            s.finish = "stop"
        elif len(s.tokens) >= self.cfg.max_completion_length:
            s.finish = "length"

    # ------------------------------------------------------------------ the batch
    def _completions(self, groups: list[Group]) -> Completions:
        samples = [s for g in groups for s in g.samples]
        kept = None
        if any(s.kept for s in samples):
            kept = [_joined(s.kept, len(s.tokens)) for s in samples]
        return Completions(
            token_ids=[list(s.tokens) for s in samples],
            texts=self._texts([s.tokens for s in samples]),
            finish_reasons=[s.finish or "length" for s in samples],
            logprobs=[list(s.logprobs) for s in samples],
            versions=[s.versions[0] if s.versions else self.version for s in samples],
            kept=kept,
        )

    def _texts(self, token_ids: list[list[int]]) -> list[str]:
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                f"rollout.partial_rollouts needs the engine's tokenizer; {self.engine!r} has none"
            )
        return tokenizer.batch_decode(token_ids, skip_special_tokens=True)

    def _metrics(self, groups: list[Group], restarted: int, rounds: int) -> dict[str, float]:
        samples = [s for g in groups for s in g.samples]
        spans = [s.versions[-1] - s.versions[0] + 1 if s.versions else 1 for s in samples]
        carried = sum(sum(v < self.version for v in s.versions) for s in samples)
        return {
            ROLLOUT_PARTIAL_FRAC: sum(s.rounds > 1 for s in samples) / max(len(samples), 1),
            ROLLOUT_VERSIONS_SPANNED: sum(spans) / max(len(spans), 1),
            ROLLOUT_VERSIONS_SPANNED_MAX: float(max(spans, default=1)),
            ROLLOUT_TOKENS_CARRIED: float(carried),
            ROLLOUT_PARTIAL_RESTARTED: float(restarted),
            ROLLOUT_PARTIAL_ROUNDS: float(rounds),
        }


def _joined(parts: list[torch.Tensor], length: int) -> torch.Tensor:
    """A completion's kept sets of several rounds as one [length, W] tensor, -1 padding the narrower rows."""
    if not parts:
        return torch.full((length, 1), -1, dtype=torch.int32)
    width = max(p.shape[1] for p in parts)
    out = torch.full((sum(p.shape[0] for p in parts), width), -1, dtype=torch.int32)
    row = 0
    for p in parts:
        out[row : row + p.shape[0], : p.shape[1]] = p
        row += p.shape[0]
    return out
