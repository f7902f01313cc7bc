"""The reference of every config key, written from the config's own field docstrings.

    python -m grpokit.config.reference [--out docs/reference/config.md]
    grpokit config-reference [--out docs/reference/config.md]

`render()` returns the Markdown page: one table per section (key, type, default, description) for
`grpokit train` and then for `grpokit sft`. `missing_docstrings()` names every field that has no
docstring; the test that keeps docs/reference/config.md current fails on any.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from grpokit.config import Config, SFTConfig

DEFAULT_OUT = Path("docs/reference/config.md")
COMMAND = "python -m grpokit.config.reference"


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (a section, an optional section, or a list of them), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _type_name(annotation: Any) -> str:
    """A short, readable type: int, str | None, "a" | "b", list[str]."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "dict"
    if annotation is type(None):
        return "None"
    if origin is not None and getattr(origin, "__name__", "") == "Callable":
        return "callable"
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return f"`{value!r}`"


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|").replace("*", "\\*")
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _sections(
    model: type[BaseModel], prefix: str = ""
) -> list[tuple[str, type[BaseModel], list[tuple[str, FieldInfo]]]]:
    """[(section key, its model, [(key, field), ...]), ...]: top-level keys first, then each section."""
    rows: list[tuple[str, FieldInfo]] = []
    nested: list[tuple[str, type[BaseModel], list[tuple[str, FieldInfo]]]] = []
    for name, field in model.model_fields.items():
        inner = _section_model(field.annotation)
        if inner is None:
            rows.append((prefix + name, field))
            continue
        if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            rows.append((prefix + name, field))  # an optional section or a list: the key itself has a default
        is_list = typing.get_origin(field.annotation) is list
        nested += _sections(inner, f"{prefix}{name}[]." if is_list else f"{prefix}{name}.")
    return [(prefix.rstrip("."), model, rows), *nested]


def _doc(model: type[BaseModel]) -> str:
    own = model.__dict__.get("__doc__")
    return " ".join(own.split()) if own else ""


def _table(
    section: str, model: type[BaseModel], rows: list[tuple[str, FieldInfo]], parent_doc: str
) -> list[str]:
    title = f"`{section}`" if section else "top level"
    out = [f"### {title}", ""]
    doc = _doc(model) or parent_doc
    if doc:
        out += [_cell(doc), ""]
    out += ["| key | type | default | description |", "|---|---|---|---|"]
    for key, field in rows:
        ann = field.annotation
        inner = _section_model(ann)
        kind = _type_name(ann)
        if inner is not None:
            is_list = typing.get_origin(ann) is list
            kind = f"list of `{key}[]` entries" if is_list else f"`{key}` section \\| None"
        out.append(f"| `{key}` | {kind} | {_default(field)} | {_cell(field.description or '')} |")
    return out + [""]


def _part(
    title: str, intro: str, schema: type[BaseModel], skip: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    docs = {name: f.description or "" for name, f in schema.model_fields.items()}
    out = [f"## {title}", "", intro, ""]
    for section, model, rows in _sections(schema):
        if not rows or section in skip:
            continue
        out += _table(section, model, rows, docs.get(section, ""))
    return out


def render() -> str:
    """docs/reference/config.md, from the field docstrings in grpokit/config/ (the section models)."""
    lines = [
        "# Config reference",
        "",
        "<!-- Generated from the field docstrings in grpokit/config/; do not edit by hand.",
        f"     Regenerate with `{COMMAND}` (or `grpokit config-reference`). -->",
        "",
        "Every key of a grpokit config, with its type, its default and what it does. A config is a YAML",
        "file of these sections plus `section.key=value` overrides on the command line; `grpokit config`",
        "prints the same keys in a table. Unknown keys and bad values stop with one line naming the key.",
        "`algorithm.preset` fills in one paper's algorithm keys; a key you set yourself wins",
        "([algorithm.md](../algorithm.md)).",
        "",
    ]
    lines += _part(
        "`grpokit train`",
        "The keys of `grpokit train CONFIG` and of `grpokit.train(cfg)` (`grpokit.config.Config`).",
        Config,
    )
    shared = {"model", "model.lora", "data", "logging"}
    lines += _part(
        "`grpokit sft`",
        "The keys of `grpokit sft CONFIG` (`grpokit.config.SFTConfig`). The `model`, `data` and `logging`"
        " sections are the ones above (`model.lora` is refused: SFT trains every weight; so is"
        " `model.padding_free`).",
        SFTConfig,
        skip=shared,
    )
    return "\n".join(lines).rstrip() + "\n"


def missing_docstrings() -> list[str]:
    """Dotted keys of every config field without a docstring (train and SFT schemas)."""
    missing = []
    for schema, label in ((Config, ""), (SFTConfig, "sft config: ")):
        for _section, _model, rows in _sections(schema):
            missing += [f"{label}{key}" for key, field in rows if not (field.description or "").strip()]
        for name, field in schema.model_fields.items():
            if _section_model(field.annotation) and not (field.description or "").strip():
                missing.append(f"{label}{name}")
    return sorted(set(missing))


def write(out: Path = DEFAULT_OUT) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write the config reference page.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    print(f"wrote {write(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
