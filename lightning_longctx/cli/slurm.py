"""Write an sbatch script that launches ``lightning-longctx fit`` with ``srun``, one task per GPU.

Usage (the console script routes ``lightning-longctx slurm ...`` here)::

    lightning-longctx slurm --nodes 4 --gpus-per-node 8 --config my.yaml -o train.sbatch \\
        -- --trainer.max_steps=1000
    sbatch train.sbatch

Arguments after ``--`` are appended to the ``fit`` command line. The script passes ``--ckpt_path auto``: a
requeued (or resubmitted) job resumes from the run's newest committed checkpoint, and a first run starts fresh.
SLURM sends SIGUSR1 ``--signal-lead`` seconds before the time limit; every rank then saves at the next optimizer
step and rank 0 requeues the job (lightning_longctx/lightning/preemption.py). The lead time must cover the rest of one
optimizer step plus one checkpoint save.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "write_sbatch"]

# [days-]hours:minutes:seconds, minutes:seconds, minutes, days-hours[:minutes] (sbatch --time forms)
_TIME_RE = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
# Lightning's SLURMEnvironment treats these job names as an interactive session and ignores SLURM.
_INTERACTIVE_JOB_NAMES = ("bash", "interactive")
#: seconds between SLURM's SIGUSR1 and the time limit: one optimizer step (a 1M-token step takes minutes) plus
#: one save of the sharded state, with room to spare
DEFAULT_SIGNAL_LEAD_S = 600
#: sbatch's ``--signal=<sig>@<time>`` takes at most 65535 s
_MAX_SIGNAL_LEAD_S = 65535


def time_limit_seconds(time: str) -> int:
    """An sbatch ``--time`` value in seconds: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``."""
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = [*parts, 0, 0][:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def _check_word(name: str, value: str) -> None:
    """Refuse values that would break out of their ``#SBATCH`` line."""
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"{name}={value!r} must be non-empty and contain no whitespace.")


def write_sbatch(
    *,
    nodes: int,
    gpus_per_node: int,
    config: str,
    time: str = "24:00:00",
    partition: str | None = None,
    account: str | None = None,
    job_name: str = "longctx",
    output: str | None = None,
    extra_args: Sequence[str] = (),
    log_file: str = "%x-%j.out",
    cpus_per_task: int | None = None,
    signal_lead: int = DEFAULT_SIGNAL_LEAD_S,
) -> str:
    """The text of an sbatch script for ``nodes`` x ``gpus_per_node`` ranks.

    Args:
        nodes: number of nodes (``--trainer.num_nodes``).
        gpus_per_node: GPUs per node; one task per GPU (``--trainer.devices``).
        config: the LightningCLI YAML passed to ``fit --config``.
        time: wall-clock limit in an sbatch ``--time`` form, e.g. ``24:00:00`` or ``2-00:00:00``.
        partition / account: optional ``#SBATCH`` lines.
        job_name: ``#SBATCH --job-name``; not ``bash`` or ``interactive``, which Lightning reads
            as an interactive session (it then ignores SLURM and launches nothing).
        output: if given, also write the script to this file.
        extra_args: appended to the ``fit`` command line, e.g. ``["--trainer.max_steps=100"]``.
        log_file: ``#SBATCH --output`` pattern for the job's log (``%x`` job name, ``%j`` job id).
        cpus_per_task: optional ``#SBATCH --cpus-per-task`` (dataloader workers per rank).
        signal_lead: seconds between SIGUSR1 and the time limit (``#SBATCH --signal=SIGUSR1@<lead>``). Rule:
            at least one optimizer step plus one checkpoint save (measure both; a 1M-token step takes minutes).
            Every rank saves at the next step boundary after the signal, so a shorter lead time loses the job's
            work since its last checkpoint.

    Returns:
        The script text.
    """
    _check_arguments(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        config=config,
        time=time,
        partition=partition,
        account=account,
        job_name=job_name,
        log_file=log_file,
        cpus_per_task=cpus_per_task,
        signal_lead=signal_lead,
    )
    lines = _sbatch_header(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        time=time,
        partition=partition,
        account=account,
        job_name=job_name,
        log_file=log_file,
        cpus_per_task=cpus_per_task,
        signal_lead=signal_lead,
    )
    lines += _srun_lines(nodes=nodes, gpus_per_node=gpus_per_node, config=config, extra_args=extra_args)
    text = "\n".join(lines)
    if output is not None:
        Path(output).write_text(text)
    return text


