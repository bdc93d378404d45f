"""lightning_longctx: Ulysses sequence parallelism and FPDT for PyTorch Lightning."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from lightning_longctx.attention import fpdt_attention, ulysses_attention
from lightning_longctx.loss import sequence_parallel_cross_entropy
from lightning_longctx.sharding import gather_sequence, shard_batch, shard_sequence

try:
    __version__ = version("lightning-longctx")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "__version__",
    "fpdt_attention",
    "gather_sequence",
    "sequence_parallel_cross_entropy",
    "shard_batch",
    "shard_sequence",
    "ulysses_attention",
]
