"""Memory planner: the bytes one training step needs per device and per host, before you launch it.

:func:`plan_memory` models one steady-state training step (forward, backward, optimizer step) of a
Hugging Face decoder LM under :class:`~lightning_longctx.UlyssesFPDTStrategy`, from the model config
and the strategy's settings alone (no weights, no GPU). :func:`longest_sequence` searches the longest
sequence whose per-device peak fits a memory size. ``lightning-longctx plan --config my.yaml`` prints
both for a LightningCLI config.

The model follows the code of this package and of PyTorch/transformers tensor by tensor (checked
against a step's allocations with the PyTorch profiler and against peak RSS; docs/benchmarks.md).
Per rank, with ``t = micro_batch_size * N / P`` local tokens, ``d, L, H, H_kv, hd, I, V`` the
config's dims, ``w`` the parameter bytes, ``m`` the matmul (autocast) bytes, ``r`` the residual
stream's bytes (the embedding's dtype):

* **weights, gradients** ``= n_params * w`` (``/ (dp*sp)`` with FSDP); **optimizer state** = 2 states
  (AdamW) ``* n_params * w`` (torch keeps them in the parameter dtype; Lightning's ``bf16-mixed``
  keeps fp32 weights, which are the master copy: no extra one); DDP: the gradients are views into its
  all-reduce buckets (the strategy sets ``gradient_as_bucket_view=True``), allocated for the whole run,
  so they show as **DDP gradient buckets** in every phase; FSDP: the unsharded root
  parameters (embedding, head, final norm) for the step, two unsharded blocks (current + prefetched)
  and one block's plus the root's unsharded gradients in backward.
* **activations kept for backward**, per layer per token: two RMSNorms ``2 * (4 + r) * d`` (fp32 input,
  normalised copy); the projections' inputs (``d*m`` each; under autocast each of q/k/v and gate/up
  keeps its own cast copy); attention in head layout after the all-to-all: q, k, v, out
  ``(2H + 2H_kv') * hd`` and the fp32 log-sum-exp ``4H`` (FPDT: the same per chunk, in host memory with
  offload; its blocks run in the autocast dtype, the lse too); the o_proj input ``H*hd*m``; the MLP's
  gate, act, up, act*up ``4*I*m`` (none when FPDT tiles it). With activation checkpointing only each
  layer's input ``d*r``, and one layer is recomputed in backward; FPDT's offloaded chunks of every layer
  still stay on the host (its chunk store lives on the autograd node, which checkpointing keeps). With
  ``activation_offload`` those layer inputs are on the host; the device holds the one being recomputed
  and the next one prefetched in backward, and the running one in forward. Plus
  the final norm, the head's input (both freed in the loss backward), the batch and the RoPE tables.
* **loss working set**: Ulysses (Hugging Face's loss) ``t*V`` fp32 log-softmax + its gradient + the
  logits' gradient (``12*t*V`` bytes at the start of backward); FPDT's chunked lm_head + loss: one
  fp32 ``(loss_chunk, V)`` block (two with a soft-cap; plus its matmul-dtype original and copy under
  autocast), the head's fp32 gradient accumulator and the hidden states' gradient; ``loss_chunk``
  defaults to 128 MiB per block (``chunked_loss.default_loss_chunk_size``).
* **attention / MLP working sets, all-to-all buffers**: one layer's transient tensors in forward and
  backward (Ulysses: the gradients of q, k, v and the all-to-all copies, O(t); FPDT: one chunk's
  segment, one ``(H/P, 1024, 1024)`` score tile, the double-buffered kv prefetch with offload, and the
  layer's q/k/v gradients).

The peak is the largest of five phases: the last layer's forward and the loss forward (with the
previous step's gradients still allocated: Lightning frees them between forward and backward), the
loss backward, the last layer's backward, and the optimizer step. A layer phase is the larger of its
attention moment and its MLP moment (the layer's MLP tensors do not exist yet, or are freed, while its
attention runs). Each component is shown with its bytes in the peak phase, so the rows add up to the
total; ``largest`` is its maximum over all phases and moments.

What it does not model: allocator caching and fragmentation (CUDA's caching allocator reserves more
than it allocates: keep 5-10% headroom), CUDA context and library workspaces (cuBLAS, NCCL: ~1 GiB),
mixture-of-experts layers, non-RMSNorm norms and fused qkv projections (counted as Llama's), and
gradient accumulation (gradients then persist through backward: add ``gradients`` to the peak).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_longctx.chunked_loss import default_loss_chunk_size
from lightning_longctx.flops import _NON_GATED_MODEL_TYPES, _dims, _text_config, matmul_params
from lightning_longctx.strategy import DEFAULT_FPDT_CHUNK_SIZE, SUPPORTED_PRECISION

__all__ = ["MemoryComponent", "MemoryPlan", "format_bytes", "longest_sequence", "parse_bytes", "plan_memory"]

MODES = ("ulysses", "fpdt")
DATA_PARALLEL = ("ddp", "fsdp")
#: optimizer name -> state tensors per parameter (kept in the parameter's dtype by torch.optim)
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
#: FPDT's score tile (``fpdt_attention(block_size=1024)``)
FPDT_BLOCK_SIZE = 1024
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float64": 8, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_UNITS.update({f"{u}ib": v for u, v in list(_UNITS.items()) if u not in ("", "b")})
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})

# Components in table order. Resident ones are allocated for the whole step; the others are
# working sets of some phases only.
_ORDER = (
    "weights",
    "gradients",
    "optimizer state",
    "DDP gradient buckets",
    "FSDP unsharded params/grads",
    "autocast weight copies",
    "activations kept for backward",
    "loss working set",
    "attention working set",
    "MLP working set",
    "all-to-all buffers",
    "layer recompute (checkpointing)",
)


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"80G"`` (= GiB), ``"141GB"`` (10^9), ``"512MiB"`` or a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a memory size; write e.g. 80GiB, 80G (= GiB), 141GB (10^9 bytes) or 512MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``1.50 GiB``-style text (binary units)."""
    if n == 0:
        return "0 B"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------------
