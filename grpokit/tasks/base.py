"""What every built-in task shares: the `Task` interface and the train / test split by hash.

    from grpokit.tasks.base import Split, check_split, split_of
    split_of("3 7 21>23")   # -> "train" or "test", the same in every process and for every seed

Train and test problems never overlap: a problem goes to one split by a hash of its canonical
form (`split_of`), whatever the seed, so two calls with different seeds still cannot leak test
problems into training. The task modules import this one; the package (grpokit/tasks/__init__.py)
imports them.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

Split = Literal["train", "test"]

#: share of all problems that belong to the test split (by hash), in percent
TEST_PERCENT = 20


@runtime_checkable
class Task(Protocol):
    # read-only, so that a frozen dataclass is a Task
    @property
    def name(self) -> str: ...

    @property
    def charset(self) -> str:
        """Every character a prompt or reference completion can contain."""
        ...

    def make_rows(self, split: Split, n: int, seed: int) -> list[dict[str, Any]]:
        """`n` distinct problems of `split`; each row has "prompt", "completion" (one reference
        solution, without EOS) and the task's reward columns."""
        ...

    def reward(self, completions: list, *args: Any, **columns: Any) -> list[float]:
        """TRL-style reward: the columns by keyword, aligned with completions. (`*args, **columns` is
        how a protocol lets each task name the columns it reads; callers pass keywords only.)"""
        ...

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool: ...

    def problem_key(self, row: dict[str, Any]) -> str:
        """The problem's canonical text: rows with the same key are the same problem, and
        `split_of(key)` is the split it belongs to."""
        ...


def split_of(canonical_problem: str) -> Split:
    """The split a problem belongs to, from a stable hash of its canonical text
    (not Python's `hash`, which is salted per process)."""
    h = int.from_bytes(hashlib.blake2b(canonical_problem.encode(), digest_size=8).digest(), "big")
    return "test" if h % 100 < TEST_PERCENT else "train"


def check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


#: one draw of a task: None (no problem this time), or the problem's canonical key and a function that builds
#: its row, called only once the key is accepted (so a row's own random choices follow the accepted draws)
Draw = tuple[str, Callable[[], dict[str, Any]]] | None


def distinct_rows(
    task: Any, split: Split, n: int, seed: int, draw: Callable[[random.Random], Draw]
) -> list[dict[str, Any]]:
    """`n` distinct problems of `split` for make_rows: draws from one RNG seeded by (task name, split, seed),
    keeping the problems whose key is new and belongs to `split`; at most 1000 + 100 n draws."""
    check_split(split)
    rng = random.Random(f"{task.name}-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(1000 + 100 * n):
        if len(rows) == n:
            return rows
        drawn = draw(rng)
        if drawn is None:
            continue
        key, make_row = drawn
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        rows.append(make_row())
    if len(rows) == n:
        return rows
    raise ValueError(f"could only draw {len(rows)} distinct {split} problems of {task}; ask for fewer")
