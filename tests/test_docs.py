"""Docs don't rot: every shell command in README.md, docs/ and benchmarks/README.md is exercised.

Cheap commands run here for real (sbatch generation); configs are parsed; for long runs every flag the
docs use must exist in the script's ``--help`` (the runs themselves are in test_cli.py,
test_benchmarks_smoke.py and test_faults.py); install and test commands must be what .ci/run does.

A walk-through (docs/finetune.md) is a path a reader follows top to bottom on a laptop, each command using what
the ones before it wrote: it runs whole, in order, in a fresh folder (``test_walkthrough_runs_top_to_bottom``).
"""

from __future__ import annotations

import functools
import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: pages whose commands build on each other: run whole, in order, by test_walkthrough_runs_top_to_bottom
WALKTHROUGHS = [ROOT / "docs" / "finetune.md"]
DOCS = [
    p
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
    if p not in WALKTHROUGHS
]


def block_commands(block: str) -> list[str]:
    """The commands of one ```bash block, in order (continued lines joined, comments dropped)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        cmd = line.split("  #")[0].strip()
        if cmd and not cmd.startswith("#"):
            out.append(cmd)
    return out


def text_commands(text: str) -> list[str]:
    """The commands of every ```bash block of a page's markdown, in order."""
    return [cmd for block in re.findall(r"```bash\n(.*?)```", text, re.S) for cmd in block_commands(block)]


def page_commands(path: Path) -> list[str]:
    return text_commands(path.read_text())


def documented_commands() -> list[tuple[str, str]]:
    return [(path.relative_to(ROOT).as_posix(), cmd) for path in DOCS for cmd in page_commands(path)]


COMMANDS = documented_commands()


def _help(argv: list[str]) -> str:
    return _help_of(tuple(argv))


@functools.cache  # a script documented by several commands parses its --help once
def _help_of(argv: tuple[str, ...]) -> str:
    proc = subprocess.run(
        [sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _flags(args: list[str]) -> list[str]:
    return [a.split("=")[0] for a in args if a.startswith("--")]


def _starts_a_process(cmd: str) -> bool:
    """The check runs the command's script (``--help``, ``--print_config``) in a new Python: ~1.5-7 s each on
    2 cores, so the slow tier; plan / slurm / export run in-process and the rest are read, not run."""
    return cmd.startswith(("python ", "torchrun ", "lightning-longctx fit")) and cmd != "python -m pytest -q"


@pytest.mark.parametrize(
    "where,cmd",
    [pytest.param(w, c, marks=pytest.mark.slow) if _starts_a_process(c) else (w, c) for w, c in COMMANDS],
    ids=[c for _, c in COMMANDS],
)
def test_documented_command_is_exercised(where: str, cmd: str, tmp_path: Path, capsys, monkeypatch) -> None:
    from lightning_longctx.cli import main as cli_main

    args = shlex.split(cmd)
    monkeypatch.chdir(ROOT)  # the documented commands run from the repository root
    ci = (ROOT / ".ci" / "run").read_text()
    if args[:2] == ["pip", "install"]:
        problems = pip_install_problems(cmd, ci, _pyproject())
        assert not problems, f"{where}: `{cmd}`: {problems}"
    elif cmd == "python -m pytest -q":
        assert "\npython -m pytest -q\n" in ci, ".ci/run must run exactly the README's test command"
    elif args[:2] == ["lightning-longctx", "slurm"]:  # writes the script that a later `sbatch` submits
        assert "sbatch " + _slurm_args(args)[0].get("--output", "?") in page_commands(ROOT / where), (
            f"{where}: `{cmd}` writes a script no documented `sbatch` submits"
        )
    elif args[:2] == ["lightning-longctx", "plan"]:  # cheap: runs for real, in-process (the same entry point)
        status = cli_main(args[1:])
        out, err = capsys.readouterr()
        assert status == 0, err[-2000:]
        assert "total at peak" in out or "--json" in args
    elif args[:2] == ["lightning-longctx", "export"]:  # needs a run: its flags exist (test_export.py runs it)
        with pytest.raises(SystemExit):
            cli_main(["export", "--help"])
        help_text = capsys.readouterr().out
        for flag in _flags(args[2:]):
            assert flag in help_text, f"{where}: lightning-longctx export has no flag {flag}"
    elif args[:2] == ["lightning-longctx", "fit"]:
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_longctx", *args[1:], "--print_config"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]  # the short real run is in test_cli.py
    elif args[0] == "sbatch":  # needs a cluster: the slurm command before it runs, in a clone's root
        problems = sbatch_problems(page_commands(ROOT / where), cmd, _clone_root(tmp_path))
        assert not problems, f"{where}: {problems}"
    elif args[0] == "torchrun":
        script = next(a for a in args if a.endswith(".py"))
        _help([script])  # the script exists and parses; torchrun launches are tested in test_faults.py
    elif args[0] == "python" and args[1].endswith(".py"):
        help_text = _help([args[1]])
        for flag in _flags(args[2:]):
            assert flag in help_text, f"{where}: {args[1]} has no flag {flag}"
    else:
        pytest.fail(f"{where}: no rule exercises `{cmd}`; add one here")


# ---- pip install: the documented command installs what CI tests ----


#: pip options that take a value (the next word unless written ``--opt=value``)
_PIP_VALUED = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "-r"}
#: a clone's install target: ``.`` or ``.[extra,...]`` (``-e`` before it or not)
_CLONE = re.compile(r"\.(?:\[(.*)\])?")


def _pip_install(args: list[str]) -> tuple[list[str], list[str]]:
    """The words after ``pip install``: its index options, as ``--opt=value`` (what decides which torch build
    comes), and its targets (requirements and ``.[extras]``)."""
    options, targets, i = [], [], 0
    while i < len(args):
        opt, has_value, value = args[i].partition("=")
        if opt in _PIP_VALUED and not has_value:
            i, value = i + 1, args[i + 1] if i + 1 < len(args) else ""
        if opt in _PIP_VALUED and opt not in ("-c", "--constraint", "-r"):
            options.append(f"{'--index-url' if opt == '-i' else opt}={value}")
        elif not args[i].startswith("-") and opt not in _PIP_VALUED:
            targets.append(args[i])
        i += 1
    return options, targets


def _extras(clone: re.Match[str]) -> set[str]:
    return {e.strip() for e in (clone[1] or "").split(",") if e.strip()}


def ci_installs(ci: str) -> tuple[str | None, list[str], set[str] | None]:
    """What .ci/run installs: its torch requirement (``torch==2.13.0``: the CPU build's pin), the index options
    of that install (none today), and the extras it installs the clone with (``{"test"}``)."""
    torch_pin, torch_options, extras = None, [], None
    for line in ci.splitlines():
        words = shlex.split(line.split(" #")[0]) if "pip install" in line else []
        options, targets = _pip_install(words[words.index("install") + 1 :] if words else [])
        for target in targets:
            if re.match(r"torch\b", target):
                torch_pin, torch_options = target, options
            elif clone := _CLONE.fullmatch(target):
                extras = _extras(clone)
    return torch_pin, torch_options, extras


def pip_install_problems(cmd: str, ci: str, pyproject: dict) -> list[str]:
    """What is wrong with a documented ``pip install``: the package is named by its project name (or ``.``, the
    clone) with extras pyproject.toml defines; any other package is one pyproject.toml depends on; torch is
    pinned as .ci/run pins it (an unpinned torch pulls a multi-GB CUDA build), with the same index options;
    a clone's install names torch and the extras CI installs (the README's is the suite's environment)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    known = {
        canonicalize_name(Requirement(r).name)
        for r in [*project["dependencies"], *(r for group in optional.values() for r in group)]
    }
    ci_torch, ci_options, ci_extras = ci_installs(ci)
    if ci_torch is None or ci_extras is None:
        return [f".ci/run installs no pinned torch or no clone (found {ci_torch!r}, extras {ci_extras!r})"]
    options, targets = _pip_install(shlex.split(cmd)[2:])
    problems, torch_named, clone = [], None, None
    for target in targets:
        if match := _CLONE.fullmatch(target):
            clone = extras = _extras(match)
        else:
            try:
                req = Requirement(target)
            except InvalidRequirement as err:
                problems.append(f"`{target}` is no requirement pip reads: {err}")
                continue
            name, extras = canonicalize_name(req.name), set(req.extras)
            if name == "torch":
                torch_named = target
            elif name != canonicalize_name(project["name"]) and name not in known:
                problems.append(f"`{target}`: {req.name} is no dependency in pyproject.toml")
        if undefined := sorted(extras - optional.keys()):
            problems.append(f"`{target}` names extras {undefined} that pyproject.toml does not define")
    if torch_named is not None and (torch_named != ci_torch or options != ci_options):
        problems.append(
            f"torch is installed as `{' '.join([torch_named, *options])}`, .ci/run as "
            f"`{' '.join([ci_torch, *ci_options])}`: pin it the same way (an unpinned torch is the CUDA build)"
        )
    if clone is not None and torch_named is None:
        problems.append(f"the clone's install names no torch: add `{ci_torch}` first, as .ci/run does")
    if clone is not None and clone != ci_extras:
        problems.append(
            f"the clone is installed with extras {sorted(clone)}, .ci/run with {sorted(ci_extras)}"
        )
    return problems


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_pip_rule_fails_on_a_broken_install_line():
    """Each documented-install mistake is caught; the README's line as written passes."""
    ci, pyproject = (ROOT / ".ci" / "run").read_text(), _pyproject()
    readme = 'pip install torch==2.13.0 -e ".[test]"'
    assert readme in page_commands(ROOT / "README.md")
    assert pip_install_problems(readme, ci, pyproject) == []
    broken = {
        'pip install torch==2.12.0 -e ".[test]"': "pin it the same way",  # another torch than CI tests
        'pip install torch -e ".[test]"': "pin it the same way",  # unpinned: the CUDA build
        'pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126 -e ".[test]"': "same way",
        'pip install -e ".[test]"': "names no torch",
        'pip install torch==2.13.0 -e ".[tests]"': "does not define",
        'pip install torch==2.13.0 -e ".[data]"': ".ci/run with ['test']",
        'pip install "lightning-longctx[dta]"': "does not define",
        'pip install "longctx[data]"': "no dependency in pyproject.toml",
    }
    for cmd, why in broken.items():
        problems = pip_install_problems(cmd, ci, pyproject)
        assert any(why in p for p in problems), (cmd, problems)
    assert pip_install_problems(readme, ci.replace("torch==", "torch>="), pyproject)  # CI's pin is read too


# ---- sbatch: the documented slurm command writes the script the docs submit ----


def _slurm_args(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """``{flag: value}`` of a ``lightning-longctx slurm ...`` command (``-o`` as ``--output``) and what follows
    ``--`` (the ``fit`` arguments)."""
    extra = args[args.index("--") + 1 :] if "--" in args else []
    args = args[2 : args.index("--")] if "--" in args else args[2:]
    flags = {("--output" if a == "-o" else a): v for a, v in itertools.pairwise(args) if a.startswith("-")}
    return flags, extra


def sbatch_content_problems(slurm_cmd: str, text: str) -> list[str]:
    """What the script ``slurm_cmd`` wrote lacks: from the command's own flags (not from the writer), the
    ``#SBATCH`` lines of the allocation, time limit, SIGUSR1 lead and requeue, all before the first command, and
    the one ``srun`` line of the fit that resumes (``--ckpt_path auto``)."""
    flags, extra = _slurm_args(shlex.split(slurm_cmd))
    nodes, gpus = flags["--nodes"], flags["--gpus-per-node"]
    want = [
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={gpus}",
        f"#SBATCH --gres=gpu:{gpus}",
        f"#SBATCH --time={flags.get('--time', '24:00:00')}",
        f"#SBATCH --signal=SIGUSR1@{flags.get('--signal-lead', '600')}",
        "#SBATCH --requeue",
        *(f"#SBATCH --{k}={flags['--' + k]}" for k in ("partition", "account") if "--" + k in flags),
    ]
    lines = text.splitlines()
    problems = [f"no `{line}`" for line in want if line not in lines]
    if lines[:1] != ["#!/bin/bash"]:
        problems.append(f"the first line is {lines[:1]}, not #!/bin/bash")
    first = next((i for i, line in enumerate(lines) if line and not line.startswith("#")), len(lines))
    if late := [line for line in lines[first:] if line.startswith("#SBATCH")]:
        problems.append(f"sbatch ignores these, after the first command: {late}")
    resume = [] if any(a.split("=")[0] == "--ckpt_path" for a in extra) else ["--ckpt_path", "auto"]
    fit = ["srun", "lightning-longctx", "fit", "--config", flags["--config"]]
    fit += [f"--trainer.num_nodes={nodes}", f"--trainer.devices={gpus}", *resume, *extra]
    srun = [line for line in lines if line.startswith("srun ")]
    if srun != [shlex.join(fit)]:
        problems.append(f"the srun lines are {srun}, not [{shlex.join(fit)!r}]")
    return problems


def sbatch_problems(commands: list[str], cmd: str, folder: Path) -> list[str]:
    """``sbatch FILE`` of a page whose ``commands`` are given: the ``lightning-longctx slurm ... -o FILE``
    before it runs, for real, in ``folder`` (a clone's root: ``examples/`` there) and writes FILE, which holds
    what :func:`sbatch_content_problems` asks, for the config it names, which exists."""
    import contextlib

    from lightning_longctx.cli import main as cli_main

    target = shlex.split(cmd)[1]
    writers = [
        c
        for c in commands[: commands.index(cmd)]
        if c.startswith("lightning-longctx slurm ")
        and _slurm_args(shlex.split(c))[0].get("--output") == target
    ]
    if not writers:
        return [f"`{cmd}`: no `lightning-longctx slurm ... -o {target}` before it writes {target}"]
    with contextlib.chdir(folder):
        status = cli_main(shlex.split(writers[-1])[1:])
    if status != 0 or not (folder / target).is_file():
        return [f"`{writers[-1]}` (exit {status}) wrote no {target}"]
    config = _slurm_args(shlex.split(writers[-1]))[0]["--config"]
    missing = [] if (folder / config).is_file() else [f"the config {config} does not exist"]
    return missing + sbatch_content_problems(writers[-1], (folder / target).read_text())


def _clone_root(folder: Path) -> Path:
    """``folder`` as a reader's clone: ``examples/`` there (what the documented commands name)."""
    folder.mkdir(exist_ok=True)
    (folder / "examples").symlink_to(ROOT / "examples")
    return folder


def test_the_sbatch_rule_fails_on_a_broken_doc(tmp_path: Path, monkeypatch) -> None:
    """slurm.md's block passes as written; a script name the slurm line does not write, a slurm line that
    writes to stdout or that the CLI refuses, a config that does not exist, and a writer that loses the srun
    line each fail."""
    from lightning_longctx.cli import slurm

    page = (ROOT / "docs" / "slurm.md").read_text()
    write = next(c for c in text_commands(page) if c.startswith("lightning-longctx slurm"))

    def problems(text: str, name: str) -> list[str]:
        commands = text_commands(text)
        submit = next(c for c in commands if c.startswith("sbatch"))
        return sbatch_problems(commands, submit, _clone_root(tmp_path / name))

    assert problems(page, "as_written") == []
    broken = {
        "other_name": (
            page.replace("sbatch job.sbatch", "sbatch jobs.sbatch"),
            "no `lightning-longctx slurm",
        ),
        "stdout": (page.replace(write, write.replace(" -o job.sbatch", "")), "before it writes job.sbatch"),
        "refused": (
            page.replace(write, write.replace("--nodes 4", "--nodes 0")),
            "(exit 2) wrote no job.sbatch",
        ),
        "no_config": (page.replace("4node_slurm.yaml", "4node.yaml"), "does not exist"),
    }
    for name, (text, why) in broken.items():
        assert text != page and any(why in p for p in problems(text, name)), name
    monkeypatch.setattr(slurm, "_srun_lines", lambda **kw: ["", "srun true"])  # a writer that lost the fit
    assert any("the srun lines are ['srun true']" in p for p in problems(page, "bad_writer"))


