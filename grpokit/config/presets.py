"""The algorithm presets: each paper's `algorithm.*` settings, expanded under the keys a config sets."""

from __future__ import annotations

from typing import Any

from grpokit.config.sections import ConfigError

# Each paper's algorithm settings. Budget choices (G, batch sizes, learning rate) are not part of a
# preset; the paper's values are listed in docs/algorithm.md.
_DAPO: dict[str, Any] = dict(
    beta=0.0,
    epsilon=0.2,
    epsilon_high=0.28,
    loss_type="dapo",
    scale_rewards="group",
    advantage_estimator="grpo",
    dynamic_sampling=True,
    mask_truncated_completions=True,
    overlong_buffer_frac=0.2,
    importance_sampling_level="token",
)
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (2402.03300) §4.2: beta 0.04, k3 KL, eps 0.2, per-sequence mean, group std; G=64, mu=1.
    "grpo": dict(
        beta=0.04,
        kl_estimator="k3",
        epsilon=0.2,
        epsilon_high=None,
        loss_type="grpo",
        scale_rewards="group",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
    # DAPO (2503.14476): clip-higher 0.2/0.28, no KL, token-level loss, dynamic sampling,
    # overlong filtering and soft overlong punishment (L_cache / L_max = 4096 / 20480 = 0.2).
    "dapo": _DAPO,
    # Dr. GRPO (2503.20783): no std scaling, constant normalizer instead of lengths, no KL.
    "dr_grpo": dict(
        beta=0.0,
        epsilon=0.2,
        loss_type="dr_grpo",
        scale_rewards="none",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
    # GSPO (2507.18071): sequence-level ratio with its own, much smaller clip range (3e-4 / 4e-4), no KL.
    "gspo": dict(
        beta=0.0,
        epsilon=3e-4,
        epsilon_high=4e-4,
        importance_sampling_level="sequence",
        loss_type="grpo",
        scale_rewards="group",
        advantage_estimator="grpo",
    ),
    # RLOO (2402.14740): leave-one-out baseline, no std scaling, REINFORCE-style token sum (constant
    # normalizer).
    "rloo": dict(
        beta=0.0,
        advantage_estimator="rloo",
        scale_rewards="none",
        loss_type="dr_grpo",
        importance_sampling_level="token",
    ),
    # REINFORCE++-baseline (2501.03262): group-mean baseline, then the centered values whitened over the
    # batch (their std, not the raw rewards'), token-mean loss, k2 KL loss 1e-3.
    "reinforce_pp": dict(
        beta=0.001,
        kl_estimator="k2",
        advantage_estimator="grpo",
        scale_rewards="batch_centered",
        loss_type="dapo",
        importance_sampling_level="token",
    ),
    # CISPO (MiniMax-M1, 2506.13585, eq. 4): the clipped IS weight, detached, times A log pi; token-level
    # normalization; no lower bound on the weight (eps_low^IS "set large": 1 makes the bound 0); the upper
    # bound 1 + 4 = 5, the ratio cap TRL recommends for cispo (its epsilon_high=5.0, a bound on r itself).
    "cispo": dict(
        beta=0.0,
        epsilon=1.0,
        epsilon_high=4.0,
        loss_type="cispo",
        scale_rewards="group",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
    # SAPO (2511.20347): the soft gate sigmoid(tau (r - 1)) 4 / tau with tau_pos = 1.0, tau_neg = 1.05;
    # GRPO's group advantages and per-sequence mean; no KL.
    "sapo": dict(
        beta=0.0,
        loss_type="sapo",
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        scale_rewards="group",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
    # GMPO (2507.20673): the geometric mean of the token ratios, each clipped to (e^-0.4, e^0.4) in log space;
    # group advantages; one term per sequence; no KL.
    "gmpo": dict(
        beta=0.0,
        epsilon=0.4,
        epsilon_high=0.4,
        loss_type="gmpo",
        scale_rewards="group",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
    # INTELLECT-2 (2505.07291): GRPO with the two-sided clip, delta = 4 on the ratio of A < 0 tokens, eps 0.2.
    "intellect2": dict(
        beta=0.0,
        epsilon=0.2,
        epsilon_high=None,
        delta=4.0,
        loss_type="grpo",
        scale_rewards="group",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
    # "Beyond the 80/20 rule" (2506.01939): DAPO with the policy gradient on the top 20% entropy tokens only.
    "high_entropy": {**_DAPO, "top_entropy_quantile": 0.2},
    # Clip-Cov (Cui et al. 2025, 2505.22617): 2e-4 of the tokens, drawn from covariance in [1, 5], detached;
    # token-mean loss, no KL.
    "clip_cov": dict(
        beta=0.0,
        loss_type="dapo",
        clip_cov_ratio=2e-4,
        clip_cov_lb=1.0,
        clip_cov_ub=5.0,
        scale_rewards="group",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
    # KL-Cov (same paper): the top 2e-3 of the tokens by covariance get 1 x |log r|; token-mean loss, no KL.
    "kl_cov": dict(
        beta=0.0,
        loss_type="dapo",
        kl_cov_ratio=2e-3,
        kl_cov_coef=1.0,
        scale_rewards="group",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
    # GDPO (decoupled normalization): each reward's group z-score, the weighted sum normalized over the batch.
    "gdpo": dict(
        multi_objective_aggregation="normalize_then_sum",
        advantage_estimator="grpo",
        loss_type="grpo",
        importance_sampling_level="token",
    ),
    # DeepSeek-V3.2: off-policy sequence masking and the importance-weighted (unbiased) k3 KL on GRPO. The
    # paper gives no value for the masking threshold delta; 0.5 is ours (docs/algorithm.md §10).
    "deepseek_v32": dict(
        kl_estimator="k3",
        use_bias_correction_kl=True,
        off_policy_mask_threshold=0.5,
        loss_type="grpo",
        scale_rewards="group",
        advantage_estimator="grpo",
        importance_sampling_level="token",
    ),
}


def _apply_preset(tree: dict[str, Any]) -> dict[str, Any]:
    alg = tree.get("algorithm")
    if not isinstance(alg, dict) or alg.get("preset") is None:
        return tree
    name = alg["preset"]
    if name not in PRESETS:
        raise ConfigError(f"bad value for 'algorithm.preset': {name!r}; allowed: {', '.join(PRESETS)}")
    return {**tree, "algorithm": {**PRESETS[name], **alg}}  # the user's own keys win
