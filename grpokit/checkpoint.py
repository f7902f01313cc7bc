"""Checkpoints: Hugging Face weights (safetensors) + trainer state, written atomically.

    out_dir/checkpoints/step-000050/   model.safetensors, config.json, tokenizer files,
                                       trainer_state.pt (optimizer, scheduler, RNG, data position, step)
                                       COMPLETE (written last)
    out_dir/final/                      the model to load with AutoModelForCausalLM.from_pretrained

A save goes to a temporary folder, is fsynced, gets its COMPLETE marker, and is renamed into place:
a crash during a save leaves the previous checkpoint intact, and a folder without COMPLETE is
never loaded. Older checkpoints are deleted only after a new one is complete.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says where and what to do."""


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_pretrained_atomic(model, tokenizer, dest: Path, extra_state: dict | None = None) -> Path:
    """Write model + tokenizer (+ trainer state) to dest atomically; returns dest."""
    dest = Path(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra_state is not None:
            torch.save(extra_state, tmp / STATE_FILE)
        (tmp / MARKER).write_text("ok\n")
        _fsync_tree(tmp)
        if dest.exists():
            old = dest.parent / f".old-{dest.name}-{os.getpid()}"
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dest)
        fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not save to {str(dest)!r}: {exc.strerror or exc} (free disk space or make output_dir writable; "
            "earlier checkpoints are untouched)"
        ) from None
    return dest


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under out_dir/checkpoints, oldest first."""
    root = Path(out_dir) / "checkpoints"
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / MARKER).is_file() and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(out_dir: Path, step: int, model, tokenizer, state: dict, keep_last: int) -> Path:
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    path = save_pretrained_atomic(model, tokenizer, root / f"step-{step:06d}", {**state, "step": step, "rng": rng_state()})
    for _, old in list_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by a crash during an earlier save
        shutil.rmtree(stale, ignore_errors=True)
    return path


def load_checkpoint(path: Path, model) -> dict:
    """Load weights into model (in place) and return the trainer state saved with them."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {str(path)!r} has no safetensors weights; delete it to start from the one before")
    weights = {}
    for f in files:
        weights.update(load_file(f))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied weights (lm_head = embed_tokens) are saved once; anything else missing is an error.
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if really_missing or unexpected:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match the model: missing {really_missing[:3]}, unexpected {unexpected[:3]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return torch.load(path / STATE_FILE, weights_only=False)
