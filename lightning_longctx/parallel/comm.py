"""Autograd-aware collectives for sequence parallelism. Every collective of the package lives here.

Layouts: ``bshd`` = (batch, seq, heads, head_dim). ``P`` = size of the sequence-parallel group.

* ``seq_to_head(x)``: (b, s, h, d) "my tokens, all heads" -> (b, P*s, h_r, d) "all tokens, my heads".
* ``head_to_seq(x)``: the inverse. The backward of one is the other (scatter and gather swapped).
* ``seq_to_head_packed(q, k, v)``: several tensors (GQA k/v may have fewer heads) in ONE all-to-all of
  a flat buffer with per-rank split sizes; its backward is one all-to-all too (Ulysses).
* ``seq_to_head_async`` / ``head_to_seq_async``: the no-grad ones started in the background
  (``async_op=True``), returning a :class:`PendingAllToAll` whose ``wait()`` gives the result (FPDT's
  overlap of communication with compute).
* ``halo_exchange(tails, order=...)``: each segment receives the tail of the segment before it in global order
  (a causal convolution's k-1 inputs), wherever that segment lives (``order``: the layout's global segment
  ids, :data:`SegmentOrder`); its backward sends the gradient back.
* ``exclusive_affine_scan(M, B, apply, order=...)``: the entry state of every segment of a recurrence that is
  affine in its state, ``S_out = M S_in + B``, from one all-gather of the per-segment summaries folded in
  global segment order; its backward is one all-gather of the entry-state gradients (hybrid mixers: gated
  DeltaNet, Mamba, ...).
* the reductions of the loss and of tensor parallelism: ``all_reduce_sum_identity_grad`` (a loss all ranks
  hold), ``all_reduce_no_grad`` / ``all_reduce_`` (a copy / in place, e.g. the vocabulary-parallel hidden
  gradient), ``all_gather_no_grad``, ``all_gather_object``.

Every autograd Function whose forward runs a sequence-parallel collective derives from
:class:`SequenceParallelFunction` (FPDT's attention too); :func:`reaches_sequence_parallel` finds one in a
loss's graph (the strategy's first-step guard for plain models). :func:`count_all_to_all` is a meter for
tests and benchmarks: the list of open blocks is this module's one piece of module-level state, and nothing
in the package reads it.

Heads are split in contiguous blocks, rank r owning ``head_split(h, P)[r]`` heads; when ``h % P != 0``
the first ``h % P`` ranks own one head more (``all_to_all_single`` with uneven split sizes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Group = Any  # a torch.distributed ProcessGroup or None (= the default group / single process)


def group_rank_size(group: Group = None) -> tuple[int, int]:
    """(rank, size) within ``group``; (0, 1) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def head_split(num_heads: int, world: int) -> list[int]:
    """Heads per rank: contiguous blocks, the first ``num_heads % world`` ranks get one more."""
    base, extra = divmod(num_heads, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


class SequenceParallelFunction(torch.autograd.Function):
    """Base of the autograd Functions whose forward runs a sequence-parallel collective (the all-to-alls, the
    hybrid mixers' state exchanges, FPDT's attention): :func:`reaches_sequence_parallel` recognises their
    nodes in an autograd graph. Subclasses define ``forward`` and ``backward`` as any Function."""


def reaches_sequence_parallel(tensor: Any) -> bool | None:
    """Whether ``tensor``'s autograd graph contains a :class:`SequenceParallelFunction` node, i.e. whether
    it depends on tokens of other ranks through our attention or mixers. ``None`` when the graph cannot
    tell: no graph (not a tensor, no ``grad_fn``: manual optimisation returns no loss) or a reentrant
    activation checkpoint, whose forward ran without recording its inner nodes. Walks the graph once."""
    node = getattr(tensor, "grad_fn", None)
    if node is None:
        return None
    seen, stack, hidden = {node}, [node], False
    while stack:
        node = stack.pop()
        cls = getattr(node, "_forward_cls", None)
        if isinstance(cls, type) and issubclass(cls, SequenceParallelFunction):
            return True
        hidden = hidden or type(node).__name__ == "CheckpointFunctionBackward"
        for parent, _ in node.next_functions:
            if parent is not None and parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return None if hidden else False


@dataclass
class AllToAllCount:
    """All-to-alls run while a :func:`count_all_to_all` block was open, and the bytes this process sent
    to OTHER ranks through them (its own block is not counted). The hybrid mixers' state exchanges
    (:func:`halo_exchange`, :func:`exclusive_affine_scan`) are counted apart, in ``exchange_*``."""

    calls: int = 0
    bytes_sent: int = 0
    exchange_calls: int = 0
    exchange_bytes: int = 0


#: Counters of the open :func:`count_all_to_all` blocks; empty (nothing counted) unless one is open. A meter
#: for tests and benchmarks only: no code of the package reads it.
_OPEN_COUNTS: list[AllToAllCount] = []


@contextmanager
def count_all_to_all() -> Iterator[AllToAllCount]:
    """Count the all-to-alls this process runs inside the block (blocks may nest; each counts its own).

    Costs nothing outside such a block. Tests and benchmarks use it::

        with count_all_to_all() as count:
            loss.backward()
        count.calls, count.bytes_sent
    """
    count = AllToAllCount()
    _OPEN_COUNTS.append(count)
    try:
        yield count
    finally:
        _OPEN_COUNTS.remove(count)


def _all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: Group,
    async_op: bool = False,
) -> Any:
    """``all_to_all_single`` on FLAT buffers; splits are element counts (gloo and NCCL accept uneven
    ones). Inputs must be contiguous: a permuted ``empty_like`` silently produced garbage. Returns the
    ``Work`` handle with ``async_op=True``, else None (``out`` is filled)."""
    work = dist.all_to_all_single(
        out, inp.contiguous(), out_splits, in_splits, group=group, async_op=async_op
    )
    if _OPEN_COUNTS:
        rank, _ = group_rank_size(group)
        sent = (sum(in_splits) - in_splits[rank]) * inp.element_size()
        for count in _OPEN_COUNTS:
            count.calls += 1
            count.bytes_sent += sent
    return work


