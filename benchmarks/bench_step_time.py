"""The step-time model against this machine: predicted vs measured CPU step times, and the published runs.

1. ``calibrate_cpu()`` (``calibrate_step_time.py``) measures this machine as a device (fp32 matmul FLOP/s, the
   fused CPU attention kernel's forward / backward FLOP/s, a copy's memory bandwidth, one operator's latency,
   gloo's all-to-all bandwidth).
2. Every point of the grid (Ulysses, FPDT and FPDT with offload at P = 1, 2, 4 and N = 2K-16K) is a fresh
   Lightning run of a small Llama (bench_throughput's runner: ``--warmup`` + ``--steps`` AdamW steps, rank 0's
   wall time between batch ends, median of the measured steps), one thread per rank, next to
   ``estimate_step_time(..., gpu=<the calibration>)`` for the same settings.
3. ``--published``: the published runs (``lightning_longctx.planner.published``) with the model's prediction.

The load average before and after is recorded: other processes on the machine slow the measured steps and
not the prediction (rerun when it was busy).

    python benchmarks/bench_step_time.py              # the grid: ~10-20 min on 2 idle cores
    python benchmarks/bench_step_time.py --smoke      # 2 tiny points, < 1 min
    python benchmarks/bench_step_time.py --published  # the published table only (no runs)
    python benchmarks/bench_step_time.py --comm       # communication-bound points (Ulysses, short rows), ~1 min
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_throughput import _fit_once
from calibrate_step_time import calibrate_cpu, collective_seconds
from common import add_model_args, format_table, launch, save_results

from lightning_longctx.planner.published import PUBLISHED_RUNS
from lightning_longctx.planner.step_time import estimate_step_time

#: (P, N) points of the grid; each runs every mode
GRID = ((1, 2048), (1, 4096), (1, 8192), (2, 4096), (2, 8192), (2, 16384), (4, 8192), (4, 16384))
MODES = ("ulysses", "fpdt", "fpdt_offload")
#: ``--comm``: short rows (64 tokens per rank), where DDP's gradient all-reduce is a third to a half of the
#: step, and P = 1 at the same rows (no collective): the points that see how the model prices a collective
#: (the grid above is compute-bound)
COMM_GRID = ((1, 64), (2, 128), (4, 256))
#: ``--comm``'s collectives alone: (kind, ranks), a buffer of COLLECTIVE_BYTES per rank
COLLECTIVES = (("all_to_all", 2), ("all_to_all", 4), ("all_reduce", 2), ("all_reduce", 4))
COLLECTIVE_BYTES = 8 << 20
COLLECTIVE_COLUMNS = [
    ("collective", "collective", ""),
    ("ranks", "ranks", ""),
    ("sent_mib", "MiB a rank sends", ".3g"),
    ("measured_ms", "measured ms", ".1f"),
    ("predicted_ms", "predicted ms", ".1f"),
    ("error_pct", "error %", "+.1f"),
    ("counted_twice_ms", "(n-1)/n twice: ms", ".1f"),
]
COLUMNS = [
    ("world_size", "P", ""),
    ("seq_len", "N", ""),
    ("mode", "mode", ""),
    ("chunk_size", "chunk", ""),
    ("measured_s", "measured s", ".3f"),
    ("predicted_s", "predicted s", ".3f"),
    ("error_pct", "error %", "+.1f"),
    ("binding", "binds", ""),
    ("comm_pct", "comm %", ".0f"),
    ("status", "status", ""),
]
PUBLISHED_COLUMNS = [
    ("name", "run", ""),
    ("metric", "metric", ""),
    ("published", "published", ".1f"),
    ("predicted", "predicted", ".1f"),
    ("error", "error", ""),
    ("mfu_pct", "our MFU %", ".1f"),
    ("hfu_pct", "our HFU %", ".1f"),
    ("binding", "binds", ""),
    ("tolerance", "tolerance", ""),
    ("within", "within", ""),
    ("fitted", "fitted", ""),
]


def published_rows() -> list[dict[str, Any]]:
    rows = []
    for run in PUBLISHED_RUNS:
        est = run.estimate()
        err = run.error(est)
        rows.append({
            "name": run.name, "metric": "s / step" if run.metric == "step_s" else "MFU % (hw FLOPs)",
            "published": run.published, "predicted": run.predicted(est),
            "error": f"{100 * err:+.1f} %" if run.metric == "step_s" else f"{err:+.1f} pts",
            "mfu_pct": 100 * est.mfu, "hfu_pct": 100 * est.hfu, "binding": est.binding,
            "tolerance": run.tolerance_text(), "within": "yes" if run.within(est) else "**no**",
            "fitted": "yes" if run.fit else "", "fit": run.fit, "source": run.source, "assumption": run.assumption,
        })  # fmt: skip
    return rows


def _communication_by_difference(rows: list[dict[str, Any]]) -> str:
    """``--comm``: each P > 1 step minus the P = 1 step at the same tokens per rank, measured and predicted
    (what the ranks add: the collectives and, past the cores, the sharing of them)."""
    one = next((r for r in rows if r["world_size"] == 1 and r.get("measured_s")), None)
    if one is None:
        return "no P = 1 point: no difference"
    lines = []
    for r in rows:
        if r["world_size"] > 1 and r.get("measured_s"):
            got, want = r["measured_s"] - one["measured_s"], r["predicted_s"] - one["predicted_s"]
            lines.append(
                f"P={r['world_size']} minus P=1: measured {got * 1e3:.1f} ms, predicted {want * 1e3:.1f} ms"
            )
    return "\n".join(lines)


def chunk_for(n: int, p: int, mode: str) -> int | None:
    """FPDT: four chunks per rank (at least 256 tokens); Ulysses: None."""
    return None if mode == "ulysses" else max(256, n // (4 * p))


def predict(spec: Any, model: dict[str, Any], p: int, n: int, mode: str, chunk: int | None) -> Any:
    kw: dict[str, Any] = (
        {"mode": "ulysses"} if mode == "ulysses" else {"mode": "fpdt", "fpdt_chunk_size": chunk}
    )
    return estimate_step_time(
        model, seq_len=n, sequence_parallel_size=p, gpu=spec, gpus_per_node=p, precision="32-true",
        offload=mode == "fpdt_offload", **kw,
    )  # fmt: skip


def measure(
    args: argparse.Namespace, model: dict[str, Any], p: int, n: int, mode: str, chunk: int | None
) -> dict:
    cfg = {"mode": mode, "seq_len": n, "chunk_size": chunk, "model": model, "peak_flops": 1e9, "device": "cpu",
           "precision": "32-true", "world_size": p, "warmup": args.warmup, "steps": args.steps,
           "activation_checkpointing": False}  # fmt: skip
    done = launch(_fit_once, p, cfg, threads=1, timeout_s=args.timeout)
    if done.error:
        return {"status": done.error.splitlines()[0], "log_tail": done.log[-2000:]}
    steps = done.results[0]["step_s"]
    return {"status": "ok", "step_s": steps, "measured_s": statistics.median(steps[args.warmup :])}


def collectives(spec: Any, timeout: float) -> list[dict[str, Any]]:
    """Each of :data:`COLLECTIVES` on fresh gloo ranks (one thread each), the median time of a call against
    the model's price: the bytes a rank sends, ``(n-1)/n`` of the buffer for an all-to-all and ``2(n-1)/n`` for
    an all-reduce, at the calibration's rate (an all-to-all of 2 ranks); beside it, what the model said when it
    counted ``(n-1)/n`` twice (before issue 43)."""
    from lightning_longctx.planner.step_time import _transfer_s

    rows = []
    for kind, n in COLLECTIVES:
        done = launch(collective_seconds, n, kind, COLLECTIVE_BYTES, threads=1, timeout_s=timeout)
        if done.error:
            rows.append({"collective": kind, "ranks": n, "status": done.error.splitlines()[0]})
            continue
        sent = (2 if kind == "all_reduce" else 1) * (n - 1) / n * COLLECTIVE_BYTES
        predicted = _transfer_s(spec, sent, n, 1, n)
        measured = max(done.results)
        rows.append({"collective": kind, "ranks": n, "sent_mib": sent / 2**20, "measured_ms": 1e3 * measured,
                     "predicted_ms": 1e3 * predicted, "error_pct": 100 * (predicted / measured - 1),
                     "counted_twice_ms": 1e3 * predicted * (n - 1) / n, "status": "ok"})  # fmt: skip
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 5.0))
    marks = {"ulysses": "o", "fpdt": "s", "fpdt_offload": "^"}
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green"}
    ok = [r for r in rows if r.get("measured_s") and r.get("predicted_s")]
    if ok:
        lo = min(min(r["measured_s"], r["predicted_s"]) for r in ok) * 0.8
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in ok) * 1.25
        ax.fill_between(
            [lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="0.9", label="±25 %", zorder=1
        )
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, zorder=2)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    for r in ok:
        ax.scatter(r["measured_s"], r["predicted_s"], marker=marks[r["mode"]], color=colors.get(r["world_size"]),
                   zorder=3)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(ScalarFormatter())
    for mode, m in marks.items():
        ax.scatter([], [], marker=m, color="0.3", label=mode)
    for p, c in colors.items():
        ax.scatter([], [], marker="o", color=c, label=f"P = {p}")
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title("Step-time model vs this CPU (calibrated)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--published", action="store_true", help="print the published-runs table only")
    add_model_args(p, hidden=256, intermediate=768, layers=2, heads=4, vocab=2048)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true", help="two tiny points")
    p.add_argument("--comm", action="store_true", help="the communication-bound points (COMM_GRID)")
    p.add_argument("--out", default=None, help="default benchmarks/results/step_time[_comm].json")
    p.add_argument("--png", default="docs/img/step_time.png")
    p.add_argument("--replot", action="store_true", help="redraw --png from the rows of --out (no runs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out or f"benchmarks/results/step_time{'_comm' if args.comm else ''}.json"
    if args.replot:
        import json

        print(f"wrote {plot(json.loads(Path(args.out).read_text())['rows'], Path(args.png))}")
        return 0
    pub = published_rows()
    print(format_table(pub, PUBLISHED_COLUMNS))
    if args.published:
        return 0
    grid = ((1, 1024), (2, 2048)) if args.smoke else COMM_GRID if args.comm else GRID
    modes = ("ulysses",) if args.comm else MODES
    model = {"model_type": "llama", "hidden_size": args.hidden, "intermediate_size": args.intermediate,
             "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
             "num_key_value_heads": args.heads, "vocab_size": args.vocab,
             "max_position_embeddings": max(n for _, n in grid), "tie_word_embeddings": False,
             "attention_dropout": 0.0}  # fmt: skip
    t0, load_before = time.perf_counter(), os.getloadavg()
    spec = calibrate_cpu(seconds=0.5 if args.smoke else 3.0)
    print(f"calibration: {spec.to_dict()}")
    collective_rows = collectives(spec, args.timeout) if args.comm else []
    if collective_rows:
        print(format_table(collective_rows, COLLECTIVE_COLUMNS))
    rows = []
    for p, n in grid:
        for mode in modes:
            chunk = chunk_for(n, p, mode)
            est = predict(spec, model, p, n, mode, chunk)
            load = os.getloadavg()[0]
            got = measure(args, model, p, n, mode, chunk)
            row = {"world_size": p, "seq_len": n, "mode": mode, "chunk_size": chunk, "predicted_s": est.step_time_s,
                   "binding": est.binding, "load_1min": load, **got,
                   "comm_pct": 100 * est.exposed_communication_s / est.step_time_s,
                   "components": {c.name: c.exposed for c in est.components}}  # fmt: skip
            if got.get("measured_s"):
                row["error_pct"] = 100 * (est.step_time_s / got["measured_s"] - 1)
            print(f"  P={p} N={n} {mode}: measured {got.get('measured_s')}, predicted {est.step_time_s:.3f} s "
                  f"(load {load:.1f})", flush=True)  # fmt: skip
            rows.append(row)
    print()
    print(format_table(rows, COLUMNS))
    errors = [abs(r["error_pct"]) for r in rows if "error_pct" in r]
    within = sum(e <= 25 for e in errors)
    load_after = os.getloadavg()
    print(
        f"\n{within} of {len(errors)} points within ±25 %; load average before {load_before}, after {load_after}"
    )
    if args.comm:
        print(_communication_by_difference(rows))
    fields = {"calibration": spec.to_dict(), "model": model, "rows": rows, "published": pub,
              "collectives": collective_rows,
              "within_25pct": within, "points": len(errors), "load_before": load_before, "load_after": load_after,
              "cpu_count": os.cpu_count(), "elapsed_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    save_results("step_time", vars(args), fields, args.out)
    png = None if args.comm else plot(rows, Path(args.png))
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
