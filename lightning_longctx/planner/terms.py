"""The memory terms: one small function per memory component, each a :class:`_Term` of a :class:`_PerRank`.

Rows in table order are ``_ORDER``; when each term is alive is the phase table's (``phases.py``). Notation as
in the package docstring: ``t`` local tokens, ``w`` / ``pw`` / ``m`` / ``r`` master-parameter / compute-
parameter / matmul / residual bytes. The recurrent mixers' per-token formulas (:func:`_gdn_token_bytes`,
:func:`_mamba2_token_bytes`) are checked against autograd's saved tensors in tests/test_planner.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_longctx.config import DataParallel
from lightning_longctx.planner.per_rank import _PerRank
from lightning_longctx.planner.report import format_bytes
from lightning_longctx.planner.shapes import (
    _LLAMA_BLOCK,
    ATTENTION,
    GATED_DELTANET,
    MAMBA2,
    _Block,
    _GDNDims,
    _Mamba2Dims,
)

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
    "ring buffers",
    "state exchange buffers",
    "layer recompute (checkpointing)",
)

# Each term returns the bytes it holds on one device and on its host while it is alive, and the table row
# (one of ``_ORDER``) it adds to. A row's note is its terms' notes, in phase-table order, joined by "; ": a
# term folded into a row that another term describes (a backward variant, a small extra) leaves it empty.
# A term that does not apply to the settings returns zero bytes and no note.

_ACTS, _RECOMPUTE = "activations kept for backward", "layer recompute (checkpointing)"


@dataclass(frozen=True)
class _Term:
    """One memory component: bytes on one device and on its host, the table row it adds to, and a note."""

    row: str
    device: int
    host: int = 0
    note: str = ""


def _placed(lay: _PerRank, row: str, nbytes: int, note: str = "") -> _Term:
    """A model-state term: on the device, or on the host with ``cpu_offload``."""
    return _Term(row, 0, nbytes, note) if lay.cpu_offload else _Term(row, nbytes, 0, note)


# ---- parameters, gradients, optimizer ----


def _weights(lay: _PerRank) -> _Term:
    n = lay.local_params + lay.lora
    note = f"{n:,} params" + (f" of {lay.shape.params:,} (tp {lay.tp})" if lay.tp > 1 else "")
    note += f" x {lay.w} B" + (f" / {lay.shard} (FSDP)" if lay.shard > 1 else "")
    note += f", {lay.lora:,} of them LoRA's" if lay.lora else ""
    return _placed(lay, "weights", lay.weight_bytes, note + (" (cpu_offload)" if lay.cpu_offload else ""))


def _sharded_gradients(lay: _PerRank) -> _Term:
    """FSDP's sharded gradients (in the master weights' dtype: the MixedPrecisionPolicy reduces in fp32).
    DDP's gradients are views into its buckets (``gradient_as_bucket_view``)."""
    if lay.data_parallel is DataParallel.DDP:
        return _Term("gradients", 0)
    note = "FSDP's sharded gradients, freed between forward and backward (Lightning's zero_grad)"
    return _placed(lay, "gradients", lay.grad_bytes, note)


def _optimizer_state(lay: _PerRank) -> _Term:
    """torch.optim keeps its states in the parameter dtype (Lightning's bf16-mixed: fp32 weights, no master
    copy), for the trainable parameters only (LoRA: the adapters)."""
    note = f"{lay.optimizer}: {lay.states} x trainable params x {lay.w} B" + (
        " + foreach temporary" if lay.states else ""
    )
    return _placed(lay, "optimizer state", lay.states * lay.grad_bytes, note)


