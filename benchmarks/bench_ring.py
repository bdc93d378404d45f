"""Ulysses vs ring vs USP (Ulysses x ring) attention on CPU/gloo: bytes per rank against their formulas, and
the fwd+bwd time of one causal attention layer on the same inputs.

For every P in ``--world-sizes`` one gloo group of P launched ranks builds the world mesh with each ring degree
r in ``--rings`` (1: Ulysses alone over P ranks; P: a pure ring; between: USP with U = P / r Ulysses ranks per
ring rank, ``mesh.build_world_mesh``), shards one ``(b, N, h, d)`` sequence in that layout
(``RingLayout.sp_shard``: zigzag over the ring) and runs ``usp_attention`` (``ulysses_attention`` at r = 1)
with its backward. Measured per variant: the bytes this rank sends to other ranks, forward + backward
(``count_all_to_all``: all-to-alls and the ring's point-to-point passes), the maximum over ranks, against

* Ulysses over U ranks (MHA, ``h % U == 0``): ``2 * 4 b (N/P) h d e (U-1)/U`` (q, k, v, out forward; dout,
  dq, dk, dv backward);
* ring over r ranks, ``B = 2 b (N/r) (h_kv/U) d`` elements per k/v block: ``(r-1) B e`` forward,
  ``(r-1) B e + r B e_acc`` backward (fp32 dk/dv travelling home; ``e_acc = 4``, 8 for fp64);

and the median fwd+bwd wall time of the slowest rank (barriers around each step, variants interleaved).
Also checked: every variant's output equals the r = 1 one (``max|Δout|``).

Balance (no ranks: ``ring_work``, the score elements of the blocks each ring rank computes, tiles of
``--block-size``): for every ring degree of ``--balance-rings``, zigzag and contiguous layouts of
``--balance-seq-len`` tokens, causal alone, with packed documents (``--doc-counts``: one random split each,
seeded) and with a sliding window (``--window``, default N/8): the slowest rank's work over the mean
(``max/mean``: the attention's critical path against perfect balance) and the least loaded one's
(``min/mean``). The target: zigzag within 10 % of the mean at r = 2 and 4, causal.

Exit status 1 when a byte count differs from its formula or the balance target is missed. ``--png``: the
plot (``plot.py``'s ``plot_ring``: time and bytes per rank against r). Commands and results:
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from common import MIB, format_table, launch, save_results

from lightning_longctx.attention.ring import RING_LAYOUTS, RingLayout, ring_work
from lightning_longctx.parallel.sharding import document_ids

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
COLUMNS = [
    ("P", "P", ""),
    ("ring", "r", ""),
    ("ulysses", "U", ""),
    ("N", "N", ""),
    ("ms", "fwd+bwd ms", ".1f"),
    ("a2a_mib", "all-to-all MiB/rank", ".3f"),
    ("ring_mib", "ring MiB/rank", ".3f"),
    ("formula_mib", "formula MiB", ".3f"),
    ("bytes_ratio", "bytes/formula", ".3f"),
    ("diff_out", "max|Δout| vs r=1", ".1e"),
]


BALANCE_COLUMNS = [
    ("mask", "causal +", ""),
    ("ring", "r", ""),
    *((f"{kind}_{m}", f"{kind} {m}/mean", ".3f") for kind in RING_LAYOUTS for m in ("max", "min")),
]
#: zigzag's causal work on every rank within this fraction of the mean, at these ring degrees
BALANCE_TARGET, BALANCE_TARGET_RINGS = 0.10, (2, 4)


def random_documents(n: int, count: int, seed: int) -> torch.Tensor:
    """``(1, n)`` document ids of ``count`` packed documents cut at random (seeded) token positions."""
    g = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(n - 1, generator=g)[: count - 1] + 1).sort().values.tolist()
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    return document_ids(torch.cat([torch.arange(m) for m in lengths])[None])


def balance_rows(
    n: int, rings: list[int], doc_counts: list[int], window: int, block_size: int
) -> list[dict[str, Any]]:
    """Per (mask, r): each layout's per-rank causal work (``ring_work``), max/mean and min/mean."""
    masks: dict[str, dict[str, Any]] = {"-": {}}
    for count in doc_counts:
        masks[f"{count} documents"] = {"documents": random_documents(n, count, seed=count)}
    masks[f"window {window}"] = {"sliding_window": window}
    rows = []
    for name, kw in masks.items():
        for r in rings:
            row: dict[str, Any] = {"mask": name, "ring": r, "N": n, "block_size": block_size}
            for kind in RING_LAYOUTS:
                work = ring_work(RingLayout(ring_size=r, seq_len=n, kind=kind), block_size=block_size, **kw)
                mean = sum(work) / r
                row.update(
                    {f"{kind}_work": work, f"{kind}_max": max(work) / mean, f"{kind}_min": min(work) / mean}
                )
            rows.append(row)
    return rows


