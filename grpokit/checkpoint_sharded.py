"""Checkpoints of a run on several processes: torch.distributed.checkpoint (DCP), sharded, atomic, and
resumable on another world size.

    out_dir/checkpoints/step-000050/   dcp/            every rank's shards of the weights and AdamW's moments
                                                       (.metadata + one __R_0.distcp file per rank), by name
                                       rng-R.pt        rank R's Python / NumPy / torch generators
                                       trainer_state.pt  schedule, data position, step, config (rank 0)
                                       tokenizer files, COMPLETE (written last)

    save_sharded(out_dir, step, model, adamw, tokenizer, state, keep_last, world)   # every rank calls it
    load_sharded(path, model, adamw, rank)   # at any world size, one process included: DCP reshards

The weights and moments are saved by parameter name (torch.distributed.checkpoint.state_dict), as
DTensor shards under FSDP2 and whole tensors under DDP or in one process, so a checkpoint written by W
ranks loads at W' ranks: DCP reads each rank's part of every tensor, whatever the layout that wrote it.
The save is atomic as checkpoint/save.py's: every rank writes into one temporary folder (on a filesystem
that every node sees), rank 0 fsyncs it, writes COMPLETE and renames it into place; a folder without
COMPLETE is never loaded. A rank that resumes without its own generators' file (more ranks than
wrote the checkpoint) seeds them from (seed, rank, step).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from grpokit.checkpoint.resume import _why
from grpokit.checkpoint.save import (
    DCP_DIR,
    MARKER,
    STATE_FILE,
    _fsync_tree,
    _remove,
    _save_failure,
    checkpoint_dir,
    list_checkpoints,
)
from grpokit.run import CheckpointError, rng_state, seed_everything, set_rng_state


def _rng_file(path: Path, rank: int) -> Path:
    return Path(path) / f"rng-{rank}.pt"


def _barrier(world) -> None:
    if world.size > 1:
        dist.barrier()


def save_sharded(
    out_dir: Path,
    step: int,
    model,
    adamw: torch.optim.Optimizer,
    tokenizer,
    state: dict,
    keep_last: int,
    world,
    ref=None,
    critic=None,
) -> Path:
    """Write the checkpoint of `step` from every rank (a collective: all ranks call it with the same step).
    `state` is rank 0's trainer state without the optimizer's moments (those go into the DCP shards); `ref`:
    pi_ref, when it is no longer the initial weights (ref_policy=reset), saved with them; `critic`: PPO's
    (value model, its AdamW), its weights and moments saved with them too."""
    dest, root = checkpoint_dir(out_dir, step), Path(out_dir) / "checkpoints"
    tmp = root / f".tmp-{dest.name}-sharded"
    try:
        if world.is_main:
            for stale in (
                *root.glob(".tmp-*"),
                *root.glob(".old-*"),
            ):  # left by a crash during an earlier save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier(world)
        dcp.save(
            _shards(model, adamw, ref, critic), checkpoint_id=tmp / DCP_DIR
        )  # every rank writes its shards; rank 0 the metadata
        torch.save(rng_state(), _rng_file(tmp, world.rank))
        _barrier(world)
        if world.is_main:
            torch.save(
                {**state, "step": step, "rng": rng_state(), "world_size": world.size}, tmp / STATE_FILE
            )
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            (tmp / MARKER).write_text("ok\n")
            _fsync_tree(tmp)
            if dest.exists():
                _remove(dest)
            tmp.rename(dest)
            fd = os.open(root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            for _, old in list_checkpoints(out_dir)[:-keep_last]:
                _remove(old)
    except Exception as exc:  # OSError, or DCP's CheckpointException wrapping one
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not save to {str(dest)!r} on rank {world.rank}: {_save_failure(exc)} (free disk space or "
            "make output_dir writable; earlier checkpoints are untouched)"
        ) from exc
    _barrier(world)  # every rank returns once the checkpoint is in place
    return dest


def _shards(model, adamw, ref, critic) -> dict[str, Any]:
    """What a sharded checkpoint holds, by key: the weights and moments, pi_ref's weights, the critic's."""
    shards = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, adamw)}
    if ref is not None:
        shards["ref"] = get_model_state_dict(ref)
    if critic is not None:
        shards["critic"] = get_model_state_dict(critic[0])
        shards["critic_optim"] = get_optimizer_state_dict(*critic)
    return shards


def load_sharded(
    path: Path,
    model,
    adamw: torch.optim.Optimizer | None,
    *,
    rank: int,
    seed: int,
    step: int,
    ref=None,
    critic=None,
) -> None:
    """Load a sharded checkpoint's weights (and, given adamw, its moments; given ref, pi_ref when the
    checkpoint holds one; given critic, PPO's (value model, AdamW) weights and moments) into this rank's
    modules, whatever the world size that wrote it; restore this rank's generators (or seed them when the
    writer had fewer ranks)."""
    reader = dcp.FileSystemReader(Path(path) / DCP_DIR)
    try:
        saved = {
            key.split(".", 1)[0] for key in reader.read_metadata().state_dict_metadata
        }  # "model", "optim", "ref"
        shards: dict[str, Any] = {"model": get_model_state_dict(model)}  # what dcp.load fills
        if adamw is not None:
            shards["optim"] = get_optimizer_state_dict(model, adamw)
        if ref is not None and "ref" in saved:
            shards["ref"] = get_model_state_dict(ref)
        if critic is not None and "critic" in saved:
            shards["critic"] = get_model_state_dict(critic[0])
            if adamw is not None:
                shards["critic_optim"] = get_optimizer_state_dict(*critic)
        with (
            warnings.catch_warnings()
        ):  # one process without a process group is a case this module means to serve
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
            )
            dcp.load(shards, storage_reader=reader)  # DCP reshards: each rank reads its part of every tensor
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({_why(exc)}); resume with the model it was trained "
            "from, or delete it to resume from the one before"
        ) from None
    set_model_state_dict(model, shards["model"])
    if adamw is not None:
        set_optimizer_state_dict(model, adamw, shards["optim"])
    if "ref" in shards:
        set_model_state_dict(ref, shards["ref"])
    if "critic" in shards:
        set_model_state_dict(critic[0], shards["critic"])
    if "critic_optim" in shards:
        set_optimizer_state_dict(critic[0], critic[1], shards["critic_optim"])
    if _rng_file(path, rank).is_file():
        set_rng_state(torch.load(_rng_file(path, rank), weights_only=False))
    else:
        seed_everything(hash((seed, rank, step)) % 2**31)
