"""Checkpoints written atomically: Hugging Face weights (safetensors), tokenizer and trainer state in a
temporary folder, fsynced, marked COMPLETE, renamed into place; older ones removed only after (see
grpokit/checkpoint/__init__.py for the layout and the guarantees)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from grpokit.checkpoint.run import CheckpointError, rng_state

STATE_FILE = "trainer_state.pt"
MARKER = "COMPLETE"
DCP_DIR = "dcp"  # a run on several processes: torch.distributed.checkpoint's shards (sharded.py)
_STEP_DIR = re.compile(r"^step-(\d+)$")


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
        for stale in (*dest.parent.glob(f".tmp-{dest.name}-*"), *dest.parent.glob(f".old-{dest.name}-*")):
            shutil.rmtree(stale)  # left by a process killed during an earlier save of dest
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
    except Exception as exc:  # OSError, but safetensors and torch.save report a full disk as their own errors
        shutil.rmtree(tmp, ignore_errors=True)
        why = _save_failure(exc)
        raise CheckpointError(
            f"could not save to {str(dest)!r}: {why} (free disk space or make output_dir writable; "
            "earlier checkpoints are untouched)"
        ) from exc
    return dest


def save_final(model, tokenizer, dest: Path, *, merge: bool = False) -> Path:
    """out_dir/final: the model (a LoRA policy: its adapter) and tokenizer; merge (model.lora.merge_on_save):
    also dest/merged, the base weights with the adapter merged in (peft's merge_and_unload on a copy: the
    run's model keeps its adapter), a plain checkpoint that from_pretrained loads without peft."""
    dest = save_pretrained_atomic(model, tokenizer, dest)
    if merge and hasattr(model, "merge_and_unload"):
        import copy

        save_pretrained_atomic(
            _untie_adapted_head(copy.deepcopy(model)).merge_and_unload(), tokenizer, Path(dest) / "merged"
        )
    return dest


def _untie_adapted_head(peft_model):
    """An LM head with an adapter that shares its weight with the input embeddings (tie_word_embeddings) gets
    a weight of its own before the merge: merging into the shared tensor would change the embeddings too (peft
    warns of this when it adapts a tied layer without ensure_weight_tying)."""
    base = peft_model.get_base_model()
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    inner = getattr(head, "base_layer", None)  # a peft LoRA layer wraps the original Linear
    if inner is not None and embed is not None and inner.weight.data_ptr() == embed.weight.data_ptr():
        inner.weight = torch.nn.Parameter(inner.weight.detach().clone(), requires_grad=False)
        for config in {id(c): c for c in (base.config, base.config.get_text_config())}.values():
            config.tie_word_embeddings = False
    return peft_model


def _save_failure(exc: BaseException) -> str:
    """Why a save failed, in words: torch.save reports a full disk as a writer assertion
    ("[enforce fail at inline_container.cc:...] . unexpected pos N vs M"), not as ENOSPC."""
    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    if "unexpected pos" in text or "inline_container" in text:
        return f"No space left on device (torch's writer stopped short: {text.strip()})"
    return getattr(exc, "strerror", None) or text


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


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives: out_dir/checkpoints/step-NNNNNN."""
    return Path(out_dir) / "checkpoints" / f"step-{step:06d}"


def save_checkpoint(out_dir: Path, step: int, model, tokenizer, state: dict, keep_last: int) -> Path:
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    path = save_pretrained_atomic(
        model, tokenizer, checkpoint_dir(out_dir, step), {**state, "step": step, "rng": rng_state()}
    )
    for _, old in list_checkpoints(out_dir)[:-keep_last]:
        _remove(old)
    for stale in (*root.glob(".tmp-*"), *root.glob(".old-*")):  # left by a crash during an earlier save
        shutil.rmtree(stale, ignore_errors=True)
    return path


def _remove(path: Path) -> None:
    """Delete a checkpoint folder: rename it out of step-N first (atomic), then delete the files."""
    doomed = path.parent / f".old-{path.name}-{os.getpid()}"
    try:
        path.rename(doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def latest_checkpoint(out_dir: Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete checkpoint under out_dir, or None."""
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def is_sharded_checkpoint(path: Path) -> bool:
    """A checkpoint that several ranks wrote with torch.distributed.checkpoint (not model.safetensors)."""
    return (Path(path) / DCP_DIR / ".metadata").is_file()
