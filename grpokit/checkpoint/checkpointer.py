"""The one owner of a run's checkpoints: the trainer says when (save, load), this module says how.

    checkpointer = Checkpointer(
        out_dir, world,                              # the ranks: rank, size, is_main, gather, barrier
        policy=Weights(model, adamw, whole=handle.gathered),
        modules={"ref": Weights(ref), "critic": Weights(value_model, critic_adamw)},
        states={"optimizer": optimizer, "sampler": position, "entropy": entropy, "critic": critic},
        rank_states={"pipeline": pipeline},          # each rank's own (its rollouts in flight)
        tokenizer=tokenizer, config=cfg.model_dump(), allow_changes=[...], keep_last=2, seed=cfg.seed,
    )
    checkpointer.save(step)        # every rank calls it
    checkpointer.load()            # (the checkpoint's step, the trainer's step), or None: nothing to resume

The parts arrive as objects; nothing here imports them. The weights and moments are `Weights` (a module and
its optimizer). The rest are states: anything with state_dict() / load_state_dict()
(torch.distributed.checkpoint.stateful.Stateful's protocol), small and the same on every rank. Each state
gives top-level keys of trainer_state.pt, no two states the same key, and gets those keys back on load, once
the weights and moments are in place. Rank states are states that differ from rank to rank (the rollout
pipeline's batches in flight): each rank's {name: state_dict()} is kept per rank, as the generators are, and
each rank gets its own back, last, when the world size is the writer's (at another one every rank gets {}, and
a line says so: a rank's work does not carry over to another rank's share). The random generators are this
module's own part.

Three layouts, each readable at any world size:

    whole      one process: model.safetensors (a LoRA policy: its adapter) and trainer_state.pt, which holds
               AdamW's moments keyed by parameter order, pi_ref's and the critic's weights and moments, the
               states, the config, the step, the generators and the rank states (rank_states, one entry)
               (checkpoint/save.py)
    gathered   model.lora at several ranks: the whole layout, written by rank 0 from the gathered adapter
               and moments (the adapter is small; the frozen base comes from model.name_or_path), with every
               rank's generators (rank_rng) and rank states (rank_states), in rank order
    sharded    several ranks: every rank's shards of the weights and moments (torch.distributed.checkpoint,
               checkpoint/sharded.py), rank 0's trainer_state.pt, one generators file and one rank states
               file per rank

A whole checkpoint read at several ranks: every rank reads the whole tensors and keeps its part
(StateDictOptions(full_state_dict=True)). A sharded one read at any world size: DCP reshards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from grpokit.checkpoint.resume import read_adapter, resume
from grpokit.checkpoint.run import CheckpointError, rng_state, seed_everything, set_rng_state
from grpokit.checkpoint.save import checkpoint_dir, is_sharded_checkpoint, save_checkpoint
from grpokit.checkpoint.sharded import Modules, load_rank_states, load_sharded, save_sharded
from grpokit.checkpoint.whole import is_peft
from grpokit.types import Ranks

logger = logging.getLogger("grpokit.checkpoint")


@dataclass
class Weights:
    """A module the checkpoint holds, with the optimizer whose moments go with it (None: a frozen module).
    whole (the policy): every rank calls it; rank 0 gets the module with whole weights, the others None
    (FSDP2: the shards gathered), for the gathered layout; None: the module itself."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    whole: Callable[[], torch.nn.Module | None] | None = None


#: In a whole checkpoint's trainer_state.pt, the keys of a module's weights and of its moments (the policy's
#: weights are the safetensors files beside it, its moments "optimizer").
WHOLE_KEYS = {"ref": ("ref_model", None), "critic": ("critic", "critic_optimizer")}


