"""Supervised warm-start (SFT) of any Hugging Face causal LM on (prompt, completion) pairs.

    grpokit sft sft.yaml model.name_or_path=runs/tiny-model data.train_path=pairs.jsonl output_dir=runs/sft
    # -> run_sft(cfg): progress bar, metrics.jsonl, held-out loss / exact match, runs/sft/final

    from grpokit.sft import train_sft
    stats = train_sft(model, tokenizer, [{"prompt": "7 3>21=", "completion": "7*3"}], epochs=3)

Settings are grpokit.config.SFTSection (the `sft:` section of the config): one set of defaults for the
command and for train_sft's keyword arguments.

GRPO learns only from the rewards of what the policy samples, so a policy that never
samples a correct answer learns nothing; a short SFT on reference solutions puts it where
sampling sometimes succeeds (the demo's warm start). The loss is the cross-entropy of the
completion tokens only, EOS included: prompt tokens and padding get label -100.

Data comes through grpokit.data like training data (JSONL / JSON / Parquet / CSV / a datasets
folder, a "prompt" column rendered as for GRPO: the tokenizer's BOS for a string, the chat
template with the generation prompt for messages, the system prompt), plus a "completion"
column encoded without special tokens and followed by EOS -- the same token boundary as a
rollout, which samples completion tokens after the prompt's tokens. Batches are right-padded,
so position ids are simply 0..T-1 for every row. AdamW (no weight decay on norms and biases),
linear warm-up then cosine or linear decay to 0 (grpokit.policy.optim's schedules), gradient clipping;
deterministic for a given seed on a given machine.
"""

from __future__ import annotations

import functools
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpokit.checkpoint import RunLock, ensure_writable_dir, save_pretrained_atomic
from grpokit.config import DataConfig, SFTConfig, SFTSection
from grpokit.data import PromptDataset, build_datasets
from grpokit.metrics.compute import (
    EVAL_EXACT_MATCH,
    EVAL_LOSS,
    PERF_TRAIN_TOKENS_PER_S,
    SFT_EPOCH,
    SFT_GRAD_NORM,
    SFT_LOSS,
    SFT_LR,
)
from grpokit.policy import load_policy
from grpokit.policy.optim import adamw, lr_lambda
from grpokit.policy.padding_free import resolve_padding_free

IGNORE_INDEX = -100  # label of tokens the loss skips (prompt, padding)


# --- data ------------------------------------------------------------------------------
def load_pairs(
    path: str | Path, tokenizer: Any, *, system_prompt: str | None = None, max_prompt_length: int = 512
) -> PromptDataset:
    """(prompt, completion) rows of a data file, read and rendered by grpokit.data (build_datasets)."""
    data_cfg = DataConfig(
        train_path=str(path), system_prompt=system_prompt, max_prompt_length=max_prompt_length
    )
    return build_datasets(data_cfg, tokenizer, seed=0, required_columns=("completion",)).train


def _as_dataset(
    pairs: Sequence[dict[str, Any]] | PromptDataset, tokenizer: Any, max_length: int
) -> PromptDataset:
    if isinstance(pairs, PromptDataset):
        return pairs
    # Rendered as training prompts are; the whole sequence is cut at max_length.
    return PromptDataset(pairs, tokenizer, max_prompt_length=max_length, overlong="truncate")


def encode_pair(
    tokenizer: Any, prompt_ids: list[int], completion: str, max_length: int
) -> tuple[list[int], list[int], bool]:
    """(input ids, labels, truncated) of one example: the rendered prompt's ids, then the completion and EOS;
    labels are IGNORE_INDEX on the prompt."""
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = list(prompt_ids) + completion_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + completion_ids
    truncated = len(ids) > max_length
    return ids[:max_length], labels[:max_length], truncated


def collate(
    examples: list[tuple[list[int], list[int]]], pad_id: int, packed: bool = False
) -> dict[str, torch.Tensor]:
    """Right-padded batch: with the padding at the end, position ids are 0..T-1 on every row. packed
    (model.padding_free): the examples back to back in one row [1, L], position ids restarting at each and
    no attention mask, which transformers reads as packed sequences (attention stays inside each); the
    first token of each example is never a target (no position of its own example predicts it)."""
    if packed:
        input_ids = torch.tensor([[t for ids, _ in examples for t in ids]])  # [1, L]
        labels = torch.tensor([[x for _, lab in examples for x in [IGNORE_INDEX, *lab[1:]]]])  # [1, L]
        position_ids = torch.tensor([[p for ids, _ in examples for p in range(len(ids))]])  # [1, L]
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    T = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), T), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(examples), T), dtype=torch.long)  # [B, T]
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(ids)] = 1
    position_ids = torch.arange(T).expand(len(examples), T)  # [B, T]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


