"""Peak memory and time of one training pass of the log-probs at a real vocabulary: plain against fused.

    .venv/bin/python benchmarks/fused_logprobs.py                      # ->
                                                                       # benchmarks/results/fused_logprobs.md
    .venv/bin/python benchmarks/fused_logprobs.py --lengths 256 --rows 4

One pass = grpokit.policy.completion_logprobs on N rows (one prompt of 16 tokens, completions of T tokens)
and the backward of their sum, on a random Llama body (hidden 256, 2 layers, about 2M parameters besides
the embeddings) with Qwen2.5's vocabulary of 151,936 tokens (untied head), fp32, CPU. `plain` computes
the logits [N, T, V] (fused=False); `fused` applies the LM head in chunks from the hidden states
(grpokit/algo/fused.py). Each cell runs in a fresh process, so its peak RSS (ru_maxrss) is its own; the
model's weights and their gradients (about 0.6 GB together at this vocabulary) are in both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CELL = r"""
import json, resource, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from grpokit.data.batch import pack_sequences
from grpokit.policy import completion_logprobs

rows, T, V, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
fused = mode.startswith("fused")
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[5]))
cfg = LlamaConfig(vocab_size=V, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=T + 64,
                  tie_word_embeddings=False)
model = LlamaForCausalLM(cfg).train()
if mode.endswith("bf16"):  # model.autocast=bfloat16: fp32 weights, bf16 matmuls
    from grpokit.policy import enable_autocast
    enable_autocast(model, torch.bfloat16)
g = torch.Generator().manual_seed(1)
batch = pack_sequences([torch.randint(0, V, (16,), generator=g).tolist()] * rows,
                       [torch.randint(0, V, (T,), generator=g).tolist() for _ in range(rows)], pad_id=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
logp, _ = completion_logprobs(model, batch, fused=fused, share_prompts=False)
(logp * batch.completion_mask).sum().backward()
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_gb": peak / 2**20, "before_gb": before / 2**20, "seconds": seconds,
                  "logp_sum": float(logp.sum()), "head_grad_norm": float(model.lm_head.weight.grad.norm())}))
"""


def cell(rows: int, T: int, V: int, mode: str, threads: int) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CELL, str(rows), str(T), str(V), mode, str(threads)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": "out of memory (killed)" if r.returncode in (-9, 137) else tail[:120]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="also the fused path under model.autocast=bfloat16")
    ap.add_argument(
        "--out",
        help="the table (default: benchmarks/results/fused_logprobs.md; --smoke: runs/fused_logprobs/smoke)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest cells (2 rows, T=8, a 4,096-token vocabulary, --bf16 too): a check that the "
        "benchmark runs; the table goes to runs/fused_logprobs/smoke/fused_logprobs.md",
    )
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.lengths, args.vocab, args.bf16 = 2, [8], 4096, True
    default = Path("runs/fused_logprobs/smoke") if args.smoke else ROOT / "benchmarks/results"
    args.out = args.out or str(default / "fused_logprobs.md")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    command = "  .venv/bin/python benchmarks/fused_logprobs.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Log-probs at V = {args.vocab}: plain against fused, one training pass",
        "",
        command.strip(),
        "",
        f"load average at start: {os.getloadavg()[0]:.2f}; {args.threads} threads; N = {args.rows} rows; "
        f"logits [N, T, V] in fp32 would be N*T*V*4 bytes",
        "",
        "| T | logits [N,T,V] fp32 | plain peak RSS | fused peak RSS | plain s | fused s | fused/plain time |"
        " same log-probs | same head grad |" + (" fused bf16 s | fused bf16 peak RSS |" if args.bf16 else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.bf16 else ""),
    ]
    for T in args.lengths:
        plain, fused = (cell(args.rows, T, args.vocab, mode, args.threads) for mode in ("plain", "fused"))
        logits_gb = args.rows * T * args.vocab * 4 / 2**30
        if "error" in plain or "error" in fused:
            row = [
                T,
                f"{logits_gb:.2f} GB",
                plain.get("error") or f"{plain['peak_gb']:.2f} GB",
                fused.get("error") or f"{fused['peak_gb']:.2f} GB",
                "-",
                "-",
                "-",
                "-",
                "-",
            ]
        else:
            same = abs(plain["logp_sum"] - fused["logp_sum"]) <= 1e-5 * abs(plain["logp_sum"])
            same_g = abs(plain["head_grad_norm"] - fused["head_grad_norm"]) <= 1e-4 * plain["head_grad_norm"]
            row = [
                T,
                f"{logits_gb:.2f} GB",
                f"{plain['peak_gb']:.2f} GB",
                f"{fused['peak_gb']:.2f} GB",
                f"{plain['seconds']:.1f}",
                f"{fused['seconds']:.1f}",
                f"{fused['seconds'] / plain['seconds']:.2f}",
                "yes" if same else "NO",
                "yes" if same_g else "NO",
            ]
        if args.bf16:
            bf = cell(args.rows, T, args.vocab, "fused-bf16", args.threads)
            row += [bf.get("error") or f"{bf['seconds']:.1f}", bf.get("error") or f"{bf['peak_gb']:.2f} GB"]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
