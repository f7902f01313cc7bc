"""Tools from plain Python functions and TRL-style environments, and how one call runs.

    tool = as_tool(calculator)            # name, schema (type hints + Google docstring), sync or async
    box = ToolBox([tool], timeout=10.0)   # the tools of one episode
    # + a fresh environment
    box = ToolBox.for_episode(tools, env_factory, timeout=10.0, columns={"answer": "42"})
    outcome = box.call("calculator", {"expression": "2*3"})   # CallOutcome(text="6", error=None, seconds=...)

Conventions (TRL 1.16's GRPOTrainer `tools=` / `environment_factory`, so code written for it runs unchanged):
a tool is a function with a type hint per parameter and a Google-style docstring; an environment is a class
whose public methods are its tools, with `reset(**row)` (called with the dataset row's columns before the
episode; it may return a string observation) and an optional `get_reward()` (called after the episode: the
environment's own reward, logged as reward/<ClassName>). One environment instance per episode.

A call never raises: a tool that raises, runs past `timeout` seconds, is unknown or gets arguments that do not
match its signature returns an error text to the model (`error: ...`), and CallOutcome.error says which
("raised", "timeout", "unknown_tool", "bad_args") for the metrics. Python cannot stop a thread: a sync tool
that times out is left running in a daemon thread (as reward timeouts are, grpokit/rewards/timeouts.py); an
async tool is cancelled. Results are str(result) (JSON for dicts and lists), cut to `max_result_chars`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from grpokit.tools.schema import check_arguments, function_schema

#: environment methods that are not tools (TRL's convention)
ENVIRONMENT_METHODS = ("reset", "get_reward")


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {...}}: what the chat template renders
    is_async: bool


def as_tool(fn: Callable[..., Any] | Tool, name: str | None = None) -> Tool:
    if isinstance(fn, Tool):
        return fn
    if not callable(fn):
        raise ValueError(f"a tool must be a callable, got {fn!r}")
    name = name or getattr(fn, "__name__", None)
    if not name:
        raise ValueError(f"tool {fn!r} has no __name__; give it a name")
    return Tool(name, fn, function_schema(fn, name), inspect.iscoroutinefunction(fn))


def environment_tools(env: Any) -> list[Tool]:
    """The tools of an environment instance: its public methods other than reset / get_reward, bound to it."""
    names = [
        n
        for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if not n.startswith("_") and n not in ENVIRONMENT_METHODS
    ]
    return [as_tool(getattr(env, n), n) for n in names]


def check_environment_class(factory: Callable[[], Any]) -> None:
    """An environment factory must make objects with a callable reset (TRL's requirement)."""
    cls = factory if inspect.isclass(factory) else None
    if cls is not None and not callable(getattr(cls, "reset", None)):
        raise ValueError(
            f"environment {cls.__name__}: needs a reset(**row) method (TRL's environment_factory convention)"
        )


@dataclass(frozen=True)
class CallOutcome:
    text: str  # what the model reads
    error: str | None  # None | "unknown_tool" | "bad_args" | "raised" | "timeout"
    seconds: float


def result_text(value: Any, limit: int) -> str:
    text = "" if value is None else json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= limit else text[:limit] + "...(cut)"


class ToolBox:
    """The tools one episode may call (standalone tools plus its own environment's methods)."""

    def __init__(
        self,
        tools: Iterable[Tool],
        *,
        timeout: float = 10.0,
        max_result_chars: int = 1000,
        environment: Any = None,
    ):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}; tool names must be distinct")
            self.tools[t.name] = t
        self.timeout, self.max_result_chars, self.environment = timeout, max_result_chars, environment

    @classmethod
    def for_episode(
        cls,
        tools: list[Tool],
        env_factory: Callable[[], Any] | None,
        *,
        columns: dict[str, Any] | None = None,
        timeout: float = 10.0,
        max_result_chars: int = 1000,
    ) -> tuple[ToolBox, str | None]:
        """A toolbox with a fresh environment (reset with the row's columns); returns it and reset's
        observation."""
        env, observation = None, None
        if env_factory is not None:
            env = env_factory()
            observation = env.reset(**(columns or {}))
            if observation is not None and not isinstance(observation, str):
                raise ValueError(
                    f"{type(env).__name__}.reset returned {type(observation).__name__}; it must return None "
                    "or a string"
                )
            tools = list(tools) + environment_tools(env)
        return cls(tools, timeout=timeout, max_result_chars=max_result_chars, environment=env), observation

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def check(self, name: str | None, arguments: Any) -> tuple[str | None, str | None]:
        """(error kind, message) for a call that cannot run, or (None, None)."""
        if name not in self.tools:
            return "unknown_tool", f"unknown tool {name!r}; tools: {', '.join(self.tools) or 'none'}"
        if problem := check_arguments(self.tools[name].schema, arguments):
            return "bad_args", f"bad arguments for {name}: {problem}"
        return None, None

    def call(self, name: str | None, arguments: Any) -> CallOutcome:
        start = time.monotonic()
        kind, message = self.check(name, arguments)
        if kind is not None:
            return CallOutcome(f"error: {message}", kind, time.monotonic() - start)
        assert name is not None  # check() passed: a known tool's name
        tool, out = self.tools[name], {}

        def work() -> None:
            try:
                if tool.is_async:
                    out["value"] = asyncio.run(asyncio.wait_for(tool.fn(**arguments), self.timeout))
                else:
                    out["value"] = tool.fn(**arguments)
            except BaseException as exc:  # reported to the model, counted
                out["error"] = exc

        worker = threading.Thread(target=work, name=f"grpokit-tool {name}", daemon=True)
        worker.start()
        worker.join(
            self.timeout + (1.0 if tool.is_async else 0.0)
        )  # async: its own wait_for cancels it first
        seconds = time.monotonic() - start
        if worker.is_alive() or isinstance(out.get("error"), (asyncio.TimeoutError, TimeoutError)):
            return CallOutcome(f"error: {name} timed out after {self.timeout:g} s", "timeout", seconds)
        if "error" in out:
            exc = out["error"]
            return CallOutcome(f"error: {name} raised {type(exc).__name__}: {exc}", "raised", seconds)
        return CallOutcome(result_text(out["value"], self.max_result_chars), None, seconds)
