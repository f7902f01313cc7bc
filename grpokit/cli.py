"""The `grpokit` command line.

    grpokit train config.yaml [section.key=value ...]     train (resumes when output_dir holds a checkpoint)
    grpokit eval MODEL_DIR --config config.yaml            held-out pass@1 / pass@k / maj@k
    grpokit sft MODEL_DIR DATA.jsonl --out DIR             supervised warm-start on prompt / completion pairs
    grpokit demo [--quick] [--out DIR]                     the whole pipeline on a tiny model, no downloads
    grpokit doctor RUN_DIR                                 what looks wrong in a run, with step ranges and fixes
    grpokit config                                         every config key with its default and meaning

User mistakes (bad config, missing data, unloadable model) print one line and exit with status 2.
`grpokit train` stopped by SIGTERM / SIGINT saves a checkpoint and exits with 128 + the signal
number (143 / 130); the same command resumes. docs/errors.md lists every message.
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="GRPO and its family for Hugging Face causal LMs.")


def _user_errors() -> tuple[type[BaseException], ...]:
    from grpokit.checkpoint import CheckpointError
    from grpokit.config import ConfigError
    from grpokit.data import DataError
    from grpokit.optim import TrainingError
    from grpokit.policy import ModelLoadError

    return (ConfigError, ModelLoadError, CheckpointError, TrainingError, DataError)


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _run(fn):
    """Run fn, turning a user mistake into one line on stderr and exit status 2 (no traceback)."""
    try:
        return fn()
    except _user_errors() as exc:
        _fail(str(exc))


@app.command()
def train(
    config: Path = typer.Argument(..., help="YAML config file"),
    overrides: Optional[list[str]] = typer.Argument(None, help="section.key=value overrides"),
):
    """Train a causal LM with GRPO as the config says (PPO with a critic when algorithm.advantage_estimator=gae)."""
    from grpokit.config import load_config

    def go():
        cfg = load_config(config, overrides)
        from grpokit.checkpoint import ensure_writable_dir
        from grpokit.trainer import Trainer

        ensure_writable_dir(cfg.output_dir)  # before loading the model, so a bad path fails in a second
        trainer = Trainer(cfg)  # with a critic (grpokit/critic.py) when algorithm.advantage_estimator=gae
        last = trainer.train()
        if trainer.interrupted:  # saved; the trainer printed the step and how to resume
            raise typer.Exit(128 + signal.Signals[trainer.interrupted].value)
        typer.echo(f"done: step {trainer.step}; final model in {Path(cfg.output_dir) / 'final'}")
        return last

    _run(go)


@app.command("eval")
def eval_cmd(
    model: Path = typer.Argument(..., help="model folder (from_pretrained), e.g. runs/x/final"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="config with data / rewards / eval sections"),
    overrides: Optional[list[str]] = typer.Argument(None, help="section.key=value overrides"),
):
    """Evaluate a model on the held-out set with fixed decoding."""
    from grpokit.config import load_config

    def go():
        cfg = load_config(config, [*(overrides or []), f"model.name_or_path={model}"])
        from grpokit.trainer import Trainer

        trainer = Trainer(cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"beta": 0.0})}))
        metrics = trainer.evaluate()
        if not metrics:
            _fail("no held-out data: set data.eval_path, data.eval_size or data.task")
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"held-out evaluation of {model}")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for k, v in metrics.items():
            table.add_row(k, f"{v:.4f}")
        Console().print(table)

    _run(go)


@app.command()
def sft(
    model: Path = typer.Argument(..., help="model folder to start from"),
    data: Path = typer.Argument(..., help="JSONL / CSV with prompt and completion columns"),
    out: Path = typer.Option(..., "--out", "-o", help="where to save the fine-tuned model"),
    epochs: float = typer.Option(1.0, help="passes over the data"),
    lr: float = typer.Option(1e-4, help="AdamW learning rate"),
    batch_size: int = typer.Option(32, help="pairs per optimizer step"),
    seed: int = typer.Option(0),
):
    """Supervised fine-tuning on completion tokens only (the usual warm-start before RL)."""
    from grpokit.sft import run_sft

    def go():
        try:
            stats = run_sft(str(model), str(data), str(out), epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
        except (ValueError, FileNotFoundError) as exc:
            _fail(str(exc).splitlines()[0])
        typer.echo(f"saved to {out}: {stats}")

    _run(go)


@app.command()
def demo(
    quick: bool = typer.Option(False, "--quick", help="about a minute: a smoke test with the same outputs"),
    out: Path = typer.Option(Path("runs/demo"), "--out", help="output folder"),
    seed: int = typer.Option(0, help="seed for data, model and training"),
):
    """Tiny model, SFT warm-start, GRPO on countdown, before / after table and plots. No GPU, no downloads."""
    from grpokit.demo import run_demo

    _run(lambda: run_demo(out, quick=quick, seed=seed))


@app.command()
def doctor(run_dir: Path = typer.Argument(..., help="a run's output_dir (or its metrics.jsonl)")):
    """Read a run's metrics and report known GRPO problems with step ranges and fixes (seed Q24)."""
    from grpokit.doctor import doctor_main

    raise typer.Exit(doctor_main(str(run_dir)))


@app.command("config")
def config_cmd():
    """Every config key with its default and what it does."""
    from rich.console import Console
    from rich.table import Table

    from grpokit.config import describe

    table = Table(title="grpokit config keys")
    for col in ("key", "default", "meaning"):
        table.add_column(col)
    for row in describe():
        table.add_row(*row)
    Console().print(table)


def main() -> None:
    try:  # transformers' per-file progress bars drown the training progress
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    app()


if __name__ == "__main__":
    sys.exit(main())
