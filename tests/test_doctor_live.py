"""The doctor during a run (grpokit/doctor/live.py, run by RunRecords.log_step every logging.doctor_every
steps): a collapse is one line, printed once, during the run; healthy runs, replayed or real, print nothing.

The collapse is the real-model demo's seed 1 (benchmarks/results/demo_real.md: 16 steps of 4 prompts x 8
completions, held-out greedy accuracy 20.0% -> 16.5%, the rollout reward falling back from step 12). Its
metrics.jsonl was not kept, so SEED_1 below is built to mirror it: the reward of 32 completions a step rising
from about 0.15 to 0.5 over steps 1-11, then falling from step 12 to 0.09; completions shortening from 44.6
to 28 tokens; no KL term (beta = 0) and one optimizer step per batch (clip fraction 0, ratio 1).
"""

import numpy as np
import pytest

from grpokit.doctor import diagnose
from grpokit.doctor.live import LIVE_CHECKS, LiveDoctor
from tests.helpers import read_metrics, tiny_config
from tests.test_doctor import CONFIG, healthy, rows_of

#: the settings of that run (grpokit/demo/real.py FULL before its recipe changed), as config.yaml has them
DEMO_CONFIG = {
    "algorithm": {
        "beta": 0.0,
        "epsilon": 0.2,
        "epsilon_high": None,
        "num_iterations": 1,
        "loss_type": "grpo",
    },
    "rollout": {"num_generations": 8, "prompts_per_step": 4, "temperature": 0.7, "max_completion_length": 48},
    "optim": {"learning_rate": 3e-5, "max_grad_norm": 1.0, "num_minibatches": 1, "max_steps": 16},
}
CORRECT = [4, 5, 6, 8, 9, 13, 10, 15, 16, 15, 15, 13, 7, 3, 3, 3]  # of 32 completions, steps 1-16


def seed_1() -> list[dict]:
    """Seed 1's rows as the trainer logs them: the evaluation at step 0, then steps 1-16 (the last one with
    its evaluation)."""
    rng = np.random.default_rng(1)
    p = np.array(CORRECT) / 32
    rows = [{"step": 0, "eval/pass@1": 0.200, "eval/completion_len_mean": 44.6}]
    for i, k in enumerate(CORRECT):
        rows.append(
            {
                "step": i + 1,
                "reward/mean": k / 32,
                "reward/std": float(np.sqrt(p[i] * (1 - p[i]))),
                "reward/zero_std_frac": float(
                    np.clip(0.5 - 0.5 * abs(p[i] - 0.3) + rng.normal(0, 0.1), 0, 1)
                ),
                "advantage/mean": 0.0,
                "policy/loss": float(rng.normal(0, 0.01)),
                "policy/kl": 0.0,
                "policy/clip_frac": 0.0,
                "policy/ratio_mean": 1.0,
                "policy/entropy": float(0.62 * rng.lognormal(0, 0.05)),
                "policy/grad_norm": float(2.0 * rng.lognormal(0, 0.3)),
                "policy/lr": 3e-5,
                "policy/skipped_updates": 0.0,
                "rollout/completion_len_mean": float(np.interp(i + 1, [1, 11, 16], [44.6, 40.0, 28.0])),
                "rollout/truncated_frac": 0.3 if i < 11 else 0.1,
            }
        )
    rows[-1].update({"eval/pass@1": 0.165, "eval/completion_len_mean": 27.7})
    return rows


def replay(rows: list[dict], config: dict, every: int) -> list[str]:
    """The lines the live doctor prints while the rows are logged, as RunRecords feeds it."""
    live, lines = LiveDoctor(config, every), []
    last = max(r["step"] for r in rows)
    for row in rows:
        step, metrics = row["step"], {k: v for k, v in row.items() if k != "step"}
        if step == 0:
            live.note(step, metrics)
        else:
            lines += live.add(step, metrics, last=step == last)
    return lines


@pytest.mark.parametrize("every", [1, 5])
def test_seed_1_collapse_is_one_line_from_the_step_it_starts(every):
    lines = replay(seed_1(), DEMO_CONFIG, every)
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith(
        "doctor at step 15: reward_drop (error), steps 10-15: reward/mean fell from 0.448 (mean of steps "
        "10-12) to 0.135 (last 3 steps), 6.05 standard errors: training became unstable; fix: "
    ), line
    assert "; fix: lower optim.learning_rate (now 3e-05); raise algorithm.beta (now 0.0)" in line, line
    assert "resume from the checkpoint before the fall" in line and "\n" not in line
    # `grpokit doctor` afterwards says the same of the whole run
    assert [(f.check, f.steps) for f in diagnose(seed_1(), DEMO_CONFIG)] == [("reward_drop", (10, 16))]


