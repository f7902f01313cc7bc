"""The sections of a grpokit config: one pydantic model per YAML section (model, data, rollout,
algorithm, optim, ...), the Section base they share, and ConfigError, the one-line error of a bad config.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message is one line that says the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class LoraConfig(Section):
    """`model.lora`: train LoRA adapters (peft) instead of every weight; pi_ref is the base model with the
    adapter off, so no second copy of the weights is held (docs/lora.md). Needs `pip install
    grpokit[lora]`."""

    r: int = Field(8, ge=1)
    """Rank of each adapter's A (r x in) and B (out x r) matrices."""
    alpha: float = Field(16.0, gt=0)
    """Scale: the adapter adds (alpha / r) * B A x to the frozen layer's output."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in training passes (0: pi_theta and pi_old see the same network)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (suffixes, e.g. [q_proj, v_proj]) that get adapters; all-linear = every Linear but the LM
    head."""
    merge_on_save: bool = False
    """Also write final/merged/: the base weights with the adapter merged in, a plain model for
    from_pretrained."""


class ModelConfig(Section):
    name_or_path: str = ""
    """Hugging Face model id or local folder, loaded with AutoModelForCausalLM.from_pretrained."""
    tokenizer: str | None = None
    """Tokenizer id or folder; None = the model's."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype of the trained policy (the reference copy uses the same)."""
    autocast: Literal["none", "bfloat16"] = "none"
    """Mixed precision: every forward of the policy and pi_ref (rollout, log-probs, training) under
    torch.autocast in this dtype, so matmuls run in bf16 while the weights, their gradients and AdamW's state
    stay in model.dtype (fp32 master weights, as HF Trainer's bf16=True). Use with dtype=float32."""
    cast_lm_head_to_fp32: bool = False
    """The LM head (final projection, then the log-softmax) in float32 even under model.autocast=bfloat16 or
    dtype=bfloat16 (ScaleRL; TRL's cast_lm_head_to_fp32): smaller sampler-trainer mismatch."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in the backward pass: less memory, ~30% more compute. auto = only when a
    micro-batch of the longest rows would keep more than half the memory left in activations (estimated from
    the model's sizes once the run is built), and then on the fewest decoder layers that fit
    (grpokit/policy/memory.py); the run prints the decision."""
    release_freed_memory: bool = True
    """On the CPU under glibc, with gradient checkpointing: hand what each checkpointed decoder layer, its
    attention and its MLP free back to the OS after their forward and before their backward (malloc_trim), in
    the passes with a gradient. glibc's malloc keeps freed blocks resident, and a checkpointed pass fragments
    its heap: one 4k-token row held 3.4x its tensors, a third of that with it (docs/memory.md). The cost, for
    re-faulting the pages: 5-12% of such a pass's time at 4k tokens, 26-34% at 1k, none measured at 16k.
    false: leave the allocator alone."""
    attn_implementation: str | None = None
    """Passed to from_pretrained (e.g. "sdpa", "eager", "flash_attention_2"); None = transformers' default."""
    padding_free: bool | Literal["auto"] = "auto"
    """The policy's log-prob passes (training, pi_old, pi_ref), the PPO critic's and SFT's run each
    micro-batch's sequences back to back in one row with position ids restarting at each, no padding
    (transformers' packed sequences): same log-probs and gradients, fewer positions computed (where a
    group's shared prompt run once costs less, the policy's passes run the padded rows on it instead). The
    model is checked when the run starts (grpokit/policy/padding_free.py): auto = on where the check passes,
    else padded rows with one line saying why; true = refused where it fails; false = padded rows. When on,
    an sdpa model's attention becomes grpokit_sdpa: each packed sequence in a causal call of its own, no
    [L, L] mask (grpokit/policy/attention.py)."""
    memory_check: bool = True
    """Before the model loads, compute the run's memory plan (per rank and phase: weights, pi_ref, AdamW,
    gradients, the engine's KV cache, activations; `grpokit plan`, docs/memory.md), print it, and refuse a
    run whose peak exceeds the available memory with one line naming what to change. false: print only."""
    trust_remote_code: bool = False
    """Allow model code from the hub folder (only for models you trust)."""
    disable_dropout: bool = True
    """Set every dropout probability to 0, so pi_theta, pi_old and pi_ref see the same network (as verl /
    OpenRLHF)."""
    compile: bool = False
    """torch.compile the log-prob passes (training forward/backward, pi_ref and pi_old) and the fast engine's
    forward. Costs a compile at the first steps and a recompile for each new batch shape
    (docs/performance.md)."""
    lora: LoraConfig | None = None
    """LoRA adapters (peft) on the policy: {r, alpha, dropout, target_modules, merge_on_save}; None = full
    fine-tune."""


