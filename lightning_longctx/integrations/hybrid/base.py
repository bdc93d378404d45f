"""What every hybrid-mixer adapter shares: the call's layout (segments), its refusals, and the rebinding
of a mixer's methods so that the kernel functions it calls by name resolve to our adapters.

A *segment* is a run of consecutive global tokens on one rank (``comm.py``): the whole shard in the
contiguous (Ulysses) layout, each of the ``u`` local chunks of ``c`` tokens in the FPDT layout, each half of
the shard under Ulysses x ring (``ring_size > 1``: zigzag, whose two halves are runs apart in the sequence).
Adapters run the model's own kernel function on all segments at once, stacked along the batch dimension
``(u*b, c, ...)`` (u-major), and join them with :meth:`MixerCall.halo_exchange` (causal convolutions) or
:meth:`MixerCall.exclusive_affine_scan` (recurrences): ``comm``'s collectives in the layout's global segment
order (:func:`segment_order`, read from the layout's global index), so a segment's neighbours are found
wherever they live, never across a local seam.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_longctx.parallel.comm import (
    Group,
    SegmentOrder,
    exclusive_affine_scan,
    group_rank_size,
    halo_exchange,
)
from lightning_longctx.parallel.layout import SequenceLayout

if TYPE_CHECKING:
    from lightning_longctx.integrations.context import SequenceParallelContext


#: The mixer kinds whose adapters reset their state at document starts (packed rows), for the messages.
PACKED_KINDS = (
    "short convolutions (LFM2), gated DeltaNet / Kimi delta attention (Qwen3.5, Qwen3-Next, OLMo-hybrid, "
    "Kimi-Linear), Mamba-2 (Mamba-2, Bamba, Falcon-H1, Granite-4 hybrid, Nemotron-H, Zamba2), Mamba-1 "
    "(Mamba, Falcon-Mamba, Jamba), RG-LRU (RecurrentGemma), lightning attention (MiniMax), RWKV-4 and xLSTM"
)


def packed_documents_error(name: str, mixer: str | None = None) -> ValueError:
    """The refusal of a packed batch (position ids restarting at 0) by ``name``; ``mixer``: the mixer class
    whose adapter cannot reset its state at a document start."""
    who = f"its mixer {mixer} cannot yet reset its" if mixer else "its mixers cannot yet reset their"
    return ValueError(
        f"{name}: the batch packs several documents (position_ids restart at 0), and {who} recurrent / "
        "convolutional state at a document start under sequence parallelism: it would flow from one document "
        f"into the next (a plain Hugging Face model mixes them too). Packed rows are exact for {PACKED_KINDS}; "
        "train this model on one document per row (pad instead of packing)"
    )


def halo_error(name: str, halo: int, segment: int, local_len: int | None = None, ring: int = 1) -> ValueError:
    """``ring`` > 1: the segment is half of the shard (Ulysses x ring's two zigzag runs)."""
    if local_len is None:
        where = f"fpdt_chunk_size={segment}"
    elif ring > 1:
        where = (
            f"half of local length {local_len}: under ring_size={ring} each half of a shard is its own run"
        )
    else:
        where = f"local length {local_len}"
    fix = "a smaller ring_size" if ring > 1 else f"fpdt_chunk_size >= {halo}"
    return ValueError(
        f"{name} needs the last {halo} tokens before each segment (its causal convolution), but a segment "
        f"holds {segment} tokens ({where}); use a longer sequence, fewer sequence-parallel ranks or {fix}"
    )


def segment_length(context: SequenceParallelContext, local_len: int) -> int:
    """Tokens per segment of a call whose shard holds ``local_len`` tokens: the FPDT chunk when chunking,
    else half the shard under Ulysses x ring (each half a run of the zigzag, never mixed across the seam
    between them), else the whole shard."""
    c = context.local_chunk(local_len)
    if c is not None:
        return c
    if context.ring > 1:
        if local_len % 2:
            raise ValueError(
                f"ring_size={context.ring}: a shard of {local_len} tokens is not two equal zigzag halves; "
                "shard batches with shard_batch(..., ring=ring_size) (pads the sequence to a multiple of 2 x sp)"
            )
        return local_len // 2
    return local_len


@functools.lru_cache(maxsize=64)
def segment_order(
    local_len: int, segment: int, world: int, chunk_size: int | None, ring: int
) -> SegmentOrder:
    """The global id of every rank's local segments (``comm.SegmentOrder``, the table every rank passes to
    the collectives): segment ``i`` of rank ``r`` holds global tokens ``[g*L, (g+1)*L)`` with ``L = segment``
    and ``g = index[i*L] // L``, ``index`` the layout's global index of rank ``r``'s tokens
    (``SequenceLayout.global_index``, the map ``SequenceParallelContext.global_index`` reads). One rule for
    every layout: Ulysses, FPDT, Ulysses x ring, FPDT x ring. No collective; a pure function of its arguments."""
    rows = []
    step = torch.arange(segment)
    layout = SequenceLayout(sp=world, ring=ring, chunk_size=chunk_size).for_local(local_len)
    for rank in range(world):
        index = layout.global_index(local_len, rank)
        runs = index.view(-1, segment)  # (u, L)
        if bool((runs[:, 0] % segment).any()) or not torch.equal(runs, runs[:, :1] + step):
            raise RuntimeError(  # an internal invariant of the layouts (parallel/layout.py)
                f"the layout (world={world}, chunk_size={chunk_size}, ring={ring}) gives rank {rank} tokens that "
                f"are not runs of {segment} consecutive global tokens aligned to {segment}: {index.tolist()}"
            )
        rows.append(tuple((runs[:, 0] // segment).tolist()))
    return tuple(rows)


def mixer_halo(mixers: list[Any]) -> int:
    """The most tokens any of ``mixers`` needs from before its segment: a depthwise causal ``nn.Conv1d``'s
    ``k-1`` (the functional convs take a Conv1d's weight too); 1 (RWKV's token shift) otherwise."""
    halo = 1 if mixers else 0
    for mixer in mixers:
        for m in mixer.modules():
            if isinstance(m, torch.nn.Conv1d):
                halo = max(halo, m.kernel_size[0] - 1)
    return halo


class MixerCall:
    """One patched mixer module's view of its model's sequence-parallel context (what adapters receive).

    ``kernel_calls`` counts adapter calls: a mixer forward that ran none took a path we did not adapt
    (a fused kernel, a cache) and is refused instead of mixing only its own shard. A deep copy of the model
    shares it, as it shares the context: the copied methods' kernel names are bound to this object.
    ``packed``: every adapter this mixer calls resets its state at document starts (packed rows allowed)."""

    def __init__(self, context: SequenceParallelContext, name: str, packed: bool = False) -> None:
        self.context = context
        self.name = name  # the module's class name, for errors
        self.packed = packed
        self.kernel_calls = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> MixerCall:
        return self

    @property
    def group(self) -> Group:
        return self.context.group

    def chunk(self, local_len: int) -> int:
        """Tokens per segment of a call whose shard holds ``local_len`` tokens (:func:`segment_length`)."""
        return segment_length(self.context, local_len)

    def order(self, local_len: int) -> SegmentOrder:
        """The global segment id of every rank's segments for a shard of ``local_len`` tokens
        (:func:`segment_order`)."""
        _, world = group_rank_size(self.group)
        ctx = self.context
        return segment_order(local_len, self.chunk(local_len), world, ctx.chunk_size, ctx.ring)

    def halo_exchange(self, tails: torch.Tensor, local_len: int) -> torch.Tensor:
        """:func:`~lightning_longctx.parallel.comm.halo_exchange` of this call's segments in global order: ``tails``
        ``(u, ...)`` the last positions of each local segment of a shard of ``local_len`` tokens; returns those
        of the segment before each, ``(u, ...)`` (zeros before the sequence start)."""
        return halo_exchange(tails, self.group, order=self.order(local_len))

    def exclusive_affine_scan(
        self,
        M: torch.Tensor,
        B: torch.Tensor,
        apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        local_len: int,
    ) -> torch.Tensor:
        """:func:`~lightning_longctx.parallel.comm.exclusive_affine_scan` of this call's segments in global order:
        ``M`` ``(u, ...)``, ``B`` ``(u, *state)`` each local segment's summary (shard of ``local_len`` tokens);
        returns each one's entry state ``(u, *state)``."""
        return exclusive_affine_scan(M, B, apply, self.group, order=self.order(local_len))

    def _batch_documents(self) -> torch.Tensor | None:
        """``(b, N)`` document ids of the batch in global order, or ``None`` (one document per row).

        The batch is the one the model's forward hook recorded for the call in progress (its ``position_ids``),
        or, during an activation-checkpoint recompute (no call in progress), the last forward's: the hook clears
        them for a forward without ``position_ids`` (``masks.PositionsHook``), so they are never another call's."""
        pos = self.context.positions
        return None if pos is None else pos.documents()

    def check(self, local_len: int, halo: int = 0) -> int:
        """The segment length, after the refusals every adapter shares; ``halo``: tokens a segment needs
        from the one before it (a convolution's k-1)."""
        self.kernel_calls += 1
        if not self.packed and self._batch_documents() is not None:
            # the strategy refuses it before the forward, on every rank
            raise packed_documents_error(self.context.model_name or "the model", self.name)
        c = self.chunk(local_len)
        if halo > c:
            halves = self.context.ring if self.context.chunk_size is None else 1
            raise halo_error(self.name, halo, c, local_len, ring=halves)
        return c

    def documents(self, local_len: int, batch: int, halo: int, device: torch.device) -> Documents | None:
        """The packed documents of this call's segments (:class:`Documents`), ``None`` for one document per
        row. ``batch`` rows of ``local_len`` tokens; ``halo``: the tokens before each segment whose ids are
        needed (a convolution's k-1). From the batch's GLOBAL document ids, no collective."""
        docs = self._batch_documents()
        if docs is None:
            return None
        _, world = group_rank_size(self.group)
        if docs.shape[-1] != world * local_len or docs.shape[0] not in (1, batch):
            raise ValueError(
                f"{self.name} runs on {batch} rows of {local_len} tokens per rank, but the batch's position ids "
                f"describe {docs.shape[0]} rows of {docs.shape[-1]} tokens over {world} ranks: the mixer was "
                "called on something other than the batch the model's forward received"
            )
        return Documents.build(
            docs.to(device).expand(batch, -1),
            self.chunk(local_len),
            self.context.global_index(local_len, device),
            halo,
        )

    def refuse(self, what: str) -> None:
        raise ValueError(
            f"{self.name} called {what}, which sequence-parallel training does not support (a cache, "
            "decoding, or a fused kernel that cannot take an entry state). Train with use_cache=False"
        )


@dataclass(frozen=True, eq=False)
class Documents:
    """Packed documents inside the ``N = u*b`` segments of one mixer call (stacked as :func:`to_segments`
    stacks them), and their *pieces*: the runs of one segment that belong to one document.

    Adapters run the model's own function on the pieces, each a row of ``W = h + L`` positions (``L``: the
    longest piece; ``h``: the halo a convolution reads before it), its tokens right-aligned behind neutral
    zeros: a zero input keeps a zero state zero (Mamba: ``Δ x Bᵀ = 0``; the delta rule: ``β = 0, g = 0``
    leave any state unchanged) and is a convolution's own zero padding, so each piece starts exactly as its
    document would alone. Only the segment's first piece continues a document from the segment before
    (``continues``): it alone takes the entry state and the halo. A segment holding a document start
    (``restarts``) passes no earlier state on: ``M = 0``, and gradients stop there too.

    ``ids`` ``(N, c)`` document ids; ``prev`` ``(N,)`` the id of the token before each segment (-1 at the
    sequence start); ``halo_ids`` ``(N, h)`` those of the ``h`` tokens before each segment; ``piece`` ``(N, c)``
    each token's piece; ``slot`` ``(N*c,)`` its flat position in ``(n_pieces, W)``; ``source``
    ``(n_pieces*W,)`` what fills each piece position: a token (``< N*c``), a halo value (``N*c + s*h + j``)
    or a zero (the last index); ``first`` / ``last`` ``(N,)`` each segment's first and last piece."""

    ids: torch.Tensor
    prev: torch.Tensor
    halo_ids: torch.Tensor
    piece: torch.Tensor
    slot: torch.Tensor
    source: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    width: int

    @classmethod
    def build(cls, docs: torch.Tensor, chunk: int, index: torch.Tensor, halo: int) -> Documents:
        """``docs`` ``(b, N_global)`` document ids, ``index`` ``(u*c,)`` the global index of each local token
        (``SequenceParallelContext.global_index``), ``chunk`` = c tokens per segment, ``halo`` = h."""
        dev = docs.device
        ids = to_segments(docs[:, index], 1, chunk)  # (N, c)
        starts = index[::chunk]  # (u,) global index of each local segment's first token

        def before(offsets: torch.Tensor) -> torch.Tensor:  # ids at starts + offsets (< 0: -1), (N, len)
            at = starts[:, None] + offsets  # (u, len)
            got = docs[:, at.clamp(min=0)].masked_fill(at < 0, -1)  # (b, u, len)
            return got.transpose(0, 1).flatten(0, 1)  # u-major, as to_segments

        halo_ids = before(torch.arange(-halo, 0, device=dev))
        prev = before(torch.full((1,), -1, device=dev))[:, 0]
        n, c = ids.shape
        new = torch.ones_like(ids, dtype=torch.bool)  # a new piece starts at token t of the segment
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]
        local_piece = new.long().cumsum(1) - 1  # (N, c): piece within its segment
        counts = local_piece[:, -1] + 1  # (N,)
        first = torch.cumsum(counts, 0) - counts
        piece = first[:, None] + local_piece  # (N, c)
        flat_piece = piece.reshape(-1)
        n_pieces = int(counts.sum())
        sizes = torch.bincount(flat_piece, minlength=n_pieces)  # (n_pieces,)
        length = int(sizes.max())
        width = halo + length
        offset = length - sizes  # leading zeros of each piece (its tokens right-aligned)
        flat = torch.arange(n * c, device=dev)
        pos = flat - (torch.cumsum(sizes, 0) - sizes)[flat_piece]  # position within the piece
        slot = flat_piece * width + halo + offset[flat_piece] + pos
        source = torch.full((n_pieces * width,), n * c + n * halo, dtype=torch.long, device=dev)
        source[slot] = flat
        if halo:  # the halo sits right before the segment's first piece; later pieces see zeros
            j = torch.arange(halo, device=dev)
            segs = torch.arange(n, device=dev)
            halo_slot = (first * width + offset[first])[:, None] + j  # (N, h)
            source[halo_slot.reshape(-1)] = (n * c + segs[:, None] * halo + j).reshape(-1)
        return cls(ids, prev, halo_ids, piece, slot, source, first, first + counts - 1, width)

    @property
    def continues(self) -> torch.Tensor:
        """``(N,)`` bool: the segment's first token continues the document of the token before it."""
        return self.ids[:, 0] == self.prev

    @property
    def restarts(self) -> torch.Tensor:
        """``(N,)`` bool: a document starts inside the segment (its first token included): ``M = 0``."""
        return ~self.continues | (self.ids[:, -1] != self.ids[:, 0])

    @property
    def entry(self) -> torch.Tensor:
        """``(N, c)`` bool: the tokens that see the segment's entry state (its first piece, if it continues)."""
        return (self.piece == self.first[:, None]) & self.continues[:, None]

    @property
    def final(self) -> torch.Tensor:
        """``(N, c)`` bool: the tokens of the segment's last piece (the only ones its exit state holds)."""
        return self.piece == self.last[:, None]

    @property
    def halo_mask(self) -> torch.Tensor:
        """``(N, h)`` bool: the halo tokens of the same document as the segment's first token."""
        return self.halo_ids == self.ids[:, :1]

    def gather(self, x: torch.Tensor, dim: int, halo: torch.Tensor | None = None) -> torch.Tensor:
        """Segments ``(N, ..., c, ...)`` (sequence dim ``dim``) and their halos ``(N, ..., h, ...)`` ->
        pieces ``(n_pieces, ..., W, ...)``."""
        dim = dim % x.dim()
        parts = [x]
        if halo is not None:  # halo tokens of another document are zeros (a document starts the segment)
            shape = [1] * halo.dim()
            shape[0], shape[dim] = halo.shape[0], halo.shape[dim]
            parts.append(halo * self.halo_mask.view(shape).to(halo.dtype))
        flat = torch.cat([p.movedim(dim, 1).flatten(0, 1) for p in parts])  # (N*c [+ N*h], ...)
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        if halo is None and self.halo_ids.shape[1]:  # no halo values: those slots are zeros too
            flat = torch.cat([flat[:-1], flat.new_zeros(self.halo_ids.numel() + 1, *flat.shape[1:])])
        return flat[self.source].unflatten(0, (-1, self.width)).movedim(1, dim)

    def scatter(self, y: torch.Tensor, dim: int) -> torch.Tensor:
        """The real tokens of pieces ``(n_pieces, ..., W, ...)`` -> segments ``(N, ..., c, ...)``."""
        dim = dim % y.dim()
        flat = y.movedim(dim, 1).flatten(0, 1)[self.slot]  # (N*c, ...)
        return flat.unflatten(0, tuple(self.ids.shape)).movedim(1, dim)


def to_segments(x: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """``x`` with local sequence dim ``dim`` (length u*c) -> segments stacked on the batch dim:
    ``(b, ..., u*c, ...)`` -> ``(u*b, ..., c, ...)``, u-major."""
    dim = dim % x.dim()
    u = x.shape[dim] // chunk
    return x.unflatten(dim, (u, chunk)).movedim(dim, 0).flatten(0, 1)


def from_segments(x: torch.Tensor, dim: int, u: int) -> torch.Tensor:
    """Inverse of :func:`to_segments`: ``(u*b, ..., c, ...)`` -> ``(b, ..., u*c, ...)``."""
    dim = dim % x.dim()
    return x.unflatten(0, (u, -1)).movedim(0, dim).flatten(dim, dim + 1)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def global_names(fn: Callable[..., Any]) -> set[str]:
    """The global names a function's innermost body (below its decorators) reads."""
    return _code_names(inspect.unwrap(fn).__code__)


def rebind(fn: Callable[..., Any], overrides: dict[str, Any]) -> Callable[..., Any]:
    """A copy of ``fn`` whose innermost body reads ``overrides`` in place of those module globals, its
    decorators kept: each wrapper layer (``functools.wraps``, which sets ``__wrapped__``) is copied with the
    closure cell that held the layer below pointing at the copy. The class and its other instances are
    untouched."""
    layers = [fn]
    while hasattr(layers[-1], "__wrapped__"):
        layers.append(layers[-1].__wrapped__)
    inner = layers[-1]
    scope = {**inner.__globals__, **overrides}
    new = types.FunctionType(inner.__code__, scope, inner.__name__, inner.__defaults__, inner.__closure__)
    new.__kwdefaults__ = inner.__kwdefaults__
    for layer, below in reversed(list(itertools.pairwise(layers))):
        cells = layer.__closure__ or ()
        if not any(cell.cell_contents is below for cell in cells):
            raise TypeError(
                f"cannot rebind {fn.__qualname__}: its decorator {layer.__qualname__} does not hold the function "
                "it wraps in a closure, so the sequence-parallel kernels cannot be put below it"
            )
        closure = tuple(types.CellType(new) if cell.cell_contents is below else cell for cell in cells)
        copy = types.FunctionType(
            layer.__code__, layer.__globals__, layer.__name__, layer.__defaults__, closure
        )
        copy.__kwdefaults__ = layer.__kwdefaults__
        copy.__wrapped__ = new
        new = copy
    return new