class PendingAllToAll:
    """An all-to-all in flight (``async_op=True``); :meth:`wait` returns its result.

    Keeps the send and receive buffers alive until then (the collective reads and writes them in the
    background: gloo's worker threads, NCCL's stream; ``Work.wait`` makes the current CUDA stream wait).
    The compute issued between the launch and the first ``wait`` overlaps with the transfer; later
    calls return the same result."""

    def __init__(self, work: Any, finish: Callable[[], Any], *buffers: torch.Tensor) -> None:
        self._work, self._finish, self._buffers = work, finish, buffers
        self._result: Any = None

    @classmethod
    def done(cls, result: Any) -> PendingAllToAll:
        """An already finished one (a group of one rank: nothing to send)."""
        return cls(None, lambda: result)

    def wait(self) -> Any:
        if self._finish is not None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._finish, self._work, self._buffers = None, None, ()
        return self._result


# Buffers are laid out rank-first, (P, b, s, heads, d), as DeepSpeed does: for batch 1 the receive side
# of seq->head and the send side of head->seq are then views, not copies (a heads-first layout cost
# 15 full-tensor copies per forward+backward of an attention layer against 8 here).


def _seq_to_head(x: torch.Tensor, group: Group, async_op: bool = False) -> Any:
    rank, world = group_rank_size(group)
    b, s, h, d = x.shape
    splits = head_split(h, world)
    mine = splits[rank]
    if h % world == 0:  # (P, b, s, h/P, d): rank j's block is slice j
        send = x.view(b, s, world, mine, d).permute(2, 0, 1, 3, 4).contiguous()
    else:  # uneven heads: concatenate each rank's (b, s, h_j, d) block
        send = torch.cat([blk.reshape(-1) for blk in x.split(splits, dim=2)])
    recv = torch.empty((world, b, s, mine, d), dtype=x.dtype, device=x.device)
    work = _all_to_all(
        recv.view(-1),
        send.view(-1),
        [b * s * mine * d] * world,
        [b * s * m * d for m in splits],
        group,
        async_op,
    )

    def finish() -> torch.Tensor:
        # recv[j] = source rank j's s tokens of my heads -> (b, P*s, mine, d), rank order = sequence order
        return recv.transpose(0, 1).reshape(b, world * s, mine, d)

    return PendingAllToAll(work, finish, send, recv) if async_op else finish()


def _head_to_seq(x: torch.Tensor, num_heads: int, group: Group, async_op: bool = False) -> Any:
    _, world = group_rank_size(group)
    b, seq, mine, d = x.shape
    s = seq // world
    splits = head_split(num_heads, world)
    send = x.reshape(b, world, s, mine, d).transpose(0, 1).contiguous()  # (P, b, s, mine, d)
    recv = torch.empty(b * s * num_heads * d, dtype=x.dtype, device=x.device)
    work = _all_to_all(
        recv, send.view(-1), [b * s * m * d for m in splits], [b * s * mine * d] * world, group, async_op
    )

    def finish() -> torch.Tensor:
        if num_heads % world == 0:
            return recv.view(world, b, s, mine, d).permute(1, 2, 0, 3, 4).reshape(b, s, num_heads, d)
        blocks = recv.split([b * s * m * d for m in splits])
        return torch.cat([blk.view(b, s, m, d) for blk, m in zip(blocks, splits)], dim=2)

    return PendingAllToAll(work, finish, send, recv) if async_op else finish()


