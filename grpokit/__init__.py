"""grpokit: GRPO and its family for Hugging Face causal LMs.

    import grpokit
    grpokit.train("config.yaml", ["optim.max_steps=50"])   # and grpokit.evaluate / sft / report: docs/api.md

The four calls live in grpokit/api.py and are imported on first use, so `import grpokit` stays light.
`grpokit.evaluate` and `grpokit.sft` are those calls although grpokit/evaluate.py and grpokit/sft.py are
modules too: reach the modules by their full names (`from grpokit.sft import train_sft`, or
`sys.modules["grpokit.sft"]`), never as attributes of the package.
"""

import sys
import types

__version__ = "0.1.0"


class _ApiCall:
    """grpokit.<name> is grpokit.api.<name>. A data descriptor, so it wins over the attribute that the import
    system sets on the package when the submodule of the same name (grpokit.evaluate, grpokit.sft) loads;
    that module is kept in sys.modules as always."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, package, owner=None):
        from grpokit import api

        return getattr(api, self.name)

    def __set__(self, package, value) -> None:
        package.__dict__.setdefault("_submodules", {})[self.name] = value


class _Package(types.ModuleType):
    train = _ApiCall()
    evaluate = _ApiCall()
    sft = _ApiCall()
    report = _ApiCall()


sys.modules[__name__].__class__ = _Package
