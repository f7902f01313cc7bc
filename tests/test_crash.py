"""Crash safety: a kill at any moment never leaves an unreadable checkpoint, and the same command resumes.

Run: .venv/bin/python -m pytest tests/test_crash.py
(benchmarks/kill_resume.py does the same with 20 SIGKILLs at random moments; --lag 1 at
rollout.max_policy_lag=1, --ranks 2 under torchrun.)

- kill -9 mid-step, mid-save and mid-deletion of an old checkpoint: every step-N folder stays
  loadable, the rerun resumes from the newest one, and the weights at the end equal those of a run
  that was never killed, bit for bit;
- a save that raises part-way leaves the previous checkpoint intact and no half-written folder;
  a half-written folder left by a crash is never loaded;
- SIGTERM to a `grpokit train` process, and SIGINT: the step finishes, a checkpoint is saved (once),
  a line names the step and says to rerun the command; exit status 128 + signal (143, 130).

The kills run `grpokit train` in a forked child of the test process (the console script's code,
without paying for a Python start per run); test_sigterm_console_script runs the real console script.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from grpokit.checkpoint import MARKER, STATE_FILE, CheckpointError, list_checkpoints
from grpokit.cli import app
from grpokit.config import load_config
from grpokit.trainer import Trainer
from tests.helpers import NO_TASK, read_metrics, tiny_overrides

PROMPTS = [{"prompt": f"{a} {b}>{a + b}=", "target": a + b} for a in range(1, 5) for b in range(1, 3)]


def overrides(model_dir, tmp_path, out="run", max_steps=6):
    return tiny_overrides(
        model_dir,
        tmp_path / out,
        *NO_TASK,
        f"data.train_path={tmp_path / 'prompts.jsonl'}",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_completion_length=4",
        f"optim.max_steps={max_steps}",
        "logging.tensorboard=false",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=2",
    )


@pytest.fixture
def setup(tiny_model_dir, tmp_path):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    (tmp_path / "config.yaml").write_text("{}\n")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return tiny_model_dir, tmp_path


# ----------------------------------------------------------------------------- helpers


def fork_train(args: list[str], log: Path, stall: str | None = None) -> int:
    """`grpokit train ARGS` in a forked child writing to `log`; returns its pid.

    stall="save": the child's second checkpoint save stops for good after writing the weights into
    its temporary folder. stall="delete": the first deletion of an old checkpoint stops after one
    file. The parent then kills the child there.
    """
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        out = open(log, "w", buffering=1)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.stdout = sys.stderr = out
        # One thread, also for `grpokit train`'s automatic count: a forked child of a process whose OpenMP
        # pool has run hangs when it starts a larger pool.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        if stall == "save":
            from transformers import PreTrainedModel

            real, saves = PreTrainedModel.save_pretrained, set()

            def save_then_hang(self, path, *a, **k):
                real(self, path, *a, **k)
                saves.add(str(path))
                if len(saves) == 2 and ".tmp-step-" in str(path):
                    time.sleep(600)

            PreTrainedModel.save_pretrained = save_then_hang
        elif stall == "delete":
            import shutil

            real_rmtree = shutil.rmtree

            def delete_one_file_then_hang(path, *a, **k):
                if Path(path).name.startswith(".old-step-"):
                    next(p for p in Path(path).iterdir() if p.suffix == ".safetensors").unlink()
                    time.sleep(600)
                real_rmtree(path, *a, **k)

            shutil.rmtree = delete_one_file_then_hang
        try:
            app(["train", *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os._exit(code)


def wait_exit(pid: int, timeout: float = 600.0) -> int:
    """The forked run's wait status once it exits; killed and failed after `timeout` seconds (a hung child
    must not hang the suite)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            kill9(pid)
            raise AssertionError(f"the forked run did not exit within {timeout:.0f} s")
        time.sleep(0.05)


