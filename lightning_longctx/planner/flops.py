"""Model FLOPs of Hugging Face decoder LMs and the dense peak FLOP/s of accelerators.

FLOPs per token (one multiply-add = 2 FLOPs; forward = 1 pass, training = forward + backward = 3):

    matmul  = 2 · N_matmul                      N_matmul: weights of every matmul a token goes through
    attn    = 4 · L · H · hd · K(S)             QKᵀ (2·H·hd per key) + PV (2·H·hd per key), per layer
    total   = (1 or 3) · (matmul + attn)

``N_matmul`` is counted from the shapes in the config: q ``d×H·hd``, k and v ``d×H_kv·hd`` each
(exact for GQA/MQA), o ``H·hd×d``, the MLP (3 matrices ``d×I`` when gated as in Llama/Qwen/Mistral/
Gemma/Phi-3, else 2), and the LM head ``d×V`` (a matmul even when tied to the embedding). The
embedding lookup is a gather, not a matmul, and is excluded. For ``H·hd = d`` training gives the
familiar ``6·N + 12·L·d·K``. The dims and ``N_matmul`` come from :mod:`lightning_longctx.planner.shapes`,
which the memory planner reads too.

``K(S)`` is the number of keys a query attends to. Non-causal: ``K = S``. Causal (the default):
``K = S/2``. Why halve: flash-style kernels (flash-attn, cuDNN, FPDT's chunk loop) skip the
masked blocks, so the masked half is never computed and is not useful work; counting it would
inflate MFU by up to 2× at long context (the PaLM appendix convention counts it; FlashAttention's
and this package's do not). ``torch.utils.flop_counter.FlopCounterMode`` counts the full ``S×S``
of an eager/SDPA attention, so it agrees with ``causal=False`` (tests check that, within 5%).
Sliding-window layers attend to ``K = w·(1 - w/2S)`` keys (``w = min(window, S)``; ``= S/2`` at
``w = S``). Packed documents are not detected: ``S`` is the full row, an upper bound.

These are *model* FLOPs: activation recomputation (checkpointing, tiled MLP/loss recompute) is
not useful work and is never counted, so ``MFU = model FLOP/s / peak`` (not HFU). Elementwise
work (norms, softmax, RoPE, activations) is left out, as in the usual MFU definition.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_longctx.planner.shapes import decoder_dims, has_gated_mlp, matmul_params_of, text_config

__all__ = [
    "PEAK_FLOPS",
    "attention_flops_per_token",
    "find_hf_config",
    "flops_per_token",
    "get_peak_flops",
    "matmul_params",
    "measure_peak_flops",
    "model_flops_per_step",
    "precision_to_dtype",
]


def matmul_params(config: Any, *, gated_mlp: bool | None = None) -> int:
    """Weights of the matmuls one token goes through (all layers + LM head; no embedding lookup).

    ``gated_mlp=None`` infers it from ``config.model_type`` (gated unless a known 2-matrix MLP).
    """
    config = text_config(config)
    gated = has_gated_mlp(config) if gated_mlp is None else gated_mlp
    return matmul_params_of(decoder_dims(config), gated)


def _keys_per_query(seq_len: int, window: int | None, causal: bool) -> float:
    if not causal:
        return float(seq_len)
    w = seq_len if window is None else min(int(window), seq_len)
    return w * (1.0 - w / (2.0 * seq_len))


def _layer_windows(config: Any, layers: int) -> list[int | None]:
    """Sliding window of each of ``layers`` layers (None = full attention), from ``layer_types`` or
    ``sliding_window``."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if window is not None and getattr(config, "use_sliding_window", True):
        return [window] * layers
    return [None] * layers


def attention_flops_per_token(
    config: Any, seq_len: int, *, causal: bool = True, training: bool = True
) -> float:
    """Score (QKᵀ) and value (PV) FLOPs per token over all layers, for rows of ``seq_len`` tokens."""
    config = text_config(config)
    dims = decoder_dims(config)
    keys = sum(_keys_per_query(seq_len, w, causal) for w in _layer_windows(config, dims.layers))
    return (3.0 if training else 1.0) * 4.0 * dims.heads * dims.head_dim * keys


