"""Structural guards for the grpokit package.

These tests read the source with ``ast`` (nothing is imported, except in the
import-alone test, which runs in a fresh interpreter) and check:

* there is no import cycle between grpokit modules (imports inside function
  bodies and under ``if TYPE_CHECKING:`` count, and so does the package
  ``__init__`` an import runs), and no
  ``__import__`` / ``importlib.import_module("grpokit...")`` trick hides one
  (the layers those imports must follow: tests/test_layers.py);
* ``grpokit/trainer.py`` stays at most ``TRAINER_MAX_LINES`` lines as the formatter writes them;
* no function or method is longer than ``MAX_FUNCTION_LINES`` lines, except the
  ones listed in ``LONG_FUNCTION_ALLOWLIST``;
* every module (package ``__init__`` files included) imports on its own: a fresh
  interpreter loads the third-party packages once, then forks one child per
  module, which starts with no grpokit module loaded and imports just that one.

The helpers take the package root directory and package name, so the graph
builder is itself tested on a small fake package with a deliberate cycle.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_NAME = "grpokit"
PACKAGE_DIR = REPO_ROOT / PACKAGE_NAME

# Lines as `ruff format` writes them (CI checks the format, so the file's lines are the formatted lines).
# A ratchet: lower it when the loop gets shorter.
TRAINER_MAX_LINES = 440
MAX_FUNCTION_LINES = 60
# "module:qualified_name" -> one-line reason why this function may be longer than MAX_FUNCTION_LINES.
# Entries marked "to split" are ratchets: functions written packed and now formatted, awaiting their split.
LONG_FUNCTION_ALLOWLIST: dict[str, str] = {
    "grpokit.rollout.fast:FastEngine._generate_batch": "one decode loop over a static KV cache, kept whole "
    "to read",
}

IMPORT_TIMEOUT_S = 120
IMPORT_WORKERS = max(2, min(4, os.cpu_count() or 2))


# --------------------------------------------------------------------------- helpers


def discover_modules(root: Path, package: str) -> dict[str, Path]:
    """Map every dotted module name under ``root`` (the directory of ``package``) to its file.

    ``pkg/__init__.py`` is the module ``pkg``; ``pkg/sub/mod.py`` is ``pkg.sub.mod``.
    """
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts:
            continue
        parts = [package, *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking_test(test: ast.expr) -> bool:
    """True for ``TYPE_CHECKING`` and ``typing.TYPE_CHECKING`` (or any ``x.TYPE_CHECKING``)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return False


