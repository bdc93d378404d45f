"""The ``lightning-longctx`` console script: LightningCLI, plus ``lightning-longctx slurm``, ``plan`` and
``export`` (``lightning-longctx --help`` lists them all).

::

    lightning-longctx fit --config examples/configs/demo_cpu.yaml
    lightning-longctx validate --config my.yaml --ckpt_path last.ckpt
    lightning-longctx fit --config my.yaml --ckpt_path auto   # the newest committed checkpoint, or fresh
    lightning-longctx slurm --nodes 4 --gpus-per-node 8 --config my.yaml -o train.sbatch
    lightning-longctx plan --config my.yaml --device-memory 80GiB
    lightning-longctx export run/ hf_model/ [--merge-lora] [--dtype bfloat16]   # a save_pretrained folder

Importing this module imports ``lightning_longctx``, which registers the strategy names
(``--trainer.strategy=ulysses_fpdt`` / ``ulysses`` / ``fpdt_offload``). ``--model`` takes any
LightningModule by ``class_path`` (default :class:`lightning_longctx.recipes.CausalLM`), ``--data``
any LightningDataModule (e.g. ``lightning_longctx.recipes.RecallDataModule`` or
``lightning_longctx.data.TextFilesDataModule``). The default is a class path string, so this module
imports no recipe; jsonargparse imports the class when it parses the config.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

import lightning_longctx  # noqa: F401  (registers the strategy names before the Trainer parses them)
from lightning_longctx.cli import export, slurm
from lightning_longctx.cli import plan as plan_cli
from lightning_longctx.lightning.callbacks.progress import step_aware_progress_bar
from lightning_longctx.lightning.checkpoint import commit_info, latest_checkpoint

__all__ = ["LongCtxCLI", "main", "torchrun_world"]

DEFAULT_MODEL = "lightning_longctx.recipes.CausalLM"
#: ``--ckpt_path auto``: the newest committed checkpoint of the run, or a fresh start when there is none
AUTO = "auto"


def auto_checkpoint(trainer: L.Trainer) -> Path | None:
    """The checkpoint ``--ckpt_path auto`` resumes from: the newest committed one (by global step) under the
    trainer's ``default_root_dir`` and every ``ModelCheckpoint``'s folder, or None. Every rank resolves it
    alike from the shared file system (nothing is being written before the run starts)."""
    roots = [Path(trainer.default_root_dir)]
    roots += [
        Path(c.dirpath) for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath
    ]
    found = [path for path in map(latest_checkpoint, dict.fromkeys(roots)) if path is not None]
    if not found:
        return None
    return max(found, key=lambda path: int((commit_info(path) or {}).get("global_step", -1)))


def _device_count(devices: Any) -> int | None:
    """The number of devices a Trainer's ``devices`` asks for; None for "all of them" (``"auto"``, -1, None)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1", ""):
            return None
        if "," in text:  # GPU ids, "0,1"
            return len([i for i in text.split(",") if i.strip()])
        devices = int(text)
    return None if devices is None or devices == -1 else int(devices)


