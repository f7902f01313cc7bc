"""Dataset files as rows: .jsonl, .json, .parquet, .csv or a `datasets` folder, each row a plain dict, with
where each row is in its file ("prompts.jsonl line 57", "prompts.parquet row 56 (0-based)") for errors."""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUPPORTED_FILES = (".jsonl", ".json", ".parquet", ".csv")


class DataError(ValueError):
    """A problem with the user's data, in one line that names the problem and the fix."""


def load_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read every row of a dataset file or `datasets` folder as a plain dict."""
    return load_located_rows(path)[0]


def load_located_rows(path: str | os.PathLike) -> tuple[list[dict[str, Any]], list[str]]:
    """load_rows, and beside each row where the user finds it, as errors name it: the line of a text
    file ("d.jsonl line 57", "d.csv line 3"), the 0-based index of a JSON list item ("d.json item 56
    (0-based)") or of a Parquet / datasets row ("d.parquet row 56 (0-based)")."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(
            f"dataset not found: {str(path)!r} (resolved to {p.resolve()}); check data.train_path / "
            "data.eval_path"
        )
    if p.is_dir():
        rows, where = _read_datasets_folder(p)
    else:
        reader = _READERS.get(p.suffix.lower())
        if reader is None:
            raise DataError(
                f"unsupported dataset file {p.name!r}; use one of {', '.join(SUPPORTED_FILES)} "
                "or a folder written by datasets' save_to_disk"
            )
        rows, where = reader(p)
    if not rows:
        raise DataError(f"dataset {str(path)!r} has no rows; point to a file with at least one prompt")
    return rows, where


def _decode(path: Path) -> str:
    """The file as text; a byte that is not UTF-8 is a DataError naming its line and column."""
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        line_start = data.rfind(b"\n", 0, e.start) + 1
        column = len(data[line_start : e.start].decode("utf-8")) + 1  # in characters, as an editor counts
        raise DataError(
            f"{path.name}: line {line} is not valid UTF-8 (byte 0x{data[e.start]:02x} at column {column}); "
            "re-save the file as UTF-8"
        ) from None


def _as_row(obj: Any, where: str, path: Path) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DataError(
            f"{path.name}: {where} is a JSON {type(obj).__name__}, not an object; write one {{...}} per row"
        )
    return obj


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    rows, where = [], []
    for lineno, line in enumerate(
        io.StringIO(_decode(path), newline=None), start=1
    ):  # \n, \r\n or \r, as open()
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path.name}: line {lineno} is not valid JSON ({e.msg}); fix or remove that line"
            ) from None
        rows.append(_as_row(obj, f"line {lineno}", path))
        where.append(f"{path.name} line {lineno}")
    return rows, where


def _read_json(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    text = _decode(path)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # more than one top-level value: JSON lines in a .json file
            return _read_jsonl(path)
        raise DataError(f"{path.name}: not valid JSON ({e.msg} at line {e.lineno}); fix the file") from None
    if isinstance(obj, dict):  # a single JSON-lines row is also a valid JSON document
        return [obj], [f"{path.name} line 1"]
    if not isinstance(obj, list):
        raise DataError(
            f"{path.name}: holds a JSON {type(obj).__name__}; write a list of objects or one object per line"
        )
    where = [f"{path.name} item {i} (0-based)" for i in range(len(obj))]
    return [_as_row(o, f"item {i}", path) for i, o in enumerate(obj)], where


def _read_parquet(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path.name}: cannot read as Parquet ({e}); check the file") from None
    return rows, [f"{path.name} row {i} (0-based)" for i in range(len(rows))]


def _read_csv(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    # Read as csv.DictReader does (blank lines skipped, missing trailing fields None), but keeping the
    # line each record starts on: a quoted cell may span lines. Columns whose every non-empty cell is
    # an int (or a float) become ints (floats), as pandas.read_csv and therefore datasets' CSV loader
    # do; everything else stays a string.
    records = csv.reader(io.StringIO(_decode(path), newline=""))
    names = next(records, None) or []
    cells: list[dict[str, str | None]] = []
    where: list[str] = []
    while True:
        line = records.line_num + 1  # the line the next record starts on (its quoted cells may span lines)
        record = next(records, None)
        if record is None:
            break
        if not record:
            continue
        if len(record) > len(names):
            raise DataError(
                f"{path.name}: line {line} has more fields than the header {names}; quote fields that "
                "contain commas"
            )
        cells.append(dict(zip(names, record + [None] * (len(names) - len(record)), strict=True)))
        where.append(f"{path.name} line {line}")
    columns = {name: _infer_csv_column([row[name] for row in cells]) for name in names}
    return [{name: columns[name][i] for name in names} for i in range(len(cells))], where


def _infer_csv_column(values: list[str | None]) -> list[Any]:
    present = [v for v in values if v not in ("", None)]
    if not present:
        return values
    for cast in (int, float):
        try:
            [cast(v) for v in present]
        except ValueError:
            continue
        return [cast(v) if v not in ("", None) else None for v in values]
    return values


def _read_datasets_folder(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path} is a folder; reading a datasets folder needs `pip install datasets`"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise DataError(
            f"{path} is a folder but not one written by datasets' save_to_disk; point to a data file "
            f"({', '.join(SUPPORTED_FILES)}) or a save_to_disk folder"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(
                f"{path} holds splits {sorted(ds)} but no 'train' split; save the split to train on "
                "with ds[name].save_to_disk(folder) and point to that folder"
            )
        ds, name = ds["train"], f"{path.name} (train split)"
    else:
        name = path.name
    return ds.to_list(), [f"{name} row {i} (0-based)" for i in range(len(ds))]


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}


def column_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Every column of the rows, in first-seen order."""
    names: dict[str, None] = {}  # ordered union: JSON-lines rows need not share keys
    for row in rows:
        names.update(dict.fromkeys(row))
    return list(names)


def check_prompt_column(columns: list[str], prompt_column: str) -> None:
    """A DataError naming the columns when the prompt column is not among them."""
    if prompt_column not in columns:
        raise DataError(
            f"no {prompt_column!r} column in the dataset (columns found: {columns}); "
            "name the prompt column with data.prompt_column"
        )
