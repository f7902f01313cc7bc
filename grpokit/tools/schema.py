"""A tool's JSON schema from a plain Python function, and the check of a call's arguments against it.

    schema = function_schema(fn)          # {"type": "function", "function": {"name", "description",
                                          # "parameters"}}
    args, problem = check_arguments(fn, {"a": 3})   # (the arguments to call with, None) or (None, "what is
                                                    # wrong")

The schema is the one chat templates render for `tools=` (transformers' `get_json_schema` convention, which
TRL's `tools=` relies on): the description is the docstring's text before its sections, each parameter's type
comes from its type hint and its description from the Google-style `Args:` section. Every parameter needs a
type hint (the model has to know what to send); a missing one is a ValueError naming the function and the
parameter.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

_JSON_TYPES = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    dict: "object",
    list: "array",
    tuple: "array",
    type(None): "null",
}
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def _type_schema(hint: Any, where: str) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if hint is Any:
        return {}
    if origin is Literal:
        kinds = {type(a) for a in args}
        out: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _JSON_TYPES:
            out["type"] = _JSON_TYPES[next(iter(kinds))]
        return out
    if origin in (Union, types.UnionType):
        members = [_type_schema(a, where) for a in args if a is not type(None)]
        out = members[0] if len(members) == 1 else {"anyOf": members}
        return {**out, "nullable": True} if type(None) in args else out
    if origin in (list, tuple, typing.Sequence) or hint in (list, tuple):
        return {
            "type": "array",
            **({"items": _type_schema(args[0], where)} if args and args[0] is not Ellipsis else {}),
        }
    if origin is dict:
        return {"type": "object"}
    raise ValueError(
        f"{where}: type hint {hint!r} has no JSON schema type; use int, float, str, bool, list, dict, "
        "Literal or X | None"
    )


def parse_google_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines()
    description, params, section, current = [], {}, None, None
    indent = 0  # of the current parameter's line: a deeper line continues its description
    for line in lines:
        head = _SECTION.match(line)
        if head:
            section, current = head.group(1), None
            continue
        if section is None:
            description.append(line)
        elif section in ("Args", "Arguments", "Parameters"):
            m = _ARG_LINE.match(line)
            if m and (current is None or len(line) - len(line.lstrip()) <= indent):
                current = m.group(1).lstrip("*")
                params[current] = m.group(3).strip()
                indent = len(line) - len(line.lstrip())
            elif current is not None and line.strip():
                params[current] = (params[current] + " " + line.strip()).strip()
    return " ".join(x.strip() for x in description if x.strip()), params


def tool_parameters(fn: Callable) -> list[inspect.Parameter]:
    """The parameters a model may pass: keyword-able ones (no *args / **kwargs, no `self`)."""
    P = inspect.Parameter
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
    ]
    return (
        params[1:] if params and params[0].name == "self" else params
    )  # an environment's method, from its class


def function_schema(fn: Callable, name: str | None = None) -> dict[str, Any]:
    """The OpenAI / transformers tool schema of `fn` (a function or a bound method)."""
    name = name or fn.__name__
    description, docs = parse_google_docstring(fn.__doc__)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for p in tool_parameters(fn):
        if p.name not in hints:
            raise ValueError(
                f"tool {name!r}: parameter {p.name!r} has no type hint; tools need one per parameter "
                "(it tells the model what to send)"
            )
        prop = _type_schema(hints[p.name], f"tool {name!r}, parameter {p.name!r}")
        if docs.get(p.name):
            prop["description"] = docs[p.name]
        properties[p.name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _matches(value: Any, schema: dict[str, Any]) -> bool:
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "anyOf" in schema:
        return (value is None and schema.get("nullable", False)) or any(
            _matches(value, s) for s in schema["anyOf"]
        )
    if value is None:
        return schema.get("nullable", False) or schema.get("type") == "null"
    kind = schema.get("type")
    if kind is None:
        return True
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":  # JSON has one number type: an int is a valid float
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "array":
        return isinstance(value, (list, tuple)) and all(_matches(v, schema.get("items", {})) for v in value)
    return isinstance(value, {"string": str, "boolean": bool, "object": dict}[kind])


def check_arguments(schema: dict[str, Any], arguments: Any) -> str | None:
    """None when `arguments` (a dict) matches the tool's schema, else what is wrong, for the model to read."""
    params = schema["function"]["parameters"]
    props, required = params["properties"], params.get("required", [])
    if not isinstance(arguments, dict):
        return f"arguments must be an object of named values, got {type(arguments).__name__}"
    if unknown := sorted(set(arguments) - set(props)):
        return f"unknown argument(s) {unknown}; the tool takes {sorted(props)}"
    if missing := [r for r in required if r not in arguments]:
        return f"missing required argument(s) {missing}"
    for key, value in arguments.items():
        if not _matches(value, props[key]):
            want = props[key].get("type") or props[key].get("enum") or "anyOf"
            return f"argument {key!r} should be {want}, got {type(value).__name__} {value!r:.40}"
    return None
