"""Memory bounds for whole sandboxes: a memory cgroup per evaluation, under one for the pool.

    pool = memory_pool()                    # None where no writable memory cgroup exists here
    pool.set_limit(limit_mb)                # all sandboxes of this process together
    group = pool.child(limit_mb)            # one evaluation: every process it starts, and its tmpfs
    argv = group.wrap(argv)                 # the command joins the group before it execs
    ...                                     # run it; when it is over:
    group.peak_mb(), group.oom_kills()
    group.remove()

Per-process rlimits (RLIMIT_AS) bound each process; a program that forks still multiplies them.
A cgroup bounds the sum: past its limit the kernel's OOM killer kills inside the group only.
cgroup v2 (`memory.max`, `memory.peak`, `memory.events`) is used where the process's own cgroup
can delegate the memory controller; else cgroup v1 (`memory.limit_in_bytes`, ...); else None,
and the sandbox keeps only its rlimits (docs/sandbox.md has the numbers).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time

logger = logging.getLogger("grpokit.rewards")
MIB = 1 << 20


class MemoryGroup:
    """One cgroup directory with a memory limit (v1 or v2 file names)."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, version

    def _file(self, v2: str, v1: str) -> str:
        return os.path.join(self.path, v2 if self.version == 2 else v1)

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, v2: str, v1: str) -> str:
        with open(self._file(v2, v1)) as f:
            return f.read()

    def set_limit(self, limit_mb: int) -> None:
        if self.version == 2:
            self._write("memory.max", str(limit_mb * MIB))
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                self._write("memory.swap.max", "0")
        else:
            self._write("memory.limit_in_bytes", str(limit_mb * MIB))
            if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                self._write("memory.memsw.limit_in_bytes", str(limit_mb * MIB))  # no swap either

    def wrap(self, argv: list[str]) -> list[str]:
        """argv, started by a shell that first moves itself (and so all it execs and forks) here."""
        procs = os.path.join(self.path, "cgroup.procs")
        return ["/bin/sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", procs, *argv]

    def peak_mb(self) -> float | None:
        try:
            return int(self._read("memory.peak", "memory.max_usage_in_bytes")) / MIB
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        try:
            text = self._read("memory.events", "memory.oom_control")
        except OSError:
            return 0
        fields = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(fields.get("oom_kill", 0))

    def remove(self) -> None:
        for attempt in range(50):  # the last processes may take a moment to leave
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02 * (attempt + 1))
        logger.warning("could not remove the sandbox cgroup %s", self.path)


class MemoryPool(MemoryGroup):
    """The parent of this process's sandbox cgroups."""

    _names = itertools.count()

    def child(self, limit_mb: int) -> MemoryGroup:
        group = MemoryGroup(os.path.join(self.path, f"run-{next(self._names)}"), self.version)
        os.mkdir(group.path)
        try:
            group.set_limit(limit_mb)
        except OSError:
            group.remove()
            raise
        return group


_lock = threading.Lock()
_pool: list[MemoryPool | None] = []


def memory_pool() -> MemoryPool | None:
    """This process's pool cgroup, made on first use (and removed at exit), or None."""
    with _lock:
        if not _pool:
            _pool.append(_make_pool())
        return _pool[0]


def _make_pool() -> MemoryPool | None:
    name = f"grpokit-sandboxes-{os.getpid()}"
    for version, base in _own_cgroups():
        _remove_stale(base)
        pool = MemoryPool(os.path.join(base, name), version)
        if version == 2:  # let our children have the controller (refused where we have siblings)
            try:
                MemoryGroup(base, 2)._write("cgroup.subtree_control", "+memory")
            except OSError:
                pass
        try:
            os.mkdir(pool.path)
            if version == 2:
                pool._write("cgroup.subtree_control", "+memory")
            child = pool.child(64)  # a probe: can we make and limit a group here?
            child.remove()
        except OSError as e:
            logger.debug("no sandbox cgroup under %s: %s", base, e)
            try:
                os.rmdir(pool.path)
            except OSError:
                pass
            continue
        atexit.register(pool.remove)
        logger.info("code sandbox memory: cgroup v%d under %s", version, base)
        return pool
    logger.info("code sandbox memory: no writable memory cgroup here; per-process rlimits only")
    return None


def _remove_stale(base: str) -> None:
    """Pools left by processes that were killed (kill -9 skips atexit): empty, so rmdir works."""
    try:
        names = [n for n in os.listdir(base) if n.startswith("grpokit-sandboxes-")]
    except OSError:
        return
    for name in names:
        pid = name.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            pool = os.path.join(base, name)
            for child in [os.path.join(pool, c) for c in os.listdir(pool) if c.startswith("run-")]:
                MemoryGroup(child, 0).remove()
            MemoryGroup(pool, 0).remove()


def _own_cgroups() -> list[tuple[int, str]]:
    """(version, directory) of this process's memory cgroups that could hold children: v2 first."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    found = []
    for fields in mounts:
        sep = fields.index("-")
        fstype, options, point = fields[sep + 1], fields[-1].split(","), fields[4]
        for hid, controllers, path in lines:
            if fstype == "cgroup2" and hid == "0" and controllers == "":
                directory = point + path.rstrip("/")
                try:
                    with open(os.path.join(directory, "cgroup.controllers")) as f:
                        if "memory" in f.read().split():
                            found.append((2, directory))
                except OSError:
                    pass
            elif fstype == "cgroup" and "memory" in options and "memory" in controllers.split(","):
                found.append((1, point + path.rstrip("/")))
    return sorted(found, key=lambda vd: -vd[0])


def machine_memory_mb() -> int:
    """MemTotal, in MiB (or 4096 where /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        pass
    return 4096
