"""Lightning callbacks that know about sequence parallelism: throughput/MFU and memory."""

from __future__ import annotations

from lightning_longctx.callbacks.memory import MemoryMonitor, max_over_ranks
from lightning_longctx.callbacks.mfu import MFUMonitor

__all__ = ["MFUMonitor", "MemoryMonitor", "max_over_ranks"]
