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
#: (module, function) allowed to call one directly, and why (none: the step-time model's calibration, which
#: measures gloo's all-to-all itself, is benchmarks/calibrate_step_time.py, outside the package)
COLLECTIVE_EXCEPTIONS: set[tuple[str, str]] = set()


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


#: files under tests/ or benchmarks/ allowed to edit ``sys.path``, and why
SYS_PATH_EXCEPTIONS = {
    # examples/nanogpt_sp.py is a script a user copies, not a package: the test imports it by name, and the
    # pool's ranks, which import this test module to unpickle its functions, find it the same way
    "tests/test_plain_model.py",
}
#: list methods that change ``sys.path`` in place
_LIST_EDITS = {"insert", "append", "extend", "remove", "pop", "clear", "reverse", "sort", "__setitem__"}


def _is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _sys_path_edits(source: str) -> list[int]:
    """Lines of ``source`` that change ``sys.path``: a list method that edits it in place, an assignment or a
    deletion of it or of an item or slice of it."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _LIST_EDITS and _is_sys_path(node.func.value):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(
                _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)) for t in targets
            ):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_test_or_benchmark_edits_sys_path():
    """Tests and benchmarks import the package (``lightning_longctx.testing`` for what they share) and the
    modules of their own folder, which Python finds beside the script it runs (pytest: beside the test
    module)."""
    every_form = (
        "import sys\nsys.path.insert(0, 'a')\nsys.path[:0] = ['b']\nsys.path += ['c']\ndel sys.path[0]\n"
    )
    assert _sys_path_edits(every_form) == [2, 3, 4, 5]  # the scan sees each form
    assert _sys_path_edits("import sys\nprint(sys.path[0], list(sys.path))\n") == []  # reading is no edit
    found = [
        f"{name}:{line}"
        for folder in (TESTS, ROOT / "benchmarks")
        for path in sorted(folder.rglob("*.py"))
        if (name := path.relative_to(ROOT).as_posix()) not in SYS_PATH_EXCEPTIONS
        for line in _sys_path_edits(path.read_text())
    ]
    assert not found, f"import what these need from the package, don't edit sys.path: {found}"


def test_the_core_never_imports_the_testing_helper():
    """``lightning_longctx.testing`` is for tests and benchmarks: no other module of the package imports
    it."""
    testing = "lightning_longctx.testing"
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        package = path.relative_to(ROOT).with_suffix("").parts[:-1]  # what a relative import starts from
        if package[1:2] == ("testing",):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from lightning_longctx import testing` names it too
                base = package[: len(package) - node.level + 1] if node.level else ()
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            else:
                continue
            if any(name == testing or name.startswith(f"{testing}.") for name in names):
                found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
    assert not found, f"the core imports the testing helper: {found}"


#: the package's layers, bottom first: a module imports only from its own layer or the ones below it
#: (docs/architecture.md, "Layers"). The longest matching prefix names a module's layer.
LAYERS = (
    (
        "runtime",
        (
            *(
                f"parallel.{m}"
                for m in ("comm", "mesh", "layout", "sharding", "tensor_parallel", "fsdp", "ddp")
            ),
            "_moved",
        ),
    ),
    ("attention", ("attention",)),
    ("ops", ("ops", "config")),
    ("integrations", ("integrations",)),
    ("plan", ("parallel",)),
    ("planner", ("planner",)),
    ("lightning", ("lightning", "data")),
    ("cli", ("cli", "__main__")),
    ("top", ("recipes", "testing", "__init__")),
)


def _layer(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (dotted, below ``lightning_longctx.``)."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _package_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a package module in ``path`` (function-level ones too); ``from
    lightning_longctx.x import y`` names ``x.y`` when ``y`` is a module, else ``x``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = []
            for alias in node.names:
                sub = f"{node.module}.{alias.name}".split(".", 1)[-1].replace(".", "/")
                is_module = (PACKAGE / f"{sub}.py").exists() or (PACKAGE / sub).is_dir()
                names.append(f"{node.module}.{alias.name}" if is_module else node.module)
        else:
            continue
        found += [(node.lineno, n.split(".", 1)[1]) for n in names if n.startswith("lightning_longctx.")]
    return found


def test_layers_only_look_down():
    assert _layer("parallel.comm") < _layer("attention.fpdt") < _layer("integrations.transformers")
    assert (
        _layer("integrations.masks")
        < _layer("parallel.plan")
        < _layer("lightning.strategy")
        < _layer("cli.main")
    )
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        mine = _layer(module)
        for line, imported in _package_imports(path):
            theirs = _layer(imported)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{module}:{line} ({LAYERS[mine][0]}) imports {imported} ({LAYERS[theirs][0]})")
    assert not found, f"a layer imports one above it: {found}"


#: functions longer than :data:`MAX_FUNCTION_LINES` (docstring excluded), and why they stay whole
LONG_FUNCTIONS = {
    # FPDT x ring's backward: r ring steps, each a k/v pass, the blocks' recompute and the dk/dv pass one hop behind;
    # the steps share a dozen buffers that helpers would have to pass back and forth
    ("attention/fpdt_ring.py", "backward"),
}
MAX_FUNCTION_LINES = 80


def test_functions_do_one_job():
    """No function of the package over 80 lines (docstring excluded) but those named above."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = node.body[0]
            doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
            lines = node.end_lineno - node.lineno + 1 - ((first.end_lineno - first.lineno + 1) if doc else 0)
            key = (path.relative_to(PACKAGE).as_posix(), node.name)
            if lines > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                found.append(f"{key[0]}::{key[1]} {lines} lines")
    assert not found, f"split these into functions that do one job each: {found}"
