"""The run's reward functions from its config: `rewards:`, the built-in task's reward, DAPO's overlong
shaping.

    registry = grpokit.rewards.reward_registry()
    rewards = build_rewards(cfg, dataset.column_names, registry=registry, task=data.task)

Everything a config can get wrong about rewards is found here, before the first rollout: an unknown
function, a bad kwarg, a dataset column a function needs, eval.reward naming no configured reward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpokit.config import Config, ConfigError, RewardSpec
from grpokit.rewards.manager import RewardManager
from grpokit.rewards.model import reward_model_spec


def reward_specs(cfg: Config, task: Any | None) -> list[RewardSpec]:
    """The configured reward functions (a reward model loaded as one: grpokit/rewards/model.py); the built-in
    task's reward (by its name) when none is configured;
    DAPO's soft overlong punishment (eq. 13) when algorithm.overlong_buffer_frac > 0."""
    specs = list(cfg.rewards) or ([RewardSpec(function=task.name)] if task else [])
    specs = [
        reward_model_spec(s, index=i) if s.model is not None else s for i, s in enumerate(specs)
    ]  # rewards/model.py
    if (
        cfg.tools.environment is not None
    ):  # TRL: an environment with get_reward() owns a reward (grpokit/tools/setup.py)
        from grpokit.tools.setup import environment_reward_spec, resolve_callable

        if (
            spec := environment_reward_spec(resolve_callable(cfg.tools.environment, "tools.environment"))
        ) is not None:
            specs.append(spec)
    if not specs:
        raise ConfigError(
            "no reward functions: add `rewards: [{function: package.module:function}]` to the config"
        )
    if cfg.algorithm.overlong_buffer_frac > 0:
        L = cfg.rollout.max_completion_length
        cache = max(1, int(cfg.algorithm.overlong_buffer_frac * L))
        specs.append(
            RewardSpec(
                function="overlong",
                name="overlong",
                kwargs={"max_completion_length": L, "cache_length": cache},
            )
        )
    return specs


def build_rewards(
    cfg: Config, column_names: Sequence[str], *, registry: Mapping[str, Callable], task: Any | None = None
) -> RewardManager:
    """A RewardManager for the run, checked against the dataset's columns (a column a reward function
    needs is an error now, not at the first rollout). Mistakes are ConfigError."""
    try:
        rewards = RewardManager(
            reward_specs(cfg, task),
            strict=cfg.reward_errors == "raise",
            registry=registry,
            timeout=cfg.reward_timeout,
            slow_warning=cfg.reward_slow_warning,
            on_timeout=cfg.reward_on_timeout,
        )
        columns: dict[str, list[Any]] = {c: [] for c in column_names if c != cfg.data.prompt_column}
        episode_args: dict[str, list[Any]] = (
            {"episodes": [], "environments": []} if cfg.tools.enabled else {}
        )  # multi-turn rollouts with tools
        for reward in rewards.rewards:
            reward.arguments(
                {"prompts": [], "completions": [], "completion_ids": [], **episode_args},
                columns,
                cfg.data.prompt_column,
            )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.eval.reward is not None and cfg.eval.reward not in rewards.names:
        raise ConfigError(
            f"eval.reward={cfg.eval.reward!r} is not a configured reward; use one of {rewards.names}"
        )
    return rewards
