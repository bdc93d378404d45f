"""FPDT attention: Fully Pipelined Distributed Transformer (arXiv 2408.16978), exact, on any backend.

Layout (``shard_batch(..., chunk_size=c)``): the global sequence of N tokens is cut into chunks of c
tokens and rank r of the P ranks holds chunks ``r, r+P, r+2P, ...``, i.e. ``u = N / (P*c)`` local
chunks. The all-to-all of local chunk i gives every rank the contiguous GLOBAL segment i
(``S = P*c`` tokens starting at ``i*S``) with its block of heads.

Forward, per segment i: all-to-all q_i (causal: q_i, k_i, v_i in ONE packed all-to-all; otherwise
k_j, v_j together and q_i alone); attend to the kv segments j ≤ i (all j when not causal) one
block at a time, merging block results with an fp32 online softmax on the log-sum-exp; all-to-all the
output back to local chunk i. Only q, k, v, out (head layout) and lse are kept per segment — no
scores, no probabilities — on the device or, with ``offload=True``, in host memory with the next kv
chunk prefetched on a side stream while the current block computes.

Backward: outer loop over kv segments j, inner over q segments i it reaches (i ≥ j when causal);
each block is recomputed from the row's saved FINAL (out, lse); dk/dv/dq accumulate in fp32 in fresh
buffers (never in-place into saved tensors). A gradient leaves through the inverse all-to-all as soon
as it is final (dk_j and dv_j in one all-to-all): 5u all-to-alls per causal layer and step, Ulysses'
bytes.

Kernels (``BlockPlan.units``): with a fused kernel (``fused.py``: the CPU flash op, CUDA flash /
memory-efficient / flash-attn, whichever passed its probe) a block that only the causal diagonal
masks, or nothing, is ONE kernel call (no tiling: the fused kernel never builds the score matrix);
a block that packed documents or a sliding window cut is tiled by ``block_size`` and each tile runs
the fused kernel with an additive mask (when the op takes one exactly), tiles the mask empties are
skipped. The math blocks of ``kernels.py`` (the reference) serve soft-capping, ``backend="math"``,
ops that failed their probe, and masked tiles where no fused op takes a mask.

Overlap (``overlap=True``): the all-to-alls are started in the background (``comm.*_async``): the next
segment's q, k, v travel while the current one computes, and each output (in backward each dk/dv/dq)
while the next computes; in backward the next dout segment travels during the current block.

Attention sinks fold into each q segment's final ``(out, lse)`` after the online softmax
(``merge_sinks``); the saved lse is the sink-aware total, so the recomputed probabilities, delta and
dq/dk/dv are exact with no other change, and the sinks' own gradient is ``sink_grad`` per segment.
Soft-capping lives in the blocks (``block_forward`` / ``block_backward``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from lightning_longctx.attention import fused
from lightning_longctx.attention.common import (
    MaskSpec,
    check_qkv,
    check_sinks,
    check_softcap,
    compute_dtype,
    default_scale,
    documents_of,
    local_heads,
    spread_kv_heads,
)
from lightning_longctx.attention.fused import FusedKernel, additive_mask, common_dtype, fused_kernel
from lightning_longctx.attention.kernels import (
    block_backward,
    block_forward,
    merge_blocks,
    merge_sinks,
    resolve_backend,
    sink_grad,
)
from lightning_longctx.attention.offload import ChunkStore
from lightning_longctx.parallel.comm import (
    Group,
    PendingAllToAll,
    SequenceParallelFunction,
    group_rank_size,
    head_to_seq_async,
    head_to_seq_packed_async,
    seq_to_head_async,
    seq_to_head_packed_async,
)
from lightning_longctx.parallel.sharding import gather_sequence

#: Backends FPDT accepts: its blocks need the log-sum-exp and a backward given the row's final
#: (out, lse). "auto": a fused kernel where one passed its probe (``fused.py``), else math; "fused":
#: the fused kernel or an error; "math": the math building blocks of ``kernels.py`` (the reference).
FPDT_BACKENDS = ("auto", "fused", "math")


class UnitKind(enum.Enum):
    """How one kernel call of a block runs."""

    FULL = "full"  # the fused kernel, nothing masked
    CAUSAL = "causal"  # the fused kernel with the square causal mask of a diagonal block
    BIAS = "bias"  # the fused kernel with an additive mask (documents, the window, an off-square cut)
    MATH = "math"  # the math block of kernels.py (soft-capping, math plans, no fused mask op)


@dataclass(frozen=True)
class Unit:
    """One kernel call of block (i, j): q rows ``qs`` and kv rows ``ks`` (slices into the segments),
    its :class:`UnitKind`, and the block's ``mask`` with global offsets."""

    qs: slice
    ks: slice
    kind: UnitKind
    mask: MaskSpec