class Checkpointer:
    def __init__(
        self,
        out_dir: str | Path,
        ranks: Ranks,
        *,
        policy: Weights,
        modules: dict[str, Weights],
        states: dict[str, Stateful],
        rank_states: dict[str, Stateful] | None = None,
        tokenizer: Any,
        config: dict[str, Any],
        allow_changes: list[str],
        keep_last: int,
        seed: int,
    ) -> None:
        unknown = set(modules) - set(WHOLE_KEYS)
        assert not unknown, f"modules a checkpoint has no keys for: {unknown}"
        self.out, self.ranks, self.policy, self.modules, self.states = (
            Path(out_dir),
            ranks,
            policy,
            modules,
            states,
        )
        self.rank_states = rank_states or {}
        self.tokenizer, self.config, self.allow_changes = tokenizer, config, allow_changes
        self.keep_last, self.seed = keep_last, seed

    # ------------------------------------------------------------------ save
    def save(self, step: int) -> Path:
        """The checkpoint of `step` (every rank calls it): whole in one process, gathered for a LoRA policy
        at several ranks, sharded otherwise. Atomic: a crash leaves the previous checkpoint as it was."""
        state = self._states() | {"config": self.config}
        mine = {name: part.state_dict() for name, part in self.rank_states.items()}
        if self.ranks.size == 1:
            return save_checkpoint(
                self.out,
                step,
                self.policy.module,
                self.tokenizer,
                state | self._whole_tensors() | {"rank_states": [mine]},
                self.keep_last,
            )
        if is_peft(self.policy.module):
            return self._save_gathered(step, state, mine)
        return save_sharded(
            self.out, step, self._dcp_modules(), self.tokenizer, state, self.keep_last, self.ranks, mine
        )

    def _states(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, part in self.states.items():
            given = part.state_dict()
            clash = out.keys() & given.keys()
            assert not clash, f"checkpoint state {name!r} gives keys another state gives: {sorted(clash)}"
            out.update(given)
        return out

    def _whole_tensors(self) -> dict[str, Any]:
        """One process: AdamW's moments and the other modules' weights and moments, for trainer_state.pt."""
        out: dict[str, Any] = {}
        if self.policy.optimizer is not None:
            out["optimizer"] = self.policy.optimizer.state_dict()
        for name, part in self.modules.items():
            weights_key, moments_key = WHOLE_KEYS[name]
            out[weights_key] = part.module.state_dict()
            if part.optimizer is not None and moments_key is not None:
                out[moments_key] = part.optimizer.state_dict()
        return out

    def _dcp_modules(self) -> Modules:
        return {
            "model": (self.policy.module, self.policy.optimizer),
            **{name: (w.module, w.optimizer) for name, w in self.modules.items()},
        }

    def _save_gathered(self, step: int, state: dict[str, Any], mine: dict[str, Any]) -> Path:
        """model.lora at W > 1: the whole layout from rank 0. The policy's adapter and every module's moments
        are gathered whole to rank 0 (collectives: every rank takes part), the moments keyed by parameter
        order as one process keys them; every rank's generators and rank states go with them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        gather = StateDictOptions(full_state_dict=True, cpu_offload=True)
        policy = self.policy.whole() if self.policy.whole is not None else self.policy.module
        tensors: dict[str, Any] = {}
        if self.policy.optimizer is not None:
            tensors["optimizer"] = _gathered_moments(self.policy.module, self.policy.optimizer)
        for name, part in self.modules.items():
            weights_key, moments_key = WHOLE_KEYS[name]
            tensors[weights_key] = get_model_state_dict(part.module, options=gather)
            if part.optimizer is not None and moments_key is not None:
                tensors[moments_key] = _gathered_moments(part.module, part.optimizer)
        rngs = self.ranks.gather(rng_state())  # every rank's generators, in rank order
        per_rank = {"rank_rng": rngs, "rank_states": self.ranks.gather(mine)}
        if self.ranks.is_main:
            assert policy is not None  # rank 0 holds the gathered policy
            save_checkpoint(
                self.out, step, policy, self.tokenizer, state | tensors | per_rank, self.keep_last
            )
        self.ranks.barrier()  # every rank returns once the checkpoint is in place
        return checkpoint_dir(self.out, step)

    # ------------------------------------------------------------------ load
    def load(self) -> tuple[int, int] | None:
        """Continue from the newest complete checkpoint in out_dir: the config compared with this run's
        (checkpoint.resume: a refused change is a CheckpointError naming every one), then the weights and
        moments, the generators, the states, and last this rank's own states. (the checkpoint's step, the
        trainer's step), or None when there is none."""
        found = resume(self.out, self.policy.module, self.config, self.allow_changes, self._load_tensors)
        if found is None:
            return None
        step, state, _ = found  # resume printed the changes that checkpoint.allow_changes let through
        for part in self.states.values():
            try:
                part.load_state_dict({k: state[k] for k in part.state_dict() if k in state})
            except CheckpointError as exc:  # a part says what is wrong; the path is the checkpoint's
                raise CheckpointError(f"checkpoint {str(checkpoint_dir(self.out, step))!r} {exc}") from None
        mine = self._my_rank_states(checkpoint_dir(self.out, step), state)
        for name, part in self.rank_states.items():
            part.load_state_dict(mine.get(name, {}))
        return step, state["step"]

    def _my_rank_states(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's own states in the checkpoint: {} when it has none (written before they were kept) or
        was written at another world size (said in one line: each rank's work was its share of the batch)."""
        if is_sharded_checkpoint(path):
            written_by = state.get("world_size", self.ranks.size)
            mine = load_rank_states(path, self.ranks.rank) if written_by == self.ranks.size else None
        else:
            per_rank = state.get("rank_states") or []
            written_by = len(per_rank) or self.ranks.size
            mine = per_rank[self.ranks.rank] if len(per_rank) == self.ranks.size else None
        if written_by != self.ranks.size and self.ranks.is_main and self.rank_states:
            logger.warning(
                "checkpoint %r was written at world size %d and resumes at %d: each rank's own state (%s) "
                "starts afresh",
                str(path),
                written_by,
                self.ranks.size,
                ", ".join(self.rank_states),
            )
        return mine or {}

    def _load_tensors(self, path: Path, state: dict[str, Any]) -> None:
        if is_sharded_checkpoint(path):
            load_sharded(path, self._dcp_modules(), rank=self.ranks.rank, seed=self.seed, step=state["step"])
        elif self.ranks.size == 1:
            self._load_whole_here(path, state)
        else:
            self._load_whole_at_ranks(path, state)

    def _load_whole_here(self, path: Path, state: dict[str, Any]) -> None:
        """A whole checkpoint in one process."""
        from grpokit.checkpoint.resume import load_weights

        load_weights(path, self.policy.module)
        if self.policy.optimizer is not None and "optimizer" in state:
            self.policy.optimizer.load_state_dict(state["optimizer"])
        for name, part in self.modules.items():
            weights_key, moments_key = WHOLE_KEYS[name]
            if weights_key in state:
                part.module.load_state_dict(state[weights_key])
            if part.optimizer is not None and moments_key in state:
                part.optimizer.load_state_dict(state[moments_key])
        set_rng_state(state["rng"])

    def _load_whole_at_ranks(self, path: Path, state: dict[str, Any]) -> None:
        """A whole checkpoint (one process's, or a LoRA run's at several ranks) at W > 1: every rank reads the
        whole tensors and keeps its part. The moments, keyed by parameter order, are set by name."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True)
        lenient = StateDictOptions(full_state_dict=True, strict=False)
        model = self.policy.module
        if is_peft(model):
            set_model_state_dict(model, read_adapter(path, model), options=lenient)
        else:
            weights = {
                k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()
            }
            missing = [n for n, _ in model.named_parameters() if n not in weights]
            if missing:  # a tied head is saved once, as the embedding
                raise CheckpointError(
                    f"checkpoint {str(path)!r} does not hold {missing[:3]} of this model; resume it with one "
                    "process, with the model it was trained from"
                )
            set_model_state_dict(model, weights, options=lenient)  # type: ignore[arg-type]
        if self.policy.optimizer is not None:
            set_optimizer_state_dict(
                model, self.policy.optimizer, _by_name(model, state["optimizer"]), options=whole
            )
        for name, part in self.modules.items():
            weights_key, moments_key = WHOLE_KEYS[name]
            if weights_key in state:
                set_model_state_dict(
                    part.module, state[weights_key], options=lenient if name == "ref" else whole
                )
            if part.optimizer is not None and moments_key in state:
                by_name = _by_name(part.module, state[moments_key])
                set_optimizer_state_dict(part.module, part.optimizer, by_name, options=whole)
        ranks = state.get("rank_rng") or [state["rng"]]  # a gathered checkpoint holds every rank's
        if self.ranks.rank < len(ranks):
            set_rng_state(ranks[self.ranks.rank])
        else:
            seed_everything(hash((self.seed, self.ranks.rank, state["step"])) % 2**31)


def _gathered_moments(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's moments gathered whole to rank 0 (a collective), keyed by the index of the trainable
    parameter as one process's optimizer.state_dict() keys them; {} on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    moments: Any = get_optimizer_state_dict(module, optimizer, options=options)
    if "state" not in moments:  # cpu_offload: the ranks other than 0 get nothing
        return {}
    index = {n: i for i, n in enumerate(n for n, p in module.named_parameters() if p.requires_grad)}
    return {
        "state": {index[n]: v for n, v in moments["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in moments["param_groups"]],
    }


def _by_name(module: torch.nn.Module, saved: dict[str, Any]) -> Any:
    """One process's optimizer state (moments keyed by the index of the trainable parameter, the order of
    named_parameters) keyed by parameter name, for set_optimizer_state_dict."""
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: v for i, v in saved["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
