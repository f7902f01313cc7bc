"""The distributed world: this process's rank among the torchrun ranks, the process group, and the
whole-batch collectives the math needs (share, sum, gather, the metrics' reductions, the stop signals).

    world = World.from_env(cfg)          # RANK / WORLD_SIZE / LOCAL_RANK from torchrun; unset or 1: one
    rows = world.share(sampler.next())   # this rank's contiguous share of the step's prompts: whole groups
    n_seq, n_tok = world.sum(len(idx), tokens)   # all_reduce SUM: the normalizers of the global minibatch
    world.teardown()

What the policy becomes over the ranks (FSDP2 / DDP, its handle) is parallel.py's: World holds a Parallel
(world.parallel) and hands wrap, wrap_critic and backward on to it. The checkpoints are grpokit/checkpoint/'s,
which asks of the world only what its Ranks protocol names. At world size 1 nothing here communicates and
every method returns what the one process has: one process never opens a process group.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from grpokit.config import Config
from grpokit.config.world import check_world
from grpokit.data.batch import PackedBatch, RolloutBatch, ValueTargets
from grpokit.data.micro_batches import balance
from grpokit.distributed.handle import PolicyHandle
from grpokit.distributed.parallel import Parallel
from grpokit.distributed.signals import StopSignals
from grpokit.metrics.compute import RANK_REDUCTIONS, MeanAccumulator
from grpokit.types import RewardOutput

REDUCE: dict[str, Callable[[list[float]], float]] = {
    "max": max,
    "min": min,
    "sum": sum,
    "mean": lambda v: sum(v) / len(v),
}


def check_config(cfg: Config, world_size: int) -> None:
    """ConfigError (one line) for a config that cannot run on `world_size` processes: the config's own rules
    at that size (config.world.check_world), then what the engine can do there (rollout.engines: its
    EngineCaps against FEATURES). Every rule lives in one of those two."""
    from grpokit.rollout.engines import check_engine, choose_engine  # at start-up only: no engine loaded

    cfg, _ = choose_engine(cfg, world_size)  # rollout.engine=auto: the engine the run starts with
    check_world(cfg, world_size)
    check_engine(cfg, world_size)


def gathers_on_push(cfg: Config) -> bool:
    """The run's engine takes the policy from its FSDP2 shards as it pushes (not EngineCaps.whole_copy: vLLM
    colocated, each rank into its own engine, or rank 0 to a server). No whole copy of the policy for it
    (Parallel.whole_copy)."""
    from grpokit.rollout.engines import select

    return not select(cfg.rollout).caps.whole_copy


class World:
    """This process's place among the ranks, and the collectives the loop needs (see the module docstring).
    What the policy becomes over the ranks is its Parallel's (world.parallel); wrap, wrap_critic and backward
    are handed on to it."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        local_rank: int = 0,
        strategy: str = "none",
        mixed_precision: str = "none",
        *,
        whole_copy: bool = True,
        engine_dtype: torch.dtype = torch.float32,
    ):
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.parallel = Parallel(
            rank, size, strategy, mixed_precision, whole_copy=whole_copy, engine_dtype=engine_dtype
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where collectives' tensors go: the policy's device (set by wrap)."""
        return self.parallel.device

    def wrap(self, model: torch.nn.Module, ref: Any = None) -> PolicyHandle:
        """The policy over the ranks and its one handle (Parallel.wrap); the process group starts here."""
        return self.parallel.wrap(model, ref)

    def wrap_critic(self, module: torch.nn.Module) -> torch.nn.Module:
        """The PPO critic over the ranks, as the policy (Parallel.wrap_critic)."""
        return self.parallel.wrap_critic(module)

    def backward(self, loss: Tensor) -> None:
        """loss.backward() for this rank's share of a loss summed over the ranks (Parallel.backward)."""
        self.parallel.backward(loss)

    @classmethod
    def from_env(cls, cfg: Config) -> World:
        """The world torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK; MASTER_ADDR / MASTER_PORT are read when
        the process group starts, in wrap). WORLD_SIZE unset or 1: one process, no process group."""
        size = int(os.environ.get("WORLD_SIZE") or 1)
        if size <= 1:
            return cls()
        check_config(cfg, size)
        return cls(
            int(os.environ["RANK"]),
            size,
            int(os.environ.get("LOCAL_RANK") or 0),
            cfg.distributed.strategy,
            cfg.distributed.mixed_precision,
            whole_copy=not gathers_on_push(cfg),
            engine_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.distributed.engine_copy],
        )

    # ------------------------------------------------------------------ data
    def share(self, items: list) -> list:
        """This rank's contiguous share of the step's global prompts (rank r: the r-th of W equal parts), so
        the global batch, rank after rank, is what one process samples."""
        n = len(items) // self.size
        return items[self.rank * n : (self.rank + 1) * n]

    def minibatches(self, num_rows: int, num_minibatches: int, costs: Tensor | None = None) -> list[Tensor]:
        """This rank's rows of each minibatch of a pass. One minibatch: the rank's own rows, unshuffled.
        Several: a permutation of all num_rows rows of gather_batch (rank 0's draw, as one process draws it),
        each minibatch cut into W equal shares, rank r taking the r-th; so the minibatches are those of one
        process. costs [num_rows]: the shares dealt by cost instead (micro_batches.balance: equal counts,
        about equal tokens)."""
        if num_minibatches == 1:
            return [torch.arange(num_rows)]
        order = torch.randperm(num_rows)
        if self.size > 1:
            dist.broadcast(order, src=0)
        size = num_rows // num_minibatches
        minibatches = [order[m * size : (m + 1) * size] for m in range(num_minibatches)]
        if costs is not None and self.size > 1:
            return [balance(rows, costs, self.size)[self.rank] for rows in minibatches]
        return [rows.chunk(self.size)[self.rank] for rows in minibatches]

    def gather_batch(self, b: RolloutBatch, pad_id: int) -> RolloutBatch:
        """Every rank's rollout batch, in rank order (the global batch), re-padded to the widest prompt and
        completion: for minibatches that mix ranks' rows. One all_gather_object of the step's tensors."""
        return b if self.size == 1 else cat_batches(self.gather(b), pad_id)

    def gather_values(
        self, tokens: PackedBatch, loss_mask: Tensor, targets: ValueTargets
    ) -> tuple[PackedBatch, Tensor, ValueTargets]:
        """The PPO critic's gather_batch: every rank's rows of its update (tokens, loss mask, V_old and the
        returns), in rank order, laid out as pack_sequences lays out the whole batch (padded with the pad id
        the ranks' batches were padded with). One all_gather_object."""
        if self.size == 1:
            return tokens, loss_mask, targets
        padding = tokens.input_ids[tokens.attention_mask == 0]
        pad_id = int(padding[0]) if padding.numel() else -1  # -1: no padding on this rank
        everyone = self.gather((tokens, loss_mask, targets.values, targets.returns, pad_id))
        parts = list(zip(*everyone, strict=True))
        return (
            _cat_packed(list(parts[0]), max(0, *parts[4])),
            _cat(list(parts[1])),
            ValueTargets(_cat(list(parts[2])), _cat(list(parts[3]))),
        )

    # ------------------------------------------------------------------ reductions
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (all_gather_object)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, *values: float) -> Any:
        """Each value summed over the ranks (one all_reduce), types kept; one value in, one out."""
        if self.size > 1:
            t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            values = tuple(type(v)(x) for v, x in zip(values, t.tolist(), strict=True))
        return values[0] if len(values) == 1 else values

    def barrier(self) -> None:
        """Every rank waits here for the others (a checkpoint's folder is complete before anyone goes on)."""
        if self.size > 1:
            dist.barrier()

    def all(self, flag: bool) -> bool:
        """True when `flag` holds on every rank: a decision all ranks must take together (they run the same
        collectives)."""
        if self.size == 1:
            return bool(flag)
        t = torch.tensor([int(bool(flag))], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def most(self, n: int) -> int:
        """The largest n of any rank (the micro-batches every rank must run: MicroBatching.plan)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def all_finite(self, loss: Tensor) -> bool:
        """The loss is finite on every rank: otherwise every rank skips the backward (and the optimizer step)
        together."""
        return self.all(bool(torch.isfinite(loss)))

    def all_rows(self, x: Tensor) -> Tensor:
        """[W * n, ...] every rank's [n, ...] rows (n the same on every rank), in rank order: the global
        batch's order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x, device=self.device) for _ in range(self.size)]
        dist.all_gather(parts, x.to(self.device))
        return torch.cat(parts).to(x.device)

    def my_rows(self, x: Tensor) -> Tensor:
        """This rank's block of a global [W * n, ...] tensor."""
        return x.chunk(self.size)[self.rank]

    def cat_rows(self, *args: Any) -> tuple[Any, ...]:
        """Per-row data of every rank concatenated in rank order: tensors [n, ...] (a second dimension
        right-padded with zeros to the widest) and lists; anything else (a group size) as it is. For metrics,
        whose whole-batch statistics (a std, a min) have no per-rank reduction. One all_gather_object."""
        if self.size == 1:
            return args
        everyone = self.gather(args)
        return tuple(
            _cat([r[i] for r in everyone]) if isinstance(a, (Tensor, list)) else a for i, a in enumerate(args)
        )

    def scores(self, scored: RewardOutput) -> RewardOutput:
        """Every rank's rewards as one RewardOutput (the reward/ metrics of the whole batch)."""
        return (
            scored if self.size == 1 else RewardOutput.take([(s, slice(None)) for s in self.gather(scored)])
        )

    def means(self, acc: MeanAccumulator) -> dict[str, float]:
        """acc.means() over every rank's micro-batches (their sums and weights added up)."""
        return (
            acc.means()
            if self.size == 1
            else MeanAccumulator.merge(self.gather((acc.sums, acc.weights))).means()
        )

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The run's metrics from every rank's: metrics.RANK_REDUCTIONS for per-rank times and counts, the
        mean for the rest, which are whole-batch values already (the same everywhere) or one rank's (eval/ on
        rank 0)."""
        if self.size == 1:
            return metrics
        everyone = self.gather(metrics)
        keys = dict.fromkeys(k for m in everyone for k in m)
        return {k: REDUCE[RANK_REDUCTIONS.get(k, "mean")]([m[k] for m in everyone if k in m]) for k in keys}

    # ------------------------------------------------------------------ stop signals
    def stop_signals(self) -> StopSignals:
        """SIGTERM / SIGINT finish the step, save and stop (distributed.signals.StopSignals), on every rank:
        torchrun passes a signal it gets on to every rank and waits 30 s for them (then SIGKILL); the loop
        stops when any rank got one (World.signal_received), so that all ranks take part in the save."""
        return StopSignals()

    def signal_received(self, received: str | None) -> str | None:
        """The stop signal some rank received (StopSignals.received: "SIGTERM", ...), on every rank alike, or
        None: the loop's decision to save and stop, taken by all ranks together. One all_reduce; a gather when
        one came."""
        if self.size == 1 or self.all(received is None):
            return received
        return next(name for name in self.gather(received) if name is not None)

    def teardown(self) -> None:
        """Leave the process group (after the last collective). The barrier first: gloo waits in it for every
        collective still in flight (the last ones are asynchronous: DDP's reductions, FSDP2's gathers), so no
        worker thread still holds a Python tensor when this process exits. A rank that left right after its
        last collective while another was still saving aborted now and then at exit (`terminate called
        without an active exception`: the worker thread freeing that tensor needs the interpreter that is
        shutting down). Called from a `finally` while an error leaves, no barrier: the other ranks may be in
        another collective, or gone."""
        if self.size > 1 and dist.is_initialized():
            if sys.exc_info()[1] is None:
                dist.barrier()
            dist.destroy_process_group()


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], list):
        return [x for p in parts for x in p]
    if parts[0].dim() < 2:
        return torch.cat(parts)
    out = parts[0].new_zeros(
        (sum(len(p) for p in parts), max(p.shape[1] for p in parts), *parts[0].shape[2:])
    )
    row = 0
    for p in parts:
        out[row : row + len(p), : p.shape[1]] = p
        row += len(p)
    return out


def _cat_packed(parts: list[PackedBatch], pad_id: int) -> PackedBatch:
    """PackedBatches of different prompt / completion widths as one, laid out as pack_sequences lays out the
    whole batch: prompts left-padded to the longest, completions right-padded, positions from the mask."""
    P = max(p.input_ids.shape[1] - p.completion_width for p in parts)
    T = max(p.completion_width for p in parts)

    def widen(x: Tensor, p: PackedBatch, fill: int) -> Tensor:
        left = P - (x.shape[1] - p.completion_width)
        right = T - p.completion_width
        return torch.cat([x.new_full((len(x), left), fill), x, x.new_full((len(x), right), fill)], dim=1)

    ids = torch.cat([widen(p.input_ids, p, pad_id) for p in parts])
    attn = torch.cat([widen(p.attention_mask, p, 0) for p in parts])
    cmask = _cat([p.completion_mask for p in parts])
    kept = None
    if all(p.kept is not None for p in parts):  # [N, T, W]: widened with -1 (no record)
        W = max(p.kept.shape[2] for p in parts if p.kept is not None)
        kept = torch.full((len(ids), T, W), -1, dtype=torch.int32)
        row = 0
        for p in parts:
            assert p.kept is not None
            kept[row : row + len(p.kept), : p.kept.shape[1], : p.kept.shape[2]] = p.kept
            row += len(p.kept)
    return PackedBatch(ids, attn, (attn.cumsum(-1) - 1).clamp_min(0), ids[:, P:], cmask, kept)


def cat_batches(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Rollout batches as one, in order (every rank's: the global batch). PPO's value targets are not
    carried."""

    def opt(name):
        return _cat([getattr(p, name) for p in parts]) if getattr(parts[0], name) is not None else None

    return RolloutBatch(
        _cat_packed([p.tokens for p in parts], pad_id),
        _cat([p.loss_mask for p in parts]),
        _cat([p.truncated for p in parts]),
        _cat([p.rewards for p in parts]),
        _cat([p.advantages for p in parts]),
        opt("old_logp"),
        opt("ref_logp"),
        None,
        opt("sampler_logp"),
    )
