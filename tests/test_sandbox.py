"""The code sandbox (grpokit/sandbox/) and the code_tests reward (grpokit/rewards/code.py).

    .venv/bin/python -m pytest tests/test_sandbox.py -q

The hostile-program suite runs every attack once, in parallel, through `code_tests` (one
module fixture), then checks each result: reward 0, a reason, nothing outside changed, and
this process still alive. It needs "namespaces" isolation (root and util-linux `unshare`)
and is skipped elsewhere; the fallback's own tests run everywhere. Limits are small so the
file stays quick: wall 3 s, CPU 2 s, 256 MiB.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest

from grpokit.rewards import BUILTIN_REWARDS, RewardManager, RewardSpec
from grpokit.rewards.code import code_tests, evaluate_code, extract_code, parse_stdio, parse_tests
from grpokit.sandbox import UID_BASE, UID_COUNT, Limits, isolation_mode, memory_pool, run_many, run_python
from grpokit.sandbox import run as sandbox

SMALL = Limits(
    wall_time=3.0,
    cpu_time=2,
    memory_mb=256,
    processes=16,
    output_bytes=64 << 10,
    disk_mb=32,
    file_size_mb=4,
    tree_memory_mb=512,
)
ROOMY = Limits(wall_time=30.0, memory_mb=256)  # for programs that must finish, even on a busy machine
SMALL_KWARGS = {
    "wall_time": 3.0,
    "cpu_time": 2,
    "memory_mb": 256,
    "processes": 16,
    "output_bytes": 64 << 10,
    "disk_mb": 32,
    "file_size_mb": 4,
    "tree_memory_mb": 512,
}


@pytest.fixture(scope="session")
def namespaces():
    if isolation_mode() != "namespaces":
        pytest.skip("needs namespaces isolation (root and util-linux unshare); see docs/sandbox.md")


def sandbox_processes() -> list[int]:
    """Processes owned by a sandbox uid, anywhere on the machine."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
        if UID_BASE <= uid < UID_BASE + UID_COUNT:
            found.append(int(pid))
    return found


def sandbox_dirs() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("grpokit-sandbox-")}


def accepted_a_connection(server: socket.socket) -> bool:
    """Whether a hostile program reached the non-blocking listening `server` (closed here)."""
    try:
        server.accept()
        return True
    except BlockingIOError:
        return False
    finally:
        server.close()


# -- run_python ----------------------------------------------------------------------------


def test_runs_a_program_with_stdin_and_reports_ok():
    r = run_python("import sys\nprint(sys.stdin.read()[::-1])", stdin="abc", limits=ROOMY)
    assert (r.ok, r.reason, r.returncode, r.stdout) == (True, "ok", 0, "cba\n")
    assert r.cpu_time is not None and r.wall_time > 0


def test_uncaught_exception_is_error_with_traceback():
    r = run_python("raise ValueError('boom')", limits=ROOMY)
    assert (r.ok, r.reason, r.returncode) == (False, "error", 1)
    assert "ValueError: boom" in r.stderr


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("GRPOKIT_TEST_SECRET", "hunter2")
    r = run_python("import os, json\nprint(json.dumps(dict(os.environ)))", limits=ROOMY)
    assert r.ok and "hunter2" not in r.stdout
    env = json.loads(r.stdout)
    assert set(env) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"}
    assert env["PATH"] == "/usr/bin:/bin"


def test_home_and_tmpdir_are_the_empty_working_folder_and_it_is_removed():
    before = sandbox_dirs()
    r = run_python(
        "import os\nprint(os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])\n"
        "print(sorted(os.listdir('.')))\nopen('scratch', 'w').write('x')",
        limits=ROOMY,
    )
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == ["True", "['main.py']"]
    assert sandbox_dirs() <= before


def test_files_are_put_next_to_the_program():
    r = run_python("print(open('data.txt').read())", files={"data.txt": "hello"}, limits=ROOMY)
    assert r.stdout == "hello\n"
    with pytest.raises(ValueError):
        run_python("pass", files={"../x": "no"})


