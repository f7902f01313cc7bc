"""The compatibility table (grpokit/rollout/compat.py, tests/compat_coverage.py, docs/compatibility.md): every
combination of engine mode, world size, model.lora, model.compile and the PPO critic is refused with one line
that names what to use instead, or accepted and run by a named test, or listed as accepted and untested; the
docs show the table the code generates."""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpokit.config import ConfigError, load_config
from grpokit.policy import ModelLoadError
from grpokit.rollout import compat
from grpokit.rollout.compat import CELLS, Cell, refusal
from tests import compat_coverage
from tests.compat_coverage import TESTED, UNTESTED
from tests.helpers import read_metrics, require, tiny_config
from tests.test_distributed import TORCHRUN, _env
from tests.test_rollout_server import START_TIMEOUT_S, server  # noqa: F401 (the fixture of the server cells)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "compatibility.md"
#: a verb that points somewhere else, then a config key (section.key) or a value of one
ALTERNATIVE = re.compile(r"\b(use|drop|set|change)\b.*\b[a-z_]+\.[a-z_]+")


def test_the_docs_table_is_the_generated_one():
    found = re.search(
        r"do not edit by hand -->\n(.*?)<!-- end of the compatibility table -->", DOCS.read_text(), re.S
    )
    assert found, "docs/compatibility.md has no generated table"
    assert found.group(1) == compat_coverage.table(), "regenerate it: python tests/compat_coverage.py"


def test_the_cells_are_every_combination_once():
    assert len(CELLS) == len(set(CELLS)) == len(compat.MODES) * len(compat.WORLDS) * 2 ** len(compat.SWITCHES)
    assert Cell("vllm", "torchrun 2, fsdp2", lora=True).overrides() == [
        "rollout.engine=vllm",
        "distributed.strategy=fsdp2",
        "model.lora.r=8",
    ]


def test_every_accepted_cell_names_a_test_or_is_listed_untested():
    accepted = {c for c in CELLS if refusal(c) is None}
    assert not set(TESTED) & UNTESTED
    assert set(TESTED) | UNTESTED <= set(CELLS)
    assert not set(TESTED) - accepted, "a cell that names a test is refused: drop its TESTED entry"
    assert not UNTESTED - accepted, "a refused cell is listed untested: drop its UNTESTED entry"
    missing = sorted(accepted - set(TESTED) - UNTESTED, key=CELLS.index)
    assert not missing, f"accepted with no test named (TESTED) nor listed (UNTESTED): {missing}"


def test_every_refusal_is_one_line_that_names_what_to_use_instead():
    refused = {c: line for c in CELLS if (line := refusal(c)) is not None}
    assert refused  # the test can fail: some cells are refused
    for cell, line in refused.items():
        assert "\n" not in line and line.strip() == line, (cell, line)
        assert ALTERNATIVE.search(line.split(";", 1)[-1]), (cell, line)


def test_refusal_runs_the_checks_a_run_starts_with(tmp_path, monkeypatch):
    """Trainer(cfg) under each world (WORLD_SIZE as torchrun sets it) stops at refusal()'s line for a refused
    cell, and passes every start-up check of an accepted one: it goes on to load the model (here none is
    named, so that is where it stops), which is after World.from_env and check_engine."""
    from grpokit.trainer import Trainer

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for cell in CELLS:
        if cell.world_size > 1:
            monkeypatch.setenv("WORLD_SIZE", str(cell.world_size))
            monkeypatch.setenv("RANK", "1")
        else:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        want = refusal(cell)
        with pytest.raises(ConfigError if want else ModelLoadError) as err:
            Trainer(load_config(None, [*cell.overrides(), f"output_dir={tmp_path / 'run'}"]))  # as the CLI
        if want:
            assert str(err.value) == want, cell
        else:
            assert "model.name_or_path is empty" in str(err.value), (cell, str(err.value))


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_named_test_is_a_test_function_of_its_file():
    for node_id in set(TESTED.values()):
        file, _, name = node_id.partition("::")
        assert (ROOT / file).is_file(), node_id
        assert name.split("[")[0] in _functions(ROOT / file), node_id


@pytest.mark.slow
def test_every_named_test_is_collected_by_pytest_with_its_parameters():
    files = sorted({t.split("::")[0] for t in TESTED.values()})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-o",
            "addopts=",
            "-p",
            "no:cacheprovider",
            *files,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = set(proc.stdout.split())
    missing = sorted(set(TESTED.values()) - collected)
    assert not missing, f"not collected: {missing}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


# ----------------------------------------------------------------------------- cells run here
def _compile_works() -> bool:
    import shutil

    return hasattr(torch, "compile") and shutil.which("g++") is not None  # inductor builds C++ kernels on CPU


#: the one-process cells this module runs (their TESTED entries name test_one_process_run[slug])
ONE_PROCESS_RUNS = [
    c for c, t in TESTED.items() if t == f"tests/test_compat.py::test_one_process_run[{c.slug}]"
]


