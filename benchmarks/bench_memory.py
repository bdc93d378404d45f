"""Peak memory per rank of one full training step vs sequence length: single process, Ulysses, FPDT.

Every point is a fresh job of P processes (1 for ``single``) — forked from a server that imported the
libraries once, or ``torchrun`` of this script in ``--worker`` mode (``--launcher``) — that runs ONE
optimizer step — forward, backward, SGD —
of a tiny Llama (vocab 32000, hidden 256, 2 layers, 4 heads) on one sequence of N tokens through a
real ``lightning.Trainer``:

* ``single``: ``devices=1``, Hugging Face attention ``"sdpa"``, HF loss (whole ``(N, vocab)`` logits);
* ``ulysses``: ``UlyssesFPDTStrategy(sequence_parallel_size=P)``;
* ``fpdt``: the same with ``fpdt_chunk_size=c`` (chunked attention, tiled MLP, chunked lm_head + loss);
* ``fpdt_offload``: ``fpdt`` with ``offload=True``.

Measured per rank, around the step (Lightning's ``on_train_batch_start`` .. ``on_train_batch_end``):

* CPU: resident memory. Right before the step the kernel's peak-RSS mark is reset
  (``/proc/self/clear_refs`` = 5) and the current RSS is the baseline; after the step ``VmHWM`` is
  the peak. "step" = peak - baseline: what the step itself needs (activations, gradients, logits,
  workspaces) on top of the loaded model, libraries and process group.
* CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
  "step" = peak - ``memory_allocated`` at the start. Host RSS is recorded alongside.

A mode stops growing N once a point went over ``--budget-gib`` (memory only grows with N), and a
point whose linear extrapolation from the previous one would not fit in the machine's free memory is
skipped; both are marked in the table. "largest fit" = the largest measured N whose step memory is
within the budget (``>=`` when even the largest N tried fits), and "est." = where the least-squares
line through the mode's measured points crosses the budget (memory is close to linear in N here:
every attention kernel used is O(N) in memory).

    python benchmarks/bench_memory.py                 # N = 2K..16K, 4 modes: ~6-7 min on 2 loaded cores
    python benchmarks/bench_memory.py --seq-lens 256 --modes ulysses fpdt --chunk-size 64 --out /tmp/m.json  # ~10 s

``--merge`` reuses the measured points of earlier outputs (the committed ``results/memory.json`` merges
three runs; see ``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import child_env, environment, format_table, free_port, launch_cmd, token_lm_module, write_json

MODES = ("single", "ulysses", "fpdt", "fpdt_offload")
MIB = float(1 << 20)
GIB = float(1 << 30)
HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------------
# worker: one rank of one point
# ---------------------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", "0"))
    cuda = args.device == "cuda"

    make_module = functools.partial(token_lm_module, args, num_samples=1, lr=0.1)

    class StepMemory(L.Callback):
        """Baseline right before the step, peak right after it (the SGD step included)."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            gc.collect()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.dev_base = torch.cuda.memory_allocated()
            self.rss_base = _rss_bytes()
            _reset_hwm()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if cuda:
                torch.cuda.synchronize()
                self.dev_peak = torch.cuda.max_memory_allocated()
            self.step_s = time.perf_counter() - self.t0
            self.rss_peak = _hwm_bytes()

    if args.mode == "single":
        strategy: Any = "auto"
    else:
        from lightning_longctx import UlyssesFPDTStrategy

        strategy = UlyssesFPDTStrategy(
            sequence_parallel_size=args.world_size,
            fpdt_chunk_size=None if args.mode == "ulysses" else args.chunk_size,
            offload=args.mode == "fpdt_offload",
            process_group_backend="nccl" if cuda else "gloo",
        )
    meter = StepMemory()
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1 if args.mode == "single" else args.world_size,
        strategy=strategy,
        precision=args.precision,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[meter],
    )
    module = make_module()
    trainer.fit(module)
    from lightning_longctx.attention.offload import offloaded_bytes

    result = {
        "rank": rank,
        "rss_baseline_bytes": meter.rss_base,
        "rss_peak_bytes": meter.rss_peak,
        "step_s": meter.step_s,
        "loss": module.loss,
        "offloaded_bytes_after": offloaded_bytes(),
    }
    if cuda:
        result.update(device_baseline_bytes=meter.dev_base, device_peak_bytes=meter.dev_peak)
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------
def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can still be allocated without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _forked_rank(args: argparse.Namespace, rank: int, world: int, port: int) -> None:
    """Entry of one rank started by the forkserver: the environment a launcher would set, then the worker."""
    for key in [k for k in os.environ if k.startswith(("TORCHELASTIC", "SLURM_"))]:
        del os.environ[key]
    os.environ.update(OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    log = os.open(Path(args.result_dir, f"log{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)  # the ranks' Lightning chatter goes to a log, shown when the point fails
    os.dup2(log, 2)
    if world > 1:  # LOCAL_RANK tells Lightning the processes exist already (no launcher of its own)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            NODE_RANK="0",
        )
    _worker(args)


_FORKSERVER: Any = None


def _forkserver() -> Any:
    """A forkserver that imported torch, lightning and transformers once: each point then starts in
    ~1 s instead of ~15 s of imports per rank on a loaded 2-core machine, and is still a fresh process."""
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing as mp

        _FORKSERVER = mp.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(
            [
                "__main__",
                "torch",
                "lightning",
                "transformers.models.llama.modeling_llama",
                "lightning_longctx",
            ]
        )
    return _FORKSERVER


def _launch_forkserver(args: argparse.Namespace, world: int) -> tuple[bool, str]:
    ctx = _forkserver()
    port = free_port()
    procs = [ctx.Process(target=_forked_rank, args=(args, r, world, port)) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout
    for proc in procs:
        proc.join(max(1.0, deadline - time.monotonic()))
    timed_out = any(proc.is_alive() for proc in procs)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    if timed_out:
        return False, f"timed out after {args.timeout:.0f}s"
    codes = [proc.exitcode for proc in procs]
    logs = "".join(
        f"--- rank {p.stem[3:]} ---\n" + p.read_text()[-1500:]
        for p in sorted(Path(args.result_dir).glob("log*.txt"))
    )
    return all(c == 0 for c in codes), f"exit codes {codes}\n{logs}"


def _launch_torchrun(args: argparse.Namespace, world: int) -> tuple[bool, str]:
    cmd = launch_cmd(__file__, world, "--worker", *_worker_flags(args))
    try:
        proc = subprocess.run(
            cmd, env=child_env(args.threads), capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {args.timeout:.0f}s"
    return proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def run_point(args: argparse.Namespace, mode: str, n: int) -> dict[str, Any]:
    """Launch one fresh job for (mode, N); returns the row (max over ranks) and every rank's numbers."""
    world = 1 if mode == "single" else args.world_size
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        point = argparse.Namespace(**{**vars(args), "mode": mode, "seq_len": n, "result_dir": tmp})
        launch = _launch_torchrun if args.launcher == "torchrun" else _launch_forkserver
        t0 = time.perf_counter()
        ok, log = launch(point, world)
        wall = time.perf_counter() - t0
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    row: dict[str, Any] = {"mode": mode, "P": world, "N": n, "tokens_per_rank": n // world, "wall_s": wall}
    row["chunk"] = min(args.chunk_size, n // world) if mode.startswith("fpdt") else None
    if not ok or len(ranks) != world:
        row["status"] = "failed"
        row["log_tail"] = log
        return row
    for r in ranks:
        r["rss_step_bytes"] = r["rss_peak_bytes"] - r["rss_baseline_bytes"]
        if args.device == "cuda":
            r["device_step_bytes"] = r["device_peak_bytes"] - r["device_baseline_bytes"]
    key = "device" if args.device == "cuda" else "rss"
    row.update(
        status="ok",
        peak_mib=max(r[f"{key}_peak_bytes"] for r in ranks) / MIB,
        baseline_mib=max(r[f"{key}_baseline_bytes"] for r in ranks) / MIB,
        step_mib=max(r[f"{key}_step_bytes"] for r in ranks) / MIB,
        host_step_mib=max(r["rss_step_bytes"] for r in ranks) / MIB,
        step_s=max(r["step_s"] for r in ranks),
        loss=ranks[0]["loss"],
        offloaded_bytes_after=max(r["offloaded_bytes_after"] for r in ranks),
        ranks=ranks,
    )
    return row


def _worker_flags(args: argparse.Namespace) -> list[str]:
    flags = {
        "--mode": args.mode,
        "--seq-len": args.seq_len,
        "--result-dir": args.result_dir,
        "--world-size": args.world_size,
        "--chunk-size": args.chunk_size,
        "--threads": args.threads,
        "--device": args.device,
        "--precision": args.precision,
        "--vocab": args.vocab,
        "--hidden": args.hidden,
        "--intermediate": args.intermediate,
        "--layers": args.layers,
        "--heads": args.heads,
    }
    return [s for k, v in flags.items() for s in (k, str(v))]


#: settings that must agree between merged runs (everything that changes what a point measures)
SAME_SETTINGS = (
    "world_size",
    "chunk_size",
    "device",
    "precision",
    "threads",
    "vocab",
    "hidden",
    "intermediate",
    "layers",
    "heads",
)


def load_merged(
    args: argparse.Namespace,
) -> tuple[dict[tuple[str, int], dict[str, Any]], list[dict[str, Any]]]:
    """Measured rows of the ``--merge`` files by (mode, N) (later files win), and where they came from."""
    reused: dict[tuple[str, int], dict[str, Any]] = {}
    sources = []
    for path in args.merge:
        data = json.loads(Path(path).read_text())
        theirs = data["config"]
        differ = {
            k: (theirs.get(k), getattr(args, k)) for k in SAME_SETTINGS if theirs.get(k) != getattr(args, k)
        }
        if differ:
            raise SystemExit(f"--merge {path}: settings differ from this run's (theirs, ours): {differ}")
        env = data["environment"]
        sources.append({"path": str(path), "argv": env["argv"], "time_utc": env["time_utc"]})
        command = " ".join(["python", *env["argv"]])
        for row in data["rows"]:
            if row["status"] == "ok" and row["mode"] in args.modes:
                reused[row["mode"], row["N"]] = {**row, "source": row.get("source", command)}
    return reused, sources


def skip_reason(args: argparse.Namespace, done: list[dict[str, Any]], mode: str, n: int) -> str | None:
    """Why (mode, N) is not launched, or None. ``done`` = this mode's rows so far, ascending N."""
    measured = [r for r in done if r["status"] == "ok"]
    if not measured:
        return None
    last = measured[-1]
    if last["step_mib"] > args.budget_gib * 1024:
        return f"over budget (N={last['N']} already needed {last['step_mib'] / 1024:.2f} GiB)"
    world = last["P"]
    per_rank = (last["baseline_mib"] + last["step_mib"] * n / last["N"]) * MIB
    if args.device == "cuda":  # each rank on its own GPU
        import torch

        if per_rank > args.ram_fraction * torch.cuda.get_device_properties(0).total_memory:
            return (
                f"skipped: predicted {per_rank / GIB:.1f} GiB per GPU > {args.ram_fraction:g} of its memory"
            )
    elif per_rank * world > args.ram_fraction * available_bytes():
        return f"skipped: predicted {per_rank * world / GIB:.1f} GiB for {world} rank(s) > free memory"
    return None


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Largest N within the budget per mode (measured and estimated) and the headline ratios."""
    budget_mib = args.budget_gib * 1024
    fits: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        ok = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        if not ok:
            continue
        inside = [r["N"] for r in ok if r["step_mib"] <= budget_mib]
        tried = [r["N"] for r in rows if r["mode"] == mode]
        a, b = linear_fit([float(r["N"]) for r in ok], [r["step_mib"] for r in ok]) if len(ok) > 1 else (0, 0)
        largest = max(inside) if inside else None
        fits[mode] = {
            "largest_fit": largest,
            "lower_bound": largest is not None and largest == max(tried),  # even the longest tried fits
            "mib_per_1k_tokens": b * 1024 if len(ok) > 1 else None,
            "intercept_mib": a if len(ok) > 1 else None,
            "estimated_fit": int((budget_mib - a) / b) if b > 0 and budget_mib > a else None,
        }
    out: dict[str, Any] = {"budget_gib": args.budget_gib, "fits": fits}

    def ratio(num: str, den: str, key: str) -> float | None:
        x, y = fits.get(num, {}).get(key), fits.get(den, {}).get(key)
        return x / y if x and y else None

    for base in ("single", "ulysses"):
        out[f"fpdt_vs_{base}_largest_fit"] = ratio("fpdt", base, "largest_fit")
        out[f"fpdt_vs_{base}_estimated_fit"] = ratio("fpdt", base, "estimated_fit")
    both = {
        r["N"]: r
        for r in rows
        if r["mode"] == "ulysses"
        and r["status"] == "ok"
        and any(f["mode"] == "fpdt" and f["N"] == r["N"] and f["status"] == "ok" for f in rows)
    }
    if both:
        n = max(both)
        f = next(r for r in rows if r["mode"] == "fpdt" and r["N"] == n)
        out["fpdt_over_ulysses"] = {"N": n, "step": f["step_mib"] / both[n]["step_mib"]}
        out["fpdt_over_ulysses"]["peak"] = f["peak_mib"] / both[n]["peak_mib"]
    return out


def save_plot(path: Path, args: argparse.Namespace, rows: list[dict[str, Any]]) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed (`pip install matplotlib`): no plot")
        return False
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, mode in enumerate(args.modes):
        ok = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        if ok:
            world = ok[0]["P"]
            label = mode if mode == "single" else f"{mode} (P={world})"
            style = "--" if mode == "fpdt_offload" else "-"
            ax.plot(
                [r["N"] for r in ok],
                [r["step_mib"] for r in ok],
                style,
                marker="o",
                color=f"C{i}",
                label=label,
            )
    ax.axhline(args.budget_gib * 1024, color="gray", linestyle=":", label=f"budget {args.budget_gib:g} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N (tokens)")
    what = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS"
    ax.set_ylabel(f"step memory per rank, MiB\n({what} - before the step, max over ranks)")
    ax.set_title(
        f"one training step, Llama vocab {args.vocab} hidden {args.hidden} x{args.layers} layers, "
        f"FPDT chunk {args.chunk_size}",
        fontsize="small",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    p.add_argument("--world-size", type=int, default=2, help="P of the sequence-parallel modes")
    p.add_argument("--chunk-size", type=int, default=1024, help="FPDT tokens per chunk per rank")
    p.add_argument("--budget-gib", type=float, default=2.0, help="step memory budget per rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--ram-fraction",
        type=float,
        default=0.7,
        help="skip points predicted above this share of MemAvailable (of GPU memory with --device cuda)",
    )
    p.add_argument(
        "--launcher",
        choices=("forkserver", "torchrun"),
        default="forkserver",
        help="how each point's fresh processes start: forked from a server that imported the libraries "
        "once (fast), or torchrun of this script (slow imports per point; the ranks' logs on failure)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per point")
    p.add_argument(
        "--merge",
        nargs="+",
        default=[],
        metavar="JSON",
        help="earlier outputs of this script (same model and settings): their measured points are reused, "
        "not re-run, and land in this run's table, fits and plot",
    )
    p.add_argument("--out", default=str(HERE / "results" / "memory.json"))
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0

    reused, sources = load_merged(args)
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        done: list[dict[str, Any]] = []
        for n in sorted({*args.seq_lens, *(k[1] for k in reused if k[0] == mode)}):
            reason = skip_reason(args, done, mode, n)
            if (mode, n) in reused:
                row = reused[mode, n]
            elif reason is not None:
                row = {
                    "mode": mode,
                    "P": 1 if mode == "single" else args.world_size,
                    "N": n,
                    "status": reason,
                }
            else:
                row = run_point(args, mode, n)
            done.append(row)
            rows.append(row)
            if "source" in row:
                print(
                    f"{mode:>12} N={n:>6}: step {row['step_mib']:8.1f} MiB (from {row['source']})", flush=True
                )
            elif row["status"] == "ok":
                print(
                    f"{mode:>12} N={n:>6}: step {row['step_mib']:8.1f} MiB, peak {row['peak_mib']:8.1f} MiB, "
                    f"{row['step_s']:.1f} s step, {row['wall_s']:.0f} s launch",
                    flush=True,
                )
            else:
                print(f"{mode:>12} N={n:>6}: {row['status']}", flush=True)
                if "log_tail" in row:
                    print(row["log_tail"], file=sys.stderr)

    summary = summarize(args, rows)
    unit = "GPU max_memory_allocated" if args.device == "cuda" else "peak RSS"
    columns = [
        ("mode", "mode", ""),
        ("P", "P", ""),
        ("N", "N", ""),
        ("chunk", "chunk", ""),
        ("step_mib", "step MiB", ".1f"),
        ("peak_mib", "peak MiB", ".1f"),
        ("baseline_mib", "before MiB", ".1f"),
        ("step_s", "step s", ".1f"),
        ("loss", "loss", ".4f"),
        ("note", "note", ""),
    ]
    if args.device == "cuda":
        columns.insert(7, ("host_step_mib", "host step MiB", ".1f"))
    shown = [{**r, "note": None if r["status"] == "ok" else r["status"]} for r in rows]
    print(f"\nper rank, max over ranks; {unit}; step = peak - value right before the step")
    print(format_table(shown, columns))
    budget = args.budget_gib
    fit_rows = []
    for mode, f in summary["fits"].items():
        largest = f["largest_fit"]
        fit_rows.append(
            {
                "mode": mode,
                "fit": None if largest is None else (">= " if f["lower_bound"] else "") + str(largest),
                "est": f["estimated_fit"],
                "slope": f["mib_per_1k_tokens"],
                "icpt": f["intercept_mib"],
            }
        )
    print(f"\nlargest N within {budget:g} GiB of step memory per rank (measured; est. = linear fit)")
    print(
        format_table(
            fit_rows,
            [
                ("mode", "mode", ""),
                ("fit", "largest fit", ""),
                ("est", "est. fit", ""),
                ("slope", "MiB per 1K tokens", ".1f"),
                ("icpt", "intercept MiB", ".1f"),
            ],
        )
    )
    for base, target in (("single", 16), ("ulysses", 8)):
        m, e = summary[f"fpdt_vs_{base}_largest_fit"], summary[f"fpdt_vs_{base}_estimated_fit"]
        if m or e:
            lb = ">= " if summary["fits"]["fpdt"]["lower_bound"] else ""
            ms = f"{lb}{m:.1f}x" if m else "-"
            es = f"{e:.1f}x" if e else "-"
            print(f"FPDT vs {base}: largest fit {ms} (measured), {es} (est.); target >= {target}x")
    if "fpdt_over_ulysses" in summary:
        r = summary["fpdt_over_ulysses"]
        print(
            f"FPDT / Ulysses at N={r['N']}: step {r['step']:.3f}, peak {r['peak']:.3f} (target step <= 0.3 at 32K)"
        )

    payload = {
        "benchmark": "memory",
        "config": {
            k: v for k, v in vars(args).items() if k not in ("worker", "mode", "seq_len", "result_dir")
        },
        "environment": environment(),
        "measure": unit,
        "merged_from": sources,
        "rows": rows,
        "summary": summary,
    }
    out = write_json(args.out, payload)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    if save_plot(plot, args, rows):
        print(f"wrote {out} and {plot}")
    else:
        print(f"wrote {out}")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