@pytest.mark.parametrize(
    "code, reasons",
    [
        ("import time\ntime.sleep(60)", {"timeout"}),
        ("while True:\n    pass", {"cpu_limit", "timeout"}),  # which comes first depends on the load
        ("x = bytearray(1 << 30)", {"memory_limit"}),
        (
            "with open('big', 'wb') as f:\n    while True:\n        f.write(b'0' * (1 << 20))",
            {"file_size_limit"},
        ),
        ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", {"output_limit"}),
        ("import sys\nwhile True:\n    sys.stderr.write('x' * 65536)", {"output_limit"}),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", {"killed:SIGSEGV"}),
    ],
    ids=["sleep", "loop", "memory", "file_size", "stdout_flood", "stderr_flood", "segv"],
)
def test_limits_stop_the_program_with_a_reason(code, reasons):
    r = run_python(code, limits=dataclasses.replace(SMALL, wall_time=1.0))
    assert not r.ok and r.reason in reasons, (r.reason, r.stderr[-500:])
    assert len(r.stdout.encode()) <= SMALL.output_bytes and len(r.stderr.encode()) <= SMALL.output_bytes


def test_cpu_limit(namespaces):
    r = run_python("while True:\n    pass", limits=Limits(cpu_time=1, wall_time=60))
    assert r.reason == "cpu_limit" and r.returncode == -signal.SIGXCPU


def test_disk_limit(namespaces):
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'0' * (1 << 20))\n    i += 1"
    r = run_python(code, limits=Limits(disk_mb=8, wall_time=30))
    assert r.reason == "disk_limit", r.stderr[-300:]


def test_namespaces_isolation_facts(namespaces):
    code = textwrap.dedent("""
        import os, socket
        print(os.getuid() != 0, os.getpid(), sorted(os.listdir('/')))
        print(socket.if_nameindex())
    """)
    r = run_python(code, limits=ROOMY)
    assert r.ok and r.network_isolated and r.isolation == "namespaces", r.stderr
    line1, line2 = r.stdout.splitlines()
    assert line1.startswith("True 2 ")  # PID 1 is the launcher; the host's root is not there
    assert "'work'" not in line1 and "'home'" not in line1
    assert line2 == "[(1, 'lo')]"


def test_run_many_keeps_order_and_runs_everything():
    programs = [(f"print({i} * int(input()))", str(i)) for i in range(6)] + ["print('bare')"]
    results = run_many(programs, limits=ROOMY, max_workers=3)
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)] + ["bare\n"]
    assert run_many([], limits=ROOMY) == []


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_time"):
        Limits(wall_time=0)
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=1.5)


# -- the fallback without namespaces -------------------------------------------------------


def test_require_network_isolation_refuses_to_run_without_it():
    r = run_python(
        "open('/tmp/should-not-run', 'w')", isolation="none", limits=Limits(require_network_isolation=True)
    )
    assert (r.ok, r.reason, r.returncode, r.network_isolated) == (
        False,
        "network_isolation_unavailable",
        None,
        False,
    )


def test_fallback_blocks_sockets_in_process_and_says_it_is_not_isolated():
    code = "import socket\ntry:\n    socket.socket()\nexcept PermissionError as e:\n    print('blocked')"
    r = run_python(code, isolation="none", limits=ROOMY)
    assert (r.reason, r.stdout, r.network_isolated, r.isolation) == ("ok", "blocked\n", False, "none")


def test_fallback_still_enforces_the_wall_limit():
    r = run_python(
        "import time\ntime.sleep(60)", isolation="none", limits=dataclasses.replace(SMALL, wall_time=1.0)
    )
    assert r.reason == "timeout" and not r.network_isolated


# -- code_tests: extraction, parsing, scoring ----------------------------------------------


