"""The bad-step guard (grpokit/records/health.py) and the metrics it reads: reward/error_frac over dynamic
sampling's merged rounds, failed_fractions, no_learning_signal. The whole runs are in tests/test_errors.py."""

import logging

import pytest
import torch

from grpokit.config import load_config
from grpokit.data.batch import Groups
from grpokit.metrics.compute import failed_fractions, no_learning_signal
from grpokit.policy.optim import TrainingError
from grpokit.records.health import StepHealth
from grpokit.rewards.manager import RewardOutput
from grpokit.rollout import Completions

NO_SIGNAL = {"reward/zero_std_frac": 1.0, "advantage/abs_mean": 0.0}
HEALTHY = {
    "reward/zero_std_frac": 0.5,
    "advantage/abs_mean": 0.4,
    "reward/errors/judge": 0.0,
    "reward/error_frac": 0.0,
}
FAILING = {
    **HEALTHY,
    "reward/errors/judge": 6.0,
    "reward/errors/format": 2.0,
    "reward/error_frac": 0.75,
}  # of 8


def config(*overrides):
    return load_config(
        None, ["rollout.prompts_per_step=2", "rollout.num_generations=4", "optim.max_steps=10", *overrides]
    )


def test_error_frac_counts_over_every_merged_round():
    """Dynamic sampling merges rounds: their errors add up, and so do the completions those are out of."""

    def round_of(errors, timeouts):
        total = torch.tensor([0.0, 1.0, 0.0, 0.0])  # two groups of G = 2
        out = RewardOutput(
            total=total,
            per_function={"judge": total.clone()},
            errors={"judge": errors},
            weights={"judge": 1.0},
            timeouts=timeouts,
        )
        return Groups(rows=["a", "b"], comps=Completions([[1]] * 4, ["x"] * 4, ["stop"] * 4), scored=out)

    first, second = round_of(2, {"judge": 1}), round_of(1, {})
    merged = Groups.take([(first, 0), (second, 1)], 2).scored
    assert merged.total.numel() == 4 and merged.errors == {"judge": 3} and merged.timeouts == {"judge": 1}
    assert merged.scored == 8 and merged.metrics()["reward/error_frac"] == 3 / 8  # not 3 / 4
    assert first.scored.metrics()["reward/error_frac"] == 2 / 4  # one call: over its N


def test_failed_fractions_and_no_learning_signal():
    assert failed_fractions(FAILING) == {"judge": 0.75, "format": 0.25}
    assert failed_fractions(HEALTHY) == {} and failed_fractions(NO_SIGNAL) == {}
    assert no_learning_signal(NO_SIGNAL) and not no_learning_signal(HEALTHY)
    assert not no_learning_signal(
        {"reward/zero_std_frac": 1.0, "advantage/abs_mean": 0.2}
    )  # a PPO critic, process rewards


def test_warns_when_a_stretch_starts_or_changes_and_stops_after_n_in_a_row(caplog):
    health = StepHealth(config("stop_after_bad_steps=3"))
    steps = [NO_SIGNAL, NO_SIGNAL, HEALTHY, NO_SIGNAL, {**FAILING, **NO_SIGNAL}, FAILING]
    with (
        caplog.at_level(logging.WARNING, logger="grpokit.records.health"),
        pytest.raises(TrainingError) as stop,
    ):
        for step, metrics in enumerate(steps, 1):
            health.check(step, metrics)
    assert step == 6  # steps 4, 5, 6: three in a row; step 3 broke the first stretch
    assert str(stop.value).startswith(
        "stopped at step 6 after 3 bad steps in a row (steps 4-6; stop_after_bad_steps=3, "
        "0 = never stop): reward function 'judge' failed on 75% of the step's completions"
    )
    warned = [r.getMessage() for r in caplog.records]
    assert [w.split(":")[0] for w in warned] == [
        "step 1",
        "step 4",
        "step 5",
    ]  # a stretch starts, or its reasons change
    assert warned[0].startswith(
        "step 1: no learning signal: in each of the 2 groups all 4 completions got the same reward"
    )
    assert (
        "'judge' failed on 75%" in warned[2]
        and "no learning signal" in warned[2]
        and "'format'" not in warned[2]
    )
    assert warned[0].endswith("The run stops after 3 such steps in a row (stop_after_bad_steps)")


def test_never_stops_on_the_last_step_nor_with_0_and_the_fraction_is_the_configs(caplog):
    health = StepHealth(config("stop_after_bad_steps=3", "optim.max_steps=3"))
    for step in (1, 2, 3):  # the run ends here anyway, with its final save
        health.check(step, NO_SIGNAL)
    health = StepHealth(config("stop_after_bad_steps=0"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpokit.records.health"):
        for step in range(1, 51):
            health.check(step, NO_SIGNAL)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.endswith("The run goes on (stop_after_bad_steps=0)")
    assert StepHealth(config("reward_error_fraction=0.8")).reasons(FAILING) == {}
    assert list(StepHealth(config("reward_error_fraction=0.2")).reasons(FAILING)) == ["judge", "format"]