# ---- walk-throughs: the reader's path, run whole in a fresh folder ----

#: the first line of a ```yaml block the reader saves as a file before the commands that follow it
SAVE_AS = "# save as "


def walkthrough_steps(path: Path) -> list[tuple[str, str, str]]:
    """The page in reading order: ``("file", name, text)`` for each ```yaml block headed ``# save as NAME``,
    ``("run", command, "")`` for each command."""
    steps = []
    for kind, body in re.findall(r"```(bash|yaml)\n(.*?)```", path.read_text(), re.S):
        if kind == "yaml" and body.startswith(SAVE_AS):
            steps.append(("file", body.splitlines()[0].removeprefix(SAVE_AS).strip(), body))
        elif kind == "bash":
            steps += [("run", cmd, "") for cmd in block_commands(body)]
    return steps


def _fit_config(args: list[str], folder: Path) -> dict:
    import yaml

    return yaml.safe_load((folder / args[args.index("--config") + 1]).read_text())


def _fit_args(args: list[str]) -> list[str] | None:
    """``fit ...`` of a ``lightning-longctx fit`` or ``torchrun ... -m lightning_longctx fit`` command."""
    if args[:2] == ["lightning-longctx", "fit"]:
        return args[1:]
    if args[0] == "torchrun" and "-m" in args:
        module = args.index("-m") + 1
        if args[module : module + 2] == ["lightning_longctx", "fit"]:
            return args[module + 1 :]
    return None


