"""Built-in tasks: seeded problem generators with a reward, used by `grpokit demo` and the tests.

    from grpokit.tasks import get_task
    task = get_task("countdown")
    rows = task.make_rows("train", 1000, seed=0)   # [{"prompt", "completion", "numbers", "target"}]
    task.reward(completions=["3*7+2"], numbers=[[3, 7, 2]], target=[23])   # -> [1.0]

Every task has the same small interface (`Task`, grpokit/tasks/base.py, with the train / test
split by hash). Text formats are compact because the demo model is character-level and pays per
character. Tasks use rewards (grpokit.rewards), never the reverse: importing this package registers
the tasks with the data layer (grpokit/data/tasks.py, so data.task may name them) and their rewards,
TASK_REWARDS, with the rewards' registry (grpokit/rewards/registry.py: `reward_registry()` is every
name a config's `rewards` may use, for RewardManager(specs, registry=reward_registry())). The
"grpokit.tasks" and "grpokit.rewards" entry points in pyproject.toml name them too, so a run finds
them when nothing imported this package.
"""

from __future__ import annotations

from collections.abc import Callable

import grpokit.tools.rewards  # noqa: F401 (importing it registers the process rewards on tool use)
from grpokit.data.tasks import get_task, register_task
from grpokit.rewards.registry import TASK, register_reward, reward_registry
from grpokit.tasks.arithmetic import ArithmeticTask
from grpokit.tasks.base import TEST_PERCENT, Split, Task, check_split, split_of
from grpokit.tasks.countdown import CountdownTask, countdown_reward, countdown_steps
from grpokit.tasks.multiply import MultiplyTask, multiply_reward
from grpokit.tasks.word_problems import WordProblemsTask, word_problems_reward

TASKS: dict[str, Task] = {
    "countdown": CountdownTask(),
    "arithmetic": ArithmeticTask(),
    "multiply": MultiplyTask(),  # needs the calculator tool (docs/agentic.md)
}

#: tasks whose prompts are chat messages, for a pretrained model's tokenizer (`grpokit demo --model smollm2`);
#: apart from TASKS, whose characters are the demo tokenizer's alphabet
CHAT_TASKS: dict[str, Task] = {"word_problems": WordProblemsTask()}

#: every character of every built-in task: the default alphabet of the demo tokenizer
DEFAULT_CHARSET = "".join(sorted(set("".join(t.charset for t in TASKS.values()))))

#: the tasks' rewards, by the name a config's `rewards` entry uses
TASK_REWARDS: dict[str, Callable[..., list]] = {
    "countdown": countdown_reward,
    "countdown_steps": countdown_steps,
    "multiply": multiply_reward,
    "word_problems": word_problems_reward,
}

for _name, _task in TASKS.items():
    register_task(_name, _task)
for _name, _task in CHAT_TASKS.items():
    register_task(_name, _task)
for _name, _fn in TASK_REWARDS.items():
    register_reward(_name, _fn, rank=TASK)  # listed after math and format, before the other built-ins


__all__ = [
    "Task",
    "Split",
    "TASKS",
    "CHAT_TASKS",
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
    "WordProblemsTask",
    "countdown_reward",
    "countdown_steps",
]
