"""Rewards: TRL calling convention, loading, weighted combination, error isolation, built-ins."""

from __future__ import annotations

import ast
import logging
import math
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grpokit.rewards
from grpokit.rewards import BUILTIN_REWARDS, RewardManager, RewardSpec, resolve_reward
from grpokit.rewards.builtins import extract_final_answer

NAN = float("nan")


def call(manager, completions, columns=None, completion_ids=None, prompts=None):
    n = len(completions)
    return manager(
        prompts=prompts or [f"p{i}" for i in range(n)],
        completions=completions,
        completion_ids=completion_ids or [[1] * (i + 1) for i in range(n)],
        columns=columns or {},
    )


def const(values, name="const"):
    """A reward function returning fixed values, whatever it is given."""

    def fn(completions, **kwargs):
        return values

    fn.__name__ = name
    return fn


def assert_same(actual: torch.Tensor, expected: list[float]):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), equal_nan=True)


# -- calling convention ------------------------------------------------------------------


def test_trl_signature_gets_columns_and_call_args_as_keywords():
    seen = {}

    def exact(completions, answer, **kwargs):
        seen.update(kwargs, answer=answer)
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    out = call(
        RewardManager([exact]),
        ["4", "5"],
        columns={"answer": ["4", "4"], "level": [1, 2]},
        completion_ids=[[7], [8, 9]],
        prompts=["2+2", "2+2"],
    )
    assert_same(out.total, [1.0, 0.0])
    assert seen == {
        "prompts": ["2+2", "2+2"],
        "completion_ids": [[7], [8, 9]],
        "level": [1, 2],
        "answer": ["4", "4"],
    }


def test_function_without_kwargs_gets_only_what_it_declares():
    def by_length(completion_ids, prompts):
        return [len(ids) / len(p) for ids, p in zip(completion_ids, prompts, strict=True)]

    out = call(
        RewardManager([by_length]),
        ["a", "b"],
        columns={"answer": ["x", "y"]},
        completion_ids=[[1, 2], [1]],
        prompts=["ab", "abcd"],
    )
    assert_same(out.total, [1.0, 0.25])


def test_missing_column_names_function_column_and_available_columns():
    def needs_solution(completions, solution):
        return [0.0] * len(completions)

    manager = RewardManager([needs_solution])  # strict=False: a setup error still raises
    with pytest.raises(ValueError) as e:
        call(manager, ["a"], columns={"answer": ["1"], "level": [3]})
    msg = str(e.value)
    assert "needs_solution" in msg and "'solution'" in msg and "['answer', 'level']" in msg


def test_spec_kwargs_are_partial_applied_and_checked():
    def scaled(completions, scale, **kwargs):
        return [scale] * len(completions)

    out = call(RewardManager([RewardSpec(scaled, kwargs={"scale": 3.0})]), ["a"], columns={"scale": [9.0]})
    assert_same(out.total, [3.0])  # spec kwargs win over a column of the same name

    def strict_sig(completions):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"kwargs \['scale'\] are not parameters"):
        RewardManager([RewardSpec(strict_sig, kwargs={"scale": 1})])
    with pytest.raises(ValueError, match="may not set"):
        RewardManager([RewardSpec(scaled, kwargs={"completions": []})])


def test_specs_as_objects_dicts_strings_and_names():
    spec_obj = SimpleNamespace(function="format", weight=2.0, kwargs={"pattern": "a+"}, name="as")
    manager = RewardManager(
        [spec_obj, {"function": "format", "name": "default_format"}, const([0.5], "half")]
    )
    assert manager.names == ["as", "default_format", "half"]
    assert_same(call(manager, ["aaa"]).total, [2.5])
    with pytest.raises(ValueError, match="distinct `name`"):
        RewardManager(["format", "format"])
    with pytest.raises(ValueError, match="reserved"):
        RewardManager([RewardSpec("format", name="total")])
    with pytest.raises(ValueError, match="at least one"):
        RewardManager([])
    with pytest.raises(ValueError, match="weight"):
        RewardManager([RewardSpec("format", weight=float("inf"))])


# -- loading -----------------------------------------------------------------------------


