"""Long-context training steps of a ~1B Llama on ONE GPU (P = 1): MFU by length, largest FPDT fit.

    python benchmarks/gpu/longctx.py mfu --seq-lens 32768 65536 131072 262144 --budget-s 150 --out OUT/mfu.json
    python benchmarks/gpu/longctx.py fit --start 65536 --budget-s 180 --out OUT/fit.json
    python benchmarks/gpu/longctx.py fit --cpu-offload --activation-offload --budget-s 120 --out OUT/fit_offload.json
    python benchmarks/gpu/longctx.py selftest --out OUT/selftest.json

Model: Llama shape, hidden 2048, 16 layers, 16 heads (head_dim 128), 8 kv heads, intermediate 5632,
vocab 32000 (~0.9B parameters), bf16 weights, fused AdamW; one sample of N tokens per step, random
tokens. The model is patched with ``enable_sequence_parallel(model, group=None, ...)`` (P = 1: the
all-to-alls are identities, the kernels and tiling are the ones used at any P):

* ``mfu`` (mode ``ulysses``): SDPA attention (PyTorch picks flash/cuDNN/efficient; ``--sdpa-backend``
  forces one) and the package's chunked lm_head + loss (``chunked_lm_head_cross_entropy``; a
  ``(N, 32000)`` logits tensor would dominate memory). Lengths in order; each first without activation
  checkpointing, and on OOM again with it (``as needed``); the first OOM with checkpointing stops the
  sweep. MFU = ``flops_per_token(config, N) * N / step_s / peak`` (causal attention counted half,
  recomputation never counted), peak = the data-sheet dense bf16 FLOP/s of ``lightning_longctx.planner.flops``
  (989e12 for an H200; a GPU not in that table: its measured bf16 matmul).
* ``fit`` (mode ``fpdt`` + ``offload``; ``--activation-offload``: checkpointing from the start with each
  layer's input in host memory): doubling search from ``--start``, one fresh process per length
  (``lightning_longctx.testing.launch``: an OOM of the GPU or of pinned host memory can't poison the next
  try), stopping at the first failure, or when the next length's predicted time (4x the last: attention is
  quadratic) exceeds what is left of ``--budget-s``. The peak GPU memory of the lengths that ran gives a linear
  estimate of the largest length that would fit (FPDT's memory is linear in N), labelled as an estimate.
  Each length also gets the memory planner's prediction (``plan_memory``: bf16 weights, AdamW, P = 1)
  and its error against ``max_memory_allocated`` (the planner counts DDP buckets, here the gradients:
  the same bytes).
  ``--start N --max-len N`` runs one length.
* ``fit --cpu-offload``: the same search with the model state in host memory, the way
  ``UlyssesFPDTStrategy(data_parallel="fsdp", cpu_offload=True)`` with ``bf16-mixed`` holds it: the package's
  ``FSDP2Sharding`` over a 1-rank process group (``cuda:nccl,cpu:gloo``, as the strategy's backend; gloo on a
  CPU) shards every decoder block and the root with FSDP2's ``CPUOffloadPolicy`` and a
  ``MixedPrecisionPolicy`` (bf16 compute, fp32 gradient reduction): fp32 master weights, their gradients and
  the AdamW state (torch's foreach kernel over the host DTensors) live on the host, the optimizer steps
  there; the forward runs under bf16 autocast as Lightning's ``bf16-mixed`` does. The planner is asked the
  same (``data_parallel="fsdp", cpu_offload=True, precision="bf16-mixed"``, fp32 weights). Per length, beside
  ``max_memory_allocated`` vs the planned peak (``device_reserve=0``: the reserve is not allocated memory):
  ``max_memory_reserved`` and the device memory in use at the end (the CUDA context too) vs the planned
  ``device_needed`` with the default reserve, and the process's peak RSS vs the planned ``host_needed``.

* ``selftest``: the strategy's self-test (``lightning_longctx.parallel.self_test.run_self_test``) of a tiny Llama (hidden
  512, 4 heads of 128, 2 kv heads, 2 layers, vocab 1024) on this device at P = 1, Ulysses and FPDT + offload,
  each in ``32-true`` (float32 weights: one float32 check) and ``bf16-mixed`` (float32 weights under bf16
  autocast, as DDP runs it: a float32 check with autocast off, then a bf16 one): the relative errors of the
  logits, the input-embedding gradient and the loss per check against the tolerance, and the seconds. Exit
  status 1 when one fails.

``mfu`` and ``fit`` run the same self-test first, on their first length's batch, with the run's own settings
(bf16 weights: ``bf16-true``, one bf16 check; ``--cpu-offload``: FSDP2 over fp32 master weights with bf16
compute, ``bf16-mixed``, one bf16 check), and record it as ``self_test`` in their JSON: so a GPU's first run
of the check shows whether our CUDA paths are exact on it. A failed self-test is recorded, the measurements go
on, and the command exits with status 3.

All write their JSON after each length, so a run killed by ``timeout`` keeps what it measured.
``--device cpu --tiny`` runs the same logic at toy sizes on a CPU (a dry run of the script).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from lightning_longctx.testing import environment, free_port, launch, linear_fit, meminfo_bytes, write_json
from lightning_longctx.testing.results import GIB

SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "vocab_size")  # fmt: skip
MODEL_1B = dict(zip(SHAPE, (2048, 5632, 16, 16, 8, 32000)))
MODEL_TINY = dict(zip(SHAPE, (64, 128, 2, 4, 2, 512)))
#: the ``selftest`` model: tiny, with the head dim of the 1B (the kernels are chosen by it)
MODEL_SELFTEST = dict(zip(SHAPE, (512, 1024, 2, 4, 2, 1024)))
#: ``selftest``: (mode, precision) of each run
SELFTEST_RUNS = (
    ("ulysses", "32-true"),
    ("ulysses", "bf16-mixed"),
    ("fpdt", "32-true"),
    ("fpdt", "bf16-mixed"),
)
#: exit status of ``mfu`` / ``fit`` when their self-test did not pass (their measurements still ran)
SELF_TEST_FAILED = 3
SDPA_BACKENDS = dict(
    flash="FLASH_ATTENTION", cudnn="CUDNN_ATTENTION", efficient="EFFICIENT_ATTENTION", math="MATH"
)


def peak_flops(device: torch.device) -> tuple[float, str]:
    """Dense bf16 peak of the GPU from the package's table (else its measured bf16 matmul); CPU: fp32."""
    from lightning_longctx.planner.flops import get_peak_flops, measure_peak_flops

    if device.type != "cuda":
        return measure_peak_flops(device, "fp32"), "measured: cpu fp32 matmul (dry run)"
    name = torch.cuda.get_device_name(device)
    peak = get_peak_flops(name, "bf16")
    if peak is None:
        return measure_peak_flops(device, "bf16"), f"measured: bf16 matmul ({name} not in the table)"
    return peak, f"table: {name} bf16 dense"


