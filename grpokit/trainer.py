"""The GRPO loop. Run it with `grpokit train config.yaml [key=value ...]`.

One step, as in DeepSeekMath Algorithm 1 and the seed (Q3):
    sample prompts -> G completions each from pi_old (rollout/) -> rewards (rewards/)
    -> group advantages (algo/) -> mu passes of minibatch updates on the clipped surrogate
    minus beta * KL(pi_theta || pi_ref) (algo/losses) -> sync pi_old -> log -> eval / checkpoint.

Departures from the textbook, each a config switch: the loss normalization (algorithm.loss_type),
clip-higher (epsilon_high), sequence-level ratios (GSPO), the advantage scale (Dr. GRPO), masking
truncated completions (DAPO). Process supervision (DeepSeekMath §4.1.3) needs no switch: when a
reward function returns StepScores, the advantages are per token. docs/algorithm.md has the formulas.
"""
from __future__ import annotations

import math
import random
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import Tensor

from grpokit.algo import group_advantages, masked_mean, policy_loss, step_advantages
from grpokit.checkpoint import (
    ensure_writable_dir,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    save_pretrained_atomic,
    set_rng_state,
)
from grpokit.config import AlgorithmConfig, Config, ConfigError, RewardSpec
from grpokit.evaluate import evaluate, make_judge
from grpokit.policy import PackedBatch, completion_logprobs, frozen_copy, load_policy, pack_sequences
from grpokit.rewards import RewardOutput
from grpokit.rewards.steps import process_rewards
from grpokit.rollout import Completions, SamplingParams, make_engine


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. updates non-finite too many times in a row); the message says why."""


@dataclass
class RolloutBatch:
    """Everything one step trains on. N = prompts_per_step x G completions, groups contiguous."""

    tokens: PackedBatch  # input_ids / masks [N, P + T], completion ids / mask [N, T]
    loss_mask: Tensor  # [N, T] completion_mask, minus truncated rows when they are masked (DAPO)
    truncated: Tensor  # [N] bool: hit max_completion_length without EOS
    rewards: Tensor  # [N] weighted total reward
    advantages: Tensor  # [N] one per completion, broadcast over its tokens; or [N, T] per token (process rewards, PPO's GAE)
    old_logp: Tensor | None  # [N, T] pi_old; None when it equals pi_theta (mu = 1, one minibatch)
    ref_logp: Tensor | None  # [N, T] pi_ref; None when beta = 0


@dataclass
class Groups:
    """Prompts with their G completions each and the rewards of those, before advantages."""

    rows: list  # [B] PromptRow
    comps: Completions  # [B * G], prompt-major
    scored: RewardOutput  # total / per_function [B * G]

    @staticmethod
    def take(chosen: list[tuple["Groups", int]], G: int) -> "Groups":
        """The groups (source, index) in `chosen`, concatenated in that order."""
        spans = [(src, slice(g * G, (g + 1) * G)) for src, g in chosen]
        cat = lambda get: [x for src, sl in spans for x in get(src)[sl]]  # noqa: E731
        logprobs = None
        if all(src.comps.logprobs is not None for src, _ in spans):
            logprobs = cat(lambda s: s.comps.logprobs)
        comps = Completions(cat(lambda s: s.comps.token_ids), cat(lambda s: s.comps.texts), cat(lambda s: s.comps.finish_reasons), logprobs)
        first = spans[0][0].scored
        sources = {id(src): src for src, _ in spans}.values()
        step_names = {k for src, _ in spans for k in src.scored.steps}
        steps = {k: [s for src, sl in spans for s in src.scored.steps.get(k, [None] * len(src.scored.total))[sl]] for k in step_names}
        scored = RewardOutput(
            total=torch.cat([src.scored.total[sl] for src, sl in spans]),
            per_function={k: torch.cat([src.scored.per_function[k][sl] for src, sl in spans]) for k in first.per_function},
            errors={k: sum(src.scored.errors[k] for src in sources) for k in first.errors},
            weights=first.weights,
            steps=steps,
        )
        return Groups([src.rows[g] for src, g in chosen], comps, scored)


# ---------------------------------------------------------------- the config's algorithm, as pure functions
# The trainer goes from rewards and log-probs to the loss only through these three, so that
# tests/test_presets.py can check each preset against its paper on tensors, without a model.


def outcome_advantages(alg: AlgorithmConfig, rewards: Tensor, group_size: int) -> Tensor:
    """[N] advantages of [N] outcome rewards (groups contiguous), as algorithm.* says."""
    return group_advantages(
        rewards, group_size, scale=alg.scale_rewards, estimator=alg.advantage_estimator, eps=alg.std_eps
    )


def process_advantages(alg: AlgorithmConfig, step_rewards: list[Tensor], step_ends: list[Tensor], group_size: int, num_tokens: int) -> Tensor:
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


def make_loss_mask(alg: AlgorithmConfig, completion_mask: Tensor, truncated: Tensor) -> Tensor:
    """[N, T] tokens that get a loss: the completion tokens, minus truncated rows under DAPO's overlong filtering."""
    loss_mask = completion_mask.clone()
    if alg.mask_truncated_completions:
        loss_mask[truncated] = 0
    return loss_mask


