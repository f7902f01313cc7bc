"""The GRPO loop. Run it with `grpokit train config.yaml [key=value ...]`.

One step, as in DeepSeekMath Algorithm 1 (iterative GRPO), each stage a call into the module that owns it:
    sample prompts (data) -> G completions each from pi_old (rollout/) -> rewards (rewards/)
    -> advantages (algo/: group baseline; or the critic's GAE, critic.py) -> mu passes of minibatch
    updates on the clipped surrogate minus beta * KL(pi_theta || pi_ref) (algo/losses, optim.py)
    -> sync pi_old -> log (metrics.py, records/) -> eval / checkpoint (evaluate.py, checkpoint.py).

Departures from the textbook, each a config switch: the loss normalization (algorithm.loss_type), clip-higher
(epsilon_high), sequence-level ratios (GSPO), the advantage scale (Dr. GRPO), masking truncated completions (DAPO).
Process supervision (DeepSeekMath §4.1.3) needs no switch: when a reward function returns StepScores, the
advantages are per token. docs/algorithm.md has the formulas. Under torchrun every rank runs this loop on its
share of the prompts; distributed.py wraps the model (FSDP2 / DDP) and makes whole-batch quantities global.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import yaml
from torch import Tensor

from grpokit.algo import masked_mean
from grpokit.algorithm import (
    algorithm_loss,
    dynamic_sampling,
    make_loss_mask,
    outcome_advantages,
    process_advantages,
)
from grpokit.batch import Groups, RolloutBatch, micro_batches, pack_sequences, process_rewards, repeat_rows
from grpokit.checkpoint import RunLock, checkpoint_dir, resume, save_final, seed_everything
from grpokit.config import Config
from grpokit.critic import Critic
from grpokit.data import PromptSampler, build_datasets, check_context_length
from grpokit.distributed import World
from grpokit.evaluate import evaluate, make_judge
from grpokit.health import StepHealth
from grpokit.metrics import (
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
from grpokit.optim import Optimizer, TrainingError, check_finite_weights, non_finite
from grpokit.policy import batched_logprobs, build_reference, completion_logprobs, load_policy
from grpokit.records import MetricLogger, TrainProgress, plot_run
from grpokit.rewards import RewardError, build_rewards
from grpokit.rollout import SamplerCorrection, make_engine, sampler_logprobs, with_tools
from grpokit.rollout.pipeline import RolloutPipeline, lag_metrics
from grpokit.tasks import reward_registry


class Trainer:
    def __init__(self, cfg: Config, *, model=None, tokenizer=None, train_rows=None, eval_rows=None):
        self.cfg, self.out, alg = cfg, Path(cfg.output_dir), cfg.algorithm
        if (
            cfg.threads
        ):  # the command line also resolves threads=0 (auto); the Python API leaves torch's setting alone
            torch.set_num_threads(cfg.threads)
        self.world = World.from_env(cfg)  # torchrun's ranks (distributed.py); one process without it
        seed_everything(cfg.seed + self.world.rank)  # each rank samples its own completions
        model, self.tokenizer = (model, tokenizer) if model is not None else load_policy(cfg.model)
        self.ref = build_reference(
            model, alg
        )  # pi_ref: the policy as loaded, before any resume replaces the weights
        # The trained module, what the log-prob passes call (FSDP2 / DDP under torchrun; compiled when model.compile is set), the engine's.
        self.model, policy_fn, rollout_model = self.world.wrap(model, self.ref)
        if (
            cfg.model.compile
        ):  # several graphs of one forward (rollout, pi_ref, training); dynamo's default limit is 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        self.policy_fn = torch.compile(policy_fn) if cfg.model.compile else policy_fn
        self.ref_fn = torch.compile(self.ref) if cfg.model.compile and self.ref is not None else self.ref

        data = build_datasets(
            cfg.data, self.tokenizer, seed=cfg.seed, train_rows=train_rows, eval_rows=eval_rows
        )
        self.train_data, self.eval_data = data.train, data.eval
        self.sampler = PromptSampler(
            len(self.train_data), cfg.rollout.prompts_per_step, cfg.seed, shuffle=cfg.data.shuffle
        )
        self.rewards = build_rewards(
            cfg, self.train_data.column_names, registry=reward_registry(), task=data.task
        )
        self.judge = make_judge(
            self.rewards, reward_name=cfg.eval.reward, threshold=cfg.eval.correct_threshold
        )
        self.health, self.correction = (
            StepHealth(cfg),
            SamplerCorrection(cfg.rollout),
        )  # bad steps; sampler-trainer mismatch
        check_context_length(data, getattr(model, "config", None), cfg.rollout.max_completion_length)

        engine = with_tools(
            make_engine(
                cfg.rollout.engine,
                rollout_model,
                self.tokenizer,
                batch_size=cfg.rollout.generation_batch_size,
                compile=cfg.model.compile,
                rollout=cfg.rollout,
            ),
            cfg,
            self.tokenizer,
        )
        # The engine plays pi_old: synchronous, or rollout.max_policy_lag steps ahead in a background thread.
        self.pipeline = RolloutPipeline(
            engine,
            cfg.rollout,
            max_lag=cfg.rollout.max_policy_lag,
            version=0,
            model=rollout_model,
            seed=cfg.seed + self.world.rank,
        )
        self._drawn: dict[int, dict] = {}  # batch -> the prompt sampler's state before its prompts were drawn
        total = cfg.optim.max_steps * alg.num_iterations * cfg.optim.num_minibatches
        self.optimizer = Optimizer(
            model.named_parameters(), cfg.optim, lr=cfg.optim.learning_rate, total_steps=total
        )
        self.critic = (
            Critic(cfg, model, has_ref=self.ref is not None, total_steps=total)
            if alg.advantage_estimator == "gae"
            else None
        )
        self.loss_beta = 0.0 if self.critic is not None and self.critic.shapes_kl_into_reward else alg.beta
        self.step = 0
        self.signals = (
            self.world.stop_signals()
        )  # SIGTERM / SIGINT during train(): finish the step, save, stop
        self.interrupted: str | None = None  # the signal (SIGTERM / SIGINT) that made train() stop early

    # ------------------------------------------------------------------ rollout -> rewards -> advantages
    def _draw(self, b: int | None = None) -> list:
        """The rows of the next prompts (of batch b for the pipeline; dynamic sampling's further rounds: None)."""
        if b is not None:
            self._drawn = {i: s for i, s in self._drawn.items() if i >= self.step} | {
                b: self.sampler.state_dict()
            }
        return [self.train_data[i] for i in self.world.share(self.sampler.next())]

    def _score(self, rows, comps, timings: dict[str, float]) -> Groups:
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
        except RewardError as exc:  # reward_errors=raise, or a timeout with reward_on_timeout / on_timeout=raise (its message says so)
            raise TrainingError(
                f"step {self.step + 1}: {exc}"
                + (
                    " (reward_errors=raise; reward_errors=skip counts it and goes on)"
                    if self.cfg.reward_errors == "raise"
                    else ""
                )
            ) from exc
        timings[PERF_REWARD_TIME] = timings.get(PERF_REWARD_TIME, 0.0) + time.perf_counter() - t
        return Groups(list(rows), comps, scored)

    def rollout(self, rows=None) -> tuple[RolloutBatch, dict[str, float], list]:
        """This step's batch from the pipeline (or completions of `rows` now), scored, with advantages and log-probs."""
        cfg, alg, G = self.cfg, self.cfg.algorithm, self.cfg.rollout.num_generations
        metrics: dict[str, float] = {}
        rows, comps, metrics = (
            self.pipeline.batch(self.step, self._draw, cfg.optim.max_steps)
            if rows is None
            else (rows, self.pipeline.extra(rows, metrics), metrics)
        )
        groups = self._score(rows, comps, metrics)
        if alg.dynamic_sampling:
            more = lambda: self._score(new := self._draw(), self.pipeline.extra(new, metrics), metrics)  # noqa: E731
            groups, sampling_metrics = dynamic_sampling(
                groups, more, len(rows), G, alg.max_sampling_rounds, self.world
            )
            metrics.update(sampling_metrics)
        rows, comps, scored = groups.rows, groups.comps, groups.scored
        rewards = scored.total.float()  # [N]
        tokens = pack_sequences(
            [r.prompt_ids for r in rows for _ in range(G)], comps.token_ids, self.tokenizer.pad_token_id
        )
        truncated = torch.tensor(comps.truncated, dtype=torch.bool)  # [N]
        loss_mask = make_loss_mask(
            alg, tokens.completion_mask, truncated, comps.model_mask
        )  # [N, T]; tool results: 0

        t, sampler_logp = time.perf_counter(), sampler_logprobs(comps, tokens)  # [N, T] or None (hf)
        # pi_old differs from pi_theta after an optimizer step inside this batch's updates, and with rollout.max_policy_lag: then
        # it is the sampler's log-probs, or (importance_correction on) ours, the ratio's anchor, corrected by pi_old / pi_sampler.
        lagged, correct = cfg.rollout.max_policy_lag > 0, cfg.rollout.importance_correction != "none"
        need_old = alg.num_iterations > 1 or cfg.optim.num_minibatches > 1 or (lagged and correct)
        logprobs = lambda model: batched_logprobs(
            model,
            tokens,
            micro_batch_size=cfg.micro_batch_size,
            temperature=cfg.rollout.temperature,  # noqa: E731
            by_length=cfg.optim.group_by_length,
        )
        old_logp = (
            sampler_logp if lagged and not correct else logprobs(self.policy_fn) if need_old else None
        )  # [N, T]
        ref_logp = logprobs(self.ref_fn) if self.ref is not None else None  # [N, T]
        needs_kl_old = (
            old_logp is None and self.critic is not None and self.critic.kl_coef
        )  # PPO's KL shaping, at mu = 1 too
        kl_old = logprobs(self.model) if needs_kl_old else old_logp
        metrics[PERF_REF_TIME] = time.perf_counter() - t

        value_targets, critic_metrics = None, {}
        if self.critic is not None:  # PPO: whitened GAE from the critic's values [N, T]
            advantages, value_targets, critic_metrics = self.critic.advantages(
                rewards, tokens, loss_mask, old_logp=kl_old, ref_logp=ref_logp
            )
        elif scored.steps:  # process rewards: one advantage per token (DeepSeekMath §4.1.3)
            step_rewards, step_ends = process_rewards(scored, comps.texts, comps.token_ids, self.tokenizer)
            advantages = process_advantages(
                alg, step_rewards, step_ends, G, tokens.completion_width
            )  # [N, T]
        else:
            advantages = outcome_advantages(
                alg, rewards, G, self.world
            )  # [N]; a batch std over every rank's rewards

        batch = RolloutBatch(
            tokens, loss_mask, truncated, rewards, advantages, old_logp, ref_logp, value_targets, sampler_logp
        )
        metrics.update(
            {k: v for k, v in self.world.scores(scored).metrics().items() if not k.startswith(REWARD_TOTAL)}
        )  # every rank's rows
        metrics.update(
            rollout_metrics(
                *self.world.cat_rows(
                    rewards,
                    advantages,
                    tokens.completion_mask,
                    truncated,
                    [len(r.prompt_ids) for r in rows],
                    G,
                    [r.truncated for r in rows],
                )
            )
        )
        metrics.update(
            critic_metrics | lag_metrics(comps, self.step)
        )  # rollout/version_lag: 0 unless rollout.max_policy_lag
        return (
            batch,
            metrics,
            sample_records(
                [r.prompt_text for r in rows],
                comps.texts,
                batch,
                scored.per_function,
                G,
                cfg.logging.num_samples,
            ),
        )

    # ------------------------------------------------------------------ policy update (and the critic's)
    def update(self, b: RolloutBatch) -> dict[str, float]:
        """mu passes of minibatch updates of the policy on this batch (then the critic's, for PPO)."""
        bad = [
            (name, p)
            for name, x in (("weighted total reward", b.rewards), ("advantage", b.advantages))
            if (p := non_finite(x, b.rewards.numel()))
        ]
        if not self.world.all(
            not bad
        ):  # e.g. weighted rewards that overflow float32 (on any rank): skip every optimizer step of this batch
            for _ in range(self.cfg.algorithm.num_iterations * self.cfg.optim.num_minibatches):
                self.optimizer.skip(
                    *(bad[0] if bad else ("weighted total reward or advantage", "on another rank")),
                    self.step + 1,
                )
            stats = {POLICY_SKIPPED_UPDATES: float(self.optimizer.skipped)}
        else:
            stats = self._policy_passes(b)
        if self.critic is not None:
            stats.update(self.critic.update(b.tokens, b.loss_mask, b.value_targets, at_step=self.step + 1))
        return stats

    def _policy_passes(self, b: RolloutBatch) -> dict[str, float]:
        cfg, M, acc = self.cfg, self.cfg.optim.num_minibatches, MeanAccumulator()
        b = (
            self.world.gather_batch(b, self.tokenizer.pad_token_id) if M > 1 else b
        )  # minibatches mix every rank's rows
        for it in range(cfg.algorithm.num_iterations):
            # A fresh minibatch split each pass (this rank's share of each); a single minibatch needs no shuffle.
            for m, idx in enumerate(self.world.minibatches(b.rewards.numel(), M)):
                self.optimizer.zero_grad()
                loss, why = self._accumulate_gradient(b, idx, first_pass=it == 0, acc=acc)
                done = self.optimizer.step(
                    loss_finite=loss is not None,
                    where=f"pass {it + 1}, minibatch {m + 1}{why}",
                    at_step=self.step + 1,
                )
                if done is not None:
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
        # Normalizers of the whole minibatch, over every rank's share: accumulation and ranks give the same gradient.
        cfg, (num_sequences, num_tokens) = self.cfg, self.world.sum(len(idx), b.loss_mask[idx].sum().item())
        minibatch_loss = 0.0
        for sub_idx in micro_batches(idx, b.tokens, cfg.micro_batch_size, cfg.optim.group_by_length):
            tokens = b.tokens.rows(sub_idx)  # trimmed to this micro-batch's longest completion
            T = tokens.completion_width
            logp, entropy = completion_logprobs(
                self.policy_fn, tokens, temperature=cfg.rollout.temperature, with_entropy=first_pass
            )
            mask = b.loss_mask[sub_idx, :T]
            loss, stats = algorithm_loss(
                cfg.algorithm,
                logp,
                b.old_logp[sub_idx, :T] if b.old_logp is not None else logp.detach(),
                b.advantages[sub_idx] if b.advantages.dim() == 1 else b.advantages[sub_idx, :T],
                mask,
                ref_logp=b.ref_logp[sub_idx, :T] if b.ref_logp is not None else None,
                beta=self.loss_beta,
                num_tokens=num_tokens,
                max_completion_length=cfg.rollout.max_completion_length,
                num_sequences=num_sequences,
                is_weights=self.correction(b, sub_idx, logp, mask, acc, first_pass),
            )
            if not self.world.all_finite(loss):  # every rank skips together
                bad_logp = not torch.isfinite(logp.detach()[mask.bool()]).all()
                return None, ": the policy's log-probs were non-finite" if bad_logp else ""
            self.world.backward(loss)
            acc.add({policy_name(k): v for k, v in stats.items()}, mask.sum().item())
            acc.add(
                {PERF_PADDING_FRAC: 1 - tokens.completion_mask.float().mean().item()},
                tokens.completion_mask.numel(),
            )
            minibatch_loss += loss.item()  # micro-batch losses add up to the minibatch's loss
            if entropy is not None:
                acc.add(
                    {POLICY_ENTROPY: masked_mean(entropy, tokens.completion_mask).item()},
                    tokens.completion_mask.sum().item(),
                )
        return minibatch_loss, ""

    # ------------------------------------------------------------------ eval, checkpoints
    def evaluate(self) -> dict[str, float]:
        ev, held_out = self.cfg.eval, (self.eval_data or []) if self.world.is_main else []  # rank 0 evaluates
        rows = [held_out[i] for i in range(min(ev.max_samples or len(held_out), len(held_out)))]
        with self.pipeline.exclusive(
            self.world.full_model
        ) as engine:  # the current weights, the background sampler paused
            return (
                evaluate(
                    engine,
                    rows,
                    self.judge,
                    k=ev.k,
                    temperature=ev.temperature,
                    max_tokens=self.cfg.rollout.max_completion_length,
                    batch_size=ev.batch_size,
                    seed=self.cfg.seed + 1234,
                )
                if rows
                else {}
            )

    def state_dict(self) -> dict:
        # The prompts of batches generated ahead (rollout.max_policy_lag) are drawn again after a resume.
        state = {
            **self.optimizer.state_dict(),
            "sampler": self._drawn.get(self.step, self.sampler.state_dict()),
            "config": self.cfg.model_dump(),
        }
        if self.cfg.algorithm.ref_policy == "reset" and self.ref is not None:
            state["ref_model"] = self.ref.state_dict()  # no longer the initial weights
        return {**state, **(self.critic.state_dict() if self.critic is not None else {})}

    def save(self) -> Path:
        check_finite_weights(self.model, f"refusing to save step {self.step}")
        with self.signals.protecting(f"the save of step {self.step}"):  # a second Ctrl-C waits for the save
            return self.world.save_checkpoint(
                self.out,
                self.step,
                self.model,
                self.optimizer.adamw,
                self.tokenizer,
                self.state_dict(),
                self.cfg.checkpoint.keep_last,
            )

    def maybe_resume(self) -> int | None:
        """Continue from the newest checkpoint in output_dir (checkpoint.resume): weights, optimizer, schedule,
        data position, RNGs, pi_ref (when reset) and the critic. Returns its step, or None."""
        load = lambda path, state: self.world.load_checkpoint(
            path, state, model=self.model, adamw=self.optimizer.adamw, seed=self.cfg.seed
        )  # noqa: E731
        if (
            found := resume(
                self.out, self.model, self.cfg.model_dump(), self.cfg.checkpoint.allow_changes, load
            )
            if self.cfg.checkpoint.resume
            else None
        ) is None:
            return None
        step, state, _ = found  # resume printed the changes that checkpoint.allow_changes let through
        self.optimizer.load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        if "ref_model" in state and self.ref is not None:
            self.ref.load_state_dict(state["ref_model"])
        if self.critic is not None:
            self.critic.load_state_dict(state, str(checkpoint_dir(self.out, step)))
        self.step = state["step"]
        self.pipeline.publish(self.step, self.world.full_model())
        return step

    # ------------------------------------------------------------------ the loop
    def train(self, *, on_log=None) -> dict[str, float]:
        with self.world.on_main(
            RunLock, self.out
        ):  # one run per output_dir: a second one stops here, naming this one
            return self._train(on_log)

    def _train(self, on_log) -> dict[str, float]:
        cfg, resumed = (
            self.cfg,
            self.maybe_resume(),
        )  # before config.yaml: a refused resume leaves the run's record as it was
        self.world.on_main(
            (self.out / "config.yaml").write_text, yaml.safe_dump(cfg.model_dump(), sort_keys=False)
        )  # rank 0 writes files
        saved_step = resumed  # the step of the newest checkpoint on disk: never written twice
        log = self.world.on_main(MetricLogger, self.out, **cfg.logging.trackers(), config=cfg.model_dump())
        metrics: dict[str, float] = {}
        try:
            with (
                self.signals as stop,
                self.world.on_main(TrainProgress, cfg.optim.max_steps, start_step=self.step) as prog,
            ):
                log.truncate_after(
                    self.step if resumed is not None else -1
                )  # a fresh run never appends to an old log
                if resumed is not None:
                    prog.print(f"resuming from checkpoint step {resumed} in {self.out / 'checkpoints'}")
                elif cfg.eval.at_start and (ev := self.evaluate()):
                    log.log(0, ev)
                    prog.update(0, ev)
                while self.step < cfg.optim.max_steps:
                    metrics, samples = self._step()
                    log.log_step(
                        self.step,
                        metrics,
                        samples,
                        last=self.step == cfg.optim.max_steps,
                        every=cfg.logging.log_every,
                        samples_every=cfg.logging.sample_every,
                    )
                    prog.update(self.step, metrics)
                    if on_log is not None:
                        on_log(self.step, metrics)
                    self.health.check(
                        self.step, metrics
                    )  # stop_after_bad_steps bad steps in a row stop here, before a save
                    if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                        self.save()
                        saved_step = self.step
                    if (
                        signal := self.world.signal_received(stop.received)
                    ) and self.step < cfg.optim.max_steps:  # any rank's: all save
                        path = self.save() if saved_step != self.step else checkpoint_dir(self.out, self.step)
                        prog.print(
                            f"{signal}: saved step {self.step} to {path}; run the same command to resume"
                        )
                        self.interrupted = signal
                        return metrics
                if saved_step != self.step:
                    self.save()  # the end state, so that running the command again finds the run finished
                self.world.on_main(
                    save_final,
                    self.world.full_model(),
                    self.tokenizer,
                    self.out / "final",
                    merge=bool(cfg.model.lora and cfg.model.lora.merge_on_save),
                )
        finally:
            log.close()
            self.pipeline.close()
        self.world.on_main(plot_run, self.out)
        return metrics

    def _step(self) -> tuple[dict[str, float], list[dict]]:
        """One GRPO step: rollout -> rewards -> advantages -> update -> sync pi_old (-> pi_ref reset, eval)."""
        cfg, t0 = self.cfg, time.perf_counter()
        batch, metrics, samples = self.rollout()
        t1 = time.perf_counter()
        self.pipeline.idle()  # a colocated vLLM on GPU frees its memory for the update
        metrics.update(self.update(batch))
        self.step += 1
        self.pipeline.publish(
            self.step, self.world.full_model()
        )  # pi_old <- pi_theta (FSDP2: the whole weights)
        if (
            cfg.algorithm.ref_policy == "reset"
            and self.ref is not None
            and self.step % cfg.algorithm.ref_reset_every == 0
        ):
            self.world.reset_reference()  # DeepSeekMath §4.1.4 iterative RL
        t2 = time.perf_counter()
        metrics = self.world.reduce_metrics(
            metrics
            | perf_metrics(
                rollout_time=metrics[PERF_ROLLOUT_TIME],
                step_time=t2 - t0,
                train_time=t2 - t1,
                completion_tokens=batch.tokens.completion_mask.sum().item(),
                # prompt + completion tokens through forward and backward, once per pass (padding excluded)
                train_tokens=batch.tokens.attention_mask.sum().item() * cfg.algorithm.num_iterations,
                threads=torch.get_num_threads(),
            )
        )
        if (cfg.eval.every and self.step % cfg.eval.every == 0) or self.step == cfg.optim.max_steps:
            metrics.update(self.evaluate())
        return metrics, samples
