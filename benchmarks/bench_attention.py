"""FPDT vs Ulysses attention on CPU/gloo: fwd+bwd time on the same inputs, and where FPDT's time goes.

For every P in ``--world-sizes`` one gloo group of P launched ranks (``common.launch``) runs, for every
N in ``--seq-lens``, the same global q, k, v and output gradient (b, N, h, d) through:

* ``ulysses``: ``ulysses_attention(..., backend="sdpa")`` on contiguous ``(b, N/P, h, d)`` shards;
* ``fpdt``: ``fpdt_attention(..., chunk_size=c)`` on the FPDT layout (``shard_sequence(...,
  chunk_size=c)``), default backend (the fused block kernel where its probe passed), overlap on;
* ``fpdt_offload``: the same with ``offload=True``;
* ``fpdt_no_overlap``: ``overlap=False`` (every all-to-all completes before the next block);
* ``fpdt_math``: ``backend="math"`` (the plain-PyTorch reference blocks).

All causal. Measured: the median fwd+bwd wall time (slowest rank: barriers around each step; the
variants interleaved round-robin, the order rotating every round), the paired per-round ratio of each
FPDT variant to Ulysses, the kernels FPDT's blocks ran, the largest difference of FPDT's output and
input gradients from Ulysses' (gathered into global order), and one profiled step per variant
(``torch.profiler``, rank 0): self CPU time by op, grouped into attention kernels, all-to-all waits,
layout copies and the rest. Commands and results: ``benchmarks/README.md``, ``docs/benchmarks.md``.

Exit status 1 when a difference exceeds ``--atol``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from bench_ulysses import time_interleaved
from common import format_table, launch, save_results

VARIANTS = ("ulysses", "fpdt", "fpdt_offload", "fpdt_no_overlap", "fpdt_math")
FPDT_KW: dict[str, dict[str, Any]] = {
    "fpdt": {},
    "fpdt_offload": {"offload": True},
    "fpdt_no_overlap": {"overlap": False},
    "fpdt_math": {"backend": "math"},
}
#: profile op names -> the share they are reported under (first match wins, substrings of the name)
PROFILE_GROUPS = (
    ("fused attention ops", ("scaled_dot_product",)),
    ("matmuls (math blocks)", ("bmm", "aten::mm", "einsum")),
    ("all-to-all (gloo, in the op)", ("alltoall", "all_to_all", "allgather", "all_gather")),
    ("layout copies", ("copy_", "clone", "contiguous", "aten::cat")),
)


def _group_of(op: str) -> str:
    for group, keys in PROFILE_GROUPS:
        if any(k in op for k in keys):
            return group
    return "other (exp/masks of math blocks, merges, autograd, python)"


def _profile(step: Callable[[], Any]) -> dict[str, Any]:
    """Self CPU time of one fwd+bwd, by op (top 12) and by group, in ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    ops = [(e.key, e.self_cpu_time_total / 1e3) for e in prof.key_averages()]
    ops.sort(key=lambda kv: -kv[1])
    groups: dict[str, float] = defaultdict(float)
    for key, ms in ops:
        groups[_group_of(key)] += ms
    return {
        "wall_ms": round(1e3 * wall, 1),
        "groups_ms": {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_ops_ms": [[k, round(v, 1)] for k, v in ops[:12]],
    }


def _bench_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank (a launched process): a gloo group from the launcher's variables, every N measured."""
    from lightning_longctx import gather_sequence, shard_sequence
    from lightning_longctx.attention.fpdt import fpdt_attention
    from lightning_longctx.attention.ulysses import ulysses_attention
    from lightning_longctx.lightning.callbacks.memory import max_over_ranks

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    b, h, h_kv, d, c = args.batch, args.heads, args.kv_heads or args.heads, args.head_dim, args.chunk_size
    variants = [v for v in args.variants if v in VARIANTS]

    rows = []
    for n in args.seq_lens:
        g = torch.Generator().manual_seed(1234 + n)
        full = [torch.randn(b, n, hh, d, generator=g) for hh in (h, h_kv, h_kv, h)]  # q, k, v, dout
        layouts = {"ulysses": None, "fpdt": c}
        shards = {name: [shard_sequence(x, chunk_size=cs) for x in full] for name, cs in layouts.items()}
        del full
        kernels: set[str] = set()

        def make(name: str, shards: dict[str, list[torch.Tensor]], kernels: set[str]) -> Callable[[], Any]:
            layout = "ulysses" if name == "ulysses" else "fpdt"
            *qkv, dout = shards[layout]
            leaves = [x.clone().requires_grad_() for x in qkv]

            def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
                for x in leaves:
                    x.grad = None
                if name == "ulysses":
                    out = ulysses_attention(*leaves, causal=True, backend="sdpa")
                else:
                    out = fpdt_attention(*leaves, chunk_size=c, causal=True, **FPDT_KW[name])
                    if name == "fpdt":
                        kernels.update(out.grad_fn.call.plan.kernel_names())
                out.backward(dout)
                return out.detach(), leaves

            return run

        steps = {name: make(name, shards, kernels) for name in variants}
        row: dict[str, Any] = {"P": world, "N": n, "b": b, "h": h, "h_kv": h_kv, "d": d, "chunk": c}
        outs = {name: steps[name]() for name in variants}  # also the warm-up (probe, allocator)
        if "ulysses" in outs:
            ref_out, ref_leaves = outs["ulysses"]
            ref = [gather_sequence(x) for x in (ref_out, *(t.grad for t in ref_leaves))]
            for name in variants[1:] if variants[0] == "ulysses" else variants:
                if name == "ulysses":
                    continue
                o, leaves = outs[name]
                got = [gather_sequence(x, chunk_size=c) for x in (o, *(t.grad for t in leaves))]
                row[f"{name}_diff"] = max(
                    float(max_over_ranks((a - e).abs().max().double())) for a, e in zip(got, ref)
                )
        del outs
        times = time_interleaved(steps, repeats=args.repeats, warmup=args.warmup)
        row |= {f"{name}_s": ts for name, ts in times.items()}
        if args.profile and n in args.profile_seq_lens:
            profiles = {name: _profile(steps[name]) for name in variants}
            if rank == 0:
                row["profile_rank0"] = profiles
        row["fpdt_kernels"] = sorted(kernels)
        rows.append(row)
    dist.destroy_process_group()
    return {"rank": rank, "rows": rows}


def _merge(per_rank: list[dict[str, Any]], variants: list[str]) -> list[dict[str, Any]]:
    """One row per (P, N): slowest rank per repeat, then the median; ratios paired per round."""
    merged = []
    for i, row0 in enumerate(per_rank[0]["rows"]):
        rows = [r["rows"][i] for r in per_rank]
        row = {k: row0[k] for k in ("P", "N", "b", "h", "h_kv", "d", "chunk", "fpdt_kernels")}
        for name in variants:
            per_rep = [max(ts) for ts in zip(*(r[f"{name}_s"] for r in rows))]
            row[f"{name}_ms"] = 1e3 * statistics.median(per_rep)
            row[f"{name}_ms_repeats"] = [round(1e3 * t, 2) for t in per_rep]
            if f"{name}_diff" in row0:
                row[f"{name}_diff"] = row0[f"{name}_diff"]
        for name in variants:
            if name != "ulysses" and "ulysses" in variants:
                pairs = zip(row[f"{name}_ms_repeats"], row["ulysses_ms_repeats"])
                row[f"{name}_ratio"] = statistics.median([x / y for x, y in pairs])
        if "fpdt" in variants and "fpdt_no_overlap" in variants:
            pairs = zip(row["fpdt_ms_repeats"], row["fpdt_no_overlap_ms_repeats"])
            row["overlap_gain"] = 1 - statistics.median([x / y for x, y in pairs])
        if "profile_rank0" in row0:
            row["profile_rank0"] = row0["profile_rank0"]
        merged.append(row)
    return merged


def columns(variants: list[str]) -> list[tuple[str, str, str]]:
    cols = [("P", "P", ""), ("N", "N", ""), ("chunk", "chunk", "")]
    cols += [(f"{v}_ms", f"{v} ms", ".0f") for v in variants]
    cols += [(f"{v}_ratio", f"{v}/ulysses", ".3f") for v in variants if v != "ulysses"]
    cols += [("overlap_gain", "overlap saved", ".1%"), ("fpdt_diff", "max|Δ| fpdt", ".1e")]
    return cols


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384], help="global sequence lengths N")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="sequence-parallel sizes P")
    p.add_argument("--chunk-size", type=int, default=2048, help="FPDT tokens per chunk per rank")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA kv heads (default: = heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--repeats", type=int, default=5, help="timed fwd+bwd steps per variant (median)")
    p.add_argument(
        "--warmup", type=int, default=0, help="extra untimed rounds (one untimed step always runs)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="profile one step per variant (rank 0)")  # fmt: skip
    p.add_argument("--profile-seq-lens", type=int, nargs="+", default=[8192], help="N values to profile")
    p.add_argument("--atol", type=float, default=1e-4, help="largest FPDT-vs-Ulysses difference accepted")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one world size may take")
    p.add_argument("--out", default="benchmarks/results/attention.json", help="JSON output path")
    p.add_argument("--plot", default=None, help="PNG path (default: the JSON's, .png)")
    args = p.parse_args(argv)
    if "ulysses" not in args.variants:
        p.error("--variants must include ulysses (every ratio is against it)")
    args.variants = ["ulysses", *[v for v in args.variants if v != "ulysses"]]
    for n in args.seq_lens:
        for w in args.world_sizes:
            if n % (w * args.chunk_size):
                p.error(f"--seq-lens {n} is not a multiple of P * chunk = {w} * {args.chunk_size}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for world in args.world_sizes:
        per_rank = launch(_bench_rank, world, args, threads=args.threads, timeout_s=args.timeout).check()
        rows += _merge(per_rank, args.variants)
    load_after = os.getloadavg()
    failures = [
        f"P={r['P']} N={r['N']}: {v} differs from ulysses by {r[f'{v}_diff']:.2e} > {args.atol}"
        for r in rows
        for v in args.variants
        if r.get(f"{v}_diff") is not None and r[f"{v}_diff"] > args.atol
    ]
    cores = os.cpu_count() or 1
    print(f"attention fwd+bwd, CPU/gloo, b={args.batch} h={args.heads} h_kv={args.kv_heads or args.heads} "
          f"d={args.head_dim} fp32 causal, FPDT chunk {args.chunk_size}, {args.threads} thread(s)/rank, {cores} "
          f"cores; ms: median of {args.repeats} (slowest rank); ratios: median of per-round ratios; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")  # fmt: skip
    print(format_table(rows, columns(args.variants)))
    print("FPDT kernels: " + ", ".join(f"P={r['P']} N={r['N']}: {'+'.join(r['fpdt_kernels'])}" for r in rows))
    for r in rows:
        for name, prof in (r.get("profile_rank0") or {}).items():
            shares = ", ".join(f"{k} {v:.0f}" for k, v in prof["groups_ms"].items())
            print(
                f"profile P={r['P']} N={r['N']} {name}: wall {prof['wall_ms']:.0f} ms; self CPU ms: {shares}"
            )
    fields = {
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "load_average": {"before": load_before, "after": load_after},
        "checks_passed": not failures,
        "failures": failures,
        "results": rows,
    }
    png = args.plot or os.path.splitext(args.out)[0] + ".png"
    save_results("attention", vars(args), fields, args.out, png)
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
