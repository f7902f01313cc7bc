"""Asynchronous rollouts (rollout.max_policy_lag=1) against the synchronous loop on the demo task: held-out
accuracy after the same steps, and seconds per step.

    .venv/bin/python benchmarks/async_lag.py --model runs/demo/sft              # -> benchmarks/results/async_lag.md
    .venv/bin/python benchmarks/async_lag.py --model runs/demo/sft --steps 20 --seeds 0   # a quick look

The warm start is the demo's SFT model (`make demo` leaves it in runs/demo/sft). Three arms of one config
(benchmarks/arms.py, presets.py's: 16 prompts x G=8, 16-token completions, T=1, lr 1e-4; rollout.engine=fast):
  lag0        the synchronous loop
  lag1        max_policy_lag=1: batch b+1 is generated with the weights of step b while step b trains, and pi_old
              is the sampler's log-probs (off-policy PPO: the clip is around the behaviour policy)
  lag1_tis    max_policy_lag=1 with importance_correction=token_truncate (C_max 3): pi_old is the trainer's own
              log-probs before the update and each token's loss is weighted min(pi_old / pi_sampler, 3)
With --threads 1 the synchronous loop uses one core; a lagged run uses one more for its sampler thread (this
machine has 2). Reported besides the accuracy and times: the median of rollout/logp_diff_mean (the policy lag
as the trainer sees it), rollout/is_clip_frac (lag1_tis), perf/rollout_wait_time (the trainer waiting for its
batch) and perf/weights_wait_time (the sampler waiting for a step to end).
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from arms import arm_parser, run_all  # noqa: E402

ARMS = {
    "lag0": ["rollout.engine=fast"],
    "lag1": ["rollout.engine=fast", "rollout.max_policy_lag=1"],
    "lag1_tis": ["rollout.engine=fast", "rollout.max_policy_lag=1", "rollout.importance_correction=token_truncate"],
}
KEYS = ("rollout/logp_diff_mean", "rollout/is_clip_frac", "perf/rollout_wait_time", "perf/weights_wait_time")


def main() -> None:
    p = arm_parser(__doc__, "async_lag", "runs/demo/sft")
    p.add_argument("--arms", default=",".join(ARMS))
    args = p.parse_args()
    args.eval_every = args.steps  # before step 1 and after the last only
    if not Path(args.model).exists():
        sys.exit(f"no warm start at {args.model}: run `make demo` (it leaves runs/demo/sft) or pass --model")
    import torch

    torch.set_num_threads(args.threads)
    setup = (f"warm start {args.model}; {args.steps} GRPO steps of {args.prompts} prompts x G={args.G}; "
             f"{args.eval_size} held-out problems; {args.threads} thread(s)")
    run_all(args, {a: ARMS[a] for a in args.arms.split(",")}, "async_lag.py",
            "rollout.max_policy_lag=1 against the synchronous loop on the demo task", setup, KEYS)


if __name__ == "__main__":
    main()
