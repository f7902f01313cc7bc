"""LoRA against the full fine-tune on the demo task: held-out accuracy before / after and peak memory
(docs/lora.md).

    .venv/bin/python benchmarks/lora_vs_full.py --out runs/lora_vs_full [--steps 100] [--sft runs/demo/sft]

1. the demo's SFT warm-start (grpokit.demo.toy.FULL: the demo-size tiny Llama, 900 SFT steps), saved to
OUT/sft
   once (a second call reuses it); --sft DIR takes one that `grpokit demo --model tiny --seed 0` wrote (its
   OUT/sft) instead;
2. `grpokit train` on it twice, each in its own process so that perf/peak_rss_mb (the process's peak resident
   memory, ru_maxrss) is the run's own: the demo's GRPO settings (beta raised to 0.04 so that pi_ref is in
   memory), shortened to --steps, once as a full fine-tune and once with model.lora;
3. prints a table: held-out greedy pass@1 and sampled mean@8 before and after, the mean reward of the first
   and last 10 steps, and the peak RSS.

    .venv/bin/python benchmarks/lora_vs_full.py --out runs/lora_vs_full --memory [--hidden 1024 --layers 8]

--memory: where the weights, not the activations, decide the peak: a randomly initialized Llama of that size
(~100M parameters by default), 3 GRPO steps of 4 prompts x G=4, beta 0.04, no evaluation, full fine-tune
against LoRA; prints the peak RSS of each and the trained parameters.

--smoke (with or without --memory): the same runs at the smallest sizes (a test-size model, one SFT step on 64
rows, 3 GRPO steps of 2 prompts x G=2 with 8 tokens, 4 held-out problems; --memory: hidden 64, 2 layers) into
runs/lora_vs_full/smoke: a check that the benchmark runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


#: --smoke: the GRPO runs' sizes (after the demo's settings)
SMOKE_GRPO = ["rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_completion_length=8"]


def build_sft(out: Path, steps: int, seed: int, smoke: bool = False) -> Path:
    from grpokit.config import DataConfig
    from grpokit.data import build_datasets
    from grpokit.demo.toy import FULL
    from grpokit.sft import train_sft
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    path = out / "sft"
    if (path / "config.json").is_file():
        return path
    task, sft = get_task("countdown"), dict(FULL["sft"], **({"rows": 64} if smoke else {}))
    tok = build_tokenizer(task, path)
    model = build_tiny_llama(tok, size="test" if smoke else FULL["model_size"], seed=seed)
    pairs = build_datasets(DataConfig(task=task.name, task_train_size=sft["rows"]), tok, seed=seed).train
    train_sft(
        model,
        tok,
        pairs,
        max_steps=steps,
        batch_size=sft["batch_size"],
        learning_rate=sft["lr"],
        max_length=256,
        seed=seed,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def grpo(sft: Path, out: Path, steps: int, eval_size: int, extra: list[str]) -> list[dict]:
    from grpokit.demo.toy import FULL

    keep = [
        o
        for o in FULL["grpo"]
        if not o.startswith(("optim.max_steps", "eval.", "checkpoint.", "data.eval_size", "optim.warmup"))
    ]
    overrides = [
        f"model.name_or_path={sft}",
        "data.task=countdown",
        f"output_dir={out}",
        *keep,
        f"optim.max_steps={steps}",
        "algorithm.beta=0.04",
        f"data.eval_size={eval_size}",
        "eval.k=8",
        "eval.batch_size=250",
        "optim.warmup_steps=5",
        "checkpoint.save_every=0",
        *extra,
    ]
    (out.parent / "empty.yaml").write_text("{}\n")
    cmd = [sys.executable, "-m", "grpokit", "train", str(out.parent / "empty.yaml"), *overrides]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def memory(out: Path, hidden: int, layers: int) -> None:
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    path = out / f"random_h{hidden}_l{layers}"
    if not (path / "config.json").is_file():
        tok = build_tokenizer(get_task("countdown"), path)
        build_tiny_llama(
            tok,
            size="demo",
            hidden_size=hidden,
            num_layers=layers,
            num_heads=hidden // 64,
            intermediate_size=hidden * 11 // 4,
        ).save_pretrained(path)
    from safetensors.torch import load_file

    n = sum(t.numel() for t in load_file(path / "model.safetensors").values())
    common = [
        "rollout.prompts_per_step=4",
        "rollout.num_generations=4",
        "rollout.max_completion_length=16",
        "optim.max_steps=3",
        "algorithm.beta=0.04",
        "eval.at_start=false",
        "data.eval_size=0",
        "checkpoint.save_every=0",
        "rollout.engine=fast",
        "data.task_train_size=100",
        "logging.sample_every=0",
    ]
    rows = []
    for name, extra in (
        ("full fine-tune", []),
        ("LoRA r=16, all-linear", ["model.lora.r=16", "model.lora.alpha=32"]),
    ):
        run = out / f"memory_{'lora' if extra else 'full'}"
        (out / "empty.yaml").write_text("{}\n")
        cmd = [
            sys.executable,
            "-m",
            "grpokit",
            "train",
            str(out / "empty.yaml"),
            f"model.name_or_path={path}",
            "data.task=countdown",
            f"output_dir={run}",
            *common,
            *extra,
        ]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rows.append((name, max(m.get("perf/peak_rss_mb", 0.0) for m in metrics)))
    print(
        f"\n{n / 1e6:.1f}M parameters ({4 * n / 2**20:.0f} MiB in fp32), hidden {hidden}, {layers} layers\n"
    )
    print("| run | peak RSS MB |\n|---|---|")
    for name, peak in rows:
        print(f"| {name} | {peak:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, help="run folders (default: runs/lora_vs_full; --smoke: runs/lora_vs_full/smoke)"
    )
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument(
        "--sft", type=Path, default=None, help="an SFT model folder to start from (default: build OUT/sft)"
    )
    ap.add_argument("--sft-steps", type=int, default=900)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lora", nargs="*", default=["model.lora.r=16", "model.lora.alpha=32", "optim.learning_rate=1e-3"]
    )
    ap.add_argument(
        "--memory", action="store_true", help="the peak-memory comparison on a larger random model instead"
    )
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="the same runs at the smallest sizes (see above)")
    args = ap.parse_args()
    # absolute: the runs are `grpokit train` processes started in the repository root
    args.out = (args.out or Path("runs/lora_vs_full") / ("smoke" if args.smoke else "")).resolve()
    if args.smoke:
        args.steps, args.sft_steps, args.eval_size, args.hidden, args.layers = 3, 1, 4, 64, 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.memory:
        return memory(args.out, args.hidden, args.layers)
    sft = args.sft.resolve() if args.sft else build_sft(args.out, args.sft_steps, args.seed, args.smoke)
    rows, sizes = [], SMOKE_GRPO if args.smoke else []
    for name, extra in (("full fine-tune", []), ("LoRA " + " ".join(args.lora), args.lora)):
        run = args.out / ("lora" if extra else "full")
        metrics = grpo(sft, run, args.steps, args.eval_size, [*extra, *sizes])
        evals = [m for m in metrics if "eval/pass@1" in m]
        peak = max(m.get("perf/peak_rss_mb", 0.0) for m in metrics)
        rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
        b, a = evals[0], evals[-1]
        rows.append(
            (
                name,
                b["eval/pass@1"],
                a["eval/pass@1"],
                b["eval/mean@8"],
                a["eval/mean@8"],
                sum(rewards[:10]) / len(rewards[:10]),
                sum(rewards[-10:]) / len(rewards[-10:]),
                peak,
            )
        )
    print(
        "\n| run | pass@1 before | pass@1 after | mean@8 before | mean@8 after | reward, first 10 steps | "
        "reward, last 10 steps | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, p0, p1, m0, m1, r0, r1, peak in rows:
        print(
            f"| {name} | {100 * p0:.1f}% | {100 * p1:.1f}% | {100 * m0:.1f}% | {100 * m1:.1f}% | {r0:.3f} | "
            f"{r1:.3f} | {peak:.0f} |"
        )


if __name__ == "__main__":
    main()
