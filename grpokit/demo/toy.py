"""`grpokit demo --model tiny`: the whole pipeline on 2 CPU cores, no GPU, no downloads, no model wheel.

    grpokit demo --model tiny           # ~10 minutes: countdown, SFT warm-start, GRPO, 500 held-out problems
    grpokit demo --model tiny --quick   # ~1 minute smoke test with the same outputs

1. builds a character tokenizer and a tiny Llama (a few million parameters) from a config;
2. warms it up with SFT on countdown problems with one reference solution each;
3. trains it with GRPO on the countdown reward, evaluating on the same held-out problems
   (greedy pass@1, sampled pass@8 / maj@8) before and after;
4. writes metrics.jsonl, plots, report.md, report.html (the page of `grpokit report`) and the final model
   to --out, and prints a before / after table.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from grpokit.metrics.compute import (
    EVAL_FORMAT_RATE,
    EVAL_MEAN_LENGTH,
    EVAL_NUM_PROMPTS,
    EVAL_PASS_AT_1,
    eval_maj_at,
    eval_mean_at,
    eval_pass_at,
    read_metrics,
)

if TYPE_CHECKING:
    from grpokit.config import Config


class SFTSettings(TypedDict):
    rows: int
    steps: int
    batch_size: int
    lr: float


class DemoSettings(TypedDict):
    model_size: str  # build_tiny_llama's size
    sft: SFTSettings  # the warm-start
    grpo: list[str]  # config overrides


# Settings found in the trials of docs/demo_tuning.md; every GRPO key is a normal config override.
FULL: DemoSettings = {
    "model_size": "demo",
    "sft": dict(rows=20000, steps=900, batch_size=64, lr=1e-3),
    "grpo": [
        "rollout.engine=fast",
        "rollout.prompts_per_step=16",
        "rollout.num_generations=8",
        "rollout.max_completion_length=16",
        "rollout.temperature=1.0",
        "algorithm.beta=0.0",
        "optim.learning_rate=1e-4",
        "optim.lr_scheduler=cosine",
        "optim.warmup_steps=50",
        "optim.max_steps=400",
        "data.task_train_size=10000",
        "data.eval_size=500",
        "eval.every=100",
        "eval.k=8",
        "eval.batch_size=250",
        "checkpoint.save_every=100",
        "logging.sample_every=50",
    ],
}
QUICK: DemoSettings = {
    "model_size": "test",
    "sft": dict(rows=2000, steps=32, batch_size=64, lr=3e-3),
    "grpo": [
        "rollout.engine=fast",
        "rollout.prompts_per_step=8",
        "rollout.num_generations=8",
        "rollout.max_completion_length=16",
        "algorithm.beta=0.0",
        "optim.learning_rate=5e-4",
        "optim.max_steps=10",
        "data.task_train_size=2000",
        "data.eval_size=100",
        "eval.k=4",
        "checkpoint.save_every=5",
        "logging.sample_every=5",
    ],
}


def eval_rows(metrics_path: Path) -> list[dict]:
    return [r for r in read_metrics(metrics_path) if r.get(EVAL_PASS_AT_1) is not None]


def _before_after(console, before: dict, after: dict, k: int, seed: int) -> list[tuple[str, ...]]:
    """Print the held-out table (SFT warm-start vs after GRPO) and return its rows for the report."""
    from rich.table import Table

    keys = [
        EVAL_PASS_AT_1,
        eval_mean_at(k),
        eval_pass_at(k),
        eval_maj_at(k),
        EVAL_FORMAT_RATE,
        EVAL_MEAN_LENGTH,
    ]
    table = Table(title=f"held-out countdown, {int(before[EVAL_NUM_PROMPTS])} problems (seed {seed})")
    for col in ("metric", "SFT warm-start", "after GRPO", "change"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    rows: list[tuple[str, ...]] = [("metric", "SFT warm-start", "after GRPO", "change")]
    for key in keys:
        b, a = before.get(key), after.get(key)
        if b is None or a is None:
            continue
        pct = key != EVAL_MEAN_LENGTH
        fmt = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.1f}")
        change = f"{100 * (a - b):+.1f} pts" if pct else f"{a - b:+.1f}"
        table.add_row(key.removeprefix("eval/"), fmt(b), fmt(a), change)
        rows.append((key.removeprefix("eval/"), fmt(b), fmt(a), change))
    console.print(table)
    return rows


def start_fresh(out: Path) -> Path:
    """The output folder, created; a demo always starts fresh, and only its own folders are removed."""
    out = Path(out)
    for owned in ("sft", "grpo"):
        shutil.rmtree(out / owned, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def tiny_model(task_name: str, out: Path, settings: DemoSettings, seed: int, console) -> tuple:
    """Stage 1: the task, its character tokenizer (saved to out/sft) and a tiny Llama; (task, tokenizer,
    model, parameter count)."""
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    task = get_task(task_name)
    tok = build_tokenizer(task, out / "sft")
    model = build_tiny_llama(tok, size=settings["model_size"], seed=seed)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]1/3[/] tiny Llama: {n_params / 1e6:.2f}M parameters, vocabulary {len(tok)} characters"
    )
    return task, tok, model, n_params


def warm_start(model, tok, task, sft: SFTSettings, seed: int, max_length: int, out: Path) -> tuple:
    """Stage 2: SFT on the task's train split, read as training reads it ("completion" is its reference
    solution); the model and tokenizer saved to out/sft. (pairs, train_sft's stats, seconds)."""
    from grpokit.config import DataConfig
    from grpokit.data import build_datasets
    from grpokit.sft import train_sft

    pairs = build_datasets(DataConfig(task=task.name, task_train_size=sft["rows"]), tok, seed=seed).train
    t = time.perf_counter()
    stats = train_sft(
        model,
        tok,
        pairs,
        max_steps=sft["steps"],
        batch_size=sft["batch_size"],
        learning_rate=sft["lr"],
        max_length=max_length,
        seed=seed,
    )
    model.save_pretrained(out / "sft")
    tok.save_pretrained(out / "sft")
    return pairs, stats, time.perf_counter() - t


def train_grpo(cfg: Config) -> float:
    """Stage 3: GRPO from the warm start; its seconds."""
    from grpokit.trainer import Trainer

    t = time.perf_counter()
    Trainer(cfg).train()
    return time.perf_counter() - t


def _grpo_config(out: Path, seed: int, settings: DemoSettings, overrides: list[str] | None) -> Config:
    """The GRPO stage's config: from the warm start in out/sft to out/grpo, the settings' overrides, then
    the user's."""
    from grpokit.config import load_config

    return load_config(
        None,
        [
            f"model.name_or_path={out / 'sft'}",
            "data.task=countdown",
            f"output_dir={out / 'grpo'}",
            f"seed={seed}",
            *settings["grpo"],
            *(overrides or []),
        ],
    )


def demo_result(before: dict, after: dict, sft_time: float, grpo_time: float, total: float) -> dict:
    """What run_demo and run_tools_demo return."""
    return {
        "before": before,
        "after": after,
        "sft_time": sft_time,
        "grpo_time": grpo_time,
        "total_time": total,
    }


def _write_reports(out: Path, rows: list[tuple[str, ...]], plots, notes: str) -> tuple[Path, Path]:
    """report.md (the before / after table, the plots, the notes) and report.html (grpokit report's page)."""
    from grpokit.records import write_report
    from grpokit.records.report import write_html_report

    report = write_report(
        out, title="grpokit demo: GRPO on countdown", summary_rows=rows, plots=plots, notes=notes
    )
    page = write_html_report(
        out / "grpo",
        out / "report.html",
        title="grpokit demo: GRPO on countdown",
        notes=notes.replace("`", ""),
    )
    return report, page


def run_demo(out: Path, *, quick: bool = False, seed: int = 0, overrides: list[str] | None = None) -> dict:
    """`grpokit demo --model tiny`: the three stages on countdown, then the before / after table, plots and
    reports."""
    from rich.console import Console

    from grpokit.records import plot_metrics

    console = Console()
    settings = QUICK if quick else FULL
    out = start_fresh(out)
    t_start = time.perf_counter()
    task, tok, model, n_params = tiny_model("countdown", out, settings, seed, console)
    pairs, stats, sft_time = warm_start(model, tok, task, settings["sft"], seed, 256, out)
    console.print(
        f"[bold]2/3[/] SFT on {len(pairs)} solved problems: loss "
        f"{stats.get('final_loss', float('nan')):.3f}, {sft_time:.0f}s"
    )

    cfg = _grpo_config(out, seed, settings, overrides)
    console.print(
        f"[bold]3/3[/] GRPO: {cfg.optim.max_steps} steps of {cfg.rollout.prompts_per_step} prompts x "
        f"G={cfg.rollout.num_generations}"
    )
    grpo_time = train_grpo(cfg)

    evals = eval_rows(out / "grpo" / "metrics.jsonl")
    before, after = evals[0], evals[-1]
    rows = _before_after(console, before, after, cfg.eval.k, seed)
    plots = plot_metrics(out / "grpo" / "metrics.jsonl", out)
    total = time.perf_counter() - t_start
    notes = (
        f"Model: tiny Llama, {n_params / 1e6:.2f}M parameters. SFT: {len(pairs)} problems, {sft_time:.0f}s. "
        f"GRPO: {cfg.optim.max_steps} steps, {grpo_time:.0f}s. Total {total:.0f}s on "
        f"{torch.get_num_threads()} threads.\n\nReproduce: `grpokit demo --model tiny"
        f"{' --quick' if quick else ''} --seed {seed}`"
    )
    report, page = _write_reports(out, rows, plots, notes)
    console.print(
        f"outputs in {out}: {page.name} (open it in a browser), {report.name}, plots, grpo/metrics.jsonl, "
        f"final model grpo/final ({total:.0f}s)"
    )
    return demo_result(before, after, sft_time, grpo_time, total)