def completion_loss(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the completion tokens of the batch, and how many there are."""
    # a packed batch has no attention mask (collate); use_cache=False: with a cache, packed sequences would
    # attend to the ones before them
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits  # [B, T, V]
    targets = batch["labels"][:, 1:]  # token t+1 is predicted at position t
    n_tokens = int((targets != IGNORE_INDEX).sum())
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss / max(n_tokens, 1), n_tokens


# --- training --------------------------------------------------------------------------
def _examples(tokenizer: Any, pairs: PromptDataset, max_length: int, column: str) -> tuple[list, int]:
    """[(input ids, labels)] of every pair, and how many were cut at max_length."""
    rows = [pairs[i] for i in range(len(pairs))]
    encoded = [encode_pair(tokenizer, r.prompt_ids, str(r.columns[column]), max_length) for r in rows]
    return [(ids, labels) for ids, labels, _ in encoded], sum(t for _, _, t in encoded)


def _optimizer(model: Any, lr: float, weight_decay: float, schedule: Callable[[int], float]):
    """AdamW with no weight decay on norms and biases, and its LambdaLR schedule."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    # The per-tensor AdamW (fused=False) keeps the demo's SFT warm start bit for bit what it was measured
    # with.
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = adamw(groups, lr=lr, fused=False)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def _update(model: Any, optimizer, scheduler, batch: dict[str, torch.Tensor], max_grad_norm: float):
    """One optimizer step on one batch: (loss, completion tokens, gradient norm before clipping)."""
    loss, n_tokens = completion_loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    # 0 = off, as optim.max_grad_norm (clipping at 0 would scale every gradient to zero: a frozen model).
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
    optimizer.step()
    scheduler.step()
    return loss, n_tokens, grad_norm


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def evaluate_sft(
    model: Any,
    tokenizer: Any,
    pairs: PromptDataset,
    *,
    column: str = "completion",
    max_length: int = 1024,
    batch_size: int = 32,
    packed: bool = False,
) -> dict[str, float]:
    """Held-out eval/loss (completion cross-entropy per token) and eval/exact_match (the greedy completion,
    stripped, equals the reference): the two numbers that say whether SFT has taught the format and the
    task."""
    from grpokit.rollout import SamplingParams, make_engine

    examples, _ = _examples(tokenizer, pairs, max_length, column)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    for s in range(0, len(examples), batch_size):
        collated = collate(examples[s : s + batch_size], pad_id, packed)
        batch = {k: v.to(_device(model)) for k, v in collated.items()}
        loss, n = completion_loss(model, batch)
        loss_sum, tokens = loss_sum + loss.item() * n, tokens + n
    rows = [pairs[i] for i in range(len(pairs))]
    references = [str(r.columns[column]).strip() for r in rows]
    longest = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in references) + 1  # + EOS
    engine = make_engine("hf", model, tokenizer, batch_size=batch_size)
    comps = engine.generate([r.prompt_ids for r in rows], 1, SamplingParams(max_tokens=longest, greedy=True))
    model.train(was_training)
    exact = sum(text.strip() == ref for text, ref in zip(comps.texts, references, strict=True)) / len(rows)
    return {EVAL_LOSS: loss_sum / max(tokens, 1), EVAL_EXACT_MATCH: exact}


def sft_steps(cfg: SFTSection, num_pairs: int) -> int:
    """Optimizer steps of a run: sft.max_steps, else sft.epochs passes of batch_size pairs."""
    return cfg.max_steps or max(1, round(cfg.epochs * math.ceil(num_pairs / cfg.batch_size)))


def _training_data(
    tokenizer: Any,
    pairs: Sequence[dict[str, Any]] | PromptDataset,
    eval_pairs: Sequence[dict[str, Any]] | PromptDataset | None,
    cfg: SFTSection,
) -> tuple[list, int, PromptDataset | None]:
    """The encoded training examples, how many were cut at sft.max_length, and the held-out pairs (None
    without any); a ValueError when the tokenizer has no EOS or there are no training pairs."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; SFT appends EOS to every completion")
    if not len(pairs):
        raise ValueError("no training pairs")
    examples, n_truncated = _examples(
        tokenizer, _as_dataset(pairs, tokenizer, cfg.max_length), cfg.max_length, cfg.completion_column
    )
    held_out = (
        _as_dataset(eval_pairs, tokenizer, cfg.max_length)
        if eval_pairs is not None and len(eval_pairs)
        else None
    )
    return examples, n_truncated, held_out


def _evaluate_held_out(
    model: Any, tokenizer: Any, held_out: PromptDataset | None, cfg: SFTSection, packed: bool = False
) -> dict[str, float]:
    """evaluate_sft on the held-out pairs with the run's settings; {} without held-out pairs."""
    if not held_out:
        return {}
    return evaluate_sft(
        model,
        tokenizer,
        held_out,
        column=cfg.completion_column,
        max_length=cfg.max_length,
        batch_size=cfg.batch_size,
        packed=packed,
    )


