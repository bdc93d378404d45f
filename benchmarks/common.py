"""Helpers shared by the benchmark scripts; they know nothing about any one benchmark.

:func:`launch` (the tests' launcher, ``tests/helpers/launch.py``: one way to start ranks for both) starts
the ranks, fresh processes for every measured point. What the package already measures is used from it,
not copied here: ``host_rss_bytes`` / ``max_over_ranks`` (``lightning_longctx.lightning.callbacks.memory``),
the FLOP formulas and peak table (``lightning_longctx.planner.flops``), ``count_all_to_all``
(``lightning_longctx.parallel.comm``), ``offloaded_bytes`` (``lightning_longctx.attention.offload``).

Scripts import this as ``from common import ...``: run them as ``python benchmarks/<script>.py``
(``gpu/`` scripts put this folder on ``sys.path`` themselves).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

# the one launcher, shared with the tests (tests/helpers/launch.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.launch import Launch, free_port, launch  # noqa: F401  (re-exported for the scripts)

MIB = float(1 << 20)
GIB = float(1 << 30)

#: benchmark mode -> UlyssesFPDTStrategy settings (besides the sizes); "single" runs without the strategy
STRATEGY_MODES: dict[str, dict[str, Any]] = {
    "ulysses": {},
    "fpdt": {"fpdt": True},
    "fpdt_offload": {"fpdt": True, "offload": True},  # FPDT's cold chunks in host memory
    "fpdt_ckpt": {"fpdt": True, "activation_checkpointing": True},
    # everything that moves memory off the device: FPDT offload + checkpointed layer inputs in host memory
    "fpdt_act_offload": {"fpdt": True, "offload": True, "activation_offload": True},
}


def bench_trainer(mode: str, world_size: int, *, chunk_size: int | None, device: str = "cpu",
                  callbacks: Sequence[Any] = (), **trainer_kwargs: Any) -> Any:  # fmt: skip
    """A ``lightning.Trainer`` without logger, checkpoints, progress bar or sanity check, for one mode.

    ``single``: one device, Lightning's default strategy. The others (:data:`STRATEGY_MODES`):
    ``UlyssesFPDTStrategy`` over ``world_size`` ranks (gloo on CPU, NCCL on CUDA), the FPDT ones with
    ``chunk_size`` tokens per chunk per rank.
    """
    import lightning as L

    from lightning_longctx import UlyssesFPDTStrategy

    cuda = device == "cuda"
    strategy: Any = "auto"
    if mode != "single":
        settings = dict(STRATEGY_MODES[mode])
        strategy = UlyssesFPDTStrategy(
            sequence_parallel_size=world_size,
            fpdt_chunk_size=chunk_size if settings.pop("fpdt", False) else None,
            process_group_backend="nccl" if cuda else "gloo",
            **settings,
        )
    return L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1 if mode == "single" else world_size,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
        **trainer_kwargs,
    )


def token_lm_module(args: Any, *, num_samples: int, lr: float) -> Any:
    """A LightningModule training a seeded Llama (MHA, untied head, SDPA) with SGD, one sample per step.

    ``args`` carries ``vocab, hidden, intermediate, layers, heads, seq_len``; the ``num_samples``
    random sequences (seed 1) are their own labels. The module remembers the last loss."""
    import lightning as L
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    class TokenLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = LlamaConfig(
                vocab_size=args.vocab,
                hidden_size=args.hidden,
                intermediate_size=args.intermediate,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                num_key_value_heads=args.heads,
                max_position_embeddings=max(args.seq_len, 2048),
                tie_word_embeddings=False,
                attn_implementation="sdpa",
            )
            self.model = LlamaForCausalLM(config).float()
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(1, args.vocab, (num_samples, args.seq_len), generator=g)
            self.samples = [{"input_ids": x, "labels": x.clone()} for x in ids]
            self.loss = float("nan")

        def training_step(self, batch: dict, batch_idx: int) -> Any:
            loss = self.model(**batch, use_cache=False).loss
            self.loss = float(loss.detach())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=lr)

        def train_dataloader(self) -> Any:
            return DataLoader(self.samples, batch_size=1)

    return TokenLM()


def add_model_args(p: Any, **defaults: int) -> None:
    """``--vocab --hidden --intermediate --layers --heads`` (the Llama a script trains), with defaults."""
    for name, default in defaults.items():
        p.add_argument(f"--{name}", type=int, default=default)


def malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (None elsewhere): ``malloc_trim(0)`` returns freed heap to the kernel."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def live_rss_bytes() -> int:
    """This process's RSS after ``gc.collect()`` and ``malloc_trim(0)``: what is live, not the freed heap
    glibc kept (``host_rss_bytes`` of ``lightning_longctx.lightning.callbacks.memory``)."""
    import gc

    from lightning_longctx.lightning.callbacks.memory import host_rss_bytes

    gc.collect()
    trim = malloc_trim()
    if trim is not None:
        trim(0)
    return host_rss_bytes()


def add_malloc_threshold_arg(p: Any) -> None:
    """``--malloc-mmap-threshold``: glibc's ``MALLOC_MMAP_THRESHOLD_`` for the ranks (see :func:`use_malloc_threshold`)."""
    p.add_argument("--malloc-mmap-threshold", type=int, default=1 << 18,
                   help="glibc MALLOC_MMAP_THRESHOLD_ of the ranks: allocations from this size on get their own "
                   "mapping, returned on free, so RSS follows live bytes (default: 262144; 0: glibc's dynamic "
                   "default, whose heap keeps freed holes)")  # fmt: skip


