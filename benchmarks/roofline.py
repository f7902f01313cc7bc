"""Roofline of grpokit's training phase on CPU: peak matmul FLOP/s, and where a training step loses time.

    python benchmarks/roofline.py                       # peak + breakdown on the compute-bound workload
    python benchmarks/roofline.py --peak-only           # just this machine's fp32 matmul peak
    python benchmarks/roofline.py --model DIR --seqs 32 --completion 64 --threads 2

Peak: best of --repeats torch.matmul calls on square fp32 matrices (2048 and 4096), with
torch.set_num_threads(os.cpu_count()). Achieved FLOP/s are counted the usual way (Kaplan et al. 2020):

    training   6 x N x tokens   forward 2N + backward 4N per token through the model
    rollout    2 x N x tokens   one forward per generated token (prefill not counted)

with N = non-embedding parameters (the LM head counts when it is not tied to the embedding) and
tokens = real (non-padding) prompt + completion tokens through the model for training, generated
completion tokens for rollout. Attention-score FLOPs (QK^T and AV, 2 x 2 x layers x context x width
per token forward) are left out of 6N; `attention_share` prints how much they would add.

The breakdown times one micro-step of grpokit's update (grpokit/trainer.py `update`) piece by piece
on a synthetic batch of the compute-bound shape (countdown prompts, random completion tokens, no
EOS): forward, log-probs, loss, backward, gradient clipping, optimizer, and the variants that could
be faster (threads, attention kernel, entropy pass, fused AdamW, torch.compile). Results go to
benchmarks/results/roofline.md with the command and the machine load (`uptime`).

--smoke: the peak on 256 x 256 matrices and the breakdown of one round on compare_trl.py's small model (built
in runs/roofline/smoke unless --model), 2 sequences of 8 completion tokens, written to
runs/roofline/smoke/roofline.md: a check that the benchmark runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine_load() -> str:
    """`uptime`'s load averages: timings on a shared machine mean little without them."""
    try:
        out = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
        return out[out.index("load average") :] if "load average" in out else out
    except Exception:  # the load is a note, never a reason to fail
        return "load average: unknown"


def peak_matmul_flops(sizes=(2048, 4096), repeats: int = 5, threads: int | None = None) -> dict[int, float]:
    """Best fp32 matmul FLOP/s per square size n (2 n^3 FLOPs a call), all cores unless `threads`."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        best = {}
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            c = torch.empty(n, n)
            torch.matmul(a, b, out=c)  # warm-up
            rates = []
            for _ in range(repeats):
                t = time.perf_counter()
                torch.matmul(a, b, out=c)
                rates.append(2 * n**3 / (time.perf_counter() - t))
            best[n] = max(rates)
        return best
    finally:
        torch.set_num_threads(old)


def param_counts(model) -> dict[str, int]:
    """total (tied weights once), embedding, and non-embedding parameters."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


def attention_share(model, context: float) -> float:
    """Attention-score FLOPs per token (2 x 2 x layers x context x width, forward) over 2N."""
    cfg = model.config
    n = param_counts(model)["non_embedding"]
    return (4 * cfg.num_hidden_layers * context * cfg.hidden_size) / (2 * n)


