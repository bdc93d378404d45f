"""Needle in a haystack: does the model find a fact planted at any depth of a long context?

:class:`NeedleRetrieval` builds a grid of prompts, context lengths x needle depths, and scores each by
teacher-forced exact match: a prompt ends with its answer, and it counts as retrieved when the argmax of the
logits at every answer position is the answer's next token (no sampling). Logged at the end of every
validation run (not the sanity check) as ``val/needle/<length>/<depth>`` (the fraction of the cell's samples
retrieved), ``val/needle/mean`` and ``val/needle/loss`` (the answer tokens' mean cross entropy), and drawn as
the familiar heatmap, ``needle.png`` in the run's log folder.

The prompts (a :class:`NeedlePrompt`): by default the passkey test of Mohtashami & Jaggi (2023),
:class:`PasskeyPrompt` — a task line, filler text, "The pass key is 71432. Remember it. 71432 is the pass key."
at the depth, more filler, "What is the pass key? The pass key is" and the answer " 71432" — tokenized with the
run's tokenizer (the datamodule's ``tokenizer``: :class:`~lightning_longctx.data.ByteTokenizer` or a local
Hugging Face one), from the built-in filler, a text file, or the validation corpus' own tokens. A datamodule
with its own task offers its prompts through ``needle_prompt()`` (the recall demo's does).

How it runs, sharded like training: each batch of the grid goes through the strategy's own batch path,
``trainer.strategy.batch_to_device`` (under :class:`~lightning_longctx.UlyssesFPDTStrategy`: ``shard_batch``,
the layout of every validation batch, FPDT's strided chunks included), and the Hugging Face model is called
with a boolean ``logits_to_keep`` of the answer's targets: the answer's logits exist only on the ranks that
hold the last tokens, and only for those positions (under FPDT too: no rank builds ``(tokens, vocab)``
logits). A hook on the model's output embedding (``lm_head``) counts the rows it projects during each scoring
forward and refuses more than the rank's answer positions: a full-logits pass (a forward that ignores
``logits_to_keep``, or an extra one) is an error, not a silent cost. Each rank adds its answer tokens' hits
and losses per sample; one all-reduce over all ranks per validation run makes them global. The grid's batches
are split over the data-parallel ranks (each sequence-parallel group runs its share; every rank runs the same
number of forwards).
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import math
import numbers
import random
import re
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_longctx.lightning.callbacks.positional_loss import _outermost_hf_models, log_equal, plot_path
from lightning_longctx.parallel.comm import all_reduce_no_grad
from lightning_longctx.parallel.sharding import IGNORE_INDEX, shift_labels

__all__ = ["NeedlePrompt", "NeedleRetrieval", "NeedleSample", "PasskeyPrompt"]

METRIC_PREFIX = "val/needle/"
#: the passkey retrieval test (Mohtashami & Jaggi, "Landmark Attention", 2023), as the long-context papers run it
PASSKEY_TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"
PASSKEY_ANSWER = " {key}"


def _seed(*parts: Any) -> int:
    """A 63-bit seed that is a pure function of ``parts``, the same in every process (not Python's ``hash``)."""
    digest = hashlib.blake2b("/".join(map(repr, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class NeedleSample:
    """One prompt of the grid: ``input_ids`` ``(length,)`` long, ending with the answer's ``answer_len`` tokens;
    ``needle_at``: the index of the needle's first token (for plots and tests)."""

    input_ids: Tensor
    answer_len: int
    needle_at: int


class NeedlePrompt(abc.ABC):
    """What :class:`NeedleRetrieval` scores: ``sample(length, depth, index)`` gives the ``index``-th prompt of a
    cell, exactly ``length`` tokens, the needle at ``depth`` (0: the start of the haystack, 1: right before the
    question), a pure function of its arguments (every rank builds the same prompt)."""

    #: the token ids are below this (checked against the model's vocabulary), ``None``: not known
    vocab_size: int | None = None

    @abc.abstractmethod
    def sample(self, length: int, depth: float, index: int) -> NeedleSample:
        """The prompt; raises ``ValueError`` naming the shortest length when ``length`` is too short."""


class _Filler:
    """Filler tokens ``ids`` ``(T,)`` cut at ``starts`` (offsets where a piece begins: sentences of a text, every
    token of a token stream), used cyclically: a haystack starts at a piece and the needle goes between two."""

    def __init__(self, ids: Tensor, starts: Tensor) -> None:
        if ids.numel() == 0:
            raise ValueError("the filler has no tokens; give a non-empty text or token list")
        self.ids, self.starts = ids, starts

    @classmethod
    def of_pieces(cls, pieces: Sequence[Sequence[int]]) -> _Filler:
        """Pieces of token ids (a text's sentences, each encoded): the needle goes between two."""
        pieces = [list(p) for p in pieces if len(p)]
        ids = torch.tensor([t for p in pieces for t in p], dtype=torch.long)
        return cls(
            ids, torch.tensor([0, *itertools.accumulate(len(p) for p in pieces[:-1])], dtype=torch.long)
        )

    @classmethod
    def of_tokens(cls, ids: Tensor) -> _Filler:
        """A token stream: the needle goes between any two tokens."""
        ids = ids.reshape(-1).long()
        return cls(ids, torch.arange(ids.numel()))

    def haystack(self, offset: int, size: int) -> tuple[Tensor, Tensor]:
        """``(ids (size,), cuts)``: ``size`` tokens of the cyclic stream from piece ``offset``, and the sorted
        offsets in ``[0, size]`` where a needle may go (the pieces' starts, both ends)."""
        total = self.ids.numel()
        first = int(self.starts[offset % self.starts.numel()])
        reps = (first + size) // total + 1
        ids = self.ids.repeat(reps)[first : first + size]
        starts = (self.starts[None] + total * torch.arange(reps)[:, None]).flatten() - first
        cuts = torch.cat([torch.tensor([0, size]), starts[(starts > 0) & (starts < size)]])
        return ids, cuts.unique()


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


class PasskeyPrompt(NeedlePrompt):
    """The passkey test: ``[BOS] task haystack-with-needle question answer``, ``length`` tokens in all.

    Args:
        tokenizer: anything with ``encode(text) -> list[int]`` (the package's :class:`~lightning_longctx.data.
            ByteTokenizer`, a datamodule's tokenizer) or a ``transformers`` tokenizer (encoded without special
            tokens); its ``bos_token_id`` starts the prompt when ``add_bos`` and it has one.
        filler: the haystack: a text (cut into sentences; the needle goes between two) or token ids (the needle
            goes between any two). Repeated as often as the length needs.
        needle, question, answer: the templates; ``{key}`` is the sample's passkey, ``key_digits`` random digits.
            The answer's tokens are the ones scored (teacher forced).
        task: the line before the haystack ("" for none).
        seed: the keys and the haystacks' offsets are a pure function of ``(seed, length, depth, index)``.
    """

    def __init__(
        self,
        tokenizer: Any,
        filler: str | Sequence[int] | Tensor = PASSKEY_FILLER,
        *,
        needle: str = PASSKEY_NEEDLE,
        question: str = PASSKEY_QUESTION,
        answer: str = PASSKEY_ANSWER,
        task: str = PASSKEY_TASK,
        key_digits: int = 5,
        add_bos: bool = True,
        seed: int = 0,
    ) -> None:
        if not isinstance(key_digits, int) or isinstance(key_digits, bool) or not 1 <= key_digits <= 18:
            raise ValueError(f"key_digits={key_digits!r}: a passkey has 1 to 18 digits (default 5)")
        if "{key}" not in answer or "{key}" not in needle:
            raise ValueError(
                f"needle={needle!r} and answer={answer!r} must both contain {{key}}: the answer is the key the "
                "needle planted"
            )
        self.encode = _encoder(tokenizer)
        bos = getattr(tokenizer, "bos_token_id", None)
        self.prefix = ([bos] if add_bos and bos is not None else []) + (self.encode(task) if task else [])
        self.question = self.encode(" " + question)
        self.templates = (needle, answer)
        self.key_digits = key_digits
        self.seed = seed
        self.vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
        if isinstance(filler, str):
            self.filler = _Filler.of_pieces([self.encode(" " + s) for s in _sentences(filler)])
        else:
            self.filler = _Filler.of_tokens(torch.as_tensor(filler))
        needle_ids, answer_ids = self._needle("9" * key_digits)
        #: the shortest length that holds the prompt without haystack (keys of other digits may take more tokens)
        self.minimum_length = len(self.prefix) + len(needle_ids) + len(self.question) + len(answer_ids)

    def _needle(self, key: str) -> tuple[list[int], list[int]]:
        needle, answer = self.templates
        return self.encode(" " + needle.format(key=key)), self.encode(answer.format(key=key))

    @override
    def sample(self, length: int, depth: float, index: int) -> NeedleSample:
        rng = random.Random(_seed(self.seed, length, float(depth), index))
        key = str(rng.randrange(10 ** (self.key_digits - 1), 10**self.key_digits))
        needle, answer = self._needle(key)
        size = length - len(self.prefix) - len(needle) - len(self.question) - len(answer)
        if size < 0:
            raise ValueError(
                f"context length {length} is too short for the passkey prompt: its task line, needle, question "
                f"and answer take {length - size} tokens with this tokenizer; use lengths >= "
                f"{self.minimum_length}"
            )
        haystack, cuts = self.filler.haystack(rng.randrange(self.filler.starts.numel()), size)
        at = int(cuts[(cuts.double() - depth * size).abs().argmin()])  # the piece boundary nearest the depth
        parts = [
            torch.tensor(self.prefix, dtype=torch.long),
            haystack[:at],
            torch.tensor(needle, dtype=torch.long),
            haystack[at:],
            torch.tensor(self.question + answer, dtype=torch.long),
        ]
        return NeedleSample(torch.cat(parts), len(answer), len(self.prefix) + at)


def _encoder(tokenizer: Any) -> Any:
    """``text -> list[int]`` without special tokens, for the package's tokenizers and ``transformers``' alike."""
    from transformers import PreTrainedTokenizerBase

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return lambda text: tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"tokenizer {type(tokenizer).__name__} has no encode(text) -> list[int]; pass "
            "lightning_longctx.data.ByteTokenizer(), a transformers tokenizer or a local tokenizer directory"
        )
    return tokenizer.encode


@dataclass(frozen=True)
class _Batch:
    """Samples ``[first, first + count)`` of one cell of the grid."""

    cell: int
    first: int
    count: int


class NeedleRetrieval(L.Callback):
    """Needle-in-a-haystack retrieval on a grid of context lengths x needle depths, scored by teacher-forced
    exact match of the answer, equal to one process under every layout (Ulysses, FPDT, dp x sp).

    Args:
        lengths: the context lengths in tokens (each prompt is exactly this long), e.g. ``[4096, 16384, 65536]``.
        depths: where the needle sits in the haystack: 0 its start, 1 right before the question.
        samples: prompts per cell (different keys and haystack offsets); a cell's value is the fraction
            retrieved.
        batch_size: prompts per forward (of one cell).
        tokenizer: the passkey prompt's tokenizer: ``None`` the datamodule's ``tokenizer``; ``"byte"``
            :class:`~lightning_longctx.data.ByteTokenizer`; a local Hugging Face tokenizer directory; or an
            object with ``encode(text) -> list[int]``.
        filler: the passkey prompt's haystack: ``"passkey"`` the built-in sentences, ``"validation"`` the
            validation set's own tokens (its rows in order, padding left out), or the path of a UTF-8 text file.
        prompt: a :class:`NeedlePrompt` of your own (then ``tokenizer`` and ``filler`` are not used); ``None``:
            the datamodule's ``needle_prompt()`` when it has one, else the passkey prompt.
        seed: the prompts are a pure function of ``(seed, length, depth, index)``: the same every run.
        plot: write ``filename`` (the heatmap of the last run) into ``trainer.log_dir``.
        verbose: print the grid (:meth:`table`) on rank 0 after every run.

    ``history`` keeps each run's ``{"step", "accuracy": {(length, depth): float}, "loss": {...}}``.
    The model is the LightningModule's Hugging Face model (its one outermost ``PreTrainedModel``, e.g.
    ``CausalLM.model`` or the ``self.model`` of your own module), called with ``input_ids``, the sharded
    batch's ``position_ids`` / ``attention_mask`` and a boolean ``logits_to_keep``: what the validation step does
    is not used, so any module works, with any ``eval_metric``.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
        *,
        samples: int = 4,
        batch_size: int = 1,
        tokenizer: Any = None,
        filler: str = "passkey",
        prompt: NeedlePrompt | None = None,
        seed: int = 0,
        plot: bool = True,
        filename: str = "needle.png",
        verbose: bool = True,
    ) -> None:
        self.lengths = _lengths(lengths)
        self.depths = _depths(depths)
        for name, value in (("samples", samples), ("batch_size", batch_size)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if prompt is not None and not isinstance(prompt, NeedlePrompt):
            raise TypeError(
                f"prompt={prompt!r} is not a NeedlePrompt; subclass lightning_longctx.lightning.callbacks.needle.NeedlePrompt "
                "(its sample(length, depth, index) gives the prompt)"
            )
        self.samples, self.batch_size = int(samples), int(batch_size)
        self.tokenizer, self.filler, self.seed = tokenizer, filler, seed
        self.prompt = prompt
        self._prompt: NeedlePrompt | None = prompt  # the one in use: ``prompt``, else resolved in setup
        self.plot, self.filename, self.verbose = plot, filename, verbose
        self.history: list[dict[str, Any]] = []
        self.plot_path: str | None = None
        self._checked_model = False

    @property
    def cells(self) -> list[tuple[int, float]]:
        """``(length, depth)`` of every cell, lengths outer."""
        return [(length, depth) for length in self.lengths for depth in self.depths]

    # ---- set-up: the prompts, refused before the first step ----------------------------------------------
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate"):  # test / predict run no validation
            return
        self._prompt = self.prompt or self._default_prompt(trainer, pl_module)
        minimum = getattr(self._prompt, "minimum_length", None)
        if isinstance(minimum, int) and self.lengths[0] < minimum:
            raise ValueError(
                f"NeedleRetrieval(lengths={list(self.lengths)}): the prompts need at least {minimum} tokens "
                f"({type(self._prompt).__name__} with this tokenizer); raise the shortest length"
            )
        self._prompt.sample(self.lengths[0], self.depths[0], 0)  # a prompt that cannot be built fails here
        self._checked_model = False

    def _default_prompt(self, trainer: L.Trainer, pl_module: L.LightningModule) -> NeedlePrompt:
        datamodule = getattr(trainer, "datamodule", None)
        own = getattr(datamodule, "needle_prompt", None)
        if callable(own) and self.tokenizer is None and self.filler == "passkey":
            prompt = own(seed=self.seed)
            if not isinstance(prompt, NeedlePrompt):
                raise TypeError(f"{type(datamodule).__name__}.needle_prompt() did not return a NeedlePrompt")
            return prompt
        return PasskeyPrompt(self._tokenizer(datamodule), self._filler(trainer, pl_module), seed=self.seed)

    def _tokenizer(self, datamodule: Any) -> Any:
        from lightning_longctx.data import ByteTokenizer

        if self.tokenizer is None:
            found = getattr(datamodule, "tokenizer", None)
            if found is None:
                what = (
                    "no datamodule" if datamodule is None else f"{type(datamodule).__name__} has no tokenizer"
                )
                raise ValueError(
                    f"NeedleRetrieval builds its passkey prompts with the run's tokenizer, but {what}. Pass "
                    "tokenizer='byte' (lightning_longctx.data.ByteTokenizer), a local tokenizer directory, or a "
                    "prompt=NeedlePrompt of your own"
                )
            return found
        if self.tokenizer == "byte":
            return ByteTokenizer()
        if isinstance(self.tokenizer, (str, Path)):
            from lightning_longctx.data.packing import _HFTokenizer

            return _HFTokenizer(str(self.tokenizer))
        return self.tokenizer

    def _filler(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str | Tensor:
        if self.filler == "passkey":
            return PASSKEY_FILLER
        if self.filler == "validation":
            return _validation_tokens(trainer, pl_module, need=2 * self.lengths[-1])
        path = Path(self.filler)
        if not path.is_file():
            raise ValueError(
                f"filler={self.filler!r}: use 'passkey' (the built-in sentences), 'validation' (the validation "
                "set's tokens) or the path of a UTF-8 text file"
            )
        return path.read_text(encoding="utf-8")

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._model(pl_module)  # the model's checks, before the first step

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._model(pl_module)

    # ---- the model ----------------------------------------------------------------------------------------
    def _model(self, pl_module: L.LightningModule) -> nn.Module:
        models = _outermost_hf_models(pl_module)
        if len(models) != 1:
            found = ", ".join(type(m).__name__ for m in models) or "none"
            raise ValueError(
                f"NeedleRetrieval scores the LightningModule's Hugging Face causal LM, but it holds {found}; "
                "it needs exactly one transformers model (e.g. self.model = AutoModelForCausalLM...)"
            )
        model = models[0]
        if not self._checked_model:
            self._check_model(model)
            self._checked_model = True
        return model

    def _check_model(self, model: nn.Module) -> None:
        """Refused before the first forward, alike on every rank (no collective runs before it)."""
        import inspect

        from lightning_longctx.integrations.transformers import context_of

        name = type(model).__name__
        if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
            raise ValueError(
                f"{name}.forward takes no logits_to_keep: NeedleRetrieval projects only the answer's positions "
                "onto the vocabulary (never (tokens, vocab) logits) and needs a transformers causal LM that "
                "takes it (Llama, Qwen, Mistral, Gemma, ...)"
            )
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        size = getattr(self._prompt, "vocab_size", None)
        if isinstance(vocab, int) and isinstance(size, int) and size > vocab:
            raise ValueError(
                f"the needle prompts use token ids up to {size - 1} but {name} has vocab_size={vocab}; use the "
                "model's own tokenizer (NeedleRetrieval(tokenizer=...)) or a larger vocabulary"
            )
        ctx = context_of(model)
        limit = getattr(ctx, "rope_limit", None)
        if limit is not None and self.lengths[-1] > limit.limit:
            raise limit.error(name, self.lengths[-1])

    # ---- a validation run -----------------------------------------------------------------------------------
    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self._prompt is None:  # added after the trainer's set-up
            self.setup(trainer, pl_module, "validate")
        model = self._model(pl_module)
        n = self.samples
        # per sample: answer tokens right, answer tokens, their loss sum (fp64; summed over every rank below)
        table = torch.zeros(len(self.cells) * n, 3, dtype=torch.float64, device=pl_module.device)
        batches = [
            _Batch(cell, first, min(self.batch_size, n - first))
            for cell in range(len(self.cells))
            for first in range(0, n, self.batch_size)
        ]
        rank, size = _data_parallel(trainer.strategy)
        mine = batches[rank::size]
        # every rank runs as many forwards: they hold collectives beyond the sequence-parallel group (FSDP's
        # gathers, the strategy's per-batch checks); a rank with fewer batches repeats one, not counted
        rounds = math.ceil(len(batches) / size)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), _ProjectedRows(model) as projected:
                for i in range(rounds):
                    batch = mine[i] if i < len(mine) else batches[0]
                    rows, stats = self._score(trainer, model, batch, projected)
                    if i < len(mine):
                        table.index_add_(0, rows + batch.cell * n + batch.first, stats)
        finally:
            model.train(was_training)
        table = all_reduce_no_grad(table) if trainer.world_size > 1 else table
        self._report(trainer, pl_module, table.view(len(self.cells), n, 3).cpu())

    def _score(
        self, trainer: L.Trainer, model: nn.Module, batch: _Batch, projected: _ProjectedRows
    ) -> tuple[Tensor, Tensor]:
        """One forward: ``(rows (k,), stats (k, 3))`` for this rank's ``k`` answer targets: the row of their
        sample in the batch, and (hit, 1, cross entropy) each; ``projected`` refuses any other row the
        ``lm_head`` projected since the previous forward."""
        length, depth = self.cells[batch.cell]
        prompts = [self._prompt.sample(length, depth, batch.first + j) for j in range(batch.count)]
        ignore = _ignore_index(trainer.strategy)
        ids = torch.stack([p.input_ids for p in prompts])
        if ids.shape[1] != length:
            raise ValueError(f"{type(self._prompt).__name__} gave {ids.shape[1]} tokens for length {length}")
        labels = torch.full_like(ids, ignore)
        for j, p in enumerate(prompts):
            labels[j, length - p.answer_len :] = ids[j, length - p.answer_len :]
        out = trainer.strategy.batch_to_device({"input_ids": ids, "labels": labels})
        targets = out["shift_labels"] if "shift_labels" in out else shift_labels(out["labels"], ignore)
        keep = targets != ignore  # (b, s_local): this rank's answer targets
        inputs = {k: v for k, v in out.items() if k not in ("labels", "shift_labels")}
        precision = getattr(trainer.strategy, "precision_plugin", None)
        with precision.val_step_context() if precision is not None else nullcontext():
            logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
        wanted = int(keep.sum())
        projected.check(wanted, type(model).__name__)
        if logits.dim() != 2 or logits.shape[0] != wanted:
            raise ValueError(
                f"{type(model).__name__} returned logits of shape {tuple(logits.shape)} for a boolean "
                f"logits_to_keep of {wanted} positions; NeedleRetrieval needs a forward that slices its hidden "
                "states with transformers' slice_logits_to_keep (a (positions, vocab) result)"
            )
        y = targets[keep]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        hit = (logits.argmax(-1) == y).to(torch.float64)
        loss = F.cross_entropy(logits, y, reduction="none").to(torch.float64)
        rows = keep.nonzero()[:, 0]
        return rows, torch.stack([hit, torch.ones_like(hit), loss], dim=1)

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, table: Tensor) -> None:
        hits, counts, losses = table.unbind(-1)  # (cells, samples) each
        if bool((counts == 0).any()):
            raise RuntimeError(
                "NeedleRetrieval: a prompt's answer was scored on no rank (a layout it misses)"
            )
        # every rank and tensor-parallel peer counted a token as often: the ratios are exact
        retrieved = (hits == counts).to(torch.float64).mean(dim=1)
        loss = losses.sum(dim=1) / counts.sum(dim=1)
        accuracy = {cell: float(retrieved[i]) for i, cell in enumerate(self.cells)}
        cell_loss = {cell: float(loss[i]) for i, cell in enumerate(self.cells)}
        for (length, depth), value in accuracy.items():
            log_equal(pl_module, f"{METRIC_PREFIX}{length}/{depth:g}", value)
        log_equal(pl_module, f"{METRIC_PREFIX}mean", float(retrieved.mean()))
        log_equal(pl_module, f"{METRIC_PREFIX}loss", float(losses.sum() / counts.sum()))
        self.history.append({"step": trainer.global_step, "accuracy": accuracy, "loss": cell_loss})
        if self.plot:
            path = plot_path(trainer, self.filename, "NeedleRetrieval")
            if path is not None:
                self.plot_path = path
                self._save_plot(path)
        if self.verbose:
            rank_zero_info(self.table())

    def table(self) -> str:
        """The last run's grid as text: one row per depth, one column per length (what ``verbose`` prints)."""
        run = self.history[-1]
        mean = sum(run["accuracy"].values()) / len(run["accuracy"])
        head = (
            f"NeedleRetrieval, step {run['step']}: retrieved (exact match, {self.samples} prompts per cell), "
        )
        corner = "depth \\ length"
        lines = [
            head + f"mean {mean:.2f}",
            f"{corner:<16}" + "".join(f"{_tokens(n):>8}" for n in self.lengths),
        ]
        for d in self.depths:
            depth = f"{100 * d:g}%"
            lines.append(f"{depth:>14}  " + "".join(f"{run['accuracy'][(n, d)]:>8.2f}" for n in self.lengths))
        if self.plot_path is not None:
            lines.append(f"heatmap: {self.plot_path}")
        return "\n".join(lines)

    # ---- the heatmap --------------------------------------------------------------------------------------
    def _save_plot(self, path: str) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        run = self.history[-1]
        grid = torch.tensor([[run["accuracy"][(n, d)] for n in self.lengths] for d in self.depths])
        fig = Figure(
            figsize=(1.3 * len(self.lengths) + 2.5, 0.55 * len(self.depths) + 2), layout="constrained"
        )
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        image = ax.imshow(grid.numpy(), cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for i in range(len(self.depths)):
            for j in range(len(self.lengths)):
                value = float(grid[i, j])
                ink = "white" if not 0.25 <= value <= 0.75 else "black"  # readable on the dark ends
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize="small", color=ink)
        ax.set_xticks(range(len(self.lengths)), [_tokens(n) for n in self.lengths])
        ax.set_yticks(range(len(self.depths)), [f"{100 * d:g}%" for d in self.depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth (0% = start)")
        mean = sum(run["accuracy"].values()) / len(run["accuracy"])
        ax.set_title(f"Needle retrieval, step {run['step']}: mean {mean:.2f}")
        fig.colorbar(image, ax=ax, label=f"retrieved (exact match, {self.samples} prompts per cell)")
        fig.savefig(path, dpi=100)


class _ProjectedRows:
    """While scoring: the rows (positions) the model's output embedding projects onto the vocabulary, counted by
    a forward pre-hook on ``get_output_embeddings()`` (every full-logits pass goes through it, whoever calls
    the model). :meth:`check` after each forward refuses more rows than the rank's answer positions."""

    def __init__(self, model: nn.Module) -> None:
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        self.head = head if isinstance(head, nn.Module) else None
        self.rows = 0
        self._handle: Any = None

    def __enter__(self) -> _ProjectedRows:
        if self.head is not None:
            self._handle = self.head.register_forward_pre_hook(self._count, with_kwargs=True)
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if kind is None:  # nothing may be projected after the last forward's check either
            self.check(0, "the model", after="after the last scoring forward")

    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("input")
        if isinstance(hidden, Tensor):
            local = hidden.to_local() if callable(getattr(hidden, "to_local", None)) else hidden  # a DTensor
            self.rows += local.shape[:-1].numel()  # (positions, hidden) or (b, s, hidden)

    def check(self, wanted: int, name: str, after: str = "in one scoring forward") -> None:
        rows, self.rows = self.rows, 0
        if rows > wanted:
            raise RuntimeError(
                f"NeedleRetrieval: {name}'s output embedding projected {rows} positions onto the vocabulary "
                f"{after}, but this rank holds {wanted} answer positions (the boolean logits_to_keep): a "
                "full-logits pass ran while scoring, the (tokens, vocab) logits the needle exists to avoid. A "
                "forward that ignores logits_to_keep (a patched or wrapped forward) or a second forward does this; "
                "pass logits_to_keep through to transformers' slice_logits_to_keep and call the model once"
            )


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def _lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    values = list(lengths) if isinstance(lengths, Sequence) and not isinstance(lengths, str) else [lengths]
    bad = [v for v in values if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 2]
    if not values or bad:
        raise ValueError(
            f"lengths={lengths!r}: give the context lengths as positive token counts, e.g. [4096, 16384, 65536]"
        )
    if len(set(values)) != len(values):
        raise ValueError(f"lengths={list(values)!r} lists a length twice; list each once")
    return tuple(sorted(int(v) for v in values))


def _depths(depths: Sequence[float]) -> tuple[float, ...]:
    values = list(depths) if isinstance(depths, Sequence) and not isinstance(depths, str) else [depths]
    bad = [
        v
        for v in values
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or not 0 <= v <= 1
    ]
    if not values or bad:
        raise ValueError(
            f"depths={depths!r}: a depth is a fraction of the haystack in [0, 1] (0: its start, 1: right before "
            "the question), e.g. [0, 0.25, 0.5, 0.75, 1]"
        )
    if len({f"{float(v):g}" for v in values}) != len(values):
        raise ValueError(f"depths={list(values)!r} lists a depth twice; list each once")
    return tuple(sorted(float(v) for v in values))


def _data_parallel(strategy: Any) -> tuple[int, int]:
    """``(rank, size)`` over which the grid's batches are split: the data-parallel ranks of
    :class:`~lightning_longctx.UlyssesFPDTStrategy` (each sequence-parallel group runs its share); other
    strategies run the whole grid on every rank."""
    from lightning_longctx.lightning.strategy import UlyssesFPDTStrategy

    if isinstance(strategy, UlyssesFPDTStrategy):
        return strategy.dp_rank, strategy.dp_size
    return 0, 1


def _ignore_index(strategy: Any) -> int:
    config = getattr(strategy, "config", None)
    settings = getattr(config, "settings", None)
    return int(getattr(settings, "ignore_index", IGNORE_INDEX))


def _validation_tokens(trainer: L.Trainer, pl_module: L.LightningModule, need: int) -> Tensor:
    """The validation set's tokens in order, at least ``need`` of them when it has as many: each row's
    ``input_ids`` without its padding (a target of ``-100`` that starts no document: ``labels`` and
    ``position_ids``, as the package's datamodules pack them)."""
    datamodule = getattr(trainer, "datamodule", None)
    dataset = getattr(datamodule, "val_dataset", None)
    if dataset is None:
        source = datamodule if datamodule is not None and hasattr(datamodule, "val_dataloader") else pl_module
        try:
            loader = source.val_dataloader()
        except Exception as e:  # Lightning's default raises for a module without one
            raise ValueError(
                f"NeedleRetrieval(filler='validation') found no validation set ({e}); give the datamodule a "
                "val_dataset or val_dataloader, or use filler='passkey'"
            ) from None
        loader = loader[0] if isinstance(loader, (list, tuple)) and loader else loader
        dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ValueError(
            "NeedleRetrieval(filler='validation') needs a map-style validation dataset of dicts with input_ids; "
            "use filler='passkey' or a text file"
        )
    parts, total = [], 0
    for i in range(len(dataset)):
        row = dataset[i]
        ids = torch.as_tensor(row["input_ids"]).reshape(-1)
        labels, positions = row.get("labels"), row.get("position_ids")
        if labels is not None and positions is not None:
            labels, positions = torch.as_tensor(labels).reshape(-1), torch.as_tensor(positions).reshape(-1)
            ids = ids[(labels != IGNORE_INDEX) | (positions == 0)]
        parts.append(ids.long())
        total += ids.numel()
        if total >= need:
            break
    if total == 0:
        raise ValueError("NeedleRetrieval(filler='validation'): the validation set has no tokens")
    return torch.cat(parts)
