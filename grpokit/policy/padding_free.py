"""model.padding_free: may this model's log-prob passes run padding-free rows? Checked when the run starts.

    check_padding_free(model)                       # ValueError naming model.padding_free and why, or nothing
    on, line = resolve_padding_free(model, "auto")  # auto: on where the check passes, else off and why;
                                                    # on: sdpa runs each packed sequence alone (attention.py)
    packs(model_section)                            # before the model loads (the memory plan): auto's guess

Padding-free rows (grpokit/data/batch.py: one_row) are exact when the model keeps attention inside each
sequence of a row. transformers does it from the position ids alone (they restart at 0; no attention mask, no
KV cache) in masking_utils, for the attention implementations below: sdpa, eager and flex get a mask that is
causal within each sequence (sliding windows too), flash-attention its varlen kernel (one row:
_is_packed_sequence). A model that builds its own mask, or carries state along the row (recurrent or
linear-attention layers, ALiBi with no position ids), would let a sequence see those before it: the check runs
two short sequences packed in one row and alone, and refuses when their logits differ. Under autocast the
tolerance is bf16's (2e-2): a smaller leak passes (a randomly initialized tiny Bloom leaks 0.004).
"""

from __future__ import annotations

import torch

from grpokit.policy.attention import use_segment_attention

#: attention implementations that transformers' packed-sequence detection reaches (masking_utils'
#: ALL_MASK_ATTENTION_FUNCTIONS, transformers 5.x)
PACKED_ATTENTION = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "grpokit_sdpa",  # sdpa, each packed sequence in a call of its own (policy/attention.py)
    "grpokit_ulysses",  # the same over sequence ranks (distributed/sequence.py)
)


def check_padding_free(model) -> None:
    """ValueError (one line: the key, why, what to do) unless padding-free rows give this model's logits."""
    why = why_not_packed(model)
    if why is not None:
        other = "model.attn_implementation or " if why.startswith("packed") else ""
        raise ValueError(f"model.padding_free=true: {why}; set {other}model.padding_free=false")


def why_not_packed(model) -> str | None:
    """Why padding-free rows would not give this model's logits (one clause), or None when they do."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in PACKED_ATTENTION:
        return (
            "packed sequences are kept apart by the attention implementations "
            f"{', '.join(PACKED_ATTENTION)}; this model runs {impl!r}"
        )
    diff = _packed_difference(model)
    if diff is None or diff > (1e-4 if getattr(model, "_grpokit_autocast", None) is None else 2e-2):
        seen = "fails on packed rows" if diff is None else f"differ by {diff:.2g}"
        return (
            f"{type(model).__name__} ({impl}) lets a packed sequence see the ones before it (two sequences' "
            f"logits in one row and alone {seen})"
        )
    return None


def _packed_difference(model) -> float | None:
    """The largest difference between two short sequences' logits packed in one row and run alone (eval mode,
    no gradient), or None when the model refuses the packed row."""
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    ids = (torch.arange(7, device=device) * 5 + 3).remainder(vocab)[None]  # [1, 7]
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]], device=device)  # sequences of 4 and 3 tokens
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
            alone = torch.cat(
                [
                    model(input_ids=ids[:, s], position_ids=positions[:, s], use_cache=False).logits.float()
                    for s in (slice(0, 4), slice(4, 7))
                ],
                dim=1,
            )
        return (packed - alone).abs().max().item()
    except (TypeError, ValueError, RuntimeError):
        return None
    finally:
        model.train(was_training)


def resolve_padding_free(model, setting: bool | str, required: str = "") -> tuple[bool, str | None]:
    """model.padding_free made concrete for this model: (on, the line that says why auto turned it off, or
    None). true is refused where the check fails (ValueError); so is auto when `required` names a setting
    that needs padding-free rows (distributed.sequence_parallel=N)."""
    if setting is False:
        return False, None
    if setting is True:
        check_padding_free(model)
        use_segment_attention(model)
        return True, None
    why = why_not_packed(model)
    if why is None:
        use_segment_attention(model)
        return True, None
    if required:
        raise ValueError(f"{required} needs padding-free rows, but {why}; set it to 1")
    return False, f"model.padding_free=auto: padded rows, since {why}"


def packs(model_section) -> bool:
    """Whether the run's passes will be padding-free, before the model loads (the memory plan): true, or auto
    with an attention implementation that keeps packed sequences apart (transformers' default, sdpa, is one;
    the check when the run starts has the last word)."""
    setting = model_section.padding_free
    if setting != "auto":
        return bool(setting)
    return model_section.attn_implementation in (None, *PACKED_ATTENTION)
