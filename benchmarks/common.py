"""Helpers shared by the benchmark scripts; they know nothing about any one benchmark.

What the benchmarks share with the tests comes from the package's testing helper,
:mod:`lightning_longctx.testing`, and is re-exported here: :func:`launch` (the one way ranks start for both:
fresh processes for every measured point), :func:`environment`, :func:`write_json`, :func:`format_table`,
:func:`linear_fit`, :func:`meminfo_bytes`, ``MIB`` / ``GIB``. What the package already measures is used
from it, not copied here: ``host_rss_bytes`` / ``max_over_ranks``
(``lightning_longctx.lightning.callbacks.memory``), the FLOP formulas and peak table (``lightning_longctx.planner.flops``), ``count_all_to_all``
(``lightning_longctx.parallel.comm``), ``offloaded_bytes`` (``lightning_longctx.attention.offload``).

Scripts import this as ``from common import ...``: run them as ``python benchmarks/<script>.py`` (Python puts
the script's folder, ``benchmarks/``, on the import path). ``gpu/`` scripts import only the package.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path  # noqa: F401  (bench_planner.py reads common.Path)
from typing import Any

import torch

from lightning_longctx.testing import (  # noqa: F401  (re-exported for the scripts)
    Launch,
    environment,
    format_table,
    free_port,
    launch,
    linear_fit,
    meminfo_bytes,
    write_json,
)
from lightning_longctx.testing.results import GIB, MIB  # noqa: F401  (re-exported for the scripts)

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