def _seq_to_head_packed(xs: Sequence[torch.Tensor], group: Group, async_op: bool = False) -> Any:
    """Several ``(b, s, h_x, d)`` tensors (same b, s, d and dtype; any heads) in ONE all-to-all: the
    send buffer holds, for each destination rank, its head block of every tensor one after the other.
    Returns ``(b, P*s, h_x_r, d)`` per tensor, as :func:`_seq_to_head` would one by one (a
    :class:`PendingAllToAll` of that list with ``async_op``)."""
    rank, world = group_rank_size(group)
    b, s, _, d = xs[0].shape
    splits = [head_split(x.shape[2], world) for x in xs]  # per tensor, per rank
    mine = [sp[rank] for sp in splits]
    if all(x.shape[2] % world == 0 for x in xs):  # (P, sum_x b*s*h_x/P*d): one strided copy per tensor
        send = torch.empty((world, b * s * d * sum(mine)), dtype=xs[0].dtype, device=xs[0].device)
        off = 0
        for x, m in zip(xs, mine):
            send[:, off : off + b * s * m * d].view(world, b, s, m, d).copy_(
                x.view(b, s, world, m, d).permute(2, 0, 1, 3, 4)
            )
            off += b * s * m * d
    else:  # uneven heads: rank j's blocks of every tensor, rank by rank
        blocks = [x.split(sp, dim=2) for x, sp in zip(xs, splits)]
        send = torch.cat([blk[j].reshape(-1) for j in range(world) for blk in blocks])
    in_splits = [b * s * d * sum(sp[j] for sp in splits) for j in range(world)]
    recv = torch.empty((world, b * s * d * sum(mine)), dtype=xs[0].dtype, device=xs[0].device)
    work = _all_to_all(
        recv.view(-1), send.view(-1), [b * s * d * sum(mine)] * world, in_splits, group, async_op
    )

    def finish() -> list[torch.Tensor]:
        out, off = [], 0
        for m in mine:  # recv[j] = source rank j's s tokens of my heads of every tensor
            part = recv[:, off : off + b * s * m * d].reshape(world, b, s, m, d)
            out.append(part.transpose(0, 1).reshape(b, world * s, m, d))
            off += b * s * m * d
        return out

    return PendingAllToAll(work, finish, send, recv) if async_op else finish()


def _head_to_seq_packed(
    xs: Sequence[torch.Tensor], num_heads: Sequence[int], group: Group, async_op: bool = False
) -> Any:
    """Inverse of :func:`_seq_to_head_packed`: ``(b, P*s, h_x_r, d)`` per tensor -> ``(b, s, h_x, d)``."""
    rank, world = group_rank_size(group)
    b, seq, _, d = xs[0].shape
    s = seq // world
    splits = [head_split(h, world) for h in num_heads]
    mine = [sp[rank] for sp in splits]
    send = torch.empty((world, b * s * d * sum(mine)), dtype=xs[0].dtype, device=xs[0].device)
    off = 0
    for x, m in zip(xs, mine):  # send[j] = destination rank j's s tokens of my heads of every tensor
        send[:, off : off + b * s * m * d].view(world, b, s, m, d).copy_(
            x.view(b, world, s, m, d).transpose(0, 1)
        )
        off += b * s * m * d
    out_splits = [b * s * d * sum(sp[j] for sp in splits) for j in range(world)]
    recv = torch.empty(sum(out_splits), dtype=xs[0].dtype, device=xs[0].device)
    work = _all_to_all(recv, send.view(-1), out_splits, [b * s * d * sum(mine)] * world, group, async_op)

    def finish() -> list[torch.Tensor]:
        if all(h % world == 0 for h in num_heads):
            rows, out, off = recv.view(world, -1), [], 0
            for h, m in zip(num_heads, mine):
                part = rows[:, off : off + b * s * m * d].reshape(world, b, s, m, d)
                out.append(part.permute(1, 2, 0, 3, 4).reshape(b, s, h, d))
                off += b * s * m * d
            return out
        per_rank = recv.split(out_splits)  # rank j's blocks of every tensor, in tensor order
        pieces: list[list[torch.Tensor]] = [[] for _ in xs]
        for j, chunk in enumerate(per_rank):
            parts = chunk.split([b * s * sp[j] * d for sp in splits])
            for t, (part, sp) in enumerate(zip(parts, splits)):
                pieces[t].append(part.view(b, s, sp[j], d))
        return [torch.cat(p, dim=2) for p in pieces]

    return PendingAllToAll(work, finish, send, recv) if async_op else finish()


class _SeqToHead(SequenceParallelFunction):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.num_heads = group, x.shape[2]
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _head_to_seq(grad, ctx.num_heads, ctx.group), None


