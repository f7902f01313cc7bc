"""The text a reward scores: one rule for the built-ins, the tasks' rewards and the manager's check of step offsets.

    completion_text("3*7+2")                                        # -> "3*7+2"
    completion_text([{"role": "assistant", "content": "3*7+2"}])    # -> "3*7+2"

A leaf module (no grpokit imports), so any reward or task module can import it at the top.
"""
from __future__ import annotations

from typing import Any


def completion_text(completion: Any) -> str:
    """A completion's text: the string, or the last message's content (conversational completions, as TRL)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return ""