@dataclass(frozen=True)
class BlockPlan:
    """Which (q segment i, kv segment j) blocks carry any allowed pair, and their masks.

    ``docs`` ``(b, N)`` are document ids of the whole sequence in global order (packed sequences) or
    ``None``. Blocks that the causal mask, the sliding window or the documents mask entirely are
    skipped; the plan is the same on every rank (it depends only on gathered data).
    """

    num_segments: int
    seg_len: int
    block_size: int
    causal: bool
    sliding_window: int | None
    docs: torch.Tensor | None
    live: tuple[tuple[bool, ...], ...]
    kernel: FusedKernel | None = None  # fused kernel of unmasked blocks; None: math everywhere
    bias_kernel: FusedKernel | None = None  # fused kernel of masked tiles; None: math tiles
    docs_cpu: torch.Tensor | None = None  # docs on the host: tiles are classified without syncs

    @classmethod
    def build(
        cls,
        num_segments: int,
        seg_len: int,
        *,
        block_size: int,
        causal: bool,
        sliding_window: int | None,
        docs: torch.Tensor | None,
        kernel: FusedKernel | None = None,
        bias_kernel: FusedKernel | None = None,
    ) -> BlockPlan:
        u, S = num_segments, seg_len
        idx = torch.arange(u)
        live = torch.ones(u, u, dtype=torch.bool) if not causal else idx[None, :] <= idx[:, None]  # [i, j]
        if sliding_window is not None:  # keys of block j all older than the window of block i's first query
            live &= (idx[None, :] * S + S - 1) > (idx[:, None] * S - sliding_window)
        docs_cpu = None
        if docs is not None:  # doc ids never decrease along the sequence: compare segment ranges
            docs_cpu = docs.cpu() if kernel is not None else None  # fused plans classify tiles on the host
            src = docs if docs_cpu is None else docs_cpu
            first, last = src[:, ::S].cpu(), src[:, S - 1 :: S].cpu()  # (b, u), one device sync
            disjoint = (last[:, None, :] < first[:, :, None]) | (first[:, None, :] > last[:, :, None])
            live &= ~disjoint.all(0)
        rows = tuple(tuple(row) for row in live.tolist())
        return cls(
            u, S, min(block_size, S), causal, sliding_window, docs, rows, kernel, bias_kernel, docs_cpu
        )

    def cols(self, i: int) -> list[int]:
        """kv segments that q segment i attends to (always includes i)."""
        return [j for j in range(self.num_segments) if self.live[i][j]]

    def rows(self, j: int) -> list[int]:
        """q segments that attend to kv segment j (always includes j)."""
        return [i for i in range(self.num_segments) if self.live[i][j]]

    def tiles(self, i: int, j: int) -> list[tuple[slice, slice, MaskSpec]]:
        """``(q tile, kv tile, mask)`` compute tiles of block (i, j), slices into the segments.

        Tiles of ``block_size`` tokens bound the ``(b, h_r, block, block)`` score block of the math
        kernel; tiles that the causal mask or the window empty entirely are left out. Every q tile keeps
        at least its diagonal tile in block (i, i).
        """
        S, T = self.seg_len, self.block_size
        out = []
        for a in range(0, S, T):
            q0, q1 = i * S + a, i * S + min(a + T, S)  # global [q0, q1)
            for b in range(0, S, T):
                k0, k1 = j * S + b, j * S + min(b + T, S)
                if self.causal and k0 >= q1:
                    continue
                if self.sliding_window is not None and k1 - 1 <= q0 - self.sliding_window:
                    continue
                docs = self.docs
                mask = MaskSpec(
                    causal=self.causal,
                    sliding_window=self.sliding_window,
                    q_start=q0,
                    k_start=k0,
                    q_doc=None if docs is None else docs[:, q0:q1],
                    k_doc=None if docs is None else docs[:, k0:k1],
                )
                out.append((slice(a, a + q1 - q0), slice(b, b + k1 - k0), mask))
        return out

    def _cut(self, q0: int, q1: int, k0: int, k1: int) -> UnitKind | None:
        """How the mask cuts global rows ``[q0, q1)`` x keys ``[k0, k1)``: None (nothing allowed), FULL,
        CAUSAL (the square causal diagonal) or BIAS (documents, the window, or an off-square cut)."""
        cut = False
        if self.docs_cpu is not None:
            d = self.docs_cpu
            fq, lq, fk, lk = d[:, q0], d[:, q1 - 1], d[:, k0], d[:, k1 - 1]
            if bool(((lk < fq) | (fk > lq)).all()):
                return None
            cut = not bool(((fq == lq) & (fk == lk) & (fq == fk)).all())
        if self.sliding_window is not None and q1 - 1 - k0 >= self.sliding_window:
            cut = True
        if cut:
            return UnitKind.BIAS
        if not (self.causal and k1 - 1 > q0):
            return UnitKind.FULL
        return UnitKind.CAUSAL if (q0, q1) == (k0, k1) else UnitKind.BIAS

    def units(self, i: int, j: int) -> list[Unit]:
        """The kernel calls of block (i, j), the same in forward and backward.

        Math plans: the math tiles of :meth:`tiles`. Fused plans: one call for a block the mask leaves
        whole or cuts only on the causal diagonal; otherwise its tiles, each fused with an additive
        mask (or math when no fused op takes one), tiles the documents empty left out."""
        if self.kernel is None:
            return [Unit(qs, ks, UnitKind.MATH, mask) for qs, ks, mask in self.tiles(i, j)]
        S = self.seg_len
        kind = self._cut(i * S, (i + 1) * S, j * S, (j + 1) * S)
        if kind in (UnitKind.FULL, UnitKind.CAUSAL):
            mask = MaskSpec(
                causal=self.causal, sliding_window=self.sliding_window, q_start=i * S, k_start=j * S
            )
            return [Unit(slice(0, S), slice(0, S), kind, mask)]
        out = []
        for qs, ks, mask in self.tiles(i, j):
            q0, k0 = i * S + qs.start, j * S + ks.start
            kind = self._cut(q0, i * S + qs.stop, k0, j * S + ks.stop)
            if kind is None:
                continue
            if kind is UnitKind.BIAS and self.bias_kernel is None:
                kind = UnitKind.MATH
            out.append(Unit(qs, ks, kind, mask))
        return out

    def kernel_names(self) -> set[str]:
        """Which kernels the plan's blocks run ("math", a fused kernel's name): tests and benchmarks."""
        names = set()
        for i in range(self.num_segments):
            for j in self.cols(i):
                for unit in self.units(i, j):
                    kern = self.kernel_of(unit)
                    names.add("math" if kern is None else kern.name)
        return names

    def kernel_of(self, unit: Unit) -> FusedKernel | None:
        """The fused kernel a unit runs on (``None``: the math block)."""
        return {UnitKind.MATH: None, UnitKind.BIAS: self.bias_kernel}.get(unit.kind, self.kernel)


