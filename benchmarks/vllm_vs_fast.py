"""rollout.engine=vllm against the built-in fast engine on the demo task: held-out accuracy and s/step.

    .venv/bin/python benchmarks/vllm_vs_fast.py                       # -> benchmarks/results/vllm_vs_fast.md
    .venv/bin/python benchmarks/vllm_vs_fast.py --steps 20 --seeds 0   # a quick look

vLLM's CPU attention kernel takes head sizes 32, 64, 80, ...; the demo's Llama has 4 heads of 48. So the warm
start here (--model; built into runs/vllm_vs_fast/sft when missing) is the demo's Llama with 3 heads of 64: the
same hidden size 192, 4 layers, MLP 512 and so the same 1.78M parameters (q, k, v, o are 192 x 192 whatever the
head count), SFT'd as `grpokit demo` does (20,000 countdown solutions, 900 steps of 64, lr 1e-3). Each seed then
runs GRPO twice with one config (benchmarks/presets.py's: 16 prompts x G=8, 16-token completions, T=1, lr 1e-4)
that differs only in rollout.engine; the two arms of a seed run back to back in alternating order, so a change
of the machine's load hits both. Reported per run: held-out eval/mean@8 and greedy eval/pass@1 on the same
--eval-size test problems before step 1 and after the last step (evaluation runs on the run's engine too), the
median perf/step_time and perf/rollout_time (steps after the first two), and vLLM's mismatch to the trainer
(max over steps of rollout/logp_diff_max).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from presets import K, config_overrides, load_avg  # noqa: E402

ENGINES = ("fast", "vllm")


def make_sft_hd64(out: str, threads: int) -> None:
    """The demo's warm start with 3 attention heads of 64 (vLLM-CPU-compatible), same parameter count."""
    import torch

    from grpokit.config import DataConfig
    from grpokit.data import build_datasets
    from grpokit.sft import train_sft
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(threads)
    task = get_task("countdown")
    tok = build_tokenizer(task, out)
    model = build_tiny_llama(tok, size="demo", num_heads=3, seed=0)
    pairs = build_datasets(DataConfig(task=task.name, task_train_size=20000), tok, seed=0).train
    stats = train_sft(model, tok, pairs, epochs=57600 / 20000, batch_size=64, learning_rate=1e-3, max_length=256, seed=0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"SFT warm start ({sum(p.numel() for p in model.parameters()):,} parameters) saved to {out}: {stats}", flush=True)


def run_arm(args, engine: str, seed: int, eval_rows: list[dict]) -> dict:
    from grpokit.config import load_config
    from grpokit.metrics import read_metrics
    from grpokit.trainer import Trainer

    overrides = [o for o in config_overrides(args, "grpo", seed) if not o.startswith("rollout.engine=")]
    overrides += [f"rollout.engine={engine}", f"output_dir={Path(args.out) / f'{engine}-seed{seed}'}"]
    cfg = load_config(None, overrides)
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    load = load_avg()
    t = time.perf_counter()
    with mock.patch("grpokit.trainer.plot_metrics", lambda *a, **k: []):
        trainer = Trainer(cfg, eval_rows=eval_rows)
        start = time.perf_counter() - t
        trainer.train()
    if hasattr(trainer.engine, "close"):
        trainer.engine.close()
    wall = time.perf_counter() - t
    rows = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    evals = [r for r in rows if r.get("eval/pass@1") is not None]
    med = lambda key: statistics.median([r[key] for r in rows if r.get(key) is not None][2:])  # noqa: E731
    diffs = [r["rollout/logp_diff_max"] for r in rows if r.get("rollout/logp_diff_max") is not None]
    return {"engine": engine, "seed": seed, "before": evals[0], "after": evals[-1], "s_step": med("perf/step_time"),
            "s_rollout": med("perf/rollout_time"), "diff_max": max(diffs) if diffs else float("nan"), "start": start,
            "wall": wall, "load": f"{load} -> {load_avg()}"}


def table(args, results: list[dict]) -> str:
    command = "    .venv/bin/python benchmarks/vllm_vs_fast.py " + " ".join(sys.argv[1:])
    lines = ["# rollout.engine=vllm against fast on the demo task", "", command.rstrip(), "",
             f"warm start {args.model} (demo Llama, 3 heads of 64); {args.steps} GRPO steps of {args.prompts} prompts x "
             f"G={args.G}; {args.eval_size} held-out problems; {args.threads} thread(s); {os.cpu_count()} cores", "",
             f"| engine | seed | mean@{K} before | mean@{K} after | pass@1 before | pass@1 after | s/step | rollout s/step "
             "| max logp diff | engine start s | wall s | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    for r in sorted(results, key=lambda r: (r["engine"], r["seed"])):
        b, a = r["before"], r["after"]
        lines.append(f"| {r['engine']} | {r['seed']} | {pct(b[f'eval/mean@{K}'])} | {pct(a[f'eval/mean@{K}'])} | "
                     f"{pct(b['eval/pass@1'])} | {pct(a['eval/pass@1'])} | {r['s_step']:.3f} | {r['s_rollout']:.3f} | "
                     f"{r['diff_max']:.2g} | {r['start']:.1f} | {r['wall']:.0f} | {r['load']} |")
    for engine in ENGINES:
        mine = [r for r in results if r["engine"] == engine]
        if mine:
            mean = lambda f: statistics.mean(f(r) for r in mine)  # noqa: E731
            lines.append(f"| {engine} mean | | | {pct(mean(lambda r: r['after'][f'eval/mean@{K}']))} | | "
                         f"{pct(mean(lambda r: r['after']['eval/pass@1']))} | {mean(lambda r: r['s_step']):.3f} | "
                         f"{mean(lambda r: r['s_rollout']):.3f} | | | | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/vllm_vs_fast/sft")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/vllm_vs_fast")
    p.add_argument("--results", default=str(HERE / "results" / "vllm_vs_fast.md"))
    args = p.parse_args()
    args.eval_every = args.steps  # before step 1 and after the last only
    import torch

    torch.set_num_threads(args.threads)
    if not Path(args.model).exists():
        t = time.perf_counter()
        make_sft_hd64(args.model, args.threads)
        print(f"warm start built in {time.perf_counter() - t:.0f}s: {args.model}", flush=True)
    from grpokit.tasks import get_task

    eval_rows = get_task("countdown").make_rows("test", args.eval_size, 0)  # the same problems for every run
    results = []
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        for engine in (ENGINES if i % 2 == 0 else ENGINES[::-1]):
            results.append(run_arm(args, engine, seed, eval_rows))
            r = results[-1]
            print(f"{engine} seed {seed}: mean@{K} {r['before'][f'eval/mean@{K}']:.3f} -> {r['after'][f'eval/mean@{K}']:.3f}, "
                  f"{r['s_step']:.3f} s/step, max logp diff {r['diff_max']:.2g}", flush=True)
            Path(args.results).write_text(table(args, results))  # after each run: a partial table survives a stop
    print(table(args, results))


if __name__ == "__main__":
    main()