def test_resolve_builtins_modules_and_files(tmp_path, monkeypatch):
    assert list(BUILTIN_REWARDS) == ["math", "format", "overlong", "length", "code_tests"]  # task-agnostic
    for name, fn in BUILTIN_REWARDS.items():
        assert resolve_reward(name) is fn

    (tmp_path / "my_rewards.py").write_text(
        "def shout(completions, **kwargs):\n    return [float(c.isupper()) for c in completions]\n"
        "class Scorer:\n    @staticmethod\n    def score(completions, **kwargs):\n        return [1.0] * "
        "len(completions)\nNOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("my_rewards:shout")(completions=["HI", "hi"]) == [1.0, 0.0]
    assert resolve_reward("my_rewards:Scorer.score")(completions=["x"]) == [1.0]

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file_reward.py").write_text(
        "def two(completions, **kw):\n    return [2.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert resolve_reward("sub/file_reward.py:two")(completions=["a"]) == [2.0]
    assert resolve_reward(f"{tmp_path}/sub/file_reward.py:two")(completions=["a"]) == [2.0]
    manager = RewardManager([RewardSpec("my_rewards:shout", weight=2.0), "sub/file_reward.py:two"])
    assert manager.names == ["shout", "two"]
    assert_same(call(manager, ["OK"]).total, [4.0])


def test_resolve_errors_are_one_line_and_say_the_fix(tmp_path, monkeypatch):
    (tmp_path / "broken_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "has_const.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "matth": "did you mean 'math'",
        "no_such_pkg_xyz.mod:fn": "module 'no_such_pkg_xyz' not found",
        "broken_dep:fn": "importing 'broken_dep' failed",
        "has_const:missing": "has no attribute 'missing'",
        "has_const:VALUE": "not callable",
        "nowhere/r.py:fn": "not found",
    }
    for spec, expected in cases.items():
        with pytest.raises(ValueError) as e:
            resolve_reward(spec)
        assert expected in str(e.value) and spec in str(e.value) and "\n" not in str(e.value), spec


# -- combination -------------------------------------------------------------------------


def test_weights_combine_with_hand_numbers():
    manager = RewardManager(
        [
            RewardSpec(const([1.0, 0.0, 0.5], "a"), weight=2.0),
            RewardSpec(const([0.2, None, -1.0], "b"), weight=-0.5),
        ]
    )
    out = call(manager, ["x", "y", "z"])
    # 2*1 - 0.5*0.2 = 1.9;  2*0 + (None -> 0) = 0;  2*0.5 - 0.5*(-1) = 1.5
    assert_same(out.total, [1.9, 0.0, 1.5])
    assert_same(out.per_function["a"], [1.0, 0.0, 0.5])  # raw, unweighted
    assert_same(out.per_function["b"], [0.2, NAN, -1.0])
    assert out.errors == {"a": 0, "b": 0} and out.weights == {"a": 2.0, "b": -0.5}


def test_none_means_not_applicable_and_counts_in_none_frac():
    manager = RewardManager([const([None, 1.0, None, 4.0], "a"), const([None, None, 2.0, 2.0], "b")])
    out = call(manager, ["w", "x", "y", "z"])
    assert_same(out.total, [0.0, 1.0, 2.0, 6.0])
    m = out.metrics()
    assert m["reward/none_frac"] == 0.25  # sample 0 gets nothing from anyone
    assert m["reward/a"] == pytest.approx(2.5) and m["reward/b"] == pytest.approx(2.0)
    assert m["reward/a/std"] == pytest.approx(math.sqrt(4.5))  # sample std of [1, 4]
    assert m["reward/total"] == pytest.approx(9 / 4)
    assert m["reward/errors/a"] == 0.0 and m["reward/errors/b"] == 0.0
    assert m["reward/timeouts/a"] == 0.0 and m["reward/error_frac"] == 0.0
    assert set(m) == {
        "reward/total",
        "reward/total/std",
        "reward/a",
        "reward/a/std",
        "reward/errors/a",
        "reward/timeouts/a",
        "reward/b",
        "reward/b/std",
        "reward/errors/b",
        "reward/timeouts/b",
        "reward/none_frac",
        "reward/error_frac",
        "reward/skipped_frac",
    }


def test_array_and_tensor_returns_are_accepted():
    manager = RewardManager(
        [
            const(np.array([1.0, 2.0]), "np"),
            const(torch.tensor([0.5, 0.5]), "pt"),
            const([torch.tensor(1.0), np.float32(2.0)], "scalars"),
        ]
    )
    assert_same(call(manager, ["a", "b"]).total, [2.5, 4.5])


# -- isolation ---------------------------------------------------------------------------


def test_raising_function_is_isolated_counted_and_logged_once(caplog):
    def flaky(completions, **kwargs):
        raise ZeroDivisionError("boom")

    manager = RewardManager([flaky, const([1.0, 2.0], "ok")])
    with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
        first = call(manager, ["a", "b"])
        second = call(manager, ["a", "b"])
    for out in (first, second):
        assert_same(out.total, [1.0, 2.0])
        assert_same(out.per_function["flaky"], [NAN, NAN])
        assert out.errors == {"flaky": 2, "ok": 0}
        assert out.metrics()["reward/errors/flaky"] == 2.0
    records = [r for r in caplog.records if r.name == "grpokit.rewards"]
    assert len(records) == 1
    assert "flaky" in records[0].getMessage() and "ZeroDivisionError: boom" in records[0].getMessage()
    assert records[0].exc_info and "raise ZeroDivisionError" in caplog.text  # the traceback


@pytest.mark.parametrize(
    "returned, problem, n_errors, expected",
    [
        ([1.0], "returned 1 rewards for 3 completions", 3, [NAN, NAN, NAN]),
        (None, "returned NoneType instead of a list", 3, [NAN, NAN, NAN]),
        ("1.0", "returned str instead of a list", 3, [NAN, NAN, NAN]),
        ([1.0, "1.0", 0.5], "invalid reward(s) of 3, e.g. '1.0' at index 1", 1, [1.0, NAN, 0.5]),
        ([NAN, 1.0, float("-inf")], "2 invalid reward(s) of 3, e.g. nan at index 0", 2, [NAN, 1.0, NAN]),
        ([1e300, [1.0], None], "2 invalid reward(s)", 2, [NAN, NAN, NAN]),  # overflows float32; not a number
    ],
)
def test_bad_outputs_void_only_what_they_must(returned, problem, n_errors, expected, caplog):
    bad = const(returned, "bad")
    with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
        out = call(RewardManager([bad, const([1.0, 1.0, 1.0], "one")]), ["a", "b", "c"])
    assert out.errors["bad"] == n_errors
    assert_same(out.per_function["bad"], expected)
    assert_same(out.total, [1.0 + (0.0 if math.isnan(e) else e) for e in expected])
    assert problem in caplog.text

    with pytest.raises(RuntimeError, match="'bad'") as e:
        call(RewardManager([bad], strict=True), ["a", "b", "c"])
    assert problem in str(e.value)


def test_strict_mode_raises_with_the_cause():
    def flaky(completions, **kwargs):
        raise KeyError("answer")

    with pytest.raises(RuntimeError, match="'flaky'.*raised KeyError") as e:
        call(RewardManager([flaky], strict=True), ["a"])
    assert isinstance(e.value.__cause__, KeyError)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_fuzz_total_is_finite_and_equals_reference_nansum(data):
    n = data.draw(st.integers(1, 6))
    k = data.draw(st.integers(1, 4))
    entry = st.one_of(
        st.none(), st.just(NAN), st.just(math.inf), st.just("x"), st.floats(-1e3, 1e3), st.integers(-5, 5)
    )
    outputs = [data.draw(st.lists(entry, min_size=n, max_size=n)) for _ in range(k)]
    weights = [data.draw(st.floats(-5, 5)) for _ in range(k)]
    manager = RewardManager(
        [
            RewardSpec(const(o, f"f{i}"), weight=w)
            for i, (o, w) in enumerate(zip(outputs, weights, strict=True))
        ]
    )
    logging.getLogger("grpokit.rewards").disabled = True
    try:
        out = call(manager, ["c"] * n)
    finally:
        logging.getLogger("grpokit.rewards").disabled = False

    def valid(v):
        return isinstance(v, (int, float)) and math.isfinite(v)

    reference = [
        math.fsum(w * float(np.float32(o[i])) for o, w in zip(outputs, weights, strict=True) if valid(o[i]))
        for i in range(n)
    ]
    assert torch.isfinite(out.total).all()
    torch.testing.assert_close(out.total, torch.tensor(reference, dtype=torch.float32), rtol=1e-5, atol=1e-3)
    for i, o in enumerate(outputs):
        assert out.errors[f"f{i}"] == sum(v is not None and not valid(v) for v in o)
    none_frac = sum(not any(valid(o[i]) for o in outputs) for i in range(n)) / n
    assert out.metrics()["reward/none_frac"] == pytest.approx(none_frac)


def test_registry_is_the_callers():
    def mine(completions, **kwargs):
        return [1.0] * len(completions)

    registry = {"mine": mine, **BUILTIN_REWARDS}
    assert resolve_reward("mine", registry) is mine
    manager = RewardManager(["mine", RewardSpec("format", weight=0.5)], registry=registry)
    assert manager.names == ["mine", "format"]
    assert_same(call(manager, ["x"]).total, [1.0])
    # The message lists the registry's names in its order; without one, the built-ins.
    with pytest.raises(
        ValueError, match=r"'mne' is not a built-in \(mine, math, format, .*\); did you mean 'mine'\?"
    ):
        RewardManager(["mne"], registry=registry)
    with pytest.raises(
        ValueError, match=r"'mine' is not a built-in \(math, format, overlong, length, code_tests\)"
    ):
        RewardManager(["mine"])


def test_reward_spec_is_the_configs():
    import grpokit.config
    import grpokit.rewards.manager

    assert RewardSpec is grpokit.config.RewardSpec is grpokit.rewards.manager.RewardSpec
    fn = const([1.0], "f")
    assert RewardSpec("math").function == "math" and RewardSpec(fn, weight=0.5).function is fn
    assert RewardSpec(function="math", name="m") == RewardSpec("math", name="m")
    with pytest.raises(TypeError, match="twice"):
        RewardSpec("math", function="format")
    with pytest.raises(ValueError, match="valid string"):
        RewardSpec(3)


def test_rewards_never_import_tasks():
    # Tasks use rewards, never the reverse (grpokit/tasks/__init__.py holds the tasks' rewards):
    # no import of grpokit.tasks anywhere in grpokit/rewards, function bodies included ...
    for path in sorted(Path(grpokit.rewards.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.startswith("grpokit.tasks") for n in names), f"{path.name}:{node.lineno}"
    # ... and importing the rewards loads no task module.
    code = (
        "import sys, grpokit.rewards; print(sorted(m for m in sys.modules if m.startswith('grpokit.tasks')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- built-ins ---------------------------------------------------------------------------


def test_math_reward_worked_examples():
    math_reward = BUILTIN_REWARDS["math"]
    completions = [
        "so the result is \\boxed{2}",  # boxed vs plain gold "2"
        "2",  # bare answer
        "I get \\boxed{3}",  # wrong
        "first \\boxed{3}, no wait: \\boxed{2}",  # the last \boxed counts
        "The answer is \\boxed{0.5}",  # equal value, other form
        "<think>maybe \\boxed{7}</think><answer>2</answer>",  # the <answer> tag wins over the thinking
        [{"role": "assistant", "content": "\\boxed{2}"}],  # conversational completion
        "\\boxed{2}",  # gold that does not parse: not applicable
    ]
    answers = ["2", "2", "2", "2", "\\frac{1}{2}", "2", 2, ""]
    assert math_reward(completions=completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, None]
    assert extract_final_answer("a \\boxed{\\frac{1}{2}} b") == "\\boxed{\\frac{1}{2}}"


def test_math_reward_works_off_the_main_thread():
    # math-verify's timeout uses signal.alarm, which raises off the main thread unless disabled.
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            r=BUILTIN_REWARDS["math"](completions=["\\boxed{4}", "\\boxed{5}"], answer=["4", "4"])
        )
    )
    worker.start()
    worker.join()
    assert result["r"] == [1.0, 0.0]


def test_math_via_manager_counts_unparsable_gold_as_none():
    out = call(RewardManager(["math"]), ["\\boxed{2}", "\\boxed{2}"], columns={"answer": ["2", None]})
    assert_same(out.per_function["math"], [1.0, NAN])
    assert out.errors == {"math": 0} and out.metrics()["reward/none_frac"] == 0.5


def test_format_reward():
    fmt = BUILTIN_REWARDS["format"]
    completions = [
        "<think>2+2 is 4</think><answer>4</answer>",
        "<think>\nmulti\nline\n</think>\n<answer>\n4\n</answer>\n",
        "<answer>4</answer>",
        "<think>a</think><think>b</think><answer>c</answer>",
        "<think>a</think><answer>4</answer> trailing text",
    ]
    assert fmt(completions=completions) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert fmt(completions=["x 12 y"], pattern=r"\d+") == [0.0]
    assert fmt(completions=["x 12 y"], pattern=r"\d+", search=True) == [1.0]
    assert fmt(completions=["a\nb"], pattern="a.b", dotall=False) == [0.0]
    with pytest.raises(ValueError, match="not a valid regex"):
        RewardManager([RewardSpec("format", kwargs={"pattern": "(unclosed"})])


def test_overlong_reward_follows_dapo_eq_13():
    # L_max = 100, L_cache = 20: free up to 80, then linear down to -1 at 100, -1 beyond.
    lengths = [10, 80, 81, 90, 100, 101]
    out = BUILTIN_REWARDS["overlong"](
        completion_ids=[[0] * n for n in lengths], max_completion_length=100, cache_length=20
    )
    assert out == pytest.approx([0.0, 0.0, -0.05, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="max_completion_length"):
        RewardManager([RewardSpec("overlong", kwargs={"cache_length": 20})])
    with pytest.raises(ValueError, match="cache_length"):
        RewardManager([RewardSpec("overlong", kwargs={"max_completion_length": 100})])
    with pytest.raises(ValueError, match=r"cache_length \(200\) must be <="):
        RewardManager([RewardSpec("overlong", kwargs={"max_completion_length": 100, "cache_length": 200})])


def test_length_reward():
    out = BUILTIN_REWARDS["length"](completion_ids=[[0] * 4, []], max_completion_length=10, coef=0.5)
    assert out == pytest.approx([-0.2, 0.0])  # -0.5 * 4 / 10
    with pytest.raises(ValueError, match="max_completion_length"):
        RewardManager(["length"])


@pytest.mark.parametrize("name", ["mean", "std", "zero_std_frac", "group_std_mean", "kl_shaping"])
def test_a_reward_named_like_a_batch_statistic_is_refused(name):
    # reward/mean, reward/std, ... are the trainer's statistics of the total reward: a function with that
    # name would be overwritten in the step's metrics without a word
    # (grpokit.metrics.compute.RESERVED_REWARD_NAMES).
    with pytest.raises(ValueError, match=rf"name '{name}' is reserved \(reward/{name} is another metric"):
        RewardManager([RewardSpec("format", name=name)])
    RewardManager([RewardSpec("format", name=f"{name}_ok")])  # a name that merely contains it is fine


def test_a_function_that_raises_on_one_sample_costs_only_that_sample():
    """One bad sample used to void the whole batch (None for all 64 completions, every step). The call is
    retried on halves, and the halves that raise on their halves, down to single samples: the others keep
    their scores, the failed one is counted."""
    calls = []

    def picky(completions, **kwargs):
        calls.append(len(completions))
        if "boom" in completions:
            raise ValueError("cannot score 'boom'")
        return [float(len(c)) for c in completions]

    texts = ["a", "bb", "ccc", "boom", "ee", "f", "gg", "hhh"]
    out = call(RewardManager([RewardSpec(picky)]), texts)
    scores = out.per_function["picky"]
    assert torch.isnan(scores[3]) and scores[[0, 1, 2, 4, 5, 6, 7]].tolist() == [
        1.0,
        2.0,
        3.0,
        2.0,
        1.0,
        2.0,
        3.0,
    ]
    assert out.errors["picky"] == 1 and out.total[3] == 0.0
    assert len(calls) == 1 + 2 + 2 + 2  # the batch, then two parts at each of three levels

    def broken(completions, **kwargs):
        calls.append(len(completions))
        raise RuntimeError("always")

    calls.clear()
    out = call(RewardManager([RewardSpec(broken)]), texts * 8)  # 64 samples
    assert out.errors["broken"] == 64 and torch.isnan(out.per_function["broken"]).all()
    assert len(calls) == 2 * 64 - 1  # a function that fails on everything: every part once, down to singles
    with pytest.raises(
        RuntimeError, match="raised ValueError"
    ):  # reward_errors=raise: the first failure stops
        call(RewardManager([RewardSpec(picky)], strict=True), texts)


def isolation_bound(n: int, k: int) -> int:
    """The most calls a batch of n samples costs a function that fails on k of them (docs/rewards.md,
    RewardManager._isolate): 1 when none fails; else 2**(a+1) - 1 + 2k(D - a), D = ceil(log2 n),
    a = ceil(log2 k), and never more than 2n - 1."""
    if k == 0:
        return 1
    depth, a = (n - 1).bit_length(), (k - 1).bit_length()  # ceil(log2 n), ceil(log2 k)
    return min(2 * n - 1, 2 ** (a + 1) - 1 + 2 * k * (depth - a))


def test_the_isolation_bound_in_the_docs():
    assert [isolation_bound(64, k) for k in (0, 1, 2, 8, 12, 64)] == [1, 13, 23, 63, 79, 127]
    for n in range(1, 200):
        for k in range(1, n + 1):  # the simpler forms the docs give are looser
            simple = 2 * k * math.ceil(math.log2(n / k)) + 4 * k - 3
            assert isolation_bound(n, k) <= min(simple, 2 * n - 1, 1 + 2 * k * (n - 1).bit_length())


def _picky(bad: set[str], calls: list[int], is_async: bool):
    """A reward that raises on any call holding one of `bad`, and scores the others by their number."""

    def score(completions):
        calls.append(len(completions))
        if hit := [c for c in completions if c in bad]:
            raise ValueError(f"cannot score {hit[0]!r}")
        return [float(c[1:]) for c in completions]

    if is_async:

        async def picky(completions, **kwargs):
            return score(completions)

        return picky

    def picky(completions, **kwargs):  # noqa: F811 (one of the two, as is_async says)
        return score(completions)

    return picky


_PICKY: dict[bool, tuple[RewardManager, set[str], list[int]]] = {}


def _picky_manager(is_async: bool) -> tuple[RewardManager, set[str], list[int]]:
    """One manager per kind for every example (an async one holds an event loop thread): its bad set and its
    calls are cleared in place."""
    if is_async not in _PICKY:
        bad: set[str] = set()
        calls: list[int] = []
        specs = [RewardSpec(_picky(bad, calls, is_async), name="picky"), RewardSpec(const_len(), name="len")]
        _PICKY[is_async] = RewardManager(specs), bad, calls
    return _PICKY[is_async]


def const_len():
    def fn(completions, **kwargs):
        return [float(len(c)) for c in completions]

    return fn


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_isolation_finds_exactly_the_failing_samples(data):
    """Any failure pattern over any batch size, sync and async: exactly the samples the function raises on go
    without its reward, every other one gets its value, errors counts the failing ones, and the calls stay
    within the documented bound."""
    n = data.draw(st.integers(1, 100), label="n")
    pattern = data.draw(
        st.one_of(
            st.lists(st.booleans(), min_size=n, max_size=n).map(lambda b: {i for i, x in enumerate(b) if x}),
            st.sets(st.integers(0, n - 1), max_size=4),  # a few
            st.integers(1, 9).map(lambda m: set(range(0, n, m))),  # spread: every m-th
            st.just(set(range(n))),  # all
        ),
        label="failing",
    )
    manager, bad, calls = _picky_manager(data.draw(st.booleans(), label="async"))
    texts = [f"s{i}" for i in range(n)]
    bad.clear()
    bad.update(texts[i] for i in pattern)
    calls.clear()
    logging.getLogger("grpokit.rewards").disabled = True
    try:
        out = call(manager, texts)
    finally:
        logging.getLogger("grpokit.rewards").disabled = False
    scores = out.per_function["picky"]
    assert {i for i in range(n) if torch.isnan(scores[i])} == pattern
    assert all(scores[i] == i for i in range(n) if i not in pattern)
    assert_same(out.per_function["len"], [float(len(t)) for t in texts])  # the other function: untouched
    assert_same(out.total, [len(t) + (0.0 if i in pattern else i) for i, t in enumerate(texts)])
    assert out.errors == {"picky": len(pattern), "len": 0}
    assert out.metrics()["reward/errors/picky"] == len(pattern)
    assert len(calls) <= isolation_bound(n, len(pattern)), (len(calls), n, len(pattern))


def test_a_call_that_raises_only_on_whole_batches_costs_at_most_2n_minus_1_calls():
    """A failure that depends on the batch, not on a sample (here: more than 3 at once): no sample fails,
    each gets its value from a part small enough, and no part is called twice."""
    calls: list[int] = []

    def crowded(completions, **kwargs):
        calls.append(len(completions))
        if len(completions) > 3:
            raise RuntimeError("too many at once")
        return [1.0] * len(completions)

    out = call(RewardManager([RewardSpec(crowded)]), ["x"] * 37)
    assert out.errors["crowded"] == 0 and (out.per_function["crowded"] == 1.0).all()
    assert len(calls) <= 2 * 37 - 1


def test_evaluation_loses_only_the_samples_a_reward_raises_on():
    """The held-out judge (grpokit.evaluate.make_judge) scores through the same manager: a function raising on
    one completion in 8, spread through the batch, costs only those."""
    from grpokit.evaluate import make_judge
    from grpokit.rollout import Completions

    texts = [f"s{i}" for i in range(50)]
    bad = {t for i, t in enumerate(texts) if i % 8 == 3}
    judge = make_judge(RewardManager([RewardSpec(_picky(bad, [], False), name="picky")]), threshold=0.0)
    rows = [SimpleNamespace(prompt=f"p{i}", columns={}) for i in range(50)]
    comps = Completions(token_ids=[[1]] * 50, texts=texts, finish_reasons=["stop"] * 50)
    logging.getLogger("grpokit.rewards").disabled = True
    try:
        score, _, scored = judge(rows, comps)
    finally:
        logging.getLogger("grpokit.rewards").disabled = False
    assert score == [0.0 if t in bad else float(i) for i, t in enumerate(texts)]
    assert sum(not s for s in scored) == len(bad) + 1  # s0's value is 0: not "well formed" either


# ----------------------------------------------------------------------------- time limits (reward_timeout)


def hanging(release: threading.Event, calls: list, name="hangs"):
    """A reward function that waits for `release` (at most 5 s), as one stuck on a network call would."""

    def fn(completions, **kwargs):
        calls.append(threading.current_thread().name)
        release.wait(5)
        return [1.0] * len(completions)

    fn.__name__ = name
    return fn


def test_a_call_past_its_timeout_returns_counts_its_samples_and_is_not_started_again_while_busy(caplog):
    release, calls = threading.Event(), []
    manager = RewardManager([RewardSpec(hanging(release, calls)), const([0.5] * 4, "ok")], timeout=0.2)
    try:
        with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
            start = time.monotonic()
            out = call(manager, ["a", "b", "c", "d"])
            assert time.monotonic() - start < 2  # the call returned at its timeout, not when the function did
            busy = call(manager, ["a", "b", "c", "d"])  # the first call still runs: this one is not started
        for o in (out, busy):
            assert o.errors == {"hangs": 4, "ok": 0} and o.timeouts == {"hangs": 1}
            assert torch.isnan(o.per_function["hangs"]).all() and o.total.tolist() == [0.5] * 4
            assert o.metrics()["reward/timeouts/hangs"] == 1 and o.metrics()["reward/error_frac"] == 1.0
        assert len(calls) == 1  # not bisected, and no second thread while the first still runs
        assert "reward function 'hangs'" in caplog.text and "did not return within 0.2 s" in caplog.text
        assert "reward_timeout=0.2 s; raise it, give this reward its own `timeout`" in caplog.text
        assert caplog.text.count("did not return") == 1  # reported once, then counted
    finally:
        release.set()
    time.sleep(0.1)  # the abandoned call returns; the next call runs again
    out = call(manager, ["a", "b", "c", "d"])
    assert out.errors["hangs"] == 0 and out.per_function["hangs"].tolist() == [1.0] * 4 and len(calls) == 2


def test_a_timeout_with_strict_raises_naming_the_function_and_the_keys():
    release = threading.Event()
    manager = RewardManager([RewardSpec(hanging(release, []), timeout=0.1)], strict=True, timeout=300)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"reward function 'hangs' \(.*\) did not return within 0.1 s.*"
            r"its own timeout=0.1 s in rewards:",
        ):
            call(manager, ["a", "b"])
    finally:
        release.set()


def test_a_rewards_own_timeout_beats_the_default():
    release = threading.Event()
    try:
        shorter = RewardManager([RewardSpec(hanging(release, []), timeout=0.1)], timeout=60)
        start = time.monotonic()
        assert call(shorter, ["a", "b"]).timeouts == {"hangs": 1} and time.monotonic() - start < 5
    finally:
        release.set()

    def slowish(completions, **kwargs):
        time.sleep(0.3)
        return [1.0] * len(completions)

    assert call(RewardManager([RewardSpec(slowish)], timeout=0.1), ["a"]).timeouts == {"slowish": 1}
    for own in (5, 0):  # a longer limit, or none (0): the default of 0.1 s does not apply
        out = call(RewardManager([RewardSpec(slowish, timeout=own)], timeout=0.1), ["a"])
        assert out.timeouts == {} and out.per_function["slowish"].tolist() == [1.0]
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        RewardManager([{"function": slowish, "timeout": -1}])


def test_a_slow_call_logs_a_warning_with_its_time(caplog):
    def slowish(completions, **kwargs):
        time.sleep(0.25)
        return [1.0] * len(completions)

    with caplog.at_level(logging.WARNING, logger="grpokit.rewards"):
        out = call(
            RewardManager([RewardSpec(slowish), const([0.0] * 3, "quick")], timeout=10, slow_warning=0.1),
            ["a", "b", "c"],
        )
    assert out.errors == {"slowish": 0, "quick": 0}
    (line,) = [r.getMessage() for r in caplog.records]
    assert re.search(
        r"reward function 'slowish' \(.*\) took 0\.[23] s for 3 completions, more than "
        r"reward_slow_warning=0.1 s \(its timeout is 10 s\)",
        line,
    ), line


def test_functions_that_need_the_main_thread_run_there(caplog):
    """signal.signal works only in the main thread: math-verify's timeouts (the built-in math, TRL's
    accuracy_reward)."""
    import signal

    threads = []

    def alarmed(completions, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))  # ValueError off the main thread
        return [1.0] * len(completions)

    manager = RewardManager([RewardSpec(alarmed), "math"], timeout=10)
    assert manager._limits["math"].main_thread  # marked: its own per-expression timeouts bound it
    with caplog.at_level(logging.WARNING, logger="grpokit.rewards"):
        for _ in range(2):
            out = call(manager, ["\\boxed{4}"], columns={"answer": ["4"]})
            assert out.errors == {"alarmed": 0, "math": 0} and out.total.tolist() == [2.0]
    assert threads == [False, True, True]  # tried in the worker once, then in the main thread
    assert "'alarmed'" in caplog.text and "work only in the main thread" in caplog.text


