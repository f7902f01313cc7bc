"""torch.distributed for grpokit: launch from torchrun, FSDP2 or DDP, and the whole-batch reductions the math
needs.

    torchrun --nproc_per_node 2 -m grpokit train config.yaml   # one node, two processes (docs/scaling.md)

    # RANK / WORLD_SIZE / LOCAL_RANK from torchrun; unset or 1: one process
    world = World.from_env(cfg)
    # FSDP2 fully_shard per decoder layer then the root, or DDP
    policy = world.wrap(model, ref)
    # this rank's contiguous share of the step's prompts: whole groups
    rows = world.share(sampler.next())
    # all_reduce SUM: the normalizers of the global minibatch's loss
    n_seq, n_tok = world.sum(len(idx), tokens)
    # DDP / FSDP2 average gradients over ranks; the loss is scaled by W
    world.backward(loss)
    world.teardown()

Every rank rolls out and scores whole groups of its share of the prompts, so a group never straddles
ranks and group statistics are local. What is a whole-batch quantity (a batch std, the
loss normalizers, dynamic sampling's "enough kept groups", the gradient and its norm, the logged
metrics) goes through a method here, so the loop reads the same at one rank or many.
At world size 1 nothing here communicates and every method returns what the one process has:
one process never opens a process group.

Collectives are torch.distributed's own (all_reduce, all_gather, broadcast, their *_object forms); the
sharding is FSDP2's fully_shard and the replication DDP's; checkpoints are torch.distributed.checkpoint's
(checkpoint_sharded.py). docs/scaling.md has the whole picture.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from grpokit.batch import PackedBatch, RolloutBatch
from grpokit.checkpoint import (
    CheckpointError,
    StopSignals,
    is_sharded_checkpoint,
    load_weights,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from grpokit.checkpoint_sharded import load_sharded, save_sharded
from grpokit.config import Config, ConfigError
from grpokit.metrics import RANK_REDUCTIONS, MeanAccumulator
from grpokit.policy_handle import PolicyHandle
from grpokit.types import RewardOutput

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import OptimizerStateType, ValueType
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

REDUCE: dict[str, Callable[[list[float]], float]] = {
    "max": max,
    "min": min,
    "sum": sum,
    "mean": lambda v: sum(v) / len(v),
}


def check_config(cfg: Config, world_size: int) -> None:
    """ConfigError (one line) for a config that cannot run on `world_size` processes in this version."""
    where = f"at world size {world_size} (WORLD_SIZE from torchrun)"
    if cfg.distributed.strategy == "none":
        raise ConfigError(f"distributed.strategy=none is for one process; {where} use fsdp2 or ddp")
    if cfg.distributed.mixed_precision != "none" and cfg.distributed.strategy != "fsdp2":
        raise ConfigError(
            f"distributed.mixed_precision={cfg.distributed.mixed_precision} is FSDP2's MixedPrecisionPolicy; "
            f"with distributed.strategy={cfg.distributed.strategy} use model.autocast=bfloat16 instead"
        )
    B, M = cfg.rollout.prompts_per_step, cfg.optim.num_minibatches
    if B % world_size:
        raise ConfigError(
            f"rollout.prompts_per_step={B} is not a multiple of the world size {world_size}: every rank "
            f"rolls out an equal share of whole groups; use a multiple of {world_size} (the global batch "
            "stays prompts_per_step x G)"
        )
    if cfg.minibatch_size % world_size:
        raise ConfigError(
            f"the minibatch of {cfg.minibatch_size} completions (rollout batch / optim.num_minibatches={M}) "
            f"does not split into {world_size} equal shares {where}; change optim.num_minibatches or "
            "rollout.prompts_per_step"
        )
    share = cfg.minibatch_size // world_size
    if cfg.optim.micro_batch_size and share % cfg.optim.micro_batch_size:
        raise ConfigError(
            f"optim.micro_batch_size={cfg.optim.micro_batch_size} must divide each rank's share of a "
            f"minibatch, {share} completions {where}"
        )
    for what, on in (
        ("algorithm.advantage_estimator=gae (the PPO critic)", cfg.algorithm.advantage_estimator == "gae"),
        ("model.compile=true", cfg.model.compile),
        ("model.lora (LoRA adapters)", cfg.model.lora is not None),
    ):
        if on:
            raise ConfigError(f"{what} is not supported {where} yet (docs/scaling.md); run it in one process")


def is_sharded(model) -> bool:
    """An FSDP2 module: its parameters are shards and every forward all-gathers them, so every rank must run
    the same sequence of forwards (grpokit/policy/logprobs.py then takes the one-forward path)."""
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, each an FSDP2 unit: the classes transformers marks as never split across
    devices (`_no_split_modules`, e.g. LlamaDecoderLayer; what accelerate's FSDP auto-wrap uses too)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


class World:
    """This process's place among the ranks, and the collectives the loop needs (see the module docstring)."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        local_rank: int = 0,
        strategy: str = "none",
        mixed_precision: str = "none",
    ):
        self.rank, self.size, self.local_rank, self.strategy, self.mixed_precision = (
            rank,
            size,
            local_rank,
            strategy,
            mixed_precision,
        )
        self.device = torch.device("cpu")  # where collectives' tensors go: the policy's device (wrap)
        self._model: torch.nn.Module | None = None  # the trained module (FSDP2: sharded in place)
        self._full: torch.nn.Module | None = (
            None  # FSDP2: an unsharded copy for the rollout engine and the saved model
        )
        self._ref: torch.nn.Module | None = None  # pi_ref (FSDP2: sharded as the policy is)

    @classmethod
    def from_env(cls, cfg: Config) -> World:
        """The world torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK; MASTER_ADDR / MASTER_PORT are read when
        the process group starts, in wrap). WORLD_SIZE unset or 1: one process, no process group."""
        size = int(os.environ.get("WORLD_SIZE") or 1)
        if size <= 1:
            return cls()
        check_config(cfg, size)
        return cls(
            int(os.environ["RANK"]),
            size,
            int(os.environ.get("LOCAL_RANK") or 0),
            cfg.distributed.strategy,
            cfg.distributed.mixed_precision,
        )

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
        the policy, refreshed by full_model() after each update, so that generation and rank 0's evaluation
        run no collective whatever their lengths (it costs one full copy of the weights per rank).
        ddp: the replica itself generates; only the training forward goes through DDP; pi_ref is a whole
        copy."""
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
        self._full = copy.deepcopy(model)
        for module in (model, ref) if ref is not None else (model,):
            self._shard(module)
        return self._handle(model, self._full)

    def _handle(self, forward: Any, whole: torch.nn.Module) -> PolicyHandle:
        assert self._model is not None
        return PolicyHandle(
            self._model,
            forward,
            self._ref,
            whole=whole,
            full=self.full_model,
            reset_reference=self.reset_reference,
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
            if self._full is None:
                ref.load_state_dict(model.state_dict())
                return
            for module in (ref, model):  # sharded in place by _shard
                # a no-grad forward leaves the root's parameters unsharded (plain tensors) until the next
                cast("FSDPModule", module).reshard()
            for r, p in zip(ref.parameters(), model.parameters(), strict=True):
                r.copy_(p)

    def full_model(self) -> torch.nn.Module:
        """The policy with whole weights, current: what the engine syncs to, rank 0 saves, pi_ref resets to.
        FSDP2: the unsharded copy, refreshed from the shards (an all-gather per parameter; every rank calls
        this)."""
        model = self._model
        assert model is not None  # wrap() came first
        if self._full is None:
            return model
        full = dict(self._full.named_parameters())
        cast("FSDPModule", model).reshard()  # the shards (DTensors), whatever the last forward left
        with torch.no_grad():
            for name, p in model.named_parameters():
                full[name].copy_(cast("DTensor", p).full_tensor())
        return self._full

    def backward(self, loss: Tensor) -> None:
        """loss.backward() for this rank's share of a loss that is a sum over every rank's rows. DDP and FSDP2
        average gradients over the W ranks; the gradient of the global loss is their sum, hence W x loss."""
        (loss * self.size if self.size > 1 else loss).backward()

    # ------------------------------------------------------------------ data
    def share(self, items: list) -> list:
        """This rank's contiguous share of the step's global prompts (rank r: the r-th of W equal parts), so
        the global batch, rank after rank, is what one process samples."""
        n = len(items) // self.size
        return items[self.rank * n : (self.rank + 1) * n]

    def minibatches(self, num_rows: int, num_minibatches: int) -> list[Tensor]:
        """This rank's rows of each minibatch of a pass. One minibatch: the rank's own rows, unshuffled.
        Several: a permutation of all num_rows rows of gather_batch (rank 0's draw, as one process draws it),
        each minibatch cut into W equal shares, rank r taking the r-th; so the minibatches are those of one
        process."""
        if num_minibatches == 1:
            return [torch.arange(num_rows)]
        order = torch.randperm(num_rows)
        if self.size > 1:
            dist.broadcast(order, src=0)
        size = num_rows // num_minibatches
        return [order[m * size : (m + 1) * size].chunk(self.size)[self.rank] for m in range(num_minibatches)]

    def gather_batch(self, b: RolloutBatch, pad_id: int) -> RolloutBatch:
        """Every rank's rollout batch, in rank order (the global batch), re-padded to the widest prompt and
        completion: for minibatches that mix ranks' rows. One all_gather_object of the step's tensors."""
        return b if self.size == 1 else cat_batches(self.gather(b), pad_id)

    # ------------------------------------------------------------------ reductions
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (all_gather_object)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, *values: float) -> Any:
        """Each value summed over the ranks (one all_reduce), types kept; one value in, one out."""
        if self.size > 1:
            t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            values = tuple(type(v)(x) for v, x in zip(values, t.tolist(), strict=True))
        return values[0] if len(values) == 1 else values

    def all(self, flag: bool) -> bool:
        """True when `flag` holds on every rank: a decision all ranks must take together (they run the same
        collectives)."""
        if self.size == 1:
            return bool(flag)
        t = torch.tensor([int(bool(flag))], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def all_finite(self, loss: Tensor) -> bool:
        """The loss is finite on every rank: otherwise every rank skips the backward (and the optimizer step)
        together."""
        return self.all(bool(torch.isfinite(loss)))

    def all_rows(self, x: Tensor) -> Tensor:
        """[W * n, ...] every rank's [n, ...] rows (n the same on every rank), in rank order: the global
        batch's order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x, device=self.device) for _ in range(self.size)]
        dist.all_gather(parts, x.to(self.device))
        return torch.cat(parts).to(x.device)

    def my_rows(self, x: Tensor) -> Tensor:
        """This rank's block of a global [W * n, ...] tensor."""
        return x.chunk(self.size)[self.rank]

    def cat_rows(self, *args: Any) -> tuple[Any, ...]:
        """Per-row data of every rank concatenated in rank order: tensors [n, ...] (a second dimension
        right-padded with zeros to the widest) and lists; anything else (a group size) as it is. For metrics,
        whose whole-batch statistics (a std, a min) have no per-rank reduction. One all_gather_object."""
        if self.size == 1:
            return args
        everyone = self.gather(args)
        return tuple(
            _cat([r[i] for r in everyone]) if isinstance(a, (Tensor, list)) else a for i, a in enumerate(args)
        )

    def scores(self, scored: RewardOutput) -> RewardOutput:
        """Every rank's rewards as one RewardOutput (the reward/ metrics of the whole batch)."""
        return (
            scored if self.size == 1 else RewardOutput.take([(s, slice(None)) for s in self.gather(scored)])
        )

    def means(self, acc: MeanAccumulator) -> dict[str, float]:
        """acc.means() over every rank's micro-batches (their sums and weights added up)."""
        return (
            acc.means()
            if self.size == 1
            else MeanAccumulator.merge(self.gather((acc.sums, acc.weights))).means()
        )

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The run's metrics from every rank's: metrics.RANK_REDUCTIONS for per-rank times and counts, the
        mean for the rest, which are whole-batch values already (the same everywhere) or one rank's (eval/ on
        rank 0)."""
        if self.size == 1:
            return metrics
        everyone = self.gather(metrics)
        keys = dict.fromkeys(k for m in everyone for k in m)
        return {k: REDUCE[RANK_REDUCTIONS.get(k, "mean")]([m[k] for m in everyone if k in m]) for k in keys}

    # ------------------------------------------------------------------ stop signals
    def stop_signals(self) -> StopSignals:
        """SIGTERM / SIGINT finish the step, save and stop (checkpoint.StopSignals), on every rank: torchrun
        passes a signal it gets on to every rank and waits 30 s for them (then SIGKILL); the loop stops when
        any rank got one (World.signal_received), so that all ranks take part in the save."""
        return StopSignals()

    def signal_received(self, received: str | None) -> str | None:
        """The stop signal some rank received (StopSignals.received: "SIGTERM", ...), on every rank alike, or
        None: the loop's decision to save and stop, taken by all ranks together. One all_reduce; a gather when
        one came."""
        if self.size == 1 or self.all(received is None):
            return received
        return next(name for name in self.gather(received) if name is not None)

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
        rest = {
            k: v for k, v in state.items() if k not in ("optimizer", "ref_model")
        }  # pi_ref after a reset: sharded too
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
        )

    def load_checkpoint(self, path: Path, state: dict, *, model, adamw, seed: int) -> None:
        """A checkpoint into this world: weights, AdamW's moments, generators, and pi_ref when the checkpoint
        holds one (ref_policy=reset). Written by ranks (torch.distributed.checkpoint): at any world size, one
        process included. Written by one process (model.safetensors, the rest in `state`): as it is, or at
        several ranks every rank reads the whole tensors and keeps its part
        (StateDictOptions(full_state_dict=True))."""
        if is_sharded_checkpoint(path):
            load_sharded(path, model, adamw, rank=self.rank, seed=seed, step=state["step"], ref=self._ref)
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
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        saved = state.pop("optimizer")
        by_name: OptimizerStateType = {
            "state": {names[i]: v for i, v in saved["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
        }
        set_optimizer_state_dict(model, adamw, by_name, options=whole)
        if "ref_model" in state and self._ref is not None:
            set_model_state_dict(self._ref, state.pop("ref_model"), options=lenient)
        if self.is_main:
            set_rng_state(state["rng"])
        else:
            seed_everything(hash((seed, self.rank, state["step"])) % 2**31)

    def teardown(self) -> None:
        """Leave the process group (after the last collective)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], list):
        return [x for p in parts for x in p]
    if parts[0].dim() < 2:
        return torch.cat(parts)
    out = parts[0].new_zeros(
        (sum(len(p) for p in parts), max(p.shape[1] for p in parts), *parts[0].shape[2:])
    )
    row = 0
    for p in parts:
        out[row : row + len(p), : p.shape[1]] = p
        row += len(p)
    return out


