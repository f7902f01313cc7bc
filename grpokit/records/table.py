"""The completion table: the recorded completions of a run, one row each, in OUT/completions.parquet,
and `grpokit show RUN_DIR [--step N] [--worst K]`, which prints one step's rows in the terminal.

    append_step("runs/x", 50, samples)          # MetricLogger.log_samples calls this for every recorded step
    rows = read_table("runs/x")                 # [{"step": 50, "prompt": ..., "reward": 1.0, ...}, ...]
    print_table("runs/x", step=50, worst=5)     # the 5 lowest-reward completions of step 50

Columns (docs/report.md): step, prompt, completion, group, reward, reward/<fn> for each reward function,
advantage, prompt_len, completion_len, truncated; any other key of a sample becomes a column too. Numbers,
strings and booleans are stored as they are, anything else (chat messages) as JSON text; NaN as null.
A Parquet file cannot be appended to, so each recorded step rewrites it (atomically) with the rows of the
steps before it: a run resumed from a checkpoint replaces the rows of the steps it redoes.
Runs recorded before this table existed have only samples.jsonl; read_table reads that instead.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpokit.metrics.compute import (
    COMPLETIONS_FILE,
    METRICS_FILE,
    REWARD_PREFIX,
    SAMPLES_FILE,
    STEP,
    parse_record,
    record_step,
    reward_fn,
)
from grpokit.values import shorten

GROUP = "group"
REWARD = "reward"


class RunFolderError(ValueError):
    """A run folder that cannot be shown or reported on; the message says what is wrong and the fix."""


# ---------------------------------------------------------------------------------------------
# Rows


def _cell(value: Any) -> Any:
    """A value Parquet stores as it is (None, bool, int, finite float, str), or JSON text."""
    if hasattr(value, "item") and len(getattr(value, "shape", (1,))) == 0:
        value = value.item()  # numpy scalar or 0-d tensor
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return json.dumps(value, ensure_ascii=False, default=str)


def _row(step: int, sample: Mapping[str, Any]) -> dict[str, Any]:
    """One sample as a table row: {"step": step, **sample}, a "rewards" dict spread into reward/<fn> columns
    (a reward/<fn> key of the sample itself wins)."""
    row: dict[str, Any] = {STEP: step}
    per_fn = sample.get("rewards")
    for key, value in sample.items():
        if key != "rewards" or not isinstance(per_fn, Mapping):
            row[str(key)] = _cell(value)
    if isinstance(per_fn, Mapping):
        for name, value in per_fn.items():
            row.setdefault(reward_fn(str(name)), _cell(value))
    return row


def first_of_each_group(samples: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The first sample of each group (one completion per prompt, what the terminal shows); samples without
    a "group" key are each their own group."""
    out, last = [], object()
    for s in samples:
        group = s.get(GROUP, object())
        if group != last:
            out.append(s)
        last = group
    return out


# ---------------------------------------------------------------------------------------------
# The Parquet file


