"""Asynchronous rollouts (rollout.max_policy_lag, grpokit/rollout/pipeline.py) on a tiny real model: every
batch is sampled by exactly the weights its version names, the run learns, the same seed gives the same
weights, the metrics say what happened, and a resume draws no prompt twice and skips none."""

import contextlib
import copy

import pytest
import torch

from grpokit.config import ConfigError, load_config
from grpokit.data.batch import pack_sequences
from grpokit.data.micro_batches import MicroBatching
from grpokit.policy import batched_logprobs, load_policy
from grpokit.rollout import make_engine
from grpokit.rollout.pipeline import make_pipeline
from grpokit.trainer import Trainer
from tests.helpers import require
from tests.test_trainer import Crash, _crash_at, config, read_metrics

LAG = ["rollout.engine=fast", "rollout.max_policy_lag=1"]


class _Row:
    def __init__(self, ids):
        self.prompt_ids, self.columns = ids, {}


def _logp(model, rows, comps, pad_id):
    """The model's log-probs of the completions, laid out as the engine's (ragged)."""
    tokens = pack_sequences(
        [r.prompt_ids for r in rows for _ in range(len(comps) // len(rows))], comps.token_ids, pad_id
    )
    lp = batched_logprobs(model, tokens, MicroBatching(len(comps)), temperature=1.0)
    return [lp[i, : len(ids)] for i, ids in enumerate(comps.token_ids)]


def _max_diff(a, b_lists):
    return max((x - torch.tensor(y)).abs().max().item() for x, y in zip(a, b_lists, strict=True))


@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_each_batch_is_sampled_by_the_version_it_names(tiny_model_dir, sampler):
    """Lag 1: batch b is generated with the weights of version max(0, b - 1), whatever the timing. The
    sampler's log-probs equal those weights' own (float noise) and differ from the newer ones' (so the test
    can fail). process: the fast engine in a child process (rollout.async_sampler=process), the weights
    through shared memory. The model runs grpokit_sdpa, as a padding-free run's does (the child registers it
    too)."""
    from grpokit.policy.padding_free import resolve_padding_free

    model, tok = load_policy(load_config(None, [f"model.name_or_path={tiny_model_dir}"]).model)
    assert resolve_padding_free(model, True) == (True, None)
    assert model.config._attn_implementation == "grpokit_sdpa"
    rollout = load_config(
        None,
        [
            f"model.name_or_path={tiny_model_dir}",
            "rollout.engine=fast",
            "rollout.num_generations=4",
            "rollout.max_completion_length=6",
            "rollout.max_policy_lag=1",
            f"rollout.async_sampler={sampler}",
        ],
    ).rollout
    engine = make_engine("fast", model, tok, rollout=rollout)
    pipe = make_pipeline(engine, rollout, max_lag=1, version=0, model=model, seed=0)
    prompts = [_Row(tok("3 4 5>12=")["input_ids"]), _Row(tok("1 2>3=")["input_ids"])]
    weights = [copy.deepcopy(model.state_dict())]
    try:
        for b in range(4):
            rows, comps, timings = pipe.batch(b, lambda i: prompts, 4)
            assert comps.versions == [max(0, b - 1)] * len(comps)
            assert timings["perf/weights_wait_time"] >= 0 and timings["perf/rollout_wait_time"] >= 0
            sampled_by = copy.deepcopy(model)
            sampled_by.load_state_dict(weights[max(0, b - 1)])
            assert _max_diff(_logp(sampled_by, rows, comps, tok.pad_token_id), comps.logprobs) < 1e-4
            with torch.no_grad():  # an "update": the trainer's weights move on to version b + 1
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            weights.append(copy.deepcopy(model.state_dict()))
            pipe.publish(b + 1, model)
            if b >= 1:  # the trainer's current weights are another policy: the test sees the difference
                assert _max_diff(_logp(model, rows, comps, tok.pad_token_id), comps.logprobs) > 1e-2
    finally:
        pipe.close()


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_lag_one_learns_and_logs_its_lag(tiny_model_dir, tmp_path, sampler):
    cfg = config(
        tiny_model_dir,
        tmp_path / "run",
        "optim.max_steps=40",
        "checkpoint.save_every=0",
        *LAG,
        f"rollout.async_sampler={sampler}",
    )
    Trainer(cfg).train()
    rows = read_metrics(tmp_path / "run")
    assert [r["rollout/version_lag"] for r in rows[:3]] == [0.0, 1.0, 1.0]
    assert all(r["rollout/version_lag_max"] == 1.0 for r in rows[1:])
    assert all(r["perf/weights_wait_time"] >= 0 and r["perf/rollout_wait_time"] >= 0 for r in rows)
    # pi_old is the sampler (no correction): the lag shows as a difference to the policy being trained, from
    # step 2
    assert rows[0]["rollout/logp_diff_max"] < 1e-4 < min(r["rollout/logp_diff_max"] for r in rows[1:])
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.15, (first, last)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["thread", "process"])
def test_the_same_seed_gives_the_same_weights_at_lag_two(tiny_model_dir, tmp_path, sampler):
    runs = []
    for name in ("a", "b"):
        trainer = Trainer(
            config(
                tiny_model_dir,
                tmp_path / name,
                "optim.max_steps=5",
                "checkpoint.save_every=0",
                "rollout.engine=fast",
                "rollout.max_policy_lag=2",
                f"rollout.async_sampler={sampler}",
                "eval.every=2",
                "data.eval_size=8",
            )
        )
        trainer.train()
        runs.append(trainer.model.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    lags = [r["rollout/version_lag"] for r in read_metrics(tmp_path / "a") if "rollout/version_lag" in r]
    assert lags == [0.0, 1.0, 2.0, 2.0, 2.0]


@pytest.mark.slow
def test_importance_correction_with_lag_anchors_on_the_trainer(tiny_model_dir, tmp_path):
    """With a correction, pi_old is the trainer's own recomputed log-probs (decoupled PPO) and the weights
    pi_old / pi_sampler are logged; the lag makes some of them differ from 1."""
    cfg = config(
        tiny_model_dir,
        tmp_path / "run",
        "optim.max_steps=6",
        "checkpoint.save_every=0",
        *LAG,
        "rollout.importance_correction=token_truncate",
        "rollout.importance_c_max=1.001",
        "optim.learning_rate=1e-2",
    )
    Trainer(cfg).train()
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["rollout/is_clip_frac"] == 0.0 and rows[0]["rollout/logp_diff_max"] < 1e-4
    assert max(r["rollout/is_clip_frac"] for r in rows[1:]) > 0
    assert all(r["rollout/logp_diff_max"] > 1e-4 for r in rows[1:])


@pytest.mark.slow
def test_resume_at_lag_draws_the_prompts_of_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """Batches generated ahead are in the checkpoint (rollout/pipeline.py): after a resume the prompt stream
    goes on after theirs, so the prompts drawn over both runs are the uninterrupted run's, none twice, none
    skipped (tests/test_async_resume.py: the weights too)."""

    def run(out, on_log=None):
        trainer = Trainer(config(tiny_model_dir, out, "optim.max_steps=5", "checkpoint.save_every=2", *LAG))
        drawn, draw = [], trainer._draw
        trainer._draw = lambda b=None: (rows := draw(b), drawn.append([r.prompt_text for r in rows]))[0]
        with pytest.raises(Crash) if on_log else contextlib.nullcontext():
            trainer.train(on_log=on_log)
        return drawn

    straight = run(tmp_path / "a")
    # saved step 2 with batch 2 generated ahead (in the checkpoint); drew batch 3 in step 3, then crashed
    crashed = run(tmp_path / "b", _crash_at(3))
    resumed = run(tmp_path / "b")
    assert len(straight) == 5 and crashed == straight[:4]
    assert resumed == straight[3:5]  # batches 3 and 4: batch 2 came back from the checkpoint


def test_lag_needs_an_engine_with_log_probs(tiny_model_dir, tmp_path):
    # Checked against the engine's capabilities when the run starts (grpokit/rollout/engines.py).
    cfg = config(tiny_model_dir, tmp_path / "run", "rollout.engine=hf", "rollout.max_policy_lag=1")
    with pytest.raises(ConfigError, match="rollout.max_policy_lag=1 needs the sampler's log-probs"):
        Trainer(cfg)


@pytest.mark.slow
def test_lag_one_on_vllm_pushes_each_version_from_the_sampler_thread(vllm_model_dir, tmp_path):
    """vLLM in the background thread: each version is pushed (and checked against the sampler's copy)
    there."""
    require("vllm")
    from tests.test_rollout_vllm import grpo_config

    trainer = Trainer(
        grpo_config(
            vllm_model_dir,
            tmp_path / "run",
            "optim.max_steps=5",
            "rollout.engine=vllm",
            "rollout.max_policy_lag=1",
        )
    )
    trainer.train()  # closes its engine at the end
    rows = read_metrics(tmp_path / "run")
    assert [r["rollout/version_lag"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert rows[0]["rollout/logp_diff_max"] < 1e-3 < min(r["rollout/logp_diff_max"] for r in rows[1:])
    assert (
        trainer.pipeline.engine.pushes == 6
    )  # the constructor's; v0 (batches 0, 1), v1-v3 (2-4) by the sampler; the last evaluation's


def test_an_engine_without_log_probs_is_refused_at_lag(tiny_model_dir):
    """The config refuses rollout.engine=hf at lag > 0; an engine passed in by code (here HFEngine itself) is
    refused at its first batch, named, instead of training on lagged samples as if they were on-policy."""
    from grpokit.rollout.hf import HFEngine

    model, tok = load_policy(load_config(None, [f"model.name_or_path={tiny_model_dir}"]).model)
    rollout = load_config(
        None,
        [
            f"model.name_or_path={tiny_model_dir}",
            "rollout.engine=fast",
            "rollout.num_generations=2",
            "rollout.max_completion_length=4",
        ],
    ).rollout
    pipe = make_pipeline(HFEngine(model, tok), rollout, max_lag=1, version=0, model=model, seed=0)
    try:
        with pytest.raises(
            ValueError,
            match=(
                "rollout.max_policy_lag=1 needs the engine's sampling log-probs, and HFEngine returned none"
            ),
        ):
            pipe.batch(0, lambda i: [_Row(tok("1 2>3=")["input_ids"])], 2)
    finally:
        pipe.close()
