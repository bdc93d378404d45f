"""``SequenceLayout`` (``parallel/layout.py``), the one encoding of the sequence layouts: its index maps against
maps built token by token from each layout's definition (contiguous, FPDT, zigzag ring, ring + FPDT at sp 1, 2,
4 and several lengths), shard then unshard is the identity, its ring view is ``RingLayout``, the chunk rules,
the refusals, and the attention chosen once per layout (``attention/dispatch.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_longctx.attention.dispatch import AttentionSetup, choose_attention
from lightning_longctx.attention.fpdt import fpdt_attention
from lightning_longctx.attention.ring import RingLayout
from lightning_longctx.attention.ulysses import ulysses_attention
from lightning_longctx.config import SequenceParallelConfig
from lightning_longctx.parallel.layout import SequenceLayout


def _brute(n: int, sp: int, ring: int, chunk: int | None) -> list[list[int]]:
    """Every sp rank's global token indices, built from the definitions (module doc of ``layout.py``)."""
    u_size = sp // ring
    if ring == 1:
        ring_tokens = [list(range(n))]
    else:  # 2r zigzag chunks, ring rank j holds chunks j and 2r-1-j
        z = n // (2 * ring)
        chunks = [list(range(i * z, (i + 1) * z)) for i in range(2 * ring)]
        ring_tokens = [chunks[j] + chunks[2 * ring - 1 - j] for j in range(ring)]
    rows = []
    for j in range(ring):
        tokens = ring_tokens[j]
        c = len(tokens) // u_size if chunk is None else chunk  # one piece per Ulysses rank without chunks
        pieces = [tokens[i : i + c] for i in range(0, len(tokens), c)]  # Ulysses rank u: pieces u, u+U, ...
        rows += [[t for piece in pieces[u::u_size] for t in piece] for u in range(u_size)]
    return rows


def _cases() -> list[tuple[int, int, int | None, int]]:
    cases = []
    for sp in (1, 2, 4):
        for ring in (r for r in (1, 2, 4) if sp % r == 0):
            for chunk in (None, 1, 2, 3):
                unit = SequenceLayout(sp=sp, ring=ring, chunk_size=chunk).multiple
                cases += [(sp, ring, chunk, unit * k) for k in (1, 2, 3, 5)]
    return cases