def walkthrough_action(cmd: str) -> str:
    """How the walk-through runs ``cmd``: ``"process"`` (a new Python, for real), ``"cli"`` (our entry point,
    in-process, for real), ``"fit"`` (for real on a CPU config; a GPU config is parsed: ``--print_config``) or
    ``"sbatch"`` (needs a cluster: its script was written by a command before it)."""
    args = shlex.split(cmd)
    if args[0] == "python" and (args[1] == "-c" or args[1].endswith(".py")):
        return "process"
    if _fit_args(args) is not None:
        return "fit"
    if args[0] == "lightning-longctx" and args[1] in ("plan", "export", "slurm"):
        return "cli"
    if args[0] == "sbatch" and len(args) == 2:
        return "sbatch"
    raise AssertionError(f"no walk-through rule runs `{cmd}`; add one in tests/test_docs.py")


@pytest.mark.parametrize("page", WALKTHROUGHS, ids=lambda p: p.name)
def test_walkthrough_steps_are_known(page: Path, tmp_path: Path) -> None:
    """Cheap: every command has a rule that runs it, every saved YAML parses, every config named is saved; an
    ``sbatch`` submits what the slurm command before it writes (run here, in-process)."""
    import yaml

    saved: set[str] = set()
    folder = _clone_root(tmp_path)
    commands = [name for kind, name, _ in walkthrough_steps(page) if kind == "run"]
    for kind, name, text in walkthrough_steps(page):
        if kind == "file":
            assert isinstance(yaml.safe_load(text), dict), f"{page.name}: {name} is not a YAML mapping"
            saved.add(name)
            (folder / name).write_text(text)
            continue
        if walkthrough_action(name) == "sbatch":
            problems = sbatch_problems(commands, name, folder)
            assert not problems, f"{page.name}: {problems}"
        args = shlex.split(name)
        if "--config" in args:
            assert args[args.index("--config") + 1] in saved, (
                f"{page.name}: `{name}` names a config not saved above"
            )
    assert saved and any(k == "run" for k, _, _ in walkthrough_steps(page))


