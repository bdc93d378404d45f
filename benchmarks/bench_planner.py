"""The memory planner (``lightning_longctx.plan_memory``) against measured CPU memory of a training step.

Every point is a fresh job of P launched processes (``common.launch``; P = sp x tp with tensor parallelism)
that trains ``CausalLM`` (AdamW,
the package's own LightningModule) on a tiny Llama through a real ``lightning.Trainer`` with
``UlyssesFPDTStrategy`` (gloo), one random sequence of N tokens per step, and measures the THIRD step
(steady state: AdamW's states exist, the previous step's gradients are still allocated at its start,
and DDP rebuilt its buckets in the step before: the rebuilt buckets' pages are first touched in that
step's backward, after its peak, which made the second step read ~30 MiB low), in the style of
``bench_memory.py``:

* **step**: peak RSS during that step minus the RSS right before it (``VmHWM`` after resetting it with
  ``/proc/self/clear_refs``), max over ranks. Planned: the plan's largest ``device + host`` of any
  phase (``MemoryPlan.combined``: on a CPU the device IS the host, so offloaded chunks stay in the same
  RAM) minus what the plan holds between steps (``MemoryPlan.between_steps``: weights, gradients,
  optimizer state, DDP buckets).
* **total**: peak RSS during that step minus the RSS before the model was built (the ``setup`` hook,
  after the process group exists), max over ranks. Planned: ``MemoryPlan.combined``.

The planner counts live tensor bytes (on a GPU: ``torch.cuda.max_memory_allocated``). RSS counts what
glibc holds: both baselines are read after ``malloc_trim(0)`` (freed heap returned to the kernel), and
the ranks run with ``MALLOC_MMAP_THRESHOLD_`` = 256 KiB (``--malloc-mmap-threshold``) so that a freed
tensor's pages go back at once instead of fragmenting the heap (with glibc's default, FPDT's many
medium-sized per-chunk tensors left up to 25% of RSS in free heap holes at 32K tokens).
Error = planned / measured - 1. Commands and results: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import common
from bench_memory import _hwm_bytes, _reset_hwm
from common import MIB

#: (N, P, mode, offload, activation checkpointing, activation offload): N from 4K to 32K, P = 1, 2, 4, both
#: modes, each memory setting on and off; ~12 minutes on 2 loaded cores, most of it the 32K FPDT row
DEFAULT_POINTS = (
    "4096:1:ulysses",
    "4096:2:ulysses",
    "16384:2:ulysses",
    "8192:2:ulysses:ckpt",
    "8192:4:ulysses",
    "8192:2:fpdt",
    "32768:2:fpdt",
    "8192:2:fpdt:offload",
    "8192:2:fpdt:offload:ckpt",
    "8192:4:fpdt",
    "8192:2:ulysses:aoff",
    "16384:2:fpdt:offload:aoff",
    # FSDP2: sharded state, state offload (cpu_offload), the MixedPrecisionPolicy (fsdp + bf16-mixed)
    "8192:2:fpdt:fsdp:ckpt",
    "8192:2:fpdt:coff:aoff",
    "8192:2:fpdt:offload:coff:ckpt",
    "8192:2:fpdt:mp:ckpt",
    "8192:2:fpdt:coff:mp:aoff",
    "8192:2:ulysses:coff:mp",
    # tensor parallelism: world 4 = sp 2 x tp 2 (FSDP2 over sp, the HF TP plan over tp; FPDT's lm_head and
    # chunked loss vocabulary parallel)
    "8192:4:fpdt:fsdp:tp2",
    "8192:4:ulysses:fsdp:tp2",
    # Ulysses x ring: sp 2 as a ring of 2 (U = 1), sp 4 as ring 2 x Ulysses 2
    "16384:2:ulysses:ring2",
    "8192:4:ulysses:ring2",
)
#: where the ring's layer backward is the peak (``--vocab 512 --intermediate 128``: the attention moment above the
#: MLP's and the loss's), ~4 minutes: the ring's buffers and working sets are the binding terms
RING_POINTS = ("16384:2:ulysses:ring2:ckpt", "16384:4:ulysses:ring2:ckpt", "16384:4:ulysses:ring4:ckpt")
SMOKE_POINTS = ("1024:2:ulysses", "1024:2:fpdt:offload:aoff", "1024:2:fpdt:coff:mp:ckpt")
FLAGS = {"offload", "ckpt", "aoff", "fsdp", "coff", "mp"}


def _numbered(flags: set[str], prefix: str) -> set[str]:
    return {
        f for f in flags if f.startswith(prefix) and f[len(prefix) :].isdigit() and int(f[len(prefix) :]) >= 1
    }


def parse_point(text: str) -> dict[str, Any]:
    """``N:P:mode[:offload][:ckpt][:aoff][:fsdp][:coff][:mp][:tpT][:ringR]`` -> the point's settings (``aoff``:
    activation offload, which checkpoints too; ``coff``: ``cpu_offload``, FSDP; ``mp``: FSDP with ``bf16-mixed``,
    i.e. the MixedPrecisionPolicy; ``tpT``: ``tensor_parallel_size=T``, FSDP, the P ranks as sp = P / T x tp = T;
    ``ringR``: ``ring_size=R``, Ulysses x ring, R dividing sp)."""
    parts = text.split(":")
    flags = set(parts[3:])
    tp_flags, ring_flags = _numbered(flags, "tp"), _numbered(flags, "ring")
    tp = int(next(iter(tp_flags))[2:]) if len(tp_flags) == 1 else 1
    ring = int(next(iter(ring_flags))[4:]) if len(ring_flags) == 1 else 1
    if (len(parts) < 3 or parts[2] not in ("ulysses", "fpdt") or flags - FLAGS - tp_flags - ring_flags
            or len(tp_flags) > 1 or len(ring_flags) > 1 or int(parts[1]) % tp or (int(parts[1]) // tp) % ring
            or (ring > 1 and parts[2] != "ulysses")):  # fmt: skip
        raise argparse.ArgumentTypeError(
            f"{text!r}: write N:P:ulysses|fpdt[:offload][:ckpt][:aoff][:fsdp][:coff][:mp][:tpT][:ringR] (T dividing "
            "P, R dividing P / T, a ring in Ulysses mode), e.g. 32768:2:fpdt:offload, 8192:4:fpdt:fsdp:tp2 or "
            "8192:4:ulysses:ring2"
        )
    return {"N": int(parts[0]), "P": int(parts[1]), "mode": parts[2], "offload": "offload" in flags,
            "ckpt": "ckpt" in flags or "aoff" in flags, "aoff": "aoff" in flags,
            "fsdp": bool(flags & {"fsdp", "coff", "mp"}) or tp > 1, "coff": "coff" in flags, "mp": "mp" in flags,
            "tp": tp, "ring": ring}  # fmt: skip


def precision_of(args: argparse.Namespace, point: dict[str, Any]) -> str:
    return "bf16-mixed" if point["mp"] else args.precision


def model_config(args: argparse.Namespace, n: int) -> dict[str, Any]:
    return {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
            "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.heads,
            "max_position_embeddings": max(n, 2048), "tie_word_embeddings": False}  # fmt: skip


def _point(args: argparse.Namespace, point: dict[str, Any]) -> dict[str, Any]:
    """One rank of one point (runs in a launched process)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_longctx import UlyssesFPDTStrategy
    from lightning_longctx.recipes import CausalLM

    class StepMemory(L.Callback):
        """RSS before the model exists (setup), and around step ``args.measure_step``."""

        def setup(self, trainer, pl_module, stage) -> None:
            self.rss_setup = common.live_rss_bytes()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == args.measure_step:
                self.rss_base = common.live_rss_bytes()
                _reset_hwm()
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == args.measure_step:
                self.step_s = time.perf_counter() - self.t0
                self.rss_peak = _hwm_bytes()

    meter = StepMemory()
    strategy = UlyssesFPDTStrategy(
        sequence_parallel_size=point["P"] // point["tp"],
        tensor_parallel_size=point["tp"],
        ring_size=point["ring"],
        fpdt_chunk_size=args.chunk_size if point["mode"] == "fpdt" else None,
        offload=point["offload"],
        activation_checkpointing=point["ckpt"],
        activation_offload=point["aoff"],
        data_parallel="fsdp" if point["fsdp"] else "ddp",
        cpu_offload=point["coff"],
        process_group_backend="gloo",
    )
    trainer = L.Trainer(accelerator="cpu", devices=point["P"], strategy=strategy, precision=precision_of(args, point),
                        max_steps=args.measure_step + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[meter])  # fmt: skip
    module = CausalLM(model_config=model_config(args, point["N"]), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (args.measure_step + 1, point["N"]), generator=g)
    trainer.fit(module, train_dataloaders=DataLoader([{"input_ids": x, "labels": x.clone()} for x in ids]))
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "rss_setup_bytes": meter.rss_setup,
        "rss_before_step_bytes": meter.rss_base,
        "rss_peak_bytes": meter.rss_peak,
        "step_s": meter.step_s,
    }


