"""A sandbox for running untrusted, model-written Python (code-execution rewards).

    from grpokit.sandbox import Limits, run_python, run_many
    r = run_python("print(input()[::-1])", stdin="abc", limits=Limits(wall_time=5))
    r.ok, r.reason, r.stdout          # True, "ok", "cba\\n"
    results = run_many([(code, stdin), ...], max_workers=4)

Every evaluation is a fresh process tree that is killed whole when it returns. With root and
util-linux `unshare` ("namespaces" isolation, chosen automatically when a probe run works;
"userns" is the same for a non-root user, in a user namespace, with every capability dropped
instead of a uid of its own):

    new network namespace        no interface but a downed loopback: no network at all
    new PID namespace            the program sees only its own processes; killing the sandbox's
                                 PID 1 (our launcher) kills every process it left behind
    new mount namespace + chroot a fresh tmpfs root (size-limited) holding read-only binds of
                                 /usr, the Python installation, a few /etc files and /dev/null,
                                 /dev/zero, /dev/urandom...; the working folder /sandbox is in it.
                                 Host files (the repo, /root, /tmp, /home) are not visible
    new IPC and UTS namespaces   no shared memory or hostname with the host
    a uid of its own             a random unused uid per run: cannot touch root's files, signal
                                 the trainer, or share its RLIMIT_NPROC budget with other runs
    rlimits                      CPU, address space, file size, open files, processes, no core

Without namespaces ("none": no `unshare`, or a kernel or container that forbids them) the program
still runs in its own session with the rlimits, a scrubbed environment and a wall limit, in an
empty temporary folder, as its own uid when we are root; sockets are blocked only by replacing
the `socket` module's classes before the program runs, which a determined program can undo.
SandboxResult.network_isolated says which case a result came from; Limits(require_network_isolation
=True) refuses to run without it (reason "network_isolation_unavailable"). docs/sandbox.md has
the details, each limit's default, and what each hostile program in tests/test_sandbox.py gets.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from grpokit.sandbox.cgroup import MemoryGroup, machine_memory_mb, memory_pool

logger = logging.getLogger("grpokit.rewards")

Isolation = Literal["auto", "namespaces", "userns", "none"]
_NAMESPACE_MODES = ("namespaces", "userns")

#: sandbox uids are drawn at random from [UID_BASE, UID_BASE + UID_COUNT): no real account uses
#: them, so no file on the host belongs to them and no other process shares their NPROC count
UID_BASE = 1_700_000_000
UID_COUNT = 1 << 24


@dataclass(frozen=True)
class Limits:
    """What one evaluation may use. The defaults suit RL rollouts of short programs."""

    wall_time: float = 10.0
    """seconds of real time; then the parent SIGKILLs the whole sandbox (reason "timeout")"""
    cpu_time: int = 10
    """RLIMIT_CPU, seconds per process: SIGXCPU at the limit, SIGKILL a second later ("cpu_limit")"""
    memory_mb: int = 512
    """RLIMIT_AS, MiB of address space per process; Python raises MemoryError ("memory_limit")"""
    file_size_mb: int = 16
    """RLIMIT_FSIZE, MiB per written file; past it writes fail with EFBIG ("file_size_limit")"""
    disk_mb: int = 64
    """size of the tmpfs holding the sandbox's whole writable tree (namespaces isolation only)"""
    open_files: int = 64
    """RLIMIT_NOFILE"""
    processes: int = 8
    """RLIMIT_NPROC: processes and threads, counted per uid: exact with a uid of its own (root) or
    its own user namespace ("userns"); shared with the trainer's count, or absent as root, in "none"."""
    output_bytes: int = 1 << 20
    """cap on each of stdout and stderr; past it the sandbox is killed ("output_limit")"""
    tree_memory_mb: int = 1024
    """memory (RSS, page cache and its tmpfs) of the whole sandbox, every process together: a memory
    cgroup, where one can be made here (grpokit/sandbox/cgroup.py); past it the kernel kills inside
    the sandbox ("memory_limit"). Without a cgroup only the per-process memory_mb holds"""
    pool_memory_mb: int = 0
    """memory of all sandboxes of this process together (their parent cgroup); 0 = half the machine's"""
    require_network_isolation: bool = False
    """refuse to run ("network_isolation_unavailable") when no network namespace is available"""

    def __post_init__(self) -> None:
        for name in (
            "wall_time",
            "cpu_time",
            "memory_mb",
            "file_size_mb",
            "disk_mb",
            "open_files",
            "processes",
            "output_bytes",
            "tree_memory_mb",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Limits.{name} must be a number > 0, got {value!r}")
        for name in (
            "cpu_time",
            "memory_mb",
            "file_size_mb",
            "disk_mb",
            "open_files",
            "processes",
            "output_bytes",
            "tree_memory_mb",
            "pool_memory_mb",
        ):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"Limits.{name} must be an int, got {getattr(self, name)!r}")
        if self.pool_memory_mb < 0:
            raise ValueError(
                f"Limits.pool_memory_mb must be >= 0 (0 = half the machine's), got {self.pool_memory_mb}"
            )


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    """the program ran to the end and exited with status 0 within every limit"""
    returncode: int | None
    """exit status; -N when killed by signal N; None when it never ran"""
    stdout: str
    """at most Limits.output_bytes bytes, decoded as UTF-8 (errors replaced)"""
    stderr: str
    reason: str
    """"ok"; "error" (exited nonzero, e.g. an uncaught exception); "timeout"; "cpu_limit";
    "memory_limit" (exited nonzero after a MemoryError); "file_size_limit"; "disk_limit" (its
    tmpfs is full); "output_limit";
    "killed:SIGSEGV" and the like; "network_isolation_unavailable"; "sandbox_error" (the sandbox
    itself failed; stderr says why). Reasons read from the program's stderr (memory_limit) are
    diagnostics, not proof: the program writes its own stderr."""
    wall_time: float
    """seconds from start to the end of the sandbox"""
    network_isolated: bool
    """the program ran in a network namespace of its own"""
    cpu_time: float | None = None
    """user + system CPU seconds of the program (and children it waited for); None if unknown"""
    isolation: str = "none"
    """"namespaces" (root), "userns" (unprivileged user namespace) or "none"; see the module docstring"""
    memory_peak_mb: float | None = None
    """the most memory the whole sandbox held at once (its cgroup's peak); None without a cgroup"""
    memory_killed: bool = False
    """the kernel killed a process of it at Limits.tree_memory_mb (its cgroup's OOM kill count)"""


