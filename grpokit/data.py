"""The data stage (config section `data`): load rows, render and tokenize prompts, sample prompts per step.

    data = build_datasets(cfg.data, tokenizer, seed=cfg.seed)   # train / eval / sft / demo: rows -> split ->
                                                                # datasets
    rows = load_rows("train.jsonl")                      # .jsonl .json .parquet .csv, or a datasets folder
    rows, where = load_located_rows("train.jsonl")       # ... and where each row is: "train.jsonl line 57"
    train, held_out = split_rows(rows, eval_size=100, seed=0)
    ds = PromptDataset(train, tokenizer, max_prompt_length=512)
    sampler = PromptSampler(len(ds), prompts_per_step=8, seed=0)
    batch = [ds[i] for i in sampler.next()]              # each row is then repeated G times by the trainer

Rendering follows TRL (`maybe_apply_chat_template`): a string prompt is tokenized as-is with the
tokenizer's special tokens (BOS); a list of chat messages goes through the tokenizer's chat template
with the generation prompt, and is tokenized without special tokens because the template already
writes them. Prompts are tokenized once, here, so rollouts never re-tokenize.

Errors about one row name it as the user finds it in the file ("prompts.jsonl line 57", "prompts.parquet
row 56 (0-based)"), also after data.eval_size took held-out rows out of the middle: build_datasets carries
those labels beside the rows (never inside them, so reward functions see only the file's columns).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import logging
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from grpokit.config import ConfigError
from grpokit.task_registry import get_task
from grpokit.types import Prompt, PromptRow
from grpokit.values import short_repr

SUPPORTED_FILES = (".jsonl", ".json", ".parquet", ".csv")
OVERLONG_CHOICES = ("error", "truncate")

logger = logging.getLogger("grpokit.data")


class DataError(ValueError):
    """A problem with the user's data, in one line that names the problem and the fix."""


# ---------------------------------------------------------------------------------------------
# Loading


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


# ---------------------------------------------------------------------------------------------
# Columns and splitting


def _column_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    names: dict[str, None] = {}  # ordered union: JSON-lines rows need not share keys
    for row in rows:
        names.update(dict.fromkeys(row))
    return list(names)


def _check_prompt_column(columns: list[str], prompt_column: str) -> None:
    if prompt_column not in columns:
        raise DataError(
            f"no {prompt_column!r} column in the dataset (columns found: {columns}); "
            "name the prompt column with data.prompt_column"
        )


def _prompt_key(prompt: Any) -> str:
    # Same text <=> same key; a string and a one-message chat with that text are different prompts.
    if isinstance(prompt, str):
        return "s:" + prompt
    return "j:" + json.dumps(prompt, sort_keys=True, default=str)


