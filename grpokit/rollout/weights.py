"""Weights into a vLLM engine: what a push sends, how it travels to a server, and the check that it took.

    named = pushed_tensors(model, everything=False)          # [(name, tensor)]: trainable tensors, tied names
                                                             # included; a LoRA policy's adapted layers merged
    shapes = pushed_shapes(model)                            # {name: shape} of a first push, nothing computed
    path, aliases = write_push(named, push_dir())            # rollout.vllm_mode=server: a safetensors file in
                                                             # /dev/shm
    unique, aliases = unique_tensors(named)                  # each storage once (a broadcast push:
                                                             # grpokit/rollout/fleet.py)
    named = read_push(path, aliases)                         # the server's side
    err = check_push(vllm_logprobs, model, ids, dtype, n)    # RolloutError when vLLM's probe log-probs are
                                                             # not the model's

One copy for both vLLM engines: the colocated one (grpokit/rollout/vllm.py) hands `named` to vLLM in memory;
the server client (grpokit/rollout/server.py) writes it to a file the server (grpokit/rollout/serve.py) loads,
and both check every push the same way (docs/rollout.md).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import torch

#: max |vLLM prompt log-prob - trainer log-prob| on the probe after a push, by the weights' dtype
PUSH_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}
#: tokens in the probe sequence a push is checked on
PROBE_LENGTH = 16


class RolloutError(RuntimeError):
    """The rollout engine failed in a way the run cannot go on from (e.g. a weight push that did not take)."""


def base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def trainable_tensors(model, *, everything: bool) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the parameters vLLM needs: the trainable ones, or every one (`everything`, the first
    push). state_dict, not named_parameters: a tied LM head is listed under its own name too, and vLLM's
    lm_head is a layer of its own that a reload otherwise leaves with the weights of the previous push."""
    return [
        (name, t.detach())
        for name, t in base_model(model).state_dict(keep_vars=True).items()
        if isinstance(t, torch.nn.Parameter) and (t.requires_grad or everything)
    ]


