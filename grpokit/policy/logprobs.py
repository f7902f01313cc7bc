"""Per-token log-probs (and entropies) of completions under a model: the pi_theta, pi_old and pi_ref passes.

    logp, entropy = completion_logprobs(model, packed, temperature=1.0, with_entropy=True)   # [N, T] each
    # at large vocabularies from the hidden states and the LM head in chunks, never [N, T, V]
    # (fused=None: auto)
    logp = batched_logprobs(model_or_adapter_off, packed, MicroBatching(size=8))   # no grad, eval mode
    # MicroBatching(packed=True) (model.padding_free): each micro-batch's rows back to back in one row

`packed` is a grpokit.data.batch.PackedBatch (pack_sequences: left-padded prompts, right-padded completions).
With packed.kept, the top-k / top-p sampler's kept set of each completion token (the fast engine records them:
rollout.replay_truncation), every log-prob is that of the distribution truncated to its token's kept set, the
one the token was drawn from (grpokit/algo/truncation.py), in every path (plain, shared prompts, fused head,
padding-free); the entropy stays the full distribution's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpokit.algo import token_entropy, token_logprobs
from grpokit.algo.fused import linear_logprobs
from grpokit.algo.truncation import truncated_logprobs
from grpokit.data.batch import PackedBatch, one_row
from grpokit.data.micro_batches import MicroBatching
from grpokit.distributed import is_sharded
from grpokit.policy.loading import AdapterOff, autocast_of, is_checkpointing, is_lora


def completion_logprobs(
    model,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
    fused: bool | None = None,
    entropy_grad: bool = False,
    padding_free: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log pi(completion token | prefix) for every completion position: [N, T] (and entropy [N, T]).

    Only the last T + 1 positions go through the LM head (logits_to_keep): the prompt's logits are
    never computed. The logits at position P - 1 + t predict completion token t.

    share_prompts: rows with the same prompt (GRPO's G completions of one prompt) run that prompt
    through the model once, and their completions attend to its keys / values (shared_prompt_logits);
    same values and gradients as the plain pass, fewer FLOPs. Used when at most half the rows have a
    distinct prompt and the model takes a KV cache with gradients (not with gradient checkpointing).

    fused: take the backbone's last hidden states and apply the LM head in chunks of tokens,
    recomputing them in the backward (grpokit/algo/fused.py): the [N, T, V] logits are never held.
    None (default) = when the logits [N, T, V] would have at least FUSED_MIN_LOGITS elements and the
    model's logits are its head applied to its backbone's output (checked once per model:
    fused_head). Same values and gradients either way.

    entropy_grad: the entropy carries its gradient (an entropy bonus in the loss); otherwise it has none.

    padding_free: the N sequences run back to back in one row with restarting position ids (one_row), and
    only the K positions that predict a completion token reach the LM head; same values and gradients, 0 on
    padding. Exact only for models that confine attention to each packed sequence: model.padding_free checks
    the model once (grpokit/policy/padding_free.py). Where the prompts can be shared (share_prompts) and that
    computes fewer positions than the row (U x P + N x T against the real tokens: long prompts, short
    completions), the padded pass on shared prompts runs instead (runs_packed says which).
    batch.kept (top-k / top-p kept sets, when the engine recorded them): see the module's docstring.
    """
    fused = use_fused(model, batch, fused)
    shared = _shared_prompts(model, batch) if share_prompts else None
    if padding_free and not _sharing_is_cheaper(batch, shared):
        return _padding_free_logprobs(model, batch, fused, temperature, with_entropy, entropy_grad)
    T = batch.completion_width
    out = None
    if shared is not None:
        unique, inverse = shared
        P = unique.shape[1] // 2
        out = shared_prompt_logits(model, batch, unique[:, :P], unique[:, P:], inverse, fused=fused)
    if out is None:
        inputs = dict(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        )
        out = _forward(model, fused, T + 1, use_cache=False, **inputs)
        out = out[:, :-1]  # [N, T, V], or [N, T, H] fused
    args = (batch.completion_ids, temperature, with_entropy, entropy_grad, batch.kept)
    return _fused_logprobs(model, out, *args) if fused else _logp_entropy(out, *args)