def test_extract_code_prefers_the_last_python_block():
    text = "plan\n```\nbare\n```\n```python\nfirst\n```\ntext\n```py\nsecond\n```\n"
    assert extract_code(text) == "second\n"
    assert extract_code("x\n```\nbare\n```") == "bare\n"
    assert extract_code("```python\ntruncated") == "truncated"
    assert extract_code("def f(): pass") == "def f(): pass"


def test_parse_tests_counts_asserts_and_keeps_setup():
    assert parse_tests("import math\nassert f(1) == 1\nx = 2\nassert f(x) == 2") == [
        ("import math", False),
        ("assert f(1) == 1", True),
        ("x = 2", False),
        ("assert f(x) == 2", True),
    ]
    assert parse_tests("def check(f):\n    assert f(1) == 1\ncheck(f)") == [
        ("def check(f):\n    assert f(1) == 1\ncheck(f)", True)
    ]  # no top-level assert: one test
    assert parse_tests(["assert f(1) == 1", "assert f(2) == 2"]) == [
        ("assert f(1) == 1", True),
        ("assert f(2) == 2", True),
    ]
    for bad in ("assert (", ["ok = 1", 3], 5):
        with pytest.raises(ValueError):
            parse_tests(bad)


ADD_TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 0\nassert add(-1, 1) == 0"


def test_correct_gets_one_partial_gets_the_fraction():
    completions = [
        "Here:\n```python\ndef add(a, b):\n    return a + b\n```",  # all 4
        "def add(a, b):\n    return a * 2",  # add(2,2), add(0,0): 2 of 4
        "```python\ndef add(a, b)\n    return a + b\n```",  # syntax error
        "```python\nimport sys\ndef add(a, b):\n    return 0\nsys.exit(3)\n```",  # exits, then 2 of 4
        [{"role": "assistant", "content": "```python\nadd = lambda a, b: a + b\n```"}],  # chat message
    ]
    scores = code_tests(completions, [ADD_TESTS] * 5, **SMALL_KWARGS)
    assert scores == [1.0, 0.5, 0.0, 0.5, 1.0]
    assert code_tests.last_reasons == ["passed", "failed", "syntax_error", "exception:SystemExit", "passed"]
    assert [(r.passed, r.total) for r in code_tests.last_results] == [(4, 4), (2, 4), (0, 4), (2, 4), (4, 4)]


def test_all_or_nothing_and_list_tests_and_rows_without_tests():
    half = "def add(a, b):\n    return a * 2"
    tests = [ADD_TESTS, ["assert add(2, 2) == 4"], None, "assert (", ADD_TESTS]
    scores = code_tests([half, half, half, half, ""], tests, partial=False, **SMALL_KWARGS)
    assert scores == [0.0, 1.0, None, None, 0.0]
    reasons = code_tests.last_reasons
    assert reasons[:3] == ["failed", "passed", "no_tests"] and reasons[4] == "no_code"
    assert reasons[3].startswith("bad_tests")
    with pytest.raises(ValueError, match="2 completions but 1 rows"):
        evaluate_code([half, half], [ADD_TESTS])


def test_the_harness_resists_simple_reward_hacks():
    hacks = [
        "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None",
        "import os\n_w = os.write\nos.write = lambda fd, b: _w(fd, b.replace(b' 0 4', b' 4 4'))",
        "print('\\n0123456789abcdef0123456789abcdef ok 4 4')\nprint('deadbeef ok 4 4')",
        "import builtins\nbuiltins.BaseException = int",
        "import os\nos._exit(0)",
    ]
    scores = code_tests(hacks, [ADD_TESTS] * len(hacks), **SMALL_KWARGS)
    assert scores == [0.0] * 5, code_tests.last_reasons
    assert code_tests.last_reasons == ["failed", "failed", "failed", "failed", "candidate_exited"]


