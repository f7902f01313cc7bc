"""fp32 against bf16 mixed precision (model.autocast=bfloat16) on the demo task: s/step and held-out accuracy.

    .venv/bin/python benchmarks/precision.py                      # -> benchmarks/results/precision.md
    .venv/bin/python benchmarks/precision.py --steps 40 --seeds 0  # a quick look

From one countdown SFT warm start (--model; built into runs/precision/sft when missing: the demo's
1.78M-parameter Llama, ~2.9 epochs of SFT on 20,000 solutions, as `grpokit demo --model tiny` does), each seed
runs GRPO twice with the same config (benchmarks/presets.py's: 16 prompts x G=8, 16-token completions, T=1,
lr 1e-4, fast engine) but for model.autocast: none (fp32) and bfloat16 (forward passes under torch.autocast,
fp32 weights, gradients and AdamW state). The two arms of a seed run back to back, in alternating order, so a
change of the machine's load hits both. Reported per run: held-out eval/mean@8 and greedy eval/pass@1 on the
same --eval-size test problems before step 1 and after the last step, and the median perf/step_time (steps
after the first two).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from arms import SMOKE_SFT, arm_parser, parse_arm_args  # noqa: E402 (after sys.path gets benchmarks/)
from presets import K, config_overrides, load_avg  # noqa: E402 (after sys.path gets benchmarks/)

ARMS = {"fp32": "none", "bf16": "bfloat16"}


def run_arm(args, arm: str, seed: int, eval_rows: list[dict]) -> dict:
    from grpokit.config import load_config
    from grpokit.metrics.compute import read_metrics
    from grpokit.trainer import Trainer

    overrides = config_overrides(args, "grpo", seed) + [
        f"model.autocast={ARMS[arm]}",
        f"output_dir={Path(args.out) / f'{arm}-seed{seed}'}",
    ]
    cfg = load_config(None, overrides)
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    load = load_avg()
    t = time.perf_counter()
    with mock.patch("grpokit.trainer.plot_run", lambda *a, **k: []):
        Trainer(cfg, eval_rows=eval_rows).train()
    wall = time.perf_counter() - t
    rows = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    evals = [r for r in rows if r.get("eval/pass@1") is not None]
    steps = [r["perf/step_time"] for r in rows if r.get("perf/step_time") is not None][2:]
    return {
        "arm": arm,
        "seed": seed,
        "before": evals[0],
        "after": evals[-1],
        "s_step": statistics.median(steps),
        "wall": wall,
        "load": f"{load} -> {load_avg()}",
    }


def main() -> None:
    p = arm_parser(__doc__, "precision", "runs/precision/sft")
    args = parse_arm_args(p)
    if not Path(args.model).exists():
        from grpo_vs_ppo import make_sft

        t = time.perf_counter()
        sizes = (
            dict(size="test", **SMOKE_SFT)
            if args.smoke
            else dict(size="demo", rows=20000, epochs=57600 / 20000)
        )
        make_sft(args.model, lr=1e-3, seed=0, threads=args.threads, **sizes)
        print(f"warm start built in {time.perf_counter() - t:.0f}s: {args.model}", flush=True)
    from grpokit.tasks import get_task

    eval_rows = get_task("countdown").make_rows("test", args.eval_size, 0)  # the same problems for every run
    results = []
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        for arm in ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32"):
            results.append(run_arm(args, arm, seed, eval_rows))
            r = results[-1]
            print(
                f"{arm} seed {seed}: mean@{K} {r['before'][f'eval/mean@{K}']:.3f} -> "
                f"{r['after'][f'eval/mean@{K}']:.3f}, {r['s_step']:.3f} s/step",
                flush=True,
            )
    command = "    .venv/bin/python benchmarks/precision.py " + " ".join(sys.argv[1:])
    lines = [
        "# fp32 against bf16 mixed precision on the demo task",
        "",
        command.rstrip(),
        "",
        f"warm start {args.model}; {args.steps} GRPO steps of {args.prompts} prompts x G={args.G}; "
        f"{args.eval_size} held-out problems; {args.threads} thread(s); {os.cpu_count()} cores",
        "",
        f"| arm | seed | mean@{K} before | mean@{K} after | pass@1 before | pass@1 after | s/step (median) | "
        "wall s | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(x):
        return f"{100 * x:.1f}"

    for r in sorted(results, key=lambda r: (r["arm"], r["seed"])):
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['arm']} | {r['seed']} | {pct(b[f'eval/mean@{K}'])} | {pct(a[f'eval/mean@{K}'])} | "
            f"{pct(b['eval/pass@1'])} | {pct(a['eval/pass@1'])} | {r['s_step']:.3f} | {r['wall']:.0f} | "
            f"{r['load']} |"
        )
    for arm in ARMS:
        mine = [r for r in results if r["arm"] == arm]
        if mine:
            lines.append(
                f"| {arm} mean | | | {pct(statistics.mean(r['after'][f'eval/mean@{K}'] for r in mine))} | | "
                f"{pct(statistics.mean(r['after']['eval/pass@1'] for r in mine))} | "
                f"{statistics.mean(r['s_step'] for r in mine):.3f} | | |"
            )
    text = "\n".join(lines) + "\n"
    Path(args.results).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
