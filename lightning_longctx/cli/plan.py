"""``lightning-longctx plan``: the memory plan of a LightningCLI config, before launching it.

Usage (the console script routes ``lightning-longctx plan ...`` here)::

    lightning-longctx plan --config examples/configs/llama3_8b_1m_fpdt_8gpu.yaml --device-memory 80GiB
    lightning-longctx plan --config examples/configs/llama3_8b_500k_1gpu.yaml --device-memory 80GiB --host-memory 1TB
    lightning-longctx plan --config my.yaml --seq-len 262144 --json
    lightning-longctx plan --config my.yaml --ring-size auto        # Ulysses x ring: prints r and why

Read from the YAML: ``model.init_args.model_config`` (or ``pretrained_path``, a local directory: only its
``config.json`` is read, so a folder holding just that file plans the model; ``--pretrained-path DIR`` reads it
from another folder, e.g. on a laptop without the weights),
``model.init_args.dtype`` and ``activation_checkpointing``; ``trainer.devices``, ``num_nodes``,
``precision``, ``accelerator`` and ``strategy`` (``UlyssesFPDTStrategy`` with its ``init_args``, e.g.
``activation_offload``, or a
registered name such as ``ulysses_fpdt``); ``data.init_args.seq_len`` and ``batch_size``. The host's
devices default to ``trainer.devices``; ``--host-memory`` is per host (node). ``accelerator: cpu`` plans a CPU
run: no CUDA context in the device reserve.

The strategy's ``ring_size`` (or ``--ring-size``, an int or ``auto``) is taken as given and settled by the
planner against the model's heads per tensor-parallel rank (``config.auto_ring_size``); the plan prints the
ring it runs and why (``planner.ring_choice``), and when the all-to-all has more ranks than heads, what
``auto`` would pick.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_longctx.config import Mode, SequenceParallelConfig
from lightning_longctx.integrations.hf_config import build_config
from lightning_longctx.planner import (
    MemoryPlan,
    format_bytes,
    longest_sequence,
    parse_bytes,
    plan_memory,
    ring_choice,
    step_plan_kwargs,
)

__all__ = ["main", "plan_kwargs_from_config", "slurm_suggestion"]

_OUR_STRATEGY_NAMES = ("ulysses_fpdt", "ulysses", "fpdt_offload")


def _count(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"trainer.{name}={value!r}: the planner needs a number (e.g. {name}: 8) in the config"
        )
    return value


def _strategy_settings(strategy: Any) -> tuple[dict[str, Any], str | None]:
    """The strategy's sequence-parallel settings, and a note when it is not ours (planned as plain DDP)."""
    if isinstance(strategy, dict):
        path = str(strategy.get("class_path", ""))
        if path.split(".")[-1] == "UlyssesFPDTStrategy":
            return dict(strategy.get("init_args") or {}), None
        return {"sequence_parallel_size": 1}, f"strategy {path or strategy!r} is not UlyssesFPDTStrategy"
    if strategy in _OUR_STRATEGY_NAMES:
        from lightning.pytorch.strategies import StrategyRegistry

        import lightning_longctx  # noqa: F401  (registers the names)

        return dict(StrategyRegistry[strategy]["init_params"]), None
    return {"sequence_parallel_size": 1}, f"strategy {strategy!r} is not UlyssesFPDTStrategy"


def _pretrained_config(path: str, overrides: dict[str, Any] | None, given: bool) -> Any:
    """The config of the pretrained model at ``path`` (only its ``config.json`` is read: no weights needed), or
    a ValueError naming the path and the fix when this machine does not have it."""
    folder = Path(path).expanduser()
    where = "--pretrained-path" if given else "model.init_args.pretrained_path"
    missing = f"{where}={path!r}: " + (
        "no config.json in that folder" if folder.is_dir() else "not on this machine"
    )
    fix = (
        "; the plan reads only the model's config.json (no weights): pass --pretrained-path DIR, a local "
        "folder holding it, or give the model's shape as model.init_args.model_config"
    )
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise ValueError(missing + fix)
    try:
        return build_config(None, path, overrides)
    except OSError:  # neither a local folder nor a Hub name in the Hugging Face cache (nothing is downloaded)
        cache = "" if folder.is_absolute() or path.startswith(".") else " (nor in the Hugging Face cache)"
        raise ValueError(missing + cache + fix) from None


