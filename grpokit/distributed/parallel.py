"""Parallelization: the policy over the ranks (FSDP2's fully_shard or DDP), its one handle, and the
checkpoints that go with it (sharded with torch.distributed.checkpoint, or whole).

    policy = world.wrap(model, ref)   # FSDP2 fully_shard per decoder layer then the root, or DDP; the handle
    world.backward(loss)              # DDP / FSDP2 average gradients over ranks; the loss is scaled by W
    world.save_checkpoint(out, step, model, adamw, tokenizer, state, keep_last)
    is_sharded(model)                 # an FSDP2 module: every rank runs the same forwards

Parallel is World's parallelization half (World in world.py derives from it): the ranks, the process group
and the collectives are World's; what the model is and how it is saved are here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from grpokit.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    is_sharded_checkpoint,
    load_weights,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from grpokit.checkpoint_sharded import load_sharded, save_sharded
from grpokit.policy_handle import PolicyHandle

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import OptimizerStateType, ValueType
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor


def is_sharded(model) -> bool:
    """An FSDP2 module: its parameters are shards and every forward all-gathers them, so every rank must run
    the same sequence of forwards (grpokit/policy/logprobs.py then takes the one-forward path)."""
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, each an FSDP2 unit: the classes transformers marks as never split across
    devices (`_no_split_modules`, e.g. LlamaDecoderLayer; what accelerate's FSDP auto-wrap uses too), as any
    module inside `model` lists them: the model itself, the transformers model under a peft wrapper
    (model.lora), the critic's backbone."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def whole_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """`model` with whole weights, for saving: the model itself, or for an FSDP2 module its shards gathered
    (every rank must call this: an all-gather per tensor) into a module of the model's class on rank 0, built
    on the meta device and given the gathered tensors, so that it costs one copy of the weights, on rank 0
    alone, for as long as the caller keeps it (the others get None)."""
    if not is_sharded(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    cast("FSDPModule", model).reshard()
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


def is_peft(model) -> bool:
    """A peft model (model.lora): the adapters train, the base is frozen, and its checkpoint is the adapter
    (PeftModel.save_pretrained)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