def _iter_runtime_nodes(tree: ast.AST, type_checking: bool = False):
    """Yield every node of ``tree`` (function bodies included) except those under ``if TYPE_CHECKING:``
    (unless ``type_checking``: then every node).

    The ``else`` branch of such an ``if`` does run, so it is walked.
    """
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not type_checking and isinstance(node, ast.If) and _is_type_checking_test(node.test):
            stack.append(node.test)
            stack.extend(reversed(node.orelse))
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _known_prefix(name: str, modules: dict[str, Path]) -> str | None:
    """The longest dotted prefix of ``name`` that is a known module (``name`` itself first)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _import_targets(
    node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path], package: str
) -> list[str]:
    """The package-internal modules one import statement in ``module`` depends on."""
    targets: list[str] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if _within(alias.name, package):
                target = _known_prefix(alias.name, modules)
                if target is not None:
                    targets.append(target)
        return targets

    # ast.ImportFrom
    if node.level:
        is_package = modules[module].name == "__init__.py"
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        drop = node.level - 1
        if drop > len(anchor) - 1:
            return targets  # relative import beyond the top-level package: not ours
        anchor = anchor[: len(anchor) - drop] if drop else anchor
        base = ".".join(anchor + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if not _within(base, package):
        return targets
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if alias.name != "*" and submodule in modules:
            targets.append(submodule)
        else:
            target = _known_prefix(base, modules)
            if target is not None:
                targets.append(target)
    return targets


def _parent_packages(target: str, module: str, package: str) -> list[str]:
    """The packages whose ``__init__`` importing ``target`` from ``module`` runs: ``target``'s ancestors,
    except the top-level ``package`` and the packages ``module`` is in (they ran before it)."""
    parts = target.split(".")
    ancestors = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [a for a in ancestors if a != package and not (module == a or module.startswith(a + "."))]


def build_import_graph(
    root: Path, package: str, *, type_checking: bool = False, parents: bool = False
) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """Graph module -> set of package-internal modules it imports (at run time, anywhere in the file).

    Returns the graph and, for each edge, where it comes from (``path:line``). By default no implicit
    edge to parent packages is added: ``import pkg.a.b`` is the single edge ``-> pkg.a.b``.
    type_checking: imports under ``if TYPE_CHECKING:`` count too. parents: ``import pkg.a.b`` from
    outside ``pkg.a`` is also an edge ``-> pkg.a``, whose ``__init__`` the import runs (the top-level
    package's is left out: every import runs it).
    """
    modules = discover_modules(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    origins: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _iter_runtime_nodes(tree, type_checking):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _import_targets(node, module, modules, package):
                implied = _parent_packages(target, module, package) if parents else []
                for dst in [target, *implied]:
                    if dst == module or dst not in modules:
                        continue
                    graph[module].add(dst)
                    origins[(module, dst)].append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph, dict(origins)


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit). Each component is returned sorted."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    for start in sorted(graph):
        if start in index:
            continue
        index[start] = lowlink[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph.get(start, ()))))]
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = lowlink[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    lowlink[node] = min(lowlink[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def find_import_cycles(
    root: Path, package: str, *, type_checking: bool = False, parents: bool = False
) -> list[str]:
    """One human-readable description per import cycle (SCC of more than one module); the options are
    build_import_graph's."""
    graph, origins = build_import_graph(root, package, type_checking=type_checking, parents=parents)
    reports = []
    for component in strongly_connected_components(graph):
        if len(component) < 2:
            continue
        members = set(component)
        lines = [f"cycle of {len(component)} modules: {', '.join(component)}"]
        for src in component:
            for dst in sorted(graph[src] & members):
                lines.append(f"    {src} -> {dst}   ({', '.join(origins[(src, dst)])})")
        reports.append("\n".join(lines))
    return reports


def find_dynamic_package_imports(root: Path, package: str) -> list[str]:
    """Calls that could hide an import of the package from the graph builder.

    Flags every ``__import__(...)`` call, and ``import_module(...)`` calls whose module name
    (or ``package=`` argument) is a string literal naming ``package``. ``import_module`` on a
    user-supplied name (a variable) is fine.
    """

    def literal_prefix(expr: ast.expr | None) -> str | None:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        if isinstance(expr, ast.JoinedStr) and expr.values:
            return literal_prefix(expr.values[0])
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            return literal_prefix(expr.left)
        return None

    def names_package(expr: ast.expr | None) -> bool:
        text = literal_prefix(expr)
        return text is not None and (text == package or text.startswith(package + "."))

    found = []
    for path in discover_modules(root, package).values():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else None
            )
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            if name == "__import__":
                found.append(f"{where}: __import__(...) call")
            elif name == "import_module":
                args = list(node.args[:2]) + [
                    kw.value for kw in node.keywords if kw.arg in ("name", "package")
                ]
                if any(names_package(arg) for arg in args):
                    found.append(f"{where}: import_module with a literal {package!r} module name")
    return found


def find_long_functions(root: Path, package: str, max_lines: int) -> dict[str, int]:
    """``"module:qualname" -> length`` for every (async) function longer than ``max_lines`` lines.

    ``qualname`` follows Python's ``__qualname__``: ``Class.method``, ``outer.<locals>.inner``.
    """
    long_functions: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str, module: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{child.name}"
                length = child.end_lineno - child.lineno + 1
                if length > max_lines:
                    long_functions[f"{module}:{qualname}"] = length
                visit(child, f"{qualname}.<locals>.", module)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", module)
            else:
                visit(child, prefix, module)

    for module, path in discover_modules(root, package).items():
        visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "", module)
    return long_functions


