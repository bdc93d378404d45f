"""Peak memory per rank of one full training step vs sequence length: single process, Ulysses, FPDT.

Every point is a fresh job of P launched processes (1 for ``single``) that runs ONE optimizer step
(forward, backward, SGD) of a tiny Llama on one sequence of N tokens through a real ``lightning.Trainer``,
in mode ``single`` (HF SDPA attention and loss), ``ulysses``, ``fpdt`` (chunk ``--chunk-size``: chunked
attention, tiled MLP, chunked lm_head + loss), ``fpdt_offload`` (+ FPDT's host offload), ``fpdt_ckpt``
(+ activation checkpointing) or ``fpdt_act_offload`` (FPDT offload + activation offload: the checkpointed
layer inputs in host memory; ``common.STRATEGY_MODES``). Measured per rank around the step:

* CPU: right before the step freed heap goes back to the kernel (``malloc_trim(0)``), the kernel's
  peak-RSS mark is reset (``/proc/self/clear_refs`` = 5) and the RSS is the baseline; after it
  ``VmHWM`` is the peak. "step" = peak - baseline: what the step needs (activations, gradients,
  logits, workspaces) on top of the loaded model, libraries and group. The ranks run with glibc's
  ``MALLOC_MMAP_THRESHOLD_`` at 256 KiB (``--malloc-mmap-threshold``, as ``bench_planner.py``), so a
  freed tensor's pages return at once and RSS follows the live bytes, as a GPU's allocated memory does
  (glibc's default keeps freed holes in its heap: FPDT's many per-chunk tensors then read high).
* CUDA (``--device cuda``): ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus
  ``memory_allocated`` at the start. Host RSS is recorded alongside.

A mode stops growing N once a point went over ``--budget-gib`` (memory only grows with N); a point
predicted (linearly) not to fit in free memory is skipped. "largest fit" = the largest measured N
within the budget (``>=``: even the longest tried), "est." = where the least-squares line through the
mode's points crosses it (memory is close to linear in N: every attention kernel used is O(N)).
Run with doubling ``--seq-lens`` and a ``--budget-gib`` this is the memory ladder: the longest sequence
each mode trains within the budget. "x16": the step memory of a mode at 16x the tokens of a ``single``
point, over that point's (the FPDT paper's 16x claim: <= 1 means 16x longer in no more memory).
``--merge`` reuses the measured points of earlier outputs. Commands and results: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import common
from common import GIB, MIB

MODES = ("single", *common.STRATEGY_MODES)
#: the memory ladder (issue 15): what each way of training reaches within the budget
DEFAULT_MODES = ("single", "ulysses", "fpdt", "fpdt_ckpt", "fpdt_act_offload")
HERE = Path(__file__).resolve().parent
#: settings that must agree between merged runs (everything that changes what a point measures)
SAME_SETTINGS = ("world_size", "chunk_size", "device", "precision", "threads", "vocab", "hidden", "intermediate",
                 "layers", "heads", "malloc_mmap_threshold")  # fmt: skip


def _hwm_bytes() -> int:
    """The kernel's peak-RSS mark of this process (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _point(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of one point (runs in a launched process): the rank's memory around the one step."""
    import lightning as L
    import torch

    from lightning_longctx.attention.offload import offloaded_bytes

    cuda = args.device == "cuda"

    class StepMemory(L.Callback):
        """Baseline right before the step, peak right after it (the SGD step included)."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.rss_base = common.live_rss_bytes()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.dev_base = torch.cuda.memory_allocated()
            _reset_hwm()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if cuda:
                torch.cuda.synchronize()
                self.dev_peak = torch.cuda.max_memory_allocated()
            self.step_s = time.perf_counter() - self.t0
            self.rss_peak = _hwm_bytes()

    meter = StepMemory()
    trainer = common.bench_trainer(args.mode, args.world_size, chunk_size=args.chunk_size, device=args.device,
                            callbacks=[meter], precision=args.precision, max_steps=1)  # fmt: skip
    module = common.token_lm_module(args, num_samples=1, lr=0.1)
    trainer.fit(module)
    result = {
        "rank": int(os.environ.get("RANK", "0")),
        "rss_baseline_bytes": meter.rss_base,
        "rss_peak_bytes": meter.rss_peak,
        "step_s": meter.step_s,
        "loss": module.loss,
        "offloaded_bytes_after": offloaded_bytes(),
    }
    if cuda:
        result.update(device_baseline_bytes=meter.dev_base, device_peak_bytes=meter.dev_peak)
    return result


