"""Parallelization: the policy over the ranks (FSDP2's fully_shard or DDP) and its one handle.

    policy = world.wrap(model, ref)   # FSDP2 fully_shard per decoder layer then the root, or DDP; the handle
    world.backward(loss)              # DDP / FSDP2 average gradients over ranks; the loss is scaled by W
    is_sharded(model)                 # an FSDP2 module: every rank runs the same forwards

World (world.py) holds a Parallel (world.parallel): the ranks, the process group and the collectives are
World's; what the model becomes over them is here. How it is saved is
grpokit/checkpoint/'s (the Checkpointer is handed the module, its optimizer and policy.gathered).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from grpokit.checkpoint.whole import is_peft
from grpokit.distributed.handle import PolicyHandle

if TYPE_CHECKING:
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


class Parallel:
    """The policy (and the critic) over the ranks: wrapping (wrap, wrap_critic), its whole weights
    (full_model), pi_ref's reset and the backward over ranks. World holds one (world.parallel) and hands its
    wrap / wrap_critic / backward on; nothing here is about checkpoints (grpokit/checkpoint/)."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        strategy: str = "none",
        mixed_precision: str = "none",
        *,
        whole_copy: bool = True,
        engine_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.rank, self.size, self.strategy, self.mixed_precision = rank, size, strategy, mixed_precision
        self.whole_copy = whole_copy
        """FSDP2: the rollout engine generates with an unsharded copy of the policy (fast, hf); False when it
        takes the weights from the shards itself (vllm colocated, which gathers them as it pushes)."""
        self.engine_dtype = engine_dtype
        """FSDP2: the dtype of that copy's parameters (distributed.engine_copy); its buffers stay the
        model's."""
        self.device = torch.device("cpu")  # the policy's device (wrap): where collectives' tensors go
        self._model: torch.nn.Module | None = None  # the trained module (FSDP2: sharded in place)
        self._full: torch.nn.Module | None = None  # FSDP2: an unsharded copy for the engine and the save
        self._ref: Any = None  # pi_ref (FSDP2: sharded as the policy is; LoRA: the adapter-off policy)

    # ------------------------------------------------------------------ the model
    def wrap(self, model: torch.nn.Module, ref: Any = None) -> PolicyHandle:
        """The policy's one handle (grpokit/distributed/handle.py): the module whose parameters the optimizer
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
        is made after this, on the module's (sharded) parameters; the Checkpointer saves both."""
        if self.size == 1:
            return module
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(module, forward_sync_buffers=False)
        self._shard(module)
        return module

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


def _broadcast(params: list[torch.nn.Parameter]) -> None:
    """Rank 0's values of `params` on every rank. Each rank seeds its generators with seed + rank, so weights
    drawn at random when the model is built (LoRA's A matrices) differ between ranks; DDP broadcasts rank 0's
    at its start, FSDP2 shards whatever each rank holds. The checkpoint's weights are the same everywhere."""
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)