# -- the launcher: runs first inside the sandbox, as root where we are root ----------------
# Its source (the functions in _LAUNCHER_FUNCTIONS) is sent with `python -I -S -c`, so they
# import nothing from grpokit and may use only names defined inside them and each other.
# _launcher_main imports every module any of them uses before it mounts or chroots anything;
# the helpers' own imports then only look the modules up in sys.modules.


def _launcher_main() -> None:
    """The launcher's steps, in order: become non-dumpable, set up the sandbox's root and enter
    it, fork the program (limits, uid, exec), wait for it and report its status and CPU time."""
    import ctypes
    import json
    import os
    import resource
    import shutil  # noqa: F401  (for _launcher_build_root, imported before the chroot)
    import signal
    import sys

    cfg = json.loads(sys.argv[1])
    report_fd = cfg["report_fd"]

    def report(**fields):
        os.write(report_fd, json.dumps(fields).encode())

    PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
    libc = ctypes.CDLL(None, use_errno=True)

    # Nobody may ptrace us or open our descriptors (the report pipe) through /proc.
    _launcher_check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")

    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        home = cfg["home"]
        if cfg["mode"] in ("namespaces", "userns"):
            root = _launcher_build_root(cfg, libc, home)
            os.chroot(root)
        os.chdir(home)
    except Exception as e:
        report(error=f"sandbox set-up failed: {type(e).__name__}: {e}")
        os._exit(0)

    pid = os.fork()
    if pid == 0:  # the program: limits, the sandbox uid, then exec
        try:
            os.close(report_fd)
            for name, value in cfg["rlimits"].items():
                resource.setrlimit(getattr(resource, name), (value[0], value[1]))
            if cfg["uid"] is not None:
                os.setgroups([])
                os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
                os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
            elif os.geteuid() == 0:  # "userns", or root without a uid to switch to
                _launcher_drop_capabilities(libc)
            _launcher_check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
            os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
        except BaseException as e:
            os.write(2, f"grpokit sandbox: could not start the program: {type(e).__name__}: {e}\n".encode())
        os._exit(126)

    # Our own wall limit, in case the parent that enforces the real one has died.
    signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
    signal.setitimer(signal.ITIMER_REAL, cfg["wall_time"] + 2.0)
    _, status, usage = os.wait4(pid, 0)
    report(status=status, cpu_time=usage.ru_utime + usage.ru_stime)
    # Exiting as PID 1 of the namespace kills whatever the program left running.


