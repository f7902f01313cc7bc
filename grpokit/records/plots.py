"""PNG plots of a run's metrics.jsonl and a Markdown report that embeds them.

    paths = plot_metrics("runs/x/metrics.jsonl", "runs/x/plots")   # reward.png, eval.png, kl.png, ...
    write_report("runs/x", title="countdown, Qwen2.5-0.5B", summary_rows=[("metric", "before", "after"),
                 ("eval/pass@1", "0.12", "0.41")], plots=paths)
    # read_metrics: grpokit.metrics.compute.read_metrics
    steps, values = series(read_metrics("runs/x/metrics.jsonl"), "reward/mean")

A plot whose metrics are all absent is skipped; missing keys and null values are gaps, never errors.
Figures are drawn on matplotlib's Agg canvas directly: no pyplot, no global backend switch, no display.
The metric names are defined in docs/metrics.md and grpokit/metrics/compute.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpokit.metrics.compute import (
    EVAL_PASS_AT_1,
    EVAL_PREFIX,
    METRICS_FILE,
    POLICY_CLIP_FRAC,
    POLICY_CLIP_FRAC_HIGH,
    POLICY_CLIP_FRAC_LOW,
    POLICY_KL,
    RESERVED_REWARD_NAMES,
    REWARD_MEAN,
    REWARD_PREFIX,
    ROLLOUT_COMPLETION_LEN_MAX,
    ROLLOUT_COMPLETION_LEN_MEAN,
    ROLLOUT_COMPLETION_LEN_MIN,
    ROLLOUT_TRUNCATED_FRAC,
    STEP,
    read_metrics,
)
from grpokit.values import finite_number


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric over the rows that have a step and a finite value for it."""
    xs, ys = [], []
    for row in rows:
        x, y = finite_number(row.get(STEP)), finite_number(row.get(key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def metric_keys(rows: Sequence[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def _reward_keys(keys: list[str]) -> list[str]:
    # reward/<fn> of each reward function: one part after reward/, not a statistic of the total.
    one_part = re.compile(re.escape(REWARD_PREFIX) + r"[^/]+")
    fns = [
        k
        for k in keys
        if one_part.fullmatch(k) and k.removeprefix(REWARD_PREFIX) not in RESERVED_REWARD_NAMES
    ]
    return [REWARD_MEAN] + sorted(fns)


def _eval_keys(keys: list[str]) -> list[str]:
    # eval/pass@1 first, then pass@k / maj@k whether k is written as a letter or a number (pass@8).
    sampled = re.compile(re.escape(EVAL_PREFIX) + r"(pass|maj)@\w+")
    found = [k for k in keys if sampled.fullmatch(k) and k != EVAL_PASS_AT_1]
    return [EVAL_PASS_AT_1] + sorted(found, key=lambda k: (not k.startswith(EVAL_PREFIX + "pass@"), k))


@dataclass(frozen=True)
class PlotSpec:
    name: str  # file name without .png
    title: str
    ylabel: str
    keys: Callable[[list[str]], list[str]]  # the metrics drawn, chosen from the keys present
    right: tuple[str, ...] = ()  # metrics drawn against a second y axis (a fraction beside token counts)
    right_label: str = ""


PLOTS = (
    PlotSpec("reward", "Training reward", "reward (mean over completions)", _reward_keys),
    PlotSpec("eval", "Held-out evaluation", "fraction of prompts", _eval_keys),
    PlotSpec("kl", "KL(π_θ ‖ π_ref) per token", "KL", lambda _: [POLICY_KL]),
    PlotSpec(
        "clip",
        "Clipped-token fractions",
        "fraction of completion tokens",
        lambda _: [POLICY_CLIP_FRAC, POLICY_CLIP_FRAC_LOW, POLICY_CLIP_FRAC_HIGH],
    ),
    PlotSpec(
        "lengths",
        "Completion lengths",
        "tokens",
        lambda _: [ROLLOUT_COMPLETION_LEN_MEAN, ROLLOUT_COMPLETION_LEN_MIN, ROLLOUT_COMPLETION_LEN_MAX],
        right=(ROLLOUT_TRUNCATED_FRAC,),
        right_label="truncated fraction",
    ),
)


def _smooth(ys: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def _draw(ax, xs: list[float], ys: list[float], label: str, color, *, dashed: bool = False) -> None:
    style = "--" if dashed else "-"
    marker = "o" if len(xs) <= 30 else None  # sparse series (eval every N steps) need visible points
    if len(xs) > 50:
        # Noisy per-step metrics: the raw values faint, a moving average over ~1/25 of the run on top.
        ax.plot(xs, ys, style, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(
            xs,
            _smooth(ys, max(2, len(xs) // 25)),
            style,
            color=color,
            label=f"{label} (smoothed)",
            linewidth=1.6,
        )
    else:
        ax.plot(xs, ys, style, color=color, marker=marker, markersize=3, label=label, linewidth=1.4)


def draw_plot(spec: PlotSpec, rows: Sequence[dict[str, Any]], keys: list[str]):
    """The matplotlib Figure of one plot (on the Agg canvas), or None when none of its metrics was logged.
    keys: the metric names of the run (the union of the rows' keys)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    left = [(k, *series(rows, k)) for k in dict.fromkeys(spec.keys(keys))]
    left = [s for s in left if s[1]]
    right = [(k, *series(rows, k)) for k in spec.right]
    right = [s for s in right if s[1]]
    if not left and not right:
        return None

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = [f"C{i}" for i in range(10)]
    handles_axes = [ax]
    for i, (key, xs, ys) in enumerate(left):
        _draw(ax, xs, ys, key, colors[i % 10])
    ax.set_xlabel("step")
    ax.set_ylabel(spec.ylabel)
    ax.grid(True, alpha=0.3)
    if right:
        ax2 = ax.twinx()
        for j, (key, xs, ys) in enumerate(right):
            _draw(ax2, xs, ys, key, colors[(len(left) + j) % 10], dashed=True)
        ax2.set_ylabel(spec.right_label)
        handles_axes.append(ax2)
    handles, labels = [], []
    for a in handles_axes:
        h, lab = a.get_legend_handles_labels()
        handles += h
        labels += lab
    ax.legend(handles, labels, loc="best", fontsize="small")
    ax.set_title(spec.title)
    fig.tight_layout()
    return fig


def _plot_one(spec: PlotSpec, rows: Sequence[dict[str, Any]], keys: list[str], out_dir: Path) -> Path | None:
    fig = draw_plot(spec, rows, keys)
    if fig is None:
        return None
    path = out_dir / f"{spec.name}.png"
    fig.savefig(path, format="png")
    return path


def plot_metrics(metrics_jsonl: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Draw reward.png, eval.png, kl.png, clip.png and lengths.png into out_dir from a metrics.jsonl.

    reward   reward/mean and each reward/<fn> against step
    eval     eval/pass@1, eval/pass@k, eval/maj@k (when the run evaluated)
    kl       policy/kl
    clip     policy/clip_frac, policy/clip_frac_low, policy/clip_frac_high
    lengths  rollout/completion_len_mean / _min / _max, and rollout/truncated_frac on a second axis
    Returns the paths written, in that order; a plot with none of its metrics is not written.
    """
    rows = read_metrics(metrics_jsonl)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = metric_keys(rows)
    paths = []
    for spec in PLOTS:
        path = _plot_one(spec, rows, keys, out)
        if path is not None:
            paths.append(path)
    return paths


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """plot_metrics of a finished run into its folder, best effort: plots are a convenience, and a failure to
    draw them is a warning, never a lost run (the trainer's last call)."""
    try:
        return plot_metrics(Path(run_dir) / METRICS_FILE, run_dir)
    except Exception as exc:
        print(f"warning: plots were not written: {exc}")
        return []


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(
    out_dir: str | os.PathLike,
    *,
    title: str,
    summary_rows: Sequence[Sequence[Any]],
    plots: Sequence[str | os.PathLike],
    notes: str = "",
) -> Path:
    """Write out_dir/report.md: the title, the summary table (header row first, e.g. metric / before /
    after), the notes, and each plot embedded by its path relative to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", ""]
    if summary_rows:
        header, *body = [list(r) for r in summary_rows]
        width = max(len(r) for r in summary_rows)
        lines.append("| " + " | ".join(_cell(c) for c in header + [""] * (width - len(header))) + " |")
        lines.append("|" + "|".join(" --- " for _ in range(width)) + "|")
        for row in body:
            lines.append("| " + " | ".join(_cell(c) for c in row + [""] * (width - len(row))) + " |")
        lines.append("")
    if notes:
        lines += [notes.rstrip(), ""]
    if plots:
        lines += ["## Plots", ""]
        for p in plots:
            p = Path(p)
            rel = Path(os.path.relpath(p.resolve(), out.resolve())).as_posix()
            rel = f"<{rel}>" if " " in rel else rel  # CommonMark: a destination with spaces goes in <>
            lines += [f"![{p.stem}]({rel})", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
