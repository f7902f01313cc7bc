"""Rewards: TRL-style reward functions, loaded by name, combined with weights.

    from grpokit.rewards import RewardManager, RewardSpec
    manager = RewardManager([RewardSpec("math"), RewardSpec("format", weight=0.5)])
    out = manager(prompts=..., completions=..., completion_ids=..., columns={"answer": [...]})
    out.total, out.per_function, out.errors, out.metrics()

See manager.py for the calling convention and error isolation, builtins.py for the task-agnostic
built-ins, text.py for the text a reward scores (completion_text), steps.py for process (per-step)
rewards: a function may return StepScores instead of a float. RewardSpec is the config's
(grpokit.config.RewardSpec). Rewards never import grpokit.tasks or grpokit.tools: a built-in task's
rewards live with the task and register themselves (registry.py), and
`RewardManager(specs, registry=reward_registry())` lets specs name them.
build.py makes the run's RewardManager from its config (build_rewards).
"""

from grpokit.config import RewardSpec
from grpokit.rewards.build import build_rewards
from grpokit.rewards.builtins import BUILTIN_REWARDS
from grpokit.rewards.manager import RewardError, RewardManager, RewardOutput, resolve_reward
from grpokit.rewards.registry import register_reward, reward_registry
from grpokit.rewards.steps import StepScores
from grpokit.rewards.text import completion_text

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardManager",
    "RewardOutput",
    "RewardSpec",
    "StepScores",
    "build_rewards",
    "completion_text",
    "register_reward",
    "resolve_reward",
    "reward_registry",
]