class DataConfig(Section):
    train_path: str = ""
    """Prompts: a .jsonl/.json/.parquet/.csv file or a `datasets` save_to_disk folder."""
    task: str | None = None
    """A built-in task (countdown, arithmetic) to generate prompts from instead of train_path."""
    task_train_size: int = Field(20000, ge=1)
    """Rows generated for a built-in task's train split."""
    eval_path: str | None = None
    """Held-out prompts for evaluation; None = hold out `eval_size` rows of the train data (or the task's test
    split)."""
    eval_size: int = Field(0, ge=0)
    """Held-out rows for evaluation (0 = no held-out evaluation unless eval_path or a task is given)."""
    prompt_column: str = "prompt"
    """Column with the prompt: a string, or a list of chat messages {role, content}."""
    max_prompt_length: int = Field(512, ge=1)
    """Prompts longer than this many tokens are an error or are truncated (see overlong_prompts)."""
    overlong_prompts: Literal["error", "truncate"] = "error"
    """What to do with a prompt longer than max_prompt_length: stop naming the file line, or keep its tail and
    count it."""
    system_prompt: str | None = None
    """Prepended to every prompt (as a system message for chat prompts)."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded)."""


class RolloutConfig(Section):
    engine: Literal["auto", "hf", "fast", "vllm"] = "auto"
    """Generation engine for rollouts: hf (transformers generate), fast (built-in KV-cache engine, CPU / small
    GPUs) or vllm (vLLM in this process, or a `grpokit serve` process: vllm_mode; docs/rollout.md). auto:
    chosen when the run starts and said in one line: vllm with a GPU and vLLM installed, else fast (hf for a
    model with a recurrent state)."""
    num_generations: int = Field(8, ge=2)
    """G: completions sampled per prompt; the group its advantages are relative to (DeepSeekMath §4.1.2)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts sampled per step; the rollout batch is prompts_per_step x num_generations completions."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of rollouts (log-probs for the ratio use the same temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; 1.0 = off."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0 = off."""
    replay_truncation: bool = True
    """With top_p < 1 or top_k > 0: the engine records the token set its sampler kept at each step, and the
    pi_theta, pi_old and pi_ref log-probs (hence the ratio and the importance weights) are those of the
    distribution truncated to it, the one each token was drawn from. Engines that cannot record it (hf, vllm)
    use the full distribution, said in one line at start; false: the full distribution with every engine."""
    max_completion_length: int = Field(256, ge=1)
    """Completions stop here; those without EOS by then count as truncated."""
    generation_batch_size: int = Field(0, ge=0)
    """Max sequences per generate call; 0 = the whole rollout batch at once."""
    max_turns: int = Field(4, ge=1)
    """With tools (the `tools` section): model turns per episode at most; a tool call in the last turn is not
    run (docs/agentic.md). max_completion_length bounds the whole episode, tool results included."""
    importance_correction: Literal[
        "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask"
    ] = "none"
    """Truncated importance sampling against the sampler-trainer mismatch (TRL 1.16's
    vllm_importance_sampling_mode): each token's loss times rho = pi_old / pi_sampler, per token or per
    sequence, clamped to (truncate) or zeroed outside (mask) [importance_c_min, importance_c_max];
    geometric_mask drops a sequence whose exp(mean_t log rho_t) is outside the bounds. Needs an engine that
    returns log-probs (fast, vllm); docs/rollout.md."""
    importance_c_min: float | None = Field(None, ge=0)
    """C_min of importance_correction (TRL's vllm_importance_sampling_clip_min); None = no lower bound."""
    importance_c_max: float | None = Field(3.0, gt=0)
    """C_max of importance_correction (TRL's vllm_importance_sampling_clip_max); None = no upper bound."""
    max_policy_lag: int = Field(0, ge=0)
    """Asynchronous rollouts: k > 0 generates the batch of step b + k with the weights of step b while step b
    trains, in a background thread (samples exactly k versions old once the run is k steps in). pi_old is then
    the sampler's log-probs, or with importance_correction the trainer's own with that correction (decoupled
    PPO); 0 = the synchronous loop. Needs an engine that returns log-probs (fast, vllm); docs/rollout.md."""
    partial_rollouts: bool = False
    """A step trains on the groups that finished; completions still going keep their tokens and go on under
    the next weights, each token with the version that sampled it and its sampler log-prob (its pi_old), so
    the longest completion no longer sets every step's length (grpokit/rollout/partial.py, docs/rollout.md).
    Needs an engine that returns log-probs (fast, vllm); not with max_policy_lag or tools."""
    partial_chunk_tokens: int = Field(0, ge=0)
    """With partial_rollouts: tokens a completion may add in one generation round; 0 = the smallest chunk
    with which the longest completion finishes within max_staleness versions
    (ceil(max_completion_length / (max_staleness + 1))). At least max_completion_length: the synchronous
    loop."""
    partial_in_flight: int = Field(2, ge=1)
    """With partial_rollouts: groups kept in flight (or complete and waiting), in steps' worth of
    prompts_per_step. A step ends once prompts_per_step of them are complete, so the slowest wait; 1 = no more
    in flight than a step takes."""
    max_staleness: int = Field(2, ge=0)
    """With partial_rollouts: versions a completion's tokens may span after its first token's; an older
    completion is restarted from its prompt, counted in rollout/partial_restarted."""
    async_sampler: Literal["thread", "process"] = "thread"
    """With max_policy_lag > 0: where the fast engine samples. thread: a thread of the trainer's process
    (overlaps training when ops are large: GPUs, real models); process: a CPU process of its own
    (grpokit/rollout/process.py), which a small model on a CPU needs to overlap at all (Python's GIL). vllm
    overlaps with vllm_mode=server."""
    vllm_kv_cache_mb: int = Field(0, ge=0)
    """rollout.engine=vllm on CPU: MiB of KV cache (per rank under torchrun); 0 = room for this rank's share
    of the rollout batch at the run's longest prompt + max_completion_length tokens (at least 256)."""
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """rollout.engine=vllm on GPU: the fraction of GPU memory vLLM takes (weights and KV cache); the rest is
    the trainer's."""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """rollout.engine=vllm: colocate (vLLM in the trainer's process) or server (a `grpokit serve` process at
    vllm_server_url; weights reach it through /dev/shm or a broadcast: vllm_weight_sync). TRL's vllm_mode;
    docs/rollout.md."""
    vllm_server_url: str | list[str] = "http://127.0.0.1:8000"
    """vllm_mode=server: the URL `grpokit serve` prints (TRL's vllm_server_base_url), or a fleet of servers: a
    list of URLs (on the command line, comma-separated) over which each step's prompts are spread."""
    vllm_server_timeout: float = Field(240.0, gt=0)
    """vllm_mode=server: seconds to wait for the server to come up at the start, and for each reply (a
    generate of the whole rollout batch included), and for each collective of a broadcast push. TRL's
    vllm_server_timeout."""
    vllm_weight_sync: Literal["auto", "shm", "broadcast"] = "auto"
    """vllm_mode=server: how weights reach the servers. shm: a file in this machine's /dev/shm (the servers
    share the machine); broadcast: a torch.distributed broadcast (gloo on CPU, NCCL on CUDA) to servers
    anywhere; auto: shm for one server at a loopback address, else broadcast."""
    vllm_weight_sync_host: str = ""
    """vllm_weight_sync=broadcast: the trainer's address as the servers reach it; "" = the local address of
    the trainer's connection to the first server."""

    @property
    def server_urls(self) -> list[str]:
        """vllm_server_url as a list (a string may hold several URLs, comma-separated)."""
        urls = self.vllm_server_url
        items = urls.split(",") if isinstance(urls, str) else urls
        return [u.strip().rstrip("/") for u in items if u.strip()] or [""]

    @property
    def off_policy(self) -> bool:
        """Samples come from older weights than the ones they train: asynchronous or partial rollouts (pi_old
        is then the sampler's log-probs, or with importance_correction a pass of the trainer's own)."""
        return self.max_policy_lag > 0 or self.partial_rollouts

    @model_validator(mode="after")
    def _check_importance_correction(self) -> RolloutConfig:
        lo, hi = self.importance_c_min, self.importance_c_max
        if lo is not None and hi is not None and not lo < hi:
            raise ValueError(f"rollout.importance_c_min={lo} must be below rollout.importance_c_max={hi}")
        for url in self.server_urls:
            if not re.fullmatch(r"https?://[^/\s]+/?", url):
                raise ValueError(
                    f"rollout.vllm_server_url={url!r} must be http://HOST:PORT, as `grpokit serve` prints it "
                    "(several: a list, or comma-separated)"
                )
        if len(set(self.server_urls)) < len(self.server_urls):
            raise ValueError(f"rollout.vllm_server_url lists a server twice: {', '.join(self.server_urls)}")
        if self.partial_rollouts and self.max_policy_lag:
            raise ValueError(
                f"rollout.partial_rollouts and rollout.max_policy_lag={self.max_policy_lag} are two "
                "timelines: set one (partial rollouts carry unfinished completions; the lag samples whole "
                "batches ahead)"
            )
        chunk = self.partial_chunk_tokens
        if self.partial_rollouts and chunk and chunk * (self.max_staleness + 1) < self.max_completion_length:
            raise ValueError(
                f"rollout.partial_chunk_tokens={chunk} over rollout.max_staleness={self.max_staleness} + 1 "
                f"versions reaches {chunk * (self.max_staleness + 1)} tokens, fewer than "
                f"max_completion_length={self.max_completion_length}: the longest completions would restart "
                "forever; raise either, or set partial_chunk_tokens=0 (chosen from them)"
            )
        # What the engine can do (log-probs, a sampler process, a server) is checked against its capabilities
        # when the run starts: grpokit/rollout/engines.py.
        return self


