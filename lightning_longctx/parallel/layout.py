"""Which global tokens each sequence-parallel rank holds: the ONE encoding of the sequence layouts.

Four layouts of a global sequence of N tokens over P = ``sp`` ranks, one value each,
``SequenceLayout(sp=P, ring=r, chunk_size=c)``:

* contiguous (``chunk_size=None``, ``ring=1``; Ulysses): rank s holds tokens ``[s*N/P, (s+1)*N/P)``.
* FPDT (``chunk_size=c``): the sequence is cut into chunks of c tokens and rank s holds chunks
  ``s, s+P, s+2P, ...`` in that order, so that after the all-to-all of its i-th local chunk every rank holds
  the contiguous global segment i (``P*c`` tokens).
* Ulysses x ring (``ring=r > 1``, ``U = P / r``): the ring's :class:`RingLayout` (zigzag) cuts the sequence
  into ``2r`` chunks, ring rank j holds chunks j and ``2r-1-j`` (equal causal work), and sp rank
  ``s = j*U + u`` holds piece u of U equal pieces of them (``RingLayout.sp_shard``), so the Ulysses all-to-all
  gives ring rank j its two chunks in order.
* FPDT x ring (``ring=r > 1`` and ``chunk_size=c``): ring rank j's ``N/r`` tokens (its two zigzag chunks, in
  order) are laid out over its U Ulysses ranks as FPDT lays a sequence out over P ranks: cut into segments of
  ``U*c`` tokens, sp rank ``(j, u)`` holds chunk u of each. ``N % (2*P*c) == 0``, so no segment straddles the
  two zigzag chunks: every local chunk is a run of c consecutive global tokens.

One rule builds all four (:meth:`SequenceLayout.index`): ring rank j's tokens in the ring view
(:meth:`SequenceLayout.ring_view`; at r = 1 the whole sequence) are cut into segments of ``U*c`` tokens and sp
rank ``(j, u)`` takes chunk u of each, with ``c = N/P`` (one segment) without ``chunk_size``. The zigzag itself
lives in :meth:`RingLayout.chunks`, which ring attention (``attention/ring.py``, ``attention/fpdt_ring.py``)
reads too.

The chunk of one sequence: ``chunk_size`` is the configured FPDT chunk per rank; a sequence shorter than
``P*chunk_size`` (``2*P*chunk_size`` with a ring) runs one chunk of its local length (half of it with a ring:
a chunk never straddles a ring rank's two zigzag chunks): :meth:`~SequenceLayout.chunk_for` and
:meth:`~SequenceLayout.local_chunk` say which, :meth:`~SequenceLayout.for_length` and
:meth:`~SequenceLayout.for_local` give the layout of that one sequence. The maps (``index``,
``global_index``, ``shard``, ``unshard``, ``gather``) act at exactly ``chunk_size``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Literal

import torch

from lightning_longctx.parallel.comm import Group, all_gather_no_grad, group_rank_size

#: The layouts of a ring: "zigzag" (chunks j and 2r-1-j, causal balance) and "contiguous".
RING_LAYOUTS = ("zigzag", "contiguous")
#: Chunks of the sequence each ring rank holds, per layout kind.
_CHUNKS_PER_RANK = {"zigzag": 2, "contiguous": 1}


@dataclass(frozen=True, kw_only=True)
class RingLayout:
    """Which global tokens each rank of a ring of ``ring_size`` ranks holds, for a sequence of ``seq_len``.

    ``kind="zigzag"``: ``2 * ring_size`` chunks of ``seq_len / (2 * ring_size)`` tokens, rank j holds chunk
    j then chunk ``2r-1-j`` (causal work is the same on every rank); ``"contiguous"``: ``ring_size`` chunks,
    rank j holds chunk j. A rank's local tensors are its chunks concatenated in that order:
    ``(b, seq_len / ring_size, ...)``."""

    ring_size: int
    seq_len: int
    kind: Literal["zigzag", "contiguous"] = "zigzag"

    def __post_init__(self) -> None:
        if not isinstance(self.ring_size, int) or self.ring_size < 1:
            raise ValueError(f"ring_size must be a positive number of ranks, got {self.ring_size!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"seq_len must be a positive number of tokens, got {self.seq_len!r}")
        if self.kind not in RING_LAYOUTS:
            raise ValueError(f"ring layout kind {self.kind!r} is unknown; choose one of {list(RING_LAYOUTS)}")
        if self.seq_len % self.num_chunks:
            rule = "2 x ring_size" if self.kind == "zigzag" else "ring_size"
            raise ValueError(
                f"seq_len {self.seq_len} is not divisible by {rule} = {self.num_chunks} (the {self.kind} layout "
                f"cuts the sequence into {self.num_chunks} equal chunks); pad the sequence to a multiple of "
                f"{self.num_chunks}"
            )

    @property
    def num_chunks(self) -> int:
        """Chunks the sequence is cut into: ``2r`` (zigzag) or ``r`` (contiguous)."""
        return _CHUNKS_PER_RANK[self.kind] * self.ring_size

    @property
    def chunk_len(self) -> int:
        """Tokens per chunk."""
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        """Tokens per rank, ``seq_len / ring_size``."""
        return self.seq_len // self.ring_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ring_size:
            raise ValueError(
                f"ring rank {rank} is outside the ring of {self.ring_size} ranks [0, {self.ring_size})"
            )

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Global chunk indices that ``rank`` holds, in local order (the zigzag: ``(j, 2r-1-j)``)."""
        self._check_rank(rank)
        return (rank, 2 * self.ring_size - 1 - rank) if self.kind == "zigzag" else (rank,)

    def runs(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` of each run of consecutive global tokens ``rank`` holds, in local order; chunks
        that follow each other in the sequence form one run (zigzag rank r-1 holds chunks r-1 and r)."""
        c = self.chunk_len
        runs: list[tuple[int, int]] = []
        for chunk in self.chunks(rank):
            if runs and runs[-1][0] + runs[-1][1] == chunk * c:
                runs[-1] = (runs[-1][0], runs[-1][1] + c)
            else:
                runs.append((chunk * c, c))
        return tuple(runs)

    def global_index(self, rank: int, device: torch.device | None = None) -> torch.Tensor:
        """``(seq_len / ring_size,)`` global token index of each of ``rank``'s local tokens."""
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.runs(rank)])

    def _check_length(self, x: torch.Tensor, dim: int, what: str) -> int:
        dim = dim % x.dim()
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"{what}: dim {dim} of shape {tuple(x.shape)} has {x.shape[dim]} tokens, the layout's seq_len is "
                f"{self.seq_len}; pass the whole sequence along dim {dim} (or the right dim=)"
            )
        return dim

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s part of ``x`` (``seq_len`` tokens along ``dim``, global order), in local order:
        ``seq_len / ring_size`` tokens along ``dim``."""
        dim = self._check_length(x, dim, "shard")
        return torch.cat([x.narrow(dim, s, n) for s, n in self.runs(rank)], dim=dim)

    def sp_shard(
        self, x: torch.Tensor, ring_rank: int, ulysses_rank: int, ulysses: int, dim: int = 1
    ) -> torch.Tensor:
        """Sp rank ``(j, u)``'s part of ``x`` under 2-D sequence parallelism (``usp_attention``): piece u of
        ``ulysses`` equal pieces of ring rank j's tokens, ``seq_len / (ring_size * ulysses)`` along ``dim``;
        the Ulysses all-to-all concatenates the pieces in u order, so ring rank j then holds exactly
        :meth:`shard`'s tokens (for zigzag: its two chunks, no reordering)."""
        part = self.shard(x, ring_rank, dim)
        dim = dim % x.dim()
        if not 0 <= ulysses_rank < ulysses or part.shape[dim] % ulysses:
            raise ValueError(
                f"ulysses rank {ulysses_rank} of {ulysses}: a ring rank's {part.shape[dim]} tokens must split into "
                f"{ulysses} equal pieces; make seq_len a multiple of ring_size x ulysses (x 2 for zigzag)"
            )
        return part.chunk(ulysses, dim=dim)[ulysses_rank]

    def unshard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: ``x`` holds every rank's local part concatenated in rank order along
        ``dim`` (what an all-gather gives); returns the ``seq_len`` tokens in global order."""
        dim = self._check_length(x, dim, "unshard")
        c = self.chunk_len
        by_chunk: dict[int, torch.Tensor] = {}
        for rank, part in enumerate(x.split(self.local_len, dim=dim)):
            for chunk, piece in zip(self.chunks(rank), part.split(c, dim=dim)):
                by_chunk[chunk] = piece
        return torch.cat([by_chunk[i] for i in range(self.num_chunks)], dim=dim)


@functools.lru_cache(maxsize=256)
def _ring_view(ring_size: int, seq_len: int, kind: str) -> RingLayout:
    """One :class:`RingLayout` per shape: every attention layer of a step reads the same one."""
    return RingLayout(ring_size=ring_size, seq_len=seq_len, kind=kind)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class SequenceLayout:
    """The layout of a sequence over ``sp`` sequence-parallel ranks (module doc): contiguous, FPDT's strided
    chunks (``chunk_size``), zigzag over a ring of ``ring`` ranks x Ulysses of ``sp / ring``, or both.

    ``chunk_size``: tokens per FPDT chunk per rank (``None``: no chunks), the chunk of every sequence long
    enough for it (:meth:`chunk_for`). Tensors are ``(..., N, ...)`` along ``dim`` in global order, a rank's
    shard ``(..., N/sp, ...)`` in its local order; sp rank ``s = j * (sp / ring) + u`` is Ulysses rank u of
    ring rank j (the world mesh's flattened sp axis)."""

    sp: int
    ring: int = 1
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sp, bool) or not isinstance(self.sp, int) or self.sp < 1:
            raise ValueError(f"sp must be a positive number of sequence-parallel ranks, got {self.sp!r}")
        ring = self.ring
        if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1 or self.sp % ring:
            raise ValueError(
                f"ring={ring} must be a positive divisor of the sequence-parallel size {self.sp}"
            )
        c = self.chunk_size
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"chunk_size must be a positive number of tokens, got {c}")

    @property
    def ulysses(self) -> int:
        """Ranks of one Ulysses group, ``sp / ring``."""
        return self.sp // self.ring

    @property
    def kind(self) -> Literal["zigzag", "contiguous"]:
        """The ring view's kind: zigzag over a ring, contiguous without one."""
        return "zigzag" if self.ring > 1 else "contiguous"

    @property
    def _chunks_per_ring_rank(self) -> int:
        return _CHUNKS_PER_RANK[self.kind]

    # ---- the chunk of one sequence ----
    def chunk_for(self, seq_len: int) -> int | None:
        """Tokens per FPDT chunk per rank for a global sequence of ``seq_len`` tokens: ``chunk_size``, or one
        chunk of the local length for a shorter sequence (half of it with a ring) (``None``: no chunks)."""
        if self.chunk_size is None:
            return None
        return min(self.chunk_size, -(-seq_len // (self.sp * self._chunks_per_ring_rank)))

    def local_chunk(self, local_len: int) -> int | None:
        """The chunk of a call whose shard holds ``local_len`` tokens: :meth:`chunk_for`'s rule seen from the
        local length that :meth:`pad_length` made (``None``: no chunks)."""
        if self.chunk_size is None:
            return None
        return min(self.chunk_size, local_len // self._chunks_per_ring_rank)

    def for_length(self, seq_len: int) -> SequenceLayout:
        """The layout a sequence of ``seq_len`` tokens is cut in (its chunk: :meth:`chunk_for`)."""
        c = self.chunk_for(seq_len)
        return self if c == self.chunk_size else replace(self, chunk_size=c)

    def for_local(self, local_len: int) -> SequenceLayout:
        """The layout of a call whose shard holds ``local_len`` tokens (its chunk: :meth:`local_chunk`)."""
        c = self.local_chunk(local_len)
        return self if c == self.chunk_size else replace(self, chunk_size=c)

    @property
    def multiple(self) -> int:
        """Every length this layout cuts is a multiple of it: ``sp x chunk_size`` (``sp`` without chunks), x 2
        with a ring (its 2r zigzag chunks, each ring rank's split over its Ulysses ranks)."""
        return self.sp * (self.chunk_size or 1) * self._chunks_per_ring_rank

    def pad_length(self, seq_len: int) -> int:
        """Tokens appended at the end of a sequence of ``seq_len`` so that it lays out at its chunk
        (:meth:`for_length`)."""
        return -seq_len % self.for_length(seq_len).multiple

    # ---- the map, at exactly chunk_size ----
    def _check_length(self, seq_len: int) -> None:
        if seq_len % self.multiple == 0:
            return
        world, ring, c = self.sp, self.ring, self.chunk_size
        if ring > 1:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {self.multiple} (ring_size={ring}: 2 x {ring} "
                f"zigzag chunks, each ring rank's split over {self.ulysses} Ulysses ranks"
                + ("" if c is None else f" in FPDT chunks of {c}")
                + "); pad the sequence (shard_batch does)"
            )
        if c is None:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by the sequence-parallel size {world}; "
                "pad it to a multiple of it (shard_batch does this for you)"
            )
        raise ValueError(
            f"sequence length {seq_len} is not divisible by sequence-parallel size x chunk_size = "
            f"{world} x {c} = {world * c}; pad the sequence (shard_batch does) "
            "or pick a chunk_size that divides the local length"
        )

    def ring_view(self, seq_len: int) -> RingLayout:
        """The ring's layout of a sequence of ``seq_len`` tokens: which tokens each ring rank holds
        (zigzag; with ``ring=1`` one rank holding the whole sequence)."""
        return _ring_view(self.ring, seq_len, self.kind)

    def _rows(self, seq_len: int, ring_rank: int, device: torch.device | None) -> torch.Tensor:
        """``(U, N/sp)``: the global index of the tokens of ring rank j's U sp ranks. THE rule: its tokens in
        the ring view, cut into segments of ``U*c`` tokens, chunk u of each to Ulysses rank u."""
        c = seq_len // self.sp if self.chunk_size is None else self.chunk_size
        tokens = self.ring_view(seq_len).global_index(ring_rank, device)  # (N/r,) in local order
        return tokens.view(-1, self.ulysses, c).transpose(0, 1).reshape(self.ulysses, -1)

    def _row(self, seq_len: int, rank: int, device: torch.device | None) -> torch.Tensor:
        self._check_length(seq_len)
        if not 0 <= rank < self.sp:
            raise ValueError(f"rank {rank} is outside the {self.sp} sequence-parallel ranks [0, {self.sp})")
        ring_rank, u = divmod(rank, self.ulysses)
        return self._rows(seq_len, ring_rank, device)[u]

    def index(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """``(sp, seq_len / sp)``: the global index of every sp rank's tokens, in rank and local order."""
        self._check_length(seq_len)
        return torch.cat([self._rows(seq_len, j, device) for j in range(self.ring)])

    def global_index(self, local_len: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
        """``(local_len,)`` global token index of each of sp rank ``rank``'s ``local_len`` tokens (row ``rank``
        of :meth:`index`); no collective."""
        return self._row(local_len * self.sp, rank, device)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Sp rank ``rank``'s part of ``x`` (the whole sequence along ``dim``, global order), in local order:
        ``N / sp`` tokens along ``dim``."""
        dim = dim % x.dim()
        return x.index_select(dim, self._row(x.shape[dim], rank, x.device))

    def _unshard_index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        local = seq_len // self.sp
        if self.ring == 1 and self.chunk_size is not None and local % self.chunk_size:
            raise ValueError(f"local length {local} is not a multiple of chunk_size {self.chunk_size}")
        return self.index(seq_len, device).flatten()

    def unshard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: ``x`` holds every sp rank's shard concatenated in rank order along ``dim``
        (what an all-gather gives), ``N`` tokens; returns them in global order."""
        dim = dim % x.dim()
        index = self._unshard_index(x.shape[dim], x.device)
        return torch.empty_like(x).index_copy_(dim, index, x)

    def gather(self, x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
        """The whole sequence in global order on every rank of ``group`` (its ``sp`` ranks, in sp rank order)
        from each rank's shard ``x``: one all-gather, no autograd."""
        _, world = group_rank_size(group)
        if world != self.sp:
            raise ValueError(f"the group has {world} ranks, the layout {self.sp} sequence-parallel ranks")
        dim = dim % x.dim()
        index = self._unshard_index(x.shape[dim] * self.sp, x.device)  # refused before the collective
        stacked = all_gather_no_grad(x, group, dim=dim)  # (..., sp * local, ...)
        return torch.empty_like(stacked).index_copy_(dim, index, stacked)