@dataclass(frozen=True)
class _FPDTCall:
    """The settings of one ``fpdt_attention`` call, fixed before the autograd Function runs."""

    group: Group
    chunk_size: int
    scale: float
    plan: BlockPlan
    offload: bool
    softcap: float | None = None
    overlap: bool = True

    @property
    def ahead(self) -> int:
        """Segments an all-to-all is started before it is needed (0: just in time)."""
        return 1 if self.overlap else 0


@dataclass(frozen=True)
class _Inputs:
    """What backward needs to know of the forward's inputs (kept on the autograd context)."""

    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    heads: int
    kv_heads: int
    has_sinks: bool


def _chunk(x: torch.Tensor, i: int, c: int) -> torch.Tensor:
    """Local chunk i, ``(b, c, heads, d)``."""
    return x[:, i * c : (i + 1) * c]


def _to_heads(x: torch.Tensor, call: _FPDTCall) -> PendingAllToAll:
    """(b, c, h, d) local chunk -> (b, P*c, h_r, d) global segment, my heads; ``.wait()`` for it."""
    return seq_to_head_async(x, call.group)


def _to_heads_packed(*xs: torch.Tensor, call: _FPDTCall) -> PendingAllToAll:
    """:func:`_to_heads` of several chunks (q, k, v of one segment) in ONE all-to-all; ``.wait()`` -> list."""
    return seq_to_head_packed_async(*xs, group=call.group)


def _to_seq(x: torch.Tensor, num_heads: int, call: _FPDTCall) -> PendingAllToAll:
    """(b, P*c, h_r, d) -> (b, c, num_heads, d); inverse of :func:`_to_heads`."""
    return head_to_seq_async(x, num_heads, call.group)