def pushed_tensors(model, *, everything: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """What a push sends: the trainable tensors (every one: `everything`), or for a LoRA policy (model.lora)
    the adapted layers' weights with the adapters merged in (lora_tensors)."""
    if hasattr(model, "peft_config"):
        return lora_tensors(model, everything=everything)
    return iter(trainable_tensors(model, everything=everything))


def pushed_shapes(model) -> dict[str, list[int]]:
    """{name: shape} of every tensor a first push sends (pushed_tensors(everything=True)), without merging or
    gathering anything: an FSDP2 shard's shape is its whole tensor's."""
    if hasattr(model, "peft_config"):
        return {name: list(t.shape) for name, t, _ in _lora_entries(model, everything=True)}
    return {name: list(t.shape) for name, t in trainable_tensors(model, everything=True)}


def lora_tensors(model, *, everything: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA policy (a peft model) as vLLM's model has it: each adapted layer's weight with its adapters
    merged in (W + B A alpha / r, peft's get_delta_weight), computed one layer at a time as the consumer takes
    it, and names without peft's. `everything`: every tensor (the first push); else the adapted layers and
    their siblings (vLLM fuses q, k, v and gate, up into one layer, which it reloads once all its parts
    arrived), so a push costs what the adapted part of the model weighs."""
    for name, t, layer in _lora_entries(model, everything=everything):
        yield name, (t.detach() if layer is None else merged_weight(layer))


def _lora_entries(model, *, everything: bool) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """(vLLM's name, the peft model's tensor, its adapted layer or None) of each tensor lora_tensors sends."""
    base = base_model(model)
    adapted = {n: m for n, m in base.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
    parents = {n.rpartition(".")[0] for n in adapted}
    for name, t in base.state_dict(keep_vars=True).items():
        if ".lora_" in name or not isinstance(t, torch.nn.Parameter):
            continue
        plain = name.replace(".base_layer.", ".")
        owner = plain.rpartition(".")[0]
        if not everything and owner.rpartition(".")[0] not in parents:
            continue
        yield plain, t, adapted[owner] if owner in adapted and plain.endswith(".weight") else None


@torch.no_grad()
def merged_weight(layer) -> torch.Tensor:
    """A peft LoRA Linear's base weight plus each active adapter's (alpha / r) B A (peft's get_delta_weight
    for a Linear), from whole tensors: FSDP2's shards are gathered first (every rank takes the same ones)."""
    w = _whole(layer.base_layer.weight)
    for name in layer.active_adapters:
        if name in layer.lora_A:
            delta = (
                _whole(layer.lora_B[name].weight) @ _whole(layer.lora_A[name].weight) * layer.scaling[name]
            )
            w = w + (delta.T if layer.fan_in_fan_out else delta).to(w.dtype)
    return w


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def gathered(named) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs with each FSDP2 shard (a DTensor) replaced by its whole tensor, gathered as
    the consumer takes it: one parameter at a time, never a whole copy of the model. Every rank must take the
    same tensors in the same order (one all-gather each)."""
    for name, t in named:
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


def probe_ids(model, push: int) -> list[int]:
    """PROBE_LENGTH token ids, fixed per push number, from a generator of their own (the run's RNG is
    untouched)."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return torch.randint(0, vocab, (PROBE_LENGTH,), generator=torch.Generator().manual_seed(push)).tolist()


@torch.no_grad()
def model_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1] float64 log-probs of ids[1:] under `model`, in eval mode (what vLLM's prompt_logprobs
    report)."""
    was_training = model.training
    model.eval()
    try:
        logits = (
            model(input_ids=torch.tensor([ids], device=next(model.parameters()).device))
            .logits[0, :-1]
            .float()
        )
    finally:
        model.train(was_training)
    ours = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:], device=logits.device)[:, None]).squeeze(-1)
    return ours.double().cpu()


def push_error(vllm_logprobs: list[float], model, ids: list[int]) -> float:
    """max |vLLM's prompt log-probs of the probe - the model's own|."""
    return (
        (model_prompt_logprobs(model, ids) - torch.tensor(vllm_logprobs, dtype=torch.float64))
        .abs()
        .max()
        .item()
    )


def check_push(err: float, model, dtype: torch.dtype, push: int, where: str = "vLLM") -> float:
    """RolloutError when err is above PUSH_TOLERANCE for vLLM's weights dtype (0.1 under model.autocast: the
    trainer's forward then runs in bf16 / fp16 while vLLM runs the weights' dtype)."""
    tol = 0.1 if getattr(model, "_grpokit_autocast", None) is not None else PUSH_TOLERANCE.get(dtype, 0.1)
    if not err <= tol:
        raise RolloutError(
            f"{where} weight push {push} did not take: its log-probs differ from the trainer's by "
            f"{err:.3g} (> {tol:g}) on the probe sequence"
        )
    return err


# --------------------------------------------------------------------- the file a push to a server travels in
def push_dir() -> str:
    """/dev/shm (memory, not disk) where there is one, else the temp folder: shared by the trainer and a
    server on the same machine."""
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )


def unique_tensors(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """Each storage once: a tied name (lm_head.weight = embed_tokens.weight) becomes an alias of the first
    name that holds it. Returns ([(name, contiguous tensor)], {alias: name})."""
    unique, aliases = [], {}
    seen: dict[tuple[Any, ...], str] = {}  # storage key -> the name it is sent under
    for name, t in named:
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique.append((name, t.contiguous()))
    return unique, aliases


def write_push(named: list[tuple[str, torch.Tensor]], folder: str) -> tuple[str, dict[str, str]]:
    """A safetensors file of the tensors, each storage once: a tied name (lm_head.weight =
    embed_tokens.weight) becomes an alias (safetensors refuses shared tensors). Returns (path, {alias: name in
    the file})."""
    from safetensors.torch import save_file

    unique, aliases = unique_tensors(named)
    path = os.path.join(folder, f"grpokit-push-{os.getpid()}-{uuid.uuid4().hex[:12]}.safetensors")
    try:
        save_file(dict(unique), path)
    except BaseException:
        if os.path.exists(path):
            os.unlink(path)
        raise
    return path, aliases


def read_push(path: str, aliases: dict[str, str]) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors = load_file(path)
    return [*tensors.items(), *((alias, tensors[name]) for alias, name in aliases.items())]
