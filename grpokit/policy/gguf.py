"""GGUF files (llama.cpp, Ollama) as models: a `.gguf` file, or a folder holding one, wherever grpokit takes a
model path. transformers dequantizes it once; the result is written as a standard Hugging Face folder
(config.json, model.safetensors in fp32, the tokenizer with its chat template) to a cache keyed by the file's
SHA-256, and every later load reads that folder (a few seconds instead of a minute).

    folder = resolve("models/SmolLM2-135M-Instruct.Q4_1.gguf")   # -> ~/.cache/grpokit/gguf/<sha256[:16]>
    resolve("runs/x/final")                                       # anything else: returned unchanged

The cache is $GRPOKIT_CACHE/gguf (default $XDG_CACHE_HOME/grpokit, else ~/.cache/grpokit); deleting a folder
there only costs a new conversion.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("grpokit.policy")

#: the extra that installs what transformers needs to read GGUF files
GGUF_EXTRA = "pip install 'grpokit[gguf]' (or pip install gguf accelerate)"
#: written beside the converted model: where it came from
SOURCE_FILE = "grpokit_gguf.json"


class GGUFError(ValueError):
    """A GGUF path that cannot be used; the message names the config key and the fix."""


def cache_root() -> Path:
    """Where converted models go: $GRPOKIT_CACHE, else $XDG_CACHE_HOME/grpokit, else ~/.cache/grpokit."""
    if os.environ.get("GRPOKIT_CACHE"):
        return Path(os.environ["GRPOKIT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "grpokit"


def gguf_file(name_or_path: str, key: str = "model.name_or_path") -> Path | None:
    """The GGUF file that `name_or_path` names: the file itself (a .gguf name, or GGUF's magic bytes, as in an
    Ollama blob), or the one .gguf in a folder without a config.json; None for anything else (a Hugging Face
    folder or a hub id)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or is_gguf(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise GGUFError(f"{key}={name_or_path!r} holds {len(found)} GGUF files ({names}); name one of them")
    return found[0] if found else None


def is_gguf(path: Path) -> bool:
    """The file starts with GGUF's magic bytes: Ollama keeps its models as GGUF blobs named by their hash."""
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


_HASHES: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256: hash a file once a process


def cached_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = file_sha256(path)
    return _HASHES[key]


_ANNOUNCED: set[Path] = set()


def resolve(name_or_path: str, key: str = "model.name_or_path") -> str:
    """A folder from_pretrained loads: for a GGUF file (or a folder holding one) its converted folder in the
    cache, converted now if it is not there yet; anything else unchanged."""
    gguf = gguf_file(name_or_path, key)
    if gguf is None:
        return name_or_path
    sha = cached_sha256(gguf)
    folder = cache_root() / "gguf" / sha[:16]
    if complete(folder):
        if folder not in _ANNOUNCED:  # the tokenizer and the model load it: say so once
            _ANNOUNCED.add(folder)
            logger.warning("%s: %s is loaded from its converted copy %s", key, gguf.name, folder)
        return str(folder)
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise GGUFError(
            f"{key}={name_or_path!r} is a GGUF file; reading it needs {' and '.join(missing)}: {GGUF_EXTRA}"
        )
    check_whole(gguf, key)
    size_mb = gguf.stat().st_size / 2**20
    logger.warning(
        "%s: converting %s (%.0f MB) to a Hugging Face folder in %s, once (about a minute; later runs "
        "load the folder; $GRPOKIT_CACHE moves the cache)",
        key,
        gguf.name,
        size_mb,
        folder,
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:16]}-", dir=folder.parent))
    try:
        start = time.perf_counter()
        convert(gguf, tmp, key=key)
        (tmp / SOURCE_FILE).write_text(
            json.dumps(
                {
                    "source": str(gguf.resolve()),
                    "sha256": sha,
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
            + "\n"
        )
        # mkdtemp's 0700, and the 0600 transformers gives the weights it writes, would hide a shared cache
        # from other users
        tmp.chmod(0o755)
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        move_into_place(tmp, folder, key)
        _ANNOUNCED.add(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def move_into_place(tmp: Path, folder: Path, key: str) -> None:
    """The converted `tmp` renamed to `folder`, unless another process converted the same file meanwhile
    (theirs is kept); a folder there without its weights (as an earlier version left it under torchrun) is
    replaced."""
    try:
        tmp.rename(folder)
    except OSError:
        if complete(folder):
            return
        if not folder.exists():
            raise
        logger.warning("%s: replacing %s, a conversion without its weights", key, folder)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)


def data_end(gguf: Path) -> int:
    """The size the file must have: where its last tensor's data ends, from the header (metadata and tensor
    list) alone. Raises what gguf's reader raises on a header it cannot read (a file cut inside it)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class Header(GGUFReader):
        def _build_tensors(self, start_offs, fields):  # the sizes only: a cut file has data too short to view
            self.end = start_offs
            for field in fields:
                _, _, _, dims, dtype, offset = field.parts  # as GGUFReader._build_tensors reads them
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(dtype[0]))]
                size = int(np.prod(dims)) * type_size // block
                self.end = max(self.end, start_offs + int(offset[0]) + size)

    return Header(gguf).end


def check_whole(gguf: Path, key: str = "model.name_or_path") -> None:
    """A GGUFError naming a file cut short (an interrupted download or copy) before transformers reads it:
    its reader fails there with a struct.error, or with a reshape error that blames nothing."""
    size, fix = gguf.stat().st_size, "download or copy it again"
    try:
        end = data_end(gguf)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error):  # numpy's words, not the cause
        raise GGUFError(
            f"{key}={str(gguf)!r} is truncated or damaged: its header (metadata and tensor list) cannot be "
            f"read in its {size:,} bytes; {fix}"
        ) from None
    if end > size:
        raise GGUFError(
            f"{key}={str(gguf)!r} is truncated: its tensors end at byte {end:,} but the file has {size:,} "
            f"bytes ({size / end:.0%}); {fix}"
        )


def convert(gguf: Path, out: Path, *, key: str = "model.name_or_path") -> None:
    """Dequantize `gguf` with transformers and write a plain Hugging Face folder (fp32 safetensors, config,
    generation config, tokenizer) to `out`. A model loaded from GGUF refuses save_pretrained, so its weights
    go into a fresh model built from the same config without the quantization entry."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as exc:
        raise GGUFError(
            f"{key}={str(gguf)!r}: transformers could not read this GGUF file ({str(exc).splitlines()[0]}); "
            "its architecture or quantization may not be supported (transformers' GGUF docs list them)"
        ) from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    save(model, tokenizer, out)
    if not complete(out, record=False):
        raise GGUFError(f"{key}={str(gguf)!r}: the conversion wrote no config.json or weights into {out}")


def save(model, tokenizer, out: Path) -> None:
    """save_pretrained of both, by this process whatever its rank: once torch.distributed is initialized,
    transformers writes a model's files on rank 0 only, while every rank converts into a folder of its own
    and any of them may be the one renamed into the cache."""
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def complete(folder: Path, record: bool = True) -> bool:
    """Whether `folder` holds a converted model: its config, its weights, and (`record`) the record of its
    source, written last."""
    return (
        (folder / "config.json").exists()
        and any(folder.glob("*.safetensors"))
        and (not record or (folder / SOURCE_FILE).exists())
    )
