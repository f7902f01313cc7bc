"""Built-in tools: `calculator` (exact arithmetic, no eval) and `python` (grpokit's code sandbox).

    calculator("123*456")                  # "56088"
    calculator("7/2")                      # "3.5"
    python("print(sum(range(10)))")        # "45\\n"   (a fresh sandbox per call: grpokit/sandbox/)
    make_python_tool(Limits(wall_time=3))  # the same tool with other sandbox limits

`calculator` parses the expression with `ast` and evaluates only numbers, + - * / // % ** and parentheses
(integers stay exact); exponents above MAX_EXPONENT and results above MAX_DIGITS digits are errors, so an
expression cannot make the trainer compute for minutes. `python` runs the code exactly as `code_tests` runs a
candidate (grpokit.sandbox.run_python with its isolation and limits: no network, no host files, its own
uid and process tree, CPU / memory / process / output limits; docs/sandbox.md) and returns its stdout, or an
error text with the sandbox's reason and the last line of stderr.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from grpokit.sandbox import Isolation, Limits, run_python

MAX_EXPONENT = 256
MAX_DIGITS = 1000

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is above {MAX_EXPONENT}")
        if (
            isinstance(node.op, ast.Pow)
            and isinstance(left, int)
            and right > 0
            and len(str(abs(left))) * right > MAX_DIGITS + right
        ):
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")  # checked before computing it
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.dump(node)[:40]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "123*456".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else format(value, ".12g")
    return str(value)


def make_python_tool(
    limits: Limits = Limits(), *, isolation: Isolation = "auto", max_output_chars: int = 2000
) -> Callable[[str], str]:
    """The `python` tool with these sandbox limits (the code_tests sandbox, grpokit/sandbox/)."""

    def python(code: str) -> str:
        """Run a Python program (standard library only) in a sandbox and return what it printed.

        Args:
            code: the program; print the values you need.
        """
        result = run_python(code, limits=limits, isolation=isolation)
        python.last_result = result  # type: ignore[attr-defined]  # function attribute
        if result.ok:
            return result.stdout[:max_output_chars]
        last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        raise RuntimeError(
            f"{result.reason}{'; ' + last[:200] if last else ''}"
        )  # e.g. "timeout", "error; NameError: ..."

    python.last_result = None  # type: ignore[attr-defined]  # function attribute
    return python


python = make_python_tool()

#: the tools a config's `tools.builtin` may name
BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}
