"""`grpokit doctor RUN_DIR`: read a run's metrics.jsonl and say what a GRPO instability checklist
finds in it, with the step range and the fix.

    grpokit doctor runs/x        # table of findings; exit 0 healthy, 1 findings, 2 no readable run

    from grpokit.doctor import diagnose
    from grpokit.metrics.compute import read_metrics
    findings = diagnose(read_metrics("runs/x/metrics.jsonl"), config_dict_or_None)

Each check is a small function of the run, listed in CHECKS in the order one debugs a run:
first the reward and advantage distributions, then ratio / clip / KL, then the hyperparameters,
then reward hacking and held-out accuracy. Thresholds are the named constants of thresholds.py;
docs/doctor.md gives each one's value, reason and fix. Every level check
looks at a centered rolling median and needs the condition to hold for a whole window of logged
steps, so one noisy step never fires; trend checks compare means of blocks of steps (and the
least-squares slope) against the run's own step-to-step noise. Metrics a run did not log are skipped,
never an error: a check asks the Run for its series, and the Run notes each metric it was asked for
and no row has, so the report can list the checks that had nothing to read.

The modules: run.py (the run reader: Run, Series, Finding), stats.py (the robust statistics), thresholds.py,
the checks by area (rewards.py, policy.py, rollouts.py, optimizer.py, hacking.py), checks.py (CHECKS,
run_checks, diagnose), report.py (the command and its report) and live.py (the checks during a run, which the
run's records call every logging.doctor_every steps). Every name is importable from here.
"""

from __future__ import annotations

from grpokit.doctor.checks import CHECKS, Check, diagnose, run_checks
from grpokit.doctor.hacking import check_reward_hacking, check_tool_spam
from grpokit.doctor.optimizer import check_grad_spikes, check_nonfinite
from grpokit.doctor.policy import check_clip, check_entropy, check_kl_high, check_kl_zero, check_ratio
from grpokit.doctor.report import doctor_main
from grpokit.doctor.rewards import (
    check_no_signal,
    check_reward_drop,
    check_reward_errors,
    check_reward_flat,
    check_reward_none,
    check_zero_std,
)
from grpokit.doctor.rollouts import check_length, check_truncation
from grpokit.doctor.run import CONFIG_FILE, Finding, Run, Series, row_step
from grpokit.doctor.stats import (
    Stretch,
    blocks,
    mean_diff_se,
    percent,
    rolling_median,
    rounded,
    slope_t,
    start_level,
    step_noise,
    sustained,
    true_stretches,
    window,
)
from grpokit.doctor.thresholds import (
    CLIP_FRAC_ERROR,
    CLIP_FRAC_MAX,
    DROP_FRAC,
    DROP_MIN_BLOCK,
    DROP_MIN_STEPS,
    DROP_Z,
    ENTROPY_COLLAPSE_FRAC,
    ERROR_FRAC_ERROR_STEPS,
    ERROR_FRAC_MAX,
    FLAT_BLOCKS,
    FLAT_MIN_STEPS,
    FLAT_Z,
    GRAD_HISTORY,
    GRAD_MIN_HISTORY,
    GRAD_SPIKE_FACTOR,
    GRAD_SPIKE_Z,
    HACK_EVAL_DROP,
    HACK_EVAL_MIN_GAIN,
    HACK_MIN_EVALS,
    HACK_TRAIN_GAIN_STD,
    HACK_Z,
    KL_GROWTH,
    KL_GROWTH_FLOOR,
    KL_GROWTH_WINDOWS,
    KL_MAX,
    KL_ZERO,
    LEN_BLOWUP_FACTOR,
    LEN_COLLAPSE_FRAC,
    MAX_WINDOW,
    MIN_STEPS,
    MIN_WINDOW,
    NO_SIGNAL_MIN_STEPS,
    NONE_FRAC_MAX,
    NONFINITE_KEYS,
    RATIO_TOL,
    SPAM_MIN_RISE,
    SPAM_Z,
    TRUNC_ERROR,
    TRUNC_MAX,
    WINDOW_DIVISOR,
    ZERO_STD_ERROR,
    ZERO_STD_MAX,
)

__all__ = [
    "CHECKS",
    "CLIP_FRAC_ERROR",
    "CLIP_FRAC_MAX",
    "CONFIG_FILE",
    "Check",
    "DROP_FRAC",
    "DROP_MIN_BLOCK",
    "DROP_MIN_STEPS",
    "DROP_Z",
    "ENTROPY_COLLAPSE_FRAC",
    "ERROR_FRAC_ERROR_STEPS",
    "ERROR_FRAC_MAX",
    "FLAT_BLOCKS",
    "FLAT_MIN_STEPS",
    "FLAT_Z",
    "Finding",
    "GRAD_HISTORY",
    "GRAD_MIN_HISTORY",
    "GRAD_SPIKE_FACTOR",
    "GRAD_SPIKE_Z",
    "HACK_EVAL_DROP",
    "HACK_EVAL_MIN_GAIN",
    "HACK_MIN_EVALS",
    "HACK_TRAIN_GAIN_STD",
    "HACK_Z",
    "KL_GROWTH",
    "KL_GROWTH_FLOOR",
    "KL_GROWTH_WINDOWS",
    "KL_MAX",
    "KL_ZERO",
    "LEN_BLOWUP_FACTOR",
    "LEN_COLLAPSE_FRAC",
    "MAX_WINDOW",
    "MIN_STEPS",
    "MIN_WINDOW",
    "NONE_FRAC_MAX",
    "NONFINITE_KEYS",
    "NO_SIGNAL_MIN_STEPS",
    "RATIO_TOL",
    "Run",
    "SPAM_MIN_RISE",
    "SPAM_Z",
    "Series",
    "Stretch",
    "TRUNC_ERROR",
    "TRUNC_MAX",
    "WINDOW_DIVISOR",
    "ZERO_STD_ERROR",
    "ZERO_STD_MAX",
    "blocks",
    "check_clip",
    "check_entropy",
    "check_grad_spikes",
    "check_kl_high",
    "check_kl_zero",
    "check_length",
    "check_no_signal",
    "check_nonfinite",
    "check_ratio",
    "check_reward_drop",
    "check_reward_errors",
    "check_reward_flat",
    "check_reward_hacking",
    "check_reward_none",
    "check_tool_spam",
    "check_truncation",
    "check_zero_std",
    "diagnose",
    "doctor_main",
    "mean_diff_se",
    "percent",
    "rolling_median",
    "rounded",
    "row_step",
    "run_checks",
    "slope_t",
    "start_level",
    "step_noise",
    "sustained",
    "true_stretches",
    "window",
]
