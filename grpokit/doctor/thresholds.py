"""The thresholds of the checks, one named constant each; docs/doctor.md gives each one's value, reason
and fix."""

from __future__ import annotations

from grpokit.metrics.compute import (
    ADVANTAGE_MEAN,
    POLICY_ENTROPY,
    POLICY_GRAD_NORM,
    POLICY_KL,
    POLICY_LOSS,
    REWARD_MEAN,
    REWARD_STD,
)

# Smoothing: a rolling window of n / WINDOW_DIVISOR logged steps, clamped to [MIN_WINDOW, MAX_WINDOW]
# and made odd; "sustained" means for at least one window of consecutive logged steps.
WINDOW_DIVISOR = 20
MIN_WINDOW = 5
MAX_WINDOW = 25
MIN_STEPS = 20  # logged steps a windowed check needs before it says anything

# reward: is it sparse or noisy, are groups all equal
FLAT_MIN_STEPS = 30  # logged steps before "no trend" means anything
FLAT_BLOCKS = 8  # the run is cut into this many blocks of steps for trend tests
FLAT_Z = 3.0  # a rise counts when it exceeds FLAT_Z standard errors (block means, or the run's slope)
DROP_Z = 4.0  # a fall from the best block counts when it exceeds DROP_Z standard errors ...
DROP_FRAC = 0.5  # ... and gives back at least this fraction of the rise
DROP_MIN_STEPS = (
    12  # logged steps before a fall can be judged (a short run, or a run so far: the live doctor)
)
DROP_MIN_BLOCK = 3  # steps in the blocks the fall is judged on: n / FLAT_BLOCKS, at least this many
NONE_FRAC_MAX = 0.5  # reward/none_frac: no reward function applied to most completions
ZERO_STD_MAX = 0.5  # reward/zero_std_frac: most groups carry no gradient
ZERO_STD_ERROR = 0.9
NO_SIGNAL_MIN_STEPS = 5  # logged steps in a row where every group was tied (or the whole run, when shorter)
ERROR_FRAC_MAX = (
    0.5  # reward/error_frac: a function failed on most of a step (config reward_error_fraction wins)
)
ERROR_FRAC_ERROR_STEPS = 0.1  # ... at more than this fraction of the logged steps: an error, else a warning
# ratio / clip / KL
RATIO_TOL = 0.1  # |policy/ratio_mean - 1|: trainer and sampler disagree
CLIP_FRAC_MAX = 0.2  # policy/clip_frac
CLIP_FRAC_ERROR = 0.3
KL_MAX = 0.5  # policy/kl in nats per token: far from pi_ref
KL_GROWTH = 5.0  # policy/kl multiplied by this within KL_GROWTH_WINDOWS windows ...
KL_GROWTH_WINDOWS = 2
KL_GROWTH_FLOOR = 0.1  # ... and above this: exploding (below it, the early rise from 0 is normal)
KL_ZERO = 1e-6  # policy/kl this small with beta > 0 and a moving policy: pi_ref is pi_theta
# rollouts: did rollout length and diversity change
ENTROPY_COLLAPSE_FRAC = 0.25  # policy/entropy below this fraction of its start
LEN_COLLAPSE_FRAC = 0.25  # rollout/completion_len_mean below this fraction of its start
LEN_BLOWUP_FACTOR = 4.0  # ... or above this multiple of its start
TRUNC_MAX = 0.2  # rollout/truncated_frac
TRUNC_ERROR = 0.5
# numerics
GRAD_SPIKE_FACTOR = 10.0  # policy/grad_norm above this multiple of the median of ...
GRAD_HISTORY = 20  # ... the previous GRAD_HISTORY logged steps
GRAD_MIN_HISTORY = 10  # (needs at least this many before it)
GRAD_SPIKE_Z = 5.0  # ... and above this many of the run's step-to-step spreads of log(grad_norm)
NONFINITE_KEYS = (
    REWARD_MEAN,
    REWARD_STD,
    ADVANTAGE_MEAN,
    POLICY_LOSS,
    POLICY_KL,
    POLICY_GRAD_NORM,
    POLICY_ENTROPY,
)
# reward hacking: training reward up, held-out pass@1 not
HACK_MIN_EVALS = 3
HACK_Z = 3.0  # the training-reward rise must be this many standard errors ...
HACK_TRAIN_GAIN_STD = 0.5  # ... and at least this many reward/std (the within-step spread)
HACK_EVAL_MIN_GAIN = 0.02  # eval/pass@1 must rise at least this much (absolute) ...
HACK_EVAL_DROP = 0.05  # ... and a fall of this much is an error
# tool spam: calls per episode up, held-out pass@1 not (same evaluation rules as reward hacking)
SPAM_MIN_RISE = 0.5  # rollout/tools/calls_per_episode rose by at least this many calls per episode ...
SPAM_Z = 3.0  # ... and by more than this many standard errors of its step-to-step noise
