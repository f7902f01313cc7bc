"""Every metric name grpokit logs, the metrics log's file names and its one reader, and the pure
functions that turn a step's tensors into the trainer's metric dicts. docs/metrics.md defines each name.

    from grpokit import metrics as M
    rows = M.read_metrics("runs/x/metrics.jsonl")    # [{"step": 1, "time": 1.7e9, "reward/mean": 0.4, ...},
                                                     # ...]
    M.rollout_metrics(rewards, advantages, completion_mask, truncated, prompt_lengths, 8, prompts_truncated)
    acc = M.MeanAccumulator()
    acc.add({M.POLICY_KL: 0.01}, weight=37)          # weighted by the micro-batch's tokens
    acc.means()                                      # {"policy/kl": 0.01}

Names are namespaced: reward/ (what the reward functions said), advantage/ (what the loss was fed),
policy/ (the update), value/ (PPO's critic), rollout/ (what was generated), perf/ (time and memory),
eval/ (held-out evaluation). A name with a part chosen at run time (a reward function's name, a key
of a loss's metrics, eval's k) comes from a builder below (reward_fn("correct") -> "reward/correct");
every other name is a constant.

Nothing here imports torch or another grpokit module at import time: the doctor and the plots use
the names and the reader without paying torch's import (~2 s).
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

if TYPE_CHECKING:
    from torch import Tensor

    from grpokit.batch import RolloutBatch

# ---------------------------------------------------------------------------------------------
# Files and the record's own fields

METRICS_FILE = "metrics.jsonl"  # one record per logged step: {"step", "time", **metrics}
SAMPLES_FILE = "samples.jsonl"  # one record per recorded sample completion: {"step", **sample}
COMPLETIONS_FILE = "completions.parquet"  # the same records as a table (grpokit/records/table.py)
STEP = "step"  # the record's step (an int; 0 = before training)
TIME = "time"  # Unix seconds when the record was written
RECORD_FIELDS = (STEP, TIME)  # reserved: no metric may take these names

# ---------------------------------------------------------------------------------------------
# Namespaces (plots pick their metrics by prefix)

REWARD_PREFIX = "reward/"
ADVANTAGE_PREFIX = "advantage/"
POLICY_PREFIX = "policy/"
VALUE_PREFIX = "value/"
ROLLOUT_PREFIX = "rollout/"
PERF_PREFIX = "perf/"
EVAL_PREFIX = "eval/"
SFT_PREFIX = "sft/"

# ---------------------------------------------------------------------------------------------
# reward/: the trainer's statistics of the weighted total, and RewardOutput.metrics()'s names

REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
REWARD_ZERO_STD_FRAC = "reward/zero_std_frac"
REWARD_GROUP_STD_MEAN = "reward/group_std_mean"
REWARD_NONE_FRAC = "reward/none_frac"
REWARD_KL_SHAPING = "reward/kl_shaping"  # PPO with the KL in the reward
# RewardOutput.metrics() reports the total as reward/total and reward/total/std; the trainer drops
# both (reward/mean and reward/std are the same statistics over the same batch).
REWARD_TOTAL = "reward/total"
REWARD_TOTAL_STD = "reward/total/std"
REWARD_ERRORS_PREFIX = "reward/errors/"
REWARD_TIMEOUTS_PREFIX = "reward/timeouts/"
REWARD_ERROR_FRAC = (
    "reward/error_frac"  # the largest fraction of the step's completions one function failed on
)
REWARD_SKIPPED_FRAC = (
    "reward/skipped_frac"  # completions whose group a timed-out call dropped (on_timeout=skip_group)
)


def reward_fn(name: str) -> str:
    """reward/<name>: nanmean of one reward function's raw values."""
    return f"{REWARD_PREFIX}{name}"


def reward_fn_std(name: str) -> str:
    """reward/<name>/std: their sample std."""
    return f"{REWARD_PREFIX}{name}/std"


def reward_fn_steps(name: str) -> str:
    """reward/<name>/steps: mean number of steps of the function's StepScores."""
    return f"{REWARD_PREFIX}{name}/steps"


def reward_errors(name: str) -> str:
    """reward/errors/<name>: completions for which the function raised or returned a bad value."""
    return f"{REWARD_ERRORS_PREFIX}{name}"


