"""docs/architecture.md names only what exists: every module path and every code name in backticks.

Read with ``ast``, nothing imported. A path (``parallel/plan.py``, ``hybrid/``, ``token_mean.py``) must exist in the
package (``tests/...``, ``docs/...``: in the repository); a bare file name in a module table is looked for in that
table's subpackage. A name (``ParallelPlan``, ``shard_batch``, ``ParallelPlan.shard``, ``comm.ring_pass_async``) must
be defined in the package (a top-level definition, a class member, an instance attribute) or imported by it under
that name (``AttentionInterface``); in a table row, a top-level name of the package must belong to the row's
module(s): defined or imported there. Links to the page's anchors, from it and from the other docs, must hit one
of its headings.
"""

from __future__ import annotations

import ast
import builtins
import functools
import keyword
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_longctx"
DOC = ROOT / "docs" / "architecture.md"
#: pages that may link to the page's anchors
LINKING = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "benchmarks" / "README.md",
    *(ROOT / "docs").glob("*.md"),
]
#: paths read from the repository root rather than the package
REPO_FOLDERS = ("tests/", "docs/", "benchmarks/", "examples/")
#: names the page uses that the package neither defines nor imports: notation, other libraries' attributes
EXTERNAL = frozenset({"bshd", "is_global_zero"})
IDENTIFIER = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
#: shorter names are notation (``sp``, ``tp``, ``c_m``, ``seq``), not code names
MIN_NAME = 4


@dataclass
class Module:
    top: set[str] = field(default_factory=set)  # defined at module level
    imported: set[str] = field(default_factory=set)  # bound by an import, anywhere in the module


@dataclass
class Index:
    modules: dict[Path, Module]
    members: dict[str, set[str]]  # class name -> members (every class of that name)

    @functools.cached_property
    def defined(self) -> set[str]:
        return {name for m in self.modules.values() for name in m.top}

    @functools.cached_property
    def imported(self) -> set[str]:
        return {name for m in self.modules.values() for name in m.imported}

    @functools.cached_property
    def all_members(self) -> set[str]:
        return {name for names in self.members.values() for name in names}

    def stem(self, name: str) -> list[Module]:
        """The modules called ``name`` (``comm`` -> parallel/comm.py; a subpackage -> its __init__.py)."""
        return [
            m
            for path, m in self.modules.items()
            if path.stem == name or (path.name == "__init__.py" and path.parent.name == name)
        ]


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [name for elt in node.elts for name in _targets(elt)]
    return []


def _scan(path: Path, members: dict[str, set[str]]) -> Module:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = Module()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            module.top.add(node.name)
        elif isinstance(node, ast.Assign):
            module.top.update(name for target in node.targets for name in _targets(target))
        elif isinstance(node, ast.AnnAssign):
            module.top.update(_targets(node.target))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            module.imported.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module.imported.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.ClassDef):
            names = members.setdefault(node.name, set())
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                        names.update(_targets(target))  # class attributes, dataclass fields
                        if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                            names.add(target.attr)  # instance attributes
    return module


@functools.cache
def index() -> Index:
    members: dict[str, set[str]] = {}
    modules = {
        path: _scan(path, members)
        for path in sorted(PACKAGE.rglob("*.py"))
        if "__pycache__" not in path.parts
    }
    return Index(modules, members)


def resolve_path(span: str, context: str | None, *, strict: bool = False) -> list[Path]:
    """The files or folders ``span`` names; ``context``: the subpackage of the table it is in (``strict``: only
    there, for the module column of a table)."""
    span = span.removeprefix("lightning_longctx/").rstrip("/")
    if span.startswith(REPO_FOLDERS):
        return [ROOT / span] if (ROOT / span).exists() else []
    bases = [PACKAGE / context] if context else []
    if not (strict and context):
        bases.append(PACKAGE)
    for base in bases:
        if (base / span).exists():
            return [base / span]
    if "/" not in span:  # a bare file name: anywhere below the table's subpackage, or the package
        found = (PACKAGE / context if context else PACKAGE).rglob(span)
        return sorted(p for p in found if "__pycache__" not in p.parts)
    return []


def _python_files(paths: list[Path]) -> list[Path]:
    return [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]


