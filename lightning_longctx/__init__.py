"""lightning_longctx: Ulysses sequence parallelism and FPDT for PyTorch Lightning."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from lightning.pytorch.strategies import StrategyRegistry

from lightning_longctx import _moved

_moved.install()  # the module paths from before the subpackages (0.6) still import

from lightning_longctx.attention import fpdt_attention, ulysses_attention  # noqa: E402
from lightning_longctx.integrations.transformers import (  # noqa: E402
    disable_sequence_parallel,
    enable_activation_checkpointing,
    enable_sequence_parallel,
)
from lightning_longctx.lightning import callbacks  # noqa: E402
from lightning_longctx.lightning.strategy import UlyssesFPDTStrategy  # noqa: E402
from lightning_longctx.ops.chunked_loss import chunked_lm_head_cross_entropy  # noqa: E402
from lightning_longctx.ops.loss import sequence_parallel_cross_entropy  # noqa: E402
from lightning_longctx.ops.tiling import tile_mlp_, untile_mlp_  # noqa: E402
from lightning_longctx.parallel.sharding import gather_sequence, shard_batch, shard_sequence  # noqa: E402
from lightning_longctx.planner import longest_sequence, plan_memory  # noqa: E402

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
