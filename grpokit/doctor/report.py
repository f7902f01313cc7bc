"""The `grpokit doctor RUN_DIR` command: read the run folder, run the checks, print the report."""

from __future__ import annotations

import sys
from pathlib import Path

from grpokit.doctor.checks import run_checks
from grpokit.doctor.run import CONFIG_FILE, Finding, Run, row_step
from grpokit.doctor.thresholds import MIN_STEPS
from grpokit.metrics.compute import (
    METRICS_FILE,
    read_metrics,
)


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _load_config(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        import yaml

        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception:  # a broken config only costs the config-aware parts of the checks
        return None
    return data if isinstance(data, dict) else None


def doctor_main(run_dir: str) -> int:
    """Print the report for the run in run_dir (an output_dir, or a metrics.jsonl itself).
    Returns 0 when no check fires, 1 when some do, 2 (after one line on stderr) when there is no readable
    run."""
    path = Path(run_dir)
    metrics = path if path.is_file() else path / METRICS_FILE
    if not path.exists():
        return _error(f"no run at {run_dir}: no such file or directory")
    if not metrics.is_file():
        return _error(f"{run_dir} has no {METRICS_FILE} (is it a grpokit output_dir?)")
    try:
        rows = read_metrics(metrics)
    except (OSError, UnicodeDecodeError) as exc:
        return _error(f"cannot read {metrics}: {exc}")
    run = Run(rows, _load_config(metrics.parent / CONFIG_FILE))
    if not run.rows:
        return _error(f'{metrics} has no metric lines (a line needs a numeric "step")')
    findings, not_checked = run_checks(run)
    _print_report(run, findings, not_checked, str(run_dir))
    return 1 if findings else 0


def _print_report(run: Run, findings: list[Finding], not_checked: list[str], name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    steps = sorted({row_step(r) for r in run.rows})
    console.print(
        f"[bold]grpokit doctor[/bold] {name}: {len(steps)} logged steps ({steps[0]}-{steps[-1]}), "
        f"config {'read' if run.config else 'not found (config-aware checks skipped)'}"
    )
    if len(steps) < MIN_STEPS:
        console.print(
            f"only {len(steps)} logged steps: most checks need {MIN_STEPS} or more, so little can be judged "
            "yet"
        )
    if not_checked:
        console.print(f"not checked (metrics not logged): {', '.join(not_checked)}")
    if not findings:
        console.print("[green]no problems found[/green]")
        return
    table = Table(show_lines=True)
    table.add_column("check")
    table.add_column("steps", no_wrap=True)
    table.add_column("what was seen", overflow="fold")
    table.add_column("suggested fix", overflow="fold")
    for f in findings:
        color = "red" if f.severity == "error" else "yellow"
        table.add_row(
            f"[{color}]{f.check}[/{color}]\n{f.severity}", f"{f.steps[0]}-{f.steps[1]}", f.message, f.fix
        )
    console.print(table)
    n_err = sum(f.severity == "error" for f in findings)
    console.print(f"{len(findings)} finding(s): {n_err} error(s), {len(findings) - n_err} warning(s)")
