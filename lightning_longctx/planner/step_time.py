"""How long one training step takes: a step-time and MFU model beside the memory planner.

:func:`estimate_step_time` walks the same per-rank layout as :func:`~lightning_longctx.planner.plan_memory`
(``build_layout``: tokens per rank, heads after the all-to-all, FPDT chunks, checkpointing, offloads, tp, FSDP)
and prices each piece of work with a device's achieved rates (:mod:`~lightning_longctx.planner.devices`; a CPU's
are measured by :func:`calibrate_cpu`). Per rank, one optimizer step of ``micro_batch_size`` sequences, with
``t`` local tokens, ``N`` the padded sequence, ``K`` the keys a query attends to:

* **matmuls**: ``2·t·W`` FLOPs forward for the TP-local weights ``W`` of the blocks and the lm_head, twice that
  backward; recompute adds one more forward of the blocks with checkpointing, of the MLP with FPDT's tiled MLP
  (both: two), and of the lm_head with FPDT's chunked loss. Time: FLOPs / ``matmul_flops``.
* **attention** (attention layers only): ``F = 4·h·hd·N·K`` forward FLOPs per rank (``h`` heads after the
  all-to-all, ``K = w·(1 - w/2S)`` with ``S`` the document length (the row unless ``document_length``) and ``w``
  the layer's sliding window or ``S``: causal halving, window and document skipping), ``2.5·F`` backward and
  ``F`` again when checkpointed, at the kernel's forward / backward rate for the keys of one call (Ulysses: the
  document; FPDT: one segment of ``P · chunk`` tokens).
* **elementwise** (norms, residuals, RoPE, SwiGLU, layout copies, the loss's softmax, autocast casts; FPDT's
  per-tile layout copies, online-softmax merges and fp32 gradient sums): bytes through device memory /
  ``memory_bandwidth``; backward moves twice the forward's bytes.
* **launches**: operators launched x ``op_latency`` (FPDT adds a few per tile, MLP tile and loss chunk). On a
  GPU the host runs ahead: a step costs at least its launches. On a CPU they add up.
* **communication**: the Ulysses all-to-alls (q, k, v in, out back: forward, backward, recompute), TP's two
  all-reduces per layer per pass, FSDP's all-gathers (forward, backward) and reduce-scatter, DDP's all-reduce;
  over NVLink inside a node, InfiniBand across (a group spanning nodes is bound by its off-node share).
  Exposed: Ulysses' all-to-alls and TP's all-reduces wholly (the attention waits for them); FPDT's chunk
  all-to-all only where it is longer than the previous chunk's attention (the condition, per chunk); FSDP's
  prefetched all-gather where longer than a block's compute; DDP's all-reduce where longer than backward.
* **host transfers**: FPDT offload (each chunk's q/k/v/out/lse to the host once, the older kv chunks back for
  every segment in forward, q/out/grads per tile in backward), each hidden behind one tile's attention when
  shorter; activation offload (each checkpointed layer input out in forward, in for backward, behind one
  layer's compute); ``cpu_offload``'s shards in and gradients out per block.
* **a CPU "device"** (:func:`calibrate_cpu`): its ranks share ``cores``; with more ranks than cores every term
  takes ``ranks / cores`` times longer (time slicing), and nothing overlaps (``overlap=False``).
* **optimizer**: AdamW reads and writes ~10 bytes per parameter byte-width (param, grad, 2 states, the foreach
  temporary, the clip's norm) of the rank's shard: device memory, or under ``cpu_offload`` the host's DRAM,
  shared by the host's ranks.

``step_time = compute + exposed communication + exposed host transfers + optimizer``; ``binding`` names the
largest. MFU is PaLM's: model FLOPs (``6·N_matmul + 12·L·H·hd·K`` per token, causal halved, recompute never
counted; for attention-only models equal to :func:`lightning_longctx.planner.flops.flops_per_token` without
``document_length``, hybrids count their attention layers only) per device per second over the data-sheet
peak. ``hfu`` counts what runs: recompute included (Megatron's convention for
checkpointing), causal still halved.

Blind spots: data loading, the first step's compilation and allocator warm-up, stragglers and network
contention from other jobs, the recurrent layers' scans of hybrid models (their projections are counted), MoE,
pipeline parallelism, gradient accumulation, fp8, and kernel rates at shapes far from the table's (head dims
other than 128). The device table is per kind, not per machine: a slower NIC or PCIe switch moves the
communication terms; pass your own rates (``DeviceSpec``, ``--device-spec``).
"""

from __future__ import annotations

import inspect
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_longctx.planner.devices import DeviceSpec, KernelRate, device_spec
from lightning_longctx.planner.layout import _Layout, build_layout
from lightning_longctx.planner.plan import resolve_parallel
from lightning_longctx.planner.shapes import ATTENTION, _as_config, model_shape, text_config