def plan(args: argparse.Namespace, point: dict[str, Any]) -> Any:
    from lightning_longctx import plan_memory

    return plan_memory(
        model_config(args, point["N"]),
        seq_len=point["N"],
        sequence_parallel_size=point["P"] // point["tp"],
        tensor_parallel_size=point["tp"],
        ring_size=point["ring"],
        mode=point["mode"],
        fpdt_chunk_size=args.chunk_size if point["mode"] == "fpdt" else None,
        offload=point["offload"],
        activation_checkpointing=point["ckpt"],
        activation_offload=point["aoff"],
        data_parallel="fsdp" if point["fsdp"] else "ddp",
        cpu_offload=point["coff"],
        precision=precision_of(args, point),
        optimizer="adamw",
        device_reserve=0,  # live tensor bytes, as measured: no CUDA context on a CPU
    )


def run_point(args: argparse.Namespace, point: dict[str, Any]) -> dict[str, Any]:
    """Plan and measure one point; the row compares them (max over ranks)."""
    p = plan(args, point)
    row: dict[str, Any] = {
        **point,
        "planned_step_mib": (p.combined - p.between_steps) / MIB,
        "planned_total_mib": p.combined / MIB,
        "peak_phase": p.peak_phase,
        "plan": p.to_dict(),
    }
    run = common.launch(_point, point["P"], args, point, threads=args.threads, timeout_s=args.timeout)
    row["wall_s"] = run.wall_s
    if run.error:
        return {**row, "status": "failed", "log_tail": f"{run.error}\n{run.log}"[-3000:]}
    ranks = run.results
    row.update(
        status="ok",
        measured_step_mib=max(r["rss_peak_bytes"] - r["rss_before_step_bytes"] for r in ranks) / MIB,
        measured_total_mib=max(r["rss_peak_bytes"] - r["rss_setup_bytes"] for r in ranks) / MIB,
        step_s=max(r["step_s"] for r in ranks),
        ranks=ranks,
    )
    row["step_error_pct"] = 100 * (row["planned_step_mib"] / row["measured_step_mib"] - 1)
    row["total_error_pct"] = 100 * (row["planned_total_mib"] / row["measured_total_mib"] - 1)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", nargs="+", type=parse_point, default=None,
                   help=f"N:P:ulysses|fpdt[:offload][:ckpt][:aoff][:fsdp][:coff][:mp][:tpT][:ringR] (default: {' '.join(DEFAULT_POINTS)})")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help=f"toy run: {' '.join(SMOKE_POINTS)}, chunk 256")
    p.add_argument("--ring", action="store_true",
                   help=f"the ring's binding points: {' '.join(RING_POINTS)} at --vocab 512 --intermediate 128")  # fmt: skip
    p.add_argument(
        "--chunk-size", type=int, default=1024, help="FPDT tokens per chunk per rank (default: 1024)"
    )
    p.add_argument("--precision", default="32-true")
    p.add_argument(
        "--measure-step", type=int, default=2, help="0-based index of the measured step (default: 2)"
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default: 1)")
    p.add_argument("--max-error", type=float, default=15.0, help="target |step error| in %% (default: 15)")
    common.add_malloc_threshold_arg(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per point (default: 600)")
    p.add_argument("--out", default=str(common.Path(__file__).resolve().parent / "results" / "planner.json"))
    common.add_model_args(p, vocab=32000, hidden=128, intermediate=344, layers=2, heads=4)
    args = p.parse_args(argv)
    if args.smoke:
        args.points, args.chunk_size = [parse_point(x) for x in SMOKE_POINTS], 256
    if args.ring:
        args.points, args.vocab, args.intermediate = [parse_point(x) for x in RING_POINTS], 512, 128
    points = args.points or [parse_point(x) for x in DEFAULT_POINTS]
    common.use_malloc_threshold(args.malloc_mmap_threshold)
    args.points = [":".join(map(str, (q["N"], q["P"], q["mode"]))) + (":offload" if q["offload"] else "")
                   + (":aoff" if q["aoff"] else ":ckpt" if q["ckpt"] else "")
                   + (":coff" if q["coff"] else ":fsdp" if q["fsdp"] and not q["mp"] else "")
                   + (":mp" if q["mp"] else "") + (f":tp{q['tp']}" if q["tp"] > 1 else "")
                   + (f":ring{q['ring']}" if q["ring"] > 1 else "") for q in points]  # fmt: skip

    rows = []
    for point in points:
        row = run_point(args, point)
        rows.append(row)
        tp = f" tp {point['tp']}" if point["tp"] > 1 else ""
        tp += f" ring {point['ring']}" if point["ring"] > 1 else ""
        where = (f"N={point['N']:>6} P={point['P']} {point['mode']:>7}{' offload' * point['offload']}"
                 f"{' ckpt' * point['ckpt']}{' act-offload' * point['aoff']}{' fsdp' * point['fsdp']}"
                 f"{' cpu_offload' * point['coff']}{' mp' * point['mp']}{tp}")  # fmt: skip
        if row["status"] == "ok":
            print(f"{where}: step planned {row['planned_step_mib']:7.1f} measured {row['measured_step_mib']:7.1f} MiB "
                  f"({row['step_error_pct']:+.1f}%), total {row['total_error_pct']:+.1f}%, {row['step_s']:.0f} s step",
                  flush=True)  # fmt: skip
        else:
            print(f"{where}: {row['status']}", flush=True)
            print(row.get("log_tail", ""), end="", file=sys.stderr)

    shown = [{**r, **{k: "on" if r[k] else "off" for k in ("offload", "ckpt", "aoff", "coff", "mp")},
              "dp": "FSDP" if r["fsdp"] else "DDP"} for r in rows]  # fmt: skip
    columns = [("N", "N", ""), ("P", "P", ""), ("mode", "mode", ""), ("offload", "offload", ""), ("ckpt", "ckpt", ""),
               ("aoff", "act. offload", ""), ("dp", "dp", ""), ("tp", "tp", ""), ("ring", "ring", ""), ("coff", "cpu_offload", ""), ("mp", "MP policy", ""), ("planned_step_mib", "planned step MiB", ".1f"), ("measured_step_mib", "measured step MiB", ".1f"),
               ("step_error_pct", "error %", "+.1f"), ("planned_total_mib", "planned total MiB", ".1f"),
               ("measured_total_mib", "measured total MiB", ".1f"), ("total_error_pct", "total error %", "+.1f"),
               ("peak_phase", "planned peak", ""), ("status", "status", "")]  # fmt: skip
    print(f"\nper rank, max over ranks, CPU RSS; step = peak during step {args.measure_step + 1} - RSS before it; "
          "total = peak - RSS before the model was built; error = planned / measured - 1")  # fmt: skip
    print(common.format_table(shown, columns))
    ok = [r for r in rows if r["status"] == "ok"]
    missed = [r for r in ok if abs(r["step_error_pct"]) > args.max_error]
    if ok:
        worst = max(ok, key=lambda r: abs(r["step_error_pct"]))
        print(f"\nlargest |step error| {abs(worst['step_error_pct']):.1f}% (N={worst['N']} P={worst['P']} "
              f"{worst['mode']}); {len(ok) - len(missed)} of {len(ok)} rows within {args.max_error:g}%")  # fmt: skip
    fields = {"measure": "peak RSS", "rows": rows}
    common.save_results("planner", vars(args), fields, args.out)
    return 1 if (missed and not args.smoke) or len(ok) < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
