"""Where one grpokit GRPO step spends its time, on compare_trl.py's workloads (CPU, fp32, 1 thread).

    .venv/bin/python benchmarks/profile_step.py --workload small --steps 8            # phase table
    .venv/bin/python benchmarks/profile_step.py --workload small --cprofile 25        # + top functions
    .venv/bin/python benchmarks/profile_step.py --workload small --set model.compile=true
    .venv/bin/python benchmarks/profile_step.py --workload small --ab model.compile=true --steps 20   # A/B

--ab builds two trainers in this process, A (the config) and B (A + the --ab overrides), runs --warmup steps
of each (compile time is reported as B's warm-up minus A's), then alternates A and B step by step, so that
load from other processes on a shared machine hits both alike; it prints medians per phase and B / A.

Needs the workload's model and prompts, built by compare_trl.py in runs/compare_trl (it builds them if
missing). Phases are the trainer's own perf/* timings: rollout (generation), reward, ref (pi_ref / pi_old
log-prob passes), train (update + weight sync), and the rest of the rollout phase (packing, advantages,
metrics).

--smoke: compare_trl.py's --smoke sizes (2 prompts x G=2, 8 tokens) of the workload, 3 steps after 1 warm-up,
its model and runs in runs/profile_step/smoke: a check that the benchmark runs (with --ab or --cprofile too).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def make_config(workload: str, steps: int, out_dir: str, overrides: list[str], smoke: bool = False):
    import compare_trl as ct

    from grpokit.config import load_config

    wl = dict(ct.WORKLOADS[workload], **(ct.SMOKE if smoke else {}))
    work = Path(
        "runs/profile_step/smoke" if smoke else "runs/compare_trl"
    )  # smoke: other sizes, other models
    model_dir = ct.build_model(wl, work)
    data_path = ct.write_prompts(wl, work)
    a = ct.ALGO
    tree = {
        "output_dir": out_dir,
        "seed": a["seed"],
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "data": {"train_path": str(data_path), "eval_size": 0},
        "rollout": {
            "engine": "fast",
            "num_generations": wl["G"],
            "prompts_per_step": wl["prompts"],
            "max_completion_length": wl["T"],
            "temperature": a["temperature"],
            "top_p": 1.0,
            "top_k": 0,
        },
        "algorithm": {
            "beta": a["beta"],
            "epsilon": a["epsilon"],
            "loss_type": a["loss_type"],
            "scale_rewards": a["scale_rewards"],
            "num_iterations": a["mu"],
        },
        "optim": {
            "learning_rate": wl["lr"],
            "max_steps": steps,
            "lr_scheduler": "constant",
            "max_grad_norm": 1.0,
        },
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
    ap.add_argument(
        "--cprofile", type=int, default=0, help="print this many top functions by cumulative time"
    )
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    ap.add_argument("--ab", nargs="*", help="compare against a second trainer with these extra overrides")
    ap.add_argument("--smoke", action="store_true", help="the smallest run (see above)")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup = 3, 1
    args.runs = "runs/profile_step" + ("/smoke/run" if args.smoke else "")
    if args.ab:
        return ab(args)

    import shutil

    import torch

    torch.set_num_threads(args.threads)
    from grpokit.trainer import Trainer

    out = Path(args.runs)
    shutil.rmtree(out, ignore_errors=True)
    cfg = make_config(args.workload, args.steps, str(out), args.set, args.smoke)
    trainer = Trainer(cfg)
    recs: list[dict] = []
    trainer_rollout = trainer.rollout

    def timed_rollout(rows=None):  # Trainer.rollout: the pipeline's batch, or of `rows` now
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
    # without the plots of the run the trainer draws after its last step (seconds: they swamped the profile)
    with mock.patch("grpokit.trainer.plot_run", lambda *a, **k: []):
        trainer.train(on_log=on_log)
    if prof is not None:
        prof.disable()
    timed = recs[args.warmup :]

    def med(k):
        return statistics.median(m[k] for m in timed)

    rest = statistics.median(
        m["perf/prep_time"] - m["perf/rollout_time"] - m["perf/reward_time"] - m["perf/ref_time"]
        for m in timed
    )
    print(
        f"{args.workload} {' '.join(args.set)}: {len(timed)} steps timed, wall {time.perf_counter() - t:.1f}s"
    )
    print(f"  step   {med('perf/step_time'):.4f} s")
    print(
        f"  rollout {med('perf/rollout_time'):.4f}  reward {med('perf/reward_time'):.4f}  ref "
        f"{med('perf/ref_time'):.4f}  other-prep {rest:.4f}  train {med('perf/train_time'):.4f}"
    )
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.cprofile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


PHASES = ("step", "rollout", "ref", "train")


def one_step(trainer) -> dict[str, float]:
    """One GRPO step outside Trainer.train (no logging, no checkpoints): phase times in seconds."""
    t0 = time.perf_counter()
    rows = [trainer.train_data[i] for i in trainer.sampler.next()]
    batch, metrics, _ = trainer.rollout(rows)
    t1 = time.perf_counter()
    trainer.update(batch)
    trainer.pipeline.engine.sync_weights(trainer.model)
    trainer.step += 1
    t2 = time.perf_counter()
    return {
        "step": t2 - t0,
        "rollout": metrics["perf/rollout_time"],
        "ref": metrics["perf/ref_time"],
        "train": t2 - t1,
    }


def ab(args) -> None:
    import shutil

    import torch

    torch.set_num_threads(args.threads)
    from grpokit.trainer import Trainer

    trainers, warm = {}, {}
    for name, extra in (("A", []), ("B", args.ab)):
        out = Path(f"{args.runs}_{name}")
        shutil.rmtree(out, ignore_errors=True)
        trainers[name] = Trainer(
            make_config(args.workload, args.steps + args.warmup, str(out), args.set + extra, args.smoke)
        )
        t = time.perf_counter()
        for _ in range(args.warmup):
            one_step(trainers[name])
        warm[name] = time.perf_counter() - t
    recs: dict[str, list] = {"A": [], "B": []}
    for _ in range(args.steps):
        for name in ("A", "B"):
            recs[name].append(one_step(trainers[name]))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in PHASES} for n, rs in recs.items()}
    print(
        f"{args.workload}, {args.threads} thread(s), {args.steps} interleaved steps after {args.warmup} "
        f"warm-up steps each; A: {' '.join(args.set) or 'defaults'}; B: A + {' '.join(args.ab)}"
    )
    print(f"warm-up: A {warm['A']:.1f}s, B {warm['B']:.1f}s")
    print("| | " + " | ".join(f"{k} s" for k in PHASES) + " |")
    print("|---" * (len(PHASES) + 1) + "|")
    for n in ("A", "B"):
        print(f"| {n} | " + " | ".join(f"{med[n][k]:.4f}" for k in PHASES) + " |")
    print("| B / A | " + " | ".join(f"{med['B'][k] / med['A'][k]:.2f}x" for k in PHASES) + " |")


if __name__ == "__main__":
    main()