# Operators launched per decoder layer and forward-equivalent pass in eager PyTorch: a Hugging Face Llama layer's
# forward + backward + its AdamW share dispatch 264 aten ops (counted with a dispatch mode, torch 2.13), a third
# of that per pass (backward launches about twice the forward's). FPDT adds per score tile, MLP tile, loss chunk.
OPS_PER_LAYER = 88
OPS_PER_FPDT_TILE = 15
OPS_PER_MLP_TILE = 8
OPS_PER_LOSS_CHUNK = 15
#: a step's operators outside the layers: embedding, final norm, loss, foreach AdamW (the same count: 94)
OPS_OPTIMIZER = 94
#: elementwise bytes moved per loss token per vocabulary entry (logits written, fp32 softmax read/written forward
#: and backward, the logits' gradient)
LOSS_BYTES_PER_VOCAB = 24
#: AdamW bytes per parameter byte: read param, grad, exp_avg, exp_avg_sq; write param and both states; the
#: foreach temporary (write and read); the gradient clip's norm (read grad)
OPTIMIZER_BYTES_PER_PARAM_BYTE = 10
#: DDP's last gradient bucket (25 MiB): its all-reduce starts when backward ends
DDP_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class TimeComponent:
    """One priced piece of a step: its seconds, the seconds it adds to the step (exposed), its kind
    (``compute``, ``communication``, ``host transfers``, ``optimizer``) and a note."""

    name: str
    kind: str
    seconds: float
    exposed: float
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class StepTimeEstimate:
    """One training step's time, throughput and MFU on one device kind (module docstring for the model).

    ``tokens_per_s`` is global (every dp replica's sequences, an SP group's sample counted once);
    ``mfu`` = model FLOP/s per device / ``peak_flops`` (PaLM: no recompute, causal halved); ``hfu`` the same
    with what runs (recompute counted, as Megatron's formula counts it; causal still halved)."""

    device: str
    kernel: str
    world_size: int
    gpus_per_node: int
    seq_len: int
    tokens_per_step: int
    step_time_s: float
    tokens_per_s: float
    model_flops_per_device: float
    hardware_flops_per_device: float
    peak_flops: float
    mfu: float
    hfu: float
    compute_s: float
    exposed_communication_s: float
    exposed_host_s: float
    optimizer_s: float
    binding: str
    components: tuple[TimeComponent, ...]
    max_steps: int | None = None

    @property
    def wall_time_s(self) -> float | None:
        """Seconds of ``max_steps`` steps (None without ``max_steps``)."""
        return None if self.max_steps is None else self.max_steps * self.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "kernel": self.kernel, "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node, "seq_len": self.seq_len, "tokens_per_step": self.tokens_per_step,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "hfu": self.hfu,
            "model_tflops_per_device": self.model_flops_per_device / 1e12 / self.step_time_s,
            "hardware_tflops_per_device": self.hardware_flops_per_device / 1e12 / self.step_time_s,
            "peak_tflops": self.peak_flops / 1e12,
            "breakdown_s": {"compute": self.compute_s, "exposed_communication": self.exposed_communication_s,
                            "exposed_host_transfers": self.exposed_host_s, "optimizer": self.optimizer_s},
            "binding": self.binding, "max_steps": self.max_steps, "wall_time_s": self.wall_time_s,
            "components": [vars(c) for c in self.components],
        }  # fmt: skip

    def table(self) -> str:
        """The estimate as text: the headline, the breakdown and each component."""
        lines = [
            f"step time on {self.world_size} x {self.device} ({self.kernel} attention, {self.gpus_per_node} per "
            f"node): {format_seconds(self.step_time_s)}; {self.tokens_per_s:,.0f} tokens/s",
            f"MFU {100 * self.mfu:.1f} % (model FLOPs: no recompute, causal attention halved; PaLM)  "
            f"HFU {100 * self.hfu:.1f} % (hardware FLOPs: recompute counted, as Megatron's formula)",
            f"breakdown: compute {format_seconds(self.compute_s)}, exposed communication "
            f"{format_seconds(self.exposed_communication_s)}, exposed host transfers "
            f"{format_seconds(self.exposed_host_s)}, optimizer {format_seconds(self.optimizer_s)}; "
            f"binds: {self.binding}",
        ]
        if self.max_steps is not None:
            lines.append(f"max_steps {self.max_steps:,}: {format_seconds(self.wall_time_s or 0.0)} of steps")
        width = max(len(c.name) for c in self.components)
        lines.append(f"  {'component':<{width}}  {'kind':<15} {'seconds':>10} {'exposed':>10}  note")
        for c in self.components:
            lines.append(
                f"  {c.name:<{width}}  {c.kind:<15} {c.seconds:>10.4g} {c.exposed:>10.4g}  {c.note}".rstrip()
            )
        return "\n".join(lines)


def format_seconds(s: float) -> str:
    """``1.23 s`` / ``4.5 min`` / ``2.1 h`` / ``3.2 days``."""
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


# ---------------------------------------------------------------------------------------------------------
# The per-rank walk
# ---------------------------------------------------------------------------------------------------------


def _keys_per_query(row: int, window: int | None, document: int | None) -> float:
    """Keys a causal query attends to on average: ``w·(1 - w/2S)`` over documents of ``S`` tokens."""
    s = row if document is None else min(int(document), row)
    w = s if window is None else min(int(window), s)
    return w * (1.0 - w / (2.0 * s))


def _attention_windows(config: Any, lay: _Layout) -> list[int | None]:
    """The sliding window (None: full) of each attention layer, in order."""
    from lightning_longctx.planner.flops import _layer_windows

    windows = _layer_windows(text_config(_as_config(config)), lay.shape.layers)
    return [w for w, block in zip(windows, lay.blocks, strict=False) if ATTENTION in block.mixers]


