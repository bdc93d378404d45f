"""A progress bar that reads right for step-based runs (``max_steps`` set, no ``max_epochs``).

Lightning then trains with ``max_epochs = -1`` and its bars print "Epoch 0/-2". Ours prints
"Epoch 0" and, as Lightning's own, counts the bar up to ``max_steps``; epoch-based runs read as
usual ("Epoch 2/9"). The CLI installs it unless the config brings its own progress bar.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override

__all__ = ["StepAwareRichProgressBar", "StepAwareTQDMProgressBar", "step_aware_progress_bar"]


def train_description(trainer: L.Trainer) -> str:
    """``"Epoch e/last"``, or ``"Epoch e"`` when the run is bounded by steps only."""
    epochs = trainer.max_epochs
    return f"Epoch {trainer.current_epoch}" + (f"/{epochs - 1}" if epochs is not None and epochs > 0 else "")


class StepAwareTQDMProgressBar(TQDMProgressBar):
    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(train_description(trainer))


class StepAwareRichProgressBar(RichProgressBar):
    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=train_description(trainer))


def step_aware_progress_bar() -> TQDMProgressBar | RichProgressBar:
    """The kind Lightning would pick by default (rich when installed), step-aware."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return StepAwareTQDMProgressBar()
    return StepAwareRichProgressBar()