def wait_for(predicate, pid: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        done, status = os.waitpid(pid, os.WNOHANG)
        assert not done, f"the run exited ({os.waitstatus_to_exitcode(status)}) before the moment to kill it"
        assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
        time.sleep(0.002)


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def hidden(out: Path, prefix: str, pid: int | None = None) -> list[Path]:
    """Folders under checkpoints/ named prefix... (and written by process pid: .tmp-step-N-PID,
    .old-step-N-PID)."""
    root = out / "checkpoints"
    found = [p for p in root.iterdir() if p.name.startswith(prefix)] if root.is_dir() else []
    return [p for p in found if p.name.endswith(f"-{pid}")] if pid is not None else found


def assert_checkpoints_readable(out: Path) -> list[int]:
    """Every step-N folder is complete, loads with from_pretrained, and its trainer state loads."""
    from transformers import AutoModelForCausalLM

    root = out / "checkpoints"
    folders = sorted(p for p in root.iterdir() if p.name.startswith("step-")) if root.is_dir() else []
    for p in folders:
        assert (p / MARKER).is_file(), f"{p.name} has no {MARKER}"
        AutoModelForCausalLM.from_pretrained(p)
        state = torch.load(p / STATE_FILE, weights_only=False)
        assert state["step"] == int(p.name.split("-")[1])
    steps = [s for s, _ in list_checkpoints(out)]
    assert steps == [int(p.name.split("-")[1]) for p in folders]
    return steps


# ----------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_exact(setup):
    model_dir, tmp_path = setup
    straight = tmp_path / "straight"
    pid = fork_train(
        [str(tmp_path / "config.yaml"), *overrides(model_dir, tmp_path, "straight")],
        tmp_path / "straight.log",
    )
    status = wait_exit(pid)
    assert os.waitstatus_to_exitcode(status) == 0, (tmp_path / "straight.log").read_text()[-2000:]

    out = tmp_path / "run"
    args = [str(tmp_path / "config.yaml"), *overrides(model_dir, tmp_path)]
    kills = []
    for i, (moment, stall) in enumerate([("mid-step", None), ("mid-save", "save"), ("mid-delete", "delete")]):
        before = [s for s, _ in list_checkpoints(out)]
        log = tmp_path / f"kill{i}.log"
        start = logged_steps(out)
        pid = fork_train(args, log, stall)
        if stall is None:
            wait_for(
                lambda start=start: logged_steps(out) >= start + 2, pid
            )  # between steps, or inside a save
        elif stall == "save":
            wait_for(
                lambda pid=pid: any(
                    (p / "model.safetensors").exists() for p in hidden(out, ".tmp-step-", pid)
                ),
                pid,
            )
        else:
            wait_for(
                lambda pid=pid: any(
                    not list(p.glob("*.safetensors")) for p in hidden(out, ".old-step-", pid)
                ),
                pid,
            )
        kill9(pid)
        if before:
            assert f"resuming from checkpoint step {before[-1]}" in log.read_text()
        steps = assert_checkpoints_readable(out)
        if stall == "save":  # killed while a step's weights were in .tmp-step-N-PID: step N is no checkpoint
            (tmp,) = hidden(out, ".tmp-step-", pid)
            assert int(tmp.name.split("-")[2]) not in steps and steps[-1] >= before[-1]
        kills.append((moment, steps))

    log = tmp_path / "final.log"
    pid = fork_train(args, log)
    status = wait_exit(pid)
    assert os.waitstatus_to_exitcode(status) == 0, log.read_text()[-2000:]
    assert f"resuming from checkpoint step {kills[-1][1][-1]}" in log.read_text()
    assert assert_checkpoints_readable(out)[-1] == 6
    assert not hidden(out, ".")  # no half-written or half-deleted folder is left behind
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 7)
    )
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit


