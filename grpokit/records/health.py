"""Bad steps: a reward function that fails on most of a step, or a step with no learning signal. Each gets a
warning that says what to change; `stop_after_bad_steps` of them in a row stop the run with a TrainingError.

    health = StepHealth(cfg)
    health.check(step, metrics)   # after the step is logged: warns (logger grpokit.records.health) or raises
                                  # TrainingError

A step is bad when
- a reward function failed (raised, timed out, returned a bad value) on more than `reward_error_fraction` of
  the step's completions (reward/errors/<fn>, reward/error_frac): they get 0 from it in the total, which is
  not a score of the task but still moves the advantages; or
- it had no learning signal: every group's G rewards were equal (reward/zero_std_frac = 1), so every advantage
  is 0 and so is the policy gradient; only the KL term moves the policy. E.g. rollout.temperature near 0 (G
  identical completions), prompts the policy always or never solves, a reward that cannot tell completions
  apart.

A warning comes when a stretch of bad steps starts or its reasons change, not at every step. The stop comes
after the step's metrics are logged and before its checkpoint: what is on disk is what was saved before (those
weights are finite; the guard is about wasted compute, not broken weights). The last step of a run never stops
it: the run ends there anyway, with its final save. `grpokit doctor` reports the same from metrics.jsonl
(no_signal, reward_errors).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from grpokit.config import Config
from grpokit.metrics.compute import failed_fractions, no_learning_signal
from grpokit.policy.optim import TrainingError

logger = logging.getLogger("grpokit.records.health")


class StepHealth:
    """The run's stretch of bad steps in a row (config: reward_error_fraction, stop_after_bad_steps)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.bad_steps: list[int] = []  # the current stretch of bad steps in a row
        self._warned: frozenset[str] = frozenset()  # the reasons said in this stretch of bad steps

    def reasons(self, metrics: Mapping[str, Any]) -> dict[str, str]:
        """What makes this step bad, by kind ("no_signal", or a reward function's name), with what to
        change."""
        cfg, out = self.cfg, {}
        for name, fraction in failed_fractions(metrics).items():
            if fraction > cfg.reward_error_fraction:
                out[name] = (
                    f"reward function {name!r} failed on {100 * fraction:.0f}% of the step's completions "
                    f"(more than reward_error_fraction={cfg.reward_error_fraction:g}), which get 0 from it "
                    "in the total instead of a score; its first error is logged above (logger "
                    "grpokit.rewards): fix the function, give it more time if it timed out (reward_timeout, "
                    "or its own `timeout` in rewards:), or remove it from rewards"
                )
        if no_learning_signal(metrics):
            r = cfg.rollout
            out["no_signal"] = (
                f"no learning signal: in each of the {r.prompts_per_step} groups all {r.num_generations} "
                "completions got the same reward (reward/zero_std_frac = 1), so every advantage is 0 and the "
                f"policy does not learn; raise rollout.temperature (now {r.temperature:g}) or "
                f"rollout.num_generations (now {r.num_generations}), train on prompts the policy solves "
                "sometimes rather than always or never (an SFT warm start, easier data), give the reward "
                "partial credit, or set algorithm.dynamic_sampling=true to draw other groups"
            )
        return out

    def check(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Count the step (the one just done) as bad or not; warn, or raise TrainingError on the last bad step
        allowed."""
        reasons = self.reasons(metrics)
        if not reasons:
            self.bad_steps, self._warned = [], frozenset()
            return
        self.bad_steps.append(step)
        limit, text = self.cfg.stop_after_bad_steps, "; ".join(reasons.values())
        if limit and len(self.bad_steps) >= limit and step < self.cfg.optim.max_steps:
            raise TrainingError(
                f"stopped at step {step} after {len(self.bad_steps)} bad steps in a row (steps "
                f"{self.bad_steps[0]}-{step}; stop_after_bad_steps={limit}, 0 = never stop): {text}"
            )
        if not set(reasons) <= self._warned:  # a reason not yet said in this run of bad steps
            self._warned |= frozenset(reasons)
            then = (
                f"the run stops after {limit} such steps in a row (stop_after_bad_steps)"
                if limit
                else "the run goes on (stop_after_bad_steps=0)"
            )
            logger.warning("step %d: %s. %s", step, text, then[0].upper() + then[1:])
