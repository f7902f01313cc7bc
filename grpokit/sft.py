"""Supervised warm-start (SFT) of any Hugging Face causal LM on (prompt, completion) pairs.

    grpokit sft MODEL_DIR pairs.jsonl OUT_DIR      # -> run_sft(MODEL_DIR, pairs.jsonl, OUT_DIR)

    from grpokit.sft import train_sft
    stats = train_sft(model, tokenizer, [{"prompt": "7 3>21=", "completion": "7*3"}], epochs=3)

GRPO learns only from the rewards of what the policy samples, so a policy that never
samples a correct answer learns nothing; a short SFT on reference solutions puts it where
sampling sometimes succeeds (the demo's warm start). The loss is the cross-entropy of the
completion tokens only, EOS included: prompt tokens and padding get label -100.

Sequences are the prompt encoded as the tokenizer does by default (with its BOS, if any;
a list of chat messages goes through the chat template with the generation prompt) followed
by the completion encoded without special tokens plus EOS -- the same token boundary as a
rollout, which samples completion tokens after the prompt's tokens. Batches are right-padded,
so position ids are simply 0..T-1 for every row. AdamW (no weight decay on norms and
biases), linear warm-up then cosine or linear decay to 0, gradient clipping; deterministic
for a given seed on a given machine.
"""
from __future__ import annotations

import csv
import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch

IGNORE_INDEX = -100  # label of tokens the loss skips (prompt, padding)


# --- data ------------------------------------------------------------------------------
def read_pairs(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL (one object a line), JSON (a list of objects) or CSV file that has the
    columns "prompt" and "completion"."""
    path = Path(path)
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    elif path.suffix in (".jsonl", ".json"):
        text = path.read_text()
        if path.suffix == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .csv")
    if not rows:
        raise ValueError(f"{path}: no rows")
    for column in ("prompt", "completion"):
        if column not in rows[0]:
            raise ValueError(f"{path}: missing column {column!r} (columns: {sorted(rows[0])})")
    return rows


def encode_pair(tokenizer: Any, prompt: Any, completion: str, max_length: int) -> tuple[list[int], list[int], bool]:
    """(input ids, labels, truncated) of one example; labels are IGNORE_INDEX on the prompt."""
    if isinstance(prompt, list):  # chat messages
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = prompt_ids + completion_ids
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
def _lr_lambda(total: int, warmup: int, schedule: str) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if schedule == "linear":
            return 1.0 - progress
        return 1.0

    return f


def train_sft(
    model: Any,
    tokenizer: Any,
    pairs: list[dict[str, Any]],
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
    """Fine-tune `model` in place on `pairs` ({"prompt", "completion"}) and return final stats.

    Length of training: `epochs` (passes over the pairs, may be fractional) or `steps`
    (optimizer steps of `batch_size` pairs); neither means one epoch.
    warmup: a number of steps if >= 1, else a fraction of all steps.
    schedule: "cosine" | "linear" (decay to 0 after warm-up) | "constant".
    log_fn: called every `log_every` steps and at the end with {"step", "loss", "lr", ...}.
    """
    if epochs is not None and steps is not None:
        raise ValueError("give epochs or steps, not both")
    if schedule not in ("cosine", "linear", "constant"):
        raise ValueError(f"schedule must be one of 'cosine', 'linear', 'constant', got {schedule!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; SFT appends EOS to every completion")
    if not pairs:
        raise ValueError("no training pairs")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    encoded = [encode_pair(tokenizer, p["prompt"], str(p["completion"]), max_length) for p in pairs]
    n_truncated = sum(t for _, _, t in encoded)
    examples = [(ids, labels) for ids, labels, _ in encoded]
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    total = steps if steps is not None else max(1, round((1.0 if epochs is None else epochs) * steps_per_epoch))
    warmup_steps = int(warmup) if warmup >= 1 else int(warmup * total)

    torch.manual_seed(seed)  # dropout, if the model has any
    order_rng = random.Random(seed)
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(total, warmup_steps, schedule))

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
        loss, n_tokens = completion_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()

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
    from_pretrained, train on the pairs in `data_path` (JSONL / JSON / CSV with columns
    "prompt" and "completion"), and save model (safetensors) + tokenizer + sft_stats.json to
    `out_dir`. `train_kwargs` are train_sft's (epochs, steps, batch_size, lr, warmup, ...)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pairs = read_pairs(data_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    stats = train_sft(model, tokenizer, pairs, **train_kwargs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "sft_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
