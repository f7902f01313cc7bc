"""Checkpoints, one owner: every stateful part of a run saved and restored at any world size, atomically.

    from grpokit.checkpoint.checkpointer import Checkpointer, Weights   # (torch.distributed.checkpoint)
    checkpointer = Checkpointer(out_dir, world, policy=Weights(...), modules={...}, states={...},
                                rank_states={...}, ...)   # rank_states: each rank's own (rollouts in flight)
    checkpointer.save(step)            # the trainer says when; checkpointer.py says how
    checkpointer.load()                # the newest complete checkpoint, or None

    out_dir/checkpoints/step-000050/   model.safetensors, config.json, tokenizer files,
                                       trainer_state.pt (optimizer, scheduler, RNG, data position, step,
                                       the rank states: the rollout batches in flight at max_policy_lag > 0)
                                       COMPLETE (written last)
    out_dir/final/                      the model to load with AutoModelForCausalLM.from_pretrained
    (model.lora: adapter_model.safetensors + adapter_config.json instead of model.safetensors, in both; with
     model.lora.merge_on_save also final/merged/, the base with the adapter merged in: save_final)

A save goes to a temporary folder, is fsynced, gets its COMPLETE marker, and is renamed into place:
a crash during a save leaves the previous checkpoint intact, and a folder without COMPLETE is
never loaded. Older checkpoints are deleted only after a new one is complete, and are first renamed
out of the step-N namespace, so a crash during the deletion cannot leave a half-deleted step-N.
Any failure while writing (a full disk, an unwritable folder) is a CheckpointError.

The rooms: checkpointer.py (the parts, the layouts, save and load), save.py (the atomic write, the listing,
the final model), sharded.py (torch.distributed.checkpoint's shards of several ranks), resume.py (the config
compared with the checkpoint's, the weights and the one adapter loader), run.py (the lock that keeps a second
run out of the folder, RunLock; the random generators; CheckpointError). Nothing outside this folder imports
torch.distributed.checkpoint, writes safetensors for a checkpoint or renames one into place. The package
itself loads neither checkpointer.py nor sharded.py: `import grpokit.checkpoint` stays light (the lock, the
error, the listing), and DCP loads with the Checkpointer.
"""

from __future__ import annotations

from grpokit.checkpoint.resume import (
    FREE_ON_RESUME,
    config_changes,
    load_weights,
    read_adapter,
    read_state,
    resume,
)
from grpokit.checkpoint.run import (
    CheckpointError,
    RunLock,
    ensure_writable_dir,
    rng_state,
    seed_everything,
    set_rng_state,
)
from grpokit.checkpoint.save import (
    DCP_DIR,
    MARKER,
    STATE_FILE,
    checkpoint_dir,
    is_sharded_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
    save_final,
    save_pretrained_atomic,
)

__all__ = [
    "DCP_DIR",
    "FREE_ON_RESUME",
    "MARKER",
    "STATE_FILE",
    "CheckpointError",
    "RunLock",
    "checkpoint_dir",
    "config_changes",
    "ensure_writable_dir",
    "is_sharded_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_weights",
    "read_adapter",
    "read_state",
    "resume",
    "rng_state",
    "save_checkpoint",
    "save_final",
    "save_pretrained_atomic",
    "seed_everything",
    "set_rng_state",
]
