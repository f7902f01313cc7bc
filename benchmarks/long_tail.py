"""Long-tailed completion lengths: the synchronous loop against asynchronous rollouts (lag 1) against partial
rollouts, on the same warm start, steps and seeds.

    .venv/bin/python benchmarks/long_tail.py                   # -> benchmarks/results/long_tail.md
    .venv/bin/python benchmarks/long_tail.py --steps 10 --seeds 0   # a quick look
    .venv/bin/python benchmarks/long_tail.py --smoke           # the tests' check that it runs

The workload: countdown (benchmarks/presets.py's config: 16 prompts x G=8 at T=1, lr 1e-4, the fast
engine) from a warm start whose completions are long-tailed. It is built here (OUT/warm-start, unless
--model): a demo-size tiny Llama fine-tuned on countdown solutions of which --tail-frac (10%) come after 40-48
spaces, which the reward strips (so a long completion can still be right): most completions take about 8-12
tokens, one in ten about 50-60, all under --max-completion-length (64, the countdown parser's limit). Arms
(benchmarks/arms.py):
  sync      the synchronous loop: each step waits for its longest completion
  lag1      rollout.max_policy_lag=1: batch b + 1 sampled with the weights of step b while step b trains
  partial   rollout.partial_rollouts with chunks of --chunk tokens (16), max_staleness 3, twice a step's
            groups in flight: a step trains on the first groups to finish
Reported besides held-out accuracy and seconds per step: the median over steps of the trainer's wait for its
batch (perf/rollout_wait_time: the trainer idle), rollout tokens/s, completion lengths, and for partial the
share of completions that took several rounds, versions spanned and tokens carried over.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from arms import arm_parser, parse_arm_args, run_all  # noqa: E402 (after sys.path gets benchmarks/)

ARMS = {
    "sync": ["rollout.engine=fast"],
    "lag1": ["rollout.engine=fast", "rollout.max_policy_lag=1"],
    "partial": [
        "rollout.engine=fast",
        "rollout.partial_rollouts=true",
        "rollout.max_staleness=3",
        "rollout.partial_in_flight=2",
    ],
}
KEYS = (
    "perf/rollout_wait_time",
    "perf/rollout_tokens_per_s",
    "rollout/completion_len_mean",
    "rollout/completion_len_max",
    "rollout/partial_frac",
    "rollout/versions_spanned",
    "rollout/tokens_carried",
)


def make_warm_start(out: str, *, size: str, rows: int, epochs: float, tail_frac: float, seed: int) -> None:
    """A countdown SFT warm start whose completions are long-tailed: tail_frac of the training solutions come
    after 40-48 spaces (stripped by the reward)."""
    import torch

    from grpokit.sft import train_sft
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    task = get_task("countdown")
    tok = build_tokenizer(task, out)
    model = build_tiny_llama(tok, size=size, seed=seed)
    rng = random.Random(seed)
    pairs = task.make_rows("train", rows, seed)
    for row in pairs:
        if rng.random() < tail_frac:
            row["completion"] = " " * rng.randint(40, 48) + row["completion"]
    torch.manual_seed(seed)
    stats = train_sft(
        model, tok, pairs, epochs=epochs, batch_size=64, learning_rate=1e-3, max_length=256, seed=seed
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"long-tailed warm start saved to {out}: {stats}", flush=True)


def main() -> None:
    p = arm_parser(__doc__, "long_tail", "")
    p.set_defaults(max_completion_length=64, steps=40)
    p.add_argument("--arms", default="sync,lag1,partial")
    p.add_argument("--chunk", type=int, default=16, help="rollout.partial_chunk_tokens of the partial arm")
    p.add_argument("--tail-frac", type=float, default=0.1)
    p.add_argument("--sft-rows", type=int, default=20000)
    p.add_argument("--sft-epochs", type=float, default=2.0)
    args = parse_arm_args(p)
    if not args.model:
        args.model = f"{args.out}/warm-start"
    if not Path(args.model).exists():
        rows, epochs = (256, 1.0) if args.smoke else (args.sft_rows, args.sft_epochs)
        size = "test" if args.smoke else "demo"
        make_warm_start(args.model, size=size, rows=rows, epochs=epochs, tail_frac=args.tail_frac, seed=0)
    arms = {a: ARMS[a] for a in args.arms.split(",")}
    if "partial" in arms:
        arms["partial"] = [*arms["partial"], f"rollout.partial_chunk_tokens={args.chunk}"]
    setup = (
        f"warm start {args.model} ({args.tail_frac:.0%} of its SFT solutions after 40-48 spaces); "
        f"{args.steps} GRPO steps of {args.prompts} prompts x G={args.G}, completions <= "
        f"{args.max_completion_length} tokens; partial: chunks of {args.chunk}; {args.eval_size} held-out "
        f"problems; {args.threads} thread(s)"
    )
    run_all(
        args, arms, "long_tail.py", "Long-tailed completions: sync, lag 1 and partial rollouts", setup, KEYS
    )


if __name__ == "__main__":
    main()