@pytest.mark.slow
def test_sigkill_at_lag_one_then_resume_is_exact(setup):
    """rollout.max_policy_lag=1: kill -9 mid-step (the sampler thread generating the next batch) and during a
    save; each checkpoint holds the batch generated ahead and the sampler's generators, so the run resumed
    after each kill ends with the weights of a run never killed, bit for bit (benchmarks/kill_resume.py --lag
    1 does it 10 times, also at 2 ranks)."""
    model_dir, tmp_path = setup
    lag = ["rollout.engine=fast", "rollout.max_policy_lag=1"]
    pid = fork_train(
        [str(tmp_path / "config.yaml"), *overrides(model_dir, tmp_path, "straight"), *lag],
        tmp_path / "straight.log",
    )
    assert os.waitstatus_to_exitcode(wait_exit(pid)) == 0, (tmp_path / "straight.log").read_text()[-2000:]

    out = tmp_path / "run"
    args = [str(tmp_path / "config.yaml"), *overrides(model_dir, tmp_path), *lag]
    for i, stall in enumerate([None, "save"]):
        start, log = logged_steps(out), tmp_path / f"kill{i}.log"
        pid = fork_train(args, log, stall)
        if stall is None:
            wait_for(lambda start=start: logged_steps(out) >= start + 2, pid)
        else:
            wait_for(
                lambda pid=pid: any(
                    (p / "model.safetensors").exists() for p in hidden(out, ".tmp-step-", pid)
                ),
                pid,
            )
        kill9(pid)
        assert assert_checkpoints_readable(out)
    log = tmp_path / "final.log"
    pid = fork_train(args, log)
    assert os.waitstatus_to_exitcode(wait_exit(pid)) == 0, log.read_text()[-2000:]
    assert "the checkpoint holds no batches generated ahead" not in log.read_text()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 7)
    )
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit


# ----------------------------------------------------------------------------- a save that fails part-way


def test_save_that_raises_leaves_previous_checkpoint(setup, monkeypatch):
    model_dir, tmp_path = setup
    cfg = load_config(None, overrides(model_dir, tmp_path, max_steps=3))
    from transformers import AutoModelForCausalLM, PreTrainedModel

    real, calls = PreTrainedModel.save_pretrained, []

    def fails_on_second(self, path, *a, **k):
        calls.append(path)
        real(self, path, *a, **k)  # the weights are written, then the save dies
        if len(calls) == 2:
            raise RuntimeError("simulated crash inside save_pretrained")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", fails_on_second)
    with pytest.raises(
        CheckpointError, match=r"step-000002.*simulated crash.*earlier checkpoints are untouched"
    ):
        Trainer(cfg).train()
    assert assert_checkpoints_readable(tmp_path / "run") == [1]
    assert not hidden(tmp_path / "run", ".")
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "step-000001")

    # What a kill would leave: a temporary folder with weights, and a step folder without COMPLETE.
    root = tmp_path / "run" / "checkpoints"
    for name in (".tmp-step-000002-99999", "step-000003"):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(b"half a file")
        (root / name / STATE_FILE).write_bytes(b"half a file")
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    resumed = Trainer(cfg)
    assert resumed.maybe_resume() == 1  # neither half-written folder is loaded
    resumed.train()
    assert resumed.step == 3 and not (root / ".tmp-step-000002-99999").exists()


# ----------------------------------------------------------------------------- SIGTERM / SIGINT


