"""The word problems of `grpokit demo --model smollm2` (grpokit/tasks/word_problems.py): the generator, the
verifier, with worked examples, and the train / test split."""

import pytest

from grpokit.tasks import CHAT_TASKS, get_task, reward_registry, split_of
from grpokit.tasks.word_problems import WordProblemsTask, last_integer, word_problems_reward


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("7 + 5 = 12", 12),
        ("Mia has 12 books.", 12),
        ("The answer is -3.", -3),
        ("She has 1,200 coins", 1200),
        ("6 x 11 = 66 apples in each bag, so 66 x 11 = 726", 726),
        ("no number here", None),
        ("", None),
    ],
)
def test_last_integer(text, value):
    assert last_integer(text) == value


def test_worked_examples():
    completions = [
        "Mia has 7 + 5 = 12 books.",  # right
        "7 + 5 = 12. This is a classic example of addition with 2 numbers.",  # a number after the answer
        "Omar has 5 + 12 = 16 toys.",  # wrong arithmetic
        [{"role": "assistant", "content": "12"}],  # conversational, as TRL passes it
        "Mia has 7 books and gets 5 more, so she",  # cut off before the answer
    ]
    assert word_problems_reward(completions, answer=["12", "12", "17", "12", "12"]) == [1.0, 0, 0, 1.0, 0]
    task = WordProblemsTask()
    row = {"answer": "66"}
    assert task.is_correct("6 x 11 = 66", row) and not task.is_correct("6 x 11 = 67", row)


def test_rows_are_seeded_distinct_chat_prompts_solved_by_their_reference():
    task = get_task("word_problems")
    assert task is CHAT_TASKS["word_problems"] and reward_registry()["word_problems"] is word_problems_reward
    rows = task.make_rows("train", 500, seed=3)
    assert rows == task.make_rows("train", 500, seed=3) and rows != task.make_rows("train", 500, seed=4)
    assert len({task.problem_key(r) for r in rows}) == 500
    for r in rows:
        [message] = r["prompt"]
        assert message["role"] == "user" and message["content"].endswith("?")
        assert task.is_correct(r["completion"], r)
        a, op, b, _, answer = r["completion"].split()
        assert int(answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "x": int(a) * int(b)}[op] >= 1
    assert {r["completion"].split()[1] for r in rows} == {"+", "-", "x"}
    assert task.reward([r["completion"] for r in rows], answer=[r["answer"] for r in rows]) == [1.0] * 500


def test_one_operation_with_small_operands():
    import random

    task = WordProblemsTask(ops="-", max_operand=5)
    for _ in range(200):
        question, solution, answer = task.draw(random.Random(_))
        a, _op, b = solution.split()[:3]
        assert 2 <= int(b) < int(a) <= 6 and answer == int(a) - int(b)
        assert f" {a} " in question and f" {b}" in question
    with pytest.raises(ValueError):
        WordProblemsTask(ops="/")


def test_train_and_test_never_overlap_whatever_the_seeds():
    task = get_task("word_problems")
    train = {task.problem_key(r) for seed in (0, 1) for r in task.make_rows("train", 1000, seed=seed)}
    test = {task.problem_key(r) for seed in (0, 1) for r in task.make_rows("test", 200, seed=seed)}
    assert not train & test
    assert all(split_of(k) == "test" for k in test) and all(split_of(k) == "train" for k in train)
