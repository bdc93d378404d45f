"""Core data plumbing: a resumable ``DataLoader`` and packed local text files.

Batches are dicts of ``(batch, seq_len)`` long tensors, in the Hugging Face
convention: ``labels[t]`` is the token at ``t`` (or ``-100``), and the model's logits at ``t``
predict ``labels[t + 1]`` after the usual shift (done by ``shard_batch`` before sharding under
sequence parallelism). Nothing here downloads anything.

The dataloaders are plain ``DataLoader``s without a sampler: Lightning injects the
``DistributedSampler`` (over the data-parallel ranks only, see the strategy), so every rank of a
sequence-parallel group sees the same sample and shards it.

Corpora larger than host memory: :class:`~lightning_longctx.data.hf.HFDatasetDataModule` (on Hugging Face
``datasets``, tokenized once into the datasets cache, read memory-mapped).

The demo's synthetic recall task lives in :mod:`lightning_longctx.recipes.recall`, built on this module.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_longctx.parallel.sharding import IGNORE_INDEX


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that resumes mid-epoch: Lightning saves ``state_dict()`` in checkpoints and,
    on resume, ``load_state_dict()`` makes the next ``iter()`` skip the batches already trained on.

    With the (seeded, per-epoch) ``DistributedSampler`` Lightning injects, the resumed run then sees
    exactly the batches an uninterrupted run would have seen. Skipped batches are read and dropped,
    which costs their loading time once.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._skip = 0

    def __iter__(self) -> Any:
        it = super().__iter__()
        skip, self._skip = self._skip, 0
        self._yielded = 0
        for _ in range(skip):
            next(it)
            self._yielded += 1
        for batch in it:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state["batches_yielded"])


# ----------------------------------------------------------------------------------------------
# Packed local text files
# ----------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens, no vocabulary file needed.

    Ids: ``0`` PAD, ``1`` BOS, ``2`` EOS, ``3 + b`` for byte ``b``; ``vocab_size = 259``.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    offset = 3
    vocab_size = 256 + offset

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of :meth:`encode`; special ids are dropped, broken UTF-8 is replaced."""
        return bytes(i - self.offset for i in ids if i >= self.offset).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


class _HFTokenizer:
    """Adapter giving a local ``transformers`` tokenizer the :class:`ByteTokenizer` interface."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        # local_files_only: this package never downloads; a hub name fails here, clearly.
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.bos_token_id: int | None = self.tok.bos_token_id
        self.eos_token_id: int | None = self.tok.eos_token_id
        if self.eos_token_id is None:
            raise ValueError(
                f"tokenizer {path!r} has no EOS token; packing needs one to separate documents. "
                "Set `eos_token` in its tokenizer_config.json."
            )
        # Pads are never trained on (labels -100), so EOS is a safe stand-in when no PAD exists.
        pad = self.tok.pad_token_id
        self.pad_token_id: int = self.eos_token_id if pad is None else pad
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        # verbose=False: documents are longer than model_max_length by design; we pack them.
        return self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size


def _find_files(paths: Sequence[str]) -> list[Path]:
    """``.txt`` / ``.jsonl`` files named in ``paths`` or found (recursively) under them, sorted."""
    suffixes = (".txt", ".jsonl")
    if isinstance(paths, str):  # a bare string would be iterated character by character
        paths = [paths]
    files: list[Path] = []
    missing: list[str] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes))
        elif p.is_file():
            if p.suffix not in suffixes:
                raise ValueError(
                    f"{str(p)!r} is neither .txt (one document) nor .jsonl (one document per line); "
                    "rename it or convert it."
                )
            files.append(p)
        else:
            missing.append(str(p))
    if missing:
        raise ValueError(f"paths {missing} do not exist; pass existing .txt/.jsonl files or directories.")
    if not files:
        raise ValueError(
            f"no .txt or .jsonl files found in paths={list(map(str, paths))}; pass files or "
            "directories that contain .txt (one document per file) or .jsonl (one document per line) files."
        )
    return files


def _read_documents(files: Sequence[Path], text_key: str) -> list[str]:
    """Non-empty documents in file order: a whole ``.txt`` file, or each ``.jsonl`` line's ``text_key``."""
    docs: list[str] = []
    for f in files:
        if f.suffix == ".txt":
            docs.append(f.read_text(encoding="utf-8"))
            continue
        with f.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or text_key not in record:
                    raise ValueError(
                        f"{f}:{lineno} has no key {text_key!r}; set text_key to the field holding the text."
                    )
                docs.append(str(record[text_key]))
    return [d for d in docs if d]