def preload_imports(root: Path, package: str) -> list[str]:
    """The third-party imports of the package's modules at module level: ``"module"`` or ``"module:name"``.

    Module level includes ``if`` / ``try`` blocks but not function bodies or ``if TYPE_CHECKING:``.
    ``from x import y`` gives ``"x:y"`` so that lazily loaded names (transformers) are loaded too.
    Relative imports and imports of ``package`` itself are left out.
    """
    specs: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                specs.update(a.name for a in node.names if not _within(a.name, package))
            elif isinstance(node, ast.ImportFrom):
                if node.level or not node.module or _within(node.module, package):
                    continue
                specs.add(node.module)
                specs.update(f"{node.module}:{a.name}" for a in node.names if a.name != "*")
            elif isinstance(node, ast.If) and not _is_type_checking_test(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.If):
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(block)

    for path in discover_modules(root, package).values():
        visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body)
    return sorted(specs)


# Run in a fresh interpreter: load the third-party modules once (argv[4], failures ignored: the child that
# needs one reports it), check that no module of the package is loaded, then fork one child per module
# (argv[5]) that imports just that module and exits; at most argv[3] children at a time, each killed after
# argv[2] seconds. A child's stderr (the traceback) goes to a file; the last line is the failure message.
# Prints one JSON line: {"loaded": [package modules loaded before a fork], "results": [[module, rc, last]]}.
_IMPORT_ALONE_SCRIPT = r"""
import compileall, importlib, json, os, shutil, signal, sys, tempfile, time, traceback

package, timeout, workers = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
preload, modules = json.loads(sys.argv[4]), json.loads(sys.argv[5])
for spec in preload:
    name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(name)
        if attr:
            getattr(module, attr)
    except Exception:
        pass


# Compile the package once into a private cache (nothing written in the tree): no child compiles it again.
sys.pycache_prefix = tempfile.mkdtemp(prefix="import-alone-pyc-")
compileall.compile_dir(package, quiet=2, workers=1)


def package_modules():
    return sorted(m for m in sys.modules if m == package or m.startswith(package + "."))


def child(module, err):
    os.dup2(err.fileno(), 2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    code = 0
    try:
        importlib.import_module(module)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        traceback.print_exc()
    except BaseException:
        code = 1
        traceback.print_exc()
    sys.stderr.flush()
    os._exit(code)


def last_line(err):
    err.seek(0)
    lines = [line for line in err.read().decode(errors="replace").splitlines() if line.strip()]
    err.close()
    return lines[-1] if lines else "(no stderr)"


pending, running, results = list(modules), {}, {}
while pending or running:
    while pending and len(running) < workers:
        loaded = package_modules()
        if loaded:
            shutil.rmtree(sys.pycache_prefix, ignore_errors=True)
            print(json.dumps({"loaded": loaded, "results": []}))
            sys.exit(0)
        module = pending.pop(0)
        err = tempfile.TemporaryFile()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(module, err)
        running[pid] = (module, err, time.monotonic())
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid == 0:
        for pid, (module, err, start) in list(running.items()):
            if time.monotonic() - start > timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                err.close()
                results[module] = (-1, f"timed out after {timeout:g} s")
                del running[pid]
        time.sleep(0.005)
        continue
    module, err, _ = running.pop(pid)
    results[module] = (os.waitstatus_to_exitcode(status), last_line(err))
shutil.rmtree(sys.pycache_prefix, ignore_errors=True)
print(json.dumps({"loaded": [], "results": [[m, *results[m]] for m in modules]}))
"""