def build_model(args: argparse.Namespace, device: torch.device, max_len: int) -> torch.nn.Module:
    """bf16 weights on ``device``; ``--cpu-offload``: fp32 weights built on the host and sharded there by FSDP2
    (a 1-rank group must exist: :func:`single_rank_group`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_longctx import enable_sequence_parallel

    shape = MODEL_TINY if args.tiny else MODEL_1B
    config = AutoConfig.for_model("llama", **shape, max_position_embeddings=max_len, tie_word_embeddings=False,
                                  attention_dropout=0.0, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    # under cpu_offload the model is never whole on the device (the strategy's tensor_init_context)
    with torch.device("cpu" if args.cpu_offload else device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32 if args.cpu_offload else torch.bfloat16
        )
    model.train()
    chunk = min(args.chunk_size, max_len) if args.mode == "fpdt" else None
    backend = "sdpa" if args.mode == "ulysses" else "auto"
    enable_sequence_parallel(
        model, group=None, mode=args.mode, chunk_size=chunk, offload=args.offload, backend=backend
    )
    if args.cpu_offload:  # parallelize's last step for data_parallel="fsdp", cpu_offload=True, bf16-mixed
        from lightning_longctx.parallel.fsdp import FSDP2Sharding
        from lightning_longctx.parallel.mesh import ParallelDims, build_world_mesh

        mesh = build_world_mesh(ParallelDims(world_size=1, sp=1), device.type)
        FSDP2Sharding(mesh, cpu_offload=True).shard(model, param_dtype=torch.bfloat16)
    return model


@contextlib.contextmanager
def single_rank_group(device: torch.device) -> Iterator[None]:
    """A 1-rank default process group for FSDP2 (``--cpu-offload``): NCCL for the device's tensors and gloo for
    the host's, the backend the strategy picks under ``cpu_offload``; gloo alone on a CPU. Destroyed on exit."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
    dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_ids(n: int, vocab: int, device: torch.device, rows: int = 1) -> torch.Tensor:
    """``(rows, n)`` random token ids, seeded by ``n``."""
    return torch.randint(1, vocab, (rows, n), generator=torch.Generator().manual_seed(n)).to(device)


