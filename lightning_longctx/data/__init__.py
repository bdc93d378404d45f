"""Data: packed rows of documents for sequence-parallel training. Nothing here downloads anything.

* :mod:`~lightning_longctx.data.packing`: the resumable ``DataLoader``, the byte tokenizer, document packing and
  local text files (``TextFilesDataModule``);
* :mod:`~lightning_longctx.data.hf`: ``HFDatasetDataModule``, corpora larger than host memory on Hugging Face
  ``datasets``, imported on first access so that importing this package does not import the optional ``datasets``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_longctx.data.packing import (
    ByteTokenizer,
    PackedDataModule,
    PackedDataset,
    ResumableDataLoader,
    TextFilesDataModule,
    pack_documents,
    validation_documents,
)

if TYPE_CHECKING:  # imported on first access by __getattr__ below
    from lightning_longctx.data.hf import HFDatasetDataModule

__all__ = [
    "ByteTokenizer",
    "HFDatasetDataModule",
    "PackedDataModule",
    "PackedDataset",
    "ResumableDataLoader",
    "TextFilesDataModule",
    "pack_documents",
    "validation_documents",
]


def __getattr__(name: str) -> Any:
    """``HFDatasetDataModule`` on first access: ``datasets`` stays optional and is not imported with this package."""
    if name == "HFDatasetDataModule":
        from lightning_longctx.data.hf import HFDatasetDataModule

        return HFDatasetDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