def runs_packed(model, batch: PackedBatch, padding_free: bool, share_prompts: bool = True) -> bool:
    """Whether completion_logprobs(model, batch, padding_free=..., share_prompts=...) runs the batch as one
    padding-free row (else padded rows, with or without shared prompts)."""
    if not padding_free:
        return False
    return not _sharing_is_cheaper(batch, _shared_prompts(model, batch) if share_prompts else None)


def padding_fraction(model, batch: PackedBatch, padding_free: bool, split: bool = False) -> float:
    """perf/padding_frac of completion_logprobs(model, batch, padding_free=...): the share of the completion
    positions it computes that are padding; 0 for one padding-free row (split: a sequence-parallel one)."""
    if split or runs_packed(model, batch, padding_free):
        return 0.0
    return 1 - batch.completion_mask.float().mean().item()


def _shared_prompts(model, batch: PackedBatch) -> tuple[Tensor, Tensor] | None:
    """(unique [U, 2P]: each distinct prompt's ids then mask, inverse [N]: row -> its prompt) when the prompts
    may be shared: the model takes a KV cache with gradients and at most half the rows have a distinct
    prompt; else None."""
    if not _can_share(model):
        return None
    P = batch.input_ids.shape[1] - batch.completion_width
    prompts = torch.cat([batch.input_ids[:, :P], batch.attention_mask[:, :P]], dim=1)  # [N, 2P]
    unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)  # [U, 2P], [N]
    return (unique, inverse) if unique.shape[0] * 2 <= prompts.shape[0] else None


def _sharing_is_cheaper(batch: PackedBatch, shared: tuple[Tensor, Tensor] | None) -> bool:
    """Padded rows on shared prompts compute fewer positions than the padding-free row: U x P + N x T
    against the real tokens (long prompts, short completions of similar lengths). Either is exact."""
    if shared is None:
        return False
    N, T = batch.completion_ids.shape
    U, P = shared[0].shape[0], batch.input_ids.shape[1] - T
    return U * P + N * T < int(batch.attention_mask.sum())


