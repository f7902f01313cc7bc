"""Which combinations of rollout engine, world size, LoRA, torch.compile and the PPO critic a run accepts,
read from the start-up checks themselves.

    refusal(Cell("vllm", "torchrun 2, fsdp2", lora=True))   # None: the run starts; else the one-line error
    CELLS            # every combination: MODES x WORLDS x (model.lora, model.compile, the critic)

Which test runs each accepted combination, and the table of docs/compatibility.md, are the test suite's
(tests/compat_coverage.py): the package names no test.

refusal() builds the Config from dotted overrides as `grpokit train` does (load_config: the config's own
checks) and runs the checks a run makes before it loads a model (Trainer.__init__: World.from_env's
check_world at a world size above 1, then check_engine), without starting a run or torch.distributed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from grpokit.config import ConfigError, load_config
from grpokit.config.world import check_world
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
            check_world(cfg, cell.world_size)  # World.from_env, under torchrun
        check_engine(cfg, cell.world_size)
    except ConfigError as exc:
        return str(exc)
    return None
