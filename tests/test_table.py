"""The completion table (grpokit/records/table.py): a real run records whole groups with each function's
reward, the advantage and the lengths in completions.parquet; `grpokit show` prints a step, or its worst
completions."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from grpokit.algo import group_advantages
from grpokit.cli import app
from grpokit.records import MetricLogger
from grpokit.records.table import append_step, read_table
from grpokit.trainer import Trainer
from tests.helpers import REWARD, tiny_config

G, K, T = 4, 2, 8  # num_generations, logging.num_samples (prompts recorded per step), max_completion_length


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory):
    """6 GRPO steps of a tiny model with two reward functions, completions recorded at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("table") / "run"
    cfg = tiny_config(
        tiny_model_dir,
        out,
        "data.task_train_size=200",
        f"rewards=[{{function: '{REWARD}'}}, {{function: countdown, weight: 2.0}}]",
        f"rollout.num_generations={G}",
        f"rollout.max_completion_length={T}",
        "optim.max_steps=6",
        "algorithm.beta=0.04",  # the default (TINY_RUN's is 0.0)
        "logging.sample_every=2",
        f"logging.num_samples={K}",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
    )
    Trainer(cfg).train()
    return out


def test_a_run_records_whole_groups_with_rewards_advantages_and_lengths(run_dir):
    table = pq.read_table(run_dir / "completions.parquet")
    for column in (
        "step",
        "prompt",
        "completion",
        "group",
        "reward",
        "reward/count_sevens",
        "reward/countdown",
        "advantage",
        "prompt_len",
        "completion_len",
        "truncated",
    ):
        assert column in table.column_names, column
    rows = table.to_pylist()
    assert sorted({r["step"] for r in rows}) == [2, 4, 6]
    for step in (2, 4, 6):
        at = [r for r in rows if r["step"] == step]
        assert [r["group"] for r in at] == [g for g in range(K) for _ in range(G)]  # K whole groups of G
        for g in range(K):
            group = at[g * G : (g + 1) * G]
            assert len({r["prompt"] for r in group}) == 1
            rewards = torch.tensor([r["reward"] for r in group])
            # the total is the weighted sum of the functions' rewards (weights 1 and 2)
            assert rewards.tolist() == pytest.approx(
                [r["reward/count_sevens"] + 2 * r["reward/countdown"] for r in group]
            )
            # the advantage the loss was fed: the group z-score of those rewards
            assert [r["advantage"] for r in group] == pytest.approx(
                group_advantages(rewards, G).tolist(), abs=1e-5
            )
        for r in at:
            assert r["completion_len"] <= T and r["prompt_len"] > 0
            assert r["completion_len"] == T if r["truncated"] else r["completion_len"] <= T
    # samples.jsonl holds the same records
    jsonl = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["completion"], r["advantage"]) for r in jsonl] == [
        (r["step"], r["completion"], r["advantage"]) for r in rows
    ]


def test_show_prints_the_last_recorded_step_by_default(run_dir):
    result = CliRunner().invoke(app, ["show", str(run_dir)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "completions at step 6" in result.output
    last = [r for r in read_table(run_dir) if r["step"] == 6]
    assert f"{K * G} completions" in result.output
    for column in ("count_sevens", "countdown", "advantage", "length", "truncated"):
        assert column in result.output
    assert last[0]["prompt"] in result.output


def test_show_worst_lists_the_lowest_rewards_first(tmp_path):
    samples = [
        {"prompt": "p", "completion": f"c{i}", "group": 0, "reward": r, "advantage": 0.0}
        for i, r in enumerate([0.9, 0.1, 0.5, 0.3, None])
    ]
    append_step(tmp_path, 3, samples)
    append_step(tmp_path, 5, [{"prompt": "q", "completion": "later", "reward": -1.0}])
    result = CliRunner().invoke(
        app, ["show", str(tmp_path), "--step", "3", "--worst", "3"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "the 3 lowest-reward completions at step 3" in result.output
    shown = [c for c in ("c0", "c1", "c2", "c3", "c4", "later") if f" {c} " in result.output]
    assert shown == [
        "c1",
        "c2",
        "c3",
    ]  # rewards 0.1, 0.5, 0.3: the three lowest of step 3 (None last; step 5 not shown)
    out = result.output
    assert out.index(" c1 ") < out.index(" c3 ") < out.index(" c2 ")  # lowest first


def test_a_resumed_run_replaces_the_steps_it_redoes(tmp_path):
    for step in (2, 4, 6):
        append_step(tmp_path, step, [{"prompt": "p", "completion": f"first run {step}", "reward": 0.0}])
    append_step(tmp_path, 4, [{"prompt": "p", "completion": "resumed 4", "reward": 1.0, "reward/new": 1}])
    rows = read_table(tmp_path)
    assert [(r["step"], r["completion"]) for r in rows] == [(2, "first run 2"), (4, "resumed 4")]
    assert rows[0]["reward/new"] is None and rows[1]["reward/new"] == 1


def test_odd_values_are_stored(tmp_path):
    # chat messages, a rewards dict, NaN, and a column that is a number at one step and text at the next
    append_step(
        tmp_path,
        1,
        [
            {
                "prompt": [{"role": "user", "content": "7*6="}],
                "completion": "42",
                "reward": float("nan"),
                "rewards": {"correct": 1.0},
                "answer": 42,
            }
        ],
    )
    append_step(tmp_path, 2, [{"prompt": "x", "completion": "<b>", "reward": 0.5, "answer": "forty-two"}])
    rows = read_table(tmp_path)
    assert json.loads(rows[0]["prompt"]) == [{"role": "user", "content": "7*6="}]
    assert rows[0]["reward"] is None and rows[0]["reward/correct"] == 1.0
    assert [r["answer"] for r in rows] == ["42", "forty-two"]


def test_log_samples_writes_the_table(tmp_path, capsys):
    samples = [{"prompt": "a", "completion": f"a{i}", "group": 0, "reward": float(i)} for i in range(3)]
    samples += [{"prompt": "b", "completion": f"b{i}", "group": 1, "reward": float(i)} for i in range(3)]
    with MetricLogger(tmp_path, tensorboard=False) as log:
        log.log_samples(7, samples)
    assert [r["completion"] for r in read_table(tmp_path)] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    out = capsys.readouterr().out
    assert "a0" in out and "b0" in out and "a1" not in out  # the terminal shows the first of each group


def test_a_run_from_before_the_table_is_read_from_samples_jsonl(tmp_path):
    lines = [{"step": 10, "prompt": "p", "completion": "c", "reward": 1.0, "rewards": {"fmt": 0.0}}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(app, ["show", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "1 completion at step 10" in result.output and "fmt" in result.output


def test_a_run_shorter_than_sample_every_records_its_last_step(tiny_model_dir, tmp_path):
    """2 steps under the default logging.sample_every (10): the last step is recorded, so `grpokit show`
    has something to show."""
    out = tmp_path / "run"
    cfg = tiny_config(
        tiny_model_dir,
        out,
        "logging.sample_every=10",
        f"logging.num_samples={K}",
        "optim.max_steps=2",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
    )
    Trainer(cfg).train()
    assert sorted({r["step"] for r in read_table(out)}) == [2]
    result = CliRunner().invoke(app, ["show", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "completions at step 2" in result.output
