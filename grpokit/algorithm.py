"""The config's `algorithm` section applied: pure functions from rewards and log-probs to the loss.

    options = loss_options(cfg.algorithm, cfg.rollout.max_completion_length)        # once, at start-up
    advantages = outcome_advantages(cfg.algorithm, rewards, G)                       # [N]
    loss_mask = make_loss_mask(cfg.algorithm, completion_mask, truncated)            # [N, T]
    loss, stats = algorithm_loss(options, logp, old_logp, advantages, loss_mask, ref_logp=ref, ...)

The loop (grpokit/trainer.py) goes from rewards and log-probs to the loss only through these, so
that tests/test_presets.py checks each preset against its paper on tensors, without a model.
The math itself is in grpokit/algo/ (no config there); docs/algorithm.md has the formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch
from torch import Tensor

from grpokit.algo import (
    LossOptions,
    adaptive_entropy_coef,
    decoupled_advantages,
    group_advantages,
    policy_loss,
    step_advantages,
)
from grpokit.config import AlgorithmConfig, ConfigError
from grpokit.data.batch import Groups
from grpokit.metrics.compute import (
    POLICY_ENTROPY,
    POLICY_ENTROPY_COEF,
    ROLLOUT_GROUPS_DRAWN,
    ROLLOUT_GROUPS_DROPPED,
    ROLLOUT_GROUPS_TOPPED_UP,
    ROLLOUT_SAMPLING_ROUNDS,
)
from grpokit.types import Ranks

#: advantage scales whose statistics are over the whole batch (the others are per group: local to a rank)
BATCH_SCALES = ("batch", "batch_centered")


class _OneProcess:
    """The ranks of a caller that passes none: one, whose collectives return what it has (as World's at 1)."""

    size, rank, is_main = 1, 0, True

    def barrier(self) -> None:
        return None

    def sum(self, value: Any) -> Any:
        return value

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def all_rows(self, x: Tensor) -> Tensor:
        return x

    def my_rows(self, x: Tensor) -> Tensor:
        return x


ONE_PROCESS = _OneProcess()

#: the LossOptions fields loss_options sets itself; every other one is algorithm.<the same name>
SET_IN_LOSS_OPTIONS = ("eps_low", "eps_high", "ratio_level", "max_completion_length", "beta")


def outcome_advantages(
    alg: AlgorithmConfig,
    rewards: Tensor,
    group_size: int,
    world: Ranks | None = None,
    scored: Any = None,
) -> Tensor:
    """[N] advantages of [N] outcome rewards (groups contiguous), as algorithm.* says. world: with several
    ranks (grpokit/distributed/) a batch scale's mean and std are those of every rank's rewards (one
    all_gather of [N] floats), so each rank gets its rows of what one process computes on the global batch.
    scored: the batch's RewardOutput; with multi_objective_aggregation=normalize_then_sum, GDPO's decoupled
    advantages of its per-function rewards."""
    ranks: Ranks = world or ONE_PROCESS
    if alg.multi_objective_aggregation == "normalize_then_sum" and scored is not None:
        names = list(scored.per_function)
        rows = [ranks.all_rows(scored.per_function[k].to(rewards.dtype)) for k in names]
        per_reward = torch.stack(rows)  # [K, N]
        weights = torch.tensor([scored.weights[k] for k in names], dtype=per_reward.dtype)
        return ranks.my_rows(
            decoupled_advantages(
                per_reward, weights, group_size, estimator=alg.advantage_estimator, eps=alg.std_eps
            )
        )
    if alg.scale_rewards not in BATCH_SCALES:  # per group: each rank has its whole groups
        ranks = ONE_PROCESS
    advantages = group_advantages(
        ranks.all_rows(rewards),
        group_size,
        scale=alg.scale_rewards,
        estimator=alg.advantage_estimator,
        eps=alg.std_eps,
    )
    return ranks.my_rows(advantages)


def process_advantages(
    alg: AlgorithmConfig,
    step_rewards: list[Tensor],
    step_ends: list[Tensor],
    group_size: int,
    num_tokens: int,
) -> Tensor:
    """[N, T] advantages of step rewards (DeepSeekMath §4.1.3): all steps of a group normalized
    together, token t gets the sum over the steps ending at or after it. Only the group z-score
    is defined for steps, so other algorithm.scale_rewards / advantage_estimator are an error."""
    if alg.scale_rewards != "group" or alg.advantage_estimator != "grpo":
        raise ConfigError(
            f"a reward function returned step scores (process rewards), whose advantages are DeepSeekMath's "
            f"group-normalized step rewards; algorithm.scale_rewards={alg.scale_rewards!r} / "
            f"advantage_estimator={alg.advantage_estimator!r} do not apply to them: use scale_rewards=group, "
            "advantage_estimator=grpo, or return one float per completion"
        )
    return step_advantages(step_rewards, step_ends, group_size, num_tokens, eps=alg.std_eps)


def make_loss_mask(
    alg: AlgorithmConfig,
    completion_mask: Tensor,
    truncated: Tensor,
    model_mask: list[list[int]] | None = None,
) -> Tensor:
    """[N, T] tokens that get a loss: the completion tokens, minus truncated rows under DAPO's overlong
    filtering, minus (multi-turn episodes with tools) the tool-result and template tokens, model_mask
    [N][len_i] = 0: they are context, so they get no gradient and the token normalizers (which count this
    mask) never count them."""
    loss_mask = completion_mask.clone()
    if model_mask is not None:
        for i, m in enumerate(model_mask):
            loss_mask[i, : len(m)] *= torch.tensor(m, dtype=loss_mask.dtype)
    if alg.mask_truncated_completions:
        loss_mask[truncated] = 0
    return loss_mask


def loss_options(
    alg: AlgorithmConfig, max_completion_length: int | None = None, beta: float | None = None
) -> LossOptions:
    """The objective's settings from algorithm.*, built once (when the trainer is) and handed to
    algorithm_loss on every call. A LossOptions field is copied from the algorithm.* field of the same name,
    so a new knob is a field in both and nothing here; only SET_IN_LOSS_OPTIONS (named otherwise in the
    config, or not in algorithm.*) are set below. max_completion_length: rollout.max_completion_length (Dr.
    GRPO's constant). beta: None = algorithm.beta; 0 when the KL is shaped into the reward instead (PPO's
    ppo.kl_in_reward)."""
    by_name = {f.name: getattr(alg, f.name) for f in fields(LossOptions) if f.name not in SET_IN_LOSS_OPTIONS}
    return LossOptions(
        **by_name,
        eps_low=alg.epsilon,
        eps_high=alg.epsilon_high,
        ratio_level=alg.importance_sampling_level,
        max_completion_length=max_completion_length,
        beta=alg.beta if beta is None else beta,
    )


def algorithm_loss(
    options: LossOptions | AlgorithmConfig,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    ref_logp: Tensor | None,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: int | float | None = None,
    beta: float | None = None,
    is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """policy_loss with the run's LossOptions (-J, to minimize).

    options: what loss_options built once; algorithm.* itself is turned into its options on this call (a
    caller holding only the config: tests/test_presets.py, and the trainer until it keeps its options).
    logp, old_logp, ref_logp, loss_mask: [N, T]; advantages: [N] or [N, T]. num_sequences / num_tokens:
    the whole minibatch's counts when this is a micro-batch of it (docs/algorithm.md §4). is_weights: [N, T]
    rollout.importance_correction's weights (grpokit.algo.importance), or None. entropy: [N, T] pi_theta's
    entropy (pass_options says when the loss needs it; with the bonus it carries the gradient). beta,
    max_completion_length, entropy_coef: this call's values in place of the options' (None keeps them), as
    EntropyControl.coef, which moves every step."""
    if not isinstance(options, LossOptions):
        options = loss_options(options)
    per_call: dict[str, Any] = {
        "beta": beta,
        "max_completion_length": max_completion_length,
        "entropy_coef": entropy_coef,
    }
    return policy_loss(
        logp,
        old_logp,
        advantages,
        loss_mask,
        ref_logp=ref_logp,
        options=replace(options, **{k: v for k, v in per_call.items() if v is not None}),
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        is_weights=is_weights,
        entropy=entropy,
    )


def needs_entropy(alg: AlgorithmConfig) -> bool:
    """Whether the loss itself takes pi_theta's entropy (the high-entropy token selection, the bonus)."""
    return alg.top_entropy_quantile < 1.0 or has_entropy_bonus(alg)


def has_entropy_bonus(alg: AlgorithmConfig) -> bool:
    """Whether the loss may add c H (then the entropy carries its gradient): a fixed c != 0, or adaptive."""
    return alg.entropy_coef != 0.0 or alg.entropy_target is not None


class EntropyControl:
    """The entropy bonus coefficient of each step: algorithm.entropy_coef, or with algorithm.entropy_target
    Skywork-OR1's adaptive control (grpokit.algo.adaptive_entropy_coef), moved after each step by the step's
    policy/entropy (the mean over every rank's completion tokens, so every rank moves it alike). Its state is
    in the checkpoint, so a resumed run continues with the same coefficient."""

    def __init__(self, alg: AlgorithmConfig):
        self.alg, self.value, self.on = alg, alg.entropy_coef, True

    @property
    def coef(self) -> float:
        """The coefficient of the next step's loss."""
        return self.value if self.on else 0.0

    def update(self, metrics: dict[str, float]) -> dict[str, float]:
        """After a step (its metrics, reduced over ranks): the coefficient that step used, as a metric; then
        the next step's. A step without an entropy (every update skipped) leaves it as it is."""
        alg, used = self.alg, self.coef
        if alg.entropy_target is None:
            return {}
        if (entropy := metrics.get(POLICY_ENTROPY)) is not None:
            self.value, self.on = adaptive_entropy_coef(
                self.value,
                entropy,
                alg.entropy_target,
                alg.entropy_coef_delta,
                alg.entropy_coef_min,
                alg.entropy_coef_max,
            )
        return {POLICY_ENTROPY_COEF: used}

    def state_dict(self) -> dict[str, Any]:
        return {"entropy_control": {"value": self.value, "on": self.on}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (saved := state.get("entropy_control")) is not None:
            self.value, self.on = float(saved["value"]), bool(saved["on"])


def pass_options(cfg: Any, first_pass: bool) -> dict[str, Any]:
    """completion_logprobs' options for a training pass of the policy (cfg: the Config): the rollout's
    temperature, and the entropy for the metric (first pass) or for the loss (every pass), with its gradient
    when the loss has an entropy bonus; padding-free rows with model.padding_free."""
    alg = cfg.algorithm
    return {
        "temperature": cfg.rollout.temperature,
        "with_entropy": first_pass or needs_entropy(alg),
        "entropy_grad": has_entropy_bonus(alg),
        "padding_free": cfg.model.padding_free is True,  # the run's config: made concrete when it started
    }


def dynamic_sampling(
    first: Groups, draw: Callable[[], Groups], want: int, G: int, max_rounds: int, world: Ranks | None = None
) -> tuple[Groups, dict[str, float]]:
    """DAPO §3.2: keep groups whose rewards differ; draw() more prompts' groups until `want` are kept.
    After max_rounds rounds a short batch is topped up with dropped groups (they carry no policy
    gradient, only the KL term), so every step has the same shape.

    world: with W ranks, `want` is this rank's share and every round is each rank's share of the same global
    prompts. The rounds go on until the kept groups of every rank add up to W x want (one all_reduce per
    round); then every rank's groups are gathered in global order (round by round, rank after rank: the order
    one process draws them in), the first W x want (kept, then dropped) are the step's batch, and each rank
    takes its r-th share. So the batch is the one one process keeps, whatever the world size; rollout/groups_*
    are summed."""
    ranks: Ranks = world or ONE_PROCESS
    W = ranks.size
    rounds: list[tuple[Groups, list[int], list[int]]] = []  # this rank's (groups, kept, dropped) per round
    cur, drawn, kept_total = first, 0, 0
    while True:
        drawn += len(cur.rows)
        per_group = cur.scored.total.reshape(-1, G)
        differ = (per_group.max(dim=1).values > per_group.min(dim=1).values).tolist()
        rounds.append(
            (cur, [g for g, d in enumerate(differ) if d], [g for g, d in enumerate(differ) if not d])
        )
        kept_total += sum(differ)
        if ranks.sum(kept_total) >= W * want or len(rounds) >= max_rounds:
            break
        cur = draw()
    everyone = ranks.gather(rounds)  # [rank][round]
    in_order = [(rank[k], kept) for kept in (True, False) for k in range(len(rounds)) for rank in everyone]
    chosen = [(src, g, kept) for (src, ks, ds), kept in in_order for g in (ks if kept else ds)][: W * want]
    mine = chosen[ranks.rank * want : (ranks.rank + 1) * want]
    metrics = {
        ROLLOUT_SAMPLING_ROUNDS: float(len(rounds)),
        ROLLOUT_GROUPS_DRAWN: float(drawn),  # this rank's counts: summed over the ranks in the logs
        ROLLOUT_GROUPS_DROPPED: float(drawn - kept_total),
        ROLLOUT_GROUPS_TOPPED_UP: float(sum(not kept for _, _, kept in mine)),
    }
    return Groups.take([(src, g) for src, g, _ in mine], G), metrics
