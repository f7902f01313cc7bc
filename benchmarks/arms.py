"""Arms of one GRPO config on the demo task, side by side: the shared part of vllm_vs_fast.py and
async_lag.py.

An arm is a name and the config overrides that make it differ from presets.py's one config (16 prompts x G=8,
16-token completions, T=1, lr 1e-4); every arm of a seed runs back to back, in alternating order from seed to
seed, so that a change of the machine's load hits each. Reported per run: held-out eval/mean@8 and greedy
eval/pass@1 on the same problems before step 1 and after the last step, the median perf/step_time and
perf/rollout_time (steps after the first two), and the max over steps of rollout/logp_diff_max.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

from presets import K, config_overrides, load_avg

#: --smoke: the sizes of one tiny run per arm (they replace the flags' values), on a warm start of a few SFT
#: steps that the script builds in OUT/smoke-sft (unless --model)
SMOKE = dict(seeds="0", steps=3, prompts=2, G=2, max_completion_length=8, eval_size=4)
#: --smoke: the warm start's SFT, one step of 64 rows
SMOKE_SFT = dict(rows=64, epochs=1.0)


def arm_parser(doc: str, name: str, model: str):
    """The command line every arms benchmark takes (presets.py's config knobs); --out runs/<name>, --results
    benchmarks/results/<name>.md (--smoke: runs/<name>/smoke and OUT/<name>.md). args.eval_every is set after
    parsing: before step 1 and after the last."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(bench=name, warm_start=model)
    p.add_argument("--model", help=f"the warm start (default: {model}; --smoke: OUT/smoke-sft, built)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--mu", type=int, default=1, help="algorithm.num_iterations")
    p.add_argument("--minibatches", type=int, default=1, help="optim.num_minibatches")
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help=f"run folders (default: runs/{name}; --smoke: runs/{name}/smoke)")
    p.add_argument(
        "--results", help=f"the table (default: benchmarks/results/{name}.md; --smoke: OUT/{name}.md)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny run per arm (1 seed, 3 steps of 2 prompts x G=2, 8 tokens, 4 held-out problems) on a "
        "warm start of a few SFT steps: a check that the benchmark runs; the table goes to OUT",
    )
    return p


def parse_arm_args(p):
    """p's arguments, with args.eval_every = args.steps (evaluate before step 1 and after the last only) and
    torch set to --threads threads; --smoke sets the SMOKE sizes."""
    import torch

    args = p.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.out = args.out or f"runs/{args.bench}" + ("/smoke" if args.smoke else "")
    args.model = args.model or (f"{args.out}/smoke-sft" if args.smoke else args.warm_start)
    if not args.results:
        results = Path(args.out) if args.smoke else Path(__file__).resolve().parent / "results"
        args.results = str(results / f"{args.bench}.md")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    args.eval_every = args.steps
    torch.set_num_threads(args.threads)
    return args


def run_arm(
    args, arm: str, extra: list[str], seed: int, eval_rows: list[dict], keys: tuple[str, ...] = ()
) -> dict:
    """One GRPO run; `keys`: more metrics to report, as their median over steps (after the first two)."""
    from grpokit.config import load_config
    from grpokit.metrics.compute import read_metrics
    from grpokit.trainer import Trainer

    overrides = [o for o in config_overrides(args, "grpo", seed) if not o.startswith("rollout.engine=")]
    overrides += [*extra, f"output_dir={Path(args.out) / f'{arm}-seed{seed}'}"]
    cfg = load_config(None, overrides)
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    load = load_avg()
    t = time.perf_counter()
    with mock.patch("grpokit.trainer.plot_run", lambda *a, **k: []):
        trainer = Trainer(cfg, eval_rows=eval_rows)
        start = time.perf_counter() - t
        trainer.train()  # closes its engine at the end
    wall = time.perf_counter() - t
    rows = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    evals = [r for r in rows if r.get("eval/pass@1") is not None]

    def med(key):
        return statistics.median([r[key] for r in rows if r.get(key) is not None][2:] or [float("nan")])

    diffs = [r["rollout/logp_diff_max"] for r in rows if r.get("rollout/logp_diff_max") is not None]
    return {
        "arm": arm,
        "seed": seed,
        "before": evals[0],
        "after": evals[-1],
        "s_step": med("perf/step_time"),
        "s_rollout": med("perf/rollout_time"),
        "diff_max": max(diffs) if diffs else float("nan"),
        "start": start,
        "wall": wall,
        "load": f"{load} -> {load_avg()}",
        **{k: med(k) for k in keys},
    }


def table(
    script: str, title: str, setup: str, arms: list[str], results: list[dict], keys: tuple[str, ...] = ()
) -> str:
    command = f"    .venv/bin/python benchmarks/{script} " + " ".join(sys.argv[1:])
    extra_head = "".join(f" {k} |" for k in keys)
    lines = [
        f"# {title}",
        "",
        command.rstrip(),
        "",
        f"{setup}; {os.cpu_count()} cores",
        "",
        f"| arm | seed | mean@{K} before | mean@{K} after | pass@1 before | pass@1 after | s/step | rollout "
        f"s/step | max logp diff |{extra_head} start s | wall s | load |",
        "|---" * (12 + len(keys)) + "|",
    ]

    def pct(x):
        return f"{100 * x:.1f}"

    for r in sorted(results, key=lambda r: (arms.index(r["arm"]), r["seed"])):
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['arm']} | {r['seed']} | {pct(b[f'eval/mean@{K}'])} | {pct(a[f'eval/mean@{K}'])} | "
            f"{pct(b['eval/pass@1'])} | {pct(a['eval/pass@1'])} | {r['s_step']:.3f} | {r['s_rollout']:.3f} | "
            f"{r['diff_max']:.2g} |"
            + "".join(f" {r[k]:.3g} |" for k in keys)
            + f" {r['start']:.1f} | {r['wall']:.0f} | {r['load']} |"
        )
    for arm in arms:
        mine = [r for r in results if r["arm"] == arm]
        if mine:

            def mean(f, mine=mine):
                return statistics.mean(f(r) for r in mine)

            lines.append(
                f"| {arm} mean | | | {pct(mean(lambda r: r['after'][f'eval/mean@{K}']))} | | "
                f"{pct(mean(lambda r: r['after']['eval/pass@1']))} | {mean(lambda r: r['s_step']):.3f} | "
                f"{mean(lambda r: r['s_rollout']):.3f} | |" + " |" * len(keys) + " | | |"
            )
    return "\n".join(lines) + "\n"


def run_all(
    args, arms: dict[str, list[str]], script: str, title: str, setup: str, keys: tuple[str, ...] = ()
) -> None:
    """Every arm for every seed of --seeds; the table goes to --results after each run (a stop keeps a partial
    one)."""
    from grpokit.tasks import get_task

    eval_rows = get_task("countdown").make_rows("test", args.eval_size, 0)  # the same problems for every run
    names, results = list(arms), []
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        for arm in names if i % 2 == 0 else names[::-1]:
            results.append(run_arm(args, arm, arms[arm], seed, eval_rows, keys))
            r = results[-1]
            print(
                f"{arm} seed {seed}: mean@{K} {r['before'][f'eval/mean@{K}']:.3f} -> "
                f"{r['after'][f'eval/mean@{K}']:.3f}, {r['s_step']:.3f} s/step",
                flush=True,
            )
            Path(args.results).write_text(table(script, title, setup, names, results, keys))
    print(table(script, title, setup, names, results, keys))