def split_rows(
    rows: Sequence[dict[str, Any]], eval_size: int | float, seed: int, *, prompt_column: str = "prompt"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Hold out `eval_size` distinct prompts (an int, or a fraction in (0, 1) of the distinct prompts).

    The held-out set has one row per chosen prompt; the train set is every row whose prompt was
    not chosen (duplicates included), so no prompt text appears in both. Both keep the input order.
    Deterministic in `seed`.
    """
    train_idx, held_idx = split_indices(rows, eval_size, seed, prompt_column=prompt_column)
    return _take(rows, train_idx), _take(rows, held_idx)


def _take(items: Sequence[Any], idx: Sequence[int]) -> list[Any]:
    return [items[i] for i in idx]


def split_indices(
    rows: Sequence[dict[str, Any]], eval_size: int | float, seed: int, *, prompt_column: str = "prompt"
) -> tuple[list[int], list[int]]:
    """split_rows as indices into `rows` (train, held out), to split anything kept beside the rows too."""
    if not rows:
        raise DataError("cannot split an empty dataset; point to a file with at least one prompt")
    _check_prompt_column(_column_names(rows), prompt_column)
    first_row_of: dict[str, int] = {}
    for i, row in enumerate(rows):
        first_row_of.setdefault(_prompt_key(row.get(prompt_column)), i)
    n_unique = len(first_row_of)

    if isinstance(eval_size, bool) or not isinstance(eval_size, (int, float)):
        raise DataError(f"eval_size must be an int (rows) or a float in (0, 1) (fraction), got {eval_size!r}")
    if isinstance(eval_size, float):
        if not 0.0 < eval_size < 1.0:
            raise DataError(
                f"eval_size={eval_size} as a fraction must be in (0, 1); use an int for a row count"
            )
        n_eval = math.ceil(eval_size * n_unique)  # ceil, as datasets' train_test_split does for test_size
    else:
        if eval_size < 0:
            raise DataError(f"eval_size={eval_size} must be >= 0")
        n_eval = eval_size
    if n_eval == 0:
        return list(range(len(rows))), []
    if n_eval >= n_unique:
        raise DataError(
            f"eval_size={eval_size} would hold out {n_eval} of the dataset's {n_unique} distinct prompts, "
            "leaving none to train on; lower data.eval_size"
        )

    keys = list(first_row_of)  # first-occurrence order, so the shuffle below is deterministic
    random.Random(seed).shuffle(keys)
    held_keys = set(keys[:n_eval])
    held_idx = sorted(first_row_of[k] for k in held_keys)
    train_idx = [i for i, row in enumerate(rows) if _prompt_key(row.get(prompt_column)) not in held_keys]
    return train_idx, held_idx


# ---------------------------------------------------------------------------------------------
# Rendering and tokenizing


def _is_messages(prompt: Any) -> bool:
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt)
    )


def _is_blank(prompt: Prompt) -> bool:
    """An empty or whitespace-only string, or chat messages none of which has any content."""
    if isinstance(prompt, str):
        return not prompt.strip()
    return all(_is_blank(m["content"]) if isinstance(m["content"], str) else not m["content"] for m in prompt)


class PromptDataset:
    """Rows with their prompts rendered and tokenized once, at construction.

    overlong="error" rejects a prompt longer than max_prompt_length; "truncate" keeps its last
    max_prompt_length tokens (the question is usually at the end; the cost is that a truncated
    prompt loses its BOS and the head of its chat template) and counts it in `num_truncated`.
    where: each row's place as errors name it (load_located_rows: "prompts.jsonl line 57"); default "row i".
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        prompt_column: str = "prompt",
        max_prompt_length: int = 512,
        overlong: str = "error",
        system_prompt: str | None = None,
        where: Sequence[str] | None = None,
    ):
        if overlong not in OVERLONG_CHOICES:
            raise DataError(f"data.overlong_prompts={overlong!r} is not one of {list(OVERLONG_CHOICES)}")
        if (
            isinstance(max_prompt_length, bool)
            or not isinstance(max_prompt_length, int)
            or max_prompt_length < 1
        ):
            raise DataError(f"data.max_prompt_length={max_prompt_length!r} must be a positive int")
        if not rows:
            raise DataError("the dataset has no rows; point to a file with at least one prompt")
        self.column_names = _column_names(rows)  # every column, prompt included, in first-seen order
        _check_prompt_column(self.column_names, prompt_column)
        self.prompt_column = prompt_column
        self.max_prompt_length = max_prompt_length

        where = [f"row {i}" for i in range(len(rows))] if where is None else list(where)
        if len(where) != len(rows):
            raise ValueError(f"where has {len(where)} labels for {len(rows)} rows")
        prompts: list[Any] = [row.get(prompt_column) for row in rows]  # Prompts once _render accepts them
        texts = [self._render(w, p, tokenizer, system_prompt) for w, p in zip(where, prompts, strict=True)]
        ids = self._tokenize(texts, prompts, tokenizer)

        lengths = [len(x) for x in ids]
        if min(lengths) == 0:
            i = lengths.index(0)
            raise DataError(
                f"{where[i]}: prompt {short_repr(prompts[i])} renders to zero tokens; remove the row or "
                "fill in its prompt"
            )
        overlong_rows = [i for i, n in enumerate(lengths) if n > max_prompt_length]
        if overlong_rows and overlong == "error":
            i, more = overlong_rows[0], len(overlong_rows) - 1
            others = f" ({more} more rows are too)" if more else ""
            raise DataError(
                f"{where[i]}: prompt is {lengths[i]} tokens, longer than "
                f"data.max_prompt_length={max_prompt_length}{others}; raise data.max_prompt_length or set "
                "data.overlong_prompts=truncate"
            )
        for i in overlong_rows:
            ids[i] = ids[i][-max_prompt_length:]
            texts[i] = tokenizer.decode(ids[i], skip_special_tokens=False)
        self.num_truncated = len(overlong_rows)
        if overlong_rows:
            logger.warning(
                "%d of %d prompts are longer than data.max_prompt_length=%d tokens; kept the last %d tokens "
                "of each (data.overlong_prompts=truncate)",
                len(overlong_rows),
                len(ids),
                max_prompt_length,
                max_prompt_length,
            )

        self._ids = ids
        self._truncated = set(overlong_rows)
        self._texts = texts
        self._prompts = prompts
        self._columns = [{c: row.get(c) for c in self.column_names if c != prompt_column} for row in rows]

    @staticmethod
    def _render(where: str, prompt: Any, tokenizer: Any, system_prompt: str | None) -> str:
        if not isinstance(prompt, str) and not _is_messages(prompt):
            raise DataError(
                f"{where}: prompt {short_repr(prompt)} ({type(prompt).__name__}) is not a string or a list "
                "of "
                '{"role", "content"} messages; fix that row or point data.prompt_column at the prompt column'
            )
        if _is_blank(prompt):  # it would train on the system prompt or BOS alone, silently
            raise DataError(
                f"{where}: prompt {short_repr(prompt)} is empty; remove the row or fill in its prompt"
            )
        if isinstance(prompt, str):
            return prompt if system_prompt is None else system_prompt + "\n" + prompt
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{where}: prompt is a list of chat messages but the tokenizer has no chat_template; "
                "use a tokenizer with a chat template (e.g. an instruct model) or plain-string prompts"
            )
        messages = list(prompt)
        if system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    @staticmethod
    def _tokenize(texts: list[str], prompts: list[Any], tokenizer: Any) -> list[list[int]]:
        # Two batched calls: plain strings get the tokenizer's special tokens (BOS), rendered chats
        # do not, because the chat template already wrote them.
        ids: list[list[int]] = [[] for _ in texts]
        for is_str in (True, False):
            idx = [i for i, p in enumerate(prompts) if isinstance(p, str) == is_str]
            if idx:
                enc = tokenizer([texts[i] for i in idx], add_special_tokens=is_str)["input_ids"]
                for i, e in zip(idx, enc, strict=True):
                    ids[i] = list(e)
        return ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i: int) -> PromptRow:
        return PromptRow(
            prompt_ids=self._ids[i],
            prompt_text=self._texts[i],
            prompt=self._prompts[i],
            columns=self._columns[i],
            truncated=i in self._truncated,
        )


