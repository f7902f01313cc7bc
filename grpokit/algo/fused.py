"""Per-token log-probs straight from hidden states and the LM head, never holding [tokens, V] logits.

    logp, entropy = linear_logprobs(hidden, weight, targets, bias=None, temperature=1.0, with_entropy=False)
    # hidden [..., H], weight [V, H] (the LM head), targets [...] -> logp [...] float32 (and entropy)

The plain path computes logits [N, T, V] and autograd keeps them (and their log-softmax's inputs)
for the backward: at N=16, T=1024, V=151,936 in fp32 that is 10 GB. Here the tokens go through the
head in chunks of `chunk` rows; the forward keeps one float per token (the logsumexp) and the
backward recomputes each chunk's logits to form its gradient (Liger's fused linear cross-entropy,
for log-probs):

    z = (h W^T + b) / tau           logp = z[target] - logsumexp(z)
    d logp / d z = onehot(target) - softmax(z)        dz -> dh = (dz / tau) W,  dW = (dz / tau)^T h

One extra matmul of the head in the backward buys memory that no longer grows with V.
Entropy comes from the same chunk's logits in the forward: no gradient (as token_entropy), or with
entropy_grad its gradient d H / d z = -p (log p + H) joins the chunk's in the backward (an entropy bonus).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpokit.algo.truncation import keep_only

#: bytes of fp32 logits one chunk may hold: the chunk's row count is this over 4 * V
CHUNK_BYTES = 64 << 20


def chunk_rows(vocab_size: int) -> int:
    return max(16, min(8192, CHUNK_BYTES // (4 * vocab_size)))


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    z = torch.nn.functional.linear(h, weight, bias).float()
    return z / temperature if temperature != 1.0 else z


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        entropy_grad: bool,
        kept: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        logp = hidden.new_empty(targets.shape, dtype=torch.float32)
        lse = torch.empty_like(logp)  # over the kept set with `kept`: the log-probs' normalizer
        lse_full = lse if kept is None else torch.empty_like(logp)  # the entropy's
        entropy = torch.empty_like(logp) if with_entropy else None
        for s in range(0, targets.shape[0], chunk):
            z = _chunk_logits(hidden[s : s + chunk], weight, bias, temperature)
            lse_full[s : s + chunk] = torch.logsumexp(z, dim=-1)
            if kept is not None:
                lse[s : s + chunk] = torch.logsumexp(
                    keep_only(z, kept[s : s + chunk], targets[s : s + chunk]), -1
                )
            logp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - lse[s : s + chunk]
            if entropy is not None:  # with_entropy
                logp_all = z - lse_full[s : s + chunk, None]
                entropy[s : s + chunk] = -(logp_all.exp() * logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if entropy_grad else None)
        ctx.kept, ctx.lse_full = kept, lse_full
        ctx.temperature, ctx.chunk = temperature, chunk
        device = hidden.device.type  # the backward recomputes the logits as the forward computed them
        ctx.autocast = (
            (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        )
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        if ctx.autocast is None:
            return _LinearLogprobs._backward(ctx, grad_logp, grad_entropy)
        with torch.autocast(device_type=ctx.autocast[0], dtype=ctx.autocast[1]):
            return _LinearLogprobs._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _backward(ctx: Any, grad_logp: Tensor, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = torch.promote_types(
            weight.dtype, torch.float32
        )  # gradients of the head summed in fp32 or wider
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b and bias is not None else None
        for s in range(0, targets.shape[0], chunk):
            g = grad_logp[s : s + chunk].float()
            z = _chunk_logits(hidden[s : s + chunk], weight, bias, tau)
            if ctx.kept is not None:
                dz = _kept_dz(z, ctx, s, g, entropy, grad_entropy)
            elif entropy is not None and grad_entropy is not None:  # + dH/dz * gH = -p (log p + H) * gH
                logp_all = z.sub_(lse[s : s + chunk, None])
                gh = grad_entropy[s : s + chunk, None].float()
                dz = logp_all.exp() * (-g[:, None] - gh * (logp_all + entropy[s : s + chunk, None]))
            else:
                dz = z.sub_(lse[s : s + chunk, None]).exp_().mul_(-g[:, None])  # -softmax * g, in z's memory
            dz.scatter_add_(-1, targets[s : s + chunk, None], g[:, None])  # + onehot * g
            if tau != 1.0:
                dz /= tau
            if grad_h is not None:  # need_h
                grad_h[s : s + chunk] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:  # need_w
                grad_w += dz.t().to(acc) @ hidden[s : s + chunk].to(acc)
            if grad_b is not None:
                grad_b += dz.to(acc).sum(0)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _kept_dz(
    z: Tensor, ctx: Any, s: int, g: Tensor, entropy: Tensor | None, grad_entropy: Tensor | None
) -> Tensor:
    """d / dz of one chunk with kept sets: -softmax over the kept set * g (0 outside it), plus the entropy's
    -p (log p + H) * gH on the full distribution; the caller adds onehot * g."""
    chunk, targets = ctx.chunk, ctx.saved_tensors[3]
    lse = ctx.saved_tensors[4][s : s + chunk, None]
    dz = keep_only(z, ctx.kept[s : s + chunk], targets[s : s + chunk]).sub_(lse).exp_().mul_(-g[:, None])
    if entropy is not None and grad_entropy is not None:
        logp_all = z - ctx.lse_full[s : s + chunk, None]
        gh = grad_entropy[s : s + chunk, None].float()
        dz -= logp_all.exp() * gh * (logp_all + entropy[s : s + chunk, None])
    return dz


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk: int | None = None,
    kept: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log softmax((hidden W^T + b) / temperature)[target] per position: hidden [..., H], weight [V, H],
    targets [...] -> float32 [...] (and the entropy: no gradient, or with entropy_grad its own). Same values
    and gradients as token_logprobs(linear(hidden, weight, bias), targets), without the [..., V] logits.
    kept [..., W]: the sampler's kept sets (grpokit/algo/truncation.py): the log-probs are those of the
    distribution truncated to them, truncated_logprobs' values and gradients; the entropy stays the full
    distribution's."""
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    rows = chunk or chunk_rows(weight.shape[0])
    logp, entropy = _LinearLogprobs.apply(  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
        flat_h,
        weight,
        bias,
        flat_t,
        float(temperature),
        rows,
        with_entropy,
        with_entropy and entropy_grad,
        None if kept is None else kept.reshape(-1, kept.shape[-1]),
    )
    return logp.view(shape), entropy.view(shape) if entropy is not None else None
