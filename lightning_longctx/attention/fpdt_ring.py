"""FPDT x ring: FPDT's chunked attention inside each ring rank, key/value segments passed around the ring
(2-D sequence parallelism with FPDT's chunking and offload; ``shared/research/usp.md``).

Layout (``shard_batch(..., chunk_size=c, ring=r)``: ``SequenceLayout(sp=P, ring=r, chunk_size=c)`` of
``parallel/layout.py``, whose ring view is ring attention's :class:`~.ring.RingLayout`): the global sequence of
N tokens is cut into ``2r`` zigzag chunks; ring rank j owns chunks j and ``2r-1-j`` (``N/r`` tokens, in that
order), cut into ``K`` segments of ``S = U*c`` tokens; sp rank ``(j, u)`` holds chunk u of each segment,
``(b, K*c, ...)``.
``N % (2*P*c) == 0``: each segment is a run of S consecutive global tokens (global segment ``g``, ``G = r*K``
of them), so FPDT's :class:`~.fpdt.BlockPlan` over the G global segments says which (q segment, kv segment)
pairs carry an allowed pair (causal, sliding window, packed documents) and gives their kernel calls.

Forward: the all-to-all of local chunk i over the Ulysses group (q, k, v in one) gives ring rank j's segment
i with ``h/U`` heads; q, k, v, and later out and lse, go into a :class:`~.offload.ChunkStore` (host memory with
``offload=True``). Then r ring steps: at step t the K k/v segments of ring rank ``(j - t) mod r`` visit, ONE
segment at a time: its pass to the next rank (``comm.ring_pass_async``) starts before it computes against
every local q segment it reaches, and the received segment goes into a store of its own (host memory with
``offload``) for the next step. A ring step is FPDT's next kv chunk arriving from a neighbour instead of
from host memory. The fp32 (fp64) running ``out``/``lse`` of every local q segment stay on the device through
the steps (``(b, N/r, h/U, d)`` in all: the layer's output in fp32), merged by ``kernels.merge_blocks``;
sinks join once at the end. Each output segment returns through the inverse all-to-all.

Backward: the dout segments arrive by all-to-all; the k/v segments travel the ring again and each visiting
segment's dk/dv (fp32) travels one hop behind it, home after r hops; dq accumulates in fp32 on the device;
dq and dk/dv leave through the inverse all-to-alls.

Bytes per rank per call: the Ulysses all-to-alls of FPDT over U ranks (q, k, v, out forward; dout, dq, dk,
dv backward) and the ring's passes of :mod:`~.ring` (``(r - 1)`` k/v blocks forward, ``(r - 1)`` k/v blocks
and ``r`` fp32 dk/dv blocks backward), a block being the K segments of one ring rank.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_longctx.attention.common import (
    check_qkv,
    compute_dtype,
    default_scale,
    local_heads,
    spread_kv_heads,
)
from lightning_longctx.attention.fpdt import (
    BlockPlan,
    UnitKind,
    _SegmentAcc,
    unit_backward,
    unit_forward,
)
from lightning_longctx.attention.kernels import merge_sinks, sink_grad
from lightning_longctx.attention.offload import ChunkStore
from lightning_longctx.attention.ring import _check_call
from lightning_longctx.parallel.comm import (
    Group,
    PendingAllToAll,
    SequenceParallelFunction,
    group_rank_size,
    head_to_seq_async,
    head_to_seq_packed_async,
    ring_pass_async,
    seq_to_head_async,
    seq_to_head_packed_async,
)
from lightning_longctx.parallel.layout import RingLayout

_KV_TAG, _DKV_TAG = 0, 1


@dataclass(frozen=True)
class _Call:
    """The settings of one :func:`fpdt_ring_attention` call, fixed before the autograd Function runs."""

    ulysses_group: Group
    ring_group: Group
    layout: RingLayout  # the ring's zigzag over the whole sequence
    chunk: int  # c: tokens per local chunk
    segments: int  # K: local chunks (segments of the ring rank)
    ring_rank: int  # j
    plan: BlockPlan  # over the G = r * K global segments of S = U * c tokens
    scale: float
    softcap: float | None
    offload: bool

    @property
    def ring(self) -> int:
        return self.layout.ring_size

    @functools.cached_property
    def _global_segments(self) -> tuple[tuple[int, ...], ...]:
        """Per ring rank, the global segment of each of its K segments: the first K/2 lie in its first zigzag
        chunk, the others in its second (``layout.chunks``)."""
        half = self.segments // 2
        return tuple(
            tuple(self.layout.chunks(j)[i // half] * half + i % half for i in range(self.segments))
            for j in range(self.ring)
        )

    def global_segment(self, ring_rank: int, i: int) -> int:
        """Global segment of ring rank ``ring_rank``'s segment ``i``."""
        return self._global_segments[ring_rank][i]

    def pairs(self, src: int, s: int) -> list[tuple[int, int, int]]:
        """``(local q segment i, its global segment, the visiting global segment)`` of every live pair of
        visiting segment ``s`` of ring rank ``src``."""
        gs = self.global_segment(src, s)
        out = []
        for i in range(self.segments):
            gi = self.global_segment(self.ring_rank, i)
            if self.plan.live[gi][gs]:
                out.append((i, gi, gs))
        return out


