"""Randomized differential testing of the attention core: ``ulysses_attention``, ``fpdt_attention`` and
``usp_attention`` (Ulysses x ring).

:func:`attention_cases` draws what the public API accepts — P in {1, 2, 4}; in Ulysses mode a ring degree
r | P (r > 1: ``usp_attention`` over r rings of U = P / r Ulysses ranks, groups from the world mesh, sp rank
``j * U + u``) and the ring's layout (zigzag or contiguous); query and kv heads (GQA,
``h_kv < P``, ``h < P``, ``h % P != 0``); head dim; batch; chunk size and chunks per rank; causal or
not; packed documents of random lengths, given as position ids or as ``documents`` (length-1 documents, documents spanning ranks, documents
inside one chunk, cuts on chunk and rank edges so that whole kv chunks are skipped); a sliding window;
soft-capping; sinks; FPDT offload and overlap; compute tiles (FPDT and the ring); backend; float32 /
float64.
:func:`run_attention` runs one case on every rank (forward and backward, gathered) against
``reference.reference_attention`` in float64 on the whole sequence: output, dq, dk, dv and the sinks'
gradient within :data:`TOLERANCE` (relative to each reference tensor's largest value, see
:data:`FLOOR`), or a refusal the package documents for that call (:data:`EXPECTED_REFUSALS`; any other refusal
fails, ``fuzz_common``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fuzz_common import REFUSALS, ExpectedRefusal, refusal_or_raise
from hypothesis import assume
from hypothesis import strategies as st

from helpers.reference import reference_attention
from lightning_longctx import gather_sequence, shard_sequence
from lightning_longctx.attention import fpdt_attention, ulysses_attention
from lightning_longctx.attention.ring import RING_LAYOUTS, RingLayout, usp_attention
from lightning_longctx.parallel.mesh import ParallelDims, WorldMesh, build_world_mesh
from lightning_longctx.parallel.sharding import document_ids

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
    ``docs``: per batch row, the lengths of its packed documents (summing to N), or None (one document).
    ``ring_size > 1`` (mode "ulysses"): ``usp_attention`` with ``RingLayout(ring_size, N, ring_kind)``, each
    rank holding ``layout.sp_shard``'s tokens; the documents go as ``documents`` (the ring takes no position
    ids)."""

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
    ring_size: int = 1
    ring_kind: str = "zigzag"

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
def attention_cases(
    draw: st.DrawFn, worlds: tuple[int, ...] = (1, 2, 4), ring_only: bool = False
) -> AttnCase:
    """``ring_only``: Ulysses x ring cases alone (``ring_size > 1``; ``worlds`` without 1)."""
    world = draw(st.sampled_from(worlds))
    mode = "ulysses" if ring_only else draw(st.sampled_from(["ulysses", "fpdt"]))
    rings = [r for r in range(2 if ring_only else 1, world + 1) if world % r == 0]
    ring = 1 if mode == "fpdt" else draw(st.sampled_from(rings))
    kind = draw(st.sampled_from(RING_LAYOUTS)) if ring > 1 else "zigzag"
    h_kv = draw(st.integers(1, 4))
    h = h_kv * draw(st.integers(1, 3))  # GQA groups of 1-3; h < P (h < U) and h % P != 0 both occur
    chunk = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    chunks = draw(st.integers(1, 4))
    if kind == "zigzag" and (world * chunk * chunks) % (2 * ring):
        chunks *= 2  # zigzag cuts N into 2r equal chunks (N = r U chunk chunks: make it even)
    n = world * chunk * chunks
    assume(n <= MAX_TOKENS)
    b = draw(st.integers(1, 2))
    packed = draw(st.booleans())
    edge = n // (2 * ring if kind == "zigzag" else ring) if ring > 1 else chunk  # the blocks' edges
    docs = tuple(_doc_lengths(draw, n, edge, n // world) for _ in range(b)) if packed else None
    fpdt = mode == "fpdt"
    tiled = fpdt or ring > 1  # FPDT and the ring tile their blocks (block_size); Ulysses runs one kernel
    backends = ["auto", "math", "fused"] if fpdt else ["auto", "math", "sdpa"]
    if ring > 1:
        backends = ["auto", "math", "fused", "sdpa"]  # the ring runs FPDT's blocks and refuses "sdpa" by name
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
        documents=packed and (ring > 1 or draw(st.booleans())),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, n + 2))),
        softcap=draw(st.one_of(st.none(), st.sampled_from([0.5, 2.0, 20.0]))),
        sinks=draw(st.booleans()),
        offload=fpdt and draw(st.booleans()),
        overlap=not fpdt or draw(st.booleans()),
        block_size=draw(st.sampled_from([1024, 2, 3, 5])) if tiled else 1024,
        backend=draw(st.sampled_from(backends)),
        dtype=draw(st.sampled_from(["float32", "float64"])),
        seed=draw(st.integers(0, 2**16)),
        ring_size=ring,
        ring_kind=kind,
    )


