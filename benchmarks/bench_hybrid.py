"""Hybrid layers under sequence parallelism: state-exchange bytes against the formula and against attention's
all-to-all, and the per-rank time of a recurrent layer at P ranks against one process on the same sequence.

    python benchmarks/bench_hybrid.py [--seq-len 8192] [--world 2] [--out benchmarks/results/hybrid.json]

A Qwen3.5 text model (hidden 256; layer 0 gated DeltaNet: causal conv k=4 over q, k, v, 4 key / 8 value heads
of 32 dims; layer 1 attention: 8 heads, 2 kv heads of 32 dims; fp32), one sample of N tokens, in fresh gloo
processes of one thread each, Ulysses (``enable_sequence_parallel``).

* **bytes**: per rank in one forward + backward, the hybrid state exchange (``count.exchange_bytes``: the
  conv halo and the state scan) beside its formula, and the attention layer's all-to-all bytes
  (``count.bytes_sent``) beside :func:`attention_formula`.
* **time**: the median forward + backward of the gated DeltaNet module alone (``model.layers[0].linear_attn``)
  on its shard of N/P tokens, max over ranks, divided by the same module on all N tokens in one process.
* **packed**: the same sample packed with documents of 1/16 to 1/4 of N tokens (:func:`packed_positions`;
  position ids restarting at 0): the exchange bytes (the same formula: a piece per document changes no
  summary's size) and the layer's time per rank beside the unpacked one (``packed_ratio``), where the layer
  runs one piece per document behind zero tokens (``integrations/hybrid/base.py``, ``Documents``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import common

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 4096,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
         "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 4,
         "linear_num_value_heads": 8, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
         "linear_conv_kernel_dim": 4}  # fmt: skip
FP32 = 4


def halo_formula(world: int) -> int:
    """Conv halo, forward + its gradient backward: (k-1) inputs of the q, k, v channels, to one neighbour."""
    channels = 2 * SHAPE["linear_num_key_heads"] * SHAPE["linear_key_head_dim"] + (
        SHAPE["linear_num_value_heads"] * SHAPE["linear_value_head_dim"]
    )
    return 0 if world == 1 else 2 * (SHAPE["linear_conv_kernel_dim"] - 1) * channels * FP32


def scan_formula(world: int) -> int:
    """State scan: all-gather of [M | B] (h_v x d_k x (d_k + d_v)) forward, of dS_in (h_v x d_k x d_v) backward;
    all-gather sends this rank's block to the P-1 others."""
    h, dk, dv = SHAPE["linear_num_value_heads"], SHAPE["linear_key_head_dim"], SHAPE["linear_value_head_dim"]
    return (world - 1) * h * dk * ((dk + dv) + dv) * FP32