def _visits(call: _Call, store: ChunkStore, device: torch.device) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Every ring step's visiting k/v segments in order, ``(the ring rank they belong to, segment s, k/v
    (2, b, S, h_kv_u, d))``: step 0 this rank's own (``store``'s ``("kv", s)``), step t those of ring rank
    ``(j - t) mod r``. Each segment's pass to the next rank starts before it is yielded; it is received, into
    the store of the next step (host memory with offload), when the caller asks for the next segment (drop
    the yielded one first: two segments alive). Forward and backward walk the ring alike."""
    r, visiting = call.ring, store
    for t in range(r):
        arriving = ChunkStore(offload=call.offload, device=device)
        for s in range(call.segments):
            kv = visiting.get(("kv", s))
            passing = ring_pass_async(kv, call.ring_group, tag=_KV_TAG) if t < r - 1 else None
            yield (call.ring_rank - t) % r, s, kv
            del kv
            if passing is not None:
                arriving.put(("kv", s), passing.wait())
        visiting = arriving


def _local(x: torch.Tensor, i: int, c: int) -> torch.Tensor:
    return x[:, i * c : (i + 1) * c]


class _FPDTRingAttention(SequenceParallelFunction):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        call: _Call,
    ) -> torch.Tensor:
        """``sinks``: ``(h_u,)`` the sinks of this rank's heads after the all-to-all, or ``None``."""
        K, c = call.segments, call.chunk
        S = call.plan.seg_len
        store = ChunkStore(offload=call.offload, device=q.device)
        pending = seq_to_head_packed_async(
            _local(q, 0, c), _local(k, 0, c), _local(v, 0, c), group=call.ulysses_group
        )
        for i in range(K):  # each segment's all-to-all travels while the previous one is stored
            q_i, k_i, v_i = pending.wait()
            if i + 1 < K:
                parts = (_local(q, i + 1, c), _local(k, i + 1, c), _local(v, i + 1, c))
                pending = seq_to_head_packed_async(*parts, group=call.ulysses_group)
            store.put(("q", i), q_i)  # (b, S, h_u, d)
            store.put(("kv", i), torch.stack([k_i, v_i]))  # (2, b, S, h_kv_u, d): one message per ring pass
            del q_i, k_i, v_i
        h_u = store.get(("q", 0)).shape[2]
        accs = [_SegmentAcc(S) for _ in range(K)]
        if h_u:  # a Ulysses rank without heads has none in its whole ring (same u): nothing to pass
            for src, s, kv in _visits(call, store, q.device):
                for i, gi, gs in call.pairs(src, s):
                    q_i = store.get(("q", i))
                    for unit in call.plan.units(gi, gs):
                        blk = unit_forward(
                            unit, q_i[:, unit.qs], kv[0, :, unit.ks], kv[1, :, unit.ks],
                            plan=call.plan, scale=call.scale, softcap=call.softcap,
                        )  # fmt: skip
                        accs[i].add(unit.qs, *blk)
                    del q_i
                del kv
        outs: list[torch.Tensor] = []
        pend_out: PendingAllToAll | None = None
        for i in range(K):
            out_i, lse_i = accs[i].out, accs[i].lse
            if out_i is None or lse_i is None:  # no key at all (no heads): out 0, lse -inf
                q_i = store.get(("q", i))
                out_i = q_i.new_zeros(q_i.shape, dtype=compute_dtype(q.dtype))
                lse_i = q_i.new_full((q_i.shape[0], h_u, S), float("-inf"), dtype=out_i.dtype)
            if sinks is not None:  # one more softmax column per row, after every key
                out_i, lse_i = merge_sinks(out_i, lse_i, sinks.detach().to(out_i.dtype))
            accs[i] = _SegmentAcc(S)  # drop the accumulator as its segment leaves
            out_i = out_i.to(q.dtype)
            store.put(("out", i), out_i)
            store.put(("lse", i), lse_i)
            if pend_out is not None:
                outs.append(pend_out.wait())
            pend_out = head_to_seq_async(out_i, q.shape[2], call.ulysses_group)
            del out_i, lse_i
        assert pend_out is not None
        outs.append(pend_out.wait())
        tail = [] if sinks is None else [sinks]
        ctx.keys, tensors = store.saved()
        ctx.save_for_backward(*tensors, *tail)
        ctx.call = call
        ctx.meta = (q.dtype, k.dtype, q.shape[2], k.shape[2], sinks is not None, h_u)
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        call: _Call = ctx.call
        q_dtype, kv_dtype, heads, kv_heads, has_sinks, h_u = ctx.meta
        K, c, r = call.segments, call.chunk, call.ring
        saved = list(ctx.saved_tensors)
        sinks = saved.pop() if has_sinks else None
        store = ChunkStore.restore(ctx.keys, saved, offload=call.offload, device=grad.device)
        del saved
        ct = compute_dtype(q_dtype)
        grad = grad.contiguous()
        pending = seq_to_head_async(_local(grad, 0, c), call.ulysses_group)
        dsink = None
        for i in range(K):  # every dout segment (and its delta) in the store first
            dout_i = pending.wait()
            if i + 1 < K:
                pending = seq_to_head_async(_local(grad, i + 1, c), call.ulysses_group)
            out_i = store.get(("out", i))
            delta_i = (dout_i.to(ct) * out_i.to(ct)).sum(-1).transpose(1, 2).contiguous()  # (b, h_u, S)
            store.put(("dout", i), dout_i)
            store.put(("delta", i), delta_i)
            if sinks is not None:  # over this rank's rows; summed over the sp group it is exact
                part = sink_grad(store.get(("lse", i)).to(ct), delta_i, sinks.to(ct))
                dsink = part if dsink is None else dsink + part
            del dout_i, out_i, delta_i
        dq: list[torch.Tensor | None] = [None] * K
        own: list[torch.Tensor | None] = [None] * K  # this rank's dk/dv, home after r hops
        if h_u:
            behind: list[PendingAllToAll | None] = [None] * K  # the visiting segment's dk/dv, one hop behind
            for src, s, kv in _visits(call, store, grad.device):
                dkv = torch.zeros(kv.shape, dtype=ct, device=kv.device)  # (2, b, S, h_kv_u, d)
                for i, gi, gs in call.pairs(src, s):
                    q_i, out_i, lse_i = store.get(("q", i)), store.get(("out", i)), store.get(("lse", i))
                    dout_i, delta_i = store.get(("dout", i)), store.get(("delta", i))
                    for unit in call.plan.units(gi, gs):
                        qs, ks = unit.qs, unit.ks
                        dq_u, dk_u, dv_u = unit_backward(
                            unit, dout_i[:, qs], q_i[:, qs], kv[0, :, ks], kv[1, :, ks], out_i[:, qs],
                            lse_i[:, :, qs], delta_i[:, :, qs] if unit.kind is UnitKind.MATH else None,
                            plan=call.plan, scale=call.scale, softcap=call.softcap,
                        )  # fmt: skip
                        if dq[i] is None:
                            dq[i] = torch.zeros(q_i.shape, dtype=ct, device=q_i.device)
                        dq[i][:, qs] += dq_u  # type: ignore[index]
                        dkv[0, :, ks] += dk_u
                        dkv[1, :, ks] += dv_u
                    del q_i, out_i, lse_i, dout_i, delta_i
                del kv
                came = behind[s]
                if came is not None:  # the ranks before this one: their queries' share
                    dkv += came.wait()
                behind[s] = ring_pass_async(dkv, call.ring_group, tag=_DKV_TAG) if r > 1 else None
                if r == 1:
                    own[s] = dkv
                del dkv
            for s in range(K):
                came = behind[s]
                if came is not None:  # after the last hop: this rank's own segment, every rank's queries
                    own[s] = came.wait()
        dq_parts, dkv_parts = [], []
        for i in range(K):
            q_i, kv_i = store.get(("q", i)), store.get(("kv", i))
            dq_i = dq[i] if dq[i] is not None else torch.zeros(q_i.shape, dtype=ct, device=q_i.device)
            dkv_i = own[i] if own[i] is not None else torch.zeros(kv_i.shape, dtype=ct, device=kv_i.device)
            dq[i] = own[i] = None
            dq_parts.append(head_to_seq_async(dq_i.to(q_dtype), heads, call.ulysses_group))
            dkv_parts.append(
                head_to_seq_packed_async(
                    [dkv_i[0].to(kv_dtype), dkv_i[1].to(kv_dtype)], [kv_heads, kv_heads], call.ulysses_group
                )
            )
            del q_i, kv_i, dq_i, dkv_i
        store.release()
        dsinks = None
        if sinks is not None:
            dsinks = (torch.zeros_like(sinks, dtype=ct) if dsink is None else dsink).to(sinks.dtype)
        dkvs = [p.wait() for p in dkv_parts]
        return (
            torch.cat([p.wait() for p in dq_parts], dim=1),
            torch.cat([x[0] for x in dkvs], dim=1),
            torch.cat([x[1] for x in dkvs], dim=1),
            dsinks,
            None,
        )


