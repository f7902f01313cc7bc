"""`grpokit demo --task tools`: agentic RL on 2 CPU cores, no GPU, no downloads (docs/agentic.md).

    grpokit demo --task tools                 # SFT warm start, GRPO with the calculator tool, before / after
    grpokit demo --task tools --quick         # a smoke test with the same outputs
    grpokit demo --task tools --process-only  # the same GRPO paid by the process rewards alone: are they
                                              # gamed?

1. a character tokenizer and a tiny Llama (grpokit/tasks/tiny_model.py);
2. SFT on 3-digit multiplications (grpokit/tasks/multiply.py) whose references call `calculator` in half of
   the problems (`<tool>calculator(482*917)</tool><result>441994</result>441994`) and answer directly in the
   other half (which a tiny model cannot compute);
3. GRPO with multi-turn episodes (rollout.max_turns, tool results masked out of the loss), paid by task
   success plus the process rewards `tool_result_used` (the answer is a verified tool result) and `step_cost`
   (a price per call, on the call's tokens); --process-only drops the task reward and adds `tool_args_valid`;
4. held-out task success with tools before and after (greedy episodes, `eval/pass@1`, judged by the task
   reward alone, independent of the process rewards), with the valid-call rate and calls per episode of those
   episodes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpokit.demo.toy import (
    DemoSettings,
    demo_result,
    eval_rows,
    start_fresh,
    tiny_model,
    train_grpo,
    warm_start,
)
from grpokit.metrics.compute import (
    EVAL_NUM_PROMPTS,
    EVAL_PASS_AT_1,
    EVAL_TOOLS_CALLS_PER_EPISODE,
    EVAL_TOOLS_CUT_BY_BUDGET,
    EVAL_TOOLS_VALID_CALL_RATE,
)

if TYPE_CHECKING:
    from grpokit.config import Config

TASK_REWARD = "{function: multiply, weight: 1.0}"
#: with the task reward: the answer is a verified tool result (0.2), and a price per call (0.05)
PROCESS_REWARDS = [
    "{function: tool_result_used, weight: 0.2}",
    "{function: step_cost, weight: 1.0, kwargs: {cost: 0.05}}",
]
#: --process-only: those and a well-formed call (0.2 per call, on the call's tokens), the task reward's weight
#: 0
PROCESS_ONLY_REWARDS = ["{function: tool_args_valid, weight: 0.2}", *PROCESS_REWARDS]
COMMON = [
    "data.task=multiply",
    "tools.builtin=[calculator]",
    "rollout.max_turns=3",
    "rollout.engine=fast",
    "rollout.max_completion_length=72",
    "rollout.temperature=1.0",
    "algorithm.beta=0.0",
    "eval.reward=multiply",
    "eval.k=1",
]
# The "test" model (~0.2M parameters) learns to copy the tool's result in ~900 SFT steps (held-out success
# ~0.6 after SFT, greedy); the 1.8M "demo" model needs longer than the 15-minute budget allows on 2 cores.
FULL: DemoSettings = {
    "model_size": "test",
    "sft": dict(rows=8000, steps=900, batch_size=32, lr=3e-3),
    "grpo": [
        *COMMON,
        "rollout.prompts_per_step=8",
        "rollout.num_generations=8",
        "optim.learning_rate=5e-4",
        "optim.max_steps=40",
        "data.task_train_size=4000",
        "data.eval_size=200",
        "eval.every=10",
        "eval.batch_size=100",
        "checkpoint.save_every=0",
        "logging.sample_every=10",
    ],
}
QUICK: DemoSettings = {
    "model_size": "test",
    "sft": dict(rows=1000, steps=40, batch_size=32, lr=3e-3),
    "grpo": [
        *COMMON,
        "rollout.prompts_per_step=4",
        "rollout.num_generations=4",
        "optim.learning_rate=5e-4",
        "optim.max_steps=4",
        "data.task_train_size=500",
        "data.eval_size=20",
        "eval.every=2",
        "checkpoint.save_every=0",
        "logging.sample_every=2",
    ],
}
#: what the before / after table shows
KEYS = (EVAL_PASS_AT_1, EVAL_TOOLS_VALID_CALL_RATE, EVAL_TOOLS_CALLS_PER_EPISODE, EVAL_TOOLS_CUT_BY_BUDGET)


def _table(console, before: dict, after: dict, title: str) -> list[tuple[str, ...]]:
    from rich.table import Table

    table = Table(title=title)
    rows: list[tuple[str, ...]] = [("metric", "SFT warm-start", "after GRPO", "change")]
    for col in rows[0]:
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key in KEYS:
        b, a = before.get(key), after.get(key)
        if b is None or a is None:
            continue
        row = (key.removeprefix("eval/"), f"{b:.3f}", f"{a:.3f}", f"{a - b:+.3f}")
        table.add_row(*row)
        rows.append(row)
    console.print(table)
    return rows


def _rewards(process_only: bool) -> list[str]:
    """The reward specs of the GRPO stage: task success and the process rewards, or (--process-only) the
    process rewards alone with the task reward at weight 0."""
    if process_only:
        return [TASK_REWARD.replace("1.0", "0.0"), *PROCESS_ONLY_REWARDS]
    return [TASK_REWARD, *PROCESS_REWARDS]


def _grpo_config(
    out: Path, seed: int, settings: DemoSettings, process_only: bool, overrides: list[str] | None
) -> Config:
    """The GRPO stage's config: from the warm start in out/sft to out/grpo with the calculator demo's
    rewards, the settings' overrides, then the user's."""
    from grpokit.config import load_config

    return load_config(
        None,
        [
            f"model.name_or_path={out / 'sft'}",
            f"output_dir={out / 'grpo'}",
            f"seed={seed}",
            f"rewards=[{', '.join(_rewards(process_only))}]",
            *settings["grpo"],
            *(overrides or []),
        ],
    )


def run_tools_demo(
    out: Path,
    *,
    quick: bool = False,
    seed: int = 0,
    process_only: bool = False,
    overrides: list[str] | None = None,
) -> dict:
    """`grpokit demo --task tools`: the three stages on multiply with the calculator, then the before / after
    table, plots and report.md."""
    from rich.console import Console

    from grpokit.records import plot_metrics, write_report

    console, settings = Console(), QUICK if quick else FULL
    out = start_fresh(out)
    t_start = time.perf_counter()
    task, tok, model, n_params = tiny_model("multiply", out, settings, seed, console)
    pairs, stats, sft_time = warm_start(model, tok, task, settings["sft"], seed, 128, out)
    console.print(
        f"[bold]2/3[/] SFT on {len(pairs)} problems (half with a calculator call): "
        f"loss {stats.get('final_loss', float('nan')):.3f}, {sft_time:.0f}s"
    )

    cfg = _grpo_config(out, seed, settings, process_only, overrides)
    what = "process rewards only (task reward weight 0)" if process_only else "task success + process rewards"
    console.print(
        f"[bold]3/3[/] GRPO with the calculator, {what}: {cfg.optim.max_steps} steps of "
        f"{cfg.rollout.prompts_per_step} prompts x G={cfg.rollout.num_generations}, up to "
        f"{cfg.rollout.max_turns} turns"
    )
    grpo_time = train_grpo(cfg)

    evals = eval_rows(out / "grpo" / "metrics.jsonl")
    before, after = evals[0], evals[-1]
    title = f"held-out multiply with the calculator, {int(before[EVAL_NUM_PROMPTS])} problems (seed {seed})"
    rows = _table(console, before, after, title)
    plots = plot_metrics(out / "grpo" / "metrics.jsonl", out)
    total = time.perf_counter() - t_start
    flags = (" --quick" if quick else "") + (" --process-only" if process_only else "")
    notes = (
        f"Model: tiny Llama, {n_params / 1e6:.2f}M parameters. SFT: {len(pairs)} problems, {sft_time:.0f}s. "
        f"GRPO ({what}): {cfg.optim.max_steps} steps, {grpo_time:.0f}s. Total {total:.0f}s on "
        f"{torch.get_num_threads()} threads.\n\nReproduce: `grpokit demo --task tools{flags} --seed {seed}`"
    )
    write_report(
        out, title="grpokit demo: agentic GRPO with a calculator", summary_rows=rows, plots=plots, notes=notes
    )
    console.print(
        f"outputs in {out}: report.md, plots, grpo/metrics.jsonl, final model grpo/final ({total:.0f}s)"
    )
    return demo_result(before, after, sft_time, grpo_time, total)
