"""Measure this machine as a "device" for the step-time model (``planner.estimate_step_time``).

The planner reads rates and never measures them: a CPU's are measured here, in ~10 s, and written as the JSON
of a ``DeviceSpec`` that ``lightning_longctx.planner.devices.load_spec`` reads back (``lightning-longctx plan
--gpu cpu --device-spec FILE``). Measured: fp32 matmul FLOP/s (a linear layer's forward, input-gradient and
weight-gradient GEMMs), the fused CPU attention kernel's forward / backward FLOP/s, causal and full, at 256
to 8192 tokens, a copy's memory bandwidth, the host time per operator of an eager Hugging Face step, and
gloo's all-to-all bandwidth between two fresh local ranks (``common.launch``). Rates are per ``--threads``
threads (one rank); ``cores`` = ``os.cpu_count()``.

    python benchmarks/calibrate_step_time.py --out cpu.json              # ~10 s
    lightning-longctx plan --config examples/configs/demo_cpu.yaml --gpu cpu --device-spec cpu.json

``--max-tokens 2048`` stops the attention ramp at its reference length (a few seconds; beyond it the model
holds the 2048-token rate): the smallest calibration, ``tests/test_benchmarks_smoke.py``'s.

``bench_step_time.py`` calls :func:`calibrate_cpu` before comparing the model with measured steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import launch

from lightning_longctx.planner.devices import DeviceSpec, KernelRate
from lightning_longctx.planner.step_time import OPS_OPTIMIZER, OPS_PER_LAYER

#: the attention kernel's lengths (tokens) measured; the spec's reference rate is the one at 2048
ATTENTION_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
REFERENCE_TOKENS = 2048


def calibrate_cpu(
    *,
    path: str | Path | None = None,
    threads: int = 1,
    seconds: float = 1.0,
    max_tokens: int = ATTENTION_LENGTHS[-1],
) -> DeviceSpec:
    """This machine's rates as a :class:`DeviceSpec` (``gpu=calibrate_cpu()`` in ``estimate_step_time``),
    measured for about ``10 * seconds`` seconds with ``threads`` threads per rank, the attention at the lengths
    of :data:`ATTENTION_LENGTHS` up to ``max_tokens`` (at least 2048, the reference); ``path``: also written
    there as JSON (``devices.load_spec`` reads it back)."""
    import torch

    if max_tokens < REFERENCE_TOKENS:
        raise ValueError(
            f"max_tokens={max_tokens}: the attention's reference rate is measured at {REFERENCE_TOKENS} tokens; "
            f"give {REFERENCE_TOKENS} or more"
        )
    lengths = tuple(n for n in ATTENTION_LENGTHS if n <= max_tokens)
    torch.set_num_threads(threads)
    budget = max(0.02, seconds / 26)  # 26 timed pieces
    # the three GEMMs of a linear layer's training step: forward, input gradient, weight gradient (K = tokens)
    x, w, dy = torch.randn(4096, 256), torch.randn(256, 768), torch.randn(4096, 768)
    gemms = ((x, w), (dy, w.t()), (x.t(), dy))
    work = 2.0 * 4096 * 256 * 768
    matmul = 3 * work / sum(work / _rate(lambda a=a, b=b: a @ b, work, budget) for a, b in gemms)
    x = torch.empty(32 << 20)  # 128 MiB: past the caches
    y = torch.empty_like(x)
    bandwidth = _rate(lambda: y.copy_(x), 2.0 * x.numel() * 4, budget)
    latency = _eager_op_latency(budget)
    measured = tuple(
        (n, *_cpu_attention_rates(n, budget, True), *_cpu_attention_rates(n, budget, False)) for n in lengths
    )
    ref = measured[lengths.index(REFERENCE_TOKENS)]
    a2a = _gloo_all_to_all_bandwidth()
    cores = os.cpu_count() or 1
    spec = DeviceSpec(
        name=f"CPU ({cores} cores, {threads} thread(s) per rank, measured)",
        peak_flops=matmul, matmul_flops=matmul,
        attention={"cpu-flash": KernelRate(ref[1], ref[2], half_tokens=0, reference_tokens=REFERENCE_TOKENS, measured=measured)},
        default_kernel="cpu-flash", memory_bandwidth=bandwidth, intra_node_bandwidth=a2a,
        inter_node_bandwidth=a2a, host_link_bandwidth=bandwidth, host_memory_bandwidth=bandwidth,
        device_memory=_host_memory_bytes(), op_latency=latency, overlap=False, cores=cores,
        source=f"calibrate_cpu() at {time.strftime('%Y-%m-%d %H:%M:%S')}, load average {os.getloadavg()[0]:.2f}",
    )  # fmt: skip
    if path is not None:
        Path(path).write_text(json.dumps(spec.to_dict(), indent=2))
    return spec


def _rate(fn: Any, work: float, budget: float) -> float:
    """``work`` per call of ``fn`` over its seconds per call, timed for about ``budget`` seconds."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed > budget:
            return work * n / elapsed