def _padding_free_logprobs(
    model, batch: PackedBatch, fused: bool, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """completion_logprobs of the batch run as one padding-free row, unpacked to [N, T]."""
    row = one_row(batch)
    logp, entropy = row_logprobs(
        model,
        row.input_ids,
        row.position_ids,
        row.predicts,
        row.targets,
        fused=fused,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        kept=row.kept,
    )
    return row.unpack(logp), None if entropy is None else row.unpack(entropy)


def use_fused(model, batch: PackedBatch, fused: bool | None) -> bool:
    """completion_logprobs' `fused` resolved: None = when the batch's logits would be large and the model's
    head is fusable (fused_head); True for a model without such a head is a ValueError."""
    if fused is None:
        rows, width = batch.completion_ids.shape
        return rows * width * _vocab_size(model) >= FUSED_MIN_LOGITS and fused_head(model) is not None
    if fused and fused_head(model) is None:
        raise ValueError(
            "fused log-probs need a model whose logits are a Linear head on its backbone's output"
        )
    return fused


def row_logprobs(
    model,
    input_ids: Tensor,
    position_ids: Tensor,
    predicts: Tensor,
    targets: Tensor,
    *,
    fused: bool,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    kept: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The log-probs [1, K] (and entropies) of `targets` [1, K] predicted at positions `predicts` [K] of one
    padding-free row input_ids / position_ids [1, L] (a OneRow, or a sequence rank's share of one); kept
    [1, K, W]: the targets' kept sets (OneRow.kept), or None."""
    # No attention mask and no KV cache (use_cache=False): transformers then reads the restarting position ids
    # as packed sequences; with either one it would let every sequence attend to those before it.
    out = _forward(
        model, fused, predicts, input_ids=input_ids, position_ids=position_ids, use_cache=False
    )  # [1, K, V], or [1, K, H] fused
    if fused:
        return _fused_logprobs(model, out, targets, temperature, with_entropy, entropy_grad, kept)
    return _logp_entropy(out, targets, temperature, with_entropy, entropy_grad, kept)


def _fused_logprobs(
    model,
    hidden: Tensor,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    kept: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The LM head applied to the backbone's hidden states in chunks (grpokit/algo/fused.py), under the
    model's autocast, or in float32 outside it with model.cast_lm_head_to_fp32."""
    head = fused_head(model)
    assert head is not None  # fused only with a fused head (checked by the caller)
    if model.__dict__.get("_grpokit_fp32_head"):  # model.cast_lm_head_to_fp32: the head in fp32
        hidden, weight = hidden.float(), head.weight.float()
        precision = torch.autocast(device_type=hidden.device.type, enabled=False)
    else:
        weight, precision = head.weight, autocast_of(model)
    with precision:
        return linear_logprobs(
            hidden,
            weight,
            targets,
            bias=None if head.bias is None else head.bias.to(weight.dtype),
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            kept=kept,
        )


#: logits of this many elements or more (256 MiB in fp32) take the fused path by default; below it the
#: chunks' temporaries cost about what the logits would (benchmarks/results/fused_logprobs.md)
FUSED_MIN_LOGITS = 64 << 20


def _vocab_size(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head.weight.shape[0] if isinstance(head, torch.nn.Linear) else 0


def _backbone(model):
    """The transformer body under the LM head (a peft model's base_model is peft's LoraModel: the body is
    below it)."""
    return model.get_base_model().base_model if is_lora(model) else getattr(model, "base_model", model)


def _forward(model, fused: bool, keep: int | Tensor, **inputs) -> Tensor:
    """The last `keep` positions' logits, or (fused) the backbone's hidden states there; keep a Tensor [K]:
    those positions (transformers' logits_to_keep)."""
    if fused:
        at = slice(-keep, None) if isinstance(keep, int) else keep
        return _backbone(model)(**inputs).last_hidden_state[:, at]
    return model(**inputs, logits_to_keep=keep).logits


def fused_head(model) -> torch.nn.Linear | None:
    """The model's LM head when its logits are exactly head(backbone(x)) (no soft-capping, scaling or
    other post-processing), else None. Checked once per model on a few tokens, in eval mode."""
    cached = model.__dict__.get("_grpokit_fused_head")
    if cached is not None:
        return cached or None
    if is_sharded(model):  # FSDP2: the head's weight is a shard outside the root's forward
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    ok = isinstance(head, torch.nn.Linear) and _backbone(model) is not model
    if ok:
        assert isinstance(head, torch.nn.Linear)  # ok says so
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                ids = torch.arange(4, device=head.weight.device).remainder(head.weight.shape[0])[None]
                logits = model(input_ids=ids, use_cache=False).logits.float()
                with autocast_of(model):
                    mine = head(_backbone(model)(input_ids=ids, use_cache=False).last_hidden_state).float()
                tol = (
                    1e-4 if getattr(model, "_grpokit_autocast", None) is None else 2e-2
                )  # bf16 matmuls under autocast
                ok = torch.allclose(mine, logits, rtol=tol, atol=tol)
        except (TypeError, AttributeError, RuntimeError):
            ok = False
        finally:
            model.train(was_training)
    model.__dict__["_grpokit_fused_head"] = head if ok else False
    return head if ok else None


def _logp_entropy(
    logits: Tensor,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = False,
    kept: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of the targets (under the kept sets' truncation when there are any) and the full entropy."""
    if kept is None:
        logp = token_logprobs(logits, targets, temperature=temperature)
    else:
        logp = truncated_logprobs(logits, targets, kept, temperature=temperature)
    entropy = token_entropy(logits, temperature=temperature, grad=entropy_grad) if with_entropy else None
    return logp, entropy


def _can_share(model) -> bool:
    # Gradient checkpointing turns the KV cache off in training mode; the plain pass then does the work. So
    # does FSDP2, where every forward is a collective: the shared pass runs one or two, depending on the rows.
    if is_sharded(model):
        return False
    return not is_checkpointing(model) and hasattr(model, "config")


def shared_prompt_logits(
    model, batch: PackedBatch, prompt_ids: Tensor, prompt_mask: Tensor, inverse: Tensor, fused: bool = False
) -> Tensor:
    """Logits [N, T, V] predicting each completion token, each distinct prompt run through the model once
    (fused: the backbone's hidden states [N, T, H] there, for the LM head to be applied in chunks).

    prompt_ids / prompt_mask: [U, P] the distinct (left-padded) prompts; inverse: [N] row -> its prompt.
    1. the U prompts -> KV cache [U, H, P, D] per layer and the logits of their last position
       (which predict completion token 0);
    2. the cache rows are gathered to [N, H, P, D] (an index: its backward sums the N rows' gradients
       into their prompt, so gradients are those of the plain pass);
    3. the N completions run with that cache; position t's logits predict token t + 1.
    Costs U x P + N x T tokens instead of N x (P + T): with G = 8 completions of 12-token prompts and
    8-token completions, 1216 tokens instead of 2560.
    """
    from transformers.cache_utils import DynamicCache

    # Here, not at the top: importing grpokit.rollout runs its __init__, which still loads the tool episodes.
    from grpokit.rollout.base import cache_kwarg

    P, T = prompt_ids.shape[1], batch.completion_width
    cache = DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache}
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp_min(0)  # [U, P], as pack_sequences computes it
    first = _forward(
        model,
        fused,
        1,
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=prompt_pos,
        use_cache=True,
        **kw,
    )
    logits0 = select_rows(first, inverse)  # [N, 1, V]: predicts completion token 0
    if T == 1:
        return logits0
    select_cache_rows(cache, inverse)  # [N, H, P, D] per layer, differentiable
    rest = _forward(
        model,
        fused,
        T,
        input_ids=batch.input_ids[:, P:],
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids[:, P:],
        use_cache=True,
        **kw,
    )
    return torch.cat([logits0, rest[:, : T - 1]], dim=1)  # [N, T, V]


def select_rows(x: Tensor, index: Tensor) -> Tensor:
    """x[index] along dim 0, with a backward that sums the rows that share a source row in a fixed order.

    On CPU, x[index]'s backward is index_put_(accumulate=True), which torch runs with atomic float adds
    from several threads once the gradient has 32768 elements or more: the G rows of a prompt are then
    summed in whatever order the threads get there, and two runs of one config differ in the last bits
    (seen at 3 and 5 threads; docs/threads.md). index_select's backward (index_add_) adds them in index
    order. On CUDA it is the other way round (index_add_ uses atomics, the indexing backward sorts), so
    CUDA keeps x[index].
    """
    return x.index_select(0, index) if x.device.type == "cpu" else x[index]


def select_cache_rows(cache, index: Tensor) -> None:
    """cache.batch_select_indices(index) (transformers: keys[index] per layer), through select_rows."""
    for layer in getattr(cache, "layers", None) or ():
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, Tensor) and isinstance(values, Tensor) and keys.numel():
            layer.keys, layer.values = select_rows(keys, index), select_rows(values, index)
        else:  # not filled yet, or state of another kind (e.g. linear attention): transformers' own
            layer.batch_select_indices(index)
    if not getattr(cache, "layers", None):
        cache.batch_select_indices(index)


@torch.no_grad()
def batched_logprobs(
    model,
    tokens: PackedBatch,
    batching: MicroBatching,
    *,
    temperature: float = 1.0,
    most: Callable[[int], int] | None = None,
) -> Tensor:
    """Log-probs [N, T] (float32, 0 on padding) under a model in eval mode, no gradient, in the micro-batches
    of `batching` (rows or tokens; packed: each as one padding-free row): the pi_old and pi_ref passes. most:
    the largest micro-batch count of any rank (World.most), so that every rank runs as many forwards (FSDP2
    gathers weights in each). An AdapterOff (pi_ref of a LoRA policy): the policy's passes with its adapter
    disabled."""
    if isinstance(model, AdapterOff):
        with model.policy.disable_adapter():
            return batched_logprobs(model.policy, tokens, batching, temperature=temperature, most=most)
    out = torch.zeros(tokens.completion_ids.shape, dtype=torch.float32)
    was_training = model.training
    model.eval()
    try:
        rows = torch.arange(out.shape[0])
        for idx, filler in batching.plan(rows, tokens, most or (lambda n: n)):
            sub = tokens.rows(idx)
            logp, _ = completion_logprobs(model, sub, temperature=temperature, padding_free=batching.packed)
            if not filler:  # a filler only evens out the ranks' forwards
                out[idx, : sub.completion_width] = logp.float()
    finally:
        model.train(was_training)
    return out
