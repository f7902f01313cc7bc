"""Kill a `grpokit train` run with SIGKILL at random moments, resume it with the same command each time.

    .venv/bin/python benchmarks/kill_resume.py [--kills 20] [--max-steps 80] [--seed 0] \\
        [--lag K | --partial C] [--ranks 2] [--out runs/kill_resume]

Builds a tiny Llama and a prompt file (no download), writes one config, then `--kills` times:
start `grpokit train CONFIG` (the same command every time), wait until it has resumed (it prints
"resuming from checkpoint step N"), and kill -9 it at a random moment: 0-2 steps later plus a
random fraction of a step ("random"), or 0-40 ms after the temporary folder of the checkpoint of
step N+1..N+3 appears ("save": during a checkpoint write, at a random point of it; a kill that
lands after the save finished is reported as such). After each kill every step-N checkpoint must hold
COMPLETE, load with AutoModelForCausalLM.from_pretrained, and have a trainer_state.pt that torch.load reads;
the next start must resume from the newest of them. Finally the command runs to the end: it must reach
max_steps, log each step once, and (unless --no-reference) end with the same weights, bit for bit,
as a run that was never killed. Prints a table of the kills and the command behind it; exits 1 if
any check failed. Tested in small by tests/test_crash.py.

--lag K: rollout.max_policy_lag=K on the fast engine (a sampler thread generates K batches ahead; each
checkpoint holds them, rollout/pipeline.py). --partial C: rollout.partial_rollouts on the fast engine with
chunks of C tokens (completions under way carried from step to step; each checkpoint holds them,
rollout/partial.py). --ranks N: the command is `torchrun --nproc_per_node N -m grpokit
train CONFIG` (distributed.strategy=ddp, gloo on CPU, sharded checkpoints); each kill is a SIGKILL to the
launcher and every process below it, at once (each rank). Results: benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def grpokit_cmd(ranks: int = 1) -> list[str]:
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
        return [*launcher, str(ranks), "-m", "grpokit"]
    script = Path(sys.executable).parent / "grpokit"
    return [str(script)] if script.exists() else [sys.executable, "-m", "grpokit.cli"]


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (torchrun's ranks run in process groups of their own), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # a process that ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL to the run and every process below it, all at once: the launcher and each rank."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def build(out: Path, max_steps: int, lag: int = 0, ranks: int = 1, partial: int = 0) -> Path:
    """Tiny model, prompts and config under out/ (lag: rollout.max_policy_lag on the fast engine; ranks > 1:
    DDP); returns the config path."""
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    task = get_task("countdown")
    tok = build_tokenizer(task, out / "model")
    build_tiny_llama(tok, size="test", seed=0).save_pretrained(out / "model")
    rows = task.make_rows("train", 200, 0)
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "rewards.py").write_text(
        "def count_sevens(completions, **kwargs):\n"
        "    return [c.count('7') / max(len(c), 1) for c in completions]\n"
    )
    lagged = f", engine: fast, max_policy_lag: {lag}" if lag else ""
    if partial:  # chunks of `partial` tokens of 8: as many versions as that takes
        lagged = f", engine: fast, partial_rollouts: true, partial_chunk_tokens: {partial}"
        lagged += f", max_staleness: {-(-8 // partial)}, temperature: 1.5"
    config = f"""\
model: {{name_or_path: {out / "model"}}}
data: {{train_path: {out / "prompts.jsonl"}}}
rewards: [{{function: '{out / "rewards.py"}:count_sevens'}}]
rollout: {{num_generations: 4, prompts_per_step: 4, max_completion_length: 8{lagged}}}
algorithm: {{beta: 0.04}}
optim: {{learning_rate: 3.0e-3, max_steps: {max_steps}}}
eval: {{at_start: false}}
logging: {{sample_every: 0, tensorboard: false}}
checkpoint: {{save_every: 1, keep_last: 2}}
output_dir: {out / "run"}
"""
    if ranks > 1:
        config += "distributed: {strategy: ddp}\n"
    (out / "config.yaml").write_text(config)
    (out / "reference.yaml").write_text(config.replace(str(out / "run"), str(out / "reference")))
    return out / "config.yaml"


def checkpoint_steps(run: Path) -> list[int]:
    from grpokit.checkpoint import list_checkpoints

    return [s for s, _ in list_checkpoints(run)]


def check_readable(run: Path) -> list[str]:
    """Problems with any step-N folder: missing COMPLETE, weights or trainer state that do not load (a sharded
    checkpoint's weights: its torch.distributed.checkpoint metadata)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from grpokit.checkpoint import DCP_DIR, MARKER, STATE_FILE, is_sharded_checkpoint

    problems = []
    root = run / "checkpoints"
    for p in sorted(root.glob("step-*")) if root.is_dir() else []:
        try:
            assert (p / MARKER).is_file(), f"no {MARKER}"
            if is_sharded_checkpoint(p):
                dcp.FileSystemReader(p / DCP_DIR).read_metadata()
            else:
                AutoModelForCausalLM.from_pretrained(p)
            state = torch.load(p / STATE_FILE, weights_only=False)
            assert state["step"] == int(p.name.split("-")[1]), f"state says step {state['step']}"
        except Exception as exc:  # report every unreadable checkpoint, not just the first
            problems.append(f"{p.name}: {type(exc).__name__}: {exc}")
    return problems


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):  # a line cut by the kill: the resume drops it
            pass
    return steps