def _arrow_table(rows: list[dict[str, Any]]):
    import pyarrow as pa

    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    arrays = {}
    for name in columns:
        values = [row.get(name) for row in rows]
        try:
            arrays[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed kinds in one column (a str here, a number there)
            arrays[name] = pa.array([None if v is None else str(v) for v in values], type=pa.string())
    return pa.table(arrays)


def _concat(old, new):
    """old's rows then new's, the schemas unified: int and float columns widen, other clashes become text."""
    import pyarrow as pa

    try:
        return pa.concat_tables([old, new], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        for name in set(old.column_names) & set(new.column_names):
            if old.schema.field(name).type != new.schema.field(name).type:
                old = old.set_column(old.column_names.index(name), name, old[name].cast(pa.string()))
                new = new.set_column(new.column_names.index(name), name, new[name].cast(pa.string()))
        return pa.concat_tables([old, new], promote_options="permissive")


def append_step(out_dir: str | os.PathLike, step: int, samples: Sequence[Mapping[str, Any]]) -> Path:
    """Record one step's samples in out_dir/completions.parquet, after the rows of the steps before it (rows
    of this step or later ones, left by a run that is now resumed from an earlier checkpoint, are dropped)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path = Path(out_dir) / COMPLETIONS_FILE
    table = _arrow_table([_row(int(step), s) for s in samples])
    if path.exists():
        old = pq.read_table(path)
        table = _concat(old.filter(pc.less(old[STEP], pa.scalar(int(step)))), table)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)  # a reader never sees half a file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# Reading


def run_folder(run_dir: str | os.PathLike) -> Path:
    """run_dir as a folder that exists, or RunFolderError."""
    path = Path(run_dir)
    if not path.exists():
        raise RunFolderError(
            f"no run at {run_dir}: no such folder; give a run's output_dir (the folder with {METRICS_FILE})"
        )
    if not path.is_dir():
        raise RunFolderError(f"{run_dir} is a file; give a run's output_dir (the folder with {METRICS_FILE})")
    return path


def _read_samples_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = parse_record(line)
            if record is None:
                continue
            step = record_step(record)
            if step is not None:
                rows.append(_row(int(step), {k: v for k, v in record.items() if k != STEP}))
    return rows


def read_table(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every recorded completion of the run in run_dir, in step order: completions.parquet, or samples.jsonl
    for a run recorded before the table existed. RunFolderError when there is neither."""
    path = run_folder(run_dir)
    if (path / COMPLETIONS_FILE).is_file():
        import pyarrow.parquet as pq

        return pq.read_table(path / COMPLETIONS_FILE).to_pylist()
    if (path / SAMPLES_FILE).is_file():
        return _read_samples_jsonl(path / SAMPLES_FILE)
    raise RunFolderError(
        f"{run_dir} has no {COMPLETIONS_FILE}: the run recorded no completions; "
        "record them with logging.sample_every=N (every N steps) and logging.num_samples=K (K prompts, G "
        "completions each)"
    )


def _steps_text(steps: list[int]) -> str:
    shown = (
        [str(s) for s in steps] if len(steps) <= 12 else [*map(str, steps[:6]), "...", *map(str, steps[-5:])]
    )
    return ", ".join(shown)


def select(
    rows: list[dict[str, Any]], step: int | None = None, worst: int | None = None
) -> tuple[int, list[dict[str, Any]]]:
    """(the step, its rows): step None is the last recorded step; worst=K keeps the K lowest rewards,
    lowest first (rows without a reward last). RunFolderError when the step was not recorded."""
    steps = sorted({int(r[STEP]) for r in rows})
    if not steps:
        raise RunFolderError(
            "the completion table has no rows; record completions with logging.sample_every=N and "
            "logging.num_samples=K"
        )
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise RunFolderError(
            f"step {step} has no recorded completions; recorded steps: {_steps_text(steps)} (pick one with "
            "--step)"
        )
    chosen = [r for r in rows if r[STEP] == step]
    if worst is not None:

        def key(r):
            return (r.get(REWARD) is None, r.get(REWARD) if r.get(REWARD) is not None else 0.0)

        chosen = sorted(chosen, key=key)[:worst]
    return step, chosen


# ---------------------------------------------------------------------------------------------
# The terminal


def reward_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The reward/<fn> columns present in rows, in first-seen order."""
    seen: dict[str, None] = {}
    for r in rows:
        seen.update(dict.fromkeys(k for k in r if k.startswith(REWARD_PREFIX)))
    return list(seen)


_YES_NO: dict[Any, str] = {True: "yes", False: "no"}


def print_table(
    run_dir: str | os.PathLike,
    *,
    step: int | None = None,
    worst: int | None = None,
    width: int = 400,
    console=None,
) -> None:
    """Print the completions recorded at `step` (default: the last recorded step) of the run in run_dir,
    or only its `worst` lowest-reward ones, as a table: group, prompt (its end), completion, reward, each
    function's reward, advantage, completion length, truncated."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text  # model output is not rich markup

    from grpokit.records.progress import _fmt

    step, rows = select(read_table(run_dir), step, worst)
    fns = reward_columns(rows)
    plural = "s" if len(rows) != 1 else ""
    what = (
        f"the {len(rows)} lowest-reward completion{plural}"
        if worst is not None
        else f"{len(rows)} completion{plural}"
    )
    table = Table(title=f"{what} at step {step}", caption=str(run_dir), show_lines=True)
    columns: list[tuple[str, dict[str, Any]]] = [
        (GROUP, {"justify": "right"}),
        ("prompt", {"overflow": "fold", "ratio": 2}),
        ("completion", {"overflow": "fold", "ratio": 3}),
        (REWARD, {"justify": "right"}),
        *((f.removeprefix(REWARD_PREFIX), {"justify": "right"}) for f in fns),
        ("advantage", {"justify": "right"}),
        ("length", {"justify": "right"}),
        ("truncated", {}),
    ]
    for name, kw in columns:
        table.add_column(name, **kw)
    for r in rows:
        table.add_row(
            _fmt(r.get(GROUP)),
            Text(shorten(r.get("prompt"), width, keep_end=True)),
            Text(shorten(r.get("completion"), width)),
            _fmt(r.get(REWARD)),
            *(_fmt(r.get(f)) for f in fns),
            _fmt(r.get("advantage")),
            _fmt(r.get("completion_len")),
            _YES_NO.get(r.get("truncated"), "-"),
        )
    (console or Console()).print(table)