class _HeadToSeq(SequenceParallelFunction):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, num_heads: int, group: Group) -> torch.Tensor:
        ctx.group = group
        return _head_to_seq(x, num_heads, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _seq_to_head(grad, ctx.group), None, None


class _SeqToHeadPacked(SequenceParallelFunction):
    @staticmethod
    def forward(ctx: Any, group: Group, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.num_heads = group, [x.shape[2] for x in xs]
        outs = _seq_to_head_packed(xs, group)
        ctx.shapes = [o.shape for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        like = next(g for g in grads if g is not None)
        # an output that got no gradient still takes its place in the one buffer
        full = [like.new_zeros(shape) if g is None else g for g, shape in zip(grads, ctx.shapes)]
        return (None, *_head_to_seq_packed(full, ctx.num_heads, ctx.group))


def _check_packable(xs: Sequence[torch.Tensor]) -> None:
    for x in xs:
        if x.dim() != 4:
            raise ValueError(
                f"seq_to_head_packed expects bshd tensors (batch, seq, heads, head_dim), got shape {tuple(x.shape)}"
            )
    first = xs[0]
    for x in xs[1:]:
        if (x.shape[0], x.shape[1], x.shape[3]) != (first.shape[0], first.shape[1], first.shape[3]):
            raise ValueError(
                f"seq_to_head_packed needs equal (batch, seq, head_dim): {tuple(first.shape)} vs {tuple(x.shape)}; "
                "send them one by one with seq_to_head"
            )


def seq_to_head_packed(*xs: torch.Tensor, group: Group = None) -> tuple[torch.Tensor, ...]:
    """:func:`seq_to_head` of several ``(b, s, h_x, d)`` tensors (same b, s, d; heads may differ, e.g. q
    and GQA k/v) in ONE all-to-all, forward and backward: ``(b, P*s, h_x_r, d)`` each. Tensors of
    different dtypes (a buffer has one) go one by one instead."""
    _check_packable(xs)
    if any(x.dtype != xs[0].dtype for x in xs):  # autocast can leave q in fp32 and k/v in bf16
        return tuple(seq_to_head(x, group) for x in xs)
    if group_rank_size(group)[1] == 1:
        return tuple(xs)
    return _SeqToHeadPacked.apply(group, *xs)


def seq_to_head_packed_async(*xs: torch.Tensor, group: Group = None) -> PendingAllToAll:
    """:func:`seq_to_head_packed` outside autograd, started in the background (FPDT's own backward):
    ``.wait()`` gives the list of ``(b, P*s, h_x_r, d)``. Tensors of different dtypes go one by one."""
    _check_packable(xs)
    if group_rank_size(group)[1] == 1:
        return PendingAllToAll.done(list(xs))
    if any(x.dtype != xs[0].dtype for x in xs):
        parts = [_seq_to_head(x, group, True) for x in xs]
        return PendingAllToAll(None, lambda: [p.wait() for p in parts])
    return _seq_to_head_packed(xs, group, async_op=True)


def head_to_seq_packed_async(
    xs: Sequence[torch.Tensor], num_heads: Sequence[int], group: Group = None
) -> PendingAllToAll:
    """The inverse of :func:`seq_to_head_packed_async`: ``(b, P*s, h_x_r, d)`` per tensor -> ``.wait()``
    gives the list of ``(b, s, num_heads[x], d)``."""
    if group_rank_size(group)[1] == 1:
        return PendingAllToAll.done(list(xs))
    if any(x.dtype != xs[0].dtype for x in xs):
        parts = [_head_to_seq(x, n, group, True) for x, n in zip(xs, num_heads)]
        return PendingAllToAll(None, lambda: [p.wait() for p in parts])
    return _head_to_seq_packed(xs, num_heads, group, async_op=True)


def seq_to_head_async(x: torch.Tensor, group: Group = None) -> PendingAllToAll:
    """:func:`seq_to_head` outside autograd (for FPDT's own backward), started in the background:
    ``.wait()`` gives ``(b, P*s, h_r, d)``.
    The layout copy into the send buffer happens now, the one out of the receive buffer at ``wait``."""
    return PendingAllToAll.done(x) if group_rank_size(group)[1] == 1 else _seq_to_head(x, group, True)


def head_to_seq_async(x: torch.Tensor, num_heads: int, group: Group = None) -> PendingAllToAll:
    """:func:`head_to_seq` outside autograd, started in the background: ``.wait()`` gives
    ``(b, s, num_heads, d)``."""
    return (
        PendingAllToAll.done(x) if group_rank_size(group)[1] == 1 else _head_to_seq(x, num_heads, group, True)
    )


def seq_to_head(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-to-all ``(b, s, h, d)`` -> ``(b, P*s, h_r, d)``; rank order is sequence order."""
    if x.dim() != 4:
        raise ValueError(
            f"seq_to_head expects a bshd tensor (batch, seq, heads, head_dim), got shape {tuple(x.shape)}"
        )
    if group_rank_size(group)[1] == 1:
        return x
    return _SeqToHead.apply(x, group)


def head_to_seq(x: torch.Tensor, num_heads: int, group: Group = None) -> torch.Tensor:
    """All-to-all ``(b, P*s, h_r, d)`` -> ``(b, s, num_heads, d)``; inverse of :func:`seq_to_head`."""
    if group_rank_size(group)[1] == 1:
        return x
    return _HeadToSeq.apply(x, num_heads, group)


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    """Forward: sum over the group. Backward: identity.

    Right when every rank back-propagates the SAME upstream gradient of the reduced value (a loss
    that all ranks hold): rank r then receives exactly d(sum)/d(its contribution) = upstream.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def all_reduce_sum_identity_grad(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    if group_rank_size(group)[1] == 1:
        return x
    return _AllReduceSumIdentityGrad.apply(x, group)


def _reduce_op(op: str) -> Any:
    if op not in ("sum", "max", "min"):
        raise ValueError(f"op={op!r} is not a reduction of this package; use 'sum', 'max' or 'min'")
    return getattr(dist.ReduceOp, op.upper())


def all_reduce_no_grad(x: torch.Tensor, group: Group = None, op: str = "sum") -> torch.Tensor:
    """A reduced copy of ``x`` (no autograd); ``op`` in {"sum", "max", "min"}."""
    x = x.detach().clone()
    if group_rank_size(group)[1] > 1:
        dist.all_reduce(x, op=_reduce_op(op), group=group)
    return x


def all_reduce_(x: torch.Tensor, group: Group = None, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over ``group`` in place (no autograd; for a gradient inside a hand-written backward,
    where a copy would cost a second buffer of its size); returns ``x``. ``op`` in {"sum", "max", "min"}."""
    if group_rank_size(group)[1] > 1:
        dist.all_reduce(x, op=_reduce_op(op), group=group)
    return x


def all_gather_no_grad(x: torch.Tensor, group: Group = None, dim: int = 0) -> torch.Tensor:
    """Concatenate equal-shaped tensors of all ranks along ``dim`` in rank order (no autograd)."""
    _, world = group_rank_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def barrier(group: Group = None, device_ids: list[int] | None = None) -> None:
    """Wait until every rank of ``group`` got here (nothing to wait for without a process group); on NCCL
    ``device_ids`` names this rank's device."""
    if dist.is_available() and dist.is_initialized():
        if device_ids is not None and dist.get_backend(group) == "nccl":
            dist.barrier(group=group, device_ids=device_ids)
        else:
            dist.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank of the world (pickled; ``obj`` itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def broadcast_module_(module: torch.nn.Module, src: int = 0) -> None:
    """Every rank's parameters and buffers of ``module`` become rank ``src``'s, in place (what DDP does when it
    wraps; for a model that runs without DDP's wrapper)."""
    if group_rank_size(None)[1] == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src)


def reduce_mean_or_sum(x: torch.Tensor, group: Group = None, op: Any = "mean") -> torch.Tensor:
    """Lightning's ``Strategy.reduce``: ``x`` summed, or averaged (``"mean"`` / ``"avg"``), over ``group``;
    a ``ReduceOp`` passes through as it is."""
    world = group_rank_size(group)[1]
    if world == 1:
        return x
    x = x.detach().clone() if x.requires_grad else x.clone()
    name = op.lower() if isinstance(op, str) else None
    if name in ("mean", "avg"):
        if not x.is_floating_point():
            x = x.float()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x / world
    dist.all_reduce(x, op=_reduce_op(name) if name is not None else op, group=group)
    return x


def new_gloo_group() -> Any:
    """A new gloo group over the world (a collective: every rank calls it, in the same order), for host-side
    work that must not queue behind the training collectives (background checkpoint writes)."""
    return dist.new_group(backend="gloo")


def new_subgroup(cells: list[list[int]]) -> Any:
    """This rank's group of ``cells`` (disjoint lists of global ranks covering the world): every rank creates
    every group, in the same order (a collective), and keeps the one it is in."""
    return dist.new_subgroups_by_enumeration(cells)[0]


def all_gather_object(obj: Any, group: Group = None) -> list[Any]:
    _, world = group_rank_size(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


# ---------------------------------------------------------------------------------------------------
# Hybrid mixers: halo exchange and exclusive affine scan
#
# A "segment" is a run of consecutive global tokens held by one rank: the whole local shard in the
# contiguous (Ulysses) layout (u = 1), each of the u local chunks in the FPDT layout, each half of the shard
# under Ulysses x ring (zigzag). Segments are numbered in global order (segment g holds the tokens before
# segment g+1); ``order[r][i]`` is the global id of local segment i of rank r, the same table on every rank
# (:data:`SegmentOrder`). The contiguous and FPDT layouts have the strided order g = i*P + r
# (:func:`strided_order`), the default; any permutation is exact (the ring's zigzag puts a segment's
# predecessor on another rank, the same rank, or nowhere).
# ---------------------------------------------------------------------------------------------------

#: ``order[r][i]``: the global segment id of rank r's local segment i; P rows of u ids, a permutation of
#: ``range(P * u)``, the same on every rank.
SegmentOrder = tuple[tuple[int, ...], ...]


def strided_order(world: int, u: int) -> SegmentOrder:
    """The contiguous (u = 1) and FPDT layouts' order: rank r's local segment i is global segment ``i*P + r``."""
    return tuple(tuple(i * world + r for i in range(u)) for r in range(world))


@dataclass(frozen=True)
class _SegmentPlan:
    """One rank's part in the halo exchange and the scan of a segment order (:func:`_segment_plan`).

    Local segment indices throughout. ``mine``: my segments' global ids; ``gathered``: for each global id g,
    its row ``r*u + i`` in the all-gathered summaries; ``local_dst``/``local_src``: halo ``dst`` comes from
    my own segment ``src`` (its predecessor); ``recv[s]``: my segments whose predecessor rank s holds,
    ``send[d]``: my segments whose successor rank d holds (``s, d`` != me), both ascending in global id, so
    that a sender's list and its receiver's match; ``remote``: some rank sends to another one (the same
    answer on every rank: no rank skips a collective the others run); ``strided``: :func:`strided_order`."""

    mine: tuple[int, ...]
    gathered: tuple[int, ...]
    local_dst: tuple[int, ...]
    local_src: tuple[int, ...]
    recv: tuple[tuple[int, ...], ...]
    send: tuple[tuple[int, ...], ...]
    remote: bool
    strided: bool


def _as_order(order: Any, world: int, u: int) -> SegmentOrder:
    """``order`` (None: strided; a (P, u) int tensor or nested sequence) as a :data:`SegmentOrder`."""
    if order is None:
        return strided_order(world, u)
    rows = order.tolist() if isinstance(order, torch.Tensor) else order
    return tuple(tuple(int(g) for g in row) for row in rows)


@functools.lru_cache(maxsize=256)
def _segment_plan(order: SegmentOrder, rank: int, world: int) -> _SegmentPlan:
    u = len(order[0]) if order else 0
    if len(order) != world or any(len(row) != u for row in order):
        raise ValueError(
            f"segment order {order}: expected {world} rows (one per rank of the group) of the same length"
        )
    flat = [g for row in order for g in row]
    if sorted(flat) != list(range(world * u)):
        raise ValueError(f"segment order {order} is not a permutation of the {world * u} global segments")
    owner = {g: (r, i) for r, row in enumerate(order) for i, g in enumerate(row)}
    mine = order[rank]
    local_dst, local_src = [], []
    recv: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    send: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for i, g in enumerate(mine):
        if g > 0:  # the predecessor's tails come here
            s, k = owner[g - 1]
            if s == rank:
                local_dst.append(i)
                local_src.append(k)
            else:
                recv[s].append((g, i))
        if g + 1 < world * u and (d := owner[g + 1][0]) != rank:  # my tails go to the successor
            send[d].append((g, i))
    remote = any(owner[g][0] != owner[g - 1][0] for g in range(1, world * u))
    return _SegmentPlan(
        mine=mine,
        gathered=tuple(r * u + i for r, i in (owner[g] for g in range(world * u))),
        local_dst=tuple(local_dst),
        local_src=tuple(local_src),
        recv=tuple(tuple(i for _, i in sorted(x)) for x in recv),
        send=tuple(tuple(i for _, i in sorted(x)) for x in send),
        remote=remote,
        strided=order == strided_order(world, u),
    )


def _count_exchange(sent: int) -> None:
    for count in _OPEN_COUNTS:
        count.exchange_calls += 1
        count.exchange_bytes += sent


def _ring_shift(x: torch.Tensor, group: Group, forward: bool) -> torch.Tensor:
    """``x`` of rank r+1 (``forward=False``) or r-1 (``forward=True``), ring order, one
    ``all_to_all_single`` that moves ``x`` to a single neighbour (zero-sized splits to the others)."""
    rank, world = group_rank_size(group)
    x = x.contiguous()
    if world == 1:
        return x.clone()
    n = x.numel()
    dst, src = (
        ((rank + 1) % world, (rank - 1) % world) if forward else ((rank - 1) % world, (rank + 1) % world)
    )
    in_splits = [n if r == dst else 0 for r in range(world)]
    out_splits = [n if r == src else 0 for r in range(world)]
    out = torch.empty_like(x)
    dist.all_to_all_single(out.view(-1), x.view(-1), out_splits, in_splits, group=group)
    _count_exchange(n * x.element_size())
    return out


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _permuted_shift(x: torch.Tensor, group: Group, plan: _SegmentPlan, reverse: bool) -> torch.Tensor:
    """Each local segment's row of ``x`` ``(u, ...)`` moved to its successor's slot (``reverse``: to its
    predecessor's, the gradient's way), wherever that segment lives; zeros where none arrives. Pairs on this
    rank are a local copy; the others travel in one ``all_to_all_single`` with per-rank splits (every rank
    calls it while any rank sends)."""
    send, recv = (plan.recv, plan.send) if reverse else (plan.send, plan.recv)
    dst, src = (plan.local_src, plan.local_dst) if reverse else (plan.local_dst, plan.local_src)
    x = x.contiguous()
    out = torch.zeros_like(x)
    if dst:
        out[_index(dst, x.device)] = x[_index(src, x.device)]
    if not plan.remote:
        return out
    per = x[0].numel()
    sent = [i for rows in send for i in rows]
    got = [i for rows in recv for i in rows]
    buf = x[_index(sent, x.device)].reshape(-1)  # empty on a rank that sends nothing (gloo takes it)
    into = x.new_empty(len(got) * per)
    dist.all_to_all_single(
        into, buf, [len(rows) * per for rows in recv], [len(rows) * per for rows in send], group=group
    )
    out[_index(got, x.device)] = into.view(len(got), *x.shape[1:])
    _count_exchange(len(sent) * per * x.element_size())
    return out


class _HaloExchange(SequenceParallelFunction):
    @staticmethod
    def forward(ctx: Any, tails: torch.Tensor, group: Group, plan: _SegmentPlan) -> torch.Tensor:
        ctx.group, ctx.plan = group, plan
        if not plan.strided:
            return _permuted_shift(tails, group, plan, reverse=False)
        received = _ring_shift(tails, group, forward=True)  # rank r holds rank r-1's tails
        if group_rank_size(group)[0] == 0:  # rank 0's segment i follows rank P-1's segment i-1
            received = torch.cat([torch.zeros_like(received[:1]), received[:-1]])
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if not ctx.plan.strided:
            return _permuted_shift(grad, ctx.group, ctx.plan, reverse=True), None, None
        grad = grad.contiguous()
        if group_rank_size(ctx.group)[0] == 0:  # undo the shift: halo i came from segment i-1
            grad = torch.cat([grad[1:], torch.zeros_like(grad[:1])])
        return _ring_shift(grad, ctx.group, forward=False), None, None


def halo_exchange(tails: torch.Tensor, group: Group = None, order: Any = None) -> torch.Tensor:
    """The tail of the previous segment in global order, for each of this rank's segments.

    ``tails``: ``(u, ...)``, the last ``k-1`` positions of each of this rank's ``u`` local segments (any
    trailing layout, the same on every rank). ``order``: the :data:`SegmentOrder` of the layout (a (P, u) table
    of global segment ids, the same on every rank; ``None``: :func:`strided_order`). Returns ``(u, ...)``: for
    the local segment with global id g, the tails of segment g-1 wherever it lives, zeros for g = 0 (the
    sequence start). Backward: the gradient goes back to the segment whose tails they were.

    Bytes per rank, each way: strided order (contiguous, FPDT), one shift around the ring, ``tails.numel() *
    elt``; any other order, ``n * tails[0].numel() * elt``, with n the local segments whose successor (forward)
    or predecessor (backward) lives on another rank (a neighbour on this rank is a local copy), in one
    ``all_to_all_single`` with per-rank splits. Every rank of ``group`` must call it (one collective forward,
    one backward)."""
    rank, world = group_rank_size(group)
    plan = _segment_plan(_as_order(order, world, tails.shape[0]), rank, world)
    return _HaloExchange.apply(tails, group, plan)


def _fold(
    M: torch.Tensor, B: torch.Tensor, apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Entry states of segments in order: ``S[0] = 0``, ``S[g+1] = apply(M[g], S[g]) + B[g]``."""
    states = [torch.zeros_like(B[0])]
    for g in range(B.shape[0] - 1):
        states.append(apply(M[g], states[-1]) + B[g])
    return torch.stack(states)


def _gather_segments(x: torch.Tensor, group: Group, plan: _SegmentPlan) -> torch.Tensor:
    """``x`` ``(u, ...)`` of every rank -> ``(P*u, ...)`` in global segment order."""
    _, world = group_rank_size(group)
    x = x.contiguous()
    if world > 1:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        _count_exchange((world - 1) * x.numel() * x.element_size())
        x = torch.cat(parts)  # (P*u, ...): row r*u + i is rank r's segment i
    return x[_index(plan.gathered, x.device)]


class _ExclusiveAffineScan(SequenceParallelFunction):
    @staticmethod
    def forward(
        ctx: Any,
        M: torch.Tensor,
        B: torch.Tensor,
        apply: Callable[..., torch.Tensor],
        group: Group,
        plan: _SegmentPlan,
    ) -> torch.Tensor:
        u = B.shape[0]
        # one all-gather of [M | B] (flat), not two: the summaries are small, the latency is not
        flat = _gather_segments(torch.cat([M.reshape(u, -1), B.reshape(u, -1)], dim=1), group, plan)
        Ms = flat[:, : M[0].numel()].reshape(-1, *M.shape[1:])
        Bs = flat[:, M[0].numel() :].reshape(-1, *B.shape[1:])
        ctx.combine, ctx.group, ctx.plan = apply, group, plan
        ctx.save_for_backward(Ms, Bs)
        return _fold(Ms, Bs, apply)[_index(plan.mine, B.device)]  # this rank's segments

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        Ms, Bs = ctx.saved_tensors
        grads = _gather_segments(grad, ctx.group, ctx.plan)  # every segment's S_in gradient, global order
        dM, dB = None, None
        with torch.enable_grad():  # the fold is tiny (u*P small states): differentiate it again locally
            Ms, Bs = Ms.detach().requires_grad_(), Bs.detach().requires_grad_()
            states = _fold(Ms, Bs, ctx.combine)
            if states.requires_grad:  # one segment in all: its entry state is zero, whatever M and B are
                dM, dB = torch.autograd.grad(states, (Ms, Bs), grads, allow_unused=True)
        dM = torch.zeros_like(Ms) if dM is None else dM
        dB = torch.zeros_like(Bs) if dB is None else dB
        mine = _index(ctx.plan.mine, grad.device)
        return dM[mine], dB[mine], None, None, None


def exclusive_affine_scan(
    M: torch.Tensor,
    B: torch.Tensor,
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: Group = None,
    order: Any = None,
) -> torch.Tensor:
    """Entry states of this rank's segments of a recurrence affine in its state.

    ``M`` ``(u, ...)`` and ``B`` ``(u, *state)``: each local segment's summary from a zero entry state,
    ``S_out = apply(M, S_in) + B`` (``apply``: the matrix product for gated DeltaNet's dense ``M``, a
    broadcast product for Mamba's diagonal or scalar one). ``order``: the :data:`SegmentOrder` of the layout
    (``None``: :func:`strided_order`). Returns ``(u, *state)``: ``S_in`` of each local segment, the exclusive
    fold over all earlier segments in global order (zeros for the first). One all-gather of ``[M | B]``
    forward (``(P-1) * (M + B).numel() * elt`` bytes per rank, whatever the order), one of the ``S_in``
    gradients backward, then a local fold of ``u*P`` small states in global order; every rank of ``group``
    must call it, the one holding the first segment too, whose entry state is zero (a rank that skipped the
    backward collective would hang the others)."""
    rank, world = group_rank_size(group)
    plan = _segment_plan(_as_order(order, world, B.shape[0]), rank, world)
    return _ExclusiveAffineScan.apply(M, B, apply, group, plan)


# ---------------------------------------------------------------------------------------------------
# Ring attention: point-to-point passes around the ring
# ---------------------------------------------------------------------------------------------------


def ring_pass_async(x: torch.Tensor, group: Group = None, *, tag: int = 0) -> PendingAllToAll:
    """Send ``x`` to the next rank of ``group``'s ring, ``(rank + 1) % size``, and receive the previous
    rank's tensor of the same shape and dtype, in the background (no autograd: ring attention's own
    forward and backward call it). ``.wait()`` gives the received tensor; the compute issued before it
    overlaps with the transfer (the ring's double buffer: two such tensors are alive).

    One ``batch_isend_irecv`` of an isend and an irecv with ``tag`` (two passes in flight between the
    same ranks, e.g. k/v and the dk/dv that travel behind them, take different tags). Every rank of
    ``group`` must call it, in the same order. Counted as an exchange of :func:`count_all_to_all`:
    ``x.numel() * x.element_size()`` bytes per call; a group of one sends nothing (``wait()`` gives
    ``x``)."""
    rank, world = group_rank_size(group)
    x = x.contiguous()
    if world == 1:
        return PendingAllToAll.done(x)
    recv = torch.empty_like(x)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, x, group=group, tag=tag, group_peer=(rank + 1) % world),
            dist.P2POp(dist.irecv, recv, group=group, tag=tag, group_peer=(rank - 1) % world),
        ]
    )
    _count_exchange(x.numel() * x.element_size())

    def finish() -> torch.Tensor:
        for work in works:
            work.wait()
        return recv

    return PendingAllToAll(None, finish, x, recv)
