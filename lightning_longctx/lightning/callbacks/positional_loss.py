"""Validation loss by position of the GLOBAL sequence: does the model use its long context?

A model that uses its context keeps lowering its loss deeper into the sequence; one that does not flattens
after a few hundred tokens. :class:`PositionalLoss` measures it: in every validation run, the token mean of
the loss per bucket of positions (log-spaced by default: 0-127, 128-255, 256-511, ...), logged as
``val/loss_by_position/<start>-<end>`` and drawn as one line per run in ``loss_by_position.png``.

Where the per-token losses come from (one mechanism, no second forward):

* a sequence-parallel model (the strategy patched it, Ulysses or FPDT): its own loss hands each rank's
  per-token losses to an observer on the model's ``SequenceParallelContext`` (``ctx.loss_observer``, a
  :data:`~lightning_longctx.ops.loss.TokenLossObserver`): ``sequence_parallel_cross_entropy`` under Ulysses,
  the chunked lm_head + loss under FPDT (from the chunks' log-sum-exps: never full logits). The observer
  places them at their GLOBAL positions: the layout's global token index (``SequenceLayout.global_index``,
  FPDT's strided chunks included) or the batch's global ``position_ids``.
* a plain Hugging Face model (one device, no strategy): a forward hook computes them from the logits the
  model returns and the ``labels`` it was called with.

Each rank adds its tokens to per-bucket fp64 sums and counts; at the end of the run ONE all-reduce over
all ranks (the SP group's shards and the data-parallel ranks' samples; tensor-parallel peers repeat the same
tokens, which leaves every mean as it is) makes them global. A token counts where the model's loss counts
it: its target is not ``ignore_index`` (labels are shifted before sharding: the loss at position t is the
loss of predicting token t+1 from tokens 0..t).
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_longctx.integrations.context import SequenceParallelContext
from lightning_longctx.parallel.comm import all_reduce_no_grad
from lightning_longctx.parallel.sharding import IGNORE_INDEX, shift_labels

__all__ = ["PositionalLoss", "bucket_edges"]

#: what a token's position is: its index in the (packed) row, or its position within its document
BY = ("token", "document")
#: the default log-spaced edges run past any position a sequence reaches
_LAST_EDGE = 1 << 40
_MAX_BUCKETS = 4096
METRIC_PREFIX = "val/loss_by_position/"


def bucket_edges(
    buckets: Sequence[int] | None = None, *, first: int | None = None, log_base: float | None = None
) -> tuple[int, ...]:
    """The edges ``e0 < e1 < ... < ek`` of the position buckets: bucket ``i`` holds positions
    ``e_i .. e_(i+1) - 1``; positions outside ``[e0, ek)`` are not counted.

    ``buckets``: the edges themselves. Else log-spaced: ``0, first, first * log_base, first * log_base**2, ...``
    (rounded to integers; defaults ``first=128``, ``log_base=2``: 0-127, 128-255, 256-511, ...), open-ended.
    """
    if buckets is not None:
        if first is not None or log_base is not None:
            raise ValueError(
                f"PositionalLoss got buckets={list(buckets)!r} and first={first!r}, log_base={log_base!r}: the "
                "buckets are either explicit edges or log-spaced from first and log_base. Give one of the two"
            )
        edges = list(buckets)
        bad = [e for e in edges if not isinstance(e, numbers.Integral) or isinstance(e, bool)]
        if len(edges) < 2 or bad:
            raise ValueError(
                f"buckets={edges!r}: bucket edges are at least two integers e0 < e1 < ... (bucket i holds "
                "positions e_i .. e_(i+1)-1), e.g. buckets=[0, 1024, 4096, 16384]"
            )
        edges = [int(e) for e in edges]
        if edges[0] < 0:
            raise ValueError(f"buckets={edges!r}: positions start at 0, so the first edge must be >= 0")
        for a, b in itertools.pairwise(edges):
            if b <= a:
                raise ValueError(
                    f"buckets={edges!r} are not strictly increasing ({a} then {b}); list each edge once, in "
                    "increasing order"
                )
        return tuple(edges)
    first = 128 if first is None else first
    log_base = 2.0 if log_base is None else log_base
    if not isinstance(first, numbers.Integral) or isinstance(first, bool) or first < 1:
        raise ValueError(
            f"first={first!r}: the first bucket's size must be a positive integer number of tokens (default 128)"
        )
    if not isinstance(log_base, numbers.Real) or not math.isfinite(log_base) or log_base <= 1:
        raise ValueError(
            f"log_base={log_base!r}: each bucket is log_base times the one before, so it must be > 1 "
            "(default 2: 0-127, 128-255, 256-511, ...)"
        )
    edges = [0, int(first)]
    while edges[-1] < _LAST_EDGE:
        edges.append(max(edges[-1] + 1, round(first * float(log_base) ** (len(edges) - 1))))
        if len(edges) > _MAX_BUCKETS:
            raise ValueError(
                f"log_base={log_base!r} with first={first!r} makes more than {_MAX_BUCKETS} buckets; use a "
                "larger log_base (e.g. 2) or explicit buckets=[...]"
            )
    return tuple(edges)


class _BucketSums:
    """One validation run's per-bucket loss sums and valid-token counts on this rank (fp64)."""

    def __init__(self, edges: Sequence[int]) -> None:
        self.edges = tuple(edges)
        self.sums: torch.Tensor | None = None  # (k,) made on the device of the first tokens
        self.counts: torch.Tensor | None = None
        self._edges: torch.Tensor | None = None

    def add(self, losses: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> None:
        """``losses``, ``valid``, ``positions``: the same shape, one entry per token."""
        if self.sums is None:
            self._edges = torch.tensor(self.edges, dtype=torch.long, device=losses.device)
            self.sums = torch.zeros(len(self.edges) - 1, dtype=torch.float64, device=losses.device)
            self.counts = torch.zeros_like(self.sums)
        bucket = torch.bucketize(positions.reshape(-1).long(), self._edges, right=True) - 1
        keep = valid.reshape(-1) & (bucket >= 0) & (bucket < self.sums.numel())
        bucket = bucket[keep]
        self.sums.index_add_(0, bucket, losses.reshape(-1)[keep].to(torch.float64))
        self.counts.index_add_(0, bucket, torch.ones_like(bucket, dtype=torch.float64))

    def totals(self, device: torch.device, reduce: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sums, counts)``, with ``reduce`` over every rank: one all-reduce (every rank calls it)."""
        k = len(self.edges) - 1
        local = (
            torch.zeros(2 * k, dtype=torch.float64, device=device)
            if self.sums is None
            else torch.cat([self.sums, self.counts]).to(device)
        )
        both = all_reduce_no_grad(local) if reduce else local  # the world: every SP shard, every dp sample
        return both[:k], both[k:]


class _ShardObserver:
    """``ctx.loss_observer`` of a sequence-parallel model: this rank's per-token losses at their GLOBAL
    positions, from the context (the layout's token index; the call's global ``position_ids``)."""

    def __init__(self, ctx: SequenceParallelContext, sums: _BucketSums, by: str) -> None:
        self.ctx, self.sums, self.by = ctx, sums, by

    def __call__(self, losses: torch.Tensor, valid: torch.Tensor) -> None:
        index = self.ctx.global_index(losses.shape[-1], losses.device)  # (s,) in the shard_batch layout
        positions = self.ctx.call_position_ids if self.by == "document" else None
        self.sums.add(losses, valid, (index if positions is None else positions).expand(losses.shape))


class _LogitsObserver:
    """A forward hook on a plain Hugging Face model (one device): per-token losses from its logits and the
    ``labels`` (or ``shift_labels``) it was called with. Calls without labels, or with logits of only some
    tokens (``logits_to_keep``), are not observed."""

    def __init__(self, sums: _BucketSums, by: str, ignore_index: int) -> None:
        self.sums, self.by, self.ignore_index = sums, by, ignore_index

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        logits = getattr(output, "logits", None)
        targets = kwargs.get("shift_labels")
        if targets is None and kwargs.get("labels") is not None:
            targets = shift_labels(kwargs["labels"], self.ignore_index)
        if not isinstance(logits, torch.Tensor) or targets is None or logits.shape[:-1] != targets.shape:
            return
        with torch.no_grad():
            losses = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                targets.reshape(-1),
                ignore_index=self.ignore_index,
                reduction="none",
            ).view(targets.shape)
        positions = kwargs.get("position_ids") if self.by == "document" else None
        if positions is None:
            positions = torch.arange(targets.shape[-1], device=targets.device)
        self.sums.add(losses, targets != self.ignore_index, positions.expand(targets.shape))


def _outermost_hf_models(module: nn.Module) -> list[nn.Module]:
    from lightning_longctx.parallel.fsdp import outermost_models

    return outermost_models(module)


def log_equal(pl_module: L.LightningModule, name: str, value: float) -> None:
    """Log a validation run's ``value``, equal on every rank already: once per run; "max" over the ranks keeps it
    exact and Lightning quiet about unsynced epoch-level values."""
    pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max", batch_size=1)


def plot_path(trainer: L.Trainer, filename: str, owner: str) -> str | None:
    """Where rank 0 writes a validation plot: ``filename`` in ``trainer.log_dir`` (made), or ``None`` on the other
    ranks, without a log folder or without matplotlib (warned once, naming ``owner``). Every rank calls it:
    ``trainer.log_dir`` is a broadcast under DDP."""
    log_dir = trainer.log_dir
    if not trainer.is_global_zero or log_dir is None:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        rank_zero_warn(f"{owner}: matplotlib is not installed (`pip install matplotlib`); no plot.")
        return None
    os.makedirs(log_dir, exist_ok=True)
    return os.path.join(log_dir, filename)


class PositionalLoss(L.Callback):
    """In validation, the token-mean loss per position bucket of the GLOBAL sequence, exact under every
    layout (Ulysses, FPDT, packed documents, any sp x dp), equal to one process on the whole sequence.

    Args:
        buckets: the bucket edges ``[e0, e1, ..., ek]`` (bucket i: positions ``e_i .. e_(i+1)-1``; positions
            outside ``[e0, ek)`` are not counted). ``None``: log-spaced from ``first`` and ``log_base``.
        first: tokens in the first log-spaced bucket (default 128). log_base: each bucket's size over the
            previous one's (default 2): 0-127, 128-255, 256-511, ... up to the sequence length.
        by: ``"token"``: a token's position is its index in the row (packed rows: in the whole packed row);
            ``"document"``: its position within its document, the batch's ``position_ids`` (which restart at
            0 per packed document).
        plot: write ``filename`` into ``trainer.log_dir`` after every validation run (one line per run).
        ignore_index: the label of a token without loss (Hugging Face's -100).

    Logged at the end of every validation run (not the sanity check): ``val/loss_by_position/<start>-<end>``
    for every bucket that holds a valid token, equal on every rank. ``history`` keeps each run's step and
    losses. The model's own loss must run: the validation step calls the Hugging Face model with labels
    (``self.model(**batch)``); ``CausalLM(eval_metric=True)`` computes its loss outside the model and is not
    observed (use ``eval_metric=False``).
    """

    def __init__(
        self,
        buckets: Sequence[int] | None = None,
        *,
        first: int | None = None,
        log_base: float | None = None,
        by: str = "token",
        plot: bool = True,
        filename: str = "loss_by_position.png",
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.edges = bucket_edges(buckets, first=first, log_base=log_base)
        if by not in BY:
            raise ValueError(
                f"by={by!r}: choose 'token' (position in the packed row) or 'document' (position within the "
                "document, the batch's position_ids)"
            )
        self.by = by
        self.plot = plot
        self.filename = filename
        self.ignore_index = ignore_index
        self.history: list[dict[str, Any]] = []  # per run: {"step": int, "loss": {(start, end): float}}
        self.plot_path: str | None = None
        self._sums: _BucketSums | None = None
        self._release: list[Callable[[], None]] = []

    # ---- observing -------------------------------------------------------------------------------
    def _attach(self, pl_module: L.LightningModule) -> None:
        from lightning_longctx.integrations.transformers import context_of

        sums = self._sums
        for model in _outermost_hf_models(pl_module):
            ctx = context_of(model)
            if ctx is None:
                hook = _LogitsObserver(sums, self.by, self.ignore_index)
                self._release.append(model.register_forward_hook(hook, with_kwargs=True).remove)
                continue
            if ctx.loss_observer is not None:
                self._detach()
                raise RuntimeError(
                    f"the loss of {ctx.model_name} is observed already (another PositionalLoss in the "
                    "callbacks?); one PositionalLoss per model"
                )
            ctx.loss_observer = _ShardObserver(ctx, sums, self.by)
            self._release.append(lambda ctx=ctx: setattr(ctx, "loss_observer", None))
        if not self._release:
            rank_zero_warn(
                "PositionalLoss found no Hugging Face model in the LightningModule; it measures the loss of a "
                "transformers model that the validation step calls with labels"
            )

    def _detach(self) -> None:
        while self._release:
            self._release.pop()()

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._detach()
        self._sums = None
        if trainer.sanity_checking:
            return
        self._sums = _BucketSums(self.edges)
        self._attach(pl_module)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._detach()
        if self._sums is None:  # the sanity check
            return
        sums, counts = self._sums.totals(pl_module.device, reduce=trainer.world_size > 1)
        self._sums = None
        losses: dict[tuple[int, int], float] = {}
        for i, (total, count) in enumerate(zip(sums.tolist(), counts.tolist())):
            if count > 0:
                losses[(self.edges[i], self.edges[i + 1] - 1)] = total / count
        if not losses:
            rank_zero_warn(
                "PositionalLoss saw no token loss in this validation run: the validation step must call the "
                "Hugging Face model with labels (self.model(**batch)); CausalLM needs eval_metric=False"
            )
        for (start, end), value in losses.items():
            log_equal(pl_module, f"{METRIC_PREFIX}{start}-{end}", value)
        self.history.append({"step": trainer.global_step, "loss": losses})
        if self.plot and losses:
            self._write_plot(trainer)

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._detach()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._detach()

    # ---- the plot --------------------------------------------------------------------------------
    def _write_plot(self, trainer: L.Trainer) -> None:
        path = plot_path(trainer, self.filename, "PositionalLoss")
        if path is not None:
            self.plot_path = path
            self._save_plot(path)

    def _save_plot(self, path: str) -> None:
        # the object API with its own Agg canvas: no pyplot, no change to the global backend
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        runs = [run for run in self.history if run["loss"]]
        colors = colormaps["viridis"]
        for i, run in enumerate(runs):
            buckets = sorted(run["loss"])
            middle = [(start + end + 1) / 2 for start, end in buckets]  # > 0: a log axis
            named = len(runs) <= 12 or i in (0, len(runs) - 1)  # a long run's legend: the first and the last
            ax.plot(
                middle,
                [run["loss"][b] for b in buckets],
                marker="o",
                color=colors(i / max(1, len(runs) - 1)),
                label=f"step {run['step']}" if named else None,
            )
        ax.set_xscale("log")
        top = max(value for run in runs for value in run["loss"].values())
        ax.set_ylim(0, 1.1 * top)  # from 0: a flat curve looks flat, not like noise magnified
        where = "in the sequence (token index)" if self.by == "token" else "within the document"
        ax.set_xlabel(f"position {where}, bucket middle")
        ax.set_ylabel("validation loss (token mean)")
        ax.set_title("Loss by position: falling to the right = the model uses its context")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small", title="validation run")
        fig.savefig(path, dpi=100)
