"""Attention over padding-free rows without an [L, L] mask: each packed sequence in its own causal sdpa call.

    use_segment_attention(model)      # sdpa -> "grpokit_sdpa" (once, where padding-free rows are on)
    segment_attention(q, k, v, [(0, 13), (13, 21)])   # [B, H, L, D]: causal within each (start, end)

transformers keeps a padding-free row's sequences apart (their position ids restart at 0) with a block-causal
mask [1, 1, L, L] built for sdpa: sdpa keeps it, converted, once a decoder layer for the backward (4 L^2 bytes
each: 1 GiB a layer at 16k tokens) and, given a mask, computes every block of the [L, L] scores, the ones
above the diagonal and across sequences too. "grpokit_sdpa" is sdpa everywhere but there: where
transformers would build that mask (one row, no padding mask, queries = keys, nothing but causal and packed
sequences), its mask function returns none, and the attention reads the sequences from the position ids and
runs each alone with is_causal (the kernel skips the blocks above the diagonal): sum(l_i^2) work, not L^2,
and no mask kept. What flash-attention's varlen kernel does on a GPU, with the CPU's sdpa kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

#: the name of the segment attention in transformers' AttentionInterface (config._attn_implementation)
ATTENTION = "grpokit_sdpa"


def segments(position_ids: Tensor) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence of a row's position ids [L]: a sequence starts where the position
    does not follow the one before (transformers' rule, masking_utils.find_packed_sequence_indices)."""
    starts = torch.nonzero(position_ids[1:] != position_ids[:-1] + 1).flatten() + 1
    edges = [0, *starts.tolist(), position_ids.numel()]
    return list(zip(edges, edges[1:], strict=False))


def segment_attention(
    q: Tensor, k: Tensor, v: Tensor, spans: list[tuple[int, int]], dropout: float, scaling: float | None
) -> Tensor:
    """sdpa of q / k / v [B, H, L, D] (as many KV heads as query heads), causal within each span of `spans`
    and never across one: [B, H, L, D]."""
    parts = [
        scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dropout_p=dropout, is_causal=True, scale=scaling
        )
        for a, b in spans
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


#: the last position ids seen and their segments (every layer of a forward gets the same tensor)
_LAST: list[Any] = [None, []]


def _segments_of(position_ids: Tensor) -> list[tuple[int, int]]:
    if _LAST[0] is not position_ids:
        _LAST[:] = [position_ids, segments(position_ids[0])]
    return _LAST[1]


def segment_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention contract (q / k / v [B, H, S, D]; returns [B, S, H, D]): where no mask was
    built for a row of queries = keys (mask_or_segments), each of its packed sequences causal on its own;
    otherwise transformers' sdpa."""
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[2] != key.shape[2] or position_ids.shape[-1] != query.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = segment_attention(query, key, value, _segments_of(position_ids), dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


def mask_or_segments(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> Tensor | None:
    """sdpa's mask, except none where the only masking is causal within packed sequences (one row, no padding
    mask, no cache, no window, no extra mask function): segment_sdpa then reads the sequences itself."""
    packed_row = (
        batch_size == 1
        and attention_mask is None
        and q_length == kv_length
        and q_offset == 0
        and kv_offset == 0
        and local_size is None
        and not use_vmap
    )
    if packed_row:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        local_size=local_size,
        use_vmap=use_vmap,
        **kwargs,
    )


AttentionInterface.register(ATTENTION, segment_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, mask_or_segments)


def use_segment_attention(model) -> bool:
    """The model's sdpa becomes segment_sdpa (transformers' set_attn_implementation on the base model, under
    LoRA too), unless it has sliding windows or soft-capped attention (kept on transformers' masks). True
    when it did (or already runs it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    impl = getattr(config, "_attn_implementation", None)
    if impl == ATTENTION:
        return True
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None) or []  # e.g. Qwen2's: "full_attention" for every layer
    windowed = "sliding_attention" in kinds or (not kinds and getattr(text, "sliding_window", None))
    if impl != "sdpa" or windowed or getattr(text, "attn_logit_softcapping", None):
        return False
    base.set_attn_implementation(ATTENTION)
    return True
