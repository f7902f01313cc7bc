"""One typed config for a grpokit run: every default on one screen, a docstring per field.

    cfg = load_config("config.yaml", ["algorithm.beta=0.0", "rollout.num_generations=16"])

Names follow TRL's GRPOConfig where one exists (num_generations, beta, epsilon, epsilon_high,
loss_type, scale_rewards, num_iterations, max_completion_length, importance_sampling_level).
Unknown keys and bad values raise ConfigError with one line naming the key, the value and what
is allowed.

One module per job: sections.py (the section models and ConfigError), rewards.py (RewardSpec),
schema.py (Config and its cross-section checks), presets.py (each paper's algorithm settings), sft.py
(the `grpokit sft` config), loading.py (load_config, overrides, describe).
"""

from grpokit.config.loading import Schema, describe, load_config, parse_overrides
from grpokit.config.presets import PRESETS
from grpokit.config.rewards import ON_TIMEOUT_CHOICES, RewardSpec, check_on_timeout
from grpokit.config.schema import Config
from grpokit.config.sections import (
    THREADS_DOC,
    AlgorithmConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    OptimizerSettings,
    PPOConfig,
    RolloutConfig,
    Section,
    ToolsConfig,
)
from grpokit.config.sft import SFT_OPTIMIZER_DEFAULTS, SFTConfig, SFTSection

__all__ = [
    "ON_TIMEOUT_CHOICES",
    "PRESETS",
    "SFT_OPTIMIZER_DEFAULTS",
    "THREADS_DOC",
    "AlgorithmConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "OptimizerSettings",
    "PPOConfig",
    "RewardSpec",
    "RolloutConfig",
    "SFTConfig",
    "SFTSection",
    "Schema",
    "Section",
    "ToolsConfig",
    "check_on_timeout",
    "describe",
    "load_config",
    "parse_overrides",
]
