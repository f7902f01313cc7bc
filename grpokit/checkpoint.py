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

Resuming (`resume`), the stop signals of a run (`StopSignals`: SIGTERM / SIGINT finish the step,
save, and stop) and the lock that keeps a second run out of the folder (`RunLock`) live here too.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
MARKER = "COMPLETE"
DCP_DIR = (
    "dcp"  # a run on several processes: torch.distributed.checkpoint's shards (grpokit/checkpoint_sharded.py)
)
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says where and what to do."""


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (what rng_state saves and set_rng_state
    restores)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


def ensure_writable_dir(path: str | Path) -> Path:
    """Create path if needed and check that files can be written there: called before a run starts."""
    path = Path(path)
    probe = path / f".write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok\n")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(
            f"output_dir {str(path)!r} is not a writable folder ({exc.strerror or exc}: "
            f"{exc.filename or path}); set output_dir to a folder you can write to"
        ) from None
    return path


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
    issue 2777)."""
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


def load_weights(path: Path, model) -> None:
    """Load a checkpoint's weights into model (in place)."""
    from safetensors.torch import load_file

    path = Path(path)
    if hasattr(
        model, "peft_config"
    ):  # model.lora: the checkpoint holds the adapter (PeftModel.save_pretrained)
        return _load_adapter(path, model)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no safetensors weights; delete it to start from the one before"
        )
    weights = {}
    try:
        for f in files:
            weights.update(load_file(f))
    except Exception as exc:  # SafetensorError, OSError: a damaged file
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({_why(exc)}); delete it to resume from the one before"
        ) from None
    refit = "resume with the model it was trained from, or set a new output_dir"
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # shape mismatches raise even with strict=False
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the model ({_why(exc)}); {refit}"
        ) from None
    # Tied weights (lm_head = embed_tokens) are saved once; anything else missing is an error.
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    really_missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if really_missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the model: missing {really_missing[:3]}, unexpected "
            f"{unexpected[:3]}; {refit}"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _load_adapter(path: Path, model) -> None:
    """A LoRA checkpoint's adapter weights into the peft model (the base weights came from
    model.name_or_path)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no adapter_model.safetensors, but model.lora is set; "
            "resume with the config it was trained with, or set a new output_dir"
        )
    try:
        weights = load_file(file)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({_why(exc)}); delete it to resume from the one before"
        ) from None
    result = set_peft_model_state_dict(model, weights)
    if unexpected := getattr(result, "unexpected_keys", None):
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the adapter: unexpected {unexpected[:3]}; "
            "resume with the model and model.lora it was trained with, or set a new output_dir"
        )


def read_state(path: Path) -> dict:
    """The trainer state saved with a checkpoint (optimizer, schedule, sampler, RNG, step, config)."""
    try:
        return torch.load(path / STATE_FILE, weights_only=False)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({_why(exc)}); delete it to resume from the one before"
        ) from None


def _why(exc: BaseException) -> str:
    """The telling line of an exception message (torch puts the size mismatch on the second line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "mismatch" in line), lines[0] if lines else type(exc).__name__)