def make_batch(n: int, vocab: int, device: torch.device, chunk: int | None) -> dict[str, torch.Tensor]:
    from lightning_longctx import shard_batch

    ids = make_ids(n, vocab, device)
    return shard_batch({"input_ids": ids, "labels": ids}, group=None, chunk_size=chunk)


def run_self_test(
    model: torch.nn.Module, ids: torch.Tensor, device: torch.device, precision: str, fp32_layout: bool
) -> dict[str, Any]:
    """The strategy's self-test of the patched ``model`` on ``ids`` ``(b, N)`` (the first batch, whole), as
    ``UlyssesFPDTStrategy`` runs it under ``precision`` (a ``*-mixed`` one under its bf16 / fp16 autocast;
    ``fp32_layout``: float32 parameters under it, so float32 is compared first). Its report as a dict: the probe,
    each check's relative errors and tolerance, where a failed one diverges first, the seconds; an exception
    other than a refusal is recorded too (``error``)."""
    from lightning_longctx.integrations.transformers import context_of
    from lightning_longctx.parallel.self_test import SelfTestFailed
    from lightning_longctx.parallel.self_test import run_self_test as self_test

    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)

    def autocast() -> Any:
        return contextlib.nullcontext() if low is None else torch.autocast(device.type, dtype=low)

    ctx = context_of(model)
    start = time.perf_counter()
    out: dict[str, Any] = {
        "precision": precision,
        "mode": ctx.config.mode.value,
        "offload": ctx.config.offload,
    }
    try:
        (report,) = self_test(
            [model],
            [ctx],
            {"input_ids": ids},
            config=ctx.config,
            group=None,
            precision=precision,
            autocast=autocast,
            device=device,
            fp32_layout=fp32_layout,
        )
    except SelfTestFailed as e:
        report = e.report
        out["error"] = str(e)
    except Exception as e:  # a crash of the self-test itself: recorded, the check goes on
        seconds = round(time.perf_counter() - start, 3)
        out.update(passed=False, seconds=seconds, error=f"{type(e).__name__}: {str(e)[:1000]}")
        return out
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the probe's blocks: not the measured step's
    out.update(
        passed=report.passed,
        seconds=round(report.seconds, 3),
        probe={"rows": report.rows, "length": report.probe.length, "chunk": report.probe.chunk},
        checks=[
            {
                "dtype": str(c.dtype).removeprefix("torch."),
                "errors": c.errors,
                "tolerance": c.tolerance,
                "passed": c.passed,
                "divergence": c.divergence,
            }
            for c in report.checks
        ],
        summary=report.summary(),
    )
    return out


def self_test_line(result: dict[str, Any]) -> str:
    """One line: passed or FAILED, the seconds and the errors (or the error)."""
    verdict = "passed" if result.get("passed") else "FAILED"
    what = result.get("summary") or result.get("error", "")
    if not result.get("passed") and result.get("error"):
        what = result["error"][:600]
    return (
        f"self-test {verdict} in {result.get('seconds')} s ({result['mode']}, {result['precision']}): {what}"
    )


def _run_precision(args: argparse.Namespace) -> tuple[str, bool]:
    """The strategy's precision of a ``mfu`` / ``fit`` run and whether its parameters stay float32 under it:
    bf16 weights (``bf16-true``), or with ``--cpu-offload`` FSDP2's bf16 compute over fp32 master weights
    (``bf16-mixed``, no float32 layout: FSDP2 computes in its param_dtype)."""
    return ("bf16-mixed" if args.cpu_offload else "bf16-true"), False


