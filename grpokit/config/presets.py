"""The algorithm presets: each paper's `algorithm.*` settings, expanded under the keys a config sets."""

from __future__ import annotations

from typing import Any

from grpokit.config.sections import ConfigError

# Each paper's algorithm settings. Budget choices (G, batch sizes, learning rate) are not part of a
# preset; the paper's values are listed in docs/algorithm.md.
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
    "dapo": dict(
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
    ),
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
}


def _apply_preset(tree: dict[str, Any]) -> dict[str, Any]:
    alg = tree.get("algorithm")
    if not isinstance(alg, dict) or alg.get("preset") is None:
        return tree
    name = alg["preset"]
    if name not in PRESETS:
        raise ConfigError(f"bad value for 'algorithm.preset': {name!r}; allowed: {', '.join(PRESETS)}")
    return {**tree, "algorithm": {**PRESETS[name], **alg}}  # the user's own keys win
