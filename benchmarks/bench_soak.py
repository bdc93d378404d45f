"""CPU soak: many training steps at sp=2 with FPDT + offload; host memory must stay flat.

``torchrun --nproc_per_node 2`` of this script in ``--worker`` mode trains a tiny Llama (vocab 32000,
hidden 256, 2 layers) through a real ``lightning.Trainer`` with
``UlyssesFPDTStrategy(sequence_parallel_size=2, fpdt_chunk_size=64, offload=True)`` for ``--steps``
optimizer steps, one new sequence of ``--seq-len`` tokens per step. After every step each rank
records its resident memory (RSS) and ``offloaded_bytes()`` (the bytes live FPDT stores keep in host
buffers: must be 0 between steps); before every backward it records ``offloaded_bytes()`` too (must
be > 0, or nothing was offloaded and the soak proves nothing).

Reported per rank: the RSS slope in MiB per 100 steps, least squares over steps ``--fit-from`` ..
the last (the first steps grow allocator pools and caches), and the largest ``offloaded_bytes()``
seen between steps. The verdict uses the RSS read right after glibc's ``malloc_trim(0)`` (called
after every step; ``--no-trim`` turns it off): without it, freed heap memory that glibc keeps
because a small live block sits above it stays in the RSS, and the raw RSS can climb by 100-200 MiB
for tens of steps and fall back, which reads as a leak and is not one. The raw slope is shown too. A leak of the offloaded k/v buffers or of one step's saved tensors would show
as ~2 MiB per step or more at the default sizes, i.e. > 100 MiB per 100 steps.

    python benchmarks/bench_soak.py               # 200 steps, N=512: ~2-3 min on 2 cores
    python benchmarks/bench_soak.py --steps 5 --fit-from 1 --out /tmp/soak.json   # smoke, < 30 s

Exit status 1 when bytes stay offloaded between steps, nothing was offloaded, or a rank's slope is
above ``--max-slope-mib`` (checked when the fit window holds at least 50 steps).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import child_env, environment, format_table, launch_cmd, token_lm_module, write_json

MIB = float(1 << 20)
HERE = Path(__file__).resolve().parent
MIN_FIT_STEPS = 50  # fewer steps than this in the fit window: warm-up growth dominates, no verdict


def _worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    from lightning_longctx import UlyssesFPDTStrategy
    from lightning_longctx.attention.offload import offloaded_bytes
    from lightning_longctx.callbacks.memory import host_rss_bytes

    torch.set_num_threads(args.threads)
    trim = None if args.no_trim else _malloc_trim()

    make_module = functools.partial(token_lm_module, args, num_samples=args.steps, lr=0.05)

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
            trimmed = host_rss_bytes() if trim is not None else raw
            self.steps.append(
                {
                    "step": trainer.global_step,
                    "rss_bytes": raw,
                    "rss_trimmed_bytes": trimmed,
                    "offloaded_bytes": offloaded_bytes(),
                    "offloaded_before_backward": self.in_step[-1] if self.in_step else 0,
                    "loss": float(loss.detach()),
                    "time": time.perf_counter(),
                }
            )

    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy=UlyssesFPDTStrategy(
            sequence_parallel_size=args.world_size,
            fpdt_chunk_size=args.chunk_size,
            offload=True,
            process_group_backend="gloo",
        ),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    trainer.fit(make_module())
    rank = trainer.global_rank
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": recorder.steps}))


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (None elsewhere)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def slope_per_100(steps: list[int], values: list[float]) -> float:
    """Least-squares slope of ``values`` over ``steps``, times 100."""
    n = len(steps)
    if n < 2:
        return float("nan")
    mx, my = sum(steps) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(steps, values)) / sxx


def save_plot(path: Path, ranks: list[dict[str, Any]], fit_from: int) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed (`pip install matplotlib`): no plot")
        return False
    fig = Figure(figsize=(7, 5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for r in ranks:
        xs = [s["step"] for s in r["steps"]]
        top.plot(
            xs,
            [s["rss_trimmed_bytes"] / MIB for s in r["steps"]],
            label=f"rank {r['rank']}, after malloc_trim",
        )
        top.plot(
            xs, [s["rss_bytes"] / MIB for s in r["steps"]], ":", alpha=0.6, label=f"rank {r['rank']}, raw"
        )
        bottom.plot(
            xs,
            [s["offloaded_before_backward"] / MIB for s in r["steps"]],
            label=f"rank {r['rank']}, before backward",
        )
        bottom.plot(
            xs, [s["offloaded_bytes"] / MIB for s in r["steps"]], "--", label=f"rank {r['rank']}, after step"
        )
    top.axvline(fit_from, color="gray", linestyle=":", label=f"slope fit from step {fit_from}")
    top.set_ylabel("RSS, MiB")
    bottom.set_ylabel("offloaded_bytes(), MiB")
    bottom.set_xlabel("optimizer step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    top.set_title("FPDT + offload soak (sp=2, CPU/gloo)", fontsize="small")
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fit-from", type=int, default=50, help="first step of the slope fit")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--world-size", type=int, default=2, help="sequence-parallel ranks")
    p.add_argument("--chunk-size", type=int, default=64, help="FPDT tokens per chunk per rank")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-slope-mib", type=float, default=5.0, help="fail above this RSS slope per 100 steps")
    p.add_argument("--no-trim", action="store_true", help="no malloc_trim(0) after each step (raw RSS only)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0

    names = (
        "steps",
        "seq_len",
        "world_size",
        "chunk_size",
        "threads",
        "vocab",
        "hidden",
        "intermediate",
        "layers",
        "heads",
    )
    flags = {"--" + name.replace("_", "-"): getattr(args, name) for name in names}
    env = child_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_soak_") as tmp:
        cmd = launch_cmd(
            __file__,
            args.world_size,
            "--worker",
            "--result-dir",
            tmp,
            *(s for k, v in flags.items() for s in (k, str(v))),
            *(["--no-trim"] if args.no_trim else []),
        )
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
            print(f"soak failed: torchrun exit status {proc.returncode}", file=sys.stderr)
            return 1
        ranks = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]

    rows = []
    for r in ranks:
        steps = r["steps"]
        fit = [s for s in steps if s["step"] >= args.fit_from]
        live = [s["rss_trimmed_bytes"] / MIB for s in steps]
        times = [s["time"] for s in steps]
        rows.append(
            {
                "rank": r["rank"],
                "steps": len(steps),
                "slope": slope_per_100([s["step"] for s in fit], [s["rss_trimmed_bytes"] / MIB for s in fit]),
                "raw_slope": slope_per_100([s["step"] for s in fit], [s["rss_bytes"] / MIB for s in fit]),
                "rss_first": live[0],
                "rss_fit_start": fit[0]["rss_trimmed_bytes"] / MIB if fit else None,
                "rss_last": live[-1],
                "rss_max": max(live),
                "raw_max": max(s["rss_bytes"] for s in steps) / MIB,
                "off_between": max(s["offloaded_bytes"] for s in steps),
                "off_during_mib": max(s["offloaded_before_backward"] for s in steps) / MIB,
                "s_per_step": (times[-1] - times[0]) / max(1, len(times) - 1),
            }
        )
    trimmed = "after malloc_trim" if not args.no_trim else "raw, no malloc_trim"
    print(
        f"FPDT + offload soak: sp={args.world_size}, N={args.seq_len}, chunk {args.chunk_size}, {args.steps} steps; "
        f"RSS {trimmed}; slope = least squares over steps {args.fit_from}..{args.steps}"
    )
    print(
        format_table(
            rows,
            [
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
            ],
        )
    )
    losses = [s["loss"] for s in ranks[0]["steps"]]
    print(f"loss: step 1 {losses[0]:.4f}, last {losses[-1]:.4f}; wall {wall:.0f} s")
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

    payload = {
        "benchmark": "soak",
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "result_dir")},
        "environment": environment(),
        "wall_s": wall,
        "summary": rows,
        "failures": failures,
        "ranks": ranks,
    }
    out = write_json(args.out, payload)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    print(f"wrote {out} and {plot}" if save_plot(plot, ranks, args.fit_from) else f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
