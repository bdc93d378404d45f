"""Rules of the code base that a review would otherwise have to remember: checked on the source, by ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "lightning_longctx"

#: torch.distributed calls that move data or synchronise: they belong in comm.py (the communication layer)
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "new_group",
}  # fmt: skip
#: (module, function) allowed to call one directly, and why
COLLECTIVE_EXCEPTIONS = {
    # the step-time model's calibration measures gloo's all-to-all itself, in its own processes
    ("planner/step_time.py", "all_to_all_single"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers; a test module is never a library of another."""
    test_modules = {p.stem for p in TESTS.glob("test_*.py")}
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name for name in _imports(path) if name.split(".")[0] in test_modules
        )
        for path in sorted(TESTS.rglob("*.py"))
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"move what these import into tests/helpers: {offenders}"


def test_collectives_are_called_in_the_communication_layer_only():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "parallel/comm.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in COLLECTIVES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "dist"
                and (module, node.func.attr) not in COLLECTIVE_EXCEPTIONS
            ):
                found.append(f"{module}:{node.lineno} dist.{node.func.attr}")
    assert not found, f"call these through lightning_longctx.parallel.comm: {found}"
