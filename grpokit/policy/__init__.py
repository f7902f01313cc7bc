"""The policy: model / tokenizer loading (policy, reference, critic backbone, SFT), and per-token log-probs.

    model, tokenizer = load_policy(cfg.model)     # AutoModelForCausalLM + tokenizer, train mode
    ref = build_reference(model, cfg.algorithm)   # frozen copy of pi_theta, or None (beta = 0);
                                                  # with model.lora: AdapterOff(model), no copy
    backbone = load_model(path, head="backbone")  # the critic's body (AutoModel)
    logp, entropy = completion_logprobs(model, packed, temperature=1.0, with_entropy=True)   # [N, T] each

One module per job: loading.py (loading and the model.* training settings: dropout, checkpointing, autocast,
LoRA, pi_ref), logprobs.py (the log-prob and entropy kernels: plain, shared-prompt, fused and padding-free
passes), padding_free.py (whether a model may run padding-free rows: model.padding_free) and memory.py
(model.gradient_checkpointing=auto: which layers to checkpoint for the memory left).
"""

from __future__ import annotations

from grpokit.policy.loading import (
    AUTO_CLASSES,
    DTYPES,
    AdapterOff,
    ModelLoadError,
    apply_lora,
    autocast_of,
    build_reference,
    disable_dropout,
    enable_autocast,
    enable_checkpointing,
    frozen_copy,
    is_checkpointing,
    is_lora,
    load_model,
    load_model_from_config,
    load_policy,
    load_tokenizer,
    prepare,
)
from grpokit.policy.logprobs import (
    FUSED_MIN_LOGITS,
    batched_logprobs,
    completion_logprobs,
    fused_head,
    padding_fraction,
    select_cache_rows,
    select_rows,
    shared_prompt_logits,
)
from grpokit.policy.memory import checkpointing_plan, memory_left
from grpokit.policy.padding_free import check_padding_free

__all__ = [
    "AUTO_CLASSES",
    "DTYPES",
    "FUSED_MIN_LOGITS",
    "AdapterOff",
    "ModelLoadError",
    "apply_lora",
    "autocast_of",
    "batched_logprobs",
    "build_reference",
    "check_padding_free",
    "checkpointing_plan",
    "completion_logprobs",
    "padding_fraction",
    "disable_dropout",
    "enable_autocast",
    "enable_checkpointing",
    "frozen_copy",
    "fused_head",
    "is_checkpointing",
    "is_lora",
    "load_model",
    "load_model_from_config",
    "load_policy",
    "load_tokenizer",
    "memory_left",
    "prepare",
    "select_cache_rows",
    "select_rows",
    "shared_prompt_logits",
]
