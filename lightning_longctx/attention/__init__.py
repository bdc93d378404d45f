"""Sequence-parallel attention: Ulysses and FPDT, over pluggable local kernels."""

from lightning_longctx.attention.common import MaskSpec
from lightning_longctx.attention.fpdt import fpdt_attention
from lightning_longctx.attention.kernels import KERNELS
from lightning_longctx.attention.ulysses import ulysses_attention

__all__ = ["KERNELS", "MaskSpec", "fpdt_attention", "ulysses_attention"]
