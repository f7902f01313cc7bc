"""The sampler's truncation on SmolLM2-135M-Instruct (vocabulary 49,152): the gap replaying it closes, and
what the kept sets cost.

    .venv/bin/python benchmarks/truncation.py            # top_k=20 top_p=0.9, and top_p=0.9 alone
    .venv/bin/python benchmarks/truncation.py --smoke    # a tiny random Llama over SmolLM2's tokenizer

Per setting: the fast engine samples 4 chat prompts x G=4, 32 tokens, temperature 1, fp32, recording the kept
sets (SamplingParams.record_kept). Over the completion tokens, against the engine's own sampling log-probs
(those of the distribution it drew from):
- before: completion_logprobs without the kept sets (the full distribution: what the trainer computed until
  now), mean and min of (trainer - sampler) = the log of the kept mass;
- after: completion_logprobs with them (rollout.replay_truncation), max |trainer - sampler|;
- the kept sets' size: tokens kept a step (mean, max), ids stored a token (W of the batch, the dropped ids
  when more than half is kept) and the [N, T, W] int32 tensor's bytes per completion token.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace

import torch
from decode_real import chat_prompts, load  # benchmarks/decode_real.py: SmolLM2 and its chat prompts


def measure(model, tok, prompts, sampling, G: int) -> dict[str, float]:
    from grpokit.algo.truncation import kept_mask
    from grpokit.data.batch import pack_sequences
    from grpokit.policy import completion_logprobs
    from grpokit.rollout.fast import FastEngine

    torch.manual_seed(0)
    out = FastEngine(model, tok).generate(prompts, G, sampling)
    batch = pack_sequences([p for p in prompts for _ in range(G)], out.token_ids, tok.pad_token_id, out.kept)
    mask = batch.completion_mask.bool()
    sampler = torch.zeros(mask.shape)
    for i, lp in enumerate(out.logprobs):
        sampler[i, : len(lp)] = torch.tensor(lp)
    with torch.no_grad():
        after, _ = completion_logprobs(model, batch, temperature=sampling.temperature)
        before, _ = completion_logprobs(model, replace(batch, kept=None), temperature=sampling.temperature)
    gap = (before - sampler)[mask]
    assert batch.kept is not None
    sizes = kept_mask(batch.kept, model.config.vocab_size)[mask].sum(-1).float()
    return {
        "tokens": float(mask.sum()),
        "before_mean": float(gap.mean()),
        "before_min": float(gap.min()),
        "after_max": float((after - sampler)[mask].abs().max()),
        "kept_mean": float(sizes.mean()),
        "kept_max": float(sizes.max()),
        "W": float(batch.kept.shape[-1]),
        "bytes_per_token": batch.kept.numel() * 4 / float(mask.sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="a tiny random Llama over SmolLM2's tokenizer")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from grpokit.rollout.base import SamplingParams

    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv))
    model, tok = load(args.smoke)
    model.eval()
    prompts = chat_prompts(tok, 4)
    print(
        "\n| top_k | top_p | tokens | before: mean log(kept mass) | before: min | after: max abs diff "
        "| kept a step (mean / max) | W | kept-set bytes / token |\n|---|---|---|---|---|---|---|---|---|"
    )
    for top_k, top_p in [(20, 0.9), (0, 0.9)]:
        sampling = SamplingParams(max_tokens=args.tokens, top_k=top_k, top_p=top_p, record_kept=True)
        m = measure(model, tok, prompts, sampling, args.G)
        print(
            f"| {top_k} | {top_p} | {m['tokens']:.0f} | {m['before_mean']:.4f} | {m['before_min']:.4f} | "
            f"{m['after_max']:.1e} | {m['kept_mean']:.1f} / {m['kept_max']:.0f} | {m['W']:.0f} | "
            f"{m['bytes_per_token']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
