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
    "batch_isend_irecv", "new_group", "new_subgroups_by_enumeration",
}  # fmt: skip
#: the functional collectives (traceable, out of place; ``torch.distributed._functional_collectives``) and the
#: autograd-aware ones of ``torch.distributed.nn``: they move data too
FUNCTIONAL_COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
    "permute_tensor", "wait_tensor",
}  # fmt: skip
#: every qualified name of a collective, whatever module of torch.distributed exports it
COLLECTIVE_NAMES = {
    *(f"{m}.{c}" for m in ("torch.distributed", "torch.distributed.distributed_c10d") for c in COLLECTIVES),
    *(f"torch.distributed._functional_collectives.{c}" for c in FUNCTIONAL_COLLECTIVES),
    *(f"{m}.{c}" for m in ("torch.distributed.nn", "torch.distributed.nn.functional") for c in COLLECTIVES),
}
#: (module, collective) allowed to call one directly, and why (none: the step-time model's calibration, which
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


def _bound_names(tree: ast.AST) -> dict[str, str]:
    """What each name an import binds stands for, dotted (``import torch.distributed as d``: ``d`` ->
    ``torch.distributed``; ``import torch.distributed``: ``torch`` -> ``torch``; ``from torch.distributed import
    all_reduce as ar``: ``ar`` -> ``torch.distributed.all_reduce``). Imports inside functions count too, for
    the whole module: a lint may over-approximate scopes, it must not miss a binding."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """``node`` (a name or an attribute chain on one) as the dotted name it resolves to through ``names``."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _collective_uses(source: str) -> list[tuple[int, str]]:
    """``(line, collective)`` of every import of a collective and every use of one (called, or taken as a
    value: ``partial(dist.all_reduce, ...)``), whatever name or alias it is reached by."""
    tree = ast.parse(source)
    names = _bound_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [
                (node.lineno, f"{node.module}.{a.name}")
                for a in node.names
                if f"{node.module}.{a.name}" in COLLECTIVE_NAMES
            ]
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            dotted = _dotted(node, names)
            if dotted in COLLECTIVE_NAMES:
                found.append((node.lineno, dotted))
    return sorted(set(found))


def test_the_collective_scan_sees_every_import_form():
    """Each way of reaching a collective is seen (the rule once matched only ``dist.<name>(``); what is not a
    collective, or is our own comm layer's, is not."""
    caught = {
        "import torch.distributed as dist\ndist.all_reduce(x)\n": [(2, "torch.distributed.all_reduce")],
        "import torch.distributed as d\nd.barrier()\n": [(2, "torch.distributed.barrier")],
        "import torch\ntorch.distributed.all_to_all_single(y, x)\n": [
            (2, "torch.distributed.all_to_all_single")
        ],
        "import torch.distributed\ntorch.distributed.broadcast(x, 0)\n": [(2, "torch.distributed.broadcast")],
        "from torch import distributed\ndistributed.gather(x)\n": [(2, "torch.distributed.gather")],
        "from torch import distributed as td\ntd.send(x, 1)\n": [(2, "torch.distributed.send")],
        "from torch.distributed import all_reduce\nall_reduce(x)\n": [
            (1, "torch.distributed.all_reduce"),
            (2, "torch.distributed.all_reduce"),
        ],
        "from torch.distributed import all_gather as ag\nag(xs, x)\n": [
            (1, "torch.distributed.all_gather"),
            (2, "torch.distributed.all_gather"),
        ],
        "def f(x):\n    import torch.distributed as dist\n    return dist.reduce_scatter_tensor(x, x)\n": [
            (3, "torch.distributed.reduce_scatter_tensor")
        ],
        "import functools\nimport torch.distributed as dist\nop = functools.partial(dist.all_reduce, x)\n": [
            (3, "torch.distributed.all_reduce")
        ],
        "from torch.distributed import distributed_c10d as c10d\nc10d.new_group([0])\n": [
            (2, "torch.distributed.distributed_c10d.new_group")
        ],
        "import torch.distributed._functional_collectives as funcol\nfuncol.all_reduce(x, 'sum', g)\n": [
            (2, "torch.distributed._functional_collectives.all_reduce")
        ],
        "from torch.distributed._functional_collectives import all_gather_tensor\n": [
            (1, "torch.distributed._functional_collectives.all_gather_tensor")
        ],
        "import torch.distributed.nn.functional as dnn\ndnn.all_to_all(out, xs)\n": [
            (2, "torch.distributed.nn.functional.all_to_all")
        ],
    }
    for source, want in caught.items():
        assert _collective_uses(source) == want, source
    passed = (
        "import torch.distributed as dist\nrank = dist.get_rank(); dist.destroy_process_group()\n"
        "from lightning_longctx.parallel.comm import all_reduce_no_grad, barrier\nbarrier(); all_reduce_(x)\n"
        "import torch\ntorch.all(x)\nall_reduce = 1\nreduce(f, xs)\n"
    )
    assert _collective_uses(passed) == []


