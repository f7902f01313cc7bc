"""The small value helpers every module uses the same way: what counts as a number, and how text is shortened.

    real_number(v)        # a float, or None when v is not a real number (NaN and inf are numbers)
    finite_number(v)      # a float, or None when v is not a finite real number
    shorten(text, 60)     # at most 60 characters, "…" where it was cut; keep_end=True keeps the end
    short_repr(v)         # repr(v) on one line, shortened: how error messages quote a user's value

The rules: a real number is an int or a float, a numpy scalar of either, or a 0-d tensor of either (its
.item()); a bool is not one (True is a yes, not a 1), nor is None, a string ("1.5") or a container.
This module imports nothing from grpokit.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def real_number(value: Any) -> float | None:
    """`value` as a float when it is a real number (the rules above), else None."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d tensor or numpy scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite real number, else None."""
    x = real_number(value)
    return x if x is not None and math.isfinite(x) else None


def shorten(text: Any, limit: int, *, keep_end: bool = False) -> str:
    """str(text) (None: "") cut to at most `limit` characters, the cut marked with "…": its start, or its
    end with keep_end (the end of a prompt is its question)."""
    text = "" if text is None else str(text)
    if len(text) <= limit:
        return text
    return "…" + text[-(limit - 1) :] if keep_end else text[: limit - 1] + "…"


def short_repr(value: Any, limit: int = 60) -> str:
    """repr(value) with its line breaks escaped (an error message is one line), shortened to `limit`."""
    return shorten(repr(value).replace("\n", "\\n"), limit)