class _ForwardExchange:
    """The forward's seq->head all-to-alls, in the order the segments need them, each started
    ``call.ahead`` segments early. Causal: segment i needs kv segments j <= i, so q, k, v of a segment
    travel in ONE packed all-to-all; otherwise every kv segment first (k and v together), then each q.
    (A packed receive is copied out per tensor: q_i does not keep k_i and v_i alive once offloaded.)"""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _FPDTCall) -> None:
        self.q, self.k, self.v, self.call = q, k, v, call
        self.num_segments = call.plan.num_segments
        c = call.chunk_size
        self._kv = (
            []
            if call.plan.causal
            else [
                _to_heads_packed(_chunk(k, j, c), _chunk(v, j, c), call=call)
                for j in range(self.num_segments)
            ]
        )
        self._pending: dict[int, PendingAllToAll] = {}
        self._launched = 0
        self._launch_upto(1 + call.ahead)

    def _launch_upto(self, n: int) -> None:
        c, call = self.call.chunk_size, self.call
        for i in range(self._launched, min(n, self.num_segments)):
            if call.plan.causal:
                parts = (_chunk(self.q, i, c), _chunk(self.k, i, c), _chunk(self.v, i, c))
                self._pending[i] = _to_heads_packed(*parts, call=call)
            else:
                self._pending[i] = _to_heads(_chunk(self.q, i, c), call)
        self._launched = max(self._launched, min(n, self.num_segments))

    def all_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Non-causal: every kv segment ``(k_j, v_j)``, each ``(b, S, h_kv_r, d)``."""
        return [tuple(p.wait()) for p in self._kv]  # type: ignore[misc]

    def segment(self, i: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``q_i`` ``(b, S, h_r, d)`` and, causal, ``(k_i, v_i)``; the next segment then starts to travel."""
        self._launch_upto(i + 1)
        got = self._pending.pop(i).wait()
        self._launch_upto(i + 1 + self.call.ahead)  # the next segment travels while this one computes
        if self.call.plan.causal:
            q_i, k_i, v_i = got
            return q_i, (k_i, v_i)
        return got, None


class _DoutExchange:
    """The backward's dout segments (the backward of head_to_seq), each started ``call.ahead`` segments
    before its first use (ascending i), and the per-row ``delta = rowsum(dout * out)``; dropped once
    the segment's dq is final."""

    def __init__(self, grad: torch.Tensor, call: _FPDTCall, compute: torch.dtype) -> None:
        self.grad, self.call, self.compute = grad, call, compute
        self._pending: dict[int, PendingAllToAll] = {}
        self._douts: dict[int, torch.Tensor] = {}
        self._deltas: dict[int, torch.Tensor] = {}

    def dout(self, i: int) -> torch.Tensor:
        """``(b, S, h_r, d)``: segment i of the output gradient, my heads."""
        c, u = self.call.chunk_size, self.call.plan.num_segments
        for n in range(i, min(u, i + 1 + self.call.ahead)):
            if n not in self._pending and n not in self._douts:
                self._pending[n] = _to_heads(_chunk(self.grad, n, c), self.call)
        if i not in self._douts:
            self._douts[i] = self._pending.pop(i).wait()
        return self._douts[i]

    def delta(self, i: int, out_i: torch.Tensor) -> torch.Tensor:
        """``(b, h_r, S)`` rowsum(dout * out) for the math blocks and the sinks (the fused ops take out)."""
        if i not in self._deltas:
            ct = self.compute
            self._deltas[i] = (self.dout(i).to(ct) * out_i.to(ct)).sum(-1).transpose(1, 2).contiguous()
        return self._deltas[i]

    def drop(self, i: int) -> None:
        self._douts.pop(i, None)
        self._deltas.pop(i, None)


def unit_forward(
    unit: Unit,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    plan: BlockPlan,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, |qs|, h, d) fp32/fp64, lse (b, h, |qs|)) of one unit, on its rows: q ``(b, |qs|, h, d)``, k/v
    ``(b, |ks|, h_kv, d)``. FPDT's blocks and the ring's steps (``ring.py``) both run here."""
    if unit.kind is UnitKind.MATH:
        return block_forward(q, k, v, scale=scale, mask=unit.mask, softcap=softcap)
    kern, bias = _fused_args(unit, q, k, plan)
    return fused.block_forward(kern, q, k, v, scale=scale, causal=unit.kind is UnitKind.CAUSAL, bias=bias)


def unit_backward(
    unit: Unit,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor | None,
    *,
    plan: BlockPlan,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (b, |qs|, h, d), dk, dv (b, |ks|, h_kv, d)) of one unit, on its rows, recomputed from the rows'
    FINAL ``out`` ``(b, |qs|, h, d)`` and ``lse`` ``(b, h, |qs|)`` (every kv block, sinks included);
    ``delta = rowsum(dout * out)`` ``(b, h, |qs|)`` is read by math units only (``None`` for fused ones)."""
    if unit.kind is UnitKind.MATH:
        assert delta is not None
        return block_backward(dout, q, k, v, lse, delta, scale=scale, mask=unit.mask, softcap=softcap)
    kern, bias = _fused_args(unit, q, k, plan)
    return fused.block_backward(
        kern, dout, q, k, v, out, lse, scale=scale, causal=unit.kind is UnitKind.CAUSAL, bias=bias
    )


