"""Checkpoints, full vs sharded vs async: save and load time, peak host memory per rank, bytes on disk.

    python benchmarks/bench_checkpoint.py [--world 4] [--sp 2] [--repeats 3] [--out benchmarks/results/checkpoint.json]
    python benchmarks/bench_checkpoint.py --smoke --out /tmp/checkpoint.json --ckpt-dir /tmp/ckpts

Each format is a fresh job of ``--world`` launched gloo processes (``common.launch``, one thread each) that
trains ``CausalLM`` (AdamW: params + 2 moments = 12 B per parameter, fp32) on a Llama (hidden 768, 8 layers,
12 heads, intermediate 2048, vocab 32000, untied: ~106M parameters) through a real ``Trainer`` with
``UlyssesFPDTStrategy(data_parallel="fsdp", sequence_parallel_size=--sp)`` for one step of a 64-token sample,
so that AdamW's moments exist, then ``--repeats`` times:

* **save**: ``trainer.save_checkpoint(path)`` on every rank (the state gathered or not, written, committed).
  ``full``: the whole state gathered to rank 0's host and written there as one file; ``sharded``: every rank
  writes its own FSDP shards (``torch.distributed.checkpoint``); ``async``: sharded through
  ``dcp.async_save``: *blocking* is until ``save_checkpoint`` returns (the state staged in host memory, the
  write started), *committed* until ``strategy.wait_for_checkpoint()`` returns as well (every shard written, rank 0's
  marker and rename done). For sync formats the two are the same.
* **load**: ``trainer.strategy.load_checkpoint(path)`` into the set-up (sharded) model and AdamW, after the
  parameters and moments were zeroed; a checksum of every rank's local shards must come back as saved. This
  is the state loading of a resume (``trainer.fit(ckpt_path=...)``) without the Trainer's setup around it.

Memory per rank: the peak RSS during the operation (``VmHWM`` after ``/proc/self/clear_refs``) minus the RSS
right before it (after ``gc.collect`` and ``malloc_trim(0)``), i.e. what the operation added at its worst.
RSS counts file pages a process has mapped: a full checkpoint is loaded memory-mapped on every rank, so its
pages show in every rank's RSS although the kernel holds them once (page cache). A 5 ms sampler reads
``RssAnon`` as well (anonymous memory only: private copies, gathered tensors), reported beside it.
Times are per rank, max over ranks. Bytes on disk: the checkpoint file or directory, marker included.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import common
from bench_memory import _hwm_bytes, _reset_hwm
from common import MIB

FORMATS = {"full": {"checkpoint_format": "full"}, "sharded": {"checkpoint_format": "sharded"},
           "async": {"checkpoint_format": "sharded", "async_save": True}}  # fmt: skip
SMOKE_MODEL = {"vocab": 512, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4}


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
            "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.heads,
            "max_position_embeddings": 2048, "tie_word_embeddings": False}  # fmt: skip


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


class PeakRss:
    """Around one operation: RSS before (trimmed), ``VmHWM`` (the kernel's exact peak of RSS) after, and the
    largest ``RssAnon`` a background thread saw every ``interval`` seconds."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval

    def __enter__(self) -> PeakRss:
        self.before = common.live_rss_bytes()
        self.anon_before = _status_kib("RssAnon") * 1024
        self.anon_peak = self.anon_before
        _reset_hwm()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.anon_peak = max(self.anon_peak, _status_kib("RssAnon") * 1024)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _status_kib("RssAnon") * 1024)
        self.peak = _hwm_bytes()

    def result(self) -> dict[str, int]:
        return {"rss_before": self.before, "rss_peak": self.peak, "peak_delta": self.peak - self.before,
                "anon_peak_delta": self.anon_peak - self.anon_before}  # fmt: skip


def _local_tensors(trainer: Any) -> list[Any]:
    """This rank's shards of every parameter and AdamW state tensor (DTensors under FSDP)."""
    module, optimizer = trainer.lightning_module, trainer.optimizers[0]
    params = list(module.parameters())
    states = [v for p in params for k, v in optimizer.state[p].items() if k != "step"]
    return params + states


