"""Ring attention: exact attention over a sequence spread over a ring of r ranks, key/value blocks passed
between neighbours (the outer axis of 2-D sequence parallelism; ``shared/research/usp.md`` §2-§4).

Layout (:class:`RingLayout`, defined with the other layouts in ``parallel/layout.py`` and re-exported here;
under 2-D sequence parallelism ``SequenceLayout.ring_view``): the global sequence of N tokens is cut into
chunks. ``"zigzag"``: 2r chunks of N/(2r) tokens, ring rank j holds chunk j then chunk 2r-1-j (every rank gets
the same causal work); ``"contiguous"``: r chunks, rank j holds tokens ``[jN/r, (j+1)N/r)``. A rank's q, k, v
are its chunks concatenated in that order, ``(b, N/r, heads, d)``.

Forward (r steps): at step t rank j holds the k/v of ring rank ``(j - t) mod r``; the next block's
send/receive (``comm.ring_pass_async``) is started before the current block computes and waited after (a
double buffer: two k/v blocks are alive). The blocks are FPDT's: a :class:`~.fpdt.BlockPlan` over the
global chunks says which (q chunk, kv chunk) pairs carry an allowed pair (causal, sliding window, packed
documents: the others are skipped, no N x N mask is ever built) and gives their kernel calls with
GLOBAL offsets, run on the fused kernels of ``fused.py`` where one passed its probe, else on the math
blocks of ``kernels.py``; partial results are merged by ``kernels.merge_blocks`` (safe when both sides
are ``-inf``) in fp32 (fp64 for fp64 inputs). Attention sinks join once, after the last step
(``merge_sinks``). Saved: q, k, v (this rank's own), out and the final lse.

Backward (r steps again): each block is recomputed from the row's FINAL (out, lse) and
``delta = rowsum(dout * out)``; dq accumulates here; dk/dv of the visiting block accumulate in an fp32
(fp64) buffer that travels one hop behind its k/v and reaches its owner after r hops. The sinks'
gradient comes from the final lse (``sink_grad``), over this rank's rows.

Bytes sent per rank per call (``count_all_to_all().exchange_bytes``), with ``e`` the bytes of a k/v
element and ``e_acc`` of the accumulator (4; 8 when an input is fp64), ``B = 2 * b * (N/r) * h_kv * d``
the elements of one k/v block (at kv-head size: GQA k/v are never expanded before they travel):

* forward: ``(r - 1) * B * e`` (r - 1 passes of k and v);
* backward: ``(r - 1) * B * e + r * B * e_acc`` (k and v again, and dk/dv home after r hops); nothing at
  r = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_longctx.attention.common import (
    check_qkv,
    check_sinks,
    check_softcap,
    compute_dtype,
    default_scale,
    local_heads,
    spread_kv_heads,
)
from lightning_longctx.attention.fpdt import BlockPlan, Unit, block_kernels, unit_backward, unit_forward
from lightning_longctx.attention.fused import common_dtype
from lightning_longctx.attention.kernels import merge_blocks, merge_sinks, sink_grad
from lightning_longctx.parallel.comm import (
    Group,
    SequenceParallelFunction,
    group_rank_size,
    head_to_seq,
    ring_pass_async,
    seq_to_head_packed,
)
from lightning_longctx.parallel.layout import RING_LAYOUTS, RingLayout

__all__ = ["RING_LAYOUTS", "RingLayout", "ring_attention", "ring_work", "usp_attention"]

_KV_TAG, _DKV_TAG = 0, 1  # k/v and the dk/dv behind them travel between the same ranks at once


@dataclass(frozen=True)
class _Piece:
    """One kernel call of a ring step: local q rows, rows of the visiting k/v block (both slices of
    ``(b, N/r, ...)`` tensors), and the plan's :class:`~.fpdt.Unit` (kind, mask with global offsets)."""

    q_rows: slice
    kv_rows: slice
    unit: Unit

    @property
    def work(self) -> int:
        """Score elements it computes per (batch, head)."""
        return (self.q_rows.stop - self.q_rows.start) * (self.kv_rows.stop - self.kv_rows.start)


