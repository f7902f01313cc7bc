"""The PPO baseline's critic: a value model, its values, its GAE advantages and its update.

    grpokit train config.yaml algorithm.advantage_estimator=gae ppo.critic_learning_rate=1e-4

The one loop (grpokit/trainer.py) uses a Critic when algorithm.advantage_estimator=gae, in place of
the group baseline; everything else (rollout, rewards, the clipped policy loss, checkpoints) is
GRPO's. InstructGPT-style (Ouyang et al. 2022; TRL's PPOTrainer), on the same rollout batch as GRPO
(prompts_per_step x num_generations completions: PPO does not need groups, but the same batch makes
the comparison one of budgets, not of batch sizes):
    V_old per completion token (this critic)
    -> per-token rewards: the score on the last token, minus beta * (logp_old - logp_ref) on every
       token when ppo.kl_in_reward (then the policy loss runs with beta = 0)          (algo/gae)
    -> GAE(gamma, lam) advantages and returns; advantages whitened over the batch     (algo/gae)
    -> after the policy's mu passes, mu passes of minibatch steps on the clipped value loss with
       the critic's own AdamW (ppo.critic_learning_rate).

What GRPO saves (DeepSeekMath §4.1) is exactly this: a second backbone, its AdamW moments, and a
forward + backward pass of it per step. benchmarks/grpo_vs_ppo.py measures both (docs/ppo.md).
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from grpokit.algo import gae_advantages, masked_whiten, token_rewards, value_loss
from grpokit.checkpoint import CheckpointError
from grpokit.data.batch import PackedBatch, ValueTargets, one_row
from grpokit.data.micro_batches import MicroBatching
from grpokit.distributed import World
from grpokit.metrics.compute import (
    PERF_CRITIC_TRAIN_TIME,
    PERF_VALUE_TIME,
    VALUE_SKIPPED_UPDATES,
    MeanAccumulator,
    critic_metrics,
    value_name,
)
from grpokit.policy import is_checkpointing, load_model_from_config
from grpokit.policy.heap import release_between_layers
from grpokit.policy.optim import Optimizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ValueModel(nn.Module):
    """V(s_t) for every completion token: a transformer backbone whose last hidden states feed a
    scalar head (nn.Linear(hidden, 1), zero-initialized, float32). padding_free (model.padding_free): a
    batch's sequences run back to back in one row, as the policy's passes do (data/batch.py: one_row)."""

    def __init__(self, backbone: nn.Module, padding_free: bool = False):
        super().__init__()
        self.backbone, self.padding_free = backbone, padding_free
        config = cast("PretrainedConfig", backbone.config)  # a transformers model's
        hidden = config.get_text_config().hidden_size
        self.head = nn.Linear(hidden, 1)
        # V = 0 everywhere at the start: no guess about the reward scale. The backbone gets gradient
        # from the second critic step on, once the head is no longer 0.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: PackedBatch) -> Tensor:
        if self.padding_free:
            row = one_row(batch)  # no attention mask, no cache: attention stays inside each sequence
            h = self.backbone(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False)
            # the positions that predict the completion tokens: the states before them, as below
            values = self.head(h.last_hidden_state[:, row.predicts].float()).squeeze(-1)  # [1, K]
            return row.unpack(values)  # [N, T], 0 on padding
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


def build_value_model(model_cfg, policy: nn.Module) -> ValueModel:
    """The policy's architecture without its LM head, loaded from model.name_or_path (a copy of the
    policy's backbone when the policy was passed in without a path), with the policy's gradient
    checkpointing setting (its dropout is left as the checkpoint has it)."""
    if not model_cfg.name_or_path:
        base = policy.base_model
        assert isinstance(base, nn.Module)  # a transformers model's backbone
        return ValueModel(copy.deepcopy(base), model_cfg.padding_free)
    backbone = load_model_from_config(model_cfg, head="backbone")
    if is_checkpointing(policy):  # model.gradient_checkpointing=true, or auto found it needed
        backbone.gradient_checkpointing_enable()
        if model_cfg.release_freed_memory:
            release_between_layers(backbone)
    return ValueModel(backbone, model_cfg.padding_free).train()


class Critic:
    """The value model, its AdamW and its update. world: torchrun's ranks (grpokit/distributed/): the value
    model is wrapped as the policy is (FSDP2 / DDP, World.wrap_critic), the whitening, the metrics and the
    loss normalizer cover every rank's rows, and minibatches are those of one process (World.minibatches);
    None: one process."""

    def __init__(
        self, cfg, policy: nn.Module, *, has_ref: bool, total_steps: int, world: World | None = None
    ):
        self.cfg, self.world = cfg, world if world is not None else World()
        # beta > 0 with kl_in_reward: -beta * KL per token in the reward, and none in the loss.
        self.kl_coef = cfg.algorithm.beta if (cfg.ppo.kl_in_reward and has_ref) else 0.0
        self.model = build_value_model(cfg.model, policy)
        self.forward = self.world.wrap_critic(self.model)  # the training forward (DDP: the wrapper)
        self.batching = MicroBatching.of(cfg)  # the policy's micro-batches (padding-free or padded)
        self.optimizer = Optimizer(
            self.model.named_parameters(),
            cfg.optim,
            lr=cfg.ppo.critic_learning_rate,
            total_steps=total_steps,
            name="critic",
            subject="value ",
            fix="lower ppo.critic_learning_rate or check the rewards for NaN/inf",
            # torch's per-tensor AdamW, as the critic has always had: the PPO numbers in docs/ppo.md
            fused=False,
        )

    @property
    def shapes_kl_into_reward(self) -> bool:
        """True when the KL is in the per-token reward: the policy loss must then run with beta = 0."""
        return self.cfg.ppo.kl_in_reward

    @torch.no_grad()
    def values(self, tokens: PackedBatch) -> Tensor:
        """V_old [N, T] under the critic, no gradient, in micro-batches; 0 on padding."""
        out = torch.zeros(tokens.completion_ids.shape, dtype=torch.float32)
        self.model.eval()
        try:
            for idx, filler in self.batching.plan(torch.arange(out.shape[0]), tokens, self.world.most):
                sub = tokens.rows(idx)
                v = self.model(sub)  # [mb, T_sub]
                if not filler:  # a filler only evens out the ranks' forwards
                    out[idx, : sub.completion_width] = torch.where(sub.completion_mask.bool(), v, 0.0)
        finally:
            self.model.train()
        return out

    def advantages(
        self,
        rewards: Tensor,
        tokens: PackedBatch,
        loss_mask: Tensor,
        *,
        old_logp: Tensor | None,
        ref_logp: Tensor | None,
    ) -> tuple[Tensor, ValueTargets, dict[str, float]]:
        """Whitened GAE advantages [N, T], the critic's targets, and the critic's metrics.
        rewards: [N] sequence scores; old_logp / ref_logp: [N, T], needed when the KL is shaped into the
        reward."""
        t = time.perf_counter()
        mask = tokens.completion_mask  # [N, T] every sampled token is a step of the episode
        values = self.values(tokens)  # [N, T]
        kl = None
        if self.kl_coef > 0:  # [N, T] k1 = log pi_old / pi_ref (InstructGPT eq. 2)
            assert (
                old_logp is not None and ref_logp is not None
            )  # passed when the KL is shaped into the reward
            kl = old_logp - ref_logp
        per_token = token_rewards(rewards, mask, kl=kl, kl_coef=self.kl_coef)  # [N, T]
        adv, returns = gae_advantages(per_token, values, mask, gamma=self.cfg.ppo.gamma, lam=self.cfg.ppo.lam)
        # Whitening over the tokens that get a loss, of every rank's rows: the per-token analogue of GRPO's
        # std scaling. At W > 1 the rows of all ranks, in rank order, right-padded to the widest (padding is
        # outside the masks); this rank keeps its own block.
        everyone = self.world.cat_rows(adv, values, returns, loss_mask, mask, per_token, rewards)
        white = masked_whiten(everyone[0], everyone[3])  # [W * N, T_max]
        metrics = critic_metrics(white, *everyone)
        metrics[PERF_VALUE_TIME] = time.perf_counter() - t
        return self.world.my_rows(white)[:, : adv.shape[1]], ValueTargets(values, returns), metrics

    def update(
        self, tokens: PackedBatch, loss_mask: Tensor, targets: ValueTargets, *, at_step: int
    ) -> dict[str, float]:
        """mu passes of minibatch steps on the clipped value loss, with the policy's batch shapes."""
        t = time.perf_counter()
        cfg, world, M = self.cfg, self.world, self.cfg.optim.num_minibatches
        if M > 1 and world.size > 1:  # minibatches mix every rank's rows, as the policy's do
            tokens, loss_mask, targets = world.gather_values(tokens, loss_mask, targets)
        acc = MeanAccumulator()
        for _ in range(cfg.algorithm.num_iterations):
            # One process's split: a fresh permutation per pass (rank 0's), this rank's share of each.
            for idx in world.minibatches(loss_mask.shape[0], M, self.batching.costs(tokens)):
                self.optimizer.zero_grad()
                finite = self._accumulate(tokens, loss_mask, targets, idx, acc)
                done = self.optimizer.step(loss_finite=finite, at_step=at_step)
                if done is not None:
                    acc.add({value_name(k): v for k, v in done.items()})
        self.optimizer.zero_grad()
        return {
            **world.means(acc),
            VALUE_SKIPPED_UPDATES: float(self.optimizer.skipped),
            PERF_CRITIC_TRAIN_TIME: time.perf_counter() - t,
        }

    def _accumulate(
        self, tokens: PackedBatch, loss_mask: Tensor, targets: ValueTargets, idx: Tensor, acc: MeanAccumulator
    ) -> bool:
        """Backward of one minibatch's value loss (this rank's rows `idx` of it) over its micro-batches; False
        when a micro-batch's loss is non-finite on any rank (every rank then skips the step)."""
        ppo, world = self.cfg.ppo, self.world
        num_tokens = world.sum(loss_mask[idx].sum().item())  # the minibatch's token mean, over every rank
        for sub_idx, filler in self.batching.plan(idx, tokens, world.most):
            sub = tokens.rows(sub_idx)
            T = sub.completion_width
            mask = loss_mask[sub_idx, :T]
            loss, stats = value_loss(
                self.forward(sub),
                targets.values[sub_idx, :T],
                targets.returns[sub_idx, :T],
                mask,
                clip_range=ppo.cliprange_value,
                num_tokens=num_tokens,
            )
            if not world.all_finite(loss):
                return False
            # With its own AdamW, vf_coef only scales the critic's gradient before clipping.
            world.backward(ppo.vf_coef * loss * (0.0 if filler else 1.0))  # a filler: no gradient
            if filler:
                continue
            acc.add({value_name(k): v for k, v in stats.items()}, mask.sum().item())
        return True

    def state_dict(self) -> dict:
        """The critic's schedule (a checkpoint part); its weights and moments are the checkpoint's Weights."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if "critic_scheduler" not in state:
            raise CheckpointError("has no critic (a GRPO run?); give the PPO run its own output_dir")
        self.optimizer.load_state_dict(state)
