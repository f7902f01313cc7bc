"""Held-out prompts split off the rows: distinct prompts, seeded, no prompt text in both sets."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from typing import Any

from grpokit.data.files import DataError, check_prompt_column, column_names


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
    return take(rows, train_idx), take(rows, held_idx)


def take(items: Sequence[Any], idx: Sequence[int]) -> list[Any]:
    """items[i] for each i of idx: rows and whatever is kept beside them, split alike."""
    return [items[i] for i in idx]


def split_indices(
    rows: Sequence[dict[str, Any]], eval_size: int | float, seed: int, *, prompt_column: str = "prompt"
) -> tuple[list[int], list[int]]:
    """split_rows as indices into `rows` (train, held out), to split anything kept beside the rows too."""
    if not rows:
        raise DataError("cannot split an empty dataset; point to a file with at least one prompt")
    check_prompt_column(column_names(rows), prompt_column)
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
