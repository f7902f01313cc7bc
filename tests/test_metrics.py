"""grpokit.metrics.compute: the one reader of metrics.jsonl as each caller needs it, the trainer's metric
dicts with worked numbers, the reserved reward names, and every name documented."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import pytest
import torch

import grpokit.metrics.compute as M
from grpokit.doctor import Run
from grpokit.metrics.compute import (
    METRICS_FILE,
    RESERVED_REWARD_NAMES,
    MeanAccumulator,
    critic_metrics,
    perf_metrics,
    read_metrics,
    record_step,
    rollout_metrics,
    sample_records,
)
from grpokit.records import MetricLogger, series

DOCS = pathlib.Path(__file__).parents[1] / "docs"


# ---------------------------------------------------------------- reading metrics.jsonl
def test_read_metrics_torn_last_line_and_non_numeric_step(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text(
        '{"step": 1, "time": 10.0, "reward/mean": 0.5}\n'
        "\n"
        '{"step": "two", "reward/mean": 0.6}\n'  # a record, but without a numeric step
        "[1, 2]\n"  # JSON, but not a record
        '{"step": 3, "time": 30.0, "reward/mean": null}\n'  # NaN was written as null
        '{"step": 4, "reward/me'  # cut short by a crash
    )
    rows = read_metrics(path)
    assert rows == [
        {"step": 1, "time": 10.0, "reward/mean": 0.5},
        {"step": "two", "reward/mean": 0.6},
        {"step": 3, "time": 30.0, "reward/mean": None},
    ]
    assert [record_step(r) for r in rows] == [1, None, 3]
    assert record_step({"step": True}) is None and record_step({"step": math.inf}) is None
    # The plots: points with a step and a finite value only.
    assert series(rows, M.REWARD_MEAN) == ([1.0], [0.5])
    # The doctor: rows with a numeric step only.
    assert [r["step"] for r in Run(rows).rows] == [1, 3]
    # Resume: the kept lines are those with a numeric step <= s; the torn line and "two" go.
    with MetricLogger(tmp_path, tensorboard=False) as log:
        log.truncate_after(3)
    assert read_metrics(path) == [rows[0], rows[2]]
    assert path.read_text().endswith("\n")
    assert read_metrics(tmp_path / "absent.jsonl") == []


# ---------------------------------------------------------------- the trainer's metric dicts, worked numbers
def test_rollout_metrics_two_groups_of_two():
    # Group 1: rewards [1, 0] (a spread), group 2: [1, 1] (constant: no gradient).
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.0])
    completion_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])  # lengths 3, 1, 2, 3
    truncated = torch.tensor([True, False, False, True])
    m = rollout_metrics(
        rewards,
        advantages,
        completion_mask,
        truncated,
        prompt_lengths=[5, 8],
        group_size=2,
        prompts_truncated=[False, True],
    )
    expected = {
        "reward/mean": 0.75,  # 3 / 4
        "reward/std": math.sqrt(0.1875),  # deviations .25, -.75, .25, .25: (3 * .0625 + .5625) / 4
        "reward/zero_std_frac": 0.5,  # group 2 of 2
        "reward/group_std_mean": 0.25,  # (0.5 + 0) / 2
        "advantage/mean": 0.0,
        "advantage/std": math.sqrt(0.5),  # (1 + 1 + 0 + 0) / 4
        "advantage/abs_mean": 0.5,
        "rollout/completion_len_mean": 2.25,  # 9 / 4
        "rollout/completion_len_min": 1.0,
        "rollout/completion_len_max": 3.0,
        "rollout/truncated_frac": 0.5,
        "rollout/prompt_len_mean": 6.5,  # (5 + 8) / 2
        "rollout/tokens": 9.0,
        "rollout/truncated_prompts": 1.0,  # the second prompt was cut to data.max_prompt_length
    }
    assert list(m) == list(expected)
    assert m == pytest.approx(expected)
    assert all(type(v) is float for v in m.values())

    # Per-token advantages (process rewards): over the completion tokens; padding (100) never counts.
    per_token = torch.tensor([[1.0, 1.0, 1.0], [2.0, 100.0, 100.0], [0.0, 0.0, 100.0], [-1.0, -1.0, -1.0]])
    m = rollout_metrics(rewards, per_token, completion_mask, truncated, [5, 8], 2, [False, False])
    assert m["advantage/mean"] == pytest.approx(2 / 9)  # (3 + 2 + 0 - 3) / 9 tokens
    assert m["advantage/abs_mean"] == pytest.approx(8 / 9)


def test_perf_metrics():
    m = perf_metrics(
        rollout_time=2.0,
        step_time=5.0,
        train_time=2.5,
        completion_tokens=100.0,
        train_tokens=300.0,
        threads=3,
    )
    assert list(m) == [
        "perf/step_time",
        "perf/train_time",
        "perf/rollout_tokens_per_s",
        "perf/train_tokens_per_s",
        "perf/peak_rss_mb",
        "perf/threads",
    ]
    assert m["perf/step_time"] == 5.0 and m["perf/train_time"] == 2.5
    assert m["perf/rollout_tokens_per_s"] == 50.0 and m["perf/train_tokens_per_s"] == 120.0
    assert m["perf/peak_rss_mb"] > 1.0 and m["perf/threads"] == 3.0  # MiB of this process so far
    zero = perf_metrics(
        rollout_time=0.0, step_time=0.0, train_time=0.0, completion_tokens=1.0, train_tokens=1.0, threads=1
    )
    assert zero["perf/rollout_tokens_per_s"] == pytest.approx(1e9)  # no division by zero


def test_critic_metrics_worked_numbers():
    # 3 completions of up to 2 tokens; the third has none. 9.0 / 7.0 sit on padding and never count.
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    white = torch.tensor([[1.0, -1.0], [0.0, 9.0], [9.0, 9.0]])
    raw = torch.tensor([[2.0, 0.0], [1.0, 9.0], [9.0, 9.0]])
    values = torch.tensor([[0.5, 0.5], [0.0, 7.0], [7.0, 7.0]])
    returns = torch.tensor([[1.0, 1.0], [0.0, 7.0], [7.0, 7.0]])
    token_rewards = torch.tensor(
        [[-0.1, 0.9], [0.8, 0.0], [0.0, 0.0]]
    )  # score 1 on the last token, KL shaping
    rewards = torch.tensor([1.0, 1.0, 1.0])
    m = critic_metrics(white, raw, values, returns, mask, mask, token_rewards, rewards)
    assert m == pytest.approx(
        {
            "advantage/mean": 0.0,  # (1 - 1 + 0) / 3
            "advantage/std": math.sqrt(2 / 3),
            "advantage/abs_mean": 2 / 3,
            "advantage/raw_mean": 1.0,  # (2 + 0 + 1) / 3
            "advantage/raw_std": math.sqrt(2 / 3),
            "value/mean": 1 / 3,
            "value/return_mean": 2 / 3,
            # Var(R) = 2/9, Var(R - V) = Var(.5, .5, 0) = 1/18: 1 - (1/18) / (2/9)
            "value/explained_variance": 0.75,
            # shaped return - score: 0.8 - 1, 0.8 - 1, and 0 for the completion with no tokens (no score)
            "reward/kl_shaping": -0.4 / 3,
        }
    )


def _sample_batch(advantages):
    from grpokit.data.batch import RolloutBatch, pack_sequences

    # 3 prompts x G=2; prompt lengths 2, 3, 1; completion lengths 1, 2, 3, 0, 1, 1
    tokens = pack_sequences(
        [[5, 6]] * 2 + [[5, 6, 7]] * 2 + [[5]] * 2, [[1], [1, 2], [1, 2, 3], [], [4], [4]], pad_id=0
    )
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    truncated = torch.tensor([False, True, False, False, False, False])
    return RolloutBatch(tokens, tokens.completion_mask, truncated, rewards, advantages, None, None, None)


def test_sample_records_hold_whole_groups_of_the_first_k_prompts():
    completions = ["a1", "a2", "b1", "b2", "c1", "c2"]
    batch = _sample_batch(torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0, 1.0]))
    per_fn = {"correct": torch.tensor([0.0, 1.0, float("nan"), 1.0, 1.0, 1.0])}
    records = sample_records(["a", "b", "c"], completions, batch, per_fn, group_size=2, k=2)
    assert records == [
        {
            "prompt": "a",
            "completion": "a1",
            "group": 0,
            "reward": 0.0,
            "reward/correct": 0.0,
            "advantage": -1.0,
            "prompt_len": 2,
            "completion_len": 1,
            "truncated": False,
        },
        {
            "prompt": "a",
            "completion": "a2",
            "group": 0,
            "reward": 1.0,
            "reward/correct": 1.0,
            "advantage": 1.0,
            "prompt_len": 2,
            "completion_len": 2,
            "truncated": True,
        },
        {
            "prompt": "b",
            "completion": "b1",
            "group": 1,
            "reward": 2.0,
            "reward/correct": None,
            "advantage": -1.0,  # NaN: did not apply
            "prompt_len": 3,
            "completion_len": 3,
            "truncated": False,
        },
        {
            "prompt": "b",
            "completion": "b2",
            "group": 1,
            "reward": 3.0,
            "reward/correct": 1.0,
            "advantage": 1.0,
            "prompt_len": 3,
            "completion_len": 0,
            "truncated": False,
        },
    ]
    assert len(sample_records(["a", "b", "c"], completions, batch, per_fn, group_size=2, k=10)) == 6


def test_sample_records_average_per_token_advantages_over_the_completion():
    # [N, T=3] per-token advantages (process rewards, GAE): the mean over each completion's own tokens
    adv = torch.tensor(
        [[2.0, 9.0, 9.0], [1.0, 3.0, 9.0], [1.0, 2.0, 6.0], [9.0, 9.0, 9.0], [4.0, 9.0, 9.0], [5.0, 9.0, 9.0]]
    )
    records = sample_records(["a", "b", "c"], list("abcdef"), _sample_batch(adv), {}, group_size=2, k=3)
    assert [r["advantage"] for r in records] == [2.0, 2.0, 3.0, 0.0, 4.0, 5.0]  # no tokens: 0


def test_mean_accumulator_weights():
    acc = MeanAccumulator()
    acc.add({"policy/kl": 1.0, "policy/loss": 2.0})
    acc.add({"policy/kl": 4.0}, weight=3.0)
    acc.add({"policy/entropy": 5.0}, weight=0.0)  # no weight: no mean
    assert acc.means() == {"policy/kl": (1 + 12) / 4, "policy/loss": 2.0}


# ---------------------------------------------------------------- names
def _emitted_reward_names() -> set[str]:
    """Every reward/ name a step can log, for one reward function named "correct" with step scores."""
    from grpokit.rewards import RewardOutput, StepScores

    scored = RewardOutput(
        total=torch.tensor([1.0, 0.0]),
        per_function={"correct": torch.tensor([1.0, 0.0])},
        errors={"correct": 0},
        weights={"correct": 1.0},
        steps={"correct": [StepScores([1.0], [1]), None]},
    )
    mask = torch.ones(2, 1)
    names = set(scored.metrics())
    names |= set(
        rollout_metrics(
            torch.tensor([1.0, 0.0]),
            torch.tensor([1.0, -1.0]),
            mask,
            torch.tensor([False, False]),
            [3],
            2,
            [False],
        )
    )
    names |= set(critic_metrics(mask, mask, mask, mask, mask, mask, mask, torch.ones(2)))
    return {n for n in names if n.startswith(M.REWARD_PREFIX)}


def test_reserved_reward_names_cover_every_other_reward_metric():
    assert {"mean", "std"} <= RESERVED_REWARD_NAMES
    emitted = _emitted_reward_names()
    own = {
        M.reward_fn("correct"),
        M.reward_fn_std("correct"),
        M.reward_fn_steps("correct"),
        M.reward_errors("correct"),
    }
    assert own <= emitted
    for name in emitted - own:
        assert name.split("/")[1] in RESERVED_REWARD_NAMES, name
    # A function called "steps" collides with nothing (tests/test_process_rewards.py uses one).
    assert "steps" not in RESERVED_REWARD_NAMES


def _fixed_names() -> set[str]:
    prefixes = (
        M.REWARD_PREFIX,
        M.ADVANTAGE_PREFIX,
        M.POLICY_PREFIX,
        M.VALUE_PREFIX,
        M.ROLLOUT_PREFIX,
        M.PERF_PREFIX,
        M.EVAL_PREFIX,
        M.SFT_PREFIX,
    )
    return {
        v
        for k, v in vars(M).items()
        if k.isupper() and isinstance(v, str) and v.startswith(prefixes) and not k.endswith("_PREFIX")
    }


def test_loss_metric_keys_have_names():
    from grpokit.algo import policy_loss, value_loss

    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    _, policy = policy_loss(x, x, torch.ones(2), mask, ref_logp=x, beta=0.1)
    _, value = value_loss(x, x, x, mask)
    assert {M.policy_name(k) for k in policy} <= _fixed_names()
    assert {M.value_name(k) for k in value} <= _fixed_names()


def test_every_name_is_documented():
    text = (DOCS / "metrics.md").read_text() + (DOCS / "ppo.md").read_text()
    missing = sorted(n for n in _fixed_names() | _emitted_reward_names() if f"`{n}`" not in text)
    # reward/<fn>... are documented by their pattern
    missing = [n for n in missing if "correct" not in n]
    assert missing == []
    assert "grpokit/metrics/compute.py" in (DOCS / "metrics.md").read_text()


def test_names_and_reader_import_without_torch():
    code = (
        "import sys, grpokit.metrics.compute, grpokit.records, grpokit.doctor; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
