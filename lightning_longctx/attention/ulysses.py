"""Ulysses sequence-parallel attention (DeepSpeed-Ulysses, arXiv 2309.14509).

Each of the P ranks of ``group`` holds a contiguous 1/P of the sequence. One all-to-all turns
"my tokens, all heads" into "all tokens, my heads", the local kernel attends over the whole
sequence, and a second all-to-all turns the result back.
"""

from __future__ import annotations

import torch

from lightning_longctx.attention.common import (
    MaskSpec,
    check_qkv,
    default_scale,
    doc_ids,
    has_resets,
    spread_kv_heads,
)
from lightning_longctx.attention.kernels import resolve_backend
from lightning_longctx.comm import Group, all_gather_no_grad, group_rank_size, head_to_seq, seq_to_head


def global_mask(
    position_ids: torch.Tensor | None, *, causal: bool, sliding_window: int | None, group: Group
) -> MaskSpec:
    """The mask of the gathered sequence; ``position_ids`` ``(b, s/P)`` are GLOBAL, contiguous layout."""
    docs = None
    if position_ids is not None:
        full = all_gather_no_grad(position_ids, group, dim=1)  # (b, N), rank order = sequence order
        if has_resets(full):
            docs = doc_ids(full)
    return MaskSpec(causal=causal, sliding_window=sliding_window, q_doc=docs, k_doc=docs)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    position_ids: torch.Tensor | None = None,
    backend: str = "auto",
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded contiguously over ``group``.

    Args:
        q: ``(b, s/P, h, d)`` local queries (rank r holds tokens ``[r*s/P, (r+1)*s/P)``).
        k, v: ``(b, s/P, h_kv, d)``; ``h % h_kv == 0``. Any ``h`` works with any P (uneven split).
        position_ids: ``(b, s/P)`` GLOBAL positions; a reset to 0 starts a new packed document and
            attention never crosses documents. ``None``: one document.
        sliding_window: attend only to the last ``sliding_window`` tokens (incl. itself), as HF.
        softcap: tanh logit soft-capping (Gemma-2 style); needs a kernel that applies it.

    Returns:
        ``(b, s/P, h, d)``, equal to full attention over the gathered sequence.
    """
    check_qkv(q, k, v)
    _, world = group_rank_size(group)
    kernel = resolve_backend(backend, softcap=softcap)
    h = q.shape[2]
    k, v = spread_kv_heads(k, v, h, world)
    mask = global_mask(position_ids, causal=causal, sliding_window=sliding_window, group=group)
    q_h, k_h, v_h = (seq_to_head(x, group) for x in (q, k, v))  # (b, s, h_r, d): all tokens, my heads
    out_h, _ = kernel.fn(
        q_h, k_h, v_h, scale=default_scale(q.shape[-1], softmax_scale), mask=mask, softcap=softcap
    )
    return head_to_seq(out_h, h, group)  # (b, s/P, h, d)
