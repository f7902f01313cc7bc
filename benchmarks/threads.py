"""Seconds per step of the README example at 1 and 2 threads (and auto), idle and with one other busy process.

    .venv/bin/python benchmarks/threads.py                  # -> benchmarks/results/threads.md (and stdout)
    .venv/bin/python benchmarks/threads.py --steps 60 --sft-steps 200

Each cell is a fresh `grpokit train examples/config.yaml` (the README's GRPO example on the tiny model from
examples/make_tiny_model.py, no evaluation, no checkpoints) with `threads=N`: the median perf/step_time
of its steps after the first two, plus the seconds of a `grpokit sft examples/sft.yaml` run of --sft-steps
steps. "busy" runs one other process spinning on a core (python -c 'while True: pass') for the whole cell,
which is what a shared machine looks like. docs/threads.md explains the numbers.

--smoke: one cell (threads=0, idle), 3 GRPO steps and 2 SFT steps, without waiting for the load average, the
table in runs/threads/smoke/threads.md: a check that the benchmark runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRPOKIT = str(Path(sys.executable).with_name("grpokit"))
WAIT_S = 150.0  # the most a cell waits for the load average (--smoke: 0)


def run(*cmd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the cell's threads= decides
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return r


def settle(below: float = 0.3, at_most: float = 150.0) -> float:
    """Wait until the 1-minute load average falls below `below` (the previous cell's load decays slowly), at
    most `at_most` seconds; returns the load average then."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= below and time.monotonic() - t0 < min(at_most, WAIT_S):
        time.sleep(5)
    return os.getloadavg()[0]


def cell(model: Path, work: Path, threads: int, busy: bool, steps: int, sft_steps: int) -> dict:
    load = settle()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        t0 = (
            time.monotonic()
        )  # a job that has been running a while: until the load average shows it (at most 150 s)
        while busy and os.getloadavg()[0] < 0.9 and time.monotonic() - t0 < WAIT_S:
            time.sleep(5)
        out = work / f"train-{threads}-{busy}"
        r = run(
            GRPOKIT,
            "train",
            "examples/config.yaml",
            f"model.name_or_path={model}",
            f"output_dir={out}",
            f"optim.max_steps={steps}",
            "eval.every=0",
            "eval.at_start=false",
            "logging.sample_every=0",
            "checkpoint.save_every=0",
            "logging.tensorboard=false",
            f"threads={threads}",
        )
        used = next(line for line in r.stdout.splitlines() if line.startswith("threads:"))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        step_times = [row["perf/step_time"] for row in rows if "perf/step_time" in row][2:]
        t0 = time.perf_counter()
        run(
            GRPOKIT,
            "sft",
            "examples/sft.yaml",
            f"model.name_or_path={model}",
            f"output_dir={work / f'sft-{threads}-{busy}'}",
            f"sft.max_steps={sft_steps}",
            "sft.eval_every=0",
            "data.eval_size=0",
            "logging.tensorboard=false",
            f"threads={threads}",
        )
        sft_s = time.perf_counter() - t0
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return {
        "threads": threads,
        "busy": busy,
        "used": used,
        "step_s": statistics.median(step_times),
        "sft_s": sft_s,
        "load": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="GRPO steps per cell")
    ap.add_argument("--sft-steps", type=int, default=150, help="SFT steps per cell")
    ap.add_argument("--out", type=Path, help="the table (default: benchmarks/results/threads.md)")
    ap.add_argument("--smoke", action="store_true", help="one small cell (see above)")
    args = ap.parse_args()
    global WAIT_S
    cells = [(t, busy) for busy in (False, True) for t in (1, 2, 0)]
    if args.smoke:
        args.steps, args.sft_steps, WAIT_S, cells = 3, 2, 0.0, [(0, False)]
    args.out = (
        args.out or (Path("runs/threads/smoke") if args.smoke else ROOT / "benchmarks/results") / "threads.md"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run(sys.executable, "examples/make_data.py")
        run(sys.executable, "examples/make_tiny_model.py", str(work / "tiny-model"))
        load = os.getloadavg()[0]
        results = [cell(work / "tiny-model", work, t, busy, args.steps, args.sft_steps) for t, busy in cells]
    lines = [
        "# Threads: seconds per step of the README example",
        "",
        f"`.venv/bin/python benchmarks/threads.py --steps {args.steps} --sft-steps {args.sft_steps}` on "
        f"{os.cpu_count()} cores, load average {load:.2f} at the start; each cell waits (up to 150 s) for "
        "the load average to fall below 0.3 first; in the busy cells the spinning process then runs until "
        "the load average reaches 0.9 (as a job that has been running a while) before the cell starts. GRPO: "
        f"median `perf/step_time` of steps 3-{args.steps} of `grpokit train examples/config.yaml` (8 prompts "
        "x G=8, 6 tokens, 0.2M-parameter Llama). SFT: seconds of `grpokit sft examples/sft.yaml "
        f"sft.max_steps={args.sft_steps}` (batch 32), loading included.",
        "",
        "| other busy process | load average before the cell | threads= | threads used (what the run "
        "printed) | GRPO s/step | SFT s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        asked = "0 (auto)" if r["threads"] == 0 else str(r["threads"])
        lines.append(
            f"| {'yes' if r['busy'] else 'no'} | {r['load']:.2f} | {asked} | `{r['used']}` | "
            f"{r['step_s']:.3f} | {r['sft_s']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
