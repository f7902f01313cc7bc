"""Slow reward functions: `async def` ones run at once, every call is bounded, and a timed-out call scores as
the config says (reward_on_timeout, rewards[i].on_timeout). docs/rewards.md, "Slow reward functions".

Run: .venv/bin/python -m pytest tests/test_rewards_async.py

No wall-clock bounds: concurrency is shown by behaviour (functions that wait for each other would time out if
they ran one after the other), a cut call by the cancellation the coroutine sees, or by its release event.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
import torch

from grpokit.algo import group_advantages
from grpokit.config import ConfigError, RewardSpec, load_config
from grpokit.data.batch import process_rewards
from grpokit.rewards import RewardError, RewardManager, RewardOutput, StepScores
from grpokit.trainer import Trainer
from tests.helpers import read_metrics, tiny_config

G = 2  # completions per prompt in these batches


def call(manager, n=4):
    return manager(
        prompts=[f"p{i // G}" for i in range(n)],
        completions=[f"c{i}" for i in range(n)],
        completion_ids=[[i + 1] for i in range(n)],
        columns={"answer": [str(i) for i in range(n)]},
    )


def waits_for_all(k: int, state: dict, name: str):
    """An async reward function that returns only once k of its kind are running at the same time: called one
    after the other, the first would wait for the others forever (its own 20 s limit, then TimeoutError)."""

    async def fn(completions, **kwargs):
        state["running"] += 1
        if state["running"] == k:
            state["all_running"].set()
        await asyncio.wait_for(state["all_running"].wait(), 20)
        return [1.0] * len(completions)

    fn.__name__ = name
    return fn


def test_the_async_functions_of_a_batch_run_at_once():
    state = {"running": 0, "all_running": asyncio.Event()}
    fns = [waits_for_all(4, state, f"judge{i}") for i in range(4)]
    out = call(RewardManager(fns, timeout=60))
    assert out.errors == {f"judge{i}": 0 for i in range(4)} and out.total.tolist() == [4.0] * 4


def test_the_async_functions_run_while_the_sync_ones_do():
    async_started = threading.Event()

    async def judge(completions, **kwargs):
        async_started.set()
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    def sync_first(
        completions, **kwargs
    ):  # listed first, and called in the caller's thread: the judge is running
        return [float(async_started.wait(20))] * len(completions)

    out = call(RewardManager([sync_first, judge], timeout=0))
    assert out.per_function["sync_first"].tolist() == [1.0] * 4 and out.errors == {
        "sync_first": 0,
        "judge": 0,
    }


def test_async_functions_are_called_as_trl_calls_them_once_per_batch_with_lists():
    calls = []

    async def judge(prompts, completions, completion_ids, answer, **kwargs):
        calls.append((prompts, completions, completion_ids, answer))
        return [float(c == f"c{a}") for c, a in zip(completions, answer, strict=True)]

    out = call(RewardManager([judge]))
    assert calls == [
        (["p0", "p0", "p1", "p1"], ["c0", "c1", "c2", "c3"], [[1], [2], [3], [4]], ["0", "1", "2", "3"])
    ]
    assert out.total.tolist() == [1.0] * 4


def test_callables_that_return_awaitables_are_async_too():
    class Judge:  # an object with an async __call__: known before the first call
        async def __call__(self, completions, **kwargs):
            return [2.0] * len(completions)

    async def score(completions):
        return [3.0] * len(completions)

    wrapped = RewardSpec(
        lambda completions, **kwargs: score(completions), name="wrapped"
    )  # found at its first call
    manager = RewardManager([RewardSpec(Judge(), name="judge"), wrapped])
    assert manager._limits["judge"].is_async and not manager._limits["wrapped"].is_async
    for _ in range(2):
        assert call(manager).total.tolist() == [5.0] * 4
    assert manager._limits["wrapped"].is_async


def test_scoring_works_from_another_thread_and_under_a_running_event_loop():
    loops = []

    async def judge(completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        return [1.0] * len(completions)

    manager = RewardManager([judge], timeout=60)
    results = []
    worker = threading.Thread(target=lambda: results.append(call(manager)))
    worker.start()
    worker.join()

    # Jupyter: an event loop runs in this thread already, where asyncio.run would refuse
    async def notebook_cell():
        return call(manager)

    results.append(asyncio.run(notebook_cell()))
    results.append(call(manager))
    assert [r.total.tolist() for r in results] == [[1.0] * 4] * 3
    assert (
        loops[0] is loops[1] is loops[2]
    )  # one loop for the manager's life: clients bound to it keep working


# ----------------------------------------------------------------------------- timeouts, and what they score


def hanging_async(seen: list):
    async def hangs(completions, **kwargs):
        try:
            await asyncio.Event().wait()  # never set: a request that never answers
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return [1.0] * len(completions)

    return hangs


def hanging_sync(release: threading.Event):
    def hangs(completions, **kwargs):
        release.wait(20)
        return [1.0] * len(completions)

    return hangs


def ok(completions, **kwargs):
    return [float(i % G) for i in range(len(completions))]  # 0, 1 in every group: advantages +-1


@pytest.mark.parametrize("kind", ["async", "sync"])
@pytest.mark.parametrize(
    "on_timeout, hangs_scores, total",
    [
        ("skip", [float("nan")] * 4, [0.0, 1.0, 0.0, 1.0]),  # as reward_errors=skip: no reward from it
        (0.25, [0.25] * 4, [0.25, 1.25, 0.25, 1.25]),  # the score it gives every sample of the call
        ("skip_group", [float("nan")] * 4, [0.0] * 4),  # every group of the call: equal totals, advantages 0
    ],
)
def test_a_hanging_call_is_cut_at_its_timeout_and_scored_as_on_timeout_says(
    kind, on_timeout, hangs_scores, total, caplog
):
    seen, release = [], threading.Event()
    fn = hanging_async(seen) if kind == "async" else hanging_sync(release)
    manager = RewardManager([RewardSpec(fn, on_timeout=on_timeout), ok], timeout=0.2)
    try:
        with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
            out = call(manager)
    finally:
        release.set()
    torch.testing.assert_close(out.per_function["hangs"], torch.tensor(hangs_scores), equal_nan=True)
    assert out.total.tolist() == total
    assert out.timeouts == {"hangs": 1} and out.errors == {"hangs": 4, "ok": 0}  # counted, whatever it scores
    m = out.metrics()
    assert m["reward/timeouts/hangs"] == 1 and m["reward/skipped_frac"] == (
        1.0 if on_timeout == "skip_group" else 0.0
    )
    advantages = group_advantages(out.total, G)
    assert advantages.abs().sum() == 0 if on_timeout == "skip_group" else advantages.abs().sum() > 0
    assert "reward function 'hangs'" in caplog.text and "did not return within 0.2 s" in caplog.text
    if kind == "async":
        assert seen == ["cancelled"] and "the call was cancelled" in caplog.text  # stopped, not abandoned
    else:
        assert "left running in a background thread" in caplog.text


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_on_timeout_raise_stops_with_the_function_its_timeout_and_the_keys(kind):
    seen, release = [], threading.Event()
    fn = hanging_async(seen) if kind == "async" else hanging_sync(release)
    try:
        with pytest.raises(
            RewardError,
            match=r"reward function 'hangs' \(.*\) did not return within 0\.2 s.*"
            r"\(reward_timeout=0\.2 s; raise it, give this reward its own `timeout` in rewards:.*"
            r"reward_on_timeout=raise stops the run: skip, skip_group or a score goes on\)",
        ):
            call(RewardManager([fn, ok], timeout=0.2, on_timeout="raise"))
        with pytest.raises(
            RewardError, match=r"its own timeout=0\.1 s in rewards:.*its own on_timeout=raise stops the run"
        ):
            call(RewardManager([RewardSpec(fn, timeout=0.1, on_timeout="raise"), ok], on_timeout=0.0))
    finally:
        release.set()


def test_a_rewards_own_on_timeout_beats_the_managers_and_both_beat_reward_errors():
    seen = []
    strict = RewardManager(
        [RewardSpec(hanging_async(seen), on_timeout=0.5), ok], strict=True, timeout=0.1, on_timeout="raise"
    )
    out = call(strict)  # reward_errors=raise, reward_on_timeout=raise, its own on_timeout=0.5: scored 0.5
    assert out.per_function["hangs"].tolist() == [0.5] * 4 and out.timeouts == {"hangs": 1}
    with pytest.raises(RewardError):  # unset both: as reward_errors=raise says
        call(RewardManager([hanging_async(seen), ok], strict=True, timeout=0.1))


def test_skip_group_drops_the_groups_from_process_rewards_and_merged_batches_too(tiny_model_dir):
    from transformers import AutoTokenizer

    def steps(completions, **kwargs):  # process rewards: a step ending at each of the first two characters
        return [StepScores([1.0, float(i)], [1, 2]) for i in range(len(completions))]

    manager = RewardManager([RewardSpec(hanging_async([]), on_timeout="skip_group"), steps], timeout=0.1)
    dropped, kept = call(manager), call(RewardManager([steps]))
    merged = RewardOutput.take([(kept, slice(0, 2)), (dropped, slice(2, 4))])  # dynamic sampling's rounds
    assert merged.skipped.tolist() == [False, False, True, True] and merged.total.tolist()[2:] == [0.0, 0.0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["12", "13", "21", "31"]
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    rewards, ends = process_rewards(merged, texts, ids, tokenizer)
    assert [r.numel() for r in rewards] == [2, 2, 0, 0] and [e.numel() for e in ends] == [2, 2, 0, 0]


def test_an_async_function_that_blocks_the_loop_is_cut_and_the_next_call_gets_a_new_loop(caplog):
    release, loops = threading.Event(), []

    async def blocks(completions, **kwargs):
        release.wait(20)  # a blocking call inside async def: nothing else on the loop runs
        return [1.0] * len(completions)

    async def fine(completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        return [1.0] * len(completions)

    manager = RewardManager([blocks, fine], timeout=0.1)
    try:
        with caplog.at_level(logging.WARNING, logger="grpokit.rewards"):
            out = call(manager)
            assert out.timeouts == {"blocks": 1, "fine": 1}  # `fine` never got the loop
            again = call(manager)  # `blocks` is still busy: not started; `fine` runs on a new loop
        assert again.timeouts == {"blocks": 1} and again.per_function["fine"].tolist() == [1.0] * 4
        assert (
            "'blocks'" in caplog.text
            and "and it blocks the event loop (a blocking call such as time.sleep" in caplog.text
        )
        assert (
            "'fine'" in caplog.text and "another async reward function blocked the event loop" in caplog.text
        )
    finally:
        release.set()
    assert len(loops) == 1


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "override, key",
    [
        (["reward_on_timeout=drop"], "reward_on_timeout"),
        (["reward_on_timeout=.nan"], "reward_on_timeout"),
        (["rewards=[{function: math, on_timeout: true}]"], "rewards.0.on_timeout"),
    ],
)
def test_a_bad_on_timeout_names_the_key_and_the_allowed_values(override, key):
    with pytest.raises(ConfigError) as exc:
        load_config(None, override)
    assert str(exc.value).startswith(f"bad value for '{key}'")
    assert "Input should be 'skip', 'skip_group', 'raise' or a finite number" in str(exc.value)
    with pytest.raises(
        ValueError, match=r"reward 'ok': on_timeout 'drop': Input should be 'skip', 'skip_group', 'raise'"
    ):
        RewardManager([{"function": ok, "on_timeout": "drop"}])


def test_on_timeout_values_and_what_a_saved_config_records():
    c = load_config(
        None,
        ["reward_on_timeout=0", "rewards=[{function: math}, {function: format, on_timeout: skip_group}]"],
    )
    assert (
        c.reward_on_timeout == 0.0
        and c.rewards[0].on_timeout is None
        and c.rewards[1].on_timeout == "skip_group"
    )
    # an unset on_timeout is not written, so a checkpoint saved before the key existed still matches on resume
    assert (
        "on_timeout" not in c.model_dump()["rewards"][0]
        and c.model_dump()["rewards"][1]["on_timeout"] == "skip_group"
    )
    assert load_config(None, []).reward_on_timeout is None


def test_skip_group_needs_group_baselines():
    with pytest.raises(
        ConfigError,
        match=r"^rewards\.0\.on_timeout=skip_group drops a prompt's group .* not gae\); "
        r"use skip, raise or a number$",
    ):
        load_config(
            None, ["rewards=[{function: math, on_timeout: skip_group}]", "algorithm.advantage_estimator=gae"]
        )


# ----------------------------------------------------------------------------- end to end


_calls = {"n": 0}


async def judge_that_hangs_on_its_second_call(completions, **kwargs):
    """The share of 7s, as tests/reward_fns.py's count_sevens; its second call never answers."""
    _calls["n"] += 1
    if _calls["n"] == 2:
        await asyncio.Event().wait()
    await asyncio.sleep(0)
    return [c.count("7") / max(len(c), 1) for c in completions]


def test_a_run_with_an_async_reward_that_hangs_on_some_calls_finishes_and_counts_them(
    tiny_model_dir, tmp_path
):
    _calls["n"] = 0
    cfg = tiny_config(
        tiny_model_dir,
        tmp_path / "run",
        "data.task_train_size=50",
        "rewards=[]",  # set below
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=6",
        "optim.learning_rate=1e-6",  # the default (TINY_RUN's is 3e-3)
        "optim.max_steps=3",
        "checkpoint.save_every=0",
        "reward_timeout=0.5",
    )
    cfg.rewards = [RewardSpec(judge_that_hangs_on_its_second_call, name="judge", on_timeout="skip_group")]
    Trainer(cfg).train()
    rows = read_metrics(Path(cfg.output_dir))
    rows = [r for r in rows if "reward/timeouts/judge" in r]
    assert [r["reward/timeouts/judge"] for r in rows] == [0, 1, 0]
    assert [r["reward/skipped_frac"] for r in rows] == [0, 1, 0]
    assert (
        rows[1]["reward/errors/judge"] == 8 and rows[1]["advantage/abs_mean"] == 0
    )  # the step's groups are dropped
    assert (Path(cfg.output_dir) / "final").is_dir()
