"""Model / tokenizer loading, for every model grpokit loads (policy, reference, critic backbone, SFT, reward
model), and the model.* training settings (dropout, gradient checkpointing, autocast, LoRA).

    model, tokenizer = load_policy(cfg.model)     # AutoModelForCausalLM + tokenizer, train mode
    ref = build_reference(model, cfg.algorithm)   # frozen copy of pi_theta, or None (beta = 0);
                                                  # with model.lora: AdapterOff(model), no copy
    backbone = load_model(path, head="backbone")  # the critic's body (AutoModel)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import types
from pathlib import Path

import torch

from grpokit.policy.gguf import GGUFError, resolve
from grpokit.policy.heap import release_between_layers

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
            f"{key}={name_or_path!r}: no such folder or file{where}; fix the path, or give a Hugging Face "
            "model id"
        )


def model_folder(name_or_path: str, key: str) -> str:
    """What from_pretrained loads for `name_or_path`: a local path must exist; a GGUF file (or a folder
    holding one) becomes its converted folder in the cache (policy/gguf.py); a hub id or a model folder is
    itself."""
    _check_local(name_or_path, key)
    try:
        return resolve(name_or_path, key)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    folder = model_folder(name_or_path, "model.tokenizer / model.name_or_path")
    try:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
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


AUTO_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "backbone": "AutoModel",
    "sequence_classification": "AutoModelForSequenceClassification",
}

#: what load_model could not load, per head ({name}: the path or id, {key}: the config key that gave it)
LOAD_FAILURES = {
    "causal_lm": "could not load a causal LM from {name!r} ({key})",
    "backbone": "could not load the critic's backbone from {name!r} ({key}) with AutoModel",
    "sequence_classification": (
        "{key}={name!r}: could not load a sequence-classification reward model "
        "(AutoModelForSequenceClassification)"
    ),
}


#: files a tokenizer's folder holds (save_pretrained of a tokenizer writes some of them)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _check_not_only_a_tokenizer(folder: str, name_or_path: str, key: str) -> None:
    """A local folder with a tokenizer but no config.json: transformers' error asks for a `model_type` key;
    say what the folder is and which key to point where."""
    path = Path(folder)
    if (
        path.is_dir()
        and not (path / "config.json").exists()
        and any((path / f).exists() for f in TOKENIZER_FILES)
    ):
        separate = " (model.tokenizer names a separate tokenizer)" if key == "model.name_or_path" else ""
        raise ModelLoadError(
            f"{key}={name_or_path!r}: the folder holds a tokenizer but no config.json or weights; "
            f"point {key} at the model's folder{separate}"
        )


def load_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    head: str = "causal_lm",
    key: str = "model.name_or_path",
    device: str | torch.device | None = None,
):
    """from_pretrained with the config's dtype / attention / remote-code settings, for every model grpokit
    loads: head="causal_lm" (the policy, SFT), "backbone" (the body without its LM head: the PPO critic's) or
    "sequence_classification" (a reward model). dtype is a DTYPES name or "auto" (the checkpoint's own);
    key is the config key that named the model, for the errors; device, when given, is where it then goes."""
    import transformers

    auto = getattr(transformers, AUTO_CLASSES[head])
    folder = model_folder(name_or_path, key)
    kwargs = dict(dtype="auto" if dtype == "auto" else DTYPES[dtype], trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    _check_not_only_a_tokenizer(folder, name_or_path, key)
    try:
        model = auto.from_pretrained(folder, **kwargs)
    except (OSError, ValueError) as exc:
        what = LOAD_FAILURES[head].format(name=name_or_path, key=key)
        raise ModelLoadError(f"{what}: {str(exc).splitlines()[0]}") from None
    return model if device is None else model.to(device)


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
        model = apply_lora(
            model, model_cfg.lora, gradient_checkpointing=model_cfg.gradient_checkpointing is True
        )
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
    if model_cfg.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(model)
    if model_cfg.disable_dropout:
        disable_dropout(model)
    if model_cfg.gradient_checkpointing is True:  # auto: decided once the run is built (components.py)
        enable_checkpointing(model, release=model_cfg.release_freed_memory)
    return model.train()


def enable_checkpointing(model, every_n_layers: int = 1, *, release: bool = True) -> None:
    """transformers' gradient checkpointing (non-reentrant torch.utils.checkpoint) on every
    `every_n_layers`-th decoder layer; the KV cache off in training passes. A LoRA model's frozen
    embeddings get an output that carries a gradient, as the checkpointed layers' inputs must. `release`
    (model.release_freed_memory): on the CPU, the freed heap back to the OS between layers (heap.py)."""
    if every_n_layers == 1:
        model.gradient_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable(every_n_layers=every_n_layers)
    model.config.use_cache = False
    if is_lora(model):
        model.enable_input_require_grads()
    if release:
        release_between_layers(model)


def is_checkpointing(model) -> bool:
    """The model recomputes its activations in the backward (transformers' gradient checkpointing)."""
    state = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    if state is None:
        state = getattr(model, "is_gradient_checkpointing", False)
    return bool(state)


def enable_autocast(model, dtype: torch.dtype) -> None:
    """Run the model's forward, and its backbone's (which the fused log-prob path calls), under
    torch.autocast(dtype): matmuls in dtype, weights / gradients / optimizer state in their own dtype.
    As accelerate does, by replacing `forward` on the instance with a bound method, so a deepcopy (pi_ref)
    keeps it, bound to the copy."""
    for module in {model, getattr(model, "base_model", model)}:
        module.forward = types.MethodType(_autocast_forward(type(module).forward, dtype), module)
    model.__dict__["_grpokit_autocast"] = dtype


def cast_lm_head_to_fp32(model) -> None:
    """model.cast_lm_head_to_fp32 (ScaleRL): the LM head's forward runs outside autocast on float32 copies of
    its input and weight, so the logits (and the log-softmax after them) are float32 under autocast or bf16
    weights; the weight keeps its dtype and gets its gradient through the cast. The fused log-prob path
    (grpokit/algo/fused.py) does the same for its chunks. A model without a Linear head is an error."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ModelLoadError(
            f"model.cast_lm_head_to_fp32 needs a Linear LM head; this model's is {type(head).__name__}"
        )
    head.forward = types.MethodType(_fp32_linear, head)  # type: ignore[method-assign]  # per instance
    model.__dict__["_grpokit_fp32_head"] = True


def _fp32_linear(self, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else self.bias.float()
    with torch.autocast(device_type=x.device.type, enabled=False):
        return torch.nn.functional.linear(x.float(), self.weight.float(), bias)


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
