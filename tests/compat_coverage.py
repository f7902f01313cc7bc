"""The test that runs each combination the start-up checks accept (grpokit/rollout/compat.py), and the table
of docs/compatibility.md built from both. tests/test_compat.py checks that every accepted cell names a test
that exists, and that the docs show this table.

    TESTED[cell]     # the pytest node id that runs an accepted combination; UNTESTED: those no test runs yet
    table()          # the markdown of docs/compatibility.md:  python tests/compat_coverage.py
"""

from __future__ import annotations

import itertools

from grpokit.rollout.compat import COMBOS, MODES, SWITCHES, WORLDS, Cell, refusal


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


if __name__ == "__main__":  # python tests/compat_coverage.py: the table, for docs/compatibility.md
    print(table(), end="")