def _argv(args: list[str]) -> list[str]:
    head = {"python": [sys.executable], "lightning-longctx": [sys.executable, "-m", "lightning_longctx"]}
    head["torchrun"] = [sys.executable, "-m", "torch.distributed.run"]
    return [*head[args[0]], *args[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("page", WALKTHROUGHS, ids=lambda p: p.name)
def test_walkthrough_runs_top_to_bottom(page: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """The reader's folder is a clone's root (``examples/`` there); the laptop commands run for real, in order."""
    import os

    from lightning_longctx.cli import main as cli_main

    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    env.update(HF_DATASETS_CACHE=str(tmp_path / ".cache" / "datasets"), HF_HUB_OFFLINE="1")
    for kind, name, text in walkthrough_steps(page):
        if kind == "file":
            (tmp_path / name).write_text(text)
            continue
        args, action = shlex.split(name), walkthrough_action(name)
        if action == "cli":
            status = cli_main(args[1:])
            assert status == 0, f"`{name}`: exit {status}\n{capsys.readouterr().err[-2000:]}"
            continue
        if action == "sbatch":  # needs a cluster: the script the slurm command above wrote, as it asked
            assert (tmp_path / args[1]).is_file(), f"`{name}`: no {args[1]} written above"
            writer = next(
                c
                for k, c, _ in walkthrough_steps(page)
                if c.startswith("lightning-longctx slurm ")
                and _slurm_args(shlex.split(c))[0].get("--output") == args[1]
            )
            problems = sbatch_content_problems(writer, (tmp_path / args[1]).read_text())
            assert not problems, f"`{name}`: {problems}"
            continue
        gpu = action == "fit" and _fit_config(args, tmp_path)["trainer"]["accelerator"] != "cpu"
        if gpu and "--print_config" not in args:
            # a GPU run: its config and arguments parse (one process, no torchrun)
            args = ["lightning-longctx", *_fit_args(args), "--print_config"]
        proc = subprocess.run(_argv(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"`{name}`: exit {proc.returncode}\n{proc.stderr[-3000:]}"
