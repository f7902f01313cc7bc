"""The run's tools from the config's `tools:` section.

    tools, env_factory = load_tools(cfg.tools)          # [Tool], the environment factory or None
    spec = environment_reward_spec(env_factory)         # a RewardSpec calling get_reward(), or None

Mistakes (a spec that does not load, a function without type hints, an environment without reset) are
ConfigError naming the key.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from grpokit.config import ConfigError, RewardSpec, ToolsConfig
from grpokit.imports import load_object
from grpokit.tools.builtin import BUILTIN_TOOLS
from grpokit.tools.registry import Tool, ToolBox, as_tool, check_environment_class


def resolve_callable(spec: str | Callable[..., Any], key: str) -> Callable[..., Any]:
    """package.module:name or path/to/file.py:name (a dotted attribute path works) -> the object
    (grpokit/imports.py); a callable as is."""
    if callable(spec):
        return spec
    hint = "point at a class or a factory" if key == "tools.environment" else "point at a function"
    return load_object(str(spec), f"{key}={spec!r}", noun="name", hint=hint, error=ConfigError)


def load_tools(cfg: ToolsConfig) -> tuple[list[Tool], Callable[[], Any] | None]:
    """The standalone tools (built-ins, then functions) and the environment factory of the config."""
    tools = []
    try:
        tools += [as_tool(BUILTIN_TOOLS[name], name) for name in cfg.builtin]
        tools += [as_tool(resolve_callable(f, "tools.functions")) for f in cfg.functions]
        ToolBox(tools)  # distinct names
    except ValueError as exc:
        raise ConfigError(f"tools: {exc}") from None
    factory = resolve_callable(cfg.environment, "tools.environment") if cfg.environment is not None else None
    if factory is not None:
        try:
            check_environment_class(factory)
            if inspect.isclass(factory):  # its tools' schemas, checked now rather than at the first rollout
                [
                    as_tool(getattr(factory, n), n)
                    for n, _ in inspect.getmembers(factory, predicate=inspect.isfunction)
                    if not n.startswith("_") and n not in ("reset", "get_reward")
                ]
        except ValueError as exc:
            raise ConfigError(f"tools.environment: {exc}") from None
    return tools, factory


def environment_reward_spec(factory: Callable[[], Any] | None) -> RewardSpec | None:
    """TRL's convention: an environment with get_reward() owns a reward, weight 1, named after its class; it
    is called once per finished episode on that episode's environment (None for an episode without one)."""
    cls: type[Any] | None = factory if inspect.isclass(factory) else None
    if cls is None or not callable(getattr(cls, "get_reward", None)):
        return None
    is_async = inspect.iscoroutinefunction(cls.get_reward)

    def get_reward(environments: list[Any], **kwargs: Any) -> list[float | None]:
        if is_async:
            import asyncio

            return [asyncio.run(e.get_reward()) if isinstance(e, cls) else None for e in environments]
        return [e.get_reward() if isinstance(e, cls) else None for e in environments]

    get_reward.__name__ = get_reward.__qualname__ = cls.__name__
    return RewardSpec(function=get_reward, name=cls.__name__)
