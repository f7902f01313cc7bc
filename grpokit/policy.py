"""The policy: model / tokenizer loading, and per-token log-probs of sampled completions.

    model, tokenizer = load_policy(cfg.model)
    batch = pack_sequences(prompt_ids, completion_ids, pad_id)      # left-padded prompts, right-padded completions
    logp, entropy = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids, T)

Position ids follow the attention mask (cumsum - 1), so left padding never shifts a position:
a padded row gets exactly the log-probs it would get alone (tests/test_policy.py).
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from grpokit.algo import token_entropy, token_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger("grpokit.policy")


class ModelLoadError(ValueError):
    """The model or tokenizer could not be loaded; the message names the config key and the fix."""


def _check_local(name_or_path: str, key: str) -> None:
    """A path that is clearly local (absolute, ./, ../, ~, or under an existing folder) must exist:
    otherwise transformers would take it for a hub id and fail with a message about repo ids."""
    p = Path(name_or_path).expanduser()
    local = p.is_absolute() or name_or_path.startswith((".", "~")) or (len(p.parts) > 1 and Path(p.parts[0]).is_dir())
    if local and not p.exists():
        where = "" if str(p.resolve()) == name_or_path else f" (resolved to {p.resolve()})"
        raise ModelLoadError(f"{key}={name_or_path!r}: no such folder{where}; fix the path, or give a Hugging Face model id")


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    _check_local(name_or_path, "model.tokenizer / model.name_or_path")
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load a tokenizer from {name_or_path!r} (model.tokenizer / model.name_or_path): {str(exc).splitlines()[0]}"
        ) from None
    if tok.pad_token_id is None:
        # Common for base models. Masks, not pad ids, decide what is padding, so EOS is a safe pad.
        if tok.eos_token is None:
            raise ModelLoadError(f"tokenizer {name_or_path!r} has neither a pad nor an EOS token; add one to its special tokens")
        tok.pad_token = tok.eos_token
        logger.warning("tokenizer %r has no pad token; padding with its EOS token %r", name_or_path, tok.eos_token)
    tok.padding_side = "left"
    return tok


def load_model(name_or_path: str, *, dtype: str = "float32", attn_implementation: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    _check_local(name_or_path, "model.name_or_path")
    kwargs = dict(dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load a causal LM from {name_or_path!r} (model.name_or_path): {str(exc).splitlines()[0]}"
        ) from None


def disable_dropout(model) -> None:
    """Zero every dropout: with dropout on, the ratio pi_theta / pi_old is noisy even before any update."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)


def load_policy(model_cfg):
    """(model, tokenizer) from a ModelConfig; the model is in train mode."""
    if not model_cfg.name_or_path:
        raise ModelLoadError("model.name_or_path is empty: set it to a Hugging Face model id or a local folder")
    tok = load_tokenizer(model_cfg.tokenizer or model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code)
    model = load_model(
        model_cfg.name_or_path,
        dtype=model_cfg.dtype,
        attn_implementation=model_cfg.attn_implementation,
        trust_remote_code=model_cfg.trust_remote_code,
    )
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    if model_cfg.disable_dropout:
        disable_dropout(model)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    model.train()
    return model, tok


