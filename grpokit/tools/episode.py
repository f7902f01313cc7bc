"""What one multi-turn episode did: its messages, tool calls and their results; and the step's tool metrics.

    ep.tool_calls[0].name, .arguments, .valid, .result, .error, .end    # end: character offset in the
                                                                        # completion text
    ep.turns, ep.cut, ep.final                                          # cut: None | "max_turns" | "budget"
    episode_metrics(episodes, prefix="rollout/tools/")                  # docs/metrics.md

Reward functions receive `episodes=[Episode, ...]` (one per completion) besides the completions, and
`environments=[env or None, ...]` as in TRL. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from grpokit.metrics.compute import ROLLOUT_TOOLS_PREFIX, TOOL_METRICS

#: ToolCall.error values that mean the model's call itself was wrong (vs. the tool failing or timing out)
CALL_ERRORS = ("parse", "unknown_tool", "bad_args")


@dataclass
class ToolCall:
    raw: str  # the call's text as the model wrote it
    name: str | None  # None when the call did not parse
    arguments: Any  # the parsed arguments (a dict when well formed)
    result: str = ""  # what the model was shown
    error: str | None = (
        # None | "parse" | "unknown_tool" | "bad_args" | "raised" | "timeout"; "not_run": at the last turn
        None
    )
    seconds: float = 0.0
    turn: int = 0  # 1-based turn whose model text holds the call
    end: int = 0  # characters of the completion text up to and including the call (StepScores.ends)

    @property
    def parsed(self) -> bool:
        return self.error != "parse"

    @property
    def known(self) -> bool:
        """parsed and names an existing tool"""
        return self.error not in ("parse", "unknown_tool")

    @property
    def args_valid(self) -> bool:
        """parsed, names an existing tool and its arguments match the signature"""
        return self.error not in CALL_ERRORS

    @property
    def valid(self) -> bool:
        return self.args_valid

    @property
    def ok(self) -> bool:
        """ran and returned a result"""
        return self.error is None


@dataclass
class Episode:
    messages: list[dict[str, Any]] = field(
        default_factory=list
    )  # assistant and tool messages after the prompt
    tool_calls: list[ToolCall] = field(default_factory=list)
    turns: int = 0  # model generations in the episode
    cut: str | None = (
        None  # None (ended by itself) | "max_turns" (a call at the last turn) | "budget" (token budget)
    )
    environment: Any = None  # the episode's environment instance (environment_factory), or None

    @property
    def final(self) -> str:
        """The last assistant message: the answer when the episode ended by itself."""
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return m["content"]
        return ""


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def episode_metrics(episodes: list[Episode], prefix: str = ROLLOUT_TOOLS_PREFIX) -> dict[str, float]:
    """The step's tool-use statistics, prefix + each of TOOL_METRICS (docs/metrics.md, rollout/tools/ and
    eval/tools/). errors: calls that did not parse, named no tool, had bad arguments or raised (a call at the
    last turn, not run, counts only when it was malformed); timeouts: calls past tools.timeout."""
    calls = [c for e in episodes for c in e.tool_calls]
    n = max(len(episodes), 1)
    values = {
        "calls_per_episode": len(calls) / n,
        "turns": _mean([float(e.turns) for e in episodes]),
        "valid_call_rate": _mean([float(c.valid) for c in calls]),
        "episodes_with_calls": sum(bool(e.tool_calls) for e in episodes) / n,
        "errors": float(sum(c.error in CALL_ERRORS or c.error == "raised" for c in calls)),
        "timeouts": float(sum(c.error == "timeout" for c in calls)),
        "seconds": float(sum(c.seconds for c in calls)),
        "cut_by_budget": sum(e.cut == "budget" for e in episodes) / n,
        "cut_by_turns": sum(e.cut == "max_turns" for e in episodes) / n,
    }
    assert tuple(values) == TOOL_METRICS
    return {prefix + k: v for k, v in values.items()}
