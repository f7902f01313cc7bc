"""Partial rollouts (rollout.partial_rollouts, grpokit/rollout/partial.py) on a tiny real model and the fast
engine: a completion that spans versions is trained with each token's own pi_old, only complete groups are
trained, the staleness bound is enforced and counted, and a chunk of the whole length is the synchronous
loop."""

from __future__ import annotations

import copy

import pytest
import torch

from grpokit.config import ConfigError, load_config
from grpokit.policy import load_policy
from grpokit.rollout import make_engine
from grpokit.rollout.partial import PartialPipeline, Sample
from grpokit.trainer import Trainer
from tests.helpers import read_metrics, require
from tests.helpers import tiny_config as config

PARTIAL = ["rollout.engine=fast", "rollout.partial_rollouts=true"]


class Recorded(Trainer):
    """A trainer that keeps, per step, the batch the update saw, the per-token record of the pipeline's
    completions (tokens, sampler log-probs, versions), and the weights of every version published."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.batches, self.samples = [], []
        self.weights = {0: copy.deepcopy(self.policy.module.state_dict())}
        if isinstance(self.pipeline, PartialPipeline):
            taken = self.pipeline._completions

            def record(groups):
                self.samples.append([(g.row, copy.deepcopy(s)) for g in groups for s in g.samples])
                return taken(groups)

            self.pipeline._completions = record

    def update(self, batch, *args, **kwargs):
        self.batches.append(batch)
        return super().update(batch, *args, **kwargs)


def _train(cfg) -> Recorded:
    trainer = Recorded(cfg)
    publish = trainer.pipeline.publish

    def keep(version, model):
        trainer.weights[version] = copy.deepcopy(trainer.policy.module.state_dict())
        publish(version, model)

    trainer.pipeline.publish = keep
    trainer.train()
    return trainer


def _logprobs(model, prompt_ids, tokens, temperature):
    """A direct reference: log softmax(logits / T) of each completion token, one sequence, no padding."""
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize(
    "engine", ["fast", pytest.param("vllm", marks=pytest.mark.slow)], ids=["fast", "vllm"]
)
def test_a_completion_that_spans_versions_is_trained_with_each_tokens_own_pi_old(request, engine, tmp_path):
    """Chunks of 2 tokens of 8: most completions take several rounds over several steps. Each token's
    recorded log-prob is that of the weights of the version it names (a direct forward of those weights),
    not of the newer ones, and it is the pi_old the update saw for that token. vLLM continues a completion
    from its prompt and tokens so far as the fast engine does (its weights pushed at each version; its
    log-probs agree with a direct forward to 1e-4 in fp32)."""
    if engine == "vllm":
        require("vllm")
    model_dir = request.getfixturevalue("vllm_model_dir" if engine == "vllm" else "tiny_model_dir")
    atol = 1e-4 if engine == "vllm" else 1e-5
    cfg = config(
        model_dir,
        tmp_path / "run",
        "rollout.partial_rollouts=true",
        f"rollout.engine={engine}",
        "rollout.partial_chunk_tokens=2",
        "rollout.max_staleness=3",
        "rollout.temperature=1.5",
        "optim.max_steps=4",
        "checkpoint.save_every=0",
    )
    trainer = _train(cfg)
    model, _ = load_policy(cfg.model)
    spanning = 0
    for step, (batch, samples) in enumerate(zip(trainer.batches, trainer.samples, strict=True)):
        for i, (row, s) in enumerate(samples):
            assert s.finish is not None  # complete groups only
            n = len(s.tokens)
            assert batch.old_logp is not None
            assert torch.equal(batch.old_logp[i, :n], torch.tensor(s.logprobs, dtype=batch.old_logp.dtype))
            if len(set(s.versions)) < 2:
                continue
            spanning += 1
            for version in sorted(set(s.versions)):
                model.load_state_dict(trainer.weights[version])
                own = _logprobs(model, row.prompt_ids, s.tokens, 1.5)
                at = torch.tensor([v == version for v in s.versions])
                assert torch.allclose(own[at], torch.tensor(s.logprobs)[at], atol=atol)
                newer = [v for v in trainer.weights if v > version and v <= step]
                if newer:  # the newer weights give other log-probs: the check can fail
                    model.load_state_dict(trainer.weights[newer[0]])
                    other = _logprobs(model, row.prompt_ids, s.tokens, 1.5)
                    assert (other[at] - torch.tensor(s.logprobs)[at]).abs().max() > 1e-4
    assert spanning > 0
    rows = read_metrics(tmp_path / "run")
    assert max(r["rollout/versions_spanned_max"] for r in rows) >= 2
    assert all(r["rollout/versions_spanned_max"] <= 4 for r in rows)
    assert sum(r["rollout/tokens_carried"] for r in rows) > 0 and rows[-1]["rollout/partial_frac"] > 0


def test_a_chunk_of_the_whole_length_samples_what_the_synchronous_loop_samples(tiny_model_dir, tmp_path):
    """partial_chunk_tokens = max_completion_length: every group completes in its first round, so the steps
    draw the same prompts and sample the same tokens as the synchronous loop. pi_old differs only as the
    sampler's log-probs differ from the trainer's (float noise), so the weights agree to float noise."""
    steps = ["optim.max_steps=3", "checkpoint.save_every=0", "rollout.engine=fast"]
    partial = _train(
        config(
            tiny_model_dir,
            tmp_path / "p",
            *steps,
            *PARTIAL,
            "rollout.partial_chunk_tokens=8",
            "rollout.partial_in_flight=1",
        )
    )
    sync = Recorded(config(tiny_model_dir, tmp_path / "s", *steps))
    sync.train()
    for a, b in zip(partial.batches, sync.batches, strict=True):
        assert torch.equal(a.tokens.input_ids, b.tokens.input_ids)
    ours, theirs = partial.policy.module.state_dict(), sync.policy.module.state_dict()
    for name, x in ours.items():  # against how far training moved it: float noise (measured 2.8e-5 at most)
        moved = (theirs[name] - partial.weights[0][name]).norm()
        assert (x - theirs[name]).norm() <= 1e-3 * moved, name
    rows = read_metrics(tmp_path / "p")
    assert all(r["rollout/partial_frac"] == 0 and r["rollout/partial_rounds"] == 1 for r in rows)


def _pipeline(tiny_model_dir, *overrides):
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_model_dir}",
            "rollout.num_generations=2",
            "rollout.max_completion_length=8",
            "rollout.temperature=1.5",
            *PARTIAL,
            *overrides,
        ],
    )
    model, tok = load_policy(cfg.model)
    engine = make_engine("fast", model, tok, rollout=cfg.rollout)
    return PartialPipeline(engine, cfg.rollout, max_lag=0, version=0, model=model, seed=0), model, tok


class _Rows:
    """draw(None): the next `n` prompt rows of a fixed stream, counted."""

    def __init__(self, tok, n=2):
        self.n, self.drawn, self.tok = n, 0, tok

    def __call__(self, b):
        assert b is None
        out = []
        for _ in range(self.n):
            ids = self.tok(f"{self.drawn} + {self.drawn} =")["input_ids"]
            out.append(type("Row", (), {"prompt_ids": ids, "columns": {}})())
            self.drawn += 1
        return out


def test_the_staleness_bound_restarts_a_completion_and_counts_it(tiny_model_dir):
    """max_staleness 1 with chunks of 4 of 8 and twice a step's groups in flight: the groups left waiting
    after a step hold tokens of version 0; two versions later they are restarted from their prompts (their
    tokens dropped) and counted, and nothing of version 0 is trained. Every group a step returns is complete;
    a step returns the rank's share of groups."""
    pipeline, model, tok = _pipeline(
        tiny_model_dir, "rollout.partial_chunk_tokens=4", "rollout.max_staleness=1"
    )
    draw = _Rows(tok)
    try:
        rows, comps, metrics = pipeline.batch(0, draw, 10)
        assert len(rows) == 2 and len(comps) == 4 and draw.drawn == 4  # 2 groups a step, 4 in flight
        assert all(
            r == "stop" or len(t) == 8 for r, t in zip(comps.finish_reasons, comps.token_ids, strict=True)
        )
        assert metrics["rollout/partial_restarted"] == 0
        waiting = [s for g in pipeline.flying + pipeline.done for s in g.samples if s.versions]
        assert waiting and all(s.versions[0] == 0 for s in waiting)
        pipeline.publish(1, model)
        pipeline.publish(2, model)  # a step without a rollout: what waits is 2 versions old
        rows, comps, metrics = pipeline.batch(2, draw, 10)
        assert metrics["rollout/partial_restarted"] == len(waiting)
        assert metrics["rollout/versions_spanned_max"] <= 2  # max_staleness + 1
        assert all(v == 2 for v in comps.versions)  # nothing of version 0 was trained at version 2
        assert all(
            r == "stop" or len(t) == 8 for r, t in zip(comps.finish_reasons, comps.token_ids, strict=True)
        )
    finally:
        pipeline.close()


