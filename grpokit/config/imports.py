"""Objects named by an import path, the one loader of rewards, tools and environments.

    load_object("package.module:function", "reward 'package.module:function'")
    load_object("path/to/file.py:Class.method", "tools.functions='...'", noun="name", error=ConfigError)

A target containing "/" (or "\\") or ending in ".py" is a file, run once per process under a name derived
from its resolved path (sha1, so the same in every process) and kept in sys.modules, so that dataclasses
and pickling inside it find their module and a file named twice (as a tool and as a reward) is one module.
Any other target is a module imported as `python -m` would: the current folder is importable. The part after
the last ":" is a dotted attribute path. Every mistake is one `error` (ValueError by default) that starts
with `what`, says what went wrong and how to fix it, and suggests the closest name where one is close.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """The hint `did you mean 'x'? ` naming the closest candidate (difflib), or "" when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _close_files(path_text: str, path: Path) -> str:
    # The closest .py file in the folder the path names, written as the user wrote theirs.
    if not path.parent.is_dir() or not path_text.endswith(path.name):
        return ""
    close = difflib.get_close_matches(path.name, sorted(p.name for p in path.parent.glob("*.py")), n=1)
    return f"did you mean {path_text.removesuffix(path.name) + close[0]!r}? " if close else ""


def _close_modules(module_name: str) -> str:
    # A missing submodule: its siblings in the parent package; a missing top-level module: the
    # modules and packages in the current folder (where `my_module:fn` is looked for).
    parent, _, _ = module_name.rpartition(".")
    try:
        where = importlib.import_module(parent).__path__ if parent else [os.getcwd()]
    except (ImportError, AttributeError):  # the parent is a plain module, or fails to import
        return ""
    prefix = parent + "." if parent else ""
    return did_you_mean(module_name, [prefix + m.name for m in pkgutil.iter_modules(where)])


def is_file_target(target: str) -> bool:
    """Whether the part before ':' names a file rather than a module."""
    return target.endswith(".py") or "/" in target or "\\" in target


def load_file(path_text: str, what: str, error: type[Exception] = ValueError) -> Any:
    """The module of a .py file, run on first use and cached in sys.modules."""
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise error(
            f"{what}: file {path_text!r} not found (looked at {path}); "
            f"{_close_files(path_text, path)}fix the path"
        )
    # A stable, unique module name, registered before running the file so dataclasses and
    # pickling inside it find their module.
    name = f"grpokit_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]  # None: not loadable
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]  # a file spec has a loader
    except Exception as e:
        del sys.modules[name]
        raise error(f"{what}: running {path} failed: {type(e).__name__}: {e}") from e
    return module


def load_module(module_name: str, what: str, error: type[Exception] = ValueError) -> Any:
    """An imported module; the current folder is importable (like `python -m`)."""
    # `my_module:fn` finds ./my_module.py even when grpokit runs as a console script (whose sys.path lacks
    # the working directory).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        parts = module_name.split(".")
        if e.name in {".".join(parts[: i + 1]) for i in range(len(parts))}:
            raise error(
                f"{what}: loading {module_name!r} failed: module {e.name!r} not found; "
                f"{_close_modules(e.name or module_name)}install it, add its folder to PYTHONPATH, or give a "
                "file path ('path/to/file.py:name')"
            ) from e
        raise error(f"{what}: importing {module_name!r} failed: {e}") from e
    except Exception as e:
        raise error(f"{what}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e


def load_object(
    spec: str,
    what: str,
    *,
    noun: str = "function",
    hint: str = "point at a function",
    error: type[Exception] = ValueError,
) -> Callable[..., Any]:
    """The callable `spec` ("package.module:attr.path" or "path/to/file.py:attr.path") names.
    what: how errors name the spec ("reward 'x'"); noun: the word for the part after ':' in the usage
    line; hint: how to fix an object that is not callable; error: the exception raised."""
    target, _, attr_path = spec.strip().rpartition(":")
    if not target or not attr_path:
        raise error(f"{what}: expected 'package.module:{noun}' or 'path/to/file.py:{noun}'")
    obj = load_file(target, what, error) if is_file_target(target) else load_module(target, what, error)
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            public = [name for name in dir(obj) if not name.startswith("_") or attr.startswith("_")]
            raise error(
                f"{what}: {target!r} has no attribute {attr!r}; {did_you_mean(attr, public)}check the name "
                "after ':'"
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise error(f"{what}: {attr_path!r} is a {type(obj).__name__}, not callable; {hint}")
    return cast("Callable[..., Any]", obj)
