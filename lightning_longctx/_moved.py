"""Module paths from before the package was grouped into subpackages (version 0.6), still importable.

``lightning_longctx.strategy`` and the other old flat paths (in user code, LightningCLI YAML ``class_path``
strings, pickled objects) resolve to the module at its new place: the same module object, so a monkeypatch
through either name patches both. ``MOVED`` is the one table; CHANGELOG.md lists it too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

#: old path (below ``lightning_longctx.``) -> new path
MOVED = {
    "comm": "parallel.comm",
    "mesh": "parallel.mesh",
    "sharding": "parallel.sharding",
    "tensor_parallel": "parallel.tensor_parallel",
    "fsdp": "parallel.fsdp",
    "ddp": "parallel.ddp",
    "parallelize": "parallel.parallelize",
    "self_test": "parallel.self_test",
    "loss": "ops.loss",
    "chunked_loss": "ops.chunked_loss",
    "token_mean": "ops.token_mean",
    "tiling": "ops.tiling",
    "checkpoint_offload": "ops.activation_offload",
    "strategy": "lightning.strategy",
    "checkpoint": "lightning.checkpoint",
    "preemption": "lightning.preemption",
    "fit_check": "lightning.fit_check",
    "callbacks": "lightning.callbacks",
    "hf_data": "data.hf",
    "flops": "planner.flops",
    "plan_cli": "cli.plan",
    "slurm": "cli.slurm",
    "export": "cli.export",
}
_PREFIX = "lightning_longctx."


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the target module ran when it was imported


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds ``lightning_longctx.<old>[.<sub>]`` at ``lightning_longctx.<new>[.<sub>]``."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        head, _, rest = fullname[len(_PREFIX) :].partition(".")
        if head not in MOVED:
            return None
        new = _PREFIX + MOVED[head] + (f".{rest}" if rest else "")
        spec = importlib.util.find_spec(new)
        if spec is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _Alias(new), is_package=spec.submodule_search_locations is not None
        )


def install() -> None:
    # first: the path finder would otherwise load ``lightning_longctx.callbacks.memory`` a second time, as a new
    # module, from the real package's ``__path__``
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
