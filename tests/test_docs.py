"""Docs don't rot: every shell command in README.md, docs/ and benchmarks/README.md is exercised.

Cheap commands run here for real (sbatch generation); configs are parsed; for long runs every flag the
docs use must exist in the script's ``--help`` (the runs themselves are in test_cli.py,
test_benchmarks_smoke.py and test_faults.py); install and test commands must be what .ci/run does.

A walk-through (docs/finetune.md) is a path a reader follows top to bottom on a laptop, each command using what
the ones before it wrote: it runs whole, in order, in a fresh folder (``test_walkthrough_runs_top_to_bottom``).
"""

from __future__ import annotations

import functools
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


def page_commands(path: Path) -> list[str]:
    return [
        cmd
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
        for cmd in block_commands(block)
    ]


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
        assert "pip install -q torch==2.13.0" in ci and 'pip install -q -e ".[test]"' in ci
    elif cmd == "python -m pytest -q":
        assert "\npython -m pytest -q\n" in ci, ".ci/run must run exactly the README's test command"
    elif args[:2] == ["lightning-longctx", "slurm"]:
        out = tmp_path / "job.sbatch"
        i = args.index("-o")
        assert cli_main([*args[1:i], "-o", str(out), *args[i + 2 :]]) == 0  # in-process: the same entry point
        assert "#SBATCH --signal=SIGUSR1@600" in out.read_text() and "--ckpt_path auto" in out.read_text()
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
    elif args[0] == "sbatch":
        assert (ROOT / args[1]).name == "job.sbatch"  # written by the slurm command above, needs a cluster
    elif args[0] == "torchrun":
        script = next(a for a in args if a.endswith(".py"))
        _help([script])  # the script exists and parses; torchrun launches are tested in test_faults.py
    elif args[0] == "python" and args[1].endswith(".py"):
        help_text = _help([args[1]])
        for flag in _flags(args[2:]):
            assert flag in help_text, f"{where}: {args[1]} has no flag {flag}"
    else:
        pytest.fail(f"{where}: no rule exercises `{cmd}`; add one here")


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
def test_walkthrough_steps_are_known(page: Path) -> None:
    """Cheap: every command has a rule that runs it, every saved YAML parses, every config named is saved."""
    import yaml

    saved: set[str] = set()
    for kind, name, text in walkthrough_steps(page):
        if kind == "file":
            assert isinstance(yaml.safe_load(text), dict), f"{page.name}: {name} is not a YAML mapping"
            saved.add(name)
            continue
        walkthrough_action(name)
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
        if action == "sbatch":
            assert (tmp_path / args[1]).is_file(), f"`{name}`: no {args[1]} written above"
            continue
        gpu = action == "fit" and _fit_config(args, tmp_path)["trainer"]["accelerator"] != "cpu"
        if gpu and "--print_config" not in args:
            # a GPU run: its config and arguments parse (one process, no torchrun)
            args = ["lightning-longctx", *_fit_args(args), "--print_config"]
        proc = subprocess.run(_argv(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"`{name}`: exit {proc.returncode}\n{proc.stderr[-3000:]}"