def _check_arguments(
    *,
    nodes: int,
    gpus_per_node: int,
    config: str,
    time: str,
    partition: str | None,
    account: str | None,
    job_name: str,
    log_file: str,
    cpus_per_task: int | None,
    signal_lead: int,
) -> None:
    """Refuse, with the fix, any :func:`write_sbatch` argument sbatch or Lightning would not take."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes={nodes!r} must be an integer >= 1 (e.g. --nodes 1).")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(
            f"gpus_per_node={gpus_per_node!r} must be an integer >= 1 (e.g. --gpus-per-node 8); "
            "this script launches one task per GPU."
        )
    if cpus_per_task is not None and cpus_per_task < 1:
        raise ValueError(f"cpus_per_task={cpus_per_task!r} must be >= 1, or left unset.")
    if not str(config).endswith((".yaml", ".yml")):
        raise ValueError(
            f"config={config!r} must be a LightningCLI YAML file ending in .yaml or .yml "
            "(write one with `lightning-longctx fit --print_config > my.yaml`)."
        )
    if not _TIME_RE.match(time):
        raise ValueError(
            f"time={time!r} is not an sbatch time limit; use e.g. '24:00:00', '2-00:00:00' or '90' (minutes)."
        )
    _check_word("job_name", job_name)
    if job_name in _INTERACTIVE_JOB_NAMES:
        raise ValueError(
            f"job_name={job_name!r} makes Lightning treat the job as an interactive session and skip "
            "its SLURM setup; choose another name, e.g. 'longctx'."
        )
    _check_word("log_file", log_file)
    _check_signal_lead(signal_lead, time)
    for name, value in (("partition", partition), ("account", account)):
        if value is not None:
            _check_word(name, value)


def _check_signal_lead(signal_lead: int, time: str) -> None:
    """Whole seconds that sbatch's ``--signal`` takes, and shorter than the time limit ``time``."""
    if (
        isinstance(signal_lead, bool)
        or not isinstance(signal_lead, int)
        or not 1 <= signal_lead <= _MAX_SIGNAL_LEAD_S
    ):
        raise ValueError(
            f"signal_lead={signal_lead!r} must be whole seconds in 1..{_MAX_SIGNAL_LEAD_S} (sbatch's --signal "
            f"limit); use one optimizer step plus one checkpoint save, e.g. {DEFAULT_SIGNAL_LEAD_S}."
        )
    if signal_lead >= time_limit_seconds(time):
        raise ValueError(
            f"signal_lead={signal_lead} s is not shorter than the time limit {time!r} "
            f"({time_limit_seconds(time)} s): SIGUSR1 would come before any training. Lengthen --time or "
            "shorten --signal-lead (it needs one optimizer step plus one checkpoint save)."
        )


def _sbatch_header(
    *,
    nodes: int,
    gpus_per_node: int,
    time: str,
    partition: str | None,
    account: str | None,
    job_name: str,
    log_file: str,
    cpus_per_task: int | None,
    signal_lead: int,
) -> list[str]:
    """The shebang and every ``#SBATCH`` line, each with the comment that explains it."""
    lines = [
        "#!/bin/bash",
        f"# Generated by `lightning-longctx slurm`: {nodes} node(s) x {gpus_per_node} GPU(s).",
        f"#SBATCH --job-name={job_name}",
        "# One task per node and GPU: Lightning's SLURMEnvironment requires",
        "# ntasks-per-node == trainer.devices and takes each rank from SLURM_PROCID.",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={gpus_per_node}",
        f"#SBATCH --gres=gpu:{gpus_per_node}",
    ]
    if cpus_per_task is not None:
        lines += [
            "# CPU cores per rank, for its dataloader workers.",
            f"#SBATCH --cpus-per-task={cpus_per_task}",
        ]
    lines += [
        f"#SBATCH --time={time}",
        f"# SIGUSR1 {signal_lead} s before the time limit, sent to the srun tasks (no 'B:' prefix, which",
        "# would signal only this batch shell). Every rank saves at the next optimizer step, rank 0",
        "# requeues the job. The lead time must cover one optimizer step plus one checkpoint save.",
        f"#SBATCH --signal=SIGUSR1@{signal_lead}",
        "# Allow the job to be requeued (after the save above, or after a node failure).",
        "#SBATCH --requeue",
        "# Log file; %x = job name, %j = job id. Opened in append mode so a requeued run keeps the log.",
        f"#SBATCH --output={log_file}",
        "#SBATCH --open-mode=append",
    ]
    if partition is not None:
        lines.append(f"#SBATCH --partition={partition}")
    if account is not None:
        lines.append(f"#SBATCH --account={account}")
    return lines