# The model's shape
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    gated: bool
    params: int  # all parameters (tied ones once)
    block_params: int  # the largest transformer block (FSDP's unit)
    root_params: int  # parameters outside the blocks: embedding, head, final norm
    matmul_params: int  # weights that go through a matmul (autocast casts these)
    head_params: int  # the lm_head weight (its gradient comes first in backward)
    model_name: str
    softcap: bool  # a final-logit soft-cap (Gemma-2): the chunked loss backward keeps two blocks


def _as_config(config: Any) -> Any:
    if isinstance(config, Mapping):
        if "model_type" not in config:
            raise ValueError(
                f"a config dict needs a 'model_type' key (e.g. 'llama'), as in a LightningCLI model_config; got "
                f"keys {sorted(config)}"
            )
        from transformers import AutoConfig

        cfg = dict(config)
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if not hasattr(config, "hidden_size") and not hasattr(config, "get_text_config"):
        raise TypeError(
            f"config must be a transformers config or a dict with 'model_type', got {type(config).__name__}"
        )
    return config


def _count_params(config: Any) -> tuple[int, int, int, str]:
    """(all, largest block, outside blocks, class name) from the model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    block_sizes, in_block = [], set()
    for module in model.modules():
        if type(module).__name__ in blocks:
            params = list(module.parameters())
            block_sizes.append(sum(p.numel() for p in params))
            in_block.update(id(p) for p in params)
    total = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_block)
    return total, max(block_sizes, default=0), root, type(model).__name__


@functools.lru_cache(maxsize=32)
def _shape_cached(config_json: str, model_type: str) -> _Shape:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **json.loads(config_json))
    return _shape_of(config)


def _shape_of(config: Any) -> _Shape:
    text = _text_config(config)
    d, layers, heads, kv_heads, head_dim, inter, vocab = _dims(text)
    gated = getattr(text, "model_type", None) not in _NON_GATED_MODEL_TYPES
    n_matmul = matmul_params(text, gated_mlp=gated)
    try:
        total, block, root, name = _count_params(config)
    except Exception:  # a model transformers cannot build: count the Llama-style weights
        tied = bool(getattr(text, "tie_word_embeddings", False))
        block = (n_matmul - d * vocab) // layers + 2 * d
        root = d * vocab * (1 if tied else 2) + d
        total, name = layers * block + root, type(config).__name__.replace("Config", "")
    return _Shape(d, layers, heads, kv_heads, head_dim, inter, vocab, gated, total, block, root, n_matmul,
                  d * vocab, name, bool(getattr(text, "final_logit_softcapping", None)))  # fmt: skip


def _shape(config: Any) -> _Shape:
    to_dict = getattr(config, "to_diff_dict", None)
    model_type = getattr(config, "model_type", None)
    if callable(to_dict) and model_type:
        try:
            return _shape_cached(json.dumps(to_dict(), sort_keys=True, default=str), model_type)
        except (TypeError, ValueError):
            pass
    return _shape_of(config)


# ---------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryComponent:
    """One row of a plan: bytes on one device and on its host in the peak phase, the largest it gets
    in any phase, and what it is."""

    name: str
    device: int
    host: int
    largest: int
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Bytes per device and per host of one training step, by component (see the module docstring).

    ``device_total`` / ``host_total``: the per-device / per-host peak (largest phase). ``combined``:
    the largest ``device + host`` of any phase (what a CPU run, whose device IS the host, peaks at).
    ``phases``: ``(phase, device bytes, host bytes)`` of every phase modelled.
    """

    model: str
    params: int
    seq_len: int  # as asked
    padded_seq_len: int  # what shard_batch pads it to
    tokens_per_device: int  # micro_batch_size * padded_seq_len / sp
    sequence_parallel_size: int
    data_parallel_size: int
    mode: str
    fpdt_chunk_size: int | None  # tokens per chunk per rank actually used
    loss_chunk_size: int | None
    mlp_chunk_size: int | None
    offload: bool
    activation_checkpointing: bool
    activation_offload: bool
    data_parallel: str
    micro_batch_size: int
    precision: str
    param_bytes: int
    optimizer: str
    components: tuple[MemoryComponent, ...]
    phases: tuple[tuple[str, int, int], ...]
    peak_phase: str
    device_total: int
    host_total: int
    combined: int
    between_steps: int  # allocated between steps: weights, gradients, optimizer state, DDP buckets
    device_memory: int | None = None

    def __getitem__(self, name: str) -> MemoryComponent:
        for comp in self.components:
            if comp.name == name:
                return comp
        raise KeyError(f"{name!r} is not a component; components: {[c.name for c in self.components]}")

    @property
    def fits(self) -> bool | None:
        """Whether ``device_total`` fits ``device_memory`` (None when no memory size was given)."""
        return None if self.device_memory is None else self.device_total <= self.device_memory

    def phase(self, name: str) -> tuple[int, int]:
        """``(device, host)`` bytes of one phase."""
        for phase, device, host in self.phases:
            if phase == name:
                return device, host
        raise KeyError(f"{name!r} is not a phase; phases: {[p for p, _, _ in self.phases]}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data: settings, components, phases and totals (bytes)."""
        out = dataclasses.asdict(self)
        out["components"] = [dataclasses.asdict(c) for c in self.components]
        out["phases"] = [{"phase": p, "device": d, "host": h} for p, d, h in self.phases]
        out["fits"] = self.fits
        return out

    def describe(self) -> str:
        """One line: model, sequence, layout, mode and precision."""
        n = f"{self.seq_len:,} tokens"
        if self.padded_seq_len != self.seq_len:
            n += f" (padded to {self.padded_seq_len:,})"
        mode = "Ulysses"
        if self.mode == "fpdt":
            chunks = self.tokens_per_device // (self.micro_batch_size * self.fpdt_chunk_size)
            mode = f"FPDT chunk {self.fpdt_chunk_size:,} ({chunks} per rank)" + (
                " + offload" if self.offload else ""
            )
        extras = [self.precision, self.data_parallel.upper()]
        if self.activation_offload:
            extras.append("activation checkpointing + offload")
        elif self.activation_checkpointing:
            extras.append("activation checkpointing")
        if self.micro_batch_size > 1:
            extras.append(f"micro batch {self.micro_batch_size}")
        return (
            f"{self.model} ({_count(self.params)} params), {n}, sp {self.sequence_parallel_size} x dp "
            f"{self.data_parallel_size}, {mode}, {', '.join(extras)}: {self.tokens_per_device:,} tokens per device"
        )

    def table(self) -> str:
        """A printable table: component, bytes per device and per host in the peak phase, and notes."""
        rows = [(c.name, format_bytes(c.device) if c.device else "-", format_bytes(c.host) if c.host else "-",
                 c.note) for c in self.components]  # fmt: skip
        rows.append((f"total at peak ({self.peak_phase})", format_bytes(self.device_total),
                     format_bytes(self.host_total) if self.host_total else "-", ""))  # fmt: skip
        heads = ("component", "per device", "per host", "note")
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
        line = "-" * (sum(widths) + 6)

        def fmt(r: tuple[str, ...]) -> str:
            return f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip()

        out = [self.describe(), fmt(heads), line, *map(fmt, rows[:-1]), line, fmt(rows[-1])]
        out.append("phases (device / host): " + ", ".join(
            f"{p} {format_bytes(d)} / {format_bytes(h)}" for p, d, h in self.phases))  # fmt: skip
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            gap = abs(self.device_memory - self.device_total)
            out.append(f"device memory {format_bytes(self.device_memory)}: {verdict} "
                       f"({format_bytes(gap)} {'free' if self.fits else 'over'})")  # fmt: skip
        return "\n".join(out)


def _dtype_bytes(name: Any) -> int:
    key = str(name).replace("torch.", "").lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(
            f"param_dtype={name!r} is unknown; use 'float32', 'bfloat16', 'float16' or 'float64'"
        )
    return _DTYPE_BYTES[key]


def _dtypes(precision: str, param_dtype: Any) -> tuple[int, int, int, bool]:
    """(w parameter bytes, m matmul bytes, r residual bytes, autocast on) of a Lightning precision."""
    p = str(precision)
    p = {"32": "32-true", "64": "64-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(p, p)
    if p not in SUPPORTED_PRECISION:
        raise ValueError(f"precision={precision!r} is not supported; use one of {SUPPORTED_PRECISION}")
    w = None if param_dtype is None else _dtype_bytes(param_dtype)
    if p.endswith("-mixed"):  # fp32 weights unless the model was built in another dtype; autocast matmuls
        w = w or 4
        return w, 2, w, True
    if p in ("bf16-true", "16-true"):  # Lightning converts the module to the half dtype
        return 2, 2, 2, False
    w = w or (8 if p == "64-true" else 4)
    return w, w, w, False


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


def plan_memory(
    config: Any,
    *,
    seq_len: int,
    sequence_parallel_size: int,
    data_parallel_size: int = 1,
    mode: str = "ulysses",
    fpdt_chunk_size: int | None = None,
    offload: bool = False,
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    data_parallel: str = "ddp",
    micro_batch_size: int = 1,
    precision: str = "32-true",
    param_dtype: Any = None,
    optimizer: str = "adamw",
    loss_chunk_size: int | None = None,
    mlp_chunk_size: int | None = None,
    device_memory: int | str | None = None,
) -> MemoryPlan:
    """Plan the memory of one training step per device and per host (no GPU, no weights needed).

    Args:
        config: a transformers config (e.g. ``AutoConfig.from_pretrained(path)``) or a dict with
            ``model_type``, as in a LightningCLI ``model_config``.
        seq_len: tokens per sequence (global); padded like ``shard_batch`` pads it (to a multiple of
            ``P``, or of ``P * chunk`` with FPDT).
        sequence_parallel_size: P, ranks that share one sequence. data_parallel_size: dp (matters
            for FSDP, which shards over dp x sp).
        mode: ``"ulysses"`` or ``"fpdt"``. fpdt_chunk_size: tokens per chunk per rank (FPDT; default
            4096, capped at the local length as the strategy does). offload: FPDT's chunks in host memory.
        activation_checkpointing: checkpoint every decoder layer (the strategy's or ``CausalLM``'s flag).
        activation_offload: the checkpointed layer inputs in host memory (implies checkpointing).
        data_parallel: ``"ddp"`` (replicated parameters, gradient buckets) or ``"fsdp"`` (sharded).
        micro_batch_size: sequences per device per step.
        precision: a Lightning precision (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ...).
        param_dtype: the weights' dtype when the model is built in one (``CausalLM(dtype=...)``), e.g.
            ``"bfloat16"``; ``None``: what the precision gives (fp32 for ``-mixed`` and ``32-true``).
        optimizer: ``"adamw"`` / ``"adam"`` (2 states per parameter) or ``"sgd"`` (none).
        loss_chunk_size / mlp_chunk_size: FPDT's chunk of the lm_head + loss / the tiled MLP (defaults
            as the strategy's: 128 MiB fp32 logits blocks / the FPDT chunk size).
        device_memory: bytes (or ``"80GiB"``) per device, to say whether the plan fits.

    Returns a :class:`MemoryPlan`; ``plan.table()`` prints it.
    """
    shape = _shape(_as_config(config))
    P = _check_int("sequence_parallel_size", sequence_parallel_size)
    dp = _check_int("data_parallel_size", data_parallel_size)
    b = _check_int("micro_batch_size", micro_batch_size)
    _check_int("seq_len", seq_len)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; use 'ulysses' or 'fpdt' (chunked, optionally offloaded)")
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel={data_parallel!r} is unknown; use 'ddp' or 'fsdp'")
    if optimizer.lower() not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is unknown; use one of {sorted(OPTIMIZER_STATES)}")
    if offload and mode != "fpdt":
        raise ValueError(
            "offload=True needs FPDT chunking: mode='fpdt' (offload moves FPDT's chunks to the host)"
        )
    for name, value in (("fpdt_chunk_size", fpdt_chunk_size), ("loss_chunk_size", loss_chunk_size),
                        ("mlp_chunk_size", mlp_chunk_size)):  # fmt: skip
        if value is not None:
            _check_int(name, value)
    activation_checkpointing = bool(activation_checkpointing or activation_offload)  # offload implies it
    w, m, r, autocast = _dtypes(precision, param_dtype)
    casting = autocast and w != m  # autocast makes (and linear saves) low-precision copies
    memory = None if device_memory is None else parse_bytes(device_memory)

    # ---- layout: what shard_batch and the strategy make of the sequence ----
    chunk = None
    if mode == "fpdt":
        chunk = min(fpdt_chunk_size or DEFAULT_FPDT_CHUNK_SIZE, -(-seq_len // P))  # strategy.chunk_size_for
        loss_chunk_size = loss_chunk_size or default_loss_chunk_size(shape.vocab)
        mlp_chunk_size = mlp_chunk_size or fpdt_chunk_size or DEFAULT_FPDT_CHUNK_SIZE
    multiple = P * (chunk or 1)
    n_pad = -(-seq_len // multiple) * multiple
    t = b * n_pad // P  # tokens per rank
    bn = b * n_pad  # tokens of the sequences, seen by each rank in head layout

    s = shape
    d, L, H, hd, inter, V = s.d, s.layers, s.heads, s.head_dim, s.inter, s.vocab
    if H % P == 0 and H % math.lcm(s.kv_heads, P) == 0:  # attention.common.spread_kv_heads
        kv = s.kv_heads * (P // math.gcd(s.kv_heads, P))
    else:
        kv = H
    h_r, kv_r = -(-H // P), -(-kv // P)  # heads per rank after the all-to-all (largest rank)
    q_elems, kv_elems = bn * h_r * hd, bn * kv_r * hd  # one rank's q (or out) / k (or v) in head layout

    # ---- parameters, gradients, optimizer ----
    W = dp * P
    shard = W if data_parallel == "fsdp" else 1
    weights = -(-s.params // shard) * w
    grads = 0 if data_parallel == "ddp" else weights  # DDP: views into its buckets (gradient_as_bucket_view)
    states = OPTIMIZER_STATES[optimizer.lower()]
    opt = states * weights
    buckets = s.params * w if data_parallel == "ddp" else 0  # the strategy wraps in DDP even on one rank
    mlp_weights = (3 if s.gated else 2) * d * inter  # one layer's
    # weight casts linear saves for backward; FPDT's tiled MLP and chunked loss cast per chunk instead
    cast_params = s.matmul_params - (L * mlp_weights + s.head_params if mode == "fpdt" else 0)
    casts = cast_params * m if casting else 0
    chunk_casts = m if casting else 0  # bytes per weight cast inside a chunked function
    fsdp_step = s.root_params * w if data_parallel == "fsdp" else 0  # root stays unsharded (reshard=False)
    fsdp_blocks = 2 * s.block_params * w if data_parallel == "fsdp" else 0  # current + prefetched block
    fsdp_grads = (s.block_params + s.root_params) * w if data_parallel == "fsdp" else 0
    opt_step = opt // 2 if states else 0  # foreach AdamW: one temporary per state (sqrt of exp_avg_sq)

    # ---- activations kept for backward ----
    fpdt = mode == "fpdt"
    # FPDT keeps q, k and out in RoPE's output dtype: the residual's (fp32) under autocast
    qa = r if (casting and fpdt) else m
    lse_b = m if (autocast and fpdt) else max(4, m)  # FPDT's blocks run in the autocast dtype, lse too
    mlp_tiled = fpdt
    copies_qkv = 3 if casting else 1  # autocast casts the normed input once per projection
    copies_mlp = (2 if s.gated else 1) if casting else 1
    norm = (4 + r) * d * t  # x in fp32 and its normalised copy, saved by each of the two RMSNorms
    qkv_in = copies_qkv * d * m * t
    mlp_in = (d * r if mlp_tiled else copies_mlp * d * m) * t
    store = 2 * q_elems * qa + kv_elems * (qa + m) + bn * h_r * lse_b  # q, out, k, v, lse
    o_in = H * hd * m * t
    mlp_saved = 0 if mlp_tiled else (4 if s.gated else 2) * inter * m * t
    mlp_part = norm + mlp_in + mlp_saved  # freed by the time the layer's attention runs its backward
    layer_full = norm + qkv_in + store + o_in + mlp_part  # one layer, nothing offloaded
    layer_host = store if offload else 0
    layer_device = layer_full - layer_host
    head_in = d * r * t + 4 * t if fpdt else d * m * t  # chunked loss: hidden + lse; HF: lm_head's input
    final = (4 + r) * d * t + head_in  # the final norm and the head's input: freed in the loss backward
    model_once = final + 4 * 8 * t + 2 * hd * r * t  # + the batch's ids and the RoPE tables
    if activation_checkpointing:
        inputs = L * d * r * t  # the checkpointed layer inputs
        acts_device, acts_host = (
            (model_once, L * layer_host + inputs)
            if activation_offload
            else (inputs + model_once, L * layer_host)
        )
    else:
        acts_device, acts_host = L * layer_device + model_once, L * layer_host

    # ---- working sets ----
    ct = max(m, 4)  # the softmax / loss dtype: fp32 (fp64 for fp64)
    if fpdt:
        lc = min(loss_chunk_size, t)
        # forward: one logits block (+ its matmul-dtype original) and logsumexp's exp; backward: the
        # recomputed block, exp, softmax - onehot, where(), * grad, the previous chunk's gradient, and
        # the fp32 grad_w accumulator and grad_h
        low = m if m != ct else 0  # autocast: the matmul-dtype logits (and gradient) beside the fp32 block
        loss_fwd = lc * V * (ct + low) + s.head_params * chunk_casts
        loss_bwd = (
            lc * V * ((2 if s.softcap else 1) * ct + low)
            + s.head_params * (ct + chunk_casts + low)
            + d * r * t
        )
    else:
        loss_fwd = t * V * (m + ct + (ct if m != ct else 0))  # logits (+ fp32 copy) + log-softmax
        loss_bwd = 3 * ct * t * V  # log-softmax, its gradient, the logits' gradient
    seg = b * P * chunk if fpdt else bn  # tokens of one FPDT segment
    tile = min(FPDT_BLOCK_SIZE, seg // b) if fpdt else 0
    grad_stream = d * max(r, 4) * t  # the residual stream's gradient (a norm's fp32 backward)
    if fpdt:
        per_seg = b * P * chunk * h_r * hd
        tile_ws = b * h_r * tile * tile * (m if autocast else ct) + b * tile * tile
        kv_buffer = 4 * b * P * chunk * kv_r * hd * qa if offload else 0  # 2 fetched (k, v) steps
        # the outputs gathered so far, one segment (q, its fp32 accumulator and merge, the next q and kv
        # in flight), a math score tile, the offload double buffer
        ahead = per_seg * qa + 2 * b * P * chunk * kv_r * hd * qa
        attn_fwd = q_elems * qa + per_seg * (qa + 8) + ahead + tile_ws + kv_buffer
        parts = q_elems * qa + 2 * kv_elems * qa  # dq, dk, dv, all chunks (and their concatenation)
        fetched = 2 * (per_seg * (qa + qa) + b * P * chunk * (h_r * 4 + 2 * kv_r * hd * qa)) if offload else 0
        # the output's gradient throughout; early: every segment's dout and fp32 dq accumulator (the
        # first kv segment reaches all q segments); late: dq/dk/dv of every chunk and their concatenation
        early = q_elems * qa + bn * h_r * 4 + q_elems * ct + 2 * tile_ws + fetched
        attn_bwd = q_elems * qa + max(early, 2 * parts)
        comm = 2 * b * chunk * H * hd * qa  # send + receive of one chunk
        mc = min(mlp_chunk_size, t)
        n_mlp = 4 if s.gated else 2
        # outputs + one chunk without grad; backward: grad_x + one chunk recomputed with grad (+ casts)
        mlp_fwd = 2 * d * r * t + (n_mlp - 1) * mc * inter * m + mlp_weights * chunk_casts
        mlp_bwd = 2 * d * r * t + (n_mlp + 3) * mc * inter * m + mlp_weights * chunk_casts
    else:
        attn_fwd = 0  # the kernel's out and lse are kept (activations); O(1) workspace
        # the output's gradient in both layouts, dq/dk/dv in head layout and back in sequence layout
        attn_bwd = 2 * q_elems * m + 2 * (q_elems + 2 * kv_elems) * m
        comm = 2 * t * H * hd * m  # head_to_seq: the reshaped copy and the send buffer
        mlp_fwd = d * m * t
        mlp_bwd = (2 if s.gated else 1) * inter * m * t  # the activation's gradients (act*up is freed)
    # the recomputed layer's first norm saves the checkpointed input itself when it is fp32 already
    recompute_dev = layer_device - (d * 4 * t if r == 4 else 0) if activation_checkpointing else 0
    recompute_host = layer_host if activation_checkpointing else 0
    # activation offload: the last layer's input is alive on the device while it runs forward; in backward the
    # recomputed layer's input and the one prefetched for the layer before it
    running = d * r * t if activation_offload else 0
    fetched = min(2, L) * d * r * t if activation_offload else 0

    # ---- phases: what is alive at each candidate peak ----
    ACTS, RECOMPUTE = "activations kept for backward", "layer recompute (checkpointing)"
    resident = {"weights": weights, "optimizer state": opt, "DDP gradient buckets": buckets,
                "FSDP unsharded params/grads": fsdp_step, "autocast weight copies": casts, ACTS: acts_device}  # fmt: skip

    def layer_moment(base: dict[str, int], attn: int, mlp: int, extra: int) -> dict[str, int]:
        """The last layer's attention or MLP moment, whichever is larger. The layer's MLP tensors do not
        exist yet when its attention runs forward, and are freed when it runs backward."""
        owner = RECOMPUTE if base.get(RECOMPUTE) else ACTS  # who holds the last layer's tensors
        has_layer = bool(base.get(RECOMPUTE)) or not activation_checkpointing
        at_attn = {**base, "attention working set": attn + extra, "all-to-all buffers": comm}
        if has_layer:
            at_attn[owner] -= mlp_part
        at_mlp = {**base, "MLP working set": mlp + extra}
        for name in ("attention working set", "all-to-all buffers", "MLP working set"):  # for "largest"
            seen[name] = max(seen.get(name, 0), at_attn.get(name, 0), at_mlp.get(name, 0))
        return max(at_attn, at_mlp, key=lambda parts: sum(parts.values()))

    seen: dict[str, int] = {}  # working sets of the moments that are not a phase's peak
    fsdp_fwd = {"FSDP unsharded params/grads": fsdp_step + fsdp_blocks}
    fsdp_bwd = {"FSDP unsharded params/grads": fsdp_step + fsdp_blocks + fsdp_grads}
    phases: dict[str, tuple[dict[str, int], int]] = {
        "layer forward": (layer_moment({**resident, ACTS: acts_device + running, "gradients": grads, **fsdp_fwd},
                                       attn_fwd, mlp_fwd, 0), acts_host),
        "loss forward": ({**resident, "gradients": grads, "loss working set": loss_fwd}, acts_host),
        "loss backward": ({**resident, "loss working set": loss_bwd}, acts_host),
        "layer backward": (layer_moment({**resident, ACTS: acts_device - final + fetched, "gradients": 0, **fsdp_bwd,
                                         RECOMPUTE: recompute_dev},
                                        attn_bwd, mlp_bwd, grad_stream), acts_host + recompute_host),
        "optimizer step": ({"weights": weights, "DDP gradient buckets": buckets, "FSDP unsharded params/grads":
                            fsdp_step, "gradients": grads, "optimizer state": opt + opt_step}, 0),
    }  # fmt: skip
    totals = {name: (sum(parts.values()), host) for name, (parts, host) in phases.items()}
    peak = max(totals, key=lambda k: totals[k][0])
    host_peak = max(h for _, h in totals.values())

    notes = {
        "weights": f"{s.params:,} params x {w} B" + (f" / {shard} (FSDP)" if shard > 1 else ""),
        "gradients": "FSDP's sharded gradients, freed between forward and backward (Lightning's zero_grad)",
        "optimizer state": f"{optimizer.lower()}: {states} x params x {w} B" + (" + foreach temporary" if states else ""),
        "DDP gradient buckets": "the gradients, as views into DDP's buckets (gradient_as_bucket_view=True)",
        "FSDP unsharded params/grads": "root params; 2 blocks in flight; block + root grads in backward",
        "autocast weight copies": f"{m}-byte casts of the weights linear keeps for backward",
        "activations kept for backward": ("layer inputs (checkpointed)" if activation_checkpointing else
                                          "per layer: norms, q/k/v/out/lse, projections" + (", MLP" if not mlp_tiled else ""))
        + ("; host: FPDT chunks (offload)" if offload else "")
        + ("; host: the layer inputs (activation offload)" if activation_offload else ""),
        "loss working set": (f"chunked lm_head + loss: ({min(loss_chunk_size, t):,} x {V:,}) blocks" if fpdt
                             else f"logits ({t:,} x {V:,}) fp32: log-softmax + gradients"),
        "attention working set": (f"one segment of {seg // b:,} tokens, {tile}x{tile} score tile, dq/dk/dv" if fpdt
                                  else "dq/dk/dv and their all-to-all copies"),
        "MLP working set": f"tiled: {min(mlp_chunk_size, t):,}-token chunks" if mlp_tiled else "MLP gradients",
        "all-to-all buffers": "send + receive of one all-to-all",
        "layer recompute (checkpointing)": "one layer recomputed in backward",
    }  # fmt: skip
    components = []
    for name in _ORDER:
        at_peak = phases[peak][0].get(name, 0)
        largest = max(seen.get(name, 0), *(parts.get(name, 0) for parts, _ in phases.values()))
        host = acts_host if name == "activations kept for backward" else 0
        if name == "layer recompute (checkpointing)":
            host = recompute_host if peak == "layer backward" else 0
        if largest == 0 and host == 0:
            continue
        note = notes[name]
        if largest != at_peak:
            note += f" (largest {format_bytes(largest)})"
        components.append(MemoryComponent(name, at_peak, host, largest, note))
    return MemoryPlan(
        model=s.model_name,
        params=s.params,
        seq_len=seq_len,
        padded_seq_len=n_pad,
        tokens_per_device=t,
        sequence_parallel_size=P,
        data_parallel_size=dp,
        mode=mode,
        fpdt_chunk_size=chunk,
        loss_chunk_size=loss_chunk_size if fpdt else None,
        mlp_chunk_size=mlp_chunk_size if fpdt else None,
        offload=bool(offload),
        activation_checkpointing=activation_checkpointing,
        activation_offload=bool(activation_offload),
        data_parallel=data_parallel,
        micro_batch_size=b,
        precision=str(precision),
        param_bytes=w,
        optimizer=optimizer.lower(),
        components=tuple(components),
        phases=tuple((name, dev, host) for name, (dev, host) in totals.items()),
        peak_phase=peak,
        device_total=totals[peak][0],
        host_total=host_peak,
        combined=max(dev + host for dev, host in totals.values()),
        between_steps=weights + grads + opt + buckets,
        device_memory=memory,
    )


def longest_sequence(
    config: Any, *, device_memory: int | str, sequence_parallel_size: int, **kwargs: Any
) -> int:
    """The largest ``seq_len`` whose per-device peak (:func:`plan_memory`) fits ``device_memory``.

    Searched over multiples of ``P * fpdt_chunk_size`` (FPDT) or of ``P * 1024`` (Ulysses); the other
    keyword arguments are :func:`plan_memory`'s. Returns 0 when not even one multiple fits.
    """
    if "seq_len" in kwargs:
        raise TypeError("longest_sequence() searches seq_len; do not pass it")
    memory = parse_bytes(device_memory)
    P = _check_int("sequence_parallel_size", sequence_parallel_size)
    chunk = kwargs.get("fpdt_chunk_size") or DEFAULT_FPDT_CHUNK_SIZE
    step = P * (chunk if kwargs.get("mode", "ulysses") == "fpdt" else 1024)

    def fits(k: int) -> bool:
        plan = plan_memory(config, seq_len=k * step, sequence_parallel_size=P, **kwargs)
        return plan.device_total <= memory

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):  # memory grows with the length: double, then bisect
        lo, hi = hi, hi * 2
        if hi * step > 1 << 40:
            return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step