def latest_checkpoint(out_dir: Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete checkpoint under out_dir, or None."""
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


#: Config keys that may change on resume without a word: they change neither the math nor the data stream
#: (the reward time limit and the bad-step guard only decide when to stop waiting, warn or stop; the
#: distributed strategy only how the same math is laid out over the ranks).
FREE_ON_RESUME = (
    "output_dir",
    "threads",
    "logging",
    "eval",
    "checkpoint",
    "distributed",
    "reward_timeout",
    "reward_slow_warning",
    "reward_error_fraction",
    "stop_after_bad_steps",
    "rollout.vllm_server_url",
    "rollout.vllm_server_timeout",
)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _defaults() -> dict[str, Any]:
    from grpokit.config import Config, SFTConfig

    return {**_flat(SFTConfig().model_dump()), **_flat(Config().model_dump())}


def config_changes(saved: dict, now: dict, allowed: list[str]) -> tuple[list[str], list[str]]:
    """(refused, allowed) differences between a checkpoint's config and this run's, as "key: old -> new";
    keys under FREE_ON_RESUME are not compared, `allowed` keys (or sections) may change. A key missing
    from the checkpoint's config (saved by an older grpokit) counts only when this run sets it off its
    default."""
    old, new, defaults = _flat(saved), _flat(now), _defaults()

    def under(key, names):
        return any(key == n or key.startswith(n + ".") for n in names)

    diffs = [(k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    # A key the checkpoint's grpokit did not have yet, left at its default, is the behaviour of then: no
    # change.
    diffs = [(k, a, b) for k, a, b in diffs if k in old or k not in defaults or b != defaults[k]]
    diffs = [(k, a, b) for k, a, b in diffs if not under(k, FREE_ON_RESUME)]

    def text(d):
        return f"{d[0]}: {d[1]!r} -> {d[2]!r}"

    return [text(d) for d in diffs if not under(d[0], allowed)], [
        text(d) for d in diffs if under(d[0], allowed)
    ]


def resume(
    out_dir: Path, model, config: dict, allowed: list[str], load=None
) -> tuple[int, dict, list[str]] | None:
    """Continue from the newest complete checkpoint: compare its config with this run's `config` (a
    difference outside FREE_ON_RESUME and `allowed` is a CheckpointError listing every one), load its
    weights into model and restore the RNGs. Returns (step, the trainer state, the allowed changes as
    "key: old -> new"), or None when out_dir holds no checkpoint. load(path, state): how this process loads
    the weights and generators (World.load_checkpoint: a checkpoint that ranks wrote, or one process's at
    several ranks; the moments too); None: a one-process checkpoint into one process."""
    found = latest_checkpoint(out_dir)
    if found is None:
        return None
    step, path = found
    state = read_state(path)
    saved = state.get("config") or _recorded_config(
        Path(out_dir)
    )  # checkpoints before 0.1.x: the run's config.yaml
    refused, changed = config_changes(saved, config, allowed) if saved is not None else ([], [])
    if refused:
        keys = ",".join(r.split(":")[0] for r in refused)
        raise CheckpointError(
            f"{str(path)!r} was saved with another config ({'; '.join(refused)}); resume with the same "
            "config, give this run a new output_dir, or let them change with "
            f"checkpoint.allow_changes=[{keys}]"
        )
    if changed:
        print(f"resuming with changes allowed by checkpoint.allow_changes: {'; '.join(changed)}")
    if load is not None:  # the trainer's World: weights, moments and generators, one process or several ranks
        load(path, state)
    elif is_sharded_checkpoint(path):
        raise CheckpointError(
            f"{str(path)!r} holds sharded weights (torch.distributed.checkpoint); resume it with `grpokit "
            "train`"
        )
    else:
        load_weights(path, model)
        set_rng_state(state["rng"])
    return step, state, changed


def is_sharded_checkpoint(path: Path) -> bool:
    """A checkpoint that several ranks wrote with torch.distributed.checkpoint (not model.safetensors)."""
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def _recorded_config(out_dir: Path) -> dict | None:
    import yaml

    try:
        return yaml.safe_load((out_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None


class StopSignals:
    """SIGTERM / SIGINT while a run is inside: the first is remembered (`received`, the signal's name) so that
    the loop finishes its step, saves and stops; a second one stops at once (KeyboardInterrupt), except
    inside `protecting()`: a save in progress finishes first, says so, and then the run stops.
    The previous handlers are restored on exit.

        with StopSignals() as stop:
            while ...:
                ...
                with stop.protecting("the save of step 3"):
                    save()
                if stop.received: return
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}
        self._protecting: str | None = None  # what must not be cut short now
        self._again: str | None = None  # a second signal that arrived while protecting

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
        elif self._protecting is not None:  # finish what is in progress, then stop (see protecting)
            self._again = name
        else:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt

    @contextmanager
    def protecting(self, what: str):
        """A second signal inside this block waits for it to end; then the run stops (KeyboardInterrupt)
        with a line that says what was finished."""
        self._protecting = what
        try:
            yield
        finally:
            self._protecting = None
        if self._again is not None:
            print(f"{self._again} again during {what}: it finished; stopping now", flush=True)
            raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        self.received = self._again = None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class RunLock:
    """One run per output_dir: an exclusive lock (flock) on output_dir/.grpokit.lock for the whole run.

    A second run on the same folder stops at once with CheckpointError naming the holder (pid, host, start
    time, as the holder wrote them). The kernel drops the lock when its process ends however it ends
    (kill -9 included), so a lock file left behind never blocks a later run. flock is local to a machine:
    two hosts writing to one network folder are not stopped.
    """

    FILE = ".grpokit.lock"

    def __init__(self, out_dir: str | Path):
        self.out = Path(out_dir)
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        import fcntl
        import socket
        import time

        path = ensure_writable_dir(self.out) / self.FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = (
                os.read(fd, 4096).decode("utf-8", "replace").strip()
                or "a process that has not written its name yet"
            )
            os.close(fd)
            raise CheckpointError(
                f"output_dir {str(self.out)!r} is in use by another run ({holder}); wait for it to finish, "
                "stop it, or give this run another output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd,
            (
                f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            ).encode(),
        )
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None