# ---------------------------------------------------------------- training-phase breakdown


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each callable, timed round-robin (A, B, C, A, B, C, ...) so that a load change
    on a shared machine hits every candidate alike; one untimed warm-up call each first."""
    for fn in fns.values():
        fn()  # allocator, oneDNN primitives
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def synthetic_batch(tokenizer, n_seqs: int, completion_len: int, seed: int = 0):
    """A PackedBatch of countdown prompts and random completion tokens (no EOS, none shorter)."""
    from compare_trl import countdown_task  # the comparison's pinned countdown problems

    from grpokit.data.batch import pack_sequences

    rows = countdown_task().make_rows("train", n_seqs, seed)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    g = torch.Generator().manual_seed(seed)
    low = max(tokenizer.all_special_ids) + 1  # ordinary characters only
    comps = torch.randint(low, len(tokenizer), (n_seqs, completion_len), generator=g).tolist()
    return pack_sequences(prompts, comps, tokenizer.pad_token_id)


def breakdown(
    model_dir: str, n_seqs: int, completion_len: int, threads: int, repeats: int, compile_: bool
) -> dict:
    """Seconds of each piece of one grpokit micro-step (whole minibatch) and of the variants."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.algo import policy_loss, token_logprobs
    from grpokit.policy import completion_logprobs, frozen_copy

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    ref = frozen_copy(model)
    batch = synthetic_batch(tok, n_seqs, completion_len)
    N, W = batch.input_ids.shape
    T = batch.completion_width
    real_tokens = int(batch.attention_mask.sum())
    counts = param_counts(model)
    mask = batch.completion_mask.float()
    adv = torch.randn(N)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    fused = torch.optim.AdamW([p for p in params], lr=1e-5, fused=True)
    with torch.no_grad():
        ref_logp, _ = completion_logprobs(ref, batch)
    fwd_kw = dict(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )

    def loss_of(logp):
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, ref_logp=ref_logp, beta=0.04, loss_type="grpo")
        return loss

    def micro_step(with_entropy=True, m=model):
        logp, _ = completion_logprobs(m, batch, with_entropy=with_entropy)
        loss_of(logp).backward()

    def full_step(optimizer=opt, with_entropy=True, m=model):
        optimizer.zero_grad(set_to_none=True)
        micro_step(with_entropy, m)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    def fwd_logp():
        out = model(**fwd_kw, logits_to_keep=T + 1)
        return token_logprobs(out.logits[:, :-1], batch.completion_ids)

    def with_threads(n, fn):
        def run():
            torch.set_num_threads(n)
            try:
                fn()
            finally:
                torch.set_num_threads(threads)

        return run

    today = "full optimizer step (grpokit today)"
    pieces = {
        today: full_step,  # leaves gradients for the clip / optimizer pieces below
        "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0),
        "AdamW step (foreach, grpokit's default)": opt.step,
        "AdamW step (fused=True)": fused.step,
        "forward, no grad (one old / ref log-prob pass)": lambda: _nograd(
            lambda: completion_logprobs(model, batch)
        ),
        "forward with grad (model only, logits_to_keep=T+1)": lambda: model(**fwd_kw, logits_to_keep=T + 1),
        "forward + token_logprobs": fwd_logp,
        "forward + log-probs + entropy (completion_logprobs, it=0)": lambda: completion_logprobs(
            model, batch, with_entropy=True
        ),
        "forward + log-probs + loss + backward (micro-step, it=0)": micro_step,
    }
    # Variants that could be faster, timed in the same round-robin as today's step.
    eager = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    eager.train()
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-5)
    variants = {
        "attn_implementation=eager (default: sdpa)": lambda: full_step(eager_opt, m=eager),
        "no entropy pass": lambda: full_step(with_entropy=False),
        "fused AdamW": lambda: full_step(fused),
        "fused AdamW + no entropy pass": lambda: full_step(fused, with_entropy=False),
    }
    if threads > 1:
        variants[f"1 thread (instead of {threads})"] = with_threads(1, full_step)

    def bf16_step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full_step()

    # Not a drop-in: changes the numerics of the ratio; shown for what the hardware could give.
    variants["autocast bf16 (AVX512-BF16 / AMX matmuls; not fp32)"] = bf16_step
    compile_s = None
    if compile_:
        try:
            compiled = torch.compile(model)
            t0 = time.perf_counter()
            full_step(m=compiled)
            compile_s = time.perf_counter() - t0
            variants["torch.compile (inductor), after compiling"] = lambda: full_step(m=compiled)
        except Exception as exc:  # report, don't fail the benchmark
            print(f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    measured = interleaved_medians({**pieces, **variants}, repeats)
    r = {k: measured[k] for k in pieces}
    variants = {k: measured[k] for k in variants}
    if compile_s is not None:
        variants["torch.compile: first step (compiles)"] = compile_s

    # Where the operators spend it: one profiled full step.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        full_step()
    avgs = prof.key_averages()
    ops = avgs.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=40)
    total_us = sum(e.self_cpu_time_total for e in avgs)
    mm_us = sum(e.self_cpu_time_total for e in avgs if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    return {
        "shape": (N, W, T),
        "real_tokens": real_tokens,
        "params": counts,
        "attention_share": attention_share(model, context=W / 2),
        "pieces": r,
        "variants": variants,
        "profile": ops,
        "mm_s": mm_us / 1e6,
        "mm_share": mm_us / max(total_us, 1),
    }


@torch.no_grad()
def _nograd(fn):
    return fn()


def report(res: dict, peak: float, command: str, load: str, threads: int) -> str:
    N, W, T = res["shape"]
    n = res["params"]["non_embedding"]
    step = res["pieces"]["full optimizer step (grpokit today)"]
    p = res["pieces"]
    backward = (
        p["forward + log-probs + loss + backward (micro-step, it=0)"]
        - p["forward + log-probs + entropy (completion_logprobs, it=0)"]
    )
    flops = 6 * n * res["real_tokens"]
    lines = [
        f"`{command}`",
        "",
        f"Machine load at start: {load}. {threads} thread(s); peak fp32 matmul on {threads} thread(s): "
        f"{peak / 1e9:.1f} GFLOP/s. Matmuls (aten::mm/addmm/bmm) take {100 * res['mm_share']:.0f}% of the "
        f"profiled step and run at {flops / max(res['mm_s'], 1e-9) / 1e9:.1f} GFLOP/s = "
        f"{100 * flops / max(res['mm_s'], 1e-9) / peak:.0f}% of peak (6N x tokens over their time alone).",
        "",
        f"Batch: {N} sequences x {W} positions ({T} completion tokens each, {res['real_tokens']} real "
        f"tokens), {n / 1e6:.2f}M non-embedding parameters. One full optimizer step = 6 x N x real tokens = "
        f"{flops / 1e9:.1f} GFLOP (attention scores would add {100 * res['attention_share']:.1f}%): "
        f"**{flops / step / 1e9:.1f} GFLOP/s = {100 * flops / step / peak:.0f}% of peak**.",
        "",
        "| piece of one micro-step | seconds | share of the full step |",
        "|---|---:|---:|",
    ]
    for k, v in [
        *res["pieces"].items(),
        ("(derived) loss + backward = micro-step - forward with log-probs", backward),
    ]:
        lines.append(f"| {k} | {v:.3f} | {100 * v / step:.0f}% |")
    lines += ["", "| variant (full optimizer step) | seconds | vs grpokit today |", "|---|---:|---:|"]
    for k, v in res["variants"].items():
        lines.append(f"| {k} | {v:.3f} | {v / step:.2f}x |")
    lines += [
        "",
        "Top operators of one profiled full step (self CPU time):",
        "",
        "```",
        res["profile"].rstrip(),
        "```",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peak-only", action="store_true")
    ap.add_argument(
        "--model",
        help="model folder (default: the compute-bound model compare_trl.py built, or a fresh 25M Llama)",
    )
    ap.add_argument(
        "--seqs", type=int, default=32, help="sequences in the micro-batch (compute-bound: 4 prompts x G=8)"
    )
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=7, help="round-robin rounds; the medians are over these")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (slow to compile on CPU)")
    ap.add_argument(
        "--out", help="the report (default: benchmarks/results/roofline.md; --smoke: runs/roofline/smoke)"
    )
    ap.add_argument("--smoke", action="store_true", help="the smallest sizes (see above)")
    args = ap.parse_args(argv)
    work = Path("runs/roofline/smoke")
    if args.smoke:
        args.seqs, args.completion, args.repeats = 2, 8, 1
    args.out = args.out or str((work if args.smoke else RESULTS) / "roofline.md")
    quick = dict(sizes=(256,), repeats=1) if args.smoke else {}
    command = "python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])
    )
    load = machine_load()
    peaks = peak_matmul_flops(**quick)
    peak = max(peaks.values())
    print(
        f"{load}; peak fp32 matmul on {os.cpu_count()} threads: "
        + ", ".join(f"n={n}: {v / 1e9:.1f} GFLOP/s" for n, v in peaks.items())
    )
    if args.threads != os.cpu_count():
        peak = max(peak_matmul_flops(threads=args.threads, **quick).values())
        print(f"peak fp32 matmul on {args.threads} thread(s): {peak / 1e9:.1f} GFLOP/s")
    if args.peak_only:
        return
    model_dir = args.model
    if model_dir is None:
        from compare_trl import WORKLOADS, build_model  # the same 25M model as the comparison

        if args.smoke:  # the small workload's 1M-parameter model, apart from the comparison's
            model_dir = str(build_model(WORKLOADS["small"], work, sft=False))
        else:
            model_dir = str(build_model(WORKLOADS["compute"], Path("runs/compare_trl"), sft=False))
    res = breakdown(model_dir, args.seqs, args.completion, args.threads, args.repeats, args.compile)
    text = report(res, peak, command, load, args.threads)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("# grpokit training phase vs this machine's peak\n\n" + text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