def _eager_op_latency(budget: float) -> float:
    """Host seconds per operator on the real eager path: a forward + backward + AdamW step of a one-layer
    Hugging Face Llama on 8 tokens of width 32 (Python module calls, autograd bookkeeping and dispatch, no
    arithmetic to speak of), over its operators (``OPS_OPTIMIZER`` + a layer's three passes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=32, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    ids = torch.randint(0, 32, (1, 8))

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()

    return 1.0 / _rate(step, 1.0, budget) / (OPS_OPTIMIZER + 3 * OPS_PER_LAYER)


def _host_memory_bytes() -> int:
    """The machine's RAM (a CPU device's memory), from sysconf; 0 where unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _cpu_attention_rates(n: int, budget: float, causal: bool) -> tuple[float, float]:
    """Forward and backward FLOP/s (FlashAttention's convention: a causal call counts half) of the fused CPU
    attention op on ``(1, 4, n, 64)``."""
    import torch

    q, k, v = (torch.randn(1, 4, n, 64) for _ in range(3))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flops = 4.0 * 4 * 64 * n * n / (2 if causal else 1)

    def timed(fn: Any) -> float:
        fn()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < budget:
            fn()
            count += 1
        return (time.perf_counter() - start) / count

    out, lse = op(q, k, v, 0.0, causal)
    fwd = timed(lambda: op(q, k, v, 0.0, causal))
    dout = torch.randn_like(out)
    bwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    bwd = timed(lambda: bwd_op(dout, q, k, v, out, lse, 0.0, causal))
    return flops / fwd, 2.5 * flops / bwd


def _gloo_all_to_all_bandwidth() -> float:
    """Bytes per second one of two local gloo ranks sends in ``all_to_all_single`` (8 MiB per rank, half of it
    to the peer): NCCL's bus-bandwidth convention, the rate the step-time model divides the bytes a rank sends
    by. Two fresh processes (``common.launch``, one thread each); the median call (:func:`collective_seconds`)."""
    nbytes = 8 << 20
    ranks = launch(collective_seconds, 2, "all_to_all", nbytes, threads=1, timeout_s=300.0)
    if ranks.error:
        raise RuntimeError(f"calibrate_cpu: the gloo all-to-all ranks failed: {ranks.error}\n{ranks.log}")
    return nbytes / 2 / max(ranks.results)


def collective_seconds(kind: str, nbytes: int, calls: int = 10) -> float:
    """One rank (the group from the launcher's torchrun variables): the median seconds of ``kind``
    (``"all_to_all"`` or ``"all_reduce"``) over a buffer of ``nbytes``, each call timed alone between barriers,
    after 2 warm-up calls."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        x = torch.randn(nbytes // 4)
        y = torch.empty_like(x)
        call = (
            (lambda: dist.all_to_all_single(y, x)) if kind == "all_to_all" else (lambda: dist.all_reduce(x))
        )
        times = []
        for i in range(calls + 2):
            dist.barrier()
            start = time.perf_counter()
            call()  # the measured collective itself, not a layout of comm.py's
            if i >= 2:
                times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the DeviceSpec JSON to write (read by --device-spec)")
    p.add_argument("--threads", type=int, default=1, help="threads per rank (default: 1)")
    p.add_argument("--seconds", type=float, default=1.0, help="timing budget; the whole run takes ~10x this")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=ATTENTION_LENGTHS[-1],
        choices=[n for n in ATTENTION_LENGTHS if n >= REFERENCE_TOKENS],
        help=f"the longest attention measured (default {ATTENTION_LENGTHS[-1]}; {REFERENCE_TOKENS}: the quickest)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = calibrate_cpu(
        path=args.out, threads=args.threads, seconds=args.seconds, max_tokens=args.max_tokens
    )
    print(f"wrote {args.out}: {spec.name}; {spec.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