def _launcher_check(ret, what):
    """Raise OSError (with errno) when a libc call returned nonzero."""
    import ctypes
    import os

    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _launcher_build_root(cfg, libc, home):
    """In the sandbox's mount namespace: a fresh size-limited tmpfs holding read-only binds of
    what the program needs, /dev nodes, /tmp, /proc and its home with its files. Returns the
    root, for the caller to chroot into."""
    import os
    import shutil

    MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
    root = os.path.join(cfg["workdir"], "root")
    os.mkdir(root, 0o755)
    _launcher_mount(
        libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mb']}m,nr_inodes=16k,mode=755"
    )
    for path in cfg["binds"]:
        if os.path.lexists(path):
            _launcher_bind(libc, path, root)
    for dev in ("null", "zero", "full", "random", "urandom"):
        _launcher_bind(libc, "/dev/" + dev, root, device=True)
    for path in ("/tmp", "/dev/shm"):
        os.makedirs(root + path, exist_ok=True)
        os.chmod(root + path, 0o1777)
    os.makedirs(root + "/proc")
    try:
        _launcher_mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:  # refused in some user namespaces (a masked /proc); Python needs none
        pass
    os.mkdir(root + home, 0o700)
    for name in cfg["files"]:
        shutil.copyfile(os.path.join(cfg["workdir"], "files", name), root + home + "/" + name)
    if cfg["uid"] is not None:
        for name in [root + home, *(root + home + "/" + n for n in cfg["files"])]:
            os.chown(name, cfg["uid"], cfg["gid"])
    return root


def _launcher_mount(libc, src, dst, fstype, flags, data=None):
    import ctypes
    import os

    args = [None if a is None else os.fsencode(a) for a in (src, dst, fstype, data)]
    _launcher_check(
        libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {src} on {dst}"
    )


def _launcher_bind(libc, src, root, device=False):
    """Bind host path `src` read-only at the same path under `root` (a symlink is copied)."""
    import os

    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
    MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
    MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
    dst = root + src
    if os.path.islink(src):  # /bin -> usr/bin on merged-/usr systems
        os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
        if not os.path.lexists(dst):
            os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
        open(dst, "a").close()
    _launcher_mount(libc, src, dst, None, MS_BIND | MS_REC)
    # Read-only; in a user namespace the source's noexec and atime flags are locked, so keep them.
    f_flag = os.statvfs(src).f_flag
    keep = [
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ]
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if device else MS_NODEV)
    _launcher_mount(libc, None, dst, None, flags | sum(ms for st, ms in keep if f_flag & st))


def _launcher_drop_capabilities(libc):
    # For a program that stays uid 0 (of its user namespace in "userns"): no capabilities
    # now, none regained by exec (SECBIT_NOROOT), none addable later (empty bounding set).
    import ctypes

    PR_CAPBSET_DROP, PR_SET_SECUREBITS = 24, 28
    _launcher_check(libc.prctl(PR_SET_SECUREBITS, 0x2F, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):
        _launcher_check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "prctl(PR_CAPBSET_DROP)")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _launcher_check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")


_LAUNCHER_FUNCTIONS = (
    _launcher_main,
    _launcher_check,
    _launcher_build_root,
    _launcher_mount,
    _launcher_bind,
    _launcher_drop_capabilities,
)
_LAUNCHER_SOURCE = "\n\n".join(inspect.getsource(f) for f in _LAUNCHER_FUNCTIONS) + "\n_launcher_main()\n"

