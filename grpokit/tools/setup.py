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
from grpokit.config.imports import load_object
from grpokit.tools.builtin import BUILTIN_TOOLS
from grpokit.tools.registry import Tool, ToolBox, as_tool, check_environment_class


def resolve_callable(spec: str | Callable[..., Any], key: str) -> Callable[..., Any]:
    """package.module:name or path/to/file.py:name (a dotted attribute path works) -> the object
    (grpokit/config/imports.py); a callable as is."""
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
            class_tools(factory)  # its tools' schemas, checked now rather than at the first rollout
        except ValueError as exc:
            raise ConfigError(f"tools.environment: {exc}") from None
    return tools, factory


def prompt_tool_schemas(cfg: ToolsConfig) -> list[dict[str, Any]] | None:
    """The JSON schemas of the episode's tools, for the chat template to render into chat prompts
    (tools.format=chat_template, as TRL passes tools= to apply_chat_template); None otherwise. An
    environment class's tools are its public methods other than reset / get_reward."""
    if not cfg.enabled or cfg.format != "chat_template":
        return None
    tools, factory = load_tools(cfg)
    return [t.schema for t in tools + class_tools(factory)]


def class_tools(factory: Callable[[], Any] | None) -> list[Tool]:
    """An environment class's tools, from the class: its public methods other than reset / get_reward (a
    factory that is not a class shows its tools only on an instance)."""
    if not inspect.isclass(factory):
        return []
    return [
        as_tool(getattr(factory, n), n)
        for n, _ in inspect.getmembers(factory, predicate=inspect.isfunction)
        if not n.startswith("_") and n not in ("reset", "get_reward")
    ]


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