def _checksum(tensors: list[Any]) -> list[float]:
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return [float((t.to_local() if isinstance(t, DTensor) else t).double().sum()) for t in tensors]


def _disk_bytes(path: Path) -> tuple[int, list[str]]:
    """Bytes of a checkpoint (file or directory) and its marker, and the names of its files."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    marker = path.with_name(path.name + ".commit.json")
    files += [marker] if marker.exists() else []
    return sum(p.stat().st_size for p in files), sorted(str(p.relative_to(path.parent)) for p in files)


def _rank(args: argparse.Namespace, fmt: str, root: str) -> dict[str, Any]:
    """One rank of one format (a launched process)."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_longctx import UlyssesFPDTStrategy
    from lightning_longctx.recipes import CausalLM

    strategy = UlyssesFPDTStrategy(sequence_parallel_size=args.sp, data_parallel="fsdp",
                                   process_group_backend="gloo", **FORMATS[fmt])  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=args.world, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)  # fmt: skip
    module = CausalLM(model_config=model_config(args), lr=1e-4)
    dp = args.world // args.sp
    ids = torch.randint(1, args.vocab, (dp, args.seq_len), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, train_dataloaders=DataLoader([{"input_ids": x, "labels": x.clone()} for x in ids]))
    rank, tensors = dist.get_rank(), _local_tensors(trainer)
    local_bytes = sum(
        (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors
    )
    saved = _checksum(tensors)
    repeats = []
    for i in range(args.repeats):
        path = Path(root, f"{fmt}-{i}.ckpt")
        dist.barrier()
        with PeakRss() as save_mem:
            t0 = time.perf_counter()
            trainer.save_checkpoint(path)
            blocking = time.perf_counter() - t0
            trainer.strategy.wait_for_checkpoint()  # async: the write finished and committed (no-op otherwise)
            committed = time.perf_counter() - t0
        dist.barrier()
        disk, files = _disk_bytes(path) if rank == 0 else (None, None)
        with torch.no_grad():  # what the load must bring back
            for t in tensors:
                t.zero_()
        dist.barrier()
        with PeakRss() as load_mem:
            t0 = time.perf_counter()
            meta = trainer.strategy.load_checkpoint(path)
            load_s = time.perf_counter() - t0
        del meta  # a full checkpoint's tensors are memory-mapped views of the file
        # the optimizer may hold new state tensors now (the full format loads through load_state_dict)
        tensors = _local_tensors(trainer)
        if _checksum(tensors) != saved:
            raise RuntimeError(f"rank {rank}: the state loaded from {path} is not the state saved")
        repeats.append({"blocking_s": blocking, "committed_s": committed, "load_s": load_s,
                        "save_mem": save_mem.result(), "load_mem": load_mem.result(),
                        "disk_bytes": disk, "files": files})  # fmt: skip
        dist.barrier()
        if rank == 0 and i + 1 < args.repeats:  # keep the last one only (disk)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            path.with_name(path.name + ".commit.json").unlink(missing_ok=True)
    params = sum(p.numel() for p in module.parameters())  # global numel (DTensors)
    return {"rank": rank, "parameters": params, "local_state_bytes": local_bytes, "repeats": repeats}


def summarize(fmt: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One row: times max over ranks, median over repeats; memory max over repeats, rank 0 and max of others."""

    def time_of(key: str) -> float:
        return statistics.median(
            max(r["repeats"][i][key] for r in ranks) for i in range(len(ranks[0]["repeats"]))
        )

    def mem(op: str, key: str, who: list[dict[str, Any]]) -> float | None:
        return max((rep[op][key] for r in who for rep in r["repeats"]), default=None)

    zero, others = ranks[0], ranks[1:]
    last = zero["repeats"][-1]
    row = {"format": fmt, "status": "ok", "save_s": time_of("committed_s"),
           "blocking_s": time_of("blocking_s") if fmt == "async" else None, "load_s": time_of("load_s"),
           "disk_bytes": last["disk_bytes"], "files": last["files"],
           "local_state_bytes": [r["local_state_bytes"] for r in ranks], "parameters": zero["parameters"]}  # fmt: skip
    for op in ("save_mem", "load_mem"):
        for key, name in (("peak_delta", "peak"), ("anon_peak_delta", "anon")):
            row[f"{op}_{name}_rank0"] = mem(op, key, [zero])
            row[f"{op}_{name}_others"] = mem(op, key, others)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument(
        "--sp", type=int, default=2, help="sequence_parallel_size (dp = world / sp, FSDP over all)"
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    common.add_model_args(p, vocab=32000, hidden=768, intermediate=2048, layers=8, heads=12)
    p.add_argument("--smoke", action="store_true", help="toy model, world 2, one repeat (< 60 s)")
    p.add_argument(
        "--ckpt-dir", default=None, help="where the checkpoints go (default: a temporary folder, deleted)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="per format")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "checkpoint.json"))
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE_MODEL, world=2, sp=2, repeats=1)
    if args.world % args.sp:
        p.error(f"--sp {args.sp} must divide --world {args.world}")
    # allocations >= 256 KiB get their own mapping, returned on free: RSS follows live bytes
    common.use_malloc_threshold(1 << 18)
    tmp = None if args.ckpt_dir else tempfile.mkdtemp(prefix="bench_ckpt_", dir=os.environ.get("TMPDIR"))
    root = Path(args.ckpt_dir or tmp)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for fmt in args.formats:
            run = common.launch(_rank, args.world, args, fmt, str(root), threads=1, timeout_s=args.timeout)
            if run.error:
                rows.append(
                    {"format": fmt, "status": "failed", "log_tail": f"{run.error}\n{run.log}"[-3000:]}
                )
                print(f"{fmt}: FAILED\n{rows[-1]['log_tail']}")
                continue
            rows.append({**summarize(fmt, run.results), "wall_s": run.wall_s, "ranks": run.results})
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        for key in [k for k in r if k.endswith(("_rank0", "_others"))]:
            r[key.replace("_mem_", "_mib_")] = None if r[key] is None else r[key] / MIB
        r["disk_mib"] = r["disk_bytes"] / MIB
    columns = [("format", "format", ""), ("save_s", "save s (committed)", ".2f"),
               ("blocking_s", "async blocking s", ".2f"), ("load_s", "load s", ".2f"),
               ("save_mib_peak_rank0", "save ΔRSS r0 MiB", ".0f"), ("save_mib_peak_others", "save ΔRSS others", ".0f"),
               ("load_mib_peak_rank0", "load ΔRSS r0 MiB", ".0f"), ("load_mib_peak_others", "load ΔRSS others", ".0f"),
               ("load_mib_anon_rank0", "load ΔAnon r0", ".0f"), ("load_mib_anon_others", "load ΔAnon others", ".0f"),
               ("disk_mib", "disk MiB", ".1f"), ("status", "status", "")]  # fmt: skip
    params = ok[0]["parameters"] if ok else 0
    state = ok[0]["local_state_bytes"] if ok else []
    print(f"world {args.world} = sp {args.sp} x dp {args.world // args.sp}, FSDP, gloo; Llama {params / 1e6:.1f}M "
          f"parameters, AdamW; per-rank params+moments MiB {[round(b / MIB) for b in state]}")  # fmt: skip
    print(
        "times: max over ranks, median of repeats; ΔRSS: peak - before, max over repeats (others: max of ranks 1..)"
    )
    print(common.format_table(rows, columns))
    full = next((r for r in ok if r["format"] == "full"), None)
    sharded = next((r for r in ok if r["format"] == "sharded"), None)
    ratio = None
    if full and sharded and full["save_mem_peak_rank0"] > 0:
        worst = max(sharded["save_mem_peak_rank0"], sharded["save_mem_peak_others"] or 0)
        ratio = worst / full["save_mem_peak_rank0"]
        print(
            f"sharded save peak per rank / full save peak on rank 0 = {ratio:.3f} (1/world = {1 / args.world:.3f})"
        )
    fields = {
        "model": model_config(args),
        "parameters": params,
        "sharded_over_full_save_peak": ratio,
        "rows": rows,
    }
    common.save_results(
        "checkpoint", vars(args), fields, args.out, args.plot or Path(args.out).with_suffix(".png")
    )
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
