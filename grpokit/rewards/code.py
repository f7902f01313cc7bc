"""The `code_tests` reward: run the completion's Python against the row's tests, sandboxed.

    name        reads               settings (spec kwargs)                               value
    code_tests  completions, tests  partial=True, max_workers, isolation, Limits fields  passed / total
                                    (wall_time, cpu_time, memory_mb, ...)                (1/0 if not partial)

    reward:
      - function: code_tests
        kwargs: {wall_time: 5, memory_mb: 512, partial: true}

The code is the last ```python (or ```py) block of the completion, else its last bare ``` block,
else the whole text. `tests` (a dataset column) is one of:

    a string of Python      its top-level `assert`s are the tests, its other statements set-up run
                            in order (a string without a top-level assert is one test)
    a list of strings       each one test
    {"inputs": [...], "outputs": [...]}   stdin/stdout cases (APPS, CodeContests): the program runs
                            once per case; its output must match up to trailing whitespace

Python tests run in one sandbox per completion (grpokit/sandbox/run.py) as two processes
(grpokit/sandbox/harness.py): the judge runs the tests; the candidate, forked before the tests are
read, runs the solution and answers the judge's calls with plain data. The expected values never
enter the candidate's process and only the judge writes the verdict, so forging a summary,
reading the harness's frames, or returning an object whose __eq__ is always true scores nothing.

Reward: the fraction of tests passed (partial=True) or 1.0 only when all pass; 0.0 when the
sandbox stops the program (timeout, memory, output...), the candidate is killed, or no verdict
comes; None when the row has no usable tests or the sandbox itself could not run. Each result's
reason is kept: `code_tests.last_results` (CodeResult per completion) and `code_tests.last_reasons`
after every call, or call `evaluate_code` directly. docs/sandbox.md has the details.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grpokit.rewards.text import completion_text
from grpokit.sandbox import HARNESS, Isolation, Limits, SandboxResult, run_many

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
    "candidate_exited" (it ended before the tests did), "no_code", "no_summary" (no verdict: the
    judge was killed), "cpu_limit" / "killed:<SIGNAL>" (the candidate was), a sandbox reason (timeout,
    cpu_limit, memory_limit, output_limit, killed:SIGKILL, error, ...), or for None scores "no_tests",
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
        return [(_source(tests, node), isinstance(node, ast.Assert)) for node in module.body]
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


def _source(text: str, node: ast.stmt) -> str:
    segment = ast.get_source_segment(text, node)
    assert segment is not None  # a statement parsed from `text` knows its position in it
    return segment


def parse_stdio(tests: Mapping) -> list[tuple[str, str]]:
    """(stdin, expected stdout) pairs from {"inputs": [...], "outputs": [...]} (APPS, CodeContests).
    Raises ValueError for anything else."""
    if set(tests) != {"inputs", "outputs"}:
        raise ValueError(
            f"stdin/stdout tests are {{'inputs': [...], 'outputs': [...]}}, got keys {sorted(tests)}"
        )
    inputs, outputs = tests["inputs"], tests["outputs"]
    if (
        not isinstance(inputs, (list, tuple))
        or not isinstance(outputs, (list, tuple))
        or len(inputs) != len(outputs)
    ):
        raise ValueError("'inputs' and 'outputs' must be lists of the same length")
    if not all(isinstance(x, str) for x in [*inputs, *outputs]):
        raise ValueError("every input and output must be a string")
    return list(zip(inputs, outputs, strict=True))


def same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines (the usual judge rule)."""

    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(got) == lines(expected)


def _score_stdio(runs: list[tuple[SandboxResult, str]], partial: bool) -> CodeResult:
    total = len(runs)
    for out, _ in runs:
        if out.reason in _NOT_THE_PROGRAM:
            return CodeResult(None, out.reason, 0, total, out)
    wrong = [out for out, expected in runs if not (out.reason == "ok" and same_output(out.stdout, expected))]
    passed = total - len(wrong)
    reason = "passed" if not wrong else next((o.reason for o in wrong if o.reason != "ok"), "failed")
    score = passed / total if partial else float(passed == total)
    return CodeResult(score, reason, passed, total, wrong[0] if wrong else runs[0][0])


# The program run in the sandbox: the judge, which forks the candidate (grpokit/sandbox/harness.py).
_HARNESS = HARNESS.read_text()


def build_files(solution: str, tests: list[tuple[str, bool]], limit: int) -> tuple[str, dict[str, str]]:
    """(main.py, the other files) for one evaluation: the judge, the solution and the tests."""
    program = _HARNESS.replace("judge(1 << 20)", f"judge({int(limit)})")
    return program, {"solution.py": solution, "tests.json": json.dumps(tests)}


def _verdict(stdout: str) -> dict | None:
    """The judge's verdict: the last line of stdout, which only the judge writes."""
    lines = stdout.strip().splitlines()
    try:
        verdict = json.loads(lines[-1])["grpokit_verdict"] if lines else None
    except (ValueError, TypeError, KeyError):
        return None
    fields = {"status": str, "passed": int, "total": int, "candidate": str, "lost": bool}
    if type(verdict) is not dict or any(type(verdict.get(k)) is not t for k, t in fields.items()):
        return None
    return verdict


