"""A GRPO run whose reward needs completions of thousands of tokens: a tiny model learns to write `--target`
sevens.

    .venv/bin/python benchmarks/long_chains.py                  # -> benchmarks/results/long_chains.md
    .venv/bin/python benchmarks/long_chains.py --steps 40 --threads 1   # shorter, on one thread

The reward of a completion is min(its '7's, target) / target, so it rises only as completions grow long and
fill with sevens: at the target (8,192 by default, rollout.max_completion_length the same) the best
completion is 8,192 tokens. The model is a random test-size Llama (2 layers, hidden 96) over the characters
"0123456789 :" built in OUT/model with room for the longest sequence; from random weights its completions
stop after about a dozen tokens (EOS is one token in fifteen). The run is the real trainer and the fast
engine, with the settings long sequences need: model.padding_free (each micro-batch one row of real tokens)
and optim.max_tokens_per_micro_batch (micro-batches sized in tokens: one long completion, or many short
ones). Reported per step: reward, completion lengths (mean, max), the share cut at the limit, the share of
the step's tokens that are sevens, micro-batches, seconds (rollout, step) and peak RSS.

--smoke: 2 steps at target 64 (a check that the benchmark runs), into OUT/smoke.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHARSET = "0123456789 :"


def sevens(completions, target, **kwargs):
    """min('7's, target) / target for each completion."""
    return [min(c.count("7"), int(t)) / int(t) for c, t in zip(completions, target, strict=True)]


def build(out: Path, target: int, prompts: int) -> tuple[str, str]:
    """The model folder and the prompts file (`prompts` rows "<target>:") under out."""
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    model = out / "model"
    tok = build_tokenizer(CHARSET, model, model_max_length=target + 64)
    build_tiny_llama(tok, size="test", seed=0, max_position_embeddings=target + 64).save_pretrained(model)
    data = out / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{target}:", "target": target}) + "\n" for _ in range(prompts))
    )
    return str(model), str(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=int, default=8192, help="sevens wanted (= rollout.max_completion_length)")
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--prompts", type=int, default=1, help="rollout.prompts_per_step")
    p.add_argument("--G", type=int, default=8, help="rollout.num_generations")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="scratch folder (default runs/long_chains)")
    p.add_argument("--results", default=None, help="the table (default benchmarks/results/long_chains.md)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.target, args.steps = 64, 2
    args.out = Path(args.out or "runs/long_chains" + ("/smoke" if args.smoke else ""))
    results = Path(args.results or ((args.out if args.smoke else HERE / "results") / "long_chains.md"))
    import torch

    from grpokit.config import load_config
    from grpokit.trainer import Trainer

    torch.set_num_threads(args.threads)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    model, data = build(args.out, args.target, 64)
    cfg = load_config(
        None,
        [
            f"model.name_or_path={model}",
            "data.task=null",
            f"data.train_path={data}",
            "data.eval_size=0",
            f"rewards=[{{function: '{Path(__file__).resolve()}:sevens'}}]",
            f"output_dir={args.out / 'run'}",
            "rollout.engine=fast",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.num_generations={args.G}",
            f"rollout.max_completion_length={args.target}",
            "model.padding_free=true",
            f"optim.max_tokens_per_micro_batch={args.target + 64}",
            "algorithm.loss_type=dapo",  # a token mean: a long completion's tokens weigh as a short one's
            "algorithm.beta=0.0",
            f"optim.learning_rate={args.lr}",
            "optim.lr_scheduler=constant",
            "optim.warmup_ratio=0.0",
            f"optim.max_steps={args.steps}",
            "checkpoint.save_every=0",
            "checkpoint.resume=false",
            "eval.at_start=false",
            "logging.tensorboard=false",
            "seed=0",
        ],
    )
    rows: list[tuple[int, dict]] = []
    start = time.perf_counter()

    def log(step: int, m: dict) -> None:
        rows.append((step, m))
        print(
            f"step {step}: reward {m['reward/mean']:.4f}, length mean {m['rollout/completion_len_mean']:.0f} "
            f"max {m['rollout/completion_len_max']:.0f}, {m['perf/step_time']:.1f} s",
            flush=True,
        )
        write_table(args, rows, (time.perf_counter() - start) / 60, results)  # after each step: kept if cut

    Trainer(cfg).train(on_log=log)
    print(results.read_text())


def write_table(args, rows: list[tuple[int, dict]], minutes: float, results: Path) -> None:
    lines = [
        f"# GRPO on completions of thousands of tokens: a tiny model learns to write {args.target} sevens",
        "",
        "    .venv/bin/python benchmarks/long_chains.py " + " ".join(sys.argv[1:]),
        "",
        f"target {args.target} sevens (rollout.max_completion_length {args.target}); {args.prompts} prompts "
        f"x G={args.G}; lr {args.lr}; model.padding_free, "
        f"optim.max_tokens_per_micro_batch={args.target + 64}; "
        f"{args.threads} thread(s); {minutes:.1f} min so far; load average {os.getloadavg()[0]:.2f}",
        "",
        "| step | reward | length mean | length max | cut at the limit | sevens per token | micro-batches "
        "| rollout s | step s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for step, m in rows:
        # a completion has at most its length in sevens (<= target), so mean reward x target / mean length
        # is the share of all the step's tokens that are sevens: what the reward measures once lengths are
        # at the limit
        share = m["reward/mean"] * args.target / max(m["rollout/completion_len_mean"], 1.0)
        lines.append(
            f"| {step} | {m['reward/mean']:.4f} | {m['rollout/completion_len_mean']:.0f} | "
            f"{m['rollout/completion_len_max']:.0f} | {100 * m['rollout/truncated_frac']:.0f}% | "
            f"{100 * share:.1f}% | {m['perf/micro_batches']:.1f} | {m['perf/rollout_time']:.1f} | "
            f"{m['perf/step_time']:.1f} | "
            f"{m['perf/peak_rss_mb']:.0f} |"
        )
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
