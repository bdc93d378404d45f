"""Exact global cross-entropy over a sequence sharded across a sequence-parallel group."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_longctx.comm import Group, all_reduce_no_grad, all_reduce_sum_identity_grad
from lightning_longctx.sharding import IGNORE_INDEX


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
) -> torch.Tensor:
    """Mean cross-entropy over ALL valid targets of the sequence-parallel group, on every rank.

    Args:
        logits: ``(..., vocab)`` for this rank's tokens (e.g. ``(b, s/P, V)``).
        shift_labels: ``(...)`` targets already shifted before sharding (``shard_batch`` does it).

    Returns a 0-dim fp32 tensor equal on all ranks. Its backward gives each rank exactly
    d(global mean)/d(its logits): the local sum is divided by the GLOBAL valid count and the
    cross-rank sum has an identity backward. A rank with no valid target contributes 0 and gets a
    zero gradient; a group with no valid target returns 0 (never NaN).
    """
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be labels shape {tuple(shift_labels.shape)} + (vocab,); "
            "pass the shift_labels that shard_batch produced for this rank"
        )
    local_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)),
        shift_labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = global_valid_count(shift_labels, group=group, ignore_index=ignore_index)
    return all_reduce_sum_identity_grad(local_sum, group) / count.clamp(min=1)