def _score(result: SandboxResult, total: int, partial: bool) -> CodeResult:
    if result.reason in _NOT_THE_PROGRAM:
        return CodeResult(None, result.reason, 0, total, result)
    if result.reason != "ok":
        return CodeResult(0.0, result.reason, 0, total, result)
    verdict = _verdict(result.stdout)
    if verdict is None or verdict["total"] != total or not 0 <= verdict["passed"] <= total:
        return CodeResult(0.0, "no_summary", 0, total, result)
    ended = verdict["candidate"]
    if ended.startswith("signal:"):  # killed mid-way (a limit): nothing it did counts
        reason = "cpu_limit" if ended == "signal:SIGXCPU" else "killed:" + ended[7:]
        return CodeResult(0.0, "memory_limit" if result.memory_killed else reason, 0, total, result)
    passed = verdict["passed"]
    if passed == total:
        reason = "passed"
    elif verdict["status"] != "ok":
        reason = verdict["status"]
    else:
        reason = "candidate_exited" if verdict["lost"] else "failed"
    score = passed / total if partial else float(passed == total)
    return CodeResult(score, reason, passed, total, result)


#: one sandbox run: (completion index, program, stdin, files, expected stdout or None for Python tests)
_Job = tuple[int, str, str, dict[str, str] | None, str | None]


def _plan_row(
    index: int, completion: Any, row_tests: Any, output_bytes: int
) -> CodeResult | tuple[int, list[_Job]]:
    """One completion's number of tests and its sandbox runs (one per stdin/stdout case, or one for its
    Python tests), or its result when there is nothing to run: no tests, bad tests, no code."""
    if row_tests is None:
        return CodeResult(None, "no_tests")
    try:
        stdio = parse_stdio(row_tests) if isinstance(row_tests, Mapping) else None
        parsed = parse_tests(row_tests) if stdio is None else []
    except ValueError as e:
        return CodeResult(None, f"bad_tests: {e}")
    total = sum(counted for _, counted in parsed) if stdio is None else len(stdio)
    if total == 0:
        return CodeResult(None, "no_tests")
    code = extract_code(completion_text(completion))
    if not code.strip():
        return CodeResult(0.0, "no_code", 0, total)
    if stdio is not None:  # a run per case; the parent compares the output
        return total, [(index, code, stdin, None, expected) for stdin, expected in stdio]
    program, files = build_files(code, parsed, output_bytes)
    return total, [(index, program, "", files, None)]


def _score_runs(
    jobs: list[_Job], outs: list[SandboxResult], totals: dict[int, int], partial: bool
) -> dict[int, CodeResult]:
    """The result of every completion that was run: its Python tests' verdict, or its stdin/stdout cases'
    outputs compared with the expected ones."""
    results: dict[int, CodeResult] = {}
    cases: dict[int, list[tuple[SandboxResult, str]]] = {}
    for (i, _, _, _, expected), out in zip(jobs, outs, strict=True):
        if expected is None:
            results[i] = _score(out, totals[i], partial)
        else:
            cases.setdefault(i, []).append((out, expected))
    for i, runs in cases.items():
        results[i] = _score_stdio(runs, partial)
    return results


def _log_not_evaluated(scored: list[CodeResult]) -> None:
    """One error per sandbox failure that says nothing about the programs (_NOT_THE_PROGRAM), with the
    sandbox's stderr."""
    for reason in _NOT_THE_PROGRAM:
        if failed := [r for r in scored if r.reason == reason]:
            sandbox = failed[0].sandbox
            logger.error(
                "code_tests: %d of %d samples not evaluated (%s): %s",
                len(failed),
                len(scored),
                reason,
                ((sandbox.stderr.strip() if sandbox is not None else "") or "-")[-500:],
            )


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
    jobs: list[_Job] = []
    totals: dict[int, int] = {}
    for i, (completion, row_tests) in enumerate(zip(completions, tests, strict=True)):
        planned = _plan_row(i, completion, row_tests, limits.output_bytes)
        if isinstance(planned, CodeResult):
            results[i] = planned
        else:
            totals[i], row_jobs = planned
            jobs += row_jobs

    outs = run_many(
        [(program, stdin) for _, program, stdin, _, _ in jobs],
        limits=limits,
        max_workers=max_workers,
        files=[files for _, _, _, files, _ in jobs],
        isolation=isolation,
    )
    for i, result in _score_runs(jobs, outs, totals, partial).items():
        results[i] = result
    scored = [r for r in results if r is not None]
    assert len(scored) == len(results)  # every completion has its result by now
    _log_not_evaluated(scored)
    return scored


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
    results = evaluate_code(
        completions, tests, limits=limits, partial=partial, max_workers=max_workers, isolation=isolation
    )
    reasons = [r.reason for r in results]
    code_tests.last_results = results  # type: ignore[attr-defined]  # function attribute
    code_tests.last_reasons = reasons  # type: ignore[attr-defined]  # function attribute
    logger.debug("code_tests reasons: %s", dict(Counter(reasons)))
    return [r.score for r in results]


def _validate(kwargs: dict) -> None:
    if unknown := sorted(set(kwargs) - set(_SETTINGS)):
        raise ValueError(f"reward 'code_tests': unknown kwargs {unknown}; allowed: {list(_SETTINGS)}")
    if not isinstance(kwargs.get("partial", True), bool):
        raise ValueError(
            f"reward 'code_tests': kwargs['partial'] must be true or false, got {kwargs['partial']!r}"
        )
    workers = kwargs.get("max_workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"reward 'code_tests': kwargs['max_workers'] must be an int >= 1, got {workers!r}")
    if kwargs.get("isolation", "auto") not in ("auto", "namespaces", "none"):
        raise ValueError("reward 'code_tests': kwargs['isolation'] must be 'auto', 'namespaces' or 'none'")
    try:
        Limits(**{k: kwargs[k] for k in _LIMIT_FIELDS if k in kwargs})
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward 'code_tests': {e}") from e


code_tests.validate_kwargs = _validate  # type: ignore[attr-defined]  # function attribute
code_tests.last_results = []  # type: ignore[attr-defined]  # function attribute
code_tests.last_reasons = []  # type: ignore[attr-defined]  # function attribute
