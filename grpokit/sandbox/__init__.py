"""Running untrusted, model-written Python: a fresh, isolated process tree per run, killed whole when it
returns. The code_tests reward (grpokit/rewards/code.py) and the python tool (grpokit/tools/builtin.py) run
their programs here.

    from grpokit.sandbox import Limits, run_python, run_many
    r = run_python("print(input()[::-1])", stdin="abc", limits=Limits(wall_time=5))
    r.ok, r.reason, r.stdout          # True, "ok", "cba\\n"

run.py      the sandbox: namespaces, a uid of its own, rlimits (Limits), the result (SandboxResult)
cgroup.py   the memory cgroups that bound a whole sandbox's memory, where the machine allows them
harness.py  the judge program code_tests runs in the sandbox, which forks the candidate (HARNESS: its path)

docs/sandbox.md has the details. Nothing here imports torch or another part of grpokit.
"""

from pathlib import Path

from grpokit.sandbox.cgroup import MemoryGroup, machine_memory_mb, memory_pool
from grpokit.sandbox.run import (
    UID_BASE,
    UID_COUNT,
    Isolation,
    Limits,
    SandboxResult,
    isolation_mode,
    run_many,
    run_python,
)

#: the judge program that code_tests sends into the sandbox as its main.py (it imports nothing from grpokit)
HARNESS = Path(__file__).with_name("harness.py")

__all__ = [
    "HARNESS",
    "UID_BASE",
    "UID_COUNT",
    "Isolation",
    "Limits",
    "MemoryGroup",
    "SandboxResult",
    "isolation_mode",
    "machine_memory_mb",
    "memory_pool",
    "run_many",
    "run_python",
]
