"""The metrics log's one reader and the pure functions that turn a step's tensors into the trainer's
metric dicts. The names themselves are in grpokit/metrics/names.py, which imports nothing; every name
there is importable from here too, so one import serves a module that needs both. docs/metrics.md defines
each name.

    from grpokit.metrics import compute as M
    rows = M.read_metrics("runs/x/metrics.jsonl")    # [{"step": 1, "time": 1.7e9, "reward/mean": 0.4, ...},
                                                     # ...]
    M.rollout_metrics(rewards, advantages, completion_mask, truncated, prompt_lengths, 8, prompts_truncated)
    acc = M.MeanAccumulator()
    acc.add({M.POLICY_KL: 0.01}, weight=37)          # weighted by the micro-batch's tokens
    acc.means()                                      # {"policy/kl": 0.01}

Nothing here imports torch at import time: the doctor and the plots use the names and the reader
without paying torch's import (~2 s).
"""

from __future__ import annotations

import json
import math
import os
import resource
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

# Every name, re-exported: grpokit.metrics.compute stays an import path for the names.
from grpokit.metrics.names import *  # noqa: F403 (re-export of every metric name)
from grpokit.metrics.names import (
    ADVANTAGE_ABS_MEAN,
    ADVANTAGE_MEAN,
    ADVANTAGE_RAW_MEAN,
    ADVANTAGE_RAW_STD,
    ADVANTAGE_STD,
    PERF_PEAK_RSS_MB,
    PERF_ROLLOUT_TOKENS_PER_S,
    PERF_STEP_TIME,
    PERF_THREADS,
    PERF_TRAIN_TIME,
    PERF_TRAIN_TOKENS_PER_S,
    REWARD_ERROR_FRAC,
    REWARD_ERRORS_PREFIX,
    REWARD_GROUP_STD_MEAN,
    REWARD_KL_SHAPING,
    REWARD_MEAN,
    REWARD_STD,
    REWARD_ZERO_STD_FRAC,
    ROLLOUT_COMPLETION_LEN_MAX,
    ROLLOUT_COMPLETION_LEN_MEAN,
    ROLLOUT_COMPLETION_LEN_MIN,
    ROLLOUT_PROMPT_LEN_MEAN,
    ROLLOUT_TOKENS,
    ROLLOUT_TRUNCATED_FRAC,
    ROLLOUT_TRUNCATED_PROMPTS,
    STEP,
    VALUE_EXPLAINED_VARIANCE,
    VALUE_MEAN,
    VALUE_RETURN_MEAN,
    reward_fn,
)

if TYPE_CHECKING:
    from torch import Tensor

    from grpokit.data.batch import RolloutBatch


# ---------------------------------------------------------------------------------------------
# Reading metrics.jsonl


def parse_record(line: str) -> dict[str, Any] | None:
    """One line of a metrics.jsonl or samples.jsonl as a dict, or None when the line is blank, does
    not parse (a line cut short by a crash) or is not a JSON object."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def record_step(record: Mapping[str, Any]) -> int | float | None:
    """The record's step when it is a finite number (not a bool), else None."""
    step = record.get(STEP)
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return None
    return step


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, in file order: null values are None; lines that are blank, do
    not parse or are not objects are skipped; a missing file gives []. Records without a numeric step
    are kept: record_step() tells them apart for the callers that need a step."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        return [record for record in map(parse_record, f) if record is not None]