def _fused_args(
    unit: Unit, q: torch.Tensor, k: torch.Tensor, plan: BlockPlan
) -> tuple[Any, torch.Tensor | None]:
    """The fused kernel of a unit and its additive mask (BIAS units only)."""
    kern = plan.kernel_of(unit)
    if unit.kind is not UnitKind.BIAS:
        return kern, None
    return kern, additive_mask(unit.mask, q.shape[1], k.shape[1], common_dtype(q, k), q.device)


def check_block_backend(backend: str, softcap: float | None, caller: str) -> None:
    """Refuse a backend the blocks cannot use (they need the log-sum-exp and a backward given the merged row),
    and ``"fused"`` with soft-capping; ``caller`` names the function in the errors."""
    if backend not in FPDT_BACKENDS:
        resolve_backend(backend)  # unknown or unavailable names get the kernels' own error
        raise ValueError(
            f"{caller} computes its blocks with kernels that return the log-sum-exp and have a backward given "
            f"the merged row (fused.py, or the math blocks); backend {backend!r} is not used there. Pass "
            "backend='auto' or 'math' (or 'fused'), or use ulysses_attention for that kernel"
        )
    if backend == "fused" and softcap is not None:
        raise ValueError(
            "backend='fused': no fused block kernel applies logit soft-capping; use backend='auto' (math blocks)"
        )


def block_kernels(
    backend: str, q: torch.Tensor, k: torch.Tensor, *, softcap: float | None, masked: bool, caller: str
) -> tuple[FusedKernel | None, FusedKernel | None]:
    """``(kernel of unmasked blocks, kernel of masked tiles)`` for ``backend`` (``None``: the math blocks);
    ``masked``: documents or a window cut some blocks. FPDT and the ring choose alike."""
    check_block_backend(backend, softcap, caller)
    if backend == "math" or softcap is not None:
        return None, None
    kernel = fused_kernel(q.device, common_dtype(q, k))
    if kernel is None and backend == "fused":
        raise RuntimeError(
            f"backend='fused': no fused attention kernel passed its probe on {q.device} {common_dtype(q, k)} "
            "(see the warnings, attention/fused.py); use backend='auto' to fall back to the math blocks"
        )
    bias_kernel = (
        fused_kernel(q.device, common_dtype(q, k), bias=True) if kernel is not None and masked else None
    )
    return kernel, bias_kernel


