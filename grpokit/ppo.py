"""PPO with a learned critic, on grpokit's loop: the baseline to compare GRPO with (docs/ppo.md).

    grpokit train config.yaml algorithm.advantage_estimator=gae ppo.critic_learning_rate=1e-4

    from grpokit.ppo import PPOTrainer
    PPOTrainer(cfg).train()

One step, InstructGPT-style (Ouyang et al. 2022; TRL's PPOTrainer), on the same rollout batch as
GRPO (prompts_per_step x num_generations completions; PPO does not need groups, but the same batch
makes the comparison one of budgets, not of batch sizes):
    sample prompts -> completions from pi_old -> sequence rewards (rewards/)
    -> V_old per completion token (the critic) -> per-token rewards: the score on the last token,
       minus beta * (logp_old - logp_ref) on every token when ppo.kl_in_reward     (algo/gae)
    -> GAE(gamma, lam) advantages and returns; advantages whitened over the batch  (algo/gae)
    -> mu passes of minibatch updates: the policy on grpokit.algo.policy_loss with per-token
       advantages [N, T] (its beta is 0 when the KL is in the reward), then the critic on the
       clipped value loss with its own AdamW (ppo.critic_learning_rate)
    -> sync pi_old -> log -> eval / checkpoint (the critic and its optimizer go in the trainer state).

What GRPO saves (seed Q2, Q7, Q8) is exactly `self.critic` and its optimizer state: a second
backbone, its AdamW moments, and a forward + backward pass of it per step. benchmarks/grpo_vs_ppo.py
measures both.

How it reuses the GRPO loop: the inherited rollout() and update() run unchanged, seeing the
config through `_grpo_loop()`, with advantage_estimator=grpo (the group advantages it computes
are replaced by GAE's before any update) and, when the KL is in the reward, beta=0 in the loss.
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from grpokit.algo import explained_variance, gae_advantages, masked_mean, masked_whiten, token_rewards, value_loss
from grpokit.checkpoint import STATE_FILE, CheckpointError, list_checkpoints
from grpokit.config import Config
from grpokit.policy import DTYPES, ModelLoadError, PackedBatch
from grpokit.trainer import MeanAccumulator, RolloutBatch, Trainer, TrainingError, lr_lambda


class ValueModel(nn.Module):
    """V(s_t) for every completion token: a transformer backbone whose last hidden states feed a
    scalar head (nn.Linear(hidden, 1), zero-initialized, float32)."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.get_text_config().hidden_size
        self.head = nn.Linear(hidden, 1)
        # V = 0 everywhere at the start: no guess about the reward scale. The backbone gets gradient
        # from the second critic step on, once the head is no longer 0.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: PackedBatch) -> Tensor:
        T = batch.completion_width
        h = self.backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).last_hidden_state  # [N, P + T, H]
        # The state before completion token t is the prefix up to P - 1 + t: the position whose
        # logits predict token t (as in completion_logprobs).
        h = h[:, -(T + 1) : -1]  # [N, T, H]
        return self.head(h.float()).squeeze(-1)  # [N, T]


