"""How many CPU threads torch uses: `threads=N` in any config, `--threads N` on any command.

    n, why = choose_threads(cfg.threads)        # 0 = auto
    use_threads(cfg.threads)                    # torch.set_num_threads(n); returns "threads: 1 (auto: ...)"
    run_threads(cfg.output_dir)                 # the count a run to be resumed started with (its config.yaml)

torch's default is one thread per core whether or not the cores are free. On a machine shared with
other jobs that is the slowest choice by far: threads that wait for a busy core stall every matmul
(docs/threads.md measures 2-8x on 2 cores). Auto takes OMP_NUM_THREADS when it is set, else the count
of the run being resumed, else the cores that the 1-minute load average says are free, at least 1.
The count changes the order of float reductions, so runs are bit-identical only at the same count:
`grpokit train` records the count it used in output_dir/config.yaml, a resume under auto takes it
from there, and threads=N (or OMP_NUM_THREADS=N) pins it for a new run (docs/threads.md).
"""

from __future__ import annotations

import os
from pathlib import Path


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_threads(
    requested: int,
    *,
    environ: dict | None = None,
    cores: int | None = None,
    load: float | None = None,
    resumed: int = 0,
) -> tuple[int, str]:
    """(threads, why). requested > 0 wins; 0 = OMP_NUM_THREADS when it is a positive int, else `resumed` (the
    count of the run being resumed, run_threads) when > 0, else the free cores: round(cores - 1-minute load
    average), between 1 and cores. environ / cores / load: for tests."""
    if requested > 0:
        return requested, "threads setting"
    env = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    if resumed > 0:
        return resumed, "auto: the count of the run being resumed"
    cores = available_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
    free = max(1, min(cores, round(cores - load)))
    return free, f"auto: {cores} cores, load average {load:.2f}"


def use_threads(requested: int, *, resumed: int = 0) -> str:
    """Set torch's thread count as choose_threads says; returns the line to show at start."""
    import torch

    n, why = choose_threads(requested, resumed=resumed)
    torch.set_num_threads(n)
    return f"threads: {n} ({why}; set threads=N to choose)"


def run_threads(output_dir: str | Path) -> int:
    """The thread count recorded in output_dir/config.yaml (`grpokit train` writes the count it ran at) when
    output_dir holds a checkpoint to resume from; else 0. A resume at another count would not continue the
    run bit for bit: the count changes the order of float sums (docs/threads.md)."""
    import yaml

    from grpokit.checkpoint import latest_checkpoint

    try:
        if latest_checkpoint(Path(output_dir)) is None:
            return 0
        n = (yaml.safe_load((Path(output_dir) / "config.yaml").read_text()) or {}).get("threads", 0)
    except (OSError, yaml.YAMLError, AttributeError):  # unreadable: the run's own checks say why, later
        return 0
    return n if isinstance(n, int) and n > 0 else 0
