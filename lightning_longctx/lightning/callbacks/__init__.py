"""Lightning callbacks that know about sequence parallelism: throughput/MFU, memory, checkpoints, preemption,
validation loss by position, needle-in-a-haystack retrieval."""

from __future__ import annotations

from lightning_longctx.lightning.callbacks.checkpoint import PeriodicCheckpoint
from lightning_longctx.lightning.callbacks.memory import MemoryMonitor, max_over_ranks
from lightning_longctx.lightning.callbacks.mfu import MFUMonitor
from lightning_longctx.lightning.callbacks.needle import NeedleRetrieval
from lightning_longctx.lightning.callbacks.positional_loss import PositionalLoss
from lightning_longctx.lightning.preemption import Preempted, Preemption

__all__ = [
    "MFUMonitor",
    "MemoryMonitor",
    "NeedleRetrieval",
    "PeriodicCheckpoint",
    "PositionalLoss",
    "Preempted",
    "Preemption",
    "max_over_ranks",
]
