"""The `code_tests` reward: run the completion's Python against the row's tests, sandboxed.

    name        reads               settings (spec kwargs)                                 value
    code_tests  completions, tests  partial=True, max_workers, isolation, Limits fields    passed / total
                                    (wall_time, cpu_time, memory_mb, ...)                  (1/0 if not partial)

    reward:
      - function: code_tests
        kwargs: {wall_time: 5, memory_mb: 512, partial: true}

The code is the last ```python (or ```py) block of the completion, else its last bare ``` block,
else the whole text. `tests` (a dataset column) is a string of Python, whose top-level `assert`
statements are the tests and whose other statements are set-up run in order (a string without
a top-level assert is one test), or a list of strings, each one test. The program runs once, in
one sandbox (grpokit/rewards/sandbox.py): the solution, then every test in a try block, and
prints a summary line tagged with a random nonce that the parent alone knows in advance.

Reward: the fraction of tests passed (partial=True) or 1.0 only when all pass; 0.0 when the
sandbox stops the program (timeout, memory, output...) or the summary is missing or forged;
None when the row has no usable tests or the sandbox itself could not run. Each result's reason
is kept: `code_tests.last_results` (CodeResult per completion) and `code_tests.last_reasons`
after every call, or call `evaluate_code` directly.

What the summary does not stop: a program that introspects the harness (gc, frames, trace
functions) can find the nonce or change the count, and objects whose __eq__ is always True pass
equality asserts. The sandbox contains such programs; it does not make their score honest.
"""
from __future__ import annotations

import ast
import dataclasses
import logging
import re
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any

from grpokit.rewards.sandbox import Isolation, Limits, SandboxResult, run_many
from grpokit.rewards.text import completion_text

logger = logging.getLogger("grpokit.rewards")

_LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(Limits))
_SETTINGS = ("partial", "max_workers", "isolation", *_LIMIT_FIELDS)
#: sandbox reasons that say nothing about the program: the sample gets None, not 0.0
_NOT_THE_PROGRAM = ("sandbox_error", "network_isolation_unavailable")


@dataclass(frozen=True)
class CodeResult:
    score: float | None
    reason: str
    """"passed", "failed", "syntax_error", "exception:<Type>" (the solution's top level raised;
    the tests still ran; OSErrors add the errno name, e.g. "exception:OSError:EFBIG"),
    "no_code", "no_summary", "forged_summary", a sandbox reason (timeout, cpu_limit,
    memory_limit, output_limit, killed:SIGKILL, error, ...), or for None scores "no_tests",
    "bad_tests: ...", "sandbox_error", "network_isolation_unavailable"."""
    passed: int = 0
    total: int = 0
    sandbox: SandboxResult | None = None


# -- code and tests ------------------------------------------------------------------------

