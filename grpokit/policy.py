"""The policy: model / tokenizer loading (policy, reference, critic backbone, SFT), and per-token log-probs.

    model, tokenizer = load_policy(cfg.model)     # AutoModelForCausalLM + tokenizer, train mode
    ref = build_reference(model, cfg.algorithm)   # frozen copy of pi_theta, or None (beta = 0);
                                                  # with model.lora: AdapterOff(model), no copy
    backbone = load_model(path, head="backbone")  # the critic's body (AutoModel)
    logp, entropy = completion_logprobs(model, packed, temperature=1.0, with_entropy=True)   # [N, T] each
    # at large vocabularies from the hidden states and the LM head in chunks, never [N, T, V]
    # (fused=None: auto)

`packed` is a grpokit.batch.PackedBatch (pack_sequences: left-padded prompts, right-padded completions).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import types
from pathlib import Path

import torch
from torch import Tensor

from grpokit.algo import token_entropy, token_logprobs
from grpokit.algo.fused import linear_logprobs
from grpokit.batch import PackedBatch, micro_batches
from grpokit.distributed import is_sharded

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger("grpokit.policy")


class ModelLoadError(ValueError):
    """The model or tokenizer could not be loaded; the message names the config key and the fix."""


def _check_local(name_or_path: str, key: str) -> None:
    """A path that is clearly local (absolute, ./, ../, ~, or under an existing folder) must exist:
    otherwise transformers would take it for a hub id and fail with a message about repo ids."""
    p = Path(name_or_path).expanduser()
    local = (
        p.is_absolute()
        or name_or_path.startswith((".", "~"))
        or (len(p.parts) > 1 and Path(p.parts[0]).is_dir())
    )
    if local and not p.exists():
        where = "" if str(p.resolve()) == name_or_path else f" (resolved to {p.resolve()})"
        raise ModelLoadError(
            f"{key}={name_or_path!r}: no such folder{where}; fix the path, or give a Hugging Face model id"
        )


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    _check_local(name_or_path, "model.tokenizer / model.name_or_path")
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load a tokenizer from {name_or_path!r} (model.tokenizer / model.name_or_path): "
            f"{str(exc).splitlines()[0]}"
        ) from None
    if tok.pad_token_id is None:
        # Common for base models. Masks, not pad ids, decide what is padding, so EOS is a safe pad.
        if tok.eos_token is None:
            raise ModelLoadError(
                f"tokenizer {name_or_path!r} has neither a pad nor an EOS token; add one to its special "
                "tokens"
            )
        tok.pad_token = tok.eos_token
        logger.warning(
            "tokenizer %r has no pad token; padding with its EOS token %r", name_or_path, tok.eos_token
        )
    tok.padding_side = "left"
    return tok


AUTO_CLASSES = {"causal_lm": "AutoModelForCausalLM", "backbone": "AutoModel"}


def load_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    head: str = "causal_lm",
):
    """from_pretrained with the config's dtype / attention / remote-code settings, for every model grpokit
    loads: head="causal_lm" (the policy, SFT) or "backbone" (the body without its LM head: the PPO
    critic's)."""
    import transformers

    auto = getattr(transformers, AUTO_CLASSES[head])
    _check_local(name_or_path, "model.name_or_path")
    kwargs = dict(dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        return auto.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as exc:
        what = (
            "a causal LM from {!r} (model.name_or_path)"
            if head == "causal_lm"
            else ("the critic's backbone from {!r} (model.name_or_path) with AutoModel")
        )
        raise ModelLoadError(
            f"could not load {what.format(name_or_path)}: {str(exc).splitlines()[0]}"
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
    """(model, tokenizer) from a ModelConfig, the model prepared for training (`prepare`)."""
    if not model_cfg.name_or_path:
        raise ModelLoadError(
            "model.name_or_path is empty: set it to a Hugging Face model id or a local folder"
        )
    tok = load_tokenizer(
        model_cfg.tokenizer or model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code
    )
    model = prepare(load_model_from_config(model_cfg), model_cfg)
    if model_cfg.lora is not None:
        model = apply_lora(model, model_cfg.lora, gradient_checkpointing=model_cfg.gradient_checkpointing)
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def load_model_from_config(model_cfg, *, head: str = "causal_lm"):
    """load_model with model.* settings: the policy (causal_lm) or the critic's body (backbone) from one
    folder."""
    return load_model(
        model_cfg.name_or_path,
        dtype=model_cfg.dtype,
        attn_implementation=model_cfg.attn_implementation,
        trust_remote_code=model_cfg.trust_remote_code,
        head=head,
    )


def prepare(model, model_cfg):
    """model.* training settings on a loaded model: dropout off (model.disable_dropout), gradient
    checkpointing (model.gradient_checkpointing), mixed precision (model.autocast); returns it in train
    mode."""
    if model_cfg.autocast != "none":
        enable_autocast(model, DTYPES[model_cfg.autocast])
    if model_cfg.disable_dropout:
        disable_dropout(model)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model.train()


def enable_autocast(model, dtype: torch.dtype) -> None:
    """Run the model's forward, and its backbone's (which the fused log-prob path calls), under
    torch.autocast(dtype): matmuls in dtype, weights / gradients / optimizer state in their own dtype.
    As accelerate does, by replacing `forward` on the instance with a bound method, so a deepcopy (pi_ref)
    keeps it, bound to the copy."""
    for module in {model, getattr(model, "base_model", model)}:
        module.forward = types.MethodType(_autocast_forward(type(module).forward, dtype), module)
    model.__dict__["_grpokit_autocast"] = dtype


def _autocast_forward(forward, dtype: torch.dtype):
    @functools.wraps(forward)
    def autocast_forward(self, *args, **kwargs):
        with torch.autocast(device_type=self.device.type, dtype=dtype):
            return forward(self, *args, **kwargs)

    return autocast_forward


def autocast_of(model):
    """The autocast context the model's forward runs under (enable_autocast), or a null context."""
    dtype = getattr(model, "_grpokit_autocast", None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model.device.type, dtype=dtype)


def apply_lora(model, lora_cfg, *, gradient_checkpointing: bool = False):
    """The model with LoRA adapters (peft's get_peft_model) as model.lora says: only the adapters train, the
    base weights are frozen. A peft PeftModelForCausalLM: forward, generate and save_pretrained (the adapter)
    as usual."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ModelLoadError(
            "model.lora runs in one process for now; drop model.lora or run without torchrun"
        )
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ModelLoadError(
            "model.lora needs the peft package: pip install 'grpokit[lora]' (or pip install peft)"
        ) from None
    config = LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        task_type="CAUSAL_LM",
        target_modules=lora_cfg.target_modules,
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exc:  # e.g. target_modules that name no module of this model
        raise ModelLoadError(
            f"model.lora.target_modules={lora_cfg.target_modules!r}: {str(exc).splitlines()[0]}"
        ) from None
    if gradient_checkpointing:  # frozen embeddings: the checkpointed blocks' inputs must carry a gradient
        peft_model.enable_input_require_grads()
    return peft_model.train()


def is_lora(model) -> bool:
    """A peft model (model.lora): its adapters are what trains and what is saved."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


class AdapterOff:
    """pi_ref of a LoRA policy: the policy itself with its adapter disabled (peft's disable_adapter) during
    each pass, i.e. the frozen base weights, shared with pi_theta: no second copy in memory. batched_logprobs
    takes it."""

    def __init__(self, policy):
        self.policy = policy


def build_reference(model, alg) -> torch.nn.Module | AdapterOff | None:
    """pi_ref as algorithm.* says: None when beta = 0 or ref_policy=none (no KL term, no second copy in
    memory); with LoRA the base model under the policy (AdapterOff); else a frozen copy of the policy as it is
    now (ref_policy=reset later copies the policy into it)."""
    if alg.beta == 0 or alg.ref_policy == "none":
        return None
    return AdapterOff(model) if is_lora(model) else frozen_copy(model)


def frozen_copy(model) -> torch.nn.Module:
    """pi_ref: a frozen, eval-mode copy of the policy as it is now."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def completion_logprobs(
    model,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
    fused: bool | None = None,
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
    """
    if fused is None:
        rows, width = batch.completion_ids.shape
        fused = rows * width * _vocab_size(model) >= FUSED_MIN_LOGITS and fused_head(model) is not None
    elif fused and fused_head(model) is None:
        raise ValueError(
            "fused log-probs need a model whose logits are a Linear head on its backbone's output"
        )
    T = batch.completion_width
    out = None
    if share_prompts and _can_share(model):
        P = batch.input_ids.shape[1] - T
        prompts = torch.cat([batch.input_ids[:, :P], batch.attention_mask[:, :P]], dim=1)  # [N, 2P]
        unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)  # [U, 2P], [N]
        if unique.shape[0] * 2 <= prompts.shape[0]:
            out = shared_prompt_logits(model, batch, unique[:, :P], unique[:, P:], inverse, fused=fused)
    if out is None:
        inputs = dict(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        )
        out = _forward(model, fused, T + 1, use_cache=False, **inputs)[
            :, :-1
        ]  # [N, T, V], or [N, T, H] fused
    if fused:
        head = fused_head(model)
        assert head is not None  # fused only with a fused head (checked above)
        with autocast_of(model):
            return linear_logprobs(
                out,
                head.weight,
                batch.completion_ids,
                bias=head.bias,
                temperature=temperature,
                with_entropy=with_entropy,
            )
    return _logp_entropy(out, batch, temperature, with_entropy)


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


def _forward(model, fused: bool, keep: int, **inputs) -> Tensor:
    """The last `keep` positions' logits, or (fused) the backbone's hidden states there."""
    if fused:
        return _backbone(model)(**inputs).last_hidden_state[:, -keep:]
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
    logits: Tensor, batch: PackedBatch, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    logp = token_logprobs(logits, batch.completion_ids, temperature=temperature)
    entropy = token_entropy(logits.detach(), temperature=temperature) if with_entropy else None
    return logp, entropy


def _can_share(model) -> bool:
    # Gradient checkpointing turns the KV cache off in training mode; the plain pass then does the work. So
    # does FSDP2, where every forward is a collective: the shared pass runs one or two, depending on the rows.
    if is_sharded(model):
        return False
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return not checkpointing and hasattr(model, "config")


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
    model, tokens: PackedBatch, *, micro_batch_size: int, temperature: float = 1.0, by_length: bool = False
) -> Tensor:
    """Log-probs [N, T] (float32, 0 on padding) under a model in eval mode, no gradient, in micro-batches
    (by_length: of rows of similar completion length, batch.micro_batches): the pi_old and pi_ref passes.
    An AdapterOff (pi_ref of a LoRA policy): the policy's passes with its adapter disabled."""
    if isinstance(model, AdapterOff):
        with model.policy.disable_adapter():
            return batched_logprobs(
                model.policy,
                tokens,
                micro_batch_size=micro_batch_size,
                temperature=temperature,
                by_length=by_length,
            )
    out = torch.zeros(tokens.completion_ids.shape, dtype=torch.float32)
    was_training = model.training
    model.eval()
    try:
        rows = torch.arange(out.shape[0])
        for idx in micro_batches(rows, tokens, micro_batch_size, by_length):
            sub = tokens.rows(idx)
            logp, _ = completion_logprobs(model, sub, temperature=temperature)
            out[idx, : sub.completion_width] = logp.float()
    finally:
        model.train(was_training)
    return out
