"""lightning_longctx: Ulysses sequence parallelism and FPDT for PyTorch Lightning."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from lightning.pytorch.strategies import StrategyRegistry

from lightning_longctx import callbacks
from lightning_longctx.attention import fpdt_attention, ulysses_attention
from lightning_longctx.chunked_loss import chunked_lm_head_cross_entropy
from lightning_longctx.integrations.transformers import (
    disable_sequence_parallel,
    enable_activation_checkpointing,
    enable_sequence_parallel,
)
from lightning_longctx.loss import sequence_parallel_cross_entropy
from lightning_longctx.planner import longest_sequence, plan_memory
from lightning_longctx.sharding import gather_sequence, shard_batch, shard_sequence
from lightning_longctx.strategy import UlyssesFPDTStrategy
from lightning_longctx.tiling import tile_mlp_, untile_mlp_

UlyssesFPDTStrategy.register_strategies(StrategyRegistry)

try:
    __version__ = version("lightning-longctx")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "UlyssesFPDTStrategy",
    "__version__",
    "callbacks",
    "chunked_lm_head_cross_entropy",
    "disable_sequence_parallel",
    "enable_activation_checkpointing",
    "enable_sequence_parallel",
    "fpdt_attention",
    "gather_sequence",
    "longest_sequence",
    "plan_memory",
    "sequence_parallel_cross_entropy",
    "shard_batch",
    "shard_sequence",
    "tile_mlp_",
    "ulysses_attention",
    "untile_mlp_",
]
