"""Attention sinks (gpt-oss ``s_aux``) and logit soft-capping, Ulysses and FPDT, on real gloo groups.

Every case compares the output and the gradients of q, k, v and the sinks with the fp64 single-process
reference (``reference_attention``: gpt-oss's eager formula with the sinks as an extra score column;
``softcap * tanh(s / softcap)`` before the mask). The sinks are one leaf tensor per rank, as a
replicated parameter: each rank's gradient is ``(h,)`` with zeros outside the heads it owns, and the sum
over the ranks (what the strategy does to parameter gradients) is the reference gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.reference import packed_positions, reference_attention
from lightning_longctx import gather_sequence, shard_sequence, ulysses_attention
from lightning_longctx.attention.common import local_heads
from lightning_longctx.attention.fpdt import fpdt_attention

N = 24  # global tokens: u = 3 chunks per rank at P = 1, 2, 4 (c = 8, 4, 2)

CASES = {
    "sinks_causal": dict(sinks=True),
    "sinks_noncausal": dict(sinks=True, causal=False),
    "sinks_gqa_kv1": dict(h=4, h_kv=1, sinks=True),  # h_kv < P: kv heads replicated
    "sinks_uneven_gqa": dict(h=6, h_kv=2, sinks=True),  # 6 heads on P = 4: uneven split, h_kv < P
    "sinks_packed_window": dict(h=4, h_kv=2, packed=[5, 11, 3, 13], window=5, sinks=True, block=3),
    "sinks_fp32_param": dict(sinks=True, sink_dtype=torch.float32, u=2),  # sinks dtype != q dtype
    "sinks_frozen": dict(sinks=True, frozen=True),  # requires_grad=False: no sinks gradient
    "softcap_causal_u6": dict(softcap=2.0, u=6),  # c = 1 token per chunk at P = 4
    "softcap_packed_noncausal": dict(packed=[7, 9, 8], causal=False, softcap=1.5),
    "softcap_uneven_gqa_window": dict(h=6, h_kv=3, window=6, softcap=2.5, block=5),
    "both_packed_gqa": dict(h=6, h_kv=2, b=3, scale=0.3, packed=[5, 11, 3, 13], softcap=1.5, sinks=True),
    "both_noncausal_window": dict(h=5, h_kv=5, causal=False, window=7, softcap=2.0, sinks=True, block=3),
}


def _inputs(cfg: dict, dtype: torch.dtype = torch.float64):
    b, d, h, h_kv = cfg.get("b", 2), 8, cfg.get("h", 4), cfg.get("h_kv", 4)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, N, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, N, h_kv, d, generator=g, dtype=dtype)
    v = torch.randn(b, N, h_kv, d, generator=g, dtype=dtype)
    w = torch.randn(b, N, h, d, generator=g, dtype=dtype)
    # sinks around the row log-sum-exps (~ log N) so that they matter: p_sink from ~0.05 to ~0.9
    sinks = (torch.randn(h, generator=g, dtype=torch.float64) * 2 + 2).to(cfg.get("sink_dtype", dtype))
    pos = packed_positions(b, N, cfg["packed"]) if "packed" in cfg else None
    return q, k, v, w, (sinks if cfg.get("sinks") else None), pos


def _reference(cfg: dict, q, k, v, w, sinks, pos) -> list[torch.Tensor | None]:
    """fp64 single process: [out, dq, dk, dv, dsinks]."""
    ref_in = [x.double().clone().requires_grad_() for x in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.double().clone().requires_grad_()
    out = reference_attention(
        *ref_in,
        causal=cfg.get("causal", True),
        position_ids=pos,
        scale=cfg.get("scale"),
        sliding_window=cfg.get("window"),
        softcap=cfg.get("softcap"),
        sinks=ref_sinks,
    )
    (out * w.double()).sum().backward()
    return [out.detach(), *(x.grad for x in ref_in), None if ref_sinks is None else ref_sinks.grad]


def _parallel(cfg: dict, mode: str, q, k, v, w, sinks, pos, *, offload: bool = False) -> list:
    """Shard, run forward + backward, gather: [out, dq, dk, dv] in global order, and this rank's
    sinks leaf (its ``.grad`` is this rank's contribution only)."""
    world = dist.get_world_size()
    c = N // (cfg.get("u", 3) * world) if mode == "fpdt" else None
    loc = [shard_sequence(x, chunk_size=c).requires_grad_() for x in (q, k, v)]
    leaf = None if sinks is None else sinks.clone().requires_grad_(not cfg.get("frozen"))
    kw = dict(
        causal=cfg.get("causal", True),
        softmax_scale=cfg.get("scale"),
        position_ids=None if pos is None else shard_sequence(pos, chunk_size=c),
        sliding_window=cfg.get("window"),
        softcap=cfg.get("softcap"),
        sinks=leaf,
    )
    if mode == "fpdt":
        out = fpdt_attention(*loc, chunk_size=c, offload=offload, block_size=cfg.get("block", 1024), **kw)
    else:
        out = ulysses_attention(*loc, **kw)
    (out * shard_sequence(w, chunk_size=c)).sum().backward()
    return [gather_sequence(x, chunk_size=c) for x in (out.detach(), *(t.grad for t in loc))], leaf


def _errors(got: list, want: list, relative: bool = False) -> dict:
    errs = {}
    for nm, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
        if b is None:
            continue
        err = (a.double() - b).abs().max().item()
        errs[nm] = err / b.abs().max().item() if relative else err
    return errs


def _run_case(name: str, mode: str) -> dict:
    cfg = CASES[name]
    q, k, v, w, sinks, pos = _inputs(cfg)
    want = _reference(cfg, q, k, v, w, sinks, pos)
    got, leaf = _parallel(cfg, mode, q, k, v, w, sinks, pos)
    res: dict = {"errs": _errors(got, want[:4])}
    if leaf is not None:
        res["grad_is_none"] = leaf.grad is None
    if leaf is not None and leaf.grad is not None:
        mine = torch.zeros(q.shape[2], dtype=torch.bool)
        mine[local_heads(q.shape[2], None)] = True
        res["grad_dtype_ok"] = leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
        res["zeros_elsewhere"] = bool((leaf.grad[~mine] == 0).all())
        total = leaf.grad.detach().clone()
        dist.all_reduce(total)  # the strategy sums replicated parameters' gradients over the SP group
        res["errs"]["dsinks"] = (total.double() - want[4]).abs().max().item()
    return res


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("mode", ["ulysses", "fpdt"])
def test_matches_reference(dist_pool, world, mode):
    # fp32 sinks with fp64 activations: the sinks gradient is rounded to fp32 (~1e-7 relative)
    for name, cfg in CASES.items():
        tol = 1e-6 if cfg.get("sink_dtype") == torch.float32 else 1e-10
        for res in dist_pool(world).run(_run_case, name, mode):
            assert max(res["errs"].values()) < tol, (name, res)
            if cfg.get("frozen"):
                assert res["grad_is_none"], (name, res)
            elif cfg.get("sinks"):
                ok = "dsinks" in res["errs"] and res["grad_dtype_ok"] and res["zeros_elsewhere"]
                assert ok, (name, res)


def _offload_identical(name: str) -> bool:
    cfg = CASES[name]
    q, k, v, w, sinks, pos = _inputs(cfg, torch.float32)
    runs = []
    for offload in (False, True):
        got, leaf = _parallel(cfg, "fpdt", q, k, v, w, sinks, pos, offload=offload)
        runs.append([*got, None if leaf is None else leaf.grad])
    return all((a is None and b is None) or torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("world", [1, 2])
def test_fpdt_offload_bit_identical(dist_pool, world):
    for name in ["both_packed_gqa", "both_noncausal_window", "sinks_causal"]:
        assert all(dist_pool(world).run(_offload_identical, name)), name


def _fp32_errors(name: str, mode: str) -> dict:
    cfg = CASES[name]
    q, k, v, w, sinks, pos = _inputs(cfg, torch.float32)
    want = _reference(cfg, q, k, v, w, sinks, pos)
    got, leaf = _parallel(cfg, mode, q, k, v, w, sinks, pos)
    total = leaf.grad.detach().clone()
    dist.all_reduce(total)
    return _errors([*got, total], want, relative=True)


@pytest.mark.parametrize("mode", ["ulysses", "fpdt"])
def test_fp32_within_relative_tolerance(dist_pool, mode):
    for name in ["both_packed_gqa", "both_noncausal_window"]:
        for errs in dist_pool(4).run(_fp32_errors, name, mode):
            assert max(errs.values()) < 1e-5, (name, errs)


@pytest.mark.parametrize("fn", [ulysses_attention, fpdt_attention])
def test_bad_inputs_raise_clear_errors(fn):
    x = torch.randn(1, 8, 4, 8)
    kw = dict(chunk_size=4) if fn is fpdt_attention else {}
    with pytest.raises(
        ValueError, match=r"sinks must have shape \(num_heads,\) = \(4,\).*got \(2,\).*per-rank"
    ):
        fn(x, x, x, sinks=torch.zeros(2), **kw)
    with pytest.raises(ValueError, match=r"sinks must have shape .* got \(1, 4\)"):
        fn(x, x, x, sinks=torch.zeros(1, 4), **kw)
    with pytest.raises(ValueError, match=r"sinks is on meta but q is on cpu.*sinks.to\(q.device\)"):
        fn(x, x, x, sinks=torch.zeros(4, device="meta"), **kw)
    with pytest.raises(ValueError, match="floating-point"):
        fn(x, x, x, sinks=torch.zeros(4, dtype=torch.long), **kw)
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError, match=r"softcap must be a positive.*softcap=None"):
            fn(x, x, x, softcap=bad, **kw)


def test_ulysses_sinks_need_a_kernel_with_the_lse():
    x = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match=r"'sdpa' backend cannot add attention sinks.*'math' or 'auto'"):
        ulysses_attention(x, x, x, sinks=torch.zeros(4), backend="sdpa")
    ulysses_attention(x, x, x, sinks=torch.zeros(4), backend="math")
    ulysses_attention(x, x, x, sinks=torch.zeros(4), backend="auto")  # auto picks math


def test_without_the_features_results_are_unchanged():
    """``sinks=None`` / ``softcap=None`` take the old code paths: bit-identical to not passing them."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=g) for _ in range(3))
    assert torch.equal(ulysses_attention(q, k, v), ulysses_attention(q, k, v, sinks=None, softcap=None))
    assert torch.equal(
        fpdt_attention(q, k, v, chunk_size=4), fpdt_attention(q, k, v, chunk_size=4, sinks=None, softcap=None)
    )
