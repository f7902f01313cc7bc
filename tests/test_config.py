"""Config: defaults, YAML + dotted overrides, one-line errors that name the key."""

import subprocess
import sys

import pytest

from grpokit.config import Config, ConfigError, describe, load_config


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_follow_the_seed_and_trl_names():
    c = Config()
    assert c.rollout.num_generations == 8
    assert c.algorithm.beta == 0.04 and c.algorithm.kl_estimator == "k3"
    assert c.algorithm.epsilon == 0.2 and c.algorithm.epsilon_high is None
    assert c.algorithm.loss_type == "grpo" and c.algorithm.scale_rewards == "group"
    assert c.rollout_batch_size == 64 and c.minibatch_size == 64 and c.micro_batch_size == 64


def test_yaml_and_overrides(tmp_path):
    p = write(tmp_path, "model:\n  name_or_path: m\nalgorithm:\n  beta: 0.1\nrewards:\n  - function: math\n")
    c = load_config(
        p, ["algorithm.beta=0.0", "rollout.num_generations=16", "rewards.0.weight=2.5", "eval.reward=null"]
    )
    assert c.algorithm.beta == 0.0 and c.rollout.num_generations == 16
    assert c.rewards[0].function == "math" and c.rewards[0].weight == 2.5
    assert c.model.name_or_path == "m"


@pytest.mark.parametrize(
    "override, words",
    [
        (["algorithm.betaa=0.1"], ["algorithm.betaa", "beta"]),
        (["rollout.num_generations=1"], ["rollout.num_generations", "1", "greater than or equal to 2"]),
        (["algorithm.epsilon=-0.1"], ["algorithm.epsilon", "-0.1"]),
        (["algorithm.loss_type=foo"], ["algorithm.loss_type", "foo", "grpo", "dr_grpo"]),
        (["optim.num_minibatches=3"], ["optim.num_minibatches", "3", "64"]),
        (["nosection.key=1"], ["nosection"]),
        (["algorithm.beta"], ["section.key=value"]),
        (["reward_timeout=-1"], ["reward_timeout", "-1", "greater than or equal to 0"]),
        (
            ["rewards=[{function: math, timeout: -5}]"],
            ["rewards.0.timeout", "-5", "greater than or equal to 0"],
        ),
        (["reward_slow_warning=-1"], ["reward_slow_warning", "greater than or equal to 0"]),
        (["reward_error_fraction=1.5"], ["reward_error_fraction", "1.5", "less than or equal to 1"]),
        (["stop_after_bad_steps=-1"], ["stop_after_bad_steps", "-1", "greater than or equal to 0"]),
        (["stop_after_bad_steps=2.5"], ["stop_after_bad_steps", "2.5"]),
    ],
)
def test_bad_values_one_line(override, words):
    with pytest.raises(ConfigError) as exc:
        load_config(None, override)
    msg = str(exc.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_reward_guards_defaults_and_what_a_saved_config_records():
    c = Config()
    assert (c.reward_timeout, c.reward_slow_warning, c.reward_error_fraction, c.stop_after_bad_steps) == (
        300.0,
        60.0,
        0.5,
        20,
    )
    c = load_config(None, ["rewards=[{function: math}, {function: format, timeout: 2}]"])
    assert c.rewards[0].timeout is None and c.rewards[1].timeout == 2.0
    # an unset timeout is not written, so a checkpoint saved before the key existed still matches on resume
    assert [sorted(r) for r in c.model_dump()["rewards"]] == [
        ["function", "kwargs", "name", "weight"],
        ["function", "kwargs", "name", "timeout", "weight"],
    ]


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "model: [1, 2\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_every_field_documented():
    rows = describe()
    undocumented = [k for k, _, doc in rows if not doc]
    assert len(rows) > 40 and not undocumented, undocumented


def test_cli_unknown_key_one_line_exit_2(tmp_path):
    p = write(tmp_path, "model:\n  name_or_path: x\nalgorithm:\n  betaa: 0.1\n")
    r = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(p)], capture_output=True, text=True)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "algorithm.betaa" in lines[0] and "Traceback" not in r.stderr


def test_grpokit_config_lists_the_train_and_the_sft_keys():
    from typer.testing import CliRunner

    from grpokit.cli import app

    train = CliRunner().invoke(app, ["config"], terminal_width=200)
    sft = CliRunner().invoke(app, ["config", "--sft"], terminal_width=200)
    assert train.exit_code == 0 and sft.exit_code == 0
    assert (
        "algorithm.beta" in train.output
        and "threads" in train.output
        and "sft.learning_rate" not in train.output
    )
    assert (
        "sft.learning_rate" in sft.output
        and "sft.max_grad_norm" in sft.output
        and "data.train_path" in sft.output
    )
