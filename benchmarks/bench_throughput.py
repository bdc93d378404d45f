"""End-to-end training throughput (tokens/s, MFU) of a tiny Llama per mode, with real Lightning Trainer runs.

Modes at one global sequence length N (batch 1): ``single`` (one process, plain HF model), ``ulysses``
(P ranks, ``UlyssesFPDTStrategy``), ``fpdt`` (every chunk c of ``--chunk-sizes`` with ``P*c <= N``) and
``fpdt_offload`` (the largest such chunk; on CPU the "host copy" is a plain clone: same code path, no
transfer to hide). Every run is a fresh launch that trains ``--warmup`` + ``--steps`` AdamW steps of
``lightning_longctx.recipes.CausalLM`` on random tokens; ``lightning_longctx.lightning.callbacks.MFUMonitor``
measures the last ``--steps``: tokens/s = global tokens (an SP sample counted once) / rank 0's wall
seconds, MFU = model FLOP/s per device (``flops_per_token``: causal attention counted half, no
recomputation) / the peak of one device: on CPU a matmul measured once by this script with
``--threads`` threads (``measure_peak_flops``: MFU relative to this machine), on CUDA the data sheet.
FPDT overhead at equal N = ulysses tokens/s / fpdt tokens/s - 1.

    python benchmarks/bench_throughput.py            # N = 4096, chunks 256..2048: ~4 min on 2 busy cores
    python benchmarks/bench_throughput.py --smoke    # toy sizes, < 30 s
    python benchmarks/bench_throughput.py --device cuda --world-size 2 --seq-lens 32768 --hidden 1024 ...
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from common import add_model_args, bench_trainer, format_table, launch, save_results

MODES = ("single", "ulysses", "fpdt", "fpdt_offload")
PEAK_N, PEAK_REPS = 1024, 15  # the CPU peak: one 1024x1024 fp32 matmul, 15 times
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


def _fit_once(cfg: dict[str, Any]) -> dict[str, Any]:
    """One Trainer run of ``cfg`` (in a launched process); rank 0's measurements, other ranks ``{}``."""
    import lightning as L
    from torch.utils.data import DataLoader, Dataset

    from lightning_longctx.lightning.callbacks import MFUMonitor
    from lightning_longctx.recipes import CausalLM

    L.seed_everything(0, verbose=False)
    cuda = cfg["device"] == "cuda"
    n = cfg["seq_len"]

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

    steps = cfg["warmup"] + cfg["steps"]
    monitor = MFUMonitor(peak_flops=cfg["peak_flops"], window=cfg["steps"], warmup_steps=cfg["warmup"])
    timer = StepTimes()
    trainer = bench_trainer(
        cfg["mode"],
        cfg["world_size"],
        chunk_size=cfg["chunk_size"],
        device=cfg["device"],
        callbacks=[monitor, timer],
        precision=cfg["precision"],
        max_steps=steps,
        limit_val_batches=0,
    )
    module = CausalLM(model_config=cfg["model"], lr=1e-4, eval_metric=False,
                      activation_checkpointing=cfg["activation_checkpointing"])  # fmt: skip
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