def run_point(args: argparse.Namespace, mode: str, n: int) -> dict[str, Any]:
    """Launch one fresh job for (mode, N); returns the row (max over ranks) and every rank's numbers."""
    world = 1 if mode == "single" else args.world_size
    point = argparse.Namespace(**{**vars(args), "mode": mode, "seq_len": n})
    run = common.launch(_point, world, point, threads=args.threads, timeout_s=args.timeout)
    row: dict[str, Any] = {
        "mode": mode,
        "P": world,
        "N": n,
        "tokens_per_rank": n // world,
        "wall_s": run.wall_s,
    }
    row["chunk"] = min(args.chunk_size, n // world) if mode.startswith("fpdt") else None
    if run.error:
        return {**row, "status": "failed", "log_tail": f"{run.error}\n{run.log}"[-3000:]}
    ranks = run.results
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


def load_merged(args: argparse.Namespace) -> tuple[dict[tuple[str, int], dict], list[dict[str, Any]]]:
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


def skip_reason(args: argparse.Namespace, done: list[dict[str, Any]], n: int) -> str | None:
    """Why the next N of a mode is not launched, or None. ``done`` = this mode's rows so far, ascending N."""
    measured = [r for r in done if r["status"] == "ok"]
    if not measured:
        return None
    last = measured[-1]
    if last["step_mib"] > args.budget_gib * 1024:
        return f"over budget (N={last['N']} already needed {last['step_mib'] / 1024:.2f} GiB)"
    per_rank = (last["baseline_mib"] + last["step_mib"] * n / last["N"]) * MIB
    if args.device == "cuda":  # each rank on its own GPU
        import torch

        if per_rank > args.ram_fraction * torch.cuda.get_device_properties(0).total_memory:
            return (
                f"skipped: predicted {per_rank / GIB:.1f} GiB per GPU > {args.ram_fraction:g} of its memory"
            )
    elif per_rank * last["P"] > args.ram_fraction * common.meminfo_bytes("MemAvailable"):
        return (
            f"skipped: predicted {per_rank * last['P'] / GIB:.1f} GiB for {last['P']} rank(s) > free memory"
        )
    return None


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Largest N within the budget per mode (measured and estimated) and the headline ratios."""
    budget_mib = args.budget_gib * 1024
    fits: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        ok = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        if not ok:
            continue
        inside = [r["N"] for r in ok if r["step_mib"] <= budget_mib]
        largest = max(inside) if inside else None
        a, b = (
            common.linear_fit([float(r["N"]) for r in ok], [r["step_mib"] for r in ok])
            if len(ok) > 1
            else (0, 0)
        )
        fits[mode] = {
            "largest_fit": largest,
            # even the longest N tried fits: the largest fit is a lower bound
            "lower_bound": largest is not None and largest == max(r["N"] for r in rows if r["mode"] == mode),
            "mib_per_1k_tokens": b * 1024 if len(ok) > 1 else None,
            "intercept_mib": a if len(ok) > 1 else None,
            "estimated_fit": int((budget_mib - a) / b) if b > 0 and budget_mib > a else None,
        }
    out: dict[str, Any] = {"budget_gib": args.budget_gib, "fits": fits}
    for base in ("single", "ulysses"):
        for key in ("largest_fit", "estimated_fit"):
            x, y = fits.get("fpdt", {}).get(key), fits.get(base, {}).get(key)
            out[f"fpdt_vs_{base}_{key}"] = x / y if x and y else None
    ok = {(r["mode"], r["N"]): r for r in rows if r["status"] == "ok"}
    single_fit = fits.get("single", {}).get("largest_fit")
    for f in fits.values():
        f["vs_single"] = f["largest_fit"] / single_fit if single_fit and f["largest_fit"] else None
    out["x16"] = [
        {"mode": mode, "N": n, "single_N": n // 16, "step_mib": r["step_mib"],
         "single_step_mib": ok["single", n // 16]["step_mib"], "ratio": r["step_mib"] / ok["single", n // 16]["step_mib"]}
        for (mode, n), r in sorted(ok.items()) if mode != "single" and n % 16 == 0 and ("single", n // 16) in ok
    ]  # fmt: skip
    both = [n for mode, n in ok if mode == "ulysses" and ("fpdt", n) in ok]
    if both:
        n = max(both)
        f, u = ok["fpdt", n], ok["ulysses", n]
        out["fpdt_over_ulysses"] = {
            "N": n,
            "step": f["step_mib"] / u["step_mib"],
            "peak": f["peak_mib"] / u["peak_mib"],
        }
    return out


def print_report(args: argparse.Namespace, rows: list[dict], summary: dict[str, Any], unit: str) -> None:
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
    print(common.format_table(shown, columns))
    fit_rows = []
    for mode, f in summary["fits"].items():
        largest = f["largest_fit"] and (">= " if f["lower_bound"] else "") + str(f["largest_fit"])
        fit_rows.append({"mode": mode, **f, "largest_fit": largest})
    print(f"\nlargest N within {args.budget_gib:g} GiB of step memory per rank (measured; est. = linear fit)")
    fit_columns = [
        ("mode", "mode", ""),
        ("largest_fit", "largest fit", ""),
        ("estimated_fit", "est. fit", ""),
        ("vs_single", "vs single", ".1f"),
        ("mib_per_1k_tokens", "MiB per 1K tokens", ".1f"),
        ("intercept_mib", "intercept MiB", ".1f"),
    ]
    print(common.format_table(fit_rows, fit_columns))
    for r in summary["x16"]:
        print(f"x16: {r['mode']} at N={r['N']} needs {r['step_mib']:.0f} MiB per rank, single at N={r['single_N']} "
              f"{r['single_step_mib']:.0f} MiB: {r['ratio']:.2f} (target <= 1.0)")  # fmt: skip
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
            f"FPDT / Ulysses at N={r['N']}: step {r['step']:.3f}, peak {r['peak']:.3f} (target <= 0.3 at 32K)"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    p.add_argument(
        "--seq-lens", nargs="+", type=int, default=[1024 << k for k in range(7)], help="default: 1K..64K"
    )
    p.add_argument("--world-size", type=int, default=2, help="P of the sequence-parallel modes")
    p.add_argument("--chunk-size", type=int, default=2048, help="FPDT tokens per chunk per rank")
    p.add_argument("--budget-gib", type=float, default=1.0, help="step memory budget per rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    common.add_model_args(p, vocab=32000, hidden=128, intermediate=344, layers=2, heads=4)
    p.add_argument("--ram-fraction", type=float, default=0.7, help="skip points predicted above this share "
                   "of MemAvailable (of GPU memory with --device cuda)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per point")
    common.add_malloc_threshold_arg(p)
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="earlier outputs of this script (same model and settings): their measured points are "
                   "reused, not re-run, and land in this run's table, fits and plot")  # fmt: skip
    p.add_argument("--out", default=str(HERE / "results" / "memory.json"))
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    args = p.parse_args()

    common.use_malloc_threshold(args.malloc_mmap_threshold)
    reused, sources = load_merged(args)
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        done: list[dict[str, Any]] = []
        for n in sorted({*args.seq_lens, *(k[1] for k in reused if k[0] == mode)}):
            reason = skip_reason(args, done, n)
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
            where = f"{mode:>12} N={n:>6}"
            if "source" in row:
                print(f"{where}: step {row['step_mib']:8.1f} MiB (from {row['source']})", flush=True)
            elif row["status"] == "ok":
                print(f"{where}: step {row['step_mib']:8.1f} MiB, peak {row['peak_mib']:8.1f} MiB, "
                      f"{row['step_s']:.1f} s step, {row['wall_s']:.0f} s launch", flush=True)  # fmt: skip
            else:
                print(f"{where}: {row['status']}", flush=True)
                print(row.get("log_tail", ""), end="", file=sys.stderr)

    summary = summarize(args, rows)
    unit = "GPU max_memory_allocated" if args.device == "cuda" else "peak RSS"
    print_report(args, rows, summary, unit)
    fields = {"measure": unit, "merged_from": sources, "rows": rows, "summary": summary}
    png = args.plot or Path(args.out).with_suffix(".png")
    common.save_results("memory", vars(args), fields, args.out, png)
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
