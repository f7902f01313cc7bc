"""Metric sinks (JSONL), resume truncation, progress output, plots and the report. The trackers
(TensorBoard, W&B, MLflow, trackio) are tests/test_trackers.py."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from grpokit.metrics.compute import read_metrics
from grpokit.records import MetricLogger, TrainProgress, plot_metrics, print_samples, series, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# The module name


def test_stdlib_logging_is_not_shadowed():
    import logging

    import grpokit.records.sinks as sinks

    assert logging is sys.modules["logging"] and hasattr(logging, "getLogger")
    assert sinks.logging is logging
    # A fresh interpreter that imports grpokit.records first still gets the stdlib module for `logging`.
    code = "import grpokit.records, logging; assert hasattr(logging, 'basicConfig'); print(logging.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "grpokit" not in out


# ---------------------------------------------------------------------------------------------
# metrics.jsonl


def test_jsonl_lines_are_valid_json_and_nan_becomes_null(tmp_path):
    with MetricLogger(tmp_path, tensorboard=False) as log:
        log.log(1, {"reward/mean": 0.5, "policy/kl": float("nan"), "policy/loss": float("inf")})
        log.log(
            2, {"reward/mean": np.float32(0.25), "policy/grad_norm": torch.tensor(2.0), "eval/pass@1": None}
        )
        # Each line is on disk as soon as log() returns, before close().
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2

    raw = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in raw and "Infinity" not in raw
    # The strict parser (no NaN / Infinity) accepts every line.
    rows = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        for line in raw.splitlines()
    ]
    assert rows[0]["step"] == 1 and rows[0]["reward/mean"] == 0.5
    assert rows[0]["policy/kl"] is None and rows[0]["policy/loss"] is None
    assert rows[1] == {
        "step": 2,
        "time": rows[1]["time"],
        "reward/mean": 0.25,
        "policy/grad_norm": 2.0,
        "eval/pass@1": None,
    }
    assert isinstance(rows[1]["time"], float) and rows[1]["time"] >= rows[0]["time"]


def test_reserved_names_are_rejected(tmp_path):
    with MetricLogger(tmp_path, tensorboard=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log(1, {"step": 3})


def test_log_samples_appends_lines_and_prints_a_table(tmp_path, capsys):
    samples = [
        {"prompt": "2+3=", "completion": "5", "reward": 1.0, "reward/correct": 1.0, "reward/format": None},
        {
            "prompt": [{"role": "user", "content": "7*6="}],
            "completion": "41",
            "reward": 0.0,
            "rewards": {"correct": 0.0},
        },
    ]
    with MetricLogger(tmp_path, tensorboard=False) as log:
        log.log_samples(3, samples)
        log.log_samples(4, samples[:1], show=0)
    rows = _lines(tmp_path / "samples.jsonl")
    assert [r["step"] for r in rows] == [3, 3, 4]
    assert rows[0]["completion"] == "5" and rows[0]["reward/format"] is None
    assert rows[1]["prompt"][0]["content"] == "7*6=" and rows[1]["rewards"] == {"correct": 0.0}
    out = capsys.readouterr().out
    assert out.count("samples at step") == 1  # show=0 printed nothing
    assert "7*6=" in out and "correct" in out


def test_print_samples_handles_long_and_odd_values(capsys):
    print_samples(1, [{"prompt": "x" * 5000 + "END", "completion": None, "reward": float("nan")}])
    out = capsys.readouterr().out
    assert "END" in out and "nan" in out
    # Completions are text, not rich markup.
    print_samples(2, [{"prompt": "[bold]p", "completion": "[/answer] [1, 2]", "reward": 0.0}])
    out = capsys.readouterr().out
    assert "[bold]p" in out and "[/answer] [1, 2]" in out


def test_truncate_after_drops_later_steps(tmp_path):
    with MetricLogger(tmp_path, tensorboard=False) as log:
        for step in range(1, 6):
            log.log(step, {"reward/mean": step / 10})
            log.log_samples(step, [{"prompt": "p", "completion": "c", "reward": 0.0}], show=0)
    # A crash can leave a line cut short: it goes too.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')

    with MetricLogger(tmp_path, tensorboard=False) as log:  # the resumed run, from the step-3 checkpoint
        log.truncate_after(3)
        assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        assert [r["step"] for r in _lines(tmp_path / "samples.jsonl")] == [1, 2, 3]
        log.log(4, {"reward/mean": 0.9})
    rows = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["reward/mean"] == 0.9
    assert not list(tmp_path.glob("*.tmp"))  # the atomic rewrite left no temporary file


def test_truncate_after_without_files_is_a_no_op(tmp_path):
    with MetricLogger(tmp_path, tensorboard=False) as log:
        log.truncate_after(10)
    assert not (tmp_path / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# Progress


def test_progress_non_tty_prints_compact_lines(capsys, monkeypatch):
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS"):
        monkeypatch.delenv(var, raising=False)
    with TrainProgress(10, keys=("reward/mean", "policy/kl", "eval/pass@1"), every=4) as prog:
        assert not prog.live  # capsys' stdout is not a terminal
        for step in range(1, 11):
            metrics = {"reward/mean": step / 10, "policy/kl": 0.001 * step}
            if step == 5:
                metrics["eval/pass@1"] = 0.375
            prog.update(step, metrics)
            if step == 2:
                prog.print("checkpoint saved")
    lines = capsys.readouterr().out.splitlines()
    steps = [line.split()[1] for line in lines if line.startswith("step ")]
    assert steps == ["1/10", "4/10", "8/10", "10/10"]  # the first update, every 4 steps, the last
    assert "checkpoint saved" in lines
    last = lines[-1]
    assert last.startswith("step 10/10 (100%)") and "eta 0:00:00" in last
    # The latest value of each key; eval/pass@1 keeps its step-5 value.
    assert "reward/mean 1 |" in last and "policy/kl 0.01" in last and "eval/pass@1 0.375" in last


def test_progress_resumed_run_prints_the_final_step(capsys):
    with TrainProgress(7, start_step=3, keys=("reward/mean",), every=3, live=False) as prog:
        for step in range(4, 8):
            prog.update(step, {"reward/mean": 0.5})
    steps = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert steps == ["4/7", "6/7", "7/7"]


def test_progress_live_mode_renders(monkeypatch):
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with TrainProgress(4, keys=("reward/mean",), console=console) as prog:
        assert prog.live
        for step in range(1, 5):
            prog.update(step, {"reward/mean": 0.25 * step})
        prog.print("hello above the bar")
    text = buf.getvalue()
    assert "hello above the bar" in text and "4/4" in text and "reward/mean 1" in text


# ---------------------------------------------------------------------------------------------
# Plots and report


def _synthetic_metrics(path):
    with open(path, "w") as f:
        for step in range(1, 61):
            row = {
                "step": step,
                "time": 1.0 * step,
                "reward/mean": step / 60,
                "reward/correct": step / 60 if step % 7 else None,  # gaps
                "reward/format": 1.0,
                "reward/correct/std": 0.1,  # statistics, not functions: not drawn in reward.png
                "reward/zero_std_frac": 0.2,
                "policy/kl": None if step == 3 else 0.001 * step,
                "rollout/completion_len_mean": 20 + step,
                "rollout/truncated_frac": 0.1,
            }
            if step % 10 == 0:
                row["eval/pass@1"] = step / 100
                row["eval/pass@8"] = step / 80
            f.write(json.dumps(row) + "\n")
        f.write("\n")
        f.write('{"step": 61, "reward/mean": 0.9')  # cut short by a crash


def test_read_metrics_skips_blank_and_broken_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _synthetic_metrics(path)
    rows = read_metrics(path)
    assert len(rows) == 60
    xs, ys = series(rows, "policy/kl")
    assert len(xs) == 59 and 3 not in xs
    assert read_metrics(tmp_path / "absent.jsonl") == []


def test_plots_are_pngs_and_absent_metrics_are_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _synthetic_metrics(path)
    paths = plot_metrics(path, tmp_path / "plots")
    assert [p.name for p in paths] == ["reward.png", "eval.png", "kl.png", "lengths.png"]  # no clip metrics
    for p in paths:
        assert p.read_bytes()[:8] == PNG_SIGNATURE and p.stat().st_size > 1000
    assert not (tmp_path / "plots" / "clip.png").exists()


def test_plots_from_empty_or_all_null_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps({"step": 1, "reward/mean": None, "policy/kl": None})
        + "\n"
        + json.dumps({"time": 2})
        + "\n"
    )
    assert plot_metrics(path, tmp_path / "plots") == []
    assert plot_metrics(tmp_path / "absent.jsonl", tmp_path / "plots2") == []


def test_report_embeds_plots_by_relative_path(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _synthetic_metrics(path)
    plots = plot_metrics(path, tmp_path / "plots")
    report = write_report(
        tmp_path,
        title="arithmetic, tiny model",
        summary_rows=[("metric", "before", "after"), ("eval/pass@1", "0.10", "0.60"), ("note", "a|b")],
        plots=plots,
        notes="Command: `grpokit demo --quick`",
    )
    text = report.read_text()
    assert report == tmp_path / "report.md"
    assert text.startswith("# arithmetic, tiny model\n")
    assert "| metric | before | after |" in text and "| eval/pass@1 | 0.10 | 0.60 |" in text
    assert "| note | a\\|b |  |" in text  # a '|' in a cell is escaped, short rows are padded
    assert "grpokit demo --quick" in text
    for p in plots:
        assert f"](plots/{p.name})" in text
        assert (tmp_path / "plots" / p.name).exists()