def name_problem(span: str, row_modules: list[Path]) -> str | None:
    """Why the code name ``span`` is not the package's (None: it is)."""
    idx = index()
    head, *rest = span.split(".")
    if head == "lightning_longctx":
        for cut in range(len(rest), 0, -1):  # the longest prefix that is a module, then names in it
            base = PACKAGE.joinpath(*rest[:cut])
            path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            if path in idx.modules:
                attrs = rest[cut:]
                module = idx.modules[path]
                if attrs and attrs[0] not in module.top | module.imported:
                    return f"{span}: no such module, and {path.relative_to(ROOT)} has no {attrs[0]}"
                return None
        return f"{span}: no such module"
    if rest:
        if head in idx.members:
            return None if rest[0] in idx.members[head] else f"{span}: class {head} has no {rest[0]}"
        modules = idx.stem(head)
        if modules:
            ok = any(rest[0] in m.top | m.imported for m in modules)
            return None if ok else f"{span}: no module {head} defines {rest[0]}"
        return (
            None
            if head in idx.imported | EXTERNAL
            else f"{span}: {head} is neither the package's nor imported"
        )
    if len(span) < MIN_NAME or keyword.iskeyword(span) or hasattr(builtins, span) or span in EXTERNAL:
        return None
    if span in idx.defined and row_modules:
        here = [idx.modules[p] for p in _python_files(row_modules) if p in idx.modules]
        if not any(span in m.top | m.imported for m in here):
            owners = sorted(str(p.relative_to(PACKAGE)) for p, m in idx.modules.items() if span in m.top)
            shown = ", ".join(str(p.relative_to(PACKAGE)) for p in row_modules)
            return f"{span}: named in the row of {shown} but defined in {owners}"
        return None
    if span in idx.defined | idx.all_members | idx.imported:
        return None
    return f"{span}: defined nowhere in the package"


def _spans(text: str) -> list[str]:
    return [s.strip() for s in re.findall(r"`([^`\n]+)`", text)]


def _is_path(span: str) -> bool:
    return bool(PATH.fullmatch(span)) and ("/" in span or span.endswith(".py"))


def problems(text: str) -> list[str]:
    """Every path and code name of the page ``text`` that the package does not have."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # diagrams: prose, not references
    found: list[str] = []
    context: str | None = None
    lines = text.splitlines()
    for n, line in enumerate(lines):
        cells, row_modules, body_row, header = [line], [], False, False
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if set(cells[0]) <= set("-: "):
                continue
            if n + 1 < len(lines) and re.fullmatch(r"\|[-:| ]+\|", lines[n + 1].strip()):
                # a table's header: its first cell may name the subpackage its rows' modules are in
                first = [s for s in _spans(cells[0]) if _is_path(s)]
                if first and not resolve_path(first[0], None):
                    found.append(f"{first[0]}: no such subpackage")
                context = first[0].rstrip("/") if first else None
                header = True
            else:  # a row: the modules it describes, in its first cell (strictly in the table's subpackage)
                body_row = True
                for span in _spans(cells[0]):
                    if _is_path(span):
                        paths = resolve_path(span, context, strict=True)
                        if not paths:
                            found.append(f"{span}: no such module{f' in {context}/' if context else ''}")
                        row_modules += paths
        else:
            context = None
        for i, cell in enumerate(cells):
            for span in _spans(cell):
                if _is_path(span):
                    if not ((body_row or header) and i == 0) and not resolve_path(span, context):
                        found.append(f"{span}: no such path")
                    continue
                name = span.removesuffix("()")
                if IDENTIFIER.fullmatch(name):
                    problem = name_problem(name, row_modules if body_row and i else [])
                    if problem:
                        found.append(problem)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_module_and_name_of_the_page_exists():
    found = problems(DOC.read_text())
    assert not found, "docs/architecture.md names what the package does not have:\n" + "\n".join(found)


def test_the_check_sees_a_missing_module_name_or_owner():
    page = "\n".join(
        [
            "`parallel/plan.py` and `ParallelPlan.shard`, `comm.ring_pass_async`, `lightning_longctx.parallel.plan`.",
            "`parallel/bogus.py`, `NoSuchName`, `ParallelPlan.no_such_method`, `lightning_longctx.nowhere`.",
            "| `parallel/` | what it holds |",
            "| --- | --- |",
            "| `plan.py` | `ParallelPlan`, `shard_batch` (imported there) |",
            "| `mesh.py` | `TokenMeanWindow` |",
            "| `missing.py` | nothing |",
            "",
            "| `nowhere/` | what it holds |",
            "| --- | --- |",
            "",
            "| other modules | what they hold |",
            "| --- | --- |",
            "| `config.py`, `data/` | `SequenceParallelConfig`, `TextFilesDataModule`, `ParallelPlan` |",
        ]
    )
    found = problems(page)
    assert [f.split(":")[0] for f in found] == [
        "parallel/bogus.py",
        "NoSuchName",
        "ParallelPlan.no_such_method",
        "lightning_longctx.nowhere",
        "TokenMeanWindow",
        "missing.py",
        "nowhere/",
        "ParallelPlan",
    ], found


def test_links_to_the_page_hit_its_headings():
    headings = {slug(h) for h in re.findall(r"^#+ (.+)$", DOC.read_text(), re.M)}
    links = [(DOC, a) for a in re.findall(r"\]\(#([\w-]+)\)", DOC.read_text())]
    links += [
        (page, a)
        for page in LINKING
        if page.exists()
        for a in re.findall(r"architecture\.md#([\w-]+)", page.read_text())
    ]
    missing = [f"{page.relative_to(ROOT)}: #{anchor}" for page, anchor in links if anchor not in headings]
    assert not missing, f"links to headings docs/architecture.md no longer has: {missing}"
    assert slug("The step's loss: the token mean over the global batch (`token_mean.py`)") == (
        "the-steps-loss-the-token-mean-over-the-global-batch-token_meanpy"
    )