# Runs before the program in "none" isolation: the weak, in-process stand-in for a network
# namespace. A program can undo it (ctypes, the original class in socket.socket.__mro__,
# a child `python` without it); docs/sandbox.md says so.
_NO_SOCKET_PREAMBLE = """\
import _socket, socket, sys
class _NoNetwork(socket.socket):
    def __init__(self, *args, **kwargs):
        raise PermissionError(1, "network access is disabled in the grpokit sandbox")
def _no_network(*args, **kwargs):
    raise PermissionError(1, "network access is disabled in the grpokit sandbox")
socket.socket = socket.SocketType = _socket.socket = _socket.SocketType = _NoNetwork
for _name in ("socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo"):
    setattr(socket, _name, _no_network)
del _socket, socket, _NoNetwork, _no_network, _name
sys.argv = sys.argv[1:]
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# -- choosing the isolation ------------------------------------------------------------------

_mode_lock = threading.Lock()
_detected: str | None = None
_uids_in_use: set[int] = set()
_uid_lock = threading.Lock()


def _python() -> str:
    """The real interpreter (not a venv's symlink): with -I -S it needs only its own prefix."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _uid_range_mapped(first: int, count: int) -> bool:
    try:
        with open("/proc/self/uid_map") as f:
            rows = [tuple(map(int, line.split())) for line in f if line.strip()]
    except OSError:
        return False
    return any(inside <= first and first + count <= inside + n for inside, _, n in rows)


def _world_executable(path: str) -> bool:
    """Can an unrelated uid run this file (every folder above it searchable, the file r-x)?"""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001:
            return False
    return os.stat(path).st_mode & 0o005 == 0o005


def _can_drop_uid(mode: str) -> bool:
    if mode == "userns" or os.geteuid() != 0 or not _uid_range_mapped(UID_BASE, UID_COUNT):
        return False
    # In the namespaces' own root we create the folders above the bound interpreter (mode 755),
    # so any interpreter will do; in "none" the uid must reach it on the host (pyenv under a
    # 700 /root does not).
    return mode == "namespaces" or _world_executable(_python())


def isolation_mode(requested: Isolation = "auto") -> str:
    """The isolation runs get: the one asked for, or (auto) "namespaces" as root and "userns"
    otherwise when a probe run works here, else "none". Detected once per process and logged."""
    global _detected
    if requested in ("namespaces", "userns", "none"):
        return requested
    if requested != "auto":
        raise ValueError(f"isolation must be 'auto', 'namespaces', 'userns' or 'none', got {requested!r}")
    with _mode_lock:
        if _detected is None:
            _detected, why = _probe()
            log = logger.info if _detected in _NAMESPACE_MODES else logger.warning
            log("code sandbox isolation: %s (%s)", _detected, why)
        return _detected


def _probe() -> tuple[str, str]:
    if shutil.which("unshare") is None:
        return "none", "util-linux `unshare` not found; see docs/sandbox.md"
    mode: Isolation = "namespaces" if os.geteuid() == 0 else "userns"
    r = run_python("print('probe')", limits=Limits(wall_time=30.0), isolation=mode)
    if r.ok and r.stdout == "probe\n":
        who = "a uid of its own" if mode == "namespaces" else "uid 0 of a user namespace without capabilities"
        return mode, f"network, PID, mount, IPC and UTS namespaces, chroot, {who}"
    detail = (r.stderr.strip().splitlines() or [r.reason])[-1]
    return "none", f"{mode} isolation failed its probe run: {detail}; see docs/sandbox.md"


# -- one run -------------------------------------------------------------------------------


def _binds() -> list[str]:
    """Host paths bound read-only into the sandbox root (besides /dev nodes)."""
    paths = [
        "/usr",
        "/bin",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/sbin",
        "/etc/ld.so.cache",
        "/etc/localtime",
        "/etc/passwd",
        "/etc/group",
        "/etc/nsswitch.conf",
    ]
    for extra in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(_python())):
        extra = os.path.realpath(extra)
        if not any(extra == p or extra.startswith(p.rstrip("/") + "/") for p in paths):
            paths.append(extra)
    return paths


