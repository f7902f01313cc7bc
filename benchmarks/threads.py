"""Seconds per step of the README example at 1 and 2 threads (and auto), idle and with one other busy process.

    .venv/bin/python benchmarks/threads.py                  # -> benchmarks/results/threads.md (and stdout)
    .venv/bin/python benchmarks/threads.py --steps 60 --sft-steps 200

Each cell is a fresh `grpokit train examples/config.yaml` (the README's GRPO example on the tiny model from
examples/make_tiny_model.py, no evaluation, no checkpoints) with `threads=N`: the median perf/step_time
of its steps after the first two, plus the seconds of a `grpokit sft examples/sft.yaml` run of --sft-steps
steps. "busy" runs one other process spinning on a core (python -c 'while True: pass') for the whole cell,
which is what a shared machine looks like. "just stopped" runs auto right after such a process has spun
until the 1-minute load average shows it and then ended: the cores are free, the load average still says
busy. Before each cell the table records the load average and the CPU use of the other processes as auto
measures it (grpokit.config.threads.busy_cores, over a second). docs/threads.md explains the numbers.

--smoke: one cell (threads=0, no other process), 3 GRPO steps and 2 SFT steps, the table in
runs/threads/smoke/threads.md: a check that the benchmark runs.
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

from grpokit.config.threads import busy_cores

ROOT = Path(__file__).resolve().parents[1]
GRPOKIT = str(Path(sys.executable).with_name("grpokit"))


def run(*cmd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the cell's threads= decides
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return r


def spin_until_counted(at_most: float = 150.0) -> None:
    """Run one spinning process until the 1-minute load average shows it (>= 0.9 more than when it started, at
    most `at_most` seconds), then end it: a job that ran a while and has just stopped."""
    load0, t0 = os.getloadavg()[0], time.monotonic()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    while os.getloadavg()[0] < load0 + 0.9 and time.monotonic() - t0 < at_most:
        time.sleep(5)
    spinner.kill()
    spinner.wait()


def cell(model: Path, work: Path, threads: int, other: str, steps: int, sft_steps: int) -> dict:
    if other == "just stopped":
        spin_until_counted()
    load, busy = os.getloadavg()[0], busy_cores(1.0)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if other == "yes" else None
    try:
        out = work / f"train-{threads}-{other}"
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
            f"output_dir={work / f'sft-{threads}-{other}'}",
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
        "other": other,
        "used": used,
        "step_s": statistics.median(step_times),
        "sft_s": sft_s,
        "load": load,
        "busy": busy,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="GRPO steps per cell")
    ap.add_argument("--sft-steps", type=int, default=150, help="SFT steps per cell")
    ap.add_argument("--out", type=Path, help="the table (default: benchmarks/results/threads.md)")
    ap.add_argument("--smoke", action="store_true", help="one small cell (see above)")
    args = ap.parse_args()
    cells = [(t, other) for other in ("no", "yes") for t in (1, 2, 0)] + [(0, "just stopped")]
    if args.smoke:
        args.steps, args.sft_steps, cells = 3, 2, [(0, "no")]
    args.out = (
        args.out or (Path("runs/threads/smoke") if args.smoke else ROOT / "benchmarks/results") / "threads.md"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run(sys.executable, "examples/make_data.py")
        run(sys.executable, "examples/make_tiny_model.py", str(work / "tiny-model"))
        load = os.getloadavg()[0]
        results = [
            cell(work / "tiny-model", work, t, other, args.steps, args.sft_steps) for t, other in cells
        ]
    lines = [
        "# Threads: seconds per step of the README example",
        "",
        f"`.venv/bin/python benchmarks/threads.py --steps {args.steps} --sft-steps {args.sft_steps}` on "
        f"{os.cpu_count()} cores, shared with other jobs (their CPU use is the third column), load average "
        f"{load:.2f} at the start. yes: one more process spinning on a core for the whole cell. just "
        "stopped: auto right after such a process spun until the load average showed it and ended. GRPO: "
        f"median `perf/step_time` of steps 3-{args.steps} of `grpokit train examples/config.yaml` (8 prompts "
        "x G=8, 6 tokens, 0.2M-parameter Llama). SFT: seconds of `grpokit sft examples/sft.yaml "
        f"sft.max_steps={args.sft_steps}` (batch 32), loading included.",
        "",
        "| a spinning process | load average before the cell | other processes' CPU use before the cell "
        "(cores) | threads= | threads used (what the run printed) | GRPO s/step | SFT s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        asked = "0 (auto)" if r["threads"] == 0 else str(r["threads"])
        busy = "unknown" if r["busy"] is None else f"{r['busy']:.2f}"
        lines.append(
            f"| {r['other']} | {r['load']:.2f} | {busy} | {asked} | `{r['used']}` | "
            f"{r['step_s']:.3f} | {r['sft_s']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
