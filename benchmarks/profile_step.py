"""Where one grpokit GRPO step spends its time, on compare_trl.py's workloads (CPU, fp32, 1 thread).

    .venv/bin/python benchmarks/profile_step.py --workload small --steps 8            # phase table
    .venv/bin/python benchmarks/profile_step.py --workload small --cprofile 25        # + top functions
    .venv/bin/python benchmarks/profile_step.py --workload small --set model.compile=true

Needs the workload's model and prompts, built by compare_trl.py in runs/compare_trl (it builds them if missing).
Phases are the trainer's own perf/* timings: rollout (generation), reward, ref (pi_ref / pi_old log-prob
passes), train (update + weight sync), and the rest of the rollout phase (packing, advantages, metrics).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def make_config(workload: str, steps: int, out_dir: str, overrides: list[str]):
    import compare_trl as ct
    from grpokit.config import load_config

    wl = ct.WORKLOADS[workload]
    work = Path("runs/compare_trl")
    model_dir = ct.build_model(wl, work)
    data_path = ct.write_prompts(wl, work)
    a = ct.ALGO
    tree = {
        "output_dir": out_dir, "seed": a["seed"],
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "data": {"train_path": str(data_path), "eval_size": 0},
        "rollout": {"engine": "fast", "num_generations": wl["G"], "prompts_per_step": wl["prompts"],
                    "max_completion_length": wl["T"], "temperature": a["temperature"], "top_p": 1.0, "top_k": 0},
        "algorithm": {"beta": a["beta"], "epsilon": a["epsilon"], "loss_type": a["loss_type"],
                      "scale_rewards": a["scale_rewards"], "num_iterations": a["mu"]},
        "optim": {"learning_rate": wl["lr"], "max_steps": steps, "lr_scheduler": "constant", "max_grad_norm": 1.0},
        "eval": {"at_start": False, "every": 0},
        "logging": {"tensorboard": False, "sample_every": 0},
        "checkpoint": {"save_every": 0, "resume": False},
        "rewards": [{"function": "countdown"}],
    }
    return load_config(base=tree, overrides=overrides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="small", choices=["small", "compute"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cprofile", type=int, default=0, help="print this many top functions by cumulative time")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    args = ap.parse_args()

    import shutil

    import torch

    torch.set_num_threads(args.threads)
    from grpokit.trainer import Trainer

    out = Path("runs/profile_step")
    shutil.rmtree(out, ignore_errors=True)
    cfg = make_config(args.workload, args.steps, str(out), args.set)
    trainer = Trainer(cfg)
    recs: list[dict] = []
    trainer_rollout = trainer.rollout

    def timed_rollout(rows):
        t = time.perf_counter()
        out = trainer_rollout(rows)
        out[1]["perf/prep_time"] = time.perf_counter() - t
        return out

    trainer.rollout = timed_rollout
    prof = cProfile.Profile() if args.cprofile else None

    def on_log(step, m):
        recs.append(m)
        if prof is not None and step == args.warmup:
            prof.enable()

    t = time.perf_counter()
    trainer.train(on_log=on_log)
    if prof is not None:
        prof.disable()
    timed = recs[args.warmup :]
    med = lambda k: statistics.median(m[k] for m in timed)  # noqa: E731
    rest = statistics.median(m["perf/prep_time"] - m["perf/rollout_time"] - m["perf/reward_time"] - m["perf/ref_time"] for m in timed)
    print(f"{args.workload} {' '.join(args.set)}: {len(timed)} steps timed, wall {time.perf_counter() - t:.1f}s")
    print(f"  step   {med('perf/step_time'):.4f} s")
    print(f"  rollout {med('perf/rollout_time'):.4f}  reward {med('perf/reward_time'):.4f}  ref {med('perf/ref_time'):.4f}  "
          f"other-prep {rest:.4f}  train {med('perf/train_time'):.4f}")
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.cprofile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
