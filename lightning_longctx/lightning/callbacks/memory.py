"""Per-step memory, max over ranks, with a summary table and a plot at the end of fit.

Per training step: the device's peak allocated and reserved bytes (CUDA only; peaks are reset at
the start of every step, so each value belongs to one step), the process's resident host memory
(RSS) and the bytes FPDT currently keeps in host memory (offloaded k/v chunks). Each is the max
over all ranks: one ``all_reduce(MAX)`` of one small tensor per step, called by every rank.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_longctx.attention.offload import offloaded_bytes
from lightning_longctx.lightning.callbacks.mfu import MFUMonitor
from lightning_longctx.parallel.comm import all_reduce_no_grad

__all__ = ["MemoryMonitor", "host_rss_bytes", "max_over_ranks"]

GIB = float(1 << 30)


def max_over_ranks(values: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Elementwise max of ``values`` over the ranks of ``group`` (a copy; the input is untouched).

    Every rank of ``group`` must call it with the same shape, dtype and device kind (CPU for gloo,
    CUDA for NCCL). Without an initialised process group it returns a copy of ``values``.
    """
    return all_reduce_no_grad(values, group, op="max")


def host_rss_bytes() -> int:
    """Resident set size of this process in bytes (Linux ``/proc``; else the peak from ``getrusage``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class MemoryMonitor(L.Callback):
    """Logs ``mem/peak_allocated_gib``, ``mem/peak_reserved_gib`` (CUDA only), ``mem/host_rss_gib``,
    ``mem/offloaded_gib`` every training step, each the max over ranks.

    At the end of fit, rank 0 logs a summary table (also kept in ``summary``) and, when matplotlib
    is installed, writes ``filename`` into the log directory: memory over steps, and tokens/s when
    an :class:`MFUMonitor` is among the callbacks.
    """

    def __init__(self, *, plot: bool = True, filename: str = "memory.png") -> None:
        super().__init__()
        self.plot = plot
        self.filename = filename
        self.history: list[dict[str, float]] = []
        self.summary: str | None = None
        self.plot_path: str | None = None

    @staticmethod
    def _is_cuda(trainer: L.Trainer) -> bool:
        return trainer.strategy.root_device.type == "cuda"

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._is_cuda(trainer):
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def _measure(self, trainer: L.Trainer) -> dict[str, float]:
        """This rank's numbers in bytes; the keys are the same on every rank (same device kind)."""
        device = trainer.strategy.root_device
        stats: dict[str, float] = {}
        if device.type == "cuda":
            stats["mem/peak_allocated_gib"] = float(torch.cuda.max_memory_allocated(device))
            stats["mem/peak_reserved_gib"] = float(torch.cuda.max_memory_reserved(device))
        stats["mem/host_rss_gib"] = float(host_rss_bytes())
        stats["mem/offloaded_gib"] = float(offloaded_bytes())
        return stats

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = self._measure(trainer)
        values = torch.tensor(list(stats.values()), dtype=torch.float64, device=trainer.strategy.root_device)
        if trainer.world_size > 1:  # a single-device Trainer never joins a collective
            values = max_over_ranks(values)
        reduced = {name: value / GIB for name, value in zip(stats, values.tolist())}
        for name, value in reduced.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        self.history.append({"step": float(trainer.global_step), **reduced})

    # -- end of fit -----------------------------------------------------------------------------
    @staticmethod
    def _perf_history(trainer: L.Trainer) -> list[dict[str, float]]:
        mfu = next((cb for cb in trainer.callbacks if isinstance(cb, MFUMonitor)), None)
        return mfu.history if mfu is not None else []

    def _summary_table(self, perf: list[dict[str, float]]) -> str:
        columns = {k: [row[k] for row in self.history] for k in self.history[0] if k != "step"}
        for name in ("perf/tokens_per_sec", "perf/mfu"):
            if perf:
                columns[name] = [row[name] for row in perf]
        width = max(len(n) for n in columns)
        lines = [
            f"MemoryMonitor: {len(self.history)} steps; mem/* in GiB, max over ranks",
            f"{'metric':<{width}}  {'max':>10}  {'mean':>10}  {'last':>10}",
        ]
        for name, column in columns.items():
            mean = sum(column) / len(column)
            lines.append(f"{name:<{width}}  {max(column):10.4g}  {mean:10.4g}  {column[-1]:10.4g}")
        return "\n".join(lines)

    def _save_plot(self, path: str, perf: list[dict[str, float]]) -> None:
        # The object API with its own Agg canvas: no pyplot, no change to the global backend.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 6 if perf else 3.5), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(2 if perf else 1, 1, sharex=True, squeeze=False)[:, 0]
        steps = [row["step"] for row in self.history]
        for name in (k for k in self.history[0] if k != "step"):
            axes[0].plot(steps, [row[name] for row in self.history], label=name.removeprefix("mem/"))
        axes[0].set_ylabel("GiB (max over ranks)")
        axes[0].legend(fontsize="small")
        axes[0].grid(alpha=0.3)
        if perf:
            axes[1].plot([r["step"] for r in perf], [r["perf/tokens_per_sec"] for r in perf], color="C4")
            axes[1].set_ylabel("tokens/s (global)")
            axes[1].grid(alpha=0.3)
        axes[-1].set_xlabel("step")
        fig.savefig(path, dpi=100)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.history:  # the same on every rank: each step's numbers were reduced over all ranks
            return
        # trainer.log_dir is a broadcast under DDP: every rank reads it, before the rank-zero-only part.
        log_dir = trainer.log_dir if self.plot else None
        if not trainer.is_global_zero:
            return
        perf = self._perf_history(trainer)
        self.summary = self._summary_table(perf)
        rank_zero_info(self.summary)
        if not self.plot:
            return
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            rank_zero_warn(
                "MemoryMonitor: matplotlib is not installed (`pip install matplotlib`); no plot written."
            )
            return
        log_dir = log_dir or trainer.default_root_dir
        os.makedirs(log_dir, exist_ok=True)
        self.plot_path = os.path.join(log_dir, self.filename)
        self._save_plot(self.plot_path, perf)