class _SegmentAcc:
    """The running fp32 ``(out (b, S, h_r, d), lse (b, h_r, S))`` of one q segment's online softmax.

    A unit over the whole segment merges whole tensors (new ones, no in-place writes); a tile merges
    into its rows of buffers allocated here (fresh and never saved, so the row writes touch nothing
    else). Rows no unit reached stay ``out = 0``, ``lse = -inf``."""

    def __init__(self, seg_len: int) -> None:
        self.seg_len = seg_len
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.owned = False  # out/lse are buffers of this object (row writes allowed)

    def add(self, qs: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        if qs.start == 0 and qs.stop == self.seg_len:
            if self.out is None or self.lse is None:
                self.out, self.lse = out, lse
            else:
                self.out, self.lse = merge_blocks(self.out, self.lse, out, lse)
            self.owned = False
            return
        if not self.owned:
            b, _, h, d = out.shape
            buf_out = out.new_zeros((b, self.seg_len, h, d))
            buf_lse = lse.new_full((b, h, self.seg_len), float("-inf"))
            if self.out is not None and self.lse is not None:
                buf_out.copy_(self.out)
                buf_lse.copy_(self.lse)
            self.out, self.lse, self.owned = buf_out, buf_lse, True
        assert self.out is not None and self.lse is not None
        new_out, new_lse = merge_blocks(self.out[:, qs], self.lse[:, :, qs], out, lse)
        self.out[:, qs] = new_out
        self.lse[:, :, qs] = new_lse


def _accumulate(acc: torch.Tensor | None, rows: slice, full: int, x: torch.Tensor) -> torch.Tensor:
    """``acc[:, rows] += x`` into a fresh fp32 buffer (allocated on first use, zeros elsewhere); a first
    ``x`` over all ``full`` rows becomes the buffer itself (it is a fresh kernel output)."""
    if acc is None:
        if rows.start == 0 and rows.stop == full:
            return x if x.is_contiguous() else x.contiguous()
        acc = x.new_zeros((x.shape[0], full, *x.shape[2:]))
    acc[:, rows] += x
    return acc


class _FPDTAttention(SequenceParallelFunction):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        call: _FPDTCall,
    ) -> torch.Tensor:
        """``sinks``: ``(h_r,)`` the sinks of this rank's heads, or ``None``."""
        plan = call.plan
        u, S = plan.num_segments, plan.seg_len
        sink = None if sinks is None else sinks.detach().to(compute_dtype(q.dtype))  # (h_r,)
        store = ChunkStore(offload=call.offload, device=q.device)
        exchange = _ForwardExchange(q, k, v, call)
        for j, (k_j, v_j) in enumerate(exchange.all_kv()):  # non-causal: every kv segment first
            store.put(("k", j), k_j)  # (b, S, h_kv_r, d)
            store.put(("v", j), v_j)
        kv_stream = store.pipeline([(("k", j), ("v", j)) for i in range(u) for j in plan.cols(i)])
        outs: list[torch.Tensor] = []
        pend_out: PendingAllToAll | None = None
        for i in range(u):
            q_i, kv_i = exchange.segment(i)  # (b, S, h_r, d): segment i, my heads
            if kv_i is not None:  # causal: k_i, v_i came with q_i
                store.put(("k", i), kv_i[0])
                store.put(("v", i), kv_i[1])
            store.put(("q", i), q_i)
            acc = _SegmentAcc(S)
            for j in plan.cols(i):
                k_j, v_j = next(kv_stream)
                for unit in plan.units(i, j):
                    qs, ks = unit.qs, unit.ks
                    blk = unit_forward(
                        unit,
                        q_i[:, qs],
                        k_j[:, ks],
                        v_j[:, ks],
                        plan=plan,
                        scale=call.scale,
                        softcap=call.softcap,
                    )
                    acc.add(qs, *blk)  # fp32 online softmax
                del k_j, v_j  # drop before the next fetch: double buffer
            out_i, lse_i = acc.out, acc.lse
            assert out_i is not None and lse_i is not None  # the diagonal block is always live
            if sink is not None:  # one more softmax column per row, after all keys: lse_i becomes the total
                out_i, lse_i = merge_sinks(out_i, lse_i, sink)
            out_i = out_i.to(q.dtype)
            store.put(("out", i), out_i)
            store.put(("lse", i), lse_i)  # (b, h_r, S) fp32
            if pend_out is not None:
                outs.append(pend_out.wait())
            pend_out = _to_seq(out_i, q.shape[2], call)  # back to local chunk i (b, c, h, d), in flight
            if not call.overlap:
                outs.append(pend_out.wait())
                pend_out = None
            del q_i, kv_i, acc, out_i, lse_i
        if pend_out is not None:
            outs.append(pend_out.wait())
        tail = [] if sinks is None else [sinks]  # saved as an input: in-place edits before backward raise
        # Saved tensors, host buffers too: under activation checkpointing the checkpoint drops them after this
        # forward and the layer's recompute rebuilds them (one layer's chunks on the host, not every layer's).
        ctx.keys, tensors = store.saved()
        ctx.save_for_backward(*tensors, *tail)
        ctx.call = call
        ctx.inputs = _Inputs(q.dtype, k.dtype, q.shape[2], k.shape[2], sinks is not None)
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        call: _FPDTCall = ctx.call
        inputs: _Inputs = ctx.inputs
        plan = call.plan
        u, S = plan.num_segments, plan.seg_len
        saved = list(ctx.saved_tensors)
        sinks = saved.pop() if inputs.has_sinks else None
        store = ChunkStore.restore(ctx.keys, saved, offload=call.offload, device=grad.device)
        del saved
        ct = compute_dtype(inputs.q_dtype)
        sink = None if sinks is None else sinks.to(ct)
        dsink = None if sink is None else torch.zeros_like(sink)

        # The access order of the whole backward (kv outer, the q segments it reaches inner), so each fetch
        # is prefetched one step ahead.
        steps: list[tuple[tuple[str, int], ...]] = []
        for j in range(u):
            steps.append((("k", j), ("v", j)))
            steps.extend((("q", i), ("out", i), ("lse", i)) for i in plan.rows(j))
        stream = store.pipeline(steps)
        douts = _DoutExchange(grad, call, ct)

        last_col = [max(plan.cols(i)) for i in range(u)]  # dq_i is final after this kv segment
        dq_acc: list[torch.Tensor | None] = [None] * u
        dq_parts: list[Any] = [None] * u
        dkv_parts: list[PendingAllToAll] = []  # .wait() -> [dk_j, dv_j]: one all-to-all per kv segment
        in_flight: list[PendingAllToAll] = []
        for j in range(u):
            k_j, v_j = next(stream)
            # Fresh fp32 accumulators owned here: the in-place adds never touch a saved tensor.
            dk_acc: torch.Tensor | None = None
            dv_acc: torch.Tensor | None = None
            for i in plan.rows(j):
                q_i, out_i, lse_i = next(stream)
                douts.dout(i)  # this row's dout (and the next one's all-to-all) before it computes
                if dsink is not None and sink is not None and i == j:  # once per q segment (diagonal)
                    dsink += sink_grad(lse_i.to(ct), douts.delta(i, out_i), sink)
                for unit in plan.units(i, j):
                    qs, ks = unit.qs, unit.ks
                    delta = douts.delta(i, out_i)[:, :, qs] if unit.kind is UnitKind.MATH else None
                    dq, dk, dv = unit_backward(
                        unit, douts.dout(i)[:, qs], q_i[:, qs], k_j[:, ks], v_j[:, ks], out_i[:, qs],
                        lse_i[:, :, qs], delta, plan=plan, scale=call.scale, softcap=call.softcap,
                    )  # fmt: skip
                    dq_acc[i] = _accumulate(dq_acc[i], unit.qs, S, dq)
                    dk_acc = _accumulate(dk_acc, unit.ks, S, dk)
                    dv_acc = _accumulate(dv_acc, unit.ks, S, dv)
                del q_i, out_i, lse_i
            del k_j, v_j
            assert dk_acc is not None and dv_acc is not None  # the diagonal block is always live
            for pending in in_flight:  # the previous segment's gradients travelled during this one
                pending.wait()
            kv_dtype, h_kv = inputs.kv_dtype, inputs.kv_heads
            dkv = head_to_seq_packed_async(
                [dk_acc.to(kv_dtype), dv_acc.to(kv_dtype)], [h_kv, h_kv], call.group
            )
            dkv_parts.append(dkv)  # backward of the packed seq_to_head
            in_flight = [dkv]
            for i in range(u):
                if last_col[i] == j:  # dq_i is final: it leaves now
                    acc_i = dq_acc[i]
                    assert acc_i is not None
                    dq_parts[i] = _to_seq(acc_i.to(inputs.q_dtype), inputs.heads, call)
                    in_flight.append(dq_parts[i])
                    dq_acc[i] = None
                    douts.drop(i)
            if not call.overlap:
                for pending in in_flight:
                    pending.wait()
        store.release()  # this call's references go now (autograd frees the saved ones after backward)
        dsinks = None if dsink is None or sinks is None else dsink.to(sinks.dtype)
        return (
            torch.cat([p.wait() for p in dq_parts], dim=1),
            torch.cat([p.wait()[0] for p in dkv_parts], dim=1),
            torch.cat([p.wait()[1] for p in dkv_parts], dim=1),
            dsinks,
            None,
        )