def algorithm_loss(
    alg: AlgorithmConfig,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    ref_logp: Tensor | None,
    max_completion_length: int,
    num_sequences: int | None = None,
    num_tokens: int | float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """policy_loss with algorithm.*'s clip ranges, KL, loss type and ratio level (-J, to minimize).

    logp, old_logp, ref_logp, loss_mask: [N, T]; advantages: [N] or [N, T]. num_sequences /
    num_tokens: the whole batch's counts when this is a micro-batch of it (docs/algorithm.md §4)."""
    return policy_loss(
        logp,
        old_logp,
        advantages,
        loss_mask,
        ref_logp=ref_logp,
        beta=alg.beta,
        eps_low=alg.epsilon,
        eps_high=alg.epsilon_high,
        loss_type=alg.loss_type,
        ratio_level=alg.importance_sampling_level,
        max_completion_length=max_completion_length,
        kl_estimator=alg.kl_estimator,
        dual_clip=alg.dual_clip,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(kind: str, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return f


class MeanAccumulator:
    """Weighted means of metric dicts over the micro-batches of a step."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float = 1.0) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * weight
            self.weights[k] = self.weights.get(k, 0.0) + weight

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


class Trainer:
    def __init__(self, cfg: Config, *, model=None, tokenizer=None, train_rows=None, eval_rows=None):
        from grpokit.data import PromptDataset, PromptSampler
        from grpokit.rewards import RewardManager

        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        seed_everything(cfg.seed)
        if model is None:
            model, tokenizer = load_policy(cfg.model)
        self.model, self.tokenizer = model, tokenizer
        # pi_ref is the policy as loaded, before any resume replaces the weights; not built when beta = 0.
        self.ref = frozen_copy(model) if cfg.algorithm.beta > 0 else None
        # What the log-prob passes call: the same modules (same parameters), compiled when model.compile is set.
        if cfg.model.compile:
            # One model forward, several graphs: rollout prefill / decode, pi_ref, training prompt / completion
            # passes (grad on / off, frozen / trainable weights); dynamo's default limit of 8 would leave some eager.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        self.policy_fn = torch.compile(model) if cfg.model.compile else model
        self.ref_fn = torch.compile(self.ref) if cfg.model.compile and self.ref is not None else self.ref

        train_rows, eval_rows, task = self._rows(train_rows, eval_rows)
        data_kw = dict(
            prompt_column=cfg.data.prompt_column,
            max_prompt_length=cfg.data.max_prompt_length,
            overlong=cfg.data.overlong_prompts,
            system_prompt=cfg.data.system_prompt,
        )
        self.train_data = PromptDataset(train_rows, tokenizer, **data_kw)
        self.eval_data = PromptDataset(eval_rows, tokenizer, **data_kw) if eval_rows else None
        self.sampler = PromptSampler(len(self.train_data), cfg.rollout.prompts_per_step, cfg.seed, shuffle=cfg.data.shuffle)

        specs = list(cfg.rewards) or ([RewardSpec(function=task)] if task else [])
        if not specs:
            raise ConfigError("no reward functions: add `rewards: [{function: package.module:function}]` to the config")
        if cfg.algorithm.overlong_buffer_frac > 0:  # DAPO soft overlong punishment, eq. 13
            L = cfg.rollout.max_completion_length
            buffer = max(1, int(cfg.algorithm.overlong_buffer_frac * L))
            specs.append(RewardSpec(function="overlong", name="overlong", kwargs={"max_completion_length": L, "cache_length": buffer}))
        try:
            self.rewards = RewardManager(specs, strict=cfg.reward_errors == "raise")
            # A column a reward function needs is checked now, not at the first rollout.
            columns = {c: [] for c in self.train_data.column_names if c != cfg.data.prompt_column}
            for reward in self.rewards.rewards:
                reward.arguments({"prompts": [], "completions": [], "completion_ids": []}, columns)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if cfg.eval.reward is not None and cfg.eval.reward not in self.rewards.names:
            raise ConfigError(f"eval.reward={cfg.eval.reward!r} is not a configured reward; use one of {self.rewards.names}")
        self.judge = make_judge(self.rewards, reward_name=cfg.eval.reward, threshold=cfg.eval.correct_threshold)
        self._check_context_length()

        self.engine = make_engine(
            cfg.rollout.engine, model, tokenizer, batch_size=cfg.rollout.generation_batch_size, compile=cfg.model.compile
        )
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            # One fused kernel over all parameters instead of a dozen ops per tensor: 4-5x faster steps on
            # CPU (TRL's default is adamw_torch_fused too); other devices keep the per-tensor loop.
            fused=all(p.device.type in ("cpu", "cuda") for p in params) or None,
            lr=cfg.optim.learning_rate,
            betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
            eps=cfg.optim.adam_epsilon,
            weight_decay=cfg.optim.weight_decay,
        )
        total = cfg.optim.max_steps * cfg.algorithm.num_iterations * cfg.optim.num_minibatches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.optim.lr_scheduler, cfg.optim.warmup_steps, total)
        )
        self.step = 0
        self.consecutive_skips = 0
        self.skipped_updates = 0
        self._stop_signal: str | None = None
        self.interrupted: str | None = None  # the signal (SIGTERM / SIGINT) that made train() stop early

    def _check_context_length(self) -> None:
        """Longest prompt + max_completion_length must fit the model's positions: checked before any training."""
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        if not isinstance(limit, int):
            return
        datasets = [d for d in (self.train_data, self.eval_data) if d is not None]
        longest = max(len(d[i].prompt_ids) for d in datasets for i in range(len(d)))
        T = self.cfg.rollout.max_completion_length
        if longest + T > limit:
            raise ConfigError(
                f"the longest prompt ({longest} tokens) + rollout.max_completion_length={T} is {longest + T} tokens, "
                f"more than the model's max_position_embeddings={limit}; lower rollout.max_completion_length to "
                f"{max(limit - longest, 0)} or shorten the prompts (data.max_prompt_length, data.overlong_prompts=truncate)"
            )

    # ------------------------------------------------------------------ data
    def _rows(self, train_rows, eval_rows):
        from grpokit.data import load_rows, split_rows

        cfg = self.cfg.data
        task = None
        if train_rows is None and cfg.task:
            from grpokit.tasks import get_task

            t = get_task(cfg.task)
            task = t.name
            train_rows = t.make_rows("train", cfg.task_train_size, self.cfg.seed)
            if eval_rows is None and cfg.eval_path is None:
                eval_rows = t.make_rows("test", cfg.eval_size or 500, self.cfg.seed)
        elif train_rows is None:
            if not cfg.train_path:
                raise ConfigError("no training data: set data.train_path (a .jsonl/.parquet/.csv file) or data.task")
            train_rows = load_rows(cfg.train_path)
        if eval_rows is None:
            if cfg.eval_path:
                eval_rows = load_rows(cfg.eval_path)
            elif cfg.eval_size:
                train_rows, eval_rows = split_rows(train_rows, cfg.eval_size, self.cfg.seed)
        return train_rows, eval_rows or [], task

    def _expand(self, rows, G: int):
        """Prompts and dataset columns repeated G times, aligned with the completions."""
        prompts = [r.prompt for r in rows for _ in range(G)]
        columns = {c: [r.columns[c] for r in rows for _ in range(G)] for c in rows[0].columns}
        return prompts, columns

    # ------------------------------------------------------------------ rollout -> rewards -> advantages
    @torch.no_grad()
    def _logprobs(self, model, tokens: PackedBatch) -> Tensor:
        """Log-probs [N, T] under a model, no gradient, in micro-batches (old and ref passes)."""
        out = torch.zeros(tokens.completion_ids.shape, dtype=torch.float32)
        mb = self.cfg.micro_batch_size
        was_training = model.training
        model.eval()
        try:
            for s in range(0, out.shape[0], mb):
                sub = tokens.rows(slice(s, s + mb))
                logp, _ = completion_logprobs(model, sub, temperature=self.cfg.rollout.temperature)
                out[s : s + mb, : sub.completion_width] = logp.float()
        finally:
            model.train(was_training)
        return out

    def _sample_groups(self, rows, timings: dict[str, float]) -> "Groups":
        """G completions for each row, scored: the unit dynamic sampling keeps or drops."""
        cfg, G = self.cfg, self.cfg.rollout.num_generations
        t = time.perf_counter()
        sampling = SamplingParams(
            max_tokens=cfg.rollout.max_completion_length,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
        )
        comps = self.engine.generate([r.prompt_ids for r in rows], G, sampling)
        timings["perf/rollout_time"] = timings.get("perf/rollout_time", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        prompts, columns = self._expand(rows, G)
        try:
            scored = self.rewards(prompts=prompts, completions=comps.texts, completion_ids=comps.token_ids, columns=columns)
        except RuntimeError as exc:
            if not self.rewards.strict:
                raise
            raise TrainingError(f"step {self.step + 1}: {exc} (reward_errors=raise; reward_errors=skip counts it and goes on)") from exc
        timings["perf/reward_time"] = timings.get("perf/reward_time", 0.0) + time.perf_counter() - t
        return Groups(list(rows), comps, scored)

    def _dynamic_sampling(self, first: "Groups", timings: dict[str, float]) -> tuple["Groups", dict[str, float]]:
        """DAPO §3.2: keep groups whose rewards differ; draw more prompts until the batch is full.

        After algorithm.max_sampling_rounds rounds a short batch is topped up with dropped groups
        (they carry no policy gradient, only the KL term), so every step has the same shape.
        """
        want, G = self.cfg.rollout.prompts_per_step, self.cfg.rollout.num_generations
        kept, dropped, rounds, drawn = [], [], 0, 0
        cur = first
        while True:
            rounds += 1
            drawn += len(cur.rows)
            for g in range(len(cur.rows)):
                r = cur.scored.total[g * G : (g + 1) * G]
                (kept if r.max() > r.min() else dropped).append((cur, g))
            if len(kept) >= want or rounds >= self.cfg.algorithm.max_sampling_rounds:
                break
            cur = self._sample_groups([self.train_data[i] for i in self.sampler.next()], timings)
        chosen = (kept + dropped)[:want]
        metrics = {
            "rollout/sampling_rounds": float(rounds),
            "rollout/groups_drawn": float(drawn),
            "rollout/groups_dropped": float(drawn - len(kept)),
            "rollout/groups_topped_up": float(max(0, want - len(kept))),
        }
        return Groups.take(chosen, G), metrics

    def rollout(self, rows) -> tuple[RolloutBatch, dict[str, float], list]:
        cfg, G = self.cfg, self.cfg.rollout.num_generations
        timings: dict[str, float] = {}
        groups = self._sample_groups(rows, timings)
        ds_metrics: dict[str, float] = {}
        if cfg.algorithm.dynamic_sampling:
            groups, ds_metrics = self._dynamic_sampling(groups, timings)
        rows, comps, scored = groups.rows, groups.comps, groups.scored

        rewards = scored.total.float()  # [N]
        pad = self.tokenizer.pad_token_id
        tokens = pack_sequences([r.prompt_ids for r in rows for _ in range(G)], comps.token_ids, pad)
        if scored.steps:  # process rewards: one advantage per token (DeepSeekMath §4.1.3)
            step_rewards, step_ends = process_rewards(scored, comps.texts, comps.token_ids, self.tokenizer)
            advantages = process_advantages(cfg.algorithm, step_rewards, step_ends, G, tokens.completion_ids.shape[1])
        else:
            advantages = outcome_advantages(cfg.algorithm, rewards, G)
        truncated = torch.tensor(comps.truncated, dtype=torch.bool)
        loss_mask = make_loss_mask(cfg.algorithm, tokens.completion_mask, truncated)

        t = time.perf_counter()
        # pi_old differs from pi_theta only after an optimizer step inside this batch's updates.
        need_old = cfg.algorithm.num_iterations > 1 or cfg.optim.num_minibatches > 1
        old_logp = self._logprobs(self.policy_fn, tokens) if need_old else None
        ref_logp = self._logprobs(self.ref_fn, tokens) if self.ref is not None else None
        timings["perf/ref_time"] = time.perf_counter() - t

        batch = RolloutBatch(tokens, loss_mask, truncated, rewards, advantages, old_logp, ref_logp)
        reward_metrics = {k: v for k, v in scored.metrics().items() if not k.startswith("reward/total")}
        metrics = {**timings, **reward_metrics, **ds_metrics, **self._rollout_metrics(batch, rows, comps)}
        samples = self._samples(rows, comps, rewards, G)
        return batch, metrics, samples

    def _rollout_metrics(self, b: RolloutBatch, rows, comps) -> dict[str, float]:
        G = self.cfg.rollout.num_generations
        grouped = b.rewards.view(-1, G)
        lengths = b.tokens.completion_mask.sum(-1).float()
        # Per-token advantages (process rewards): statistics over the completion tokens.
        adv = b.advantages if b.advantages.dim() == 1 else b.advantages[b.tokens.completion_mask.bool()]
        return {
            "reward/mean": b.rewards.mean().item(),
            "reward/std": b.rewards.std(correction=0).item(),
            "reward/zero_std_frac": (grouped.amax(1) == grouped.amin(1)).float().mean().item(),
            "reward/group_std_mean": grouped.std(1, correction=0).mean().item(),
            "advantage/mean": adv.mean().item(),
            "advantage/std": adv.std(correction=0).item(),
            "advantage/abs_mean": adv.abs().mean().item(),
            "rollout/completion_len_mean": lengths.mean().item(),
            "rollout/completion_len_min": lengths.min().item(),
            "rollout/completion_len_max": lengths.max().item(),
            "rollout/truncated_frac": b.truncated.float().mean().item(),
            "rollout/prompt_len_mean": float(np.mean([len(r.prompt_ids) for r in rows])),
            "rollout/tokens": lengths.sum().item(),
        }

    def _samples(self, rows, comps, rewards, G) -> list[dict]:
        k = min(self.cfg.logging.num_samples, len(rows))
        return [
            {"prompt": rows[i].prompt_text, "completion": comps.texts[i * G], "reward": rewards[i * G].item()}
            for i in range(k)
        ]

    # ------------------------------------------------------------------ policy update
    def update(self, b: RolloutBatch) -> dict[str, float]:
        cfg, alg = self.cfg, self.cfg.algorithm
        N, mb, micro = b.rewards.numel(), cfg.minibatch_size, cfg.micro_batch_size
        acc = MeanAccumulator()
        params = [p for p in self.model.parameters() if p.requires_grad]
        for name, x in (("weighted total reward", b.rewards), ("advantage", b.advantages)):
            bad = (~torch.isfinite(x)).view(N, -1).any(1).nonzero().flatten().tolist()  # completions
            if bad:  # e.g. weighted rewards that overflow float32: every optimizer step of this batch is skipped
                for _ in range(alg.num_iterations * cfg.optim.num_minibatches):
                    self._skip_update(name, f"{len(bad)} of {N} completions, first: completion {bad[0]}")
                self.optimizer.zero_grad(set_to_none=True)
                return {"policy/skipped_updates": float(self.skipped_updates)}
        for it in range(alg.num_iterations):
            # A fresh minibatch split each pass; a single minibatch needs no shuffle.
            order = torch.randperm(N) if cfg.optim.num_minibatches > 1 else torch.arange(N)
            for m in range(cfg.optim.num_minibatches):
                idx = order[m * mb : (m + 1) * mb]
                # Whole-minibatch normalizers: accumulation over micro-batches gives the same gradient.
                num_tokens = b.loss_mask[idx].sum().item()
                self.optimizer.zero_grad(set_to_none=True)
                finite, minibatch_loss = True, 0.0
                for s in range(0, mb, micro):
                    sub_idx = idx[s : s + micro]
                    tokens = b.tokens.rows(sub_idx)
                    T = tokens.completion_width
                    logp, entropy = completion_logprobs(
                        self.policy_fn, tokens, temperature=cfg.rollout.temperature, with_entropy=it == 0
                    )
                    mask = b.loss_mask[sub_idx, :T]
                    old = b.old_logp[sub_idx, :T] if b.old_logp is not None else logp.detach()
                    ref = b.ref_logp[sub_idx, :T] if b.ref_logp is not None else None
                    loss, m_stats = algorithm_loss(
                        alg,
                        logp,
                        old,
                        b.advantages[sub_idx] if b.advantages.dim() == 1 else b.advantages[sub_idx, :T],
                        mask,
                        ref_logp=ref,
                        max_completion_length=cfg.rollout.max_completion_length,
                        num_sequences=mb,
                        num_tokens=num_tokens,
                    )
                    if not torch.isfinite(loss):
                        finite = False
                        where = f"pass {it + 1}, minibatch {m + 1}"
                        if not torch.isfinite(logp.detach()[mask.bool()]).all():
                            where += ": the policy's log-probs were non-finite"
                        break
                    loss.backward()
                    weight = mask.sum().item()
                    acc.add({f"policy/{k}": v for k, v in m_stats.items()}, weight)
                    minibatch_loss += loss.item()  # micro-batch losses add up to the minibatch's loss
                    if entropy is not None:
                        acc.add({"policy/entropy": masked_mean(entropy, tokens.completion_mask).item()}, weight)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm or float("inf"))
                if not finite or not torch.isfinite(grad_norm):
                    if finite:
                        bad = [n for n, p in self.model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
                        where = f"pass {it + 1}, minibatch {m + 1}" + (f": first in {bad[0]}" if bad else "")
                    self._skip_update("loss" if not finite else "gradient norm", where)
                    continue
                self.consecutive_skips = 0
                acc.add({"policy/loss": minibatch_loss, "policy/grad_norm": grad_norm.item(), "policy/lr": self.scheduler.get_last_lr()[0]})
                self.optimizer.step()
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**acc.means(), "policy/skipped_updates": float(self.skipped_updates)}

    def _skip_update(self, what: str, where: str = "") -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_updates += 1
        self.consecutive_skips += 1
        limit = self.cfg.optim.max_consecutive_skips
        if self.consecutive_skips >= limit:
            where = f", {where}" if where else ""
            raise TrainingError(
                f"the {what} was non-finite in {limit} optimizer steps in a row (last at step {self.step + 1}{where}); "
                "no checkpoint with these weights was written. Lower optim.learning_rate, check the rewards "
                "for NaN/inf, or use model.dtype=float32"
            )

    # ------------------------------------------------------------------ eval, checkpoints, signals
    def evaluate(self) -> dict[str, float]:
        if self.eval_data is None or len(self.eval_data) == 0:
            return {}
        ev = self.cfg.eval
        n = len(self.eval_data) if not ev.max_samples else min(ev.max_samples, len(self.eval_data))
        rows = [self.eval_data[i] for i in range(n)]
        return evaluate(
            self.engine,
            rows,
            self.judge,
            k=ev.k,
            temperature=ev.temperature,
            max_tokens=self.cfg.rollout.max_completion_length,
            batch_size=ev.batch_size,
            seed=self.cfg.seed + 1234,
        )

    def state_dict(self) -> dict:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "skipped_updates": self.skipped_updates,
        }
        if self.cfg.algorithm.ref_policy == "reset" and self.ref is not None:
            state["ref_model"] = self.ref.state_dict()  # no longer the initial weights
        return state

    def save(self) -> Path:
        for name, p in self.model.named_parameters():
            if not torch.isfinite(p).all():
                raise TrainingError(f"refusing to save step {self.step}: the weights hold NaN/inf (first in {name})")
        return save_checkpoint(self.out, self.step, self.model, self.tokenizer, self.state_dict(), self.cfg.checkpoint.keep_last)

    def maybe_resume(self) -> int | None:
        found = list_checkpoints(self.out) if self.cfg.checkpoint.resume else []
        if not found:
            return None
        step, path = found[-1]
        state = load_checkpoint(path, self.model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.skipped_updates = state.get("skipped_updates", 0)
        if "ref_model" in state and self.ref is not None:
            self.ref.load_state_dict(state["ref_model"])
        self.step = state["step"]
        set_rng_state(state["rng"])
        self.engine.sync_weights(self.model)
        return step

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._stop_signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._stop_signal = name

    # ------------------------------------------------------------------ the loop
    def train(self, *, on_log=None) -> dict[str, float]:
        from grpokit.logging import MetricLogger, TrainProgress

        cfg = self.cfg
        ensure_writable_dir(self.out)
        (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        resumed = self.maybe_resume()
        saved_step = resumed  # the step of the newest checkpoint on disk: never written twice
        log = MetricLogger(self.out, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb, mlflow=cfg.logging.mlflow, config=cfg.model_dump())
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        last: dict[str, float] = {}
        try:
            with TrainProgress(cfg.optim.max_steps, start_step=self.step) as prog:
                if resumed is not None:
                    log.truncate_after(self.step)
                    prog.print(f"resuming from checkpoint step {resumed} in {self.out / 'checkpoints'}")
                elif cfg.eval.at_start:
                    ev = self.evaluate()
                    if ev:
                        log.log(0, ev)
                        prog.update(0, ev)
                while self.step < cfg.optim.max_steps:
                    t0 = time.perf_counter()
                    rows = [self.train_data[i] for i in self.sampler.next()]
                    batch, metrics, samples = self.rollout(rows)
                    t1 = time.perf_counter()
                    metrics.update(self.update(batch))
                    self.engine.sync_weights(self.model)
                    self.step += 1
                    if self.cfg.algorithm.ref_policy == "reset" and self.ref is not None and self.step % self.cfg.algorithm.ref_reset_every == 0:
                        self.ref.load_state_dict(self.model.state_dict())  # DeepSeekMath §4.1.4 iterative RL
                    t2 = time.perf_counter()
                    metrics.update(self._perf(metrics, t0, t1, t2, batch))
                    if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.optim.max_steps:
                        metrics.update(self.evaluate())
                    if self.step == cfg.optim.max_steps:
                        metrics.update(self.evaluate())
                    if self.step % cfg.logging.log_every == 0 or self.step == cfg.optim.max_steps:
                        log.log(self.step, metrics)
                    if cfg.logging.sample_every and self.step % cfg.logging.sample_every == 0 and samples:
                        log.log_samples(self.step, samples)
                    prog.update(self.step, metrics)
                    last = metrics
                    if on_log is not None:
                        on_log(self.step, metrics)
                    if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                        self.save()
                        saved_step = self.step
                    if self._stop_signal and self.step < cfg.optim.max_steps:
                        path = self.save() if saved_step != self.step else self.out / "checkpoints" / f"step-{self.step:06d}"
                        prog.print(f"{self._stop_signal}: saved step {self.step} to {path}; run the same command to resume")
                        self.interrupted = self._stop_signal
                        return last
                if saved_step != self.step:
                    self.save()  # the end state, so that running the command again finds the run finished
                save_pretrained_atomic(self.model, self.tokenizer, self.out / "final")
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            log.close()
        try:
            from grpokit.plots import plot_metrics

            plot_metrics(self.out / "metrics.jsonl", self.out)
        except Exception as exc:  # plots are a convenience; never lose a finished run over them
            print(f"warning: plots were not written: {exc}")
        return last

    def _perf(self, metrics, t0, t1, t2, batch: RolloutBatch) -> dict[str, float]:
        tokens = batch.tokens.completion_mask.sum().item()
        # Prompt + completion tokens through forward and backward, once per pass (padding excluded).
        train_tokens = batch.tokens.attention_mask.sum().item() * self.cfg.algorithm.num_iterations
        return {
            "perf/step_time": t2 - t0,
            "perf/train_time": t2 - t1,
            "perf/rollout_tokens_per_s": tokens / max(metrics["perf/rollout_time"], 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(t2 - t1, 1e-9),
            "perf/peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
