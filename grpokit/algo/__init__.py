"""The math of GRPO and its family: pure functions of tensors, no model, no I/O."""

from grpokit.algo.advantages import decoupled_advantages, group_advantages, step_advantages
from grpokit.algo.gae import explained_variance, gae_advantages, masked_whiten, token_rewards, value_loss
from grpokit.algo.kl import kl_penalty
from grpokit.algo.losses import LossOptions, adaptive_entropy_coef, policy_loss
from grpokit.algo.ops import masked_mean, masked_sum, token_entropy, token_logprobs

__all__ = [
    "group_advantages",
    "step_advantages",
    "decoupled_advantages",
    "kl_penalty",
    "policy_loss",
    "LossOptions",
    "adaptive_entropy_coef",
    "masked_mean",
    "masked_sum",
    "token_logprobs",
    "token_entropy",
    "token_rewards",
    "gae_advantages",
    "masked_whiten",
    "explained_variance",
    "value_loss",
]
