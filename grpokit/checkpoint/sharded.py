"""Checkpoints of a run on several processes: torch.distributed.checkpoint (DCP), sharded, atomic, and
resumable on another world size.

    out_dir/checkpoints/step-000050/   dcp/            every rank's shards of the weights and AdamW's moments
                                                       (.metadata + one __R_0.distcp file per rank), by name
                                       rng-R.pt        rank R's Python / NumPy / torch generators
                                       rank_states-R.pt  rank R's own states (its rollouts in flight)
                                       trainer_state.pt  schedule, data position, step, config (rank 0)
                                       tokenizer files, COMPLETE (written last)

    save_sharded(out_dir, step, modules, tokenizer, state, keep_last, ranks, mine)   # every rank calls it
    load_sharded(path, modules, rank=rank, seed=seed, step=step)   # at any world size: DCP reshards
    load_rank_states(path, rank)           # rank R's own states (checkpointer.py: at the writer's world size)

modules: {name: (module, its optimizer or None)}; the policy is "model" (its moments "optim"), pi_ref "ref",
the critic "critic" (its moments "critic_optim"). checkpointer.py decides what goes in.

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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from grpokit.checkpoint.resume import _why
from grpokit.checkpoint.run import CheckpointError, rng_state, seed_everything, set_rng_state
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


def _rng_file(path: Path, rank: int) -> Path:
    return Path(path) / f"rng-{rank}.pt"


def _rank_states_file(path: Path, rank: int) -> Path:
    return Path(path) / f"rank_states-{rank}.pt"


#: {name: (module, its optimizer or None)}: what a sharded checkpoint holds, by DCP key.
Modules = dict[str, tuple[torch.nn.Module, "torch.optim.Optimizer | None"]]


def _optim_key(name: str) -> str:
    """The DCP key of a module's moments: the policy's are "optim" (its weights "model"), others'
    name_optim."""
    return "optim" if name == "model" else f"{name}_optim"


def save_sharded(
    out_dir: Path,
    step: int,
    modules: Modules,
    tokenizer,
    state: dict,
    keep_last: int,
    ranks,
    mine: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of `step` from every rank (a collective: all ranks call it with the same step).
    `modules`: the weights (and moments) that go into the DCP shards; `state`: rank 0's trainer state, which
    holds none of them; `mine`: this rank's own states (rank_states-R.pt). ranks: rank, size, is_main and
    barrier() (grpokit's World)."""
    dest, root = checkpoint_dir(out_dir, step), Path(out_dir) / "checkpoints"
    tmp = root / f".tmp-{dest.name}-sharded"
    try:
        if ranks.is_main:
            for stale in (
                *root.glob(".tmp-*"),
                *root.glob(".old-*"),
            ):  # left by a crash during an earlier save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        ranks.barrier()
        dcp.save(
            _shards(modules), checkpoint_id=tmp / DCP_DIR
        )  # every rank writes its shards; rank 0 the metadata
        torch.save(rng_state(), _rng_file(tmp, ranks.rank))
        torch.save(mine or {}, _rank_states_file(tmp, ranks.rank))
        ranks.barrier()
        if ranks.is_main:
            torch.save(
                {**state, "step": step, "rng": rng_state(), "world_size": ranks.size}, tmp / STATE_FILE
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
        if ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not save to {str(dest)!r} on rank {ranks.rank}: {_save_failure(exc)} (free disk space or "
            "make output_dir writable; earlier checkpoints are untouched)"
        ) from exc
    ranks.barrier()  # every rank returns once the checkpoint is in place
    return dest


def _shards(modules: Modules, saved: set[str] | None = None) -> dict[str, Any]:
    """Each module's state dict (DTensor shards under FSDP2) and its optimizer's, by DCP key; given `saved`
    (the keys a checkpoint holds), only those: what dcp.load fills."""
    shards: dict[str, Any] = {}
    for name, (module, optimizer) in modules.items():
        if saved is None or name in saved:
            shards[name] = get_model_state_dict(module)
        if optimizer is not None and (saved is None or _optim_key(name) in saved):
            shards[_optim_key(name)] = get_optimizer_state_dict(module, optimizer)
    return shards


def load_sharded(path: Path, modules: Modules, *, rank: int, seed: int, step: int) -> None:
    """Load a sharded checkpoint into this rank's modules, whatever the world size that wrote it: each
    module's weights, and its optimizer's moments when an optimizer is given, for the keys the checkpoint
    holds (pi_ref only after a reset); restore this rank's generators (or seed them when the writer had fewer
    ranks)."""
    reader = dcp.FileSystemReader(Path(path) / DCP_DIR)
    try:
        saved = {key.split(".", 1)[0] for key in reader.read_metadata().state_dict_metadata}
        shards = _shards(modules, saved | {"model"})  # the policy's weights are always there
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
    for name, (module, optimizer) in modules.items():
        if name in shards:
            set_model_state_dict(module, shards[name])
        if optimizer is not None and _optim_key(name) in shards:
            set_optimizer_state_dict(module, optimizer, shards[_optim_key(name)])
    if _rng_file(path, rank).is_file():
        set_rng_state(torch.load(_rng_file(path, rank), weights_only=False))
    else:
        seed_everything(hash((seed, rank, step)) % 2**31)


def load_rank_states(path: Path, rank: int) -> dict[str, Any] | None:
    """Rank `rank`'s own states in a sharded checkpoint, or None when it holds none (written before they were
    kept)."""
    file = _rank_states_file(path, rank)
    return torch.load(file, weights_only=False) if file.is_file() else None