def _global_docs(
    position_ids: torch.Tensor | None,
    documents: torch.Tensor | None,
    shape: tuple[int, int],
    chunk_size: int,
    group: Group,
) -> torch.Tensor | None:
    """Document ids ``(b, N)`` in global order: ``documents`` as given, or from FPDT-layout GLOBAL position
    ids (one all-gather), or None (one document). ``shape`` is the local ``(batch, seq)``."""
    if position_ids is not None and tuple(position_ids.shape) != shape:
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} must be (batch, local seq) = {shape}, in the FPDT "
            "layout of shard_batch(..., chunk_size=chunk_size)"
        )
    _, world = group_rank_size(group)
    return documents_of(
        position_ids,
        documents,
        shape=(shape[0], shape[1] * world),
        gather=lambda p: gather_sequence(p, group=group, chunk_size=chunk_size),  # (b, N), global order
    )


def fpdt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group = None,
    chunk_size: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    position_ids: torch.Tensor | None = None,
    offload: bool = False,
    backend: str = "auto",
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_size: int = 1024,
    overlap: bool = True,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence in FPDT's strided layout, computed one chunk pair at a time.

    Args:
        q: ``(b, u*c, h, d)`` local queries in the FPDT layout: rank r holds global chunks
            ``r, r+P, ...`` of ``chunk_size`` = c tokens each (``shard_batch(..., chunk_size=c)``).
        k, v: ``(b, u*c, h_kv, d)``; ``h % h_kv == 0``. Any ``h`` works with any P (uneven split);
            ``h_kv < P`` replicates kv heads.
        chunk_size: tokens per chunk per rank; must divide the local length.
        position_ids: ``(b, u*c)`` GLOBAL positions in the same layout; a reset to 0 starts a new packed
            document and attention never crosses documents. ``None``: one document. Costs one all-gather
            per call; ``documents`` costs none.
        documents: ``(b, N)`` document ids of the WHOLE sequence in global order (not the FPDT layout),
            computed once per batch where it is sharded: ``document_ids(global_positions(batch, ...))``
            (``sharding.py``). Given, ``position_ids`` are not read.
        offload: keep per-chunk q/k/v/out/lse in (pinned) host memory and prefetch them back on a side
            stream; results are bit-identical to ``offload=False``.
        backend: ``"auto"``: a fused block kernel that returns the log-sum-exp where one passed its
            capability probe on this device and dtype (``attention/fused.py``), the math blocks where
            none did or for soft-capping; ``"fused"``: the same, but an error where no fused kernel is
            available (or with ``softcap``); ``"math"``: the math blocks (the reference) everywhere.
        sliding_window: attend only to the last ``sliding_window`` tokens (incl. itself), as HF.
        softcap: ``c > 0``: scores become ``c * tanh(scores / c)`` before the mask (Gemma-2,
            VaultGemma), in the forward and backward of every block.
        sinks: ``(h,)`` attention sinks (gpt-oss ``s_aux``), one learned logit per GLOBAL query head in
            the softmax denominator with no value attached; any float dtype, on q's device, the same
            tensor on every rank. Each rank uses (and gives a gradient to) the heads it owns after the
            all-to-all, so ``sinks.grad`` is ``(h,)`` with zeros outside them; summed over the group
            (as the strategy does for parameters) it is the exact gradient.
        block_size: tokens per compute tile inside a segment of ``P*chunk_size`` tokens; bounds the
            ``(b, h/P, block_size, block_size)`` fp32 score block of the math kernel and the
            ``(b, 1, block_size, block_size)`` mask of a fused tile that documents or the window cut.
            Blocks a fused kernel runs whole are not tiled.
        overlap: start each all-to-all in the background (forward: the next segment's q, k, v and the
            last output; backward: the next dout and the last dq/dk/dv) so it travels while a block
            computes. ``False``: every all-to-all completes before the next block (same results).

    Returns:
        ``(b, u*c, h, d)`` in the same layout, equal to full attention over the gathered sequence.
    """
    check_qkv(q, k, v)
    check_softcap(softcap)
    check_sinks(sinks, q)
    check_block_backend(backend, softcap, "fpdt_attention")  # before any collective
    b, local, h, d = q.shape
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens per rank, got {chunk_size!r}")
    if local % chunk_size:
        raise ValueError(
            f"chunk_size {chunk_size} does not divide the local sequence length {local}; shard the batch with "
            f"shard_batch(..., chunk_size={chunk_size}) (it pads to a multiple of P*chunk_size) or pick a "
            f"chunk_size that divides {local}"
        )
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size!r}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
    _, world = group_rank_size(group)
    k, v = spread_kv_heads(k, v, h, world)  # outside the Function: autograd sums the replicas' grads
    docs = _global_docs(position_ids, documents, (b, local), chunk_size, group)
    masked = docs is not None or sliding_window is not None
    kernel, bias_kernel = block_kernels(
        backend, q, k, softcap=softcap, masked=masked, caller="fpdt_attention"
    )
    plan = BlockPlan.build(
        local // chunk_size,
        world * chunk_size,
        block_size=block_size,
        causal=causal,
        sliding_window=sliding_window,
        docs=docs,
        kernel=kernel,
        bias_kernel=bias_kernel,
    )
    call = _FPDTCall(group, chunk_size, default_scale(d, softmax_scale), plan, offload, softcap, overlap)
    my_sinks = None if sinks is None else sinks[local_heads(h, group)]  # (h_r,); autograd scatters its grad
    return _FPDTAttention.apply(q, k, v, my_sinks, call)
