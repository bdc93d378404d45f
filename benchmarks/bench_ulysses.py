"""Ulysses attention on CPU/gloo: fwd+bwd time, all-to-all bytes per rank, and DeepSpeed side by side.

For every P in ``--world-sizes`` one gloo group of P launched ranks runs, for every N in ``--seq-lens``:

* ours: ``ulysses_attention(q, k, v, backend="sdpa")`` on ``(b, N/P, h, d)`` shards, causal;
* DeepSpeed (when installed): ``DistributedAttention(local, group, scatter_idx=2, gather_idx=1)``
  called with ``batch_dim_idx=0`` (batch-first input; ``None`` is silently wrong on rank >= 1), with
  ``local`` = the very same SDPA kernel function ours calls, on the same inputs.

Measured: the median fwd+bwd wall time (slowest rank, barriers around each step, the two variants
interleaved), the bytes each rank sends to other ranks in all-to-alls (one meter wrapping
``torch.distributed.all_to_all_single`` for both; ours also by the package's own
``lightning_longctx.parallel.comm.count_all_to_all``, which must agree) against the formula, and the largest
difference between the two outputs and input gradients. Commands and results: ``benchmarks/README.md``.

Exit status 1 when a check fails (bytes != formula, count_all_to_all != the meter, or ours != DeepSpeed
beyond --atol).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from common import MIB, format_table, launch, save_results

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
VARIANTS = ("ours", "deepspeed")
COLUMNS = [
    ("P", "P", ""),
    ("N", "N", ""),
    ("h", "h", ""),
    ("ours_ms", "ours ms", ".1f"),
    ("deepspeed_ms", "DS ms", ".1f"),
    ("time_ratio", "ours/DS", ".3f"),
    ("ours_comm_ms", "a2a+layout ours ms", ".1f"),
    ("deepspeed_comm_ms", "a2a+layout DS ms", ".1f"),
    ("comm_time_ratio", "ours/DS a2a+layout", ".3f"),
    ("bytes_mib", "sent/rank MiB", ".2f"),
    ("formula_mib", "formula MiB", ".2f"),
    ("ours_bytes_ratio", "ours bytes/formula", ".2f"),
    ("deepspeed_bytes_ratio", "DS bytes/formula", ".2f"),
    ("diff_out", "max|Δout|", ".1e"),
    ("diff_grad", "max|Δgrad|", ".1e"),
]


class AllToAllBytes:
    """Context manager: bytes this rank sends to OTHER ranks through ``all_to_all_single``, whoever calls it.

    The package counts its own all-to-alls (``count_all_to_all``); DeepSpeed's go straight to
    ``torch.distributed``, so one meter patched into ``dist.all_to_all_single`` (looked up at call time
    by both) measures the two sides alike. The block a rank keeps for itself is not counted.
    """

    def __enter__(self) -> AllToAllBytes:
        self.bytes_sent = self.calls = 0
        orig = self._orig = dist.all_to_all_single

        def counted(
            output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
        ):
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            total = input.numel() * input.element_size()
            if input_split_sizes:  # split sizes count rows of dim 0
                row = total // input.shape[0] if input.shape[0] else 0
                self.bytes_sent += (sum(input_split_sizes) - input_split_sizes[rank]) * row
            else:  # even split along dim 0
                self.bytes_sent += total - total // world
            self.calls += 1
            return orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._orig


def formula_bytes(b: int, n: int, h: int, d: int, world: int, rank: int, elem: int) -> int:
    """Bytes rank ``rank`` sends to other ranks for one Ulysses attention layer, fwd + bwd (MHA).

    Forward: q, k, v each send this rank's N/P tokens of the other ranks' heads, the output sends
    this rank's heads of the other ranks' tokens. Backward: the mirror images (dout like q; dq, dk,
    dv like the output). With ``h_r = h/P`` this is ``2 * 4*b*(N/P)*h*d*elem*(P-1)/P``; uneven head
    splits are covered rank by rank.
    """
    from lightning_longctx.parallel.comm import head_split

    s, h_r = n // world, head_split(h, world)[rank]
    return 4 * (b * s * (h - h_r) * d + b * (n - s) * h_r * d) * elem


def time_interleaved(
    steps: dict[str, Callable[[], Any]], *, repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Wall time (s) of each step, ``repeats`` times after ``warmup`` untimed rounds.

    The steps run round-robin and the order rotates every round, so drift (thermal, other load)
    hits all variants alike. Each timed call sits between two barriers: the time is the slowest
    rank's, including the collectives' waiting.
    """
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _load_deepspeed(enabled: bool) -> tuple[Any, str]:
    """(DistributedAttention class or None, status); called on every rank inside the gloo group."""
    if not enabled:
        return None, "disabled (--no-deepspeed)"
    if importlib.util.find_spec("deepspeed") is None:
        return None, "not installed (pip install deepspeed)"
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        import deepspeed.comm as ds_comm

        # DeepSpeed's CPU TorchBackend JIT-compiles a shared-memory op (~30 s the first time) that
        # only serves inference_all_reduce; all_to_all_single goes straight to torch.distributed.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        ds_comm.init_distributed(dist_backend="gloo")  # wraps the group we already built
        from deepspeed.sequence.layer import DistributedAttention
    except Exception as e:
        return None, f"failed: {type(e).__name__}: {e}"
    return DistributedAttention, f"ok (deepspeed {deepspeed.__version__})"


