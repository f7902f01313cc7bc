"""Every metric name grpokit logs and the metrics log's file names: constants and the builders of names
with a part chosen at run time. docs/metrics.md defines each name.

    from grpokit.metrics import names as M      # or grpokit.metrics.compute, which re-exports every name here
    M.REWARD_MEAN                               # "reward/mean"
    M.reward_fn("correct")                      # "reward/correct"

Names are namespaced: reward/ (what the reward functions said), advantage/ (what the loss was fed),
policy/ (the update), value/ (PPO's critic), rollout/ (what was generated), perf/ (time and memory),
eval/ (held-out evaluation), sft/ (grpokit sft). A name with a part chosen at run time (a reward
function's name, a key of a loss's metrics, eval's k) comes from a builder below (reward_fn("correct")
-> "reward/correct"); every other name is a constant.

This module imports nothing: every layer of grpokit may use the names (the metric computation and
the reader of metrics.jsonl are in grpokit/metrics/compute.py).
"""

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
POLICY_ENTROPY_COEF = "policy/entropy_coef"
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
# rollout.partial_rollouts (grpokit/rollout/partial.py): what the step's batch carried over from earlier steps
ROLLOUT_PARTIAL_FRAC = "rollout/partial_frac"
ROLLOUT_VERSIONS_SPANNED = "rollout/versions_spanned"
ROLLOUT_VERSIONS_SPANNED_MAX = "rollout/versions_spanned_max"
ROLLOUT_TOKENS_CARRIED = "rollout/tokens_carried"
ROLLOUT_PARTIAL_RESTARTED = "rollout/partial_restarted"
ROLLOUT_PARTIAL_ROUNDS = "rollout/partial_rounds"
# The check of the weight push behind the step's samples, for engines that push (vllm; under torchrun one
# engine per rank): its max |diff| and how many engines were checked.
ROLLOUT_PUSH_ERROR = "rollout/push_error"
ROLLOUT_PUSH_CHECKS = "rollout/push_checks"
# rollout.vllm_mode=server: the servers of the fleet still up (grpokit/rollout/server.py drops one that
# fails).
ROLLOUT_SERVERS = "rollout/servers"
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
PERF_MICRO_BATCHES = "perf/micro_batches"
PERF_VALUE_TIME = "perf/value_time"
PERF_CRITIC_TRAIN_TIME = "perf/critic_train_time"
PERF_ROLLOUT_WAIT = "perf/rollout_wait_time"
PERF_WEIGHTS_WAIT = "perf/weights_wait_time"

#: How one rank's value of a metric becomes the run's when several ranks train (grpokit/distributed/,
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
            ROLLOUT_PUSH_CHECKS,
            ROLLOUT_TOKENS_CARRIED,
            ROLLOUT_PARTIAL_RESTARTED,
        )
    },
    ROLLOUT_PUSH_ERROR: "max",
    ROLLOUT_VERSIONS_SPANNED_MAX: "max",
    ROLLOUT_PARTIAL_ROUNDS: "max",
    ROLLOUT_SERVERS: "max",
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
