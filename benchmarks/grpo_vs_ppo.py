"""GRPO vs PPO (learned critic, GAE) on the same task, budget and SFT warm start: held-out accuracy and
memory.

    python benchmarks/grpo_vs_ppo.py --model runs/demo/sft --steps 40    # any countdown-SFT'd model folder
    python benchmarks/grpo_vs_ppo.py --make-sft runs/sft_countdown        # or build a small warm start, ~12
                                                                          # min

GRPO's claim (DeepSeekMath §4.1): it needs no critic, so it saves the critic's memory and compute.
Both arms get the same model folder (--model), the same task (data.task=countdown unless --set
says otherwise), the same rollout batch (prompts x G completions), the same number of steps and
the same policy learning rate; PPO also trains a critic (grpokit/policy/critic.py, docs/ppo.md) with its own
learning rate (--critic-lr). Reported per arm:
  - held-out greedy pass@1 (eval/pass@1) before and after, on --eval-size test problems;
  - mean training reward over the last 5 steps;
  - bytes of model state, computed exactly from the tensors: parameters (policy, pi_ref when
    beta > 0, critic), gradients (they exist during each update: one per trainable parameter),
    AdamW moments (optimizer state);
  - peak RSS of the arm's own process (ru_maxrss: each arm runs in a subprocess), which adds
    activations, the rollout's KV cache, Python and libraries: noisy, and for tiny models dominated
    by the fixed cost of torch + transformers;
  - seconds in training steps (evaluation excluded), and of those the critic's (its forward pass at
    rollout time, GAE, its updates): noisy on a shared machine; per-phase times are in metrics.jsonl.

A warm start: any folder with a countdown-SFT'd causal LM and its tokenizer. `grpokit demo --model tiny`
writes one to runs/demo/sft (the demo's 1.78M-parameter model); `--make-sft DIR` here builds a smaller one
(the tests' 0.2M-parameter Llama, 3 epochs of SFT on 16,000 countdown solutions); the demo-tuning
experiments' exp_sft.py --save DIR (removed from the tree; last in commit e102b80, see docs/demo_tuning.md)
saved the warm start "G" of docs/ppo.md. Extra config overrides for both arms
go after --set, e.g. --set rollout.engine=fast algorithm.loss_type=dapo.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in opt.state.values() for v in state.values())


def state_bytes(trainer) -> dict[str, int]:
    """Exact bytes of what each arm keeps: parameters, gradients (during an update), optimizer moments."""
    policy = list(trainer.model.parameters())  # parameters() yields a tied weight once
    critic = list(trainer.critic.model.parameters()) if trainer.critic is not None else []
    out = {
        "policy_params": tensor_bytes(policy),
        "ref_params": tensor_bytes(trainer.ref.parameters()) if trainer.ref is not None else 0,
        "critic_params": tensor_bytes(critic),
        "grads": tensor_bytes(p for p in policy + critic if p.requires_grad),
        "optimizer_state": optimizer_bytes(trainer.optimizer.adamw)
        + (optimizer_bytes(trainer.critic.optimizer.adamw) if trainer.critic is not None else 0),
    }
    out["total"] = sum(out.values())
    return out


def run_arm(args) -> None:
    """One arm in this process; writes a JSON result to --result."""
    from grpokit.config import load_config
    from grpokit.trainer import Trainer

    torch.set_num_threads(args.threads)
    overrides = [
        f"model.name_or_path={args.model}",
        "data.task=countdown",
        # the default (20000) is more than countdown's ~16,400 distinct train problems
        "data.task_train_size=10000",
        f"data.eval_size={args.eval_size}",
        f"output_dir={Path(args.out) / args.arm}",
        f"seed={args.seed}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.num_generations={args.G}",
        f"rollout.max_completion_length={args.max_completion_length}",
        f"optim.learning_rate={args.lr}",
        f"optim.max_steps={args.steps}",
        f"algorithm.beta={args.beta}",
        "algorithm.loss_type=dapo",
        "eval.k=1",
        "eval.batch_size=250",
        "checkpoint.save_every=0",
        "checkpoint.resume=false",
        "logging.sample_every=0",
        f"algorithm.advantage_estimator={'gae' if args.arm == 'ppo' else 'grpo'}",
        f"ppo.critic_learning_rate={args.critic_lr}",
        *args.set,
    ]
    cfg = load_config(None, overrides)
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a fresh run, not a resume or an append
    t = time.perf_counter()
    trainer = Trainer(cfg)
    trainer.train()
    wall = time.perf_counter() - t
    lines = (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(ln) for ln in lines if ln.strip()]
    evals = [r for r in rows if r.get("eval/pass@1") is not None]
    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    result = {
        "arm": args.arm,
        "pass@1_start": evals[0]["eval/pass@1"],
        "pass@1_end": evals[-1]["eval/pass@1"],
        "eval_prompts": int(evals[-1]["eval/num_prompts"]),
        "reward_last5": sum(rewards[-5:]) / len(rewards[-5:]),
        "wall_s": wall,
        "train_s": sum(r.get("perf/step_time", 0.0) for r in rows),
        "critic_s": sum(r.get("perf/critic_train_time", 0.0) + r.get("perf/value_time", 0.0) for r in rows),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "bytes": state_bytes(trainer),
        "explained_variance_last5": _mean([r.get("value/explained_variance") for r in rows[-5:]]),
    }
    Path(args.result).write_text(json.dumps(result))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def make_sft(out: str, *, size: str, rows: int, epochs: float, lr: float, seed: int, threads: int) -> None:
    from grpokit.config import DataConfig
    from grpokit.data import build_datasets
    from grpokit.sft import train_sft
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(threads)
    task = get_task("countdown")
    tok = build_tokenizer(task, out)
    model = build_tiny_llama(tok, size=size, seed=seed)
    pairs = build_datasets(
        DataConfig(task=task.name, task_train_size=rows), tok, seed=seed
    ).train  # "completion": the solution
    stats = train_sft(
        model, tok, pairs, epochs=epochs, batch_size=64, learning_rate=lr, max_length=256, seed=seed
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"SFT warm start saved to {out}: {stats}")


def mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def print_table(command: str, args, results: dict[str, dict]) -> None:
    print(f"$ {command}")
    print(
        f"countdown, warm start {args.model}; {args.steps} steps x {args.prompts} prompts x G={args.G}, "
        f"policy lr {args.lr}, beta {args.beta}, PPO critic lr {args.critic_lr}; "
        f"held-out greedy pass@1 on {next(iter(results.values()))['eval_prompts']} problems; MiB = 2^20 "
        "bytes\n"
    )
    cols = [
        ("arm", lambda r: r["arm"].upper()),
        ("pass@1 start", lambda r: f"{100 * r['pass@1_start']:.1f}%"),
        ("pass@1 end", lambda r: f"{100 * r['pass@1_end']:.1f}%"),
        ("reward (last 5)", lambda r: f"{r['reward_last5']:.3f}"),
        ("policy MiB", lambda r: mb(r["bytes"]["policy_params"])),
        ("ref MiB", lambda r: mb(r["bytes"]["ref_params"])),
        ("critic MiB", lambda r: mb(r["bytes"]["critic_params"])),
        ("grads MiB", lambda r: mb(r["bytes"]["grads"])),
        ("AdamW MiB", lambda r: mb(r["bytes"]["optimizer_state"])),
        ("state MiB", lambda r: mb(r["bytes"]["total"])),
        ("peak RSS MiB", lambda r: f"{r['peak_rss_mb']:.0f}"),
        ("steps s", lambda r: f"{r['train_s']:.0f}"),
        ("critic s", lambda r: f"{r['critic_s']:.0f}"),
    ]
    table = [[name for name, _ in cols]] + [[f(r) for _, f in cols] for r in results.values()]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for j, row in enumerate(table):
        print(
            " | ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if j == 0:
            print("-+-".join("-" * w for w in widths))
    if "grpo" in results and "ppo" in results:
        g, p = results["grpo"]["bytes"]["total"], results["ppo"]["bytes"]["total"]
        print(
            f"\nPPO keeps {p / g:.2f}x GRPO's model state ({mb(p - g)} MiB more: the critic, its gradients "
            "and AdamW moments)."
        )
        ev = results["ppo"].get("explained_variance_last5")
        if ev is not None:
            print(f"PPO critic explained variance, last 5 steps: {ev:.2f}.")
    print("Wall times and RSS are from a shared, noisy machine; state bytes are exact.")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="warm-start model folder (both arms start from it)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=8, help="rollout.prompts_per_step")
    p.add_argument("--G", type=int, default=8, help="rollout.num_generations (completions per prompt)")
    p.add_argument(
        "--lr",
        type=float,
        default=1e-4,
        help="policy learning rate, both arms (5e-4 collapsed both; docs/ppo.md)",
    )
    p.add_argument("--critic-lr", type=float, default=1e-3, help="PPO's critic learning rate")
    p.add_argument(
        "--beta", type=float, default=0.0, help="KL coefficient, both arms (PPO: shaped into the reward)"
    )
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--eval-size", type=int, default=200, help="held-out test problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/grpo_vs_ppo")
    p.add_argument("--arms", default="grpo,ppo")
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides for both arms")
    p.add_argument("--make-sft", metavar="DIR", help="build a countdown SFT warm start in DIR and exit")
    p.add_argument("--sft-size", default="test", help="tiny Llama preset for --make-sft (test | demo)")
    p.add_argument("--sft-rows", type=int, default=16000)
    p.add_argument("--sft-epochs", type=float, default=3.0)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny run per arm (3 steps of 2 prompts x G=2, 8 tokens, 4 held-out problems) from a warm "
        "start of one SFT step built in OUT/smoke-sft (unless --model), OUT runs/grpo_vs_ppo/smoke: a check "
        "that the benchmark runs",
    )
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:  # the arms' children get --smoke too and read the same sizes
        vars(args).update(steps=3, prompts=2, G=2, max_completion_length=8, eval_size=4)
        if args.out == p.get_default("out"):
            args.out = str(Path(args.out) / "smoke")
        if not args.model:
            args.model = str(Path(args.out) / "smoke-sft")
            if not args.arm and not Path(args.model).exists():
                make_sft(
                    args.model,
                    size="test",
                    rows=64,
                    epochs=1.0,
                    lr=args.sft_lr,
                    seed=args.seed,
                    threads=args.threads,
                )

    if args.make_sft:
        make_sft(
            args.make_sft,
            size=args.sft_size,
            rows=args.sft_rows,
            epochs=args.sft_epochs,
            lr=args.sft_lr,
            seed=args.seed,
            threads=args.threads,
        )
        return
    if not args.model:
        p.error("--model is required (a warm-start folder; see --make-sft)")
    if args.arm:
        run_arm(args)
        return

    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {}
    for arm in args.arms.split(","):
        result = Path(args.out) / f"{arm}.json"
        # A fresh process per arm: ru_maxrss is the peak of the whole process, so arms must not share one.
        child = [sys.executable, __file__, *sys.argv[1:], "--arm", arm, "--result", str(result)]
        print(f"running {arm} ...", flush=True)
        subprocess.run(child, check=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
        results[arm] = json.loads(result.read_text())
    print()
    print_table(command, args, results)


if __name__ == "__main__":
    main()