class Stepper:
    """One optimizer step (forward, backward, AdamW) of the patched model, timed with a sync.

    AdamW: fused on the GPU's bf16 weights; ``--cpu-offload``: foreach over the host's fp32 DTensor shards (the
    fused kernel needs the device; the default per-parameter loop is one DTensor dispatch per parameter and
    op), the forward under bf16 autocast (Lightning's ``bf16-mixed``, which the strategy leaves on)."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> None:
        self.model, self.args, self.device = model, args, device
        kernel = {"foreach": True} if args.cpu_offload else {"fused": device.type == "cuda"}
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **kernel)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.cpu_offload)
        self.host_bytes_after_forward = 0
        #: the self-test's result once it ran (before the first step, when ``args.self_test``)
        self.self_test: dict[str, Any] | None = None
        self.self_test_pending = bool(getattr(args, "self_test", False))

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from lightning_longctx import chunked_lm_head_cross_entropy

        if self.args.mode == "fpdt":  # the patched forward: tiled MLP, chunked lm_head + loss
            return self.model(**batch).loss
        hidden = self.model.model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"]
        ).last_hidden_state
        labels, weight = batch["shift_labels"], self.model.lm_head.weight
        return chunked_lm_head_cross_entropy(hidden, weight, labels, chunk_size=self.args.loss_chunk)

    def __call__(self, batch: dict[str, torch.Tensor], *, simulate_oom: bool = False) -> float:
        from lightning_longctx.attention.offload import offloaded_bytes

        self._sync()
        t0 = time.perf_counter()
        if simulate_oom:
            raise torch.OutOfMemoryError("simulated OOM (--simulate-oom-above, dry run)")
        with self.autocast:
            loss = self._loss(batch)
        self.host_bytes_after_forward = max(self.host_bytes_after_forward, offloaded_bytes())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def recover(self) -> None:
        """After an OOM: drop gradients and cached blocks so the next try starts clean."""
        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def sdpa_context(name: str) -> Any:
    """Force one SDPA backend (``SDPA_BACKENDS``); ``"auto"`` lets PyTorch pick."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[name])])


def sdpa_kernel_names(device: torch.device, head_dim: int, backend: str) -> list[str]:
    """Names of the GPU kernels one causal bf16 SDPA forward launches (which backend PyTorch picked)."""
    if device.type != "cuda":
        return []
    try:
        from torch.profiler import ProfilerActivity, profile

        q = torch.randn(1, 16, 4096, head_dim, device=device, dtype=torch.bfloat16)
        with sdpa_context(backend), profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            torch.cuda.synchronize(device)
        keys = [e.key for e in prof.key_averages()]
        hits = [
            k for k in keys if any(w in k.lower() for w in ("flash", "fmha", "cudnn", "attention", "sdpa"))
        ]
        return sorted(set(hits or keys))[:8]
    except Exception as e:  # the profiler is informative only
        return [f"profiler failed: {type(e).__name__}: {e}"[:200]]