def _epoch_batches(num_examples: int, batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Indices of the examples of each batch, endlessly: every epoch reshuffled by `rng`, and a batch never
    mixes two epochs (an epoch's last partial batch is dropped)."""
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            order = list(range(num_examples))
            rng.shuffle(order)
        idx, order = order[:batch_size], order[batch_size:]
        yield idx


@dataclass
class _LogWindow:
    """Sums over the steps since the last log step: completion loss x tokens, completion tokens, and all
    tokens (prompt included, for the throughput)."""

    start: float
    loss: float = 0.0
    tokens: int = 0
    all_tokens: int = 0

    def add(self, loss: float, n_tokens: int, n_all: int) -> None:
        self.loss, self.tokens = self.loss + loss * n_tokens, self.tokens + n_tokens
        self.all_tokens += n_all

    def flush(self, scheduler: Any, grad_norm: torch.Tensor, epoch: float) -> dict[str, float]:
        """The sft/* metrics of a log step (the window's mean loss and throughput); starts a new window."""
        now = time.perf_counter()
        metrics = {
            SFT_LOSS: self.loss / max(self.tokens, 1),
            SFT_LR: scheduler.get_last_lr()[0],
            SFT_GRAD_NORM: float(grad_norm),
            SFT_EPOCH: epoch,
            PERF_TRAIN_TOKENS_PER_S: self.all_tokens / max(now - self.start, 1e-9),
        }
        self.start, self.loss, self.tokens, self.all_tokens = now, 0.0, 0, 0
        return metrics


@dataclass
class _LoopResult:
    losses: list[float]  # per step
    completion_tokens: int
    last_metrics: dict[str, float]  # of the last step (a log and eval step)


def _train_loop(
    model: Any,
    optimizer: Any,
    scheduler: Any,
    examples: list,
    pad_id: int,
    cfg: SFTSection,
    total: int,
    order_rng: random.Random,
    evaluate: Callable[[], dict[str, float]],
    on_step: Callable[[int, dict[str, float]], None] | None,
    packed: bool = False,
) -> _LoopResult:
    """The `total` optimizer steps, with logging every log_every steps and held-out evaluation every
    eval_every steps and at the end."""
    batches = _epoch_batches(len(examples), cfg.batch_size, order_rng)
    window = _LogWindow(start=time.perf_counter())
    result = _LoopResult(losses=[], completion_tokens=0, last_metrics={})
    for step in range(1, total + 1):
        rows = collate([examples[i] for i in next(batches)], pad_id, packed)
        batch = {k: v.to(_device(model)) for k, v in rows.items()}
        loss, n_tokens, grad_norm = _update(model, optimizer, scheduler, batch, cfg.max_grad_norm)
        result.losses.append(loss.item())
        result.completion_tokens += n_tokens
        real = batch["attention_mask"].sum() if not packed else batch["input_ids"].numel()  # all real
        window.add(loss.item(), n_tokens, int(real))
        metrics: dict[str, float] = {}
        if step % cfg.log_every == 0 or step == total:
            metrics = window.flush(scheduler, grad_norm, step * cfg.batch_size / len(examples))
        if step == total or (cfg.eval_every and step % cfg.eval_every == 0):
            metrics.update(evaluate())
            model.train()
        if on_step is not None:
            on_step(step, metrics)
        result.last_metrics = metrics
    return result


def train_sft(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[dict[str, Any]] | PromptDataset,
    *,
    eval_pairs: Sequence[dict[str, Any]] | PromptDataset | None = None,
    seed: int = 0,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    padding_free: bool | str = False,
    **settings: Any,
) -> dict[str, Any]:
    """Fine-tune `model` in place on `pairs` (rows with "prompt" and the completion column, or a PromptDataset
    of them: load_pairs, build_datasets) and return final stats.

    settings: grpokit.config.SFTSection's keys (epochs, max_steps, batch_size, learning_rate, lr_scheduler,
    warmup_ratio, warmup_steps, weight_decay, max_grad_norm, max_length, completion_column, log_every,
    eval_every), with its defaults; a bad value is a ValueError that names the key.
    eval_pairs: held-out pairs, evaluated (evaluate_sft) before training, every eval_every steps and at the
    end. on_step(step, metrics): after every step; metrics hold sft/* (and eval/*) on log (and eval) steps,
    else {}; and with step 0 and the held-out metrics before training. padding_free (model.padding_free):
    each batch's pairs back to back in one row, no padding (collate); the same loss and gradients. "auto":
    where the model keeps packed pairs apart (else padded, said in one line).
    """
    cfg = SFTSection(**settings)
    padding_free, line = resolve_padding_free(model, padding_free)  # attention must stay inside each pair
    if line is not None:
        print(line, flush=True)
    examples, n_truncated, held_out = _training_data(tokenizer, pairs, eval_pairs, cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    evaluate = functools.partial(_evaluate_held_out, model, tokenizer, held_out, cfg, padding_free)
    total = sft_steps(cfg, len(examples))
    torch.manual_seed(seed)  # dropout, if the model has any
    order_rng = random.Random(seed)
    schedule = lr_lambda(cfg.lr_scheduler, cfg.warmup_steps or int(cfg.warmup_ratio * total), total)
    optimizer, scheduler = _optimizer(model, cfg.learning_rate, cfg.weight_decay, schedule)

    was_training = model.training
    first_eval = evaluate()
    if on_step is not None and first_eval:
        on_step(0, first_eval)
    model.train()
    start = time.perf_counter()
    loop = _train_loop(
        model, optimizer, scheduler, examples, pad_id, cfg, total, order_rng, evaluate, on_step, padding_free
    )
    model.train(was_training)
    tail = loop.losses[-max(1, len(loop.losses) // 10) :]  # the last 10% of steps
    return {
        "steps": total,
        "epochs": total * cfg.batch_size / len(examples),
        "examples": len(examples),
        "truncated": n_truncated,
        "completion_tokens": loop.completion_tokens,
        "first_loss": loop.losses[0],
        "final_loss": sum(tail) / len(tail),
        "time_s": time.perf_counter() - start,
        "eval_before": first_eval,
        "eval_after": loop.last_metrics if held_out else {},
    }


def run_sft(cfg: SFTConfig, *, console: Any = None) -> dict[str, Any]:
    """`grpokit sft`: load model.name_or_path, read the data as training does (build_datasets:
    data.train_path, held-out data.eval_path / data.eval_size), train with a progress bar, write metrics.jsonl
    (and the enabled trackers) to output_dir, the model + tokenizer to output_dir/final and the stats to
    output_dir/sft_stats.json. Returns the stats (train_sft's); `console` (rich) prints the end-of-run
    table."""
    out = ensure_writable_dir(cfg.output_dir)
    with RunLock(out):  # one run per output_dir
        return _run_sft(cfg, out, console)


def _run_sft(cfg: SFTConfig, out: Path, console: Any) -> dict[str, Any]:
    from grpokit.metrics.compute import METRICS_FILE
    from grpokit.records import MetricLogger, TrainProgress, plot_metrics

    model, tokenizer = load_policy(cfg.model)
    data = build_datasets(cfg.data, tokenizer, seed=cfg.seed, required_columns=(cfg.sft.completion_column,))
    log = MetricLogger(out, **cfg.logging.trackers(), config=cfg.model_dump())
    log.truncate_after(-1)  # SFT does not resume: a rerun in this output_dir starts its metrics fresh
    n = len(data.train)
    total = sft_steps(cfg.sft, n)
    try:
        with TrainProgress(total, keys=(SFT_LOSS, EVAL_LOSS, EVAL_EXACT_MATCH), console=console) as progress:

            def on_step(step: int, metrics: dict[str, float]) -> None:
                if metrics:
                    log.log(step, metrics)
                progress.update(step, metrics)

            stats = train_sft(
                model,
                tokenizer,
                data.train,
                eval_pairs=data.eval,
                seed=cfg.seed,
                on_step=on_step,
                padding_free=cfg.model.padding_free,
                **cfg.sft.model_dump(),
            )
    finally:
        log.close()
    save_pretrained_atomic(model, tokenizer, out / "final")
    (out / "sft_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    plot_metrics(out / METRICS_FILE, out)
    if console is not None:
        console.print(summary_table(stats, out / "final"))
    return stats


def summary_table(stats: dict[str, Any], final: Path):
    """The end-of-run table of `grpokit sft`."""
    from rich.table import Table

    table = Table(title=f"SFT: {stats['steps']} steps, {stats['epochs']:.2f} epochs; model in {final}")
    for col in ("", "value"):
        table.add_column(col, justify="right" if col else "left")
    rows = [
        ("pairs (cut at sft.max_length)", f"{stats['examples']} ({stats['truncated']})"),
        ("loss: first step -> last 10% of steps", f"{stats['first_loss']:.4f} -> {stats['final_loss']:.4f}"),
        ("completion tokens trained on", f"{stats['completion_tokens']}"),
        ("time", f"{stats['time_s']:.1f} s"),
    ]
    before, after = stats["eval_before"], stats["eval_after"]
    for key in (EVAL_LOSS, EVAL_EXACT_MATCH):
        if key in before and key in after:
            rows.append(
                (
                    f"held-out {key.removeprefix('eval/')}: before -> after",
                    f"{before[key]:.4f} -> {after[key]:.4f}",
                )
            )
    for row in rows:
        table.add_row(*row)
    return table