def _plan(
    layout: RingLayout,
    causal: bool,
    sliding_window: int | None,
    documents: torch.Tensor | None,
    block_size: int,
    kernel: Any = None,
    bias_kernel: Any = None,
) -> BlockPlan:
    """FPDT's block plan over the layout's global chunks (the same for every rank: it reads gathered data)."""
    return BlockPlan.build(
        layout.num_chunks, layout.chunk_len, block_size=block_size, causal=causal, sliding_window=sliding_window,
        docs=documents, kernel=kernel, bias_kernel=bias_kernel,
    )  # fmt: skip


def _schedule(layout: RingLayout, plan: BlockPlan, rank: int) -> tuple[tuple[_Piece, ...], ...]:
    """Per step t, ``rank``'s kernel calls against the k/v of ring rank ``(rank - t) mod r`` (in forward
    and backward alike); an empty step still passes its k/v on."""
    c, r = layout.chunk_len, layout.ring_size
    steps = []
    for t in range(r):
        src = (rank - t) % r
        pieces = []
        for a, i in enumerate(layout.chunks(rank)):  # q chunk i at local rows [a c, (a+1) c)
            for bb, j in enumerate(layout.chunks(src)):  # kv chunk j at rows [bb c, (bb+1) c) of src's block
                if not plan.live[i][j]:
                    continue
                for unit in plan.units(i, j):
                    q_rows = slice(a * c + unit.qs.start, a * c + unit.qs.stop)
                    kv_rows = slice(bb * c + unit.ks.start, bb * c + unit.ks.stop)
                    pieces.append(_Piece(q_rows, kv_rows, unit))
        steps.append(tuple(pieces))
    return tuple(steps)


@dataclass(frozen=True)
class _RingCall:
    """The settings of one ``ring_attention`` call, fixed before the autograd Function runs."""

    group: Group
    layout: RingLayout
    plan: BlockPlan
    scale: float
    softcap: float | None
    steps: tuple[tuple[_Piece, ...], ...]  # this rank's schedule

    @property
    def work(self) -> int:
        """Score elements this rank computes per (batch, head) in the forward (the backward recomputes the
        same)."""
        return sum(p.work for step in self.steps for p in step)


