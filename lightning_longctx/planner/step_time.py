"""How long one training step takes: a step-time and MFU model beside the memory planner.

:func:`estimate_step_time` walks what one rank holds, as :func:`~lightning_longctx.planner.plan_memory` does
(``plan_per_rank``: tokens per rank, heads after the all-to-all, FPDT chunks, checkpointing, offloads, tp,
FSDP) and prices each piece of work with a device's achieved rates (:mod:`~lightning_longctx.planner.devices`; a CPU's
are measured by ``benchmarks/calibrate_step_time.py``, outside the package, and read back with
``devices.load_spec``). Per rank, one optimizer step of ``micro_batch_size`` sequences, with ``t`` local
tokens, ``N`` the padded sequence, ``K`` the keys a query attends to:

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
* **a CPU "device"** (a calibration file): its ranks share ``cores``; with more ranks than cores every term
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
from dataclasses import dataclass, replace
from typing import Any

from lightning_longctx.config import DataParallel
from lightning_longctx.planner.devices import DeviceSpec, KernelRate, device_spec
from lightning_longctx.planner.per_rank import _PerRank, build_per_rank
from lightning_longctx.planner.plan import plan_per_rank, resolve_parallel
from lightning_longctx.planner.shapes import ATTENTION, _as_config, text_config

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


def _attention_windows(config: Any, lay: _PerRank) -> list[int | None]:
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


def _link(group: int, stride: int, gpus_per_node: int) -> tuple[float, float]:
    """(intra-node share, inter-node share) of the bytes a rank of a ``group``-rank collective sends, its peers
    ``stride`` ranks apart: the ``group - 1`` peers split by where they sit (``local - 1`` on the rank's node)."""
    if group <= 1:
        return 0.0, 0.0
    local = max(1, min(group, gpus_per_node // max(stride, 1)))
    return (local - 1) / (group - 1), (group - local) / (group - 1)


def _transfer_s(dev: DeviceSpec, sent: float, group: int, stride: int, gpus_per_node: int) -> float:
    """Seconds for a collective in which one rank sends ``sent`` bytes to its peers.

    One convention for every collective, NCCL's bus bandwidth (nccl-tests' ``busbw``): the device's link rates
    are bytes a rank sends per second, and each caller passes the bytes a rank sends: ``(n-1)/n`` of the
    buffer for an all-to-all, all-gather or reduce-scatter of ``n`` ranks, ``2(n-1)/n`` for an all-reduce.
    The share that goes to peers on other nodes rides the inter-node link, concurrently with the rest."""
    intra, inter = _link(group, stride, gpus_per_node)
    return max(sent * intra / dev.intra_node_bandwidth, sent * inter / dev.inter_node_bandwidth)


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
            (a user-given device, or a CPU's calibration: ``load_spec`` of what
            ``benchmarks/calibrate_step_time.py`` writes).
        gpus_per_node: devices per node (default: ``devices_per_host``, else 8, at most the world).
        attention_kernel: a kernel of the device's table (``fa2``, ``fa3``, ``cudnn``); default: the one this
            package runs there.
        document_length: tokens per packed document (attention never crosses one); None: one document per row.
        max_steps: to report the wall time of that many steps.
    """
    dev = device_spec(gpu)
    kernel = dev.kernel(attention_kernel)
    _check_step_keywords(document_length, plan_kwargs)
    per_node = gpus_per_node or plan_kwargs.get("devices_per_host")
    lay = plan_per_rank(
        config,
        seq_len=seq_len,
        sequence_parallel_size=sequence_parallel_size,
        **{**plan_kwargs, "devices_per_host": per_node},
    )
    world = lay.dp * lay.sp * lay.tp
    per_node = min(per_node or 8, world) if dev.cores == 0 else (per_node or world)
    windows = _attention_windows(config, lay)
    walk = _price_step(lay, dev, kernel, windows, document_length, per_node)
    by_kind = _exposed_by_kind(walk, dev)
    step = sum(by_kind.values())
    binding = max(by_kind, key=lambda k: by_kind[k])
    model_flops = lay.t * _model_flops_per_token(lay, windows, document_length) / lay.tp  # t = b * N / P
    tokens_step = lay.b * lay.padded * lay.dp
    return StepTimeEstimate(
        device=dev.name, kernel=attention_kernel or dev.default_kernel, world_size=world, gpus_per_node=per_node,
        seq_len=lay.padded, tokens_per_step=tokens_step, step_time_s=step, tokens_per_s=tokens_step / step,
        model_flops_per_device=model_flops, hardware_flops_per_device=walk.hardware_flops,
        peak_flops=dev.peak_flops, mfu=model_flops / step / dev.peak_flops,
        hfu=walk.hardware_flops / step / dev.peak_flops, compute_s=by_kind["compute"],
        exposed_communication_s=by_kind["communication"], exposed_host_s=by_kind["host transfers"],
        optimizer_s=by_kind["optimizer"], binding=binding, components=tuple(walk.components), max_steps=max_steps,
    )  # fmt: skip


def _check_step_keywords(document_length: int | None, plan_kwargs: dict[str, Any]) -> None:
    """:func:`estimate_step_time`'s own checks: a positive ``document_length``, plan_memory's keywords only."""
    if document_length is not None and (isinstance(document_length, bool) or int(document_length) < 1):
        raise ValueError(f"document_length={document_length!r} must be a positive number of tokens, or None")
    names = set(inspect.signature(resolve_parallel).parameters) | set(
        inspect.signature(build_per_rank).parameters
    )
    unknown = sorted(set(plan_kwargs) - names)
    if unknown:
        raise TypeError(
            f"estimate_step_time() got unknown keywords {unknown}; it takes plan_memory's keywords"
        )


def _price_step(
    lay: _PerRank,
    dev: DeviceSpec,
    kernel: KernelRate,
    windows: list[int | None],
    document: int | None,
    per_node: int,
) -> _Walk:
    """Every priced piece of one rank's step, in order: compute, communication, host transfers, optimizer. A
    CPU's ranks time-slice the host's cores: with more ranks on a node than cores, each piece takes that much
    longer."""
    walk = _Walk([])
    times = _compute(lay, dev, kernel, windows, document, walk)
    _communication(lay, dev, per_node, times, walk)
    _host_transfers(lay, dev, times, walk)
    _optimizer(lay, dev, per_node, walk)
    world = lay.dp * lay.sp * lay.tp
    share = max(1.0, min(per_node, world) / dev.cores) if dev.cores else 1.0  # CPU ranks sharing cores
    if share > 1.0:
        walk.components = [
            replace(c, seconds=c.seconds * share, exposed=c.exposed * share) for c in walk.components
        ]
    return walk


def _exposed_by_kind(walk: _Walk, dev: DeviceSpec) -> dict[str, float]:
    """The seconds each kind of piece adds to the step. On a device (not a CPU) the host launches ahead of it:
    only the launches beyond the device's work show (the launches' component is updated to say so)."""
    by_kind = {k: sum(c.exposed for c in walk.components if c.kind == k)
               for k in ("compute", "communication", "host transfers", "optimizer")}  # fmt: skip
    if dev.cores == 0:
        i, launches = next((i, c) for i, c in enumerate(walk.components) if c.name == "operator launches")
        device_compute = by_kind["compute"] - launches.exposed
        walk.components[i] = replace(launches, exposed=max(0.0, launches.seconds - device_compute))
        by_kind["compute"] = device_compute + walk.components[i].exposed
    return by_kind


def _model_flops_per_token(lay: _PerRank, windows: list[int | None], document: int | None) -> float:
    """PaLM's model FLOPs per token (training: 3 x forward, causal halved, no recompute), all TP ranks."""
    s = lay.shape
    keys = sum(_keys_per_query(lay.padded, w, document) for w in windows)
    return 6.0 * s.matmul_params + 12.0 * s.heads * s.head_dim * keys


# ---------------------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ComputeTimes:
    """What the overlap conditions compare the transfers with (seconds on one rank)."""

    tiles: tuple[float, int] | None  # FPDT: (one full score tile's forward, segments per row); else None
    attention_pass_s: tuple[
        float, float
    ]  # one attention layer's forward and backward (a ring's steps hide in them)
    layer_s: float  # one layer's compute (matmuls, attention, elementwise; forward, backward, recompute)
    backward_s: float  # the backward's share of that compute, all layers


def _compute(
    lay: _PerRank,
    dev: DeviceSpec,
    kernel: KernelRate,
    windows: list[int | None],
    document: int | None,
    walk: _Walk,
) -> _ComputeTimes:
    """Matmul, attention, elementwise and launch time of one rank's step; returns the times the overlap
    conditions compare with."""
    _matmuls(lay, dev, walk)
    tiles, pass_s = _attention(lay, kernel, windows, document, walk)
    _elementwise(lay, dev, walk)
    _launches(lay, dev, walk)
    per_layer_compute = sum(
        c.seconds for c in walk.components if c.kind == "compute" and c.name != "operator launches"
    )
    n_attn = max(len(windows), 1)
    return _ComputeTimes(
        tiles=tiles,
        attention_pass_s=(pass_s[0] / n_attn, pass_s[1] / n_attn),
        layer_s=per_layer_compute / max(lay.shape.layers, 1),
        backward_s=per_layer_compute * 2.0 / (3 + (1 if lay.checkpointing else 0)),
    )


def _segments_per_row(lay: _PerRank) -> int:
    """FPDT: the segments (chunks of every rank of the all-to-all) of one row; 1 without FPDT."""
    return max(1, lay.t // (lay.b * lay.chunk)) if lay.fpdt else 1


def _matmuls(lay: _PerRank, dev: DeviceSpec, walk: _Walk) -> None:
    """``2·t·W`` FLOPs forward of the TP-local weights, twice that backward; recompute: the blocks again with
    checkpointing, the MLP with FPDT's tiled MLP, the lm_head with FPDT's chunked loss."""
    t, fpdt, ckpt = lay.t, lay.fpdt, lay.checkpointing
    mm_rate = dev.matmul_flops * (1.0 if lay.m <= 2 or dev.cores else 0.5)  # fp32 on a GPU: TF32 at half rate
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


def _attention(
    lay: _PerRank, kernel: KernelRate, windows: list[int | None], document: int | None, walk: _Walk
) -> tuple[tuple[float, int] | None, tuple[float, float]]:
    """The attention layers' kernel time (forward, backward, recompute); returns FPDT's ``(one full tile's
    forward seconds, segments per row)`` (None otherwise) and the layers' summed forward and backward
    passes."""
    s, ckpt, row = lay.shape, lay.checkpointing, lay.padded
    # tokens of one kernel call's queries and keys: FPDT's segment, a ring's zigzag chunk, else the row
    seg = lay.segment // lay.b if lay.fpdt else row // (2 * lay.ring) if lay.ring > 1 else row
    u = _segments_per_row(lay)
    attn_s, fwd_flops_total = 0.0, 0.0
    pass_s = [0.0, 0.0]  # one forward and one backward pass of the attention layers
    for w in windows:
        keys = _keys_per_query(row, w, document)
        f = (
            4.0 * lay.heads_per_rank * s.head_dim * lay.bn * keys
        )  # forward FLOPs of one layer (ring: bn = b N / r)
        call = min(seg, document or row, w or row)
        seconds, fwd, bwd = _attention_layer_s(
            lay, kernel, f, call, u, whole_rows=document is None and w is None
        )
        attn_s += seconds
        pass_s[0] += fwd
        pass_s[1] += bwd
        fwd_flops_total += f
    n_attn = len(windows)
    walk.hardware_flops += fwd_flops_total * (3 + (1 if ckpt else 0))
    if n_attn:
        walk.add("attention", "compute", attn_s,
                 note=f"{_kernel_note(kernel)}; {fwd_flops_total / 1e12:.4g} TFLOP forward"
                 + (" + recompute" if ckpt else ""))  # fmt: skip
    tiles = None
    if lay.fpdt and n_attn:
        # one full tile's forward: a layer's forward FLOPs over its u^2/2 full-tile equivalents
        tile_s = fwd_flops_total / n_attn / (u * u / 2.0) / kernel.rates(seg, causal=u == 1)[0]
        tiles = (tile_s, u)
    return tiles, (pass_s[0], pass_s[1])


def _attention_layer_s(
    lay: _PerRank, kernel: KernelRate, f: float, call: int, u: int, *, whole_rows: bool
) -> tuple[float, float, float]:
    """One attention layer of ``f`` forward FLOPs in kernel calls of ``call`` keys: ``(seconds with backward
    and recompute, its forward pass, its backward pass)``; the passes are 0 for FPDT's tiles (nothing hides
    in them). ``whole_rows``: no document or window cuts the causal diagonal."""
    ckpt, ring = lay.checkpointing, lay.ring
    rf, rb = kernel.rates(call, causal=True)
    if ring > 1 and whole_rows:
        # a ring rank's 2 causal diagonal chunk blocks (half each) of its 2r chunk-block equivalents, the rest
        # full blocks: the diagonal's share is 1 / (2r)
        diag = f / (2 * ring)
        ff, fb = kernel.rates(call, causal=False)
        fwd, bwd = diag / rf + (f - diag) / ff, 2.5 * diag / rb + 2.5 * (f - diag) / fb
        return fwd * (2 if ckpt else 1) + bwd, fwd, bwd
    if lay.fpdt and u > 1 and whole_rows:
        # u causal diagonal tiles (half) and u(u-1)/2 full tiles below them: u^2/2 full-tile equivalents
        diag = f / u**2  # the diagonal tiles' share: u / 2 of u^2 / 2
        ff, fb = kernel.rates(call, causal=False)
        seconds = diag / rf * (2 if ckpt else 1) + 2.5 * diag / rb
        seconds += (f - diag) / ff * (2 if ckpt else 1) + 2.5 * (f - diag) / fb
        return seconds, 0.0, 0.0
    return f / rf * (2 if ckpt else 1) + 2.5 * f / rb, f / rf, 2.5 * f / rb


def _kernel_note(kernel: KernelRate) -> str:
    return f"fwd {kernel.forward / 1e12:.4g} / bwd {kernel.backward / 1e12:.4g} TFLOP/s at {kernel.reference_tokens} keys"


def _elementwise(lay: _PerRank, dev: DeviceSpec, walk: _Walk) -> None:
    """Memory-bound work: bytes per token of a forward (backward moves twice that) at ``memory_bandwidth``."""
    s, t, m, r = lay.shape, lay.t, lay.m, lay.r
    hd, tp, inter = s.head_dim, lay.tp, lay.inter_tp
    q_w, kv_w = s.heads * hd // tp, s.kv_heads * hd // tp
    # an RMSNorm (HF's: fp32 upcast, pow, mean, scale, downcast, weight) and a residual add per sub-block
    norm_residual = (20 + 3 * r) * s.d + 3 * r * s.d
    # RoPE on q and k (two products, rotate_half's neg and cat, the sum: ~10 passes), the layout copies of
    # q / k / v / out around the attention, the o_proj input's reshape
    attn_bytes = norm_residual + 10 * m * (q_w + kv_w) + 2 * m * (2 * q_w + 2 * kv_w) + 2 * m * q_w
    mlp_bytes = norm_residual + 5 * inter * m  # act(gate) and act * up
    layer_passes = 3 + (1 if lay.checkpointing else 0)
    mlp_extra = 1 if lay.fpdt else 0  # the tiled MLP recomputes each tile in backward
    ew = t * layer_passes * (lay.attention_layers * attn_bytes + lay.mlp_layers * mlp_bytes)
    ew += t * mlp_extra * lay.mlp_layers * 5 * inter * m
    ew += t * LOSS_BYTES_PER_VOCAB * lay.vocab_local
    if lay.fpdt and lay.attention_layers:
        ew += _fpdt_tile_bytes(lay)
    if lay.casting:  # autocast casts each weight per pass (forward, recompute, backward)
        ew += lay.matmul_local * (lay.pw + m) * (2 + (1 if lay.checkpointing else 0))
    walk.add("elementwise", "compute", ew / dev.memory_bandwidth,
             note=f"{ew / 2**30:.3g} GiB through memory at {dev.memory_bandwidth / 1e9:.4g} GB/s")  # fmt: skip


def _fpdt_tile_bytes(lay: _PerRank) -> int:
    """FPDT's per-tile bytes of all attention layers: per (segment, kv chunk) tile, q / k / v into the
    kernel's layout, its output to fp32 and the online softmax merge (~5 fp32 passes); backward: dout / q / k
    / v / out in, dq / dk / dv out, their fp32 sums."""
    m, hd = lay.m, lay.shape.head_dim
    u = _segments_per_row(lay)
    hq, hkv, seg_hd = lay.heads_per_rank, lay.kv_per_rank, lay.segment * hd
    fwd_tile = seg_hd * (2 * m * (hq + 2 * hkv) + (m + 4) * hq + 20 * hq)
    bwd_tile = seg_hd * (2 * m * (3 * hq + 2 * hkv) + 2 * m * (hq + 2 * hkv) + (8 + m) * (hq + 2 * hkv))
    n_tiles = u * (u + 1) // 2
    return lay.attention_layers * n_tiles * (fwd_tile * (2 if lay.checkpointing else 1) + bwd_tile)


def _launches(lay: _PerRank, dev: DeviceSpec, walk: _Walk) -> None:
    """Operators launched x ``op_latency``: per layer and pass, FPDT's per tile, MLP tile and loss chunk, the
    optimizer's."""
    ckpt = lay.checkpointing
    ops = OPS_PER_LAYER * lay.shape.layers * (3 + (1 if ckpt else 0))
    if lay.fpdt:
        u = _segments_per_row(lay)
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


# ---------------------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------------------


def _communication(lay: _PerRank, dev: DeviceSpec, per_node: int, times: _ComputeTimes, walk: _Walk) -> None:
    """The step's collectives: the sequence all-to-all, the ring's passes, TP's all-reduces, FSDP / DDP's."""
    if lay.ulysses > 1 and lay.attention_layers:
        _sequence_all_to_all(lay, dev, per_node, times.tiles, walk)
    if lay.ring > 1 and lay.attention_layers:
        _ring_passes(lay, dev, per_node, times.attention_pass_s, walk)
    if lay.tp > 1:
        _tensor_parallel_all_reduce(lay, dev, per_node, walk)
    n = lay.dp * lay.sp
    if n > 1 and lay.data_parallel is DataParallel.FSDP:
        _fsdp_gather_scatter(lay, dev, per_node, times.layer_s, walk)
    elif n > 1:
        _ddp_all_reduce(lay, dev, per_node, times.backward_s, walk)


def _sequence_all_to_all(
    lay: _PerRank, dev: DeviceSpec, per_node: int, tiles: tuple[float, int] | None, walk: _Walk
) -> None:
    """Ulysses / FPDT: q, k, v to head layout, out back (backward: the gradients), per pass; with a ring over
    the U = P / r adjacent ranks of one Ulysses group, kv heads spread for U. FPDT's chunk all-to-all hides
    behind the previous chunk's attention where shorter."""
    s, tp, U = lay.shape, lay.tp, lay.ulysses
    passes = 2 + (1 if lay.checkpointing else 0)  # forward, backward, recompute
    q_heads, kv_heads = s.heads // tp, lay.kv_heads
    per_layer = lay.t * s.head_dim * lay.m * (2 * q_heads + 2 * kv_heads) * (U - 1) / U
    one = _transfer_s(dev, per_layer, U, tp, per_node)
    total = one * lay.attention_layers * passes
    if lay.fpdt and lay.fpdt_overlap and dev.overlap and tiles:
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


def _tensor_parallel_all_reduce(lay: _PerRank, dev: DeviceSpec, per_node: int, walk: _Walk) -> None:
    """Two all-reduces of the hidden states per layer per pass, blocking."""
    s, tp = lay.shape, lay.tp
    passes = 2 + (1 if lay.checkpointing else 0)  # forward, backward, recompute
    nbytes = 2.0 * (tp - 1) / tp * lay.t * s.d * lay.m
    seconds = 2 * s.layers * passes * _transfer_s(dev, nbytes, tp, 1, per_node)
    walk.add("tensor-parallel all-reduce", "communication", seconds, note="2 per layer per pass, blocking")


def _fsdp_gather_scatter(lay: _PerRank, dev: DeviceSpec, per_node: int, layer_s: float, walk: _Walk) -> None:
    """FSDP's all-gathers (forward, backward) and reduce-scatter of each block over dp x sp, prefetched:
    exposed where longer than a block's compute; the root's once."""
    s, tp, n = lay.shape, lay.tp, lay.dp * lay.sp
    block = lay.block_local
    gather = block * lay.pw * (n - 1) / n
    scatter = block * lay.w * (n - 1) / n
    gather_s = _transfer_s(dev, gather, n, tp, per_node)
    scatter_s = _transfer_s(dev, scatter, n, tp, per_node)
    fwd_layer = layer_s / (3 + (1 if lay.checkpointing else 0))
    bwd_layer = layer_s - fwd_layer
    if dev.overlap:
        exposed = gather_s + s.layers * (
            max(0.0, gather_s - fwd_layer) + max(0.0, gather_s + scatter_s - bwd_layer)
        )
    else:
        exposed = s.layers * (2 * gather_s + scatter_s)
    root = _transfer_s(dev, lay.root_local * lay.pw * (n - 1) / n, n, tp, per_node)
    walk.add("FSDP all-gather / reduce-scatter", "communication", s.layers * (2 * gather_s + scatter_s) + root,
             exposed + root, note="prefetched: exposed where longer than a block's compute")  # fmt: skip


def _ddp_all_reduce(lay: _PerRank, dev: DeviceSpec, per_node: int, backward_s: float, walk: _Walk) -> None:
    """DDP's gradient all-reduce over dp x sp: overlaps backward but its last bucket."""
    n = lay.dp * lay.sp
    nbytes = 2.0 * (n - 1) / n * lay.trainable * lay.w
    seconds = _transfer_s(dev, nbytes, n, lay.tp, per_node)
    last = seconds * min(1.0, DDP_BUCKET_BYTES / max(lay.trainable * lay.w, 1))
    exposed = max(0.0, seconds - backward_s) + last if dev.overlap else seconds
    walk.add(
        "DDP all-reduce", "communication", seconds, exposed, note="overlaps backward but the last bucket"
    )


def ring_pass_bytes(lay: _PerRank) -> tuple[int, int]:
    """Bytes one rank sends in the ring passes of one attention layer, ``(forward, backward)``
    (``attention/ring.py``): forward ``(r - 1)`` k/v blocks ``B`` (``2 b (N/r) (H_kv'/U) hd`` elements in the k/v
    dtype), backward ``(r - 1)`` again plus ``r`` hops of the fp32 dk/dv blocks."""
    r, blk = lay.ring, lay.ring_block_bytes
    dblk = 2 * lay.kv_elems * lay.ct
    return (r - 1) * blk, (r - 1) * blk + r * dblk


def _ring_passes(
    lay: _PerRank, dev: DeviceSpec, per_node: int, attention_s: tuple[float, float], walk: _Walk
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


# ---------------------------------------------------------------------------------------------------------
# Host transfers and the optimizer
# ---------------------------------------------------------------------------------------------------------


def _host_transfers(lay: _PerRank, dev: DeviceSpec, times: _ComputeTimes, walk: _Walk) -> None:
    """The host link's traffic: FPDT's offloaded chunks, offloaded activations, ``cpu_offload``'s shards."""
    if lay.fpdt and lay.offload and lay.attention_layers and times.tiles:
        _fpdt_offload(lay, dev, times.tiles, walk)
    if lay.activation_offload:
        _activation_offload(lay, dev, times.layer_s, walk)
    if lay.cpu_offload:
        _cpu_offload_shards(lay, dev, times.layer_s, walk)


def _fpdt_offload(lay: _PerRank, dev: DeviceSpec, tiles: tuple[float, int], walk: _Walk) -> None:
    """FPDT's chunks through the host link: each fetch hidden behind one tile's attention when shorter."""
    s, link = lay.shape, dev.host_link_bandwidth
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
    passes_fwd = 2 if lay.checkpointing else 1
    total = (passes_fwd * (store + fetch_fwd) + fetch_bwd) / link
    if dev.overlap:
        per_fetch_fwd, per_fetch_bwd = kv_bytes / link, (3 * q_bytes + seg * h * 4) / link
        exposed = passes_fwd * u * (u - 1) / 2 * max(0.0, per_fetch_fwd - tile_s)
        exposed += u * (u + 1) / 2 * max(0.0, per_fetch_bwd - 2.5 * tile_s)
    else:
        exposed = total
    walk.add("FPDT offload", "host transfers", total * lay.attention_layers, exposed * lay.attention_layers,
             note="each fetch hidden behind one tile's attention when shorter")  # fmt: skip


def _activation_offload(lay: _PerRank, dev: DeviceSpec, layer_s: float, walk: _Walk) -> None:
    """Each checkpointed layer input out in forward, in for backward, behind one layer's compute."""
    s = lay.shape
    nbytes = lay.t * s.d * lay.r
    one = nbytes / dev.host_link_bandwidth
    exposed = (
        s.layers * (max(0.0, one - layer_s / 4) + max(0.0, one - layer_s / 2))
        if dev.overlap
        else 2 * s.layers * one
    )
    walk.add("activation offload", "host transfers", 2 * s.layers * one, exposed,
             note=f"{nbytes / 2**20:.4g} MiB per layer out and back, behind a layer's compute")  # fmt: skip


def _cpu_offload_shards(lay: _PerRank, dev: DeviceSpec, layer_s: float, walk: _Walk) -> None:
    """``cpu_offload``: each block's shard in twice (forward, backward), its gradient out once."""
    s, link, n = lay.shape, dev.host_link_bandwidth, lay.shard
    shard = lay.block_local * lay.w / n
    per_block = shard / link
    seconds = s.layers * 3 * per_block + lay.root_local * lay.w / n / link
    exposed = s.layers * max(0.0, 3 * per_block - layer_s) if dev.overlap else seconds
    walk.add("cpu_offload shards", "host transfers", seconds, exposed,
             note="each block's shard in twice, its gradient out once")  # fmt: skip


def _optimizer(lay: _PerRank, dev: DeviceSpec, per_node: int, walk: _Walk) -> None:
    """AdamW's step: ~10 bytes per parameter byte of the rank's shard, through device memory, or under
    ``cpu_offload`` the host's DRAM shared by the node's ranks."""
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


__all__ = [
    "StepTimeEstimate",
    "TimeComponent",
    "estimate_step_time",
    "format_seconds",
]
