"""``PeriodicCheckpoint``: a committed checkpoint every N optimizer steps, the newest K kept."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

__all__ = ["PeriodicCheckpoint"]

#: the ModelCheckpoint arguments PeriodicCheckpoint sets itself
_SET_HERE = frozenset(
    {"filename", "monitor", "mode", "save_top_k", "auto_insert_metric_name", "every_n_epochs"}
)
_STEP_NAME = re.compile(r"step-(\d{8})\.ckpt")


class PeriodicCheckpoint(ModelCheckpoint):
    """Save ``step-00000123.ckpt`` every ``every_n_train_steps`` optimizer steps into ``dirpath`` and keep the
    newest ``keep_latest_k`` (Lightning's ``ModelCheckpoint`` monitoring the step, so it resumes and
    configures from YAML like it). Under :class:`~lightning_longctx.UlyssesFPDTStrategy` each save is a
    committed sharded checkpoint (a directory every rank writes), and older ones are deleted only once the
    newer one is committed, also with ``async_save``; the preemption save uses the same names, so
    :func:`lightning_longctx.lightning.checkpoint.latest_checkpoint` (``--ckpt_path auto``) finds the newest of all.

    Args:
        dirpath: the folder (default: Lightning's, ``<default_root_dir>/.../checkpoints``).
        every_n_train_steps: optimizer steps between saves.
        keep_latest_k: how many to keep (``-1``: all).
        kwargs: ``ModelCheckpoint``'s others (``save_last``, ``save_weights_only``, ...), except the ones set
            here.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int = 1000,
        keep_latest_k: int = 2,
        **kwargs: Any,
    ) -> None:
        if (
            isinstance(every_n_train_steps, bool)
            or not isinstance(every_n_train_steps, int)
            or every_n_train_steps < 1
        ):
            raise ValueError(
                f"every_n_train_steps={every_n_train_steps!r}: use a positive number of optimizer steps"
            )
        if (
            isinstance(keep_latest_k, bool)
            or not isinstance(keep_latest_k, int)
            or (keep_latest_k < 1 and keep_latest_k != -1)
        ):
            raise ValueError(
                f"keep_latest_k={keep_latest_k!r}: use a positive count, or -1 to keep every checkpoint"
            )
        # LightningCLI passes every ModelCheckpoint argument, at its default: only a different value is a clash
        defaults = inspect.signature(ModelCheckpoint.__init__).parameters
        taken = sorted(k for k in _SET_HERE & set(kwargs) if kwargs[k] != defaults[k].default)
        if taken:
            raise TypeError(
                f"PeriodicCheckpoint sets {taken} itself (got {', '.join(f'{k}={kwargs[k]!r}' for k in taken)}); "
                "remove them (or use ModelCheckpoint)"
            )
        kwargs = {k: v for k, v in kwargs.items() if k not in _SET_HERE}
        super().__init__(
            dirpath=dirpath,
            filename="step-{step:08d}",
            monitor="step",
            mode="max",
            save_top_k=keep_latest_k,
            every_n_train_steps=every_n_train_steps,
            auto_insert_metric_name=False,
            **kwargs,
        )
        self.keep_latest_k = keep_latest_k

    @override
    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self._drop_older_strays(trainer)

    def _drop_older_strays(self, trainer: L.Trainer) -> None:
        """Delete the ``step-*.ckpt`` in ``dirpath`` older than every checkpoint kept: the preemption saves, which
        share the naming but are not in ``ModelCheckpoint``'s record, would otherwise pile up, one per requeue."""
        if self.keep_latest_k == -1 or self.dirpath is None or not self.best_k_models:
            return
        kept = {Path(p).name for p in self.best_k_models}
        oldest = min((step for step in map(_step_of, kept) if step is not None), default=None)
        if oldest is None:
            return
        for path in Path(self.dirpath).glob("step-*.ckpt"):
            step = _step_of(path.name)
            if path.name not in kept and step is not None and step < oldest:
                trainer.strategy.remove_checkpoint(path)


def _step_of(name: str) -> int | None:
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None
