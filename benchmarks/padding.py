"""Padding of the training micro-batches with and without optim.group_by_length, on long-tailed completions.

    .venv/bin/python benchmarks/padding.py                     # -> benchmarks/results/padding.md
    .venv/bin/python benchmarks/padding.py --steps 10

From a countdown warm start (--model; benchmarks/precision.py builds runs/precision/sft), two GRPO runs that
differ only in optim.group_by_length, in alternating step order inside one process
(benchmarks/profile_step.py's A/B trainers would do too; here two Trainers step by step), with
optim.micro_batch_size splitting each minibatch and a --temperature high enough that some completions ramble
to --max-len while most stop early (long-tailed lengths). Reported: completion lengths (mean, p50, max),
perf/padding_frac (the fraction of the completion positions the training micro-batches computed that were
padding), and the medians of perf/train_time and perf/ref_time (the pi_old / pi_ref passes use the same
micro-batches).

--smoke: 3 steps of 4 prompts x G=4, completions <= 8 tokens, micro-batches of 4, on a random test-size model
built in OUT/smoke-model (unless --model), OUT runs/padding/smoke: a check that the benchmark runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent


def smoke_model(out: Path) -> str:
    """A random test-size Llama with the countdown tokenizer, in OUT/smoke-model (--smoke)."""
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    path = out / "smoke-model"
    tok = build_tokenizer(get_task("countdown"), path)
    build_tiny_llama(tok, size="test", seed=0).save_pretrained(path)
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the warm start (default: runs/precision/sft; --smoke: a random model)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_step")
    p.add_argument("--G", type=int, default=8, help="rollout.num_generations")
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.5)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="run folders (default: runs/padding; --smoke: runs/padding/smoke)")
    p.add_argument("--results", help="the table (default: benchmarks/results/padding.md; --smoke: OUT)")
    p.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.prompts, args.G, args.max_len, args.micro_batch_size = 3, 4, 4, 8, 4
    args.out = args.out or "runs/padding" + ("/smoke" if args.smoke else "")
    args.results = args.results or str((Path(args.out) if args.smoke else HERE / "results") / "padding.md")
    if not args.model:
        args.model = smoke_model(Path(args.out)) if args.smoke else "runs/precision/sft"
    import torch

    from grpokit.config import load_config
    from grpokit.trainer import Trainer

    torch.set_num_threads(args.threads)
    trainers, rows = {}, {True: [], False: []}
    for grouped in (True, False):
        out = Path(args.out) / f"grouped-{grouped}"
        shutil.rmtree(out, ignore_errors=True)
        cfg = load_config(
            None,
            [
                f"model.name_or_path={args.model}",
                "data.task=countdown",
                "data.task_train_size=2000",
                "data.eval_size=0",
                f"output_dir={out}",
                "rollout.engine=fast",
                f"rollout.prompts_per_step={args.prompts}",
                f"rollout.num_generations={args.G}",
                f"rollout.max_completion_length={args.max_len}",
                f"rollout.temperature={args.temperature}",
                "algorithm.beta=0.04",
                f"optim.micro_batch_size={args.micro_batch_size}",
                f"optim.max_steps={args.steps}",
                f"optim.group_by_length={str(grouped).lower()}",
                "checkpoint.save_every=0",
                "checkpoint.resume=false",
                "eval.at_start=false",
                "logging.sample_every=0",
                "logging.tensorboard=false",
                "seed=0",
            ],
        )
        trainers[grouped] = Trainer(cfg)
    lengths = []
    with mock.patch("grpokit.trainer.plot_run", lambda *a, **k: []):
        for step in range(args.steps):
            for grouped in (True, False) if step % 2 == 0 else (False, True):
                t = trainers[grouped]
                batch, metrics, _ = t.rollout([t.train_data[i] for i in t.sampler.next()])
                start = time.perf_counter()
                metrics.update(t.update(batch))
                metrics["perf/train_time"] = time.perf_counter() - start
                rows[grouped].append(metrics)
                if grouped:
                    lengths += batch.tokens.completion_mask.sum(1).tolist()

    def med(key, g):
        return statistics.median(r[key] for r in rows[g])

    lengths.sort()
    command = "    .venv/bin/python benchmarks/padding.py " + " ".join(sys.argv[1:])
    lines = [
        "# Padding of the training micro-batches: optim.group_by_length on and off",
        "",
        command.rstrip(),
        "",
        f"warm start {args.model}; {args.steps} steps of {args.prompts} prompts x G={args.G} at temperature "
        f"{args.temperature}, completions <= {args.max_len} tokens, micro_batch_size {args.micro_batch_size} "
        f"({-(-args.prompts * args.G // args.micro_batch_size)} micro-batches per step); load average "
        f"{os.getloadavg()[0]:.2f}; {args.threads} thread(s)",
        "",
        f"completion lengths (grouped run): mean {statistics.mean(lengths):.1f}, median "
        f"{lengths[len(lengths) // 2]}, 90th percentile {lengths[int(0.9 * len(lengths))]}, "
        f"max {lengths[-1]}",
        "",
        "| group_by_length | padding_frac (mean) | train s (median) | ref + old s (median) |",
        "|---|---|---|---|",
    ]
    for grouped in (False, True):
        lines.append(
            f"| {grouped} | {100 * statistics.mean(r['perf/padding_frac'] for r in rows[grouped]):.1f}% | "
            f"{med('perf/train_time', grouped):.3f} | {med('perf/ref_time', grouped):.3f} |"
        )
    text = "\n".join(lines) + "\n"
    Path(args.results).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
