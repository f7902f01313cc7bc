"""Which combinations of rollout engine, world size, LoRA, torch.compile and the PPO critic a run accepts,
read from the start-up checks themselves, and the test that covers each accepted one.

    refusal(Cell("vllm", "torchrun 2, fsdp2", lora=True))   # None: the run starts; else the one-line error
    CELLS            # every combination: MODES x WORLDS x (model.lora, model.compile, the critic)
    TESTED[cell]     # the pytest node id that runs an accepted combination; UNTESTED: those no test runs yet
    table()          # the markdown of docs/compatibility.md (tests/test_compat.py keeps it current)

refusal() builds the Config from dotted overrides as `grpokit train` does (load_config: the config's own
checks) and runs the checks a run makes before it loads a model (Trainer.__init__: World.from_env's
check_config at a world size above 1, then check_engine), without starting a run or torch.distributed. A
combination that passes them and has no entry in TESTED shows as "accepted, untested" in the table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from grpokit.config import ConfigError, load_config
from grpokit.distributed.world import check_config
from grpokit.rollout.engines import check_engine

#: the rollout engine and its mode (as engines.ENGINES names them) -> the overrides that pick it
MODES: dict[str, tuple[str, ...]] = {
    "hf": ("rollout.engine=hf",),
    "fast": ("rollout.engine=fast",),
    # the sampler process is for asynchronous rollouts: it needs max_policy_lag >= 1
    "fast, async_sampler=process": (
        "rollout.engine=fast",
        "rollout.async_sampler=process",
        "rollout.max_policy_lag=1",
    ),
    "vllm": ("rollout.engine=vllm",),
    "vllm, vllm_mode=server": ("rollout.engine=vllm", "rollout.vllm_mode=server"),
}
#: the world -> (its size, the overrides of its strategy)
WORLDS: dict[str, tuple[int, tuple[str, ...]]] = {
    "1 process": (1, ()),
    "torchrun 2, ddp": (2, ("distributed.strategy=ddp",)),
    "torchrun 2, fsdp2": (2, ("distributed.strategy=fsdp2",)),
}
#: each switch of a cell -> the override that turns it on
SWITCHES: dict[str, str] = {
    "lora": "model.lora.r=8",
    "compile": "model.compile=true",
    "critic": "algorithm.advantage_estimator=gae",
}


@dataclass(frozen=True)
class Cell:
    """One combination: an engine mode (a MODES key), a world (a WORLDS key) and the three switches."""

    mode: str
    world: str
    lora: bool = False
    compile: bool = False
    critic: bool = False

    @property
    def switches(self) -> tuple[str, ...]:
        """The switches that are on, in SWITCHES order ("lora", "compile", "critic")."""
        return tuple(s for s in SWITCHES if getattr(self, s))

    @property
    def world_size(self) -> int:
        return WORLDS[self.world][0]

    @property
    def slug(self) -> str:
        """A short id without spaces: "fast-process-fsdp2-compile+critic" (a pytest parameter id)."""
        mode = self.mode.replace(", async_sampler=process", "-process").replace(
            ", vllm_mode=server", "-server"
        )
        world = self.world.removeprefix("torchrun 2, ").replace("1 process", "w1")
        return f"{mode}-{world}-{'+'.join(self.switches) or 'none'}"

    def overrides(self) -> list[str]:
        """The dotted overrides of this combination, on top of the config's defaults."""
        return [*MODES[self.mode], *WORLDS[self.world][1], *(SWITCHES[s] for s in self.switches)]


#: the columns of the table: every on/off combination of the switches, fewest first
COMBOS: tuple[tuple[str, ...], ...] = tuple(
    combo for n in range(len(SWITCHES) + 1) for combo in itertools.combinations(SWITCHES, n)
)
CELLS: tuple[Cell, ...] = tuple(
    Cell(mode, world, **{s: s in combo for s in SWITCHES})
    for mode in MODES
    for world in WORLDS
    for combo in COMBOS
)


def refusal(cell: Cell) -> str | None:
    """None when a run of `cell` passes every start-up check, else the ConfigError's one line."""
    try:
        cfg = load_config(None, cell.overrides())
        if cell.world_size > 1:
            check_config(cfg, cell.world_size)  # World.from_env, under torchrun
        check_engine(cfg, cell.world_size)
    except ConfigError as exc:
        return str(exc)
    return None


def _cells(mode: str, world: str, *combos: str) -> list[Cell]:
    """The cells of `mode` and `world` with each switch combination ("", "lora", "compile+critic", ...)."""
    return [Cell(mode, world, **{s: s in c.split("+") for s in SWITCHES}) for c in combos]


