"""Process rewards on tool use, from objective evidence only: what the parser, the tools' signatures
and the tools' own results say, never "more steps". Each is a TRL-style reward taking `episodes=` (multi-turn
rollouts with tools); a per-call score is a StepScores whose step ends at the call's last character, so the
process-reward path (DeepSeekMath §4.1.3, grpokit/data/batch.py) credits the tokens of that call.

    name              per call (StepScores, step = one call)              outcome (reward/<name>)    no call
    tool_call_valid   1 if it parsed and named an existing tool, else 0   fraction valid             None
    tool_args_valid   1 if its arguments matched the signature, else 0    fraction valid             None
    tool_result_used  -                                                   1 if the final answer      None
                                                                          is a result, else 0
    step_cost         -cost (kwargs: cost=0.1)                            -cost x calls              0.0

None is "not applicable" (0 in the total). These rewards can be gamed on their own (a model paid for valid
calls learns to make more of them): pair them with a task reward, and watch held-out task success (the
independent check; docs/agentic.md has the run with process rewards only). step_cost is the counterweight to
tool spam.
"""

from __future__ import annotations

import re
from typing import Any

from grpokit.rewards.registry import TOOL, register_reward
from grpokit.rewards.steps import StepScores
from grpokit.tools.episode import Episode


def _per_call(episodes: list[Episode], passed) -> list[StepScores | None]:
    out: list[StepScores | None] = []
    for ep in episodes:
        if not ep.tool_calls:
            out.append(None)
            continue
        scores = [1.0 if passed(c) else 0.0 for c in ep.tool_calls]
        out.append(
            StepScores(scores=scores, ends=[c.end for c in ep.tool_calls], outcome=sum(scores) / len(scores))
        )
    return out


def tool_call_valid(
    completions: list[Any], episodes: list[Episode], **kwargs: Any
) -> list[StepScores | None]:
    """Per call: 1.0 when it parsed and named an existing tool."""
    return _per_call(episodes, lambda c: c.known)


def tool_args_valid(
    completions: list[Any], episodes: list[Episode], **kwargs: Any
) -> list[StepScores | None]:
    """Per call: 1.0 when it parsed, named an existing tool and its arguments matched the tool's signature."""
    return _per_call(episodes, lambda c: c.args_valid)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def result_used(ep: Episode) -> bool | None:
    """Whether the final answer is the result of a successful call: the answer's text, or its last number,
    equals a result (None: no successful call). Not "contains", which an answer passes by padding a result
    with other digits ("408408" for 408): a loophole a policy paid for containment could learn
    (docs/agentic.md)."""
    results = [c.result.strip() for c in ep.tool_calls if c.ok and c.result.strip()]
    if not results or ep.cut is not None:
        return None if not results else False
    final = ep.final.strip()
    numbers = _NUMBER.findall(final)
    return any(r == final or (numbers and r == numbers[-1]) for r in results)


def tool_result_used(completions: list[Any], episodes: list[Episode], **kwargs: Any) -> list[float | None]:
    """1.0 when the final answer is a successful tool result (its text, or its last number: a verified result
    was used), 0.0 when calls succeeded but the answer is none of them (or the episode was cut), None without
    one."""
    out: list[float | None] = []
    for ep in episodes:
        used = result_used(ep)
        out.append(None if used is None else float(used))
    return out


def step_cost(
    completions: list[Any], episodes: list[Episode], cost: float = 0.1, **kwargs: Any
) -> list[StepScores | float]:
    """-cost at every call (its tokens carry the penalty); 0.0 for an episode without calls."""
    return [
        StepScores(scores=[-float(cost)] * len(ep.tool_calls), ends=[c.end for c in ep.tool_calls])
        if ep.tool_calls
        else 0.0
        for ep in episodes
    ]


def _validate_cost(kwargs: dict) -> None:
    if unknown := sorted(set(kwargs) - {"cost"}):
        raise ValueError(f"reward 'step_cost': unknown kwargs {unknown}; allowed: ['cost']")
    cost = kwargs.get("cost", 0.1)
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost >= 0:
        raise ValueError(f"reward 'step_cost': kwargs['cost'] must be a number >= 0, got {cost!r}")


step_cost.validate_kwargs = _validate_cost  # type: ignore[attr-defined]  # function attribute

#: the names a config's `rewards` may use for these, registered with grpokit.rewards.reward_registry() here
#: (and named as "grpokit.rewards" entry points in pyproject.toml)
TOOL_REWARDS = {
    "tool_call_valid": tool_call_valid,
    "tool_args_valid": tool_args_valid,
    "tool_result_used": tool_result_used,
    "step_cost": step_cost,
}
for _name, _fn in TOOL_REWARDS.items():
    register_reward(_name, _fn, rank=TOOL)
