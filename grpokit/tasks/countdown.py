"""Countdown: combine the given numbers, each exactly once, with + - * (and parentheses) to hit a target.

    prompt      "7 3 2 9>23="      numbers, ">", target, "="
    completion  "(7-3)*2+9"        one reference solution (the trainer / SFT appends EOS)

Reward (`CountdownTask.reward`, TRL style): 1.0 when the expression uses each given number
exactly once and evaluates exactly to the target; `partial_reward` (0.1) when it is well formed
and uses the numbers correctly but misses the target; 0.0 otherwise. `countdown_reward` below (the
config's reward "countdown") builds the task from the spec's kwargs and calls its reward. Model text is never
passed to eval(): a small recursive-descent parser reads it, with a length bound, and evaluates it with exact
fractions (so "/" -- off by default, `ops="+-*/"` turns it on -- means exact division).
`countdown_steps` (the config's reward "countdown_steps") is the process reward of step-by-step
solutions: one score per step (grpokit.rewards.StepScores).

Problems are generated like the game is played: draw the numbers, then repeatedly combine two
of them with a random operator until one value is left; that value is the target and the
combination is the reference completion. Subtraction is ordered so intermediate values are
never negative. Difficulty knobs: `min_count`..`num_count` numbers from [`min_number`, `max_number`],
targets up to `max_target`; the defaults (3-4 numbers from 1..20, targets 1..99)
were chosen for the demo in docs/demo_tuning.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any

from grpokit.rewards.steps import StepScores
from grpokit.rewards.text import completion_text
from grpokit.tasks.base import Draw, Split, distinct_rows

# precedence of the expression a string holds, for printing with the fewest parentheses
_ATOM, _MUL, _ADD = 3, 2, 1

#: longest completion the parser reads (characters); longer text gets reward 0
MAX_EXPRESSION_CHARS = 64
_MAX_DEPTH = 16  # parenthesis nesting bound, so the recursion stays shallow


class _ParseError(ValueError):
    pass


def _tokenize(text: str, ops: str) -> list[str]:
    """The tokens of an expression: numbers (runs of digits), the operators in `ops` and parentheses;
    whitespace skipped, any other character a ValueError."""
    tokens: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "0123456789":
            j = i
            while j < len(text) and text[j] in "0123456789":
                j += 1
            tokens.append(text[i:j])
            i = j
        elif c in ops or c in "()":
            tokens.append(c)
            i += 1
        else:
            raise _ParseError(f"unexpected character {c!r}")
    return tokens


def parse_expression(text: str, ops: str = "+-*/") -> tuple[Fraction, list[int]]:
    """Value (exact) and the numbers used, in order, of an arithmetic expression over
    non-negative integers with the operators in `ops` and parentheses. Raises ValueError on
    anything else (unknown characters, unary minus, division by zero, too long or too deep)."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise _ParseError("expression too long")
    tokens = _tokenize(text, ops)
    numbers: list[int] = []
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise _ParseError("unexpected end")
        pos += 1
        return tokens[pos - 1]

    def expr(depth: int) -> Fraction:  # expr := term (("+" | "-") term)*
        value = term(depth)
        while peek() in ("+", "-"):
            op = take()
            rhs = term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(depth: int) -> Fraction:  # term := factor (("*" | "/") factor)*
        value = factor(depth)
        while peek() in ("*", "/"):
            op = take()
            rhs = factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise _ParseError("division by zero")
            else:
                value = value / rhs
        return value

    def factor(depth: int) -> Fraction:  # factor := NUMBER | "(" expr ")"
        tok = take()
        if tok == "(":
            if depth >= _MAX_DEPTH:
                raise _ParseError("too deeply nested")
            value = expr(depth + 1)
            if take() != ")":
                raise _ParseError("expected ')'")
            return value
        if tok.isdigit():
            numbers.append(int(tok))
            return Fraction(int(tok))
        raise _ParseError(f"unexpected {tok!r}")

    value = expr(0)
    if pos != len(tokens):
        raise _ParseError(f"unexpected {tokens[pos]!r}")
    return value, numbers


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def apply_step(step: str, pool: list[int], ops: str = "+-*/") -> int:
    """One step "a<op>b=c" of a step-by-step solution: checks that it is well formed, that a and b
    are available in pool (given numbers or earlier results) and that c is a <op> b; then takes a
    and b from pool, adds c, and returns c. Raises ValueError otherwise, pool unchanged."""
    lhs, eq, result = step.strip().partition("=")
    i = next((k for k, c in enumerate(lhs) if c in ops and k > 0), -1)
    a, op, b = lhs[:i].strip(), lhs[i : i + 1], lhs[i + 1 :].strip()
    result = result.strip()
    if not eq or i < 0 or not all(x.isdigit() and len(x) <= 6 for x in (a, b, result)):
        raise _ParseError(f"malformed step {step!r}")
    left = list(pool)
    for n in (int(a), int(b)):
        if n not in left:
            raise _ParseError(f"{n} is not available")
        left.remove(n)
    if op == "/" and int(b) == 0:
        raise _ParseError("division by zero")
    if _OPS[op](Fraction(int(a)), Fraction(int(b))) != int(result):
        raise _ParseError(f"wrong result in {step!r}")
    pool[:] = left + [int(result)]
    return int(result)