_ONE, _DDP, _FSDP2 = WORLDS
_DIST = "tests/test_distributed.py::"
_VLLM_RANKS = "tests/test_vllm_torchrun.py::"
#: (cells, the pytest node id that runs them). At two ranks the equivalence tests of test_distributed.py run
#: the real trainer with rollout.engine=hf configured and a fixed stand-in for its generate (their module
#: docstring); the hf engine's own sampling from such a policy is the one-process tests'.
_COVERAGE: list[tuple[list[Cell], str]] = [
    (_cells("hf", _ONE, ""), "tests/test_trainer.py::test_reward_rises[none]"),
    (_cells("hf", _ONE, "critic"), "tests/test_ppo.py::test_ppo_reward_rises"),
    (
        _cells("hf", _ONE, "lora"),
        "tests/test_lora.py::test_lora_learns_trains_only_the_adapter_and_saves_loadable_models[hf]",
    ),
    (
        _cells("fast", _ONE, "lora"),
        "tests/test_lora.py::test_lora_learns_trains_only_the_adapter_and_saves_loadable_models[fast]",
    ),
    (
        _cells("fast", _ONE, ""),
        "tests/test_importance.py::"
        "test_the_loop_logs_the_mismatch_for_engines_with_logprobs_and_corrects_only_when_asked",
    ),
    (_cells("fast", _ONE, "compile"), "tests/test_trainer.py::test_compile_gives_the_eager_numbers"),
    (_cells("fast", _FSDP2, ""), _DIST + "test_torchrun_trains_end_to_end[0]"),
    (
        _cells("fast, async_sampler=process", _ONE, ""),
        "tests/test_async_rollouts.py::test_lag_one_learns_and_logs_its_lag[process]",
    ),
    (_cells("vllm", _ONE, ""), "tests/test_rollout_vllm.py::test_grpo_on_vllm_learns_and_every_push_takes"),
    (_cells("vllm", _ONE, "lora"), "tests/test_vllm_lora.py::test_grpo_with_lora_on_vllm_every_push_takes"),
    (
        _cells("vllm, vllm_mode=server", _ONE, ""),
        "tests/test_rollout_server.py::test_grpo_on_a_vllm_server_learns_and_every_push_takes",
    ),
    (
        _cells("vllm, vllm_mode=server", _ONE, "lora"),
        "tests/test_rollout_server.py::test_grpo_with_lora_on_a_vllm_server_every_push_takes",
    ),
]
_EQUIVALENCE = [
    f"{_DIST}test_{name}_on_two_ranks_equals_one_process[{strategy}]"
    for name in ("one_step", "lora", "compile", "ppo_critic")
    for strategy in ("ddp", "fsdp2")
]
for _world, _strategy in ((_DDP, "ddp"), (_FSDP2, "fsdp2")):
    _COVERAGE += [
        (_cells("hf", _world, ""), f"{_DIST}test_one_step_on_two_ranks_equals_one_process[{_strategy}]"),
        (_cells("hf", _world, "lora"), f"{_DIST}test_lora_on_two_ranks_equals_one_process[{_strategy}]"),
        (
            _cells("hf", _world, "compile"),
            f"{_DIST}test_compile_on_two_ranks_equals_one_process[{_strategy}]",
        ),
        (
            _cells("hf", _world, "critic"),
            f"{_DIST}test_ppo_critic_on_two_ranks_equals_one_process[{_strategy}]",
        ),
        (
            _cells("vllm", _world, ""),
            f"{_VLLM_RANKS}test_torchrun_trains_with_a_vllm_engine_per_rank[{_strategy}]",
        ),
        (
            _cells("vllm", _world, "lora"),
            f"{_VLLM_RANKS}test_torchrun_trains_lora_with_a_vllm_engine_per_rank[{_strategy}]",
        ),
        (
            _cells("vllm, vllm_mode=server", _world, ""),
            "tests/test_vllm_server_torchrun.py::"
            f"test_torchrun_trains_with_every_rank_a_client_of_one_server[{_strategy}]",
        ),
        (
            _cells("vllm, vllm_mode=server", _world, "lora"),
            "tests/test_vllm_server_torchrun.py::"
            f"test_torchrun_trains_lora_with_every_rank_a_client_of_one_server[{_strategy}]",
        ),
    ]
