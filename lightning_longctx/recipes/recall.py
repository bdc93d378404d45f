"""The demos' long-context tasks: synthetic key/value recall, and the accuracy that scores it.

:class:`RecallDataModule` is the data of ``examples/configs/demo_cpu.yaml`` (128 tokens, the quick smoke run):
keys and values are spread over the whole sequence and asked for at its end, so a model solves it only if
attention reaches across every sequence shard. :class:`LongRecallDataModule` is the data of
``examples/configs/demo_long_cpu.yaml`` (8,192 tokens): the values of a few keys are stated over one span of
the sequence and asked for up to thousands of tokens after it; its :meth:`~LongRecallDataModule.needle_prompt`
gives :class:`~lightning_longctx.lightning.callbacks.NeedleRetrieval` the same task as a grid of context lengths x depths
of the span. :class:`RecallAccuracy` (``val/recall_acc`` of :class:`~lightning_longctx.recipes.CausalLM`) counts
argmax hits at the labelled positions and is exact under sequence parallelism. Built on the core's public
pieces only (:class:`~lightning_longctx.data.PackedDataModule` (resumable loaders), ``IGNORE_INDEX``, the callbacks'
``NeedlePrompt``); nothing here downloads anything.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torchmetrics
from torch import Tensor
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_longctx.data import PackedDataModule
from lightning_longctx.lightning.callbacks.needle import NeedlePrompt, NeedleSample
from lightning_longctx.parallel.sharding import IGNORE_INDEX

__all__ = [
    "LongRecallDataModule",
    "LongRecallDataset",
    "LongRecallPrompt",
    "RecallAccuracy",
    "RecallDataModule",
    "RecallDataset",
    "recall_accuracy",
]


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


class RecallDataModule(PackedDataModule):
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


class _LongRecallTokens:
    """The token ids of the long-range recall task (``K`` keys, ``M`` values per key, ``F`` filler tokens)::

    0                         PAD    (never produced; reserved)
    1                         BLANK  the answer's slot after a query: the answer is its label, never its input
    [2, 2 + K)                QUERY c: "what is key c's value?"
    [2 + K, 2 + K + K*M)      value m of key c: 2 + K + c*M + m (a value names its key)
    [2 + K + K*M, V)          filler
    """

    BLANK = 1

    def __init__(self, num_keys: int, num_values: int, num_filler: int) -> None:
        for name, value, least in (("num_keys", num_keys, 1), ("num_values", num_values, 2),
                                   ("num_filler", num_filler, 1)):  # fmt: skip
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}")
        self.num_keys, self.num_values = num_keys, num_values
        self.query0 = 2
        self.value0 = self.query0 + num_keys
        self.filler0 = self.value0 + num_keys * num_values
        self.vocab_size = self.filler0 + num_filler

    def sample(self, g: torch.Generator, seq_len: int, span: int, start: int) -> tuple[Tensor, Tensor, int]:
        """``(ids (seq_len,), values (K,), end)``: filler, and from ``start`` a span of ``span`` tokens each the
        value of a random key (every key's value is the sample's ``values[c]``); ``end`` = ``start + span``."""
        ids = torch.randint(self.filler0, self.vocab_size, (seq_len,), generator=g)
        values = torch.randint(0, self.num_values, (self.num_keys,), generator=g)
        keys = torch.randint(0, self.num_keys, (span,), generator=g)
        ids[start : start + span] = self.value0 + keys * self.num_values + values[keys]
        return ids, values, start + span

    def answer(self, key: Tensor | int, values: Tensor) -> Tensor:
        return self.value0 + key * self.num_values + values[key]


class LongRecallDataset(Dataset):
    """Long-range recall: each sample gives a few keys values over one span, and asks for them long after.

    Layout of one sample of ``seq_len`` tokens (ids: :class:`_LongRecallTokens`)::

        filler ... [ span: values of the keys, in random order ] filler Q_c BLANK filler Q_c' BLANK ...

    The span is ``evidence`` of the sequence, at a random place that leaves room after it (in the validation
    split, with ``span_at_start``, at the start: every query is then at least its distance from the span). After
    the span, a query ``Q_c`` starts each pair of positions with probability ``query_rate``; its answer, the
    value of key ``c``, is the label of the ``BLANK`` that follows (never an input: only the span holds the
    values). ``labels`` is ``-100`` everywhere else. Chance accuracy is ``1 / num_values``.

    Every value token names its key, so one attention hop finds it (the span's tokens of class ``c``) and the
    span holds many of them: a tiny model learns the task in minutes on a CPU at 8,192 tokens, which makes it a
    demonstration of the plumbing (the queries far from the span read tokens held by another rank), not of a
    model's skill. Sample ``i`` is a pure function of ``(seed, split, i)``.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        seq_len: int = 8192,
        num_keys: int = 2,
        num_values: int = 8,
        num_filler: int = 16,
        evidence: float = 0.25,
        query_rate: float = 0.25,
        span_at_start: bool = False,
        seed: int = 0,
        split: str = "train",
    ) -> None:
        self.tokens = _LongRecallTokens(num_keys, num_values, num_filler)
        if not 0.0 < evidence < 1.0:
            raise ValueError(f"evidence={evidence!r}: the span's fraction of the sequence, in (0, 1)")
        if not 0.0 < query_rate <= 0.5:
            raise ValueError(
                f"query_rate={query_rate!r}: the fraction of positions after the span that are queries, in (0, 0.5]"
            )
        self.span = int(evidence * seq_len)
        self.room = seq_len // 8  # the span ends at least this far from the end: room for queries
        if num_samples < 0 or self.span < 1 or seq_len - self.span < self.room or self.room < 2:
            raise ValueError(
                f"seq_len={seq_len}, evidence={evidence}, num_samples={num_samples}: need num_samples >= 0 and a "
                f"span of >= 1 token that leaves >= 1/8 of the sequence for queries (seq_len >= 16)"
            )
        self.num_samples, self.seq_len = num_samples, seq_len
        self.query_rate, self.span_at_start = query_rate, span_at_start
        self.seed, self.split = seed, split

    @property
    def vocab_size(self) -> int:
        return self.tokens.vocab_size

    @property
    def chance_accuracy(self) -> float:
        return 1.0 / self.tokens.num_values

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        """``{"input_ids": (seq_len,), "labels": (seq_len,)}``, both ``torch.long``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        g = torch.Generator().manual_seed(_sample_seed(self.seed, self.split, index))
        n, t = self.seq_len, self.tokens
        last = n - self.span - self.room
        start = 0 if self.span_at_start else int(torch.randint(0, last + 1, (1,), generator=g))
        ids, values, end = t.sample(g, n, self.span, start)
        labels = torch.full((n,), IGNORE_INDEX, dtype=torch.long)
        pairs = torch.nonzero(torch.rand((n - end) // 2, generator=g) < 2 * self.query_rate)[:, 0]
        at = end + 2 * pairs  # a query and its BLANK: both inside the sequence
        keys = torch.randint(0, t.num_keys, (len(at),), generator=g)
        ids[at], ids[at + 1] = t.query0 + keys, t.BLANK
        labels[at + 1] = t.answer(keys, values)
        return {"input_ids": ids, "labels": labels}


class LongRecallPrompt(NeedlePrompt):
    """The long-range recall task as a needle grid: filler, the span (``evidence`` of the length) at the depth,
    filler, then one query and its answer (the value token itself: the prompt's last token, scored teacher
    forced). Depth 0: the span opens the context, the query is ``(1 - evidence) x length`` tokens after it."""

    def __init__(
        self,
        *,
        num_keys: int = 2,
        num_values: int = 8,
        num_filler: int = 16,
        evidence: float = 0.25,
        seed: int = 0,
    ) -> None:
        self.tokens = _LongRecallTokens(num_keys, num_values, num_filler)
        self.vocab_size = self.tokens.vocab_size
        self.evidence, self.seed = evidence, seed
        self.minimum_length = 4

    def sample(self, length: int, depth: float, index: int) -> NeedleSample:
        g = torch.Generator().manual_seed(_sample_seed(self.seed, f"needle/{length}/{depth!r}", index))
        span = max(1, int(self.evidence * length))
        start = round(depth * (length - 2 - span))
        ids, values, _ = self.tokens.sample(g, length, span, start)
        key = int(torch.randint(0, self.tokens.num_keys, (1,), generator=g))
        ids[-2], ids[-1] = self.tokens.query0 + key, self.tokens.answer(key, values)
        return NeedleSample(ids, answer_len=1, needle_at=start)


class LongRecallDataModule(PackedDataModule):
    """The long-range recall task (:class:`LongRecallDataset`): training samples with the span anywhere,
    validation samples with the span at the start (queries up to ``seq_len`` tokens after it), and
    :meth:`needle_prompt` for :class:`~lightning_longctx.lightning.callbacks.NeedleRetrieval`.

    Args:
        seq_len, num_keys, num_values, num_filler, evidence, query_rate: as in :class:`LongRecallDataset`.
        batch_size: samples per batch per data-parallel rank.
        train_samples / val_samples: dataset sizes.
        seed: sample ``i`` of a split is a pure function of ``(seed, split, i)``.
    """

    def __init__(
        self,
        seq_len: int = 8192,
        num_keys: int = 2,
        num_values: int = 8,
        num_filler: int = 16,
        evidence: float = 0.25,
        query_rate: float = 0.25,
        batch_size: int = 1,
        train_samples: int = 10000,
        val_samples: int = 4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.num_workers = 0  # samples are made on access: cheap
        common = dict(
            seq_len=seq_len, num_keys=num_keys, num_values=num_values, num_filler=num_filler, evidence=evidence,
            query_rate=query_rate, seed=seed,
        )  # fmt: skip
        self.train_dataset = LongRecallDataset(num_samples=train_samples, split="train", **common)
        self.val_dataset = LongRecallDataset(
            num_samples=val_samples, split="val", span_at_start=True, **common
        )

    @property
    def vocab_size(self) -> int:
        return self.train_dataset.vocab_size

    @property
    def chance_accuracy(self) -> float:
        return self.train_dataset.chance_accuracy

    def needle_prompt(self, seed: int = 0) -> LongRecallPrompt:
        """The task as :class:`~lightning_longctx.lightning.callbacks.NeedleRetrieval`'s grid (it asks for it)."""
        hp = self.hparams
        return LongRecallPrompt(
            num_keys=hp.num_keys, num_values=hp.num_values, num_filler=hp.num_filler, evidence=hp.evidence,
            seed=seed,
        )  # fmt: skip


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
