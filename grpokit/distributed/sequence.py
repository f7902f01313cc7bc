"""Sequence parallelism (DeepSpeed-Ulysses, arXiv 2309.14509): one packed row's tokens split over N ranks.

    sp = SequenceGroup.from_mesh(mesh, "sequence")     # the sequence ranks of a data x sequence DeviceMesh
    enable(model)                                       # attention by all-to-all (once per model)
    logp, entropy = sequence_parallel_logprobs(model, batch, sp, with_entropy=True)   # [N, T] each, on every
    loss, _ = policy_loss(logp, old_logp, advantages, mask)   # rank: completion_logprobs(padding_free=True)'s
    loss.backward()
    sp.sum_gradients(model)                             # each rank's gradient covers its tokens: summed

How a row runs. The batch becomes one padding-free row (grpokit.data.batch.one_row) of L tokens, padded to a
multiple of N with tokens of their own sequence that predict nothing; rank r holds tokens [r S, (r + 1) S),
S = L / N, with their true position ids (RoPE is per token). In every attention layer, after the q / k / v
projections and RoPE, an all-to-all turns [B, H, S, D] into [B, H / N, L, D]: each rank attends over the whole
row with H / N heads, causal within each packed sequence, one sdpa call each (the row's sequence ids, from
the whole row's position ids before sharding: a rank's own slice cannot tell where sequences start). A second
all-to-all gives [B, H, S, D] back before o_proj. With fewer KV heads than N (GQA), each KV head is repeated
so that every rank receives the KV heads of its query heads. A head count that N does not divide (SmolLM2's 9
over 2 ranks) is made a multiple of N with zero heads, after repeating each KV head for each of its query
heads; their outputs are dropped. The backward of an all-to-all is the reverse one.

Each rank computes the log-probs of the completion tokens its positions predict; the targets are taken from
the whole row before sharding, so a rank's last position predicts the next rank's first token (verl's
Ulysses once shifted labels within each shard and lost that token). The ranks' shares are gathered into the
whole row's log-probs, identical on every rank, so losses and their normalizers are the one-rank ones; the
gather's backward keeps each rank's own share of the gradient, and the parameter gradients are summed over the
sequence ranks (sum_gradients; FSDP2 over the data x sequence mesh reduces them itself).

A split that silently did nothing would train on local attention only: each forward checks that the
registered attention ran in every layer with the whole row's length, and fails naming the model class if not.
Collectives are torch.distributed's all_to_all and all_gather (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from grpokit.data.batch import OneRow, PackedBatch, one_row
from grpokit.policy.attention import mask_or_segments, segment_attention, segment_sdpa
from grpokit.policy.loading import is_checkpointing, is_lora
from grpokit.policy.logprobs import row_logprobs, use_fused

#: the name of the Ulysses attention in transformers' AttentionInterface (config._attn_implementation)
ATTENTION = "grpokit_ulysses"


@dataclass(frozen=True)
class SequenceGroup:
    """The sequence ranks that share one row: their process group (None: the default one) and this rank."""

    group: Any  # dist.ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def from_group(cls, group: Any = None) -> SequenceGroup:
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    @classmethod
    def from_mesh(cls, mesh: Any, dim: str = "sequence") -> SequenceGroup:
        """The sequence ranks of a DeviceMesh (data x sequence): this rank's group along `dim`."""
        return cls.from_group(mesh.get_group(dim))

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """Each parameter's gradient summed over the sequence ranks (all_reduce SUM): each rank's backward
        covers the tokens it holds."""
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)


