"""grpokit's layers run one way: a module imports only from its own layer and the ones below.

    0  base types        the shared containers (grpokit/types.py), values.py and the metric names
                         (grpokit/metrics/names.py), which import nothing
    1  core              config (with the registry machinery), algo, the sandbox
    2  stages, services  data (with the batch containers), rollout engines, rewards, tools, policy (with
                         AdamW), distributed, checkpoint, records, metric computation, the doctor (pure
                         functions of the metric rows, which the records run during a run)
    3  assembly          the step (algorithm.py), the critic, evaluation, the rollout pipeline and episodes,
                         the compatibility table
    4  loops             trainer, sft
    5  face              api, cli, demo, the HTML report, the built-in tasks

Every import counts: inside functions, under ``if TYPE_CHECKING:``, and the package ``__init__`` that an
import of a submodule runs (tests/test_structure.py's graph builder, with both options on). Every grpokit
module must have a layer in LAYERS: a new module without one fails here. An import that goes up names the
file and line; the few that still do, in files another change is rewriting, are TEMPORARY_UPWARD_IMPORTS,
each with its reason, and the test fails once one is gone so that its entry goes too.

The tasks reach the rest only through registries (grpokit/data/tasks.py, grpokit/rewards/registry.py)
and the entry points pyproject.toml declares, so importing the policy or the algorithms loads no task
and no tool (fresh interpreters below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_structure import (  # tests/ is on sys.path: pytest puts a test file's folder there
    PACKAGE_DIR,
    PACKAGE_NAME,
    REPO_ROOT,
    _write_package,
    build_import_graph,
    discover_modules,
    find_import_cycles,
)

BASE, CORE, SERVICES, ASSEMBLY, LOOPS, FACE = range(6)

LAYERS: dict[str, int] = {
    # 0: base types; nothing here imports above it
    "grpokit.types": BASE,
    "grpokit.metrics": BASE,
    "grpokit.metrics.names": BASE,
    "grpokit.values": BASE,
    # 1: core
    "grpokit.config": CORE,
    "grpokit.config.loading": CORE,
    "grpokit.config.presets": CORE,
    "grpokit.config.rewards": CORE,
    "grpokit.config.schema": CORE,
    "grpokit.config.sections": CORE,
    "grpokit.config.sft": CORE,
    "grpokit.config.world": CORE,
    "grpokit.config.registry": CORE,
    "grpokit.config.imports": CORE,
    "grpokit.data.batch": SERVICES,
    "grpokit.data.micro_batches": SERVICES,
    "grpokit.algo": CORE,
    "grpokit.algo.advantages": CORE,
    "grpokit.algo.fused": CORE,
    "grpokit.algo.gae": CORE,
    "grpokit.algo.importance": CORE,
    "grpokit.algo.kl": CORE,
    "grpokit.algo.losses": CORE,
    "grpokit.algo.ops": CORE,
    "grpokit.algo.truncation": CORE,
    "grpokit.sandbox": CORE,
    "grpokit.sandbox.cgroup": CORE,
    "grpokit.sandbox.harness": CORE,
    "grpokit.sandbox.run": CORE,
    # 2: stages and services
    "grpokit.data": SERVICES,
    "grpokit.data.build": SERVICES,
    "grpokit.data.files": SERVICES,
    "grpokit.data.prompts": SERVICES,
    "grpokit.data.sampler": SERVICES,
    "grpokit.data.split": SERVICES,
    "grpokit.data.tasks": SERVICES,
    "grpokit.metrics.compute": SERVICES,
    "grpokit.policy": SERVICES,
    "grpokit.policy.gguf": SERVICES,
    "grpokit.policy.loading": SERVICES,
    "grpokit.policy.logprobs": SERVICES,
    "grpokit.policy.memory": SERVICES,
    "grpokit.policy.plan": SERVICES,
    "grpokit.policy.padding_free": SERVICES,
    "grpokit.policy.attention": SERVICES,
    "grpokit.policy.heap": SERVICES,
    "grpokit.policy.optim": SERVICES,
    "grpokit.distributed": SERVICES,
    "grpokit.distributed.parallel": SERVICES,
    "grpokit.distributed.world": SERVICES,
    "grpokit.distributed.sequence": SERVICES,
    "grpokit.distributed.sequence_turns": SERVICES,
    "grpokit.checkpoint": SERVICES,
    "grpokit.checkpoint.resume": SERVICES,
    "grpokit.checkpoint.save": SERVICES,
    "grpokit.checkpoint.run": SERVICES,
    "grpokit.checkpoint.checkpointer": SERVICES,
    "grpokit.checkpoint.whole": SERVICES,
    "grpokit.distributed.signals": SERVICES,
    "grpokit.checkpoint.sharded": SERVICES,
    "grpokit.records.health": SERVICES,
    "grpokit.config.threads": SERVICES,
    "grpokit.rollout": SERVICES,
    "grpokit.rollout.base": SERVICES,
    "grpokit.rollout.engines": SERVICES,
    "grpokit.distributed.handle": SERVICES,
    "grpokit.records.run_records": SERVICES,
    "grpokit.rollout.fast": SERVICES,
    "grpokit.rollout.fleet": SERVICES,
    "grpokit.rollout.hf": SERVICES,
    "grpokit.rollout.mismatch": SERVICES,
    "grpokit.rollout.process": SERVICES,
    "grpokit.rollout.serve": SERVICES,
    "grpokit.rollout.server": SERVICES,
    "grpokit.rollout.vllm": SERVICES,
    "grpokit.rollout.weights": SERVICES,
    "grpokit.rewards": SERVICES,
    "grpokit.rewards.build": SERVICES,
    "grpokit.rewards.builtins": SERVICES,
    "grpokit.rewards.code": SERVICES,
    "grpokit.rewards.concurrent": SERVICES,
    "grpokit.rewards.manager": SERVICES,
    "grpokit.rewards.model": SERVICES,
    "grpokit.rewards.registry": SERVICES,
    "grpokit.rewards.sandbox": SERVICES,
    "grpokit.rewards.steps": SERVICES,
    "grpokit.rewards.text": SERVICES,
    "grpokit.rewards.timeouts": SERVICES,
    "grpokit.tools": SERVICES,
    "grpokit.tools.builtin": SERVICES,
    "grpokit.tools.episode": SERVICES,
    "grpokit.tools.formats": SERVICES,
    "grpokit.tools.registry": SERVICES,
    "grpokit.tools.rewards": SERVICES,
    "grpokit.tools.schema": SERVICES,
    "grpokit.tools.setup": SERVICES,
    "grpokit.records": SERVICES,
    "grpokit.records.plots": SERVICES,
    "grpokit.records.progress": SERVICES,
    "grpokit.records.sinks": SERVICES,
    "grpokit.records.table": SERVICES,
    "grpokit.records.trackers": SERVICES,
    # the doctor's checks read metric rows only: the records run them during a run (grpokit/doctor/live.py)
    "grpokit.doctor": SERVICES,
    "grpokit.doctor.live": SERVICES,
    "grpokit.doctor.checks": SERVICES,
    "grpokit.doctor.hacking": SERVICES,
    "grpokit.doctor.optimizer": SERVICES,
    "grpokit.doctor.policy": SERVICES,
    "grpokit.doctor.report": SERVICES,
    "grpokit.doctor.rewards": SERVICES,
    "grpokit.doctor.rollouts": SERVICES,
    "grpokit.doctor.run": SERVICES,
    "grpokit.doctor.stats": SERVICES,
    "grpokit.doctor.thresholds": SERVICES,
    # 3: assembly
    "grpokit.algorithm": ASSEMBLY,
    "grpokit.policy.anchors": ASSEMBLY,
    "grpokit.components": ASSEMBLY,
    "grpokit.policy.critic": ASSEMBLY,
    "grpokit.rollout.compat": ASSEMBLY,
    "grpokit.evaluate": ASSEMBLY,
    "grpokit.rollout.episodes": ASSEMBLY,
    "grpokit.rollout.pipeline": ASSEMBLY,
    "grpokit.rollout.partial": ASSEMBLY,
    # 4: loops
    "grpokit.trainer": LOOPS,
    "grpokit.sft": LOOPS,
    # 5: the face
    "grpokit": FACE,
    "grpokit.__main__": FACE,
    "grpokit.api": FACE,
    "grpokit.cli": FACE,
    "grpokit.config.reference": FACE,
    "grpokit.demo": FACE,
    "grpokit.demo.toy": FACE,
    "grpokit.demo.tools": FACE,
    "grpokit.demo.real": FACE,
    "grpokit.records.report": FACE,
    "grpokit.tasks": FACE,
    "grpokit.tasks.arithmetic": FACE,
    "grpokit.tasks.base": FACE,
    "grpokit.tasks.countdown": FACE,
    "grpokit.tasks.multiply": FACE,
    "grpokit.tasks.tiny_model": FACE,
    "grpokit.tasks.tokenizer": FACE,
    "grpokit.tasks.word_problems": FACE,
}

#: (importer, imported) -> why the import still goes up a layer. Each is in a file that another change is
#: rewriting; the entry goes when the import does (test_temporary_upward_imports_are_still_there).
TEMPORARY_UPWARD_IMPORTS: dict[tuple[str, str], str] = {}

#: grpokit modules (the package included) that `import <module>` loads in a fresh interpreter before the
#: layers ran one way: policy 46, tasks and tools among them; algo 7; batch 41; data 28. With them: policy 17,
#: algo 7, batch 4, data 7. A count may not grow back past the old one, except by a new module of a layer at
#: or below the imported one's: policy + 1 for grpokit.data.micro_batches (its log-prob passes' splits),
#: + 1 for grpokit.policy.attention (padding-free rows' attention), + 1 for grpokit.policy.heap (a
#: checkpointed pass's freed memory).
LOADED_BEFORE = {"grpokit.policy": 50, "grpokit.algo": 7, "grpokit.data": 28}
FRESH_IMPORTS = ("grpokit.policy", "grpokit.algo", "grpokit.data")


def _graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    return build_import_graph(PACKAGE_DIR, PACKAGE_NAME, type_checking=True, parents=True)


def upward_imports(
    graph: dict[str, set[str]], origins: dict[tuple[str, str], list[str]], layers: dict[str, int]
) -> dict[tuple[str, str], str]:
    """(importer, imported) -> "layer a -> layer b at file:line, ..." for every import that goes up."""
    upward = {}
    for src, targets in graph.items():
        for dst in targets:
            if src in layers and dst in layers and layers[dst] > layers[src]:
                where = ", ".join(dict.fromkeys(origins[(src, dst)]))
                upward[(src, dst)] = f"layer {layers[src]} -> layer {layers[dst]} at {where}"
    return upward


# --------------------------------------------------------------------------- the layers of grpokit


def test_every_module_has_a_layer():
    modules = set(discover_modules(PACKAGE_DIR, PACKAGE_NAME))
    missing, stale = sorted(modules - set(LAYERS)), sorted(set(LAYERS) - modules)
    assert not missing, f"modules without a layer (add them to LAYERS in {Path(__file__).name}): {missing}"
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_no_import_goes_up_a_layer():
    graph, origins = _graph()
    upward = upward_imports(graph, origins, LAYERS)
    offenders = {edge: where for edge, where in upward.items() if edge not in TEMPORARY_UPWARD_IMPORTS}
    assert not offenders, "imports that go up a layer:\n" + "\n".join(
        f"    {src} -> {dst}: {where}" for (src, dst), where in sorted(offenders.items())
    )


def test_temporary_upward_imports_are_still_there():
    """An entry of TEMPORARY_UPWARD_IMPORTS whose import is gone (or no longer goes up) must go too."""
    graph, origins = _graph()
    gone = sorted(set(TEMPORARY_UPWARD_IMPORTS) - set(upward_imports(graph, origins, LAYERS)))
    assert not gone, f"stale TEMPORARY_UPWARD_IMPORTS entries, remove them: {gone}"


@pytest.mark.parametrize("module", FRESH_IMPORTS)
def test_importing_a_lower_layer_loads_no_task_and_no_tool(module):
    code = (
        "import json, sys\n"
        f"import {module}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'grpokit' or m.startswith('grpokit.'))))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.splitlines()[-1])
    higher = [m for m in loaded if m.startswith(("grpokit.tasks", "grpokit.tools"))]
    assert not higher, (
        f"`import {module}` loads {len(loaded)} grpokit modules, tasks or tools among them: {higher}"
    )
    if module in LOADED_BEFORE:
        assert len(loaded) <= LOADED_BEFORE[module], (module, len(loaded), loaded)


def test_shared_containers_have_one_home():
    """The old import paths of the moved containers give the very same classes as grpokit.types."""
    import grpokit.data
    import grpokit.metrics.compute
    import grpokit.metrics.names
    import grpokit.rewards
    import grpokit.rewards.manager
    import grpokit.rewards.steps
    import grpokit.types

    assert grpokit.data.PromptRow is grpokit.types.PromptRow
    assert grpokit.rewards.RewardOutput is grpokit.rewards.manager.RewardOutput is grpokit.types.RewardOutput
    assert grpokit.rewards.StepScores is grpokit.rewards.steps.StepScores is grpokit.types.StepScores
    names = [n for n in vars(grpokit.metrics.names) if not n.startswith("_")]
    assert len(names) > 100 and all(
        getattr(grpokit.metrics.compute, n) is getattr(grpokit.metrics.names, n) for n in names
    )


def test_the_engine_interface_uses_the_shared_containers():
    import grpokit.rollout.base
    import grpokit.types

    assert grpokit.rollout.base.Completions is grpokit.types.Completions
    assert grpokit.rollout.base.SamplingParams is grpokit.types.SamplingParams


def test_metric_names_import_nothing():
    import ast

    source = (PACKAGE_DIR / "metrics" / "names.py").read_text(encoding="utf-8")
    imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not imports, [ast.unparse(n) for n in imports]


def test_the_old_sandbox_path_still_works_and_says_where_it_went():
    import grpokit.sandbox

    sys.modules.pop("grpokit.rewards.sandbox", None)
    with pytest.warns(DeprecationWarning, match="grpokit.sandbox"):
        from grpokit.rewards.sandbox import Limits, run_many, run_python
    assert (Limits, run_python, run_many) == (
        grpokit.sandbox.Limits,
        grpokit.sandbox.run_python,
        grpokit.sandbox.run_many,
    )


# --------------------------------------------------------------------------- the entry points


def _declared_entry_points() -> dict[str, dict[str, str]]:
    tomllib = pytest.importorskip("tomllib")
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["entry-points"]


def test_the_entry_points_name_what_the_tasks_and_tools_register():
    import importlib

    import grpokit.tasks
    from grpokit.tools.rewards import TOOL_REWARDS

    declared = _declared_entry_points()
    tasks = {**grpokit.tasks.TASKS, **grpokit.tasks.CHAT_TASKS}
    assert set(declared["grpokit.tasks"]) == set(tasks)
    assert set(declared["grpokit.rewards"]) == set(grpokit.tasks.TASK_REWARDS) | set(TOOL_REWARDS)
    for name, value in declared["grpokit.tasks"].items():
        module, attr = value.split(":")
        assert isinstance(tasks[name], getattr(importlib.import_module(module), attr))
    for name, value in declared["grpokit.rewards"].items():
        module, attr = value.split(":")
        assert grpokit.tasks.reward_registry()[name] is getattr(importlib.import_module(module), attr)


def test_a_run_finds_the_built_in_tasks_and_rewards_without_importing_grpokit_tasks(tmp_path):
    """What the data layer and the rewards do when nothing imported grpokit.tasks: they load the entry points.
    The entry points come from a dist-info made here from pyproject.toml, so the test does not depend on when
    grpokit was installed."""
    dist = tmp_path / "grpokit_entry_points_under_test-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: grpokit-entry-points-under-test\nVersion: 0\n"
    )
    (dist / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items()) + "\n"
            for group, eps in _declared_entry_points().items()
        )
    )
    code = """
