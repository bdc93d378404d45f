"""Tokens/s, TFLOP/s and MFU per step that count a sequence-parallel sample once.

Token counting. Under sequence parallelism (SP) the ``sp`` ranks of an SP group hold slices of
the SAME sample: each rank's batch has ``input_ids`` of shape ``(b, N/sp)``. So

    tokens of one SP group  = local_numel × sp
    global tokens per step  = local_numel × sp × dp = local_numel × world_size / tp
    global sequence length  = local_seq_len × sp      (what the attention term sees)

Counting samples per rank and multiplying by the world size, as Lightning's ``ThroughputMonitor``
does, overcounts by ``sp``; counting tokens does not. Tensor-parallel peers (``strategy.tp_size``) hold the
same slice: the ranks that count are ``world_size / tp``. ``perf/tokens_per_sec`` is global,
``perf/tokens_per_sec_per_device`` = global / world_size. All positions of ``input_ids`` count,
padding included (the devices compute on them). The strategy is read by duck typing
(``strategy.sp_size``); any other strategy is taken as ``sp = 1``.

Timing is rank 0's wall clock between consecutive ``on_train_batch_end`` calls (data loading and
the optimizer included; the device is synchronised first). Ranks move in lockstep through the
gradient reduction, so the perf metrics need no collective of their own; the peak is broadcast
from rank 0 once, so every rank divides by the same number.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchmetrics.aggregation import SumMetric
from torchmetrics.wrappers import Running
from typing_extensions import override

from lightning_longctx.planner.flops import (
    find_hf_config,
    flops_per_token,
    get_peak_flops,
    measure_peak_flops,
    precision_to_dtype,
)

__all__ = ["MFUMonitor", "count_tokens", "local_running_sum", "throughput_metrics"]

FlopsPerToken = float | Callable[[int], float]


def count_tokens(batch: Any, *, world_size: int, sp_size: int = 1) -> tuple[int, int] | None:
    """``(global tokens this step, global sequence length)`` from one rank's (sharded) batch.

    ``batch``: a dict with ``input_ids`` ``(b, N/sp)``, a tensor, or a tuple whose first item is
    one. Returns None when no token tensor is found.
    """
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
    elif isinstance(batch, (list, tuple)) and batch:
        ids = batch[0]
    else:
        ids = batch
    if not isinstance(ids, torch.Tensor) or ids.dim() == 0:
        return None
    return ids.numel() * world_size, ids.shape[-1] * sp_size


def throughput_metrics(
    *, tokens: float, flops: float, seconds: float, world_size: int, peak_flops: float
) -> dict[str, float]:
    """The logged numbers from global ``tokens`` and model ``flops`` done in ``seconds`` by ``world_size`` devices."""
    tokens_per_sec = tokens / seconds
    flops_per_device = flops / world_size / seconds
    return {
        "perf/tokens_per_sec": tokens_per_sec,
        "perf/tokens_per_sec_per_device": tokens_per_sec / world_size,
        "perf/tflops_per_device": flops_per_device / 1e12,
        "perf/mfu": flops_per_device / peak_flops,
    }


def _never() -> bool:
    return False


def local_running_sum(window: int) -> Running:
    """A float64 ``torchmetrics`` running sum over the last ``window`` updates, never synced across ranks."""
    running = Running(SumMetric(distributed_available_fn=_never).set_dtype(torch.float64), window=window)
    # `Running` takes no Metric kwargs; left alone, its compute() would all-gather across ranks.
    running.distributed_available_fn = _never
    return running


def _linear_flops_per_token(module: nn.Module) -> float:
    """Fallback for models without a HF config: 6 × weights of every ``nn.Linear`` (no attention term)."""
    return 6.0 * sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


class MFUMonitor(L.Callback):
    """Logs ``perf/tokens_per_sec``, ``perf/tokens_per_sec_per_device``, ``perf/tflops_per_device``, ``perf/mfu``.

    Args:
        peak_flops: dense peak FLOP/s of ONE device. Default: looked up in
            :data:`lightning_longctx.planner.flops.PEAK_FLOPS` by GPU name and the trainer's precision;
            on a CPU (or an unlisted GPU, with a warning) a short measured matmul peak instead,
            so CPU MFU is relative to this machine's measured matmul speed, not a spec.
        window: steps in the running sums (tokens/s = Σ tokens / Σ seconds over the window).
        warmup_steps: training batches skipped before anything is measured (compilation, allocator).
        flops_per_token: override the model FLOPs per token: a number, or ``f(seq_len) -> float``.
            Default: :func:`lightning_longctx.planner.flops.flops_per_token` on the model's HF config.
        causal: count half the attention scores (masked blocks are skipped by the kernels).

    The aggregates are ``torchmetrics`` running sums kept per rank (no sync): see the module docstring.
    ``history`` holds one dict per logged step (read by :class:`MemoryMonitor` for its plot).
    """

    def __init__(
        self,
        peak_flops: float | None = None,
        window: int = 20,
        warmup_steps: int = 2,
        *,
        flops_per_token: FlopsPerToken | None = None,
        causal: bool = True,
    ) -> None:
        super().__init__()
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops must be positive, got {peak_flops}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self._peak_override = peak_flops
        self.window = window
        self.warmup_steps = warmup_steps
        self.causal = causal
        self._flops_override = flops_per_token
        self._flops_fn: Callable[[int], float] | None = None
        self.peak_flops: float | None = None
        self.peak_source: str = ""
        self.history: list[dict[str, float]] = []
        self._tokens = local_running_sum(window)
        self._flops = local_running_sum(window)
        self._seconds = local_running_sum(window)
        self._batches_seen = 0
        self._t_last: float | None = None
        self._warned_no_tokens = False

    # -- setup ----------------------------------------------------------------------------------
    def _resolve_peak(self, trainer: L.Trainer) -> float:
        if self._peak_override is not None:
            self.peak_source = "argument"
            return float(self._peak_override)
        device = trainer.strategy.root_device
        dtype = precision_to_dtype(trainer.precision, device.type)
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            peak = get_peak_flops(name, dtype)
            if peak is not None:
                self.peak_source = f"table: {name} {dtype}"
                return peak
            rank_zero_warn(
                f"MFUMonitor: no dense {dtype} peak known for {name!r}; using a measured matmul peak. "
                "Pass `peak_flops=` for a spec-based MFU."
            )
        self.peak_source = f"measured: {device.type} {dtype} matmul"
        return measure_peak_flops(device, dtype)

    def _resolve_flops_fn(self, pl_module: L.LightningModule) -> Callable[[int], float]:
        override = self._flops_override
        if callable(override):
            return override
        if override is not None:
            value = float(override)
            return lambda seq_len: value
        config = find_hf_config(pl_module)
        if config is not None:
            causal = self.causal
            return lambda seq_len: flops_per_token(config, seq_len, causal=causal)
        per_token = _linear_flops_per_token(pl_module)
        rank_zero_warn(
            "MFUMonitor: no Hugging Face config on the model; counting 6 × nn.Linear weights per token "
            "without an attention term. Pass `flops_per_token=` for an exact count."
        )
        return lambda seq_len: per_token

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Here, not in `setup`: the model may only exist after `configure_model`.
        self._flops_fn = self._resolve_flops_fn(pl_module)
        # Every rank calls the broadcast, whatever branch it took: one collective, same order.
        self.peak_flops = float(trainer.strategy.broadcast(self._resolve_peak(trainer), src=0))

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t_last = None

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t_last = None  # validation inside the epoch is not training time

    # -- per step -------------------------------------------------------------------------------
    def _now(self, trainer: L.Trainer) -> float:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._t_last is None:
            self._t_last = self._now(trainer)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = self._now(trainer)
        seconds = now - (self._t_last if self._t_last is not None else now)
        self._t_last = now
        self._batches_seen += 1
        if self._batches_seen <= self.warmup_steps or seconds <= 0.0:
            return
        sp_size = int(getattr(trainer.strategy, "sp_size", 1))
        tp_size = int(getattr(trainer.strategy, "tp_size", 1))  # TP peers hold the same tokens
        counted = count_tokens(batch, world_size=trainer.world_size // tp_size, sp_size=sp_size)
        if counted is None:
            if not self._warned_no_tokens:
                rank_zero_warn("MFUMonitor: no `input_ids` tensor in the batch; nothing is logged.")
                self._warned_no_tokens = True
            return
        tokens, seq_len = counted
        assert self._flops_fn is not None and self.peak_flops is not None, "on_train_start did not run"
        for metric, value in (
            (self._tokens, tokens),
            (self._flops, tokens * self._flops_fn(seq_len)),
            (self._seconds, seconds),
        ):
            metric.update(torch.tensor(float(value), dtype=torch.float64))
        metrics = throughput_metrics(
            tokens=float(self._tokens.compute()),
            flops=float(self._flops.compute()),
            seconds=float(self._seconds.compute()),
            world_size=trainer.world_size,
            peak_flops=self.peak_flops,
        )
        for name, value in metrics.items():
            prog_bar = name in ("perf/tokens_per_sec", "perf/mfu")
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=prog_bar, batch_size=1)
        self.history.append({"step": float(trainer.global_step), **metrics})