@pytest.mark.slow
def test_sigterm_console_script(setup):
    model_dir, tmp_path = setup
    args = [
        str(tmp_path / "config.yaml"),
        *overrides(model_dir, tmp_path, max_steps=12),
        "checkpoint.save_every=5",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpokit.cli", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    out = tmp_path / "run"
    deadline = time.monotonic() + 300
    while logged_steps(out) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, (stdout[-2000:], stderr[-2000:])
    m = re.search(r"SIGTERM: saved step (\d+) to (\S+); run the same command to resume", stdout)
    assert m, stdout[-2000:]
    step = int(m.group(1))
    assert 1 <= step < 12 and "Traceback" not in stderr and "done:" not in stdout
    assert assert_checkpoints_readable(out)[-1] == step

    again = CliRunner().invoke(app, ["train", *args])
    assert again.exit_code == 0, again.output
    assert f"resuming from checkpoint step {step}" in again.stdout and "done: step 12" in again.stdout


def test_sigint_saves_once_and_stops(setup, monkeypatch):
    model_dir, tmp_path = setup
    import grpokit.checkpoint.checkpointer

    real, saved = grpokit.checkpoint.checkpointer.save_checkpoint, []
    monkeypatch.setattr(
        grpokit.checkpoint.checkpointer,
        "save_checkpoint",
        lambda out, step, *a, **k: saved.append(step) or real(out, step, *a, **k),
    )
    cfg = load_config(None, [*overrides(model_dir, tmp_path, max_steps=6), "checkpoint.save_every=2"])
    trainer = Trainer(cfg)
    handler = signal.getsignal(signal.SIGINT)

    def ctrl_c(step, metrics):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # caught by train(): the step finishes and is saved

    trainer.train(on_log=ctrl_c)
    assert trainer.interrupted == "SIGINT" and trainer.step == 2
    assert saved == [2]  # the periodic save at step 2 is the signal's save: not written twice
    assert signal.getsignal(signal.SIGINT) is handler  # the handlers are restored
    assert not (tmp_path / "run" / "final").exists()


def test_second_ctrl_c_stops_at_once(setup, monkeypatch):
    model_dir, tmp_path = setup
    real = Trainer.update

    def update_then_two_ctrl_c(self, batch):
        stats = real(self, batch)
        if self.step == 1:  # during step 2: the first Ctrl-C asks for a save, the second one stops now
            os.kill(os.getpid(), signal.SIGINT)
            while self.signals.received is None:  # two signals sent back to back would arrive as one
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)
        return stats

    monkeypatch.setattr(Trainer, "update", update_then_two_ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    r = CliRunner().invoke(app, ["train", str(tmp_path / "config.yaml"), *overrides(model_dir, tmp_path)])
    assert r.exit_code == 130 and "saved step 2" not in r.output, r.output  # typer: KeyboardInterrupt -> 130
    assert "SIGINT: saved step 1 to " in r.output  # the newest checkpoint, as a single Ctrl-C says it
    assert signal.getsignal(signal.SIGINT) is handler
    assert assert_checkpoints_readable(tmp_path / "run") == [1]  # step 1's checkpoint; step 2 was never saved


# ----------------------------------------------------------------------------- one run per output_dir


def test_a_second_run_on_the_same_output_dir_stops_naming_the_first(tmp_path):
    from grpokit.checkpoint import CheckpointError, RunLock

    with RunLock(tmp_path):
        with pytest.raises(
            CheckpointError,
            match=rf"output_dir '{tmp_path}' is in use by another run \(pid {os.getpid()} on ",
        ):
            with RunLock(tmp_path):
                pass
    with RunLock(tmp_path):  # released on exit
        pass


def test_a_killed_run_leaves_no_lock_behind(tmp_path):
    code = (
        f"from grpokit.checkpoint import RunLock; import time; RunLock({str(tmp_path)!r}).__enter__(); "
        "print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        from grpokit.checkpoint import CheckpointError, RunLock

        with pytest.raises(CheckpointError, match=f"pid {holder.pid} on"):
            RunLock(tmp_path).__enter__()
    finally:
        holder.kill()  # kill -9: no cleanup code runs
        holder.wait()
    with RunLock(tmp_path):  # the kernel dropped the lock with the process
        pass


def test_train_refuses_a_folder_in_use_and_a_fresh_run_never_appends_to_an_old_log(setup):
    from grpokit.checkpoint import CheckpointError, RunLock

    model_dir, tmp_path = setup
    cfg = load_config(None, [*overrides(model_dir, tmp_path, max_steps=2), "checkpoint.save_every=0"])
    run = tmp_path / "run"
    with RunLock(run):
        with pytest.raises(CheckpointError, match="is in use by another run"):
            Trainer(cfg).train()
    # A previous run that died before its first checkpoint left 3 lines; this run starts fresh, not at line 4.
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": 9.0}) + "\n" for s in range(3))
    )
    Trainer(cfg).train()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert (
        steps == sorted(steps)
        and steps[-1] == 2
        and 9.0
        not in [json.loads(ln).get("reward/mean") for ln in (run / "metrics.jsonl").read_text().splitlines()]
    )


def test_a_second_signal_during_a_save_lets_the_save_finish_and_says_so(setup, monkeypatch):
    """Two Ctrl-C / SIGTERMs during a checkpoint write used to exit 130 with no message and drop the save,
    leaving a temporary folder. Now the save finishes, a line says so, and the run stops (130)."""
    import grpokit.checkpoint.checkpointer

    model_dir, tmp_path = setup
    real = grpokit.checkpoint.checkpointer.save_checkpoint

    def save_under_two_signals(out, step, *a, **k):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # the first asks for a save and a stop
            os.kill(os.getpid(), signal.SIGINT)  # the second arrives while the save is in progress
            time.sleep(0.05)  # both handled here, inside the save
        return real(out, step, *a, **k)

    monkeypatch.setattr(grpokit.checkpoint.checkpointer, "save_checkpoint", save_under_two_signals)
    handler = signal.getsignal(signal.SIGINT)
    r = CliRunner().invoke(
        app,
        ["train", str(tmp_path / "config.yaml"), *overrides(model_dir, tmp_path), "checkpoint.save_every=2"],
    )
    assert r.exit_code == 130, r.output
    assert "SIGINT again during the save of step 2: it finished; stopping now" in r.output
    assert assert_checkpoints_readable(tmp_path / "run") == [2]  # the save completed
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    assert signal.getsignal(signal.SIGINT) is handler


# ----------------------------------------------------------------------------- resuming with another config


def _train_cli(tmp_path, model_dir, *extra):
    return CliRunner().invoke(
        app,
        [
            "train",
            str(tmp_path / "config.yaml"),
            *overrides(model_dir, tmp_path, max_steps=2),
            "checkpoint.save_every=1",
            *extra,
        ],
    )


def test_resume_with_a_changed_config_stops_and_lists_every_difference(setup):
    model_dir, tmp_path = setup
    assert _train_cli(tmp_path, model_dir).exit_code == 0
    recorded = (tmp_path / "run" / "config.yaml").read_text()
    r = _train_cli(
        tmp_path,
        model_dir,
        "optim.max_steps=4",  # training longer may change by default: not listed
        "optim.learning_rate=1e-3",
        "rollout.num_generations=2",
        "seed=1",
    )
    assert r.exit_code == 2, r.output
    line = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(line) == 1 and "was saved with another config (" in line[0]
    for diff in (
        "optim.learning_rate: 0.003 -> 0.001",
        "rollout.num_generations: 4 -> 2",
        "seed: 0 -> 1",
    ):
        assert diff in line[0], (
            diff
        )  # every difference, by its real name (a seed change is not blamed on the data)
    assert "optim.max_steps" not in line[0]
    assert "checkpoint.allow_changes=[optim.learning_rate,rollout.num_generations,seed]" in line[0]
    assert (tmp_path / "run" / "config.yaml").read_text() == recorded  # the run's record is never wrong


def test_allowed_changes_are_applied_logged_and_recorded(setup):
    import yaml

    model_dir, tmp_path = setup
    assert _train_cli(tmp_path, model_dir).exit_code == 0
    r = _train_cli(
        tmp_path,
        model_dir,
        "optim.max_steps=3",
        "optim.learning_rate=1e-3",
        "checkpoint.allow_changes=[optim.learning_rate,optim.max_steps]",
    )
    assert r.exit_code == 0, r.output
    assert (
        "resuming with changes allowed by checkpoint.allow_changes: optim.learning_rate: 0.003 -> 0.001\n"
        in (r.output)
    )
    assert (
        "resuming at step 2 with optim.max_steps 2 -> 3: the learning-rate schedule does not depend on it "
        "(optim.lr_scheduler=constant)" in r.output
    )
    rows = read_metrics(tmp_path / "run")
    assert [row["policy/lr"] for row in rows] == [
        3e-3,
        3e-3,
        1e-3,
    ]  # the new learning rate, not the saved scheduler's
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["optim"]["learning_rate"] == 1e-3


def test_training_longer_resumes_by_default_on_the_longer_runs_schedule(setup):
    """A run to 2 steps resumed to 4 with no allow_changes: it trains steps 3 and 4, says what happens to the
    schedule, and from step 2 on each step's learning rate is the one a 4-step run has at that step."""
    from grpokit.policy.optim import lr_lambda

    model_dir, tmp_path = setup
    cosine = ["optim.lr_scheduler=cosine", "optim.warmup_ratio=0.25"]
    assert _train_cli(tmp_path, model_dir, *cosine).exit_code == 0
    r = _train_cli(tmp_path, model_dir, *cosine, "optim.max_steps=4")
    assert r.exit_code == 0, r.output
    assert (
        "resuming at step 2 with optim.max_steps 2 -> 4: the learning-rate schedule "
        "(optim.lr_scheduler=cosine) is now a 4-step run's, followed from step 2: each step from here has "
        "the learning rate a run started with optim.max_steps=4 has at that step" in r.output
    )
    lrs = [row["policy/lr"] for row in read_metrics(tmp_path / "run")]
    two, four = lr_lambda("cosine", 0, 2), lr_lambda("cosine", 1, 4)  # warm-up: int(0.25 x total) steps
    # policy/lr is the rate the step's update used: optimizer step s - 1 of step s
    assert lrs == [3e-3 * two(0), 3e-3 * two(1), 3e-3 * four(2), 3e-3 * four(3)]
    assert lrs[2] > lrs[1]  # the 2-step run had decayed to its end; the 4-step schedule is half-way


def test_training_longer_at_a_constant_rate_ends_where_an_uninterrupted_run_does(setup):
    model_dir, tmp_path = setup
    assert _train_cli(tmp_path, model_dir).exit_code == 0
    assert _train_cli(tmp_path, model_dir, "optim.max_steps=4").exit_code == 0
    once = CliRunner().invoke(
        app, ["train", str(tmp_path / "config.yaml"), *overrides(model_dir, tmp_path, "once", max_steps=4)]
    )
    assert once.exit_code == 0, once.output
    resumed = load_file(tmp_path / "run" / "final" / "model.safetensors")
    uninterrupted = load_file(tmp_path / "once" / "final" / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_a_max_steps_below_the_checkpoints_step_is_one_line(setup):
    model_dir, tmp_path = setup
    assert _train_cli(tmp_path, model_dir).exit_code == 0
    r = _train_cli(tmp_path, model_dir, "optim.max_steps=1")
    assert r.exit_code == 2, r.output
    line = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert (
        len(line) == 1
        and "step-000002' is at step 2, past optim.max_steps=1: set optim.max_steps" in (line[0])
    )


def test_a_full_disk_reported_by_torch_save_says_no_space_left(setup, monkeypatch):
    """torch.save on a full disk raises "[enforce fail at inline_container.cc:...] unexpected pos", not
    ENOSPC."""
    model_dir, tmp_path = setup
    real_save, calls = torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1472 vs 1366")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    r = _train_cli(tmp_path, model_dir)
    assert r.exit_code == 2, r.output
    line = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert (
        len(line) == 1
        and "could not save to" in line[0]
        and "step-000002': No space left on device (torch's writer" in line[0]
    )
    assert "free disk space" in line[0] and [s for s, _ in list_checkpoints(tmp_path / "run")] == [1]


def test_a_checkpoint_from_before_a_new_key_resumes_while_the_key_keeps_its_default():
    from grpokit.checkpoint import config_changes
    from grpokit.config import Config

    now = Config().model_dump()
    older = Config().model_dump()
    del older["rollout"]["temperature"]  # as if saved by a grpokit that had no such key
    assert config_changes(older, now, []) == ([], [])
    now["rollout"]["temperature"] = 0.5
    assert config_changes(older, now, []) == (["rollout.temperature: None -> 0.5"], [])
    now["rollout"]["temperature"], now["seed"] = Config().rollout.temperature, 7
    assert config_changes(Config().model_dump(), now, ["seed"]) == ([], ["seed: 0 -> 7"])
