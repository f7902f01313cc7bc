"""Which prompts each step trains on: an endless, seeded, resumable stream of row indices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from grpokit.data.files import DataError


class PromptSampler:
    """An endless stream of row indices, `prompts_per_step` at a time.

    Epoch e visits every row once, in a permutation seeded by (seed, e); a batch that runs past
    the end of an epoch continues into the next (so a batch may, rarely, hold a row twice).
    `epoch` is the epoch the next index comes from, i.e. the number of completed passes.
    The state is two ints, so resuming gives exactly the batches an uninterrupted run would.
    """

    def __init__(self, num_rows: int, prompts_per_step: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise DataError(f"cannot sample from {num_rows} rows; the dataset needs at least one prompt")
        if prompts_per_step < 1:
            raise DataError(f"rollout.prompts_per_step={prompts_per_step} must be >= 1")
        if prompts_per_step > num_rows:
            raise DataError(
                f"rollout.prompts_per_step={prompts_per_step} is more than the {num_rows} rows in the "
                "dataset; lower rollout.prompts_per_step or add rows"
            )
        self.num_rows = num_rows
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into the current epoch's order
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        rng = np.random.default_rng([self.seed % 2**63, epoch])
        return rng.permutation(self.num_rows).tolist()

    def next(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.prompts_per_step:
            take = min(self.prompts_per_step - len(batch), self.num_rows - self.position)
            batch += self._order[self.position : self.position + take]
            self.position += take
            if self.position == self.num_rows:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved stream; seed and shuffle come from the state, prompts_per_step from self."""
        if state["num_rows"] != self.num_rows:
            raise DataError(
                f"sampler state is for {state['num_rows']} rows but the dataset has {self.num_rows}; "
                "resume with the same dataset and data split"
            )
        self.seed = state["seed"]
        self.shuffle = state["shuffle"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._epoch_order(self.epoch)


class SamplerBookmarks:
    """The prompt sampler's position as a checkpoint part (grpokit/checkpoint/): where the stream stands now
    ("sampler_ahead") and before the prompts of the next batch to train ("sampler"). They differ when batches
    were drawn ahead (rollout.max_policy_lag = k): a checkpoint after step s holds batches s .. s + k - 1 in
    flight (rollout/pipeline.py), whose prompts the stream has already given.

        bookmarks = SamplerBookmarks(sampler, lambda: trainer.step)
        bookmarks.mark(b)        # just before batch b's prompts are drawn (None: dynamic sampling's rounds)

    Resumed, the first draw says which position to continue from: batch s itself when the pipeline generates
    the batches ahead again (a checkpoint without them, or at another lag or world size), so their prompts
    come again in the same order; a later batch, or an extra round, when the pipeline took them back, so no
    prompt is drawn twice and none is skipped.
    """

    def __init__(self, sampler: PromptSampler, step: Callable[[], int]) -> None:
        self.sampler, self.step = sampler, step
        self.before: dict[int, dict[str, Any]] = {}  # batch -> the sampler's state before its prompts
        # a checkpoint's two positions (before batch s, now), until the first draw after it picks one
        self._resumed: tuple[dict[str, Any], dict[str, Any] | None] | None = None

    def mark(self, batch: int | None) -> None:
        if self._resumed is not None:
            before, ahead = self._resumed
            self._resumed = None
            self.sampler.load_state_dict(before if batch == self.step() or ahead is None else ahead)
        if batch is not None:
            self.before = {b: s for b, s in self.before.items() if b >= self.step()}
            self.before[batch] = self.sampler.state_dict()

    def state_dict(self) -> dict[str, Any]:
        now = self.sampler.state_dict()
        return {"sampler": self.before.get(self.step(), now), "sampler_ahead": now}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The position before batch s (a checkpoint from before "sampler_ahead" holds only this one) until
        the first draw picks."""
        self.sampler.load_state_dict(state["sampler"])
        self._resumed = (state["sampler"], state.get("sampler_ahead"))