# ---------------------------------------------------------------------------------------------
# The one builder: train, eval, sft and the demo get their data here


@dataclass
class Datasets:
    train: PromptDataset
    eval: PromptDataset | None  # None: no held-out prompts
    task: Any | None  # the task (grpokit/task_registry.py) the rows came from: its reward is the default


def build_datasets(
    data_cfg: Any,
    tokenizer: Any,
    *,
    seed: int,
    train_rows: Sequence[dict[str, Any]] | None = None,
    eval_rows: Sequence[dict[str, Any]] | None = None,
    required_columns: Sequence[str] = (),
) -> Datasets:
    """The run's datasets as the config's `data` section says: rows from data.task, data.train_path or
    `train_rows`; held-out rows from `eval_rows`, data.eval_path, data.eval_size distinct prompts split off
    (seeded), or the task's test split; prompts rendered and tokenized once (PromptDataset).
    required_columns: columns every row needs besides the prompt (SFT: "completion").
    Errors about one row name it as load_located_rows does, or as "row i" of the rows given in code
    (`train_rows` before the held-out split, `eval_rows`)."""
    task = None
    train_where = eval_where = None
    if train_rows is None and data_cfg.task:
        try:
            task = get_task(data_cfg.task)
        except ValueError as exc:
            raise ConfigError(f"data.task: {exc}") from None
        train_rows = task.make_rows("train", data_cfg.task_train_size, seed)
        if eval_rows is None and data_cfg.eval_path is None:
            eval_rows = task.make_rows("test", data_cfg.eval_size or 500, seed)
    elif train_rows is None:
        if not data_cfg.train_path:
            raise ConfigError(
                "no training data: set data.train_path (a .jsonl/.parquet/.csv file) or data.task"
            )
        train_rows, train_where = load_located_rows(data_cfg.train_path)
    if eval_rows is None:
        if data_cfg.eval_path:
            eval_rows, eval_where = load_located_rows(data_cfg.eval_path)
        elif data_cfg.eval_size:
            train_where = train_where or [f"row {i}" for i in range(len(train_rows))]
            train_idx, eval_idx = split_indices(
                train_rows, data_cfg.eval_size, seed, prompt_column=data_cfg.prompt_column
            )
            eval_rows, eval_where = _take(train_rows, eval_idx), _take(train_where, eval_idx)
            train_rows, train_where = _take(train_rows, train_idx), _take(train_where, train_idx)
    for name, rows in (("data.train_path", train_rows), ("data.eval_path", eval_rows or [])):
        for column in required_columns:
            if rows and column not in _column_names(rows):
                raise DataError(
                    f"no {column!r} column in the dataset ({name}; columns found: {_column_names(rows)})"
                )
    kw = dict(
        prompt_column=data_cfg.prompt_column,
        max_prompt_length=data_cfg.max_prompt_length,
        overlong=data_cfg.overlong_prompts,
        system_prompt=data_cfg.system_prompt,
    )
    held_out = PromptDataset(eval_rows, tokenizer, **kw, where=eval_where) if eval_rows else None
    return Datasets(PromptDataset(train_rows, tokenizer, **kw, where=train_where), held_out, task)