def _cat_packed(parts: list[PackedBatch], pad_id: int) -> PackedBatch:
    """PackedBatches of different prompt / completion widths as one, laid out as pack_sequences lays out the
    whole batch: prompts left-padded to the longest, completions right-padded, positions from the mask."""
    P = max(p.input_ids.shape[1] - p.completion_width for p in parts)
    T = max(p.completion_width for p in parts)

    def widen(x: Tensor, p: PackedBatch, fill: int) -> Tensor:
        left = P - (x.shape[1] - p.completion_width)
        right = T - p.completion_width
        return torch.cat([x.new_full((len(x), left), fill), x, x.new_full((len(x), right), fill)], dim=1)

    ids = torch.cat([widen(p.input_ids, p, pad_id) for p in parts])
    attn = torch.cat([widen(p.attention_mask, p, 0) for p in parts])
    cmask = _cat([p.completion_mask for p in parts])
    return PackedBatch(ids, attn, (attn.cumsum(-1) - 1).clamp_min(0), ids[:, P:], cmask)


def cat_batches(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Rollout batches as one, in order (every rank's: the global batch). PPO's value targets are not
    carried."""

    def opt(name):
        return _cat([getattr(p, name) for p in parts]) if getattr(parts[0], name) is not None else None

    return RolloutBatch(
        _cat_packed([p.tokens for p in parts], pad_id),
        _cat([p.loss_mask for p in parts]),
        _cat([p.truncated for p in parts]),
        _cat([p.rewards for p in parts]),
        _cat([p.advantages for p in parts]),
        opt("old_logp"),
        opt("ref_logp"),
        None,
        opt("sampler_logp"),
    )
