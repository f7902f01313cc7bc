"""The GRPO loop. Run it with `grpokit train config.yaml [key=value ...]`.

One step, as in DeepSeekMath Algorithm 1 (iterative GRPO), each stage a call into the module that owns it:
    sample prompts (data) -> G completions each from pi_old (rollout/) -> rewards (rewards/)
    -> advantages (algo/: group baseline; or the critic's GAE, critic.py) -> mu passes of minibatch
    updates on the clipped surrogate minus beta * KL(pi_theta || pi_ref) (algo/losses, optim.py)
    -> sync pi_old -> log (metrics.py, records/) -> eval / checkpoint (evaluate.py, checkpoint/).

Departures from the textbook, each a config switch: the loss normalization (algorithm.loss_type),
clip-higher (epsilon_high), sequence-level ratios (GSPO), the advantage scale (Dr. GRPO), masking truncated
completions (DAPO).
Process supervision (DeepSeekMath §4.1.3) needs no switch: when a reward function returns StepScores, the
advantages are per token. docs/algorithm.md has the formulas. Under torchrun every rank runs this loop on its
share of the prompts; distributed/ wraps the model (FSDP2 / DDP) and makes whole-batch quantities global.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpokit.algo import masked_mean
from grpokit.algorithm import (
    EntropyControl,
    algorithm_loss,
    dynamic_sampling,
    loss_options,
    make_loss_mask,
    outcome_advantages,
    pass_options,
    process_advantages,
)
from grpokit.checkpoint import checkpoint_dir, seed_everything
from grpokit.components import build_checkpointer, build_components, resolved
from grpokit.config import Config
from grpokit.data import SamplerBookmarks
from grpokit.data.batch import Groups, RolloutBatch, pack_sequences, process_rewards, repeat_rows
from grpokit.data.micro_batches import MicroBatching
from grpokit.distributed import World
from grpokit.distributed.sequence_turns import policy_logprobs, turns
from grpokit.evaluate import evaluate
from grpokit.metrics.compute import (
    PERF_MICRO_BATCHES,
    PERF_PADDING_FRAC,
    PERF_REF_TIME,
    PERF_REWARD_TIME,
    PERF_ROLLOUT_TIME,
    POLICY_ENTROPY,
    POLICY_LOSS,
    POLICY_SKIPPED_UPDATES,
    REWARD_TOTAL,
    MeanAccumulator,
    perf_metrics,
    policy_name,
    rollout_metrics,
    sample_records,
)
from grpokit.policy import is_checkpointing, padding_fraction
from grpokit.policy.anchors import anchor_logprobs
from grpokit.policy.optim import TrainingError, check_finite_weights, non_finite, out_of_memory_said
from grpokit.records import plot_run
from grpokit.records.run_records import RunRecords
from grpokit.rewards import RewardError
from grpokit.rollout import Completions, check_engine, sampler_logprobs
from grpokit.rollout.pipeline import lag_metrics


class Trainer:
    def __init__(self, cfg: Config, *, model=None, tokenizer=None, train_rows=None, eval_rows=None):
        cfg = resolved(cfg, model)  # rollout.engine=auto, the automatic token budget: made concrete, and said
        self.cfg, self.out = cfg, Path(cfg.output_dir)
        # The command line also resolves threads=0 (auto); the Python API leaves torch's setting alone.
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.world = World.from_env(cfg)  # torchrun's ranks (distributed/); one process without it
        check_engine(cfg, self.world.size)  # what the run asks of the engine, against what it can do
        seed_everything(cfg.seed + self.world.rank)  # each rank samples its own completions
        parts = build_components(
            cfg, self.world, model=model, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows
        )
        cfg = self.cfg = parts.cfg  # model.padding_free=auto made concrete for the model
        self.policy, self.tokenizer = parts.policy, parts.tokenizer  # the policy's one handle
        self.train_data, self.eval_data, self.sampler = parts.train_data, parts.eval_data, parts.sampler
        self.rewards, self.judge = parts.rewards, parts.judge
        self.health, self.correction = parts.health, parts.correction  # bad steps; sampler-trainer mismatch
        self.pipeline = parts.pipeline  # the engine as pi_old (rollout/pipeline.py): it owns and closes it
        self.optimizer, self.critic, self.sequence = parts.optimizer, parts.critic, parts.sequence
        self.entropy = EntropyControl(cfg.algorithm)  # the entropy bonus coefficient of the next step
        self.bookmarks = SamplerBookmarks(self.sampler, lambda: self.step)  # checkpointed: the next batch's
        self.checkpointer = build_checkpointer(cfg, self.world, parts, self.bookmarks, self.entropy)
        # PPO with KL shaping puts the KL into the reward instead of the loss.
        shapes_kl = self.critic is not None and self.critic.shapes_kl_into_reward
        beta = 0.0 if shapes_kl else cfg.algorithm.beta
        self.loss_options = loss_options(cfg.algorithm, cfg.rollout.max_completion_length, beta=beta)
        self.batching = MicroBatching.of(cfg)  # micro-batches in rows or in tokens (data/micro_batches.py)
        self.step = 0
        self.signals = self.world.stop_signals()  # SIGTERM / SIGINT in train(): finish the step, save, stop
        self.interrupted: str | None = None  # the signal (SIGTERM / SIGINT) that made train() stop early

    @property
    def model(self) -> torch.nn.Module:
        """The trained module (the optimizer's parameters; FSDP2: sharded)."""
        return self.policy.module

    @property
    def ref(self):
        """pi_ref, or None when the run has no KL term."""
        return self.policy.ref

    def close(self) -> None:
        """Close the rollout pipeline and its engine (train() does, at its end or on an error)."""
        self.pipeline.close()

    # ------------------------------------------------------------------ rollout -> rewards -> advantages
    def _draw(self, b: int | None = None) -> list:
        """The rows of the next prompts: batch b for the pipeline, or (None) dynamic sampling's next round."""
        self.bookmarks.mark(b)
        return [self.train_data[i] for i in self.world.share(self.sampler.next())]

    def _score(self, rows, comps: Completions, timings: dict[str, float]) -> Groups:
        """The rewards of G completions for each row: a Groups, the unit dynamic sampling keeps or drops."""
        t, (prompts, columns) = time.perf_counter(), repeat_rows(rows, self.cfg.rollout.num_generations)
        try:
            scored = self.rewards(
                prompts=prompts,
                completions=comps.texts,
                completion_ids=comps.token_ids,
                columns=columns,
                episodes=comps.episodes,
            )
        except RewardError as exc:  # reward_errors=raise, or a timeout with on_timeout=raise
            hint = " (reward_errors=raise; reward_errors=skip counts it and goes on)"
            raise TrainingError(
                f"step {self.step + 1}: {exc}" + (hint if self.cfg.reward_errors == "raise" else "")
            ) from exc
        timings[PERF_REWARD_TIME] = timings.get(PERF_REWARD_TIME, 0.0) + time.perf_counter() - t
        return Groups(list(rows), comps, scored)

    def _more(self, metrics: dict[str, float]) -> Groups:
        """Dynamic sampling's next round: more prompts, their completions now, scored."""
        rows = self._draw()
        return self._score(rows, self.pipeline.extra(rows, metrics), metrics)

    def _groups(self, rows) -> tuple[Groups, dict[str, float]]:
        """This step's scored groups (dynamic sampling: the groups whose rewards differ), and timings."""
        if rows is None:
            rows, comps, metrics = self.pipeline.batch(self.step, self._draw, self.cfg.optim.max_steps)
        else:
            metrics = {}
            comps = self.pipeline.extra(rows, metrics)
        groups = self._score(rows, comps, metrics)
        alg = self.cfg.algorithm
        if alg.dynamic_sampling:
            groups, sampling_metrics = dynamic_sampling(
                groups,
                lambda: self._more(metrics),
                len(rows),
                self.cfg.rollout.num_generations,
                alg.max_sampling_rounds,
                self.world,
            )
            metrics.update(sampling_metrics)
        return groups, metrics

    def rollout(self, rows=None) -> tuple[RolloutBatch, dict[str, float], list]:
        """This step's batch from the pipeline (or of `rows`, now): scored, with advantages and log-probs."""
        cfg, alg, G = self.cfg, self.cfg.algorithm, self.cfg.rollout.num_generations
        groups, metrics = self._groups(rows)
        rows, comps, scored = groups.rows, groups.comps, groups.scored
        rewards = scored.total.float()  # [N]
        prompt_ids = [r.prompt_ids for r in rows for _ in range(G)]
        tokens = pack_sequences(prompt_ids, comps.token_ids, self.tokenizer.pad_token_id, comps.kept)
        truncated = torch.tensor(comps.truncated, dtype=torch.bool)  # [N]
        # [N, T]: the completion tokens a loss reaches (tool results and, under DAPO, truncated rows: none)
        loss_mask = make_loss_mask(alg, tokens.completion_mask, truncated, comps.model_mask)

        t, sampler_logp = time.perf_counter(), sampler_logprobs(comps, tokens)  # the engine's [N, T], or None
        kl_shaping = self.critic is not None and bool(self.critic.kl_coef)
        old_logp, ref_logp, kl_old = anchor_logprobs(
            cfg,
            self.policy,
            tokens,
            sampler_logp,
            kl_shaping=kl_shaping,
            most=self.world.most,
            sp=self.sequence,
        )
        metrics[PERF_REF_TIME] = time.perf_counter() - t

        value_targets = None
        critic_metrics: dict[str, float] = {}
        if self.critic is not None:  # PPO: whitened GAE from the critic's values [N, T]
            advantages, value_targets, critic_metrics = self.critic.advantages(
                rewards, tokens, loss_mask, old_logp=kl_old, ref_logp=ref_logp
            )
        elif scored.steps:  # process rewards: one advantage per token [N, T] (DeepSeekMath §4.1.3)
            step_rewards, step_ends = process_rewards(scored, comps.texts, comps.token_ids, self.tokenizer)
            advantages = process_advantages(alg, step_rewards, step_ends, G, tokens.completion_width)
        else:  # [N]; a batch std over every rank's rewards
            advantages = outcome_advantages(alg, rewards, G, self.world, scored)

        batch = RolloutBatch(
            tokens, loss_mask, truncated, rewards, advantages, old_logp, ref_logp, value_targets, sampler_logp
        )
        metrics.update(self._rollout_metrics(rows, scored, batch))
        metrics.update(critic_metrics | lag_metrics(comps, self.step))  # rollout/version_lag
        texts = [r.prompt_text for r in rows]
        samples = sample_records(texts, comps.texts, batch, scored.per_function, G, cfg.logging.num_samples)
        return batch, metrics, samples

    def _rollout_metrics(self, rows, scored, batch: RolloutBatch) -> dict[str, float]:
        """reward/ and rollout/ metrics of every rank's rows."""
        rewards = self.world.scores(scored).metrics()
        metrics = {k: v for k, v in rewards.items() if not k.startswith(REWARD_TOTAL)}
        everyone = self.world.cat_rows(
            batch.rewards,
            batch.advantages,
            batch.tokens.completion_mask,
            batch.truncated,
            [len(r.prompt_ids) for r in rows],
            self.cfg.rollout.num_generations,
            [r.truncated for r in rows],
        )
        return metrics | rollout_metrics(*everyone)

    # ------------------------------------------------------------------ policy update (and the critic's)
    def update(self, b: RolloutBatch) -> dict[str, float]:
        """mu passes of minibatch updates of the policy on this batch (then the critic's, for PPO)."""
        bad = [
            (name, p)
            for name, x in (("weighted total reward", b.rewards), ("advantage", b.advantages))
            if (p := non_finite(x, b.rewards.numel()))
        ]
        if self.world.all(not bad):
            stats = self._policy_passes(b)
        else:  # e.g. weighted rewards that overflow float32 (on any rank): skip each optimizer step of it
            what, where = bad[0] if bad else ("weighted total reward or advantage", "on another rank")
            for _ in range(self.cfg.algorithm.num_iterations * self.cfg.optim.num_minibatches):
                self.optimizer.skip(what, where, self.step + 1)
            stats = {POLICY_SKIPPED_UPDATES: float(self.optimizer.skipped)}
        if self.critic is not None and b.value_targets is not None:  # PPO: the critic's update
            stats.update(self.critic.update(b.tokens, b.loss_mask, b.value_targets, at_step=self.step + 1))
        return stats

    def _policy_passes(self, b: RolloutBatch) -> dict[str, float]:
        cfg, M, acc = self.cfg, self.cfg.optim.num_minibatches, MeanAccumulator()
        if M > 1:  # minibatches mix every rank's rows
            b = self.world.gather_batch(b, self.tokenizer.pad_token_id)
        for it in range(cfg.algorithm.num_iterations):
            # A fresh minibatch split each pass (this rank's share of each); one minibatch needs no shuffle.
            costs = self.batching.costs(b.tokens)  # several minibatches: rows dealt to ranks by tokens
            for m, idx in enumerate(self.world.minibatches(b.rewards.numel(), M, costs)):
                self.optimizer.zero_grad()
                loss, why = self._accumulate_gradient(b, idx, first_pass=it == 0, acc=acc)
                done = self.optimizer.step(
                    loss_finite=loss is not None,
                    where=f"pass {it + 1}, minibatch {m + 1}{why}",
                    at_step=self.step + 1,
                )
                if done is not None and loss is not None:  # a step was taken: its loss was finite
                    acc.add(
                        {POLICY_LOSS: self.world.sum(loss), **{policy_name(k): v for k, v in done.items()}}
                    )
        self.optimizer.zero_grad()
        return {
            **self.world.means(acc),
            **self.correction.pop_metrics(),
            POLICY_SKIPPED_UPDATES: float(self.optimizer.skipped),
        }

    def _accumulate_gradient(
        self, b: RolloutBatch, idx: Tensor, *, first_pass: bool, acc: MeanAccumulator
    ) -> tuple[float | None, str]:
        """Backward of one minibatch's loss over its micro-batches: (the minibatch's loss, "") or, when a
        micro-batch's loss is non-finite, (None, what was seen)."""
        # Normalizers of the whole minibatch, over every rank's share: accumulation and ranks agree.
        cfg, (num_sequences, num_tokens) = self.cfg, self.world.sum(len(idx), b.loss_mask[idx].sum().item())
        minibatch_loss, runs = 0.0, self.batching.plan(idx, b.tokens, self.world.most)
        acc.add({PERF_MICRO_BATCHES: len(runs)})
        # a filler evens out the ranks' counts (its loss counts 0 times); sequence parallelism: every member's
        # micro-batches in turn, the same pass on each, split over the group (metrics: a rank's own only)
        for mb, filler, mine in turns(self.sequence, b, runs):
            first, (tokens, mask) = first_pass and not filler, (mb.tokens, mb.loss_mask)
            n, T = len(mb.rewards), tokens.completion_width  # trimmed to the micro-batch's longest completion
            with out_of_memory_said(*self.batching.limit, is_checkpointing(self.model), n, T):
                logp, entropy = policy_logprobs(
                    self.sequence, self.policy.forward, tokens, **pass_options(cfg, first)
                )
            # no pi_old pass (anchors.pi_old_source: "none"): pi_old = pi_theta
            old_logp = logp.detach() if mb.old_logp is None else mb.old_logp
            loss, stats = algorithm_loss(
                self.loss_options,
                logp,
                old_logp,
                mb.advantages,
                mask,
                ref_logp=mb.ref_logp,
                num_tokens=num_tokens,
                num_sequences=num_sequences,
                is_weights=self.correction(mb, logp, mask, acc, first and mine),
                entropy=entropy,
                entropy_coef=self.entropy.coef,
            )
            if not self.world.all_finite(loss):  # every rank skips together
                bad_logp = not torch.isfinite(logp.detach()[mask.bool()]).all()
                return None, ": the policy's log-probs were non-finite" if bad_logp else ""
            with out_of_memory_said(*self.batching.limit, is_checkpointing(self.model), n, T):
                self.world.backward(loss * 0.0 if filler else loss)
            if filler or not mine:
                continue
            acc.add({policy_name(k): v for k, v in stats.items()}, mask.sum().item())
            split = self.sequence is not None  # sequence parallelism: always one padding-free row
            padding = padding_fraction(self.policy.forward, tokens, cfg.model.padding_free is True, split)
            acc.add({PERF_PADDING_FRAC: padding}, tokens.completion_mask.numel())
            minibatch_loss += loss.item()  # micro-batch losses add up to the minibatch's loss
            if entropy is not None and first:
                acc.add(
                    {POLICY_ENTROPY: masked_mean(entropy, tokens.completion_mask).item()},
                    tokens.completion_mask.sum().item(),
                )
        return minibatch_loss, ""

    # ------------------------------------------------------------------ eval, checkpoints
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (eval/) of the current weights, on rank 0 (the others: {}); the background sampler
        paused."""
        ev = self.cfg.eval
        held_out: Any = self.eval_data or []  # a PromptDataset
        if not self.world.is_main:  # rank 0 evaluates
            held_out = []
        rows = [held_out[i] for i in range(min(ev.max_samples or len(held_out), len(held_out)))]
        with self.pipeline.exclusive(self.policy.full) as engine:
            if not rows:
                return {}
            return evaluate(
                engine,
                rows,
                self.judge,
                k=ev.k,
                temperature=ev.temperature,
                max_tokens=self.cfg.rollout.max_completion_length,
                batch_size=ev.batch_size,
                seed=self.cfg.seed + 1234,
            )

    def save(self) -> Path:
        check_finite_weights(self.model, f"refusing to save step {self.step}")
        with self.signals.protecting(f"the save of step {self.step}"):  # a second Ctrl-C waits for the save
            return self.checkpointer.save(self.step)

    def maybe_resume(self) -> int | None:
        """Continue from the newest checkpoint in output_dir (checkpoint.Checkpointer.load): weights, moments,
        schedule, data position, generators, pi_ref (when reset), the critic; its step, or None."""
        found = self.checkpointer.load() if self.cfg.checkpoint.resume else None
        if found is None:
            return None
        resumed, self.step = found
        self.pipeline.publish(self.step, self.policy.full())
        return resumed

    # ------------------------------------------------------------------ the loop
    def train(self, *, on_log=None) -> dict[str, float]:
        """Steps up to optim.max_steps (from the newest checkpoint when there is one); the last step's
        metrics."""
        records = RunRecords(self.out, self.cfg, main=self.world.is_main, plot=plot_run)  # rank 0's duties
        try:
            with records.locked():  # one run per output_dir: a second one stops here, naming this one
                metrics = self._train(records, on_log)
                if self.interrupted is None:
                    records.plot()
        finally:
            self.close()  # the pipeline and its engine, also on an error (closing twice does nothing)
        return metrics

    def _train(self, records: RunRecords, on_log) -> dict[str, float]:
        cfg, resumed = self.cfg, self.maybe_resume()  # before config.yaml: a refused resume leaves the record
        records.write_config()
        saved_step = resumed  # the step of the newest checkpoint on disk: never written twice
        metrics: dict[str, float] = {}
        with records.open(self.step, resumed), self.signals.reporting(records.stopped) as stop:
            if resumed is None and cfg.eval.at_start and (ev := self.evaluate()):
                records.log(0, ev)
            while self.step < cfg.optim.max_steps:
                metrics, samples = self._step()
                records.log_step(self.step, metrics, samples)
                if on_log is not None:
                    on_log(self.step, metrics)
                self.health.check(self.step, metrics)  # stop_after_bad_steps bad steps in a row stop here
                if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                    self.save()
                    saved_step = self.step
                signal = self.world.signal_received(stop.received)  # any rank's: all save
                if signal and self.step < cfg.optim.max_steps:
                    path = checkpoint_dir(self.out, self.step)
                    if saved_step != self.step:
                        self.save()
                    records.print(
                        f"{signal}: saved step {self.step} to {path}; run the same command to resume"
                    )
                    self.interrupted = signal
                    return metrics
            if saved_step != self.step:
                self.save()  # the end state, so that running the command again finds the run finished
            records.save_final(self.policy.saved(), self.tokenizer)
        self.close()  # the engine's work is done
        return metrics

    def _step(self) -> tuple[dict[str, float], list[dict]]:
        """One GRPO step: rollout -> rewards -> advantages -> update -> sync pi_old (-> pi_ref reset,
        eval)."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch, metrics, samples = self.rollout()
        t1 = time.perf_counter()
        self.pipeline.idle()  # a colocated vLLM on GPU frees its memory for the update
        self.policy.release()  # FSDP2 with fast / hf: so does the engine's copy, until publish refills it
        metrics.update(self.update(batch))
        self.step += 1
        self.pipeline.publish(self.step, self.policy.full())  # pi_old <- pi_theta (FSDP2: the whole weights)
        alg = cfg.algorithm
        if alg.ref_policy == "reset" and self.ref is not None and self.step % alg.ref_reset_every == 0:
            self.policy.reset_reference()  # DeepSeekMath §4.1.4 iterative RL
        t2 = time.perf_counter()
        perf = perf_metrics(
            rollout_time=metrics[PERF_ROLLOUT_TIME],
            step_time=t2 - t0,
            train_time=t2 - t1,
            completion_tokens=batch.tokens.completion_mask.sum().item(),
            # prompt + completion tokens through forward and backward, once per pass (padding excluded)
            train_tokens=batch.tokens.attention_mask.sum().item() * alg.num_iterations,
            threads=torch.get_num_threads(),
        )
        metrics = self.world.reduce_metrics(metrics | perf)
        metrics.update(self.entropy.update(metrics))  # adaptive entropy control: the next step's c
        if (cfg.eval.every and self.step % cfg.eval.every == 0) or self.step == cfg.optim.max_steps:
            metrics.update(self.evaluate())
        return metrics, samples
