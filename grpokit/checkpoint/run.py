"""What a run holds in its output folder while it runs: the folder (writable, and locked against a second run)
and the random generators it seeds, saves with each checkpoint and restores on resume.

    ensure_writable_dir(out)          # before anything starts: a folder files can be written to
    with RunLock(out):
        seed_everything(cfg.seed)
        ...
    state = rng_state(); set_rng_state(state)   # Python's, NumPy's, torch's (and CUDA's) generators

CheckpointError is the error of the run's folder: a checkpoint that cannot be written or read
(grpokit/checkpoint/), a folder that is not writable or is in use by another run.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


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
