"""Exact global cross-entropy over a sequence sharded across a sequence-parallel group."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_longctx.parallel.comm import Group, all_reduce_no_grad, all_reduce_sum_identity_grad
from lightning_longctx.parallel.sharding import IGNORE_INDEX

#: Called by the package's losses with this rank's per-token losses: ``(losses, valid)``, both shaped like the
#: ``shift_labels`` (e.g. ``(b, s/P)``); ``losses`` fp32 (fp64 for fp64 inputs), detached, 0 where ``valid`` is
#: False (an ignored target). Validation callbacks use it (``callbacks/positional_loss.py``); it must not keep
#: the tensors beyond what it reduces them to.
TokenLossObserver = Callable[[torch.Tensor, torch.Tensor], None]


def global_valid_count(
    shift_labels: torch.Tensor, *, group: Group = None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Number of non-ignored targets over the whole SP group (a 0-dim int64 tensor, no autograd)."""
    return all_reduce_no_grad((shift_labels != ignore_index).sum(), group)


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group: Group = None,
    ignore_index: int = IGNORE_INDEX,
    observer: TokenLossObserver | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over ALL valid targets of the sequence-parallel group, on every rank.

    Args:
        logits: ``(..., vocab)`` for this rank's tokens (e.g. ``(b, s/P, V)``).
        shift_labels: ``(...)`` targets already shifted before sharding (``shard_batch`` does it).

    Returns a 0-dim fp32 tensor equal on all ranks. Its backward gives each rank exactly
    d(global mean)/d(its logits): the local sum is divided by the GLOBAL valid count and the
    cross-rank sum has an identity backward. A rank with no valid target contributes 0 and gets a
    zero gradient; a group with no valid target returns 0 (never NaN).

    ``observer``: also hands this rank's per-token losses to it (:data:`TokenLossObserver`), no collective.
    """
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be labels shape {tuple(shift_labels.shape)} + (vocab,); "
            "pass the shift_labels that shard_batch produced for this rank"
        )
    flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    if observer is None:
        local_sum = F.cross_entropy(
            flat, shift_labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
        )
    else:  # the same sum from the per-token losses: one (tokens,) vector more
        per_token = F.cross_entropy(
            flat, shift_labels.reshape(-1), ignore_index=ignore_index, reduction="none"
        )
        observer(per_token.detach().view(shift_labels.shape), shift_labels != ignore_index)
        local_sum = per_token.sum()
    count = global_valid_count(shift_labels, group=group, ignore_index=ignore_index)
    return all_reduce_sum_identity_grad(local_sum, group) / count.clamp(min=1)
