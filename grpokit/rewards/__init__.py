"""Rewards (DESIGN.md stage 3): TRL-style reward functions, loaded by name, combined with weights.

    from grpokit.rewards import RewardManager, RewardSpec
    manager = RewardManager([RewardSpec("math"), RewardSpec("format", weight=0.5)])
    out = manager(prompts=..., completions=..., completion_ids=..., columns={"answer": [...]})
    out.total, out.per_function, out.errors, out.metrics()

See manager.py for the calling convention and error isolation, builtins.py for the built-ins,
steps.py for process (per-step) rewards: a function may return StepScores instead of a float.
"""
from grpokit.rewards.builtins import BUILTIN_REWARDS
from grpokit.rewards.manager import RewardManager, RewardOutput, RewardSpec, resolve_reward
from grpokit.rewards.steps import StepScores

__all__ = ["BUILTIN_REWARDS", "RewardManager", "RewardOutput", "RewardSpec", "StepScores", "resolve_reward"]
