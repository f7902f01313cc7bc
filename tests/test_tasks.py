"""Built-in tasks, their character tokenizer and the tiny Llama (saved and loaded back)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.rewards import BUILTIN_REWARDS, RewardManager, resolve_reward
from grpokit.tasks import DEFAULT_CHARSET, TASK_REWARDS, TASKS, Task, get_task, reward_registry, split_of
from grpokit.tasks.arithmetic import ArithmeticTask
from grpokit.tasks.countdown import (
    CountdownTask,
    countdown_reward,
    countdown_steps,
    parse_expression,
    parse_steps,
)
from grpokit.tasks.multiply import multiply_reward
from grpokit.tasks.tiny_model import build_tiny_llama
from grpokit.tasks.tokenizer import build_tokenizer
from grpokit.tasks.word_problems import word_problems_reward


# --- registry ----------------------------------------------------------------------------
def test_registry_and_protocol():
    assert set(TASKS) == {"countdown", "arithmetic", "multiply"}
    for name, task in TASKS.items():
        assert isinstance(task, Task) and task.name == name and get_task(name) is task
    with pytest.raises(ValueError, match="arithmetic.*countdown"):
        get_task("sudoku")


@pytest.mark.parametrize("name", ["countdown", "arithmetic", "multiply"])
def test_rows_are_seeded_distinct_and_solved_by_their_reference(name):
    task = get_task(name)
    rows = task.make_rows("train", 300, seed=3)
    assert rows == task.make_rows("train", 300, seed=3)
    assert rows != task.make_rows("train", 300, seed=4)
    assert len({r["prompt"] for r in rows}) == 300
    for r in rows:
        assert isinstance(r["prompt"], str) and isinstance(r["completion"], str)
        assert set(r["prompt"] + r["completion"]) <= set(task.charset)
        assert task.is_correct(r["completion"], r)
    columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion")}
    assert (
        task.reward([r["completion"] for r in rows], prompts=[r["prompt"] for r in rows], **columns)
        == [1.0] * 300
    )


@pytest.mark.parametrize("name", ["countdown", "arithmetic"])
def test_train_and_test_never_overlap_whatever_the_seeds(name):
    task = get_task(name)
    key = task.problem_key
    train = {key(r) for seed in (0, 1) for r in task.make_rows("train", 2000, seed=seed)}
    test = {key(r) for seed in (0, 1) for r in task.make_rows("test", 500, seed=seed)}
    assert not train & test
    assert all(split_of(k) == "test" for k in test) and all(split_of(k) == "train" for k in train)
    with pytest.raises(ValueError, match="split"):
        task.make_rows("validation", 1, seed=0)


def test_countdown_problem_in_any_order_is_one_problem():
    task = CountdownTask()
    assert task.canonical([7, 3, 2], 23) == task.canonical([2, 7, 3], 23)
    assert task.prompt([7, 3, 2], 23) == "7 3 2>23="


def test_countdown_asks_for_fewer_when_the_space_is_exhausted():
    with pytest.raises(ValueError, match="distinct"):
        CountdownTask(num_count=2, min_count=None, max_number=3).make_rows("train", 500, seed=0)


# --- countdown reward --------------------------------------------------------------------
def test_parse_expression_worked_examples():
    assert parse_expression("(7-3)*2+9") == (Fraction(17), [7, 3, 2, 9])
    assert parse_expression(" 2 + 3 * 4 ") == (Fraction(14), [2, 3, 4])  # precedence
    assert parse_expression("10-4-3") == (Fraction(3), [10, 4, 3])  # left-associative
    assert parse_expression("7/2*2") == (Fraction(7), [7, 2, 2])  # exact fractions
    for bad in [
        "",
        "2+",
        "(2+3",
        "2+3)",
        "-2+3",
        "2**3",
        "2 3",
        "1/0",
        "__import__('os')",
        "1" + "+1" * 40,
        "(" * 20 + "1" + ")" * 20,
    ]:
        with pytest.raises(ValueError):
            parse_expression(bad)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("3*7+2", 1.0),
        (" (2+7)*3 ", 0.1),  # well formed, numbers right, misses 23 -> partial
        ("7*3+2", 1.0),  # any order
        ("3*7+2+0", 0.0),  # a number that was not given
        ("3*7", 0.0),  # a number left out
        ("3*7+2*1", 0.0),
        ("3*7+3", 0.0),  # a number used twice
        ("23", 0.0),
        ("3*7+2=23", 0.0),  # not an expression
        ("21+2/1", 0.0),
        ("(3*7+2", 0.0),
        ("import os", 0.0),
        ("3*7+2" + " " * 70, 0.0),  # over the length bound
        ([{"role": "assistant", "content": "3*7+2"}], 1.0),  # conversational completion
    ],
)
def test_countdown_reward(completion, expected):
    task = CountdownTask()
    assert task.reward([completion], numbers=[[3, 7, 2]], target=[23], prompts=["3 7 2>23="]) == [expected]


def test_parse_steps_worked_examples():
    assert parse_steps("7-3=4,4*2=8,8+9=17", [7, 3, 2, 9]) == Fraction(17)
    assert parse_steps("10*10=100,100+2=102,102-4=98", [4, 2, 10, 10]) == Fraction(98)  # repeated number
    for bad in [
        "7-3=4,4*2=8",
        "7-3=5,5*2=10,10+9=19",
        "7-3=4,4*2=8,8+9=17,1+1=2",
        "7-7=0,3*2=6,6+9=15",
        "7-3=4,4*2=8,8-9=1",
        "7-3=4,,8+9=17",
        "7-3",
        "-7+3=4,4*2=8,8+9=17",
        "7-3=4,4*2=8,8+9=17" * 5,
    ]:
        with pytest.raises(ValueError):
            parse_steps(bad, [7, 3, 2, 9])


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("7-3=4,4*2=8,8+9=17", 1.0),
        ("9+7=16,3-2=1,16-1=15", 0.1),  # a complete, correct chain that misses the target
        ("7-3=4,4*2=8,8+9=18", 0.0),  # a wrong result
        ("7-3=4,4*2=8", 0.0),  # 9 unused
        ("(7-3)*2+9", 1.0),  # the expression format is accepted too
    ],
)
def test_countdown_reward_of_step_solutions(completion, expected):
    assert CountdownTask().reward([completion], numbers=[[7, 3, 2, 9]], target=[17]) == [expected]


def test_countdown_step_format_rows_are_solved_by_their_reference():
    task = CountdownTask(solution_format="steps")
    rows = task.make_rows("train", 300, seed=0)
    assert all("=" in r["completion"] and task.is_correct(r["completion"], r) for r in rows)
    assert all(set(r["completion"]) <= set(task.charset) for r in rows)  # the tokenizer has every character
    assert all(r["completion"].count("=") == len(r["numbers"]) - 1 for r in rows)


def test_countdown_division_is_exact_and_off_by_default():
    assert CountdownTask().reward(["8/4+5"], numbers=[[8, 4, 5]], target=[7]) == [0.0]
    with_div = CountdownTask(ops="+-*/")
    assert with_div.reward(
        ["8/4+5", "(8+4)/5", "8/(4-4)"], numbers=[[8, 4, 5]] * 2 + [[8, 4, 4]], target=[7, 2, 2]
    ) == [1.0, 0.1, 0.0]
    rows = with_div.make_rows("train", 200, seed=0)
    assert any("/" in r["completion"] for r in rows)
    assert all(with_div.is_correct(r["completion"], r) for r in rows)
    with pytest.raises(ValueError, match="ops"):
        CountdownTask(ops="+^")


def test_countdown_difficulty_knobs():
    rows = CountdownTask(num_count=3, min_count=None, max_number=20, max_target=50).make_rows(
        "test", 100, seed=0
    )
    assert all(len(r["numbers"]) == 3 and max(r["numbers"]) <= 20 and 1 <= r["target"] <= 50 for r in rows)
    rows = CountdownTask(num_count=4, min_count=2).make_rows("train", 300, seed=0)
    assert {len(r["numbers"]) for r in rows} == {2, 3, 4}
    with pytest.raises(ValueError, match="min_count"):
        CountdownTask(num_count=3, min_count=4)


# --- the tasks' rewards by name ------------------------------------------------------------
def test_reward_registry_adds_the_task_rewards_to_the_builtins():
    from grpokit.tools.rewards import TOOL_REWARDS

    assert TASK_REWARDS == {
        "countdown": countdown_reward,
        "countdown_steps": countdown_steps,
        "multiply": multiply_reward,
        "word_problems": word_problems_reward,
    }
    registry = reward_registry()
    # The order error messages list them in (docs/errors.md); the process rewards on tool use last.
    assert list(registry) == [
        "math",
        "format",
        "countdown",
        "countdown_steps",
        "multiply",
        "word_problems",
        "overlong",
        "length",
        "code_tests",
        "tool_call_valid",
        "tool_args_valid",
        "tool_result_used",
        "step_cost",
    ]
    assert registry == {**BUILTIN_REWARDS, **TASK_REWARDS, **TOOL_REWARDS}
    assert "countdown" not in BUILTIN_REWARDS  # rewards never know about tasks
    with pytest.raises(ValueError) as e:
        resolve_reward("mth", registry)
    assert str(e.value) == (
        "reward 'mth' is not a built-in (math, format, countdown, countdown_steps, multiply, word_problems, "
        "overlong, length, code_tests, tool_call_valid, tool_args_valid, tool_result_used, step_cost); "
        "did you mean 'math'? use 'package.module:function' or 'path/to/file.py:function'"
    )


def test_countdown_reward_delegates_to_the_task():
    out = RewardManager(["countdown"], registry=reward_registry())(
        prompts=["p"] * 3,
        completions=["1*2*3*4", "1+2+3+4", "hello"],
        completion_ids=[[1]] * 3,
        columns={"numbers": [[1, 2, 3, 4]] * 3, "target": [24] * 3},
    )
    right, well_formed_but_wrong, garbage = out.per_function["countdown"].tolist()
    assert (
        right == 1.0 and garbage == 0.0 and well_formed_but_wrong == pytest.approx(0.1)
    )  # the task's partial reward
    with pytest.raises(ValueError, match="'numbers'"):
        RewardManager(["countdown"], registry=reward_registry())(
            prompts=["p"], completions=["1+2"], completion_ids=[[1]], columns={"target": [3]}
        )
    # Settings in the spec's kwargs configure the task; others pass through.
    assert countdown_reward(["8/4+5", "1+2"], numbers=[[8, 4, 5], [1, 2]], target=[7, 4]) == [0.0, 0.1]
    assert countdown_reward(
        ["8/4+5", "1+2"],
        numbers=[[8, 4, 5], [1, 2]],
        target=[7, 4],
        ops="+-*/",
        partial_reward=0.5,
        prompts=["a", "b"],
    ) == [1.0, 0.5]


# --- arithmetic reward -------------------------------------------------------------------
def test_arithmetic_rows_and_reward():
    rows = ArithmeticTask(digits=2).make_rows("test", 200, seed=0)
    for r in rows:
        a, op, b = r["prompt"][:-1].partition("+") if "+" in r["prompt"] else r["prompt"][:-1].partition("-")
        assert r["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
    task = ArithmeticTask()
    assert task.reward(
        ["579", " 579\n", "578", "", [{"role": "assistant", "content": "579"}]], answer=["579"] * 5
    ) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert task.is_correct("-49", {"answer": "-49"}) and not task.is_correct("49", {"answer": "-49"})


# --- tokenizer ---------------------------------------------------------------------------
def test_char_tokenizer_round_trips_after_from_pretrained(tmp_path):
    build_tokenizer(get_task("countdown"), tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == ("<pad>", "<s>", "</s>", "<unk>")
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    text = "7 3  2>21=(7-3)*2+10/5"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tok.convert_ids_to_tokens(ids[1:]) == list(text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) == text + "</s>"
    assert tok("7a", add_special_tokens=False)["input_ids"][1] == tok.unk_token_id


def test_char_tokenizer_default_charset_covers_every_task():
    tok = build_tokenizer(DEFAULT_CHARSET)
    assert len(tok) == 4 + len(DEFAULT_CHARSET)
    for task in TASKS.values():
        for r in task.make_rows("train", 50, seed=0):
            ids = tok(r["prompt"] + r["completion"])["input_ids"]
            assert tok.unk_token_id not in ids
            assert tok.decode(ids, skip_special_tokens=True) == r["prompt"] + r["completion"]
    with pytest.raises(ValueError):
        build_tokenizer("")


def test_char_tokenizer_pads_batches():
    tok = build_tokenizer("0123456789")
    tok.padding_side = "left"
    enc = tok(["1", "123"], padding=True, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == [tok.pad_token_id] * 2 + tok("1")["input_ids"]
    assert enc["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


# --- tiny model --------------------------------------------------------------------------
def test_tiny_llama_sizes_and_round_trip(tmp_path):
    tok = build_tokenizer(DEFAULT_CHARSET, tmp_path)
    model = build_tiny_llama(tok, size="test")
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 1_000_000
    cfg = model.config
    assert (cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
        len(tok),
        tok.pad_token_id,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.tensor([tok("3 7 2>23=")["input_ids"]])
    torch.testing.assert_close(loaded(x).logits, model(x).logits)
    assert loaded.generation_config.eos_token_id == tok.eos_token_id

    assert (
        build_tiny_llama(tok, size="test")
        .state_dict()["lm_head.weight"]
        .equal(model.state_dict()["lm_head.weight"])
    )
    with pytest.raises(ValueError, match="demo"):
        build_tiny_llama(tok, size="huge")


def test_tiny_llama_demo_size_is_a_few_million_params():
    model = build_tiny_llama(build_tokenizer(DEFAULT_CHARSET))
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000