#: one-process cells no other test runs: tests/test_compat.py::test_one_process_run trains each for two steps
_RUN_BY_TEST_COMPAT = [
    *_cells("hf", _ONE, "compile", "compile+critic"),
    *_cells("fast", _ONE, "critic", "compile+critic"),
    *_cells("fast, async_sampler=process", _ONE, "lora", "compile", "critic", "compile+critic"),
    *_cells("vllm", _ONE, "compile", "critic", "compile+critic"),
    *_cells("vllm, vllm_mode=server", _ONE, "compile", "critic", "compile+critic"),
]
_COVERAGE += [([c], f"tests/test_compat.py::test_one_process_run[{c.slug}]") for c in _RUN_BY_TEST_COMPAT]
#: cells at two ranks no other test runs: tests/test_compat.py::test_two_ranks_run trains each for two steps
_RUN_AT_TWO_RANKS = [
    *_cells("fast", _DDP, "", "lora", "critic"),
    *_cells("fast", _FSDP2, "lora", "critic"),
    *_cells("fast, async_sampler=process", _DDP, "", "lora", "critic"),
    *_cells("fast, async_sampler=process", _FSDP2, "", "lora", "critic"),
    *_cells("vllm", _DDP, "critic"),
    *_cells("vllm", _FSDP2, "critic"),
    *_cells("vllm, vllm_mode=server", _DDP, "critic"),
    *_cells("vllm, vllm_mode=server", _FSDP2, "critic"),
]
_COVERAGE += [([c], f"tests/test_compat.py::test_two_ranks_run[{c.slug}]") for c in _RUN_AT_TWO_RANKS]
_COMPILED_AT_TWO_RANKS = [
    *_cells("hf", _DDP, "compile+critic"),
    *_cells("hf", _FSDP2, "compile+critic"),
    *_cells("fast", _DDP, "compile", "compile+critic"),
    *_cells("fast", _FSDP2, "compile", "compile+critic"),
    *_cells("fast, async_sampler=process", _DDP, "compile", "compile+critic"),
    *_cells("fast, async_sampler=process", _FSDP2, "compile", "compile+critic"),
    *_cells("vllm", _DDP, "compile", "compile+critic"),
    *_cells("vllm", _FSDP2, "compile", "compile+critic"),
    *_cells("vllm, vllm_mode=server", _DDP, "compile", "compile+critic"),
    *_cells("vllm, vllm_mode=server", _FSDP2, "compile", "compile+critic"),
]
_COVERAGE += [
    ([c], f"tests/test_compat.py::test_two_ranks_compiled_run[{c.slug}]") for c in _COMPILED_AT_TWO_RANKS
]
#: every accepted cell that a test runs -> that test's pytest node id (tests/test_compat.py checks both ways)
TESTED: dict[Cell, str] = {cell: test for cells, test in _COVERAGE for cell in cells}
#: the accepted cells that no test runs yet, listed so that a cell the checks start to accept (or stop
#: accepting) fails tests/test_compat.py until it is put here or in TESTED: a test to write, or a refusal
UNTESTED: frozenset[Cell] = frozenset()


# ----------------------------------------------------------------------------- the docs table
def _head(combo: tuple[str, ...]) -> str:
    return " + ".join(combo) if combo else "none"


def table() -> str:
    """The markdown table of every cell (rows: engine mode x world; columns: the switches that are on), then
    the tests (T) and the refusals (R) its cells name."""
    tests: dict[str, str] = {}
    refusals: dict[str, str] = {}
    lines = [
        "| engine | world | " + " | ".join(_head(c) for c in COMBOS) + " |",
        "|---|---|" + "---|" * len(COMBOS),
    ]
    for mode, world in itertools.product(MODES, WORLDS):
        marks = []
        for combo in COMBOS:
            cell = Cell(mode, world, **{s: s in combo for s in SWITCHES})
            if (line := refusal(cell)) is not None:
                marks.append("✗ " + refusals.setdefault(line, f"R{len(refusals) + 1}"))
            elif cell in TESTED:
                marks.append("✓ " + tests.setdefault(TESTED[cell], f"T{len(tests) + 1}"))
            else:  # UNTESTED (tests/test_compat.py: every accepted cell is in one of the two)
                marks.append("accepted, untested")
        lines.append(f"| `{mode}` | {world} | " + " | ".join(marks) + " |")
    stand_in = " (the real trainer; the engine's generate a fixed stand-in)"
    lines += ["", "Tests:", ""]
    lines += [f"- {n}: `{test}`" + (stand_in if test in _EQUIVALENCE else "") for test, n in tests.items()]
    lines += ["", "Refusals:", ""] + [f"- {n}: {line}" for line, n in refusals.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m grpokit.rollout.compat: the table, for docs/compatibility.md
    print(table(), end="")