def flops_per_token(
    config: Any,
    seq_len: int,
    *,
    causal: bool = True,
    training: bool = True,
    gated_mlp: bool | None = None,
) -> float:
    """Model FLOPs per token of a HF decoder config, for sequences of ``seq_len`` tokens.

    ``seq_len`` is the full (global) sequence length, not a sequence-parallel shard.
    ``causal=True`` counts half the attention scores (see the module docstring); ``training=True``
    counts forward + backward (3× forward), never recomputation.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    matmul = (3.0 if training else 1.0) * 2.0 * matmul_params(config, gated_mlp=gated_mlp)
    return matmul + attention_flops_per_token(config, seq_len, causal=causal, training=training)


def find_hf_config(obj: Any) -> Any | None:
    """The decoder config of ``obj``: a config itself, a HF model, or any module holding one."""
    if hasattr(obj, "num_hidden_layers") and hasattr(obj, "hidden_size"):
        return obj
    config = getattr(obj, "config", None)
    if config is not None and hasattr(text_config(config), "num_hidden_layers"):
        return config
    if isinstance(obj, nn.Module):
        for module in obj.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(text_config(config), "num_hidden_layers"):
                return config
    return None


def model_flops_per_step(
    model_or_config: Any, tokens: int, seq_len: int, *, causal: bool = True, training: bool = True
) -> float:
    """Model FLOPs of one step over ``tokens`` tokens (all devices) in rows of ``seq_len`` tokens."""
    config = find_hf_config(model_or_config)
    if config is None:
        raise ValueError(f"no Hugging Face decoder config found on {type(model_or_config).__name__}")
    return tokens * flops_per_token(config, seq_len, causal=causal, training=training)


# Dense (no 2:4 sparsity) peak FLOP/s per accelerator and compute dtype, from the vendors' data sheets.
# Keys are matched as case-insensitive substrings of `torch.cuda.get_device_name()`; the longest
# match wins ("H100 PCIe" over "H100", "L40S" over "L40" over "L4", "A100" over "A10").
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # Hopper. H100 SXM, H200 and GH200 share the SXM compute; the NVL parts are clocked lower.
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12},
    "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "GH200": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12},
    # Ampere (A100 SXM and PCIe share the numbers; A10G taken as the A10 data sheet).
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "A10G": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    # Ada (fp32 accumulate for the GeForce part).
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "L40": {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    # Volta / Turing (no bf16).
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
    # AMD Instinct (matrix-core numbers; MI250X has no TF32, fp32 matmuls run at the fp32 rate).
    "MI250X": {"bf16": 383e12, "fp16": 383e12, "tf32": 95.7e12, "fp32": 95.7e12},
    "MI300X": {"bf16": 1307e12, "fp16": 1307e12, "tf32": 653.7e12, "fp32": 163.4e12},
    "MI325X": {"bf16": 1307e12, "fp16": 1307e12, "tf32": 653.7e12, "fp32": 163.4e12},
}


def get_peak_flops(
    device_name: str, dtype: str = "bf16", table: Mapping[str, Mapping[str, float]] = PEAK_FLOPS
) -> float | None:
    """Dense peak FLOP/s of ``device_name`` in ``dtype`` ("bf16", "fp16", "tf32", "fp32"); None if unknown."""
    name = device_name.lower()
    matches = [key for key in table if key.lower() in name]
    if not matches:
        return None
    return table[max(matches, key=len)].get(dtype)


def precision_to_dtype(precision: str | int, device_type: str = "cuda") -> str:
    """The matmul dtype key of a Lightning precision string: "bf16-mixed" → "bf16", "32-true" → "tf32"|"fp32"."""
    p = str(precision)
    if "bf16" in p or "transformer-engine" in p:
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if p.startswith("64"):
        return "fp64"
    if device_type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


_TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "tf32": torch.float32,
    "fp32": torch.float32,
    "fp64": torch.float64,
}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _measure(device: str, dtype: str, n: int, reps: int) -> float:
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev, dtype=_TORCH_DTYPES[dtype])
    b = torch.randn(n, n, device=dev, dtype=_TORCH_DTYPES[dtype])
    a @ b  # warm-up: allocator, kernel selection, thread pool
    _synchronize(dev)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _synchronize(dev)
    return 2.0 * n**3 * reps / (time.perf_counter() - start)


def measure_peak_flops(
    device: torch.device | str = "cpu", dtype: str = "fp32", *, n: int | None = None, reps: int = 3
) -> float:
    """Measured matmul FLOP/s of ``device`` (an ``n×n`` matmul, ``reps`` times; cached per process).

    A stand-in for a spec peak where none is known (CPUs, unlisted GPUs): MFU against it says how
    close the model gets to this machine's own matmul speed, not to a vendor number.
    """
    device = torch.device(device)
    if n is None:
        n = 1024 if device.type == "cpu" else 4096
    return _measure(str(device), dtype, n, reps)
