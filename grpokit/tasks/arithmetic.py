"""Arithmetic: multi-digit addition and subtraction.

    prompt      "482-97="
    completion  "385"          (the trainer / SFT appends EOS)

Reward 1.0 for exactly the answer (surrounding whitespace ignored), 0.0 otherwise.
Operands are drawn uniformly from [0, 10**digits); subtraction may give a negative answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from grpokit.rewards.text import completion_text
from grpokit.tasks.base import Draw, Split, distinct_rows


@dataclass(frozen=True)
class ArithmeticTask:
    name: str = "arithmetic"
    digits: int = 3
    """operands have at most this many digits"""
    ops: str = "+-"
    """operators problems are drawn from"""

    charset: str = "0123456789+-="

    def __post_init__(self) -> None:
        if not self.ops or not set(self.ops) <= set("+-"):
            raise ValueError(f"ops must be a non-empty subset of '+-', got {self.ops!r}")
        if self.digits < 1:
            raise ValueError("digits must be >= 1")

    def make_rows(self, split: Split, n: int, seed: int) -> list[dict[str, Any]]:
        def draw(rng: random.Random) -> Draw:
            a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
            op = rng.choice(self.ops)
            problem, answer = f"{a}{op}{b}", str(a + b if op == "+" else a - b)
            return problem, lambda: {"prompt": problem + "=", "completion": answer, "answer": answer}

        return distinct_rows(self, split, n, seed, draw)

    def problem_key(self, row: dict[str, Any]) -> str:
        return row["prompt"].removesuffix("=")

    def reward(self, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
        return [
            1.0 if completion_text(c).strip() == str(a).strip() else 0.0
            for c, a in zip(completions, answer, strict=True)
        ]

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        return self.reward([completion], answer=[row["answer"]])[0] == 1.0
