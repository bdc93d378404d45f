"""The ring tests' float64 cases and the ``usp_attention`` check (tests/test_ring.py; its sabotage in
tests/test_negative_checks.py); tests/test_fpdt_ring.py checks FPDT x ring with them too."""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.launch import process_groups
from helpers.reference import packed_positions, reference_attention
from lightning_longctx.attention.ring import RING_LAYOUTS, RingLayout
from lightning_longctx.parallel.sharding import document_ids

N, D = 32, 8  # global tokens (zigzag at r = 4: 8 chunks of 4), head dim

CASES = {
    "causal": dict(),
    "noncausal": dict(causal=False),
    "gqa_4_2": dict(h=4, h_kv=2),
    "gqa_4_1": dict(h=4, h_kv=1),
    # rows with different boundaries (row 1 starts with the 11-token document), documents across ranks
    "documents": dict(h=4, h_kv=2, packed=[5, 11, 3, 13]),
    "documents_noncausal": dict(packed=[7, 9, 14], causal=False),
    # a window smaller than a chunk at every r: off-diagonal blocks partly cut, rows empty on some steps
    "window_small": dict(window=3),
    "window_large": dict(window=11),  # spans several chunks
    "softcap": dict(softcap=1.5, scale=1.0),
    "sinks": dict(h=4, h_kv=2, sinks=[8.0, -8.0, 0.5, -3.0]),
    "everything": dict(h=4, h_kv=1, packed=[5, 11, 3, 13], window=6, sinks=[8.0, -8.0, 3.0, -3.0], block=3),
}
TOL = 1e-10


def inputs(cfg: dict, n: int = N, seed: int = 0):
    """Global-order float64 q, k, v, the output weights w, document ids (b, n) or None, sinks or None."""
    b, h, h_kv = cfg.get("b", 2), cfg.get("h", 2), cfg.get("h_kv", cfg.get("h", 2))
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(b, n, x, D, generator=g, dtype=torch.float64) for x in (h, h_kv, h_kv, h))
    k = k + torch.arange(n, dtype=torch.float64)[None, :, None, None] / n  # every block visibly different
    pos = packed_positions(b, n, cfg["packed"]) if "packed" in cfg else None
    sinks = torch.tensor(cfg["sinks"], dtype=torch.float64) if "sinks" in cfg else None
    return q, k, v, w, pos, sinks


def reference(cfg: dict, q, k, v, w, pos, sinks):
    """Full attention of the whole sequence: (out, dq, dk, dv, dsinks or None), global order."""
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    s = None if sinks is None else sinks.clone().requires_grad_()
    out = reference_attention(
        *ins,
        causal=cfg.get("causal", True),
        position_ids=pos,
        scale=cfg.get("scale"),
        sliding_window=cfg.get("window"),
        softcap=cfg.get("softcap"),
        sinks=s,
    )
    (out * w).sum().backward()
    return out.detach(), *(x.grad for x in ins), None if s is None else s.grad


USP_CASES = {
    **{name: CASES[name] for name in ("causal", "noncausal", "gqa_4_1", "documents", "sinks", "everything")},
    "uneven_heads": dict(h=3, h_kv=1),  # 3 heads over U = 2: ring peers (same u) hold the same heads
}


def usp_errors(ring: int) -> dict:
    """{(case, layout kind): (max error of out/dq/dk/dv on this rank, its partial dsinks, the reference's)}
    for sp = world, ring = ``ring``, the groups from the world mesh (s = j * U + u)."""
    from lightning_longctx.attention.ring import usp_attention
    from lightning_longctx.parallel.mesh import ParallelDims, build_world_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    par = ParallelDims(world_size=world, sp=world, ring=ring)
    with process_groups() as own:
        mesh = own(build_world_mesh(par, "cpu"))
        j, u, ulysses = par.ring_rank(rank), par.ulysses_rank(rank), par.ulysses
        found = {}
        for name, cfg in USP_CASES.items():
            q, k, v, w, pos, sinks = inputs(cfg)
            ref = reference(cfg, q, k, v, w, pos, sinks)
            for kind in RING_LAYOUTS:
                layout = RingLayout(ring_size=ring, seq_len=N, kind=kind)
                ins = [layout.sp_shard(x, j, u, ulysses).requires_grad_() for x in (q, k, v)]
                s = None if sinks is None else sinks.clone().requires_grad_()
                out = usp_attention(
                    *ins, ulysses_group=mesh.ulysses_group, ring_group=mesh.ring_group, layout=layout,
                    causal=cfg.get("causal", True), softmax_scale=cfg.get("scale"),
                    sliding_window=cfg.get("window"), documents=None if pos is None else document_ids(pos),
                    softcap=cfg.get("softcap"), sinks=s, block_size=cfg.get("block", 1024),
                )  # fmt: skip
                (out * layout.sp_shard(w, j, u, ulysses)).sum().backward()
                got = (out.detach(), *(x.grad for x in ins))
                want = [layout.sp_shard(x, j, u, ulysses) for x in ref[:4]]
                err = max((a - b).abs().max().item() for a, b in zip(got, want))
                found[name, kind] = (err, None if s is None else s.grad, ref[4])
        return found


def check_rank_errors(per_rank: list[dict]) -> float:
    """``per_rank``: each rank's ``{key: (max error of its out / dq / dk / dv, its partial dsinks or None, the
    reference's dsinks or None)}``. Every rank's error within TOL, dsinks summed over the sp group too; returns
    the worst error."""
    worst = 0.0
    for key in per_rank[0]:
        err = max(r[key][0] for r in per_rank)
        worst = max(worst, err)
        assert err < TOL, (key, [r[key][0] for r in per_rank])
        ref_dsinks = per_rank[0][key][2]
        if ref_dsinks is not None:
            err = (sum(r[key][1] for r in per_rank) - ref_dsinks).abs().max().item()
            assert err < TOL, (key, err)
    return worst