class AlgorithmConfig(Section):
    preset: (
        Literal[
            "grpo",
            "dapo",
            "dr_grpo",
            "gspo",
            "rloo",
            "reinforce_pp",
            "cispo",
            "sapo",
            "gmpo",
            "intellect2",
            "high_entropy",
            "clip_cov",
            "kl_cov",
            "gdpo",
            "deepseek_v32",
        ]
        | None
    ) = None
    """Expand one paper's settings (PRESETS in grpokit/config/presets.py, docs/algorithm.md); keys you set
    yourself win."""
    beta: float = Field(0.04, ge=0)
    """KL coefficient against pi_ref (DeepSeekMath: 0.04). 0 = no reference model is loaded."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator; k3 is DeepSeekMath's unbiased estimator (docs/algorithm.md)."""
    epsilon: float = Field(0.2, ge=0)
    """Lower clip range: ratio >= 1 - epsilon (and the upper one unless epsilon_high is set)."""
    epsilon_high: float | None = Field(None, ge=0)
    """Upper clip range (DAPO clip-higher: 0.28); None = epsilon."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip bound c for negative advantages (Ye et al. 2020, typically 3); None = off."""
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "gmpo"] = "grpo"
    """Loss normalization: grpo (sequence mean, DeepSeekMath), bnpo/dapo (token mean), dr_grpo (constant); or
    an objective with its paper's normalization: cispo (MiniMax-M1: clipped, detached IS weight times log pi;
    token mean), sapo (soft gate instead of the clip; sequence mean), gmpo (geometric mean of the token
    ratios, epsilon / epsilon_high in log space; one term per sequence). docs/algorithm.md §10."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Ratio level: token (GRPO) or sequence (GSPO)."""
    scale_rewards: Literal["group", "batch", "batch_centered", "none"] = "group"
    """Advantage scale: group std (DeepSeekMath), batch std of the rewards (TRL), batch_centered
    (REINFORCE++-baseline: mean and std of the group-centered values over the batch), or none (Dr. GRPO). Step
    rewards (a reward function returning StepScores) switch the advantages to DeepSeekMath §4.1.3 process
    supervision, which needs group (docs/algorithm.md)."""
    advantage_estimator: Literal["grpo", "rloo", "gae"] = "grpo"
    """Baseline: group mean (grpo), leave-one-out mean (rloo), or a learned critic with GAE (gae: the PPO
    baseline)."""
    std_eps: float = Field(1e-6, gt=0)
    """delta in (r - mean) / (std + delta), guarding a group whose rewards are all equal."""
    num_iterations: int = Field(1, ge=1)
    """mu: passes of policy updates over each rollout batch (DeepSeekMath Alg. 1)."""
    mask_truncated_completions: bool = False
    """DAPO overlong filtering: truncated completions get no loss."""
    overlong_buffer_frac: float = Field(0.0, ge=0, lt=1)
    """DAPO soft overlong punishment (eq. 13): the last this fraction of max_completion_length is penalized
    linearly; 0 = off."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal, draw more prompts until the batch is
    full."""
    max_sampling_rounds: int = Field(4, ge=1)
    """Cap on generation rounds per step with dynamic sampling; a batch still short is topped up with dropped
    groups."""
    ref_policy: Literal["frozen", "reset", "none"] = "frozen"
    """pi_ref: the frozen initial policy, reset to the current one every ref_reset_every steps (DeepSeekMath
    4.1.4), or none (needs beta = 0)."""
    ref_reset_every: int = Field(0, ge=0)
    """With ref_policy=reset: copy the current policy into pi_ref every this many steps."""
    delta: float | None = Field(None, gt=1)
    """Two-sided clip (INTELLECT-2, TRL's delta): for A < 0 the ratio is also bounded above by delta (the
    ratio itself, not 1 + delta), so the token's gradient is 0 beyond it; must exceed 1 + epsilon_high. None =
    off."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    """SAPO's gate temperature tau for A > 0 (loss_type=sapo)."""
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """SAPO's gate temperature tau for A < 0 (loss_type=sapo)."""
    top_entropy_quantile: float = Field(1.0, gt=0, le=1)
    """rho: the policy gradient only on tokens whose entropy is in the top rho quantile of the micro-batch's
    completion tokens ("Beyond the 80/20 rule": 0.2); the KL term stays on every token. 1.0 = every token."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus this times the entropy of pi_theta on completion tokens (normalized as
    the loss type's), with its gradient. 0 = off. With entropy_target: the coefficient of the first step."""
    entropy_target: float | None = Field(None, ge=0)
    """Adaptive entropy control (Skywork-OR1): after each step the coefficient moves by entropy_coef_delta
    toward keeping policy/entropy at this target (up while below it, down while above it, within
    [entropy_coef_min, entropy_coef_max]), and the bonus applies only on steps after one whose entropy was
    below the target. None = a fixed entropy_coef (Skywork-OR1: 0.2)."""
    entropy_coef_delta: float = Field(1e-4, gt=0)
    """Adaptive entropy control: the coefficient's change per step (Skywork-OR1's released scripts: 1e-4)."""
    entropy_coef_min: float = Field(0.0, ge=0)
    """Adaptive entropy control: the coefficient's lower bound (Skywork-OR1: 0)."""
    entropy_coef_max: float = Field(5e-3, ge=0)
    """Adaptive entropy control: the coefficient's upper bound (Skywork-OR1: 5e-3)."""
    clip_cov_ratio: float = Field(0.0, ge=0, le=1)
    """Clip-Cov (Cui et al. 2025): this fraction of the tokens, drawn at random from those whose covariance
    (log pi - mean)(A - mean) is in [clip_cov_lb, clip_cov_ub], get no gradient. 0 = off (paper: 2e-4)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov's lower covariance bound omega_low."""
    clip_cov_ub: float = 5.0
    """Clip-Cov's upper covariance bound omega_high."""
    kl_cov_ratio: float = Field(0.0, ge=0, le=1)
    """KL-Cov (Cui et al. 2025): this fraction of the tokens, those with the largest covariance, get the
    penalty kl_cov_coef x |log pi_theta - log pi_old|. 0 = off (paper: 2e-3)."""
    kl_cov_coef: float = Field(1.0, ge=0)
    """KL-Cov's penalty coefficient (verl's ppo_kl_coef)."""
    off_policy_mask_threshold: float | None = Field(None, ge=0)
    """DeepSeek-V3.2's off-policy sequence masking: a completion with A < 0 whose mean log(pi_old / pi_theta)
    over its tokens exceeds this gets no policy gradient. None = off."""
    use_bias_correction_kl: bool = False
    """DeepSeek-V3.2's unbiased KL: each token's KL estimate times pi_theta / pi_old (with its gradient)."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """With several reward functions: normalize the weighted sum of the rewards (GRPO), or GDPO's
    normalize_then_sum: each reward's group z-score, then their weighted sum normalized over the batch."""

    @model_validator(mode="after")
    def _check_objective_bounds(self) -> AlgorithmConfig:
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.delta is not None and self.delta <= 1.0 + high:
            raise ValueError(
                f"algorithm.delta={self.delta} must exceed 1 + the upper clip range ({1.0 + high}): it caps "
                "the ratio of negative-advantage tokens above the clip (INTELLECT-2: 4)"
            )
        if self.loss_type in ("cispo", "sapo", "gmpo") and (
            self.delta is not None or self.dual_clip is not None
        ):
            raise ValueError(
                "algorithm.delta and algorithm.dual_clip bound the clipped objective; "
                f"loss_type={self.loss_type} has none: unset them"
            )
        if self.entropy_target is not None and self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"algorithm.entropy_coef_min={self.entropy_coef_min} exceeds algorithm.entropy_coef_max="
                f"{self.entropy_coef_max}; the adaptive coefficient stays between them"
            )
        return self