def run_one(run: dict[str, Any], args: argparse.Namespace, model: dict[str, Any], peak: float | None) -> dict:
    """Launch ``run`` (1 process for ``single``, ``--world-size`` for SP); its table row."""
    cfg = {**run, "model": model, "peak_flops": peak}
    for key in ("device", "precision", "world_size", "warmup", "steps", "activation_checkpointing"):
        cfg[key] = getattr(args, key)
    world = 1 if run["mode"] == "single" else args.world_size
    label = f"N={run['seq_len']} {run['mode']}" + (f" c={run['chunk_size']}" if run["chunk_size"] else "")
    done = launch(_fit_once, world, cfg, threads=args.threads, timeout_s=args.timeout)
    if done.error:
        status, log = done.error.splitlines()[0], done.log[-3000:]
        print(f"  {label}: FAILED ({status})\n{log}", flush=True)
        return {**run, "error": done.error, "log_tail": log, "status": status}
    res = done.results[0]
    steps = ", ".join(f"{s:.3f}" for s in res["step_s"])
    print(
        f"  {label}: {res['tokens_per_sec']:.0f} tokens/s; step seconds (warmup first): {steps}", flush=True
    )
    measured = res["step_s"][args.warmup :]
    return {
        **run,
        **res,
        "wall_s": round(done.wall_s, 2),
        "status": "ok",
        "median_step_s": statistics.median(measured) if measured else None,
        "mfu_pct": None if res["mfu"] is None else 100 * res["mfu"],
    }


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
    """FPDT overhead over Ulysses at equal N: ulysses tokens/s / fpdt tokens/s - 1 (also set on the rows)."""
    out = []
    base = {r["seq_len"]: r.get("tokens_per_sec") for r in rows if r["mode"] == "ulysses"}
    for r in rows:
        ref, tps = base.get(r["seq_len"]), r.get("tokens_per_sec")
        if r["mode"].startswith("fpdt") and ref and tps:
            r["fpdt_overhead"] = ref / tps - 1.0
            r["overhead_pct"] = 100 * r["fpdt_overhead"]
            run = {k: r[k] for k in ("mode", "seq_len", "chunk_size")}
            out.append({**run, "overhead": r["fpdt_overhead"]})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096], help="global sequence lengths N")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[256, 512, 1024, 2048],
                   help="FPDT tokens per chunk per rank (runs those with world_size*chunk <= N)")  # fmt: skip
    p.add_argument("--world-size", type=int, default=2, help="sequence-parallel ranks P of the SP modes")
    add_model_args(p, hidden=256, intermediate=768, layers=4, heads=8, vocab=8192)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps not measured")
    p.add_argument("--steps", type=int, default=3, help="measured optimizer steps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", default=None, help="default 32-true (cpu), bf16-mixed (cuda)")
    p.add_argument("--activation-checkpointing", action="store_true", help="HF gradient checkpointing")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (one launch)")
    p.add_argument("--smoke", action="store_true", help="toy sizes (N=512, 2 layers, hidden 64): < 30 s")
    p.add_argument("--out", default="benchmarks/results/throughput.json", help="JSON output path")
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
    t_start = time.perf_counter()
    model = model_config(args)
    peak = None  # CUDA: MFUMonitor's data-sheet table
    if args.device == "cpu":
        from lightning_longctx.planner.flops import measure_peak_flops

        torch.set_num_threads(args.threads)
        peak = measure_peak_flops("cpu", "fp32", n=PEAK_N, reps=PEAK_REPS)
        print(f"CPU fp32 matmul peak, {args.threads} thread(s): {peak / 1e9:.1f} GFLOP/s")
    runs = plan_runs(args)
    # single first, then the SP runs (the order of the table)
    runs = [r for r in runs if r["mode"] == "single"] + [r for r in runs if r["mode"] != "single"]
    print(
        f"{len(runs)} run(s), each a fresh launch: "
        + ", ".join(f"{r['mode']} N={r['seq_len']}" for r in runs)
    )
    rows = [run_one(run, args, model, peak) for run in runs]
    over = overheads(rows)
    print()
    print(format_table(rows, COLUMNS))
    if over:
        print("\nFPDT overhead over Ulysses (ulysses tokens/s / fpdt tokens/s - 1):")
        for o in over:
            print(
                f"  N={o['seq_len']:>6} {o['mode']:<13} chunk={o['chunk_size']:>5}: {100 * o['overhead']:+.1f}%"
            )
    bad = [r for r in rows if r["status"] != "ok"]
    failures = [f"{r['mode']} N={r['seq_len']} chunk={r['chunk_size']}: {r['status']}" for r in bad]
    source = f"measured: cpu fp32 matmul (n={PEAK_N}, {PEAK_REPS} reps)" if peak else "table (MFUMonitor)"
    fields = {
        "model": model,
        "peak_flops": peak,
        "peak_source": source,
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "failures": failures,
        "results": rows,
        "fpdt_overhead": over,
    }
    save_results("throughput", vars(args), fields, args.out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