def balance_met(rows: list[dict[str, Any]]) -> bool:
    """Zigzag, causal alone, at :data:`BALANCE_TARGET_RINGS`: every rank within :data:`BALANCE_TARGET`."""
    causal = [r for r in rows if r["mask"] == "-" and r["ring"] in BALANCE_TARGET_RINGS]
    return all(
        r["zigzag_max"] <= 1 + BALANCE_TARGET and r["zigzag_min"] >= 1 - BALANCE_TARGET for r in causal
    )


def formula_bytes(
    b: int, n: int, h: int, h_kv: int, d: int, world: int, ring: int, e: int, e_acc: int
) -> int:
    """Bytes one rank sends, forward + backward, at ring degree ``ring`` over ``world`` sp ranks (module doc)."""
    u = world // ring
    a2a = 2 * 4 * b * (n // world) * h * d * e * (u - 1) // u if u > 1 else 0
    if ring == 1:
        return a2a
    block = 2 * b * (n // ring) * (h_kv // u) * d
    return a2a + (ring - 1) * block * e + (ring - 1) * block * e + ring * block * e_acc


def _rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One rank (a launched process): every ring degree of ``args.rings`` that divides the world, timed."""
    from lightning_longctx.attention.ring import RingLayout, usp_attention
    from lightning_longctx.attention.ulysses import ulysses_attention
    from lightning_longctx.parallel.comm import count_all_to_all
    from lightning_longctx.parallel.mesh import ParallelDims, build_world_mesh

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    b, n, h, d, dtype = args.batch, args.seq_len, args.heads, args.head_dim, DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, n, h, d, generator=g).to(dtype) for _ in range(4))
    rows, steps, ref = [], [], None
    for ring in [r for r in args.rings if world % r == 0 and n % (2 * world) == 0]:
        par = ParallelDims(world_size=world, sp=world, ring=ring)
        mesh = build_world_mesh(par, "cpu")
        layout = RingLayout(ring_size=max(ring, 1), seq_len=n, kind="zigzag" if ring > 1 else "contiguous")
        j, u, ulysses = par.ring_rank(rank), par.ulysses_rank(rank), par.ulysses
        ins = [layout.sp_shard(x, j, u, ulysses) for x in (q, k, v, dout)]
        leaves = [x.clone().requires_grad_() for x in ins[:3]]

        def attend(qq, kk, vv, ring=ring, mesh=mesh, layout=layout):
            if ring == 1:
                return ulysses_attention(qq, kk, vv, group=mesh.sp_group, backend="sdpa")
            return usp_attention(
                qq, kk, vv, ulysses_group=mesh.ulysses_group, ring_group=mesh.ring_group, layout=layout
            )

        def step(attend=attend, leaves=leaves, dout=ins[3]):
            for x in leaves:
                x.grad = None
            out = attend(*leaves)
            out.backward(dout)
            return out.detach()

        with count_all_to_all() as count:
            out = step()
        whole = torch.cat(
            [o for o in _gather(out, world)], dim=1
        )  # every rank's output in rank order: its global order comes from the layout
        index = torch.cat([_index(layout, s, par) for s in range(world)])
        full = torch.empty_like(whole).index_copy_(1, index, whole)
        ref = full if ref is None else ref
        e, e_acc = torch.tensor([], dtype=dtype).element_size(), 8 if dtype == torch.float64 else 4
        sent = count.bytes_sent + count.exchange_bytes
        steps.append(step)
        rows.append({
            "P": world, "ring": ring, "ulysses": ulysses, "N": n,
            "a2a_bytes": count.bytes_sent, "ring_bytes": count.exchange_bytes, "sent_bytes": sent,
            "formula_bytes": formula_bytes(b, n, h, h, d, world, ring, e, e_acc),
            "diff_out": (full - ref).abs().max().item(),
        })  # fmt: skip
    times: list[list[float]] = [[] for _ in steps]
    for i in range(args.warmup + args.repeats):  # rounds: every variant once per round (shared-machine noise)
        for step, ts in zip(steps, times):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if i >= args.warmup:
                ts.append(time.perf_counter() - t0)
    for row, ts in zip(rows, times):
        row["ms"] = 1e3 * statistics.median(ts)
    dist.destroy_process_group()
    return rows


def _gather(x: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return parts


def _index(layout: Any, s: int, par: Any) -> torch.Tensor:
    """Global index of sp rank ``s``'s tokens (the contiguous layout at r = 1)."""
    j, u, ulysses = par.ring_rank(s * par.tp), par.ulysses_rank(s * par.tp), par.ulysses
    return layout.sp_shard(torch.arange(layout.seq_len)[None], j, u, ulysses)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument(
        "--rings", type=int, nargs="+", default=[1, 2, 4, 8], help="ring degrees (those dividing P run)"
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--balance-seq-len", type=int, default=16384, help="tokens of the balance table")
    p.add_argument("--balance-rings", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--doc-counts", type=int, nargs="+", default=[4, 8, 16], help="packed documents per split")
    p.add_argument("--window", type=int, default=None, help="sliding window of the balance table (N/8)")
    p.add_argument("--block-size", type=int, default=1024, help="compute tile of ring_attention")
    p.add_argument("--out", default="benchmarks/results/ring.json")
    p.add_argument("--png", default=None, help="also draw the plot here (e.g. docs/img/ring.png)")
    args = p.parse_args(argv)
    n_bal = args.balance_seq_len
    window = args.window or n_bal // 8
    balance = balance_rows(n_bal, args.balance_rings, args.doc_counts, window, args.block_size)
    print(format_table(balance, BALANCE_COLUMNS))
    balanced = balance_met(balance)
    print(f"balance target (zigzag, causal, r in {BALANCE_TARGET_RINGS}: within {BALANCE_TARGET:.0%} of the mean): "
          f"{'met' if balanced else 'MISSED'}")  # fmt: skip
    rows: list[dict[str, Any]] = []
    for world in args.world_sizes:
        run = launch(_rank, world, args, timeout_s=args.timeout)
        if run.error:
            print(run.error, run.log, file=sys.stderr)
            return 1
        per_rank = run.results
        for i, row in enumerate(per_rank[0]):
            worst = max(r[i]["sent_bytes"] for r in per_rank)
            rows.append({
                **row, "ms": max(r[i]["ms"] for r in per_rank),
                "a2a_mib": max(r[i]["a2a_bytes"] for r in per_rank) / MIB,
                "ring_mib": max(r[i]["ring_bytes"] for r in per_rank) / MIB,
                "formula_mib": row["formula_bytes"] / MIB, "bytes_ratio": worst / row["formula_bytes"]
                if row["formula_bytes"] else (1.0 if worst == 0 else math.inf),
                "diff_out": max(r[i]["diff_out"] for r in per_rank),
            })  # fmt: skip
    print(format_table(rows, COLUMNS))
    keys = ("world_sizes", "rings", "seq_len", "batch", "heads", "head_dim", "dtype", "balance_seq_len",
            "balance_rings", "doc_counts", "block_size")  # fmt: skip
    config = {**{k: getattr(args, k) for k in keys}, "window": window}
    save_results("ring", config, {"rows": rows, "balance": balance}, args.out, png=args.png)
    ok = all(abs(r["bytes_ratio"] - 1.0) < 1e-9 for r in rows)
    if not ok:
        print("FAIL: a byte count differs from its formula", file=sys.stderr)
    if not balanced:
        print("FAIL: zigzag's causal work is not within the balance target", file=sys.stderr)
    return 0 if ok and balanced else 1


if __name__ == "__main__":
    raise SystemExit(main())