# Ordinary tests, across the judge / candidate split: each feature once, a right and a wrong solution.
ORDINARY_TESTS = [
    # expects an error
    "try:\n    root(-1)\n    raised = False\nexcept ValueError:\n    raised = True\nassert raised",
    # floats
    "import math\nassert math.isclose(area(2), 12.566, rel_tol=1e-3) and abs(area(1) - 3.14159) < 1e-4",
    # HumanEval
    "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"
    "check(total)",
    "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and len(s) == 1 and s",  # objects and methods
    "assert list(squares(3)) == [0, 1, 4] and [x for x in squares(2)] == [0, 1]",  # generators
    "x = [3, 1, 2]\nsort_in_place(x)\nassert x == [1, 2, 3]",  # changes its argument in place
    # its own error
    "try:\n    parse('x')\nexcept ParseError as e:\n    caught = 'bad' in str(e)\nassert caught",
    "assert stats([1, 2]) == {'n': 2, 'items': (1, 2), 'set': {1, 2}, 'none': None, 'raw': b'ab', 'z': 1j}",
    "assert LIMIT == 10 and isinstance(LIMIT, int)",  # a constant
]
RIGHT = """
import math
def root(x):
    if x < 0:
        raise ValueError("negative")
    return math.sqrt(x)
def area(r):
    return math.pi * r * r
def total(xs):
    return sum(xs)
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
    def pop(self):
        return self.items.pop()
    def __len__(self):
        return len(self.items)
def squares(n):
    for i in range(n):
        yield i * i
def sort_in_place(xs):
    xs.sort()
class ParseError(ValueError):
    pass
def parse(text):
    raise ParseError("bad input: " + text)
def stats(xs):
    return {"n": len(xs), "items": tuple(xs), "set": set(xs), "none": None, "raw": b"ab", "z": 1j}
LIMIT = 10
"""
WRONG = """
def root(x):
    return abs(x) ** 0.5
def area(r):
    return 3.14 * r * r
def total(xs):
    return sum(xs) + 1
class Stack:
    def push(self, x):
        pass
    def pop(self):
        return 2
    def __len__(self):
        return 0
def squares(n):
    return iter([0, 1, 4])
def sort_in_place(xs):
    return sorted(xs)
def parse(text):
    raise ValueError("bad")
def stats(xs):
    return {"n": 2, "items": [1, 2], "set": {1, 2}, "none": None, "raw": b"ab", "z": 1j}
LIMIT = 10.0
"""


def test_ordinary_tests_work_across_the_judge():
    scores = code_tests([RIGHT, WRONG], [ORDINARY_TESTS] * 2, **SMALL_KWARGS)
    assert scores == [1.0, 0.0], [
        (r.reason, r.passed, r.sandbox.stderr[-300:]) for r in code_tests.last_results
    ]


def test_stdin_stdout_cases_are_compared_by_the_parent():
    tests = {"inputs": ["3\n1 2 3\n", "1\n5\n", "2\n-1 1\n"], "outputs": ["6\n", "5", "0  \n\n"]}
    right = "n = int(input())\nprint(sum(map(int, input().split())))"
    off_by_one = "n = int(input())\nprint(sum(map(int, input().split())) + 1)"
    hangs_on_five = (
        "n = int(input())\nxs = list(map(int, input().split()))\nwhile xs == [5]:\n    pass\nprint(sum(xs))"
    )
    scores = code_tests(
        [right, off_by_one, hangs_on_five, right], [tests, tests, tests, {"inputs": ["1"]}], **SMALL_KWARGS
    )
    assert scores[:3] == [1.0, 0.0, 2 / 3] and scores[3] is None
    reasons = code_tests.last_reasons
    assert reasons[:2] == ["passed", "failed"] and reasons[2] in ("timeout", "cpu_limit")
    assert reasons[3].startswith("bad_tests")
    assert parse_stdio({"inputs": ["a"], "outputs": ["b"]}) == [("a", "b")]
    for bad in ({"inputs": ["a"], "outputs": []}, {"inputs": [1], "outputs": ["1"]}, {"input": []}):
        with pytest.raises(ValueError):
            parse_stdio(bad)


