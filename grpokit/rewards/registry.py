"""Every reward function a config's `rewards` may name: the built-ins (builtins.py) and those that tasks,
tools and other packages register.

    from grpokit.rewards import register_reward, reward_registry
    register_reward("mine", my_reward)      # a config may now say `rewards: [{function: mine}]`
    reward_registry()                        # name -> function, in the order error messages list them
    RewardManager(specs, registry=reward_registry())

grpokit.tasks registers the built-in tasks' rewards (countdown, countdown_steps, multiply, word_problems) and
grpokit.tools.rewards the process rewards on tool use, when they are imported; pyproject.toml names
them as "grpokit.rewards" entry points too, so that reward_registry() has them when nothing imported
those modules (grpokit/config/registry.py). Rewards never import tasks or tools.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpokit.config.registry import Registry
from grpokit.rewards.builtins import BUILTIN_REWARDS

#: the order names are listed in (error messages, docs/errors.md): the answer checkers, the tasks' rewards,
#: the other built-ins, the process rewards on tool use, then any other
ANSWER, TASK, GENERAL, TOOL, OTHER = range(5)

REWARDS = Registry("grpokit.rewards", "reward", default_rank=OTHER)
for _name, _fn in BUILTIN_REWARDS.items():
    REWARDS.register(_name, _fn, rank=ANSWER if _name in ("math", "format") else GENERAL)


def register_reward(name: str, fn: Callable[..., Any], *, rank: int = OTHER) -> None:
    """Let a config's `rewards` name `fn` as `name` (rank: where error messages list it)."""
    REWARDS.register(name, fn, rank=rank)


def reward_registry() -> dict[str, Callable[..., Any]]:
    """Every reward a config may name, name -> function: the built-ins, the registered ones and those of the
    installed "grpokit.rewards" entry points, in the order error messages list them."""
    return REWARDS.as_dict()