@pytest.mark.slow
def test_a_run_loses_only_the_rewards_a_function_raises_on(tiny_model_dir, tmp_path, caplog):
    """A tiny version of a user's report: a reward raising on about one completion in eight, spread through
    the batch, first of the run's rewards. Each step's reward/errors/<fn> is the number of completions that
    raise (recomputed from completions.parquet), those alone get no reward from it, and no step is a bad
    step (it used to lose the whole batch: 100% errors)."""
    import zlib

    import pyarrow.parquet as pq

    from grpokit.trainer import Trainer
    from tests.helpers import REWARD, read_metrics, tiny_config

    flaky = f"{Path(REWARD).parent / 'reward_fns.py'}:raises_on_one_in_eight"
    cfg = tiny_config(
        tiny_model_dir,
        tmp_path,
        f"rewards=[{{function: '{flaky}', name: flaky}}, {{function: '{REWARD}'}}]",
        "rollout.prompts_per_step=8",
        "optim.max_steps=3",
        "logging.sample_every=1",
        "logging.num_samples=8",
    )
    with caplog.at_level(logging.WARNING):
        Trainer(cfg).train()
    rows = pq.read_table(tmp_path / "completions.parquet").to_pylist()
    errors = {
        m["step"]: m["reward/errors/flaky"] for m in read_metrics(tmp_path) if "reward/errors/flaky" in m
    }
    assert sorted(errors) == [1, 2, 3]
    for step, count in errors.items():
        done = [r for r in rows if r["step"] == step]
        raises = [zlib.crc32((str(r["prompt"]) + "|" + r["completion"]).encode()) % 8 == 0 for r in done]
        assert len(done) == 64 and count == sum(raises) > 0
        assert [r["reward/flaky"] is None or math.isnan(r["reward/flaky"]) for r in done] == raises
    assert "reward_error_fraction" not in caplog.text  # no bad step
