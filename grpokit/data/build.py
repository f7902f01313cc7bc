"""The one builder: train, eval, sft and the demo get their datasets here, as the config's `data` says."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpokit.config import ConfigError
from grpokit.data.files import DataError, column_names, load_located_rows
from grpokit.data.prompts import PromptDataset
from grpokit.data.split import split_indices, take
from grpokit.data.tasks import get_task


@dataclass
class Datasets:
    train: PromptDataset
    eval: PromptDataset | None  # None: no held-out prompts
    task: Any | None  # the task (grpokit/data/tasks.py) the rows came from: its reward is the default


def build_datasets(
    data_cfg: Any,
    tokenizer: Any,
    *,
    seed: int,
    train_rows: Sequence[dict[str, Any]] | None = None,
    eval_rows: Sequence[dict[str, Any]] | None = None,
    required_columns: Sequence[str] = (),
    tools: list[dict[str, Any]] | None = None,
) -> Datasets:
    """The run's datasets as the config's `data` section says: rows from data.task, data.train_path or
    `train_rows`; held-out rows from `eval_rows`, data.eval_path, data.eval_size distinct prompts split off
    (seeded), or the task's test split; prompts rendered and tokenized once (PromptDataset).
    required_columns: columns every row needs besides the prompt (SFT: "completion").
    tools: the JSON schemas a chat template renders into chat prompts (tools.format=chat_template).
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
            eval_rows, eval_where = take(train_rows, eval_idx), take(train_where, eval_idx)
            train_rows, train_where = take(train_rows, train_idx), take(train_where, train_idx)
    for name, rows in (("data.train_path", train_rows), ("data.eval_path", eval_rows or [])):
        for column in required_columns:
            if rows and column not in column_names(rows):
                raise DataError(
                    f"no {column!r} column in the dataset ({name}; columns found: {column_names(rows)})"
                )
    kw = dict(
        prompt_column=data_cfg.prompt_column,
        max_prompt_length=data_cfg.max_prompt_length,
        overlong=data_cfg.overlong_prompts,
        system_prompt=data_cfg.system_prompt,
        tools=tools,
    )
    held_out = PromptDataset(eval_rows, tokenizer, **kw, where=eval_where) if eval_rows else None
    return Datasets(PromptDataset(train_rows, tokenizer, **kw, where=train_where), held_out, task)


def check_context_length(data: Datasets, model_config: Any, max_completion_length: int) -> int:
    """Longest prompt + max_completion_length must fit the model's positions: checked before any training.
    Returns that sum, the longest sequence a rollout or an evaluation of the run can hold (a tool episode's
    turns and results count within max_completion_length): what the vLLM engine sizes its context for."""
    longest = max(
        len(d[i].prompt_ids) for d in (data.train, data.eval) if d is not None for i in range(len(d))
    )
    T = max_completion_length
    limit = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return longest + T
    if longest >= limit:  # no completion length helps: the prompts themselves must get shorter
        keep = limit - T if limit - T >= 1 else limit // 2
        fit = "" if limit - T >= 1 else f" and rollout.max_completion_length={limit - keep}"
        raise ConfigError(
            f"the longest prompt ({longest} tokens) alone fills the model's max_position_embeddings={limit}, "
            f"leaving no room for a completion: the prompts alone exceed the context; shorten them, or "
            f"truncate them with data.max_prompt_length={keep}{fit} and data.overlong_prompts=truncate"
        )
    if longest + T > limit:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + rollout.max_completion_length={T} is {longest + T} "
            f"tokens, more than the model's max_position_embeddings={limit}; lower "
            f"rollout.max_completion_length to {max(limit - longest, 0)} or shorten the prompts "
            "(data.max_prompt_length, data.overlong_prompts=truncate)"
        )
    return longest + T
