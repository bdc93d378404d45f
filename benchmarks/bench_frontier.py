"""The published long-context frontier beside the memory planner's answer with our features on.

Each point: a published run (the FPDT paper; Snowflake's ALST, arXiv 2506.13996) — GPUs, memory per GPU, host
memory per node — and what ``plan_memory`` says for the same model, length and GPUs with FPDT chunking +
offload, activation checkpointing with the layer inputs in host memory (``activation_offload``), FSDP2 with
``bf16-mixed`` (MixedPrecisionPolicy: bf16 compute over fp32 master weights and AdamW), and state offload
(``cpu_offload``) where one GPU must hold an 8B model: device and host needs (the reserve included: CUDA
context + allocator slack, the process per rank), the binding limit, and the longest sequence on the same
hardware. Then the shipped example configs, planned as they are. Planner only: no GPU, no weights.

    python benchmarks/bench_frontier.py [--out benchmarks/results/frontier.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30

#: Llama-3-8B (the model of every published point below)
LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
             "tie_word_embeddings": False}  # fmt: skip
#: our settings for every point (plan_memory keywords)
SETTINGS = {"mode": "fpdt", "fpdt_chunk_size": 16384, "offload": True, "activation_offload": True,
            "data_parallel": "fsdp", "precision": "bf16-mixed"}  # fmt: skip
#: (source, published tokens, GPUs, device memory, devices per host, host memory per host or None, cpu_offload)
FRONTIER = (
    ("ALST: 500K on 1 x H100 80GB (ZeRO-3 + offload)", 500_000, 1, "80GiB", 1, "1TB", True),
    ("FPDT paper: 2M on 4 x 80GB", 2_097_152, 4, "80GiB", 4, None, False),
    ("FPDT paper, stretch: 2M on 4 x 40GB", 2_097_152, 4, "40GiB", 4, None, True),
    ("ALST: 3.7M on 8 x H100 80GB (1.9 TB host per node)", 3_700_000, 8, "80GiB", 8, "1.9TB", False),
    ("ALST: 8M on 16 x H100 80GB", 8_000_000, 16, "80GiB", 8, "1.9TB", False),
    ("ALST: 15M on 32 x H100 80GB", 15_000_000, 32, "80GiB", 8, "1.9TB", False),
)
CONFIGS = ("llama3_8b_500k_1gpu.yaml", "llama3_8b_1m_fpdt_8gpu.yaml", "llama3_8b_4node_slurm.yaml")


def frontier_kwargs(point: tuple) -> dict[str, Any]:
    """The plan_memory keywords of one frontier point (without seq_len)."""
    _, _, gpus, memory, per_host, host, cpu_offload = point
    return {**SETTINGS, "sequence_parallel_size": gpus, "device_memory": memory, "devices_per_host": per_host,
            "host_memory": host, "cpu_offload": cpu_offload}  # fmt: skip


def _row(name: str, model: Any, n: int, kw: dict[str, Any]) -> dict[str, Any]:
    from lightning_longctx import longest_sequence, plan_memory

    plan = plan_memory(model, seq_len=n, **kw)
    search = {k: v for k, v in kw.items() if k != "sequence_parallel_size"}
    longest = longest_sequence(model, sequence_parallel_size=kw["sequence_parallel_size"], **search)
    return {
        "point": name,
        "seq_len": n,
        "gpus": kw["sequence_parallel_size"] * kw.get("data_parallel_size", 1),
        "device_memory_gib": plan.device_memory / GIB,
        "host_memory_gib": None if plan.host_memory is None else plan.host_memory / GIB,
        "cpu_offload": plan.cpu_offload,
        "device_needed_gib": plan.device_needed / GIB,
        "host_needed_gib": plan.host_needed / GIB,
        "peak_phase": plan.peak_phase,
        "fits": "yes" if plan.fits else "NO",
        "binding": plan.binding,
        "longest": longest,
        "plan": plan.to_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "frontier.json"))
    args = p.parse_args(argv)
    import common  # here, not at the top: tests/test_planner.py reads FRONTIER from this file without it
    import yaml

    from lightning_longctx.cli.plan import plan_kwargs_from_config

    rows = [_row(pt[0], LLAMA3_8B, pt[1], frontier_kwargs(pt)) for pt in FRONTIER]
    shipped = []
    for name in CONFIGS:
        model, kw, _ = plan_kwargs_from_config(
            yaml.safe_load((ROOT / "examples" / "configs" / name).read_text())
        )
        n = kw.pop("seq_len")
        kw.setdefault("device_memory", "80GiB")
        kw = {k: v for k, v in kw.items() if v is not None or k == "param_dtype"}
        shipped.append(_row(name, model, n, {"data_parallel_size": 1, **kw}))
    columns = [("point", "point", ""), ("seq_len", "N", ","), ("gpus", "GPUs", ""),
               ("device_memory_gib", "GiB / GPU", ".0f"), ("host_memory_gib", "host GiB / node", ".0f"),
               ("cpu_offload", "cpu_offload", ""), ("device_needed_gib", "device needs GiB", ".1f"),
               ("host_needed_gib", "host needs GiB / node", ".1f"), ("fits", "fits", ""),
               ("binding", "binding", ""), ("longest", "longest N", ",")]  # fmt: skip
    print("published points (Llama-3-8B; FPDT chunk 16K + offload, activation offload, FSDP2 bf16-mixed):")
    print(common.format_table(rows, columns))
    print("\nshipped configs (as written; 80 GiB per GPU, host unbounded):")
    print(common.format_table(shipped, columns))
    common.save_results(
        "frontier", vars(args), {"settings": SETTINGS, "rows": rows, "configs": shipped}, args.out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