def import_each_alone(
    root: Path,
    package: str,
    modules: list[str],
    workers: int = IMPORT_WORKERS,
    preload: list[str] | None = None,
) -> list[tuple[str, int, str]]:
    """``(module, returncode, last stderr line)`` for each module imported alone, with no other module of
    ``package`` loaded (``root`` is the package's directory).

    One fresh interpreter loads the package's third-party imports once (``preload_imports``), then forks a
    child per module: each child starts with the third-party modules loaded and none of ``package``.
    Raises if a module of ``package`` was loaded in the parent (the children would not start clean).
    ``preload`` replaces the discovered third-party imports (for the runner's own test).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    args = [package, str(IMPORT_TIMEOUT_S), str(workers)]
    args += [json.dumps(preload_imports(root, package) if preload is None else preload), json.dumps(modules)]
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALONE_SCRIPT, *args],
        cwd=root.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=IMPORT_TIMEOUT_S * 2 + 30 * len(modules),
    )
    assert proc.returncode == 0 and proc.stdout.strip(), f"import-alone runner failed:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["loaded"], f"{package} modules loaded before the fork: {report['loaded']}"
    return [(module, rc, last) for module, rc, last in report["results"]]


# --------------------------------------------------------------------------- tests on grpokit


def test_no_import_cycles():
    """No cycle of any kind: imports under ``if TYPE_CHECKING:`` and the package ``__init__`` files an import
    runs count too (tests/test_layers.py checks that every import goes down the layers)."""
    cycles = find_import_cycles(PACKAGE_DIR, PACKAGE_NAME, type_checking=True, parents=True)
    assert not cycles, "import cycles inside grpokit:\n" + "\n".join(cycles)


def test_no_dynamic_imports_of_grpokit():
    found = find_dynamic_package_imports(PACKAGE_DIR, PACKAGE_NAME)
    assert not found, "dynamic imports that hide grpokit dependencies:\n" + "\n".join(found)


def test_trainer_is_short():
    n_lines = len((PACKAGE_DIR / "trainer.py").read_text(encoding="utf-8").splitlines())
    assert n_lines <= TRAINER_MAX_LINES, f"grpokit/trainer.py has {n_lines} lines (max {TRAINER_MAX_LINES})"


def test_no_long_functions():
    long_functions = find_long_functions(PACKAGE_DIR, PACKAGE_NAME, MAX_FUNCTION_LINES)
    offenders = {name: n for name, n in long_functions.items() if name not in LONG_FUNCTION_ALLOWLIST}
    assert not offenders, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(
        f"    {name}: {n} lines" for name, n in sorted(offenders.items())
    )


def test_long_function_allowlist_is_current():
    """Allow-list entries must name functions that exist and are still too long."""
    long_functions = find_long_functions(PACKAGE_DIR, PACKAGE_NAME, MAX_FUNCTION_LINES)
    stale = sorted(set(LONG_FUNCTION_ALLOWLIST) - set(long_functions))
    assert not stale, "stale LONG_FUNCTION_ALLOWLIST entries (gone or now short enough): " + ", ".join(stale)


@pytest.mark.slow  # a fork per module, ~40 s: make test runs it, make test-fast leaves it out
def test_every_module_imports_alone():
    modules = sorted(discover_modules(PACKAGE_DIR, PACKAGE_NAME))
    assert PACKAGE_NAME in modules and len(modules) > 1
    results = import_each_alone(PACKAGE_DIR, PACKAGE_NAME, modules)
    assert [module for module, _, _ in results] == modules
    failures = [f"    {module} (rc={rc}): {last}" for module, rc, last in results if rc != 0]
    assert not failures, f"{len(failures)}/{len(modules)} modules fail to import alone:\n" + "\n".join(
        failures
    )


# --------------------------------------------------------------------------- tests of the helpers


def _write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, source in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return tmp_path / "a"


def test_graph_builder_finds_a_package_init_cycle(tmp_path):
    root = _write_package(
        tmp_path,
        {
            "a/__init__.py": "import a.b\nx = 1\n",
            "a/b.py": "from a import x\n",
            "a/c.py": "import a\n",  # imports the package but nothing imports it back: no cycle
        },
    )
    graph, _ = build_import_graph(root, "a")
    assert graph == {"a": {"a.b"}, "a.b": {"a"}, "a.c": {"a"}}
    cycles = find_import_cycles(root, "a")
    assert len(cycles) == 1 and "a, a.b" in cycles[0], cycles


def test_graph_builder_resolves_relative_and_function_level_imports(tmp_path):
    root = _write_package(
        tmp_path,
        {
            "a/__init__.py": "from .sub import mod\n",
            "a/sub/__init__.py": "",
            "a/sub/mod.py": "def f():\n    from .. import helper\n    return helper\n",
            "a/helper.py": "def g():\n    if True:\n        from a.sub.mod import f\n",
        },
    )
    graph, _ = build_import_graph(root, "a")
    assert graph == {"a": {"a.sub.mod"}, "a.sub": set(), "a.sub.mod": {"a.helper"}, "a.helper": {"a.sub.mod"}}
    cycles = find_import_cycles(root, "a")
    assert len(cycles) == 1 and "a.helper, a.sub.mod" in cycles[0], cycles


def test_graph_builder_skips_type_checking_imports(tmp_path):
    root = _write_package(
        tmp_path,
        {
            "a/__init__.py": "import a.b\nx = 1\n",
            "a/b.py": """\
            from typing import TYPE_CHECKING
            import typing

            if TYPE_CHECKING:
                from a import x
            if typing.TYPE_CHECKING:
                import a
        """,
        },
    )
    graph, _ = build_import_graph(root, "a")
    assert graph == {"a": {"a.b"}, "a.b": set()}
    assert find_import_cycles(root, "a") == []


def test_dynamic_import_detector(tmp_path):
    root = _write_package(
        tmp_path,
        {
            "a/__init__.py": "",
            "a/ok.py": "import importlib\n\ndef load(name):\n    return importlib.import_module(name)\n",
            "a/bad.py": "import importlib\nm = importlib.import_module('a.ok')\nn = __import__('a')\n",
        },
    )
    found = find_dynamic_package_imports(root, "a")
    assert len(found) == 2 and all("bad.py" in f for f in found), found


def test_long_function_finder(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    root = _write_package(
        tmp_path,
        {
            "a/__init__.py": f"class C:\n    def m(self):\n{textwrap.indent(body, '    ')}\n",
            "a/f.py": "def short():\n    pass\n\ndef outer():\n    def "
            f"inner():\n{textwrap.indent(body, '    ')}\n",
        },
    )
    assert find_long_functions(root, "a", 5) == {"a:C.m": 6, "a.f:outer": 7, "a.f:outer.<locals>.inner": 6}


def test_import_alone_runner_starts_each_module_clean(tmp_path):
    root = _write_package(
        tmp_path,
        {
            "a/__init__.py": "",
            "a/good.py": "import json\nfrom textwrap import dedent\n",
            "a/bad.py": "raise RuntimeError('boom')\n",
            # passes only if a.good was imported first: a fresh set of package modules per child fails it
            "a/order.py": "import sys\nsys.modules['a.good']\n",
            "a/exits.py": "import sys\nsys.exit(3)\n",
        },
    )
    assert preload_imports(root, "a") == ["json", "sys", "textwrap", "textwrap:dedent"]
    modules = ["a", "a.good", "a.bad", "a.order", "a.exits"]
    results = {m: (rc, last) for m, rc, last in import_each_alone(root, "a", modules, workers=1)}
    assert results["a"] == (0, "(no stderr)") and results["a.good"] == (0, "(no stderr)")
    assert results["a.bad"] == (1, "RuntimeError: boom")
    assert results["a.order"] == (1, "KeyError: 'a.good'")
    assert results["a.exits"][0] == 3
    with pytest.raises(AssertionError, match=r"a modules loaded before the fork: \['a', 'a.good'\]"):
        import_each_alone(root, "a", modules, preload=["a.good"])
