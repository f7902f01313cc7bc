"""The whole weights of a policy sharded over the ranks, gathered for saving (the final model, and the LoRA
checkpoints of several ranks).

    whole = whole_module(model)       # every rank calls it; rank 0 gets the whole module, the others None
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist


def is_peft(model) -> bool:
    """A peft model (model.lora): the adapters train, the base is frozen, and its checkpoint is the adapter
    (PeftModel.save_pretrained)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def whole_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """`model` with whole weights, for saving: the model itself, or for an FSDP2 module its shards gathered
    (every rank must call this: an all-gather per tensor) into a module of the model's class on rank 0, built
    on the meta device and given the gathered tensors, so that it costs one copy of the weights, on rank 0
    alone, for as long as the caller keeps it (the others get None)."""
    if not dist.is_available():
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return model
    model.reshard()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        whole = _empty_twin(model, next(c for c in type(model).__bases__ if c is not FSDPModule))
    whole.load_state_dict(state, strict=False, assign=True)
    (whole.get_base_model() if is_peft(whole) else whole).tie_weights()  # peft: the transformers model's
    for (name, buf), (_, ours) in zip(whole.named_buffers(), model.named_buffers(), strict=True):
        if buf.is_meta:  # buffers a state dict leaves out (RoPE's frequencies): the model's own
            whole.get_submodule(name.rpartition(".")[0]).register_buffer(
                name.rpartition(".")[2], ours.detach().clone(), persistent=False
            )
    return whole


def _empty_twin(model: Any, plain: type) -> Any:
    """A module shaped as `model` (its class before fully_shard: `plain`), with no FSDP2 in it, built on the
    current device (meta: no memory). A peft model (model.lora): a fresh transformers model of the base's
    class with the same adapters added (peft's get_peft_model), so that its state dict has the sharded
    model's names, and PeftModel.save_pretrained writes the adapter from the gathered tensors."""
    if not is_peft(model):
        return plain(copy.deepcopy(model.config))
    from peft import get_peft_model

    base = model.get_base_model()
    name = model.active_adapter
    twin = type(base)(copy.deepcopy(base.config))
    return get_peft_model(twin, copy.deepcopy(model.peft_config[name]), adapter_name=name)
