"""FPDT attention vs a float64 single-process reference on real gloo groups (P = 1, 2, 4)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from helpers.reference import packed_positions, reference_attention
from lightning_longctx import gather_sequence, shard_sequence
from lightning_longctx.attention.common import spread_kv_heads
from lightning_longctx.attention.fpdt import fpdt_attention
from lightning_longctx.attention.offload import offloaded_bytes, track_offload_residency
from lightning_longctx.parallel.comm import count_all_to_all

N = 32  # global tokens; chunk_size c = N / (u * P)

CASES = {
    "causal_u1": dict(u=1),
    "causal_u2": dict(u=2),
    "causal_u4": dict(u=4),
    "causal_u8": dict(u=8),
    "noncausal_u4": dict(u=4, causal=False),
    "gqa_kv1": dict(h=4, h_kv=1, u=4),  # h_kv < P: kv heads replicated
    "gqa_6_3": dict(h=6, h_kv=3, u=2),  # h_kv does not divide P
    "uneven_heads": dict(h=5, h_kv=5, u=2),  # h % P != 0: uneven all-to-all split
    "uneven_gqa": dict(h=6, h_kv=2, u=4),
    "packed_docs": dict(h=4, h_kv=2, u=4, packed=[5, 11, 3, 13]),
    "packed_aligned": dict(u=4, packed=[8, 16, 8]),  # documents on segment edges: blocks skipped
    "packed_noncausal": dict(u=2, packed=[7, 9], causal=False),
    "sliding_window": dict(u=8, window=5),
    "batch3_scale": dict(b=3, u=2, scale=0.3),
    "tiles_causal": dict(u=2, block=3),  # compute tiles inside a segment, not dividing it
    "tiles_packed_window": dict(h=4, h_kv=2, u=2, block=3, packed=[5, 11, 3, 13], window=6),
    "tiles_noncausal": dict(u=2, block=5, causal=False),
    "offload_gqa_packed": dict(h=4, h_kv=1, u=8, packed=[5, 11, 3, 13], offload=True),
    "offload_noncausal": dict(u=4, causal=False, offload=True, block=3),
}


def _inputs(cfg: dict, dtype: torch.dtype = torch.float64):
    b, d = cfg.get("b", 2), 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, N, cfg.get("h", 4), d, generator=g, dtype=dtype)
    k = torch.randn(b, N, cfg.get("h_kv", 4), d, generator=g, dtype=dtype)
    v = torch.randn(b, N, cfg.get("h_kv", 4), d, generator=g, dtype=dtype)
    w = torch.randn(b, N, cfg.get("h", 4), d, generator=g, dtype=dtype)
    pos = packed_positions(b, N, cfg["packed"]) if "packed" in cfg else None
    return q, k, v, w, pos


def _fpdt(
    cfg: dict, q, k, v, w, pos, *, offload: bool, backend: str = "auto", overlap: bool = True, kernels=None
):
    """Shard, run FPDT forward + backward, gather: (out, dq, dk, dv) in global order. ``kernels``: a set
    that receives the names of the kernels the blocks ran."""
    c = N // (cfg["u"] * dist.get_world_size())
    loc = [shard_sequence(x, chunk_size=c).requires_grad_() for x in (q, k, v)]
    out = fpdt_attention(
        *loc,
        chunk_size=c,
        causal=cfg.get("causal", True),
        softmax_scale=cfg.get("scale"),
        position_ids=None if pos is None else shard_sequence(pos, chunk_size=c),
        offload=offload,
        sliding_window=cfg.get("window"),
        block_size=cfg.get("block", 1024),
        backend=backend,
        overlap=overlap,
    )
    if kernels is not None:
        kernels |= out.grad_fn.call.plan.kernel_names()
    (out * shard_sequence(w, chunk_size=c)).sum().backward()
    return [gather_sequence(x, chunk_size=c) for x in (out.detach(), *(t.grad for t in loc))]


def _run_case(name: str, backend: str = "auto") -> dict:
    cfg = CASES[name]
    q, k, v, w, pos = _inputs(cfg)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(
        *ref_in,
        causal=cfg.get("causal", True),
        position_ids=pos,
        scale=cfg.get("scale"),
        sliding_window=cfg.get("window"),
    )
    (ref * w).sum().backward()
    kernels: set[str] = set()
    got = _fpdt(cfg, q, k, v, w, pos, offload=cfg.get("offload", False), backend=backend, kernels=kernels)
    want = [ref.detach(), *(x.grad for x in ref_in)]
    errs = {nm: (a - b).abs().max().item() for nm, a, b in zip(["out", "dq", "dk", "dv"], got, want)}
    return errs, kernels


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_fpdt_matches_reference(dist_pool, world, name):
    """The default backend: every block on the fused CPU kernel (causal diagonal and full blocks whole,
    document / window tiles with an additive mask)."""
    for errs, kernels in dist_pool(world).run(_run_case, name):
        assert max(errs.values()) < 1e-10, errs
        assert kernels == {"cpu_flash"}, kernels


MATH_CASES = ["causal_u4", "noncausal_u4", "uneven_gqa", "tiles_packed_window", "offload_noncausal"]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", MATH_CASES)
def test_fpdt_math_blocks_match_reference(dist_pool, world, name):
    """backend="math": the reference blocks (tiled score matrices) stay exact too."""
    for errs, kernels in dist_pool(world).run(_run_case, name, "math"):
        assert max(errs.values()) < 1e-10, errs
        assert kernels == {"math"}, kernels


def _overlap_identical(name: str) -> bool:
    cfg = CASES[name]
    q, k, v, w, pos = _inputs(cfg, torch.float32)
    on = _fpdt(cfg, q, k, v, w, pos, offload=cfg.get("offload", False), overlap=True)
    off = _fpdt(cfg, q, k, v, w, pos, offload=cfg.get("offload", False), overlap=False)
    return all(torch.equal(a, b) for a, b in zip(on, off))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["causal_u8", "noncausal_u4", "offload_gqa_packed"])
def test_overlap_bit_identical(dist_pool, world, name):
    """Background all-to-alls change when data moves, not what is computed."""
    assert all(dist_pool(world).run(_overlap_identical, name))


def _offload_identical(name: str) -> dict:
    cfg = CASES[name]
    q, k, v, w, pos = _inputs(cfg, torch.float32)
    plain = _fpdt(cfg, q, k, v, w, pos, offload=False)
    assert offloaded_bytes() == 0
    with track_offload_residency() as residency:
        off = _fpdt(cfg, q, k, v, w, pos, offload=True)
    after_backward = offloaded_bytes()
    # forward only, graph dropped without backward: the host buffers are given back too
    c = N // (cfg["u"] * dist.get_world_size())
    loc = [shard_sequence(x, chunk_size=c).requires_grad_() for x in (q, k, v)]
    out = fpdt_attention(*loc, chunk_size=c, offload=True)
    held = offloaded_bytes()
    del out
    gc.collect()
    b, _, h, d = q.shape
    h_kv = spread_kv_heads(k, v, h, dist.get_world_size())[0].shape[2]
    # q, out, k, v (fp32, head layout) + lse of this rank's segments
    expect = 4 * (2 * b * N * h * d + 2 * b * N * h_kv * d + b * h * N) // dist.get_world_size()
    return {
        "expect": expect,
        "equal": all(torch.equal(a, b) for a, b in zip(plain, off)),
        "after_backward": after_backward,
        "held": held,
        "after_drop": offloaded_bytes(),
        "peak_k": residency.peak_resident["k"],
        "peak_q": residency.peak_resident["q"],
    }


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["causal_u8", "offload_gqa_packed", "noncausal_u4"])
def test_offload_bit_identical_and_double_buffered(dist_pool, world, name):
    u = CASES[name]["u"]
    for res in dist_pool(world).run(_offload_identical, name):
        assert res["equal"], "offload changed the result"
        assert res["after_backward"] == 0 and res["after_drop"] == 0, res
        assert res["held"] == res["expect"], res
        assert 1 <= res["peak_k"] <= 2 and res["peak_q"] <= 2, res  # double buffer
        if u > 1:
            assert res["peak_k"] == 2  # the next kv chunk is in flight while one computes


def _count_bytes(u: int) -> tuple[int, int]:
    world = dist.get_world_size()
    b, h, d = 1, 4, 8
    c = N // (u * world)
    x = [torch.randn(b, N // world, h, d, requires_grad=True) for _ in range(3)]
    with count_all_to_all() as count:
        fpdt_attention(*x, chunk_size=c).sum().backward()
    return count.bytes_sent, count.calls


@pytest.mark.parametrize("u", [1, 4])
def test_fpdt_bytes_equal_ulysses(dist_pool, u):
    """Same traffic as Ulysses (q, k, v, out forward; dout, dq, dk, dv backward), in 5·u all-to-alls: per
    segment q, k and v in one, out; dout, dk and dv in one, dq."""
    world = 2
    for sent, calls in dist_pool(world).run(_count_bytes, u):
        per_tensor = (N // world) * 4 * 8 * 4 * (world - 1) // world
        assert calls == 5 * u
        assert sent == 8 * per_tensor


def _fp32_error() -> tuple[float, float]:
    """FPDT in fp32 vs the reference in fp64, next to the plain fp32 reference's own error."""
    cfg = dict(u=4, h=4, h_kv=2, packed=[5, 11, 3, 13])
    q, k, v, w, pos = _inputs(cfg)
    exact = reference_attention(q, k, v, position_ids=pos)
    plain32 = reference_attention(q.float(), k.float(), v.float(), position_ids=pos)
    got = _fpdt(cfg, q.float(), k.float(), v.float(), w.float(), pos, offload=False)[0]
    return (got.double() - exact).abs().max().item(), (plain32.double() - exact).abs().max().item()