def pack_documents(
    docs: Sequence[Sequence[int]],
    *,
    seq_len: int,
    pad_id: int,
    ignore_index: int = IGNORE_INDEX,
    continue_documents: bool = False,
) -> dict[str, Tensor]:
    """Concatenate tokenized documents and cut them into ``seq_len`` rows.

    Each document in ``docs`` should already end with EOS. A document longer than what is left of its row is
    split at the row edge, and its rest starts the next row as a new document (positions from 0): a row is an
    independent sequence, its tokens cannot attend to the row before, and positions carried on would only take
    a long document past what the model's RoPE covers (the strategy refuses such a batch). So no position
    reaches ``seq_len``. ``continue_documents=True`` carries the positions on into the next row instead.

    Returns:
        ``input_ids``, ``labels``, ``position_ids``, each ``(num_rows, seq_len)`` long, where

        - ``position_ids`` restart at 0 at every document start (document-resetting positions:
          the package's attention never attends across a reset, and RoPE sees each document
          from position 0);
        - ``labels`` = ``input_ids``, except ``ignore_index`` at document starts (so no loss asks
          to predict a document's first token from the previous document) and on padding;
        - the last row is padded with ``pad_id``; pad positions continue after the last token.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1.")
    lengths = torch.tensor([len(d) for d in docs], dtype=torch.long)
    if len(docs) == 0 or int(lengths.sum()) == 0:
        raise ValueError("no tokens to pack: every document is empty.")
    ids = torch.cat([torch.as_tensor(list(d), dtype=torch.long) for d in docs])
    total = ids.numel()
    starts = torch.cumsum(lengths, 0) - lengths
    # position within the own document: global index minus the document's start index
    pos = torch.arange(total) - torch.repeat_interleave(starts, lengths)
    if not continue_documents:  # a document's piece that opens a row starts over at 0
        pos = _restart_at_rows(pos, seq_len)

    rows = -(-total // seq_len)
    n_pad = rows * seq_len - total
    ids = torch.cat([ids, torch.full((n_pad,), pad_id, dtype=torch.long)])
    pos = torch.cat([pos, pos[-1] + 1 + torch.arange(n_pad)])
    labels = ids.clone()
    labels[pos == 0] = ignore_index
    labels[total:] = ignore_index
    return {
        "input_ids": ids.view(rows, seq_len),
        "labels": labels.view(rows, seq_len),
        "position_ids": pos.view(rows, seq_len),
    }


def _restart_at_rows(pos: Tensor, seq_len: int) -> Tensor:
    """Positions ``(total,)`` in their documents, with each row's first piece (the tokens before the row's first
    position 0) counted from 0: the document it continues is split at the row edge."""
    starts = torch.arange(pos.numel()) // seq_len * seq_len  # each token's row start
    document = torch.cumsum((pos == 0).long(), 0)  # each token's document number
    return torch.where(document == document[starts], pos - pos[starts], pos)


class PackedDataset(Dataset):
    """Rows of :func:`pack_documents`: items are dicts of ``(seq_len,)`` long tensors."""

    def __init__(self, packed: dict[str, Tensor]) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return self.packed["input_ids"].shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {k: v[index] for k, v in self.packed.items()}

    def max_positions(self) -> int:
        """The largest position id of any row, + 1: the longest sequence a model's RoPE must cover."""
        return int(self.packed["position_ids"].max()) + 1


def validation_documents(num_docs: int, fraction: float, seed: int) -> Tensor:
    """``(num_docs,)`` bool: which documents are held out for validation. A seeded choice of whole documents
    (no text is both trained and validated on), the same in every process; at least one whenever
    ``fraction > 0``, and refused when none would be left for training. Shared by the datamodules."""
    n_val = max(round(fraction * num_docs), 1) if fraction > 0 else 0
    if n_val >= num_docs:
        raise ValueError(
            f"val_fraction={fraction} of {num_docs} documents leaves none for training; "
            "add documents or lower val_fraction."
        )
    is_val = torch.zeros(num_docs, dtype=torch.bool)
    is_val[torch.randperm(num_docs, generator=torch.Generator().manual_seed(seed))[:n_val]] = True
    return is_val