def measure_length(
    stepper: Stepper, n: int, args: argparse.Namespace, ckpt: bool
) -> tuple[dict[str, Any], bool]:
    """Steps at length ``n``: the first step, then ``--steps`` more when the first took < ``--quick-s``.

    Checkpointing ``ckpt`` first; on OOM without it, again with it. Returns (row, checkpointing now)."""
    model, device = stepper.model, stepper.device
    chunk = min(args.chunk_size, n) if args.mode == "fpdt" else None
    row: dict[str, Any] = {"seq_len": n}
    for use_ckpt in [ckpt] if ckpt else [False, True]:
        if use_ckpt:
            from lightning_longctx.integrations.transformers import enable_activation_checkpointing

            enable_activation_checkpointing(model, offload=getattr(args, "activation_offload", False))
        else:
            model.gradient_checkpointing_disable()
        if stepper.self_test_pending:  # the run's first batch, with the run's settings, before its first step
            stepper.self_test_pending = False
            precision, fp32_layout = _run_precision(args)
            ids = make_ids(n, model.config.vocab_size, device)
            with sdpa_context(args.sdpa_backend):
                stepper.self_test = run_self_test(model, ids, device, precision, fp32_layout)
            print(f"  N={n}: {self_test_line(stepper.self_test)}", flush=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        fake = args.simulate_oom_above is not None and n > args.simulate_oom_above * (2 if use_ckpt else 1)
        error = None
        try:
            batch = make_batch(n, model.config.vocab_size, device, chunk)
            with sdpa_context(args.sdpa_backend):
                times = [stepper(batch, simulate_oom=fake)]
                if times[0] < args.quick_s:
                    times += [stepper(batch) for _ in range(args.steps)]
        except Exception as e:  # OOM is an outcome to record; anything else too
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if error is not None:  # out of the except block: the traceback no longer holds the step's tensors
            stepper.recover()
            row.setdefault("attempts", []).append({"activation_checkpointing": use_ckpt, "error": error})
            if "OutOfMemoryError" in error or "out of memory" in error.lower():
                continue
            return {**row, "status": "error"}, use_ckpt
        measured = times[1:] if len(times) > 1 else times
        row.update(
            status="ok",
            activation_checkpointing=use_ckpt,
            step_s=[round(t, 4) for t in times],
            first_step_only=len(times) == 1,
            measured_step_s=round(sorted(measured)[len(measured) // 2], 4),
        )
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            row["max_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
            row["max_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GIB, 2)
            # what nvidia-smi shows after the steps: the CUDA context and libraries' workspaces + the reserve
            row["device_in_use_gib"] = round((total - free) / GIB, 2)
        return row, use_ckpt
    return {**row, "status": "oom"}, True


def add_rates(row: dict[str, Any], config: Any, peak: float) -> None:
    from lightning_longctx.planner.flops import flops_per_token

    n = row["seq_len"]
    fpt = row["flops_per_token"] = flops_per_token(config, n)
    if row.get("status") == "ok":
        row["tokens_per_sec"] = round(n / row["measured_step_s"], 1)
        row["tflops"] = round(fpt * n / row["measured_step_s"] / 1e12, 2)
        row["mfu"] = round(fpt * n / row["measured_step_s"] / peak, 4)


def _summary(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('attempts', row.get('reason', row.get('error', '')))}"
    mem = f", max allocated {row['max_allocated_gib']} GiB" if "max_allocated_gib" in row else ""
    return (
        f"step {row['measured_step_s']:.3f}s (steps {row['step_s']}), {row['tokens_per_sec']:.0f} tokens/s, "
        f"{row['tflops']} TFLOP/s, MFU {100 * row['mfu']:.1f}%, ckpt={row['activation_checkpointing']}{mem}"
    )


def _out_of_time(payload: dict[str, Any], n: int, step_s: float, extra_s: float, left: float,
                 args: argparse.Namespace, status: str) -> bool:  # fmt: skip
    """True (and a row saying so) when length ``n``, whose first step may take ``step_s``, won't fit in
    ``left`` seconds: ``extra_s`` to start + the first step + ``--steps`` more if that one is quick."""
    predicted = extra_s + step_s * (1 if step_s >= args.quick_s else 1 + args.steps)
    if predicted <= left:
        return False
    reason = f"predicted {predicted:.0f}s > {left:.0f}s left"
    payload["results"].append({"seq_len": n, "status": status, "reason": reason})
    print(f"  N={n}: {status} ({reason})", flush=True)
    return True


def cmd_mfu(args: argparse.Namespace) -> int:
    """Ulysses (SDPA) by length, all in this process."""
    t_start = time.perf_counter()
    device = torch.device(args.device)
    peak, peak_source = peak_flops(device)
    model = build_model(args, device, max(args.seq_lens))
    stepper = Stepper(model, args, device)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    payload: dict[str, Any] = {
        "benchmark": "gpu_mfu",
        "mode": args.mode,
        "sdpa_backend": args.sdpa_backend,
        "sdpa_kernels": sdpa_kernel_names(device, head_dim, args.sdpa_backend),
        "model": {k: getattr(model.config, k) for k in SHAPE},
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "bfloat16 weights, fused AdamW",
        "loss": f"chunked_lm_head_cross_entropy, chunk {args.loss_chunk}",
        "peak_flops": peak,
        "peak_source": peak_source,
        "environment": environment(),
        "budget_s": args.budget_s,
        "results": [],
    }
    params, kernels = payload["parameters"], payload["sdpa_kernels"]
    print(f"mfu: {params / 1e9:.2f}B parameters, SDPA kernels {kernels}", flush=True)
    ckpt, last = False, None  # (seq_len, step seconds) of the last length that ran
    for n in args.seq_lens:
        left = args.budget_s - (time.perf_counter() - t_start)
        if last is not None:  # attention is quadratic: (n / last n)^2 x the last step is an upper bound
            if _out_of_time(payload, n, last[1] * (n / last[0]) ** 2, 0.0, left, args, "skipped"):
                break
        row, ckpt = measure_length(stepper, n, args, ckpt)
        add_rates(row, model.config, peak)
        if stepper.self_test is not None and "self_test" not in payload:
            payload["self_test"] = {"seq_len": n, **stepper.self_test}
        payload["results"].append(row)
        payload["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_json(args.out, payload)
        print(f"  N={n}: {_summary(row)}", flush=True)
        if row["status"] != "ok":
            break
        last = (n, row["measured_step_s"])
    payload["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write_json(args.out, payload)
    return _self_test_status(payload)


def _self_test_status(payload: dict[str, Any]) -> int:
    """``SELF_TEST_FAILED`` when the run's self-test ran and did not pass (said on one line), else 0."""
    result = payload.get("self_test")
    if result is None or result.get("passed"):
        return 0
    print(f"SELF-TEST FAILED on this device: {self_test_line(result)}", flush=True)
    return SELF_TEST_FAILED


def run_length(args: argparse.Namespace) -> dict[str, Any]:
    """One length of ``fit`` (FPDT + offload), in a process launched for it; the row."""
    from lightning_longctx.lightning.callbacks.memory import host_rss_bytes

    device = torch.device(args.device)
    if args.tf32:
        torch.set_float32_matmul_precision("high")  # FPDT's fp32 block matmuls; exact for bf16 q, k
    peak, peak_source = peak_flops(device)
    rss_start = host_rss_bytes()  # the process before the model: torch, transformers, the CUDA context
    t0 = time.perf_counter()
    with single_rank_group(device) if args.cpu_offload else contextlib.nullcontext():
        model = build_model(args, device, args.seq_len)
        stepper = Stepper(model, args, device)
        row, _ = measure_length(stepper, args.seq_len, args, args.checkpointing)
    add_rates(row, model.config, peak)
    row.update(
        mode=args.mode,
        offload=args.offload,
        activation_offload=args.activation_offload,
        cpu_offload=args.cpu_offload,
        chunk_size=args.chunk_size,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        host_offloaded_gib=round(stepper.host_bytes_after_forward / GIB, 2),
        rss_before_model_gib=round(rss_start / GIB, 2),
        max_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),  # KiB on Linux
        peak_flops=peak,
        peak_source=peak_source,
        wall_s=round(time.perf_counter() - t0, 1),
    )
    if stepper.self_test is not None:
        row["self_test"] = stepper.self_test
    if device.type == "cuda":
        row["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / GIB, 1)
    if row.get("status") == "ok":
        add_plan(row, model.config, args)
    return row


def _error_pct(planned: float, measured: float | None) -> float | None:
    return round(100 * (planned / measured - 1), 1) if measured else None


def add_plan(row: dict[str, Any], config: Any, args: argparse.Namespace) -> None:
    """The memory planner's bytes for this length and settings, and its errors vs the measured ones.

    ``planned_gib`` (``device_reserve=0``) vs ``max_memory_allocated``; ``planned_device_needed_gib`` (the
    default reserve: CUDA context + allocator slack) vs ``max_memory_reserved`` and the device memory in use;
    ``planned_host_needed_gib`` (the rank's host peak + the process's reserve) vs the peak RSS. ``fits`` /
    ``binding`` against this GPU's memory and this host's ``MemTotal``."""
    from lightning_longctx import plan_memory

    # --cpu-offload: the strategy's data_parallel="fsdp", cpu_offload=True, bf16-mixed over fp32 weights
    if args.cpu_offload:
        setup = dict(data_parallel="fsdp", cpu_offload=True, precision="bf16-mixed", param_dtype="float32")
    else:  # bf16 weights, replicated (P = 1, one rank)
        setup = dict(precision="bf16-true")
    kw = dict(seq_len=row["seq_len"], sequence_parallel_size=1, mode="fpdt", fpdt_chunk_size=args.chunk_size,
              offload=True, activation_checkpointing=row["activation_checkpointing"],
              activation_offload=args.activation_offload, optimizer="adamw", **setup)  # fmt: skip
    allocated = plan_memory(config, **kw, device_reserve=0)  # the reserve is not allocated memory
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    needed = plan_memory(config, **kw, device_memory=gpu, host_memory=meminfo_bytes("MemTotal") or None)
    planned, device_needed = allocated.device_needed / GIB, needed.device_needed / GIB
    row.update(
        planned_gib=round(planned, 2),
        planned_host_gib=round(allocated.host_total / GIB, 2),
        planned_peak_phase=allocated.peak_phase,
        planned_device_needed_gib=round(device_needed, 2),
        planned_device_reserve_gib=round(needed.device_reserve / GIB, 2),
        planned_host_needed_gib=round(needed.host_needed / GIB, 2),
        planned_fits=needed.fits,
        planned_binding=needed.binding,
        planner_error_pct=_error_pct(planned, row.get("max_allocated_gib")),
        device_needed_vs_reserved_pct=_error_pct(device_needed, row.get("max_reserved_gib")),
        device_needed_vs_in_use_pct=_error_pct(device_needed, row.get("device_in_use_gib")),
        host_needed_vs_rss_pct=_error_pct(needed.host_needed / GIB, row.get("max_rss_gib")),
    )


def estimate_limit(rows: list[dict[str, Any]], key: str, capacity: float | None) -> dict[str, Any] | None:
    """Largest N with ``a + b*N <= 0.95*capacity``, from the last two lengths that ran (linear in N)."""
    pts = [(r["seq_len"], r[key]) for r in rows if r.get("status") == "ok" and r.get(key) is not None]
    if len(pts) < 2 or not capacity:
        return None
    a, slope = linear_fit(*zip(*pts[-2:]))
    if slope <= 0:
        return None
    n_max = int((0.95 * capacity - a) / slope)
    return {
        "from": key,
        "capacity_gib": round(capacity, 1),
        "gib_per_1k_tokens": round(slope * 1024, 4),
        "max_seq_len": n_max,
    }


def cmd_fit(args: argparse.Namespace) -> int:
    """Largest FPDT + offload length: doubling, one fresh process per length."""
    t_start = time.perf_counter()
    payload: dict[str, Any] = {
        "benchmark": "gpu_fpdt_state_offload_fit" if args.cpu_offload else "gpu_fpdt_offload_fit",
        "mode": "fpdt",
        "offload": True,
        "activation_offload": args.activation_offload,
        "cpu_offload": args.cpu_offload,
        "dtype": (
            "fp32 master weights, gradients and foreach AdamW on the host (FSDP2 CPUOffloadPolicy), bf16 compute "
            "(MixedPrecisionPolicy, bf16 autocast)"
            if args.cpu_offload
            else "bfloat16 weights, fused AdamW"
        ),
        "chunk_size": args.chunk_size,
        "tf32": args.tf32,
        "budget_s": args.budget_s,
        "environment": environment(),
        "results": [],
    }
    n, ckpt, last = args.start, args.checkpointing or args.activation_offload, None
    while n <= args.max_len:
        left = args.budget_s - (time.perf_counter() - t_start)
        # last = (first step s, start-up s) of the last length; attention is quadratic: 4x is an upper bound
        if last is not None and _out_of_time(payload, n, last[0] * 4, last[1], left, args, "not tried"):
            break
        first = not payload["results"]  # the first length's process runs the self-test
        length = argparse.Namespace(**{**vars(args), "mode": "fpdt", "offload": True, "seq_len": n,
                                       "checkpointing": ckpt, "self_test": args.self_test and first})  # fmt: skip
        run = launch(run_length, 1, length, threads=None, timeout_s=max(left, 1))
        if run.error is None:
            row = run.results[0]
        elif run.timed_out:
            row = {"seq_len": n, "status": "timeout", "reason": f"no result within the {left:.0f}s left"}
        else:  # the process died: a crash, or the kernel's OOM killer
            row = {"seq_len": n, "status": "crash", "error": run.error, "log_tail": run.log[-1500:]}
        row["process_s"] = round(run.wall_s, 1)
        if "self_test" in row:
            payload["self_test"] = {"seq_len": n, **row["self_test"]}
            print(f"  N={n}: {self_test_line(row['self_test'])}", flush=True)
        print(f"  N={n}: {_summary(row)}, host offload {row.get('host_offloaded_gib')} GiB", flush=True)
        payload["results"].append(row)
        payload["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_json(args.out, payload)
        if row.get("status") != "ok":
            break
        ckpt = bool(row.get("activation_checkpointing"))
        last = (row["step_s"][0], max(row["process_s"] - sum(row["step_s"]), 0.0))
        n *= 2
    ok = [r for r in payload["results"] if r.get("status") == "ok"]
    payload["largest_fit"] = max((r["seq_len"] for r in ok), default=None)
    stop = payload["results"][-1] if payload["results"] else {}
    payload["stopped_by"] = stop.get("status") if stop.get("status") != "ok" else "max_len"
    payload["estimated_limits"] = {
        "gpu": estimate_limit(ok, "max_reserved_gib", ok[-1].get("gpu_memory_gib") if ok else None),
        "host_offload": estimate_limit(
            ok, "host_offloaded_gib", meminfo_bytes("MemTotal") / GIB * 0.8 or None
        ),
        # the whole process (model state under --cpu-offload, pinned buffers, FPDT and activation offload)
        "host_rss": estimate_limit(ok, "max_rss_gib", meminfo_bytes("MemTotal") / GIB or None),
    }
    payload["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write_json(args.out, payload)
    print(f"fit: largest N that ran = {payload['largest_fit']}, stopped by {payload['stopped_by']}, "
          f"estimates {payload['estimated_limits']}", flush=True)  # fmt: skip
    return _self_test_status(payload)


def cmd_selftest(args: argparse.Namespace) -> int:
    """The self-test of a tiny Llama at P = 1 in each of :data:`SELFTEST_RUNS`, one process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_longctx import disable_sequence_parallel, enable_sequence_parallel

    t_start = time.perf_counter()
    device = torch.device(args.device)
    config = AutoConfig.for_model("llama", **MODEL_SELFTEST, max_position_embeddings=4096,
                                  tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)  # fmt: skip
    payload: dict[str, Any] = {
        "benchmark": "gpu_self_test",
        "model": MODEL_SELFTEST,
        "chunk_size": args.chunk_size,
        "environment": environment(),
        "results": [],
    }
    ids = make_ids(args.seq_len, config.vocab_size, device, rows=2)
    for mode, precision in SELFTEST_RUNS:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.train()
        fpdt = mode == "fpdt"
        chunk = args.chunk_size if fpdt else None
        enable_sequence_parallel(model, group=None, mode=mode, chunk_size=chunk, offload=fpdt)
        # float32 parameters: under bf16-mixed (DDP) the float32 check runs first
        result = run_self_test(model, ids, device, precision, fp32_layout=True)
        disable_sequence_parallel(model)
        del model
        payload["results"].append(result)
        payload["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_json(args.out, payload)
        print(f"  {self_test_line(result)}", flush=True)
    payload["passed"] = all(r.get("passed") for r in payload["results"])
    payload["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write_json(args.out, payload)
    print(
        f"selftest: {'all passed' if payload['passed'] else 'FAILED'} in {payload['elapsed_s']} s", flush=True
    )
    return 0 if payload["passed"] else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="cuda")
    common.add_argument("--tiny", action="store_true", help="toy model (dry run on CPU)")
    common.add_argument(
        "--chunk-size", type=int, default=4096, help="FPDT tokens per chunk (P = 1: per segment)"
    )
    common.add_argument("--loss-chunk", type=int, default=4096, help="tokens per lm_head + loss chunk (mfu)")
    common.add_argument("--steps", type=int, default=2, help="steps after the first one, when that was quick")
    common.add_argument(
        "--quick-s", type=float, default=15.0, help="first step shorter than this: run --steps more"
    )
    common.add_argument("--sdpa-backend", choices=("auto", *SDPA_BACKENDS), default="auto")
    common.add_argument("--simulate-oom-above", type=int, help=argparse.SUPPRESS)  # dry run of the OOM path
    common.add_argument("--out", required=True)

    m = sub.add_parser("mfu", parents=[common], help="Ulysses (SDPA) MFU by length, one process")
    m.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    m.add_argument("--budget-s", type=float, default=150)

    f = sub.add_parser("fit", parents=[common], help="largest FPDT+offload length, one process per length")
    f.add_argument("--start", type=int, default=65536)
    f.add_argument("--max-len", type=int, default=1 << 22)
    f.add_argument("--budget-s", type=float, default=180)
    f.add_argument("--checkpointing", action="store_true", help="start with activation checkpointing on")
    f.add_argument("--activation-offload", action="store_true",
                   help="checkpointing from the start, each layer's checkpointed input in host memory")  # fmt: skip
    f.add_argument("--no-tf32", dest="tf32", action="store_false", help="FPDT block matmuls in full fp32")
    f.add_argument("--cpu-offload", action="store_true",
                   help="model state on the host: FSDP2 CPUOffloadPolicy, fp32 master weights, bf16 compute")  # fmt: skip
    for sub_parser in (m, f):
        sub_parser.add_argument(
            "--no-self-test",
            dest="self_test",
            action="store_false",
            help="skip the self-test before the first length's first step",
        )

    t = sub.add_parser(
        "selftest", help="the self-test of a tiny Llama, Ulysses and FPDT + offload, fp32 and bf16"
    )
    t.add_argument("--device", default="cuda")
    t.add_argument(
        "--seq-len", type=int, default=64, help="tokens per row of the batch the probe is cut from"
    )
    t.add_argument(
        "--chunk-size", type=int, default=64, help="FPDT tokens per chunk (the probe's: at most 8)"
    )
    t.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "mfu":
        args.mode, args.offload, args.activation_offload, args.cpu_offload = "ulysses", False, False, False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return {"mfu": cmd_mfu, "fit": cmd_fit, "selftest": cmd_selftest}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
