"""Checkpoints: Hugging Face weights (safetensors) + trainer state, written atomically.

    out_dir/checkpoints/step-000050/   model.safetensors, config.json, tokenizer files,
                                       trainer_state.pt (optimizer, scheduler, RNG, data position, step)
                                       COMPLETE (written last)
    out_dir/final/                      the model to load with AutoModelForCausalLM.from_pretrained
    (model.lora: adapter_model.safetensors + adapter_config.json instead of model.safetensors, in both; with
     model.lora.merge_on_save also final/merged/, the base with the adapter merged in: save_final)

A save goes to a temporary folder, is fsynced, gets its COMPLETE marker, and is renamed into place:
a crash during a save leaves the previous checkpoint intact, and a folder without COMPLETE is
never loaded. Older checkpoints are deleted only after a new one is complete, and are first renamed
out of the step-N namespace, so a crash during the deletion cannot leave a half-deleted step-N.
Any failure while writing (a full disk, an unwritable folder) is a CheckpointError.

save.py writes and lists checkpoints; resume.py continues from the newest (the config compared, the weights
loaded, the generators restored); grpokit/checkpoint_sharded.py writes and reads the ones several ranks
write. The stop signals of a run (`StopSignals`: SIGTERM / SIGINT finish the step, save, and stop), the lock
that keeps a second run out of the folder (`RunLock`) and the random generators live in grpokit/run.py; their
names are importable from here too.
"""

from __future__ import annotations

from grpokit.checkpoint.resume import (
    FREE_ON_RESUME,
    config_changes,
    load_weights,
    read_state,
    resume,
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
from grpokit.run import (
    CheckpointError,
    RunLock,
    StopSignals,
    ensure_writable_dir,
    rng_state,
    seed_everything,
    set_rng_state,
)

__all__ = [
    "DCP_DIR",
    "FREE_ON_RESUME",
    "MARKER",
    "STATE_FILE",
    "CheckpointError",
    "RunLock",
    "StopSignals",
    "checkpoint_dir",
    "config_changes",
    "ensure_writable_dir",
    "is_sharded_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_weights",
    "read_state",
    "resume",
    "rng_state",
    "save_checkpoint",
    "save_final",
    "save_pretrained_atomic",
    "seed_everything",
    "set_rng_state",
]
