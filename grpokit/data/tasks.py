"""The tasks data.task may name: grpokit/data/build.py builds a run's rows from one, and its reward is the
run's default. The data layer owns this registry; grpokit.tasks (the built-in tasks) registers into it
when imported, and pyproject.toml names them as "grpokit.tasks" entry points, so that a config naming
one finds it when nothing imported grpokit.tasks (grpokit/config/registry.py). Another package adds its tasks
with an entry point of its own, or register_task.

    from grpokit.data.tasks import get_task, register_task
    register_task("mine", MyTask())     # make_rows(split, n, seed), reward(...), name (grpokit.tasks.Task)
    get_task("countdown")
"""

from __future__ import annotations

from typing import Any

from grpokit.config.registry import Registry

#: a "grpokit.tasks" entry point may name a task or its class (made with no arguments)
TASKS = Registry("grpokit.tasks", "task", make=lambda obj: obj() if isinstance(obj, type) else obj)


def register_task(name: str, task: Any) -> None:
    """Let data.task name `task` as `name`."""
    TASKS.register(name, task)


def get_task(name: str) -> Any:
    """The task registered as `name` (from an entry point if nobody has registered it yet); a ValueError
    naming the known ones if there is none."""
    try:
        return TASKS.get(name)
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}; allowed: {sorted(TASKS.names())}{TASKS.missing_hint()}"
        ) from None
