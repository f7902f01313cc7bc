"""The parts of a training run, built once from the config, in the order the run's random stream expects.

    parts = build_components(cfg, world)   # the policy handle, data, rewards, pipeline, optimizer, critic

grpokit/trainer.py runs the loop over them; each part is its module's (data/, rewards/, rollout/,
optim.py, critic.py). The order matters: loading the model, the critic's value head and the engine draw from
the run's seeded random stream, and an exact resume expects the same draws.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpokit.algorithm import EntropyControl
from grpokit.checkpoint.checkpointer import Checkpointer, Weights
from grpokit.config import Config
from grpokit.data import (
    PromptDataset,
    PromptSampler,
    SamplerBookmarks,
    build_datasets,
    check_context_length,
)
from grpokit.data.micro_batches import MicroBatching
from grpokit.distributed import World
from grpokit.distributed.handle import PolicyHandle
from grpokit.distributed.sequence import SequenceGroup
from grpokit.distributed.sequence_turns import sequence_group
from grpokit.evaluate import make_judge
from grpokit.policy import (
    build_reference,
    checkpointing_plan,
    enable_checkpointing,
    load_policy,
    memory_left,
)
from grpokit.policy.critic import Critic
from grpokit.policy.loading import model_folder
from grpokit.policy.optim import Optimizer
from grpokit.policy.padding_free import resolve_padding_free
from grpokit.policy.plan import check_memory, with_automatic_budget
from grpokit.records.health import StepHealth
from grpokit.rewards import RewardManager, build_rewards, reward_registry
from grpokit.rollout import SamplerCorrection, make_engine
from grpokit.rollout.engines import choose_engine
from grpokit.rollout.episodes import with_tools
from grpokit.rollout.partial import PartialPipeline
from grpokit.rollout.pipeline import RolloutPipeline, make_pipeline
from grpokit.tools.setup import prompt_tool_schemas


@dataclass
class Components:
    cfg: Config  # the run's config with model.padding_free made concrete (with_padding_free)
    policy: PolicyHandle
    tokenizer: Any
    train_data: PromptDataset
    eval_data: PromptDataset | None
    sampler: PromptSampler
    rewards: RewardManager
    judge: Any
    health: StepHealth
    correction: SamplerCorrection
    pipeline: RolloutPipeline
    optimizer: Optimizer
    critic: Critic | None
    sequence: SequenceGroup | None = None  # distributed.sequence_parallel > 1: this rank's group


def build_components(
    cfg: Config, world: World, *, model=None, tokenizer=None, train_rows=None, eval_rows=None
) -> Components:
    """model / tokenizer: an already loaded policy instead of model.name_or_path; train_rows / eval_rows: rows
    instead of data.*."""
    if model is None:  # the memory plan first: a run that cannot fit stops before its model loads
        check_memory(cfg, world.size, echo=world.rank == 0)
        model, tokenizer = load_policy(cfg.model)
    cfg = with_padding_free(cfg, model, echo=world.rank == 0)  # before FSDP2 shards it: the whole model
    # pi_ref: the policy as loaded, before any resume replaces the weights
    policy = world.wrap(model, build_reference(model, cfg.algorithm))
    if cfg.model.compile:
        policy.compile()
    sequence = sequence_group(cfg.distributed.sequence_parallel, world, [model, policy.ref])
    data = build_datasets(
        cfg.data,
        tokenizer,
        seed=cfg.seed,
        train_rows=train_rows,
        eval_rows=eval_rows,
        tools=prompt_tool_schemas(cfg.tools),
    )
    sampler = PromptSampler(len(data.train), cfg.rollout.prompts_per_step, cfg.seed, shuffle=cfg.data.shuffle)
    rewards = build_rewards(cfg, data.train.column_names, registry=reward_registry(), task=data.task)
    judge = make_judge(rewards, reward_name=cfg.eval.reward, threshold=cfg.eval.correct_threshold)
    health = StepHealth(cfg)  # bad steps in a row stop the run
    correction = SamplerCorrection(cfg.rollout)  # the sampler-trainer mismatch: metrics, importance weights
    max_len = check_context_length(data, getattr(model, "config", None), cfg.rollout.max_completion_length)
    pipeline = build_pipeline(
        cfg, policy, tokenizer, seed=cfg.seed + world.rank, max_len=max_len, most=world.most
    )
    if cfg.model.gradient_checkpointing == "auto":  # before the critic, which follows the policy's setting
        auto_checkpointing(model, world, cfg, max_len)
    total = cfg.optim.max_steps * cfg.algorithm.num_iterations * cfg.optim.num_minibatches
    try:
        optimizer = Optimizer(
            model.named_parameters(), cfg.optim, lr=cfg.optim.learning_rate, total_steps=total
        )
        critic = None
        if cfg.algorithm.advantage_estimator == "gae":  # PPO
            critic = Critic(cfg, model, has_ref=policy.ref is not None, total_steps=total, world=world)
    except BaseException:
        pipeline.close()  # a run that cannot start leaves no engine running
        raise
    return Components(
        cfg,
        policy,
        tokenizer,
        data.train,
        data.eval,
        sampler,
        rewards,
        judge,
        health,
        correction,
        pipeline,
        optimizer,
        critic,
        sequence,
    )


def with_padding_free(cfg: Config, model: Any, echo: bool) -> Config:
    """cfg with model.padding_free made concrete for the loaded model (policy/padding_free.py): auto is on
    where the model keeps packed sequences apart, else off with one line (echo: rank 0 says it)."""
    N = cfg.distributed.sequence_parallel
    required = f"distributed.sequence_parallel={N}" if N > 1 else ""
    on, line = resolve_padding_free(model, cfg.model.padding_free, required)
    if line is not None and echo:
        print(line, flush=True)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"padding_free": on})})


def resolved(cfg: Config, model: Any = None) -> Config:
    """The config the run runs, for the ranks torchrun describes (WORLD_SIZE; one process without it), each
    automatic choice said in one line by rank 0: rollout.engine=auto made concrete (rollout/engines.py:
    choose_engine), and a token budget when neither micro-batch key is set and the whole minibatch would
    not fit this machine's memory (policy/plan.py: automatic_budget). `model`: the model object the Python
    API was given, if any; else the model's config says whether it keeps a recurrent state."""
    ranks = int(os.environ.get("WORLD_SIZE") or 1)
    cfg, engine_line = choose_engine(cfg, ranks, recurrent_state(cfg, model))
    cfg, budget_line = with_automatic_budget(cfg, ranks)
    if int(os.environ.get("RANK") or 0) == 0:
        for line in (engine_line, budget_line):
            if line is not None:
                print(line, flush=True)
    return cfg


