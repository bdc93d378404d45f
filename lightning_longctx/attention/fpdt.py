"""FPDT attention: Fully Pipelined Distributed Transformer (arXiv 2408.16978), exact, on any backend.

Layout (``shard_batch(..., chunk_size=c)``): the global sequence of N tokens is cut into chunks of c
tokens and rank r of the P ranks holds chunks ``r, r+P, r+2P, ...``, i.e. ``u = N / (P*c)`` local
chunks. The all-to-all of local chunk i gives every rank the contiguous GLOBAL segment i
(``S = P*c`` tokens starting at ``i*S``) with its block of heads.

Forward, per segment i: all-to-all q_i; attend to the kv segments j ≤ i (all j when not causal) one
block at a time with ``block_forward``, merging block results with an fp32 online softmax on the
log-sum-exp; all-to-all the output back to local chunk i. Only q, k, v, out (head layout) and lse are
kept per segment — no scores, no probabilities — on the device or, with ``offload=True``, in host
memory with the next kv chunk prefetched on a side stream while the current block computes.

Backward: outer loop over kv segments j, inner over q segments i it reaches (i ≥ j when causal);
``block_backward`` recomputes the block's probabilities from the saved lse; dk/dv/dq accumulate in
fp32 in fresh buffers (never in-place into saved tensors). A gradient leaves through the inverse
all-to-all as soon as it is final.

Attention sinks fold into each q segment's final ``(out, lse)`` after the online softmax
(``merge_sinks``); the saved lse is the sink-aware total, so the recomputed probabilities, delta and
dq/dk/dv are exact with no other change, and the sinks' own gradient is ``sink_grad`` per segment.
Soft-capping lives in the blocks (``block_forward`` / ``block_backward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_longctx.attention.common import (
    MaskSpec,
    check_qkv,
    check_sinks,
    check_softcap,
    compute_dtype,
    default_scale,
    doc_ids,
    has_resets,
    local_heads,
    spread_kv_heads,
)
from lightning_longctx.attention.kernels import (
    block_backward,
    block_forward,
    merge_blocks,
    merge_sinks,
    resolve_backend,
    sink_grad,
)
from lightning_longctx.attention.offload import ChunkStore
from lightning_longctx.comm import Group, group_rank_size, head_to_seq_no_grad, seq_to_head_no_grad
from lightning_longctx.sharding import gather_sequence

#: Backends FPDT accepts: its blocks need the log-sum-exp and a matching block backward, which the
#: math building blocks of ``kernels.py`` provide on every device.
FPDT_BACKENDS = ("auto", "math")


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
    ) -> BlockPlan:
        u, S = num_segments, seg_len
        idx = torch.arange(u)
        live = torch.ones(u, u, dtype=torch.bool) if not causal else idx[None, :] <= idx[:, None]  # [i, j]
        if sliding_window is not None:  # keys of block j all older than the window of block i's first query
            live &= (idx[None, :] * S + S - 1) > (idx[:, None] * S - sliding_window)
        if docs is not None:  # doc ids never decrease along the sequence: compare segment ranges
            first, last = docs[:, ::S].cpu(), docs[:, S - 1 :: S].cpu()  # (b, u), one device sync
            disjoint = (last[:, None, :] < first[:, :, None]) | (first[:, None, :] > last[:, :, None])
            live &= ~disjoint.all(0)
        return cls(
            u, S, min(block_size, S), causal, sliding_window, docs, tuple(tuple(row) for row in live.tolist())
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


@dataclass(frozen=True)
class _Config:
    group: Group
    chunk_size: int
    scale: float
    plan: BlockPlan
    offload: bool
    softcap: float | None = None


def _to_heads(x: torch.Tensor, cfg: _Config) -> torch.Tensor:
    """(b, c, h, d) local chunk -> (b, P*c, h_r, d) global segment, my heads."""
    return seq_to_head_no_grad(x, cfg.group)


def _to_seq(x: torch.Tensor, num_heads: int, cfg: _Config) -> torch.Tensor:
    """(b, P*c, h_r, d) -> (b, c, num_heads, d); inverse of :func:`_to_heads`."""
    return head_to_seq_no_grad(x, num_heads, cfg.group)


class _FPDTAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        cfg: _Config,
    ) -> torch.Tensor:
        """``sinks``: ``(h_r,)`` the sinks of this rank's heads, or ``None``."""
        c, plan = cfg.chunk_size, cfg.plan
        u = plan.num_segments
        sink = None if sinks is None else sinks.detach().to(compute_dtype(q.dtype))  # (h_r,)
        store = ChunkStore(offload=cfg.offload, device=q.device)
        # kv of every segment first: non-causal segments also read later ones.
        for j in range(u):
            store.put(("k", j), _to_heads(k[:, j * c : (j + 1) * c], cfg))  # (b, S, h_kv_r, d)
            store.put(("v", j), _to_heads(v[:, j * c : (j + 1) * c], cfg))
        kv_stream = store.pipeline([(("k", j), ("v", j)) for i in range(u) for j in plan.cols(i)])
        outs = []
        for i in range(u):
            q_i = _to_heads(q[:, i * c : (i + 1) * c], cfg)  # (b, S, h_r, d): segment i, my heads
            store.put(("q", i), q_i)
            n_tiles = -(-plan.seg_len // plan.block_size)
            acc: list[Any] = [None] * n_tiles  # per q tile: running fp32 (out, lse)
            for j in plan.cols(i):
                k_j, v_j = next(kv_stream)
                for qs, ks, mask in plan.tiles(i, j):
                    blk = block_forward(
                        q_i[:, qs], k_j[:, ks], v_j[:, ks], scale=cfg.scale, mask=mask, softcap=cfg.softcap
                    )
                    t = qs.start // plan.block_size
                    acc[t] = blk if acc[t] is None else merge_blocks(*acc[t], *blk)  # fp32 online softmax
                del k_j, v_j  # drop before the next fetch: double buffer
            out_i, lse_i = torch.cat([o for o, _ in acc], dim=1), torch.cat([lse for _, lse in acc], dim=2)
            if sink is not None:  # one more softmax column per row, after all keys: lse_i becomes the total
                out_i, lse_i = merge_sinks(out_i, lse_i, sink)
            out_i = out_i.to(q.dtype)
            store.put(("out", i), out_i)
            store.put(("lse", i), lse_i)  # (b, h_r, S) fp32
            outs.append(_to_seq(out_i, q.shape[2], cfg))  # (b, c, h, d): back to local chunk i
            del q_i, acc, out_i, lse_i
        tail = [] if sinks is None else [sinks]  # saved as an input: in-place edits before backward raise
        if cfg.offload:
            ctx.store = store
            ctx.save_for_backward(*tail)
        else:
            ctx.keys, tensors = store.saved()
            ctx.save_for_backward(*tensors, *tail)
        ctx.cfg = cfg
        ctx.meta = (q.dtype, k.dtype, q.shape[2], k.shape[2], sinks is not None)
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        cfg: _Config = ctx.cfg
        plan, c = cfg.plan, cfg.chunk_size
        u = plan.num_segments
        q_dtype, kv_dtype, h, h_kv, has_sinks = ctx.meta
        saved = list(ctx.saved_tensors)
        sinks = saved.pop() if has_sinks else None
        if cfg.offload:
            store = ctx.store
        else:
            store = ChunkStore.restore(ctx.keys, saved, grad.device)
        ct = compute_dtype(q_dtype)
        sink = None if sinks is None else sinks.to(ct)
        dsink = None if sink is None else torch.zeros_like(sink)

        # The access order of the whole backward, so each fetch is prefetched one step ahead.
        steps: list[tuple[tuple[str, int], ...]] = [(("out", i),) for i in range(u)]
        for j in range(u):
            steps.append((("k", j), ("v", j)))
            steps.extend((("q", i), ("lse", i)) for i in plan.rows(j))
        stream = store.pipeline(steps)

        douts, deltas = [], []
        for i in range(u):
            dout_i = _to_heads(grad[:, i * c : (i + 1) * c], cfg)  # backward of head_to_seq
            (out_i,) = next(stream)
            deltas.append((dout_i.to(ct) * out_i.to(ct)).sum(-1).transpose(1, 2).contiguous())  # (b, h_r, S)
            douts.append(dout_i)
            del out_i

        last_col = [max(plan.cols(i)) for i in range(u)]  # dq_i is final after this kv segment
        dq_acc: list[torch.Tensor | None] = [None] * u
        dq_parts: list[torch.Tensor | None] = [None] * u
        dk_parts, dv_parts = [], []
        for j in range(u):
            k_j, v_j = next(stream)
            # Fresh fp32 accumulators owned here: the in-place adds never touch a saved tensor.
            dk_acc = torch.zeros(k_j.shape, dtype=ct, device=k_j.device)
            dv_acc = torch.zeros(v_j.shape, dtype=ct, device=v_j.device)
            for i in plan.rows(j):
                q_i, lse_i = next(stream)
                if dq_acc[i] is None:
                    dq_acc[i] = torch.zeros(q_i.shape, dtype=ct, device=q_i.device)
                if dsink is not None and i == j:  # once per q segment (the diagonal block is always live)
                    dsink += sink_grad(lse_i.to(ct), deltas[i], sink)
                for qs, ks, mask in plan.tiles(i, j):
                    dq, dk, dv = block_backward(
                        douts[i][:, qs],
                        q_i[:, qs],
                        k_j[:, ks],
                        v_j[:, ks],
                        lse_i[:, :, qs],
                        deltas[i][:, :, qs],
                        scale=cfg.scale,
                        mask=mask,
                        softcap=cfg.softcap,
                    )
                    dq_acc[i][:, qs] += dq
                    dk_acc[:, ks] += dk
                    dv_acc[:, ks] += dv
                del q_i, lse_i
            del k_j, v_j
            dk_parts.append(_to_seq(dk_acc.to(kv_dtype), h_kv, cfg))  # backward of seq_to_head
            dv_parts.append(_to_seq(dv_acc.to(kv_dtype), h_kv, cfg))
            for i in range(u):
                if last_col[i] == j:
                    dq_parts[i] = _to_seq(dq_acc[i].to(q_dtype), h, cfg)
                    dq_acc[i] = None
        if cfg.offload:
            store.release()  # host buffers go now, not when the graph is dropped
            ctx.store = None
        dsinks = None if dsink is None or sinks is None else dsink.to(sinks.dtype)
        return (
            torch.cat(dq_parts, dim=1),
            torch.cat(dk_parts, dim=1),
            torch.cat(dv_parts, dim=1),
            dsinks,
            None,
        )


def _global_docs(
    position_ids: torch.Tensor | None, shape: tuple[int, int], chunk_size: int, group: Group
) -> torch.Tensor | None:
    """Document ids ``(b, N)`` in global order from FPDT-layout GLOBAL position ids, or None (one doc)."""
    if position_ids is None:
        return None
    if tuple(position_ids.shape) != shape:
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} must be (batch, local seq) = {shape}, in the FPDT "
            "layout of shard_batch(..., chunk_size=chunk_size)"
        )
    full = gather_sequence(position_ids, group=group, chunk_size=chunk_size)  # (b, N), global order
    return doc_ids(full) if has_resets(full) else None


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
) -> torch.Tensor:
    """Exact attention over a sequence in FPDT's strided layout, computed one chunk pair at a time.

    Args:
        q: ``(b, u*c, h, d)`` local queries in the FPDT layout: rank r holds global chunks
            ``r, r+P, ...`` of ``chunk_size`` = c tokens each (``shard_batch(..., chunk_size=c)``).
        k, v: ``(b, u*c, h_kv, d)``; ``h % h_kv == 0``. Any ``h`` works with any P (uneven split);
            ``h_kv < P`` replicates kv heads.
        chunk_size: tokens per chunk per rank; must divide the local length.
        position_ids: ``(b, u*c)`` GLOBAL positions in the same layout; a reset to 0 starts a new packed
            document and attention never crosses documents. ``None``: one document.
        offload: keep per-chunk q/k/v/out/lse in (pinned) host memory and prefetch them back on a side
            stream; results are bit-identical to ``offload=False``.
        backend: ``"auto"`` or ``"math"`` — the blocks use the math building blocks (they return the
            log-sum-exp and have the matching backward) on every device.
        sliding_window: attend only to the last ``sliding_window`` tokens (incl. itself), as HF.
        softcap: ``c > 0``: scores become ``c * tanh(scores / c)`` before the mask (Gemma-2,
            VaultGemma), in the forward and backward of every block.
        sinks: ``(h,)`` attention sinks (gpt-oss ``s_aux``), one learned logit per GLOBAL query head in
            the softmax denominator with no value attached; any float dtype, on q's device, the same
            tensor on every rank. Each rank uses (and gives a gradient to) the heads it owns after the
            all-to-all, so ``sinks.grad`` is ``(h,)`` with zeros outside them; summed over the group
            (as the strategy does for parameters) it is the exact gradient.
        block_size: tokens per compute tile inside a segment of ``P*chunk_size`` tokens; bounds the
            ``(b, h/P, block_size, block_size)`` fp32 score block of the math kernel.

    Returns:
        ``(b, u*c, h, d)`` in the same layout, equal to full attention over the gathered sequence.
    """
    check_qkv(q, k, v)
    check_softcap(softcap)
    check_sinks(sinks, q)
    if backend not in FPDT_BACKENDS:
        resolve_backend(backend)  # unknown or unavailable names get the kernels' own error
        raise ValueError(
            f"fpdt_attention computes its blocks with the math building blocks (they return the log-sum-exp "
            f"and have a matching block backward); backend {backend!r} is not used there. Pass backend='auto' "
            "or 'math', or use ulysses_attention for that kernel"
        )
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
    docs = _global_docs(position_ids, (b, local), chunk_size, group)
    plan = BlockPlan.build(
        local // chunk_size,
        world * chunk_size,
        block_size=block_size,
        causal=causal,
        sliding_window=sliding_window,
        docs=docs,
    )
    cfg = _Config(group, chunk_size, default_scale(d, softmax_scale), plan, offload, softcap)
    my_sinks = None if sinks is None else sinks[local_heads(h, group)]  # (h_r,); autograd scatters its grad
    return _FPDTAttention.apply(q, k, v, my_sinks, cfg)
