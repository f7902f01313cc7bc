"""Supervised warm-start (SFT) of any Hugging Face causal LM on (prompt, completion) pairs.

    grpokit sft MODEL_DIR pairs.jsonl OUT_DIR      # -> run_sft(MODEL_DIR, pairs.jsonl, OUT_DIR)

    from grpokit.sft import train_sft
    stats = train_sft(model, tokenizer, [{"prompt": "7 3>21=", "completion": "7*3"}], epochs=3)

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
linear warm-up then cosine or linear decay to 0 (grpokit.optim's schedules), gradient clipping;
deterministic for a given seed on a given machine.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from grpokit.config import DataConfig
from grpokit.data import PromptDataset, build_datasets
from grpokit.optim import SCHEDULES, adamw, lr_lambda
from grpokit.policy import load_model, load_tokenizer

IGNORE_INDEX = -100  # label of tokens the loss skips (prompt, padding)


# --- data ------------------------------------------------------------------------------
def load_pairs(path: str | Path, tokenizer: Any, *, system_prompt: str | None = None, max_prompt_length: int = 512) -> PromptDataset:
    """(prompt, completion) rows of a data file, read and rendered by grpokit.data (build_datasets)."""
    data_cfg = DataConfig(train_path=str(path), system_prompt=system_prompt, max_prompt_length=max_prompt_length)
    return build_datasets(data_cfg, tokenizer, seed=0, required_columns=("completion",)).train


def encode_pair(tokenizer: Any, prompt_ids: list[int], completion: str, max_length: int) -> tuple[list[int], list[int], bool]:
    """(input ids, labels, truncated) of one example: the rendered prompt's ids, then the completion and EOS;
    labels are IGNORE_INDEX on the prompt."""
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = list(prompt_ids) + completion_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + completion_ids
    truncated = len(ids) > max_length
    return ids[:max_length], labels[:max_length], truncated


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: with the padding at the end, position ids are 0..T-1 on every row."""
    T = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), T), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(examples), T), dtype=torch.long)  # [B, T]
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(ids)] = 1
    position_ids = torch.arange(T).expand(len(examples), T)  # [B, T]
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "position_ids": position_ids}


