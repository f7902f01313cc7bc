"""Checks of the rollouts: completion lengths that collapse or blow up, truncation."""

from __future__ import annotations

import numpy as np

from grpokit.doctor.run import Finding, Run
from grpokit.doctor.stats import percent, rounded, start_level, sustained
from grpokit.doctor.thresholds import LEN_BLOWUP_FACTOR, LEN_COLLAPSE_FRAC, MIN_STEPS, TRUNC_ERROR, TRUNC_MAX
from grpokit.metrics.compute import (
    ROLLOUT_COMPLETION_LEN_MEAN,
    ROLLOUT_TRUNCATED_FRAC,
)


def check_length(run: Run) -> list[Finding]:
    length = run.series(ROLLOUT_COMPLETION_LEN_MEAN)
    if length is None or len(length) < MIN_STEPS:
        return []
    start = start_level(length)
    if start <= 0:
        return []
    out = []
    for st in sustained(length, below=LEN_COLLAPSE_FRAC * start):
        level = float(np.median(st.smoothed))
        out.append(
            Finding(
                "length_collapse",
                "warning",
                length.span(st.first, st.last),
                f"rollout/completion_len_mean fell from {rounded(start)} to {rounded(level)} tokens "
                f"({percent(level / start)} of its start)",
                "read samples.jsonl: short answers that still earn reward mean the reward pays for the form, "
                "not the work; the grpo loss's 1/|o_i| favors short correct answers: algorithm.loss_type="
                f"dr_grpo or dapo{run.current('algorithm.loss_type')}; lower optim.learning_rate",
            )
        )
    for st in sustained(length, above=LEN_BLOWUP_FACTOR * start):
        level = float(np.median(st.smoothed))
        out.append(
            Finding(
                "length_blowup",
                "warning",
                length.span(st.first, st.last),
                f"rollout/completion_len_mean grew from {rounded(start)} to {rounded(level)} tokens "
                f"({rounded(level / start)}x its start); fine if the answers got better, not if they repeat",
                "read samples.jsonl for repetition; overlong shaping (algorithm.overlong_buffer_frac=0.2, "
                "DAPO's soft punishment, or the overlong reward) and "
                "algorithm.mask_truncated_completions=true; algorithm.loss_type=dr_grpo or "
                f"dapo{run.current('algorithm.loss_type')} (the grpo loss's 1/|o_i| penalizes long wrong "
                "answers less); raise "
                f"rollout.max_completion_length{run.current('rollout.max_completion_length')} if long "
                "answers are right",
            )
        )
    return out


def check_truncation(run: Run) -> list[Finding]:
    truncated = run.series(ROLLOUT_TRUNCATED_FRAC)
    if truncated is None:
        return []
    out = []
    for st in sustained(truncated, above=TRUNC_MAX):
        median = float(np.median(truncated.values[st.first : st.last + 1]))
        out.append(
            Finding(
                "truncation",
                "error" if median > TRUNC_ERROR else "warning",
                truncated.span(st.first, st.last),
                f"rollout/truncated_frac median {percent(median)}: that share of completions hit "
                "max_completion_length without EOS; they usually score 0 and bias the length",
                f"raise rollout.max_completion_length{run.current('rollout.max_completion_length')}; "
                "overlong shaping "
                f"(algorithm.overlong_buffer_frac=0.2{run.current('algorithm.overlong_buffer_frac')}, or the "
                "overlong reward); "
                "algorithm.mask_truncated_completions=true"
                f"{run.current('algorithm.mask_truncated_completions')}; "
                "algorithm.loss_type=dr_grpo or dapo against the grpo loss's length bias",
            )
        )
    return out
