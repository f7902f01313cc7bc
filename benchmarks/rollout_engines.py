"""Rollout throughput: transformers' `generate` (rollout.engine=hf) against the built-in fast engine.

    python benchmarks/rollout_engines.py                 # all cases, 5 runs each, CPU, 1 thread
    python benchmarks/rollout_engines.py --cases tiny --runs 3 --threads 4 --device cuda

Models are randomly initialized Llamas over the countdown task's character tokenizer (vocabulary 23),
prompts are countdown prompts (ragged, left-padded). A random model says EOS with probability about
1/23 per token, so completions end at varied lengths, as in a real rollout; the "mean len" column
shows it. tokens/s counts completion tokens returned (EOS included, padding not), per wall-clock
second of `engine.generate`; the engines take turns, each with the same seed before every run; the
table shows the median of --runs runs after one warm-up run, and the ratio fast / hf of the medians.
One thread by default: on a CPU shared with other jobs, intra-op threads mostly wait on each other
(2 threads on 2 busy cores measured ~10x slower than 1).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

from grpokit.rollout.base import SamplingParams
from grpokit.rollout.fast import FastEngine
from grpokit.rollout.hf import HFEngine
from grpokit.tasks import get_task
from grpokit.tasks.tiny_model import build_tiny_llama
from grpokit.tasks.tokenizer import build_tokenizer

#: name -> (model shape, prompts, G, max new tokens)
CASES = {
    "tiny": (dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512), 16, 8, 8),
    "demo": (dict(size="demo"), 16, 8, 16),
    "25m": (dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1408), 16, 8, 64),
}


def time_engines(engines: dict, prompts, G, sampling, runs: int, seed: int) -> dict[str, tuple[float, float]]:
    """name -> (median tokens/s, mean completion length) over `runs` timed runs after one warm-up.

    The engines take turns run by run, so a load change on a shared machine hits both alike.
    """
    rates = {name: [] for name in engines}
    lengths = {name: [] for name in engines}
    for r in range(runs + 1):
        for name, engine in engines.items():
            torch.manual_seed(seed + r)
            t = time.perf_counter()
            comps = engine.generate(prompts, G, sampling)
            dt = time.perf_counter() - t
            n_tokens = sum(len(c) for c in comps.token_ids)
            if r:  # run 0 warms up allocators and kernels
                rates[name].append(n_tokens / dt)
                lengths[name].append(n_tokens / len(comps))
    return {name: (statistics.median(rates[name]), statistics.mean(lengths[name])) for name in engines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--smoke", action="store_true", help="the tiny case, one timed run: a check that the benchmark runs"
    )
    args = ap.parse_args()
    if args.smoke:
        args.cases, args.runs = ["tiny"], 1
    torch.set_num_threads(args.threads)

    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(
        f"torch {torch.__version__}, device {args.device}, {args.threads} threads, temperature "
        f"{args.temperature}\n",
        flush=True,
    )
    task = get_task("countdown")
    tok = build_tokenizer(task)
    prompts_all = [tok(r["prompt"])["input_ids"] for r in task.make_rows("train", 64, seed=args.seed)]
    header = (
        f"| {'case':<5} | {'params':>6} | {'prompts x G':>11} | {'max new':>7} | {'mean len':>8} | "
        f"{'hf tok/s':>9} | {'fast tok/s':>10} | {'fast/hf':>7} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name in args.cases:
        shape, n_prompts, G, max_tokens = CASES[name]
        model = build_tiny_llama(tok, **shape, seed=args.seed).to(args.device)
        params = sum(p.numel() for p in model.parameters())
        prompts = prompts_all[:n_prompts]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=args.temperature)
        engines = {"hf": HFEngine(model, tok), "fast": FastEngine(model, tok)}
        res = time_engines(engines, prompts, G, sampling, args.runs, args.seed)
        (hf_rate, _), (fast_rate, mean_len) = res["hf"], res["fast"]
        print(
            f"| {name:<5} | {params / 1e6:>5.1f}M | {f'{n_prompts} x {G}':>11} | {max_tokens:>7} | "
            f"{mean_len:>8.1f} | {hf_rate:>9.0f} | {fast_rate:>10.0f} | {fast_rate / hf_rate:>6.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