_PY_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_BARE_BLOCK = re.compile(r"```[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last ```python block (an unclosed one at the end counts: truncated generations),
    else the last bare ``` block, else the whole text."""
    for pattern in (_PY_BLOCK, _BARE_BLOCK):
        blocks = pattern.findall(text)
        if blocks:
            return blocks[-1]
    return text


def parse_tests(tests: Any) -> list[tuple[str, bool]]:
    """(source, counted) pairs in running order; counted pairs are the tests, the others set-up.
    Raises ValueError for tests that are not Python or not a string / list of strings."""
    if isinstance(tests, str):
        try:
            module = ast.parse(tests)
        except SyntaxError as e:
            raise ValueError(f"tests do not parse: {e}") from e
        if not any(isinstance(node, ast.Assert) for node in module.body):
            return [(tests, True)] if module.body else []
        return [(ast.get_source_segment(tests, node), isinstance(node, ast.Assert)) for node in module.body]
    if isinstance(tests, (list, tuple)):
        out = []
        for i, test in enumerate(tests):
            if not isinstance(test, str):
                raise ValueError(f"test {i} is a {type(test).__name__}, not a string")
            try:
                ast.parse(test)
            except SyntaxError as e:
                raise ValueError(f"test {i} does not parse: {e}") from e
            out.append((test, True))
        return out
    raise ValueError(f"tests must be a string or a list of strings, got {type(tests).__name__}")


# The program run in the sandbox. Everything the harness needs is bound before the solution
# runs (default arguments), so a solution that rebinds builtins.exec, os.write or
# BaseException does not change how the harness counts or reports.
_HARNESS = """\
import errno, os, sys

def _grpokit_harness(solution, tests, _open=open, _remove=os.remove, _dup=os.dup, _write=os.write,
                     _compile=compile, _exec=exec, _type=type, _BaseException=BaseException,
                     _OSError=OSError, _isinstance=isinstance, _errorcode=dict(errno.errorcode), _settrace=sys.settrace,
                     _setprofile=sys.setprofile, _stdout=sys.stdout):
    with _open("_grpokit_nonce") as f:
        nonce = f.read()
    _remove("_grpokit_nonce")
    summary_fd = _dup(1)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    status = "ok"
    try:
        code = _compile(solution, "solution.py", "exec")
    except _BaseException:
        code, status = None, "syntax_error"
    if code is not None:
        try:
            _exec(code, namespace)
        except _BaseException as e:
            status = "exception:" + "_".join(_type(e).__name__.split())
            if _isinstance(e, _OSError):  # which one: EFBIG is the file size limit, ENOSPC the disk
                status += ":" + (_errorcode.get(e.errno, "?") if _type(e.errno) is int else "?")
    passed = total = 0
    for source, counted in tests:
        ok = False
        if code is not None:
            try:
                _exec(_compile(source, "tests.py", "exec"), namespace)
                ok = True
            except _BaseException:
                pass
            _settrace(None)
            _setprofile(None)
        if counted:
            total += 1
            passed += ok
    try:
        _stdout.flush()
    except _BaseException:
        pass
    _write(summary_fd, ("\\n%s %s %d %d\\n" % (nonce, status, passed, total)).encode())

_grpokit_harness(SOLUTION, TESTS)
"""


def build_program(solution: str, tests: list[tuple[str, bool]]) -> str:
    """The harness with the solution and the parsed tests filled in (as literals)."""
    return _HARNESS.replace("_grpokit_harness(SOLUTION, TESTS)", f"_grpokit_harness({solution!r}, {tests!r})")


def _summary(stdout: str, nonce: str) -> list[tuple[str, int, int]]:
    found = []
    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 4 and parts[0] == nonce and parts[2].isdigit() and parts[3].isdigit():
            found.append((parts[1], int(parts[2]), int(parts[3])))
    return found


def _score(result: SandboxResult, nonce: str, total: int, partial: bool) -> CodeResult:
    if result.reason in _NOT_THE_PROGRAM:
        return CodeResult(None, result.reason, 0, total, result)
    if result.reason != "ok":
        return CodeResult(0.0, result.reason, 0, total, result)
    lines = _summary(result.stdout, nonce)
    if not lines:
        return CodeResult(0.0, "no_summary", 0, total, result)
    status, passed, reported_total = lines[-1]
    if len(lines) > 1 or reported_total != total or passed > total:
        return CodeResult(0.0, "forged_summary", 0, total, result)
    if passed == total:
        reason = "passed"
    else:
        reason = status if status != "ok" else "failed"
    score = passed / total if partial else float(passed == total)
    return CodeResult(score, reason, passed, total, result)


def evaluate_code(
    completions: list[Any],
    tests: list[Any],
    *,
    limits: Limits = Limits(),
    partial: bool = True,
    max_workers: int | None = None,
    isolation: Isolation = "auto",
) -> list[CodeResult]:
    """One CodeResult per completion: extract its code, run it with its row's tests, score it."""
    if len(completions) != len(tests):
        raise ValueError(f"{len(completions)} completions but {len(tests)} rows of tests")
    results: list[CodeResult | None] = [None] * len(completions)
    jobs = []  # (index, program, nonce, number of tests)
    for i, (completion, row_tests) in enumerate(zip(completions, tests)):
        if row_tests is None:
            results[i] = CodeResult(None, "no_tests")
            continue
        try:
            parsed = parse_tests(row_tests)
        except ValueError as e:
            results[i] = CodeResult(None, f"bad_tests: {e}")
            continue
        total = sum(counted for _, counted in parsed)
        if total == 0:
            results[i] = CodeResult(None, "no_tests")
            continue
        code = extract_code(completion_text(completion))
        if not code.strip():
            results[i] = CodeResult(0.0, "no_code", 0, total)
            continue
        jobs.append((i, build_program(code, parsed), secrets.token_hex(16), total))

    outs = run_many(
        [program for _, program, _, _ in jobs],
        limits=limits,
        max_workers=max_workers,
        files=[{"_grpokit_nonce": nonce} for _, _, nonce, _ in jobs],
        isolation=isolation,
    )
    for (i, _, nonce, total), out in zip(jobs, outs):
        results[i] = _score(out, nonce, total, partial)
    for reason in _NOT_THE_PROGRAM:
        if failed := [r for r in results if r.reason == reason]:  # type: ignore[union-attr]
            logger.error("code_tests: %d of %d samples not evaluated (%s): %s", len(failed), len(results),
                         reason, (failed[0].sandbox.stderr.strip() or "-")[-500:])  # type: ignore[union-attr]
    return results  # type: ignore[return-value]


def code_tests(
    completions: list[Any],
    tests: list[Any],
    *,
    partial: bool = True,
    max_workers: int | None = None,
    isolation: Isolation = "auto",
    **kwargs: Any,
) -> list[float | None]:
    """TRL-style reward: the fraction of the row's tests the completion's code passes (see the
    module docstring). Limits fields (wall_time, memory_mb, ...) in kwargs set the sandbox."""
    limits = Limits(**{k: kwargs[k] for k in _LIMIT_FIELDS if k in kwargs})
    results = evaluate_code(completions, tests, limits=limits, partial=partial,
                            max_workers=max_workers, isolation=isolation)
    code_tests.last_results = results  # type: ignore[attr-defined]
    code_tests.last_reasons = [r.reason for r in results]  # type: ignore[attr-defined]
    logger.debug("code_tests reasons: %s", dict(Counter(code_tests.last_reasons)))  # type: ignore[attr-defined]
    return [r.score for r in results]


def _validate(kwargs: dict) -> None:
    if unknown := sorted(set(kwargs) - set(_SETTINGS)):
        raise ValueError(f"reward 'code_tests': unknown kwargs {unknown}; allowed: {list(_SETTINGS)}")
    if not isinstance(kwargs.get("partial", True), bool):
        raise ValueError(f"reward 'code_tests': kwargs['partial'] must be true or false, got {kwargs['partial']!r}")
    workers = kwargs.get("max_workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"reward 'code_tests': kwargs['max_workers'] must be an int >= 1, got {workers!r}")
    if kwargs.get("isolation", "auto") not in ("auto", "namespaces", "none"):
        raise ValueError("reward 'code_tests': kwargs['isolation'] must be 'auto', 'namespaces' or 'none'")
    try:
        Limits(**{k: kwargs[k] for k in _LIMIT_FIELDS if k in kwargs})
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward 'code_tests': {e}") from e


code_tests.validate_kwargs = _validate  # type: ignore[attr-defined]
code_tests.last_results = []  # type: ignore[attr-defined]
code_tests.last_reasons = []  # type: ignore[attr-defined]