def _fwd_bwd_step(attn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], Any]:
    """A closure running ``attn(q, k, v)`` and its backward with ``dout`` on its own leaf copies."""
    *qkv, dout = inputs
    leaves = [x.clone().requires_grad_() for x in qkv]

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        for x in leaves:
            x.grad = None
        out = attn(*leaves)
        out.backward(dout)
        return out.detach(), leaves

    return run


@contextlib.contextmanager
def _no_attention() -> Iterator[None]:
    """Swap the SDPA kernel for an elementwise stand-in (``q + k + v``), in this process only.

    Both variants look the kernel up per call, so what remains of a step is layout + all-to-all.
    """
    from lightning_longctx.attention.kernels import KERNELS, AttnOut

    saved = KERNELS["sdpa"]
    KERNELS["sdpa"] = saved._replace(fn=lambda q, k, v, **_: AttnOut(q + k + v, None))
    try:
        yield
    finally:
        KERNELS["sdpa"] = saved


def _bench_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One rank (in a launched process): a gloo group from the launcher's variables, every N measured."""
    # Imported in the ranks only (the fork server has them loaded): the parent never needs Lightning.
    from lightning_longctx.attention.kernels import KERNELS, MaskSpec
    from lightning_longctx.attention.ulysses import ulysses_attention
    from lightning_longctx.lightning.callbacks.memory import max_over_ranks
    from lightning_longctx.parallel.comm import count_all_to_all

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_cls, ds_status = _load_deepspeed(not args.no_deepspeed)
    statuses: list[Any] = [None] * world
    dist.all_gather_object(statuses, ds_status)
    if any(not s.startswith("ok") for s in statuses):  # all ranks must take the same path
        ds_cls, ds_status = None, next(s for s in statuses if not s.startswith("ok"))

    b, h, d, dtype = args.batch, args.heads, args.head_dim, DTYPES[args.dtype]
    scale, mask = 1.0 / math.sqrt(d), MaskSpec(causal=True)

    def local_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # (b, N, h/P, d) in and out: DeepSpeed's layout after its all-to-all with batch_dim_idx=0.
        # Looked up per call, like ulysses_attention does, so `_no_attention` swaps both.
        return KERNELS["sdpa"].fn(q, k, v, scale=scale, mask=mask).out

    def largest(x: torch.Tensor) -> float:
        """max |x| over all ranks (every rank calls it, in the same order)."""
        return float(max_over_ranks(x.abs().max().double()))

    if ds_cls is not None and h % world:
        # DeepSpeed's uneven-heads all-to-all reads its own sequence-parallel groups (mpu), which a
        # bare process group does not set up: it raises on some ranks and the others hang.
        ds_cls, ds_status = None, f"skipped: heads {h} not divisible by P={world} (DeepSpeed needs its mpu)"
    variants = {"ours": lambda q, k, v: ulysses_attention(q, k, v, causal=True, backend="sdpa")}
    if ds_cls is not None:
        ds_attn = ds_cls(local_attn, dist.group.WORLD, scatter_idx=2, gather_idx=1)
        variants["deepspeed"] = lambda q, k, v: ds_attn(q, k, v, 0)  # batch_dim_idx=0: batch-first

    rows = []
    for n in args.seq_lens:
        s = n // world
        g = torch.Generator().manual_seed(1234 + n)
        full = [torch.randn(b, n, h, d, generator=g, dtype=dtype) for _ in range(4)]  # q, k, v, dout
        q, k, v, dout = (x[:, rank * s : (rank + 1) * s].contiguous() for x in full)
        del full

        steps = {name: _fwd_bwd_step(fn, q, k, v, dout) for name, fn in variants.items()}
        row: dict[str, Any] = {"P": world, "N": n, "b": b, "h": h, "d": d, "dtype": args.dtype}
        row["bytes_formula"] = formula_bytes(b, n, h, d, world, rank, q.element_size())
        outs = {}
        for name, step in steps.items():
            with AllToAllBytes() as meter, count_all_to_all() as count:
                outs[name] = step()
            row |= {f"{name}_bytes": meter.bytes_sent, f"{name}_a2a_calls": meter.calls}
            if name == "ours":  # the key predates count_all_to_all (it was COMM_STATS): kept for old results
                row["ours_comm_stats_bytes"] = count.bytes_sent
        if "deepspeed" in outs:
            (o1, g1), (o2, g2) = outs["ours"], outs["deepspeed"]
            row["diff_out"] = largest(o1 - o2)
            row["diff_grad"] = max(largest(a.grad - c.grad) for a, c in zip(g1, g2))
            if n == args.seq_lens[0]:  # the trap, shown once: batch_dim_idx=None on batch-first input
                with torch.no_grad():
                    row["deepspeed_batch_dim_none_diff"] = largest(ds_attn(q, k, v, None) - o1)
        del outs

        times = time_interleaved(steps, repeats=args.repeats, warmup=args.warmup)
        with _no_attention():
            comm_steps = {f"{name}_comm": _fwd_bwd_step(variants[name], q, k, v, dout) for name in steps}
            times |= time_interleaved(comm_steps, repeats=args.comm_repeats, warmup=1)
        rows.append(row | {f"{name}_s": ts for name, ts in times.items()})
    dist.destroy_process_group()
    return {"rank": rank, "deepspeed_status": ds_status, "rows": rows}


