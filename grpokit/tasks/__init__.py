"""Built-in tasks: seeded problem generators with a reward, used by `grpokit demo` and the tests.

    from grpokit.tasks import get_task
    task = get_task("countdown")
    rows = task.make_rows("train", 1000, seed=0)   # [{"prompt", "completion", "numbers", "target"}]
    task.reward(completions=["3*7+2"], numbers=[[3, 7, 2]], target=[23])   # -> [1.0]

Every task has the same small interface (`Task` below). Train and test problems never
overlap: a problem goes to one split by a hash of its canonical form (`split_of`), whatever
the seed, so two calls with different seeds still cannot leak test problems into training.
Text formats are compact because the demo model is character-level and pays per character.
"""
from __future__ import annotations

import hashlib
from typing import Any, Literal, Protocol, runtime_checkable

from grpokit.rewards.builtins import completion_text  # noqa: F401  (tasks' rewards read completions the same way)

Split = Literal["train", "test"]

#: share of all problems that belong to the test split (by hash), in percent
TEST_PERCENT = 20


@runtime_checkable
class Task(Protocol):
    name: str
    charset: str  # every character a prompt or reference completion can contain

    def make_rows(self, split: Split, n: int, seed: int) -> list[dict[str, Any]]:
        """`n` distinct problems of `split`; each row has "prompt", "completion" (one reference
        solution, without EOS) and the task's reward columns."""
        ...

    def reward(self, completions: list, **columns: Any) -> list[float]:
        """TRL-style reward: keyword arguments only, columns aligned with completions."""
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


# The task modules import the helpers above, so they are imported after them.
from grpokit.tasks.arithmetic import ArithmeticTask  # noqa: E402
from grpokit.tasks.countdown import CountdownTask  # noqa: E402

TASKS: dict[str, Task] = {
    "countdown": CountdownTask(),
    "arithmetic": ArithmeticTask(),
}

#: every character of every built-in task: the default alphabet of the demo tokenizer
DEFAULT_CHARSET = "".join(sorted(set("".join(t.charset for t in TASKS.values()))))


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; allowed: {sorted(TASKS)}") from None


__all__ = [
    "Task",
    "TASKS",
    "DEFAULT_CHARSET",
    "TEST_PERCENT",
    "get_task",
    "split_of",
    "completion_text",
    "CountdownTask",
    "ArithmeticTask",
]
