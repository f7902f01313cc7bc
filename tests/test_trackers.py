"""The trackers (grpokit/records/trackers.py), each with its real package, read back from its own store:
TensorBoard with its event reader, W&B offline with `wandb leet inspect --json` (wandb's reader of the
.wandb run file), MLflow with MlflowClient (file store and sqlite store), trackio with its CLI.

Hermetic: W&B offline with its config, cache, data and artifact folders under tmp_path, MLflow's store
and trackio's folder under tmp_path, no tokens, the Hugging Face hub offline. Every run is made inside a
fresh git repository under tmp_path, so the recorded commit is known.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import grpokit
import grpokit.records.trackers as trackers
from grpokit.config import ConfigError, LoggingConfig, load_config
from grpokit.records import MetricLogger, run_info
from tests.helpers import require

CONFIG = {"algorithm": {"beta": 0.04, "loss_type": "dr_grpo"}, "model": {"name_or_path": "tiny"}, "seed": 3}
SAMPLES = [
    {"prompt": "2+3=", "completion": "5", "reward": 1.0, "rewards": {"correct": 1.0}},
    {"prompt": "7*6=", "completion": "41", "reward": 0.0, "rewards": {"correct": 0.0}},
]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch) -> str:
    """cwd = a fresh git repository with one commit; returns the commit."""
    root = tmp_path / "project"
    root.mkdir()
    _git(root, "init", "-q")
    (root / "train.py").write_text("print('hi')\n")
    _git(root, "add", "train.py")
    _git(root, "commit", "-q", "-m", "first")
    monkeypatch.chdir(root)
    return _git(root, "rev-parse", "HEAD")


@pytest.fixture
def hermetic(tmp_path, monkeypatch) -> Path:
    """Every tracker's files under tmp_path/home; nothing reaches the network."""
    home = tmp_path / "home"
    for var in (
        "WANDB_API_KEY",
        "WANDB_PROJECT",
        "WANDB_DIR",
        "WANDB_ENTITY",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
        "MLFLOW_TRACKING_URI",
        "TRACKIO_SPACE_ID",
        "TRACKIO_SERVER_URL",
        "HF_TOKEN",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("TRACKIO_DIR", str(home / "trackio"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def _log_three_steps(log: MetricLogger) -> None:
    """Steps 1-3 of reward/mean 0.1, 0.2, 0.3; policy/kl NaN at step 2; eval/pass@1 at step 3 only."""
    for step in (1, 2, 3):
        metrics = {"reward/mean": step / 10, "policy/kl": float("nan") if step == 2 else 0.01 * step}
        if step == 3:
            metrics["eval/pass@1"] = 0.5
        log.log(step, metrics)
    log.log_samples(3, SAMPLES, show=0)


def _assert_run_info(info: dict, commit: str) -> None:
    assert info["grpokit_version"] == grpokit.__version__
    assert info["torch_version"] == torch.__version__
    assert info["transformers_version"] == transformers.__version__
    assert info["git_commit"] == commit and info["git_dirty"] is False


# ---------------------------------------------------------------------------------------------
# run_info


def test_run_info_records_versions_and_the_commit_of_the_working_directory(repo):
    _assert_run_info(run_info(), repo)
    Path("train.py").write_text("print('changed')\n")  # a tracked file differs from the commit
    assert run_info()["git_dirty"] is True


def test_run_info_outside_a_repository_has_no_git_keys(tmp_path, monkeypatch):
    (tmp_path / "plain").mkdir()
    monkeypatch.chdir(tmp_path / "plain")
    monkeypatch.setenv(
        "GIT_CEILING_DIRECTORIES", str(tmp_path)
    )  # git must not find a repository above tmp_path
    info = run_info()
    assert set(info) == {"grpokit_version", "torch_version", "transformers_version"}
    assert info["torch_version"] == torch.__version__


# ---------------------------------------------------------------------------------------------
# TensorBoard


def _text(acc, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def test_tensorboard_event_files(tmp_path, repo):
    require("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    with MetricLogger(out, tensorboard=True, config=CONFIG) as log:
        for step in (1, 2, 3):
            log.log(step, {"reward/mean": step / 10, "eval/pass@1": None})
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert "eval/pass@1" not in acc.Tags()["scalars"]  # None is "not measured", not a point
    values = [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")]
    assert values == [(1, 0.1), (2, 0.2), (3, 0.3)]
    [(step, config)] = _text(acc, "config")
    assert step == 0 and json.loads(config.strip("`\n")) == CONFIG
    [(step, info)] = _text(acc, "run_info")
    _assert_run_info(json.loads(info.strip("`\n")), repo)

    # Resumed from the step-2 checkpoint: step 3 is redone, and TensorBoard shows only the new one.
    with MetricLogger(out, tensorboard=True, config=CONFIG) as log:
        log.truncate_after(2)
        log.log(3, {"reward/mean": 0.9})
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    values = [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")]
    assert values == [(1, 0.1), (2, 0.2), (3, 0.9)]
    assert [step for step, _ in _text(acc, "run_info")] == [0, 3]  # the resumed process records its own


def test_tensorboard_default_follows_availability(tmp_path):
    from grpokit.records import tensorboard_available

    require("tensorboard")
    assert tensorboard_available()  # installed by the test extra
    log = MetricLogger(tmp_path)
    assert log.tensorboard is True
    log.close()
    assert MetricLogger(tmp_path / "off", tensorboard=False).tensorboard is False


# ---------------------------------------------------------------------------------------------
# Weights & Biases, offline


def _wandb_records(run_dir: Path) -> list[dict]:
    """The records of the run's .wandb file, as wandb's own reader prints them."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_wandb_offline_run_reads_back(tmp_path, hermetic, repo):
    require("wandb")
    out = tmp_path / "run"
    with MetricLogger(out, tensorboard=False, wandb=True, run_name="r1", config=CONFIG) as log:
        _log_three_steps(log)
    [run_dir] = (out / "wandb").glob("offline-run-*")  # data lands in OUT/wandb/ without WANDB_DIR
    records = _wandb_records(run_dir)

    [run] = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "r1" and run["project"] == "grpokit"
    config = run["config"]["update"]
    assert config["algorithm"] == CONFIG["algorithm"] and config["seed"] == 3
    _assert_run_info(config["run_info"], repo)

    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [1, 2, 3]
    assert [history[s]["reward/mean"] for s in (1, 2, 3)] == [0.1, 0.2, 0.3]
    assert history[2]["policy/kl"] == "NaN"  # W&B gets the NaN itself, so a diverged value shows as one
    assert "eval/pass@1" not in history[1] and history[3]["eval/pass@1"] == 0.5
    assert history[3]["samples._type"] == "table-file"

    table = json.loads((run_dir / "files" / history[3]["samples.path"]).read_text())
    assert table["columns"] == ["completion", "prompt", "reward", "rewards"]
    assert table["data"][1] == ["41", "7*6=", 0.0, '{"correct": 0.0}']
    # Nothing outside tmp_path: the table's staging copy went to the artifact folder set above.
    [artifact] = [r["artifact"] for r in records if r["type"] == "artifact"]
    assert all(Path(f["local_path"]).is_relative_to(hermetic) for f in artifact["manifest"]["contents"])


# ---------------------------------------------------------------------------------------------
# MLflow


@pytest.mark.parametrize("store, project", [("file", None), ("sqlite", "countdown")])
def test_mlflow_store_reads_back(tmp_path, hermetic, repo, monkeypatch, store, project):
    require("mlflow")
    from mlflow import MlflowClient

    if store == "sqlite":  # MLflow's sqlite store needs these two (the test extra has them)
        require("sqlalchemy")
        require("alembic")
    if store == "file":  # MLflow 3.7+ keeps the file store behind this switch; it is still what many use
        uri = (tmp_path / "mlruns").as_uri()
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    else:  # MLflow's default store since 3.7
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with MetricLogger(
        tmp_path / "run", tensorboard=False, mlflow=True, run_name="r1", project=project, config=CONFIG
    ) as log:
        _log_three_steps(log)

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(project or "grpokit")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["algorithm.beta"] == "0.04" and params["model.name_or_path"] == "tiny"
    _assert_run_info(
        {k.removeprefix("run_info."): v for k, v in params.items() if k.startswith("run_info.")}
        | {"git_dirty": params["run_info.git_dirty"] == "True"},
        repo,
    )
    assert run.data.tags["mlflow.source.git.commit"] == repo

    def history(name):
        return [
            (m.step, m.value)
            for m in sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)
        ]

    assert history("reward/mean") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert history("policy/kl") == [(1, 0.01), (3, 0.03)]  # MLflow takes no NaN: step 2 is not sent
    assert history("eval/pass_at_1") == [(3, 0.5)]  # '@' is not allowed in MLflow names


# ---------------------------------------------------------------------------------------------
# trackio, local


def _trackio(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "trackio.cli", *args, "--json"], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.slow
def test_trackio_local_store_reads_back(tmp_path, hermetic, repo, monkeypatch):
    require("trackio")
    # trackio reads TRACKIO_DIR once, when it is imported: the run is made in a fresh interpreter that
    # imports it with the fixture's folder, as a user's training process would.
    script = f"""
        from grpokit.records import MetricLogger
        import tests.test_trackers as t
        with MetricLogger(
            {str(tmp_path / "run")!r}, tensorboard=False, trackio=True, run_name="r1", config=t.CONFIG
        ) as log:
            t._log_three_steps(log)
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, check=True, capture_output=True, text=True
    )
    assert (hermetic / "trackio" / "grpokit.db").exists()

    run = _trackio("get", "run", "--project", "grpokit", "--run", "r1")
    assert run["config"]["algorithm"] == CONFIG["algorithm"] and run["config"]["seed"] == 3
    _assert_run_info(run["config"]["run_info"], repo)
    assert run["last_step"] == 3

    def values(metric):
        got = _trackio("get", "metric", "--project", "grpokit", "--run", "r1", "--metric", metric)["values"]
        return [(v["step"], v["value"]) for v in got]

    assert values("reward/mean") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    kl = values("policy/kl")
    assert kl[0] == (1, 0.01) and kl[1][0] == 2 and math.isnan(kl[1][1])
    assert values("eval/pass@1") == [(3, 0.5)]


# ---------------------------------------------------------------------------------------------
# Choosing trackers


def test_logging_config_chooses_the_trackers():
    cfg = load_config(None, ["logging.trackio=true", "logging.mlflow=true", "logging.project=countdown"])
    assert cfg.logging.trackers() == {
        "tensorboard": None,
        "wandb": False,
        "mlflow": True,
        "trackio": True,
        "project": "countdown",
    }
    assert LoggingConfig().trackers()["trackio"] is False
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'logging.trackoi'; did you mean 'trackio'\?.*allowed here: .*wandb, "
        r"mlflow, trackio",
    ):
        load_config(None, ["logging.trackoi=true"])


@pytest.mark.parametrize("key", ["wandb", "mlflow", "trackio"])
def test_tracker_not_installed_names_the_key_and_the_extra(tmp_path, monkeypatch, key):
    monkeypatch.setitem(sys.modules, key, None)  # `import key` now fails as if it were not installed
    message = (
        f"logging.{key}=true but {key} is not installed; pip install 'grpokit[{key}]' or set "
        f"logging.{key}=false"
    )
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        MetricLogger(tmp_path, tensorboard=False, **{key: True})
    assert isinstance(e.value, ImportError)


def test_tensorboard_requested_but_missing_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(
        trackers, "tensorboard_error", lambda: ModuleNotFoundError("No module named 'tensorboard'")
    )
    with pytest.raises(
        ConfigError,
        match=r"logging.tensorboard=true but tensorboard is not installed; pip install "
        r"'grpokit\[tensorboard\]'",
    ):
        MetricLogger(tmp_path, tensorboard=True)


def test_a_tracker_that_fails_to_start_closes_the_ones_already_open(tmp_path, hermetic, monkeypatch):
    require("mlflow")
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(ConfigError, match="logging.trackio=true"):
        MetricLogger(tmp_path / "run", tensorboard=False, mlflow=True, trackio=True, config=CONFIG)
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("grpokit").experiment_id])
    assert run.info.status == "FINISHED"  # opened before trackio failed, and ended, not left RUNNING