@dataclass
class RowShard:
    """One sequence rank's share of a padded row of length = size x S, and what it predicts."""

    input_ids: Tensor  # [1, S]  this rank's tokens of the padded row
    position_ids: Tensor  # [1, S]  their positions in their sequences
    sequence_ids: (
        Tensor  # [length]  the whole padded row's sequence index per token (padding: one of its own)
    )
    predicts: Tensor  # [K_r]  this rank's positions (0..S-1) whose logits predict a completion token
    targets: Tensor  # [1, K_r]  those tokens, taken from the whole row (across the shard edge too)
    counts: list[int]  # [N]  K_r of every rank: the row's K completion tokens, rank after rank
    length: int  # the padded row's length, N x S
    kept: Tensor | None = None  # [1, K_r, W]  the targets' top-k / top-p kept sets (OneRow.kept), or None

    def segments(self) -> list[tuple[int, int]]:
        """(start, end) of each packed sequence in the whole row, the padding's last: attention is causal
        within each and never crosses one's edge."""
        ids = self.sequence_ids
        edges = [0, *(torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist(), ids.numel()]
        return list(zip(edges, edges[1:], strict=False))


def shard_row(row: OneRow, rank: int, size: int) -> RowShard:
    """Rank `rank` of `size`'s contiguous share of the row, padded to a multiple of size (ceil(L / size)
    tokens a rank). The padding continues as a sequence of its own (position ids 0, 1, ...) that predicts
    nothing."""
    L = row.positions
    S = -(-L // size)
    pad = S * size - L
    ids = torch.cat([row.input_ids[0], row.input_ids.new_zeros(pad)])
    device = row.input_ids.device
    positions = torch.cat(
        [row.position_ids[0], torch.arange(pad, dtype=row.position_ids.dtype, device=device)]
    )
    # transformers' rule (masking_utils.find_packed_sequence_indices): a sequence starts where the position
    # does not follow the one before
    starts = torch.diff(positions, prepend=positions[:1] - 1) != 1
    edges = torch.arange(size + 1, device=device) * S
    bounds = torch.searchsorted(row.predicts, edges).tolist()  # predicts ascend: each rank's run of them
    mine = slice(bounds[rank], bounds[rank + 1])
    return RowShard(
        input_ids=ids[rank * S : (rank + 1) * S][None],
        position_ids=positions[rank * S : (rank + 1) * S][None],
        sequence_ids=starts.cumsum(0),
        predicts=row.predicts[mine] - rank * S,
        targets=row.targets[:, mine],
        counts=[b - a for a, b in zip(bounds, bounds[1:], strict=False)],
        length=S * size,
        kept=None if row.kept is None else row.kept[:, mine],
    )


class _AllToAll(torch.autograd.Function):
    """x split into N chunks along `scatter` (chunk i to rank i), the chunks received concatenated along
    `gather`; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scatter: int, gather: int, group: Any) -> Tensor:
        ctx.scatter, ctx.gather, ctx.group = scatter, gather, group
        return _all_to_all(x, scatter, gather, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _all_to_all(grad, ctx.gather, ctx.scatter, ctx.group), None, None, None


def _all_to_all(x: Tensor, scatter: int, gather: int, group: Any) -> Tensor:
    size = dist.get_world_size(group)
    sends = [c.contiguous() for c in x.chunk(size, dim=scatter)]
    receives = [torch.empty_like(sends[0]) for _ in range(size)]
    dist.all_to_all(receives, sends, group=group)
    return torch.cat(receives, dim=gather)


class _GatherShares(torch.autograd.Function):
    """The ranks' shares [1, K_r, ...] of a row's values, concatenated in rank order: [1, K, ...] on every
    rank. Every rank then computes the same loss from them, so its own slice of that loss's gradient is its
    share's whole gradient: the backward keeps that slice (no reduction)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, counts: list[int], rank: int, group: Any) -> Tensor:
        ctx.start, ctx.count = sum(counts[:rank]), counts[rank]
        width = max(counts)
        padded = x.new_zeros(x.shape[0], width, *x.shape[2:])
        padded[:, : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:, :n] for p, n in zip(parts, counts, strict=True)], dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad[:, ctx.start : ctx.start + ctx.count].contiguous(), None, None, None


@dataclass
class _Active:
    """The row a model's sequence-parallel forward is running, and how often its attention ran."""

    shard: RowShard
    sp: SequenceGroup
    segments: list[tuple[int, int]]  # the row's packed sequences (RowShard.segments)
    calls: int = 0
    recomputing: bool = False  # the forward is over: only the backward's recomputation may run the row again


#: id(model config) -> its row in flight (the attention layers share their model's config object)
_ACTIVE: dict[int, _Active] = {}


def ulysses_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention contract (q / k / v [B, H, S, D] after RoPE; returns [B, S, H, D]) over the
    sequence ranks: all-to-all to [B, H / N, L, D], attention over the whole row, all-to-all back. Outside a
    sequence-parallel forward (generation, a check on a few tokens) it is segment_sdpa (transformers' sdpa
    but on a padding-free row)."""
    active = _ACTIVE.get(id(module.config))
    # torch.utils.checkpoint tells its recomputation apart the same way: a backward is running (private API)
    if active is not None and active.recomputing and torch._C._current_graph_task_id() == -1:
        active = None
    if active is None:
        return segment_sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(
            f"{type(module).__name__}: sliding-window or soft-capped attention has no sequence-parallel "
            "path; run it with distributed.sequence_parallel=1"
        )
    sp, heads = active.sp, query.shape[1]
    extra = -heads % sp.size
    if extra:
        # H not a multiple of N (SmolLM2's 9 heads over 2 ranks): every KV head repeated for its query heads,
        # then zero heads to a multiple of N; a zero head's output (its values are 0) is dropped below
        key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // key.shape[1])
        query, key, value = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, extra)) for t in (query, key, value))
    else:
        # GQA: repeat each KV head so the KV head count divides N; rank r's H / N query heads then find
        # theirs among the KV heads it receives (H / N query heads over Hkv * m / N KV heads, in order)
        repeat = sp.size // math.gcd(key.shape[1], sp.size)
        key, value = repeat_kv(key, repeat), repeat_kv(value, repeat)
    q, k, v = (_AllToAll.apply(t, 1, 2, sp.group) for t in (query, key, value))  # [B, H / N, L, D]
    share = active.shard.length // sp.size
    if query.shape[2] != share or q.shape[2] != active.shard.length:
        raise RuntimeError(
            f"sequence parallelism: {type(module).__name__} held {query.shape[2]} tokens on rank {sp.rank} "
            f"and attended over {q.shape[2]}, not its share {share} of the row and the row's "
            f"{active.shard.length}"
        )
    active.calls += 1
    groups = q.shape[1] // k.shape[1]
    # each packed sequence on its own, causal: no [L, L] mask (policy/attention.py)
    out = segment_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), active.segments, dropout, scaling
    )  # [B, H / N, L, D]
    out = _AllToAll.apply(out, 2, 1, sp.group)[:, :heads]  # [B, H, S, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, ulysses_attention)
# transformers builds no mask for an attention name it does not know: with segment_sdpa's, the plain forwards
# outside a sequence-parallel one keep their padding masks (a sequence-parallel forward ignores its share's)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, mask_or_segments)


def enable(model) -> None:
    """The model's attention becomes ulysses_attention (transformers' set_attn_implementation): plain sdpa
    outside a sequence-parallel forward, the all-to-all inside one."""
    base = model.get_base_model() if is_lora(model) else model
    base.set_attn_implementation(ATTENTION)


@contextmanager
def running(model, shard: RowShard, sp: SequenceGroup) -> Iterator[None]:
    """The model's attention layers run `shard`'s row while inside; on leaving, every layer must have run the
    Ulysses attention once with the whole row (a silent no-op fails here, naming the model class). A model
    that recomputes its activations in the backward (gradient checkpointing) keeps the row for that backward
    (a forward outside it runs plain sdpa). model: the module, or the DDP wrapper whose forward runs it."""
    model = getattr(model, "module", model)  # DDP: the wrapped model (its forward goes through DDP)
    config = model.config
    active = _Active(shard, sp, shard.segments())
    _ACTIVE[id(config)] = active
    try:
        yield
    finally:
        active.recomputing = True
        if not _checkpointing(model):
            _ACTIVE.pop(id(config), None)
    layers = config.get_text_config().num_hidden_layers
    if active.calls != layers:
        raise RuntimeError(
            f"sequence parallelism: {type(model).__name__} ran the Ulysses attention in {active.calls} of "
            f"its {layers} layers: its attention does not dispatch on config._attn_implementation (call "
            "grpokit.distributed.sequence.enable first), or it cannot run with "
            "distributed.sequence_parallel > 1"
        )


def _checkpointing(model) -> bool:
    return is_checkpointing(model.get_base_model() if is_lora(model) else model)


def sequence_parallel_logprobs(
    model,
    batch: PackedBatch,
    sp: SequenceGroup,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    fused: bool | None = None,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """completion_logprobs(model, batch, padding_free=True) with the row's tokens split over the sequence
    ranks: log-probs [N, T] (and entropies), the same on every rank. Every rank of `sp` calls it with the same
    batch; the model has been through enable."""
    fused = use_fused(model, batch, fused)  # before the row is registered: fused_head may run a small forward
    row = one_row(batch)
    shard = shard_row(row, sp.rank, sp.size)
    predicts, targets, count = shard.predicts, shard.targets, len(shard.predicts)
    if count == 0:  # a rank that predicts nothing still needs a backward through every layer: its all-to-alls
        predicts, targets = predicts.new_zeros(1), targets.new_zeros(1, 1)  # pair with the other ranks'
    with running(model, shard, sp):
        logp, entropy = row_logprobs(
            model,
            shard.input_ids,
            shard.position_ids,
            predicts,
            targets,
            fused=fused,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            kept=shard.kept if count else None,
        )  # [1, K_r] each: this rank's share of the row's completion tokens
    logp, entropy = logp[:, :count], None if entropy is None else entropy[:, :count]
    logp = _GatherShares.apply(logp, shard.counts, sp.rank, sp.group)  # [1, K]
    if entropy is not None:
        entropy = _GatherShares.apply(entropy, shard.counts, sp.rank, sp.group)
    return row.unpack(logp), None if entropy is None else row.unpack(entropy)
