"""grpokit doctor on synthetic metric files: each problem fires its own check over the right steps
and no other; healthy runs (many seeds, realistic noise) fire nothing; unreadable runs exit 2."""

import json

import numpy as np
import pytest
import yaml

from grpokit.doctor import CHECKS, diagnose, doctor_main

N = 200  # logged steps 1..200
CONFIG = {
    "algorithm": {
        "beta": 0.04,
        "epsilon": 0.2,
        "epsilon_high": None,
        "num_iterations": 2,
        "loss_type": "grpo",
    },
    "rollout": {"num_generations": 8, "temperature": 1.0, "max_completion_length": 256},
    "optim": {"learning_rate": 1e-6, "max_grad_norm": 1.0, "num_minibatches": 2},
}


def healthy(seed=0, n=N):
    """A good run of n steps with per-step noise as a batch of 64 completions gives it: reward rising
    0.2 -> 0.7, KL settling near 0.02, clip fraction ~5% (mu = 2), entropy and lengths drifting slowly."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, n + 1, dtype=float)
    p = 0.2 + 0.5 / (1 + np.exp(-(t - 0.4 * n) / (0.1 * n)))
    m = {
        "reward/mean": rng.binomial(64, p) / 64,
        "reward/std": np.sqrt(p * (1 - p)) + rng.normal(0, 0.02, n),
        "reward/zero_std_frac": np.clip(0.3 + rng.normal(0, 0.08, n), 0, 1),
        "reward/none_frac": np.zeros(n),
        "advantage/mean": rng.normal(0, 1e-8, n),
        "policy/loss": rng.normal(0, 0.01, n),
        "policy/kl": 0.02 * (1 - np.exp(-t / (0.15 * n))) * rng.lognormal(0, 0.25, n),
        "policy/clip_frac": np.clip(0.05 + rng.normal(0, 0.015, n), 0, 1),
        "policy/ratio_mean": 1 + rng.normal(0, 0.003, n),
        "policy/entropy": (0.9 - 0.25 * t / n) * rng.lognormal(0, 0.05, n),
        "policy/grad_norm": 0.5 * rng.lognormal(0, 0.35, n),
        "policy/lr": np.full(n, 1e-6),
        "policy/skipped_updates": np.zeros(n),
        "rollout/completion_len_mean": (120 + 20 * t / n) * rng.lognormal(0, 0.05, n),
        "rollout/truncated_frac": rng.binomial(64, 0.02, n) / 64,
    }
    ev = {0: 0.3}  # eval.at_start, then every 20 steps, greedy pass@1 on 200 prompts
    for s in range(20, n + 1, 20):
        ev[s] = rng.binomial(200, 0.3 + 0.3 * (p[s - 1] - 0.2) / 0.5) / 200
    return m, ev


def rows_of(m, ev=None, steps=None):
    n = len(next(iter(m.values())))
    steps = list(range(1, n + 1)) if steps is None else steps
    rows = [
        {"step": s, "time": 1.7e9 + s, **{k: float(v[i]) for k, v in m.items()}} for i, s in enumerate(steps)
    ]
    by_step = {r["step"]: r for r in rows}
    for s, v in (ev or {}).items():
        if s in by_step:
            by_step[s]["eval/pass@1"] = float(v)
        else:
            rows.insert(0, {"step": s, "eval/pass@1": float(v)})
    return rows


def names(findings):
    return {f.check for f in findings}


def only(findings, check):
    assert names(findings) == {check}, [(f.check, f.steps, f.message) for f in findings]
    return [f for f in findings if f.check == check]


def near(step, expected, tol=12):
    return abs(step - expected) <= tol


T = np.arange(1, N + 1, dtype=float)


# ---------------------------------------------------------------- healthy runs
@pytest.mark.parametrize("seed", range(12))
def test_healthy_run_has_no_findings(seed):
    m, ev = healthy(seed)
    assert diagnose(rows_of(m, ev), CONFIG) == []


@pytest.mark.parametrize("seed", range(4))
def test_noisier_healthy_run_has_no_findings(seed):
    """Rewards of 8 completions per step, a gradient norm that swings x4, eval on 50 prompts."""
    m, ev = healthy(seed + 50)
    rng = np.random.default_rng(seed)
    p = 0.2 + 0.5 / (1 + np.exp(-(T - 80) / 20))
    m["reward/mean"] = rng.binomial(8, p) / 8
    m["policy/grad_norm"] = 0.5 * rng.lognormal(0, 0.7, N)
    m["policy/clip_frac"] = np.clip(0.1 + rng.normal(0, 0.05, N), 0, 1)
    m["reward/zero_std_frac"] = np.clip(0.35 + rng.normal(0, 0.15, N), 0, 1)
    ev = {s: rng.binomial(50, 0.3 + 0.3 * (p[max(s, 1) - 1] - 0.2) / 0.5) / 50 for s in ev}
    assert diagnose(rows_of(m, ev), CONFIG) == []


def test_healthy_variants_have_no_findings():
    m, ev = healthy(1)
    # converged early, then a long noisy plateau
    p = np.where(T < 60, 0.2 + 0.5 * T / 60, 0.7)
    m["reward/mean"] = np.random.default_rng(5).binomial(64, p) / 64
    assert diagnose(rows_of(m, ev), CONFIG) == []
    # mu = 1, beta = 0: clip fraction and KL exactly 0, ratio exactly 1; no eval
    m, _ = healthy(2)
    m["policy/clip_frac"][:] = 0.0
    m["policy/kl"][:] = 0.0
    m["policy/ratio_mean"][:] = 1.0
    cfg = {**CONFIG, "algorithm": {**CONFIG["algorithm"], "beta": 0.0, "num_iterations": 1}}
    assert diagnose(rows_of(m), cfg) == []
    assert diagnose(rows_of(m), None) == []  # without a config, KL = 0 is not a finding either
    # logged every 5 steps (fewer points, same shape)
    m, ev = healthy(3, n=40)
    assert diagnose(rows_of(m, ev, steps=list(range(5, 201, 5))), CONFIG) == []


def test_missing_keys_are_fine():
    m, ev = healthy(4)
    for key in (
        "policy/kl",
        "policy/entropy",
        "rollout/truncated_frac",
        "reward/zero_std_frac",
        "policy/ratio_mean",
    ):
        del m[key]
    assert diagnose(rows_of(m), CONFIG) == []  # no eval, no KL
    (f,) = diagnose([{"step": 1}, {"step": 2, "reward/mean": None}, {"note": "no step"}], None)
    assert (f.check, f.steps) == ("nonfinite", (2, 2))
    assert diagnose([], None) == []


def test_short_run_is_not_judged():
    m, ev = healthy(5, n=10)
    m["reward/mean"][:] = 0.0
    m["policy/clip_frac"][:] = 0.5
    assert diagnose(rows_of(m, ev), CONFIG) == []


# ---------------------------------------------------------------- each problem, alone
def test_reward_flat():
    m, ev = healthy(10)
    rng = np.random.default_rng(10)
    m["reward/mean"] = rng.binomial(64, 0.1, N) / 64
    ev = {s: rng.binomial(200, 0.12) / 200 for s in ev}
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "reward_flat")
    assert f.steps == (1, 200) and f.severity == "warning"
    assert "temperature (now 1.0)" in f.fix and "sft" in f.fix


def test_reward_flat_at_zero():
    m, ev = healthy(11)
    m["reward/mean"][:] = 0.0
    ev = {s: 0.0 for s in ev}
    assert "reward_flat" in names(diagnose(rows_of(m, ev), CONFIG))


def test_reward_drop():
    m, ev = healthy(12)
    p = np.interp(T, [1, 100, 150, 200], [0.2, 0.7, 0.2, 0.2])
    m["reward/mean"] = np.random.default_rng(12).binomial(64, p) / 64
    (f,) = only(diagnose(rows_of(m), CONFIG), "reward_drop")
    assert 75 <= f.steps[0] <= 125 and f.steps[1] == 200 and f.severity == "error"


@pytest.mark.parametrize("level,severity", [(0.8, "warning"), (0.97, "error")])
def test_zero_std_groups(level, severity):
    m, ev = healthy(13)
    m["reward/zero_std_frac"] = np.clip(
        np.where(T >= 80, level, 0.3) + np.random.default_rng(1).normal(0, 0.03, N), 0, 1
    )
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "zero_std")
    assert near(f.steps[0], 80) and f.steps[1] == 200 and f.severity == severity
    assert "num_generations (now 8)" in f.fix and "algorithm.dynamic_sampling=true" in f.fix
    cfg = {**CONFIG, "algorithm": {**CONFIG["algorithm"], "dynamic_sampling": True, "max_sampling_rounds": 4}}
    (f,) = diagnose(rows_of(m, ev), cfg)
    assert "max_sampling_rounds (now 4)" in f.fix


def test_no_learning_signal():
    """A run where every group's rewards were tied (e.g. rollout.temperature=1e-4): "no problems" before, now
    an error, however short the run (the trainer stops one after stop_after_bad_steps such steps in a row)."""
    m, _ = healthy(20, n=10)
    m["reward/zero_std_frac"][:] = 1.0
    m["advantage/abs_mean"] = np.zeros(10)
    (f,) = only(diagnose(rows_of(m), CONFIG), "no_signal")
    assert (
        f.steps == (1, 10) and f.severity == "error" and "every one of the run's 10 logged steps" in f.message
    )
    assert "rollout.temperature (now 1.0)" in f.fix and "rollout.num_generations (now 8)" in f.fix
    # a stretch of 8 tied steps inside a healthy run; 4 in a row are not enough
    m, ev = healthy(21)
    m["reward/zero_std_frac"][99:107] = 1.0
    m["reward/zero_std_frac"][150:154] = 1.0
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "no_signal")
    assert f.steps == (100, 107) and "8 logged steps in a row" in f.message
    # tied outcomes but non-zero advantages (a PPO critic, process rewards): there is a signal
    m, _ = healthy(20, n=10)
    m["reward/zero_std_frac"][:] = 1.0
    m["advantage/abs_mean"] = np.full(10, 0.3)
    assert diagnose(rows_of(m), CONFIG) == []


def test_reward_errors():
    m, ev = healthy(22)
    m["reward/error_frac"] = np.zeros(N)
    for name in ("judge", "format"):
        m[f"reward/errors/{name}"] = np.zeros(N)
        m[f"reward/timeouts/{name}"] = np.zeros(N)
    m["reward/error_frac"][[40, 41, 90]] = 1.0  # a judge behind a network that timed out at three steps
    m["reward/errors/judge"][[40, 41, 90]] = 64
    m["reward/timeouts/judge"][[40, 41]] = 1
    m["reward/errors/format"][40] = 16
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "reward_errors")
    assert f.steps == (41, 91) and f.severity == "warning"
    assert (
        "at 3 of 200 logged steps" in f.message
        and "more than 50% of the completions: 'judge' (up to 100%)" in f.message
    )
    assert "'format'" not in f.message and "timed out: 'judge'" in f.message
    m["reward/error_frac"][100:130] = 0.6  # more than a tenth of the steps: an error
    assert only(diagnose(rows_of(m, ev), CONFIG), "reward_errors")[0].severity == "error"
    cfg = {**CONFIG, "reward_error_fraction": 1.0}  # the run's own threshold
    assert diagnose(rows_of(m, ev), cfg) == []


def test_clip_fraction_high():
    m, ev = healthy(14)
    m["policy/clip_frac"] = np.where((T >= 60) & (T <= 140), 0.35, 0.05) + np.random.default_rng(2).normal(
        0, 0.02, N
    )
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "clip_high")
    assert near(f.steps[0], 60) and near(f.steps[1], 140) and f.severity == "error"
    assert "num_iterations (now 2)" in f.fix


def test_kl_exploding():
    m, ev = healthy(15)
    m["policy/kl"] = np.where(T < 120, m["policy/kl"], 0.02 * np.exp((T - 120) / 10))
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "kl_high")
    assert near(f.steps[0], 120) and f.steps[1] == 200 and f.severity == "error"
    assert "beta (now 0.04)" in f.fix


def test_kl_flat_at_zero_with_beta():
    m, ev = healthy(16)
    m["policy/kl"][:] = 0.0
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "kl_zero")
    assert near(f.steps[0], 1) and f.steps[1] == 200 and "pi_ref" in f.fix
    m["policy/grad_norm"][:] = 0.0  # nothing moves: nothing to say about the KL
    assert "kl_zero" not in names(diagnose(rows_of(m, ev), CONFIG))


def test_entropy_collapse():
    m, ev = healthy(17)
    m["policy/entropy"] = np.minimum(0.9, 0.9 * np.exp(-(T - 50) / 20)) * np.random.default_rng(3).lognormal(
        0, 0.05, N
    )
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "entropy_collapse")
    assert near(f.steps[0], 78) and f.steps[1] == 200 and "epsilon_high=0.28" in f.fix


def test_length_collapse():
    m, ev = healthy(18)
    m["rollout/completion_len_mean"] = np.interp(T, [1, 100, 120, 200], [120, 120, 10, 10])
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "length_collapse")
    assert near(f.steps[0], 117) and f.steps[1] == 200 and "dr_grpo" in f.fix


def test_length_blowup():
    m, ev = healthy(19)
    m["rollout/completion_len_mean"] = np.interp(
        T, [1, 50, 150, 200], [120, 120, 800, 800]
    ) * np.random.default_rng(4).lognormal(0, 0.05, N)
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "length_blowup")
    assert near(f.steps[0], 103) and f.steps[1] == 200 and "max_completion_length (now 256)" in f.fix


def test_truncation():
    m, ev = healthy(20)
    m["rollout/truncated_frac"] = np.random.default_rng(5).binomial(64, np.where(T >= 150, 0.4, 0.02)) / 64
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "truncation")
    assert near(f.steps[0], 150) and f.steps[1] == 200 and f.severity == "warning"
    assert "mask_truncated_completions" in f.fix and "overlong" in f.fix


@pytest.mark.parametrize("end,severity", [(0.3, "warning"), (0.2, "error")])
def test_reward_hacking(end, severity):
    m, ev = healthy(21)
    rng = np.random.default_rng(6)
    ev = {s: rng.binomial(200, np.interp(s, [0, 200], [0.3, end])) / 200 for s in ev}
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "reward_hacking")
    assert f.steps == (0, 200) and f.severity == severity and "verifier" in f.fix


@pytest.mark.parametrize(
    "end, calls_end, found",
    [(0.31, 3.0, "warning"), (0.15, 3.0, "error"), (0.6, 3.0, None), (0.31, 1.1, None)],
)
def test_tool_spam(end, calls_end, found):
    """Calls per episode 1 -> calls_end (noise of 64 episodes) while held-out pass@1 goes 0.3 -> end."""
    m, ev = healthy(24)
    rng = np.random.default_rng(7)
    m["reward/mean"] = np.full(N, 0.4) + rng.normal(
        0, 0.02, N
    )  # flat: not the reward_hacking check's business
    m["rollout/tools/calls_per_episode"] = np.linspace(1.0, calls_end, N) + rng.normal(0, 0.1, N)
    ev = {s: rng.binomial(200, np.interp(s, [0, 200], [0.3, end])) / 200 for s in ev}
    findings = [f for f in diagnose(rows_of(m, ev), CONFIG) if f.check == "tool_spam"]
    if found is None:
        assert findings == []
    else:
        (f,) = findings
        assert (
            f.severity == found
            and f.steps == (1, 200)
            and "step_cost" in f.fix
            and f.message.startswith("tool calls per episode rose")
        )


def test_runs_without_tools_do_not_list_tool_spam_as_unchecked():
    from grpokit.doctor import Run, run_checks

    m, ev = healthy(25)
    assert "tool_spam" not in run_checks(Run(rows_of(m, ev), CONFIG))[1]


def test_grad_norm_spikes():
    m, ev = healthy(22)
    for s in (57, 58, 143):
        m["policy/grad_norm"][s - 1] = 30.0
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "grad_spikes")
    assert f.steps == (57, 143) and f.message.startswith("3 step(s)")


@pytest.mark.parametrize("cumulative", [True, False])
def test_skipped_updates(cumulative):
    m, ev = healthy(23)
    new = np.zeros(N)
    new[89], new[94] = 1, 2  # steps 90 and 95
    m["policy/skipped_updates"] = np.cumsum(new) if cumulative else new
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "nonfinite")
    assert f.steps == (90, 95) and f.message.startswith("3 optimizer step(s) skipped")


def test_null_reward_is_nonfinite():
    m, ev = healthy(24)
    rows = rows_of(m, ev)
    next(r for r in rows if r["step"] == 120)["reward/mean"] = None  # NaN is written as null
    (f,) = only(diagnose(rows, CONFIG), "nonfinite")
    assert f.steps == (120, 120) and "reward/mean" in f.message


def test_ratio_mismatch():
    m, ev = healthy(25)
    m["policy/ratio_mean"] = np.where(T >= 100, 1.25, 1.0) + np.random.default_rng(7).normal(0, 0.01, N)
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "ratio_mismatch")
    assert near(f.steps[0], 100) and f.steps[1] == 200


def test_reward_none():
    m, ev = healthy(26)
    m["reward/none_frac"][:] = 0.8
    (f,) = only(diagnose(rows_of(m, ev), CONFIG), "reward_none")
    assert f.steps == (1, 200)


def test_docs_name_every_check_and_threshold():
    import pathlib

    import grpokit.doctor as doctor

    text = (pathlib.Path(__file__).parents[1] / "docs" / "doctor.md").read_text()
    findings = set(CHECKS) - {"length"} | {"length_collapse", "length_blowup"}
    assert all(f"`{name}`" in text for name in findings)
    constants = {k: v for k, v in vars(doctor).items() if k.isupper() and isinstance(v, (int, float))}
    assert len(constants) > 25
    for name, value in constants.items():
        assert f"`{name}` = {value:g}" in text, name


# ---------------------------------------------------------------- the command
def write_run(path, rows, config=CONFIG):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def test_main_healthy(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    m, ev = healthy(0)
    assert doctor_main(str(write_run(tmp_path / "run", rows_of(m, ev)))) == 0
    out = capsys.readouterr().out
    assert "no problems found" in out and "201 logged steps (0-200)" in out


def test_main_findings_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    m, ev = healthy(0)
    m["policy/kl"][:] = 0.0
    m["policy/clip_frac"][59:140] = 0.35
    run = write_run(tmp_path / "run", rows_of(m, ev))
    assert doctor_main(str(run)) == 1
    out = capsys.readouterr().out
    assert "kl_zero" in out and "clip_high" in out and "suggested fix" in out
    assert "2 finding(s)" in out
    # the config is what makes KL = 0 a finding: without it, only the clip fraction
    (run / "config.yaml").unlink()
    assert doctor_main(str(run / "metrics.jsonl")) == 1
    out = capsys.readouterr().out
    assert "kl_zero" not in out and "clip_high" in out and "not found" in out


@pytest.mark.parametrize("make", ["missing", "no_metrics", "empty", "garbage"])
def test_main_unreadable_run(tmp_path, capsys, make):
    run = tmp_path / "run"
    if make != "missing":
        run.mkdir()
    if make == "empty":
        (run / "metrics.jsonl").write_text("")
    if make == "garbage":
        (run / "metrics.jsonl").write_text('{"step": 1, "rew\nnot json\n[1, 2]\n{"time": 3}\n')
    assert doctor_main(str(run)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
