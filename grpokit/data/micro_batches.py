"""Micro-batches: the runs of a minibatch's rows that go through the model at once (gradient accumulation).

Counted in rows (optim.micro_batch_size) every run holds the same number of completions, so one 16k-token
completion and sixteen 1k-token ones take the same slot. Counted in tokens (optim.max_tokens_per_micro_batch)
the rows go into runs by first-fit decreasing: longest first, each into the first run it still fits, a run
costing what the model computes for it:

    padded (model.padding_free off):  rows x (longest prompt + longest completion), the trimmed tensor
    packed (model.padding_free on):   the sum of the rows' prompt + completion tokens, one padding-free row

A sequence longer than the budget runs alone. The loss normalizers are the whole minibatch's (the trainer
counts them over every rank before the first micro-batch), so any split gives the minibatch's gradient up to
the order of float sums.

Under torchrun every rank must run as many forwards and backwards (FSDP2 gathers and reduces in each; the
loss checks are collective): `plan` evens the count out to the most any rank has, splitting the costliest run
of several rows in two, and where every run is one row, adding fillers (a real row run again with its loss
times 0, which adds nothing to any gradient and nothing to the metrics). With several minibatches, the rows
of every rank are pooled and `balance` deals each minibatch's rows to the ranks by their tokens.

    batching = MicroBatching.of(cfg)
    for rows, filler in batching.plan(idx, tokens, world.most):
        ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpokit.config import Config
from grpokit.data.batch import PackedBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MicroBatching:
    """How a minibatch splits into micro-batches: `size` rows each, or (max_tokens > 0) at most max_tokens
    tokens each, costed `packed` (one padding-free row) or padded."""

    size: int  # rows per micro-batch when counted in rows
    max_tokens: int = 0  # tokens per micro-batch; 0: counted in rows
    by_length: bool = True  # rows: similar completion lengths together (micro_batches)
    packed: bool = False  # model.padding_free: a micro-batch runs as one row of its tokens

    @classmethod
    def of(cls, cfg: Config) -> MicroBatching:
        o, packed = cfg.optim, cfg.model.padding_free
        if packed == "auto":  # made concrete once the model is loaded (components.with_padding_free)
            raise ValueError("MicroBatching.of needs the run's config, with model.padding_free resolved")
        return cls(cfg.micro_batch_size, o.max_tokens_per_micro_batch, o.group_by_length, packed)

    @property
    def limit(self) -> tuple[str, int]:
        """The config key that sizes a micro-batch and its value (for the out-of-memory message)."""
        if self.max_tokens:
            return "optim.max_tokens_per_micro_batch", self.max_tokens
        return "optim.micro_batch_size", self.size

    def worst(self, max_len: int) -> tuple[int, int]:
        """(rows, tokens each) of the largest micro-batch a run of sequences of max_len tokens can have."""
        if self.max_tokens:
            return max(1, self.max_tokens // max(max_len, 1)), max_len
        return self.size, max_len

    def split(self, idx: Tensor, tokens: PackedBatch) -> list[Tensor]:
        """Rows idx of `tokens` in micro-batches (this rank's)."""
        if self.max_tokens:
            return token_micro_batches(idx, tokens, self.max_tokens, self.packed)
        return micro_batches(idx, tokens, self.size, self.by_length)

    def plan(self, idx: Tensor, tokens: PackedBatch, most: Callable[[int], int]) -> list[tuple[Tensor, bool]]:
        """(rows, filler) of each micro-batch, as many as on the rank with most (most: the max over ranks)."""
        runs = self.split(idx, tokens)
        if not self.max_tokens:  # counted in rows: every rank has as many (the config checks it)
            return [(r, False) for r in runs]
        return even_out(runs, most(len(runs)), sequence_tokens(tokens), self.packed)

    def costs(self, tokens: PackedBatch) -> Tensor | None:
        """[N] each row's tokens, by which several minibatches' rows are dealt to ranks (None: in rows)."""
        return sequence_tokens(tokens) if self.max_tokens else None


def sequence_tokens(tokens: PackedBatch) -> Tensor:
    """[N] prompt + completion tokens of each row."""
    return tokens.attention_mask.sum(1)


def _prompt_completion(tokens: PackedBatch) -> tuple[Tensor, Tensor]:
    P = tokens.input_ids.shape[1] - tokens.completion_width
    return tokens.attention_mask[:, :P].sum(1), tokens.completion_mask.sum(1)


def run_cost(prompt: Tensor, completion: Tensor, packed: bool) -> int:
    """Tokens the model computes for one micro-batch of rows with these prompt / completion lengths."""
    if packed:
        return int((prompt + completion).sum())
    return len(prompt) * (int(prompt.max()) + max(int(completion.max()), 1))


def token_micro_batches(idx: Tensor, tokens: PackedBatch, max_tokens: int, packed: bool) -> list[Tensor]:
    """Rows idx in micro-batches of at most max_tokens tokens each (run_cost), first-fit decreasing; a row
    alone over the budget runs alone (with a warning). Each micro-batch lists its rows in ascending order."""
    prompt, completion = (x[idx].tolist() for x in _prompt_completion(tokens))
    order = sorted(range(len(prompt)), key=lambda i: -(prompt[i] + completion[i]))  # stable: ties in order
    runs: list[list[int]] = []
    sizes: list[tuple[int, int, int, int]] = []  # each run's rows, longest prompt, longest completion, sum
    for i in order:
        p, c = prompt[i], completion[i]
        for k, (n, lp, lc, total) in enumerate(sizes):
            grown = (n + 1, max(lp, p), max(lc, c, 1), total + p + c)
            if (grown[3] if packed else grown[0] * (grown[1] + grown[2])) <= max_tokens:
                runs[k].append(i)
                sizes[k] = grown
                break
        else:
            runs.append([i])
            sizes.append((1, p, max(c, 1), p + c))
            if p + c > max_tokens:
                logger.warning(
                    "a sequence of %d tokens is over optim.max_tokens_per_micro_batch=%d: it runs alone",
                    p + c,
                    max_tokens,
                )
    return [idx[sorted(run)] for run in runs]


def even_out(runs: list[Tensor], n: int, costs: Tensor, packed: bool) -> list[tuple[Tensor, bool]]:
    """`runs` made n long: the costliest run of several rows split in two (rows in their order), while there
    is one; then filler runs (one real row, run with its loss times 0)."""
    runs = list(runs)
    while len(runs) < n:
        several = [k for k, r in enumerate(runs) if len(r) > 1]
        if not several:
            break
        k = max(several, key=lambda k: int(costs[runs[k]].sum()))
        half = (len(runs[k]) + 1) // 2
        runs[k : k + 1] = [runs[k][:half], runs[k][half:]]
    return [(r, False) for r in runs] + [(runs[0][:1], True)] * (n - len(runs))


def balance(rows: Tensor, costs: Tensor, ranks: int) -> list[Tensor]:
    """`rows` dealt to `ranks` equal shares (in count) of about equal cost: costliest first, each to the
    share with the least cost that still has room. Each share lists its rows in ascending order."""
    per = len(rows) // ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in torch.argsort(costs[rows], descending=True, stable=True).tolist():
        r = min((r for r in range(ranks) if len(shares[r]) < per), key=lambda r: (load[r], r))
        shares[r].append(int(rows[i]))
        load[r] += int(costs[rows[i]])
    return [torch.tensor(sorted(s), dtype=rows.dtype) for s in shares]


def micro_batches(idx: Tensor, tokens: PackedBatch, size: int, by_length: bool) -> list[Tensor]:
    """Rows idx of `tokens` in runs of `size`. by_length: in the order of the two below that runs fewer tokens
    through the model (each micro-batch trimmed to its longest prompt and completion; a prompt shared by at
    least half its rows counted once, as completion_logprobs runs it):
      rows:   longest completion first: the least padding, but a prompt's G rows may split up;
      groups: whole groups (rows with one prompt), the group with the longest completion first.
    The micro-batch losses add up to the same minibatch loss: the gradient is the same up to the order of
    sums."""
    if not by_length or len(idx) <= size:
        return list(idx.split(size))
    P = tokens.input_ids.shape[1] - tokens.completion_width
    lengths = tokens.completion_mask[idx].sum(1)  # [n]
    prompt_len = tokens.attention_mask[idx, :P].sum(1)  # [n]
    group = torch.unique(tokens.input_ids[idx, :P], dim=0, return_inverse=True)[1]  # [n]: rows of one prompt
    longest = torch.zeros(int(group.max()) + 1, dtype=lengths.dtype).scatter_reduce(0, group, lengths, "amax")
    by_rows = torch.argsort(lengths, descending=True, stable=True)
    by_groups = by_rows[torch.argsort(group[by_rows], stable=True)]  # a group's rows together, longest first
    by_groups = by_groups[torch.argsort(longest[group[by_groups]], descending=True, stable=True)]

    def cost(order: Tensor) -> int:
        total = 0
        for mb in order.split(size):
            n, shared = len(mb), int(torch.unique(group[mb]).numel())
            prompts = shared if 2 * shared <= n else n
            total += n * int(lengths[mb].max()) + prompts * int(prompt_len[mb].max())
        return total

    best = min((by_groups, by_rows), key=cost)  # groups first: on a tie, keep the prompts shared
    return list(idx[best].split(size))