def _srun_lines(*, nodes: int, gpus_per_node: int, config: str, extra_args: Sequence[str]) -> list[str]:
    """The job's body: strict bash, then ``srun lightning-longctx fit`` on the allocation, resuming by default."""
    # a requeued job runs this same command: it resumes from the newest committed checkpoint
    resume = [] if any(a.split("=", 1)[0] == "--ckpt_path" for a in extra_args) else ["--ckpt_path", "auto"]
    cmd = [
        "lightning-longctx",
        "fit",
        "--config",
        str(config),
        f"--trainer.num_nodes={nodes}",
        f"--trainer.devices={gpus_per_node}",
        *resume,
        *extra_args,
    ]
    return [
        "",
        "set -euo pipefail",
        "",
        "# srun starts nodes x gpus_per_node processes; Lightning reads rank, world size and the",
        "# rendezvous address from the SLURM environment, so no torchrun is needed. num_nodes and",
        "# devices are passed explicitly so they always match the allocation above. --ckpt_path auto:",
        "# the newest committed checkpoint of the run (a requeued job resumes there), else a fresh start.",
        "srun " + shlex.join(cmd),
        "",
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-longctx slurm",
        description="Write an sbatch script that runs `lightning-longctx fit` with srun, one task per GPU. "
        "Arguments after `--` are appended to the fit command.",
    )
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (and tasks) per node")
    p.add_argument("--config", required=True, help="LightningCLI YAML config for `fit`")
    p.add_argument("--time", default="24:00:00", help="time limit (default: %(default)s)")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--job-name", default="longctx", help="(default: %(default)s)")
    p.add_argument("--log-file", default="%x-%j.out", help="job log pattern (default: %(default)s)")
    p.add_argument("--cpus-per-task", type=int, default=None)
    p.add_argument(
        "--signal-lead",
        type=_seconds_or_auto,
        default=DEFAULT_SIGNAL_LEAD_S,
        metavar="SECONDS",
        help="SIGUSR1 this many seconds before the time limit; every rank then saves at the next optimizer step "
        "and the job is requeued. Rule: one optimizer step plus one checkpoint save (default: %(default)s; "
        "'auto' with --gpu: the step-time model's one step + one save)",
    )
    p.add_argument(
        "--gpu",
        default=None,
        help="device kind (a100-80gb, h100, h200, b200, ...): estimate the config's step time and suggest --time "
        "and --signal-lead; with --time auto the suggested time is used",
    )
    p.add_argument("-o", "--output", default=None, help="write the script to this file (default: stdout)")
    return p


def _seconds_or_auto(value: str) -> int | str:
    """``--signal-lead``: whole seconds, or ``auto`` (the step-time model's suggestion, needs ``--gpu``)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither whole seconds nor 'auto'") from None


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on a bad argument, like argparse)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.gpu is not None:  # the step-time model's suggestion (plan_cli.slurm_suggestion)
            from lightning_longctx.cli.plan import slurm_suggestion

            hint = slurm_suggestion(args.config, args.gpu, gpus_per_node=args.gpus_per_node)
            print(hint["note"], file=sys.stderr)
            if args.time == "auto":
                args.time = hint["time"]
            if args.signal_lead == "auto":
                args.signal_lead = min(hint["signal_lead"], _MAX_SIGNAL_LEAD_S)
        for name in ("time", "signal_lead"):
            if getattr(args, name) == "auto":
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} auto needs --gpu KIND: the step-time model sizes the job")
        text = write_sbatch(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            config=args.config,
            time=args.time,
            partition=args.partition,
            account=args.account,
            job_name=args.job_name,
            output=args.output,
            extra_args=extra,
            log_file=args.log_file,
            cpus_per_task=args.cpus_per_task,
            signal_lead=args.signal_lead,
        )
    except ValueError as err:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
    else:
        print(f"wrote {args.output}; submit it with: sbatch {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