def build_critic(model_cfg, policy: nn.Module) -> ValueModel:
    """The policy's architecture without its LM head, loaded from model.name_or_path with AutoModel
    (a copy of the policy's backbone when the policy was passed in without a path)."""
    if not model_cfg.name_or_path:
        return ValueModel(copy.deepcopy(policy.base_model))
    from transformers import AutoModel

    kwargs = dict(dtype=DTYPES[model_cfg.dtype], trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.attn_implementation:
        kwargs["attn_implementation"] = model_cfg.attn_implementation
    try:
        backbone = AutoModel.from_pretrained(model_cfg.name_or_path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load the critic's backbone from {model_cfg.name_or_path!r} (model.name_or_path) "
            f"with AutoModel: {str(exc).splitlines()[0]}"
        ) from None
    if model_cfg.gradient_checkpointing:
        backbone.gradient_checkpointing_enable()
    return ValueModel(backbone).train()


@dataclass
class PPOBatch(RolloutBatch):
    """A rollout batch plus the critic's side. `advantages` is [N, T] here: whitened GAE."""

    values: Tensor  # [N, T] V_old: the critic at rollout time (the value-clipping anchor)
    returns: Tensor  # [N, T] GAE returns A + V_old: the critic's targets
    token_rewards: Tensor  # [N, T] score on the last token, minus the KL shaping on every token


class PPOTrainer(Trainer):
    def __init__(self, cfg: Config, **kwargs):
        if cfg.algorithm.advantage_estimator != "gae":  # so that config.yaml and the logs say what ran
            cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"advantage_estimator": "gae"})})
        super().__init__(cfg, **kwargs)
        alg, ppo = cfg.algorithm, cfg.ppo
        # beta > 0 with kl_in_reward: -beta * KL per token in the reward, and none in the loss.
        self.kl_coef = alg.beta if (ppo.kl_in_reward and self.ref is not None) else 0.0
        loop_alg = {"advantage_estimator": "grpo"}
        if ppo.kl_in_reward:
            loop_alg["beta"] = 0.0
        self._loop_cfg = cfg.model_copy(update={"algorithm": alg.model_copy(update=loop_alg)})

        self.critic = build_critic(cfg.model, self.model)
        self.critic_optimizer = torch.optim.AdamW(
            [p for p in self.critic.parameters() if p.requires_grad],
            lr=ppo.critic_learning_rate,
            betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
            eps=cfg.optim.adam_epsilon,
            weight_decay=cfg.optim.weight_decay,
        )
        total = cfg.optim.max_steps * alg.num_iterations * cfg.optim.num_minibatches
        self.critic_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.critic_optimizer, lr_lambda(cfg.optim.lr_scheduler, cfg.optim.warmup_steps, total)
        )
        self.critic_skipped_updates = 0
        self._critic_consecutive_skips = 0

    @contextmanager
    def _grpo_loop(self):
        """Run inherited code with the loop's view of the config (see the module docstring)."""
        saved, self.cfg = self.cfg, self._loop_cfg
        try:
            yield
        finally:
            self.cfg = saved

    # ------------------------------------------------------------------ rollout -> rewards -> GAE
    @torch.no_grad()
    def _values(self, tokens: PackedBatch) -> Tensor:
        """V_old [N, T] under the critic, no gradient, in micro-batches; 0 on padding."""
        out = torch.zeros(tokens.completion_ids.shape, dtype=torch.float32)
        mb = self.cfg.micro_batch_size
        self.critic.eval()
        try:
            for s in range(0, out.shape[0], mb):
                sub = tokens.rows(slice(s, s + mb))
                v = self.critic(sub)  # [mb, T_sub]
                out[s : s + mb, : sub.completion_width] = torch.where(sub.completion_mask.bool(), v, torch.zeros_like(v))
        finally:
            self.critic.train()
        return out

    def rollout(self, rows) -> tuple[PPOBatch, dict[str, float], list]:
        with self._grpo_loop():
            b, metrics, samples = super().rollout(rows)
        t = time.perf_counter()
        ppo = self.cfg.ppo
        mask = b.tokens.completion_mask  # [N, T] every sampled token is a step of the episode
        values = self._values(b.tokens)  # [N, T]
        kl = None
        if self.kl_coef > 0:
            old = b.old_logp if b.old_logp is not None else self._logprobs(self.model, b.tokens)
            kl = old - b.ref_logp  # [N, T] k1 = log pi_old / pi_ref per sampled token (InstructGPT eq. 2)
        rewards = token_rewards(b.rewards, mask, kl=kl, kl_coef=self.kl_coef)  # [N, T]
        adv, returns = gae_advantages(rewards, values, mask, gamma=ppo.gamma, lam=ppo.lam)
        # Whitening over the tokens that get a loss: the per-token analogue of GRPO's std scaling.
        white = masked_whiten(adv, b.loss_mask)  # [N, T]
        batch = PPOBatch(
            **{f.name: getattr(b, f.name) for f in fields(RolloutBatch)} | {"advantages": white},
            values=values,
            returns=returns,
            token_rewards=rewards,
        )
        lm = b.loss_mask
        metrics.update(
            {
                "advantage/mean": masked_mean(white, lm).item(),
                "advantage/std": masked_mean((white - masked_mean(white, lm)) ** 2, lm).sqrt().item(),
                "advantage/abs_mean": masked_mean(white.abs(), lm).item(),
                "advantage/raw_mean": masked_mean(adv, lm).item(),
                "advantage/raw_std": masked_mean((adv - masked_mean(adv, lm)) ** 2, lm).sqrt().item(),
                "value/mean": masked_mean(values, mask).item(),
                "value/return_mean": masked_mean(returns, mask).item(),
                "value/explained_variance": explained_variance(values, returns, mask),
                "reward/kl_shaping": (rewards.sum(-1) - b.rewards * (mask.sum(-1) > 0)).mean().item(),
                "perf/value_time": time.perf_counter() - t,
            }
        )
        return batch, metrics, samples

    # ------------------------------------------------------------------ updates: policy, then critic
    def update(self, b: PPOBatch) -> dict[str, float]:
        with self._grpo_loop():
            stats = super().update(b)
        t = time.perf_counter()
        stats.update(self._update_critic(b))
        stats["perf/critic_train_time"] = time.perf_counter() - t
        return stats

    def _update_critic(self, b: PPOBatch) -> dict[str, float]:
        """mu passes of minibatch steps on the clipped value loss, with the policy's batch shapes."""
        cfg, ppo = self.cfg, self.cfg.ppo
        N, mb, micro = b.rewards.numel(), cfg.minibatch_size, cfg.micro_batch_size
        params = [p for p in self.critic.parameters() if p.requires_grad]
        acc = MeanAccumulator()
        for _ in range(cfg.algorithm.num_iterations):
            order = torch.randperm(N) if cfg.optim.num_minibatches > 1 else torch.arange(N)
            for m in range(cfg.optim.num_minibatches):
                idx = order[m * mb : (m + 1) * mb]
                num_tokens = b.loss_mask[idx].sum().item()  # the minibatch's token mean, whatever the micro-batches
                self.critic_optimizer.zero_grad(set_to_none=True)
                finite = True
                for s in range(0, mb, micro):
                    sub_idx = idx[s : s + micro]
                    tokens = b.tokens.rows(sub_idx)
                    T = tokens.completion_width
                    mask = b.loss_mask[sub_idx, :T]
                    loss, m_stats = value_loss(
                        self.critic(tokens),
                        b.values[sub_idx, :T],
                        b.returns[sub_idx, :T],
                        mask,
                        clip_range=ppo.cliprange_value,
                        num_tokens=num_tokens,
                    )
                    if not torch.isfinite(loss):
                        finite = False
                        break
                    # With its own AdamW, vf_coef only scales the critic's gradient before clipping.
                    (ppo.vf_coef * loss).backward()
                    acc.add({f"value/{k}": v for k, v in m_stats.items()}, mask.sum().item())
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm or float("inf"))
                if not finite or not torch.isfinite(grad_norm):
                    self._skip_critic_update("value loss" if not finite else "value gradient norm")
                    continue
                self._critic_consecutive_skips = 0
                acc.add({"value/grad_norm": grad_norm.item(), "value/lr": self.critic_scheduler.get_last_lr()[0]})
                self.critic_optimizer.step()
                self.critic_scheduler.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        return {**acc.means(), "value/skipped_updates": float(self.critic_skipped_updates)}

    def _skip_critic_update(self, what: str) -> None:
        self.critic_optimizer.zero_grad(set_to_none=True)
        self.critic_skipped_updates += 1
        self._critic_consecutive_skips += 1
        limit = self.cfg.optim.max_consecutive_skips
        if self._critic_consecutive_skips >= limit:
            raise TrainingError(
                f"the {what} was non-finite in {limit} critic steps in a row (step {self.step}); "
                "lower ppo.critic_learning_rate or check the rewards for NaN/inf"
            )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "critic": self.critic.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "critic_scheduler": self.critic_scheduler.state_dict(),
            "critic_skipped_updates": self.critic_skipped_updates,
        }

    def maybe_resume(self) -> int | None:
        step = super().maybe_resume()
        if step is None:
            return None
        _, path = list_checkpoints(self.out)[-1]  # the one the policy was just loaded from
        state = torch.load(path / STATE_FILE, weights_only=False)
        if "critic" not in state:
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no critic (a GRPO run?); give the PPO run its own output_dir"
            )
        self.critic.load_state_dict(state["critic"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.critic_scheduler.load_state_dict(state["critic_scheduler"])
        self.critic_skipped_updates = state.get("critic_skipped_updates", 0)
        return step


def make_trainer(cfg: Config, **kwargs) -> Trainer:
    """PPOTrainer when algorithm.advantage_estimator is gae, else the GRPO Trainer."""
    cls = PPOTrainer if cfg.algorithm.advantage_estimator == "gae" else Trainer
    return cls(cfg, **kwargs)