def _merge(per_rank: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """One row per (P, N): slowest rank per repeat, then the median; bytes of every rank."""
    merged = []
    for i, row0 in enumerate(per_rank[0]["rows"]):
        rows = [r["rows"][i] for r in per_rank]
        row = {k: row0[k] for k in ("P", "N", "b", "h", "d", "dtype")}
        for name in ("ours", "deepspeed", "ours_comm", "deepspeed_comm"):
            if f"{name}_s" in row0:
                per_rep = [max(ts) for ts in zip(*(r[f"{name}_s"] for r in rows))]
                row[f"{name}_ms"] = 1e3 * statistics.median(per_rep)
                row[f"{name}_ms_repeats"] = [round(1e3 * t, 3) for t in per_rep]
        for name in VARIANTS:
            if f"{name}_bytes" in row0:
                row[f"{name}_bytes_per_rank"] = [r[f"{name}_bytes"] for r in rows]
                row[f"{name}_a2a_calls"] = row0[f"{name}_a2a_calls"]
                # the rank farthest from its own formula decides the ratio
                ratios = [r[f"{name}_bytes"] / r["bytes_formula"] for r in rows]
                row[f"{name}_bytes_ratio"] = round(max(ratios, key=lambda x: abs(x - 1.0)), 6)
        row["formula_bytes_per_rank"] = [r["bytes_formula"] for r in rows]
        row["ours_comm_stats_bytes_per_rank"] = [r["ours_comm_stats_bytes"] for r in rows]
        row["bytes_mib"] = max(row["ours_bytes_per_rank"]) / MIB
        row["formula_mib"] = max(row["formula_bytes_per_rank"]) / MIB
        row |= {k: row0[k] for k in ("diff_out", "diff_grad", "deepspeed_batch_dim_none_diff") if k in row0}
        if "deepspeed_ms" in row:
            # Paired: both ran back to back in the same round, so a ratio per round cancels the
            # load drift of a shared machine better than a ratio of two medians.
            for key, a, c in (
                ("time_ratio", "ours", "deepspeed"),
                ("comm_time_ratio", "ours_comm", "deepspeed_comm"),
            ):
                pairs = zip(row[f"{a}_ms_repeats"], row[f"{c}_ms_repeats"])
                row[key] = statistics.median([x / y for x, y in pairs])
        merged.append(row)
    return per_rank[0]["deepspeed_status"], merged


def checks(rows: list[dict[str, Any]], atol: float) -> list[str]:
    """What failed: bytes vs formula, the package's count vs the meter, ours vs DeepSpeed."""
    failures = []
    for r in rows:
        where = f"P={r['P']} N={r['N']}"
        for name in VARIANTS:
            ratio = r.get(f"{name}_bytes_ratio")
            if ratio is not None and abs(ratio - 1.0) > 1e-9:
                failures.append(f"{where}: {name} bytes/formula = {ratio}")
        if r["ours_comm_stats_bytes_per_rank"] != r["ours_bytes_per_rank"]:
            failures.append(f"{where}: count_all_to_all disagrees with the all-to-all meter")
        for key in ("diff_out", "diff_grad"):
            if r.get(key) is not None and r[key] > atol:
                failures.append(f"{where}: ours vs DeepSpeed {key} = {r[key]:.2e} > {atol}")
    return failures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192], help="global sequence lengths N"
    )
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="sequence-parallel sizes P")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=5, help="timed fwd+bwd steps per variant (median reported)")
    p.add_argument(
        "--warmup", type=int, default=0, help="extra untimed rounds (the bytes pass runs each once)"
    )
    p.add_argument("--comm-repeats", type=int, default=10, help="timed steps of the a2a+layout-only variants")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed even when installed")
    p.add_argument("--atol", type=float, default=1e-5, help="largest ours-vs-DeepSpeed difference accepted")
    p.add_argument("--timeout", type=float, default=900, help="seconds one world size may take")
    p.add_argument("--out", default="benchmarks/results/ulysses.json", help="JSON output path")
    args = p.parse_args(argv)
    for n in args.seq_lens:
        for w in args.world_sizes:
            if n % w:
                p.error(f"--seq-lens {n} is not divisible by world size {w}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    statuses: dict[int, str] = {}
    for world in args.world_sizes:
        per_rank = launch(_bench_rank, world, args, threads=args.threads, timeout_s=args.timeout).check()
        statuses[world], merged = _merge(per_rank)
        rows += merged
    ds_status = "; ".join(f"P={w}: {st}" for w, st in statuses.items())
    if len(set(statuses.values())) == 1:
        ds_status = next(iter(statuses.values()))
    elapsed = time.perf_counter() - t0
    failures = checks(rows, args.atol)

    cores = os.cpu_count() or 1
    print(f"Ulysses attention fwd+bwd, CPU/gloo, b={args.batch} h={args.heads} d={args.head_dim} {args.dtype}, "
          f"{args.threads} thread(s)/rank, {cores} cores; ms: median of {args.repeats} (slowest rank), "
          "ratios: median of per-round ours/DS")  # fmt: skip
    print(f"deepspeed: {ds_status}")
    print(format_table(rows, COLUMNS))
    trap = [r["deepspeed_batch_dim_none_diff"] for r in rows if "deepspeed_batch_dim_none_diff" in r]
    if trap:
        print(
            f"DeepSpeed with batch_dim_idx=None on batch-first input: max|Δout| = {max(trap):.2e} (the trap)"
        )
    if max(args.world_sizes) > cores:
        print(f"note: P={max(args.world_sizes)} ranks share {cores} cores: times include oversubscription")
    fields = {"deepspeed": ds_status, "elapsed_s": round(elapsed, 2), "checks_passed": not failures}
    save_results("ulysses_attention", vars(args), fields | {"failures": failures, "results": rows}, args.out)
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
