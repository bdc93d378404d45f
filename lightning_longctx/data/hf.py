"""Hugging Face ``datasets`` corpora for long-context training: tokenized once, read memory-mapped.

:class:`HFDatasetDataModule` loads what ``datasets.load_dataset`` loads (``"json"`` / ``"parquet"`` /
``"text"`` with ``data_files``, a Hub name already in the local cache) or a ``save_to_disk`` folder,
tokenizes it ONCE with ``Dataset.map`` into the datasets cache (``prepare_data``: the first process of
each node), and every process then maps again in ``setup`` — a cache hit, no tokenizer call. Rows are
cut out of the memory-mapped Arrow table on ``__getitem__``: the only per-document state in host memory
is one int64 cumulative length per document (:class:`ArrowPackedDataset`), so RSS does not grow with
the corpus (``benchmarks/bench_data.py`` measures it).

Three kinds of documents, by column (``input_ids`` first, then ``text_column``, then ``messages``):

- text: ``[BOS] tokens EOS``, tokenized exactly as :class:`~lightning_longctx.data.TextFilesDataModule`
  does;
- chat (a column of ``[{"role", "content"}, ...]``): rendered by the tokenizer's chat template, the loss
  on the assistant turns only;
- pre-tokenized (an ``input_ids`` column, optionally ``labels`` with ``-100`` where no loss): used as is.

Packed rows follow :func:`~lightning_longctx.data.pack_documents` bit for bit. ``datasets`` is an optional
dependency (``pip install "lightning-longctx[data]"``); this module imports it when first used.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_longctx.data.packing import PackedDataModule, _HFTokenizer, validation_documents
from lightning_longctx.parallel.sharding import IGNORE_INDEX

if TYPE_CHECKING:
    import datasets

__all__ = ["ArrowPackedDataset", "HFDatasetDataModule"]

PACKINGS = ("documents", "none")
#: ``load_dataset`` builders that read local files: they need ``data_files``
FILE_BUILDERS = ("json", "parquet", "text", "csv", "arrow")
#: bump when the tokenized columns change meaning: part of the cache fingerprint, so old caches are not reused
_FORMAT_VERSION = 1
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _datasets() -> Any:
    """The ``datasets`` module, or an ImportError that says how to install it."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError(
            'HFDatasetDataModule needs Hugging Face `datasets`: pip install "lightning-longctx[data]" '
            '(or pip install "datasets>=2.19").'
        ) from e
    return datasets


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """``load_dataset`` without the network: a Hub name resolves from the local datasets cache only.

    ``datasets`` reads its offline switch from a module constant set at import (``HF_HUB_OFFLINE``); this
    package never downloads, so the switch is on for the duration of the call, then restored."""
    import huggingface_hub.constants as hub_constants

    config = _datasets().config
    saved = config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _saved_to_disk(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    config = _datasets().config
    return path.is_dir() and (
        (path / config.DATASETDICT_JSON_FILENAME).is_file()
        or (path / config.DATASET_STATE_JSON_FILENAME).is_file()
    )


def _is_messages(feature: Any) -> bool:
    """A ``datasets`` feature holding a list of ``{"role", "content"}`` records (a chat)."""
    inner = (
        feature[0] if isinstance(feature, list) and len(feature) == 1 else getattr(feature, "feature", None)
    )
    return isinstance(inner, Mapping) and {"role", "content"} <= set(inner)


def _is_string(feature: Any) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _tokenizer_digest(tok: Any) -> str:
    """What the tokenizer does, hashed: part of the cache fingerprint, so changed files re-tokenize."""
    h = hashlib.sha256(type(tok).__name__.encode())
    backend = getattr(tok, "backend_tokenizer", None)
    h.update(
        backend.to_str().encode() if backend is not None else repr(sorted(tok.get_vocab().items())).encode()
    )
    h.update(repr((tok.chat_template, sorted(tok.special_tokens_map.items()), len(tok))).encode())
    return h.hexdigest()


def _overlapping_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``(num_tokens,)`` bool: tokens whose character range overlaps one of ``spans`` (both in order)."""
    mask = np.zeros(len(offsets), dtype=bool)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[t] = end > spans[k][0]
    return mask


class _Tokenize:
    """The ``Dataset.map`` function: a batch of documents -> ``input_ids`` (and ``loss_mask`` for chat and
    pre-tokenized ``labels``) as int32 / bool arrays, dropping documents shorter than ``min_doc_tokens``.

    Picklable without the tokenizer (loaded lazily in each process): ``datasets`` hashes the pickled state —
    the settings and the tokenizer's digest — into the cache fingerprint, the same in every process."""

    def __init__(
        self,
        kind: str,
        tokenizer: str | None,
        digest: str | None,
        *,
        add_bos: bool,
        min_doc_tokens: int,
        vocab_size: int,
        has_labels: bool = False,
    ) -> None:
        self.kind = kind  # "text" | "chat" | "tokens"
        self.tokenizer = tokenizer
        self.digest = digest
        self.add_bos = add_bos
        self.min_doc_tokens = max(min_doc_tokens, 1)
        self.vocab_size = vocab_size
        self.has_labels = has_labels
        self.version = _FORMAT_VERSION
        self._tok: _HFTokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_tok"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tok = None

    @property
    def tok(self) -> _HFTokenizer:
        if self._tok is None:
            assert self.tokenizer is not None
            self._tok = _HFTokenizer(self.tokenizer)
        return self._tok

    def __call__(self, *args: list[Any]) -> dict[str, list[np.ndarray]]:
        *columns, indices = args  # the input columns, then the rows' indices (with_indices=True)
        if self.kind == "text":
            docs, masks = self._text(columns[0]), None
        elif self.kind == "chat":
            docs, masks = self._chat(columns[0], indices)
        else:
            docs, masks = self._tokens(columns[0], columns[1] if self.has_labels else None, indices)
        keep = [i for i, d in enumerate(docs) if len(d) >= self.min_doc_tokens]
        out = {"input_ids": [docs[i] for i in keep]}
        if masks is not None:
            out["loss_mask"] = [masks[i] for i in keep]
        return out

    def _text(self, texts: list[str | None]) -> list[np.ndarray]:
        """``[BOS] tokens EOS`` per non-empty text (``TextFilesDataModule._tokenize``); empty texts give ``[]``."""
        tok = self.tok
        bos = [tok.bos_token_id] if self.add_bos and tok.bos_token_id is not None else []
        present = [i for i, t in enumerate(texts) if t]
        # one batched call of the fast tokenizer (verbose=False: documents exceed model_max_length by design)
        batch = [texts[i] for i in present]
        encoded = tok.tok(batch, add_special_tokens=False, verbose=False)["input_ids"] if batch else []
        docs = [np.zeros(0, dtype=np.int32)] * len(texts)
        for i, ids in zip(present, encoded):
            docs[i] = np.asarray([*bos, *ids, tok.eos_token_id], dtype=np.int32)
        return docs

    def _chat(self, conversations: list[list[dict] | None], indices: list[int]) -> tuple[list, list]:
        """The template's tokens as rendered (no BOS / EOS added) and a mask of the assistant turns' tokens."""
        tok = self.tok.tok
        present = [i for i, conv in enumerate(conversations) if conv]
        docs = [np.zeros(0, dtype=np.int32)] * len(conversations)
        masks = [np.zeros(0, dtype=bool)] * len(conversations)
        if not present:
            return docs, masks
        if _GENERATION_TAG.search(tok.chat_template):  # the template marks the assistant's tokens itself
            out = tok.apply_chat_template(
                [conversations[i] for i in present],
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                tokenizer_kwargs={"verbose": False},
            )
            encoded = zip(out["input_ids"], out["assistant_masks"])
        else:  # spans from rendering prefixes, tokens from offsets
            encoded = []
            for i in present:
                text, spans = _assistant_spans(tok, conversations[i], indices[i])
                enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
                encoded.append((enc["input_ids"], _overlapping_tokens(enc["offset_mapping"], spans)))
        for i, (ids, mask) in zip(present, encoded):
            docs[i] = np.asarray(ids, dtype=np.int32)
            masks[i] = np.asarray(mask, dtype=bool)
        return docs, masks

    def _tokens(
        self, rows: list[list[int]], labels: list[list[int]] | None, indices: list[int]
    ) -> tuple[list, list | None]:
        """Pre-tokenized documents as they are, checked against the vocabulary (and ``labels``, if any)."""
        docs: list[np.ndarray] = []
        masks: list[np.ndarray] | None = None if labels is None else []
        for j, (row, ids) in enumerate(zip(indices, rows)):
            arr = np.asarray(ids if ids is not None else [], dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
                bad = int(arr.max() if arr.max() >= self.vocab_size else arr.min())
                raise ValueError(
                    f"row {row}: input_ids hold id {bad} outside [0, {self.vocab_size}); set vocab_size (or pass "
                    "the tokenizer the ids came from)."
                )
            docs.append(arr.astype(np.int32))
            if masks is not None:
                lab = np.asarray(labels[j] if labels[j] is not None else [], dtype=np.int64)
                keep = lab != IGNORE_INDEX
                if lab.shape != arr.shape or not np.array_equal(lab[keep], arr[keep]):
                    raise ValueError(
                        f"row {row}: labels must have the length of input_ids and hold each token or "
                        f"{IGNORE_INDEX} (unshifted: labels[t] is the token at t, the model shifts); fix the column "
                        "or drop it."
                    )
                masks.append(keep)
        return docs, masks


def _assistant_spans(tok: Any, conv: list[dict], row: int) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns, for a template without
    ``{% generation %}``: a turn runs from the end of the generation prompt rendered after the messages before
    it to the end of the conversation rendered up to it (its end-of-turn markers included)."""
    text = tok.apply_chat_template(conv, tokenize=False)
    spans = []
    for k, message in enumerate(conv):
        if message.get("role") != "assistant":
            continue
        if k == 0:
            raise ValueError(
                f"row {row}: the conversation starts with an assistant turn; without {{% generation %}} markers "
                "in the chat template its span cannot be told from the template's preamble. Add "
                "{% generation %}...{% endgeneration %} around the assistant content in the template."
            )
        head = tok.apply_chat_template(conv[:k], tokenize=False, add_generation_prompt=True)
        upto = tok.apply_chat_template(conv[: k + 1], tokenize=False)
        if not (text.startswith(head) and text.startswith(upto) and len(head) <= len(upto)):
            raise ValueError(
                f"row {row}: the chat template renders a conversation's beginning differently from the whole "
                "(it rewrites earlier turns), so the assistant turns cannot be located by rendering prefixes. "
                "Add {% generation %}...{% endgeneration %} around the assistant content in the template."
            )
        spans.append((len(head), len(upto)))
    return text, spans


class ArrowPackedDataset(Dataset):
    """Rows of ``seq_len`` tokens cut on access out of tokenized documents in a memory-mapped Arrow table.

    ``packing="documents"``: the documents concatenated and cut into rows, exactly
    :func:`~lightning_longctx.data.pack_documents` of them; ``"none"``: one document per row, cut to
    ``seq_len`` or padded (each row is ``pack_documents`` of that one document). ``loss_mask`` (chat, labelled
    pre-tokenized data) additionally sets ``labels = -100`` where it is False.

    Host memory per document: one int64 cumulative length (``"documents"``; ``"none"`` keeps the lengths),
    plus one int64 row number when the documents are a subset of the table (a validation split).

    Items: ``input_ids``, ``labels``, ``position_ids``, each ``(seq_len,)`` long.
    """

    def __init__(
        self,
        table: datasets.Dataset,
        *,
        seq_len: int,
        pad_id: int,
        packing: str = "documents",
        rows: np.ndarray | None = None,
        continue_documents: bool = False,
    ) -> None:
        import pyarrow.compute as pc

        self.table = table.with_format("arrow")
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.packing = packing
        self.continue_documents = continue_documents
        self.rows = rows  # table rows of the documents, in order; None: every row
        self.has_mask = "loss_mask" in table.column_names
        lengths = pc.list_value_length(table.data.column("input_ids")).to_numpy()  # the offsets only
        if rows is not None:
            lengths = lengths[rows]
        self.num_documents = len(lengths)
        if packing == "documents":
            self.cum = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=self.cum[1:])
            self.num_tokens = int(self.cum[-1])
            self._len = -(-self.num_tokens // seq_len)
        else:
            self.lengths = lengths.astype(np.int64)
            self.num_tokens = int(self.lengths.sum())
            self._len = len(lengths)

    def __len__(self) -> int:
        return self._len

    def max_positions(self) -> int:
        """The largest position id of any row, + 1, from the document lengths alone (no row is read): the
        longest stretch between two restarts, a restart being a document start or, unless
        ``continue_documents``, a row start; the last row's padding continues the last document."""
        if self.packing == "none":
            return self.seq_len  # each row one document, padded or cut to the row
        ends = np.arange(self._len + 1, dtype=np.int64) * self.seq_len  # row starts, and the padded end
        cuts = self.cum[:-1] if self.continue_documents else np.union1d(self.cum[:-1], ends[:-1])
        return int(np.diff(np.append(np.unique(cuts), ends[-1])).max())

    def _slice(self, first: int, stop: int) -> Any:
        """The documents ``first..stop-1`` (in this dataset's order) as an Arrow table: zero-copy views of the
        memory map for a contiguous range."""
        if self.rows is None:
            return self.table[first:stop]
        return self.table[self.rows[first:stop].tolist()]

    def _tokens(self, docs: Any, column: str, offset: int, count: int) -> np.ndarray:
        """``count`` values of ``column`` from ``offset`` in the documents' concatenation (copies only those)."""
        import pyarrow.compute as pc

        flat = pc.list_flatten(docs.column(column)).slice(offset, count)
        return flat.to_numpy(zero_copy_only=False)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} of {self._len}")
        s = self.seq_len
        if self.packing == "documents":
            start, end = index * s, min((index + 1) * s, self.num_tokens)
            first = int(np.searchsorted(self.cum, start, side="right")) - 1
            stop = int(np.searchsorted(self.cum, end, side="left"))  # documents starting before `end`
            begins = self.cum[first:stop]
            offset = start - int(begins[0])
        else:
            first, stop, start, offset = index, index + 1, 0, 0
            end = min(int(self.lengths[index]), s)
            begins = np.zeros(1, dtype=np.int64)
        docs = self._slice(first, stop)
        n = end - start
        ids = np.full(s, self.pad_id, dtype=np.int64)
        ids[:n] = self._tokens(docs, "input_ids", offset, n)
        # each token's position in its own document: its index minus its document's first index
        counts = np.diff(np.clip(np.append(begins, end), start, end))
        pos = np.empty(s, dtype=np.int64)
        pos[:n] = np.arange(start, end) - np.repeat(begins, counts)
        if not self.continue_documents:  # the document this row continues starts over (pack_documents)
            pos[: counts[0]] -= pos[0]
        pos[n:] = pos[n - 1] + 1 + np.arange(s - n)  # padding continues the last document
        labels = ids.copy()
        labels[pos == 0] = IGNORE_INDEX  # no loss predicts a document's first token from the one before
        labels[n:] = IGNORE_INDEX
        if self.has_mask:
            labels[:n][~self._tokens(docs, "loss_mask", offset, n).astype(bool)] = IGNORE_INDEX
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(pos),
        }