def _allocate_uid() -> int:
    with _uid_lock:
        while True:
            uid = UID_BASE + secrets.randbelow(UID_COUNT)
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` ("none" isolation: what escaped the session)."""
    code = "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n"
    try:
        subprocess.run(
            [_python(), "-I", "-S", "-c", code],
            user=uid,
            group=uid,
            extra_groups=[],
            env={},
            timeout=10,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        logger.warning("could not kill the leftover processes of sandbox uid %d", uid, exc_info=True)


def _rlimits(limits: Limits, own_uid: bool) -> dict[str, tuple[int, int]]:
    mib = 1 << 20
    out = {
        "RLIMIT_CPU": (limits.cpu_time, limits.cpu_time + 1),
        "RLIMIT_AS": (limits.memory_mb * mib, limits.memory_mb * mib),
        "RLIMIT_FSIZE": (limits.file_size_mb * mib, limits.file_size_mb * mib),
        "RLIMIT_NOFILE": (limits.open_files, limits.open_files),
        "RLIMIT_CORE": (0, 0),
    }
    # RLIMIT_NPROC counts every process and thread of the real uid (per user namespace), and
    # root ignores it. own_uid: a uid of its own, or uid 0 of a user namespace of its own.
    if own_uid:
        out["RLIMIT_NPROC"] = (limits.processes, limits.processes)
    elif os.geteuid() != 0:  # shared with the trainer: allow what the uid already runs, plus ours
        nproc = _tasks_of_uid(os.getuid()) + limits.processes
        out["RLIMIT_NPROC"] = (nproc, nproc)
    return out


def _tasks_of_uid(uid: int) -> int:
    """Threads of all processes whose real uid is `uid` (what RLIMIT_NPROC counts), best effort."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return total


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: Limits = Limits(),
    files: Mapping[str, str | bytes] | None = None,
    isolation: Isolation = "auto",
) -> SandboxResult:
    """Run `code` as a Python program (stdlib only: `python -I -S -B`) in a fresh sandbox.

    stdin: the program's standard input. files: extra files ({name: content}) put next to the
    program in its working folder. isolation: "auto" (namespaces when they work here), or force
    "namespaces" / "userns" / "none". Never raises for anything the program does.
    """
    mode = isolation_mode(isolation)
    isolated = mode in _NAMESPACE_MODES
    if limits.require_network_isolation and not isolated:
        return SandboxResult(False, None, "", "", "network_isolation_unavailable", 0.0, False, None, mode)
    for name in files or {}:
        if not name or "/" in name or name in (".", "..", "main.py"):
            raise ValueError(f"files: {name!r} is not a plain file name other than main.py")

    start = time.monotonic()
    uid = _allocate_uid() if _can_drop_uid(mode) else None
    workdir = tempfile.mkdtemp(prefix="grpokit-sandbox-")  # mode 700, ours
    try:
        return _run(code, stdin, limits, dict(files or {}), mode, uid, workdir, start)
    except Exception as e:  # our own failure, not the program's
        logger.warning("code sandbox failed", exc_info=True)
        return SandboxResult(
            False,
            None,
            "",
            f"grpokit sandbox: {type(e).__name__}: {e}",
            "sandbox_error",
            time.monotonic() - start,
            isolated,
            None,
            mode,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            with _uid_lock:
                _uids_in_use.discard(uid)


def _run(
    code: str, stdin: str, limits: Limits, files: dict, mode: str, uid: int | None, workdir: str, start: float
) -> SandboxResult:
    isolated = mode in _NAMESPACE_MODES
    files = {"main.py": code, **files}
    home = _write_files(files, workdir, isolated, uid)
    python = _python()
    report_r, report_w = os.pipe()
    argv = _sandbox_argv(python, mode, limits, workdir, home, sorted(files), uid, report_w)
    group = _memory_group(limits)
    try:
        proc = _start(group.wrap(argv) if group else argv, stdin, workdir, report_r, report_w)
        try:
            out, err, report, stopped = _collect(proc, report_r, limits, start)
        finally:
            _stop(proc, isolated, uid)
    finally:
        peak, killed = (group.peak_mb(), group.oom_kills() > 0) if group else (None, False)
        if group:
            group.remove()
    wall = time.monotonic() - start
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    try:
        info = json.loads(report) if report else {}
    except ValueError:
        info = {"error": f"unreadable launcher report {report[:200]!r}"}
    cpu_time = info.get("cpu_time")
    status = info.get("status")
    returncode = None
    if status is not None:
        returncode = os.waitstatus_to_exitcode(status)
    reason, stderr = _reason(stopped, info, returncode, cpu_time, stderr, proc.returncode, limits)
    if killed and reason not in ("ok", "timeout", "output_limit"):
        reason = "memory_limit"
    return SandboxResult(
        reason == "ok", returncode, stdout, stderr, reason, wall, isolated, cpu_time, mode, peak, killed
    )


def _memory_group(limits: Limits) -> MemoryGroup | None:
    """A cgroup of tree_memory_mb for one run, under the pool (whose limit is set here), or None."""
    pool = memory_pool()
    if pool is None:
        return None
    try:
        pool.set_limit(limits.pool_memory_mb or machine_memory_mb() // 2)
    except OSError:  # below what the running sandboxes hold: keep the old limit
        logger.debug("could not set the sandbox pool's memory limit", exc_info=True)
    return pool.child(limits.tree_memory_mb)


def _write_files(files: dict, workdir: str, isolated: bool, uid: int | None) -> str:
    """Write the program's files ({name: content}, main.py included) where it will find them;
    returns its working folder as the program sees it (its HOME)."""
    if isolated:  # the launcher copies these into the sandbox's own root
        os.mkdir(os.path.join(workdir, "files"))
        home = "/sandbox"
        file_dir = os.path.join(workdir, "files")
    else:  # the program works in this very folder
        home = file_dir = workdir
    for name, content in files.items():
        with open(os.path.join(file_dir, name), "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    if uid is not None and not isolated:
        for name in [workdir, *(os.path.join(workdir, n) for n in files)]:
            os.chown(name, uid, uid)
    return home


def _sandbox_argv(
    python: str,
    mode: str,
    limits: Limits,
    workdir: str,
    home: str,
    file_names: list[str],
    uid: int | None,
    report_w: int,
) -> list[str]:
    """The command line that starts the sandbox: the launcher with its configuration, wrapped in
    `unshare` for the namespace modes."""
    isolated = mode in _NAMESPACE_MODES
    program_argv = [python, "-I", "-S", "-B", "main.py"]
    if not isolated:
        program_argv = [python, "-I", "-S", "-B", "-c", _NO_SOCKET_PREAMBLE, "main.py"]
    env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }
    cfg = {
        "mode": mode,
        "workdir": workdir,
        "home": home,
        "files": file_names,
        "binds": _binds(),
        "disk_mb": limits.disk_mb,
        "uid": uid,
        "gid": uid,
        "report_fd": report_w,
        "rlimits": _rlimits(limits, own_uid=uid is not None or mode == "userns"),
        "argv": program_argv,
        "env": env,
        "wall_time": limits.wall_time,
    }
    argv = [python, "-I", "-S", "-B", "-c", _LAUNCHER_SOURCE, json.dumps(cfg)]
    if isolated:
        user = ["--user", "--map-root-user"] if mode == "userns" else []
        argv = [
            "unshare",
            *user,
            "--net",
            "--pid",
            "--mount",
            "--ipc",
            "--uts",
            "--fork",
            "--kill-child",
            "--propagation",
            "private",
            "--",
            *argv,
        ]
    return argv


def _start(argv: list[str], stdin: str, workdir: str, report_r: int, report_w: int) -> subprocess.Popen:
    """Start the sandbox in a session of its own, `stdin` as its standard input. Closes our copy of
    the report pipe's write end whatever happens, and the read end too if the start fails."""
    stdin_file = None
    if stdin:  # an unlinked file: the program reads it through the descriptor only
        stdin_file = tempfile.TemporaryFile()
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
    try:
        return subprocess.Popen(
            argv,
            stdin=stdin_file or subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(report_w,),
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
            cwd=workdir,
        )
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)
        if stdin_file is not None:
            stdin_file.close()


def _reason(
    stopped: str | None,
    info: dict,
    returncode: int | None,
    cpu_time: float | None,
    stderr: str,
    launcher_exit: int | None,
    limits: Limits,
) -> tuple[str, str]:
    """SandboxResult.reason for a run, and its stderr with the sandbox's own complaint added, if any.

    stopped: what _collect stopped it for; info: the launcher's report; launcher_exit: the exit
    status of the sandbox's top process (`unshare`, or the launcher in "none")."""
    if stopped:
        reason = stopped
    elif "error" in info:
        reason, stderr = "sandbox_error", stderr + "grpokit sandbox: " + info["error"] + "\n"
    elif returncode is None:
        reason = "sandbox_error"
        stderr += f"grpokit sandbox: the launcher ended without a report (exit {launcher_exit})\n"
    elif returncode == 0:
        reason = "ok"
    elif returncode == -signal.SIGXCPU or (
        returncode == -signal.SIGKILL and cpu_time is not None and cpu_time >= limits.cpu_time
    ):
        reason = "cpu_limit"
    elif returncode == -signal.SIGXFSZ:
        reason = "file_size_limit"
    elif returncode < 0:
        reason = "killed:" + _signal_name(-returncode)
    elif _last_line(stderr).startswith("MemoryError"):
        reason = "memory_limit"
    elif "[Errno 27]" in _last_line(stderr):  # EFBIG: Python ignores SIGXFSZ, so writes fail
        reason = "file_size_limit"
    elif "[Errno 28]" in _last_line(stderr):  # ENOSPC: the sandbox's tmpfs is full
        reason = "disk_limit"
    else:
        reason = "error"
    return reason, stderr


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _collect(
    proc: subprocess.Popen, report_r: int, limits: Limits, start: float
) -> tuple[bytes, bytes, bytes, str | None]:
    """Read stdout, stderr (each up to the cap) and the launcher's report until the sandbox
    ends or a limit stops it. Returns (stdout, stderr, report, reason it was stopped or None)."""
    cap = limits.output_bytes
    assert proc.stdout is not None and proc.stderr is not None  # started with stdout=PIPE, stderr=PIPE
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), report_r: bytearray()}
    deadline = start + limits.wall_time
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    stopped = None
    try:
        while sel.get_map() and stopped is None:
            now = time.monotonic()
            if report_r not in sel.get_map():
                # The launcher has exited: what is left is output in flight, or (in "none"
                # isolation) a descendant that escaped and holds the pipes open. Grace period.
                deadline = min(deadline, now + 0.5)
            if now >= deadline:
                if report_r in sel.get_map():
                    stopped = "timeout"
                break
            for key, _ in sel.select(deadline - now):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                room = (1 << 16 if key.fd == report_r else cap) - len(buf)
                buf += data[: max(room, 0)]
                if len(data) > room and key.fd != report_r:
                    stopped = "output_limit"
                    break
    finally:
        sel.close()
        os.close(report_r)
        proc.stdout.close()
        proc.stderr.close()
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), bytes(bufs[report_r]), stopped


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN
        return []


def _exited(pid: int, block: bool) -> bool:
    """Has our child `pid` ended? WNOWAIT leaves it unreaped, so its process group id cannot
    be reused by an unrelated process before we kill the group."""
    flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
    try:
        return os.waitid(os.P_PID, pid, flags) is not None
    except ChildProcessError:
        return True


def _stop(proc: subprocess.Popen, isolated: bool, uid: int | None) -> None:
    """End the sandbox and everything in it; on return no process of it is left.

    namespaces: SIGKILL the launcher (PID 1 of the namespace); the kernel kills every other
    process in the namespace and waits for them before the launcher becomes a zombie, and
    `unshare` (our child) exits only once it has reaped the launcher. "none": the session's
    process group, then (with a uid of its own) every process of that uid.
    """
    if isolated and not _exited(proc.pid, block=False):
        launchers = _children(proc.pid)
        for pid in launchers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if launchers:
            _exited(proc.pid, block=True)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None and not isolated:
        _kill_uid(uid)
    proc.wait()


# -- many runs -----------------------------------------------------------------------------


def run_many(
    programs: Iterable[str | tuple[str, str]],
    *,
    limits: Limits = Limits(),
    max_workers: int | None = None,
    files: Iterable[Mapping[str, str | bytes] | None] | None = None,
    isolation: Isolation = "auto",
) -> list[SandboxResult]:
    """run_python over many programs ((code, stdin) pairs or bare code), at most `max_workers`
    sandboxes at a time (default: the number of CPUs, at most 8). Results keep the input order."""
    items = [(p, "") if isinstance(p, str) else tuple(p) for p in programs]
    file_sets = list(files) if files is not None else [None] * len(items)
    if len(file_sets) != len(items):
        raise ValueError(f"files has {len(file_sets)} entries for {len(items)} programs")
    if not items:
        return []
    isolation_mode(isolation)  # detect once, before the threads race to do it
    workers = max_workers or min(8, os.cpu_count() or 1)
    if workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="sandbox") as pool:
        futures = [
            pool.submit(run_python, code, stdin=stdin, limits=limits, files=fs, isolation=isolation)
            for (code, stdin), fs in zip(items, file_sets, strict=True)
        ]
        return [f.result() for f in futures]