def recurrent_state(cfg: Config, model: Any = None) -> str:
    """The model's class name when transformers marks it stateful (Mamba, RecurrentGemma, ...), else "":
    from the model object, or from the config of model.name_or_path without loading weights. Only asked for
    rollout.engine=auto; a config that cannot be read says nothing here (loading the model says why)."""
    if cfg.rollout.engine != "auto":
        return ""
    if model is not None:
        return type(model).__name__ if getattr(type(model), "_is_stateful", False) else ""
    import transformers

    try:
        folder = model_folder(cfg.model.name_or_path, "model.name_or_path")
        config = transformers.AutoConfig.from_pretrained(
            folder, trust_remote_code=cfg.model.trust_remote_code
        )
    except Exception:  # noqa: BLE001  (the loader's own line says what is wrong with the model)
        return ""
    stateful = [
        a for a in config.architectures or [] if getattr(getattr(transformers, a, None), "_is_stateful", 0)
    ]
    return stateful[0] if stateful else ""


def build_checkpointer(
    cfg: Config, world: World, parts: Components, sampler: SamplerBookmarks, entropy: EntropyControl
) -> Checkpointer:
    """What a checkpoint holds (grpokit/checkpoint/ decides how): the policy and its moments, pi_ref once it
    moves (ref_policy=reset), the critic's weights and moments, the small states: the schedules, the
    prompt sampler's position, the adaptive entropy coefficient; and each rank's own: the rollout pipeline's
    batches in flight (rollout.max_policy_lag)."""
    policy, critic = parts.policy, parts.critic
    modules: dict[str, Weights] = {}
    if cfg.algorithm.ref_policy == "reset" and isinstance(policy.ref, torch.nn.Module):
        modules["ref"] = Weights(policy.ref)  # no longer the initial weights
    states: dict[str, Any] = {"optimizer": parts.optimizer, "sampler": sampler, "entropy": entropy}
    if critic is not None:
        modules["critic"] = Weights(critic.model, critic.optimizer.adamw)
        states["critic"] = critic
    return Checkpointer(
        cfg.output_dir,
        world,
        policy=Weights(policy.module, parts.optimizer.adamw, whole=policy.gathered),
        modules=modules,
        states=states,
        rank_states={"pipeline": parts.pipeline},
        tokenizer=parts.tokenizer,
        config=cfg.model_dump(),
        allow_changes=cfg.checkpoint.allow_changes,
        keep_last=cfg.checkpoint.keep_last,
        seed=cfg.seed,
    )


def auto_checkpointing(model, world: World, cfg: Config, max_len: int) -> None:
    """model.gradient_checkpointing=auto: checkpoint the layers that the run's largest micro-batch of rows
    up to `max_len` tokens needs (policy/memory.py). Every rank takes the plan of the least memory left:
    under FSDP2 a recomputed layer gathers its weights again, so the ranks must recompute the same layers."""
    rows, tokens = MicroBatching.of(cfg).worst(max_len)
    plan = checkpointing_plan(model, rows, tokens, left=min(world.gather(memory_left(model))))
    if plan is not None:
        enable_checkpointing(model, plan.every_n_layers, release=cfg.model.release_freed_memory)
        if world.rank == 0:
            print(f"model.gradient_checkpointing=auto: {plan}", flush=True)


def build_pipeline(
    cfg: Config,
    policy: PolicyHandle,
    tokenizer: Any,
    *,
    seed: int,
    max_len: int = 0,
    most: Callable[[int], int] = lambda n: n,
) -> RolloutPipeline:
    """The engine the config names (with tools: episodes around it), playing pi_old: synchronous,
    rollout.max_policy_lag steps ahead in a background thread, or partial rollouts. The pipeline owns the
    engine and closes it.
    max_len: the longest prompt + completion of the run (vllm sizes its context and KV cache for it). most:
    World.most (partial rollouts keep the ranks' draws and rounds in step)."""
    engine = make_engine(
        cfg.rollout.engine,
        policy.whole,
        tokenizer,
        batch_size=cfg.rollout.generation_batch_size,
        compile=cfg.model.compile,
        rollout=cfg.rollout,
        max_len=max_len,
    )
    if cfg.rollout.partial_rollouts:  # rollout/partial.py: every rank draws and generates in step
        return PartialPipeline(
            engine, cfg.rollout, max_lag=0, version=0, model=policy.whole, seed=seed, most=most
        )
    return make_pipeline(
        with_tools(engine, cfg, tokenizer),
        cfg.rollout,
        max_lag=cfg.rollout.max_policy_lag,
        version=0,
        model=policy.whole,
        seed=seed,
    )
