"""How many CPU threads torch uses: `threads=N` in any config, `--threads N` on any command.

    n, why = choose_threads(cfg.threads)        # 0 = auto
    use_threads(cfg.threads)                    # torch.set_num_threads(n); returns "threads: 1 (auto: ...)"
    run_threads(cfg.output_dir)                 # the count a run to be resumed started with (its config.yaml)

torch's default is one thread per core whether or not the cores are free. On a machine shared with
other jobs that is the slowest choice by far: threads that wait for a busy core stall every matmul
(docs/threads.md measures 2-8x on 2 cores). Auto takes OMP_NUM_THREADS when it is set, else the count
of the run being resumed, else the cores that other processes leave free now: busy_cores measures the
CPU time the other processes use over a quarter of a second (/proc/stat, sampled twice), at least 1
thread; every core where /proc/stat cannot be read.
The count changes the order of float reductions, so runs are bit-identical only at the same count:
`grpokit train` records the count it used in output_dir/config.yaml, a resume under auto takes it
from there, and threads=N (or OMP_NUM_THREADS=N) pins it for a new run (docs/threads.md).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


WINDOW_S = 0.25  # how long busy_cores watches: long enough for a scheduler tick on every core (4 ms)


def _cpu_jiffies(cpus: set[int] | None) -> tuple[int, int] | None:
    """(busy, total) jiffies summed over the cores in `cpus` (all when None) from /proc/stat; None when it
    cannot be read. Busy: user, nice, system, irq, softirq and steal (time the hypervisor gave to others)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = total = seen = 0
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()) or (
            cpus is not None and int(name[3:]) not in cpus
        ):
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in (fields + ["0"] * 8)[:8])
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
        seen += 1
    return (busy, total) if seen else None


def busy_cores(window: float = WINDOW_S) -> float | None:
    """Cores' worth of CPU time the other processes used over the next `window` seconds (0.0 on an idle
    machine, 1.0 with one process spinning on a core), on the cores this process may run on; None where
    /proc/stat is missing (not Linux). Measured now, not averaged over the last minute as the load average
    is, so a run that has just ended does not count and one that has just started does. This process's own
    CPU time in the window is left out."""
    try:
        cpus: set[int] | None = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = None
    first, own = _cpu_jiffies(cpus), time.process_time()
    if first is None:
        return None
    time.sleep(window)
    second, own = _cpu_jiffies(cpus), time.process_time() - own
    if second is None or second[1] <= first[1]:
        return None
    n = len(cpus) if cpus else available_cores()
    share = (second[0] - first[0]) / (second[1] - first[1])  # of all the cores' time in the window
    return max(0.0, share * n - own / window)


def choose_threads(
    requested: int,
    *,
    environ: dict[str, str] | None = None,
    cores: int | None = None,
    busy: float | None = None,
    resumed: int = 0,
) -> tuple[int, str]:
    """(threads, why). requested > 0 wins; 0 = OMP_NUM_THREADS when it is a positive int, else `resumed` (the
    count of the run being resumed, run_threads) when > 0, else the free cores: cores - busy_cores(), rounded
    half up, between 1 and cores; every core when busy_cores cannot measure. environ / cores / busy: for
    tests (busy < 0: as if not measurable)."""
    if requested > 0:
        return requested, "threads setting"
    env = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    if resumed > 0:
        return resumed, "auto: the count of the run being resumed"
    cores = available_cores() if cores is None else cores
    measured = busy_cores() if busy is None else busy if busy >= 0 else None
    if measured is None:
        return cores, f"auto: {cores} cores, CPU use of other processes unknown"
    free = max(1, min(cores, math.floor(cores - measured + 0.5)))
    return free, f"auto: {cores} cores, {measured:.2f} busy with other processes"


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