@pytest.mark.parametrize(("sp", "ring", "chunk", "n"), _cases())
def test_index_is_each_layouts_definition(sp, ring, chunk, n):
    layout = SequenceLayout(sp=sp, ring=ring, chunk_size=chunk)
    want = _brute(n, sp, ring, chunk)
    index = layout.index(n)
    assert index.shape == (sp, n // sp) and index.tolist() == want
    assert sorted(index.flatten().tolist()) == list(range(n))  # every token once
    for rank in range(sp):
        assert layout.global_index(n // sp, rank).tolist() == want[rank]
    if chunk is not None:  # every local chunk is a run of consecutive global tokens
        runs = index.view(sp, -1, chunk)
        assert bool((runs[..., 1:] - runs[..., :-1] == 1).all())


@pytest.mark.parametrize(("sp", "ring", "chunk", "n"), _cases())
def test_shard_then_unshard_is_the_identity(sp, ring, chunk, n):
    layout = SequenceLayout(sp=sp, ring=ring, chunk_size=chunk)
    x = torch.randn(2, n, 3)
    for dim in (1, -2):
        shards = [layout.shard(x, rank, dim=dim) for rank in range(sp)]
        for rank, shard in enumerate(shards):
            assert torch.equal(shard, x[:, layout.global_index(n // sp, rank)])
        assert torch.equal(layout.unshard(torch.cat(shards, dim=1), dim=dim), x)
    if sp == 1:  # one process, no process group: the all-gather is the shard itself
        assert torch.equal(layout.gather(layout.shard(x, 0), None), x)


@pytest.mark.parametrize(("sp", "ring"), [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)])
@pytest.mark.parametrize("chunk", [None, 2])
def test_ring_view_is_ring_layout(sp, ring, chunk):
    n = 4 * sp * (chunk or 1)
    layout = SequenceLayout(sp=sp, ring=ring, chunk_size=chunk)
    view = layout.ring_view(n)
    assert view == RingLayout(ring_size=ring, seq_len=n, kind="zigzag")
    assert layout.ring_view(n) is view  # one object per shape
    u_size = sp // ring
    index, x = layout.index(n), torch.arange(n)[None]
    for j in range(ring):
        mine = index[j * u_size : (j + 1) * u_size]  # ring rank j's Ulysses ranks
        assert sorted(mine.flatten().tolist()) == view.global_index(j).tolist()  # its two zigzag chunks
        if chunk is None:  # the all-to-all concatenates the pieces in u order: the ring rank's own order
            assert torch.equal(mine.flatten(), view.global_index(j))
            for u in range(u_size):
                assert torch.equal(layout.shard(x, j * u_size + u), view.sp_shard(x, j, u, u_size))


@pytest.mark.parametrize(("sp", "ring"), [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_the_chunk_of_a_sequence(sp, ring):
    """A short sequence runs one chunk of its local length (half of it with a ring); padded as the layout pads
    it, its shard's ``local_chunk`` is the same chunk, and the padded length lays out."""
    layout = SequenceLayout(sp=sp, ring=ring, chunk_size=8)
    assert SequenceLayout(sp=sp, ring=ring).chunk_for(100) is None
    halves = 2 if ring > 1 else 1
    for n in range(1, 200):
        chunk = layout.chunk_for(n)
        assert chunk == min(8, -(-n // (sp * halves)))
        padded = n + layout.pad_length(n)
        assert padded % (sp * chunk * halves) == 0 and padded - n < sp * chunk * halves
        assert layout.local_chunk(padded // sp) == chunk
        assert (
            layout.for_length(n)
            == layout.for_local(padded // sp)
            == SequenceLayout(sp=sp, ring=ring, chunk_size=chunk)
        )
        layout.for_length(n).index(padded)  # lays out


def test_refusals():
    with pytest.raises(
        ValueError, match=r"ring=3 must be a positive divisor of the sequence-parallel size 4"
    ):
        SequenceLayout(sp=4, ring=3)
    with pytest.raises(ValueError, match="sp must be a positive number"):
        SequenceLayout(sp=0)
    with pytest.raises(ValueError, match="chunk_size must be a positive number of tokens, got 0"):
        SequenceLayout(sp=2, chunk_size=0)
    with pytest.raises(TypeError):
        SequenceLayout(2)  # keyword-only
    with pytest.raises(
        ValueError, match=r"sequence length 6 is not divisible by the sequence-parallel size 4"
    ):
        SequenceLayout(sp=4).index(6)
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by .* = 4 x 2 = 8"):
        SequenceLayout(sp=4, chunk_size=2).shard(torch.zeros(1, 12), 0)
    with pytest.raises(ValueError, match=r"sequence length 24 is not divisible by 16 \(ring_size=2"):
        SequenceLayout(sp=4, ring=2, chunk_size=2).index(24)
    with pytest.raises(ValueError, match=r"local length 3 is not a multiple of chunk_size 2"):
        SequenceLayout(sp=2, chunk_size=2).unshard(torch.zeros(1, 6))
    with pytest.raises(ValueError, match=r"rank 4 is outside the 4 sequence-parallel ranks"):
        SequenceLayout(sp=4).global_index(2, 4)
    with pytest.raises(ValueError, match="the group has 1 ranks, the layout 2"):
        SequenceLayout(sp=2).gather(torch.zeros(1, 4), None)


def test_resolved_config_builds_the_layout_once():
    config = SequenceParallelConfig(sequence_parallel_size=4, ring_size=2, fpdt_chunk_size=16).resolve(
        8, 0, "cpu"
    )
    layout = config.sequence_layout
    assert layout == SequenceLayout(sp=4, ring=2, chunk_size=16) and config.sequence_layout is layout
    assert config.chunk_for(64) == layout.chunk_for(64) == 8 and config.chunk_for(1024) == 16
    ulysses = SequenceParallelConfig(sequence_parallel_size=2).resolve(2, 0, "cpu")
    assert ulysses.sequence_layout == SequenceLayout(sp=2) and ulysses.chunk_for(100) is None


def test_attention_is_chosen_by_the_layout():
    """One function per layout (chunks or not, ring or not); on one process the Ulysses and FPDT ones are the
    public functions with the call's chunk (one chunk of the local length for a short sequence)."""
    chosen = {
        (chunk, ring): choose_attention(
            AttentionSetup(layout=SequenceLayout(sp=2, ring=ring, chunk_size=chunk))
        ).func.__name__
        for chunk in (None, 4)
        for ring in (1, 2)
    }
    assert chosen == {(None, 1): "_ulysses", (4, 1): "_fpdt", (None, 2): "_usp", (4, 2): "_fpdt_ring"}
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 12, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None].expand(2, -1)  # two packed documents
    kw = dict(causal=True, sliding_window=6, softcap=None, sinks=None)
    ulysses = choose_attention(AttentionSetup(layout=SequenceLayout(sp=1)))
    got = ulysses(q, k, v, scale=0.5, position_ids=pos, **kw)
    assert torch.equal(got, ulysses_attention(q, k, v, softmax_scale=0.5, position_ids=pos, **kw))
    for chunk, want_chunk in ((4, 4), (32, 12)):  # 32 > the 12 local tokens: one chunk of 12
        fpdt = choose_attention(AttentionSetup(layout=SequenceLayout(sp=1, chunk_size=chunk), overlap=False))
        got = fpdt(q, k, v, scale=0.5, position_ids=pos, **kw)
        want = fpdt_attention(
            q, k, v, chunk_size=want_chunk, softmax_scale=0.5, position_ids=pos, overlap=False, **kw
        )
        assert torch.equal(got, want)
