"""`grpokit report RUN_DIR`: one self-contained HTML page of a run, to open in any browser.

    path = write_html_report("runs/x")                                  # runs/x/report.html
    write_html_report("runs/demo/grpo", "runs/demo/report.html", title="grpokit demo", notes="...")

The page: a summary (the config's main keys, logged steps, time, held-out accuracy first and last, reward at
the start and the end, throughput), the plots (reward per function, held-out accuracy, KL, clip fractions,
entropy, lengths, zero-std fraction, throughput; drawn by records/plots.py as inline SVG), the findings of
`grpokit doctor` (grpokit/doctor/'s checks), and the recorded completions with their rewards and advantages
at the first and last recorded steps (records/table.py). Nothing is fetched when the page is viewed: no
script, no stylesheet or font from elsewhere (the SVG draws its text as paths). docs/report.md.
"""

from __future__ import annotations

import html
import io
import os
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpokit.metrics.compute import (
    EVAL_PASS_AT_1,
    EVAL_PREFIX,
    METRICS_FILE,
    PERF_ROLLOUT_TOKENS_PER_S,
    PERF_STEP_TIME,
    PERF_TRAIN_TOKENS_PER_S,
    POLICY_ENTROPY,
    REWARD_MEAN,
    REWARD_ZERO_STD_FRAC,
    STEP,
    read_metrics,
)
from grpokit.records.plots import PLOTS, PlotSpec, draw_plot, metric_keys, series
from grpokit.records.table import GROUP, REWARD, RunFolderError, read_table, reward_columns, run_folder
from grpokit.values import shorten

REPORT_FILE = "report.html"
CONFIG_FILE = "config.yaml"
SAMPLE_ROWS = 24  # completions shown per recorded step
TEXT_WIDTH = 400  # characters of a prompt (its end) or a completion (its start) shown

_by_name = {spec.name: spec for spec in PLOTS}
#: The report's plots, in page order: records/plots.py's PLOTS and three more.
REPORT_PLOTS: tuple[PlotSpec, ...] = (
    _by_name["reward"],
    _by_name["eval"],
    _by_name["kl"],
    _by_name["clip"],
    PlotSpec("entropy", "Policy entropy", "nats per completion token", lambda _: [POLICY_ENTROPY]),
    _by_name["lengths"],
    PlotSpec(
        "zero_std",
        "Groups with equal rewards (no learning signal)",
        "fraction of groups",
        lambda _: [REWARD_ZERO_STD_FRAC],
    ),
    PlotSpec(
        "throughput",
        "Throughput",
        "tokens / s",
        lambda _: [PERF_ROLLOUT_TOKENS_PER_S, PERF_TRAIN_TOKENS_PER_S],
        right=(PERF_STEP_TIME,),
        right_label="seconds per step",
    ),
)
CONFIG_KEYS = (
    "model.name_or_path",
    "data.task",
    "data.train_path",
    "algorithm.preset",
    "algorithm.loss_type",
    "algorithm.beta",
    "algorithm.advantage_estimator",
    "rollout.engine",
    "rollout.prompts_per_step",
    "rollout.num_generations",
    "rollout.max_completion_length",
    "optim.learning_rate",
    "optim.max_steps",
    "seed",
)

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2433; background: #f6f7f9;
       margin: 0; }