def check_context_length(data: Datasets, model_config: Any, max_completion_length: int) -> None:
    """Longest prompt + max_completion_length must fit the model's positions: checked before any training."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    longest = max(
        len(d[i].prompt_ids) for d in (data.train, data.eval) if d is not None for i in range(len(d))
    )
    T = max_completion_length
    if longest + T > limit:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + rollout.max_completion_length={T} is {longest + T} "
            f"tokens, more than the model's max_position_embeddings={limit}; lower "
            f"rollout.max_completion_length to {max(limit - longest, 0)} or shorten the prompts "
            "(data.max_prompt_length, data.overlong_prompts=truncate)"
        )


# ---------------------------------------------------------------------------------------------
# Sampling


class PromptSampler:
    """An endless stream of row indices, `prompts_per_step` at a time.

    Epoch e visits every row once, in a permutation seeded by (seed, e); a batch that runs past
    the end of an epoch continues into the next (so a batch may, rarely, hold a row twice).
    `epoch` is the epoch the next index comes from, i.e. the number of completed passes.
    The state is two ints, so resuming gives exactly the batches an uninterrupted run would.
    """

    def __init__(self, num_rows: int, prompts_per_step: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise DataError(f"cannot sample from {num_rows} rows; the dataset needs at least one prompt")
        if prompts_per_step < 1:
            raise DataError(f"rollout.prompts_per_step={prompts_per_step} must be >= 1")
        if prompts_per_step > num_rows:
            raise DataError(
                f"rollout.prompts_per_step={prompts_per_step} is more than the {num_rows} rows in the "
                "dataset; lower rollout.prompts_per_step or add rows"
            )
        self.num_rows = num_rows
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into the current epoch's order
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        rng = np.random.default_rng([self.seed % 2**63, epoch])
        return rng.permutation(self.num_rows).tolist()

    def next(self) -> list[int]:
        batch: list[int] = []
        while len(batch) < self.prompts_per_step:
            take = min(self.prompts_per_step - len(batch), self.num_rows - self.position)
            batch += self._order[self.position : self.position + take]
            self.position += take
            if self.position == self.num_rows:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved stream; seed and shuffle come from the state, prompts_per_step from self."""
        if state["num_rows"] != self.num_rows:
            raise DataError(
                f"sampler state is for {state['num_rows']} rows but the dataset has {self.num_rows}; "
                "resume with the same dataset and data split"
            )
        self.seed = state["seed"]
        self.shuffle = state["shuffle"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._epoch_order(self.epoch)
