"""Checks that compare the training reward with held-out accuracy: reward hacking, tool-call spam."""

from __future__ import annotations

import numpy as np

from grpokit.doctor.run import Finding, Run, Series
from grpokit.doctor.stats import mean_diff_se, rounded, step_noise, window
from grpokit.doctor.thresholds import (
    HACK_EVAL_DROP,
    HACK_EVAL_MIN_GAIN,
    HACK_MIN_EVALS,
    HACK_TRAIN_GAIN_STD,
    HACK_Z,
    MIN_STEPS,
    SPAM_MIN_RISE,
    SPAM_Z,
)
from grpokit.metrics.compute import (
    EVAL_PASS_AT_1,
    REWARD_MEAN,
    REWARD_STD,
    ROLLOUT_TOOLS_CALLS_PER_EPISODE,
)


def check_reward_hacking(run: Run) -> list[Finding]:
    held_out = run.series(EVAL_PASS_AT_1)
    reward = run.series(REWARD_MEAN)
    if held_out is None or reward is None or len(held_out) < HACK_MIN_EVALS or len(reward) < MIN_STEPS:
        return []
    first_eval, last_eval = held_out.step(0), held_out.step(len(held_out) - 1)
    inside = reward.values[(reward.steps >= first_eval) & (reward.steps <= last_eval)]
    w = window(len(reward))
    if len(inside) < 2 * w:
        return []
    early, late = float(np.mean(inside[:w])), float(np.mean(inside[-w:]))
    gain = late - early
    stderr = mean_diff_se(step_noise(reward.values), w)
    spread = run.series(REWARD_STD, optional=True)
    need = max(
        HACK_Z * stderr, HACK_TRAIN_GAIN_STD * float(np.median(spread.values)) if spread is not None else 0.0
    )
    if gain <= need:
        return []
    third = max(1, len(held_out) // 3)
    eval_early, eval_late = float(np.mean(held_out.values[:third])), float(np.mean(held_out.values[-third:]))
    if eval_late - eval_early >= HACK_EVAL_MIN_GAIN:
        return []
    return [
        Finding(
            "reward_hacking",
            "error" if eval_late - eval_early <= -HACK_EVAL_DROP else "warning",
            (first_eval, last_eval),
            f"training reward/mean rose {rounded(early)} -> {rounded(late)} while eval/pass@1 went "
            f"{rounded(eval_early)} -> {rounded(eval_late)} "
            f"({len(held_out)} evaluations): the policy learns what the reward pays for, not the task",
            "read samples.jsonl at the late steps: does high-reward text solve the task? tighten the "
            "verifier (strict answer extraction, one answer only); add format or other rewards; check "
            "the reward's parts (reward/<fn>) and evaluate on unseen tasks",
        )
    ]


def _eval_change(held_out: Series) -> tuple[float, float]:
    """Mean eval/pass@1 of the first and of the last third of the evaluations."""
    third = max(1, len(held_out) // 3)
    return float(np.mean(held_out.values[:third])), float(np.mean(held_out.values[-third:]))


def check_tool_spam(run: Run) -> list[Finding]:
    calls = run.series(ROLLOUT_TOOLS_CALLS_PER_EPISODE, optional=True)  # runs without tools: nothing to check
    if calls is None or len(calls) < MIN_STEPS:
        return []
    held_out = run.series(EVAL_PASS_AT_1)
    if held_out is None or len(held_out) < HACK_MIN_EVALS:
        return []
    w = window(len(calls))
    early, late = float(np.mean(calls.values[:w])), float(np.mean(calls.values[-w:]))
    if late - early <= max(SPAM_MIN_RISE, SPAM_Z * mean_diff_se(step_noise(calls.values), w)):
        return []
    eval_early, eval_late = _eval_change(held_out)
    if eval_late - eval_early >= HACK_EVAL_MIN_GAIN:
        return []
    return [
        Finding(
            "tool_spam",
            "error" if eval_late - eval_early <= -HACK_EVAL_DROP else "warning",
            (calls.step(0), calls.step(len(calls) - 1)),
            f"tool calls per episode rose {rounded(early)} -> {rounded(late)} while eval/pass@1 went "
            f"{rounded(eval_early)} -> {rounded(eval_late)} ({len(held_out)} evaluations): the policy is "
            "paid for calling tools, not for solving the task",
            "pay per call only for objective evidence and charge for it: a step_cost reward (kwargs.cost), "
            "tool_result_used instead of tool_call_valid, a task reward that dominates the process rewards; "
            "lower rollout.max_turns; read samples.jsonl for repeated calls (docs/agentic.md)",
        )
    ]
