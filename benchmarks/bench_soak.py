"""CPU soak: many training steps at sp=2 with FPDT + offload; host memory must stay flat.

Two launched ranks train a tiny Llama through a real ``lightning.Trainer`` with
``UlyssesFPDTStrategy(sequence_parallel_size=2, fpdt_chunk_size=64, offload=True)``, one new sequence
per step. After every step each rank records its RSS and ``offloaded_bytes()`` (bytes live FPDT stores
keep in host buffers: must be 0 between steps); before every backward ``offloaded_bytes()`` again
(must be > 0, or nothing was offloaded and the soak proves nothing). Verdict: the RSS slope in MiB
per 100 steps, least squares over ``--fit-from`` .. the last step (the first steps grow allocator
pools and caches), on the RSS read right after glibc's ``malloc_trim(0)``: without it, freed heap that
glibc keeps below a small live block stays in the RSS, and the raw RSS can climb 100-200 MiB for tens
of steps and fall back, which reads as a leak and is not one (the raw slope is shown too). A leak of
one step's offloaded k/v would be ~2 MiB per step, > 100 MiB per 100 steps. See ``benchmarks/README.md``.

Exit status 1 when bytes stay offloaded between steps, nothing was offloaded, or a rank's slope is
above ``--max-slope-mib`` (checked when the fit window holds at least 50 steps).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import common
from common import MIB

HERE = Path(__file__).resolve().parent
MIN_FIT_STEPS = 50  # fewer steps than this in the fit window: warm-up growth dominates, no verdict
COLUMNS = [
    ("rank", "rank", ""),
    ("steps", "steps", ""),
    ("slope", "RSS slope MiB/100 steps", ".2f"),
    ("raw_slope", "raw RSS slope", ".2f"),
    ("rss_first", "RSS step 1 MiB", ".1f"),
    ("rss_fit_start", "RSS fit start", ".1f"),
    ("rss_last", "RSS last", ".1f"),
    ("rss_max", "RSS max", ".1f"),
    ("raw_max", "raw RSS max", ".1f"),
    ("off_between", "offloaded between steps B", ""),
    ("off_during_mib", "offloaded before bwd MiB", ".2f"),
    ("s_per_step", "s/step", ".2f"),
]


def _soak(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of the soak (runs in a launched process): its record of every step."""
    import lightning as L

    from lightning_longctx.attention.offload import offloaded_bytes
    from lightning_longctx.lightning.callbacks.memory import host_rss_bytes

    trim = None if args.no_trim else common.malloc_trim()

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.in_step: list[int] = []

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self.in_step.append(offloaded_bytes())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            raw = host_rss_bytes()
            if trim is not None:
                trim(0)  # hand free heap pages back to the OS: what stays is (close to) live memory
            self.steps.append(
                {
                    "step": trainer.global_step,
                    "rss_bytes": raw,
                    "rss_trimmed_bytes": host_rss_bytes() if trim is not None else raw,
                    "offloaded_bytes": offloaded_bytes(),
                    "offloaded_before_backward": self.in_step[-1] if self.in_step else 0,
                    "loss": float(loss.detach()),
                    "time": time.perf_counter(),
                }
            )

    recorder = Recorder()
    trainer = common.bench_trainer(
        "fpdt_offload",
        args.world_size,
        chunk_size=args.chunk_size,
        callbacks=[recorder],
        max_steps=args.steps,
    )
    trainer.fit(common.token_lm_module(args, num_samples=args.steps, lr=0.05))
    return {"rank": trainer.global_rank, "steps": recorder.steps}


def summarize_rank(r: dict[str, Any], fit_from: int) -> dict[str, Any]:
    """One table row: slopes (MiB per 100 steps) over the fit window, RSS levels, offloaded bytes."""
    steps = r["steps"]
    fit = [s for s in steps if s["step"] >= fit_from]

    def slope(key: str) -> float:
        if len({s["step"] for s in fit}) < 2:
            return float("nan")
        return 100.0 * common.linear_fit([s["step"] for s in fit], [s[key] / MIB for s in fit])[1]

    live = [s["rss_trimmed_bytes"] / MIB for s in steps]
    times = [s["time"] for s in steps]
    return {
        "rank": r["rank"],
        "steps": len(steps),
        "slope": slope("rss_trimmed_bytes"),
        "raw_slope": slope("rss_bytes"),
        "rss_first": live[0],
        "rss_fit_start": fit[0]["rss_trimmed_bytes"] / MIB if fit else None,
        "rss_last": live[-1],
        "rss_max": max(live),
        "raw_max": max(s["rss_bytes"] for s in steps) / MIB,
        "off_between": max(s["offloaded_bytes"] for s in steps),
        "off_during_mib": max(s["offloaded_before_backward"] for s in steps) / MIB,
        "s_per_step": (times[-1] - times[0]) / max(1, len(times) - 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fit-from", type=int, default=50, help="first step of the slope fit")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--world-size", type=int, default=2, help="sequence-parallel ranks")
    p.add_argument("--chunk-size", type=int, default=64, help="FPDT tokens per chunk per rank")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    common.add_model_args(p, vocab=32000, hidden=256, intermediate=688, layers=2, heads=4)
    p.add_argument("--max-slope-mib", type=float, default=5.0, help="fail above this RSS slope per 100 steps")
    p.add_argument("--no-trim", action="store_true", help="no malloc_trim(0) after each step (raw RSS only)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    args = p.parse_args()

    run = common.launch(_soak, args.world_size, args, threads=args.threads, timeout_s=args.timeout)
    if run.error:
        print(run.log, file=sys.stderr)
        print(f"soak failed: {run.error}", file=sys.stderr)
        return 1
    ranks = run.results
    rows = [summarize_rank(r, args.fit_from) for r in ranks]
    trimmed = "after malloc_trim" if not args.no_trim else "raw, no malloc_trim"
    print(f"FPDT + offload soak: sp={args.world_size}, N={args.seq_len}, chunk {args.chunk_size}, {args.steps} "
          f"steps; RSS {trimmed}; slope = least squares over steps {args.fit_from}..{args.steps}")  # fmt: skip
    print(common.format_table(rows, COLUMNS))
    losses = [s["loss"] for s in ranks[0]["steps"]]
    print(f"loss: step 1 {losses[0]:.4f}, last {losses[-1]:.4f}; wall {run.wall_s:.0f} s")
    failures = []
    if any(r["off_between"] != 0 for r in rows):
        failures.append("bytes stay offloaded between steps (a store was never released)")
    if not all(r["off_during_mib"] > 0 for r in rows):
        failures.append("nothing was offloaded during a step: the soak did not exercise offload")
    fit_steps = args.steps - args.fit_from + 1
    if fit_steps < MIN_FIT_STEPS:
        print(f"slope not checked: {fit_steps} steps in the fit window, fewer than {MIN_FIT_STEPS}")
    elif any(not r["slope"] <= args.max_slope_mib for r in rows):
        failures.append(f"RSS slope above {args.max_slope_mib} MiB per 100 steps")
    for f in failures:
        print(f"FAIL: {f}")

    fields = {"wall_s": run.wall_s, "summary": rows, "failures": failures, "ranks": ranks}
    common.save_results("soak", vars(args), fields, args.out, args.plot or Path(args.out).with_suffix(".png"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
