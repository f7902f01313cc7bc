"""Asynchronous rollouts (rollout.max_policy_lag=1) against the synchronous loop on the demo task: held-out
accuracy after the same steps, and seconds per step.

    .venv/bin/python benchmarks/async_lag.py --model runs/demo/sft   # -> benchmarks/results/async_lag.md
    .venv/bin/python benchmarks/async_lag.py --model runs/demo/sft --steps 20 --seeds 0   # a quick look

The warm start is the demo's SFT model (`grpokit demo --model tiny` leaves it in runs/demo/sft). Three arms
of one config (benchmarks/arms.py, presets.py's: 16 prompts x G=8, 16-token completions, T=1, lr 1e-4;
rollout.engine=fast):
  lag0        the synchronous loop
  lag1        max_policy_lag=1: batch b+1 is generated with the weights of step b while step b trains, and
              pi_old is the sampler's log-probs (off-policy PPO: the clip is around the behaviour policy)
  lag1_tis    max_policy_lag=1 with importance_correction=token_truncate (C_max 3): pi_old is the trainer's
              own log-probs before the update and each token's loss is weighted min(pi_old / pi_sampler, 3)
  lag1_process  max_policy_lag=1 with async_sampler=process: the fast engine in a child process (no GIL
                shared)
  server_lag0 / server_lag1   the same on rollouts from a `grpokit serve` process (rollout.vllm_mode=server;
              --arms server_lag0,server_lag1 with a heads-of-64 warm start such as vllm_vs_fast.py's),
              started once
With --threads 1 the synchronous loop uses one core; a lagged run uses one more for its sampler thread (this
machine has 2); the server is a process of its own (1 thread). Reported besides the accuracy and times: the
median of rollout/logp_diff_mean (the policy lag as the trainer sees it), rollout/is_clip_frac (lag1_tis),
perf/rollout_wait_time (the trainer waiting for its batch) and perf/weights_wait_time (the sampler waiting for
a step to end).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from arms import SMOKE_SFT, arm_parser, parse_arm_args, run_all  # noqa: E402 (after sys.path gets benchmarks/)

ARMS = {
    "lag0": ["rollout.engine=fast"],
    "lag1": ["rollout.engine=fast", "rollout.max_policy_lag=1"],
    "lag1_tis": [
        "rollout.engine=fast",
        "rollout.max_policy_lag=1",
        "rollout.importance_correction=token_truncate",
    ],
    "lag1_process": ["rollout.engine=fast", "rollout.max_policy_lag=1", "rollout.async_sampler=process"],
    # rollouts from a `grpokit serve` process (vLLM; needs a warm start with heads of 64: vllm_vs_fast.py's)
    "server_lag0": ["rollout.engine=vllm", "rollout.vllm_mode=server"],
    "server_lag1": ["rollout.engine=vllm", "rollout.vllm_mode=server", "rollout.max_policy_lag=1"],
}
KEYS = ("rollout/logp_diff_mean", "rollout/is_clip_frac", "perf/rollout_wait_time", "perf/weights_wait_time")


def main() -> None:
    p = arm_parser(__doc__, "async_lag", "runs/demo/sft")
    p.add_argument("--arms", default="lag0,lag1,lag1_tis")
    args = parse_arm_args(p)
    if args.smoke and not Path(args.model).exists():
        from grpo_vs_ppo import make_sft

        make_sft(args.model, size="test", lr=1e-3, seed=0, threads=args.threads, **SMOKE_SFT)
    if not Path(args.model).exists():
        sys.exit(
            f"no warm start at {args.model}: run `grpokit demo --model tiny` (it leaves runs/demo/sft) or "
            "pass --model"
        )
    setup = (
        f"warm start {args.model}; {args.steps} GRPO steps of {args.prompts} prompts x G={args.G}; "
        f"{args.eval_size} held-out problems; {args.threads} thread(s)"
    )
    arms = {a: ARMS[a] for a in args.arms.split(",")}
    server = None
    if any(
        "rollout.vllm_mode=server" in o for o in sum(arms.values(), [])
    ):  # one server for every server arm
        from vllm_server import start_server

        Path(args.out).mkdir(parents=True, exist_ok=True)
        server, url, started = start_server(Path(args.model), Path(args.out) / "serve.log")
        print(f"grpokit serve {args.model}: ready at {url} in {started:.0f} s", flush=True)
        arms = {
            a: [*o, f"rollout.vllm_server_url={url}"] if "rollout.vllm_mode=server" in o else o
            for a, o in arms.items()
        }
    try:
        run_all(
            args,
            arms,
            "async_lag.py",
            "rollout.max_policy_lag=1 against the synchronous loop on the demo task",
            setup,
            KEYS,
        )
    finally:
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    main()
