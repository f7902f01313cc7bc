"""Config, what `grpokit train CONFIG` reads: every section of a run together, the checks that span several
sections, and the batch sizes derived from them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpokit.config.presets import PRESETS
from grpokit.config.rewards import RewardSpec, check_on_timeout
from grpokit.config.sections import (
    THREADS_DOC,
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    PPOConfig,
    RolloutConfig,
    Section,
    ToolsConfig,
)


class Config(Section):
    output_dir: str = "runs/grpo"
    """Where metrics, samples, checkpoints and the final model go; a run here resumes."""
    seed: int = 0
    """Seeds Python, NumPy and torch; rollouts and data order follow from it."""
    threads: int = Field(0, ge=0, description=THREADS_DOC)
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy: which model to load and how (dtype, mixed precision, LoRA)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The prompts: the training file or built-in task, the held-out split, prompt length, chat rendering."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Sampling the completions: the engine, G, prompts per step, sampling settings, asynchronous rollouts."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The GRPO-family objective: presets, KL, clipping, loss normalization, advantages, pi_ref."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Steps, AdamW, the learning-rate schedule, minibatches and gradient accumulation."""
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    """The PPO baseline's critic and GAE (algorithm.advantage_estimator=gae only)."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation: when, how many prompts, k samples for pass@k / maj@k, the judging reward."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics, sample completions and experiment trackers."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Saving and resuming: how often, how many are kept, which config changes a resume accepts."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Several processes under torchrun: FSDP2 or DDP, and mixed precision."""
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    """Tools the model may call in multi-turn episodes (agentic RL); off while no tool is set."""
    rewards: list[RewardSpec] = Field(default_factory=list)
    """Reward functions, summed with their weights: each {function, weight, kwargs, name, timeout, on_timeout}
    (RewardSpec)."""
    reward_errors: Literal["skip", "raise"] = "skip"
    """A reward function that raises, times out (unless reward_on_timeout says otherwise) or returns bad
    values: skip (the samples get no reward from it, counted in reward/errors/<fn>) or raise."""
    reward_timeout: float = Field(300.0, ge=0)
    """Seconds one call of a reward function (one rollout batch) may take; 0 = no limit; a reward's `timeout`
    overrides it. A call that runs longer is scored as reward_on_timeout says (counted in
    reward/timeouts/<fn>). A sync function's call is left running in a background thread (Python cannot stop
    one), and the function is skipped until the call returns; an `async def` function's is cancelled.
    Functions that need the main thread (signal.alarm: the built-in math, math-verify's timeouts) run there,
    without this limit."""
    reward_on_timeout: str | float | None = None
    """What a reward call that times out scores (a reward's own `on_timeout` overrides it): skip (its samples
    get no reward from that function), skip_group (the same, and every group of the call, which is the whole
    rollout batch, is dropped from the loss: its advantages are 0, reward/skipped_frac), raise (stop the run
    with an error), or a number (the score each of its samples gets from that function). Unset: as
    reward_errors says (skip or raise). The call's samples are counted in reward/errors/<fn> whatever the
    choice."""
    reward_slow_warning: float = Field(60.0, ge=0)
    """A reward call slower than this many seconds logs a warning with the function's name and time; 0 =
    never."""
    reward_error_fraction: float = Field(0.5, ge=0, le=1)
    """A step where one reward function fails (raises, times out, returns bad values) on more than this
    fraction of the completions logs a warning and is a bad step (stop_after_bad_steps); 1 = never."""
    stop_after_bad_steps: int = Field(20, ge=0)
    """Stop the run after this many bad steps in a row: a reward function over reward_error_fraction, or no
    learning signal (every group's G rewards equal, so every advantage is 0); 0 = never stop (the warnings
    stay)."""

    @model_validator(mode="after")
    def _check_batch_shapes(self) -> Config:
        alg = self.algorithm
        if alg.ref_policy == "none" and alg.beta > 0:
            raise ValueError(
                f"algorithm.ref_policy=none needs algorithm.beta=0 (got beta={alg.beta}): the KL term needs "
                "pi_ref"
            )
        if alg.ref_policy == "reset" and not alg.ref_reset_every:
            raise ValueError(
                "algorithm.ref_policy=reset needs algorithm.ref_reset_every > 0 (steps between resets)"
            )
        if alg.epsilon_high is not None and alg.epsilon_high < alg.epsilon:
            # Clip range [1 - epsilon, 1 + epsilon_high]: clip-higher only ever widens the upper side.
            if alg.preset and PRESETS[alg.preset].get("epsilon_high") == alg.epsilon_high:
                source = f" (from algorithm.preset={alg.preset})"
                fix = "set it >= algorithm.epsilon too, or keep the preset's epsilon"
            else:
                source, fix = (
                    "",
                    "set algorithm.epsilon_high >= algorithm.epsilon or leave it unset (= epsilon)",
                )
            raise ValueError(
                f"algorithm.epsilon_high={alg.epsilon_high}{source} is below "
                f"algorithm.epsilon={alg.epsilon}: clip-higher (DAPO) raises the upper clip bound above the "
                f"lower one; {fix}"
            )
        n = self.rollout.prompts_per_step * self.rollout.num_generations
        if n % self.optim.num_minibatches:
            raise ValueError(
                f"optim.num_minibatches={self.optim.num_minibatches} must divide the rollout batch "
                f"(rollout.prompts_per_step x rollout.num_generations = {n})"
            )
        mb = n // self.optim.num_minibatches
        if self.optim.micro_batch_size and self.optim.max_tokens_per_micro_batch:
            o = self.optim
            raise ValueError(
                f"optim.micro_batch_size={o.micro_batch_size} and optim.max_tokens_per_micro_batch="
                f"{o.max_tokens_per_micro_batch} both size micro-batches: set one of them (the other 0)"
            )
        if self.optim.micro_batch_size and mb % self.optim.micro_batch_size:
            raise ValueError(
                f"optim.micro_batch_size={self.optim.micro_batch_size} must divide the minibatch size {mb}"
            )
        return self

    @field_validator("reward_on_timeout", mode="plain")
    @classmethod
    def _on_timeout(cls, value: Any) -> Any:
        return check_on_timeout(value)

    @model_validator(mode="after")
    def _check_skip_group(self) -> Config:
        keys = [
            k
            for k, v in [("reward_on_timeout", self.reward_on_timeout)]
            + [(f"rewards.{i}.on_timeout", r.on_timeout) for i, r in enumerate(self.rewards)]
            if v == "skip_group"
        ]
        if keys and self.algorithm.advantage_estimator == "gae":
            raise ValueError(
                f"{keys[0]}=skip_group drops a prompt's group of completions from the loss, which needs a "
                "group baseline (algorithm.advantage_estimator grpo or rloo, not gae); use skip, raise or a "
                "number"
            )
        return self

    @model_validator(mode="after")
    def _check_partial_rollouts(self) -> Config:
        if self.rollout.partial_rollouts and self.tools.enabled:
            raise ValueError(
                "rollout.partial_rollouts carries a completion's tokens to the next step, which multi-turn "
                "episodes with tools do not support yet; drop the tools section or partial_rollouts"
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> Config:
        if self.model.lora is None:
            return self
        refused = {
            "algorithm.ref_policy=reset": self.algorithm.ref_policy
            == "reset",  # pi_ref is the adapter-off base
            "algorithm.advantage_estimator=gae": self.algorithm.advantage_estimator
            == "gae",  # the critic copies the body
            "model.compile=true": self.model.compile,
        }  # rollout.engine: its capabilities, checked when the run starts (grpokit/rollout/engines.py)
        if bad := [k for k, v in refused.items() if v]:
            raise ValueError(
                f"model.lora does not work with {bad[0]} yet; drop model.lora or change that key "
                "(LoRA runs with ref_policy frozen or none, the grpo / rloo estimators, rollout.engine hf, "
                "fast or vllm)"
            )
        return self

    # Derived values, computed in one place.
    @property
    def rollout_batch_size(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.num_generations

    @property
    def minibatch_size(self) -> int:
        return self.rollout_batch_size // self.optim.num_minibatches

    @property
    def micro_batch_size(self) -> int:
        return self.optim.micro_batch_size or self.minibatch_size
