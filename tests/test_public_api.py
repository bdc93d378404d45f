"""The public API (`lightning_longctx.__all__`, README.md "Use") is a contract: changing it must be deliberate.
So is the layering: the recipes (`lightning_longctx.recipes`) sit on the core, and the core never imports them."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_longctx
from lightning_longctx import recipes
from lightning_longctx.attention import fpdt_attention, ulysses_attention
from lightning_longctx.lightning import callbacks

PACKAGE = Path(lightning_longctx.__file__).parent
RECIPES = "lightning_longctx.recipes"

PUBLIC = {
    "UlyssesFPDTStrategy",
    "__version__",
    "callbacks",
    "chunked_lm_head_cross_entropy",
    "disable_sequence_parallel",
    "enable_activation_checkpointing",
    "enable_sequence_parallel",
    "fpdt_attention",
    "gather_sequence",
    "longest_sequence",
    "plan_memory",
    "sequence_parallel_cross_entropy",
    "shard_batch",
    "shard_sequence",
    "tile_mlp_",
    "ulysses_attention",
    "untile_mlp_",
}


def test_all_is_frozen():
    assert set(lightning_longctx.__all__) == PUBLIC
    assert {"MFUMonitor", "MemoryMonitor", "PositionalLoss", "NeedleRetrieval"} <= set(callbacks.__all__)
    assert set(recipes.__all__) == {
        "CausalLM", "RecallAccuracy", "RecallDataModule", "RecallDataset", "recall_accuracy", "warmup_cosine",
        "LongRecallDataModule", "LongRecallDataset", "LongRecallPrompt",
    }  # fmt: skip


def _imports(path: Path, source: str | None = None) -> set[str]:
    """Every module an import statement of ``path`` (or ``source``, as if it were ``path``) names, relative
    imports resolved, and for ``from m import x`` also ``m.x`` (``x`` may be a submodule:
    ``from lightning_longctx import recipes``)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    source = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _recipe_imports(path: Path, source: str | None = None) -> list[str]:
    return sorted(m for m in _imports(path, source) if m == RECIPES or m.startswith(f"{RECIPES}."))


def test_the_core_never_imports_the_recipes():
    """No module of the package outside ``recipes/`` imports it (the CLI names its default model by a class path
    string, which jsonargparse imports when it parses the config)."""
    offenders = {
        str(path.relative_to(PACKAGE)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if "recipes" not in path.relative_to(PACKAGE).parts and (names := _recipe_imports(path))
    }
    assert not offenders, f"the core imports the recipes (move the shared piece into the core): {offenders}"


@pytest.mark.slow  # a fresh interpreter importing the package (~10 s)
def test_the_package_loads_no_recipe_at_run_time():
    """At run time too (an importlib call would escape the scan above): the package and its CLI load no
    recipe."""
    code = "import sys, lightning_longctx, lightning_longctx.cli\n"
    code += f"print(sorted(m for m in sys.modules if m.startswith({RECIPES!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_import_scan_sees_every_form_of_import():
    """The scan above would pass vacuously if it missed a form of import: each form names the recipes here."""
    forms = ["import lightning_longctx.recipes", "from lightning_longctx import recipes",
             "from lightning_longctx.recipes.recall import RecallDataset", "from .recipes import CausalLM",
             "from ..recipes import CausalLM"]  # fmt: skip
    for form in forms:
        path = PACKAGE / "integrations" / "_probe.py" if form.startswith("from ..") else PACKAGE / "_probe.py"
        assert _recipe_imports(path, form), (form, _imports(path, form))


def test_contract_signatures():
    def params(fn):
        return list(inspect.signature(fn).parameters)

    assert params(ulysses_attention)[:8] == [
        "q", "k", "v", "group", "causal", "softmax_scale", "position_ids", "backend"
    ]  # fmt: skip
    assert {"group", "chunk_size", "causal", "softmax_scale", "position_ids", "offload", "backend"} <= set(
        params(fpdt_attention)
    )
    assert params(lightning_longctx.shard_batch)[:4] == ["batch", "group", "chunk_size", "ignore_index"]
    assert params(lightning_longctx.sequence_parallel_cross_entropy)[:4] == [
        "logits", "shift_labels", "group", "ignore_index"
    ]  # fmt: skip
    strategy = params(lightning_longctx.UlyssesFPDTStrategy)
    assert strategy[:4] == ["sequence_parallel_size", "fpdt_chunk_size", "offload", "attention_backend"]
    assert params(callbacks.MFUMonitor)[0] == "peak_flops"


def test_version_comes_from_package_metadata():
    from importlib.metadata import version

    assert lightning_longctx.__version__ == version("lightning-longctx")


def test_module_paths_from_before_the_subpackages_import_the_same_module():
    """0.6 grouped the flat modules into subpackages: every old path (user code, YAML class paths) still imports,
    as the very module at its new place, and no old path is also a file of the package."""
    import importlib

    from lightning_longctx._moved import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(f"lightning_longctx.{old}") is importlib.import_module(
            f"lightning_longctx.{new}"
        ), old
        assert not (PACKAGE / f"{old}.py").exists() and not (PACKAGE / old).is_dir(), old
    from lightning_longctx.callbacks import MFUMonitor
    from lightning_longctx.callbacks.memory import MemoryMonitor
    from lightning_longctx.lightning.callbacks import MFUMonitor as new_mfu
    from lightning_longctx.lightning.callbacks.memory import MemoryMonitor as new_memory

    assert MFUMonitor is new_mfu and MemoryMonitor is new_memory
