"""Every algorithm preset on countdown from the same SFT warm start, budget and seeds: held-out accuracy per
step.

    python benchmarks/presets.py                        # warm start runs/demo/sft (from grpokit demo
                                                        # --model tiny); 25 runs, ~60 min on 1 idle thread
    python benchmarks/presets.py --model runs/demo/sft --steps 50 --presets grpo,dapo --seeds 0
    python benchmarks/presets.py --report-only          # redraw the report from runs/presets/runs.json

Writes benchmarks/results/presets.md (command, machine load, tables) and presets.png (held-out
accuracy against optimizer steps and against training seconds). The claim under test: "on
countdown from the same warm start, the DAPO preset reaches plain GRPO's final held-out accuracy in
fewer optimizer steps (table, 3 seeds)". grpo, dapo and the three newer objectives (cispo, sapo, gmpo) run
with --seeds (default 0,1,2), every other preset with the first seed only.

Every run gets the same config; only `algorithm.preset=<name>` differs (PRESETS in
grpokit/config/presets.py, docs/algorithm.md §9): the model folder (--model), data.task=countdown, 16 prompts
x G=8 completions of at most 16 tokens at T=1.0, the same steps and learning rate, mu=1 and one
minibatch (so one optimizer step per training step), the same seed. The held-out problems are the
same for every run and seed (countdown's test split drawn with seed 0, --eval-size of them); the
trainer evaluates them before step 1, every --eval-every steps and after the last step:
  - eval/mean@8: mean correctness of 8 samples per problem at T=1 (the unbiased sampled pass@1,
    DAPO's avg@k); the step comparison is made on this one;
  - eval/pass@1: greedy decoding, also reported.
"Reaches" = the first evaluated step whose accuracy is >= the grpo run's (same seed) final accuracy;
the steps resolution is --eval-every. Training seconds are the sum of perf/step_time (evaluation
excluded); on a shared machine they are noisy, so the load average is recorded with each run.

A warm start is any countdown-SFT'd model folder with its tokenizer; benchmarks/grpo_vs_ppo.py
--make-sft DIR builds one (~12 min), `grpokit demo --model tiny` leaves one in runs/demo/sft.

--smoke: grpo and dapo, seed 0, 2 steps of 2 prompts x G=2 with 8 tokens, 4 held-out problems evaluated every
step, from a random test-size model built in OUT/smoke-model (unless --model); the runs and the report in
runs/presets/smoke: a check that the benchmark runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from grpokit.config.presets import PRESETS

ALL_PRESETS = list(PRESETS)
# the presets of the claim and the three newer objectives the comparison is about, run with every seed
MULTI_SEED = ("grpo", "dapo", "cispo", "sapo", "gmpo")
K = 8  # eval.k: samples per held-out problem for mean@k


def config_overrides(args, preset: str, seed: int) -> list[str]:
    """The one config of every run; only algorithm.preset (and the seed, output folder) differ."""
    return [
        f"model.name_or_path={args.model}",
        "data.task=countdown",
        # the default (20000) is more than countdown's ~16,400 distinct train problems
        "data.task_train_size=10000",
        f"data.eval_size={args.eval_size}",
        f"output_dir={Path(args.out) / f'{preset}-seed{seed}'}",
        f"seed={seed}",
        "rollout.engine=fast",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.num_generations={args.G}",
        f"rollout.max_completion_length={args.max_completion_length}",
        "rollout.temperature=1.0",
        f"optim.learning_rate={args.lr}",
        f"optim.max_steps={args.steps}",
        f"algorithm.num_iterations={args.mu}",
        f"optim.num_minibatches={args.minibatches}",
        f"eval.k={K}",
        f"eval.every={args.eval_every}",
        "eval.batch_size=256",
        "checkpoint.save_every=0",  # only the end state the trainer always writes
        "checkpoint.resume=false",
        "logging.sample_every=0",
        "logging.tensorboard=false",
        f"algorithm.preset={preset}",
    ]


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run_one(args, preset: str, seed: int, eval_rows: list[dict]) -> dict:
    """One training run in this process; its held-out curve and times. A run folder holding a finished run of
    the same config (bench_run.json, written at its end) is read instead, so a stopped benchmark continues."""
    from grpokit.config import load_config
    from grpokit.metrics.compute import read_metrics
    from grpokit.trainer import Trainer

    overrides = config_overrides(args, preset, seed)
    cfg = load_config(None, overrides)
    done = Path(cfg.output_dir) / "bench_run.json"  # a finished run of this exact config: kept, not rerun
    if done.is_file() and (saved := json.loads(done.read_text())).get("overrides") == overrides:
        print(f"    (finished before: {done})", flush=True)
        return saved["result"]
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a fresh run, not a resume or an append
    load_before = load_avg()
    t = time.perf_counter()
    # The trainer draws its own per-run plots after training; this benchmark draws one figure for all runs.
    with mock.patch("grpokit.trainer.plot_run", lambda *a, **k: []):
        Trainer(cfg, eval_rows=eval_rows).train()
    wall = time.perf_counter() - t
    curve, train_s = [], 0.0
    for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl"):
        train_s += r.get("perf/step_time") or 0.0
        if r.get("eval/pass@1") is not None:
            curve.append(
                {
                    "step": int(r["step"]),
                    "train_s": train_s,
                    "pass@1": r["eval/pass@1"],
                    "mean@k": r[f"eval/mean@{K}"],
                }
            )
    result = {
        "preset": preset,
        "seed": seed,
        "curve": curve,
        "train_s": train_s,
        "wall_s": wall,
        "load": f"{load_before} -> {load_avg()}",
    }
    done.write_text(json.dumps({"overrides": overrides, "result": result}))
    return result


def first_reach(curve: list[dict], key: str, target: float) -> int | None:
    return next((p["step"] for p in curve if p[key] >= target - 1e-12), None)


# ---------------------------------------------------------------- report


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def reach_cells(runs: list[dict], grpo_final: dict[int, dict]) -> dict[tuple[str, int], dict | None]:
    """(preset, seed) -> {metric: first step at grpo's final value, or None}; None when no grpo run has that
    seed."""
    out = {}
    for r in runs:
        ref = grpo_final.get(r["seed"])
        out[r["preset"], r["seed"]] = (
            {key: first_reach(r["curve"], key, ref[key]) for key in ("mean@k", "pass@1")} if ref else None
        )
    return out


def curve_table(runs: list[dict], key: str, reach: dict, grpo_final: dict) -> list[str]:
    steps = sorted({p["step"] for r in runs for p in r["curve"]})
    head = [
        "preset",
        "seed",
        *[f"step {s}" for s in steps],
        "reaches grpo's final at step",
        "train s",
        "wall s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in runs:
        at = {p["step"]: p[key] for p in r["curve"]}
        ref = grpo_final.get(r["seed"])
        hits = reach[r["preset"], r["seed"]]
        if hits is None:
            cell = "—"
        else:
            cell = "not reached" if hits[key] is None else f"{hits[key]} (≥ {pct(ref[key])})"
        cells = [
            r["preset"],
            str(r["seed"]),
            *[pct(at.get(s)) for s in steps],
            cell,
            f"{r['train_s']:.0f}",
            f"{r['wall_s']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary_table(runs: list[dict], reach: dict) -> list[str]:
    head = [
        "preset",
        "seeds",
        f"mean@{K} start",
        f"mean@{K} final",
        f"reaches grpo's final mean@{K} at step (mean; reached in)",
        "pass@1 start",
        "pass@1 final",
        "reaches grpo's final pass@1 at step (mean; reached in)",
        "train s (mean)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for preset in dict.fromkeys(r["preset"] for r in runs):
        group = [r for r in runs if r["preset"] == preset]
        n = len(group)

        def mean(xs):
            return sum(xs) / len(xs)

        def reached(key, preset=preset, group=group, n=n, mean=mean):
            hits = [reach[preset, r["seed"]] for r in group]
            if all(h is None for h in hits):
                return "—"
            got = [h[key] for h in hits if h is not None and h[key] is not None]
            return f"{mean(got):.0f}; {len(got)}/{n}" if got else f"not reached; 0/{n}"

        lines.append(
            "| "
            + " | ".join(
                [
                    preset,
                    ",".join(str(r["seed"]) for r in group),
                    pct(mean([r["curve"][0]["mean@k"] for r in group])),
                    pct(mean([r["curve"][-1]["mean@k"] for r in group])),
                    reached("mean@k"),
                    pct(mean([r["curve"][0]["pass@1"] for r in group])),
                    pct(mean([r["curve"][-1]["pass@1"] for r in group])),
                    reached("pass@1"),
                    f"{mean([r['train_s'] for r in group]):.0f}",
                ]
            )
            + " |"
        )
    return lines


def eval_noise(runs: list[dict]) -> str:
    """How much the held-out numbers move without training, and between consecutive evaluations of one run."""
    parts = []
    for preset in dict.fromkeys(r["preset"] for r in runs):
        starts = [r["curve"][0]["mean@k"] for r in runs if r["preset"] == preset]
        if len(starts) > 1:
            parts.append(
                f"The warm start's mean@{K} measured with {preset}'s {len(starts)} seeds' sampling seeds "
                f"(same weights, same problems): {', '.join(pct(x) for x in starts)}."
            )
            break
    drops = [
        (a["mean@k"] - b["mean@k"], r, a, b)
        for r in runs
        for a, b in zip(r["curve"], r["curve"][1:], strict=False)
    ]
    if drops:
        d, r, a, b = max(drops, key=lambda x: x[0])
        parts.append(
            f"Largest fall between two consecutive evaluations of one run: {r['preset']} seed {r['seed']}, "
            f"mean@{K} {pct(a['mean@k'])} at step {a['step']} -> {pct(b['mean@k'])} at step {b['step']}."
        )
    return " ".join(parts)


def verdict(runs: list[dict], reach: dict) -> str:
    """The claim, answered from the numbers: DAPO reaches grpo's final mean@k in fewer steps, per seed."""
    dapo = [r for r in runs if r["preset"] == "dapo"]
    grpo = {r["seed"]: r for r in runs if r["preset"] == "grpo"}
    pairs = [
        (r["seed"], reach["dapo", r["seed"]]["mean@k"], reach["grpo", r["seed"]]["mean@k"])
        for r in dapo
        if r["seed"] in grpo
    ]
    if not pairs:
        return "The claim needs grpo and dapo runs with the same seeds; this run has none."
    sooner = [s for s, d, g in pairs if d is not None and d < g]
    parts = [
        f"seed {s}: dapo {'never' if d is None else f'at step {d}'}, grpo at step {g}" for s, d, g in pairs
    ]
    head = (
        f"**Claim (mean@{K}): DAPO reached plain GRPO's final held-out mean@{K} in fewer optimizer steps in "
        f"{len(sooner)} of {len(pairs)} seeds**"
    )

    def mean(xs):
        return sum(xs) / len(xs)

    seeds = [s for s, _, _ in pairs]
    finals = {
        p: mean([r["curve"][-1]["mean@k"] for r in runs if r["preset"] == p and r["seed"] in seeds])
        for p in ("grpo", "dapo")
    }
    tail = (
        f"Final mean@{K}, mean over these seeds: dapo {pct(finals['dapo'])}, grpo {pct(finals['grpo'])}."
        + (
            ""
            if any(d is None for _, d, _ in pairs)
            else f" Steps to grpo's final, mean over seeds: dapo {mean([d for _, d, _ in pairs]):.0f}, grpo "
            f"{mean([g for _, _, g in pairs]):.0f}."
        )
    )
    return f"{head} ({'; '.join(parts)}; steps are multiples of the eval interval). {tail}"


def plot(runs: list[dict], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    from matplotlib import colormaps

    tab20 = colormaps["tab20"]
    colors = {p: tab20(i % 20) for i, p in enumerate(ALL_PRESETS)}
    styles = ["-", "--", ":", "-."]
    # One line per preset: the mean over its seeds at each evaluated step (seeds share the eval steps).
    means = []
    for preset in dict.fromkeys(r["preset"] for r in runs):
        group = [r for r in runs if r["preset"] == preset]
        n = min(len(r["curve"]) for r in group)
        curve = [
            {
                k: sum(r["curve"][i][k] for r in group) / len(group)
                for k in ("step", "train_s", "mean@k", "pass@1")
            }
            for i in range(n)
        ]
        means.append((preset, len(group), curve))
    for row, (key, label) in enumerate(
        [("mean@k", f"held-out mean@{K} (T=1)"), ("pass@1", "held-out pass@1 (greedy)")]
    ):
        for col, (xkey, xlabel) in enumerate(
            [("step", "optimizer steps"), ("train_s", "training seconds (eval excluded)")]
        ):
            ax = axes[row][col]
            for i, (preset, n_seeds, curve) in enumerate(means):
                ax.plot(
                    [p[xkey] for p in curve],
                    [100 * p[key] for p in curve],
                    styles[i // 10 % 4],
                    color=colors.get(preset, "k"),
                    marker="o",
                    markersize=3,
                    linewidth=1.3,
                    label=f"{preset} ({n_seeds} seed{'s' if n_seeds > 1 else ''})",
                )
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{label}, %")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="x-small", ncol=2)
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, format="png")


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def git_commit() -> str:
    """HEAD when the runs start, and whether grpokit/ differs from it (the code the runs actually import)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "grpokit"], capture_output=True, text=True, cwd=root
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + (" (grpokit/ with uncommitted changes)" if dirty else "")


def write_report(
    args, command: str, runs: list[dict], started: str, load_start: str, total_s: float, commit: str
) -> Path:
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    grpo_final = {r["seed"]: r["curve"][-1] for r in runs if r["preset"] == "grpo"}
    reach = reach_cells(runs, grpo_final)
    budget = (
        f"{args.steps} steps x {args.prompts} prompts x G={args.G}, completions <= "
        f"{args.max_completion_length} tokens, T=1.0, lr {args.lr} (constant), mu={args.mu}, "
        f"{args.minibatches} minibatch(es) ({args.mu * args.minibatches} optimizer step(s) per step)"
    )
    png = results / f"{args.name}.png"
    plot(
        runs,
        png,
        f"countdown, every preset from the warm start {args.model}, held-out {args.eval_size} "
        f"problems\n{budget}",
    )
    md = [
        "# Algorithm presets on countdown, same warm start and budget",
        "",
        f"`{command}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores ({cpu_name()}), torch {torch.__version__}, "
        f"{args.threads} thread(s), shared with other jobs; load average (1, 5, 15 min) {load_start} at the "
        f"start; started {started}, {total_s / 60:.1f} min in all; grpokit commit {commit} at the start.",
        "",
        f"Warm start `{args.model}` (every run starts from it). Budget of every run: {budget}. Held-out: the "
        f"same {args.eval_size} countdown test problems for every run, evaluated at step 0, every "
        f"{args.eval_every} steps and at the end. Each run sets only `algorithm.preset` (docs/algorithm.md "
        "§9); every other key is equal (`config_overrides` in benchmarks/presets.py).",
        "",
        "**Which metric.** On this tiny model GRPO raises *sampled* accuracy but barely moves, or lowers, "
        f"*greedy* pass@1, so the step comparison is made on **mean@{K}**: the mean correctness of {K} "
        "samples per problem at T=1 (the unbiased estimate of sampled pass@1; DAPO's avg@k). Greedy pass@1 "
        'is shown as well, with the same comparison. "Reaches grpo\'s final" is the first evaluated step at '
        "which a "
        "run's accuracy is at least the grpo run's (same seed) accuracy at its last step; it is resolved to "
        f"the eval interval ({args.eval_every} steps), and grpo itself may reach its own final value before "
        f"the end. With {args.eval_size} problems one problem is {100 / args.eval_size:.1f} points of pass@1 "
        f"and mean@{K} moves in steps of {100 / (args.eval_size * K):.3f} points.",
        "",
        verdict(runs, reach),
        "",
        f"**Noise.** {eval_noise(runs)} A difference of a few points between two runs, or a step of the eval "
        "interval "
        f'in "reaches", is within what one run does from one evaluation to the next.',
        "",
        "## Summary (mean over seeds)",
        "",
        *summary_table(runs, reach),
        "",
        f"## Held-out mean@{K} (%) at each evaluated step",
        "",
        *curve_table(runs, "mean@k", reach, grpo_final),
        "",
        "## Held-out greedy pass@1 (%) at each evaluated step",
        "",
        *curve_table(runs, "pass@1", reach, grpo_final),
        "",
        f"![held-out accuracy against steps and training seconds]({png.name})",
        "",
        "Training seconds: the sum of `perf/step_time` (rollout, rewards, updates; evaluation excluded); "
        "wall s: the whole run with evaluations. DAPO's dynamic sampling generates extra rounds when groups "
        "are all-correct or all-wrong, so its steps cost more. Load average per run (before -> after): "
        + "; ".join(f"{r['preset']} s{r['seed']}: {r['load']}" for r in runs)
        + ".",
        "",
    ]
    path = results / f"{args.name}.md"
    path.write_text("\n".join(md))
    return path


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="runs/demo/sft",
        help="warm-start model folder (every run starts from it); "
        "the default is the SFT warm start that `grpokit demo --model tiny` writes (the recorded results' "
        "warm start)",
    )
    p.add_argument("--presets", default=",".join(ALL_PRESETS))
    p.add_argument(
        "--seeds",
        default="0,1,2",
        help=f"seeds of {' and '.join(MULTI_SEED)}; the other presets use the first",
    )
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_step")
    p.add_argument("--G", type=int, default=8, help="rollout.num_generations")
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--mu", type=int, default=1, help="algorithm.num_iterations: passes over each rollout batch"
    )
    p.add_argument(
        "--minibatches",
        type=int,
        default=1,
        help="optim.num_minibatches; with more than one (or mu > 1) every optimizer step after a batch's "
        "first is off-policy, where the objectives' clips and gates act",
    )
    p.add_argument("--eval-size", type=int, default=200, help="held-out test problems")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--out", help="run folders (metrics.jsonl, final model): runs/presets (--smoke: runs/presets/smoke)"
    )
    p.add_argument("--name", default="presets", help="file stem of the report: NAME.md and NAME.png")
    p.add_argument(
        "--results", help="where presets.md / presets.png go: benchmarks/results (--smoke: the --out folder)"
    )
    p.add_argument(
        "--report-only", action="store_true", help="redraw the report from --out/runs.json without training"
    )
    p.add_argument("--smoke", action="store_true", help="the smallest runs (see above)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(presets="grpo,dapo", seeds="0", steps=2, prompts=2, G=2, max_completion_length=8)
        vars(args).update(eval_size=4, eval_every=1)
    args.out = args.out or "runs/presets" + ("/smoke" if args.smoke else "")
    args.results = args.results or (args.out if args.smoke else str(Path(__file__).parent / "results"))
    if args.smoke and args.model == p.get_default("model") and not args.report_only:
        args.model = smoke_model(Path(args.out))
    return args


def smoke_model(out: Path) -> str:
    """A random test-size Llama with the countdown tokenizer, in OUT/smoke-model (--smoke)."""
    from grpokit.tasks import get_task
    from grpokit.tasks.tiny_model import build_tiny_llama
    from grpokit.tasks.tokenizer import build_tokenizer

    path = out / "smoke-model"
    tok = build_tokenizer(get_task("countdown"), path)
    build_tiny_llama(tok, size="test", seed=0).save_pretrained(path)
    return str(path)


def main(argv: list[str] | None = None) -> Path:
    from grpokit.tasks import get_task

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    presets = args.presets.split(",")
    unknown = [p for p in presets if p not in ALL_PRESETS]
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; allowed: {', '.join(ALL_PRESETS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    command = " ".join(
        ["python benchmarks/presets.py", *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))]
    )
    saved = Path(args.out) / "runs.json"
    if args.report_only:
        state = json.loads(saved.read_text())
        args = argparse.Namespace(
            **{"mu": 1, "minibatches": 1, "name": args.name, **state["args"], "results": args.results}
        )  # the settings the runs had
        path = write_report(
            args,
            state["command"],
            state["runs"],
            state["started"],
            state["load_start"],
            state["total_s"],
            state["commit"],
        )
        print(f"wrote {path} and {path.with_suffix('.png')} from {saved}")
        return path
    # One held-out set for every run and seed (the trainer would otherwise draw the test split with the run's
    # seed).
    eval_rows = get_task("countdown").make_rows("test", args.eval_size, 0)
    started, load_start, commit, t0 = (
        time.strftime("%Y-%m-%d %H:%M %Z"),
        load_avg(),
        git_commit(),
        time.perf_counter(),
    )
    runs = []
    for preset in presets:
        for seed in seeds if preset in MULTI_SEED else seeds[:1]:
            print(f"[{time.perf_counter() - t0:6.0f}s] {preset} seed {seed} ...", flush=True)
            r = run_one(args, preset, seed, eval_rows)
            print(
                "    "
                + "  ".join(
                    f"step {p['step']}: mean@{K} {pct(p['mean@k'])} pass@1 {pct(p['pass@1'])}"
                    for p in r["curve"]
                )
                + f"  ({r['train_s']:.0f}s train, {r['wall_s']:.0f}s wall)",
                flush=True,
            )
            runs.append(r)
    state = dict(
        args=vars(args),
        command=command,
        runs=runs,
        started=started,
        load_start=load_start,
        total_s=time.perf_counter() - t0,
        commit=commit,
    )
    saved.write_text(json.dumps(state, indent=1))  # --report-only redraws the report from this
    path = write_report(
        args, **{k: state[k] for k in ("command", "runs", "started", "load_start", "total_s", "commit")}
    )
    print(path.read_text())
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


if __name__ == "__main__":
    main()