def test_fpdt_fp32_error_within_2x_plain(dist_pool):
    for ours, plain in dist_pool(2).run(_fp32_error):
        assert ours <= 2 * plain + 1e-6, (ours, plain)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(1, 8, 4, 8)
    with pytest.raises(
        ValueError, match=r"chunk_size 3 does not divide the local sequence length 8.*shard_batch"
    ):
        fpdt_attention(x, x, x, chunk_size=3)
    with pytest.raises(ValueError, match="softcap"):
        fpdt_attention(x, x, x, chunk_size=4, softcap=-1.0)
    with pytest.raises(ValueError, match=r"backend 'sdpa'.*'auto' or 'math'"):
        fpdt_attention(x, x, x, chunk_size=4, backend="sdpa")
    with pytest.raises(ValueError, match="'nope'"):
        fpdt_attention(x, x, x, chunk_size=4, backend="nope")
    with pytest.raises(ValueError, match=r"position_ids shape \(1, 4\)"):
        fpdt_attention(x, x, x, chunk_size=4, position_ids=torch.arange(4)[None])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        fpdt_attention(x, torch.randn(1, 8, 3, 8), torch.randn(1, 8, 3, 8), chunk_size=4)
    with pytest.raises(ValueError, match="positive"):
        fpdt_attention(x, x, x, chunk_size=0)
    with pytest.raises(ValueError, match="block_size must be a positive"):
        fpdt_attention(x, x, x, chunk_size=4, block_size=0)


def _backward_twice(name: str) -> bool:
    """The offloaded chunks are saved tensors: ``retain_graph=True`` keeps them for a second backward, which
    then adds the same gradients again (as without offload), and both free the host buffers at the end."""
    cfg = CASES[name]
    q, k, v, w, _ = _inputs(cfg, torch.float32)
    c = N // (cfg["u"] * dist.get_world_size())
    grads = {}
    for offload in (False, True):
        loc = [shard_sequence(x, chunk_size=c).requires_grad_() for x in (q, k, v)]
        out = fpdt_attention(*loc, chunk_size=c, offload=offload)
        loss = (out * shard_sequence(w, chunk_size=c)).sum()
        loss.backward(retain_graph=True)
        once = [t.grad.clone() for t in loc]
        loss.backward()
        assert all(torch.allclose(t.grad, 2 * g, rtol=1e-6, atol=1e-7) for t, g in zip(loc, once))
        grads[offload] = [t.grad for t in loc]
        del out, loss
    gc.collect()
    return offloaded_bytes() == 0 and all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


@pytest.mark.parametrize("world", [1, 2])
def test_offload_backward_twice_with_retain_graph(dist_pool, world):
    assert all(dist_pool(world).run(_backward_twice, "causal_u8"))
