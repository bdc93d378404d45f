"""The attention of one sequence layout, chosen once: :func:`choose_attention`.

Each layout has its attention function, each with its own signature: ``ulysses_attention`` (contiguous),
``fpdt_attention`` (FPDT's chunks), ``usp_attention`` (Ulysses x ring) and ``fpdt_ring_attention`` (FPDT x
ring). A model patched for one layout calls one :class:`Attend`, picked from its
:class:`~lightning_longctx.parallel.layout.SequenceLayout` (chunks or not, ring or not) when it is patched,
with its process groups, kernel backend, offload and overlap bound then::

    attend(q, k, v, *, causal, scale, documents, position_ids, sliding_window, softcap, sinks) -> out

``q`` ``(b, s/P, h, d)``, ``k``/``v`` ``(b, s/P, h_kv, d)`` this rank's shard in the layout's local order; out
``(b, s/P, h, d)``. ``documents`` ``(b, N)``: the batch's document ids in global order; else ``position_ids``
``(b, s/P)`` GLOBAL positions, gathered once per call into them; neither: one document per row. The FPDT chunk
of a call is its layout's ``local_chunk`` of the shard's length: a short sequence runs one chunk of its local
length. Nothing here knows of Hugging Face or Lightning.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from lightning_longctx.attention.fpdt import fpdt_attention
from lightning_longctx.attention.fpdt_ring import fpdt_ring_attention
from lightning_longctx.attention.ring import usp_attention
from lightning_longctx.attention.ulysses import prepare_ulysses, ulysses_all_to_all
from lightning_longctx.parallel.comm import Group
from lightning_longctx.parallel.layout import SequenceLayout
from lightning_longctx.parallel.sharding import document_ids


class Attend(Protocol):
    """Exact attention over the sequence of one layout (module doc)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        scale: float | None = None,
        documents: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True, eq=False)
class AttentionSetup:
    """What a patched model's attention binds: its layout, the whole sp group (``layout.sp`` ranks) and, with
    a ring, its two parts (the world mesh's ``ring_group`` and ``ulysses_group``); the kernel ``backend``;
    FPDT's ``offload`` (host memory) and ``overlap`` (background all-to-alls)."""

    layout: SequenceLayout
    group: Group = None
    ring_group: Group = None
    ulysses_group: Group = None
    backend: str = "auto"
    offload: bool = False
    overlap: bool = True


def _ulysses(
    setup: AttentionSetup,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The contiguous layout: Ulysses' all-to-all around one kernel, or, where SDPA would need a dense
    ``(N, N)`` mask (``ulysses.prepare_ulysses``), FPDT's blocks with one chunk of the local length."""
    features = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    call = prepare_ulysses(
        q, k, v, group=setup.group, position_ids=position_ids, documents=documents, backend=setup.backend,
        **features,
    )  # fmt: skip
    if call.on_blocks:
        return fpdt_attention(
            q, k, v, group=setup.group, chunk_size=q.shape[1], causal=causal, softmax_scale=scale,
            documents=call.documents, **features,
        )  # fmt: skip
    return ulysses_all_to_all(
        q, k, v, call, group=setup.group, causal=causal, softmax_scale=scale, **features
    )


def _fpdt(
    setup: AttentionSetup,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """FPDT's strided chunks."""
    return fpdt_attention(
        q, k, v, group=setup.group, chunk_size=setup.layout.local_chunk(q.shape[1]), causal=causal,
        softmax_scale=scale, position_ids=position_ids, offload=setup.offload, backend=setup.backend,
        sliding_window=sliding_window, softcap=softcap, sinks=sinks, overlap=setup.overlap, documents=documents,
    )  # fmt: skip


def _ring_inputs(
    setup: AttentionSetup,
    local_len: int,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What both ring layouts take: k and v in one dtype (they travel in one buffer; under autocast k is
    fp32 after RoPE, v bf16) and the batch's document ids in global order (from the positions of the shards
    of ``local_len`` tokens, gathered)."""
    if documents is None and position_ids is not None:
        layout = setup.layout.for_local(local_len)
        documents = document_ids(layout.gather(position_ids, setup.group))
    if k.dtype != v.dtype:
        k, v = (x.to(torch.promote_types(k.dtype, v.dtype)) for x in (k, v))
    return k, v, documents


def _usp(
    setup: AttentionSetup,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ulysses x ring: zigzag over the ring (the layout's ring view)."""
    k, v, documents = _ring_inputs(setup, q.shape[1], k, v, documents, position_ids)
    return usp_attention(
        q, k, v, ulysses_group=setup.ulysses_group, ring_group=setup.ring_group,
        layout=setup.layout.ring_view(q.shape[1] * setup.layout.sp), causal=causal, softmax_scale=scale,
        documents=documents, backend=setup.backend, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
    )  # fmt: skip


def _fpdt_ring(
    setup: AttentionSetup,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """FPDT x ring: FPDT's chunks inside each ring rank's zigzag chunks."""
    k, v, documents = _ring_inputs(setup, q.shape[1], k, v, documents, position_ids)
    return fpdt_ring_attention(
        q, k, v, ulysses_group=setup.ulysses_group, ring_group=setup.ring_group,
        chunk_size=setup.layout.local_chunk(q.shape[1]), causal=causal, softmax_scale=scale,
        documents=documents, backend=setup.backend, offload=setup.offload, sliding_window=sliding_window,
        softcap=softcap, sinks=sinks,
    )  # fmt: skip


#: The attention of each layout, by (FPDT chunks, a ring).
_ATTENTION: dict[tuple[bool, bool], Callable[..., torch.Tensor]] = {
    (False, False): _ulysses,
    (True, False): _fpdt,
    (False, True): _usp,
    (True, True): _fpdt_ring,
}


def choose_attention(setup: AttentionSetup) -> Attend:
    """The attention of ``setup.layout`` with ``setup`` bound: called as :class:`Attend`."""
    layout = setup.layout
    return functools.partial(_ATTENTION[(layout.chunk_size is not None, layout.ring > 1)], setup)


def with_layout(attend: Attend, layout: SequenceLayout) -> Attend:
    """``attend``'s setup (groups, kernel, offload) over another layout: the self-test's probe runs two short FPDT
    chunks per rank through the model's own attention."""
    return choose_attention(dataclasses.replace(attend.args[0], layout=layout))