class _RingAttention(SequenceParallelFunction):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        call: _RingCall,
    ) -> torch.Tensor:
        ct = compute_dtype(common_dtype(q, k))
        b, n, h, d = q.shape
        out = q.new_zeros((b, n, h, d), dtype=ct)  # rows no block reaches stay out = 0, lse = -inf
        lse = q.new_full((b, h, n), float("-inf"), dtype=ct)
        kv = torch.stack([k, v])  # (2, b, N/r, h_kv, d): one message per step
        last = len(call.steps) - 1
        for t, pieces in enumerate(call.steps):
            pending = ring_pass_async(kv, call.group, tag=_KV_TAG) if t < last else None  # the next block
            for piece in pieces:
                rows, cols = piece.q_rows, piece.kv_rows
                blk_out, blk_lse = unit_forward(
                    piece.unit, q[:, rows], kv[0, :, cols], kv[1, :, cols],
                    plan=call.plan, scale=call.scale, softcap=call.softcap,
                )  # fmt: skip
                out[:, rows], lse[:, :, rows] = merge_blocks(out[:, rows], lse[:, :, rows], blk_out, blk_lse)
            if pending is not None:
                kv = pending.wait()
        del kv
        if sinks is not None:  # one more softmax column per row, after every key: lse becomes the total
            out, lse = merge_sinks(out, lse, sinks.detach().to(ct))
        out = out.to(q.dtype)
        tail = [] if sinks is None else [sinks]
        ctx.save_for_backward(q, k, v, out, lse, *tail)  # this rank's own k, v: not the last block received
        ctx.call = call
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        call: _RingCall = ctx.call
        q, k, v, out, lse, *tail = ctx.saved_tensors
        sinks = tail[0] if tail else None
        ct = lse.dtype
        dout = grad.contiguous()
        delta = (dout.to(ct) * out.to(ct)).sum(-1).transpose(1, 2).contiguous()  # (b, h, N/r)
        dq = torch.zeros(q.shape, dtype=ct, device=q.device)
        kv = torch.stack([k, v])
        r, last = call.layout.ring_size, len(call.steps) - 1
        dkv: torch.Tensor | None = None
        pending_dkv = None  # the visiting block's dk/dv from the ranks before this one
        for t, pieces in enumerate(call.steps):
            pending_kv = ring_pass_async(kv, call.group, tag=_KV_TAG) if t < last else None
            dkv = torch.zeros(kv.shape, dtype=ct, device=kv.device)  # (2, b, N/r, h_kv, d)
            for piece in pieces:
                qr, kr = piece.q_rows, piece.kv_rows
                dq_p, dk_p, dv_p = unit_backward(
                    piece.unit, dout[:, qr], q[:, qr], kv[0, :, kr], kv[1, :, kr], out[:, qr], lse[:, :, qr],
                    delta[:, :, qr], plan=call.plan, scale=call.scale, softcap=call.softcap,
                )  # fmt: skip
                dq[:, piece.q_rows] += dq_p
                dkv[0, :, piece.kv_rows] += dk_p
                dkv[1, :, piece.kv_rows] += dv_p
            if pending_dkv is not None:
                dkv += pending_dkv.wait()
            if r > 1:  # one hop behind its k/v; after the last step's hop it is home
                pending_dkv = ring_pass_async(dkv, call.group, tag=_DKV_TAG)
            if pending_kv is not None:
                kv = pending_kv.wait()
        if pending_dkv is not None:
            dkv = pending_dkv.wait()  # this rank's own block, every rank's queries summed
        assert dkv is not None
        dsinks = None
        if sinks is not None:  # over this rank's rows: the sum over the ring is the gradient
            dsinks = sink_grad(lse, delta, sinks.to(ct)).to(sinks.dtype)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None


def _check_layout(q: torch.Tensor, layout: RingLayout, group: Group, q_len: int) -> int:
    """This rank's ring rank, after checking ``layout`` against the group and q's ``q_len`` tokens (the ring's
    share: before a Ulysses all-to-all, q's length times U); errors name the fix."""
    if not isinstance(layout, RingLayout):
        raise TypeError(
            f"layout must be a RingLayout (ring_size, seq_len, kind), got {type(layout).__name__}; build one with "
            "RingLayout(ring_size=r, seq_len=N, kind='zigzag')"
        )
    rank, world = group_rank_size(group)
    if world != layout.ring_size:
        raise ValueError(
            f"the ring group has {world} ranks but layout.ring_size is {layout.ring_size}; they must be equal: "
            f"pass the ring's process group, or RingLayout(ring_size={world}, ...)"
        )
    if q_len != layout.local_len:
        raise ValueError(
            f"q holds {q_len} tokens per ring rank, but {layout} gives each of its {layout.ring_size} ranks "
            f"seq_len / ring_size = {layout.local_len}; shard the whole sequence with layout.shard(x, rank) "
            f"(layout.sp_shard for usp_attention; or build the layout with seq_len = {q_len} x "
            f"{layout.ring_size})"
        )
    return rank


def _check_documents(documents: torch.Tensor | None, q: torch.Tensor, layout: RingLayout) -> None:
    if documents is None:
        return
    want = (q.shape[0], layout.seq_len)
    if tuple(documents.shape) != want:
        raise ValueError(
            f"documents shape {tuple(documents.shape)} must be (batch, whole sequence) = {want}: the document ids "
            "of the WHOLE sequence in GLOBAL order, the same on every rank "
            "(sharding.document_ids(global position ids)), not this rank's shard"
        )
    if documents.device != q.device:
        raise ValueError(
            f"documents is on {documents.device} but q is on {q.device}; move it with documents.to(q.device)"
        )
    if documents.shape[1] > 1 and not bool((documents[:, 1:] >= documents[:, :-1]).all()):
        raise ValueError(
            "documents must not decrease along a row (blocks are skipped by comparing the first and last id "
            "of each chunk); number the documents in order, e.g. sharding.document_ids(global position ids)"
        )