@dataclass
class _Walk:
    """Seconds and FLOPs collected while walking one rank's step (mutable scratch, local to one estimate)."""

    components: list[TimeComponent]
    hardware_flops: float = 0.0

    def add(self, name: str, kind: str, seconds: float, exposed: float | None = None, note: str = "") -> None:
        exposed = seconds if exposed is None else exposed
        self.components.append(TimeComponent(name, kind, float(seconds), float(exposed), note))


def _link(dev: DeviceSpec, group: int, stride: int, gpus_per_node: int) -> tuple[float, float]:
    """(intra-node fraction, inter-node fraction) of the data a rank of a ``group``-rank collective exchanges,
    its peers ``stride`` ranks apart."""
    local = max(1, min(group, gpus_per_node // max(stride, 1)))
    if group <= 1:
        return 0.0, 0.0
    return (local - 1) / group, (group - local) / group


def _transfer_s(dev: DeviceSpec, nbytes: float, group: int, stride: int, gpus_per_node: int) -> float:
    """Seconds for one rank to send ``nbytes`` spread evenly over its group (itself included)."""
    intra, inter = _link(dev, group, stride, gpus_per_node)
    return max(nbytes * intra / dev.intra_node_bandwidth, nbytes * inter / dev.inter_node_bandwidth)


def estimate_step_time(
    config: Any,
    *,
    seq_len: int,
    sequence_parallel_size: int,
    gpu: str | DeviceSpec = "h100",
    gpus_per_node: int | None = None,
    attention_kernel: str | None = None,
    document_length: int | None = None,
    max_steps: int | None = None,
    **plan_kwargs: Any,
) -> StepTimeEstimate:
    """The time of one training step per rank, its throughput and MFU, on ``gpu``.

    Args:
        config: as :func:`~lightning_longctx.planner.plan_memory` (a transformers config or a ``model_type``
            dict); ``seq_len``, ``sequence_parallel_size`` and ``plan_kwargs`` are its keywords too (the same
            settings: ``mode``, ``fpdt_chunk_size``, ``offload``, ``activation_checkpointing``,
            ``activation_offload``, ``data_parallel``, ``cpu_offload``, ``tensor_parallel_size``,
            ``data_parallel_size``, ``micro_batch_size``, ``precision``, ...); memory-only ones are ignored.
        gpu: a device kind (``a100-40gb``, ``a100-80gb``, ``h100``, ``h200``, ``b200``) or a :class:`DeviceSpec`
            (a user-given device, or ``calibrate_cpu()``'s).
        gpus_per_node: devices per node (default: ``devices_per_host``, else 8, at most the world).
        attention_kernel: a kernel of the device's table (``fa2``, ``fa3``, ``cudnn``); default: the one this
            package runs there.
        document_length: tokens per packed document (attention never crosses one); None: one document per row.
        max_steps: to report the wall time of that many steps.
    """
    dev = device_spec(gpu)
    kernel = dev.kernel(attention_kernel)
    kernel_name = attention_kernel or dev.default_kernel
    if document_length is not None and (isinstance(document_length, bool) or int(document_length) < 1):
        raise ValueError(f"document_length={document_length!r} must be a positive number of tokens, or None")
    parallel_names = inspect.signature(resolve_parallel).parameters
    layout_names = inspect.signature(build_layout).parameters
    unknown = sorted(set(plan_kwargs) - set(parallel_names) - set(layout_names))
    if unknown:
        raise TypeError(
            f"estimate_step_time() got unknown keywords {unknown}; it takes plan_memory's keywords"
        )
    per_node = gpus_per_node or plan_kwargs.get("devices_per_host")
    shape = model_shape(config)
    parallel = resolve_parallel(
        sequence_parallel_size=sequence_parallel_size,
        attention_heads=shape.heads,
        **{
            k: v
            for k, v in plan_kwargs.items()
            if k in parallel_names and k not in ("devices_per_host", "attention_heads")
        },
        devices_per_host=per_node,
    )
    lay = build_layout(
        shape,
        parallel,
        seq_len=seq_len,
        **{k: v for k, v in plan_kwargs.items() if k in layout_names and k not in ("seq_len",)},
    )
    world = lay.dp * lay.sp * lay.tp
    per_node = min(per_node or 8, world) if dev.cores == 0 else (per_node or world)
    windows = _attention_windows(config, lay)
    walk = _Walk([])
    compute_parts = _compute(lay, dev, kernel, windows, document_length, walk)
    attention_times = compute_parts.pop("attention_tiles")
    share = max(1.0, min(per_node, world) / dev.cores) if dev.cores else 1.0  # CPU ranks sharing cores
    _communication(lay, dev, per_node, attention_times, parallel.settings.fpdt_overlap, compute_parts, walk)
    _host_transfers(lay, dev, attention_times, compute_parts, walk)
    _optimizer(lay, dev, per_node, walk)

    if share > 1.0:  # ranks time-slice the host's cores: everything a CPU does takes longer by that factor
        walk.components = [
            replace(c, seconds=c.seconds * share, exposed=c.exposed * share) for c in walk.components
        ]
    by_kind = {k: sum(c.exposed for c in walk.components if c.kind == k)
               for k in ("compute", "communication", "host transfers", "optimizer")}  # fmt: skip
    if dev.cores == 0:  # the host launches ahead of the device: only launches beyond the device's work show
        i, launches = next((i, c) for i, c in enumerate(walk.components) if c.name == "operator launches")
        device_compute = by_kind["compute"] - launches.exposed
        walk.components[i] = replace(launches, exposed=max(0.0, launches.seconds - device_compute))
        by_kind["compute"] = device_compute + walk.components[i].exposed
    step = sum(by_kind.values())
    binding = max(by_kind, key=lambda k: by_kind[k])

    tokens_rank = lay.t  # b * N / P
    model_per_token = _model_flops_per_token(lay, windows, document_length)
    model_flops = tokens_rank * model_per_token / lay.tp
    tokens_step = lay.b * lay.padded * lay.dp
    return StepTimeEstimate(
        device=dev.name, kernel=kernel_name, world_size=world, gpus_per_node=per_node, seq_len=lay.padded,
        tokens_per_step=tokens_step, step_time_s=step, tokens_per_s=tokens_step / step,
        model_flops_per_device=model_flops, hardware_flops_per_device=walk.hardware_flops,
        peak_flops=dev.peak_flops, mfu=model_flops / step / dev.peak_flops,
        hfu=walk.hardware_flops / step / dev.peak_flops, compute_s=by_kind["compute"],
        exposed_communication_s=by_kind["communication"], exposed_host_s=by_kind["host transfers"],
        optimizer_s=by_kind["optimizer"], binding=binding, components=tuple(walk.components), max_steps=max_steps,
    )  # fmt: skip


def _model_flops_per_token(lay: _Layout, windows: list[int | None], document: int | None) -> float:
    """PaLM's model FLOPs per token (training: 3 x forward, causal halved, no recompute), all TP ranks."""
    s = lay.shape
    keys = sum(_keys_per_query(lay.padded, w, document) for w in windows)
    return 6.0 * s.matmul_params + 12.0 * s.heads * s.head_dim * keys


def _compute(
    lay: _Layout,
    dev: DeviceSpec,
    kernel: KernelRate,
    windows: list[int | None],
    document: int | None,
    walk: _Walk,
) -> dict[str, Any]:
    """Matmul, attention, elementwise and launch time of one rank's step; returns per-layer times the
    overlap conditions compare with, and the attention of each FPDT tile (``attention_tiles``)."""
    s, t, m, r = lay.shape, lay.t, lay.m, lay.r
    tp, fpdt, ckpt = lay.tp, lay.fpdt, lay.checkpointing
    mm_rate = dev.matmul_flops * (1.0 if m <= 2 or dev.cores else 0.5)  # fp32 on a GPU: TF32 at half rate

    # ---- matmuls ----
    head = lay.head_local
    blocks = lay.matmul_local - head
    mlp = lay.mlp_layers * lay.mlp_weights
    block_passes = 3 + (1 if ckpt else 0)  # forward, backward (2), checkpoint recompute
    mlp_extra = 1 if fpdt else 0  # the tiled MLP recomputes each tile in backward
    head_passes = 3 + (1 if fpdt else 0)  # the chunked loss recomputes the logits in backward
    mm_flops = 2.0 * t * (blocks * block_passes + mlp * mlp_extra + head * head_passes)
    walk.hardware_flops += mm_flops
    recompute = 2.0 * t * (blocks * (block_passes - 3) + mlp * mlp_extra + head * (head_passes - 3))
    walk.add("matmuls", "compute", mm_flops / mm_rate,
             note=f"{mm_flops / 1e12:.4g} TFLOP ({recompute / 1e12:.3g} recompute) at {mm_rate / 1e12:.4g} TFLOP/s")  # fmt: skip

    # ---- attention ----
    hd, h = s.head_dim, lay.heads_per_rank
    row = lay.padded
    tiles: tuple[float, int] | None = None  # FPDT: (one full tile's forward seconds, segments per layer)
    attn_s = 0.0
    pass_s = [
        0.0,
        0.0,
    ]  # one forward and one backward pass of the attention layers (the ring's steps hide in them)
    fwd_flops_total = 0.0
    ring = lay.ring
    # tokens of one kernel call's queries and keys: FPDT's segment, a ring's zigzag chunk, else the row
    seg = lay.segment // lay.b if fpdt else row // (2 * ring) if ring > 1 else row
    u = max(1, lay.t // (lay.b * lay.chunk)) if fpdt else 1  # FPDT: segments per row
    for w in windows:
        keys = _keys_per_query(row, w, document)
        f = 4.0 * h * hd * lay.bn * keys  # forward FLOPs of one layer on this rank (a ring: bn = b N / r)
        call = min(seg, document or row, w or row)
        rf, rb = kernel.rates(call, causal=True)
        if ring > 1 and document is None and w is None:
            # a ring rank's 2 causal diagonal chunk blocks (half each) of its 2r chunk-block equivalents, the rest
            # full blocks: the diagonal's share is 1 / (2r)
            diag = f / (2 * ring)
            ff, fb = kernel.rates(call, causal=False)
            fwd, bwd = diag / rf + (f - diag) / ff, 2.5 * diag / rb + 2.5 * (f - diag) / fb
            seconds = fwd * (2 if ckpt else 1) + bwd
            pass_s[0] += fwd
            pass_s[1] += bwd
        elif fpdt and u > 1 and document is None and w is None:
            # u causal diagonal tiles (half) and u(u-1)/2 full tiles below them: u^2/2 full-tile equivalents
            diag = f / u**2  # the diagonal tiles' share: u / 2 of u^2 / 2
            ff, fb = kernel.rates(call, causal=False)
            seconds = diag / rf * (2 if ckpt else 1) + 2.5 * diag / rb
            seconds += (f - diag) / ff * (2 if ckpt else 1) + 2.5 * (f - diag) / fb
        else:
            seconds = f / rf * (2 if ckpt else 1) + 2.5 * f / rb
            pass_s[0] += f / rf
            pass_s[1] += 2.5 * f / rb
        attn_s += seconds
        fwd_flops_total += f
    n_attn = len(windows)
    walk.hardware_flops += fwd_flops_total * (3 + (1 if ckpt else 0))
    if n_attn:
        walk.add("attention", "compute", attn_s,
                 note=f"{_kernel_note(kernel)}; {fwd_flops_total / 1e12:.4g} TFLOP forward"
                 + (" + recompute" if ckpt else ""))  # fmt: skip
    if fpdt and n_attn:
        # one full tile's forward: a layer's forward FLOPs over its u^2/2 full-tile equivalents
        tile_s = fwd_flops_total / n_attn / (u * u / 2.0) / kernel.rates(seg, causal=u == 1)[0]
        tiles = (tile_s, u)

    # ---- elementwise (memory-bound): bytes per token of a forward, backward moving twice that ----
    inter = lay.inter_tp
    q_w, kv_w = s.heads * hd // tp, s.kv_heads * hd // tp
    # an RMSNorm (HF's: fp32 upcast, pow, mean, scale, downcast, weight) and a residual add per sub-block
    norm_residual = (20 + 3 * r) * s.d + 3 * r * s.d
    # RoPE on q and k (two products, rotate_half's neg and cat, the sum: ~10 passes), the layout copies of
    # q / k / v / out around the attention, the o_proj input's reshape
    attn_bytes = norm_residual + 10 * m * (q_w + kv_w) + 2 * m * (2 * q_w + 2 * kv_w) + 2 * m * q_w
    mlp_bytes = norm_residual + 5 * inter * m  # act(gate) and act * up
    layer_passes = 3 + (1 if ckpt else 0)
    ew = t * layer_passes * (lay.attention_layers * attn_bytes + lay.mlp_layers * mlp_bytes)
    ew += t * mlp_extra * lay.mlp_layers * 5 * inter * m
    ew += t * LOSS_BYTES_PER_VOCAB * lay.vocab_local
    if fpdt and lay.attention_layers:
        # per (segment, kv chunk) tile: q / k / v into the kernel's layout, its output to fp32 and the online
        # softmax merge (~5 fp32 passes); backward: dout / q / k / v / out in, dq / dk / dv out, their fp32 sums
        hq, hkv, seg_hd = lay.heads_per_rank, lay.kv_per_rank, lay.segment * hd
        fwd_tile = seg_hd * (2 * m * (hq + 2 * hkv) + (m + 4) * hq + 20 * hq)
        bwd_tile = seg_hd * (2 * m * (3 * hq + 2 * hkv) + 2 * m * (hq + 2 * hkv) + (8 + m) * (hq + 2 * hkv))
        n_tiles = u * (u + 1) // 2
        ew += lay.attention_layers * n_tiles * (fwd_tile * (2 if ckpt else 1) + bwd_tile)
    if lay.casting:  # autocast casts each weight per pass (forward, recompute, backward)
        ew += lay.matmul_local * (lay.pw + m) * (2 + (1 if ckpt else 0))
    walk.add("elementwise", "compute", ew / dev.memory_bandwidth,
             note=f"{ew / 2**30:.3g} GiB through memory at {dev.memory_bandwidth / 1e9:.4g} GB/s")  # fmt: skip

    # ---- operator launches ----
    layers = s.layers
    ops = OPS_PER_LAYER * layers * layer_passes
    if fpdt:
        u = max(1, lay.t // (lay.b * lay.chunk))
        ops += OPS_PER_FPDT_TILE * lay.attention_layers * (u * (u + 1) // 2) * (3 + (1 if ckpt else 0))
        mlp_tiles = -(-lay.t // (lay.b * (lay.mlp_chunk or lay.chunk)))
        ops += OPS_PER_MLP_TILE * lay.mlp_layers * mlp_tiles * (4 + (1 if ckpt else 0))
        loss_chunks = -(-lay.t // (lay.loss_chunk or lay.t))
        ops += OPS_PER_LOSS_CHUNK * loss_chunks * 4
    else:
        ops += OPS_PER_LOSS_CHUNK * 3
    ops += OPS_OPTIMIZER
    walk.add("operator launches", "compute", ops * dev.op_latency,
             note=f"{ops:,} ops x {dev.op_latency * 1e6:.3g} us" + ("" if dev.cores else " (hidden while the device is busy)"))  # fmt: skip

    per_layer_compute = sum(
        c.seconds for c in walk.components if c.kind == "compute" and c.name != "operator launches"
    )
    return {
        "attention_tiles": tiles,
        "attention_pass_s": tuple(
            x / max(n_attn, 1) for x in pass_s
        ),  # one attention layer's forward, backward
        "layer_s": per_layer_compute / max(layers, 1),
        "backward_s": per_layer_compute * 2.0 / (3 + (1 if ckpt else 0)),
    }


def _kernel_note(kernel: KernelRate) -> str:
    return f"fwd {kernel.forward / 1e12:.4g} / bwd {kernel.backward / 1e12:.4g} TFLOP/s at {kernel.reference_tokens} keys"


def _communication(
    lay: _Layout,
    dev: DeviceSpec,
    per_node: int,
    tiles: tuple[float, int] | None,
    overlap: bool,
    parts: dict[str, Any],
    walk: _Walk,
) -> None:
    s, t, m, tp = lay.shape, lay.t, lay.m, lay.tp
    ckpt = lay.checkpointing
    passes = 2 + (1 if ckpt else 0)  # forward, backward, recompute
    hd = s.head_dim
    # ---- Ulysses / FPDT all-to-all: q, k, v to head layout, out back (backward: the gradients); with a ring over
    # the U = P / r adjacent ranks of one Ulysses group, kv heads spread for U ----
    U = lay.ulysses
    if U > 1 and lay.attention_layers:
        q_heads, kv_heads = s.heads // tp, lay.kv_heads
        per_layer = t * hd * m * (2 * q_heads + 2 * kv_heads) * (U - 1) / U
        one = _transfer_s(dev, per_layer, U, tp, per_node)
        total = one * lay.attention_layers * passes
        if lay.fpdt and overlap and dev.overlap and tiles:
            tile_s, u = tiles
            chunk_a2a = one / u
            # chunk i+1's all-to-all travels while segment i attends to kv 0..i (i + 1/2 tiles)
            exposed_layer = chunk_a2a + sum(
                max(0.0, chunk_a2a - (i + 0.5) * tile_s) for i in range(min(u - 1, 4096))
            )
            exposed = exposed_layer * lay.attention_layers * passes
            note = f"per chunk {chunk_a2a * 1e3:.3g} ms vs a tile's attention {tile_s * 1e3:.3g} ms: hidden when shorter"
        else:
            exposed, note = total, "on the critical path (the attention waits for it)"
        walk.add("sequence all-to-all", "communication", total, exposed,
                 note=f"{per_layer * lay.attention_layers * passes / 2**30:.3g} GiB sent; {note}")  # fmt: skip
    if lay.ring > 1 and lay.attention_layers:
        _ring_passes(lay, dev, per_node, parts["attention_pass_s"], walk)
    # ---- tensor parallelism: two all-reduces per layer per pass ----
    if tp > 1:
        nbytes = 2.0 * (tp - 1) / tp * t * s.d * m
        seconds = 2 * s.layers * passes * _transfer_s(dev, nbytes, tp, 1, per_node)
        walk.add(
            "tensor-parallel all-reduce", "communication", seconds, note="2 per layer per pass, blocking"
        )
    # ---- FSDP / DDP ----
    n = lay.dp * lay.sp
    if n > 1 and lay.data_parallel == "fsdp":
        block = lay.block_local
        gather = block * lay.pw * (n - 1) / n
        scatter = block * lay.w * (n - 1) / n
        gather_s = _transfer_s(dev, gather, n, tp, per_node)
        scatter_s = _transfer_s(dev, scatter, n, tp, per_node)
        layer = parts["layer_s"]
        fwd_layer = layer / (3 + (1 if ckpt else 0))
        bwd_layer = layer - fwd_layer
        if dev.overlap:
            exposed = gather_s + s.layers * (
                max(0.0, gather_s - fwd_layer) + max(0.0, gather_s + scatter_s - bwd_layer)
            )
        else:
            exposed = s.layers * (2 * gather_s + scatter_s)
        root = _transfer_s(dev, lay.root_local * lay.pw * (n - 1) / n, n, tp, per_node)
        walk.add("FSDP all-gather / reduce-scatter", "communication", s.layers * (2 * gather_s + scatter_s) + root,
                 exposed + root, note="prefetched: exposed where longer than a block's compute")  # fmt: skip
    elif n > 1:
        nbytes = 2.0 * (n - 1) / n * lay.trainable * lay.w
        seconds = _transfer_s(dev, nbytes, n, tp, per_node)
        last = seconds * min(1.0, DDP_BUCKET_BYTES / max(lay.trainable * lay.w, 1))
        exposed = max(0.0, seconds - parts["backward_s"]) + last if dev.overlap else seconds
        walk.add(
            "DDP all-reduce", "communication", seconds, exposed, note="overlaps backward but the last bucket"
        )


def ring_pass_bytes(lay: _Layout) -> tuple[int, int]:
    """Bytes one rank sends in the ring passes of one attention layer, ``(forward, backward)``
    (``attention/ring.py``): forward ``(r - 1)`` k/v blocks ``B`` (``2 b (N/r) (H_kv'/U) hd`` elements in the k/v
    dtype), backward ``(r - 1)`` again plus ``r`` hops of the fp32 dk/dv blocks."""
    r, blk = lay.ring, lay.ring_block_bytes
    dblk = 2 * lay.kv_elems * lay.ct
    return (r - 1) * blk, (r - 1) * blk + r * dblk


def _ring_passes(
    lay: _Layout, dev: DeviceSpec, per_node: int, attention_s: tuple[float, float], walk: _Walk
) -> None:
    """The ring's k/v (and in backward dk/dv) passes to the next ring rank, ``U * tp`` ranks away: over NVLink
    while the sp x tp ranks fit a node, else bound by the inter-node link. Each step's message travels while the
    step's blocks compute (a forward step is 1/r of the layer's attention forward): exposed where longer, the
    overlap condition ``N/r >= (H_kv'/H) e F / B`` (U cancels); all of it on a device that does not overlap."""
    r, ckpt = lay.ring, lay.checkpointing
    bw = dev.inter_node_bandwidth if lay.sp * lay.tp > per_node else dev.intra_node_bandwidth
    blk, dblk = lay.ring_block_bytes, 2 * lay.kv_elems * lay.ct
    fwd_bytes, bwd_bytes = ring_pass_bytes(lay)
    fwd_passes = 2 if ckpt else 1  # the recompute runs the ring's forward again
    total = (fwd_passes * fwd_bytes + bwd_bytes) / bw
    if dev.overlap:
        fwd_step, bwd_step = attention_s[0] / r, attention_s[1] / r
        exposed = fwd_passes * (r - 1) * max(0.0, blk / bw - fwd_step)
        exposed += sum(max(0.0, ((blk if t < r - 1 else 0) + dblk) / bw - bwd_step) for t in range(r))
        note = (
            f"a {blk / 2**20:.4g} MiB k/v step in {blk / bw * 1e3:.3g} ms vs its blocks' forward "
            f"{fwd_step * 1e3:.3g} ms: hidden when shorter"
        )
    else:
        exposed, note = total, "not overlapped on this device"
    layers = lay.attention_layers
    sent = (fwd_passes * fwd_bytes + bwd_bytes) * layers / 2**30
    walk.add("ring passes", "communication", total * layers, exposed * layers,
             note=f"{sent:.3g} GiB sent (ring {r}, {'inter' if lay.sp * lay.tp > per_node else 'intra'}-node); {note}")  # fmt: skip


def _host_transfers(
    lay: _Layout, dev: DeviceSpec, tiles: tuple[float, int] | None, parts: dict[str, Any], walk: _Walk
) -> None:
    s, ckpt = lay.shape, lay.checkpointing
    link = dev.host_link_bandwidth
    if lay.fpdt and lay.offload and lay.attention_layers and tiles:
        tile_s, u = tiles
        hd, h, kv = s.head_dim, lay.heads_per_rank, lay.kv_per_rank
        seg = lay.segment  # tokens of one segment (b included)
        kv_bytes = seg * kv * hd * 2 * lay.m
        q_bytes = seg * h * hd * lay.qa
        # to the host once: q, out, k, v, lse of every chunk; back: the older kv chunks for every segment in
        # forward; in backward each outer step's kv chunk, and per tile q, out, dout and lse
        store = u * (2 * q_bytes + kv_bytes + seg * h * 4)
        fetch_fwd = u * (u - 1) / 2 * kv_bytes
        fetch_bwd = u * kv_bytes + u * (u + 1) / 2 * (3 * q_bytes + seg * h * 4)
        passes_fwd = 2 if ckpt else 1
        total = (passes_fwd * (store + fetch_fwd) + fetch_bwd) / link
        if dev.overlap:
            per_fetch_fwd, per_fetch_bwd = kv_bytes / link, (3 * q_bytes + seg * h * 4) / link
            exposed = passes_fwd * u * (u - 1) / 2 * max(0.0, per_fetch_fwd - tile_s)
            exposed += u * (u + 1) / 2 * max(0.0, per_fetch_bwd - 2.5 * tile_s)
        else:
            exposed = total
        walk.add("FPDT offload", "host transfers", total * lay.attention_layers, exposed * lay.attention_layers,
                 note="each fetch hidden behind one tile's attention when shorter")  # fmt: skip
    if lay.activation_offload:
        nbytes = lay.t * s.d * lay.r
        one = nbytes / link
        layer = parts["layer_s"]
        exposed = (
            s.layers * (max(0.0, one - layer / 4) + max(0.0, one - layer / 2))
            if dev.overlap
            else 2 * s.layers * one
        )
        walk.add("activation offload", "host transfers", 2 * s.layers * one, exposed,
                 note=f"{nbytes / 2**20:.4g} MiB per layer out and back, behind a layer's compute")  # fmt: skip
    if lay.cpu_offload:
        n = lay.shard
        shard = lay.block_local * lay.w / n
        per_block = shard / link
        seconds = s.layers * 3 * per_block + lay.root_local * lay.w / n / link
        layer = parts["layer_s"]
        exposed = s.layers * max(0.0, 3 * per_block - layer) if dev.overlap else seconds
        walk.add("cpu_offload shards", "host transfers", seconds, exposed,
                 note="each block's shard in twice, its gradient out once")  # fmt: skip


def _optimizer(lay: _Layout, dev: DeviceSpec, per_node: int, walk: _Walk) -> None:
    if not lay.states and lay.optimizer != "sgd":
        return
    nbytes = OPTIMIZER_BYTES_PER_PARAM_BYTE * lay.grad_bytes
    if lay.cpu_offload:  # the host's DRAM, shared by the node's ranks
        seconds = nbytes * per_node / dev.host_memory_bandwidth
        note = f"on the host: {per_node} ranks share {dev.host_memory_bandwidth / 1e9:.4g} GB/s"
    else:
        seconds = nbytes / dev.memory_bandwidth
        note = "on the device"
    walk.add("optimizer step", "optimizer", seconds, note=f"{nbytes / 2**30:.3g} GiB moved {note}")


# ---------------------------------------------------------------------------------------------------------
# A CPU, measured
# ---------------------------------------------------------------------------------------------------------


def calibrate_cpu(*, path: str | Path | None = None, threads: int = 1, seconds: float = 1.0) -> DeviceSpec:
    """Measure this machine as a "device" for :func:`estimate_step_time` (``gpu=calibrate_cpu()``), in ~10 s:
    fp32 matmul FLOP/s (a linear layer's forward, input-gradient and weight-gradient GEMMs), the fused CPU
    attention kernel's forward / backward FLOP/s, causal and full, at 256 to 8192 tokens, a copy's memory
    bandwidth, the host time per operator of an eager Hugging Face step, and gloo's all-to-all bandwidth
    between two local processes. Rates are per ``threads`` threads (one rank); ``cores`` = ``os.cpu_count()``.
    ``path``: also write it as JSON (:func:`~lightning_longctx.planner.devices.load_spec` reads it back)."""
    import torch

    torch.set_num_threads(threads)
    budget = max(0.02, seconds / 26)  # 26 timed pieces

    def rate(fn: Any, work: float) -> float:
        fn()
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed > budget:
                return work * n / elapsed

    # the three GEMMs of a linear layer's training step: forward, input gradient, weight gradient (K = tokens)
    x, w, dy = torch.randn(4096, 256), torch.randn(256, 768), torch.randn(4096, 768)
    gemms = ((x, w), (dy, w.t()), (x.t(), dy))
    work = 2.0 * 4096 * 256 * 768
    matmul = 3 * work / sum(work / rate(lambda a=a, b=b: a @ b, work) for a, b in gemms)
    x = torch.empty(32 << 20)  # 128 MiB: past the caches
    y = torch.empty_like(x)
    bandwidth = rate(lambda: y.copy_(x), 2.0 * x.numel() * 4)
    latency = _eager_op_latency(rate)
    lengths = (256, 512, 1024, 2048, 4096, 8192)
    measured = tuple(
        (n, *_cpu_attention_rates(n, budget, True), *_cpu_attention_rates(n, budget, False)) for n in lengths
    )
    ref = measured[lengths.index(2048)]
    a2a = _gloo_all_to_all_bandwidth(budget)
    cores = os.cpu_count() or 1
    spec = DeviceSpec(
        name=f"CPU ({cores} cores, {threads} thread(s) per rank, measured)",
        peak_flops=matmul, matmul_flops=matmul,
        attention={"cpu-flash": KernelRate(ref[1], ref[2], half_tokens=0, reference_tokens=2048, measured=measured)},
        default_kernel="cpu-flash", memory_bandwidth=bandwidth, intra_node_bandwidth=a2a,
        inter_node_bandwidth=a2a, host_link_bandwidth=bandwidth, host_memory_bandwidth=bandwidth,
        device_memory=_host_memory_bytes(), op_latency=latency, overlap=False, cores=cores,
        source=f"calibrate_cpu() at {time.strftime('%Y-%m-%d %H:%M:%S')}, load average {os.getloadavg()[0]:.2f}",
    )  # fmt: skip
    if path is not None:
        Path(path).write_text(json.dumps(spec.to_dict(), indent=2))
    return spec


def _eager_op_latency(rate: Any) -> float:
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

    return 1.0 / rate(step, 1.0) / (OPS_OPTIMIZER + 3 * OPS_PER_LAYER)


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


def _gloo_all_to_all_bandwidth(budget: float) -> float:
    """Bytes per second one of two local gloo ranks sends in ``all_to_all_single`` (4 MiB per rank). The ranks
    are fresh interpreters (``python -c``), so calibrating works from any script, ``__main__`` guard or not."""
    import subprocess
    import sys

    port = _free_port()
    code = "import sys; from lightning_longctx.planner.step_time import _a2a_worker as w; w(*map(float, sys.argv[1:]))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), "2", str(port), str(budget)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(
            f"calibrate_cpu: the gloo all-to-all ranks failed (exit codes {[p.returncode for p in procs]})"
        )
    return min(float(out.strip().splitlines()[-1]) for out in outs)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _a2a_worker(rank: float, world: float, port: float, budget: float) -> None:
    """One rank of :func:`_gloo_all_to_all_bandwidth`: prints the bytes per second it sent."""
    import torch
    import torch.distributed as dist

    from lightning_longctx.parallel import comm

    torch.set_num_threads(1)
    r, n = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port)}", rank=r, world_size=n)
    try:
        x = torch.randn(1 << 20)  # 4 MiB, half of it to the peer
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)  # the measured collective itself (the one raw call outside comm.py)
        comm.barrier()
        count, start = 0, time.perf_counter()
        while True:
            dist.all_to_all_single(y, x)
            count += 1
            flag = torch.tensor([int(time.perf_counter() - start > budget)])
            comm.all_reduce_(flag, op="min")
            if flag.item():
                break
        print(count * x.numel() * 4 * (n - 1) / n / (time.perf_counter() - start), flush=True)
    finally:
        dist.destroy_process_group()


def cpu_spec(path: str | Path | None = None) -> DeviceSpec:
    """The CPU spec stored at ``path`` when it exists, else a fresh :func:`calibrate_cpu` (written there)."""
    from lightning_longctx.planner.devices import load_spec

    if path is not None and Path(path).is_file():
        return load_spec(path)
    return calibrate_cpu(path=path)


__all__ = [
    "StepTimeEstimate",
    "TimeComponent",
    "calibrate_cpu",
    "cpu_spec",
    "estimate_step_time",
    "format_seconds",
]