def reward_timeouts(name: str) -> str:
    """reward/timeouts/<name>: calls of the function that timed out (or found it still busy with one that
    had)."""
    return f"{REWARD_TIMEOUTS_PREFIX}{name}"


#: reward/ names that are not reward/<fn> of a reward function: statistics of the total, and the
#: reward/errors/ and reward/timeouts/ families.
REWARD_STATISTICS = (
    REWARD_MEAN,
    REWARD_STD,
    REWARD_ZERO_STD_FRAC,
    REWARD_GROUP_STD_MEAN,
    REWARD_NONE_FRAC,
    REWARD_KL_SHAPING,
    REWARD_TOTAL,
    REWARD_TOTAL_STD,
    REWARD_ERRORS_PREFIX,
    REWARD_TIMEOUTS_PREFIX,
    REWARD_ERROR_FRAC,
    REWARD_SKIPPED_FRAC,
)

RESERVED_REWARD_NAMES = frozenset(name.split("/")[1] for name in REWARD_STATISTICS)
"""Names a reward function may not be given: the first part after reward/ of each name in
REWARD_STATISTICS. A function named "std" would log reward/std, "total" reward/total/std, "errors"
names under reward/errors/: one value would silently overwrite the other in the step's metrics.
Other names are free, "steps" included (reward/steps is nobody else's; reward/<fn>/steps has a
second part)."""

# ---------------------------------------------------------------------------------------------
# advantage/: what the loss was fed (PPO: of the whitened GAE advantages; raw_*: before whitening)

ADVANTAGE_MEAN = "advantage/mean"
ADVANTAGE_STD = "advantage/std"
ADVANTAGE_ABS_MEAN = "advantage/abs_mean"
ADVANTAGE_RAW_MEAN = "advantage/raw_mean"
ADVANTAGE_RAW_STD = "advantage/raw_std"

# ---------------------------------------------------------------------------------------------
# policy/: the update. The first six are policy/<key> for the keys of grpokit.algo.policy_loss's metrics.

POLICY_CLIP_FRAC = "policy/clip_frac"
POLICY_CLIP_FRAC_LOW = "policy/clip_frac_low"
POLICY_CLIP_FRAC_HIGH = "policy/clip_frac_high"
POLICY_RATIO_MEAN = "policy/ratio_mean"
POLICY_KL = "policy/kl"
POLICY_TOKEN_LOSS = "policy/token_loss"
POLICY_ENTROPY = "policy/entropy"
POLICY_LOSS = "policy/loss"
POLICY_GRAD_NORM = "policy/grad_norm"
POLICY_LR = "policy/lr"
POLICY_SKIPPED_UPDATES = "policy/skipped_updates"


def policy_name(key: str) -> str:
    """policy/<key> for a key of policy_loss's metrics (clip_frac, kl, ...)."""
    return f"{POLICY_PREFIX}{key}"


# ---------------------------------------------------------------------------------------------
# value/: PPO's critic. The first three are value/<key> for the keys of grpokit.algo.value_loss's metrics.

VALUE_LOSS = "value/loss"
VALUE_CLIP_FRAC = "value/clip_frac"
VALUE_MEAN = "value/mean"
VALUE_NEW_MEAN = "value/new_mean"  # V during the critic's update (value_loss); value/mean is V_old
VALUE_RETURN_MEAN = "value/return_mean"
VALUE_EXPLAINED_VARIANCE = "value/explained_variance"
VALUE_GRAD_NORM = "value/grad_norm"
VALUE_LR = "value/lr"
VALUE_SKIPPED_UPDATES = "value/skipped_updates"


def value_name(key: str) -> str:
    """value/<key> for a key of value_loss's metrics (loss, clip_frac, mean)."""
    return f"{VALUE_PREFIX}{key}"


# ---------------------------------------------------------------------------------------------
# rollout/: what was generated (the sampling_rounds / groups_* four: DAPO dynamic sampling only)