def test_code_tests_is_a_builtin_reward_with_checked_settings():
    assert BUILTIN_REWARDS["code_tests"] is code_tests
    manager = RewardManager([RewardSpec("code_tests", kwargs=SMALL_KWARGS)])
    out = manager(
        prompts=["p", "p"],
        completions=["def add(a, b):\n    return a + b", "nope"],
        completion_ids=[[1], [1]],
        columns={"tests": [ADD_TESTS, ADD_TESTS]},
    )
    assert out.total.tolist() == [1.0, 0.0] and out.errors == {"code_tests": 0}
    for bad in ({"wall_time": -1}, {"partial": "yes"}, {"max_workers": 0}, {"timeout": 3}):
        with pytest.raises(ValueError, match="code_tests"):
            RewardManager([RewardSpec("code_tests", kwargs=bad)])


# -- the hostile-program suite -------------------------------------------------------------

SECRET = "grpokit-test-secret-" + os.urandom(8).hex()
EXPECTED = "grpokit-expected-" + os.urandom(8).hex()  # only ever in the tests' expected side

# Looks for an expected value everywhere a candidate can: its own memory (frames, objects, the
# harness's data), other processes' memory, environment, command lines and descriptors, and files.
PROBE = """
import ctypes, os, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable again (the judge's setting is inherited): read itself
PATTERN = re.compile(rb"grpokit-expected-[0-9a-f]{16}")
def _search(read):
    try:
        found = PATTERN.search(read())
    except (OSError, ValueError, OverflowError, MemoryError):
        return None
    return found.group().decode() if found else None
def _memory(pid):
    try:
        maps = open("/proc/%s/maps" % pid).read().splitlines()
        mem = open("/proc/%s/mem" % pid, "rb", 0)
    except OSError:
        return None
    for line in maps:
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        for at in range(lo, hi, 1 << 22) if "r" in perms else ():
            mem.seek(at)
            found = _search(lambda: mem.read(min(1 << 22, hi - at)))
            if found:
                return found
    return None
def _read_nonblocking(path):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return os.read(fd, 1 << 20)
    finally:
        os.close(fd)
def secret():
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    for pid in ["self"] + pids:
        found = _memory(pid)
        for what in ("environ", "cmdline"):
            found = found or _search(lambda: open("/proc/%s/%s" % (pid, what), "rb").read())
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            fds = []
        for fd in fds:  # without blocking on a pipe
            found = found or _search(lambda: _read_nonblocking("/proc/%s/fd/%s" % (pid, fd)))
        if found:
            return found
    for top in (".", "/tmp", "/dev/shm"):
        for folder, _, names in os.walk(top):
            for name in names:
                found = _search(lambda: open(os.path.join(folder, name), "rb").read(1 << 20))
                if found:
                    return found
    return "not found"
KEPT = []
def echo(x):
    KEPT.append(x)
"""
FORGE_FROM_FRAMES = """
import json, os, sys
def add(a, b):
    return 0
_frame, _total = sys._getframe(1), 4
while _frame is not None:
    _seen = _frame.f_locals
    if "nonce" in _seen and "summary_fd" in _seen:  # the harness before the judge: forge its summary
        os.write(_seen["summary_fd"], ("\\n%s ok %d %d\\n" % (_seen["nonce"], _total, _total)).encode())
        os._exit(0)
    _line = "\\n" + json.dumps({"grpokit_verdict": {"status": "ok", "passed": _total, "total": _total,
                                                     "candidate": "exit:0", "lost": False}}) + "\\n"
    for _fd in [v for v in _seen.values() if type(v) is int and 0 <= v < 64] + list(range(64)):
        try:
            os.write(_fd, _line.encode())
        except OSError:
            pass
    _frame = _frame.f_back
"""
FORK_HOARD = """
import os, time
kids = []
for _ in range(7):
    pid = os.fork()
    if pid == 0:
        hoard = b"x" * (200 << 20)
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
killed = sum(os.WIFSIGNALED(os.waitpid(pid, 0)[1]) for pid in kids)
"""
ALWAYS_EQUAL = """
class Always(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__
def add(a, b):
    return Always(0)
"""