class PackedDataModule(L.LightningDataModule):
    """The loaders of a datamodule whose ``setup()`` sets ``train_dataset`` and ``val_dataset`` (``None``: no
    validation): resumable, shuffled for training, ``batch_size`` and ``num_workers`` from the subclass."""

    train_dataset: Dataset | None
    val_dataset: Dataset | None
    batch_size: int
    num_workers: int

    def max_positions(self) -> int | None:
        """The largest position id of any training or validation row, + 1 (after ``setup()``): what the
        strategy checks against the model's RoPE before the first step; ``None`` when a dataset cannot tell
        (it has no ``max_positions()``)."""
        self.setup("fit")
        found = [
            getattr(d, "max_positions", None) for d in (self.train_dataset, self.val_dataset) if d is not None
        ]
        if not found or not all(callable(f) for f in found):
            return None
        return max(f() for f in found)

    @override
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return ResumableDataLoader(
            self.train_dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers
        )

    @override
    def val_dataloader(self) -> DataLoader | list:
        self.setup("validate")
        if self.val_dataset is None:
            return []  # no validation asked for: Lightning skips validation for an empty list
        return ResumableDataLoader(
            self.val_dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )


class TextFilesDataModule(PackedDataModule):
    """Local text, tokenized and packed into ``seq_len`` sequences with document-resetting positions.

    Items: ``input_ids``, ``labels``, ``position_ids``, each ``(seq_len,)`` long; see
    :func:`pack_documents` for the packing rules (positions reset to 0 at each document start,
    ``labels = -100`` there and on padding). Each document is ``[BOS] tokens EOS`` (BOS only when
    the tokenizer has one and ``add_bos``). The corpus is read and tokenized in ``setup()`` by
    every process and held in memory: meant for corpora that fit in RAM.

    Args:
        paths: ``.txt`` files (whole file = one document), ``.jsonl`` files (one document per line,
            text under ``text_key``), or directories searched recursively for both.
        seq_len: tokens per packed sequence (the global length, before sequence sharding).
        batch_size: sequences per batch per data-parallel rank.
        tokenizer: a LOCAL directory for ``AutoTokenizer.from_pretrained(..., local_files_only=True)``;
            ``None`` uses :class:`ByteTokenizer` (PAD 0, BOS 1, EOS 2, byte ``b`` -> ``3 + b``; 259 ids).
        text_key: field of a ``.jsonl`` record that holds the text.
        val_fraction: fraction of documents (chosen by ``seed``) held out for validation.
        seed: seeds the validation split.
        num_workers: ``DataLoader`` workers.
        add_bos: prepend the tokenizer's BOS to each document.
        continue_documents: a document longer than its row carries its positions on into the next row instead
            of starting it over as a new document (:func:`pack_documents`).
    """

    def __init__(
        self,
        paths: list[str],
        seq_len: int = 2048,
        batch_size: int = 1,
        tokenizer: str | None = None,
        text_key: str = "text",
        val_fraction: float = 0.0,
        seed: int = 0,
        num_workers: int = 0,
        add_bos: bool = True,
        continue_documents: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1).")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1.")
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.tokenizer_path = tokenizer
        self.text_key = text_key
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.add_bos = add_bos
        self.continue_documents = continue_documents
        self._tokenizer: ByteTokenizer | _HFTokenizer | None = None
        self.train_dataset: PackedDataset | None = None
        self.val_dataset: PackedDataset | None = None

    @property
    def tokenizer(self) -> ByteTokenizer | _HFTokenizer:
        """Loaded on first use, so constructing the datamodule (e.g. by the CLI) stays cheap."""
        if self._tokenizer is None:
            self._tokenizer = (
                ByteTokenizer() if self.tokenizer_path is None else _HFTokenizer(self.tokenizer_path)
            )
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def _tokenize(self, text: str) -> list[int]:
        tok = self.tokenizer
        bos = [tok.bos_token_id] if self.add_bos and tok.bos_token_id is not None else []
        return bos + tok.encode(text) + [tok.eos_token_id]

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        docs = _read_documents(_find_files(self.paths), self.text_key)
        if not docs:
            raise ValueError(f"all documents in paths={self.paths} are empty; nothing to train on.")
        is_val = validation_documents(len(docs), self.val_fraction, self.seed)
        n_val = int(is_val.sum())
        pack = functools.partial(
            pack_documents, seq_len=self.seq_len, pad_id=self.tokenizer.pad_token_id,
            continue_documents=self.continue_documents,
        )  # fmt: skip
        train_tokens = [self._tokenize(d) for d, v in zip(docs, is_val.tolist()) if not v]
        self.train_dataset = PackedDataset(pack(train_tokens))
        if n_val:
            val_tokens = [self._tokenize(d) for d, v in zip(docs, is_val.tolist()) if v]
            self.val_dataset = PackedDataset(pack(val_tokens))