ROLLOUT_COMPLETION_LEN_MEAN = "rollout/completion_len_mean"
ROLLOUT_COMPLETION_LEN_MIN = "rollout/completion_len_min"
ROLLOUT_COMPLETION_LEN_MAX = "rollout/completion_len_max"
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
ROLLOUT_PROMPT_LEN_MEAN = "rollout/prompt_len_mean"
ROLLOUT_TOKENS = "rollout/tokens"
ROLLOUT_TRUNCATED_PROMPTS = "rollout/truncated_prompts"
ROLLOUT_SAMPLING_ROUNDS = "rollout/sampling_rounds"
ROLLOUT_GROUPS_DRAWN = "rollout/groups_drawn"
ROLLOUT_GROUPS_DROPPED = "rollout/groups_dropped"
ROLLOUT_GROUPS_TOPPED_UP = "rollout/groups_topped_up"
# The sampler-trainer mismatch (grpokit/rollout/mismatch.py), for engines that return their log-probs (fast,
# vllm).
ROLLOUT_LOGP_DIFF_MEAN = "rollout/logp_diff_mean"
ROLLOUT_LOGP_DIFF_MAX = "rollout/logp_diff_max"
ROLLOUT_SAMPLER_KL = "rollout/sampler_kl"
ROLLOUT_IS_WEIGHT_MEAN = "rollout/is_weight_mean"
ROLLOUT_IS_CLIP_FRAC = "rollout/is_clip_frac"
# Policy versions (optimizer steps) behind the samples: > 0 with rollout.max_policy_lag
# (grpokit/rollout/pipeline.py).
ROLLOUT_VERSION_LAG = "rollout/version_lag"
ROLLOUT_VERSION_LAG_MAX = "rollout/version_lag_max"
# Multi-turn rollouts with tools (grpokit/rollout/episodes.py): rollout/tools/<x> over the step's episodes,
# eval/tools/<x> over the held-out greedy episodes (grpokit.tools.episode.episode_metrics).
ROLLOUT_TOOLS_PREFIX = "rollout/tools/"
EVAL_TOOLS_PREFIX = "eval/tools/"
TOOL_METRICS = (
    "calls_per_episode",
    "turns",
    "valid_call_rate",
    "episodes_with_calls",
    "errors",
    "timeouts",
    "seconds",
    "cut_by_budget",
    "cut_by_turns",
)
ROLLOUT_TOOLS_CALLS_PER_EPISODE = "rollout/tools/calls_per_episode"
ROLLOUT_TOOLS_TURNS = "rollout/tools/turns"
ROLLOUT_TOOLS_VALID_CALL_RATE = "rollout/tools/valid_call_rate"
ROLLOUT_TOOLS_EPISODES_WITH_CALLS = "rollout/tools/episodes_with_calls"
ROLLOUT_TOOLS_ERRORS = "rollout/tools/errors"
ROLLOUT_TOOLS_TIMEOUTS = "rollout/tools/timeouts"
ROLLOUT_TOOLS_SECONDS = "rollout/tools/seconds"
ROLLOUT_TOOLS_CUT_BY_BUDGET = "rollout/tools/cut_by_budget"
ROLLOUT_TOOLS_CUT_BY_TURNS = "rollout/tools/cut_by_turns"
EVAL_TOOLS_CALLS_PER_EPISODE = "eval/tools/calls_per_episode"
EVAL_TOOLS_TURNS = "eval/tools/turns"
EVAL_TOOLS_VALID_CALL_RATE = "eval/tools/valid_call_rate"
EVAL_TOOLS_EPISODES_WITH_CALLS = "eval/tools/episodes_with_calls"
EVAL_TOOLS_ERRORS = "eval/tools/errors"
EVAL_TOOLS_TIMEOUTS = "eval/tools/timeouts"
EVAL_TOOLS_SECONDS = "eval/tools/seconds"
EVAL_TOOLS_CUT_BY_BUDGET = "eval/tools/cut_by_budget"
EVAL_TOOLS_CUT_BY_TURNS = "eval/tools/cut_by_turns"

# ---------------------------------------------------------------------------------------------
# perf/: seconds and memory (value_time and critic_train_time: PPO only)

PERF_ROLLOUT_TIME = "perf/rollout_time"
PERF_REWARD_TIME = "perf/reward_time"
PERF_REF_TIME = "perf/ref_time"
PERF_STEP_TIME = "perf/step_time"
PERF_TRAIN_TIME = "perf/train_time"
PERF_ROLLOUT_TOKENS_PER_S = "perf/rollout_tokens_per_s"
PERF_TRAIN_TOKENS_PER_S = "perf/train_tokens_per_s"
PERF_PEAK_RSS_MB = "perf/peak_rss_mb"
PERF_THREADS = "perf/threads"
PERF_PADDING_FRAC = "perf/padding_frac"
PERF_VALUE_TIME = "perf/value_time"
PERF_CRITIC_TRAIN_TIME = "perf/critic_train_time"
PERF_ROLLOUT_WAIT = "perf/rollout_wait_time"
PERF_WEIGHTS_WAIT = "perf/weights_wait_time"