def fpdt_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_group: Group,
    ring_group: Group,
    chunk_size: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    documents: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    block_size: int = 1024,
    offload: bool = False,
) -> torch.Tensor:
    """Exact attention over a sequence in the FPDT x ring layout (module doc), chunk by chunk.

    Args:
        q: ``(b, K*c, h, d)`` sp rank ``(j, u)``'s queries: ``shard_batch(..., chunk_size=c, ring=r)``'s layout
            (``c`` = ``chunk_size``), K even (``N % (2*P*c) == 0``).
        k, v: ``(b, K*c, h_kv, d)``, ``h % h_kv == 0``; GQA k/v with fewer heads than U are spread as
            Ulysses spreads them, and travel the ring at that head count.
        ulysses_group, ring_group: the two parts of the sp group (``mesh.WorldMesh``): the U consecutive sp
            ranks of one all-to-all, and the r ranks of one ring (the same u).
        documents: ``(b, N)`` document ids of the WHOLE sequence in GLOBAL order (packed rows), the same on
            every rank; ``None``: one document per row.
        offload: keep q, k, v, out, lse, dout segments and the k/v segments that arrive for the next ring
            step in (pinned) host memory; results are bit-identical to ``offload=False``.
        causal, softmax_scale, sliding_window, softcap, sinks, backend, block_size: as
            :func:`~.ring.ring_attention` (``sinks`` ``(h,)``: each rank gives its heads the gradient of its
            rows; summed over the sp group it is exact).

    Returns:
        ``(b, K*c, h, d)`` in q's dtype and layout. Every rank of both groups must call it (and its backward).
    """
    check_qkv(q, k, v)
    _, local, h, d = q.shape
    if not isinstance(chunk_size, int) or chunk_size <= 0 or local % (2 * chunk_size):
        raise ValueError(
            f"chunk_size {chunk_size!r} must be a positive number of tokens whose double divides the local "
            f"sequence length {local} (an even number of chunks: half in each of the ring rank's two zigzag "
            f"chunks); shard the batch with shard_batch(..., chunk_size=c, ring=r) (it pads to 2 x P x c)"
        )
    _, ring = group_rank_size(ring_group)
    _, ulysses = group_rank_size(ulysses_group)
    segments, seg_len = local // chunk_size, ulysses * chunk_size
    # the ring's own checks (the zigzag's 2r chunks, documents, window, tiles, sinks, softcap, backend), on
    # every rank before any collective
    layout = RingLayout(ring_size=ring, seq_len=local * ring * ulysses, kind="zigzag")
    ring_rank, kernel, bias_kernel = _check_call(
        q, k, v, group=ring_group, layout=layout, q_len=local * ulysses, sliding_window=sliding_window,
        documents=documents, softcap=softcap, sinks=sinks, backend=backend, block_size=block_size,
        caller="fpdt_ring_attention",
    )  # fmt: skip
    k, v = spread_kv_heads(k, v, h, ulysses)  # outside the Function: autograd sums the copies' gradients
    plan = BlockPlan.build(
        ring * segments, seg_len, block_size=block_size, causal=causal, sliding_window=sliding_window,
        docs=documents, kernel=kernel, bias_kernel=bias_kernel,
    )  # fmt: skip
    call = _Call(
        ulysses_group, ring_group, layout, chunk_size, segments, ring_rank, plan,
        default_scale(d, softmax_scale), softcap, offload,
    )  # fmt: skip
    my_sinks = None if sinks is None else sinks[local_heads(h, ulysses_group)]
    return _FPDTRingAttention.apply(q, k, v, my_sinks, call)