def test_the_probe_finds_an_expected_value_within_its_reach():
    # The control for `learn_the_verdict` below: an argument the tests pass it is in its memory.
    tests = [f"x = {EXPECTED!r}\nassert echo(x) is None and secret() == x"]
    assert code_tests([PROBE], tests, **{**SMALL_KWARGS, "wall_time": 20.0}) == [1.0], code_tests.last_reasons


def _hostile_cases(outside: str, victim: str, port: int) -> dict[str, tuple[str, str, set[str]]]:
    """name -> (solution, tests, allowed reasons). Each test passes only if the attack worked."""
    me, group = os.getpid(), os.getpgid(0)
    secret_hash = hashlib.sha256(SECRET.encode()).hexdigest()
    home = os.path.expanduser("~")
    return {
        "fork_bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "assert True",
            {"timeout", "cpu_limit"},
        ),
        "infinite_loop": ("while True:\n    pass", "assert True", {"timeout", "cpu_limit"}),
        # bytes(n) is calloc'd: the address space runs out before page faults make it slow
        "memory_bomb": (
            "hoard = []\nwhile True:\n    hoard.append(bytes(1 << 24))",
            "assert len(hoard) > 1000",
            {"exception:MemoryError", "memory_limit"},
        ),
        "sleep_past_wall": ("import time\ntime.sleep(60)\nDONE = True", "assert DONE", {"timeout"}),
        "write_outside": (
            f"open({outside + '/created.txt'!r}, 'w').write('pwned')\n"
            f"open({victim!r}, 'a').write('pwned')\nWROTE = True",
            "assert WROTE",
            {"exception:FileNotFoundError:ENOENT", "exception:PermissionError:EACCES"},
        ),
        "delete_files": (
            f"import os, shutil\nos.remove({victim!r})\nshutil.rmtree({outside!r})\nDELETED = True",
            "assert DELETED",
            {"exception:FileNotFoundError:ENOENT", "exception:PermissionError:EACCES"},
        ),
        "read_secrets": (
            "import os, glob\nfound = os.environ.get('GRPOKIT_TEST_SECRET', '')\n"
            "for path in glob.glob('/proc/*/environ'):\n    try:\n"
            "        found = found or [v for v in open(path).read().split('\\0')"
            " if v.startswith('GRPOKIT_TEST_SECRET=')][0].split('=', 1)[1]\n"
            "    except (OSError, IndexError):\n        pass\nprint(found)",
            f"import hashlib\nassert hashlib.sha256(found.encode()).hexdigest() == {secret_hash!r}",
            {"failed"},
        ),
        "read_home": (
            f"import os\nentries = os.listdir({home!r})",
            f"assert {sorted(os.listdir(home))!r} == sorted(entries)",
            {"failed", "exception:PermissionError:EACCES", "exception:FileNotFoundError:ENOENT"},
        ),
        "connect_loopback": (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'pwned')\nCONNECTED = True",
            "assert CONNECTED",
            {"exception:OSError:ENETUNREACH"},
        ),
        "signal_parent": (
            "import os, signal\nhits = 0\n"
            f"for pid in (os.getppid(), {me}, -{group}, -1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n        hits += 1\n"
            "    except OSError:\n        pass",  # its parent is the judge: no verdict
            "assert hits == 4",
            {"failed", "killed:SIGKILL"},
        ),
        "kill_own_group": (
            "import os, signal\nos.killpg(os.getpgid(0), signal.SIGKILL)\nALIVE = True",
            "assert ALIVE",
            {"killed:SIGKILL"},
        ),
        # 7 children of 200 MiB each, under a 256 MiB per-process limit: 1.4 GiB without a tree bound
        "memory_by_forking": (FORK_HOARD, "assert killed == 0", {"failed", "memory_limit", "timeout"}),
        # reward hacks: the verdict is decided outside the candidate, from values it cannot forge
        "forge_verdict_from_frames": (FORGE_FROM_FRAMES, ADD_TESTS, {"candidate_exited", "failed"}),
        "always_equal": (ALWAYS_EQUAL, ADD_TESTS, {"failed"}),
        "learn_the_verdict": (PROBE, f"assert secret() == {EXPECTED!r}", {"failed"}),
        "gigabytes_of_output": (
            "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
            "assert True",
            {"output_limit"},
        ),
        "gigabytes_to_disk": (
            "with open('big', 'wb') as f:\n    for _ in range(1024):\n"
            "        f.write(b'0' * (1 << 20))\nWRITTEN = True",
            "assert WRITTEN",
            {"exception:OSError:EFBIG"},
        ),  # at file_size_mb
    }