#: How one rank's value of a metric becomes the run's when several ranks train (grpokit/distributed.py,
#: World.reduce_metrics): the slowest rank's time and memory, the sum of throughputs and of group counts.
#: Every other metric is computed over the whole batch already (the same on every rank: reward/, advantage/,
#: rollout/ from every rank's rows, policy/ from every rank's micro-batches), or only rank 0 has it (eval/).
RANK_REDUCTIONS: dict[str, str] = {
    **{
        name: "max"
        for name in (
            PERF_ROLLOUT_TIME,
            PERF_REWARD_TIME,
            PERF_REF_TIME,
            PERF_STEP_TIME,
            PERF_TRAIN_TIME,
            PERF_PEAK_RSS_MB,
            PERF_VALUE_TIME,
            PERF_CRITIC_TRAIN_TIME,
            PERF_ROLLOUT_WAIT,
            PERF_WEIGHTS_WAIT,
        )
    },
    **{
        name: "sum"
        for name in (
            PERF_ROLLOUT_TOKENS_PER_S,
            PERF_TRAIN_TOKENS_PER_S,
            ROLLOUT_GROUPS_DRAWN,
            ROLLOUT_GROUPS_DROPPED,
            ROLLOUT_GROUPS_TOPPED_UP,
        )
    },
    ROLLOUT_LOGP_DIFF_MAX: "max",
    ROLLOUT_VERSION_LAG_MAX: "max",
}

# ---------------------------------------------------------------------------------------------
# eval/: held-out evaluation (grpokit.evaluate)

EVAL_PASS_AT_1 = "eval/pass@1"  # greedy
EVAL_FORMAT_RATE = "eval/format_rate"
EVAL_REWARD_MEAN = "eval/reward_mean"
EVAL_MEAN_LENGTH = "eval/mean_length"
EVAL_NUM_PROMPTS = "eval/num_prompts"
EVAL_TIME = "eval/time"
EVAL_LOSS = "eval/loss"  # SFT: held-out completion cross-entropy
EVAL_EXACT_MATCH = "eval/exact_match"  # SFT: greedy completion == the reference

# grpokit sft (grpokit/sft.py)
SFT_LOSS = "sft/loss"
SFT_LR = "sft/lr"
SFT_GRAD_NORM = "sft/grad_norm"
SFT_EPOCH = "sft/epoch"


def eval_pass_at(k: int) -> str:
    """eval/pass@<k>: some of k samples correct. (k = 1 is the greedy EVAL_PASS_AT_1.)"""
    return f"{EVAL_PREFIX}pass@{k}"


def eval_maj_at(k: int) -> str:
    """eval/maj@<k>: the majority answer of k samples correct."""
    return f"{EVAL_PREFIX}maj@{k}"


def eval_mean_at(k: int) -> str:
    """eval/mean@<k>: mean correctness of k samples."""
    return f"{EVAL_PREFIX}mean@{k}"


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
    trainer's bad-step guard (grpokit/health.py) and the doctor both ask this."""
    return record.get(REWARD_ZERO_STD_FRAC) == 1.0 and record.get(ADVANTAGE_ABS_MEAN, 0.0) == 0.0


def failed_fractions(record: Mapping[str, Any]) -> dict[str, float]:
    """Reward function name -> the fraction of the step's scored completions it failed on (raised, timed out,
    returned a bad value), from reward/errors/<fn> and reward/error_frac (the largest); {} when none
    failed."""
    worst = as_number(record.get(REWARD_ERROR_FRAC))
    counts = {
        k[len(REWARD_ERRORS_PREFIX) :]: as_number(v)
        for k, v in record.items()
        if k.startswith(REWARD_ERRORS_PREFIX)
    }
    counts = {name: c for name, c in counts.items() if c is not None and c > 0}
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

    def __init__(self):
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
        (grpokit/distributed.py)."""
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
    threads: torch's CPU thread count (grpokit/threads.py)."""
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