def as_number(value: Any) -> float | None:
    """A metric value as a float (NaN and inf kept: a NaN loss should show as one), or None when it is
    not a number: None, a bool, a string, a list. Numpy scalars and 0-d tensors are numbers."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def no_learning_signal(record: Mapping[str, Any]) -> bool:
    """The step had no learning signal: every group's G rewards were equal (reward/zero_std_frac = 1), so
    every advantage was 0 (advantage/abs_mean = 0; PPO's critic and process rewards can still have some). The
    trainer's bad-step guard (grpokit/records/health.py) and the doctor both ask this."""
    return record.get(REWARD_ZERO_STD_FRAC) == 1.0 and record.get(ADVANTAGE_ABS_MEAN, 0.0) == 0.0


def failed_fractions(record: Mapping[str, Any]) -> dict[str, float]:
    """Reward function name -> the fraction of the step's scored completions it failed on (raised, timed out,
    returned a bad value), from reward/errors/<fn> and reward/error_frac (the largest); {} when none
    failed."""
    worst = as_number(record.get(REWARD_ERROR_FRAC))
    read = {
        k[len(REWARD_ERRORS_PREFIX) :]: as_number(v)
        for k, v in record.items()
        if k.startswith(REWARD_ERRORS_PREFIX)
    }
    counts = {name: c for name, c in read.items() if c is not None and c > 0}
    if not counts or worst is None or not worst > 0:  # NaN too
        return {}
    scored = (
        max(counts.values()) / worst
    )  # reward/error_frac is the largest count over the scored completions
    return {name: c / scored for name, c in counts.items()}


# ---------------------------------------------------------------------------------------------
# The trainer's metric dicts, as pure functions of the step's tensors


class MeanAccumulator:
    """Weighted means of metric dicts over the micro-batches of a step."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float = 1.0) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * weight
            self.weights[k] = self.weights.get(k, 0.0) + weight

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}

    @staticmethod
    def merge(parts: list[tuple[dict[str, float], dict[str, float]]]) -> MeanAccumulator:
        """One accumulator from several (sums, weights): every rank's micro-batches
        (grpokit/distributed/)."""
        out = MeanAccumulator()
        for sums, weights in parts:
            for k, v in sums.items():
                out.sums[k] = out.sums.get(k, 0.0) + v
                out.weights[k] = out.weights.get(k, 0.0) + weights[k]
        return out


def rollout_metrics(
    rewards: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    truncated: Tensor,
    prompt_lengths: list[int],
    group_size: int,
    prompts_truncated: list[bool],
) -> dict[str, float]:
    """reward/, advantage/ and rollout/ statistics of one rollout batch (docs/metrics.md).

    rewards: [N] weighted totals, groups of group_size contiguous. advantages: [N], or [N, T] per token
    (process rewards; then over the completion tokens). completion_mask: [N, T]. truncated: [N] bool.
    prompt_lengths: [B] tokens of each prompt after the chat template. prompts_truncated: [B] which prompts
    data.overlong_prompts=truncate cut to data.max_prompt_length tokens."""
    grouped = rewards.view(-1, group_size)  # [B, G]
    lengths = completion_mask.sum(-1).float()  # [N]
    adv = advantages if advantages.dim() == 1 else advantages[completion_mask.bool()]
    return {
        REWARD_MEAN: rewards.mean().item(),
        REWARD_STD: rewards.std(correction=0).item(),
        REWARD_ZERO_STD_FRAC: (grouped.amax(1) == grouped.amin(1)).float().mean().item(),
        REWARD_GROUP_STD_MEAN: grouped.std(1, correction=0).mean().item(),
        ADVANTAGE_MEAN: adv.mean().item(),
        ADVANTAGE_STD: adv.std(correction=0).item(),
        ADVANTAGE_ABS_MEAN: adv.abs().mean().item(),
        ROLLOUT_COMPLETION_LEN_MEAN: lengths.mean().item(),
        ROLLOUT_COMPLETION_LEN_MIN: lengths.min().item(),
        ROLLOUT_COMPLETION_LEN_MAX: lengths.max().item(),
        ROLLOUT_TRUNCATED_FRAC: truncated.float().mean().item(),
        ROLLOUT_PROMPT_LEN_MEAN: float(np.mean(prompt_lengths)),
        ROLLOUT_TOKENS: lengths.sum().item(),
        ROLLOUT_TRUNCATED_PROMPTS: float(sum(prompts_truncated)),
    }


def perf_metrics(
    *,
    rollout_time: float,
    step_time: float,
    train_time: float,
    completion_tokens: float,
    train_tokens: float,
    threads: int,
) -> dict[str, float]:
    """perf/ throughput of one step. completion_tokens: generated (the completion mask's sum);
    train_tokens: prompt + completion tokens through forward and backward, counted once per pass;
    threads: torch's CPU thread count (grpokit/config/threads.py)."""
    return {
        PERF_STEP_TIME: step_time,
        PERF_TRAIN_TIME: train_time,
        PERF_ROLLOUT_TOKENS_PER_S: completion_tokens / max(rollout_time, 1e-9),
        PERF_TRAIN_TOKENS_PER_S: train_tokens / max(train_time, 1e-9),
        # ru_maxrss is in KiB on Linux: a high-water mark, it never decreases.
        PERF_PEAK_RSS_MB: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        PERF_THREADS: float(threads),
    }


def critic_metrics(
    white: Tensor,
    raw: Tensor,
    values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    completion_mask: Tensor,
    token_rewards: Tensor,
    rewards: Tensor,
) -> dict[str, float]:
    """PPO's advantage/, value/ and reward/kl_shaping at rollout time (docs/ppo.md, "Metrics").

    white, raw: [N, T] GAE advantages after / before whitening, over the loss tokens (loss_mask [N, T]).
    values (V_old), returns: [N, T], over the completion tokens (completion_mask [N, T]).
    token_rewards: [N, T] the shaped per-token rewards; rewards: [N] the sequence rewards."""
    from grpokit.algo import explained_variance, masked_mean  # torch: only when a PPO step asks

    lm, mask = loss_mask, completion_mask
    return {
        ADVANTAGE_MEAN: masked_mean(white, lm).item(),
        ADVANTAGE_STD: masked_mean((white - masked_mean(white, lm)) ** 2, lm).sqrt().item(),
        ADVANTAGE_ABS_MEAN: masked_mean(white.abs(), lm).item(),
        ADVANTAGE_RAW_MEAN: masked_mean(raw, lm).item(),
        ADVANTAGE_RAW_STD: masked_mean((raw - masked_mean(raw, lm)) ** 2, lm).sqrt().item(),
        VALUE_MEAN: masked_mean(values, mask).item(),
        VALUE_RETURN_MEAN: masked_mean(returns, mask).item(),
        VALUE_EXPLAINED_VARIANCE: explained_variance(values, returns, mask),
        # The shaped return minus the score: the KL part (a completion with no tokens gets no score).
        REWARD_KL_SHAPING: (token_rewards.sum(-1) - rewards * (mask.sum(-1) > 0)).mean().item(),
    }


def sample_records(
    prompt_texts: list[str],
    completion_texts: list[str],
    batch: RolloutBatch,
    per_function: Mapping[str, Tensor],
    group_size: int,
    k: int,
) -> list[dict]:
    """The samples a step records: every completion of the first k prompts (whole groups, so that an
    advantage can be read against its group's rewards), prompt-major. completion_texts: [B * group_size].

    Each: prompt, completion, group (the prompt's index in the step), reward (the weighted total),
    reward/<fn> (each function's raw reward, None where it did not apply or failed), advantage (per-token
    advantages, from process rewards or GAE: their mean over the completion's tokens), prompt_len and
    completion_len (tokens), truncated (stopped at rollout.max_completion_length)."""
    lengths = batch.tokens.completion_mask.sum(-1)  # [N]
    prompt_lengths = batch.tokens.attention_mask.sum(-1) - lengths  # [N]
    advantages = batch.advantages  # [N], or [N, T] per token
    if advantages.dim() == 2:
        mask = batch.tokens.completion_mask[:, : advantages.shape[1]].to(advantages.dtype)  # [N, T]
        advantages = (advantages * mask).sum(-1) / mask.sum(-1).clamp_min(1)  # [N]
    records = []
    for i in range(min(k, len(prompt_texts)) * group_size):
        fn_rewards = {reward_fn(name): r[i].item() for name, r in per_function.items()}
        records.append(
            {
                "prompt": prompt_texts[i // group_size],
                "completion": completion_texts[i],
                "group": i // group_size,
                "reward": batch.rewards[i].item(),
                **{name: (None if math.isnan(x) else x) for name, x in fn_rewards.items()},
                "advantage": advantages[i].item(),
                "prompt_len": int(prompt_lengths[i]),
                "completion_len": int(lengths[i]),
                "truncated": bool(batch.truncated[i]),
            }
        )
    return records
