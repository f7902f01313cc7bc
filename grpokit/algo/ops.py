"""Masked reductions and per-token log-probs of chosen tokens."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch
from torch import Tensor

V = TypeVar("V")


def pick(table: Mapping[str, V], key: str, what: str) -> V:
    """table[key], or a ValueError that lists the allowed names (the variants are picked from dicts)."""
    if key not in table:
        raise ValueError(f"unknown {what} {key!r}; allowed: {', '.join(table)}")
    return table[key]


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    x = torch.where(mask.bool(), x, torch.zeros_like(x))  # where, not *, so inf/NaN in padding never leak
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over positions where mask is set; an empty mask gives 0, not NaN."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def token_logprobs(
    logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0, chunk_size: int = 1024
) -> Tensor:
    """log softmax(logits / temperature)[token] for each position, without a full [.., V] log-softmax.

    logits: [..., V]; token_ids: [...] -> [...] float32.
    Per chunk of rows: logp = logit[token] - logsumexp(logits). logsumexp needs one [chunk, V] temporary
    instead of the [rows, V] log-softmax (which autograd would also keep for the backward pass).
    """
    shape = token_ids.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_ids = token_ids.reshape(-1)
    out = []
    for start in range(0, flat_ids.numel(), chunk_size):
        lg = flat_logits[start : start + chunk_size].float()
        if temperature != 1.0:
            lg = lg / temperature
        chosen = lg.gather(-1, flat_ids[start : start + chunk_size, None]).squeeze(-1)
        out.append(chosen - torch.logsumexp(lg, dim=-1))
    if not out:
        return flat_logits.new_zeros(shape, dtype=torch.float32)
    return torch.cat(out).view(shape)


def token_entropy(
    logits: Tensor, *, temperature: float = 1.0, chunk_size: int = 1024, grad: bool = False
) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position: [..., V] -> [...] float32. No gradient,
    unless grad (an entropy bonus: then autograd keeps each chunk's log-softmax for the backward)."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        return _entropy(logits if grad else logits.detach(), temperature, chunk_size)


def _entropy(logits: Tensor, temperature: float, chunk_size: int) -> Tensor:
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        lg = flat[start : start + chunk_size].float() / temperature
        logp = torch.log_softmax(lg, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    if not out:
        return flat.new_zeros(shape, dtype=torch.float32)
    return torch.cat(out).view(shape)
