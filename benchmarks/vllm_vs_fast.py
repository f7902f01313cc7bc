"""rollout.engine=vllm against the built-in fast engine on the demo task: held-out accuracy and s/step.

    .venv/bin/python benchmarks/vllm_vs_fast.py                       # -> benchmarks/results/vllm_vs_fast.md
    .venv/bin/python benchmarks/vllm_vs_fast.py --steps 20 --seeds 0   # a quick look

vLLM's CPU attention kernel takes head sizes 32, 64, 80, ...; the demo's Llama has 4 heads of 48. So the warm
start here (--model; built into runs/vllm_vs_fast/sft when missing) is the demo's Llama with 3 heads of 64:
the same hidden size 192, 4 layers, MLP 512 and so the same 1.78M parameters (q, k, v, o are 192 x 192
whatever the head count), SFT'd as `grpokit demo --model tiny` does (20,000 countdown solutions, 900 steps of
64, lr 1e-3). Each seed then runs GRPO twice with one config (benchmarks/presets.py's: 16 prompts x G=8,
16-token completions, T=1, lr 1e-4) that differs only in rollout.engine; the two arms of a seed run back to
back in alternating order, so a change of the machine's load hits both. Reported per run: held-out
eval/mean@8 and greedy eval/pass@1 on the same --eval-size test problems before step 1 and after the last
step (evaluation runs on the run's engine too), the median perf/step_time and perf/rollout_time (steps after
the first two), and vLLM's mismatch to the trainer (max over steps of rollout/logp_diff_max).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from arms import SMOKE_SFT, arm_parser, parse_arm_args, run_all  # noqa: E402 (after sys.path gets benchmarks/)

ENGINES = ("fast", "vllm")


def make_sft_hd64(out: str, threads: int, rows: int = 20000, epochs: float = 57600 / 20000) -> None:
    """The demo's warm start with 3 attention heads of 64 (vLLM-CPU-compatible), same parameter count;
    `epochs` over `rows` countdown solutions."""
    import torch

    from grpokit.config import DataConfig
    from grpokit.data import build_datasets
    from grpokit.sft import train_sft
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(threads)
    task = get_task("countdown")
    tok = build_tokenizer(task, out)
    model = build_tiny_llama(tok, size="demo", num_heads=3, seed=0)
    pairs = build_datasets(DataConfig(task=task.name, task_train_size=rows), tok, seed=0).train
    stats = train_sft(
        model, tok, pairs, epochs=epochs, batch_size=64, learning_rate=1e-3, max_length=256, seed=0
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(
        f"SFT warm start ({sum(p.numel() for p in model.parameters()):,} parameters) saved to {out}: {stats}",
        flush=True,
    )


def main() -> None:
    p = arm_parser(__doc__, "vllm_vs_fast", "runs/vllm_vs_fast/sft")
    args = parse_arm_args(p)
    if not Path(args.model).exists():
        t = time.perf_counter()
        make_sft_hd64(args.model, args.threads, **(SMOKE_SFT if args.smoke else {}))
        print(f"warm start built in {time.perf_counter() - t:.0f}s: {args.model}", flush=True)
    setup = (
        f"warm start {args.model} (demo Llama, 3 heads of 64); {args.steps} GRPO steps of {args.prompts} "
        f"prompts x G={args.G}; {args.eval_size} held-out problems; {args.threads} thread(s)"
    )
    run_all(
        args,
        {engine: [f"rollout.engine={engine}"] for engine in ENGINES},
        "vllm_vs_fast.py",
        "rollout.engine=vllm against fast on the demo task",
        setup,
    )


if __name__ == "__main__":
    main()