class PPOConfig(Section):
    """Settings of the PPO baseline (`grpokit/policy/critic.py`, algorithm.advantage_estimator=gae); unused by
    GRPO."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount over completion tokens (1.0: the usual choice for LLM RL)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda (Schulman et al. 2016)."""
    vf_coef: float = Field(0.5, ge=0)
    """Weight of the value loss."""
    cliprange_value: float = Field(0.2, ge=0)
    """Value clipping: the new value stays within this of the old one (0 = off)."""
    critic_learning_rate: float = Field(1e-5, gt=0)
    """AdamW learning rate of the critic (value model)."""
    kl_in_reward: bool = True
    """Per-token -beta * KL(pi || pi_ref) shaped into the reward (InstructGPT-style) instead of the loss."""


class OptimizerSettings(Section):
    """AdamW and its learning-rate schedule: the fields `optim` (training) and `sft` share. Their defaults
    here are training's; SFTSection states where its own differ (SFT_OPTIMIZER_DEFAULTS)."""

    learning_rate: float = Field(1e-6, gt=0)
    """AdamW peak learning rate. Training: TRL's default, tiny models want ~1e-4; SFT: pretrained models
    want 1e-5..1e-4, tiny models from scratch ~1e-3."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up, over all optimizer steps (linear and cosine decay to 0 at the
    last step)."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Linear warm-up over this fraction of the optimizer steps (when warmup_steps is 0)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, in optimizer steps; 0 = warmup_ratio."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay (SFT: not on norms and biases)."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Gradient clipping by global norm; 0 = off."""


