"""benchmarks/presets.py end to end on the tiny test model: 2 presets, 1 seed, 2 steps, a tiny held-out
set."""

import importlib.util
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "presets.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_presets", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_presets_benchmark_writes_a_row_per_run(tiny_model_dir, tmp_path):
    bench = load_bench()
    md = bench.main(
        [
            "--model",
            str(tiny_model_dir),
            "--presets",
            "grpo,dapo",
            "--seeds",
            "0",
            "--steps",
            "2",
            "--prompts",
            "4",
            "--G",
            "4",
            "--max-completion-length",
            "8",
            "--eval-size",
            "8",
            "--eval-every",
            "1",
            "--out",
            str(tmp_path / "runs"),
            "--results",
            str(tmp_path / "results"),
        ]
    )
    assert md == tmp_path / "results" / "presets.md"
    assert (tmp_path / "results" / "presets.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "`python benchmarks/presets.py --model" in text and "load average" in text
    # Per-step tables: one row per run, evaluated at steps 0, 1, 2; and one summary row per preset.
    for table in ("mean@8 (%)", "pass@1 (%)"):
        section = text.split(table, 1)[1].split("\n## ", 1)[0]
        rows = [ln for ln in section.splitlines() if re.match(r"\| (grpo|dapo) \| 0 \|", ln)]
        assert len(rows) == 2, section
        assert "step 0 | step 1 | step 2" in section
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    assert len([ln for ln in summary.splitlines() if re.match(r"\| (grpo|dapo) \| 0 \|", ln)]) == 2
    assert "Claim (mean@8)" in text
    # --report-only redraws the same report from the saved runs, without training.
    md.unlink()
    args = ["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results"), "--report-only"]
    assert bench.main(args).read_text() == text


def test_first_reach_is_the_first_evaluated_step_at_or_above_the_target():
    bench = load_bench()
    curve = [
        {"step": 0, "mean@k": 0.25},
        {"step": 25, "mean@k": 0.31},
        {"step": 50, "mean@k": 0.29},
        {"step": 75, "mean@k": 0.30},
    ]
    assert bench.first_reach(curve, "mean@k", 0.30) == 25
    assert bench.first_reach(curve, "mean@k", 0.25) == 0
    assert bench.first_reach(curve, "mean@k", 0.32) is None
