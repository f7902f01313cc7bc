"""A tiny Llama built from a config (no download), sized for the demo or for tests.

    tok = build_tokenizer(get_task("countdown"))
    model = build_tiny_llama(tok)                 # the demo model (see SIZES)
    model = build_tiny_llama(tok, size="test")    # a few hundred thousand parameters
    model.save_pretrained(out); AutoModelForCausalLM.from_pretrained(out)

The special-token ids (pad / bos / eos) and the vocabulary size come from the tokenizer.
Keyword arguments override the preset, e.g. build_tiny_llama(tok, num_layers=2); any other LlamaConfig
field goes through `config`, e.g. build_tiny_llama(tok, config={"rms_norm_eps": 1e-6, "rope_theta": 5e5}).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

#: presets; "demo" was chosen in docs/demo_tuning.md
SIZES: dict[str, dict[str, int]] = {
    "demo": dict(hidden_size=192, num_layers=4, num_heads=4, intermediate_size=512),
    "test": dict(hidden_size=96, num_layers=2, num_heads=4, intermediate_size=256),
}


def build_tiny_llama(
    tokenizer: Any,
    *,
    size: str = "demo",
    hidden_size: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    config: dict[str, Any] | None = None,
) -> LlamaForCausalLM:
    """A freshly initialized LlamaForCausalLM over `tokenizer`'s vocabulary (seeded). config: further
    LlamaConfig fields (rms_norm_eps, rope_theta, head_dim, num_key_value_heads, ...), which win."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; allowed: {sorted(SIZES)}")
    preset = SIZES[size]
    hidden = hidden_size or preset["hidden_size"]
    heads = num_heads or preset["num_heads"]
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not divisible by num_heads {heads}")
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate_size or preset["intermediate_size"],
        num_hidden_layers=num_layers or preset["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    fields.update(config or {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**fields))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
