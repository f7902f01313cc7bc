"""Activation memory of one long packed row at sequence parallelism 1 and 2 (grpokit/distributed/sequence.py):

    .venv/bin/python benchmarks/sequence_parallel.py --tokens 4096 \
        --out benchmarks/results/sequence_parallel.md

One process runs the row's padding-free training pass (completion_logprobs(padding_free=True)); then torchrun
starts 2 gloo ranks on CPU that run the same row with its tokens split over them (sequence_parallel_logprobs).
Activation memory is what autograd saves for the backward during the forward: every tensor handed to
saved_tensors_hooks, each storage counted once, the parameters left out (they are held either way); the
[.., L, L] tensors (the attention masks) are counted apart too. It does not depend on the machine's load or
allocator, unlike a peak RSS. The two runs' log-probs are compared too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from grpokit.data.batch import pack_sequences
from grpokit.policy import completion_logprobs

MODEL = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)


def model_and_batch(tokens: int, sequences: int = 8):
    """A tiny Llama (seeded) and `sequences` packed sequences, tokens / sequences each (a quarter prompt)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="sdpa"))
    each = tokens // sequences
    ids = torch.randint(1, MODEL["vocab_size"], (sequences, each)).tolist()
    return model, pack_sequences([s[: each // 4] for s in ids], [s[each // 4 :] for s in ids], pad_id=0)


def saved_bytes(model, run, length: int) -> tuple[tuple[int, int], object]:
    """Bytes autograd saves for the backward while `run()` runs (each storage once, parameters left out), and
    of those the [.., length, length] attention tensors'."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            square = t.dim() >= 2 and t.shape[-1] == t.shape[-2] == length
            seen[storage.data_ptr()] = (storage.nbytes(), square)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return (sum(b for b, _ in seen.values()), sum(b for b, sq in seen.values() if sq)), out


def one_process(tokens: int, segments: bool) -> tuple[tuple[int, int], torch.Tensor]:
    """The row in one process: with transformers' sdpa on its block-causal mask, or (`segments`) with
    grpokit_sdpa, as a padding-free run switches it (grpokit/policy/attention.py)."""
    from grpokit.policy.attention import use_segment_attention

    model, batch = model_and_batch(tokens)
    if segments:
        use_segment_attention(model)
    run = lambda: completion_logprobs(model, batch, padding_free=True)  # noqa: E731
    nbytes, (logp, _) = saved_bytes(model, run, tokens)
    return nbytes, logp.detach()


def rank_main(tokens: int, out: str) -> None:
    """One of the torchrun ranks: the row over the sequence ranks; rank 0 saves every rank's numbers."""
    from grpokit.distributed.sequence import SequenceGroup, enable, sequence_parallel_logprobs

    dist.init_process_group("gloo")
    sp = SequenceGroup.from_group()
    model, batch = model_and_batch(tokens)
    enable(model)
    run = lambda: sequence_parallel_logprobs(model, batch, sp)  # noqa: E731
    nbytes, (logp, _) = saved_bytes(model, run, tokens)
    logp.sum().backward()  # the backward runs (its all-to-alls pair up)
    everyone: list = [None] * sp.size
    dist.all_gather_object(everyone, nbytes)
    if sp.rank == 0:
        torch.save({"bytes": everyone, "logp": logp.detach()}, out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here (default: stdout only)")
    ap.add_argument("--smoke", action="store_true", help="a 64-token row: a check that the benchmark runs")
    ap.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)  # set when torchrun runs this file
    args = ap.parse_args()
    if args.rank_out:
        return rank_main(args.tokens, args.rank_out)
    if args.smoke:
        args.tokens, args.out = 64, None
    masked, logp_masked = one_process(args.tokens, segments=False)
    one, logp = one_process(args.tokens, segments=True)
    rank_out = Path(os.environ.get("TMPDIR", "/tmp")) / f"sequence_parallel_{os.getpid()}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    subprocess.run([*cmd, "--tokens", str(args.tokens), "--rank-out", str(rank_out)], env=env, check=True)
    two = torch.load(rank_out)
    rank_out.unlink()
    diff = (two["logp"] - logp).abs().max().item()
    diff_masked = (logp_masked - logp).abs().max().item()
    lines = [
        "# Sequence parallelism: activation memory of one packed row per rank",
        "",
        f"    .venv/bin/python benchmarks/sequence_parallel.py --tokens {args.tokens}"
        + (f" --out {args.out}" if args.out else ""),
        "",
        f"Tiny Llama {MODEL}; one row of {args.tokens} tokens (8 packed sequences); the training pass's "
        "activations (bytes autograd saves for the backward, parameters left out). CPU, gloo, sdpa.",
        "",
        "| sequence ranks | tokens per rank | activations per rank | against one rank | of which [.., L, L] "
        "masks | other activations | other against one rank |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {n} | {b / 2**20:.1f} MiB | {b / one[0]:.2f} | {sq / 2**20:.1f} MiB | "
            f"{(b - sq) / 2**20:.1f} MiB | {(b - sq) / (one[0] - one[1]):.2f} |"
            for name, n, (b, sq) in [
                ("1, transformers' sdpa on its packed-sequence mask", args.tokens, masked),
                ("1, grpokit_sdpa (one call a sequence)", args.tokens, one),
                *((f"2 (rank {r})", args.tokens // 2, two_r) for r, two_r in enumerate(two["bytes"])),
            ]
        ),
        "",
        "transformers' sdpa keeps its packed-sequence mask once a layer (4 L^2 bytes each). grpokit_sdpa, "
        "what padding-free runs use, and the sequence ranks' attention run each packed sequence in a causal "
        "sdpa call of its own and keep none; the sequence ranks split everything else (x 0.50 at N = 2). The "
        "'against one rank' columns divide by the grpokit_sdpa row.",
        "",
        f"Largest log-prob difference: two sequence ranks against one process {diff:.1e}; grpokit_sdpa "
        f"against transformers' sdpa {diff_masked:.1e}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if diff > 1e-5:
        sys.exit(f"the sequence ranks' log-probs differ from one process's by {diff:.1e}")


if __name__ == "__main__":
    main()
