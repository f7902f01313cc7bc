"""Process (step) rewards, DeepSeekMath §4.1.3: a reward function may score each step of a completion.

    from grpokit.rewards import StepScores
    def my_reward(completions, **kwargs):
        return [StepScores(scores=[1.0, 0.0], ends=[6, len(c)]) for c in completions]

A reward function returns, for each completion, a float (an outcome reward), None (not
applicable) or a StepScores: one score per step and the character offset in the completion
text where each step ends (`text[:ends[k]]` is the text up to and including step k). Offsets
are characters because reward functions see text; the trainer maps them to completion tokens
with the tokenizer (`token_char_ends`, `step_token_ends` in grpokit/batch.py).

How a batch's rewards become the step rewards of each completion (`process_rewards`,
grpokit/batch.py), the rule when outcome and step rewards are mixed: every reward function
contributes weight x score at the token where each of its steps ends; an outcome reward (a
float) is a single step ending at the completion's last token. Contributions that land on the
same token add up into one step.
With step rewards present, the trainer normalizes all the steps of a group together and gives
token t the sum of the normalized rewards of the steps ending at or after t
(`grpokit.algo.step_advantages`); with one outcome reward only, that is exactly the outcome
advantage. docs/algorithm.md, "Process rewards end to end", has the details.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class StepScores:
    """One completion's process reward: a score per step and where each step ends in its text."""

    scores: list[float]
    """[K] the reward of each step, finite"""
    ends: list[int]
    """[K] character offset just past each step's last character, strictly increasing, <= len(text);
    a step ending at len(text) ends at the completion's last token (EOS included)"""
    outcome: float | None = None
    """the completion's one-number reward where one is needed (reward/<name>, the total, dynamic
    sampling, evaluation); None = the sum of the step scores. Not used by the advantages."""

    def __post_init__(self) -> None:
        if problem := self.problem():
            raise ValueError(f"StepScores: {problem}")

    @property
    def value(self) -> float:
        return float(self.outcome) if self.outcome is not None else float(sum(self.scores))

    def problem(self, text_length: int | None = None) -> str | None:
        """What is wrong with these step scores (for a text of text_length characters), or None."""
        scores, ends = self.scores, self.ends
        if not isinstance(scores, (list, tuple)) or not isinstance(ends, (list, tuple)):
            return "scores and ends must be lists"
        if len(scores) != len(ends):
            return f"{len(scores)} scores but {len(ends)} step ends"
        if not scores:
            return "no steps (return None for 'not applicable')"
        if not all(
            isinstance(s, numbers.Real) and not isinstance(s, bool) and math.isfinite(s) for s in scores
        ):
            return f"scores must be finite numbers, got {scores!r}"
        if not all(isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in ends):
            return f"ends must be ints (character offsets), got {ends!r}"
        if ends[0] < 0 or any(b <= a for a, b in zip(ends, ends[1:], strict=False)):
            return f"ends must be >= 0 and strictly increasing, got {list(ends)}"
        if text_length is not None and ends[-1] > text_length:
            return f"step end {ends[-1]} is past the end of the completion ({text_length} characters)"
        if self.outcome is not None and not (
            isinstance(self.outcome, numbers.Real) and math.isfinite(self.outcome)
        ):
            return f"outcome must be a finite number or None, got {self.outcome!r}"
        return None