def _check_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    layout: RingLayout,
    q_len: int,
    sliding_window: int | None,
    documents: torch.Tensor | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    backend: str,
    block_size: int,
    caller: str,
) -> tuple[int, Any, Any]:
    """Every check of a ring call, before any collective (``usp_attention`` runs it on every rank before its
    all-to-all: a rank of a Ulysses group without heads never reaches the ring, and must refuse as the others
    do, not wait for them). Returns this rank's ring rank and the block kernels (``block_kernels``)."""
    check_qkv(q, k, v)
    check_softcap(softcap)
    check_sinks(sinks, q)
    if k.dtype != v.dtype:
        raise ValueError(
            f"k ({k.dtype}) and v ({v.dtype}) must have the same dtype: they travel in one buffer"
        )
    rank = _check_layout(q, layout, group, q_len)
    _check_documents(documents, q, layout)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window!r}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size!r}")
    masked = documents is not None or sliding_window is not None
    kernel, bias_kernel = block_kernels(backend, q, k, softcap=softcap, masked=masked, caller=caller)
    return rank, kernel, bias_kernel


def _ring_call(
    checked: tuple[int, Any, Any],
    *,
    group: Group,
    layout: RingLayout,
    causal: bool,
    scale: float,
    sliding_window: int | None,
    documents: torch.Tensor | None,
    softcap: float | None,
    block_size: int,
) -> _RingCall:
    """The :class:`_RingCall` of a call :func:`_check_call` passed (``checked``: its ring rank and kernels)."""
    rank, kernel, bias_kernel = checked
    plan = _plan(layout, causal, sliding_window, documents, block_size, kernel, bias_kernel)
    return _RingCall(group, layout, plan, scale, softcap, _schedule(layout, plan, rank))


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group,
    layout: RingLayout,
    causal: bool = True,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    documents: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    block_size: int = 1024,
) -> torch.Tensor:
    """Exact attention over a sequence spread over the ranks of ``group`` in ``layout``, k/v passed around.

    Args:
        q: ``(b, N/r, h, d)`` this rank's queries in ``layout``'s local order (``layout.shard(x, rank)``).
        k, v: ``(b, N/r, h_kv, d)``, ``h % h_kv == 0``; they travel at ``h_kv`` heads.
        group: the ring's process group, ``layout.ring_size`` ranks (``None``: the default group, or one
            process without ``torch.distributed``). Ring rank j's neighbours are j - 1 and j + 1 in it.
        layout: :class:`RingLayout`; any kind is exact with any mask, zigzag balances the causal work.
        causal: causal attention over GLOBAL positions.
        sliding_window: attend only to the last ``sliding_window`` tokens (itself included), as HF.
        documents: ``(b, N)`` document ids of the WHOLE sequence in GLOBAL order (packed rows; ids must not
            decrease along a row), the same on every rank; attention never crosses documents. ``None``: one.
        softcap: ``c > 0``: scores become ``c * tanh(scores / c)`` (math blocks).
        sinks: ``(h,)`` attention-sink logits of q's heads (gpt-oss ``s_aux``), applied once after every
            step. Each rank gives them the gradient of its own rows; summed over the ring (as the strategy
            sums parameter gradients) it is the exact gradient.
        backend: ``"auto"`` (a fused block kernel that passed its probe, ``fused.py``, else math),
            ``"fused"`` (that kernel or an error) or ``"math"`` (the reference blocks).
        block_size: tokens per compute tile of a chunk (bounds the math kernel's score tile and a masked
            fused tile's additive mask); blocks a fused kernel runs whole are not tiled.

    Returns:
        ``(b, N/r, h, d)`` in q's dtype and ``layout``'s local order. Every rank of ``group`` must call it
        (and its backward): a rank with nothing to compute on a step still passes the k/v on.
    """
    checked = _check_call(
        q, k, v, group=group, layout=layout, q_len=q.shape[1], sliding_window=sliding_window,
        documents=documents, softcap=softcap, sinks=sinks, backend=backend, block_size=block_size,
        caller="ring_attention",
    )  # fmt: skip
    call = _ring_call(
        checked, group=group, layout=layout, causal=causal, scale=default_scale(q.shape[-1], softmax_scale),
        sliding_window=sliding_window, documents=documents, softcap=softcap, block_size=block_size,
    )  # fmt: skip
    return _RingAttention.apply(q, k, v, sinks, call)