def attention_formula(seq_len: int, world: int) -> float:
    """Ulysses, one attention layer: q, k, v, out forward and their gradients backward, (P-1)/P of each leaves;
    kv heads fewer than P are first repeated by ``P / gcd(kv, P)`` (GQA)."""
    d, kv = SHAPE["head_dim"], SHAPE["num_key_value_heads"]
    kv_sent = kv * (world // math.gcd(kv, world))
    return 2 * (world - 1) / world * (seq_len // world) * d * (2 * SHAPE["num_attention_heads"] + 2 * kv_sent) * FP32  # fmt: skip


def packed_positions(seq_len: int) -> Any:
    """``(1, N)`` position ids of documents of N/16 .. N/4 tokens (seeded), restarting at 0 per document."""
    import torch

    g = torch.Generator().manual_seed(3)
    pos, start = torch.zeros(1, seq_len, dtype=torch.long), 0
    while start < seq_len:
        n = min(seq_len - start, int(torch.randint(seq_len // 16, seq_len // 4 + 1, (), generator=g)))
        pos[0, start : start + n] = torch.arange(n)
        start += n
    return pos


def _model(seq_len: int) -> Any:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE, max_position_embeddings=seq_len)).float()


def _time_mixer(mixer: Any, local: int, repeats: int, barrier: Any) -> float:
    import torch

    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, local, SHAPE["hidden_size"], generator=g).requires_grad_()
    dy = torch.randn(1, local, SHAPE["hidden_size"], generator=g)
    times = []
    for step in range(repeats + 1):
        barrier()
        t0 = time.perf_counter()
        mixer(x).backward(dy)
        if step:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_longctx import enable_sequence_parallel, shard_batch
    from lightning_longctx.parallel.comm import count_all_to_all

    world = args.world
    model = _model(args.seq_len)
    mixer = model.model.layers[0].linear_attn
    if world == 1:  # the plain Hugging Face layer: the reference time
        return {"mixer_s": _time_mixer(mixer, args.seq_len, args.repeats, lambda: None)}
    dist.init_process_group("gloo")
    enable_sequence_parallel(model, group=dist.group.WORLD)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    batch = shard_batch({"input_ids": ids, "labels": ids.clone()}, group=dist.group.WORLD)
    with count_all_to_all() as count:
        model(**batch).loss.backward()
    row = {"exchange_bytes": count.exchange_bytes, "attention_bytes": count.bytes_sent}
    row["mixer_s"] = _time_mixer(mixer, args.seq_len // world, args.repeats, dist.barrier)
    packed = {"input_ids": ids, "labels": ids.clone(), "position_ids": packed_positions(args.seq_len)}
    with count_all_to_all() as count:  # records the packed batch's documents: the mixer below reads them
        model(**shard_batch(packed, group=dist.group.WORLD)).loss.backward()
    row["packed_exchange_bytes"] = count.exchange_bytes
    row["packed_mixer_s"] = _time_mixer(mixer, args.seq_len // world, args.repeats, dist.barrier)
    dist.destroy_process_group()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "hybrid.json"))
    args = p.parse_args(argv)
    one = argparse.Namespace(**{**vars(args), "world": 1})
    ref = common.launch(_rank, 1, one, threads=1, timeout_s=args.timeout).check()[0]
    results = common.launch(_rank, args.world, args, threads=1, timeout_s=args.timeout).check()
    exchange = max(r["exchange_bytes"] for r in results)
    halo, scan = halo_formula(args.world), scan_formula(args.world)
    mixer_s = max(r["mixer_s"] for r in results)
    rows = [
        {"what": "hybrid state exchange (halo + scan)", "bytes_per_rank": exchange, "formula": halo + scan,
         "of which halo": halo, "of which scan": scan},
        {"what": "attention all-to-all (Ulysses)", "bytes_per_rank": max(r["attention_bytes"] for r in results),
         "formula": attention_formula(args.seq_len, args.world)},
    ]  # fmt: skip
    timing = {"one_process_s": ref["mixer_s"], "per_rank_s": mixer_s, "ratio": mixer_s / ref["mixer_s"]}
    packed_s = max(r["packed_mixer_s"] for r in results)
    packed = {"documents": int((packed_positions(args.seq_len) == 0).sum()), "per_rank_s": packed_s,
              "ratio_to_unpacked": packed_s / mixer_s, "formula": halo + scan,
              "exchange_bytes_per_rank": max(r["packed_exchange_bytes"] for r in results)}  # fmt: skip
    print(f"Qwen3.5-style layers, N = {args.seq_len}, P = {args.world}, fp32, one thread per rank")
    print(common.format_table(rows, [("what", "per layer, fwd + bwd", ""), ("bytes_per_rank", "bytes / rank", ","),
                                     ("formula", "formula", ",.0f")]))  # fmt: skip
    print(
        f"gated DeltaNet layer fwd+bwd: one process on {args.seq_len} tokens {ref['mixer_s']:.3f} s; "
        f"P = {args.world}, {args.seq_len // args.world} tokens per rank {mixer_s:.3f} s (max over ranks): "
        f"{timing['ratio']:.2f}x"
    )
    print(
        f"packed ({packed['documents']} documents): {packed_s:.3f} s per rank, {packed['ratio_to_unpacked']:.2f}x "
        f"the unpacked layer; state exchange {packed['exchange_bytes_per_rank']:,} bytes / rank (formula "
        f"{packed['formula']:,})"
    )
    data = {"shape": SHAPE, "rows": rows, "timing": timing, "packed": packed}
    common.save_results("hybrid", vars(args), data, args.out)
    exact = all(r["bytes_per_rank"] == r["formula"] for r in rows)
    return 0 if exact and packed["exchange_bytes_per_rank"] == packed["formula"] else 1


if __name__ == "__main__":
    sys.exit(main())