def parse_steps(text: str, numbers: list[int], ops: str = "+-*/") -> Fraction:
    """Value of a step-by-step solution "7-3=4,4*2=8,8+9=17": each step combines two numbers still
    available (given ones, or results of earlier steps) and states the result, which becomes
    available (apply_step). Returns the last result. Raises ValueError when a step is malformed,
    uses a number that is not available, states a wrong result, or when numbers are left unused."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise _ParseError("solution too long")
    pool = list(numbers)
    value = None
    for step in text.split(","):
        value = Fraction(apply_step(step, pool, ops))
    if len(pool) != 1:
        raise _ParseError("numbers left unused")
    assert value is not None  # str.split yields at least one step
    return value


def _combine(
    a: tuple[Fraction, str, int], b: tuple[Fraction, str, int], op: str
) -> tuple[Fraction, str, int]:
    """a op b as (value, text with the fewest parentheses, precedence)."""
    (va, sa, pa), (vb, sb, pb) = a, b
    if op in "*/" and pa == _ADD:
        sa = f"({sa})"
    if (op == "-" and pb == _ADD) or (op == "*" and pb == _ADD) or (op == "/" and pb != _ATOM):
        sb = f"({sb})"
    value = _OPS[op](va, vb)  # callers never divide by zero (_draw redraws the operator)
    return value, f"{sa}{op}{sb}", _ADD if op in "+-" else _MUL


@dataclass(frozen=True)
class CountdownTask:
    name: str = "countdown"
    num_count: int = 4
    """how many numbers each problem gives (the most, when min_count is set)"""
    min_count: int | None = 3
    """each problem gives a count drawn uniformly from [min_count, num_count]; None = num_count"""
    min_number: int = 1
    max_number: int = 20
    """numbers are drawn uniformly from [min_number, max_number], repeats allowed"""
    min_target: int = 1
    max_target: int = 99
    """problems whose target falls outside [min_target, max_target] are redrawn"""
    ops: str = "+-*"
    """operators the model may use; add "/" for exact division"""
    partial_reward: float = 0.1
    """reward of a well-formed expression that uses the numbers correctly but misses the target"""
    solution_format: str = "expression"
    """reference completions: "expression" ("(7-3)*2+9") or "steps" ("7-3=4,4*2=8,8+9=17");
    the reward accepts both"""

    charset: str = "0123456789+-*/() >=,"

    def __post_init__(self) -> None:
        if not set(self.ops) <= set("+-*/") or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of '+-*/', got {self.ops!r}")
        if not (2 <= self._fewest <= self.num_count and 0 <= self.min_number <= self.max_number):
            raise ValueError("need 2 <= min_count <= num_count and 0 <= min_number <= max_number")

    @property
    def _fewest(self) -> int:
        return self.num_count if self.min_count is None else self.min_count

    # -- data ---------------------------------------------------------------------------
    def canonical(self, numbers: list[int], target: int) -> str:
        """The problem regardless of the order the numbers are shown in."""
        return " ".join(map(str, sorted(numbers))) + f">{target}"

    def problem_key(self, row: dict[str, Any]) -> str:
        return self.canonical(row["numbers"], row["target"])

    def prompt(self, numbers: list[int], target: int) -> str:
        return " ".join(map(str, numbers)) + f">{target}="

    def _draw(self, rng: random.Random) -> tuple[list[int], int, str] | None:
        count = rng.randint(self._fewest, self.num_count)
        numbers = [rng.randint(self.min_number, self.max_number) for _ in range(count)]
        pool = [(Fraction(n), str(n), _ATOM) for n in numbers]
        steps = []
        while len(pool) > 1:
            a = pool.pop(rng.randrange(len(pool)))
            b = pool.pop(rng.randrange(len(pool)))
            op = rng.choice(self.ops)
            if op == "-" and a[0] < b[0]:
                a, b = b, a  # intermediate values stay non-negative, as in the game
            if op == "/" and (b[0] == 0 or (a[0] / b[0]).denominator != 1):
                op = rng.choice([o for o in self.ops if o != "/"] or ["+"])
            pool.append(_combine(a, b, op))
            steps.append(f"{a[0]}{op}{b[0]}={pool[-1][0]}")
        value, text, _ = pool[0]
        if self.solution_format == "steps":
            text = ",".join(steps)
        if value.denominator != 1 or not (self.min_target <= value <= self.max_target):
            return None
        return numbers, int(value), text

    def make_rows(self, split: Split, n: int, seed: int) -> list[dict[str, Any]]:
        def draw(rng: random.Random) -> Draw:
            drawn = self._draw(rng)
            if drawn is None:
                return None
            numbers, target, solution = drawn
            row = {
                "prompt": self.prompt(numbers, target),
                "completion": solution,
                "numbers": numbers,
                "target": target,
            }
            return self.canonical(numbers, target), lambda: row

        return distinct_rows(self, split, n, seed, draw)

    # -- reward -------------------------------------------------------------------------
    def score(self, completion: Any, numbers: list[int], target: int) -> float:
        text = completion_text(completion)
        if len(text) > MAX_EXPRESSION_CHARS:  # bound the work before anything else
            return 0.0
        try:
            if "=" in text:
                value = parse_steps(text.strip(), numbers, self.ops)
            else:
                value, used = parse_expression(text.strip(), self.ops)
                if sorted(used) != sorted(numbers):
                    return 0.0
        except ValueError:
            return 0.0
        return 1.0 if value == target else self.partial_reward

    def reward(
        self, completions: list, numbers: list[list[int]], target: list[int], **kwargs: Any
    ) -> list[float]:
        return [self.score(c, nums, t) for c, nums, t in zip(completions, numbers, target, strict=True)]

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        return self.score(completion, row["numbers"], row["target"]) == 1.0


# -- the task's rewards, by name in a config (grpokit.tasks.TASK_REWARDS) ---------------------


def countdown_reward(completions: list, numbers: list, target: list, **kwargs: Any) -> list[float]:
    """The reward "countdown": CountdownTask.reward, 1.0 when the expression uses each number once
    and hits the target, the task's partial reward when it is well formed but misses, else 0.0.
    Settings in kwargs that are task fields (ops, partial_reward, ...) configure the task."""
    settings = {f.name for f in fields(CountdownTask)} - {"name"}
    task = CountdownTask(**{k: v for k, v in kwargs.items() if k in settings})
    return task.reward(completions=completions, numbers=numbers, target=target, **kwargs)


def _countdown_step(step: str, pool: list[int], ops: str) -> int | None:
    """The result of one step "a<op>b=c" (apply_step: taken from / added to pool), or None when
    the step is not valid (pool unchanged)."""
    try:
        return apply_step(step, pool, ops)
    except ValueError:
        return None


def countdown_steps(
    completions: list, numbers: list, target: list, *, ops: str = "+-*", **kwargs: Any
) -> list[StepScores]:
    """Process reward for step-by-step countdown solutions ("7-3=4,4*2=8,8+9=17", the task's
    solution_format="steps"), one StepScores per completion; steps are split at ",".

    A step scores 1.0 when it is well formed, combines two numbers still available (given ones or
    earlier results) with an operator in `ops`, and states the right result; the first step that
    is not scores 0.0 and runs to the end of the text (nothing after it is credited). The last
    step gets +1.0 more when every number was used and its result is the target. So a right
    three-step solution scores [1, 1, 2], one that misses the target [1, 1, 1], one wrong at the
    second step [1, 0]. Empty text: one step [0.0]. `outcome` (the one-number reward used for
    logging and evaluation) is 1.0 for a right solution, else 0.0.
    """
    out = []
    for completion, nums, tgt in zip(completions, numbers, target, strict=True):
        text = completion_text(completion)
        pool, scores, ends, pos, last = list(nums), [], [], 0, None
        for step in text.split(","):
            end = pos + len(step)
            last = _countdown_step(step, pool, ops)
            if last is None:
                scores.append(0.0)
                ends.append(len(text))
                break
            scores.append(1.0)
            ends.append(end)
            pos = end + 1  # past the comma
        solved = last is not None and len(pool) == 1 and last == tgt
        if solved:
            scores[-1] += 1.0
        out.append(StepScores(scores=scores, ends=ends, outcome=1.0 if solved else 0.0))
    return out


def _validate_countdown_steps(kwargs: dict) -> None:
    ops = kwargs.get("ops", "+-*")
    if not isinstance(ops, str) or not ops or not set(ops) <= set("+-*/"):
        raise ValueError(
            f"reward 'countdown_steps': kwargs['ops'] must be a non-empty subset of '+-*/', got {ops!r}"
        )


countdown_steps.validate_kwargs = _validate_countdown_steps  # type: ignore[attr-defined]  # function attribute