_S = TypeVar("_S", bound=BaseModel)


def _with_defaults(**defaults: Any) -> Callable[[type[_S]], type[_S]]:
    """Class decorator: the inherited fields named take these defaults, their type, bounds and docstring
    unchanged (the one place a section states how its defaults differ from its base's)."""

    def apply(cls: type[_S]) -> type[_S]:
        for name, value in defaults.items():
            field = copy.copy(cls.__pydantic_fields__[name])
            field.default = value
            cls.__pydantic_fields__[name] = field
        cls.model_rebuild(force=True)
        return cls

    return apply


class OptimConfig(OptimizerSettings):
    max_steps: int = Field(100, ge=1)
    """Training steps; each is one rollout batch and num_iterations x num_minibatches optimizer steps."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""
    adam_epsilon: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    num_minibatches: int = Field(1, ge=1)
    """Optimizer steps per pass over a rollout batch (TRL: steps_per_generation)."""
    micro_batch_size: int = Field(0, ge=0)
    """Sequences per forward/backward (gradient accumulation); 0 = a whole minibatch at once."""
    group_by_length: bool = True
    """Micro-batches (of training and of the pi_old / pi_ref passes) of rows with similar completion lengths,
    longest first, so a long-tailed batch does not pad every row to its longest (HF Trainer's
    group_by_length). Same gradient up to the order of float sums; matters only when micro_batch_size splits a
    minibatch."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Micro-batches sized in tokens instead of rows (verl: ppo_max_token_len_per_gpu): a minibatch's
    sequences go into micro-batches of at most this many prompt + completion tokens each, as the model
    computes them (padded: rows x longest; model.padding_free: their sum), longest first; a longer sequence
    runs alone. Same gradient as the whole minibatch up to the order of float sums; under torchrun the ranks
    run as many micro-batches each. 0 = counted in rows (micro_batch_size); set one of the two. Also sizes
    the pi_old / pi_ref passes and the PPO critic's. With neither set, a run takes the whole minibatch while
    the memory plan says it fits (model.memory_check), else the largest budget of k longest sequences that
    fits, said in one line at start (docs/memory.md)."""
    max_consecutive_skips: int = Field(10, ge=1)
    """Stop after this many optimizer steps in a row were skipped for a non-finite loss or gradient."""


class EvalConfig(Section):
    every: int = Field(0, ge=0)
    """Evaluate on the held-out set every this many steps (0 = only before and after training)."""
    at_start: bool = True
    """Evaluate before the first step (the baseline the run is compared with)."""
    max_samples: int = Field(0, ge=0)
    """Cap on held-out prompts evaluated; 0 = all."""
    k: int = Field(8, ge=1)
    """Samples per prompt for pass@k and maj@k (1 = greedy pass@1 only)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for pass@k / maj@k (pass@1 is greedy)."""
    batch_size: int = Field(64, ge=1)
    """Prompts per generate call during evaluation."""
    reward: str | None = None
    """Reward function (by metric name) that judges correctness; None = the first configured one."""
    correct_threshold: float = 1.0
    """A completion is correct when the judging reward is >= this."""


class LoggingConfig(Section):
    log_every: int = Field(1, ge=1)
    """Write metrics every this many steps."""
    doctor_every: int = Field(5, ge=0)
    """Run the doctor's checks (`grpokit doctor`) on the metrics so far every this many steps and at the last
    one; a finding is printed once, the first time its check fires, as one line with its steps and fix
    (0 = never; docs/doctor.md)."""
    sample_every: int = Field(10, ge=0)
    """Print and save a few sample completions every this many steps and at the last one (0 = never)."""
    num_samples: int = Field(3, ge=0)
    """How many prompts to record at a sample step: all G completions of each (samples.jsonl,
    completions.parquet); the first of each is printed."""
    tensorboard: bool | None = None
    """TensorBoard event files; None = when tensorboard is installed."""
    wandb: bool = False
    """Log to Weights & Biases (pip install grpokit[wandb])."""
    mlflow: bool = False
    """Log to MLflow (pip install grpokit[mlflow]); the store is MLFLOW_TRACKING_URI's, else MLflow's
    default."""
    trackio: bool = False
    """Log to trackio (pip install grpokit[trackio]); local, in TRACKIO_DIR (default
    ~/.cache/huggingface/trackio)."""
    project: str | None = None
    """W&B project, MLflow experiment and trackio project; None = WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME when
    set, else grpokit."""

    def trackers(self) -> dict[str, Any]:
        """The MetricLogger keyword arguments that choose the trackers: MetricLogger(out,
        **cfg.logging.trackers())."""
        return {
            "tensorboard": self.tensorboard,
            "wandb": self.wandb,
            "mlflow": self.mlflow,
            "trackio": self.trackio,
            "project": self.project,
        }


class CheckpointConfig(Section):
    save_every: int = Field(50, ge=0)
    """Save a checkpoint every this many steps (0 = only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept; older ones are deleted after a successful save."""
    resume: bool = True
    """Resume from the newest checkpoint in output_dir when there is one."""
    allow_changes: list[str] = Field(default_factory=list)
    """Config keys (dotted, e.g. optim.learning_rate; a section name covers its keys) that may differ from the
    checkpoint's config on resume; they are applied and logged. Any other difference stops the resume,
    except a larger optim.max_steps (training longer: the schedule becomes the longer run's,
    docs/training.md)."""


class DistributedConfig(Section):
    """Several processes under torchrun (grpokit/distributed/, docs/scaling.md); one process ignores this
    section."""

    strategy: Literal["fsdp2", "ddp", "none"] = "fsdp2"
    """With WORLD_SIZE > 1: fsdp2 (torch.distributed.fsdp.fully_shard on each decoder layer, then the root:
    parameters, gradients and AdamW state sharded over the ranks) or ddp (a full replica per rank, gradients
    all-reduced); none is for one process only."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """fsdp2 only: bf16 parameters and compute, fp32 gradient reduction and fp32 sharded master weights and
    AdamW state (FSDP2's MixedPrecisionPolicy), for the policy and pi_ref. For one process or ddp use
    model.autocast=bfloat16."""
    engine_copy: Literal["fp32", "bf16"] = "fp32"
    """fsdp2 with rollout.engine=fast or hf: the dtype of the whole copy of the policy the engine generates
    with, gathered from the shards after each update and freed during the update. fp32 samples what one
    process samples; bf16 halves the copy (the sampler then rounds pi_theta's weights: pair it with
    mixed_precision=bf16, or rollout.importance_correction; docs/scaling.md)."""
    sequence_parallel: int = Field(1, ge=1)
    """Sequence parallelism (DeepSpeed-Ulysses, grpokit/distributed/sequence.py): groups of this many ranks
    run each training micro-batch's padding-free row split along its tokens, attention exchanging heads by
    all-to-all, so a rank keeps 1/N of a sequence's activations. Every rank still rolls out its own prompts;
    in the training and pi_old / pi_ref passes a group runs each member's micro-batches in turn. Must divide
    WORLD_SIZE and the attention heads; needs model.padding_free=true. 1 = off."""


class ToolsConfig(Section):
    """Multi-turn rollouts with tool calls (grpokit/rollout/episodes.py, docs/agentic.md); off while no tool
    is set."""

    builtin: list[Literal["calculator", "python"]] = Field(default_factory=list)
    """Built-in tools: calculator (exact arithmetic) and python (runs in the code_tests sandbox)."""
    functions: list[str | Callable[..., Any]] = Field(default_factory=list)
    """More tools, TRL's `tools=`: functions with type hints and Google-style docstrings, as
    package.module:function, path/to/file.py:function, or (from Python) the callables."""
    environment: str | Callable[..., Any] | None = None
    """TRL's `environment_factory`: a class (or factory) whose public methods are tools, with reset(**row) and
    an optional get_reward() (then a reward named after the class); package.module:Class,
    path/to/file.py:Class or the class."""
    format: Literal["plain", "chat_template"] = "plain"
    """How calls and results are written: plain (<tool>name(args)</tool> and <result>...</result>, for tiny
    and base models) or chat_template (the tokenizer's chat template: <tool_call>{json}</tool_call> and tool
    messages)."""
    timeout: float = Field(10.0, gt=0)
    """Seconds one tool call may take; past it the model reads an error (rollout/tools/timeouts counts
    them)."""
    max_result_chars: int = Field(1000, ge=1)
    """A tool result longer than this many characters is cut."""
    max_workers: int = Field(4, ge=1)
    """Threads running one turn's tool calls across the batch."""

    @field_serializer("functions", "environment")
    def _paths(self, value: Any) -> Any:
        def name(v: Any) -> str:
            return v if isinstance(v, str) else f"{v.__module__}:{v.__qualname__}"

        return [name(v) for v in value] if isinstance(value, list) else None if value is None else name(value)

    @property
    def enabled(self) -> bool:
        return bool(self.builtin or self.functions or self.environment)


THREADS_DOC = (
    "CPU threads for torch; 0 = auto: OMP_NUM_THREADS when set, else the cores not busy with other processes "
    "(their CPU use measured over a quarter of a second) at start. Results are bit-identical only at the "
    "same count (docs/threads.md)."
)
