"""The doctor during a run: every `logging.doctor_every` steps (and at the last one) the run's records
(grpokit/records/run_records.py) run the checks on the metrics logged so far, and each finding is printed as
one line, once, the first time its check fires: the step range, what was seen and the fix, as `grpokit
doctor` gives them afterwards.

    live = LiveDoctor(config, every=5, rows=earlier)   # earlier: a resumed run's metrics.jsonl rows
    for line in live.add(step, metrics, last=step == max_steps):
        print(line)   # "doctor at step 15: reward_drop (error), steps 10-15: reward/mean fell ...; fix: ..."
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpokit.doctor.checks import CHECKS
from grpokit.doctor.run import Finding, Run

#: the checks that judge a run so far. Not here: reward_flat (a run that has not risen yet may rise later; it
#: judges a whole run) and reward_errors (the trainer warns at the step itself: docs/errors.md).
LIVE_CHECKS = tuple(name for name in CHECKS if name not in ("reward_flat", "reward_errors"))


def finding_line(step: int, f: Finding) -> str:
    """The one line of a finding seen at `step`."""
    return (
        f"doctor at step {step}: {f.check} ({f.severity}), steps {f.steps[0]}-{f.steps[1]}: {f.message}; "
        f"fix: {f.fix}"
    )


class LiveDoctor:
    """The rows so far, the checks every `every` steps, and the checks that have spoken (each speaks once)."""

    def __init__(self, config: dict | None, every: int, rows: Sequence[Mapping[str, Any]] = ()) -> None:
        self.config, self.every = config, every
        self.rows: list[dict[str, Any]] = [dict(r) for r in rows]
        self.said: set[str] = set()

    def note(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record metrics logged outside a training step (the evaluation at step 0)."""
        self.rows.append({"step": step, **metrics})

    def add(self, step: int, metrics: Mapping[str, Any], *, last: bool = False) -> list[str]:
        """Record a step's metrics; at a doctor step, the lines of the findings not said before."""
        self.note(step, metrics)
        if self.every <= 0 or not (step % self.every == 0 or last):
            return []
        return [finding_line(step, f) for f in self.findings()]

    def findings(self) -> list[Finding]:
        """The live checks' findings on the rows so far whose check has not spoken yet (now marked said)."""
        run, new = Run(self.rows, self.config), []
        for name in LIVE_CHECKS:
            for f in CHECKS[name].fn(run):
                if f.check not in self.said:
                    self.said.add(f.check)
                    new.append(f)
        return new
