"""Ulysses sequence-parallel attention (DeepSpeed-Ulysses, arXiv 2309.14509).

Each of the P ranks of ``group`` holds a contiguous 1/P of the sequence. One all-to-all turns
"my tokens, all heads" of q, k and v together (one packed buffer, GQA k/v with fewer heads
included) into "all tokens, my heads", the local kernel attends over the whole sequence, and a
second all-to-all turns the result back: two collectives forward, two backward. Packed documents:
``documents`` computed once per batch where it is sharded (the strategy and the model hooks pass them);
without them, the position ids are all-gathered once per call.

No ``(N, N)`` mask or score matrix: with ``backend="auto"`` and no flash-attn (which takes packed
documents and windows natively), a call that SDPA could only run with a dense ``(N, N)`` boolean mask
(packed documents, a sliding window) or that needs the math kernel's full ``(N, N)`` scores (soft-cap,
sinks) runs as FPDT with one chunk per rank instead: the same contiguous layout, the same
all-to-all, and FPDT's blocks, whose masks and score tiles are at most ``(1024, 1024)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lightning_longctx.attention.common import (
    MaskSpec,
    check_qkv,
    check_sinks,
    check_softcap,
    default_scale,
    documents_of,
    local_heads,
    spread_kv_heads,
)
from lightning_longctx.attention.fpdt import fpdt_attention
from lightning_longctx.attention.kernels import KERNELS, Kernel, resolve_backend
from lightning_longctx.parallel.comm import (
    Group,
    all_gather_no_grad,
    group_rank_size,
    head_to_seq,
    seq_to_head_packed,
)


class UlyssesCall(NamedTuple):
    """What one Ulysses call runs, settled before any all-to-all (:func:`prepare_ulysses`)."""

    kernel: Kernel  # the local kernel of the all-to-all path
    documents: torch.Tensor | None  # (b, N) document ids in global order; None: one document per row
    on_blocks: bool  # run as FPDT with one chunk per rank instead (module doc)


def prepare_ulysses(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    position_ids: torch.Tensor | None,
    documents: torch.Tensor | None,
    backend: str,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> UlyssesCall:
    """The checks of a :func:`ulysses_attention` call, its kernel and documents (one all-gather of
    ``position_ids`` without ``documents``), and whether it runs on FPDT's blocks: with ``backend="auto"`` and
    no flash-attn, a call that SDPA could run only with a dense ``(N, N)`` mask (packed documents, a sliding
    window) or that needs the math kernel's full scores (soft-cap, sinks). Arguments as
    :func:`ulysses_attention`'s."""
    check_qkv(q, k, v)
    check_softcap(softcap)
    check_sinks(sinks, q)
    _, world = group_rank_size(group)
    kernel = resolve_backend(backend, softcap=softcap, sinks=sinks is not None)
    b, local = q.shape[:2]
    docs = documents_of(
        position_ids,
        documents,
        shape=(b, local * world),
        gather=lambda p: all_gather_no_grad(p, group, dim=1),
    )  # (b, N), rank order = sequence order
    dense = docs is not None or sliding_window is not None or softcap or sinks is not None
    # the same on every rank (global docs)
    return UlyssesCall(kernel, docs, bool(backend == "auto" and kernel is not KERNELS["flash"] and dense))


def ulysses_all_to_all(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: UlyssesCall,
    *,
    group: Group,
    causal: bool,
    softmax_scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Ulysses' own path for a call :func:`prepare_ulysses` settled: one all-to-all of q, k, v to
    ``(b, s, h/P, d)``, ``call.kernel`` over the whole sequence, one all-to-all back to ``(b, s/P, h, d)``."""
    _, world = group_rank_size(group)
    mask = MaskSpec(causal=causal, sliding_window=sliding_window, q_doc=call.documents, k_doc=call.documents)
    h = q.shape[2]
    k, v = spread_kv_heads(k, v, h, world)
    # ONE all-to-all for q, k and v: (b, s, h_r, d) each, all tokens, my heads
    q_h, k_h, v_h = seq_to_head_packed(q, k, v, group=group)
    extra = {} if sinks is None else {"sinks": sinks[local_heads(h, group)]}  # (h_r,): my heads' sinks
    out_h, _ = call.kernel.fn(
        q_h, k_h, v_h, scale=default_scale(q.shape[-1], softmax_scale), mask=mask, softcap=softcap, **extra
    )
    return head_to_seq(out_h, h, group)  # (b, s/P, h, d)


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
    sinks: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded contiguously over ``group``.

    Args:
        q: ``(b, s/P, h, d)`` local queries (rank r holds tokens ``[r*s/P, (r+1)*s/P)``).
        k, v: ``(b, s/P, h_kv, d)``; ``h % h_kv == 0``. Any ``h`` works with any P (uneven split).
        position_ids: ``(b, s/P)`` GLOBAL positions; a reset to 0 starts a new packed document and
            attention never crosses documents. ``None``: one document. Costs one all-gather per call;
            ``documents`` costs none.
        documents: ``(b, N)`` document ids of the WHOLE sequence in global order, computed once per batch
            where it is sharded: ``document_ids(global_positions(batch))`` (``sharding.py``; ``None`` there
            means one document). Given, ``position_ids`` are not read.
        sliding_window: attend only to the last ``sliding_window`` tokens (incl. itself), as HF.
        softcap: ``c > 0``: scores become ``c * tanh(scores / c)`` before the mask (Gemma-2); needs a
            kernel that applies it ("auto": flash, else FPDT's blocks; "math" by name).
        sinks: ``(h,)`` attention sinks (gpt-oss ``s_aux``), one learned logit per GLOBAL query head in
            the softmax denominator with no value attached; any float dtype, on q's device, the same
            tensor on every rank. Each rank uses (and gives a gradient to) the heads it owns after the
            all-to-all, so ``sinks.grad`` is ``(h,)`` with zeros outside them; summed over the group
            (as the strategy does for parameters) it is the exact gradient. "auto" runs them on FPDT's
            blocks, "math" on the math kernel; "sdpa" and "flash" raise.

    Returns:
        ``(b, s/P, h, d)``, equal to full attention over the gathered sequence.
    """
    call = prepare_ulysses(
        q, k, v, group=group, position_ids=position_ids, documents=documents, backend=backend,
        sliding_window=sliding_window, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    features = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    if call.on_blocks:  # FPDT's blocks, one chunk per rank: no (N, N) mask (module doc)
        return fpdt_attention(
            q, k, v, group=group, chunk_size=q.shape[1], causal=causal, softmax_scale=softmax_scale,
            documents=call.documents, **features,
        )  # fmt: skip
    return ulysses_all_to_all(
        q, k, v, call, group=group, causal=causal, softmax_scale=softmax_scale, **features
    )
