"""The demo's long-context task: synthetic key/value recall, and the accuracy that scores it.

:class:`RecallDataModule` is the data of ``examples/configs/demo_cpu.yaml``: keys and values are spread
over the whole sequence and asked for at its end, so a model solves it only if attention reaches
across every sequence shard. :class:`RecallAccuracy` (``val/recall_acc`` of
:class:`~lightning_longctx.recipes.CausalLM`) counts argmax hits at the labelled positions and is
exact under sequence parallelism. Built on the core's public pieces only
(:class:`~lightning_longctx.data.ResumableDataLoader`, ``IGNORE_INDEX``); nothing here downloads anything.
"""

from __future__ import annotations

import hashlib
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_longctx.data import ResumableDataLoader
from lightning_longctx.sharding import IGNORE_INDEX

__all__ = ["RecallAccuracy", "RecallDataModule", "RecallDataset", "recall_accuracy"]


def _sample_seed(seed: int, split: str, index: int) -> int:
    """A 63-bit seed that is a pure function of ``(seed, split, index)``.

    A hash rather than ``seed + index`` so that neighbouring seeds and splits never share samples,
    and rather than Python's ``hash`` so that it is the same in every process.
    """
    digest = hashlib.blake2b(f"{seed}/{split}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RecallDataset(Dataset):
    """Synthetic key/value recall: find the value of a key seen anywhere earlier in the sequence.

    Token ids (``V = vocab_size``, ``n = V - 3`` non-special ids)::

        0                      PAD   (never produced here; reserved so the ids match other data)
        1                      QUERY marker
        2                      SEP   marks the end of the haystack, before the queries
        [3, 3 + n//4)          keys
        [3 + n//4, 3 + n//2)   values
        [3 + n//2, V)          filler noise

    Layout of one sample of ``seq_len`` tokens::

        filler ... k1 v1 ... filler ... k2 v2 ... filler   SEP  QUERY kq vq  [QUERY kq' vq' ...]

    The ``num_pairs`` pairs are stratified: the haystack is cut into ``num_pairs`` equal segments
    and each segment holds one pair at a random offset, so keys land in every sequence shard and
    the answer for a query usually lives on another rank. Keys are distinct within a sample;
    each query asks a distinct key. ``labels`` is ``-100`` everywhere except at the value token of
    each query, where it equals that token.

    Sample ``i`` is a pure function of ``(seed, split, i)``: the same in every process and after a
    resume, whatever the sampler's order.
    """

    PAD = 0
    QUERY = 1
    SEP = 2
    NUM_SPECIAL = 3

    def __init__(
        self,
        *,
        num_samples: int,
        seq_len: int = 512,
        vocab_size: int = 256,
        num_pairs: int = 8,
        num_queries: int = 1,
        seed: int = 0,
        split: str = "train",
    ) -> None:
        n = vocab_size - self.NUM_SPECIAL
        self.key_range = (self.NUM_SPECIAL, self.NUM_SPECIAL + n // 4)
        self.value_range = (self.key_range[1], self.NUM_SPECIAL + n // 2)
        self.filler_range = (self.value_range[1], vocab_size)
        num_keys = self.key_range[1] - self.key_range[0]
        if num_samples < 0:
            raise ValueError(f"num_samples={num_samples} must be >= 0.")
        if num_pairs < 1 or num_queries < 1:
            raise ValueError(f"num_pairs={num_pairs} and num_queries={num_queries} must both be >= 1.")
        if num_queries > num_pairs:
            raise ValueError(
                f"num_queries={num_queries} > num_pairs={num_pairs}: each query asks a distinct key "
                "of the sample; lower num_queries or raise num_pairs."
            )
        if num_keys < num_pairs or self.filler_range[1] - self.filler_range[0] < 1:
            raise ValueError(
                f"vocab_size={vocab_size} leaves {num_keys} key ids for num_pairs={num_pairs} distinct "
                f"keys (keys get a quarter of the {n} non-special ids); use vocab_size >= "
                f"{4 * num_pairs + self.NUM_SPECIAL} or fewer pairs."
            )
        self.query_len = 1 + 3 * num_queries  # SEP, then (QUERY, key, value) per query
        haystack = seq_len - self.query_len
        if haystack < 2 * num_pairs:
            raise ValueError(
                f"seq_len={seq_len} is too short for num_pairs={num_pairs} and num_queries={num_queries}: "
                f"need seq_len >= {2 * num_pairs + self.query_len}."
            )
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.num_pairs = num_pairs
        self.num_queries = num_queries
        self.seed = seed
        self.split = split

    @property
    def num_value_tokens(self) -> int:
        """Number of distinct value ids; chance accuracy is ``1 / num_value_tokens``."""
        return self.value_range[1] - self.value_range[0]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        """``{"input_ids": (seq_len,), "labels": (seq_len,)}``, both ``torch.long``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        g = torch.Generator().manual_seed(_sample_seed(self.seed, self.split, index))
        s, p = self.seq_len, self.num_pairs
        ids = torch.randint(*self.filler_range, (s,), generator=g)
        keys = self.key_range[0] + torch.randperm(self.key_range[1] - self.key_range[0], generator=g)[:p]
        values = torch.randint(*self.value_range, (p,), generator=g)

        # Stratified placement: segment j = [bounds[j], bounds[j+1]) holds pair j at an offset
        # that leaves room for both tokens; haystack // p >= 2 is checked in __init__.
        haystack = s - self.query_len
        bounds = [j * haystack // p for j in range(p + 1)]
        for j in range(p):
            room = bounds[j + 1] - bounds[j] - 1  # number of valid start offsets
            start = bounds[j] + int(torch.randint(room, (1,), generator=g))
            ids[start] = keys[j]
            ids[start + 1] = values[j]

        labels = torch.full((s,), IGNORE_INDEX, dtype=torch.long)
        ids[haystack] = self.SEP
        asked = torch.randperm(p, generator=g)[: self.num_queries]
        for q, j in enumerate(asked.tolist()):
            at = haystack + 1 + 3 * q
            ids[at] = self.QUERY
            ids[at + 1] = keys[j]
            ids[at + 2] = values[j]
            labels[at + 2] = values[j]
        return {"input_ids": ids, "labels": labels}


class RecallDataModule(L.LightningDataModule):
    """Synthetic long-context key/value recall (see :class:`RecallDataset` for the token layout).

    A model solves it only if attention reaches across the whole sequence, so under sequence
    parallelism it only if attention reaches across ranks: a quick end-to-end check of the
    strategy. Chance accuracy is ``1 / num_value_tokens`` (``1/63`` with the default
    ``vocab_size=256``); measure it with :class:`RecallAccuracy`.

    Args:
        seq_len: tokens per sample.
        vocab_size: total token ids, specials included; the model's vocabulary must be at least this.
        num_pairs: key/value pairs spread over the whole sequence.
        num_queries: queries at the end of the sequence, each asking a distinct key of the sample.
        batch_size: samples per batch per data-parallel rank.
        train_samples / val_samples: dataset sizes.
        seed: sample ``i`` of a split is a pure function of ``(seed, split, i)``.
        num_workers: ``DataLoader`` workers.
    """

    def __init__(
        self,
        seq_len: int = 512,
        vocab_size: int = 256,
        num_pairs: int = 8,
        num_queries: int = 1,
        batch_size: int = 1,
        train_samples: int = 512,
        val_samples: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.num_workers = num_workers
        common = dict(
            seq_len=seq_len, vocab_size=vocab_size, num_pairs=num_pairs, num_queries=num_queries, seed=seed
        )
        # Built here, not in setup(): they are cheap (samples are made on access) and building
        # them validates the arguments as soon as the CLI parses them.
        self.train_dataset = RecallDataset(num_samples=train_samples, split="train", **common)
        self.val_dataset = RecallDataset(num_samples=val_samples, split="val", **common)

    @property
    def vocab_size(self) -> int:
        return self.train_dataset.vocab_size

    @property
    def num_value_tokens(self) -> int:
        return self.train_dataset.num_value_tokens

    @property
    def chance_accuracy(self) -> float:
        return 1.0 / self.num_value_tokens

    @override
    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(
            self.train_dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers
        )

    @override
    def val_dataloader(self) -> DataLoader:
        return ResumableDataLoader(
            self.val_dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )


def recall_accuracy(
    logits: Tensor, labels: Tensor, *, shifted: bool = False, ignore_index: int = IGNORE_INDEX
) -> tuple[Tensor, Tensor]:
    """Count argmax hits over the positions with a label.

    Args:
        logits: ``(batch, seq, vocab)``.
        labels: ``(batch, seq)``. With ``shifted=False``, HF labels: logits at ``t`` are scored
            against ``labels[t + 1]``. With ``shifted=True``, already shifted labels (the
            ``shift_labels`` of ``shard_batch``): logits at ``t`` are scored against ``labels[t]``.
        ignore_index: label value that marks positions not scored.

    Returns:
        ``(correct, total)``: 0-d long tensors on ``logits.device``.
    """
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on (batch, seq)"
            + ("" if shifted else " after the shift")
        )
    mask = labels != ignore_index
    # Index before argmax: only a few positions carry a label, and (batch, seq, vocab) is big.
    pred = logits[mask].argmax(dim=-1)
    correct = (pred == labels[mask]).sum()
    total = mask.sum()
    return correct, total


class RecallAccuracy(torchmetrics.Metric):
    """Accuracy of the argmax prediction at labelled positions (the recall answers).

    ``update(logits, labels, shifted=False)`` takes ``logits (batch, seq, vocab)`` and
    ``labels (batch, seq)``; see :func:`recall_accuracy` for ``shifted``. Chance level is
    ``1 / num_value_tokens`` of the datamodule.

    Under sequence parallelism each rank holds only its shard of the logits: pass the shard's
    pre-shifted ``shift_labels`` with ``shifted=True`` (shifting a shard locally would drop the
    label at its right edge). The metric sums ``correct`` and ``total`` and torchmetrics sums those
    over all processes at ``compute()``, so the result is the global accuracy; ranks of one SP
    group hold disjoint positions, so nothing is counted twice.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    correct: Tensor
    total: Tensor

    def __init__(self, ignore_index: int = IGNORE_INDEX, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    @override
    def update(self, logits: Tensor, labels: Tensor, shifted: bool = False) -> None:
        correct, total = recall_accuracy(logits, labels, shifted=shifted, ignore_index=self.ignore_index)
        self.correct += correct
        self.total += total

    @override
    def compute(self) -> Tensor:
        # 0.0 rather than NaN when nothing was labelled (e.g. a sanity check on an empty shard).
        return self.correct.float() / self.total.clamp(min=1)
