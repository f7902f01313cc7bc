"""A run at rollout.max_policy_lag = k stopped and resumed is the uninterrupted run, bit for bit: the
checkpoint holds the batches in flight and the sampler's generators (grpokit/rollout/pipeline.py), the prompt
stream goes on after them (grpokit/data/sampler.py's SamplerBookmarks), so the resumed run trains on the same
batches and ends with the same weights (torch.equal), and draws no prompt twice and skips none.

Each case: the straight run; a run stopped by an exception (as a crash) right after a checkpoint, or between
two; the same config again, which resumes. tests/test_crash.py kills `grpokit train` with SIGKILL at lag 1,
and tests/test_distributed.py resumes a lag-1 run at 2 ranks.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import torch

from grpokit.checkpoint import STATE_FILE, checkpoint_dir, list_checkpoints
from grpokit.config import load_config
from grpokit.policy import load_policy
from grpokit.rollout import make_engine
from grpokit.rollout.pipeline import make_pipeline
from grpokit.trainer import Trainer
from tests.helpers import read_metrics
from tests.test_async_rollouts import _Row
from tests.test_trainer import Crash, _crash_at, config

STEPS = ["optim.max_steps=6", "checkpoint.save_every=2", "checkpoint.keep_last=5", "rollout.engine=fast"]
CONSTANT_IF_EVEN = f"{Path(__file__).parent / 'reward_fns.py'}:even_target_constant"
#: dynamic sampling with groups of equal rewards (even targets): extra rounds from the pipeline's own
#: generator; and a held-out evaluation every 2 steps (the engine on the trainer's weights, the sampler
#: paused)
DYNAMIC_AND_EVAL = [
    "algorithm.dynamic_sampling=true",
    "algorithm.max_sampling_rounds=3",
    f"rewards=[{{function: '{CONSTANT_IF_EVEN}'}}]",
    "eval.every=2",
    "data.eval_size=8",
    "eval.max_samples=4",
]


class _Run:
    """A Trainer whose draws of prompts are recorded: (batch or None for an extra round, prompt texts), and
    how many had been drawn at each checkpoint."""

    def __init__(self, model_dir, out, *extra: str) -> None:
        self.trainer = Trainer(config(model_dir, out, *STEPS, *extra))
        self.drawn: list[tuple[int | None, list[str]]] = []
        self.at_save: dict[int, int] = {}
        draw, save = self.trainer._draw, self.trainer.save

        def recording_draw(b=None):
            rows = draw(b)
            self.drawn.append((b, [r.prompt_text for r in rows]))
            return rows

        def recording_save():
            path = save()
            self.at_save[self.trainer.step] = len(self.drawn)
            if self.crash_after_save == self.trainer.step:
                raise Crash
            return path

        self.trainer._draw, self.trainer.save = recording_draw, recording_save
        self.crash_after_save: int | None = None

    def train(self, on_log=None) -> Trainer:
        crashes = on_log is not None or self.crash_after_save is not None
        with pytest.raises(Crash) if crashes else contextlib.nullcontext():
            self.trainer.train(on_log=on_log)
        return self.trainer


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


def test_a_pipeline_gives_back_its_batches_in_flight(tiny_model_dir):
    """The pipeline alone, lag 1, 4 batches: one saved after batch 1 (batch 2 in flight) and restored into a
    new pipeline (also saved again before its first batch: the same state) returns the saved batch 2 and then
    generates batch 3 as the uninterrupted pipeline does, token for token; the weights never move, so only
    the restored generators make batch 3 the same."""
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_model_dir}",
            "rollout.engine=fast",
            "rollout.num_generations=3",
            "rollout.max_completion_length=5",
            "rollout.max_policy_lag=1",
        ],
    )
    model, tok = load_policy(cfg.model)
    rows = [_Row(tok("1 2>3=")["input_ids"]), _Row(tok("3 4 5>12=")["input_ids"])]

    def pipeline():
        engine = make_engine("fast", model, tok, rollout=cfg.rollout)
        return make_pipeline(engine, cfg.rollout, max_lag=1, version=0, model=model, seed=0)

    def take(pipe, batches, into):
        for b in batches:
            into.append(pipe.batch(b, lambda i: rows, 4)[1].token_ids)
            pipe.publish(b + 1, model)

    straight, resumed, first, second = [], [], pipeline(), pipeline()
    try:
        take(first, [0, 1, 2, 3], straight)
        first.close()
        first = pipeline()
        take(first, [0, 1], [])
        state = first.state_dict()
        assert sorted(state["batches"]) == [2] and state["next"] == 3
        second.load_state_dict(state)
        assert second.state_dict()["batches"].keys() == {2}
        second.publish(2, model)
        take(second, [2, 3], resumed)
    finally:
        first.close()
        second.close()
    assert resumed == straight[2:] and straight[2] != straight[3]


def _stop_and_resume(model_dir, tmp_path, lag: int, moment: str, *extra: str):
    """(straight run, stopped run, resumed run), the stopped one at `moment`: "after-save" (an error right
    after the checkpoint of step 2) or "between" (after step 3: batch 3 + k drawn, the checkpoint of step 2
    the newest)."""
    lagged = [f"rollout.max_policy_lag={lag}", *extra]
    straight = _Run(model_dir, tmp_path / "straight", *lagged)
    straight.train()
    stopped = _Run(model_dir, tmp_path / "run", *lagged)
    if moment == "after-save":
        stopped.crash_after_save = 2
        stopped.train()
    else:
        stopped.train(on_log=_crash_at(3))
    resumed = _Run(model_dir, tmp_path / "run", *lagged)
    resumed.train()
    return straight, stopped, resumed


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["after-save", "between"])
@pytest.mark.parametrize("lag", [1, 2])
def test_a_lagged_run_stopped_and_resumed_is_the_uninterrupted_run(tiny_model_dir, tmp_path, lag, moment):
    straight, stopped, resumed = _stop_and_resume(tiny_model_dir, tmp_path, lag, moment)
    saved = max(stopped.at_save)
    assert saved == 2 and len(stopped.drawn) == stopped.at_save[2] + (moment == "between")
    # the checkpoint holds the k batches after it, generated with versions saved - k .. saved - 1
    state = torch.load(checkpoint_dir(tmp_path / "run", saved) / STATE_FILE, weights_only=False)
    (in_flight,) = [r["pipeline"] for r in state["rank_states"]]
    assert sorted(in_flight["batches"]) == list(range(saved, saved + lag))
    for b, (_, comps, _) in in_flight["batches"].items():
        assert comps.versions == [b - lag] * len(comps)
    # every prompt once, in the straight run's order: the stopped run's up to its checkpoint, then the resumed
    # run's, which draws the batches after the saved ones
    assert stopped.drawn[: stopped.at_save[saved]] + resumed.drawn == straight.drawn
    assert resumed.drawn[0][0] == saved + lag
    _assert_equal(_weights(resumed.trainer), _weights(straight.trainer))
    # the metrics of the resumed steps are the straight run's (the times aside)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "run")
    for x, y in zip(a[saved:], b[saved:], strict=True):
        assert {k: v for k, v in x.items() if "time" not in k and not k.startswith("perf/")} == {
            k: v for k, v in y.items() if "time" not in k and not k.startswith("perf/")
        }


@pytest.mark.slow
def test_dynamic_sampling_and_evaluation_resume_exactly_at_lag(tiny_model_dir, tmp_path):
    """Dynamic sampling's extra rounds (drawn in the trainer's thread, generated with the pipeline's second
    generator) and held-out evaluation every 2 steps (the engine on the trainer's weights between the
    sampler's batches) stay exact over a stop and resume at lag 1."""
    straight, stopped, resumed = _stop_and_resume(tiny_model_dir, tmp_path, 1, "between", *DYNAMIC_AND_EVAL)
    rounds = [r["rollout/sampling_rounds"] for r in read_metrics(tmp_path / "straight") if "step" in r]
    assert max(rounds[2:]) > 1, rounds  # the resumed steps do draw extra rounds
    assert any(b is None for b, _ in resumed.drawn)
    assert stopped.drawn[: stopped.at_save[2]] + resumed.drawn == straight.drawn
    _assert_equal(_weights(resumed.trainer), _weights(straight.trainer))
    evals = [r["eval/pass@1"] for r in read_metrics(tmp_path / "straight") if "eval/pass@1" in r]
    assert evals[-2:] == [r["eval/pass@1"] for r in read_metrics(tmp_path / "run") if "eval/pass@1" in r][-2:]


@pytest.mark.slow
def test_a_checkpoint_without_batches_in_flight_resumes_as_before(tiny_model_dir, tmp_path, caplog):
    """A checkpoint written before checkpoints kept the batches in flight (here: the step-2 checkpoint with
    its rank states and "sampler_ahead" taken out) resumes at lag 1 as it always did, with a line saying so:
    the pipeline starts again at the checkpoint's weights and the prompts of the batches that were in flight
    are drawn again, none skipped."""
    lagged = ["rollout.max_policy_lag=1", "optim.max_steps=4"]
    straight = _Run(tiny_model_dir, tmp_path / "straight", *lagged)
    straight.train()
    stopped = _Run(tiny_model_dir, tmp_path / "run", *lagged)
    stopped.train(on_log=_crash_at(3))
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2]
    path = checkpoint_dir(tmp_path / "run", 2) / STATE_FILE
    state = torch.load(path, weights_only=False)
    del state["rank_states"], state["sampler_ahead"]
    torch.save(state, path)
    resumed = _Run(tiny_model_dir, tmp_path / "run", *lagged)
    with caplog.at_level(logging.WARNING, logger="grpokit.rollout"):
        resumed.train()
    assert "the checkpoint holds no batches generated ahead" in caplog.text
    # batches 2 and 3 again: the prompts the straight run drew for them (batch 2's was drawn before step 2)
    assert [b for b, _ in resumed.drawn] == [2, 3]
    assert resumed.drawn == straight.drawn[2:4]