#: The refusals the package documents for calls :func:`attention_cases` draws (the backends' limits), and why each
#: is expected; any other refusal fails (``fuzz_common.classify_refusal``).
EXPECTED_REFUSALS = (
    ExpectedRefusal(
        "fused block kernel with soft-capping",
        applies=lambda c: c.backend == "fused" and c.softcap is not None,
        message=r"no fused block kernel applies logit soft-capping",
        reason="docs/troubleshooting.md: FPDT and the ring take 'fused' blocks, which have no soft-cap; "
        "backend='auto' picks the math blocks",
    ),
    ExpectedRefusal(
        "sdpa with soft-capping",
        applies=lambda c: c.backend == "sdpa" and c.softcap is not None,
        message=r"the 'sdpa' backend cannot apply logit softcapping",
        reason="PyTorch's scaled_dot_product_attention has no soft-cap (docs/benchmarks.md, the fuzz's refusals)",
    ),
    ExpectedRefusal(
        "sdpa with sinks",
        applies=lambda c: c.backend == "sdpa" and c.sinks,
        message=r"backend cannot add attention sinks",
        reason="docs/troubleshooting.md: sdpa gives no differentiable log-sum-exp to add the sinks to",
    ),
    ExpectedRefusal(
        "sdpa in the ring",
        applies=lambda c: c.backend == "sdpa" and c.ring_size > 1,
        message=r"computes its blocks with kernels that return the log-sum-exp",
        reason="docs/troubleshooting.md: the ring merges FPDT's blocks by their log-sum-exp, which sdpa does not "
        "return",
    ),
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


#: (world, ring) -> this process's world mesh: the pool's ranks live for many cases, and every rank builds the
#: same meshes in the same order (each runs every case), so each is built once per process, not per case
_MESHES: dict[tuple[int, int], WorldMesh] = {}


def _world_mesh(world: int, ring: int) -> WorldMesh:
    if (world, ring) not in _MESHES:
        _MESHES[world, ring] = build_world_mesh(ParallelDims(world_size=world, sp=world, ring=ring), "cpu")
    return _MESHES[world, ring]


#: what a runner gives: this rank's out, dq, dk, dv, its sinks leaf (or None), and ``pair(got, reference)`` that
#: puts one of them beside the whole-sequence reference tensor (both gathered, or both this rank's shard)
Ran = tuple[list[torch.Tensor], torch.Tensor | None, Callable[[torch.Tensor, torch.Tensor], tuple]]


def _usp(case: AttnCase, x: dict) -> Ran:
    """Ulysses x ring on this rank, compared shard by shard (``layout.sp_shard`` of the reference); the
    groups as the strategy builds them (``build_world_mesh``, as ``tests/test_ring.py``
    ``test_usp_matches_full_attention``)."""
    rank = dist.get_rank()
    mesh = _world_mesh(case.world, case.ring_size)
    par = mesh.dims
    j, u, ulysses = par.ring_rank(rank), par.ulysses_rank(rank), par.ulysses
    layout = RingLayout(ring_size=case.ring_size, seq_len=case.seq_len, kind=case.ring_kind)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return layout.sp_shard(t, j, u, ulysses)

    loc = [shard(x[n]).requires_grad_() for n in ("q", "k", "v")]
    sinks = None if x["sinks"] is None else x["sinks"].clone().requires_grad_()
    out = usp_attention(
        *loc, ulysses_group=mesh.ulysses_group, ring_group=mesh.ring_group, layout=layout, causal=case.causal,
        sliding_window=case.sliding_window, documents=None if x["pos"] is None else document_ids(x["pos"]),
        softcap=case.softcap, sinks=sinks, backend=case.backend, block_size=case.block_size,
    )  # fmt: skip
    (out * shard(x["w"])).sum().backward()
    return [out.detach(), *(t.grad for t in loc)], sinks, lambda a, b: (a, shard(b))


def _ulysses_or_fpdt(case: AttnCase, x: dict) -> Ran:
    """``ulysses_attention`` / ``fpdt_attention`` on this rank, compared on the whole sequence
    (``gather_sequence``)."""
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
    if case.mode == "fpdt":
        out = fpdt_attention(*loc, chunk_size=c, offload=case.offload, overlap=case.overlap,
                             block_size=case.block_size, **kw)  # fmt: skip
    else:
        out = ulysses_attention(*loc, **kw)
    (out * shard(x["w"])).sum().backward()
    return [out.detach(), *(t.grad for t in loc)], sinks, lambda a, b: (gather_sequence(a, chunk_size=c), b)


def run_attention(case: AttnCase) -> tuple[str, object]:
    """On every rank of the default group: ``("ran", worst relative error)`` or ``("refused", message)``.
    Out, dq, dk, dv (gathered; under a ring each rank's own shard) against the reference's (the same shard),
    relative to the whole reference tensor's largest value; the sinks' gradient summed over the group."""
    assert dist.get_world_size() == case.world
    x = _inputs(case)
    try:
        got, sinks, pair = (_usp if case.ring_size > 1 else _ulysses_or_fpdt)(case, x)
    except REFUSALS as e:
        return refusal_or_raise(e)
    want = _reference(case, x)
    floor = FLOOR * max(float(b.abs().max()) for b in want)
    pairs = [pair(a, b) for a, b in zip(got, want)]
    if sinks is not None:  # each rank gave the heads it owns; the sum over the group is the gradient
        dsinks = sinks.grad.clone()
        dist.all_reduce(dsinks)
        pairs.append((dsinks, want[4]))
    worst = 0.0
    for (a, b), whole in zip(pairs, want):
        scale = max(float(whole.abs().max()), floor)  # the whole reference tensor's largest value
        worst = max(worst, float((a.double() - b).abs().max()) / scale)
    return "ran", worst