@pytest.mark.slow
@pytest.mark.parametrize("cell", ONE_PROCESS_RUNS, ids=lambda c: c.slug)
def test_one_process_run(cell, vllm_model_dir, tmp_path, request):
    """Two steps of the cell's run on a tiny Llama (head size 64, which vLLM's CPU kernels take): each switch
    does what it says (the adapters train, the forward is compiled, the critic logs its loss) and the engine
    samples from the weights of the step before (its log-probs equal the trainer's; vLLM: every push took)."""
    from grpokit.trainer import Trainer

    if cell.compile and not _compile_works():
        pytest.skip("torch.compile needs inductor and a C++ compiler")
    extra = []
    if cell.mode.startswith("vllm"):
        require("vllm")
    if cell.lora:
        require("peft")
    if cell.mode == "vllm, vllm_mode=server":
        url = request.getfixturevalue("server")[0]
        extra = [f"rollout.vllm_server_url={url}", f"rollout.vllm_server_timeout={START_TIMEOUT_S}"]
    cfg = tiny_config(
        vllm_model_dir,
        tmp_path / "run",
        *cell.overrides(),
        *extra,
        "optim.max_steps=2",
        "checkpoint.save_every=0",
    )
    trainer = Trainer(cfg)
    assert (trainer.policy.forward is not trainer.model) == cell.compile
    trainer.train()
    rows = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert len(rows) == 2 and all(math.isfinite(r["policy/loss"]) for r in rows)
    assert all(("value/loss" in r) == cell.critic for r in rows)
    if cell.lora:
        moved = [n for n, p in trainer.model.named_parameters() if ".lora_B" in n and p.abs().max() > 0]
        assert moved, "the adapters trained"  # B starts at 0
    if cell.mode != "hf":  # the sampler's log-probs: at lag 1 (the process sampler) from step 2 on they lag
        assert rows[0]["rollout/logp_diff_max"] < 1e-3
        lagged = cell.mode == "fast, async_sampler=process"
        assert lagged or all(r["rollout/logp_diff_max"] < 1e-3 for r in rows), rows
    if cell.mode.startswith("vllm"):
        assert all(r["rollout/push_checks"] == 1 and r["rollout/push_error"] < 1e-3 for r in rows)


def _runs(test: str) -> list[Cell]:
    """The cells whose TESTED entry is tests/test_compat.py::test[slug]."""
    return [c for c, t in TESTED.items() if t == f"tests/test_compat.py::{test}[{c.slug}]"]


#: the cells at two ranks this module runs: without model.compile, and with it (a launch of their own, as
#: compiling takes minutes)
TWO_RANK_RUNS, COMPILED_TWO_RANK_RUNS = _runs("test_two_ranks_run"), _runs("test_two_ranks_compiled_run")


def _launch(cells: list[Cell], model_dir, out: Path, request) -> Path:
    """One torchrun launch (2 ranks, gloo) that trains every cell of `cells` for two steps, in turn; the cells
    in server mode on the module's `grpokit serve` process."""
    served = any(c.mode == "vllm, vllm_mode=server" for c in cells)
    url = request.getfixturevalue("server")[0] if served else ""
    if any(c.mode.startswith("vllm") for c in cells):
        require("vllm")
    if any(c.lora for c in cells):
        require("peft")
    proc = subprocess.run(
        [
            *TORCHRUN,
            str(ROOT / "tests" / "compat_ranks.py"),
            str(model_dir),
            str(out),
            ",".join(c.slug for c in cells),
            url,
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n" + proc.stderr[-8000:]
    return out


@pytest.fixture(scope="module")
def two_rank_runs(vllm_model_dir, tmp_path_factory, request):
    return _launch(TWO_RANK_RUNS, vllm_model_dir, tmp_path_factory.mktemp("two_ranks"), request)


@pytest.fixture(scope="module")
def compiled_two_rank_runs(vllm_model_dir, tmp_path_factory, request):
    if not _compile_works():
        pytest.skip("torch.compile needs inductor and a C++ compiler")
    out = tmp_path_factory.mktemp("compiled_two_ranks")
    return _launch(COMPILED_TWO_RANK_RUNS, vllm_model_dir, out, request)


@pytest.mark.slow
@pytest.mark.parametrize("cell", TWO_RANK_RUNS, ids=lambda c: c.slug)
def test_two_ranks_run(cell, two_rank_runs):
    _check_two_rank_run(cell, two_rank_runs)


@pytest.mark.slow
@pytest.mark.parametrize("cell", COMPILED_TWO_RANK_RUNS, ids=lambda c: c.slug)
def test_two_ranks_compiled_run(cell, compiled_two_rank_runs):
    """test_two_ranks_run's checks, for the cells with model.compile."""
    _check_two_rank_run(cell, compiled_two_rank_runs)


def _check_two_rank_run(cell: Cell, two_rank_runs: Path) -> None:
    """Two steps of the cell's run under torchrun (2 ranks, the cell's strategy), with its real engine on each
    rank: rank 0 logs each step once, the switches do what they say (the adapters train, the forward is
    compiled, the critic logs its loss), and each rank's engine samples from the weights of the step before
    (the sampler's log-probs equal the trainer's at step 1, and at every step but where the process sampler
    lags; vLLM: every push took)."""
    rows = [r for r in read_metrics(two_rank_runs / cell.slug) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["policy/loss"]) for r in rows)
    assert all(("value/loss" in r) == cell.critic for r in rows)
    ends = json.loads((two_rank_runs / f"{cell.slug}.json").read_text())
    assert (ends["lora_B_moved"] > 0) == cell.lora and ends["compiled"] == cell.compile, ends
    if cell.mode != "hf":
        assert rows[0]["rollout/logp_diff_max"] < 1e-3
        lagged = cell.mode == "fast, async_sampler=process"
        assert lagged or all(r["rollout/logp_diff_max"] < 1e-3 for r in rows), rows
    if cell.mode.startswith("vllm"):
        assert all(r["rollout/push_checks"] >= 1 and r["rollout/push_error"] < 1e-3 for r in rows)
