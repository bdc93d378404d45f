"""Docs don't rot: every shell command in README.md, docs/ and benchmarks/README.md is exercised.

Cheap commands run here for real (sbatch generation); configs are parsed; for long runs every flag the
docs use must exist in the script's ``--help`` (the runs themselves are in test_cli.py,
test_benchmarks_smoke.py and test_faults.py); install and test commands must be what .ci/run does.
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
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def documented_commands() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                cmd = line.split("  #")[0].strip()
                if cmd and not cmd.startswith("#"):
                    out.append((path.relative_to(ROOT).as_posix(), cmd))
    return out


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
