"""Every check by name, in the order one debugs a run (CHECKS), and running them on a run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from grpokit.doctor.hacking import check_reward_hacking, check_tool_spam
from grpokit.doctor.optimizer import check_grad_spikes, check_nonfinite
from grpokit.doctor.policy import check_clip, check_entropy, check_kl_high, check_kl_zero, check_ratio
from grpokit.doctor.rewards import (
    check_no_signal,
    check_reward_drop,
    check_reward_errors,
    check_reward_flat,
    check_reward_none,
    check_zero_std,
)
from grpokit.doctor.rollouts import check_length, check_truncation
from grpokit.doctor.run import Finding, Run


@dataclass(frozen=True)
class Check:
    fn: Callable[[Run], list[Finding]]
    seed: str  # the part of a run it reads (reward, advantages, ratio, clip, KL, rollouts, ...)


#: name -> check, in the order one debugs a run, then reward hacking.
CHECKS: dict[str, Check] = {
    "reward_errors": Check(check_reward_errors, "reward"),
    "reward_none": Check(check_reward_none, "reward"),
    "reward_flat": Check(check_reward_flat, "reward, held-out"),
    "reward_drop": Check(check_reward_drop, "reward"),
    "no_signal": Check(check_no_signal, "advantages"),
    "zero_std": Check(check_zero_std, "advantages"),
    "ratio_mismatch": Check(check_ratio, "ratio"),
    "clip_high": Check(check_clip, "clip"),
    "kl_high": Check(check_kl_high, "KL"),
    "kl_zero": Check(check_kl_zero, "KL"),
    "entropy_collapse": Check(check_entropy, "rollouts"),
    "length": Check(check_length, "rollouts"),
    "truncation": Check(check_truncation, "rollouts"),
    "grad_spikes": Check(check_grad_spikes, "optimizer"),
    "nonfinite": Check(check_nonfinite, "optimizer"),
    "reward_hacking": Check(check_reward_hacking, "reward hacking, held-out"),
    "tool_spam": Check(check_tool_spam, "tool use, held-out"),
}


def run_checks(run: Run) -> tuple[list[Finding], list[str]]:
    """Every finding of every check, in CHECKS order, and the names of the checks that asked for a
    metric the run did not log (they said nothing, for want of data)."""
    findings, not_checked = [], []
    for name, check in CHECKS.items():
        run.absent.clear()
        findings += check.fn(run)
        if run.absent:
            not_checked.append(name)
    return findings, not_checked


def diagnose(rows: list[dict], config: dict | None = None) -> list[Finding]:
    """Every finding of every check on a run's metrics rows (as read from metrics.jsonl), in CHECKS order.
    config is the run's config as a nested dict (config.yaml), or None; it sharpens some checks
    (the KL checks run only when algorithm.beta > 0) and fills the fixes with the current values."""
    return run_checks(Run(rows, config))[0]
