"""torch.distributed for grpokit: launch from torchrun, FSDP2 or DDP, and the whole-batch reductions the math
needs.

    torchrun --nproc_per_node 2 -m grpokit train config.yaml   # one node, two processes (docs/scaling.md)

    # RANK / WORLD_SIZE / LOCAL_RANK from torchrun; unset or 1: one process
    world = World.from_env(cfg)
    # FSDP2 fully_shard per decoder layer then the root, or DDP
    policy = world.wrap(model, ref)
    # this rank's contiguous share of the step's prompts: whole groups
    rows = world.share(sampler.next())
    # all_reduce SUM: the normalizers of the global minibatch's loss
    n_seq, n_tok = world.sum(len(idx), tokens)
    # DDP / FSDP2 average gradients over ranks; the loss is scaled by W
    world.backward(loss)
    world.teardown()

Every rank rolls out and scores whole groups of its share of the prompts, so a group never straddles
ranks and group statistics are local. What is a whole-batch quantity (a batch std, the
loss normalizers, dynamic sampling's "enough kept groups", the gradient and its norm, the logged
metrics) goes through a method here, so the loop reads the same at one rank or many.
At world size 1 nothing here communicates and every method returns what the one process has:
one process never opens a process group.

Collectives are torch.distributed's own (all_reduce, all_gather, broadcast, their *_object forms); the
sharding is FSDP2's fully_shard and the replication DDP's. Checkpoints are grpokit/checkpoint/'s (its
Checkpointer is handed the modules and the ranks). docs/scaling.md has the whole picture.

One module per job: world.py (World: the ranks, the process group, the collectives), signals.py (the stop
signals), parallel.py (FSDP2 / DDP wrapping) and handle.py (the policy's one handle).
"""

from __future__ import annotations

from grpokit.distributed.parallel import Parallel, decoder_layers, is_sharded
from grpokit.distributed.world import REDUCE, World, cat_batches, check_config

__all__ = ["REDUCE", "Parallel", "World", "cat_batches", "check_config", "decoder_layers", "is_sharded"]
