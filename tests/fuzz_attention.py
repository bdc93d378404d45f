"""Randomized differential testing of the attention core: ``ulysses_attention`` and ``fpdt_attention``.

:func:`attention_cases` draws what the public API accepts — P in {1, 2, 4}; query and kv heads (GQA,
``h_kv < P``, ``h < P``, ``h % P != 0``); head dim; batch; chunk size and chunks per rank; causal or
not; packed documents of random lengths, given as position ids or as ``documents`` (length-1 documents, documents spanning ranks, documents
inside one chunk, cuts on chunk and rank edges so that whole kv chunks are skipped); a sliding window;
soft-capping; sinks; FPDT offload and overlap; compute tiles; backend; float32 / float64.
:func:`run_attention` runs one case on every rank (forward and backward, gathered) against
``reference.reference_attention`` in float64 on the whole sequence: output, dq, dk, dv and the sinks'
gradient within :data:`TOLERANCE` (relative to each reference tensor's largest value, see
:data:`FLOOR`), or a clear refusal (``fuzz_common``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fuzz_common import REFUSALS, refusal_or_raise
from hypothesis import assume
from hypothesis import strategies as st

from helpers.reference import reference_attention
from lightning_longctx import gather_sequence, shard_sequence
from lightning_longctx.attention import fpdt_attention, ulysses_attention
from lightning_longctx.sharding import document_ids

TOLERANCE = 1e-4
TIMEOUT_S = 60.0  # per example: a hang is a failure naming the ranks and the case, not a stuck run
#: A tensor whose reference is zero up to cancellation (dq and dk when every row attends only to itself)
#: is compared against this fraction of the largest reference value of the case instead of its own
#: largest value, which would be float64 noise: any error above TOLERANCE * FLOOR = 1e-6 of it still fails.
FLOOR = 1e-2
MAX_TOKENS = 96  # whole sequence: keeps one example well under a second


@dataclass(frozen=True)
class AttnCase:
    """One drawn call. ``N = world * chunk_size * chunks``; Ulysses shards the same N contiguously.
    ``docs``: per batch row, the lengths of its packed documents (summing to N), or None (one document)."""

    world: int
    mode: str  # "ulysses" | "fpdt"
    b: int
    h: int
    h_kv: int
    d: int
    chunk_size: int
    chunks: int
    causal: bool = True
    docs: tuple[tuple[int, ...], ...] | None = None
    documents: bool = False  # hand the packed documents over as ``documents`` (per batch), not position ids
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    offload: bool = False
    overlap: bool = True
    block_size: int = 1024
    backend: str = "auto"
    dtype: str = "float32"
    seed: int = 0

    @property
    def seq_len(self) -> int:
        return self.world * self.chunk_size * self.chunks


def _doc_lengths(draw: st.DrawFn, n: int, chunk: int, local: int) -> tuple[int, ...]:
    """Lengths summing to ``n``: cuts anywhere, on chunk / rank edges and one token off them (so whole
    kv chunks fall outside a document, documents sit inside one chunk, or one token long)."""
    edges = sorted({e + off for step in (chunk, local) for e in range(step, n, step) for off in (-1, 0, 1)})
    edges = [e for e in edges if 0 < e < n]
    anywhere = st.integers(1, n - 1)
    pick = st.one_of(anywhere, st.sampled_from(edges)) if edges else anywhere
    cuts = sorted(set(draw(st.lists(pick, max_size=min(n - 1, 6))))) if n > 1 else []
    bounds = [0, *cuts, n]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


@st.composite
def attention_cases(draw: st.DrawFn, worlds: tuple[int, ...] = (1, 2, 4)) -> AttnCase:
    world = draw(st.sampled_from(worlds))
    mode = draw(st.sampled_from(["ulysses", "fpdt"]))
    h_kv = draw(st.integers(1, 4))
    h = h_kv * draw(st.integers(1, 3))  # GQA groups of 1-3; h < P and h % P != 0 both occur
    chunk = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    chunks = draw(st.integers(1, 4))
    n = world * chunk * chunks
    assume(n <= MAX_TOKENS)
    b = draw(st.integers(1, 2))
    packed = draw(st.booleans())
    docs = tuple(_doc_lengths(draw, n, chunk, n // world) for _ in range(b)) if packed else None
    fpdt = mode == "fpdt"
    return AttnCase(
        world=world,
        mode=mode,
        b=b,
        h=h,
        h_kv=h_kv,
        d=draw(st.sampled_from([4, 8, 16])),
        chunk_size=chunk,
        chunks=chunks,
        causal=draw(st.booleans()),
        docs=docs,
        documents=packed and draw(st.booleans()),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, n + 2))),
        softcap=draw(st.one_of(st.none(), st.sampled_from([0.5, 2.0, 20.0]))),
        sinks=draw(st.booleans()),
        offload=fpdt and draw(st.booleans()),
        overlap=not fpdt or draw(st.booleans()),
        block_size=draw(st.sampled_from([1024, 2, 3, 5])) if fpdt else 1024,
        backend=draw(st.sampled_from(["auto", "math", "sdpa"] if not fpdt else ["auto", "math", "fused"])),
        dtype=draw(st.sampled_from(["float32", "float64"])),
        seed=draw(st.integers(0, 2**16)),
    )


def positions(docs: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """``(b, N)`` position ids restarting at 0 at each document."""
    return torch.tensor([[t for length in row for t in range(length)] for row in docs])


def _inputs(case: AttnCase) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    n = case.seq_len

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return {
        "q": randn(case.b, n, case.h, case.d),
        "k": randn(case.b, n, case.h_kv, case.d),
        "v": randn(case.b, n, case.h_kv, case.d),
        "w": randn(case.b, n, case.h, case.d),  # upstream gradient
        "sinks": randn(case.h) if case.sinks else None,
        "pos": None if case.docs is None else positions(case.docs),
    }


def _reference(case: AttnCase, x: dict) -> list[torch.Tensor]:
    """Output, dq, dk, dv (and dsinks) of full attention in float64 on the whole sequence."""
    leaves = [x[n].double().requires_grad_() for n in ("q", "k", "v")]
    sinks = None if x["sinks"] is None else x["sinks"].double().requires_grad_()
    out = reference_attention(
        *leaves,
        causal=case.causal,
        position_ids=x["pos"],
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        sinks=sinks,
    )
    (out * x["w"].double()).sum().backward()
    grads = [t.grad for t in leaves] + ([] if sinks is None else [sinks.grad])
    return [out.detach(), *grads]


def run_attention(case: AttnCase) -> tuple[str, object]:
    """On every rank of the default group: ``("ran", worst relative error)`` or ``("refused", message)``."""
    assert dist.get_world_size() == case.world
    x = _inputs(case)
    c = case.chunk_size if case.mode == "fpdt" else None

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, chunk_size=c)

    loc = [shard(x[n]).requires_grad_() for n in ("q", "k", "v")]
    sinks = None if x["sinks"] is None else x["sinks"].clone().requires_grad_()
    kw = dict(
        causal=case.causal,
        position_ids=None if x["pos"] is None or case.documents else shard(x["pos"]),
        documents=document_ids(x["pos"]) if case.documents else None,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        sinks=sinks,
        backend=case.backend,
    )
    try:
        if case.mode == "fpdt":
            out = fpdt_attention(*loc, chunk_size=c, offload=case.offload, overlap=case.overlap,
                                 block_size=case.block_size, **kw)  # fmt: skip
        else:
            out = ulysses_attention(*loc, **kw)
        (out * shard(x["w"])).sum().backward()
    except REFUSALS as e:
        return refusal_or_raise(e)
    got = [gather_sequence(t, chunk_size=c) for t in (out.detach(), *(t.grad for t in loc))]
    if sinks is not None:  # each rank gave the heads it owns; the sum over the group is the gradient
        dsinks = sinks.grad.clone()
        dist.all_reduce(dsinks)
        got.append(dsinks)
    want = _reference(case, x)
    floor = FLOOR * max(float(b.abs().max()) for b in want)
    worst = 0.0
    for a, b in zip(got, want):
        scale = max(float(b.abs().max()), floor)
        worst = max(worst, float((a.double() - b).abs().max()) / scale)
    return "ran", worst
