"""Which engine a config runs, what each engine can do, and the one check of the config against it.

    cfg, line = choose_engine(cfg, world_size)  # rollout.engine=auto made concrete, and the line saying why
    check_engine(cfg, world_size)        # at start-up: ConfigError (one line) for a feature the engine lacks
    engine = make_engine(cfg.rollout.engine, model, tokenizer, rollout=cfg.rollout)
    capability_table()                   # the markdown table in docs/rollout.md (a test keeps it current)

Each engine class declares what it can do (`caps`, an EngineCaps: grpokit/rollout/base.py); FEATURES says
which config features need which capability. Adding an engine: its class with `caps` and `from_config`, one
ENGINES entry, and docs/rollout.md's table regenerated from capability_table().
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grpokit.config import Config, ConfigError
from grpokit.config.world import where
from grpokit.rollout.base import EngineCaps, RolloutEngine

if TYPE_CHECKING:
    from grpokit.config import RolloutConfig


# ----------------------------------------------------------------------------- the engines
def _hf() -> type[RolloutEngine]:
    from grpokit.rollout.hf import HFEngine

    return HFEngine


def _fast() -> type[RolloutEngine]:
    from grpokit.rollout.fast import FastEngine

    return FastEngine


def _process() -> type[RolloutEngine]:
    from grpokit.rollout.process import ProcessEngine

    return ProcessEngine


def _vllm() -> type[RolloutEngine]:
    from grpokit.rollout.vllm import VLLMEngine

    return VLLMEngine


def _server() -> type[RolloutEngine]:
    from grpokit.rollout.server import VLLMServerEngine

    return VLLMServerEngine


@dataclass(frozen=True)
class EngineSpec:
    name: str
    """rollout.engine"""
    variant: str
    """The other rollout keys that pick this class ("" for the engine's default)."""
    load: Callable[[], type[RolloutEngine]]
    """The engine class, imported when asked for (vLLM's module only then)."""

    @property
    def setting(self) -> str:
        return f"rollout.engine={self.name}" + (f" with rollout.{self.variant}" if self.variant else "")

    @property
    def caps(self) -> EngineCaps:
        caps = self.load().caps  # a class attribute: read without building the engine
        if not isinstance(caps, EngineCaps):
            raise TypeError(f"{self.load().__name__} sets no class attribute caps = EngineCaps(...)")
        return caps


ENGINES = (
    EngineSpec("hf", "", _hf),
    EngineSpec("fast", "", _fast),
    EngineSpec("fast", "async_sampler=process", _process),
    EngineSpec("vllm", "", _vllm),
    EngineSpec("vllm", "vllm_mode=server", _server),
)


def select(rollout: RolloutConfig) -> EngineSpec:
    """The engine the rollout section picks, or ConfigError when its keys pick none."""
    if rollout.vllm_mode == "server" and rollout.engine != "vllm":
        raise ConfigError(
            "rollout.vllm_mode=server samples from a vLLM server; set rollout.engine=vllm "
            f"(it is {rollout.engine}) or drop vllm_mode"
        )
    if rollout.async_sampler == "process" and (rollout.engine != "fast" or not rollout.max_policy_lag):
        raise ConfigError(
            "rollout.async_sampler=process runs the fast engine in a process of its own for asynchronous "
            f"rollouts; set rollout.engine=fast (it is {rollout.engine}) and rollout.max_policy_lag >= 1 "
            f"(it is {rollout.max_policy_lag}), or async_sampler=thread (vllm: vllm_mode=server is its own "
            "process)"
        )
    return _spec(rollout.engine, rollout)


def _spec(name: str, rollout: RolloutConfig | None) -> EngineSpec:
    """The ENGINES entry of rollout.engine=name, its variant as the rollout section says (no checks)."""
    variant = ""
    if rollout is not None and name == "fast" and rollout.async_sampler == "process":
        variant = "async_sampler=process"
    if rollout is not None and name == "vllm" and rollout.vllm_mode == "server":
        variant = "vllm_mode=server"
    return next(s for s in ENGINES if s.name == name and s.variant == variant)


# ----------------------------------------------------------------------------- config features x capabilities
@dataclass(frozen=True)
class Feature:
    key: str
    """The config feature, as the docs table names it."""
    needs: str
    """The EngineCaps field it needs."""
    on: Callable[[Config, int], bool]
    """(config, world size) -> whether the run uses it."""
    error: Callable[[Config, EngineSpec, str, int], str]
    """(config, the engine, "rollout.engine=A or B": the engines that can, world size) -> the one-line
    error."""


def _importance(cfg: Config, engine: EngineSpec, use: str, w: int) -> str:
    return (
        f"rollout.importance_correction={cfg.rollout.importance_correction} needs the sampler's log-probs, "
        f"which {engine.setting} does not return; use {use}, or importance_correction=none"
    )


def _lag(cfg: Config, engine: EngineSpec, use: str, w: int) -> str:
    return (
        f"rollout.max_policy_lag={cfg.rollout.max_policy_lag} needs the sampler's log-probs (pi_old of "
        f"samples from older weights), which {engine.setting} does not return; use {use}, or max_policy_lag=0"
    )


def _lora(cfg: Config, engine: EngineSpec, use: str, w: int) -> str:
    return (
        f"model.lora does not work with {engine.setting} yet; drop model.lora or change that key "
        f"(LoRA runs with ref_policy frozen or none, the grpo / rloo estimators, {use})"
    )


def _ranks(cfg: Config, engine: EngineSpec, use: str, w: int) -> str:
    return f"{engine.setting} takes one trainer process; under torchrun use {use}"


def _lag_at_ranks(cfg: Config, engine: EngineSpec, use: str, w: int) -> str:
    which = f"rollout.{engine.variant}" if engine.variant else engine.setting
    return (
        f"rollout.max_policy_lag={cfg.rollout.max_policy_lag} with {which} {where(w)} would have each rank's "
        "background sampler push to the server beside the training's collectives; use "
        "rollout.max_policy_lag=0, or one trainer process"
    )


def _lag_sharded(cfg: Config, engine: EngineSpec, use: str, w: int) -> str:
    return (
        f"rollout.max_policy_lag={cfg.rollout.max_policy_lag} with rollout.engine={cfg.rollout.engine} under "
        f"distributed.strategy=fsdp2 {where(w)} would need a whole copy of the policy per rank for the "
        "sampler; use distributed.strategy=ddp, or rollout.max_policy_lag=0"
    )


def _engine_copy(cfg: Config, engine: EngineSpec, use: str, w: int) -> str:
    return (
        f"distributed.engine_copy={cfg.distributed.engine_copy} is the dtype of the whole copy of the policy "
        f"that {use} keeps under distributed.strategy=fsdp2; with distributed.strategy="
        f"{cfg.distributed.strategy} and {engine.setting} there is none: leave it at fp32"
    )


FEATURES = (
    Feature(
        "rollout.importance_correction",
        "sampling_logprobs",
        lambda c, w: c.rollout.importance_correction != "none",
        _importance,
    ),
    Feature(
        "rollout.max_policy_lag > 0", "sampling_logprobs", lambda c, w: c.rollout.max_policy_lag > 0, _lag
    ),
    Feature(
        "rollout.partial_rollouts",
        "sampling_logprobs",
        lambda c, w: c.rollout.partial_rollouts,
        lambda c, e, use, w: (
            "rollout.partial_rollouts keeps each token's sampler log-prob as its pi_old, which "
            f"{e.setting} does not return; use {use}, or partial_rollouts=false"
        ),
    ),
    Feature("model.lora", "lora", lambda c, w: c.model.lora is not None, _lora),
    Feature("torchrun (WORLD_SIZE > 1)", "several_ranks", lambda c, w: w > 1, _ranks),
    Feature(
        "rollout.max_policy_lag > 0 under torchrun",
        "lag_at_ranks",
        lambda c, w: w > 1 and c.rollout.max_policy_lag > 0,
        _lag_at_ranks,
    ),
    Feature(
        "rollout.max_policy_lag > 0 under FSDP2",
        "whole_copy",
        lambda c, w: w > 1 and c.distributed.strategy == "fsdp2" and c.rollout.max_policy_lag > 0,
        _lag_sharded,
    ),
    Feature(
        "distributed.engine_copy other than fp32",
        "whole_copy",
        lambda c, w: w > 1 and c.distributed.engine_copy != "fp32",
        _engine_copy,
    ),
)


def able(needs: str) -> list[str]:
    """The rollout.engine values whose default engine has capability `needs`."""
    return [s.name for s in ENGINES if not s.variant and getattr(s.caps, needs)]


def check_engine(cfg: Config, world_size: int = 1) -> EngineSpec:
    """The engine the config picks, checked against every feature the run uses: ConfigError (one line) naming
    the first one it lacks and the engines that have it. Called once, when a run starts."""
    cfg, _ = choose_engine(cfg, world_size)  # rollout.engine=auto: the engine the run would start with
    engine = select(cfg.rollout)
    for feature in FEATURES:
        if feature.on(cfg, world_size) and not getattr(engine.caps, feature.needs):
            raise ConfigError(
                feature.error(cfg, engine, "rollout.engine=" + " or ".join(able(feature.needs)), world_size)
            )
    return engine


# ----------------------------------------------------------------------------- rollout.engine=auto
def choose_engine(cfg: Config, world_size: int = 1, recurrent: str = "") -> tuple[Config, str | None]:
    """rollout.engine=auto made concrete when a run starts: (the config with the engine it runs, the line
    that says which and why); a named engine is kept, with no line. The choice is the fastest engine that can
    run the model and everything the run asks of an engine (FEATURES): vLLM where it is installed and a GPU is
    present; else the built-in fast engine (exact: the trainer's log-probs of its samples agree to float
    rounding); transformers' generate (hf) for a model with a recurrent state, which the fast engine's
    preallocated attention cache cannot hold. `recurrent`: the model's class name when it has such a state
    (components.chosen_engine reads it from the model's config), else ""."""
    r = cfg.rollout
    if r.engine != "auto":
        return cfg, None
    gpu, vllm = torch.cuda.is_available(), importlib.util.find_spec("vllm") is not None
    if r.vllm_mode == "server":
        name, why = "vllm", "rollout.vllm_mode=server samples from a vLLM server"
    elif r.async_sampler == "process":
        name, why = "fast", "rollout.async_sampler=process runs the fast engine in a process of its own"
    elif gpu and vllm and not _lacks(cfg, "vllm", world_size):
        name, why = "vllm", "a GPU and vLLM are here"
    elif recurrent:
        name, why = "hf", f"{recurrent} keeps a recurrent state, which the fast engine's KV cache cannot hold"
    else:
        reason = (
            "no GPU" if not gpu else "vLLM is not installed" if not vllm else _lacks(cfg, "vllm", world_size)
        )
        name, why = "fast", f"the built-in engine: {reason}"
    chosen = cfg.model_copy(update={"rollout": r.model_copy(update={"engine": name})})
    return chosen, f"rollout.engine=auto chose {name} ({why}); set rollout.engine=hf, fast or vllm to choose"


def _lacks(cfg: Config, name: str, world_size: int) -> str:
    """The first feature the run uses that engine `name` cannot do, as a phrase ("" when none)."""
    caps = select(cfg.rollout.model_copy(update={"engine": name})).caps
    missing = [f.key for f in FEATURES if f.on(cfg, world_size) and not getattr(caps, f.needs)]
    return f"{missing[0]} needs what vLLM lacks" if missing else ""


# ----------------------------------------------------------------------------- building one
def make_engine(
    name: str,
    model: Any,
    tokenizer: Any,
    *,
    batch_size: int = 0,
    compile: bool = False,
    rollout: RolloutConfig | None = None,
    max_len: int = 0,
) -> RolloutEngine:
    """The engine named in rollout.engine, generating with `model` (pi_old); compile: the fast engine's
    forward through torch.compile (the hf engine ignores it); rollout: the RolloutConfig, for the variant it
    picks (async_sampler=process; vllm_mode=server: a client of the `grpokit serve` process at
    vllm_server_url) and vllm's settings; max_len: the longest prompt + completion the run asks for (0:
    unknown), what the colocated vllm engine sizes its context and KV cache for."""
    if name not in {s.name for s in ENGINES}:
        raise ValueError(f"unknown rollout.engine {name!r}; allowed: hf, fast, vllm")
    spec = _spec(name, rollout)
    cls: Any = spec.load()
    # the colocated vllm engine alone sizes a context (a server has its own, set by `grpokit serve`)
    kwargs: dict[str, Any] = {"max_len": max_len} if spec.load is _vllm else {}
    return cls.from_config(
        model, tokenizer, batch_size=batch_size, compile=compile, rollout=rollout, **kwargs
    )


# ----------------------------------------------------------------------------- the docs table
ROWS = {
    "sampling_logprobs": "returns the sampler's log-probs",
    "several_ranks": "runs under torchrun (an engine, or a client of the server, per rank)",
    "lora": "samples from a policy with LoRA adapters",
    "stop_sequences": "stops at stop sequences itself (tools' turns)",
    "sleep": "frees GPU memory during the update (CUDA)",
    "own_process": "samples in a process of its own",
    "compiles": "compiles its forward with model.compile",
    "kept_sets": "records the top-k / top-p kept sets (rollout.replay_truncation)",
    "whole_copy": "under FSDP2, samples from a whole copy of the policy (else from the shards as it pushes)",
    "lag_at_ranks": "samples ahead (max_policy_lag > 0) under torchrun",
}


def capability_table() -> str:
    """The markdown table of what each engine can do and which config features need it (docs/rollout.md)."""
    heads = [s.setting.removeprefix("rollout.engine=").replace(" with rollout.", ", ") for s in ENGINES]
    lines = [
        "| capability | needed by | " + " | ".join(f"`{h}`" for h in heads) + " |",
        "|---|---|" + "---|" * len(ENGINES),
    ]
    for field, what in ROWS.items():
        needed = ", ".join(f"`{f.key}`" for f in FEATURES if f.needs == field) or ""
        marks = ["yes" if getattr(s.caps, field) else "no" for s in ENGINES]
        lines.append(f"| {what} | {needed} | " + " | ".join(marks) + " |")
    return "\n".join(lines) + "\n"
