"""Named registries that other modules and packages add to: the reward functions a config may name
(grpokit/rewards/registry.py) and the tasks data.task may name (grpokit/data/tasks.py).

    REWARDS = Registry("grpokit.rewards", "reward")
    REWARDS.register("mine", my_reward)
    REWARDS.get("mine")        # a name nobody registered is looked up in the entry points, else KeyError
    REWARDS.as_dict()          # every name -> object, the entry points' loaded too

The modules that own the objects register them when they are imported (grpokit.tasks registers its
tasks and their rewards). A name nobody registered yet is looked up in the entry points of the
registry's group, which a package declares in its pyproject.toml:

    [project.entry-points."grpokit.rewards"]
    my_reward = "my_package.rewards:my_reward"

grpokit declares its own tasks and task rewards that way, so a config that names one finds it when
nothing imported grpokit.tasks; another package adds its tasks and rewards the same way. Loading an
entry point imports its module: when that registers the name, the registered object is the one used.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any


class Registry:
    """Objects by name, in the order of `rank` then registration; the entry points of `group` fill misses.
    make: turns what an entry point names into the object (a class into an instance, say); default_rank: the
    rank of names registered without one, entry points' included."""

    def __init__(
        self, group: str, what: str, make: Callable[[Any], Any] | None = None, default_rank: int = 0
    ) -> None:
        self.group, self.what, self.default_rank = group, what, default_rank
        self._make = make or (lambda obj: obj)
        self._items: dict[str, tuple[int, int, Any]] = {}  # name -> (rank, registration order, object)
        self._entry_points: list[EntryPoint] | None = None

    def register(self, name: str, obj: Any, *, rank: int | None = None) -> None:
        """Add `obj` as `name`. The same object again is a no-op; another one under a taken name is a
        ValueError. rank orders names() and as_dict(): lower first, then in registration order."""
        if name in self._items:
            if self._items[name][2] is obj:
                return
            raise ValueError(f"{self.what} {name!r} is registered already ({self._items[name][2]!r})")
        self._items[name] = (self.default_rank if rank is None else rank, len(self._items), obj)

    def get(self, name: str) -> Any:
        """The object registered as `name`, loading its entry point if nobody has yet; KeyError if none."""
        if name not in self._items:
            for ep in self.entry_points():
                if ep.name == name:
                    self._load(ep)
                    break
        return self._items[name][2]

    def names(self) -> list[str]:
        """Every name: the registered ones in order, then the entry points' not loaded yet."""
        known = sorted(self._items, key=lambda name: self._items[name][:2])
        return known + sorted({ep.name for ep in self.entry_points()} - set(known))

    def as_dict(self) -> dict[str, Any]:
        """Every name -> its object, in names() order, loading the entry points not loaded yet."""
        for ep in self.entry_points():
            if ep.name not in self._items:
                self._load(ep)
        return {name: self._items[name][2] for name in self.names()}

    def entry_points(self) -> list[EntryPoint]:
        """The installed packages' entry points of this registry's group (read once)."""
        if self._entry_points is None:
            self._entry_points = list(entry_points(group=self.group))
        return self._entry_points

    def missing_hint(self) -> str:
        """A hint for an error about a missing name when nothing is registered and grpokit's own entry points
        are not installed (a source checkout run without `pip install -e .`, or installed before they were
        declared)."""
        if self._items or any(ep.value.startswith("grpokit.") for ep in self.entry_points()):
            return ""
        return (
            f" (grpokit's own {self.group!r} entry points are not installed: reinstall grpokit, "
            "`pip install -e .` in a source checkout)"
        )

    def _load(self, ep: EntryPoint) -> None:
        try:
            obj = ep.load()
        except Exception as e:
            raise ImportError(
                f"{self.what} {ep.name!r}: loading its entry point {ep.value!r} (group {self.group!r}) "
                f"failed: {type(e).__name__}: {e}"
            ) from e
        if ep.name not in self._items:  # importing its module did not register it: the entry point's object
            self.register(ep.name, self._make(obj))