def completion_loss(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the completion tokens of the batch, and how many there are."""
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits  # [B, T, V]
    targets = batch["labels"][:, 1:]  # token t+1 is predicted at position t
    n_tokens = int((targets != IGNORE_INDEX).sum())
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss / max(n_tokens, 1), n_tokens


# --- training --------------------------------------------------------------------------
def _examples(tokenizer: Any, pairs: Sequence[dict[str, Any]] | PromptDataset, max_length: int) -> tuple[list, int]:
    """[(input ids, labels)] of every pair, and how many were cut at max_length."""
    if not isinstance(pairs, PromptDataset):  # rendered as training prompts are; the whole sequence is cut at max_length
        pairs = PromptDataset(pairs, tokenizer, max_prompt_length=max_length, overlong="truncate")
    rows = [pairs[i] for i in range(len(pairs))]
    encoded = [encode_pair(tokenizer, r.prompt_ids, str(r.columns["completion"]), max_length) for r in rows]
    return [(ids, labels) for ids, labels, _ in encoded], sum(t for _, _, t in encoded)


def _optimizer(model: Any, lr: float, weight_decay: float, schedule: Callable[[int], float]):
    """AdamW with no weight decay on norms and biases, and its LambdaLR schedule."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    # The per-tensor AdamW (fused=False) keeps the demo's SFT warm start bit for bit what it was measured with.
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = adamw(groups, lr=lr, fused=False)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def _check_arguments(tokenizer: Any, pairs: Any, epochs: float | None, steps: int | None, schedule: str) -> None:
    if epochs is not None and steps is not None:
        raise ValueError("give epochs or steps, not both")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; SFT appends EOS to every completion")
    if not len(pairs):
        raise ValueError("no training pairs")


def _update(model: Any, optimizer, scheduler, batch: dict[str, torch.Tensor], max_grad_norm: float):
    """One optimizer step on one batch: (loss, completion tokens, gradient norm before clipping)."""
    loss, n_tokens = completion_loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    return loss, n_tokens, grad_norm


def train_sft(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[dict[str, Any]] | PromptDataset,
    *,
    epochs: float | None = None,
    steps: int | None = None,
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup: float = 0.05,
    schedule: str = "cosine",
    weight_decay: float = 0.01,
    max_grad_norm: float = 1.0,
    max_length: int = 256,
    seed: int = 0,
    log_every: int = 20,
    log_fn: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune `model` in place on `pairs` (rows {"prompt", "completion"}, or a PromptDataset whose rows
    have a "completion" column: load_pairs) and return final stats.

    Length of training: `epochs` (passes over the pairs, may be fractional) or `steps`
    (optimizer steps of `batch_size` pairs); neither means one epoch.
    warmup: a number of steps if >= 1, else a fraction of all steps.
    schedule: "cosine" | "linear" (decay to 0 after warm-up) | "constant".
    log_fn: called every `log_every` steps and at the end with {"step", "loss", "lr", ...}.
    """
    _check_arguments(tokenizer, pairs, epochs, steps, schedule)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples, n_truncated = _examples(tokenizer, pairs, max_length)
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    total = steps if steps is not None else max(1, round((1.0 if epochs is None else epochs) * steps_per_epoch))
    warmup_steps = int(warmup) if warmup >= 1 else int(warmup * total)

    torch.manual_seed(seed)  # dropout, if the model has any
    order_rng = random.Random(seed)
    optimizer, scheduler = _optimizer(model, lr, weight_decay, lr_lambda(schedule, warmup_steps, total))

    was_training = model.training
    model.train()
    device = next(model.parameters()).device
    start = time.perf_counter()
    order: list[int] = []
    losses: list[float] = []
    window_loss, window_tokens, total_tokens = 0.0, 0, 0
    for step in range(1, total + 1):
        if len(order) < batch_size:  # next epoch, reshuffled; a batch never mixes two epochs
            order = list(range(len(examples)))
            order_rng.shuffle(order)
        idx, order = order[:batch_size], order[batch_size:]
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in idx], pad_id).items()}
        loss, n_tokens, grad_norm = _update(model, optimizer, scheduler, batch, max_grad_norm)
        losses.append(loss.item())
        window_loss += loss.item() * n_tokens
        window_tokens += n_tokens
        total_tokens += n_tokens
        if log_fn is not None and (step % log_every == 0 or step == total):
            log_fn({
                "step": step,
                "loss": window_loss / max(window_tokens, 1),
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm),
                "epoch": step * batch_size / len(examples),
                "elapsed_s": time.perf_counter() - start,
            })
            window_loss, window_tokens = 0.0, 0
    model.train(was_training)
    tail = losses[-max(1, len(losses) // 10):]  # the last 10% of steps
    return {
        "steps": total,
        "epochs": total * batch_size / len(examples),
        "examples": len(examples),
        "truncated": n_truncated,
        "completion_tokens": total_tokens,
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "time_s": time.perf_counter() - start,
    }


def run_sft(
    model_path: str | Path,
    data_path: str | Path,
    out_dir: str | Path,
    **train_kwargs: Any,
) -> dict[str, Any]:
    """SFT from files: load the model and tokenizer in `model_path` (a folder or hub id) with
    from_pretrained, train on the pairs in `data_path` (JSONL / JSON / Parquet / CSV / a
    datasets folder with columns "prompt" and "completion", read by grpokit.data), and save model (safetensors) + tokenizer + sft_stats.json to
    `out_dir`. `train_kwargs` are train_sft's (epochs, steps, batch_size, lr, warmup, ...)."""
    tokenizer = load_tokenizer(str(model_path))
    model = load_model(str(model_path))
    stats = train_sft(model, tokenizer, load_pairs(data_path, tokenizer), **train_kwargs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "sft_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
