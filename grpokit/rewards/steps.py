"""Process (step) rewards, DeepSeekMath §4.1.3: a reward function may score each step of a completion.

    from grpokit.rewards import StepScores
    def my_reward(completions, **kwargs):
        return [StepScores(scores=[1.0, 0.0], ends=[6, len(c)]) for c in completions]

A reward function returns, for each completion, a float (an outcome reward), None (not
applicable) or a StepScores: one score per step and the character offset in the completion
text where each step ends (`text[:ends[k]]` is the text up to and including step k). Offsets
are characters because reward functions see text; the trainer maps them to completion tokens
with the tokenizer (`token_char_ends`, `step_token_ends`).

How a batch's rewards become the step rewards of each completion (`process_rewards`), the rule
when outcome and step rewards are mixed: every reward function contributes weight x score at
the token where each of its steps ends; an outcome reward (a float) is a single step ending at
the completion's last token. Contributions that land on the same token add up into one step.
With step rewards present, the trainer normalizes all the steps of a group together and gives
token t the sum of the normalized rewards of the steps ending at or after t
(`grpokit.algo.step_advantages`); with one outcome reward only, that is exactly the outcome
advantage. docs/algorithm.md, "Process rewards end to end", has the details.
"""
from __future__ import annotations

import math
import numbers
from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from grpokit.rewards.manager import RewardOutput


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
        if not all(isinstance(s, numbers.Real) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
            return f"scores must be finite numbers, got {scores!r}"
        if not all(isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in ends):
            return f"ends must be ints (character offsets), got {ends!r}"
        if ends[0] < 0 or any(b <= a for a, b in zip(ends, ends[1:])):
            return f"ends must be >= 0 and strictly increasing, got {list(ends)}"
        if text_length is not None and ends[-1] > text_length:
            return f"step end {ends[-1]} is past the end of the completion ({text_length} characters)"
        if self.outcome is not None and not (
            isinstance(self.outcome, numbers.Real) and math.isfinite(self.outcome)
        ):
            return f"outcome must be a finite number or None, got {self.outcome!r}"
        return None


def token_char_ends(tokenizer: Any, token_ids: list[int]) -> list[int]:
    """[L] for each completion token, how many characters of the completion's text are complete
    once it is decoded: the length of the common prefix of the decoded token prefix and the text.

    Decodes every prefix as the rollout engines decode (skip_special_tokens=True), so it holds for
    any tokenizer (character-level, BPE, SentencePiece): a prefix that ends inside a multi-byte
    character decodes to a replacement character there, which does not count until the token
    that completes it. Non-decreasing. One batch_decode per completion."""
    if not token_ids:
        return []
    texts = tokenizer.batch_decode([token_ids[: k + 1] for k in range(len(token_ids))], skip_special_tokens=True)
    full = texts[-1]
    out, best = [], 0
    for t in texts:
        if full.startswith(t):  # the usual case, checked in C
            n = len(t)
        else:
            n = next((j for j, (a, b) in enumerate(zip(t, full)) if a != b), min(len(t), len(full)))
        best = max(best, n)
        out.append(best)
    return out


def step_token_ends(char_ends: list[int], token_ends: list[int], text_length: int) -> list[int]:
    """Token index (0-based, inclusive) where each step ends: the first token whose decoded prefix
    covers the step's last character; a step ending at the end of the text ends at the last token
    (so EOS, which decodes to nothing, belongs to the final step). token_ends: token_char_ends."""
    last = len(token_ends) - 1
    return [last if e >= text_length else min(bisect_left(token_ends, e), last) for e in char_ends]


def process_rewards(
    scored: "RewardOutput", texts: list[str], token_ids: list[list[int]], tokenizer: Any
) -> tuple[list[Tensor], list[Tensor]]:
    """Each completion's step rewards [K_i] and step end tokens [K_i], for step_advantages.

    Every function with a nonzero weight contributes weight x score at each of its steps' end
    tokens (a float reward: one step at the last token; None or a failed reward: nothing);
    contributions on the same token add up."""
    out_rewards, out_ends = [], []
    for i, (text, ids) in enumerate(zip(texts, token_ids, strict=True)):
        at: dict[int, float] = {}
        token_ends: list[int] | None = None
        for name, r in scored.per_function.items():
            w = scored.weights[name]
            if w == 0 or not ids:
                continue
            steps = scored.steps.get(name)
            item = steps[i] if steps is not None else None
            if item is None:  # an outcome reward, or a float from a step function: one step at the end
                v = float(r[i])
                if math.isfinite(v):
                    at[len(ids) - 1] = at.get(len(ids) - 1, 0.0) + w * v
                continue
            if token_ends is None:
                token_ends = token_char_ends(tokenizer, ids)
            for tok, s in zip(step_token_ends(item.ends, token_ends, len(text)), item.scores):
                at[tok] = at.get(tok, 0.0) + w * float(s)
        order = sorted(at)
        out_rewards.append(torch.tensor([at[t] for t in order], dtype=torch.float32))
        out_ends.append(torch.tensor(order, dtype=torch.long))
    return out_rewards, out_ends