def hidden_of(run: Path, pid: int) -> list[Path]:
    """Temporary folders a process left: .tmp-step-N-PID (a save) or .old-step-N-PID (a deletion); at several
    ranks .tmp-step-N-sharded (the ranks' save) too."""
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    return sorted({*root.glob(f".*-{pid}"), *root.glob(".tmp-*-sharded")})


def step_seconds(run: Path) -> float:
    """Wall time of the last logged step (1 s before there is one)."""
    path = run / "metrics.jsonl"
    try:
        last = json.loads(path.read_text().splitlines()[-1])
        return float(last.get("perf/step_time", 1.0))
    except (OSError, IndexError, json.JSONDecodeError):
        return 1.0


def wait_until(predicate, proc, timeout: float, poll: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--max-steps", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lag", type=int, default=0, help="rollout.max_policy_lag (fast engine)")
    ap.add_argument("--partial", type=int, default=0, help="rollout.partial_rollouts, chunks of C tokens")
    ap.add_argument("--ranks", type=int, default=1, help="trainer processes under torchrun (DDP)")
    ap.add_argument(
        "--out", type=Path, help="scratch folder (default: runs/kill_resume; --smoke: runs/kill_resume/smoke)"
    )
    ap.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the uninterrupted run used for the bit-for-bit check",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="2 kills (one at a random moment, one during a save) of an 8-step run, then the reference run: "
        "a check that the benchmark runs",
    )
    args = ap.parse_args()
    if args.smoke:
        args.kills, args.max_steps = 2, 8
    args.out = args.out or ROOT / "runs" / "kill_resume" / ("smoke" if args.smoke else "")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = build(out, args.max_steps, args.lag, args.ranks, args.partial)
    run = out / "run"
    cmd = [*grpokit_cmd(args.ranks), "train", str(config)]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    if args.ranks > 1:  # one thread per rank; no outer launcher's variables
        env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    rng = random.Random(args.seed)
    rows, failures = [], []
    t_start = time.monotonic()

    for i in range(args.kills):
        mode = "save" if i % 2 else "random"
        before = checkpoint_steps(run)
        log = out / f"attempt-{i:02d}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

        def resumed_line(log=log):
            return re.search(r"resuming from checkpoint step (\d+)", log.read_text())

        if before:
            started = wait_until(resumed_line, proc, 300, 0.01)
        else:  # a fresh start: wait for it to train
            started = wait_until(lambda: run.joinpath("metrics.jsonl").exists(), proc, 300, 0.01)
        if not started:
            failures.append(f"attempt {i}: the run did not resume (exit {proc.poll()}); see {log}")
            if proc.poll() is None:
                kill9(proc)
            break
        m = resumed_line()
        resumed_from = int(m.group(1)) if m else None
        if resumed_from != (before[-1] if before else None):
            failures.append(
                f"attempt {i}: resumed from {resumed_from}, newest complete checkpoint was {before[-1:]}"
            )
        t0, base = time.monotonic(), resumed_from or 0
        if mode == "random":  # k more steps, then a random fraction of a step
            k = rng.randint(0, 2)
            wait_until(lambda base=base, k=k: len(logged_steps(run)) >= base + k, proc, 300, 0.01)
            delay = rng.uniform(0.0, step_seconds(run))
            time.sleep(delay)
            moment = f"step {base + k} + {delay:.2f} s"
            caught = proc.poll() is None
        else:  # as soon as the checkpoint of step base + 1 + k is being written
            k = rng.randint(0, 2)
            target = base + 1 + k

            def writing(target=target):
                return any(
                    int(p.name.split("-")[2]) >= target for p in (run / "checkpoints").glob(".tmp-step-*")
                )

            caught = wait_until(writing, proc, 300, 0.0002)
            delay = rng.uniform(0.0, 0.04)
            time.sleep(delay)
            moment = f"save of step {target} + {1000 * delay:.0f} ms"
        if proc.poll() is not None:
            failures.append(
                f"attempt {i}: the run ended by itself (exit {proc.returncode}) before the kill; raise "
                "--max-steps"
            )
            break
        kill9(proc)
        at = time.monotonic() - t0
        left = hidden_of(run, proc.pid)
        if left:
            inside = ", ".join(sorted(p.name for p in left[0].iterdir())) or "empty"
            during = f"yes: {left[0].name.rsplit('-', 1)[0]} [{inside}]"
        elif mode == "save":
            during = "no: the save had finished" if caught else "no (missed)"
        else:
            during = "no"
        problems = check_readable(run)
        failures += [f"attempt {i}: unreadable checkpoint {p}" for p in problems]
        done = logged_steps(run)
        rows.append(
            dict(
                n=i + 1,
                mode=mode,
                at=f"{moment} ({at:.2f} s after the resume)",
                step=done[-1] if done else 0,
                during=during,
                ckpts=checkpoint_steps(run),
                resumed=resumed_from,
                ok=not problems,
            )
        )

    # The last start runs to the end.
    before = checkpoint_steps(run)
    log = out / "final.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    m = re.search(r"resuming from checkpoint step (\d+)", log.read_text())
    final_resumed = int(m.group(1)) if m else None
    if rc != 0:
        failures.append(f"final run exited {rc}; see {log}")
    if final_resumed != (before[-1] if before else None):
        failures.append(
            f"final run resumed from {final_resumed}, newest complete checkpoint was {before[-1:]}"
        )
    for i, row in enumerate(rows):  # each kill's resume is the next start's
        row["resumed"] = rows[i + 1]["resumed"] if i + 1 < len(rows) else final_resumed
    steps = logged_steps(run)
    if steps != list(range(1, args.max_steps + 1)):
        failures.append(
            f"metrics.jsonl steps are not 1..{args.max_steps} once each: {steps[:5]}...{steps[-5:]}"
        )
    failures += [f"after the final run: {p}" for p in check_readable(run)]
    elapsed = time.monotonic() - t_start

    same = "skipped"
    if not args.no_reference:
        from safetensors.torch import load_file

        subprocess.run(
            [*grpokit_cmd(args.ranks), "train", str(out / "reference.yaml")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            check=True,
        )
        a = load_file(out / "reference" / "final" / "model.safetensors")
        b = load_file(run / "final" / "model.safetensors")
        equal = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
        same = "yes" if equal else "NO"
        if not equal:
            failures.append("the killed-and-resumed run's final weights differ from the uninterrupted run's")

    # ------------------------------------------------------------------ report
    where = f", rollout.max_policy_lag={args.lag} (fast engine)" if args.lag else ""
    where += f", rollout.partial_rollouts with chunks of {args.partial} (fast engine)" if args.partial else ""
    where += f", {args.ranks} ranks (DDP, gloo)" if args.ranks > 1 else ""
    print(
        f"\n{len(rows)} SIGKILLs of `{' '.join(cmd)}` (tiny Llama, max_steps={args.max_steps}, "
        f"save_every=1, keep_last=2, seed={args.seed}{where})\n"
    )
    print(
        "| # | mode | killed at | last logged step | during a save? (temporary folder [contents]) | "
        "checkpoints after | resumed from |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['n']} | {r['mode']} | {r['at']} | {r['step']} | {r['during']} | {r['ckpts']} | "
            f"{r['resumed']} |"
        )
    # A resume succeeded when the next start loaded the newest checkpoint the kill left (none: started fresh).
    resumes = sum(r["ok"] and r["resumed"] == (r["ckpts"][-1] if r["ckpts"] else None) for r in rows)
    in_save = sum(r["during"].startswith("yes") for r in rows)
    print(f"\nresumes that loaded the newest complete checkpoint: {resumes} of {len(rows)}")
    print(
        f"kills during a checkpoint write: {in_save}; unreadable checkpoints seen: "
        f"{sum('unreadable' in f for f in failures)}"
    )
    print(
        f"final run: exit {rc}, steps logged 1..{steps[-1] if steps else 0} once each: "
        f"{steps == list(range(1, args.max_steps + 1))}; weights equal to an uninterrupted run: {same}"
    )
    print(
        f"wall time {elapsed:.0f} s; command: .venv/bin/python benchmarks/kill_resume.py --kills "
        f"{args.kills} --max-steps {args.max_steps} --seed {args.seed}"
        + (f" --lag {args.lag}" if args.lag else "")
        + (f" --partial {args.partial}" if args.partial else "")
        + (f" --ranks {args.ranks}" if args.ranks > 1 else "")
    )
    for f in failures:
        print("FAIL:", f)
    ok = not failures and resumes == len(rows) == args.kills
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