import json, sys
from grpokit.data import get_task
from grpokit.rewards import reward_registry
assert "grpokit.tasks" not in sys.modules
task = get_task("countdown")
import grpokit.tasks
print(json.dumps([task is grpokit.tasks.TASKS["countdown"], list(reward_registry())]))
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO_ROOT)]))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    same, names = json.loads(proc.stdout.splitlines()[-1])
    assert same
    assert names[:9] == [
        "math",
        "format",
        "countdown",
        "countdown_steps",
        "multiply",
        "word_problems",
        "overlong",
        "length",
        "code_tests",
    ]
    assert set(names[9:]) == {"tool_call_valid", "tool_args_valid", "tool_result_used", "step_cost"}


def test_an_unknown_task_is_a_one_line_error_naming_the_known_ones():
    import grpokit.tasks  # noqa: F401 (registers the built-in tasks)
    from grpokit.data.tasks import get_task

    with pytest.raises(
        ValueError, match=r"unknown task 'sudoku'; allowed: \['arithmetic', 'countdown', 'multiply'"
    ):
        get_task("sudoku")


# --------------------------------------------------------------------------- the checks, on a fake package


def test_type_checking_imports_and_package_inits_count_when_asked(tmp_path):
    root = _write_package(
        tmp_path,
        {
            "a/__init__.py": "",
            "a/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.high import H\n",
            "a/high.py": "import a.sub.leaf\n",
            "a/sub/__init__.py": "from a.sub import leaf\nfrom a import high\n",
            "a/sub/leaf.py": "from a.sub import other\n",
            "a/sub/other.py": "",
        },
    )
    graph, _ = build_import_graph(root, "a")
    assert graph["a.low"] == set() and graph["a.high"] == {"a.sub.leaf"}
    graph, origins = build_import_graph(root, "a", type_checking=True, parents=True)
    assert graph["a.low"] == {"a.high"}
    assert graph["a.high"] == {"a.sub.leaf", "a.sub"}  # the import runs a/sub/__init__.py
    assert graph["a.sub.leaf"] == {"a.sub.other"}  # its own package ran before it: no edge
    assert origins[("a.high", "a.sub")] == ["a/high.py:1"]
    layers = {"a": 0, "a.low": 0, "a.high": 1, "a.sub": 1, "a.sub.leaf": 0, "a.sub.other": 0}
    assert upward_imports(graph, origins, layers) == {("a.low", "a.high"): "layer 0 -> layer 1 at a/low.py:3"}
    # a/sub/__init__.py imports a.high, whose import of a.sub.leaf runs a/sub/__init__.py: a cycle only then
    assert find_import_cycles(root, "a") == []
    (cycle,) = find_import_cycles(root, "a", type_checking=True, parents=True)
    assert "cycle of 2 modules: a.high, a.sub" in cycle and "a.high -> a.sub   (a/high.py:1)" in cycle
