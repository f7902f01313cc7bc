"""What a config needs to run on several processes, as far as the config alone can tell: one line each
(ConfigError) naming the key and what to use. What the run's engine must be able to do at that world size is
the engine table's (grpokit/rollout/engines.py: FEATURES against each engine's EngineCaps).

    check_world(cfg, world_size)      # World.from_env under torchrun, before anything is loaded
"""

from __future__ import annotations

from grpokit.config.schema import Config
from grpokit.config.sections import ConfigError


def where(world_size: int) -> str:
    """How a refusal names the world it refers to."""
    return f"at world size {world_size} (WORLD_SIZE from torchrun)"


def check_world(cfg: Config, world_size: int) -> None:
    """ConfigError (one line) for a config that cannot run on `world_size` processes in this version."""
    at = where(world_size)
    if cfg.distributed.strategy == "none":
        raise ConfigError(f"distributed.strategy=none is for one process; {at} use fsdp2 or ddp")
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
            f"does not split into {world_size} equal shares {at}; change optim.num_minibatches or "
            "rollout.prompts_per_step"
        )
    share = cfg.minibatch_size // world_size
    if cfg.optim.micro_batch_size and share % cfg.optim.micro_batch_size:
        raise ConfigError(
            f"optim.micro_batch_size={cfg.optim.micro_batch_size} must divide each rank's share of a "
            f"minibatch, {share} completions {at}"
        )
    if cfg.algorithm.advantage_estimator == "gae" and cfg.distributed.mixed_precision != "none":
        raise ConfigError(
            f"distributed.mixed_precision={cfg.distributed.mixed_precision} does not cover the PPO critic "
            "(algorithm.advantage_estimator=gae) yet: its value head runs in fp32; use "
            "distributed.mixed_precision=none (or model.autocast=bfloat16) with the critic"
        )
    check_sequence_parallel(cfg, world_size)
    copy = cfg.distributed.engine_copy
    if copy != "fp32" and cfg.distributed.strategy != "fsdp2":
        raise ConfigError(
            f"distributed.engine_copy={copy} is the dtype of the whole copy of the policy that "
            "rollout.engine=fast or hf keeps under distributed.strategy=fsdp2; with distributed.strategy="
            f"{cfg.distributed.strategy} and rollout.engine={cfg.rollout.engine} there is none: leave it "
            "at fp32"
        )


def check_sequence_parallel(cfg: Config, world_size: int) -> None:
    """distributed.sequence_parallel against the world size and what it covers in this version."""
    N = cfg.distributed.sequence_parallel
    if N == 1:
        return
    key = f"distributed.sequence_parallel={N}"
    if world_size % N:
        raise ConfigError(f"{key} must divide the world size {world_size} (WORLD_SIZE from torchrun)")
    if not cfg.model.padding_free:
        raise ConfigError(
            f"{key} splits padding-free rows over the ranks: set model.padding_free=auto or true"
        )
    if cfg.algorithm.advantage_estimator == "gae":
        raise ConfigError(
            f"{key} does not cover the PPO critic yet: use 1 with algorithm.advantage_estimator=gae"
        )
    if cfg.model.compile:
        raise ConfigError(f"{key} does not run under model.compile yet: set model.compile=false")