class Parallel:
    """World's parallelization half: wrapping the policy (wrap), its whole weights (full_model), pi_ref's
    reset, the backward over ranks and the checkpoints. It reads the world's rank, size, device, strategy and
    mixed_precision, and keeps the wrapped modules (World.__init__ sets them all)."""

    rank: int
    size: int
    strategy: str
    mixed_precision: str
    device: torch.device
    _model: torch.nn.Module | None
    _full: torch.nn.Module | None
    _ref: Any
    _critic: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None  # keep_critic: PPO's value model
    whole_copy: bool = True
    """FSDP2: the rollout engine generates with an unsharded copy of the policy (fast, hf); False when it
    takes the weights from the shards itself (vllm colocated, which gathers them as it pushes)."""
    engine_dtype: torch.dtype = torch.float32
    """FSDP2: the dtype of that copy's parameters (distributed.engine_copy); its buffers stay the model's."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ the model
    def wrap(self, model: torch.nn.Module, ref: Any = None) -> PolicyHandle:
        """The policy's one handle (grpokit/policy_handle.py): the module whose parameters the optimizer
        steps, what the training forward calls, pi_ref, and the module the rollout engine generates and
        evaluates with (full() refreshes it). One process: the model itself for all three.

        The process group starts here, its backend following the policy's device: nccl on CUDA, gloo on CPU.
        fsdp2: fully_shard on each decoder layer, then on the root (torchtitan's recipe), in place, with
        FSDP2's MixedPrecisionPolicy under distributed.mixed_precision=bf16; pi_ref (`ref`, frozen) is sharded
        the same way in place, so it costs 1/W of its weights per rank. The engine gets an unsharded copy of
        the policy (in engine_dtype), filled by full_model() after each update and emptied by
        release_engine_copy() before the next, so that generation and rank 0's evaluation run no collective
        whatever their lengths (it costs one whole copy of the weights per rank while the engine needs it).
        ddp: the replica itself generates; only the training forward goes through DDP; pi_ref is a whole
        copy.
        model.lora (a peft model): the same, the frozen base and the adapters sharded together per layer
        (FSDP2 reduces gradients only for the parameters that have one; DDP all-reduces the trainable ones);
        pi_ref is the policy with its adapter off (policy.AdapterOff), nothing of its own to shard; the
        engine's copy is the peft model, base and adapters, refreshed as the full model's."""
        self._model, self._ref = model, ref
        if self.size == 1:
            return self._handle(model, model)
        self.device = next(model.parameters()).device
        if not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo"
            )  # env://, as torchrun sets it
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # forward_sync_buffers=False: the buffers are constants (RoPE frequencies), and no-grad passes
            # need no collective
            return self._handle(DistributedDataParallel(model, forward_sync_buffers=False), model)
        if is_peft(model):  # rank 0's adapters everywhere, as DDP does at its start (see _broadcast)
            _broadcast([p for p in model.parameters() if p.requires_grad])
        self._full = self._engine_copy(model)
        for module in (model, ref) if isinstance(ref, torch.nn.Module) else (model,):
            self._shard(module)
        if self._full is None:
            return self._handle(model, model)
        self.full_model()  # filled from the shards: the whole weights and the copy are never held together
        return self._handle(model, self._full)

    def _engine_copy(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """FSDP2: the unsharded copy of the policy the engine generates with, made empty (each parameter an
        empty tensor of engine_dtype, tied weights one parameter; the buffers copied), for full_model() to
        fill once the model is sharded; or None (whole_copy False: the engine and full_model() get the
        sharded module itself)."""
        if not self.whole_copy:
            return None
        memo: dict[int, Any] = {
            id(p): torch.nn.Parameter(
                torch.empty(0, dtype=self.engine_dtype, device=p.device), requires_grad=p.requires_grad
            )
            for p in model.parameters()
        }
        return copy.deepcopy(model, memo)

    def release_engine_copy(self) -> None:
        """FSDP2: the engine's copy gives its weights back (each parameter an empty tensor of its dtype) until
        the next full_model() fills it: the update, which needs none of it, runs without that memory.
        Without a copy, and in one process or DDP: nothing."""
        if self._full is None:
            return
        for p in self._full.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def saved_model(self) -> torch.nn.Module:
        """The policy to save whole (the final model): the engine's copy when it holds the training weights
        (fp32), refreshed; otherwise the module itself, which whole_module() gathers in its own dtype on
        rank 0 (a bf16 copy would save rounded weights). Every rank calls it."""
        if self._full is not None and self.engine_dtype == torch.float32:
            return self.full_model()
        assert self._model is not None  # wrap() came first
        return self._model

    def wrap_critic(self, module: torch.nn.Module) -> torch.nn.Module:
        """The PPO critic over the ranks, as the policy (wrap, after it): FSDP2 shards it in place per decoder
        layer and root, DDP wraps it. Returns what its training forward calls; its no-grad value passes call
        the module itself (under FSDP2 the same sharded module: every rank runs them alike). Its optimizer
        is made after this, on the module's (sharded) parameters, and handed to keep_critic."""
        if self.size == 1:
            return module
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(module, forward_sync_buffers=False)
        self._shard(module)
        return module

    def keep_critic(self, module: torch.nn.Module, adamw: torch.optim.Optimizer) -> None:
        """The critic and its AdamW, saved with the policy's shards at W > 1 (save_checkpoint)."""
        self._critic = (module, adamw)

    def _handle(self, forward: Any, whole: torch.nn.Module) -> PolicyHandle:
        assert self._model is not None
        return PolicyHandle(
            self._model,
            forward,
            self._ref,
            whole=whole,
            full=self.full_model,
            reset_reference=self.reset_reference,
            release=self.release_engine_copy,
            saved=self.saved_model,
        )

    def _shard(self, model: torch.nn.Module) -> None:
        """FSDP2 in place: each decoder layer a unit, then the root; bf16 all-gathers and compute, fp32
        reductions under distributed.mixed_precision=bf16 (the sharded parameters stay in their dtype: the
        master weights)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.size,))
        layer_mp = root_mp = MixedPrecisionPolicy()  # FSDP2's default: the parameters' own dtype throughout
        if (
            self.mixed_precision == "bf16"
        ):  # the layers pass bf16 on; the root's output (the logits) comes out fp32
            layer_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            root_mp = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=layer_mp)
        fully_shard(model, mesh=mesh, mp_policy=root_mp)

    def reset_reference(self) -> None:
        """pi_ref <- pi_theta (algorithm.ref_policy=reset). FSDP2: shard by shard (the same layout), no
        all-gather."""
        model, ref = self._model, self._ref
        assert model is not None and ref is not None  # wrap(model, ref) came first
        with torch.no_grad():
            if not is_sharded(model):
                ref.load_state_dict(model.state_dict())
                return
            for module in (ref, model):  # sharded in place by _shard
                # a no-grad forward leaves the root's parameters unsharded (plain tensors) until the next
                cast("FSDPModule", module).reshard()
            for r, p in zip(ref.parameters(), model.parameters(), strict=True):
                r.copy_(p)

    def full_model(self) -> torch.nn.Module:
        """The policy with whole weights, current: what the engine syncs to and evaluates with.
        FSDP2: the unsharded copy, filled from the shards (an all-gather per parameter, each whole tensor
        cast to engine_dtype as it comes; every rank calls this), whether release_engine_copy() emptied it
        or not; without one (whole_copy False) the sharded module itself, which the engine gathers from and
        whole_module() gathers for saving."""
        model = self._model
        assert model is not None  # wrap() came first
        if self._full is None:
            return model
        full = dict(self._full.named_parameters())
        cast("FSDPModule", model).reshard()  # the shards (DTensors), whatever the last forward left
        with torch.no_grad():
            for name, p in model.named_parameters():
                target = full[name]
                target.data = cast("DTensor", p).full_tensor().to(target.dtype)
        return self._full

    def backward(self, loss: Tensor) -> None:
        """loss.backward() for this rank's share of a loss that is a sum over every rank's rows. DDP and FSDP2
        average gradients over the W ranks; the gradient of the global loss is their sum, hence W x loss."""
        (loss * self.size if self.size > 1 else loss).backward()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, out: Path, step: int, model, adamw, tokenizer, state: dict, keep_last: int
    ) -> Path:
        """One process: checkpoint.save_checkpoint (model.safetensors + the trainer state). Several: every
        rank writes its shards of the weights and AdamW's moments with torch.distributed.checkpoint
        (checkpoint_sharded.py); rank 0's `state` without the moments (state["optimizer"], per-rank DTensors)
        goes next to them."""
        if self.size == 1:
            return save_checkpoint(out, step, model, tokenizer, state, keep_last)
        if is_peft(model):
            return self._save_adapter(out, step, model, adamw, tokenizer, state, keep_last)
        # pi_ref after a reset and the PPO critic (weights and moments): sharded too
        rest = {
            k: v
            for k, v in state.items()
            if k not in ("optimizer", "ref_model", "critic", "critic_optimizer")
        }
        return save_sharded(
            out,
            step,
            model,
            adamw,
            tokenizer,
            rest,
            keep_last,
            self,
            ref=self._ref if "ref_model" in state else None,
            critic=self._critic if "critic" in state else None,
        )

    def _save_adapter(
        self, out: Path, step: int, model, adamw, tokenizer, state: dict, keep_last: int
    ) -> Path:
        """model.lora at W > 1: the checkpoint one process writes (the adapter, PeftModel.save_pretrained,
        and AdamW's moments keyed by parameter order in trainer_state.pt), from rank 0: the adapter is small,
        and the frozen base comes from model.name_or_path. The moments are gathered whole to rank 0
        (full_state_dict); every rank's generators go with them (rank_rng), for a resume at the same W."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # FSDP2: the engine's fp32 copy, refreshed from the shards; without one (vllm colocated) or with a
        # bf16 one, the shards gathered into a module on rank 0 (whole_module; DDP: the replica); every rank
        whole = whole_module(self.saved_model()) if is_sharded(model) else model
        moments: Any = get_optimizer_state_dict(
            model, adamw, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )  # a collective: rank 0 gets the whole tensors, by parameter name
        rngs: list[Any] = [None] * self.size
        dist.all_gather_object(rngs, rng_state())  # every rank's generators, in rank order
        if self.is_main:
            names = [n for n, p in model.named_parameters() if p.requires_grad]  # the one-process order
            index = {n: i for i, n in enumerate(names)}
            by_index = {
                "state": {index[n]: v for n, v in moments["state"].items()},
                "param_groups": [
                    {**g, "params": [index[n] for n in g["params"]]} for g in moments["param_groups"]
                ],
            }
            save_checkpoint(
                out, step, whole, tokenizer, {**state, "optimizer": by_index, "rank_rng": rngs}, keep_last
            )
        dist.barrier()  # every rank returns once the checkpoint is in place
        return checkpoint_dir(out, step)

    def load_checkpoint(self, path: Path, state: dict, *, model, adamw, seed: int) -> None:
        """A checkpoint into this world: weights, AdamW's moments, generators, and pi_ref when the checkpoint
        holds one (ref_policy=reset). Written by ranks (torch.distributed.checkpoint): at any world size, one
        process included. Written by one process (model.safetensors, the rest in `state`): as it is, or at
        several ranks every rank reads the whole tensors and keeps its part
        (StateDictOptions(full_state_dict=True))."""
        if is_sharded_checkpoint(path):
            load_sharded(
                path,
                model,
                adamw,
                rank=self.rank,
                seed=seed,
                step=state["step"],
                ref=self._ref if isinstance(self._ref, torch.nn.Module) else None,
                critic=self._critic,
            )
        elif self.size == 1:
            load_weights(path, model)
            set_rng_state(state["rng"])
        else:
            self._load_whole(path, state, model, adamw, seed)

    def _load_whole(self, path: Path, state: dict, model, adamw, seed: int) -> None:
        """A one-process checkpoint at several ranks. Its moments are keyed by the optimizer's parameter
        order, which is the model's named_parameters (optim.Optimizer), and are set here by name;
        state["optimizer"] and state["ref_model"] are consumed, so that the trainer's own loading skips
        them."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        whole, lenient = (
            StateDictOptions(full_state_dict=True),
            StateDictOptions(full_state_dict=True, strict=False),
        )
        if is_peft(model):
            self._load_adapter(path, model)
        else:
            weights: dict[str, ValueType] = {
                k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()
            }
            missing = [
                n for n, _ in model.named_parameters() if n not in weights
            ]  # a tied head is saved once, as the embedding
            if missing:
                raise CheckpointError(
                    f"checkpoint {str(path)!r} does not hold {missing[:3]} of this model; resume it with one "
                    "process, with the model it was trained from"
                )
            set_model_state_dict(model, weights, options=lenient)
        set_optimizer_state_dict(model, adamw, _by_name(model, state.pop("optimizer")), options=whole)
        if "ref_model" in state and self._ref is not None:
            set_model_state_dict(self._ref, state.pop("ref_model"), options=lenient)
        if "critic" in state and self._critic is not None:  # PPO: the value model and its moments
            critic, critic_adamw = self._critic
            set_model_state_dict(critic, state.pop("critic"), options=whole)
            by_name = _by_name(critic, state.pop("critic_optimizer"))
            set_optimizer_state_dict(critic, critic_adamw, by_name, options=whole)
        ranks = state.get("rank_rng") or [state["rng"]]  # a LoRA checkpoint of W ranks holds every rank's
        if self.rank < len(ranks):
            set_rng_state(ranks[self.rank])
        else:
            seed_everything(hash((seed, self.rank, state["step"])) % 2**31)

    def _load_adapter(self, path: Path, model) -> None:
        """A LoRA checkpoint (the adapter) at W > 1: peft loads it into the whole module (DDP: the replica;
        FSDP2: the engine's copy), whose adapter weights each rank then keeps its part of."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if is_sharded(model) and (self._full is None or self.engine_dtype != torch.float32):
            # FSDP2 without an fp32 copy (vllm; engine_copy=bf16): the file by name into the shards
            set_model_state_dict(
                model, _adapter_by_name(path, model), options=StateDictOptions(full_state_dict=True)
            )
            return
        whole = self._full if self._full is not None else model
        load_weights(path, whole)
        if whole is not model:
            adapter = {n: p.detach() for n, p in whole.named_parameters() if p.requires_grad}
            set_model_state_dict(model, adapter, options=StateDictOptions(full_state_dict=True, strict=False))


def _adapter_by_name(path: Path, model) -> dict[str, ValueType]:
    """A LoRA checkpoint's adapter (peft's file, whose names leave out the adapter's name) keyed by the
    model's own parameter names, every trainable parameter of the model named once."""
    from safetensors.torch import load_file

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no adapter_model.safetensors, but model.lora is set; "
            "resume with the config it was trained with, or set a new output_dir"
        )
    saved, tag = load_file(file), f".{model.active_adapter}"
    names = {n.replace(tag, ""): n for n, p in model.named_parameters() if p.requires_grad}
    if set(saved) != set(names):
        odd = sorted(set(saved) ^ set(names))[:3]
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not match the adapter ({odd}); resume with the model and "
            "model.lora it was trained with, or set a new output_dir"
        )
    return {names[k]: v for k, v in saved.items()}


def _broadcast(params: list[torch.nn.Parameter]) -> None:
    """Rank 0's values of `params` on every rank. Each rank seeds its generators with seed + rank, so weights
    drawn at random when the model is built (LoRA's A matrices) differ between ranks; DDP broadcasts rank 0's
    at its start, FSDP2 shards whatever each rank holds. The checkpoint's weights are the same everywhere."""
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def _by_name(model: torch.nn.Module, saved: dict) -> OptimizerStateType:
    """A one-process optimizer state (moments keyed by the index of the trainable parameter, the order of
    named_parameters) keyed by parameter name, for set_optimizer_state_dict."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: v for i, v in saved["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
