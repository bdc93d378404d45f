"""End-to-end training throughput (tokens/s, MFU) of a tiny Llama per mode, with real Lightning Trainer runs.

Modes, all at the same global sequence length N (batch 1, one sample per step):

* ``single``: one process, the plain Hugging Face model (SDPA attention, full logits);
* ``ulysses``: P ranks under ``UlyssesFPDTStrategy(sequence_parallel_size=P)`` (SDPA kernel);
* ``fpdt``: the same with ``fpdt_chunk_size=c`` (chunked attention with the math blocks, tiled MLP,
  chunked lm_head + loss), for every chunk size c of ``--chunk-sizes`` with ``P*c <= N``;
* ``fpdt_offload``: FPDT with ``offload=True`` at the largest such chunk size (on CPU the "host copy"
  is a plain clone: same code path, no transfer to hide).

SP modes are launched with ``torchrun`` (P processes, gloo on CPU, NCCL on CUDA), ``single`` as one
process. Each run trains ``--warmup`` + ``--steps`` optimizer steps of ``lightning_longctx.models.CausalLM``
(AdamW) on random tokens; ``lightning_longctx.callbacks.MFUMonitor`` measures the last ``--steps``
steps: tokens/s = global tokens (a sample of an SP group counted once) / wall seconds (rank 0, between
consecutive batch ends), MFU = model FLOP/s per device (``lightning_longctx.flops.flops_per_token``,
causal attention counted half, no recomputation) / peak FLOP/s of one device. On CPU the peak is a
matmul measured once by this script with ``--threads`` threads (so MFU is relative to this machine),
on CUDA the data-sheet table.

FPDT overhead at equal N and chunk c = ulysses tokens/s / fpdt tokens/s - 1.

    python benchmarks/bench_throughput.py            # N = 4096, chunks 256..2048: ~4 min on 2 busy cores
    python benchmarks/bench_throughput.py --smoke    # toy sizes, < 30 s
    python benchmarks/bench_throughput.py --device cuda --world-size 2 --seq-lens 32768 --hidden 1024 ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import child_env, environment, format_table, launch_cmd, median, write_json

ROOT = Path(__file__).resolve().parents[1]
MODES = ("single", "ulysses", "fpdt", "fpdt_offload")


# ---------------------------------------------------------------------------------------------------
# worker: one Trainer run (rank 0 writes the result file)
# ---------------------------------------------------------------------------------------------------


def _fit_once(cfg: dict[str, Any]) -> dict[str, Any]:
    """One Trainer run of ``cfg``; returns rank 0's measurements (other ranks: an empty dict)."""
    import lightning as L
    from torch.utils.data import DataLoader, Dataset

    from lightning_longctx import UlyssesFPDTStrategy
    from lightning_longctx.callbacks import MFUMonitor
    from lightning_longctx.models import CausalLM

    L.seed_everything(0, verbose=False)
    cuda = cfg["device"] == "cuda"
    n, mode = cfg["seq_len"], cfg["mode"]

    class RandomTokens(Dataset):
        def __init__(self, count: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(1, cfg["model"]["vocab_size"], (count, n), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class StepTimes(L.Callback):
        """Rank 0's wall time between consecutive batch ends (MFUMonitor's convention), every step."""

        def __init__(self) -> None:
            self.t_last: float | None = None
            self.seconds: list[float] = []

        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.t_last is None:
                self.t_last = self._now()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = self._now()
            self.seconds.append(now - self.t_last)
            self.t_last = now

    if mode == "single":
        strategy: Any = "auto"
        devices = 1
    else:
        strategy = UlyssesFPDTStrategy(
            sequence_parallel_size=cfg["world_size"],
            fpdt_chunk_size=cfg["chunk_size"],
            offload=mode == "fpdt_offload",
            process_group_backend="nccl" if cuda else "gloo",
        )
        devices = cfg["world_size"]
    steps = cfg["warmup"] + cfg["steps"]
    monitor = MFUMonitor(peak_flops=cfg["peak_flops"], window=cfg["steps"], warmup_steps=cfg["warmup"])
    timer = StepTimes()
    trainer = L.Trainer(
        accelerator=cfg["device"],
        devices=devices,
        strategy=strategy,
        precision=cfg["precision"],
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[monitor, timer],
    )
    module = CausalLM(
        model_config=cfg["model"],
        lr=1e-4,
        eval_metric=False,
        activation_checkpointing=cfg["activation_checkpointing"],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, train_dataloaders=DataLoader(RandomTokens(steps), batch_size=1))
    if trainer.global_rank != 0:
        return {}
    last = monitor.history[-1] if monitor.history else {}
    return {
        "steps_run": len(timer.seconds),
        "step_s": [round(s, 4) for s in timer.seconds],
        "tokens_per_sec": last.get("perf/tokens_per_sec"),
        "tokens_per_sec_per_device": last.get("perf/tokens_per_sec_per_device"),
        "tflops_per_device": last.get("perf/tflops_per_device"),
        "mfu": last.get("perf/mfu"),
        "peak_flops": monitor.peak_flops,
        "peak_source": monitor.peak_source,
        "cuda_max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "final_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
    }


def _worker(cfg: dict[str, Any]) -> None:
    """Every run of ``cfg["runs"]`` in this process (group), one after another; rank 0 appends one JSON
    line per run to ``cfg["result_file"]``. The process group of the first SP run is reused by the next
    ones (Lightning does not re-initialise an initialised group)."""
    import gc

    torch.set_num_threads(cfg["threads"])
    rank0 = int(os.environ.get("RANK", "0")) == 0
    for run in cfg["runs"]:
        t0 = time.perf_counter()
        result = _fit_once({**cfg, **run})
        if rank0:
            result.update(run, wall_s=round(time.perf_counter() - t0, 2))
            with open(cfg["result_file"], "a") as f:
                f.write(json.dumps(result) + "\n")
        gc.collect()
        if cfg["device"] == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# driver: plan the runs, launch them one after another, tabulate
# ---------------------------------------------------------------------------------------------------


def plan_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """(mode, N, chunk) of every run, in the order they run."""
    runs = []
    for n in args.seq_lens:
        chunks = [c for c in args.chunk_sizes if args.world_size * c <= n and n % (args.world_size * c) == 0]
        for mode in args.modes:
            if mode in ("single", "ulysses"):
                runs.append({"mode": mode, "seq_len": n, "chunk_size": None})
            elif mode == "fpdt":
                runs += [{"mode": mode, "seq_len": n, "chunk_size": c} for c in chunks]
            elif chunks:  # fpdt_offload: the largest chunk only
                runs.append({"mode": mode, "seq_len": n, "chunk_size": max(chunks)})
    return runs


def _complete_lines(path: Path) -> list[str]:
    """The newline-terminated lines of ``path`` (a line being written is left for the next look)."""
    return path.read_text().split("\n")[:-1] if path.exists() else []


def _report(run: dict[str, Any], res: dict[str, Any]) -> None:
    steps = ", ".join(f"{s:.3f}" for s in res["step_s"])
    print(
        f"  {_label(run)}: {res['tokens_per_sec']:.0f} tokens/s; step seconds (warmup first): {steps}",
        flush=True,
    )


def launch(
    runs: list[dict[str, Any]], args: argparse.Namespace, model: dict[str, Any], peak: float | None
) -> list[dict]:
    """Run ``runs`` (all ``single`` or all SP) one after another in ONE launch: a process, or a torchrun
    group of ``--world-size`` processes; prints each run's result as it arrives. Returns one dict per
    run: its results or an ``error``."""
    sp = runs[0]["mode"] != "single"
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "results.jsonl"
        cfg = {
            "runs": runs,
            "model": model,
            "device": args.device,
            "precision": args.precision,
            "world_size": args.world_size,
            "threads": args.threads,
            "warmup": args.warmup,
            "steps": args.steps,
            "peak_flops": peak,
            "activation_checkpointing": args.activation_checkpointing,
            "result_file": str(result_file),
        }
        cmd = launch_cmd(__file__, args.world_size, "--worker", json.dumps(cfg), torchrun=sp)
        error, tail, done = None, "", []
        log_path = Path(tmp) / "launch.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(  # own session: a timeout kills torchrun AND its workers
                cmd,
                cwd=ROOT,
                env=child_env(args.threads),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            deadline = time.monotonic() + args.timeout
            while proc.poll() is None or len(done) < len(_complete_lines(result_file)):
                for line in _complete_lines(result_file)[len(done) :]:
                    done.append(json.loads(line))
                    _report(runs[len(done) - 1], done[-1])
                if proc.poll() is None and time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    error = f"timeout: launch exceeded --timeout {args.timeout:.0f}s"
                time.sleep(0.5)
        if error is None and proc.returncode != 0:
            error, tail = f"exit {proc.returncode}", log_path.read_text()[-3000:]
    if error:
        print(f"  launch FAILED ({error}) after {len(done)} of {len(runs)} runs\n{tail}", flush=True)
    return done + [{"error": error or "no result", "log_tail": tail} for _ in runs[len(done) :]]


def _label(run: dict[str, Any]) -> str:
    return f"N={run['seq_len']} {run['mode']}" + (f" c={run['chunk_size']}" if run["chunk_size"] else "")


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads or args.heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": max(args.seq_lens),
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
    }


def overheads(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """FPDT overhead over Ulysses at equal N: ulysses tokens/s / fpdt tokens/s - 1."""
    out = []
    base = {r["seq_len"]: r.get("tokens_per_sec") for r in rows if r["mode"] == "ulysses"}
    for r in rows:
        ref, tps = base.get(r["seq_len"]), r.get("tokens_per_sec")
        if r["mode"].startswith("fpdt") and ref and tps:
            r["fpdt_overhead"] = ref / tps - 1.0
            out.append(
                {
                    "mode": r["mode"],
                    "seq_len": r["seq_len"],
                    "chunk_size": r["chunk_size"],
                    "overhead": r["fpdt_overhead"],
                }
            )
    return out


COLUMNS = [
    ("seq_len", "N", ""),
    ("mode", "mode", ""),
    ("chunk_size", "chunk", ""),
    ("median_step_s", "step s (median)", ".3f"),
    ("tokens_per_sec", "tokens/s", ".0f"),
    ("tokens_per_sec_per_device", "tokens/s/dev", ".0f"),
    ("tflops_per_device", "TFLOP/s/dev", ".4f"),
    ("mfu_pct", "MFU %", ".1f"),
    ("overhead_pct", "FPDT overhead %", "+.1f"),
    ("status", "status", ""),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096], help="global sequence lengths N")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--chunk-sizes",
        type=int,
        nargs="+",
        default=[256, 512, 1024, 2048],
        help="FPDT tokens per chunk per rank (runs those with world_size*chunk <= N)",
    )
    p.add_argument("--world-size", type=int, default=2, help="sequence-parallel ranks P of the SP modes")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps not measured")
    p.add_argument("--steps", type=int, default=3, help="measured optimizer steps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--precision", default=None, help="Lightning precision; default 32-true (cpu), bf16-mixed (cuda)"
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="HF gradient checkpointing")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch (all runs of one launch)")
    p.add_argument("--smoke", action="store_true", help="toy sizes (N=512, 2 layers, hidden 64): < 30 s")
    p.add_argument("--out", default="benchmarks/results/throughput.json", help="JSON output path")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_lens, args.chunk_sizes = [512], [128]
        args.hidden, args.intermediate, args.layers, args.heads, args.vocab = 64, 128, 2, 4, 512
        args.warmup, args.steps = 1, 2
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" else "32-true"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    t_start = time.perf_counter()
    model = model_config(args)
    peak = None  # CUDA: MFUMonitor's data-sheet table
    if args.device == "cpu":
        from lightning_longctx.flops import measure_peak_flops

        torch.set_num_threads(args.threads)
        peak = max(measure_peak_flops("cpu", "fp32", n=1024, reps=5) for _ in range(3))
        print(f"CPU fp32 matmul peak, {args.threads} thread(s): {peak / 1e9:.1f} GFLOP/s (best of 3)")
    runs = plan_runs(args)
    groups = [[r for r in runs if r["mode"] == "single"], [r for r in runs if r["mode"] != "single"]]
    rows = []
    for group in filter(None, groups):
        what = "1 process" if group[0]["mode"] == "single" else f"torchrun, {args.world_size} ranks"
        print(f"launching {len(group)} run(s), {what}: " + ", ".join(_label(r) for r in group), flush=True)
        for run, res in zip(group, launch(group, args, model, peak)):
            row = {**run, **res}
            if "error" in res:
                row["status"] = res["error"]
            else:
                row["status"] = "ok"
                measured = res["step_s"][args.warmup :]
                row["median_step_s"] = median(measured)
                row["mfu_pct"] = None if res["mfu"] is None else 100 * res["mfu"]
            rows.append(row)
    over = overheads(rows)
    for r in rows:
        if "fpdt_overhead" in r:
            r["overhead_pct"] = 100 * r["fpdt_overhead"]
    print()
    print(format_table(rows, COLUMNS))
    if over:
        print("\nFPDT overhead over Ulysses (ulysses tokens/s / fpdt tokens/s - 1):")
        for o in over:
            print(
                f"  N={o['seq_len']:>6} {o['mode']:<13} chunk={o['chunk_size']:>5}: {100 * o['overhead']:+.1f}%"
            )
    failures = [
        f"{r['mode']} N={r['seq_len']} chunk={r['chunk_size']}: {r['status']}"
        for r in rows
        if r["status"] != "ok"
    ]
    payload = {
        "benchmark": "throughput",
        "config": {k: v for k, v in vars(args).items() if k != "worker"},
        "model": model,
        "peak_flops": peak,
        "peak_source": "measured: cpu fp32 matmul (n=1024, best of 3)" if peak else "table (MFUMonitor)",
        "environment": environment(),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "failures": failures,
        "results": rows,
        "fpdt_overhead": over,
    }
    path = write_json(args.out, payload)
    print(f"\nwrote {path} ({payload['elapsed_s']} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