def frozen_copy(model) -> torch.nn.Module:
    """pi_ref: a frozen, eval-mode copy of the policy as it is now."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref


@dataclass
class PackedBatch:
    input_ids: Tensor  # [N, P + T]  left-padded prompt, then right-padded completion
    attention_mask: Tensor  # [N, P + T]
    position_ids: Tensor  # [N, P + T]  cumsum(attention_mask) - 1: padding never shifts a position
    completion_ids: Tensor  # [N, T]
    completion_mask: Tensor  # [N, T]  1 on completion tokens (EOS included), 0 on padding

    @property
    def completion_width(self) -> int:
        return self.completion_ids.shape[1]

    def rows(self, idx: Tensor | slice) -> "PackedBatch":
        b = PackedBatch(*(t[idx] for t in (self.input_ids, self.attention_mask, self.position_ids, self.completion_ids, self.completion_mask)))
        return b.trimmed()

    def trimmed(self) -> "PackedBatch":
        """Drop columns that are padding in every row (left of the prompts, right of the completions)."""
        left = int(self.attention_mask.sum(0).nonzero()[0]) if self.attention_mask.any() else 0
        T = int(self.completion_mask.sum(1).max()) if self.completion_mask.numel() else 0
        T = max(T, 1)
        P = self.input_ids.shape[1] - self.completion_width
        stop = P + T
        return PackedBatch(
            self.input_ids[:, left:stop],
            self.attention_mask[:, left:stop],
            self.position_ids[:, left:stop],
            self.completion_ids[:, :T],
            self.completion_mask[:, :T],
        )


def pack_sequences(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int) -> PackedBatch:
    N = len(prompt_ids)
    if N != len(completion_ids):
        raise ValueError(f"{N} prompts but {len(completion_ids)} completions")
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(c) for c in completion_ids))
    input_ids = torch.full((N, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((N, P + T), dtype=torch.long)
    cmask = torch.zeros((N, T), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p) : P] = 1
        if c:
            input_ids[i, P : P + len(c)] = torch.tensor(c, dtype=torch.long)
            attn[i, P : P + len(c)] = 1
            cmask[i, : len(c)] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
    return PackedBatch(input_ids, attn, position_ids, input_ids[:, P:], cmask)


def completion_logprobs(
    model,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log pi(completion token | prefix) for every completion position: [N, T] (and entropy [N, T]).

    Only the last T + 1 positions go through the LM head (logits_to_keep): the prompt's logits are
    never computed. The logits at position P - 1 + t predict completion token t.

    share_prompts: rows with the same prompt (GRPO's G completions of one prompt) run that prompt
    through the model once, and their completions attend to its keys / values (shared_prompt_logits);
    same values and gradients as the plain pass, fewer FLOPs. Used when at most half the rows have a
    distinct prompt and the model takes a KV cache with gradients (not with gradient checkpointing).
    """
    if share_prompts and _can_share(model):
        P = batch.input_ids.shape[1] - batch.completion_width
        prompts = torch.cat([batch.input_ids[:, :P], batch.attention_mask[:, :P]], dim=1)  # [N, 2P]
        unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)  # [U, 2P], [N]
        if unique.shape[0] * 2 <= prompts.shape[0]:
            logits = shared_prompt_logits(model, batch, unique[:, :P], unique[:, P:], inverse)
            return _logp_entropy(logits, batch, temperature, with_entropy)
    T = batch.completion_width
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=T + 1,
    )
    return _logp_entropy(out.logits[:, :-1, :], batch, temperature, with_entropy)  # logits [N, T, V]


def _logp_entropy(logits: Tensor, batch: PackedBatch, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    logp = token_logprobs(logits, batch.completion_ids, temperature=temperature)
    entropy = token_entropy(logits.detach(), temperature=temperature) if with_entropy else None
    return logp, entropy


def _can_share(model) -> bool:
    # Gradient checkpointing turns the KV cache off in training mode; the plain pass then does the work.
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return not checkpointing and hasattr(model, "config")


def shared_prompt_logits(model, batch: PackedBatch, prompt_ids: Tensor, prompt_mask: Tensor, inverse: Tensor) -> Tensor:
    """Logits [N, T, V] predicting each completion token, each distinct prompt run through the model once.

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

    from grpokit.rollout.fast import _cache_kwarg

    P, T = prompt_ids.shape[1], batch.completion_width
    cache = DynamicCache(config=model.config)
    kw = {_cache_kwarg(model): cache}
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp_min(0)  # [U, P], as pack_sequences computes it
    first = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_pos, use_cache=True, logits_to_keep=1, **kw)
    logits0 = first.logits[inverse]  # [N, 1, V]: predicts completion token 0
    if T == 1:
        return logits0
    cache.batch_select_indices(inverse)  # [N, H, P, D] per layer, differentiable
    rest = model(
        input_ids=batch.input_ids[:, P:],
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids[:, P:],
        use_cache=True,
        logits_to_keep=T,
        **kw,
    )
    return torch.cat([logits0, rest.logits[:, : T - 1]], dim=1)  # [N, T, V]
