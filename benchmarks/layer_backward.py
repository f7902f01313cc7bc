"""The peak of one checkpointed decoder layer's recomputation and backward, per token, against the memory
plan's line "a layer recomputed, and its gradients" (grpokit/policy/plan.py, _layer_backward_bytes).

    .venv/bin/python benchmarks/layer_backward.py --out benchmarks/results/layer_backward.md
    .venv/bin/python benchmarks/layer_backward.py --smoke    # 64 tokens: does it run

One Llama decoder layer of each shape (the memory-plan grid's tiny Llama; SmolLM2-135M's layer, 9 heads over 3
KV heads), random weights, fp32 on the CPU, sdpa attention over one causal row of T tokens. The layer runs
under torch.utils.checkpoint (non-reentrant, as the trainer's gradient checkpointing), then backward from a
gradient of ones. Measured: torch's profiler with profile_memory, every allocation and free of the forward and
backward in order; the most bytes live at once above the start (the layer's input and weights were there
before), divided by T. That is the tensors' peak, without what the allocator keeps (the plan counts tensors).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM

#: name -> (hidden, MLP width, heads, KV heads)
SHAPES = {"tiny Llama (grid)": (256, 1024, 4, 4), "SmolLM2-135M": (576, 1536, 9, 3)}


def peak_per_token(hidden: int, intermediate: int, heads: int, kv_heads: int, tokens: int) -> float:
    """Bytes a token at the peak of the layer's checkpointed forward, recomputation and backward."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=tokens + 1,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    layer = model.model.layers[0]
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rotary = model.model.rotary_emb(x, positions)

    def run() -> torch.Tensor:
        out = checkpoint(layer, x, position_embeddings=rotary, position_ids=positions, use_reentrant=False)
        return out[0] if isinstance(out, tuple) else out

    out = run()  # once before, so that nothing allocated once (kernels' buffers) is counted
    out.backward(torch.ones_like(out))
    x.grad = None
    layer.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run()
        out.backward(torch.ones_like(out))
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak / tokens


def planned(hidden: int, intermediate: int, heads: int, kv_heads: int) -> int:
    from grpokit.policy.plan import Shapes, _layer_backward_bytes

    shapes = Shapes(
        params=0, trained=0, hidden=hidden, intermediate=intermediate, layers=1, kv_heads=kv_heads,
        head_dim=hidden // heads, vocab=64, element_size=4, heads=heads,
    )  # fmt: skip
    return _layer_backward_bytes(shapes, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4160,16448", help="tokens T, comma-separated")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ap.add_argument("--smoke", action="store_true", help="64 tokens only, the table printed")
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.out = "64", None
    lines = [
        "# A checkpointed decoder layer's recomputation and backward: its peak per token, and the plan's",
        "",
        f"    python benchmarks/layer_backward.py {' '.join(sys.argv[1:])}".rstrip(),
        "",
        "| layer | hidden | MLP | heads / KV heads | T | measured B a token | plan B a token | plan error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, shape in SHAPES.items():
        plan = planned(*shape)
        for tokens in (int(t) for t in args.lengths.split(",")):
            measured = peak_per_token(*shape, tokens)
            lines.append(
                f"| {name} | {shape[0]} | {shape[1]} | {shape[2]} / {shape[3]} | {tokens} | "
                f"{measured:,.0f} | {plan:,} | {100 * (plan / measured - 1):+.1f}% |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
