"""Tensor x sequence parallelism at a fixed world: all-to-all bytes per rank against the formula, and step time.

    python benchmarks/bench_tp.py [--world 4] [--seq-len 4096] [--out benchmarks/results/tp.json]

Every layout ``(sp, tp)`` with ``sp * tp = world`` (dp = 1) trains a Llama (hidden 256, 8 heads, 4 kv heads,
intermediate 688, 4 layers, vocab 8192, fp32) one sample of N tokens per step in fresh gloo processes: the
model's Hugging Face TP plan on the tp axis (``lightning_longctx.parallel.tensor_parallel.apply_tp_plan``), Ulysses
over the sp axis (``enable_sequence_parallel``), forward + backward (no optimizer: the layouts differ in what
the layer computes and moves). Per rank: the all-to-all bytes sent in one step (``count_all_to_all``) beside
the formula ``2 L (sp - 1)/sp * (N/sp) * head_dim * (2 h/tp + 2 kv/tp) * 4`` (q, k, v, out forward, their
gradients backward), and the median step time of ``--repeats`` steps after one warm-up (max over ranks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import common

SHAPE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 688,
         "num_hidden_layers": 4, "vocab_size": 8192}  # fmt: skip


def _rank(args: argparse.Namespace, sp: int, tp: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_longctx import enable_sequence_parallel, shard_batch
    from lightning_longctx.parallel.comm import count_all_to_all
    from lightning_longctx.parallel.mesh import MESH_AXES
    from lightning_longctx.parallel.tensor_parallel import apply_tp_plan

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, sp, tp), mesh_dim_names=MESH_AXES)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **SHAPE, max_position_embeddings=args.seq_len)
    )
    if tp > 1:
        apply_tp_plan(model, mesh["tensor_parallel"], tp=tp)
    group = mesh["sequence_parallel"].get_group()
    enable_sequence_parallel(model, group=group)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    batch = shard_batch({"input_ids": ids, "labels": ids.clone()}, group=group)
    times, sent = [], 0
    for step in range(args.repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        with count_all_to_all() as count:
            model(**batch).loss.backward()
        if step:
            times.append(time.perf_counter() - t0)
        sent = count.bytes_sent
        model.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    return {"step_s": statistics.median(times), "bytes_sent": sent}


def formula(args: argparse.Namespace, sp: int, tp: int) -> float:
    h, kv = SHAPE["num_attention_heads"] // tp, SHAPE["num_key_value_heads"] // tp
    d = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    return 2 * SHAPE["num_hidden_layers"] * (sp - 1) / sp * (args.seq_len // sp) * d * (2 * h + 2 * kv) * 4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "tp.json"))
    args = p.parse_args(argv)
    rows = []
    for tp in (t for t in (1, 2, 4, 8) if args.world % t == 0 and SHAPE["num_key_value_heads"] % t == 0):
        sp = args.world // tp
        run = common.launch(_rank, args.world, args, sp, tp, threads=1, timeout_s=args.timeout)
        if run.error:
            rows.append(
                {"sp": sp, "tp": tp, "status": "failed", "log_tail": f"{run.error}\n{run.log}"[-2000:]}
            )
            continue
        sent = {r["bytes_sent"] for r in run.results}
        rows.append({"sp": sp, "tp": tp, "status": "ok", "bytes_sent_per_rank": max(sent),
                     "formula_bytes": formula(args, sp, tp), "step_s": max(r["step_s"] for r in run.results)})  # fmt: skip
    columns = [("sp", "sp", ""), ("tp", "tp", ""), ("bytes_sent_per_rank", "all-to-all bytes / rank", ","),
               ("formula_bytes", "formula", ",.0f"), ("step_s", "step s (fwd+bwd)", ".3f"), ("status", "status", "")]  # fmt: skip
    print(f"world {args.world}, N = {args.seq_len}, dp 1; Llama {SHAPE}")
    print(common.format_table(rows, columns))
    common.save_results("tp", vars(args), {"shape": SHAPE, "rows": rows}, args.out)
    ok = all(r["status"] == "ok" and r["bytes_sent_per_rank"] == r["formula_bytes"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