def torchrun_world(devices: Any = "auto", num_nodes: Any = 1) -> tuple[Any, Any]:
    """``(devices, num_nodes)`` for the Trainer. Under torchrun (``TORCHELASTIC_RUN_ID`` set: Lightning's test)
    the world is torchrun's, ``LOCAL_WORLD_SIZE`` processes per node on ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes:
    ``devices="auto"`` (or None, -1) takes the first, ``num_nodes=1`` (Lightning's default) the second, and a
    count that disagrees raises a ValueError that names both and the fix (Lightning would stop at its launcher,
    ``devices=2`` against world size 8). Elsewhere both are returned as given."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "LOCAL_WORLD_SIZE" not in os.environ:
        return devices, num_nodes
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world // local
    asked = _device_count(devices)
    wrong = [f"devices={devices}"] if asked is not None and asked != local else []
    if int(num_nodes or 1) not in (1, nodes):
        wrong.append(f"num_nodes={num_nodes}")
    if wrong or world % local:
        raise ValueError(
            f"{' and '.join(wrong) or 'this launch'}: torchrun started {world} processes, {local} per node "
            f"(WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}), and under torchrun the world is what it started. "
            f"Leave devices at 'auto' (num_nodes at 1) to take torchrun's, set devices={local} and "
            f"num_nodes={nodes}, or launch torchrun with --nproc_per_node {asked or local} --nnodes "
            f"{int(num_nodes or 1)}"
        )
    return (local if asked is None else devices), nodes


class LongCtxCLI(LightningCLI):
    """LightningCLI with ``CausalLM`` as the default ``--model`` class, a progress bar that reads right for
    step-based runs ("Epoch 0" and steps up to ``max_steps``, not Lightning's "Epoch 0/-2"), and under torchrun
    the devices and nodes torchrun started (:func:`torchrun_world`)."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}})

    @override
    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        config = self.config_init.get(str(self.subcommand), self.config_init).get("trainer", {})
        # under torchrun the world is torchrun's (a config's devices: auto takes it; a different count is refused)
        devices, num_nodes = torchrun_world(
            kwargs.get("devices", config.get("devices", "auto")),
            kwargs.get("num_nodes", config.get("num_nodes", 1)),
        )
        kwargs.update(devices=devices, num_nodes=num_nodes)
        callbacks = list(kwargs.get("callbacks", config.get("callbacks")) or [])
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            kwargs["callbacks"] = [*callbacks, step_aware_progress_bar()]
        return super().instantiate_trainer(**kwargs)

    def _resolve_auto_checkpoint(self, subcommand: str) -> None:
        config = self.config_init[subcommand]
        if config.get("ckpt_path") != AUTO:
            return
        path = auto_checkpoint(self.trainer)
        if path is None:
            rank_zero_info(
                f"--ckpt_path auto: no committed checkpoint under {self.trainer.default_root_dir}; starting fresh"
            )
        else:
            rank_zero_info(f"--ckpt_path auto: resuming from {path}")
        config["ckpt_path"] = None if path is None else str(path)

    def before_fit(self) -> None:
        self._resolve_auto_checkpoint("fit")

    def before_validate(self) -> None:
        self._resolve_auto_checkpoint("validate")

    def before_test(self) -> None:
        self._resolve_auto_checkpoint("test")

    def before_predict(self) -> None:
        self._resolve_auto_checkpoint("predict")


#: the subcommands of our own, beside LightningCLI's: name -> (entry point, one line for ``--help``)
SUBCOMMANDS = {
    "plan": (plan_cli.main, "Memory plan and step time of a config, before launching it."),
    "slurm": (slurm.main, "Write an sbatch script that runs `fit` on SLURM, requeued at the time limit."),
    "export": (export.main, "Write a Hugging Face save_pretrained folder from a checkpoint."),
}


def overview() -> str:
    """``lightning-longctx --help``: every subcommand, LightningCLI's and ours, one line each."""
    lines = ["usage: lightning-longctx SUBCOMMAND [options]   (python -m lightning_longctx is the same)", ""]
    lines += ["Ulysses sequence parallelism and FPDT for PyTorch Lightning.", "", "subcommands:"]
    for name in LongCtxCLI.subcommands():  # fit, validate, test, predict: the Trainer's methods
        first = " ".join((getattr(L.Trainer, name).__doc__ or "").split()).split(". ")[0].rstrip(".")
        lines.append(f"  {name:<9} {first} (LightningCLI).")
    lines += [f"  {name:<9} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "`lightning-longctx SUBCOMMAND --help` gives a subcommand's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-longctx`` and ``python -m lightning_longctx``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return SUBCOMMANDS[args[0]][0](args[1:])
    if args and args[0] in ("-h", "--help"):  # LightningCLI's own help would list its four subcommands only
        print(overview())
        return 0
    LongCtxCLI(
        L.LightningModule,
        None,  # --data optional (a model may bring its own dataloaders); any LightningDataModule class_path
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=None if argv is None else args,
    )
    return 0