def test_collectives_are_called_in_the_communication_layer_only():
    """Every collective of the package is called in parallel/comm.py (by any import form, see above)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "parallel/comm.py":
            continue
        for line, name in _collective_uses(path.read_text()):
            if (module, name.rsplit(".", 1)[1]) not in COLLECTIVE_EXCEPTIONS:
                found.append(f"{module}:{line} {name}")
    assert not found, f"call these through lightning_longctx.parallel.comm: {found}"
    # the scan sees the communication layer's own collectives (it would pass a tree it could not read)
    assert len(_collective_uses((PACKAGE / "parallel" / "comm.py").read_text())) >= 10


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


# ---- a new exactness or refusal test ships with a sabotage (issue 43) ----

#: the test modules written before the rule: not required to call ``assert_catches`` (the exact set of
#: tests/test_*.py when the rule came in; a module leaves the list when it is removed, none ever joins it)
GRANDFATHERED = frozenset({
    "test_arch_sweep", "test_architecture_doc", "test_benchmarks_smoke", "test_callbacks",
    "test_catalogue", "test_causal_lm_lora", "test_checkpoint_offload", "test_checkpoints", "test_cli",
    "test_data", "test_docs", "test_documents", "test_export", "test_faults", "test_fit_check",
    "test_fpdt", "test_fpdt_ring", "test_fused_kernels", "test_fuzz", "test_gpu", "test_hf_data",
    "test_hf_symbols", "test_house_rules", "test_hybrid", "test_hybrid_packed", "test_hybrid_ring",
    "test_lm_head", "test_lora", "test_mask_semantics", "test_memory_tiling", "test_models",
    "test_moe_aux_loss", "test_needle", "test_parallelize", "test_patch_state", "test_plain_model",
    "test_planner", "test_positional_loss", "test_preemption", "test_process_groups", "test_public_api",
    "test_ring", "test_rope", "test_self_test", "test_sequence_layout", "test_sharding_loss",
    "test_sinks_softcap", "test_slurm", "test_state_offload", "test_step_time", "test_strategy",
    "test_tensor_parallel", "test_tiling", "test_token_mean", "test_ulysses",
})  # fmt: skip
#: calls that compare numbers within a tolerance or bit for bit (their last name, leading ``_`` dropped:
#: ``torch.testing.assert_close``, our ``_assert_close`` helpers, ``torch.allclose``, ``pytest.approx``)
_EXACT_CALLS = {"assert_close", "assert_allclose", "allclose", "isclose", "approx"}


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return None if name is None else name.lstrip("_")


def _is_tolerance(node: ast.AST) -> bool:
    """``1e-5``, ``0.05``, ``tol``, ``cls.TOLERANCE``, ``atol * 2``: what an error is held under."""
    if isinstance(node, ast.Constant) and isinstance(node.value, float):
        return 0 < abs(node.value) < 1
    if isinstance(node, ast.BinOp):
        return _is_tolerance(node.left) or _is_tolerance(node.right)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "tol" in name.lower()


def _checks_needing_sabotage(source: str) -> list[str]:
    """The exactness and refusal checks of a test module (``line: what``), or ``[]`` when it has none or
    calls ``assert_catches`` or ``assert_error_above`` (lightning_longctx.testing.sabotage: the check run
    against a sabotaged version)."""
    tree = ast.parse(source)
    names = _bound_names(tree)  # ``from pytest import raises``, ``import torch as th``: seen as well
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name in ("assert_catches", "assert_error_above"):
                return []
            dotted = _dotted(node.func, names)
            if name in _EXACT_CALLS or dotted == "torch.equal":
                found.append(f"{node.lineno}: {name}")
            elif dotted == "pytest.raises":
                found.append(f"{node.lineno}: pytest.raises")
        elif isinstance(node, ast.Assert):
            for compare in ast.walk(node.test):
                if isinstance(compare, ast.Compare) and any(
                    isinstance(op, (ast.Lt, ast.LtE)) and _is_tolerance(right)
                    for op, right in zip(compare.ops, compare.comparators)
                ):
                    found.append(f"{compare.lineno}: < tolerance")
    return found


def test_the_sabotage_scan_sees_exactness_and_refusal_checks():
    head = "import pytest\nimport torch\nfrom lightning_longctx.testing import assert_catches\n\n\n"
    checks = {
        "def test_a():\n    torch.testing.assert_close(a, b)\n": ["7: assert_close"],
        "def test_a():\n    assert _assert_close(got, want, 4, 1e-3) < 1\n": ["7: assert_close"],
        "def test_a():\n    assert torch.allclose(a, b)\n": ["7: allclose"],
        "def test_a():\n    assert torch.equal(a, b)\n": ["7: equal"],
        "def test_a():\n    assert err < 1e-6, err\n": ["7: < tolerance"],
        "def test_a():\n    assert all(e <= TOLERANCE for e in errs)\n": ["7: < tolerance"],
        "def test_a():\n    assert 0 < err < 2 * tol\n": ["7: < tolerance"],
        "def test_a():\n    with pytest.raises(ValueError, match='x'):\n        f()\n": ["7: pytest.raises"],
        "from pytest import raises\ndef test_a():\n    with raises(ValueError):\n        f()\n": [
            "8: pytest.raises"
        ],
        "import torch as th\ndef test_a():\n    assert th.equal(a, b)\n": ["8: equal"],
    }
    for body, want in checks.items():
        assert _checks_needing_sabotage(head + body) == want, body  # a new module with it fails the rule
        for helper in (
            "assert_catches(check, sabotage)",
            "assert_error_above(measure, sabotage, tolerance=1e-6)",
        ):
            sabotaged = head + body + f"\n\ndef test_a_catches():\n    {helper}\n"
            assert _checks_needing_sabotage(sabotaged) == [], body  # and passes with its sabotage
    plain = head + "def test_a():\n    assert f(3) == 4 and len(xs) < 10 and n <= limit\n"
    assert _checks_needing_sabotage(plain) == []  # no exactness, no refusal: nothing to sabotage


def test_a_new_exactness_or_refusal_test_ships_with_its_sabotage():
    """A test module written after the rule (not in :data:`GRANDFATHERED`) that checks exactness
    (``assert_close``, ``torch.equal``, ``err < 1e-5``) or a refusal (``pytest.raises``) also calls
    ``lightning_longctx.testing.assert_catches`` (or ``assert_error_above``): the check shown, in the suite, to
    fail on a broken version. Files that are not test modules (helpers, fuzz drivers) are exempt."""
    modules = {p.stem: p for p in sorted(TESTS.glob("test_*.py"))}
    gone = sorted(GRANDFATHERED - modules.keys())
    assert not gone, f"remove these from GRANDFATHERED, they no longer exist: {gone}"
    found = {
        name: checks[:3]
        for name, path in modules.items()
        if name not in GRANDFATHERED and (checks := _checks_needing_sabotage(path.read_text()))
    }
    assert not found, (
        f"these test modules check exactness or refusals but never show a check failing: {found}. Add a test "
        "that runs the check against a sabotaged version with lightning_longctx.testing.assert_catches"
    )
