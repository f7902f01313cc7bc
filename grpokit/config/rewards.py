"""RewardSpec, one entry of a config's `rewards` list, and the on_timeout rule it shares with the config's
reward_on_timeout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pydantic import Field, field_serializer, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from grpokit.config.sections import Section

#: what a reward call that times out may score besides a number (reward_on_timeout, rewards[i].on_timeout)
ON_TIMEOUT_CHOICES = ("skip", "skip_group", "raise")


def check_on_timeout(value: Any) -> str | float | None:
    """A valid reward_on_timeout / on_timeout value (None = unset), or the error that lists the allowed
    ones."""
    if value is None or (isinstance(value, str) and value in ON_TIMEOUT_CHOICES):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise PydanticCustomError(
        "on_timeout",
        "Input should be 'skip', 'skip_group', 'raise' or a finite number (the score "
        "of each sample of a timed-out call)",
    )


class RewardSpec(Section):
    """One reward function in the combination: an entry of `rewards` in a config, or built in Python,
    where the function may come first: RewardSpec("math"), RewardSpec(my_fn, weight=0.5)."""

    function: str | Callable[..., Any] | None = None
    """Built-in name (math, format, overlong, length, code_tests; countdown, countdown_steps from the built-in
    tasks), package.module:function, path/to/file.py:function, or (from Python) the callable itself."""
    model: str | None = None
    """Instead of `function`: a reward model, a Hugging Face id or folder of an
    AutoModelForSequenceClassification with one label; it scores (prompt, completion) through its own chat
    template when it has one (grpokit/rewards/model.py). Its kwargs: batch_size, max_length, device."""
    weight: float = 1.0
    """Weight in the total reward."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed on every call (settings such as a regex or a length limit)."""
    name: str | None = None
    """Metric name (reward/<name>); default the function's name."""
    timeout: float | None = Field(None, ge=0)
    """Seconds one call of this function may take; default the config's reward_timeout; 0 = no limit."""
    on_timeout: str | float | None = None
    """What a call of this function that times out scores: skip, skip_group, raise or a number
    (reward_on_timeout); default the config's reward_on_timeout."""

    def __init__(self, function: Any = None, weight: Any = None, /, **data: Any) -> None:
        for key, value in (("function", function), ("weight", weight)):
            if value is not None:
                if key in data:
                    raise TypeError(f"RewardSpec got {key} twice (positionally and as {key}=)")
                data[key] = value
        super().__init__(**data)

    @model_serializer(mode="wrap")
    def _without_default_timeout(self, handler: Any) -> dict[str, Any]:
        # Unset, `timeout`, `on_timeout` and `model` (and `function` of a reward model) are left out: a
        # checkpoint saved before they existed still matches on resume.
        data: dict[str, Any] = handler(self)
        for key in ("timeout", "on_timeout", "model", "function"):
            if data.get(key) is None:
                data.pop(key, None)
        return data

    @model_validator(mode="after")
    def _function_or_model(self) -> RewardSpec:
        if (self.function is None) == (self.model is None):
            both = "both" if self.function is not None else "neither"
            raise ValueError(
                "a reward needs exactly one of `function` (a reward function) and `model` (a reward model); "
                f"this one has {both}"
            )
        return self

    @field_serializer("function")
    def _function_path(self, value: Any) -> str | None:
        # config.yaml records a callable by where it lives (package.module:qualname)
        return (
            value if isinstance(value, str) or value is None else f"{value.__module__}:{value.__qualname__}"
        )

    @field_validator("on_timeout", mode="plain")
    @classmethod
    def _on_timeout(cls, value: Any) -> Any:
        return check_on_timeout(value)

    @field_validator("function", mode="plain")
    @classmethod
    def _name_or_callable(cls, value: Any) -> Any:
        # plain: a config's value gets the usual message, without pydantic's per-union-member locations
        if value is None or isinstance(value, str) or callable(value):
            return value
        raise PydanticCustomError("string_type", "Input should be a valid string")
