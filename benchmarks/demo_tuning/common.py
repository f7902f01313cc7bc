"""Shared helpers of the demo-tuning experiments: batched eval with HF generate.

pass@1: greedy, one completion per problem. pass@8: 8 samples at temperature 1.0, solved when
any one is correct. Prompts are left-padded with an attention mask (generate derives the
position ids from it).
"""
from __future__ import annotations

import time

import torch


@torch.no_grad()
def generate(model, tok, prompts, *, n=1, greedy=True, temperature=1.0, max_new_tokens=24, batch_prompts=250, seed=0):
    tok.padding_side = "left"
    torch.manual_seed(seed)
    model.eval()
    out = []
    for i in range(0, len(prompts), batch_prompts):
        enc = tok(prompts[i : i + batch_prompts], return_tensors="pt", padding=True)
        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        gen = model.generate(
            **enc, max_new_tokens=max_new_tokens, num_return_sequences=n,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kw,
        )
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out.extend(texts[j : j + n] for j in range(0, len(texts), n))
    return out


def evaluate(model, tok, task, rows, *, k=8, max_new_tokens=24):
    prompts = [r["prompt"] for r in rows]
    t0 = time.perf_counter()
    greedy = generate(model, tok, prompts, max_new_tokens=max_new_tokens)
    t1 = time.perf_counter()
    sampled = generate(model, tok, prompts, n=k, greedy=False, max_new_tokens=max_new_tokens, batch_prompts=100)
    t2 = time.perf_counter()
    p1 = sum(task.is_correct(g[0], r) for g, r in zip(greedy, rows)) / len(rows)
    pk = sum(any(task.is_correct(s, r) for s in ss) for ss, r in zip(sampled, rows)) / len(rows)
    mean_sample = sum(task.is_correct(s, r) for ss, r in zip(sampled, rows) for s in ss) / (k * len(rows))
    by_count = {}  # countdown: greedy pass@1 by how many numbers the problem gives
    for g, r in zip(greedy, rows):
        if "numbers" in r:
            by_count.setdefault(len(r["numbers"]), []).append(task.is_correct(g[0], r))
    return {
        **{f"pass@1[{c}nums]": sum(v) / len(v) for c, v in sorted(by_count.items())},
        "pass@1": p1, f"pass@{k}": pk, "sample_acc": mean_sample,
        "greedy_s": t1 - t0, "sampled_s": t2 - t1,
        "examples": [(r["prompt"], g[0]) for r, g in zip(rows[:4], greedy[:4])],
    }