def test_a_finding_is_said_once():
    live = LiveDoctor(DEMO_CONFIG, 1)
    said = [line for row in seed_1()[1:] for line in live.add(row["step"], row)]
    assert len(said) == 1 and live.said == {"reward_drop"}
    assert live.add(17, {"reward/mean": 0.0}) == []  # still falling: not said again


@pytest.mark.parametrize("seed", range(12))
def test_healthy_runs_replayed_stay_quiet(seed):
    """The healthy runs of tests/test_doctor.py, 200 steps, checked every 5 steps as they are logged."""
    m, ev = healthy(seed)
    assert replay(rows_of(m, ev), CONFIG, 5) == []


@pytest.mark.parametrize("seed", range(8))
def test_a_short_healthy_run_replayed_stays_quiet(seed):
    """A run like the demo's seeds 0 and 2 (16 steps, 32 completions a step, the reward rising from 0.15 to
    0.5 and staying), checked at every step."""
    rng = np.random.default_rng(100 + seed)
    p = np.interp(np.arange(1, 17), [1, 11, 16], [0.15, 0.5, 0.5])
    rows = seed_1()
    for row, k in zip(rows[1:], rng.binomial(32, p), strict=True):
        row["reward/mean"] = k / 32
    assert replay(rows, DEMO_CONFIG, 1) == []


def test_the_live_checks_leave_out_only_those_that_judge_a_whole_run():
    from grpokit.doctor import CHECKS

    assert set(CHECKS) - set(LIVE_CHECKS) == {"reward_flat", "reward_errors"}


# ---------------------------------------------------------------- in the run's records


def test_the_records_print_the_line_during_the_run(tmp_path, capsys):
    """RunRecords.log_step runs the doctor every logging.doctor_every steps (5, the default) and prints the
    finding once; logging.doctor_every=0 turns it off."""
    from grpokit.records.run_records import RunRecords

    for every, expected in ((5, 1), (0, 0)):
        out = tmp_path / f"every-{every}"
        cfg = tiny_config(
            "no-model-needed",
            out,
            "optim.max_steps=16",
            "optim.learning_rate=3e-5",
            f"logging.doctor_every={every}",
            "logging.tensorboard=false",
        )
        records = RunRecords(out, cfg, main=True, plot=lambda run: None)
        with records.open(0, None):
            for row in seed_1()[1:]:
                records.log_step(row["step"], {k: v for k, v in row.items() if k != "step"}, [])
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("doctor at step")]
        assert len(lines) == expected, lines
        if expected:
            assert lines[0].startswith("doctor at step 15: reward_drop (error), steps 10-15: "), lines
            assert "lower optim.learning_rate (now 3e-05)" in lines[0]
        assert len(read_metrics(out)) == 16  # the records still write every step


@pytest.mark.slow
def test_a_real_run_hears_during_the_run_what_the_doctor_says_afterwards(tiny_model_dir, tmp_path, capsys):
    """The tests' tiny run (tests/helpers.py TINY_RUN: a random tiny model paid for the share of 7s in 8
    tokens) learns to write only 7s: its entropy collapses, its completions never end, its groups tie. The
    doctor, at every 5th step, says each of these once while the run goes on, and `grpokit doctor` afterwards
    finds the same."""
    from grpokit.trainer import Trainer

    cfg = tiny_config(
        tiny_model_dir,
        tmp_path / "run",
        "optim.max_steps=30",
        "checkpoint.save_every=0",
        "logging.tensorboard=false",
    )
    assert cfg.logging.doctor_every == 5  # the default
    Trainer(cfg).train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("doctor at step ")]
    said = [line.split(": ", 2)[1].split(" (")[0] for line in lines]
    rows = read_metrics(tmp_path / "run")
    afterwards = {f.check for f in diagnose(rows, cfg.model_dump())}
    assert len(said) == len(set(said)) and set(said) == afterwards, (lines, afterwards)
    assert {"entropy_collapse", "truncation"} <= afterwards
    steps = [int(line.split()[3].rstrip(":")) for line in lines]
    assert all(s % 5 == 0 for s in steps) and min(steps) < 30, lines  # at doctor steps, from before the end