def use_malloc_threshold(threshold: int) -> None:
    """Set (``> 0``) or clear glibc's ``MALLOC_MMAP_THRESHOLD_`` for the ranks :func:`launch` starts: glibc reads
    it when the fork server starts (the first launch), every rank inherits it. Call before the first launch."""
    if threshold > 0:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b·x``; returns ``(a, b)``. Needs two distinct ``xs`` or more."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def meminfo_bytes(field: str) -> int:
    """A field of ``/proc/meminfo`` (``MemAvailable``, ``MemTotal``) in bytes; 0 where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def environment() -> dict[str, Any]:
    """Where the numbers came from: versions, machine (GPU when there is one), time, command line."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "argv": sys.argv,
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    for name in ("transformers", "lightning", "torchmetrics", "jsonargparse", "triton", "deepspeed"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            torch_cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / GIB, 1),
            sms=props.multi_processor_count,
        )
    return env


def save_results(benchmark: str, config: dict[str, Any], fields: dict[str, Any], out: str | os.PathLike,
                 png: str | os.PathLike | None = None) -> dict[str, Any]:  # fmt: skip
    """Write ``{benchmark, config, environment, **fields}`` as the JSON ``out`` and, given ``png``, its plot
    (``plot.py``, by ``benchmark``); say where. Returns that payload."""
    payload = {"benchmark": benchmark, "config": config, "environment": environment(), **fields}
    path = write_json(out, payload)
    if png is not None:
        from plot import save_plot

        png = save_plot(payload, png)
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return payload


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """``payload`` as indented JSON, replaced atomically: a run killed mid-write keeps the last file."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(out)
    return out


Column = tuple[str, str, str]  # (row key, header, format spec such as ".2f"; "" = str())


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A plain-text table (markdown pipe style); missing or ``None`` cells print as ``-``."""

    def cell(row: dict[str, Any], key: str, spec: str) -> str:
        val = row.get(key)
        if val is None:
            return "-"
        if spec and isinstance(val, (int, float)):
            return format(val, spec)
        return str(val)

    body = [[cell(r, k, s) for k, _, s in columns] for r in rows]
    heads = [h for _, h, _ in columns]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)
