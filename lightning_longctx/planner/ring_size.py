"""``ring_size``: which r a plan runs Ulysses x ring with, and why (``lightning-longctx plan`` prints it).

The rule of ``ring_size="auto"`` is :func:`lightning_longctx.config.auto_ring_size`: 1 while the sequence-parallel
size fits the query heads of one tensor-parallel rank, else the smallest r dividing it with ``sp / r`` within
them. :func:`ring_choice` settles it for a plan's keywords and says what it means per rank: the Ulysses degree U
against the heads, the tokens each ring rank holds and the k/v block each ring step passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_longctx.config import auto_ring_size
from lightning_longctx.planner.plan import plan_per_rank
from lightning_longctx.planner.report import format_bytes


@dataclass(frozen=True, kw_only=True)
class RingChoice:
    """The ring of one plan: ``given`` (an int or ``"auto"``), the ``ring_size`` r it runs, ``auto`` (what
    ``"auto"`` picks for the same plan), the query and kv ``heads`` / ``kv_heads`` of one tensor-parallel rank,
    the padded tokens per ring rank (``N / r``) and the bytes of one k/v block a ring step passes (0 at r = 1)."""

    given: int | str
    ring_size: int
    auto: int
    sequence_parallel_size: int
    tensor_parallel_size: int
    heads: int
    kv_heads: int
    tokens_per_ring_rank: int
    block_bytes: int

    @property
    def ulysses(self) -> int:
        """U = sp / r: the ranks of one all-to-all."""
        return self.sequence_parallel_size // self.ring_size

    def text(self) -> str:
        """One line: r, and why: U against the heads per TP rank, the ring's blocks and tokens per ring rank."""
        how = " (auto)" if self.given == "auto" else ""
        fits = "fits" if self.ulysses <= self.heads else "exceeds"
        line = (
            f"ring_size {self.ring_size}{how}: Ulysses {self.ulysses} {fits} {self.heads} heads per tp rank"
        )
        if self.ring_size == 1:
            return line + "; no ring"
        return (
            f"{line}; ring {self.ring_size} passes {format_bytes(self.block_bytes)} k/v blocks "
            f"({self.tokens_per_ring_rank:,} tokens per ring rank, {self.kv_heads} kv heads per tp rank)"
        )

    def hint(self) -> str | None:
        """When U exceeds the heads per TP rank (ranks of the all-to-all hold no head): what "auto" picks."""
        if self.ulysses <= self.heads:
            return None
        idle = self.ulysses - self.heads
        return (
            f"Ulysses {self.ulysses} (sequence_parallel_size {self.sequence_parallel_size} / ring_size "
            f"{self.ring_size}) > {self.heads} heads per tp rank: {idle} of each all-to-all's ranks hold no head; "
            f"ring_size='auto' would pick {self.auto} (Ulysses {self.sequence_parallel_size // self.auto} x ring "
            f"{self.auto})"
        )


def ring_choice(
    config: Any, *, seq_len: int, sequence_parallel_size: int, ring_size: int | str = 1, **plan_kwargs: Any
) -> RingChoice:
    """The ring :func:`~lightning_longctx.planner.plan_memory` plans for the same keywords (``ring_size`` an int
    or ``"auto"``), with the figures that explain it."""
    lay = plan_per_rank(
        config,
        seq_len=seq_len,
        sequence_parallel_size=sequence_parallel_size,
        ring_size=ring_size,
        **plan_kwargs,
    )
    return RingChoice(
        given=ring_size,
        ring_size=lay.ring,
        auto=auto_ring_size(lay.sp, max(1, lay.heads_tp)),
        sequence_parallel_size=lay.sp,
        tensor_parallel_size=lay.tp,
        heads=lay.heads_tp,
        kv_heads=lay.shape.kv_heads // lay.tp,
        tokens_per_ring_rank=lay.padded // lay.ring,
        block_bytes=lay.ring_block_bytes,
    )