def test_a_sample_restarts_empty():
    s = Sample([1, 2], [-0.5, -0.7], [0, 1], [], "stop", 2)
    s.restart()
    assert (s.tokens, s.logprobs, s.versions, s.finish, s.rounds) == ([], [], [], None, 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.max_policy_lag=1"],
            "rollout.partial_rollouts and rollout.max_policy_lag=1 are two timelines",
        ),
        (
            ["rollout.partial_chunk_tokens=2", "rollout.max_staleness=1"],
            "rollout.partial_chunk_tokens=2 over rollout.max_staleness=1 + 1 versions reaches 4 tokens, "
            "fewer than max_completion_length=8",
        ),
        (["tools.builtin=[calculator]"], "rollout.partial_rollouts carries a completion's tokens"),
    ],
)
def test_settings_partial_rollouts_cannot_run_are_one_line(tiny_model_dir, tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        config(tiny_model_dir, tmp_path / "run", *PARTIAL, *overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_engine_without_log_probs_is_refused_naming_those_that_have_them(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, tmp_path / "run", "rollout.partial_rollouts=true", "rollout.engine=hf")
    with pytest.raises(ConfigError, match="rollout.partial_rollouts keeps each token's sampler log-prob"):
        Trainer(cfg)


@pytest.mark.parametrize("moment", ["after-save", "between"])
def test_a_partial_run_stopped_and_resumed_is_the_uninterrupted_run(tiny_model_dir, tmp_path, moment):
    """The checkpoint holds the groups in flight and waiting (rank_states), the prompt stream resumes after
    them: stopped right after the checkpoint of step 2 or after step 3, and resumed, the run ends with the
    uninterrupted run's weights (torch.equal), and the checkpoint held completions under way."""
    from grpokit.checkpoint import STATE_FILE, checkpoint_dir
    from tests.test_async_resume import _assert_equal, _stop_and_resume, _weights

    extra = [*PARTIAL, "rollout.partial_chunk_tokens=2", "rollout.max_staleness=3", "rollout.temperature=1.5"]
    straight, stopped, resumed = _stop_and_resume(tiny_model_dir, tmp_path, 0, moment, *extra)
    state = torch.load(checkpoint_dir(tmp_path / "run", 2) / STATE_FILE, weights_only=False)
    (kept,) = [r["pipeline"]["partial"] for r in state["rank_states"]]
    assert any(s.tokens and s.finish is None for g in kept["flying"] for s in g.samples)
    _assert_equal(_weights(resumed.trainer), _weights(straight.trainer))
    drawn = [texts for _, texts in stopped.drawn[: stopped.at_save[2]] + resumed.drawn]
    assert drawn == [texts for _, texts in straight.drawn]  # no prompt drawn twice, none skipped


@pytest.mark.slow
def test_a_partial_run_on_vllm_resumed_loses_no_prompt_and_draws_none_twice(vllm_model_dir, tmp_path):
    """vLLM's sampling is not bit-reproducible, so the resumed run's weights are not compared; what a
    checkpoint keeps still holds: the groups in flight come back (completions under way go on from their
    tokens) and the prompt stream goes on after them, none drawn twice, none skipped."""
    require("vllm")
    from grpokit.checkpoint import STATE_FILE, checkpoint_dir
    from tests.test_async_resume import _stop_and_resume

    extra = ["rollout.partial_rollouts=true", "rollout.engine=vllm", "rollout.partial_chunk_tokens=2"]
    extra += ["rollout.max_staleness=3", "rollout.temperature=1.5"]
    straight, stopped, resumed = _stop_and_resume(vllm_model_dir, tmp_path, 0, "between", *extra)
    state = torch.load(checkpoint_dir(tmp_path / "run", 2) / STATE_FILE, weights_only=False)
    (kept,) = [r["pipeline"]["partial"] for r in state["rank_states"]]
    assert any(s.tokens and s.finish is None for g in kept["flying"] for s in g.samples)
    drawn = [texts for _, texts in stopped.drawn[: stopped.at_save[2]] + resumed.drawn]
    assert drawn == [texts for _, texts in straight.drawn]
    assert resumed.trainer.step == straight.trainer.step
