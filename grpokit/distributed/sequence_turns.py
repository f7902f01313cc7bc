"""Sequence parallelism in the loop: the groups of ranks that split rows, and the turns their members take.

    sp = sequence_group(cfg.distributed.sequence_parallel, world, [model, ref])   # None at 1
    for mb, filler, mine in turns(sp, batch, runs):     # every member's micro-batches, in turn
        logp, entropy = policy_logprobs(sp, forward, mb.tokens, **options)
        ...                                              # the loss of mb; metrics only when mine

Every rank rolls out, scores and normalizes its own rows as without sequence parallelism: the data stay
where they are. In a log-prob pass the N members of a group take turns: for each micro-batch index, each
member broadcasts its micro-batch to the group and all N run it as one padding-free row split along its
tokens (grpokit/distributed/sequence.py), each holding 1/N of them. Every member computes the same loss of
that micro-batch from the gathered log-probs, and its backward covers the member's own tokens: over the group
the gradients add up to the micro-batch's, and over the world (DDP / FSDP2 sum the ranks' gradients) to the
global batch's, as without it. So the losses, normalizers and metrics are unchanged; a rank counts the
metrics of its own micro-batches only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from grpokit.data.batch import PackedBatch, RolloutBatch
from grpokit.data.micro_batches import MicroBatching
from grpokit.distributed.sequence import SequenceGroup, enable, sequence_parallel_logprobs
from grpokit.policy import completion_logprobs
from grpokit.policy.loading import AdapterOff


def sequence_group(size: int, world: Any, models: Iterable[Any]) -> SequenceGroup | None:
    """This rank's group of `size` consecutive ranks (a data x sequence DeviceMesh over the world), with the
    models' attention switched to Ulysses; None when size is 1 or the run is one process. Every rank calls it
    once the process group has started (after World.wrap)."""
    if size == 1 or world.size == 1:
        return None
    mesh = init_device_mesh(
        world.device.type, (world.size // size, size), mesh_dim_names=("data", "sequence")
    )
    for model in models:
        if model is not None and not isinstance(model, AdapterOff):  # LoRA's pi_ref is the policy's model
            enable(model)
    return SequenceGroup.from_mesh(mesh, "sequence")


def _broadcast(sp: SequenceGroup, value: Any, member: int) -> Any:
    box = [value if sp.rank == member else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(sp.group, member), group=sp.group)
    return box[0]


def turns(
    sp: SequenceGroup | None, b: RolloutBatch, runs: list[tuple[Tensor, bool]]
) -> Iterator[tuple[RolloutBatch, bool, bool]]:
    """(micro-batch, filler, mine) for each of `runs` (this rank's rows of b and whether each is a filler):
    b.rows of each; with a group, for each run every member's in member order, broadcast from it."""
    for idx, filler in runs:
        mb = b.rows(idx)
        if sp is None:
            yield mb, filler, True
            continue
        for member in range(sp.size):
            got, got_filler = _broadcast(sp, (mb, filler), member)
            yield got, got_filler, member == sp.rank


def policy_logprobs(sp: SequenceGroup | None, forward: Any, tokens: PackedBatch, **options: Any):
    """completion_logprobs(forward, tokens, **options), or with the row split over the group (options of
    completion_logprobs; the row is padding-free either way)."""
    if sp is None:
        return completion_logprobs(forward, tokens, **options)
    options.pop("padding_free", None)
    return sequence_parallel_logprobs(forward, tokens, sp, **options)


@torch.no_grad()
def sequence_parallel_batched_logprobs(
    model: Any, tokens: PackedBatch, batching: MicroBatching, sp: SequenceGroup, *, temperature: float, most
) -> Tensor:
    """batched_logprobs (the pi_old / pi_ref passes) with each micro-batch's row split over the group: the
    members' micro-batches in turn; [N, T] of this rank's rows."""
    if isinstance(model, AdapterOff):
        with model.policy.disable_adapter():
            return sequence_parallel_batched_logprobs(
                model.policy, tokens, batching, sp, temperature=temperature, most=most
            )
    out = torch.zeros(tokens.completion_ids.shape, dtype=torch.float32)
    was_training = model.training
    model.eval()
    try:
        for idx, filler in batching.plan(torch.arange(out.shape[0]), tokens, most):
            for member in range(sp.size):
                sub = _broadcast(sp, tokens.rows(idx), member)
                logp, _ = sequence_parallel_logprobs(model, sub, sp, temperature=temperature)
                if member == sp.rank and not filler:
                    out[idx, : sub.completion_width] = logp.float()
    finally:
        model.train(was_training)
    return out