def _check_settings(
    *,
    dataset: str,
    tokenizer: str | None,
    seq_len: int,
    data_files: str | list[str] | dict[str, str | list[str]] | None,
    packing: str,
    val_split: str | None,
    val_fraction: float,
    min_doc_tokens: int,
    vocab_size: int | None,
    tokenize_batch_size: int,
) -> None:
    """Refuse, naming the fix, the :class:`HFDatasetDataModule` arguments that cannot work together."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1.")
    if packing not in PACKINGS:
        raise ValueError(f"packing={packing!r} is not one of {PACKINGS}.")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1).")
    if val_split is not None and val_fraction > 0:
        raise ValueError(
            f"val_split={val_split!r} and val_fraction={val_fraction} both ask for validation data; pass one."
        )
    if min_doc_tokens < 0:
        raise ValueError(f"min_doc_tokens={min_doc_tokens} must be >= 0.")
    if tokenizer is None and vocab_size is None:
        raise ValueError(
            "tokenizer=None needs vocab_size: without a tokenizer only a pre-tokenized `input_ids` column can "
            "be read, and the model's vocabulary must be known; pass vocab_size=... or a tokenizer directory."
        )
    if tokenizer is not None and vocab_size is not None:
        raise ValueError(
            f"vocab_size={vocab_size} is for pre-tokenized data without a tokenizer; with tokenizer={tokenizer!r} "
            "the vocabulary is the tokenizer's. Pass one of them."
        )
    if dataset in FILE_BUILDERS and not data_files:
        raise ValueError(
            f"dataset={dataset!r} reads local files: pass data_files (a path, a list of paths or "
            "{split: paths})."
        )
    if tokenize_batch_size < 1:
        raise ValueError(f"tokenize_batch_size={tokenize_batch_size} must be >= 1.")


class HFDatasetDataModule(PackedDataModule):
    """A Hugging Face ``datasets`` corpus, tokenized once into the datasets cache and packed into ``seq_len``
    rows read memory-mapped: the datamodule for corpora larger than host memory.

    Items: ``input_ids``, ``labels``, ``position_ids``, each ``(seq_len,)`` long; with ``packing="documents"``
    exactly the rows :func:`~lightning_longctx.data.pack_documents` makes of the same documents (positions
    restart at 0 per document; ``labels = -100`` at each document's first token and on padding). See
    ``docs/data.md``.

    Args:
        dataset: what ``datasets.load_dataset`` takes — ``"json"``, ``"parquet"``, ``"text"``, ``"csv"`` or
            ``"arrow"`` with ``data_files``, a local folder of data files, or a Hub name that is already in the
            local datasets cache (nothing is downloaded) — or a folder written by ``Dataset.save_to_disk`` /
            ``DatasetDict.save_to_disk`` (read with ``load_from_disk``).
        tokenizer: a LOCAL directory for ``AutoTokenizer.from_pretrained(..., local_files_only=True)``. ``None``
            only for a pre-tokenized ``input_ids`` column, with ``vocab_size``.
        seq_len: tokens per row (the global length, before sequence sharding).
        data_files: ``load_dataset``'s ``data_files`` (a path, a list, or ``{split: paths}``).
        split: the training split (``load_dataset`` split syntax such as ``"train[:90%]"`` works).
        text_column: the column of text documents (or of chat messages); see the module docstring for which
            column is used.
        packing: ``"documents"`` (concatenate and cut, no padding but at the very end) or ``"none"`` (one
            document per row, cut to ``seq_len`` or padded).
        continue_documents: with ``"documents"``, a document longer than its row carries its positions on into
            the next row instead of starting it over as a new document (:func:`~lightning_longctx.data.
            pack_documents`).
        batch_size: rows per batch per data-parallel rank.
        val_split: a split to validate on (e.g. ``"validation"``).
        val_fraction: else, this fraction of the training documents (chosen by ``seed``, whole documents, the
            same choice as :class:`~lightning_longctx.data.TextFilesDataModule`) is held out for validation.
        seed: seeds the validation choice.
        min_doc_tokens: documents with fewer tokens (BOS and EOS included) are dropped, e.g. to train a long
            context on long documents only.
        add_bos: prepend the tokenizer's BOS to each text document.
        messages_column: the column of chat conversations (``[{"role", "content"}, ...]``), used when the
            dataset has no ``text_column``.
        vocab_size: token ids of pre-tokenized data without a tokenizer (ids must lie in ``[0, vocab_size)``).
        pad_token_id: the id written on padding (never trained on: labels are -100 there); default the
            tokenizer's PAD, else its EOS, else 0.
        num_proc: processes for the one-time tokenization (``Dataset.map``); None: this process.
        tokenize_batch_size: documents per ``Dataset.map`` batch (and per cache-file write): lower it for very
            long documents to bound the tokenization's memory.
        cache_dir: the datasets cache for ``load_dataset`` (its Arrow copy of the data files and the tokenized
            cache files); default ``HF_DATASETS_CACHE``. A ``save_to_disk`` folder keeps its tokenized cache
            files beside its own.
        name: ``load_dataset``'s configuration name (a Hub dataset's subset).
        load_kwargs: more keyword arguments for ``load_dataset`` (e.g. ``{"sample_by": "document"}`` for
            ``"text"``: one document per file instead of per line).
        num_workers: ``DataLoader`` workers.
    """

    def __init__(
        self,
        dataset: str,
        tokenizer: str | None,
        seq_len: int,
        *,
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        split: str = "train",
        text_column: str = "text",
        packing: str = "documents",
        continue_documents: bool = False,
        batch_size: int = 1,
        val_split: str | None = None,
        val_fraction: float = 0.0,
        seed: int = 0,
        min_doc_tokens: int = 0,
        add_bos: bool = True,
        messages_column: str = "messages",
        vocab_size: int | None = None,
        pad_token_id: int | None = None,
        num_proc: int | None = None,
        tokenize_batch_size: int = 256,
        cache_dir: str | None = None,
        name: str | None = None,
        load_kwargs: dict[str, Any] | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        _datasets()  # a missing optional dependency fails here, before any step, with the install line
        self.save_hyperparameters()
        _check_settings(
            dataset=dataset,
            tokenizer=tokenizer,
            seq_len=seq_len,
            data_files=data_files,
            packing=packing,
            val_split=val_split,
            val_fraction=val_fraction,
            min_doc_tokens=min_doc_tokens,
            vocab_size=vocab_size,
            tokenize_batch_size=tokenize_batch_size,
        )
        self.dataset = dataset
        self.tokenizer_path = tokenizer
        self.seq_len = seq_len
        self.data_files = data_files
        self.split = split
        self.text_column = text_column
        self.packing = packing
        self.continue_documents = continue_documents
        self.batch_size = batch_size
        self.val_split = val_split
        self.val_fraction = val_fraction
        self.seed = seed
        self.min_doc_tokens = min_doc_tokens
        self.add_bos = add_bos
        self.messages_column = messages_column
        self._vocab_size = vocab_size
        self._pad_token_id = pad_token_id
        self.num_proc = num_proc
        self.tokenize_batch_size = tokenize_batch_size
        self.cache_dir = cache_dir
        self.name = name
        self.load_kwargs = dict(load_kwargs or {})
        self.num_workers = num_workers
        self._tokenizer: _HFTokenizer | None = None
        self.train_dataset: ArrowPackedDataset | None = None
        self.val_dataset: ArrowPackedDataset | None = None

    # ---- tokenizer ----
    @property
    def tokenizer(self) -> _HFTokenizer | None:
        """Loaded on first use, so constructing the datamodule (e.g. by the CLI) stays cheap."""
        if self._tokenizer is None and self.tokenizer_path is not None:
            self._tokenizer = _HFTokenizer(self.tokenizer_path)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        tok = self.tokenizer
        return len(tok) if tok is not None else int(self._vocab_size)  # type: ignore[arg-type]

    @property
    def pad_token_id(self) -> int:
        if self._pad_token_id is not None:
            return self._pad_token_id
        tok = self.tokenizer
        return tok.pad_token_id if tok is not None else 0

    # ---- loading and the one-time tokenization ----
    def _load(self, split: str) -> datasets.Dataset:
        ds = _datasets()
        path = Path(self.dataset)
        if _saved_to_disk(path):
            loaded = ds.load_from_disk(str(path))
            if isinstance(loaded, ds.DatasetDict):
                if split not in loaded:
                    raise ValueError(
                        f"split {split!r} is not in the saved DatasetDict {self.dataset!r}; its splits are "
                        f"{sorted(loaded)}. Set split= / val_split= to one of them."
                    )
                return loaded[split]
            if split != "train":
                raise ValueError(
                    f"{self.dataset!r} holds one Dataset (Dataset.save_to_disk), not the splits of a DatasetDict; "
                    f"split={split!r} cannot be chosen. Use the default split, val_fraction for validation, or "
                    "save a DatasetDict."
                )
            return loaded
        try:
            with _hub_offline():
                return ds.load_dataset(
                    self.dataset,
                    self.name,
                    data_files=self.data_files,
                    split=split,
                    cache_dir=self.cache_dir,
                    **self.load_kwargs,
                )
        except (ConnectionError, FileNotFoundError, ds.exceptions.DatasetNotFoundError) as e:
            if path.exists() or self.dataset in FILE_BUILDERS:
                raise
            raise FileNotFoundError(
                f"dataset={self.dataset!r} is neither a local path, a save_to_disk folder nor a dataset in the "
                f"local datasets cache ({self.cache_dir or ds.config.HF_DATASETS_CACHE}); this package never "
                "downloads. Load it once where there is network (load_dataset, same cache_dir) or save it with "
                f"save_to_disk and pass that folder. ({type(e).__name__}: {e})"
            ) from e

    def _kind(self, table: datasets.Dataset) -> tuple[str, list[str]]:
        """Which documents ``table`` holds, and the columns the tokenization reads."""
        columns = table.column_names
        features = table.features
        if "input_ids" in columns:
            return "tokens", ["input_ids", *(["labels"] if "labels" in columns else [])]
        for column in (self.text_column, self.messages_column):
            if column not in columns:
                continue
            if _is_string(features[column]):
                return "text", [column]
            if _is_messages(features[column]):
                if self.tokenizer is None or not self.tokenizer.tok.chat_template:
                    raise ValueError(
                        f"column {column!r} holds chat messages but tokenizer={self.tokenizer_path!r} has no chat "
                        "template; use a tokenizer whose tokenizer_config.json (or chat_template.jinja) has one."
                    )
                if not self.tokenizer.tok.is_fast:
                    raise ValueError(
                        f"chat column {column!r}: masking the assistant turns needs a fast tokenizer (token "
                        f"offsets); {self.tokenizer_path!r} loads as {type(self.tokenizer.tok).__name__}."
                    )
                return "chat", [column]
            raise ValueError(
                f"column {column!r} holds {features[column]}, neither text (strings) nor chat messages "
                "(lists of {'role', 'content'}); set text_column to a column of text."
            )
        raise ValueError(
            f"the dataset has no column {self.text_column!r} (text_column), {self.messages_column!r} "
            f"(messages_column) or 'input_ids' (pre-tokenized); its columns are {columns}. Set text_column."
        )

    def _tokenized(self, split: str) -> datasets.Dataset:
        """``split`` loaded and tokenized: the first call per corpus and settings writes the datasets cache
        files, every later call (every other process) reads them back without tokenizing."""
        ds = _datasets()
        table = self._load(split)
        kind, columns = self._kind(table)
        if kind != "tokens" and self.tokenizer is None:
            raise ValueError(
                f"the dataset's column {columns[0]!r} holds {kind}, which needs a tokenizer; pass tokenizer= (a "
                "local directory), or pre-tokenize into an `input_ids` column."
            )
        tok = self.tokenizer
        fn = _Tokenize(
            kind,
            self.tokenizer_path,
            None if tok is None else _tokenizer_digest(tok.tok),
            add_bos=self.add_bos,
            min_doc_tokens=self.min_doc_tokens,
            vocab_size=self.vocab_size,
            has_labels=len(columns) > 1,
        )
        features = {"input_ids": ds.Sequence(ds.Value("int32"))}
        if kind == "chat" or len(columns) > 1:
            features["loss_mask"] = ds.Sequence(ds.Value("bool"))
        return table.map(
            fn,
            batched=True,
            with_indices=True,
            input_columns=columns,
            remove_columns=table.column_names,
            batch_size=self.tokenize_batch_size,
            writer_batch_size=self.tokenize_batch_size,
            features=ds.Features(features),
            num_proc=self.num_proc,
            desc=f"tokenizing {split}",
        )

    @override
    def prepare_data(self) -> None:
        """Load and tokenize once (Lightning runs this on the first process of each node; set
        ``dm.prepare_data_per_node = False`` when the nodes share the cache's file system)."""
        self._tokenized(self.split)
        if self.val_split is not None:
            self._tokenized(self.val_split)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        train = self._tokenized(self.split)
        n = len(train)
        if n == 0:
            raise ValueError(
                f"no documents in split {self.split!r} of {self.dataset!r}: every document is empty"
                + (f" or shorter than min_doc_tokens={self.min_doc_tokens}" if self.min_doc_tokens else "")
                + "; check the data (and text_column / min_doc_tokens)."
            )
        kw = dict(
            seq_len=self.seq_len, pad_id=self.pad_token_id, packing=self.packing,
            continue_documents=self.continue_documents,
        )  # fmt: skip
        rows = None
        if self.val_split is not None:
            val = self._tokenized(self.val_split)
            if len(val) == 0:
                raise ValueError(f"no documents in the validation split {self.val_split!r}; check the data.")
            self.val_dataset = ArrowPackedDataset(val, **kw)
        elif self.val_fraction > 0:
            is_val = validation_documents(
                n, self.val_fraction, self.seed
            ).numpy()  # TextFilesDataModule's split
            rows = np.flatnonzero(~is_val)
            self.val_dataset = ArrowPackedDataset(train, rows=np.flatnonzero(is_val), **kw)
        self.train_dataset = ArrowPackedDataset(train, rows=rows, **kw)
        if self.packing == "none":
            cut = int((self.train_dataset.lengths > self.seq_len).sum())
            if cut:
                rank_zero_warn(
                    f"packing='none': {cut} of {self.train_dataset.num_documents} training documents are longer "
                    f"than seq_len={self.seq_len} and are cut (their tail is not trained on)."
                )
        d = self.train_dataset
        rank_zero_info(
            f"HFDatasetDataModule: {d.num_documents} documents, {d.num_tokens} tokens -> {len(d)} rows of "
            f"{self.seq_len} (packing={self.packing!r})"
            + (f"; validation: {len(self.val_dataset)} rows" if self.val_dataset is not None else "")
        )
