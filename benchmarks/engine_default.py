"""The README example (`grpokit train examples/config.yaml`) with rollout.engine=hf (the old default) and
with the default, auto (on a machine without a GPU: the built-in fast engine): seconds per step, rollout
seconds per step and the held-out metrics, one process after the other on the same machine.

    .venv/bin/python benchmarks/engine_default.py [--steps 10] [--threads 2] [--out DIR] [--smoke]

Builds the example's data and tiny model as the README does (examples/make_data.py, make_tiny_model.py), then
runs `grpokit train examples/config.yaml` with model.name_or_path at that model, optim.max_steps=--steps and
eval.every=--steps, once per engine. Step times are the mean of perf/step_time over the steps after the first
(which holds one-off start-up costs); the ratio is hf / auto from the same invocation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"hf": ["rollout.engine=hf"], "auto (default)": []}


def run(out: Path, model: Path, name: str, extra: list[str], steps: int, threads: int) -> dict:
    run_dir = out / name.split()[0]
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "grpokit.cli",
        "train",
        str(ROOT / "examples/config.yaml"),
        f"model.name_or_path={model}",
        f"optim.max_steps={steps}",
        f"eval.every={steps}",
        f"threads={threads}",
        "checkpoint.save_every=0",
        f"output_dir={run_dir}",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
    chose = next((line for line in proc.stdout.splitlines() if line.startswith("rollout.engine=")), "")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "perf/step_time" in r][1:]
    evals = [r for r in rows if "eval/pass@1" in r]
    return {
        "step_s": mean(r["perf/step_time"] for r in steps_rows),
        "rollout_s": mean(r["perf/rollout_time"] for r in steps_rows),
        "pass1": evals[-1]["eval/pass@1"] if evals else float("nan"),
        "chose": chose,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/engine_default")
    parser.add_argument("--smoke", action="store_true", help="2 steps, 1 thread, in ./runs (the tests)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.threads, args.out = 2, 1, Path("runs/engine_default").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "tiny-model"
    if not (ROOT / "examples/prompts.jsonl").exists():  # the README's first step; the file ships with grpokit
        subprocess.run([sys.executable, "examples/make_data.py"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(
        [sys.executable, "examples/make_tiny_model.py", str(model)], cwd=ROOT, check=True, capture_output=True
    )
    results = {
        name: run(args.out, model, name, extra, args.steps, args.threads) for name, extra in ENGINES.items()
    }
    command = "python benchmarks/engine_default.py " + " ".join(
        f"--{k} {v}" for k, v in (("steps", args.steps), ("threads", args.threads))
    )
    print(
        f"The README example, {args.steps} steps of 8 prompts x G=8, {args.threads} threads\n"
        f"command: {command}\n"
    )
    print("| rollout.engine | s / step (steps 2..N) | rollout s / step | held-out pass@1 at the end |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['step_s']:.3f} | {r['rollout_s']:.3f} | {r['pass1']:.3f} |")
    hf, auto = results["hf"], results["auto (default)"]
    print(f"\nauto's line: `{auto['chose']}`")
    print(
        f"hf / auto: {hf['step_s'] / auto['step_s']:.2f}x per step, "
        f"{hf['rollout_s'] / auto['rollout_s']:.2f}x per rollout"
    )


if __name__ == "__main__":
    main()