main { max-width: 1480px; margin: 0 auto; padding: 20px 28px 40px; }
h1 { font-size: 24px; margin: 4px 0 6px; }
h2 { font-size: 19px; margin: 28px 0 10px; border-bottom: 1px solid #d5d9e0; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.muted { color: #5b6475; } .notes { white-space: pre-wrap; }
table { border-collapse: collapse; background: #fff; margin: 6px 0 10px; }
th, td { border: 1px solid #d5d9e0; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #eef1f5; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.cards { display: flex; flex-wrap: wrap; gap: 18px; align-items: flex-start; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 14px; }
figure.plot { margin: 0; background: #fff; border: 1px solid #d5d9e0; border-radius: 6px; padding: 8px; }
figure.plot svg { display: block; width: 100%; height: auto; }
figcaption { font-size: 12px; color: #5b6475; margin-top: 4px; }
.error { color: #b42318; font-weight: 600; } .warning { color: #b54708; font-weight: 600; }
.ok { color: #067647; font-weight: 600; }
td.text { white-space: pre-wrap; word-break: break-word;
          font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12.5px; max-width: 560px; }
tr.best td.reward { background: #e7f6ec; } tr.worst td.reward { background: #fdecea; }
"""


# ---------------------------------------------------------------------------------------------
# Small pieces


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, numeric_from: int = 1) -> str:
    """An HTML table; cells from column numeric_from on are numbers (right-aligned)."""
    head = f"<thead><tr>{''.join(f'<th>{_e(h)}</th>' for h in header)}</tr></thead>" if any(header) else ""
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_e(_num(c))}</td>' if i >= numeric_from else f"<td>{_e(c)}</td>"
            for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _setting(config: dict | None, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _load_config(run: Path) -> dict | None:
    path = run / CONFIG_FILE
    if not path.is_file():
        return None
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception:  # a broken config.yaml costs only the config table and the doctor's config-aware parts
        return None
    return data if isinstance(data, dict) else None


def _read_metrics(run: Path, run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    metrics = run / METRICS_FILE
    if not metrics.is_file():
        raise RunFolderError(
            f"{run_dir} has no {METRICS_FILE}; give a run's output_dir (grpokit train writes {METRICS_FILE} "
            "there)"
        )
    rows = [r for r in read_metrics(metrics) if isinstance(r.get(STEP), (int, float))]
    if not rows:
        raise RunFolderError(
            f'{metrics} has no metric lines (a line needs a numeric "step"); train at least one step first'
        )
    return rows


# ---------------------------------------------------------------------------------------------
# Sections


def _summary(rows: list[dict[str, Any]], config: dict | None) -> str:
    steps = sorted({int(r[STEP]) for r in rows})
    times = series(rows, PERF_STEP_TIME)[1]
    run_rows = [("logged steps", f"{len(steps)} ({steps[0]}-{steps[-1]})")]
    if times:
        run_rows.append(
            ("training time", f"{sum(times):.1f} s ({statistics.median(times):.3g} s per step, median)")
        )
    for key in (PERF_ROLLOUT_TOKENS_PER_S, PERF_TRAIN_TOKENS_PER_S):
        if values := series(rows, key)[1]:
            run_rows.append((f"{key} (median)", f"{statistics.median(values):.4g}"))
    run_rows += [
        (key, _setting(config, key)) for key in CONFIG_KEYS if _setting(config, key) not in (None, "")
    ]
    cards = [f"<div><h3>Run</h3>{_table(['', ''], run_rows, numeric_from=2)}</div>"]

    eval_rows = [r for r in rows if r.get(EVAL_PASS_AT_1) is not None]
    if eval_rows:
        first, last = eval_rows[0], eval_rows[-1]
        keys = [k for k in metric_keys(eval_rows) if k.startswith(EVAL_PREFIX)]
        body = [(k, first.get(k), last.get(k)) for k in keys]
        header = ["held-out", f"step {int(first[STEP])}", f"step {int(last[STEP])}"]
        cards.append(f"<div><h3>Held-out evaluation</h3>{_table(header, body)}</div>")

    train = [r for r in rows if r.get(REWARD_MEAN) is not None]
    if train:
        n = max(1, len(train) // 10)
        keys = _by_name["reward"].keys(metric_keys(train))  # reward/mean and each reward/<fn>

        def mean(part, k):
            return statistics.fmean(v) if (v := [r[k] for r in part if r.get(k) is not None]) else None

        body = [(k, mean(train[:n], k), mean(train[-n:], k)) for k in keys]
        header = ["training reward", f"first {n} logged step(s)", f"last {n}"]
        cards.append(f"<div><h3>Reward</h3>{_table(header, body)}</div>")
    return '<section id="summary"><h2>Summary</h2><div class="cards">' + "".join(cards) + "</div></section>"


def _svg(fig, name: str) -> str:
    """The figure as inline SVG whose ids (and the references to them) start with `name`-: matplotlib numbers
    its groups figure_1, axes_1, ... in every SVG, and ids must be unique in a page."""
    import matplotlib

    buf = io.StringIO()
    # text as paths: no font to fetch or to lack; a fixed salt: the same run gives the same page
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": name}):
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    text = text[text.index("<svg") :]  # drop the XML prologue and DOCTYPE: the SVG goes inline
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{name}-{m.group(1)}"', text)
    return re.sub(r'(url\(#|href="#)([^)"]+)', lambda m: f"{m.group(1)}{name}-{m.group(2)}", text)


def _plots(rows: list[dict[str, Any]]) -> str:
    keys = metric_keys(rows)
    figures, absent = [], []
    for spec in REPORT_PLOTS:
        fig = draw_plot(spec, rows, keys)
        if fig is None:
            absent.append(f"{spec.title} ({', '.join(dict.fromkeys([*spec.keys(keys), *spec.right]))})")
            continue
        drawn = ", ".join(k for k in dict.fromkeys([*spec.keys(keys), *spec.right]) if series(rows, k)[0])
        figures.append(
            f'<figure class="plot" id="plot-{spec.name}" data-plot="{spec.name}">{_svg(fig, spec.name)}'
            f"<figcaption>{_e(drawn)}</figcaption></figure>"
        )
    note = (
        f'<p class="muted">Not logged by this run, so not drawn: {_e("; ".join(absent))}.</p>'
        if absent
        else ""
    )
    return f'<section id="plots"><h2>Metrics</h2><div class="grid">{"".join(figures)}</div>{note}</section>'


def _doctor(rows: list[dict[str, Any]], config: dict | None) -> str:
    from grpokit.doctor import MIN_STEPS, Run, run_checks

    run = Run(rows, config)
    findings, not_checked = run_checks(run)
    parts = [
        '<section id="doctor"><h2>Doctor</h2><p class="muted">The checks of <code>grpokit doctor</code> '
        "(docs/doctor.md), on this run's metrics.</p>"
    ]
    n_steps = len({int(r[STEP]) for r in rows})
    if n_steps < MIN_STEPS:
        parts.append(
            f"<p>Only {n_steps} logged steps: most checks need {MIN_STEPS} or more, so little can be judged "
            "yet.</p>"
        )
    if not_checked:
        parts.append(f'<p class="muted">Not checked (metrics not logged): {_e(", ".join(not_checked))}.</p>')
    if not findings:
        parts.append('<p class="ok">No problems found.</p>')
    else:
        body = "".join(
            f'<tr><td><span class="{f.severity}">{_e(f.check)}</span><br>{_e(f.severity)}</td><td '
            f'class="num">{f.steps[0]}-{f.steps[1]}</td>'
            f"<td>{_e(f.message)}</td><td>{_e(f.fix)}</td></tr>"
            for f in findings
        )
        parts.append(
            "<table><thead><tr><th>check</th><th>steps</th><th>what was seen</th><th>suggested "
            f"fix</th></tr></thead><tbody>{body}</tbody></table>"
        )
    return "".join(parts) + "</section>"


def _sample_table(step: int, rows: list[dict[str, Any]]) -> str:
    fns = reward_columns(rows)
    rewards = [r[REWARD] for r in rows if isinstance(r.get(REWARD), (int, float))]
    best, worst = (max(rewards), min(rewards)) if rewards and max(rewards) > min(rewards) else (None, None)
    header = [
        "group",
        "prompt",
        "completion",
        "reward",
        *(f.removeprefix("reward/") for f in fns),
        "advantage",
        "length",
        "truncated",
    ]
    body = []
    for r in rows[:SAMPLE_ROWS]:
        cls = "best" if r.get(REWARD) == best else "worst" if r.get(REWARD) == worst else ""
        cells = [
            f'<td class="num">{_e(_num(r.get(GROUP)))}</td>',
            f'<td class="text">{_e(shorten(r.get("prompt"), TEXT_WIDTH, keep_end=True))}</td>',
            f'<td class="text">{_e(shorten(r.get("completion"), TEXT_WIDTH))}</td>',
            f'<td class="num reward">{_e(_num(r.get(REWARD)))}</td>',
            *(f'<td class="num">{_e(_num(r.get(f)))}</td>' for f in fns),
            *(
                f'<td class="num">{_e(_num(r.get(k)))}</td>'
                for k in ("advantage", "completion_len", "truncated")
            ),
        ]
        body.append(f'<tr class="{cls}">' + "".join(cells) + "</tr>")
    more = (
        f'<p class="muted">{len(rows) - SAMPLE_ROWS} more at this step: grpokit show RUN_DIR --step '
        f"{step}</p>"
        if len(rows) > SAMPLE_ROWS
        else ""
    )
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    return (
        "<h3>Step "
        f"{step}</h3><table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{more}"
    )


def _samples(run: Path) -> str:
    parts = ['<section id="samples"><h2>Sample completions</h2>']
    try:
        rows = read_table(run)
    except RunFolderError as exc:
        return "".join(parts) + f'<p class="muted">{_e(exc)}</p></section>'
    steps = sorted({int(r[STEP]) for r in rows})
    parts.append(
        f'<p class="muted">Recorded at {len(steps)} step(s); the first and the last are shown (highest '
        "reward green, "
        "lowest red). Every recorded step: <code>grpokit show RUN_DIR --step N</code>.</p>"
    )
    for step in dict.fromkeys([steps[0], steps[-1]]) if steps else []:
        parts.append(_sample_table(step, [r for r in rows if r[STEP] == step]))
    return "".join(parts) + "</section>"


# ---------------------------------------------------------------------------------------------
# The page


def write_html_report(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    title: str | None = None,
    notes: str = "",
) -> Path:
    """Write the report of the run in run_dir (an output_dir with metrics.jsonl) to `out` (default
    run_dir/report.html); returns its path. RunFolderError when run_dir is not a readable run."""
    run = run_folder(run_dir)
    rows = _read_metrics(run, run_dir)
    config = _load_config(run)
    title = title or f"grpokit run {run.resolve().name}"
    body = "".join(
        [
            f"<h1>{_e(title)}</h1>",
            f'<p class="muted">{_e(run.resolve())}</p>',
            f'<p class="notes">{_e(notes)}</p>' if notes else "",
            _summary(rows, config),
            _plots(rows),
            _doctor(rows, config),
            _samples(run),
        ]
    )
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_e(title)}</title>'
        f"<style>{CSS}</style></head><body><main>{body}</main></body></html>\n"
    )
    path = Path(out) if out is not None else run / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
