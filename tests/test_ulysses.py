"""Ulysses attention vs a float64 single-process reference on real gloo groups (P = 1, 2, 4)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.reference import packed_positions, reference_attention
from lightning_longctx import gather_sequence, shard_sequence, ulysses_attention
from lightning_longctx.parallel.comm import count_all_to_all

CASES = {
    "causal_mha": dict(h=4, h_kv=4),
    "noncausal": dict(h=4, h_kv=4, causal=False),
    "gqa_kv1": dict(h=4, h_kv=1),  # h_kv < P: kv heads replicated
    "gqa_6_3": dict(h=6, h_kv=3),  # h_kv does not divide P
    "uneven_heads": dict(h=5, h_kv=5),  # h % P != 0: uneven all-to-all split
    "uneven_gqa": dict(h=6, h_kv=2),  # P=4: h % P != 0 with GQA
    "packed_docs": dict(h=4, h_kv=2, packed=[5, 11, 3, 13]),
    "packed_noncausal": dict(h=4, h_kv=4, packed=[7, 9], causal=False),
    "batch3_scale": dict(h=4, h_kv=2, b=3, scale=0.3),
    "sliding_window": dict(h=4, h_kv=4, window=5),
    "softcap": dict(h=4, h_kv=4, softcap=2.0, backend="math"),
}


def _run_case(name: str, backend: str) -> dict:
    cfg = CASES[name]
    _rank, _world = dist.get_rank(), dist.get_world_size()
    b, n, d = cfg.get("b", 2), 16, 8
    causal = cfg.get("causal", True)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, n, cfg["h"], d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, cfg["h_kv"], d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, cfg["h_kv"], d, generator=g, dtype=torch.float64)
    w = torch.randn(b, n, cfg["h"], d, generator=g, dtype=torch.float64)
    pos = packed_positions(b, n, cfg["packed"]) if "packed" in cfg else None
    kw = dict(
        causal=causal, scale=cfg.get("scale"), sliding_window=cfg.get("window"), softcap=cfg.get("softcap")
    )

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_in, position_ids=pos, **kw)
    (ref * w).sum().backward()

    loc = [shard_sequence(x).requires_grad_() for x in (q, k, v)]
    out = ulysses_attention(
        *loc,
        causal=causal,
        softmax_scale=cfg.get("scale"),
        position_ids=None if pos is None else shard_sequence(pos),
        backend=cfg.get("backend", backend),
        sliding_window=cfg.get("window"),
        softcap=cfg.get("softcap"),
    )
    (out * shard_sequence(w)).sum().backward()
    full_out = gather_sequence(out.detach())
    errs = {"out": (full_out - ref.detach()).abs().max().item()}
    for nm, x, r in zip("qkv", loc, ref_in):
        errs["d" + nm] = (gather_sequence(x.grad) - r.grad).abs().max().item()
    return errs


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_ulysses_matches_reference(dist_pool, world, name):
    for errs in dist_pool(world).run(_run_case, name, "math"):
        assert max(errs.values()) < 1e-10, errs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["causal_mha", "gqa_kv1", "packed_docs", "uneven_heads"])
def test_ulysses_sdpa_backend(dist_pool, world, name):
    for errs in dist_pool(world).run(_run_case, name, "sdpa"):
        assert max(errs.values()) < 1e-10, errs


def _count_bytes(b: int, n: int, h: int, d: int) -> tuple[int, int]:
    world = dist.get_world_size()
    x = [torch.randn(b, n // world, h, d, requires_grad=True) for _ in range(3)]
    with count_all_to_all() as count:
        ulysses_attention(*x, backend="math").sum().backward()
    return count.bytes_sent, count.calls


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_bytes_match_formula(dist_pool, world):
    """Each rank sends (P-1)/P of each q, k, v, out shard forward and as much backward: 4·N·h·d/P·(P-1)/P·2,
    in 4 all-to-alls: q, k and v packed into one (and dq, dk, dv in backward), out (and dout) in one."""
    b, n, h, d = 1, 32, 4, 8
    for sent, calls in dist_pool(world).run(_count_bytes, b, n, h, d):
        per_tensor = b * (n // world) * h * d * 4 * (world - 1) // world
        assert calls == 4
        assert sent == 8 * per_tensor


def _bad_inputs() -> list[str]:
    world = dist.get_world_size()
    msgs = []
    good = torch.randn(1, 4, 4, 8)
    attempts = [
        lambda: ulysses_attention(torch.randn(4, 4, 8), good, good),
        lambda: ulysses_attention(good, torch.randn(1, 4, 4, 6), torch.randn(1, 4, 4, 6)),
        lambda: ulysses_attention(good, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8)),
        lambda: ulysses_attention(good, good, good, backend="nope"),
        lambda: shard_sequence(torch.randn(1, 4 * world + 1, 2)),
        lambda: shard_sequence(torch.randn(1, 4 * world, 2), chunk_size=3),
    ]
    for fn in attempts:
        try:
            fn()
        except ValueError as e:
            msgs.append(str(e))
        else:
            msgs.append("NO ERROR")
    return msgs


def test_bad_inputs_raise_clear_errors(dist_pool):
    for msgs in dist_pool(2).run(_bad_inputs):
        assert "NO ERROR" not in msgs, msgs
        assert "bshd" in msgs[0] and "3-D" in msgs[0]
        assert "head_dim differs" in msgs[1] and "6" in msgs[1]
        assert "multiple of key/value heads (3)" in msgs[2]
        assert "'nope'" in msgs[3]
        assert "not divisible by the sequence-parallel size 2" in msgs[4] and "pad" in msgs[4]
        assert "2 x 3 = 6" in msgs[5]


def _packed_matches_one_by_one() -> dict:
    """seq_to_head_packed(q, k, v) == seq_to_head of each (uneven heads, GQA), forward and backward,
    also when one output gets no gradient."""
    from lightning_longctx.parallel.comm import seq_to_head, seq_to_head_packed

    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(2, 3, h, 4, generator=g, dtype=torch.float64) for h in (6, 3, 3)]
    a = [x.clone().requires_grad_() for x in xs]
    b = [x.clone().requires_grad_() for x in xs]
    packed = seq_to_head_packed(*a)
    single = [seq_to_head(x) for x in b]

    def diff(x, y):  # a rank may own 0 of 3 heads at P = 4
        return (x - y).abs().max().item() if x.numel() else 0.0

    fwd = max(diff(p, s) for p, s in zip(packed, single))
    ws = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in packed]
    sum((p * w).sum() for p, w in zip(packed[:2], ws)).backward()  # v's output unused
    sum((s * w).sum() for s, w in zip(single[:2], ws)).backward()
    bwd = max(diff(x.grad, y.grad) for x, y in zip(a[:2], b[:2]))
    return {"fwd": fwd, "bwd": bwd, "v_grad_zero": bool((a[2].grad == 0).all()) and b[2].grad is None}


@pytest.mark.parametrize("world", [2, 4])
def test_packed_all_to_all_matches_one_by_one(dist_pool, world):
    for res in dist_pool(world).run(_packed_matches_one_by_one):
        assert res["fwd"] == 0 and res["bwd"] == 0 and res["v_grad_zero"], res


def _packed_async_matches_one_by_one() -> dict:
    """The background packed all-to-alls FPDT uses: seq_to_head_packed_async == seq_to_head_async of each,
    head_to_seq_packed_async == head_to_seq_async of each (uneven heads, GQA; mixed dtypes go one by one),
    bitwise, in one all-to-all where the dtypes agree."""
    from lightning_longctx.parallel.comm import (
        count_all_to_all,
        head_to_seq_async,
        head_to_seq_packed_async,
        seq_to_head_async,
        seq_to_head_packed_async,
    )

    g = torch.Generator().manual_seed(dist.get_rank())
    same = [torch.randn(1, 3, h, 4, generator=g, dtype=torch.float64) for h in (6, 3, 3)]
    mixed = [same[0].float(), same[1], same[2]]
    out = {}
    for name, xs in (("same", same), ("mixed", mixed)):
        with count_all_to_all() as count:
            packed = seq_to_head_packed_async(*xs).wait()
        single = [seq_to_head_async(x).wait() for x in xs]
        back = head_to_seq_packed_async(packed, [x.shape[2] for x in xs]).wait()
        out[name] = {
            "to_heads": all(torch.equal(p, s) for p, s in zip(packed, single)),
            "back": all(torch.equal(b, x) for b, x in zip(back, xs)),
            "single_back": all(
                torch.equal(head_to_seq_async(s, x.shape[2]).wait(), x) for s, x in zip(single, xs)
            ),
            "calls": count.calls,
        }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_packed_async_all_to_all_matches_one_by_one(dist_pool, world):
    for res in dist_pool(world).run(_packed_async_matches_one_by_one):
        for name, calls in (("same", 1), ("mixed", 3)):
            assert res[name] == {"to_heads": True, "back": True, "single_back": True, "calls": calls}, res


def _routed_docs_gathered_once() -> dict:
    """Ulysses ``backend="auto"`` with packed documents runs on FPDT's blocks: it hands FPDT the documents
    it gathered, so a call gathers the positions once (not twice); with ``documents=`` not at all."""
    import lightning_longctx.attention.fpdt as fpdt
    import lightning_longctx.attention.ulysses as uly
    from lightning_longctx.parallel.sharding import document_ids

    b, n, h, d = 1, 16, 4, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    pos = packed_positions(b, n, [5, 11])
    calls = [0]
    originals = (uly.all_gather_no_grad, fpdt.gather_sequence)

    def counting(fn):
        def counted(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)

        return counted

    uly.all_gather_no_grad, fpdt.gather_sequence = (counting(fn) for fn in originals)
    try:
        local, errs = shard_sequence(pos), []
        ref = reference_attention(q, k, v, position_ids=pos)
        for _ in range(3):
            out = ulysses_attention(*(shard_sequence(x) for x in (q, k, v)), position_ids=local.expand(b, -1))
            errs.append((gather_sequence(out) - ref).abs().max().item())
        by_positions = calls[0]
        out = ulysses_attention(*(shard_sequence(x) for x in (q, k, v)), documents=document_ids(pos))
        errs.append((gather_sequence(out) - ref).abs().max().item())
        return {"gathers": (by_positions, calls[0] - by_positions), "err": max(errs)}
    finally:
        uly.all_gather_no_grad, fpdt.gather_sequence = originals


@pytest.mark.parametrize("world", [2, 4])
def test_routed_packed_docs_gather_positions_once_per_call(dist_pool, world):
    for res in dist_pool(world).run(_routed_docs_gathered_once):
        assert res["gathers"] == (3, 0) and res["err"] < 1e-12, res
