"""Multiply: two 3-digit numbers, a product a tiny model cannot compute in its head but can look up with the
`calculator` tool (the demo of agentic RL, `grpokit demo --task tools`, docs/agentic.md).

    prompt      "482*917="
    completion  "<tool>calculator(482*917)</tool><result>441994</result>441994"    (a reference with the tool)
           or   "441994"                                                           (a reference without it)

The reference calls the tool in `tool_fraction` of the rows (seeded per row), so an SFT warm start leaves a
policy that calls it only sometimes; the tool-free answers are right, but a tiny model cannot learn to
multiply from them. Reward 1.0 when the final answer (the text after the last </result>, or the whole
completion when it has none) is exactly the product, else 0.0: task success, independent of how the
answer was reached.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from grpokit.rewards.text import completion_text
from grpokit.tasks.base import Draw, Split, distinct_rows

RESULT_CLOSE = "</result>"


def final_answer(text: str) -> str:
    """What the episode answered: the text after the last tool result, stripped."""
    return text.rsplit(RESULT_CLOSE, 1)[-1].strip()


@dataclass(frozen=True)
class MultiplyTask:
    name: str = "multiply"
    digits: int = 3
    """both factors have exactly this many digits"""
    tool_fraction: float = 0.5
    """share of reference completions that call the calculator"""

    # digits, the operator, and every character of the plain tool format's calls and results
    charset: str = "0123456789*=<>/()" + "acelorstu"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError("digits must be >= 1")
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction must be in [0, 1], got {self.tool_fraction}")

    def make_rows(self, split: Split, n: int, seed: int) -> list[dict[str, Any]]:
        lo, hi = 10 ** (self.digits - 1), 10**self.digits

        def draw(rng: random.Random) -> Draw:
            a, b = rng.randrange(lo, hi), rng.randrange(lo, hi)
            problem, answer = f"{a}*{b}", str(a * b)

            def row() -> dict[str, Any]:  # an accepted problem draws whether its solution calls the tool
                with_tool = rng.random() < self.tool_fraction
                completion = (
                    f"<tool>calculator({problem})</tool><result>{answer}{RESULT_CLOSE}{answer}"
                    if with_tool
                    else answer
                )
                return {"prompt": problem + "=", "completion": completion, "answer": answer}

            return problem, row

        return distinct_rows(self, split, n, seed, draw)

    def problem_key(self, row: dict[str, Any]) -> str:
        return row["prompt"].removesuffix("=")

    def reward(self, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
        return [
            1.0 if final_answer(completion_text(c)) == str(a) else 0.0
            for c, a in zip(completions, answer, strict=True)
        ]

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        return self.reward([completion], answer=[row["answer"]])[0] == 1.0


def multiply_reward(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """The multiply task's reward by name (config `rewards: [{function: multiply}]`)."""
    return MultiplyTask().reward(completions, answer=answer)
