"""The command line: ``lightning-longctx`` (:mod:`~lightning_longctx.cli.main`: LightningCLI and the subcommands),
``plan`` (:mod:`~lightning_longctx.cli.plan`), ``slurm`` (:mod:`~lightning_longctx.cli.slurm`) and ``export``
(:mod:`~lightning_longctx.cli.export`)."""

from lightning_longctx.cli.main import LongCtxCLI, auto_checkpoint, main, torchrun_world

__all__ = ["LongCtxCLI", "auto_checkpoint", "main", "torchrun_world"]
