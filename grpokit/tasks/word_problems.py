"""Word problems: one-step arithmetic stories in chat format, for a small pretrained instruct model
(`grpokit demo --model smollm2`).

    prompt      [{"role": "user", "content": "Mia has 7 books. Mia gets 5 more books. How many books
                  does Mia have now?"}]
    completion  "7 + 5 = 12"          (a reference solution)
    answer      "12"

Each problem is one addition, subtraction or multiplication of small numbers, told in one of a few
templates. The verifier reads the last integer in the completion (commas dropped): reward 1.0 when it is
the answer, else 0.0. So a completion may reason in words first, as GSM8K-style graders allow, but an
answer followed by more numbers, or one cut off by the token budget before it reaches the number, is
wrong. Train and test problems are split by a hash of the question text (grpokit/tasks/base.py).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from grpokit.rewards.text import completion_text
from grpokit.tasks.base import Draw, Split, distinct_rows

NAMES = ("Tom", "Ana", "Sam", "Lily", "Ben", "Mia", "Leo", "Zoe", "Max", "Emma", "Omar", "Nina")
ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "cards", "shells", "coins", "toys")

#: per operation, question templates: {n} a name, {it} an item, {a} and {b} the operands
TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{n} has {a} {it}. {n} gets {b} more {it}. How many {it} does {n} have now?",
        "{n} had {a} {it} and bought {b} more. How many {it} does {n} have?",
        "There are {a} {it} in a box. {n} puts in {b} more. How many {it} are in the box now?",
    ),
    "-": (
        "{n} has {a} {it}. {n} gives {b} {it} to a friend. How many {it} does {n} have left?",
        "There are {a} {it} in a box. {n} takes out {b}. How many {it} are left in the box?",
        "{n} had {a} {it} and lost {b} of them. How many {it} does {n} have now?",
    ),
    "*": (
        "{n} has {a} bags with {b} {it} in each bag. How many {it} does {n} have?",
        "{n} buys {a} packs of {it}. Each pack has {b} {it}. How many {it} does {n} buy?",
        "There are {a} boxes. Each box holds {b} {it}. How many {it} are there in all?",
    ),
}

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer in the text (thousands commas dropped), or None when there is none."""
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def word_problems_reward(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """TRL-style reward: 1.0 when the completion's last integer is the answer, else 0.0."""
    return [
        1.0 if last_integer(completion_text(c)) == int(a) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


@dataclass(frozen=True)
class WordProblemsTask:
    name: str = "word_problems"
    max_operand: int = 20
    """+ and -: operands in [2, max_operand] (a - b with a > b); *: both in [2, 12]"""
    ops: str = "+-*"

    charset: str = ""  # chat prompts for a pretrained tokenizer: no character alphabet

    def __post_init__(self) -> None:
        if not self.ops or not set(self.ops) <= set(TEMPLATES):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if self.max_operand < 3:
            raise ValueError("max_operand must be >= 3")

    def draw(self, rng: random.Random) -> tuple[str, str, int]:
        """One problem: (question, reference solution, answer)."""
        op = rng.choice(self.ops)
        if op == "*":
            a, b = rng.randint(2, 12), rng.randint(2, 12)
        else:
            a, b = rng.randint(2, self.max_operand), rng.randint(2, self.max_operand)
            if op == "-":
                a, b = max(a, b) + 1, min(a, b)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        question = rng.choice(TEMPLATES[op]).format(n=rng.choice(NAMES), it=rng.choice(ITEMS), a=a, b=b)
        sign = "x" if op == "*" else op
        return question, f"{a} {sign} {b} = {answer}", answer

    def make_rows(self, split: Split, n: int, seed: int) -> list[dict[str, Any]]:
        def draw(rng: random.Random) -> Draw:
            question, solution, answer = self.draw(rng)
            row = {
                "prompt": [{"role": "user", "content": question}],
                "completion": solution,
                "answer": str(answer),
            }
            return question, lambda: row

        return distinct_rows(self, split, n, seed, draw)

    def problem_key(self, row: dict[str, Any]) -> str:
        return str(row["prompt"][-1]["content"])

    def reward(self, completions: list, answer: list, **kwargs: Any) -> list[float]:
        return word_problems_reward(completions, answer)

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        return self.reward([completion], answer=[row["answer"]])[0] == 1.0
