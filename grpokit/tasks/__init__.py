"""Built-in tasks: seeded problem generators with a reward, used by `grpokit demo` and the tests.

    from grpokit.tasks import get_task
    task = get_task("countdown")
    rows = task.make_rows("train", 1000, seed=0)   # [{"prompt", "completion", "numbers", "target"}]
    task.reward(completions=["3*7+2"], numbers=[[3, 7, 2]], target=[23])   # -> [1.0]

Every task has the same small interface (`Task`, grpokit/tasks/base.py, with the train / test
split by hash). Text formats are compact because the demo model is character-level and pays per
character. Tasks use rewards (grpokit.rewards), never the reverse: the rewards a config can name
that belong to a task are in TASK_REWARDS, and `reward_registry()` is every name a config's
`rewards` may use, for RewardManager(specs, registry=reward_registry()).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpokit.rewards.builtins import BUILTIN_REWARDS
from grpokit.tasks.arithmetic import ArithmeticTask
from grpokit.tasks.base import TEST_PERCENT, Split, Task, check_split, split_of
from grpokit.tasks.countdown import CountdownTask, countdown_reward, countdown_steps
from grpokit.tasks.multiply import MultiplyTask, multiply_reward
from grpokit.tools.rewards import TOOL_REWARDS

TASKS: dict[str, Task] = {
    "countdown": CountdownTask(),
    "arithmetic": ArithmeticTask(),
    "multiply": MultiplyTask(),  # needs the calculator tool (docs/agentic.md)
}

#: every character of every built-in task: the default alphabet of the demo tokenizer
DEFAULT_CHARSET = "".join(sorted(set("".join(t.charset for t in TASKS.values()))))

#: the tasks' rewards, by the name a config's `rewards` entry uses
TASK_REWARDS: dict[str, Callable[..., list]] = {
    "countdown": countdown_reward,
    "countdown_steps": countdown_steps,
    "multiply": multiply_reward,
}


def reward_registry() -> dict[str, Callable[..., Any]]:
    """Every reward a config may name: BUILTIN_REWARDS and TASK_REWARDS, in the order error messages
    list them: the answer checkers (math, format), the tasks' rewards, then the rest (overlong,
    length, code_tests), then the process rewards on tool use (grpokit/tools/rewards.py)."""
    builtins = list(BUILTIN_REWARDS.items())
    cut = [name for name, _ in builtins].index("format") + 1
    return dict(builtins[:cut] + list(TASK_REWARDS.items()) + builtins[cut:] + list(TOOL_REWARDS.items()))


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; allowed: {sorted(TASKS)}") from None


__all__ = [
    "Task",
    "Split",
    "TASKS",
    "TASK_REWARDS",
    "DEFAULT_CHARSET",
    "TEST_PERCENT",
    "get_task",
    "reward_registry",
    "split_of",
    "check_split",
    "CountdownTask",
    "ArithmeticTask",
    "MultiplyTask",
    "countdown_reward",
    "countdown_steps",
]
