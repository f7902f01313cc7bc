"""Reading a config: a YAML file plus dotted overrides become a validated model, or a ConfigError of one
line; describe() lists every key with its default and docstring.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar, overload

import yaml
from pydantic import BaseModel, ValidationError

from grpokit.config.presets import _apply_preset
from grpokit.config.schema import Config
from grpokit.config.sections import ConfigError


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[int(part)]
            continue
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, (dict, list)):
            raise ConfigError(f"override {key}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = nxt
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    out = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. algorithm.beta=0.0)")
        key, raw = item.split("=", 1)
        out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else ""))
    return out


def _allowed_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        ann = model.model_fields[part].annotation
        args: tuple[Any, ...] = getattr(ann, "__args__", (ann,))  # X | None -> (X, NoneType)
        inner = args[0] if not isinstance(ann, type) else ann
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return []
        model = inner
    return list(model.model_fields)


def _one_line(err: ValidationError, schema: type[BaseModel] | None = None) -> str:
    e = err.errors()[0]
    loc = tuple(e["loc"])
    key = ".".join(str(p) for p in loc) or "config"
    if e["type"] == "extra_forbidden":
        allowed = _allowed_keys(schema or Config, loc)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"unknown config key '{key}'{hint} (allowed here: {', '.join(allowed)})"
    if e["type"] == "value_error" and not loc:
        return str(e["msg"]).removeprefix("Value error, ")
    value = e.get("input")
    return f"bad value for '{key}': {value!r}: {e['msg']}"


Schema = TypeVar("Schema", bound=BaseModel)


@overload
def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    base: dict[str, Any] | None = None,
    schema: None = None,
) -> Config: ...


@overload
def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    base: dict[str, Any] | None = None,
    schema: type[Schema],
) -> Schema: ...


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    base: dict[str, Any] | None = None,
    schema: type[BaseModel] | None = None,
) -> BaseModel:
    """YAML file (optional) + dotted overrides -> validated Config (or `schema`, e.g. SFTConfig), or
    ConfigError with one line."""
    schema = schema or Config
    tree: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}") from None
        if loaded is None:  # nothing but blank lines and comments; `{}` is an explicit empty config
            raise ConfigError(
                f"config file {str(p)!r} is empty: give it the sections of a run (model:, data:, rewards:, "
                "...; examples/config.yaml is one, `grpokit config` lists every key), or write {} to set "
                "everything with key=value overrides"
            )
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must be a mapping of sections (model:, data:, ...)")
        tree.update(loaded)
    for key, value in parse_overrides(overrides):
        try:
            _set_dotted(tree, key, value)
        except (IndexError, ValueError, TypeError) as exc:
            raise ConfigError(f"override {key}={value!r} does not fit the config: {exc}") from None
    if schema is Config:
        tree = _apply_preset(tree)
    try:
        return schema.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_one_line(err, schema)) from None


def describe(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every field of the sections: the table `grpokit config` prints.

    The same docstrings make docs/reference/config.md (lists and optional sections included), written by
    `python -m grpokit.config.reference`; a test keeps that page equal to the code."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += describe(ann, f"{prefix}{name}.")
            continue
        default = "" if field.is_required() else repr(field.get_default(call_default_factory=True))
        rows.append((prefix + name, default, field.description or ""))
    return rows