def ring_work(
    layout: RingLayout,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    documents: torch.Tensor | None = None,
    block_size: int = 1024,
) -> list[int]:
    """Score elements each ring rank computes per (batch, head) in one forward (the backward recomputes the
    same), in ring-rank order, with the math blocks' tiles (``block_size``); no process group needed.
    ``documents``: ``(b, N)`` as for :func:`ring_attention`. Causal balance: zigzag gives every rank
    ``(2r + 1) * chunk_len**2`` (one tile per block), contiguous gives rank j ``(j + 1) * (N/r)**2``."""
    plan = _plan(layout, causal, sliding_window, documents, block_size)
    return [sum(p.work for step in _schedule(layout, plan, j) for p in step) for j in range(layout.ring_size)]


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_group: Group,
    ring_group: Group,
    layout: RingLayout,
    causal: bool = True,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    documents: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    block_size: int = 1024,
) -> torch.Tensor:
    """2-D sequence parallelism (USP): Ulysses on ``ulysses_group`` (U ranks, the inner axis: fast links), ring
    attention on ``ring_group`` (r ranks, the outer axis). ``q`` ``(b, N/(rU), h, d)`` and k/v
    ``(b, N/(rU), h_kv, d)`` are sp rank ``(j, u)``'s tokens (``layout.sp_shard``); one all-to-all of q, k, v
    over the Ulysses group gives ``(b, N/r, h/U, d)`` in ring rank j's layout order, :func:`ring_attention` runs
    over the ring with those heads, and the inverse all-to-all returns ``(b, N/(rU), h, d)``. GQA k/v with
    fewer heads than U are spread as Ulysses spreads them; ring peers hold the same heads (same u), so their
    blocks have one shape even with an uneven head split. ``sinks`` ``(h,)``: each rank uses its heads' and
    gives them the gradient of its rows: summed over the sp group it is exact. The other arguments are
    :func:`ring_attention`'s."""
    h = q.shape[2]
    _, ulysses = group_rank_size(ulysses_group)
    checked = _check_call(
        q, k, v, group=ring_group, layout=layout, q_len=q.shape[1] * ulysses, sliding_window=sliding_window,
        documents=documents, softcap=softcap, sinks=sinks, backend=backend, block_size=block_size,
        caller="usp_attention",
    )  # fmt: skip  # on every rank, before the all-to-all: ranks without heads refuse too
    k, v = spread_kv_heads(k, v, h, ulysses)  # outside the Functions: autograd sums the copies' gradients
    q_h, k_h, v_h = seq_to_head_packed(q, k, v, group=ulysses_group)  # (b, N/r, h_u, d): ring rank j's tokens
    my_sinks = None if sinks is None else sinks[local_heads(h, ulysses_group)]
    if q_h.shape[2] == 0:  # fewer heads than Ulysses ranks: this rank, and its whole ring (same u), has none
        out = head_to_seq(q_h.clone(), h, ulysses_group)
        # + 0 exactly (a sum over no heads): the sinks get their zero gradient here too, as on every other rank
        return out if my_sinks is None else out + my_sinks.sum().to(out.dtype)
    call = _ring_call(
        checked, group=ring_group, layout=layout, causal=causal, scale=default_scale(q.shape[-1], softmax_scale),
        sliding_window=sliding_window, documents=documents, softcap=softcap, block_size=block_size,
    )  # fmt: skip
    out = _RingAttention.apply(q_h, k_h, v_h, my_sinks, call)  # ring_attention, checked above
    return head_to_seq(out, h, ulysses_group)
