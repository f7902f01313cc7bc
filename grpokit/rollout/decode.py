"""The fast engine's decode step for plain Llama models: one token per row through the model's own weights,
without transformers' forward.

    step = LlamaDecoder.of(model)     # None: not a plain Llama, the engine runs model(...) as before
    logits = step(cache, tokens, attention_mask, position_ids)     # [B], [B, L + 1], [B, 1] -> [B, V]

What a decode step of a small model spends its time on at one thread (benchmarks/decode_real.py --profile,
SmolLM2-135M, 32 rows): the weight matmuls of 30 layers, then attention over the cache (sdpa's CPU flash
kernel is slow for a single query), the per-op overhead of transformers' modules and masks, the LM head and
the sampler. This step does the same arithmetic with fewer, larger matmuls on weights laid out for them:

- q, k and v are one matmul, and so are gate and up, each on a [in, out] copy of the weights made once per
  `generate` call (x @ W, W contiguous, measured 1.2-1.4x faster than F.linear's x @ W.T at 32 rows);
- attention is two batched matmuls per layer over the preallocated cache (grouped query heads share their
  key/value head, so the cache is never repeated), the mask applied as -inf before a float32 softmax;
- RMSNorm and RoPE as transformers computes them (the model's own rotary embedding gives cos / sin).

Same results as the model's forward up to the order of float sums (tests/test_rollout_fast.py: the same
greedy tokens as transformers' generate, log-probs within 1e-4 of the trainer's). Plain Llama only
(_plain_llama: LlamaForCausalLM without biases, hooks or autocast); any other model (LoRA, quantized, ...),
and model.compile, keep the model's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm: in float32, then back to x's dtype, times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _plain_llama(model) -> bool:
    """A LlamaForCausalLM this step computes as its forward does: no biases, SiLU, sdpa or eager attention,
    plain nn.Linear projections, no autocast (ambient, or grpokit's model.autocast, which replaces `forward`
    on the instance, as accelerate's hooks do), no module hooks."""
    from transformers import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM:
        return False
    cfg = model.config
    linears = [model.lm_head] + [
        getattr(module, f"{name}_proj")
        for layer in model.model.layers
        for module, names in ((layer.self_attn, "q k v o"), (layer.mlp, "gate up down"))
        for name in names.split()
    ]
    return (
        not cfg.attention_bias
        and not getattr(cfg, "mlp_bias", False)
        and cfg.hidden_act == "silu"
        and getattr(cfg, "pretraining_tp", 1) == 1
        and cfg._attn_implementation in ("sdpa", "eager")
        and not torch.is_autocast_enabled(model.lm_head.weight.device.type)
        and all(type(m) is torch.nn.Linear and m.bias is None for m in linears)
        and not any(
            "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks for m in model.modules()
        )
    )


class LlamaDecoder:
    """The weights of one `generate` call, fused and laid out for decoding; callable as a decode step."""

    @classmethod
    def of(cls, model) -> LlamaDecoder | None:
        return cls(model) if _plain_llama(model) else None

    def __init__(self, model):
        body = model.model
        cfg = model.config
        self.embed, self.rotary, self.head = body.embed_tokens.weight, body.rotary_emb, model.lm_head.weight
        self.norm, self.eps = body.norm.weight, body.norm.variance_epsilon
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.q_size, self.kv_size = cfg.num_attention_heads * self.head_dim, self.kv_heads * self.head_dim
        self.layers = []
        for layer in body.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).t().contiguous(),
                    att.o_proj.weight.t().contiguous(),
                    layer.post_attention_layernorm.weight,
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t().contiguous(),
                    mlp.down_proj.weight.t().contiguous(),
                    att.scaling,
                )
            )

    def __call__(self, cache, tokens: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """Logits [B, V] (float32) of the next token after `tokens` [B], whose keys / values are appended to
        `cache` (the engine's preallocated layers); attention_mask [B, L + 1] (1 = attend), position_ids
        [B, 1]."""
        x = F.embedding(tokens, self.embed)  # [B, hidden]
        cos, sin = self.rotary(x[:, None], position_ids)  # [B, 1, D]
        masked = attention_mask[:, None, None, :] == 0  # [B, 1, 1, L + 1]
        for (ln1, qkv_w, o_w, ln2, gate_up_w, down_w, scaling), layer in zip(
            self.layers, cache.layers, strict=True
        ):
            h = _rms_norm(x, ln1, self.eps) @ qkv_w  # [B, q + 2 kv]
            q, k, v = h.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            B = x.shape[0]
            q = q.view(B, -1, self.head_dim)  # [B, Hq, D]
            k = k.view(B, self.kv_heads, self.head_dim)  # [B, Hkv, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = layer.update(
                k[:, :, None], v.view(B, self.kv_heads, 1, self.head_dim)
            )  # [B,Hkv,L+1,D]
            # the query heads of one key/value head, side by side: [B, Hkv, Hq / Hkv, D]
            scores = (q.view(B, self.kv_heads, -1, self.head_dim) @ keys.transpose(-1, -2)) * scaling
            probs = scores.masked_fill(masked, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
            x = x + (probs @ values).reshape(B, -1) @ o_w
            gate, up = (_rms_norm(x, ln2, self.eps) @ gate_up_w).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ down_w
        return F.linear(_rms_norm(x, self.norm, self.eps), self.head).float()