def ring_size_arg(text: str) -> int | str:
    """``--ring-size``: a positive int or ``auto``."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use a positive int (1: Ulysses alone) or auto (the smallest r whose Ulysses degree fits "
            "the heads per tensor-parallel rank)"
        )
    return int(text)


def plan_kwargs_from_config(
    config: dict[str, Any],
    *,
    seq_len: int | None = None,
    pretrained_path: str | None = None,
    ring_size: int | str | None = None,
) -> tuple[Any, dict[str, Any], list[str]]:
    """``(model config, plan_memory keyword arguments, notes)`` from a parsed LightningCLI config;
    ``pretrained_path``: a folder to read the model's ``config.json`` from instead of the config's model;
    ``ring_size``: instead of the strategy's (an int or ``"auto"``, settled by the planner against the model's
    heads)."""
    trainer = config.get("trainer") or {}
    model_args = (config.get("model") or {}).get("init_args") or {}
    data_args = (config.get("data") or {}).get("init_args") or {}
    notes: list[str] = []

    overrides = model_args.get("config_overrides")  # CausalLM's: the planned model is the trained one
    if pretrained_path is not None or model_args.get("pretrained_path") is not None:
        path = pretrained_path if pretrained_path is not None else model_args["pretrained_path"]
        model = _pretrained_config(str(path), overrides, given=pretrained_path is not None)
    elif model_args.get("model_config") is not None:
        model = dict(model_args["model_config"])
        if overrides:
            model = build_config(model, None, overrides)
    else:
        raise ValueError(
            "the config has no model.init_args.model_config or pretrained_path to read the model from"
        )

    devices = _count(trainer.get("devices", 1), "devices")
    world = devices * _count(trainer.get("num_nodes", 1), "num_nodes")
    settings, note = _strategy_settings(trainer.get("strategy", "auto"))
    if note:
        notes.append(f"{note}: planned as DDP without sequence parallelism")
    fields = {f.name for f in dataclasses.fields(SequenceParallelConfig)}
    # ring_size travels as given (an int or "auto") to the planner, which settles "auto" against the model's
    # heads and validates r with the strategy's own rules (resolve_parallel)
    ring = settings.get("ring_size", 1) if ring_size is None else ring_size
    fields.discard("ring_size")
    given = SequenceParallelConfig(**{k: v for k, v in settings.items() if k in fields})
    device_type = "cpu" if str(trainer.get("accelerator", "auto")) == "cpu" else "cuda"
    cfg = given.resolve(world_size=world, devices_per_node=devices, device_type=device_type)
    if given.offload == "auto":
        notes.append(f"offload='auto': planned {'on (a GPU run)' if cfg.offload else 'off (CPU)'}")

    n = seq_len if seq_len is not None else data_args.get("seq_len")
    if n is None:
        raise ValueError("no sequence length: the config has no data.init_args.seq_len; pass --seq-len")
    kwargs = step_plan_kwargs(  # the strategy's fit check plans its first step through the same mapping
        cfg,
        seq_len=int(n),
        micro_batch_size=int(data_args.get("batch_size", 1)),
        precision=str(trainer.get("precision", "32-true")),
        param_dtype=model_args.get("dtype"),
        activation_checkpointing=bool(model_args.get("activation_checkpointing")),  # CausalLM's own flag
        device_type=device_type,  # a CPU run's device reserve has no CUDA context
    )
    kwargs["ring_size"] = ring
    lora = model_args.get("lora")  # CausalLM's peft LoRA: frozen base weights, rank-r adapters
    if lora:
        kwargs["lora_rank"] = int(lora.get("r", 8))  # peft's default rank
        kwargs["lora_targets"] = lora.get("target_modules") or "all-linear"
    return model, kwargs, notes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-longctx plan",
        description="Print the memory plan (bytes per device and per host of one training step) of a "
        "LightningCLI config, and with --device-memory the longest sequence that fits.",
    )
    p.add_argument("--config", required=True, help="LightningCLI YAML (as for `lightning-longctx fit`)")
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default: data.init_args.seq_len)"
    )
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GiB, 141GB; adds the longest sequence that fits")  # fmt: skip
    p.add_argument("--host-memory", default=None, help="memory per host (node), e.g. 1.9TB; fits and the longest sequence respect it too")  # fmt: skip
    p.add_argument("--devices-per-host", type=int, default=None, help="devices sharing one host's memory (default: trainer.devices)")  # fmt: skip
    p.add_argument("--device-reserve", default=None, help="device bytes outside the plan (default: 5%% of the peak, plus 1 GiB for the CUDA context unless trainer.accelerator is cpu)")  # fmt: skip
    p.add_argument("--host-reserve", default=None, help="host bytes per rank outside the plan (default: 4 GiB, the process)")  # fmt: skip
    p.add_argument("--pretrained-path", default=None, help="a local folder with the model's config.json, read instead of the config's model (no weights needed: plan a pretrained_path that is not on this machine)")  # fmt: skip
    p.add_argument("--lora-rank", type=int, default=None, help="plan LoRA adapters of this rank on every linear layer of the blocks (frozen base weights)")  # fmt: skip
    p.add_argument("--ring-size", type=ring_size_arg, default=None, help="Ulysses x ring: r ranks in the ring, sp / r in each all-to-all (an int, or auto: the smallest r whose Ulysses degree fits the heads per tp rank); default: the strategy's ring_size")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.add_argument("--gpu", default=None, help="also estimate the step time, tokens/s and MFU on this device kind: a100-40gb, a100-80gb, h100, h200, b200, or cpu (this machine's rates, measured by benchmarks/calibrate_step_time.py, read from --device-spec)")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node for the step-time estimate's links (default: trainer.devices)")  # fmt: skip
    p.add_argument("--device-spec", default=None, help="JSON of a user-given device's rates (DeviceSpec fields; \"base\": \"h100\" to override a known kind); with --gpu cpu: the calibration file benchmarks/calibrate_step_time.py wrote")  # fmt: skip
    p.add_argument("--attention-kernel", default=None, help="attention kernel of the device's table for the estimate (fa2, fa3, cudnn; default: what this package runs there)")  # fmt: skip
    p.add_argument("--document-length", type=int, default=None, help="tokens per packed document for the estimate (attention never crosses one)")  # fmt: skip
    return p


def _step_time(args: argparse.Namespace, model: Any, kwargs: dict[str, Any], max_steps: Any) -> Any:
    """The step-time estimate of ``--gpu`` (None without it), from the same settings as the plan."""
    if args.gpu is None and args.device_spec is None:
        return None
    from lightning_longctx.planner.devices import load_spec
    from lightning_longctx.planner.step_time import estimate_step_time

    if str(args.gpu).lower() == "cpu" and (args.device_spec is None or not Path(args.device_spec).is_file()):
        given = "" if args.device_spec is None else f" ({args.device_spec}: no such file)"
        raise ValueError(
            f"--gpu cpu reads this machine's measured rates from --device-spec FILE{given}; measure them "
            "once with `python benchmarks/calibrate_step_time.py --out FILE` (in a checkout of the repository)"
        )
    gpu: Any = args.gpu if args.device_spec is None else load_spec(args.device_spec)
    steps = int(max_steps) if isinstance(max_steps, int) and max_steps > 0 else None
    return estimate_step_time(
        model, gpu=gpu, gpus_per_node=args.gpus_per_node, attention_kernel=args.attention_kernel,
        document_length=args.document_length, max_steps=steps, **kwargs,
    )  # fmt: skip


#: seconds a job spends before its first step (imports, model build, checkpoint load, first compilation)
SLURM_STARTUP_S = 600
#: a margin over the estimated steps (the model's error on published runs is within 7 %, on CPUs 25 %)
SLURM_TIME_MARGIN = 1.15
#: checkpoint write bandwidth per rank assumed for the signal lead time (a parallel filesystem client)
CHECKPOINT_WRITE_BYTES_PER_S = 1e9


def slurm_suggestion(
    config_path: str | Path, gpu: str, *, gpus_per_node: int | None = None
) -> dict[str, Any]:
    """What ``lightning-longctx slurm --gpu KIND`` suggests for a config: the step time (the step-time model on
    ``gpu``), ``time`` for ``trainer.max_steps`` steps (x ``SLURM_TIME_MARGIN`` + ``SLURM_STARTUP_S``, rounded up
    to 5 minutes, sbatch's ``D-HH:MM:SS``) and ``signal_lead`` (one step plus one checkpoint save: the rank's
    weights and optimizer state at ``CHECKPOINT_WRITE_BYTES_PER_S``, plus a minute)."""
    import yaml

    from lightning_longctx.planner.step_time import estimate_step_time, format_seconds

    path = Path(config_path)
    if not path.is_file():
        raise ValueError(f"--config {config_path}: no such file")
    config = yaml.safe_load(path.read_text()) or {}
    model, kwargs, _ = plan_kwargs_from_config(config)
    steps = (config.get("trainer") or {}).get("max_steps")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"{config_path}: trainer.max_steps={steps!r}; --time auto needs a positive max_steps"
        )
    est = estimate_step_time(model, gpu=gpu, gpus_per_node=gpus_per_node, max_steps=steps, **kwargs)
    plan = plan_memory(model, **kwargs)
    state = sum(plan[name].device + plan[name].host for name in ("weights", "optimizer state"))
    lead = int(est.step_time_s + state / CHECKPOINT_WRITE_BYTES_PER_S + 60)
    total = int(-(-(steps * est.step_time_s * SLURM_TIME_MARGIN + SLURM_STARTUP_S) // 300) * 300)
    days, rest = divmod(total, 86400)
    hms = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    note = (
        f"step-time model on {est.device}: {format_seconds(est.step_time_s)} per step, MFU {100 * est.mfu:.1f} %; "
        f"{steps:,} steps take {format_seconds(steps * est.step_time_s)}: suggest --time {days}-{hms} "
        f"(x{SLURM_TIME_MARGIN} + {SLURM_STARTUP_S // 60} min start-up) and --signal-lead {lead} (one step + a "
        f"{format_bytes(state)} checkpoint at {CHECKPOINT_WRITE_BYTES_PER_S / 1e9:g} GB/s per rank)"
    )
    return {"time": f"{days}-{hms}", "signal_lead": lead, "step_time_s": est.step_time_s, "note": note}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on a bad argument or config, like argparse)."""
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        import yaml

        path = Path(args.config)
        if not path.is_file():
            raise ValueError(f"--config {args.config}: no such file")
        config = yaml.safe_load(path.read_text()) or {}
        model, kwargs, notes = plan_kwargs_from_config(
            config, seq_len=args.seq_len, pretrained_path=args.pretrained_path, ring_size=args.ring_size
        )
        memory = None if args.device_memory is None else parse_bytes(args.device_memory)
        given = {"host_memory": args.host_memory, "devices_per_host": args.devices_per_host,
                 "device_reserve": args.device_reserve, "host_reserve": args.host_reserve,
                 "lora_rank": args.lora_rank}  # fmt: skip
        kwargs.update({k: v for k, v in given.items() if v is not None})
        plan: MemoryPlan = plan_memory(model, device_memory=memory, **kwargs)
        ring = ring_choice(model, **kwargs)
        hint = ring.hint()
        if hint is not None:
            notes.append(hint)
        longest = None
        if memory is not None:
            search = {k: v for k, v in kwargs.items() if k not in ("seq_len", "sequence_parallel_size")}
            longest = longest_sequence(
                model, device_memory=memory, sequence_parallel_size=kwargs["sequence_parallel_size"], **search
            )
        timing = _step_time(args, model, kwargs, (config.get("trainer") or {}).get("max_steps"))
    except ValueError as err:  # a config or a value the plan cannot take: one line, no traceback
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = {**plan.to_dict(), "longest_seq_len": longest, "notes": notes}
        out["ring_choice"] = {**dataclasses.asdict(ring), "ulysses": ring.ulysses, "text": ring.text()}
        if timing is not None:
            t = timing.to_dict()
            out.update(
                step_time_s=t["step_time_s"], tokens_per_s=t["tokens_per_s"], mfu=t["mfu"], step_time=t
            )
        print(json.dumps(out, indent=2))
        return 0
    print(plan.table())
    if ring.ring_size > 1 or kwargs["ring_size"] != 1:  # a ring asked for or run: which r, and why
        print(ring.text())
    for note in notes:
        print(f"note: {note}")
    if longest is not None:
        step = "P x chunk" if kwargs["mode"] == Mode.FPDT else "P x 1024"
        within = f"{format_bytes(memory)} per device" + (
            f" and {format_bytes(plan.host_memory)} per host" if plan.host_memory is not None else ""
        )
        print(f"longest sequence within {within}: {longest:,} tokens (multiples of {step})")
    if timing is not None:
        print()
        print(timing.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