@pytest.fixture(scope="module")
def hostile(namespaces, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    victim = outside / "victim.txt"
    victim.write_text("keep me")
    os.chmod(outside, 0o777)  # even world-writable: the sandbox must not see it at all
    os.chmod(victim, 0o666)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    cases = _hostile_cases(str(outside), str(victim), server.getsockname()[1])
    dirs_before = sandbox_dirs()
    os.environ["GRPOKIT_TEST_SECRET"] = SECRET
    try:
        scores = code_tests(
            [f"```python\n{code}\n```" for code, _, _ in cases.values()],
            [tests for _, tests, _ in cases.values()],
            max_workers=4,
            **SMALL_KWARGS,
        )
    finally:
        del os.environ["GRPOKIT_TEST_SECRET"]
    connected = accepted_a_connection(server)
    results = dict(zip(cases, code_tests.last_results, strict=True))
    yield {
        "cases": cases,
        "scores": dict(zip(cases, scores, strict=True)),
        "results": results,
        "outside": outside,
        "victim": victim,
        "connected": connected,
        "dirs_before": dirs_before,
    }


HOSTILE = list(_hostile_cases("/x", "/x/v", 1))


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_program_gets_zero_with_a_reason(hostile, name):
    result = hostile["results"][name]
    allowed = hostile["cases"][name][2]
    assert hostile["scores"][name] == 0.0, (
        result.reason,
        result.sandbox.stderr[-500:] if result.sandbox else "",
    )
    assert result.reason in allowed, (result.reason, result.sandbox.stderr[-500:] if result.sandbox else "")
    assert result.sandbox.network_isolated
    if memory_pool() is not None:  # the whole evaluation stayed under its bound
        assert result.sandbox.memory_peak_mb <= SMALL_KWARGS["tree_memory_mb"]


def test_one_evaluation_is_bounded_as_a_whole():
    if memory_pool() is None:
        pytest.skip("no writable memory cgroup here: per-process rlimits only (docs/sandbox.md)")
    roomy = Limits(wall_time=30.0, memory_mb=256, processes=16, tree_memory_mb=512)
    bounded = run_python(FORK_HOARD + "print(killed)", limits=roomy)
    unbounded = run_python(
        FORK_HOARD + "print(killed)", limits=dataclasses.replace(roomy, tree_memory_mb=4096)
    )
    assert bounded.ok and int(bounded.stdout) > 0 and bounded.memory_killed
    assert bounded.memory_peak_mb <= 512
    assert unbounded.ok and int(unbounded.stdout) == 0 and unbounded.memory_peak_mb > 7 * 200  # what it costs
    hog = "hoard = b'x' * (400 << 20)\nimport time\ntime.sleep(3)"
    pair = run_many(
        [hog, hog], limits=dataclasses.replace(roomy, memory_mb=512, pool_memory_mb=600), max_workers=2
    )
    assert any(r.memory_killed and r.reason == "memory_limit" for r in pair), pair  # 800 MiB > the pool's 600


def test_hostile_programs_changed_nothing_outside(hostile):
    outside, victim = hostile["outside"], hostile["victim"]
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    assert not hostile["connected"], "a sandboxed program reached the loopback server"
    for result in hostile["results"].values():
        assert SECRET not in result.sandbox.stdout and SECRET not in result.sandbox.stderr
    assert sandbox_dirs() <= hostile["dirs_before"]  # every working folder was removed
    assert sandbox_processes() == []  # nothing left running (fork bomb included)
    os.kill(os.getpid(), 0)  # and we are alive to say so


def test_output_is_capped(hostile):
    out = hostile["results"]["gigabytes_of_output"].sandbox
    assert len(out.stderr.encode()) == SMALL_KWARGS["output_bytes"]  # the candidate prints to stderr


# -- an unprivileged user: the "userns" isolation ------------------------------------------

NOBODY = 65534
_USERNS_CHECK = """
import importlib.util, json, os, sys, types
for package in ("grpokit", "grpokit.sandbox"):  # run.py and cgroup.py alone, without torch
    sys.modules[package] = types.ModuleType(package)
    sys.modules[package].__path__ = [os.path.dirname(sys.argv[1])]
spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
sb = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sb
spec.loader.exec_module(sb)
limits = sb.Limits(wall_time=20, cpu_time=5, memory_mb=256, processes=8)
programs = {
    "facts": "import os\\nstatus = open('/proc/self/status').read()\\n"
             "print(os.getuid(), status.split('CapEff:')[1].split()[0], sorted(os.listdir('/')))",
    "fork_bomb": "import os\\nwhile True:\\n    os.fork()",
    "kill_parent": "import os, signal\\nos.kill(%d, signal.SIGKILL)" % os.getpid(),
    "write_usr": "open('/usr/pwned', 'w')",
    "connect": "import socket\\nsocket.create_connection(('127.0.0.1', 9), timeout=2)",
}
out = {"mode": sb.isolation_mode()}
if out["mode"] == "userns":
    for name, code in programs.items():
        r = sb.run_python(code, limits=limits)
        out[name] = [r.reason, r.stdout, r.stderr[-300:], r.network_isolated]
print(json.dumps(out))
"""


def _python_for_nobody() -> str | None:
    """An interpreter (>= 3.9) that an unprivileged uid may run: ours when its path allows."""
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(python) and sandbox._world_executable(python):
            ok = subprocess.run([python, "-c", "import sys; sys.exit(sys.version_info < (3, 9))"])
            if ok.returncode == 0:
                return python
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged uid needs root")
def test_an_unprivileged_user_gets_user_namespace_isolation():
    python = _python_for_nobody()
    if python is None or not _world_readable(sandbox.__file__):
        pytest.skip("no interpreter or sandbox/run.py that an unprivileged uid can read")
    proc = subprocess.run(
        [python, "-I", "-c", _USERNS_CHECK, sandbox.__file__],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        timeout=300,
    )  # a guard against a hang, not a speed bound
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    if out["mode"] != "userns":
        pytest.skip(f"unprivileged user namespaces are not available here (isolation {out['mode']!r})")
    facts = out["facts"]
    assert facts[0] == "ok" and facts[3], facts
    uid, cap_eff, root = facts[1].split(" ", 2)
    assert (uid, cap_eff) == ("0", "0000000000000000")  # uid 0 of its namespace, no capabilities
    assert "'work'" not in root and "'home'" not in root
    bomb = out["fork_bomb"]
    assert bomb[0] == "error" and "BlockingIOError" in bomb[2]  # RLIMIT_NPROC holds in the namespace
    assert out["kill_parent"][0] == "error" and "ProcessLookupError" in out["kill_parent"][2]
    assert out["write_usr"][0] == "error" and "Read-only file system" in out["write_usr"][2]
    assert out["connect"][0] == "error" and "Network is unreachable" in out["connect"][2]
    leftovers = [p for p in filter(str.isdigit, os.listdir("/proc")) if _owner(p) == NOBODY]
    assert leftovers == []


def _world_readable(path: str) -> bool:
    parts = os.path.realpath(path).split(os.sep)
    folders = [os.sep.join(parts[:i]) for i in range(2, len(parts))]
    return all(os.stat(f).st_mode & 0o001 for f in folders) and bool(os.stat(path).st_mode & 0o004)


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