def _optimizer_step_temporary(lay: _PerRank) -> _Term:
    """foreach AdamW: one temporary per state (sqrt of exp_avg_sq) during the step (noted with the state); on
    the host with ``cpu_offload``, where the step runs."""
    return _placed(lay, "optimizer state", lay.states * lay.grad_bytes // 2 if lay.states else 0)


def _ddp_gradient_buckets(lay: _PerRank) -> _Term:
    """DDP's all-reduce buckets of the trainable parameters, allocated for the whole run (the strategy wraps
    in DDP even on one rank)."""
    if lay.data_parallel is not DataParallel.DDP:
        return _Term("DDP gradient buckets", 0)
    note = "the gradients, as views into DDP's buckets (gradient_as_bucket_view=True)"
    return _Term("DDP gradient buckets", lay.trainable * lay.w, note=note)


def _fsdp_root_params(lay: _PerRank) -> _Term:
    """FSDP's root (embedding, head, final norm) stays unsharded for the step (``reshard_after_forward=False``),
    in the compute dtype (the MixedPrecisionPolicy all-gathers bf16); with tp its TP-local part."""
    if lay.data_parallel is not DataParallel.FSDP:
        return _Term("FSDP unsharded params/grads", 0)
    return _Term("FSDP unsharded params/grads", lay.root_local * lay.pw, note="root params")


def _fsdp_blocks_in_flight(lay: _PerRank) -> _Term:
    """Two unsharded transformer blocks: the one running and the one prefetched (TP-local with tp)."""
    if lay.data_parallel is not DataParallel.FSDP:
        return _Term("FSDP unsharded params/grads", 0)
    block = lay.block_local + lay.lora_block
    return _Term("FSDP unsharded params/grads", 2 * block * lay.pw, note="2 blocks in flight")


def _fsdp_block_gradients(lay: _PerRank) -> _Term:
    """One block's unsharded gradients and their reduce-scatter input (a flat copy, in fp32 under the
    MixedPrecisionPolicy), and the root's unsharded gradients (trainable parameters only)."""
    if lay.data_parallel is not DataParallel.FSDP:
        return _Term("FSDP unsharded params/grads", 0)
    block, root = (lay.lora_block, 0) if lay.lora else (lay.block_local, lay.root_local)
    reduce_bytes = 4 if lay.mp_policy else lay.w  # the policy's reduce_dtype: fp32
    nbytes = block * (lay.pw + reduce_bytes) + root * lay.pw
    return _Term("FSDP unsharded params/grads", nbytes, note="block + root grads in backward")


def _autocast_weight_copies(lay: _PerRank) -> _Term:
    """The low-precision weight casts linear saves for backward; FPDT's tiled MLP and chunked loss cast per
    chunk instead (their working sets count those)."""
    if not lay.casting:
        return _Term("autocast weight copies", 0)
    cast_params = lay.matmul_local - (lay.mlp_layers * lay.mlp_weights + lay.head_local if lay.fpdt else 0)
    return _Term("autocast weight copies", cast_params * lay.m,
                 note=f"{lay.m}-byte casts of the weights linear keeps for backward")  # fmt: skip


# ---- activations kept for backward ----


def _attention_store_bytes(lay: _PerRank) -> int:
    """One layer's attention tensors in head layout: q, out, k, v and the log-sum-exp (FPDT: every chunk's,
    in host memory with offload). FPDT's blocks run in the autocast dtype, the lse too; else it is fp32. FPDT x
    ring keeps k and v stacked (one ring message: promoted to q's dtype) and the fp32 lse of its accumulators."""
    if lay.fpdt and lay.ring > 1:
        return 2 * lay.q_elems * lay.qa + 2 * lay.kv_elems * lay.qa + lay.bn * lay.heads_per_rank * lay.ct
    lse = lay.m if (lay.autocast and lay.fpdt) else max(4, lay.m)
    return 2 * lay.q_elems * lay.qa + lay.kv_elems * (lay.qa + lay.m) + lay.bn * lay.heads_per_rank * lse


def _norm_bytes(lay: _PerRank) -> int:
    """What one RMSNorm keeps for backward: Hugging Face's keeps its fp32 input and the normalised copy;
    FPDT tiles it (``enable_sequence_parallel``): only its input, in the residual dtype."""
    return (lay.r if lay.fpdt else 4 + lay.r) * lay.shape.d * lay.t


def _gdn_token_bytes(g: _GDNDims, m: int, pw: int, casting: bool, adapter: bool) -> float:
    """Bytes a gated DeltaNet mixer saves for backward per token, after its input (the projections' inputs are
    the layer's), with HF's torch fallback ``torch_chunk_gated_delta_rule`` (measured: tests/test_planner.py).

    ``adapter``: under this package's state passing (``hybrid/delta_rule.py``) the kernel runs on values
    ``[v | 0_dk]`` (``dv + dk`` wide) and the correction keeps ``R`` in fp32. The kernel works in fp32: the
    q/k/v copies and their normalised, scaled, decayed and chunked forms, the ``(c x c)`` intra-chunk matrices
    per head (pairwise decays, ``k_beta kᵀ``, ``q kᵀ``, the UT system, the masked attention; autocast runs
    ``k_beta kᵀ``/``q kᵀ`` and re-casts the attention per chunk in bf16) and the state after every chunk its
    sequential loop keeps."""
    h, dk, c = g.heads, g.dk, g.chunk
    dv = g.dv + (dk if adapter else 0)
    k = m if casting else 4  # the dtype of the kernel's matmul products and operand copies
    conv = 2 * g.conv_dim * m  # in_proj_qkv's output (the conv's input) and the conv's output (silu's input)
    gates = h * m + 8 * h * 4  # beta; fp32 decay g, softplus, l2norm rsqrts, cumulative decays
    copies = 4 * h * (10 * dk + 3 * dv)  # fp32 q/k forms (10 of d_k), v, the UT-solved values, v_new
    chunk_mats = h * c * (3 * 4 + 2 * k + (m if casting else 0))  # (c x c) per head per chunk
    states = 4 * h * dk * dv / c  # one (dk, dv') state per chunk
    norm = h * g.dv * (3 * 4 + m + pw) + 4 * h  # the gated RMSNorm (fp32 in, normed, silu(z)), out_proj input
    out_proj = h * g.dv * m
    correction = 4 * h * dk if adapter else 0
    return conv + gates + copies + chunk_mats + states + norm + out_proj + correction


def _mamba2_token_bytes(s: _Mamba2Dims, m: int, casting: bool, adapter: bool) -> float:
    """Bytes a Mamba-2 mixer saves for backward per token, after its input, with HF's torch fallback
    ``mamba2_chunk_scan`` (measured: tests/test_planner.py).

    The SSD works in fp32: x, B and C (repeated to every head) and their einsum operand copies, the ``(c x c)``
    per-head matrices ``L = exp(segsum)``, ``G = C Bᵀ`` and ``M = G L`` (autocast: the einsums' in bf16), and
    the chunk states. ``adapter``: this package's closed-form entry-state correction (``hybrid/mamba2.py``)
    keeps the fp32 read-out ``S_in C_t``, C and the decays."""
    h, p, n, c, inner = s.heads, s.head_dim, s.state, s.chunk, s.inner
    k = m if casting else 4
    # the conv's input (in_proj's whole output, or autocast's copy of its x, B, C) and output
    conv = (s.conv_dim if casting else 2 * inner + 2 * s.groups * n + h) * m + s.conv_dim * m
    x = (s.conv_dim * 4 if m == 4 else inner * 4 + h * 4) + inner * 4  # fp32 x (B, C) and its padded D copy
    dt = 2 * h * m + h * 4 + 2 * h * 4  # dt + bias, softplus; fp32 dt; the exp decays
    chunk_mats = h * c * (4 + 2 * k)
    heads_state = h * n * (4 + 4 * k)  # B and C repeated to the heads, and their einsum copies
    heads_dim = 3 * inner * k  # x * dt's einsum copies, the off-diagonal output
    states = 2 * h * p * n * k / c
    norm = 4 * inner * 4 + (inner * 4 if m != 4 else 0) + 4 * s.groups  # gated RMSNorm, fp32
    out_proj = inner * m
    correction = inner * 4 + 2 * s.groups * n * 4 + 4 * h * 4 if adapter else 0
    return conv + x + dt + chunk_mats + heads_state + heads_dim + states + norm + out_proj + correction


def _mixer_bytes(lay: _PerRank, kind: str) -> int:
    """One mixer's saved tensors after its layer's input norm: attention's q/k/v projections' inputs
    (autocast casts the normed input once per projection), its store and o_proj input; a recurrent mixer's
    projections' inputs and its tensors (the package's adapters run: ``adapter=True``)."""
    s, t = lay.shape, lay.t
    if kind == ATTENTION:
        qkv_in = (3 if lay.casting else 1) * s.d * lay.m * t
        return qkv_in + _attention_store_bytes(lay) + _attention_o_proj_bytes(lay)
    if kind == GATED_DELTANET and s.gdn is not None:  # in_proj_qkv, z, b, a read the normed input
        per_token = _gdn_token_bytes(s.gdn, lay.m, lay.pw, lay.casting, adapter=True)
        return int((4 if lay.casting else 1) * s.d * lay.m * t + per_token * t)
    if kind == MAMBA2 and s.mamba2 is not None:
        per_token = _mamba2_token_bytes(s.mamba2, lay.m, lay.casting, adapter=True)
        return int(s.d * lay.m * t + per_token * t)
    raise AssertionError(f"no layer kind {kind!r}")  # _blocks_of refuses unknown kinds


def _layer_attention_bytes(lay: _PerRank, block: _Block = _LLAMA_BLOCK) -> int:
    """One layer's saved tensors up to its MLP: the first RMSNorm's and its mixers' (:func:`_mixer_bytes`)."""
    if not block.mixers:
        return 0
    return _norm_bytes(lay) + sum(_mixer_bytes(lay, kind) for kind in block.mixers)


def _layer_mlp_bytes(lay: _PerRank, block: _Block = _LLAMA_BLOCK) -> int:
    """One layer's saved tensors from its second RMSNorm on: the norm, the MLP's input(s) and its gate, act,
    up, act*up (their TP-local columns with tp; FPDT's tiled MLP keeps only its input and recomputes the
    rest). None for a block without an MLP (Mamba-2's)."""
    if not block.mlp:
        return 0
    s, t = lay.shape, lay.t
    norm = _norm_bytes(lay)
    if lay.fpdt:
        return norm + s.d * lay.r * t
    copies = (2 if s.gated else 1) if lay.casting else 1
    return norm + copies * s.d * lay.m * t + (4 if s.gated else 2) * lay.inter_tp * lay.m * t


def _offloaded_bytes(lay: _PerRank, block: _Block) -> int:
    """FPDT offload: the attention chunks of a layer with attention are in host memory."""
    return _attention_store_bytes(lay) if lay.offload and ATTENTION in block.mixers else 0


def _layer_device_bytes(lay: _PerRank, block: _Block = _LLAMA_BLOCK) -> int:
    """One layer's saved tensors on the device (FPDT's offloaded chunks are on the host)."""
    return _layer_attention_bytes(lay, block) + _layer_mlp_bytes(lay, block) - _offloaded_bytes(lay, block)


def _saved_activations(lay: _PerRank) -> _Term:
    """Without checkpointing: every layer's saved tensors but the last one's (see the next two terms)."""
    if lay.checkpointing:
        return _Term(_ACTS, 0)
    note = "per layer: norms, q/k/v/out/lse, projections" + (", MLP" if not lay.fpdt else "")
    kinds = sorted({kind for b in lay.blocks for kind in b.mixers} - {ATTENTION})
    if kinds:
        note += f"; {', '.join(kinds)} layers: projections, conv, fp32 chunk matrices and states"
    return _Term(_ACTS, sum(_layer_device_bytes(lay, b) for b in lay.blocks[:-1]), note=note)


def _attention_o_proj_bytes(lay: _PerRank) -> int:
    """The o_proj's saved input (the attention output in sequence layout, this TP rank's heads)."""
    return lay.heads_tp * lay.shape.head_dim * lay.m * lay.t


def _o_proj_input_bytes(lay: _PerRank, block: _Block = _LLAMA_BLOCK) -> int:
    """A layer's attention o_proj input: freed by the o_proj's backward, before the attention's backward runs
    (a recurrent mixer's out_proj input is counted with the mixer)."""
    return _attention_o_proj_bytes(lay) if ATTENTION in block.mixers else 0


def _last_layer_attention_activations(lay: _PerRank) -> _Term:
    """Without checkpointing: the last layer's saved tensors up to its MLP (on the device), but its o_proj
    input (:func:`_last_layer_o_proj_input`)."""
    if lay.checkpointing:
        return _Term(_ACTS, 0)
    last = lay.blocks[-1]
    return _Term(
        _ACTS, _layer_device_bytes(lay, last) - _layer_mlp_bytes(lay, last) - _o_proj_input_bytes(lay, last)
    )


def _last_layer_o_proj_input(lay: _PerRank) -> _Term:
    """Without checkpointing: the last layer's o_proj input, alive until the layer's attention backward."""
    return _Term(_ACTS, 0 if lay.checkpointing else _o_proj_input_bytes(lay, lay.blocks[-1]))


def _last_layer_mlp_activations(lay: _PerRank) -> _Term:
    """Without checkpointing: the last layer's MLP tensors. They do not exist yet while its attention runs
    forward, and are freed when its attention runs backward."""
    return _Term(_ACTS, 0 if lay.checkpointing else _layer_mlp_bytes(lay, lay.blocks[-1]))


def _checkpointed_inputs(lay: _PerRank) -> _Term:
    """With checkpointing: each layer's input ``(b, N/P, d)`` on the device (on the host with activation
    offload: :func:`_activation_offload_store`)."""
    if not lay.checkpointing:
        return _Term(_ACTS, 0)
    inputs = 0 if lay.activation_offload else lay.shape.layers * lay.shape.d * lay.r * lay.t
    return _Term(_ACTS, inputs, note="layer inputs (checkpointed)")


def _model_inputs(lay: _PerRank) -> _Term:
    """The batch's int64 ids (input_ids, labels, shift_labels, position_ids) and the RoPE cos/sin tables."""
    return _Term(_ACTS, 4 * 8 * lay.t + 2 * lay.shape.head_dim * lay.r * lay.t)


def _final_norm_and_head_input(lay: _PerRank) -> _Term:
    """The final RMSNorm's saved tensors and the head's input (FPDT's chunked loss: hidden states + lse;
    Hugging Face: lm_head's matmul-dtype input); freed in the loss backward."""
    s, t = lay.shape, lay.t
    head_in = s.d * lay.r * t + 4 * t if lay.fpdt else s.d * lay.m * t
    return _Term(_ACTS, _norm_bytes(lay) + head_in)


def _running_layer_input(lay: _PerRank) -> _Term:
    """Activation offload: the running layer's input stays on the device while it runs forward."""
    return _Term(_ACTS, lay.shape.d * lay.r * lay.t if lay.activation_offload else 0)


def _prefetched_layer_inputs(lay: _PerRank) -> _Term:
    """Activation offload, backward: the recomputed layer's input and the one prefetched for the layer
    before it."""
    if not lay.activation_offload:
        return _Term(_ACTS, 0)
    return _Term(_ACTS, min(2, lay.shape.layers) * lay.shape.d * lay.r * lay.t)


def _fpdt_chunk_store(lay: _PerRank) -> _Term:
    """FPDT offload without checkpointing: every layer's attention chunks in host memory (saved tensors of
    its autograd node). With checkpointing the checkpoint drops them after each layer's forward: see
    :func:`_running_layer_chunk_store` and the recomputed layer's."""
    if not lay.offload or lay.checkpointing:
        return _Term(_ACTS, 0)
    host = lay.attention_layers * _attention_store_bytes(lay)
    return _Term(_ACTS, 0, host, note="host: FPDT chunks (offload)")


def _running_layer_chunk_store(lay: _PerRank) -> _Term:
    """FPDT offload with checkpointing: the running layer's chunks, on the host until its forward ends."""
    if not (lay.offload and lay.checkpointing and lay.attention_layers):
        return _Term(_ACTS, 0)
    return _Term(_ACTS, 0, _attention_store_bytes(lay), note="host: one layer's FPDT chunks (offload)")


def _activation_offload_store(lay: _PerRank) -> _Term:
    """Activation offload: every layer's checkpointed input in host memory."""
    if not lay.activation_offload:
        return _Term(_ACTS, 0)
    inputs = lay.shape.layers * lay.shape.d * lay.r * lay.t
    return _Term(_ACTS, 0, inputs, note="host: the layer inputs (activation offload)")


# ---- the loss ----


def _loss_forward(lay: _PerRank) -> _Term:
    """FPDT's chunked lm_head + loss: one logits block (+ its matmul-dtype original) and logsumexp's exp, the
    head's per-chunk cast. Hugging Face: the whole logits (+ their fp32 copy) and the log-softmax. (The
    row's note is the backward's.)"""
    s, ct = lay.shape, lay.ct
    if lay.fpdt:  # vocabulary parallel: (chunk, V / tp) blocks of this rank's rows
        low = lay.m if lay.m != ct else 0  # autocast: the matmul-dtype logits beside the fp32 block
        return _Term("loss working set", min(lay.loss_chunk, lay.t) * lay.vocab_local * (ct + low)
                     + lay.head_local * lay.chunk_casts)  # fmt: skip
    return _Term("loss working set", lay.t * s.vocab * (lay.m + ct + (ct if lay.m != ct else 0)))


def _loss_backward(lay: _PerRank) -> _Term:
    """FPDT: the recomputed block, exp, softmax - onehot, where(), * grad (two fp32 blocks with a soft-cap),
    the head's fp32 gradient accumulator and the hidden states' gradient. Vocabulary parallel: blocks and
    accumulator of this rank's ``V / tp`` rows; the hidden states' gradient is summed over the tp ranks in
    fp32, and cast back to the hidden dtype once the last block is freed. Hugging Face: the log-softmax, its
    gradient and the logits' gradient (``12 * t * V`` bytes in fp32)."""
    s, ct, m = lay.shape, lay.ct, lay.m
    if lay.fpdt:
        lc, v = min(lay.loss_chunk, lay.t), lay.vocab_local
        low = m if m != ct else 0  # autocast: the matmul-dtype gradient beside the fp32 block
        blocks = lc * v * ((2 if s.softcap else 1) * ct + low)
        grad_h = s.d * lay.t * (max(lay.r, 4) if lay.vocab_parallel else lay.r)
        cast_back = s.d * lay.t * lay.r if lay.vocab_parallel and lay.r < 4 else 0
        nbytes = max(blocks, cast_back) + lay.head_local * (ct + lay.chunk_casts + low) + grad_h
        note = f"chunked lm_head + loss: ({lc:,} x {v:,}) blocks"
        return _Term(
            "loss working set", nbytes, note=note + (" (vocabulary parallel)" if lay.vocab_parallel else "")
        )
    return _Term("loss working set", 3 * ct * lay.t * s.vocab,
                 note=f"logits ({lay.t:,} x {s.vocab:,}) fp32: log-softmax + gradients")  # fmt: skip


# ---- one layer's working sets ----


def _fpdt_score_tile_bytes(lay: _PerRank) -> int:
    """One math score tile ``(b, H/P, tile, tile)`` in the blocks' dtype and its boolean mask."""
    b, tile = lay.b, lay.tile
    return b * lay.heads_per_rank * tile * tile * (lay.m if lay.autocast else lay.ct) + b * tile * tile


def _residual_gradient_bytes(lay: _PerRank) -> int:
    """The residual stream's gradient in backward (Hugging Face's norm backward runs in fp32; FPDT's tiled
    norm in fp32 per chunk only)."""
    return lay.shape.d * (lay.r if lay.fpdt else max(lay.r, 4)) * lay.t


def _attention_forward(lay: _PerRank) -> _Term:
    """FPDT: the outputs gathered so far, one segment (q, its fp32 accumulator and merge, the next q and kv
    in flight), a score tile and, with offload, the double-buffered kv prefetch (2 fetched k, v steps).
    Ulysses: none (the kernel's out and lse are kept activations; O(1) workspace). A ring: its fp32 output
    accumulator and one kernel call's merge (:func:`_ring_forward_moment`); FPDT x ring: the fp32 accumulators
    of every local segment and one unit's (:func:`_fpdt_ring_forward_moment`). (Noted with the backward.)"""
    if lay.ring > 1 and lay.fpdt and lay.attention_layers:
        return _Term("attention working set", _fpdt_ring_forward_moment(lay)[2])
    if lay.ring > 1 and lay.attention_layers:
        return _Term("attention working set", _ring_forward_moment(lay)[1])
    if not lay.fpdt or not lay.attention_layers:
        return _Term("attention working set", 0)
    qa, hd, seg_kv = lay.qa, lay.shape.head_dim, lay.segment * lay.kv_per_rank * lay.shape.head_dim
    seg_q = lay.segment * lay.heads_per_rank * hd
    ahead = seg_q * qa + 2 * seg_kv * qa
    kv_buffer = 4 * seg_kv * qa if lay.offload else 0
    nbytes = lay.q_elems * qa + seg_q * (qa + 8) + ahead + _fpdt_score_tile_bytes(lay) + kv_buffer
    return _Term("attention working set", nbytes)


def _attention_backward(lay: _PerRank) -> _Term:
    """FPDT: the output's gradient throughout; early: every segment's dout and fp32 dq accumulator (the first
    kv segment reaches all q segments), two score tiles and, with offload, the chunks fetched back from the
    host; late: dq/dk/dv of every chunk and their concatenation. Ulysses: the output's gradient in both
    layouts, dq/dk/dv in head layout and back in sequence layout. Both: the residual stream's gradient."""
    qa, m, q, kv = lay.qa, lay.m, lay.q_elems, lay.kv_elems
    if not lay.attention_layers:  # attention-free (Mamba-2): the residual stream's gradient only
        return _Term(
            "attention working set", _residual_gradient_bytes(lay), note="residual gradient (no attention)"
        )
    if lay.ring > 1 and lay.fpdt:
        _, _, nbytes, host = _fpdt_ring_backward_moment(lay)
        note = (f"one segment of {lay.segment // lay.b:,} tokens (FPDT x ring), {lay.tile}x{lay.tile} score tiles, "
                "dout/delta, fp32 dq accumulators")  # fmt: skip
        return _Term("attention working set", nbytes + _residual_gradient_bytes(lay), host, note=note)
    if lay.ring > 1:
        nbytes = _ring_backward_moment(lay)[1]
        note = "dout, fp32 dq accumulator and one kernel call's dq/dk/dv (ring); dq/dk/dv all-to-all copies"
    elif lay.fpdt:
        seg_q = lay.segment * lay.heads_per_rank * lay.shape.head_dim
        seg_kv = lay.segment * lay.kv_per_rank * lay.shape.head_dim
        host_fetch = 2 * (seg_q * (qa + qa) + lay.segment * lay.heads_per_rank * 4 + 2 * seg_kv * qa)
        early = q * qa + lay.bn * lay.heads_per_rank * 4 + q * lay.ct + 2 * _fpdt_score_tile_bytes(lay)
        early += host_fetch if lay.offload else 0
        grads = q * qa + 2 * kv * qa  # dq, dk, dv, all chunks (and their concatenation)
        nbytes = q * qa + max(early, 2 * grads)
        note = (f"one segment of {lay.segment // lay.b:,} tokens, {lay.tile}x{lay.tile} score tile, "
                "dq/dk/dv")  # fmt: skip
    else:
        nbytes = 2 * q * m + 2 * (q + 2 * kv) * m
        note = "dq/dk/dv and their all-to-all copies"
    return _Term("attention working set", nbytes + _residual_gradient_bytes(lay), note=note)


def _all_to_all_buffers(lay: _PerRank) -> _Term:
    """FPDT: send + receive of one chunk; Ulysses (head_to_seq): the reshaped copy and the send buffer. Both of
    this TP rank's heads. With a ring (over U ranks; none at U = 1) they are one of its moments instead
    (:func:`_ring_forward_moment`): none of them is alive while the ring's loop runs. FPDT x ring: FPDT's, one
    chunk's (over U ranks)."""
    hd = lay.shape.head_dim
    if not lay.attention_layers or (
        lay.ring > 1 and not lay.fpdt
    ):  # a ring's: in its moments (not in its loop)
        return _Term("all-to-all buffers", 0)
    if lay.fpdt:
        nbytes = 2 * lay.b * lay.chunk * lay.heads_tp * hd * lay.qa
    else:
        nbytes = 2 * lay.t * lay.heads_tp * hd * lay.m
    note = "send + receive of one all-to-all" + (" (attention layers only)" if lay.shape.blocks else "")
    return _Term("all-to-all buffers", nbytes, note=note)


# ---- ring attention (ring_size > 1): the k/v blocks in flight, the dk/dv buffers (attention/ring.py) ----
# Per rank, with q = (b, N/r, H/U, hd) and kv = (b, N/r, H_kv'/U, hd) elements in head layout: one k/v block
# ``blk = 2 * kv * m`` (one message), one dk/dv block ``dblk = 2 * kv * ct`` (fp32), one kernel call a zigzag
# chunk's rows (N/(2r)) against a chunk's keys (the fused kernels run a whole chunk per call). The counts of
# each moment follow ``_RingAttention``'s loop: a pass keeps its send buffer until it is waited for, and the
# previous call's outputs stay alive until the next call returns (Python rebinds the names after the call).


def _ring_forward_moment(lay: _PerRank) -> tuple[int, int]:
    """``(ring buffers, attention working set)`` at the largest moment of ring attention's forward: a kernel
    call merging, with two k/v blocks (the visiting one and the next arriving), the fp32 output accumulator,
    and the call's fp32 output, the merge's two products and their sum (and five log-sum-exp-sized
    temporaries); with U > 1 the all-to-all before and after the loop. The fp32 log-sum-exp accumulator is the
    kept lse; in fp32 the output accumulator is the kept output itself."""
    q, ct = lay.q_elems, lay.ct
    acc = q * ct if ct != lay.qa else 0
    lse = lay.bn // 2 * lay.heads_per_rank * ct  # one call's rows
    loop = (2 * lay.ring_block_bytes, acc + 4 * (q // 2 * ct) + 5 * lse)
    return max(loop, (0, _ring_all_to_all_bytes(lay)), key=sum)


def _ring_all_to_all_bytes(lay: _PerRank) -> int:
    """With U > 1, the send and receive buffers of one all-to-all over the Ulysses group (Ulysses' count),
    before and after the ring's loop."""
    return 2 * lay.t * lay.heads_tp * lay.shape.head_dim * lay.m if lay.ulysses > 1 else 0


def _ring_backward_moment(lay: _PerRank) -> tuple[int, int]:
    """``(ring buffers, attention working set)`` at the largest moment of ring attention's backward; the
    output's gradient ``dout`` (head layout), ``delta = rowsum(dout * out)`` and the fp32 dq accumulator are
    alive throughout. A kernel call holds the previous call's fp32 dq/dk/dv and its own, in the kernel's
    dtype and in fp32 (in fp32: and the copy of its rows' lse the kernel reads). Blocks (k/v, fp32 dk/dv)
    while a step computes: step 0 (2, 1), the middle steps (2, 3) (the visiting and the next k/v; the
    accumulating dk/dv, the one sent last step and the one received), the last step (1, 3). Other moments: ``delta``'s product (fp32 copies of dout and out under a 16-bit
    dtype), the casts of dq/dk/dv home, and with U > 1 their all-to-all back to sequence layout (as Ulysses,
    with the all-to-all's buffers)."""
    q, kv, m, ct = lay.q_elems, lay.kv_elems, lay.m, lay.ct
    blk, dblk = lay.ring_block_bytes, 2 * kv * ct
    half = (q + 2 * kv) // 2  # one call's dq, dk, dv elements
    # the kernel's outputs beside the previous call's: cast to fp32 after it returns (a 16-bit dtype), or while
    # it runs, with the contiguous copy of its rows' lse it reads
    call = 2 * half * ct + (half * m if m != ct else lay.bn // 2 * lay.heads_per_rank * ct)
    base = q * m + lay.bn * lay.heads_per_rank * ct + q * ct  # dout, delta, dq
    steps = [(2, 1), (1, 3)] + ([(2, 3)] if lay.ring > 2 else [])
    moments = [(k * blk + d * dblk, base + call) for k, d in steps]
    moments.append((0, q * m + q * ct * (3 if m != ct else 1)))  # delta's product
    moments.append((blk + dblk, base + half * ct + ((q + 2 * kv) * m if m != ct else 0)))  # the casts home
    if lay.ulysses > 1:  # dq/dk/dv in both layouts and the all-to-all's buffers, as Ulysses'
        moments.append((0, 2 * q * m + 2 * (q + 2 * kv) * m + _ring_all_to_all_bytes(lay)))
    return max(moments, key=sum)


# ---- FPDT x ring (fpdt_chunk_size c with ring_size r > 1): attention/fpdt_ring.py ----
# Per rank: K = N / (r U c) local segments of S = U c tokens with H/U heads (kv H_kv'/U); one stacked k/v segment
# ``kv_seg = 2 * seg_kv * qa`` bytes, one k/v block (the K segments of a ring rank, one ring step's messages)
# ``block = 2 * kv * qa``. Kept in the ChunkStore (on the host with offload): q, kv, out, lse (the activations'
# store) and in backward dout, delta. Through the ring steps: the ``arriving`` store of the next step's K
# segments (a block) and, from the second step of a ring of r > 2, the ``visiting`` store (the previous step's
# arriving one) beside it: ``(2 if r > 2 else 1) * block`` on the device; with offload on the host, where the
# arriving store holds K - 1 segments while the last one is received and the visiting segment is fetched back
# (two segments on the device). The counts of each moment follow ``_FPDTRingAttention``'s loop (a pass keeps
# its send and receive buffers until it is waited for and its handle rebound), checked against the live tensor
# bytes of a real ``fpdt_ring_attention`` (tests/test_planner.py).


def _fpdt_ring_segments(lay: _PerRank) -> tuple[int, int, int, int]:
    """``(seg_q, seg_kv, kv_seg, block)`` of FPDT x ring: one segment's q and k (elements), one stacked k/v
    segment and one k/v block (bytes, in q's dtype: ``torch.stack`` promotes v)."""
    hd = lay.shape.head_dim
    seg_q, seg_kv = lay.segment * lay.heads_per_rank * hd, lay.segment * lay.kv_per_rank * hd
    return seg_q, seg_kv, 2 * seg_kv * lay.qa, lay.ring_block_bytes


def _fpdt_ring_kv_stores(lay: _PerRank) -> tuple[int, int]:
    """``(device, host)`` bytes of the ring's k/v stores while a step computes (see above)."""
    _, _, kv_seg, block = _fpdt_ring_segments(lay)
    stores = (2 if lay.ring > 2 else 1) * block
    return (2 * kv_seg, stores - kv_seg) if lay.offload else (stores, 0)


def _fpdt_ring_forward_moments(lay: _PerRank) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(ring buffers device, ring buffers host, attention working set)`` at the two largest moments of FPDT x
    ring's forward. In the ring steps (a unit computing): the k/v stores (:func:`_fpdt_ring_kv_stores`); the
    fp32 out/lse accumulators of ALL K local segments (``_SegmentAcc``: ``(b, N/r, H/U, hd)`` and its lse); one
    unit's fp32 output, the merge's two products and their sum (and five lse-sized temporaries); the q segment
    fetched back with offload; a math score tile (masks: none with the fused kernel). At the end (the whole
    store kept): every segment's output back in sequence layout, their concatenation, and the last unit's fp32
    output and lse."""
    seg_q, _, _, _ = _fpdt_ring_segments(lay)
    ct, seg_lse = lay.ct, lay.segment * lay.heads_per_rank * lay.ct
    accs = lay.q_elems * ct + lay.bn * lay.heads_per_rank * ct
    unit = 4 * seg_q * ct + 5 * seg_lse
    fetched = seg_q * lay.qa if lay.offload else 0
    device, host = _fpdt_ring_kv_stores(lay)
    loop = (device, host, accs + unit + fetched + _fpdt_score_tile_bytes(lay))
    return loop, (0, 0, 2 * lay.q_elems * lay.qa + seg_q * ct + seg_lse)


def _fpdt_ring_forward_moment(lay: _PerRank) -> tuple[int, int, int]:
    """The larger on the device of :func:`_fpdt_ring_forward_moments` (the ring steps' on a tie)."""
    loop, end = _fpdt_ring_forward_moments(lay)
    return loop if loop[0] + loop[2] >= end[0] + end[2] else end


def _fpdt_ring_backward_moment(lay: _PerRank) -> tuple[int, int, int, int]:
    """``(ring buffers device, ring buffers host, attention working set device, host)`` at the largest moment
    of FPDT x ring's backward (a unit computing in the last ring step). Ring buffers: the k/v stores as forward;
    the visiting segment's fp32 dk/dv; the K dk/dv passes one hop behind (``behind``: each its send and receive
    buffer, two fp32 dk/dv blocks, on the device) and the previous segment's received dk/dv, waited for but
    not yet released (one segment). Working set: the output's gradient (sequence layout), the fp32 dq accumulators of
    all K segments, the dout and fp32 delta segments in the store (the host with offload), the previous unit's
    and this unit's fp32 dq/dk/dv and the lse rows the kernel reads, two math score tiles and, with offload, one
    segment's q, out, dout, lse, delta fetched back."""
    seg_q, seg_kv, _, _ = _fpdt_ring_segments(lay)
    ct, qa, q = lay.ct, lay.qa, lay.q_elems
    seg_lse, lse = lay.segment * lay.heads_per_rank * ct, lay.bn * lay.heads_per_rank * ct
    device, host = _fpdt_ring_kv_stores(lay)
    dkv_seg, dkv_block = 2 * seg_kv * ct, 2 * lay.kv_elems * ct
    ring = device + dkv_seg + 2 * dkv_block + dkv_seg
    dout_delta = q * qa + lse
    work = q * qa + q * ct + 2 * (seg_q + 2 * seg_kv) * ct + seg_lse + 2 * _fpdt_score_tile_bytes(lay)
    work += 3 * seg_q * qa + 2 * seg_lse if lay.offload else dout_delta
    return ring, host, work, dout_delta if lay.offload else 0


def _ring_forward_buffers(lay: _PerRank) -> _Term:
    """The ring's k/v blocks in flight during the forward (:func:`_ring_forward_moment`; FPDT x ring:
    :func:`_fpdt_ring_forward_moment`, the host's with offload)."""
    if lay.ring == 1 or not lay.attention_layers:
        return _Term("ring buffers", 0)
    if lay.fpdt:
        device, host, _ = _fpdt_ring_forward_moment(lay)
        return _Term("ring buffers", device, host)
    return _Term("ring buffers", _ring_forward_moment(lay)[0])


def _ring_backward_buffers(lay: _PerRank) -> _Term:
    """The ring's k/v blocks and fp32 dk/dv blocks during the backward (:func:`_ring_backward_moment`)."""
    if lay.ring == 1 or not lay.attention_layers:
        return _Term("ring buffers", 0)
    tokens, kv = lay.bn // lay.b, lay.kv_per_rank
    if lay.fpdt:
        device, host, _, _ = _fpdt_ring_backward_moment(lay)
        note = (
            f"k/v blocks of {format_bytes(lay.ring_block_bytes)} ({tokens:,} tokens x {kv} kv heads; ring "
            f"{lay.ring} x Ulysses {lay.ulysses}) as {tokens // (lay.segment // lay.b)} segments of "
            f"{lay.segment // lay.b:,} tokens"
            + (" (host: offload)" if lay.offload else "")
            + ", fp32 dk/dv block behind in backward"
        )
        return _Term("ring buffers", device, host, note=note)
    note = (
        f"k/v blocks of {format_bytes(lay.ring_block_bytes)} ({tokens:,} tokens x {kv} kv heads; ring "
        f"{lay.ring} x Ulysses {lay.ulysses}) in flight, fp32 dk/dv blocks in backward"
    )
    return _Term("ring buffers", _ring_backward_moment(lay)[0], note=note)


def _state_exchange_buffers(lay: _PerRank) -> _Term:
    """Recurrent layers (no all-to-all): the all-gathered per-segment state summaries of the exclusive affine
    scan, fp32, for every segment of the sequence (``P`` ranks x local segments x b). GDN: ``[M | B]``,
    ``heads x dk x (dk + dv)``; Mamba-2: the scalar decay and the state, ``heads x (1 + p x n)``. Backward
    gathers the entry states' gradients, no larger. Small: independent of the sequence length per segment."""
    s, n = lay.shape, lay.segments * lay.b
    sizes = {}
    if s.gdn is not None:
        sizes["gated_deltanet"] = n * s.gdn.heads * s.gdn.dk * (s.gdn.dk + s.gdn.dv) * 4
    if s.mamba2 is not None:
        sizes["mamba2"] = n * s.mamba2.heads * (1 + s.mamba2.head_dim * s.mamba2.state) * 4
    if not sizes:
        return _Term("state exchange buffers", 0)
    note = f"all-gathered state summaries of {n} segments (" + ", ".join(sizes) + "); no all-to-all"
    return _Term("state exchange buffers", max(sizes.values()), note=note)


def _mlp_forward(lay: _PerRank) -> _Term:
    """FPDT's tiled MLP: its output (+ its input's copy) and one chunk without grad (+ the weights' casts).
    Ulysses: the MLP's output. (Noted with the backward.)"""
    s = lay.shape
    if not lay.mlp_layers:
        return _Term("MLP working set", 0)
    if not lay.fpdt:
        return _Term("MLP working set", s.d * lay.m * lay.t)
    chunk = min(lay.mlp_chunk, lay.t) * lay.inter_tp * lay.m  # one (chunk, I / tp) tensor
    n_mlp = 4 if s.gated else 2
    return _Term("MLP working set", 2 * s.d * lay.r * lay.t + (n_mlp - 1) * chunk
                 + lay.mlp_weights * lay.chunk_casts)  # fmt: skip


def _mlp_backward(lay: _PerRank) -> _Term:
    """FPDT's tiled MLP: grad_x and one chunk recomputed with grad (+ the casts). Ulysses: the activation's
    gradients (act*up is freed). Both: the residual stream's gradient."""
    s = lay.shape
    if not lay.mlp_layers:
        return _Term("MLP working set", 0)
    if lay.fpdt:
        mc = min(lay.mlp_chunk, lay.t)
        n_mlp = 4 if s.gated else 2
        nbytes = (
            2 * s.d * lay.r * lay.t
            + (n_mlp + 3) * mc * lay.inter_tp * lay.m
            + lay.mlp_weights * lay.chunk_casts
        )
        note = f"tiled: {mc:,}-token chunks"
    else:
        nbytes = (2 if s.gated else 1) * lay.inter_tp * lay.m * lay.t
        note = "MLP gradients"
    return _Term("MLP working set", nbytes + _residual_gradient_bytes(lay), note=note)


def _recomputed_block(lay: _PerRank) -> _Block:
    """The layer kind whose recompute holds the most (a hybrid's heaviest layer: its backward is the peak)."""
    return max(set(lay.blocks), key=lambda b: (_layer_device_bytes(lay, b), b.mixers))


def _recomputed_layer_attention(lay: _PerRank) -> _Term:
    """Checkpointing: the recomputed layer's saved tensors up to its MLP (its FPDT chunks on the host with
    offload). Its first norm saves the checkpointed input itself: FPDT's tiled norm always, Hugging Face's
    when that input is fp32 already."""
    if not lay.checkpointing:
        return _Term(_RECOMPUTE, 0)
    block = _recomputed_block(lay)
    shared = lay.shape.d * lay.r * lay.t if (lay.fpdt or lay.r == 4) and block.mixers else 0
    device = _layer_device_bytes(lay, block) - _layer_mlp_bytes(lay, block) - shared
    device -= _o_proj_input_bytes(lay, block)
    return _Term(_RECOMPUTE, device, _offloaded_bytes(lay, block), note="one layer recomputed in backward")


def _recomputed_o_proj_input(lay: _PerRank) -> _Term:
    """Checkpointing: the recomputed layer's o_proj input, freed before its attention runs backward."""
    return _Term(_RECOMPUTE, _o_proj_input_bytes(lay, _recomputed_block(lay)) if lay.checkpointing else 0)


def _recomputed_layer_mlp(lay: _PerRank) -> _Term:
    """Checkpointing: the recomputed layer's MLP tensors (freed by the time its attention runs backward)."""
    return _Term(_RECOMPUTE, _layer_mlp_bytes(lay, _recomputed_block(lay)) if lay.checkpointing else 0)
