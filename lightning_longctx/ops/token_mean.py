"""The loss of an optimizer step as one device computes it on the whole global batch: the token mean.

One device training on a global batch (all data-parallel ranks' samples x all micro-batches of an
accumulation window) minimises ``sum of token losses / number of valid tokens`` of the window.
Lightning instead averages per-micro-batch means (DDP's mean over ranks, ``1/k`` per micro-batch):
with labels whose valid-token counts differ (SFT prompts masked to different lengths) the two differ.

Mechanism (accumulate unnormalised sums, rescale once before clipping and stepping):

* Each micro-batch's loss is the SP group's token mean ``S_m / c_m`` (``sequence_parallel_cross_entropy``
  and the chunked loss); ``c_m`` is counted from the full, unsharded labels before ``shard_batch``
  cuts them, so it costs no communication.
* Backward runs on ``loss * c_m * W / D``: DDP (or FSDP2) averages over the ``W = dp * sp`` ranks, so
  after the window the gradients are ``d(sum of all token losses) / D``. ``D`` is any constant equal on
  every rank (fixed at the first training batch: ``k * dp * labels.numel()``, the window's token count,
  so gradient magnitudes stay those of a mean).
* At the end of the window (inside the optimizer closure, before Lightning clips or steps) one
  all-reduce of ``[sum of S_m, sum of c_m]`` over the dp group gives the window's totals ``S``, ``N``;
  gradients are multiplied by ``D / N`` and ``step_loss = S / N`` (equal on every rank).

A window without any valid token leaves zero gradients and ``step_loss = 0``, never NaN.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_longctx.parallel.comm import Group, all_reduce_no_grad
from lightning_longctx.parallel.sharding import shift_labels


class TokenMeanWindow:
    """Book-keeping of one accumulation window for token-mean normalisation (see the module docstring)."""

    def __init__(self, *, world_size: int, dp_size: int, ignore_index: int) -> None:
        self.world_size = world_size
        self.dp_size = dp_size
        self.ignore_index = ignore_index
        self.scale_base: float | None = None  # D, fixed at the first training batch
        self.step_loss: Tensor | None = None  # token mean of the last optimizer step
        self._pending: Tensor | None = None  # c_m of the batch whose backward comes next
        self._sum: Tensor | None = None  # sum over the window of S_m (this SP group)
        self._count: Tensor | None = None  # sum over the window of c_m (this SP group)

    def count(self, batch: Mapping[str, Any], accumulate: int) -> None:
        """Count the valid targets of a FULL (unsharded) training batch: ``c_m`` of this SP group."""
        labels = batch.get("shift_labels")
        if labels is None and batch.get("labels") is not None:
            labels = shift_labels(batch["labels"], self.ignore_index)
        if not isinstance(labels, Tensor):
            raise ValueError(
                "loss_normalization='tokens' counts the valid targets of each training batch from its `labels` "
                f"(or `shift_labels`), and this batch has neither (keys: {sorted(batch)}). Add labels to the "
                "batch, or set loss_normalization='micro_batch' (Lightning's mean of per-micro-batch means)"
            )
        if self.scale_base is None:
            self.scale_base = float(accumulate * self.dp_size * labels.numel())
        self._pending = (labels != self.ignore_index).sum()

    def backward_loss(self, closure_loss: Tensor, accumulate: int) -> Tensor:
        """The loss to back-propagate for this micro-batch: ``loss * c_m * W / D`` (Lightning passed
        ``loss / accumulate``)."""
        if self._pending is None or self.scale_base is None:
            raise RuntimeError(
                "a training backward ran on a batch that UlyssesFPDTStrategy did not count (did training_step "
                "run twice for one batch?); set loss_normalization='micro_batch' for such loops"
            )
        count, self._pending = self._pending.to(closure_loss.device), None
        token_sum = closure_loss.detach().double() * accumulate * count  # S_m, equal on the SP group
        self._sum = token_sum if self._sum is None else self._sum + token_sum
        self._count = count if self._count is None else self._count + count
        return closure_loss * (accumulate * count * self.world_size / self.scale_base)

    def finish(self, params: Iterable[Tensor], dp_group: Group) -> None:
        """End of the window: gradients to ``d(sum) / N`` and ``step_loss = S / N``; one all-reduce."""
        if self._sum is None or self._count is None:  # no backward in this window (skipped steps)
            return
        totals = torch.stack([self._sum, self._count.double()])
        if self.dp_size > 1:
            totals = all_reduce_no_grad(totals, dp_group)
        token_sum, count = totals.tolist()
        self._sum = self._count = None
        self.step_loss = torch.tensor(token_sum / max(count, 1.0), dtype=torch.float32)
        factor = self.scale_base / max(count, 1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)
