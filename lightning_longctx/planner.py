"""Memory planner: the bytes one training step needs per device and per host, before you launch it.

:func:`plan_memory` models one steady-state training step (forward, backward, optimizer step) of a
Hugging Face decoder LM under :class:`~lightning_longctx.UlyssesFPDTStrategy`, from the model config
and the strategy's settings alone (no weights, no GPU). :func:`longest_sequence` searches the longest
sequence whose plan fits a device (and a host) memory size. ``lightning-longctx plan --config my.yaml``
prints both for a LightningCLI config.

The model follows the code of this package and of PyTorch/transformers tensor by tensor (checked
against a step's allocations with the PyTorch profiler and against peak RSS; docs/benchmarks.md).
Per rank, with ``t = micro_batch_size * N / P`` local tokens, ``d, L, H, H_kv, hd, I, V`` the
config's dims, ``w`` the (master) parameter bytes, ``pw`` the bytes of the parameters the compute reads
(FSDP2's MixedPrecisionPolicy: bf16 over fp32 master weights under ``fsdp`` + ``bf16-mixed``; else ``w``),
``m`` the matmul (autocast) bytes, ``r`` the residual stream's bytes (the embedding's dtype):

* **weights** ``= n_params * w`` (``/ (dp*sp)`` with FSDP; LoRA adapters included); **gradients** and
  **optimizer state** (2 AdamW states, in the parameter dtype) of the trainable parameters only (LoRA: the
  adapters, the frozen base has none); with ``cpu_offload`` (FSDP2's CPUOffloadPolicy) all three are on the
  host and the optimizer step runs there. DDP: the gradients are views into its all-reduce buckets (the
  strategy sets ``gradient_as_bucket_view=True``), allocated for the whole run, so they show as **DDP
  gradient buckets** in every phase; FSDP: the unsharded root parameters (embedding, head, final norm)
  for the step, two unsharded blocks (current + prefetched), in ``pw``, and in backward one block's
  unsharded gradients with their reduce-scatter input (``w``: fp32 under the policy) and the root's.
* **activations kept for backward**, per layer per token: two RMSNorms ``2 * (4 + r) * d`` (fp32 input,
  normalised copy; FPDT tiles the norms: ``2 * r * d``, their input only); the projections' inputs (``d*m``
  each; under autocast each of q/k/v and gate/up keeps its own cast copy); attention in head layout after
  the all-to-all: q, k, v, out ``(2H + 2H_kv') * hd`` and the fp32 log-sum-exp ``4H`` (FPDT: the same per
  chunk, in host memory with offload; its blocks run in the autocast dtype, the lse too); the o_proj input
  ``H*hd*m``; the MLP's gate, act, up, act*up ``4*I*m`` (none when FPDT tiles it). With activation
  checkpointing only each layer's input ``d*r``, and one layer is recomputed in backward; FPDT's offloaded
  chunks are saved tensors, so the checkpoint drops them after each layer's forward and the recompute
  rebuilds them: the host holds the running layer's in forward, the recomputed layer's in backward. With
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

* **tensor parallelism** (``tensor_parallel_size = tp``, FSDP only; the world is dp x sp x tp): one rank
  holds the shards of the model's Hugging Face TP plan (q/k/v, gate/up and MoE experts' packed gate/up
  column-wise, o_proj/down row-wise: ``/ tp``; a row-wise bias, the embedding, norms, Qwen3's q/k norms and a
  MoE router whole), FSDP shards that over dp x sp, and its unsharded blocks are the TP-local ones. The
  lm_head splits over the vocabulary only in FPDT mode, untied and ``V % tp == 0``: the chunked loss then
  runs on ``(loss_chunk, V/tp)`` blocks with a ``(V/tp, d)`` fp32 head gradient and an fp32 hidden-state
  gradient (summed over tp), else it is replicated (Ulysses: full logits). Activations of hidden width (the
  residual stream, the norms, the o/down projections' outputs, the checkpointed layer inputs) are replicated
  over tp; those per head (q/k/v, out, lse, the o_proj input, the all-to-all buffers, the attention working
  set: ``H/tp`` heads before the sp split) and the MLP's intermediates are ``/ tp``.

* **hybrid models** (layer kinds from ``config.layer_types`` / ``layers_block_type``, or the model type when
  attention-free): gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid) and Mamba-2 layers (Mamba2, Bamba,
  Falcon-H1, whose layers run attention and Mamba-2 side by side; Granite-4 hybrid and Nemotron-H as far as
  they are not mixture-of-experts configs, which are refused) keep their
  own activations instead of attention's; the attention terms count the attention layers only, and Mamba-2
  blocks have no MLP. Per token, what HF's torch fallbacks save (``_gdn_token_bytes`` /
  ``_mamba2_token_bytes``, within 10 % of a measured mixer forward, tests/test_planner.py), with the package's
  state-passing adapters: the projections' inputs, the conv's input and output, fp32 copies of q/k/v (x, B,
  C) and their chunked forms, ``5 * heads * 64`` (GDN; Mamba-2: ``3 * heads * chunk``) fp32 intra-chunk
  matrix entries, one state per chunk (GDN: ``heads * dk * (dv + dk)`` with the identity columns), the gated
  norm and out_proj inputs. These layers have no all-to-all: their **state exchange buffers** are the
  all-gathered fp32 per-segment summaries (GDN ``heads * dk * (dk + dv)``, Mamba-2 ``heads * (1 + p * n)``
  per segment, ``P`` segments, ``P * chunks`` with FPDT). With checkpointing the heaviest layer kind is the
  one recomputed.

The peak is the largest of five phases: the last layer's forward and the loss forward (with the
previous step's gradients still allocated: Lightning frees them between forward and backward), the
loss backward, the last layer's backward, and the optimizer step. A layer phase is the larger of its
attention moment and its MLP moment (the layer's MLP tensors do not exist yet, or are freed, while its
attention runs). Each component is shown with its device bytes in the peak phase, so the rows add up to
the total; ``largest`` is its maximum at any moment, its host bytes the most it holds on the host in any
phase.

Fitting: :attr:`MemoryPlan.fits` compares ``device_total`` plus a reserve (``CUDA_CONTEXT_BYTES``, 1 GiB for
the CUDA context and cuBLAS / NCCL workspaces, plus ``ALLOCATOR_RESERVE``, 5 % of the peak for the caching
allocator's slack; ``device_reserve=`` to change it) with ``device_memory``, and ``devices_per_host`` ranks'
host peak plus ``HOST_PROCESS_BYTES`` each (4 GiB: the process, its data loader) with ``host_memory``;
:attr:`MemoryPlan.binding` names the limit with the least room.

In the code: :func:`plan_memory` resolves its arguments once into a ``_Layout`` (per-rank shapes, dtype
sizes, mode flags); each memory term is one small function of it returning a ``_Term`` (device bytes,
host bytes, the table row it adds to, a note); ``_PHASE_TABLE`` says at which moments each term is
alive, and ``_plan`` sums them and takes the peak. A new memory term is one function plus one line of
the table.

What it does not model: mixture-of-experts layers (their TP split is counted, ``_count_params``; their
configs are refused), non-RMSNorm norms and fused qkv projections (counted
as Llama's), LoRA's rank-r activations, and gradient accumulation (gradients then persist through
backward: add ``gradients`` to the peak). Hybrids: the recurrent layers' saved bytes are the torch
fallbacks' (fla / mamba-ssm kernels on GPU save far less: the plan is then an upper bound); their backward
working set (gradients of the fp32 chunk tensors) is not counted; the layer phases are the last attention
layer's with every layer's activations alive; tensor parallelism of hybrids, and the recurrent kinds MiniMax
lightning attention, Kimi delta attention, Mamba-1, RG-LRU, RWKV, xLSTM, Zamba2's shared blocks and LFM2's
convolutions are refused with the kind named.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_longctx.attention.common import kv_repeat_factor
from lightning_longctx.chunked_loss import default_loss_chunk_size
from lightning_longctx.config import DEFAULT_FPDT_CHUNK_SIZE, MODES, SUPPORTED_PRECISION, ResolvedConfig
from lightning_longctx.flops import _NON_GATED_MODEL_TYPES, _dims, _text_config, matmul_params
from lightning_longctx.fsdp import MIXED_PRECISION_DTYPES
from lightning_longctx.sharding import chunk_for

__all__ = [
    "MemoryComponent",
    "MemoryPlan",
    "format_bytes",
    "longest_sequence",
    "parallel_kwargs",
    "parse_bytes",
    "plan_memory",
]

DATA_PARALLEL = ("ddp", "fsdp")
#: LoRA target meaning every linear layer of the blocks (peft's name; the lm_head is not one of them)
ALL_LINEAR = "all-linear"
#: Device memory the plan's tensors cannot use: the CUDA context with cuBLAS / NCCL workspaces, plus the
#: caching allocator's slack (reserved but not allocated: fragmentation), as a fraction of the peak.
CUDA_CONTEXT_BYTES = 1 << 30
ALLOCATOR_RESERVE = 0.05
#: Host memory per rank outside the plan: the process itself (Python, torch and CUDA libraries, the CUDA
#: context's host side), its data loader.
HOST_PROCESS_BYTES = 4 << 30
#: devices per host when ``devices_per_host`` is not given: the job's world, at most 8 (one GPU node)
DEFAULT_DEVICES_PER_HOST = 8
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
    "state exchange buffers",
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
    block_linears: tuple[tuple[str, int, int], ...]  # one block's nn.Linear: (name, in, out), for LoRA
    tp: _TPSplit  # how the model's tensor-parallel plan splits its parameters
    blocks: tuple[_Block, ...] = ()  # each decoder layer's mixers (hybrid models); empty: all Llama blocks
    gdn: _GDNDims | None = None  # the gated DeltaNet layers' dims, when the model has some
    mamba2: _Mamba2Dims | None = None  # the Mamba-2 layers' dims, when the model has some


#: ``(rows along the split dim, elements per row)`` of parameters split over tp, summed per row count
_Split = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _TPSplit:
    """What ``tensor_parallel_size`` splits (:func:`lightning_longctx.tensor_parallel.tp_plan_of`, applied by
    transformers' styles): colwise / packed_colwise parameters along their output dim (dim 0; dim 1 of a 3-D
    expert tensor), rowwise / packed_rowwise weights along their last dim (a rowwise bias stays replicated),
    everything else replicated (embedding, norms, Qwen3's q/k norms, a MoE router). A split of ``n`` rows
    leaves the largest rank ``ceil(n / tp)`` of them (DTensor's ``Shard``)."""

    styles: tuple[str, ...]  # the plan's styles, sorted (empty: the model declares no plan)
    blocks: _Split  # every block's split parameters
    block: _Split  # the largest block's
    head: int  # elements of an lm_head that can split over the vocabulary (an untied nn.Linear); 0: it cannot

    @staticmethod
    def removed(split: _Split, tp: int) -> int:
        """Elements of ``split`` one rank does not hold when split ``tp`` ways."""
        return sum((n - -(-n // tp)) * rest for n, rest in split)


# ---------------------------------------------------------------------------------------------------
# Layer kinds: which mixer each decoder layer runs (hybrid models)
# ---------------------------------------------------------------------------------------------------

ATTENTION, GATED_DELTANET, MAMBA2 = "attention", "gated_deltanet", "mamba2"
#: models whose ``linear_attention`` layers are gated DeltaNet (``torch_chunk_gated_delta_rule``)
_GDN_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next",
                              "olmo_hybrid"})  # fmt: skip
#: models whose ``linear_attention`` (``mamba``) layers are Mamba-2 SSD (``mamba2_chunk_scan``)
_MAMBA2_MODEL_TYPES = frozenset({"mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h"})
#: models (or layer kinds) whose recurrent layers the planner does not model, and what they run
_UNMODELLED = {
    "minimax": "MiniMax lightning attention",
    "kimi_linear": "Kimi delta attention (with MLA attention)",
    "mamba": "Mamba-1 selective scan",
    "falcon_mamba": "Mamba-1 selective scan",
    "jamba": "Mamba-1 selective scan",
    "recurrent_gemma": "RG-LRU recurrence",
    "rwkv": "RWKV time mixing",
    "xlstm": "xLSTM (mLSTM) recurrence",
    "zamba2": "Zamba2 shared hybrid blocks",
    "lfm2": "LFM2 short convolutions",
}
#: the chunk of HF's ``torch_chunk_gated_delta_rule`` (its callers leave the default)
GDN_CHUNK_SIZE = 64


@dataclass(frozen=True)
class _Block:
    """One decoder layer: its token mixers (Falcon-H1 runs attention and Mamba-2 side by side on one norm's
    output) and whether an MLP (with its own norm) follows (Mamba-2's blocks have none)."""

    mixers: tuple[str, ...]
    mlp: bool = True


_LLAMA_BLOCK = _Block((ATTENTION,))


@dataclass(frozen=True)
class _GDNDims:
    """A gated DeltaNet layer: ``key_heads`` q/k heads of ``dk``, ``heads`` value heads of ``dv`` (q/k are
    repeated to them), a causal conv of ``conv`` taps over q, k, v, chunks of ``chunk`` tokens."""

    key_heads: int
    heads: int
    dk: int
    dv: int
    conv: int
    chunk: int = GDN_CHUNK_SIZE

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (q, k, v): ``in_proj_qkv``'s width."""
        return 2 * self.key_heads * self.dk + self.heads * self.dv


@dataclass(frozen=True)
class _Mamba2Dims:
    """A Mamba-2 layer: ``heads`` of ``head_dim`` (``inner`` = their product), state size ``state`` shared by
    ``groups`` groups of heads (B, C), a causal conv of ``conv`` taps over x, B, C, SSD chunks of ``chunk``."""

    heads: int
    head_dim: int
    state: int
    groups: int
    conv: int
    chunk: int
    inner: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C."""
        return self.inner + 2 * self.groups * self.state


def _refuse_kind(config: Any, kind: str) -> None:
    raise ValueError(
        f"{type(config).__name__} has {kind} layers, which plan_memory does not model (it knows attention, "
        "gated DeltaNet and Mamba-2 layers); plan a model of those kinds, or measure this one"
    )


def _layer_types(config: Any) -> list[str] | None:
    """The per-layer kinds the config declares (``layer_types``, else ``layers_block_type``)."""
    for name in ("layer_types", "layers_block_type"):
        kinds = getattr(config, name, None)
        if kinds is not None:
            return [str(k) for k in kinds]
    return None


def _block_of(config: Any, kind: str) -> _Block:
    """One layer kind of a config as a :class:`_Block` (a ValueError naming a kind it does not model)."""
    model_type = getattr(config, "model_type", "")
    if kind == "linear_attention" or kind == "mamba":
        if model_type in _GDN_MODEL_TYPES:
            return _Block((GATED_DELTANET,))
        if model_type in _MAMBA2_MODEL_TYPES:  # Mamba-2 and Nemotron-H blocks are the mixer alone
            return _Block((MAMBA2,), mlp=model_type not in ("mamba2", "nemotron_h"))
        _refuse_kind(config, f"{kind!r} ({model_type})")
    if kind == "hybrid" and model_type == "falcon_h1":
        return _Block((ATTENTION, MAMBA2))
    if kind == "mlp" and model_type == "nemotron_h":
        return _Block((), mlp=True)
    if kind.endswith("attention") and kind != "linear_attention":
        return _Block((ATTENTION,), mlp=model_type != "nemotron_h")
    _refuse_kind(config, repr(kind))
    raise AssertionError  # unreachable: _refuse_kind raises


def _blocks_of(config: Any) -> tuple[_Block, ...]:
    """Each decoder layer's :class:`_Block`; ``()`` for a model of Llama blocks only. Recurrent kinds the
    planner does not model are refused here, naming the kind, before anything counts them as attention."""
    model_type = getattr(config, "model_type", "")
    if model_type in _UNMODELLED:
        _refuse_kind(config, _UNMODELLED[model_type])
    kinds = _layer_types(config)
    if model_type == "mamba2":  # attention-free: every layer is a Mamba-2 block
        kinds = ["mamba"] * int(config.num_hidden_layers)
    if kinds is None:
        return ()
    blocks = tuple(_block_of(config, kind) for kind in kinds)
    return () if all(b == _LLAMA_BLOCK for b in blocks) else blocks


def _gdn_dims(config: Any) -> _GDNDims:
    return _GDNDims(key_heads=int(config.linear_num_key_heads), heads=int(config.linear_num_value_heads),
                    dk=int(config.linear_key_head_dim), dv=int(config.linear_value_head_dim),
                    conv=int(config.linear_conv_kernel_dim))  # fmt: skip


def _mamba2_dims(config: Any) -> _Mamba2Dims:
    """The Mamba-2 fields, under each family's names (Mamba2 / Nemotron-H, or Bamba / Granite / Falcon-H1's
    ``mamba_*``)."""

    def get(*names: str) -> int:
        value = next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
        if value is None:
            raise ValueError(
                f"{type(config).__name__} lacks {names[0]!r}: its Mamba-2 layers cannot be planned"
            )
        return int(value)

    d = int(config.hidden_size)
    heads, head_dim = (
        get("mamba_n_heads", "mamba_num_heads", "num_heads"),
        get("mamba_d_head", "mamba_head_dim", "head_dim"),
    )
    inner = getattr(config, "mamba_d_ssm", None) or heads * head_dim or get("mamba_expand", "expand") * d
    return _Mamba2Dims(heads=heads, head_dim=head_dim, state=get("mamba_d_state", "ssm_state_size", "state_size"),
                       groups=get("mamba_n_groups", "n_groups"), conv=get("mamba_d_conv", "conv_kernel"),
                       chunk=get("mamba_chunk_size", "chunk_size"), inner=int(inner))  # fmt: skip


def _mixer_matmul_params(d: int, g: _GDNDims | None, m2: _Mamba2Dims | None, kind: str) -> int:
    """Weights of one recurrent mixer's projections (what autocast casts): GDN's in_proj_qkv, z, b, a and
    out_proj; Mamba-2's in_proj (x, z, B, C, dt) and out_proj."""
    if kind == GATED_DELTANET and g is not None:
        return d * (g.conv_dim + g.heads * g.dv + 2 * g.heads) + g.heads * g.dv * d
    if kind == MAMBA2 and m2 is not None:
        return d * (2 * m2.inner + 2 * m2.groups * m2.state + m2.heads) + m2.inner * d
    return 0


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


def _split_dim(style: str, name: str, shape: tuple[int, ...]) -> int | None:
    """The dim a plan style splits a parameter along (transformers' ``shard_param``), ``None``: replicated."""
    if style in ("colwise", "packed_colwise", "colwise_gather_output"):
        return len(shape) - 2 if len(shape) > 1 else 0  # a 3-D expert tensor: (experts, out, in)
    if style in ("rowwise", "packed_rowwise"):
        return None if len(shape) == 1 or name.rsplit(".", 1)[-1] == "bias" else len(shape) - 1
    return None


def _summed(pairs: list[tuple[int, int]]) -> _Split:
    out: dict[int, int] = {}
    for n, rest in pairs:
        out[n] = out.get(n, 0) + rest
    return tuple(sorted(out.items()))


def _tp_split(model: Any, blocks: list[Any]) -> _TPSplit:
    """Each parameter's tensor-parallel split by the model's own plan (works on the meta device)."""
    from lightning_longctx.tensor_parallel import tp_plan_of, vocab_parallel_head

    plan = tp_plan_of(model)
    split = {}  # id(param) -> (rows, elements per row)
    for name, p in model.base_model.named_parameters():
        dim = _split_dim(plan[name], name, tuple(p.shape)) if name in plan else None
        if dim is not None:
            split[id(p)] = (p.shape[dim], p.numel() // p.shape[dim])
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    largest = blocks[sizes.index(max(sizes))] if blocks else None
    # the strategy's rule for an lm_head that can split (untied, linear); vocab % tp is checked per plan
    head = model.get_output_embeddings() if vocab_parallel_head(model, 1) is not None else None
    return _TPSplit(
        styles=tuple(sorted(set(plan.values()))),
        blocks=_summed([split[id(p)] for b in blocks for p in b.parameters() if id(p) in split]),
        block=_summed([split[id(p)] for p in largest.parameters() if id(p) in split] if largest else []),
        head=0 if head is None else sum(p.numel() for p in head.parameters()),
    )


def _count_params(config: Any) -> tuple[int, int, int, str, tuple[tuple[str, int, int], ...], _TPSplit]:
    """(all, largest block, outside blocks, class name, the largest block's linears, the tensor-parallel
    split) from the model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    block_sizes, in_block, linears, blocks = [], set(), (), []
    for module in model.modules():
        if type(module).__name__ in block_names:
            params = list(module.parameters())
            size = sum(p.numel() for p in params)
            if size > max(block_sizes, default=-1):
                linears = tuple((n.rsplit(".", 1)[-1], m.in_features, m.out_features)
                                for n, m in module.named_modules() if isinstance(m, torch.nn.Linear))  # fmt: skip
            block_sizes.append(size)
            blocks.append(module)
            in_block.update(id(p) for p in params)
    total = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_block)
    try:
        split = _tp_split(model, blocks)
    except Exception:  # a model whose plan cannot be read: no split (tp > 1 is refused), the counts stand
        split = _TPSplit((), (), (), 0)
    return total, max(block_sizes, default=0), root, type(model).__name__, linears, split


@functools.lru_cache(maxsize=32)
def _shape_cached(config_json: str, model_type: str) -> _Shape:
    from transformers import AutoConfig

    fields = json.loads(config_json)
    fields.pop("model_type", None)  # to_diff_dict has it; for_model takes it apart
    return _shape_of(AutoConfig.for_model(model_type, **fields))


def _hybrid_dims(text: Any, blocks: tuple[_Block, ...]) -> tuple[int, int, int, int, int, int, int]:
    """(d, L, H, H_kv, hd, I, V) of a hybrid config; an attention-free one (Mamba-2) has no attention or MLP
    fields: one placeholder head of width 0 and no MLP, so the attention and MLP terms count nothing."""
    if any(ATTENTION in b.mixers for b in blocks):
        return _dims(text)
    if getattr(text, "num_experts_per_tok", None) is not None or getattr(text, "num_local_experts", None):
        raise ValueError(
            f"{type(text).__name__} is a mixture-of-experts config; plan_memory does not model experts"
        )
    d, layers, vocab = int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)
    return d, layers, 1, 1, 0, int(getattr(text, "intermediate_size", 0) or 0), vocab


def _hybrid_matmul_params(dims: tuple[int, ...], blocks: tuple[_Block, ...], gated: bool,
                          gdn: _GDNDims | None, m2: _Mamba2Dims | None) -> int:  # fmt: skip
    """The matmul weights of a hybrid model, layer by layer: each block's mixers' and MLP's, and the head."""
    d, _, heads, kv_heads, head_dim, inter, vocab = dims
    attention = 2 * d * head_dim * (heads + kv_heads)
    mlp = (3 if gated else 2) * d * inter
    total = d * vocab
    for block in blocks:
        total += mlp if block.mlp else 0
        for kind in block.mixers:
            total += attention if kind == ATTENTION else _mixer_matmul_params(d, gdn, m2, kind)
    return total


def _shape_of(config: Any) -> _Shape:
    text = _text_config(config)
    blocks = _blocks_of(text)  # refuses the recurrent kinds it does not model, naming them
    kinds = {kind for b in blocks for kind in b.mixers}
    gdn = _gdn_dims(text) if GATED_DELTANET in kinds else None
    m2 = _mamba2_dims(text) if MAMBA2 in kinds else None
    d, layers, heads, kv_heads, head_dim, inter, vocab = dims = (
        _hybrid_dims(text, blocks) if blocks else _dims(text)
    )
    gated = getattr(text, "model_type", None) not in _NON_GATED_MODEL_TYPES
    if blocks:
        n_matmul = _hybrid_matmul_params(dims, blocks, gated, gdn, m2)
    else:
        n_matmul = matmul_params(text, gated_mlp=gated)
    try:
        total, block, root, name, linears, tp = _count_params(config)
    except Exception:  # a model transformers cannot build: count the Llama-style weights (and plan)
        tied = bool(getattr(text, "tie_word_embeddings", False))
        block = (n_matmul - d * vocab) // layers + 2 * d
        root = d * vocab * (1 if tied else 2) + d
        total, name = layers * block + root, type(config).__name__.replace("Config", "")
        q, kv = heads * head_dim, kv_heads * head_dim
        linears = (("q_proj", d, q), ("k_proj", d, kv), ("v_proj", d, kv), ("o_proj", q, d),
                   *((("gate_proj", d, inter),) if gated else ()), ("up_proj", d, inter), ("down_proj", inter, d))  # fmt: skip
        # column-wise q/k/v/gate/up split their outputs, row-wise o/down their inputs: (rows, d) each
        one = _summed([(o, i) if n != "o_proj" and n != "down_proj" else (i, o) for n, i, o in linears])
        styles = tuple(sorted(set((getattr(text, "base_model_tp_plan", None) or {}).values())))
        tp = _TPSplit(styles, tuple((n, rest * layers) for n, rest in one), one, 0 if tied else d * vocab)
    return _Shape(d, layers, heads, kv_heads, head_dim, inter, vocab, gated, total, block, root, n_matmul,
                  d * vocab, name, bool(getattr(text, "final_logit_softcapping", None)), linears, tp,
                  blocks, gdn, m2)  # fmt: skip


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

    ``device_total``: the device's peak (its largest phase); ``host_total``: one rank's peak in host memory
    (its largest moment; a host of ``devices_per_host`` ranks needs :attr:`host_needed`). ``combined``: the
    largest ``device + host`` of any moment (what a CPU run, whose device IS the host, peaks at).
    ``phases``: ``(phase, device bytes, host bytes)`` of every phase modelled (the device's at the phase's
    peak moment, the host's largest in the phase).
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
    cpu_offload: bool = False
    mp_policy: bool = False
    lora_rank: int | None = None
    trainable_params: int = 0
    device_reserve: int = 0  # CUDA context + allocator slack, beside device_total
    host_reserve: int = 0  # per rank, beside host_total
    devices_per_host: int = 1
    device_memory: int | None = None
    host_memory: int | None = None  # per host
    tensor_parallel_size: int = 1
    vocab_parallel: bool = False  # the lm_head split over the vocabulary across the tp ranks (FPDT's loss)
    local_params: int = 0  # one tensor-parallel rank's parameters (all of them with tp = 1), before FSDP

    def __getitem__(self, name: str) -> MemoryComponent:
        for comp in self.components:
            if comp.name == name:
                return comp
        raise KeyError(f"{name!r} is not a component; components: {[c.name for c in self.components]}")

    @property
    def device_needed(self) -> int:
        """What one device must have: the peak plus the reserve (CUDA context, allocator slack)."""
        return self.device_total + self.device_reserve

    @property
    def host_needed(self) -> int:
        """What one host must have: ``devices_per_host`` ranks' peak host bytes plus each one's process."""
        return self.devices_per_host * (self.host_total + self.host_reserve)

    def _slack(self) -> dict[str, float]:
        """Free fraction of each limit given (negative: over)."""
        out = {}
        if self.device_memory is not None:
            out["device"] = 1 - self.device_needed / self.device_memory
        if self.host_memory is not None:
            out["host"] = 1 - self.host_needed / self.host_memory
        return out

    @property
    def fits(self) -> bool | None:
        """Whether the device needs fit ``device_memory`` and the host needs ``host_memory`` (those given;
        None when neither was)."""
        slack = self._slack()
        return None if not slack else min(slack.values()) >= 0

    @property
    def binding(self) -> str | None:
        """The limit with the least room: ``"device"`` or ``"host"`` (None when no memory size was given)."""
        slack = self._slack()
        return min(slack, key=slack.__getitem__) if slack else None

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
        out.update(fits=self.fits, binding=self.binding, device_needed=self.device_needed,
                   host_needed=self.host_needed)  # fmt: skip
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
        if self.mp_policy:
            extras.append("MixedPrecisionPolicy (16-bit compute params, fp32 reduce)")
        if self.cpu_offload:
            extras.append("cpu_offload")
        if self.tensor_parallel_size > 1:
            head = "vocab-parallel lm_head" if self.vocab_parallel else "replicated lm_head"
            extras.append(f"{_count(self.local_params)} params per TP rank, {head}")
        if self.lora_rank:
            extras.append(f"LoRA r={self.lora_rank} ({_count(self.trainable_params)} trainable)")
        if self.activation_offload:
            extras.append("activation checkpointing + offload")
        elif self.activation_checkpointing:
            extras.append("activation checkpointing")
        if self.micro_batch_size > 1:
            extras.append(f"micro batch {self.micro_batch_size}")
        tp = f" x tp {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        return (
            f"{self.model} ({_count(self.params)} params), {n}, sp {self.sequence_parallel_size}{tp} x dp "
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
        out.append(f"reserve: {format_bytes(self.device_reserve)} per device (CUDA context, allocator slack), "
                   f"{format_bytes(self.host_reserve)} per rank on its host (the process)")  # fmt: skip
        for name, memory, needed, per in (
            ("device", self.device_memory, self.device_needed, "per device"),
            ("host", self.host_memory, self.host_needed, f"per host of {self.devices_per_host} devices"),
        ):
            if memory is not None:
                ok = needed <= memory
                out.append(f"{name} memory {format_bytes(memory)} {per}: needs {format_bytes(needed)}, "
                           f"{'fits' if ok else 'does NOT fit'} ({format_bytes(abs(memory - needed))} "
                           f"{'free' if ok else 'over'})")  # fmt: skip
        if self.binding is not None:
            out.append(f"binding limit: {self.binding} memory")
        return "\n".join(out)


def _dtype_bytes(name: Any) -> int:
    key = str(name).replace("torch.", "").lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(
            f"param_dtype={name!r} is unknown; use 'float32', 'bfloat16', 'float16' or 'float64'"
        )
    return _DTYPE_BYTES[key]


def _dtypes(precision: str, param_dtype: Any, data_parallel: str) -> tuple[int, int, int, int, bool, bool]:
    """(w master parameter bytes, pw compute parameter bytes, m matmul bytes, r residual bytes, autocast on,
    MixedPrecisionPolicy on) of a Lightning precision. FSDP with a mixed precision over fp32 weights uses
    FSDP2's MixedPrecisionPolicy (the strategy's rule: ``fsdp.MIXED_PRECISION_DTYPES``): the blocks compute
    with 16-bit parameters, the residual stream is 16-bit."""
    p = str(precision)
    p = {"32": "32-true", "64": "64-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(p, p)
    if p not in SUPPORTED_PRECISION:
        raise ValueError(f"precision={precision!r} is not supported; use one of {SUPPORTED_PRECISION}")
    w = None if param_dtype is None else _dtype_bytes(param_dtype)
    if p.endswith("-mixed"):  # fp32 weights unless the model was built in another dtype; autocast matmuls
        w = w or 4
        if data_parallel == "fsdp" and p in MIXED_PRECISION_DTYPES:
            return w, 2, 2, 2, True, True
        return w, w, 2, w, True, False
    if p in ("bf16-true", "16-true"):  # Lightning converts the module to the half dtype
        return 2, 2, 2, 2, False, False
    w = w or (8 if p == "64-true" else 4)
    return w, w, w, w, False, False


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


# ---------------------------------------------------------------------------------------------------
# The layout: what one rank holds, resolved once
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """The resolved inputs of one plan: the model's shape, the sequence as ``shard_batch`` pads and splits
    it, heads per rank after the all-to-all, dtype sizes and the mode flags. Notation as in the module
    docstring: ``t`` local tokens, ``w`` / ``m`` / ``r`` parameter / matmul / residual bytes."""

    shape: _Shape
    seq_len: int  # as asked
    padded: int  # what shard_batch pads it to: a multiple of sp (or of sp * chunk with FPDT)
    sp: int  # P, ranks that share one sequence
    dp: int
    b: int  # micro batch: sequences per device
    t: int  # tokens per rank: b * padded / sp
    bn: int  # tokens of the sequences, seen by each rank in head layout: b * padded
    mode: str
    chunk: int | None  # FPDT tokens per chunk per rank (capped at the local length)
    loss_chunk: int | None  # FPDT's lm_head + loss chunk (tokens)
    mlp_chunk: int | None  # FPDT's tiled-MLP chunk (tokens)
    offload: bool  # FPDT's chunks in host memory
    checkpointing: bool  # every decoder layer checkpointed (implied by activation_offload)
    activation_offload: bool  # the checkpointed layer inputs in host memory
    data_parallel: str  # "ddp" or "fsdp"
    optimizer: str  # lower case
    states: int  # optimizer state tensors per parameter
    precision: str
    w: int  # parameter bytes (the master weights: what is sharded, stepped and offloaded)
    pw: int  # bytes of the parameters the compute reads: the MixedPrecisionPolicy's param_dtype, else w
    m: int  # matmul (autocast) bytes
    r: int  # residual stream bytes (the embedding's dtype)
    autocast: bool
    mp_policy: bool  # FSDP2's MixedPrecisionPolicy: bf16 compute params over fp32 master weights
    cpu_offload: bool  # FSDP2's CPUOffloadPolicy: weights, gradients, optimizer state on the host
    lora: int  # LoRA adapter parameters of all blocks (0: every parameter trains)
    lora_block: int  # one block's adapter parameters
    kv_heads: int  # TP-local kv heads after the replication for the all-to-all (spread_kv_heads)
    heads_per_rank: int  # query heads per rank after the all-to-all (the largest rank's, uneven splits)
    kv_per_rank: int  # kv heads per rank after the all-to-all
    tp: int  # tensor_parallel_size: ranks that split every layer's weights (and its heads, its MLP width)
    vocab_parallel: bool  # FPDT + tp: the untied lm_head split over the vocabulary (V / tp rows per rank)
    lora_rank: int | None
    device_memory: int | None
    host_memory: int | None  # per host
    devices_per_host: int
    fixed_device_reserve: int | None  # bytes given; None: CUDA context + allocator slack
    host_reserve: int  # per rank

    def device_reserve(self, peak: int) -> int:
        if self.fixed_device_reserve is not None:
            return self.fixed_device_reserve
        return CUDA_CONTEXT_BYTES + int(ALLOCATOR_RESERVE * peak)

    @property
    def fpdt(self) -> bool:
        return self.mode == "fpdt"

    @property
    def blocks(self) -> tuple[_Block, ...]:
        """Each decoder layer's mixers and MLP (all Llama blocks unless the model is a hybrid)."""
        return self.shape.blocks or (_LLAMA_BLOCK,) * self.shape.layers

    @property
    def attention_layers(self) -> int:
        return sum(ATTENTION in b.mixers for b in self.blocks)

    @property
    def mlp_layers(self) -> int:
        return sum(b.mlp for b in self.blocks)

    @property
    def segments(self) -> int:
        """Segments of one sequence the recurrent mixers' state scan runs over: one per rank, one per local
        FPDT chunk in the FPDT layout."""
        return self.sp * (self.t // (self.b * self.chunk) if self.fpdt else 1)

    @property
    def casting(self) -> bool:
        """Autocast makes (and linear saves) low-precision copies of the weights and inputs (not of the
        MixedPrecisionPolicy's bf16 parameters: they are in the matmul dtype already)."""
        return self.autocast and self.pw != self.m

    @property
    def shard(self) -> int:
        """Ranks a parameter is split over: dp * sp with FSDP (the replicas of a TP-local block), 1 with DDP."""
        return self.dp * self.sp if self.data_parallel == "fsdp" else 1

    @property
    def head_local(self) -> int:
        """One tensor-parallel rank's lm_head weight (elements): V / tp rows when vocabulary parallel."""
        return self.shape.head_params // self.tp if self.vocab_parallel else self.shape.head_params

    @property
    def vocab_local(self) -> int:
        """The vocabulary rows one rank's logits blocks have: V / tp when vocabulary parallel."""
        return self.shape.vocab // self.tp if self.vocab_parallel else self.shape.vocab

    @property
    def root_local(self) -> int:
        """One tensor-parallel rank's parameters outside the blocks (FSDP's root): the embedding and norms are
        replicated over tp, a vocabulary-parallel lm_head is not."""
        split = self.shape.tp.head - self.shape.tp.head // self.tp if self.vocab_parallel else 0
        return self.shape.root_params - split

    @property
    def block_local(self) -> int:
        """One tensor-parallel rank's largest block (FSDP's unit): its split parameters' shards, the rest whole."""
        return self.shape.block_params - _TPSplit.removed(self.shape.tp.block, self.tp)

    @property
    def local_params(self) -> int:
        """One tensor-parallel rank's parameters, before FSDP shards them over dp * sp."""
        blocks = _TPSplit.removed(self.shape.tp.blocks, self.tp)
        return self.shape.params - blocks - (self.shape.root_params - self.root_local)

    @property
    def heads_tp(self) -> int:
        """Query heads of one tensor-parallel rank (its q/k/v columns), before the all-to-all."""
        return self.shape.heads // self.tp

    @property
    def inter_tp(self) -> int:
        """MLP intermediate width of one tensor-parallel rank (gate/up columns, down rows; the largest rank's)."""
        return -(-self.shape.inter // self.tp)

    @property
    def trainable(self) -> int:
        """Parameters with a gradient and optimizer state: the LoRA adapters, or all of them."""
        return self.lora or self.local_params

    @property
    def weight_bytes(self) -> int:
        """One rank's parameters, the LoRA adapters included."""
        return -(-(self.local_params + self.lora) // self.shard) * self.w

    @property
    def grad_bytes(self) -> int:
        """One rank's gradients (= one optimizer state): of the trainable parameters only."""
        return -(-self.trainable // self.shard) * self.w

    def placed(self, row: str, nbytes: int, note: str = "") -> _Term:
        """A model-state term: on the device, or on the host with ``cpu_offload``."""
        return _Term(row, 0, nbytes, note) if self.cpu_offload else _Term(row, nbytes, 0, note)

    @property
    def mlp_weights(self) -> int:
        """One layer's MLP weights (elements) on one tensor-parallel rank."""
        return (3 if self.shape.gated else 2) * self.shape.d * self.inter_tp

    @property
    def matmul_local(self) -> int:
        """The matmul weights one tensor-parallel rank holds: q/k/v/o split over tp (whole heads), the MLP's
        (:attr:`mlp_weights`), the lm_head's."""
        s = self.shape
        attn = 2 * s.d * s.head_dim * (s.heads + s.kv_heads)
        mlp = (3 if s.gated else 2) * s.d * s.inter
        return (
            s.matmul_params
            - s.layers * (attn - attn // self.tp + mlp - self.mlp_weights)
            - (s.head_params - self.head_local)
        )

    @property
    def chunk_casts(self) -> int:
        """Bytes per weight element cast inside a chunked function (tiled MLP, chunked loss)."""
        return self.m if self.casting else 0

    @property
    def q_elems(self) -> int:
        """One rank's q (or out) in head layout: ``(b, N, H/P, hd)`` elements."""
        return self.bn * self.heads_per_rank * self.shape.head_dim

    @property
    def kv_elems(self) -> int:
        """One rank's k (or v) in head layout: ``(b, N, H_kv'/P, hd)`` elements."""
        return self.bn * self.kv_per_rank * self.shape.head_dim

    @property
    def qa(self) -> int:
        """Bytes of the attention's q, k, out: FPDT keeps them in RoPE's output dtype, the residual's (fp32)
        under autocast; otherwise the matmul dtype."""
        return self.r if (self.casting and self.fpdt) else self.m

    @property
    def ct(self) -> int:
        """The softmax / loss dtype's bytes: fp32 (fp64 for fp64)."""
        return max(self.m, 4)

    @property
    def segment(self) -> int:
        """Tokens of one FPDT segment (one chunk of every rank, after the all-to-all); Ulysses: all of them."""
        return self.b * self.sp * self.chunk if self.fpdt else self.bn

    @property
    def tile(self) -> int:
        """Side of FPDT's score tile (``fpdt_attention(block_size=1024)``), 0 for Ulysses."""
        return min(FPDT_BLOCK_SIZE, self.segment // self.b) if self.fpdt else 0


# ---------------------------------------------------------------------------------------------------
# The terms: one function per memory component
# ---------------------------------------------------------------------------------------------------
# Each term returns the bytes it holds on one device and on its host while it is alive, and the table row
# (one of _ORDER) it adds to. A row's note is its terms' notes, in phase-table order, joined by "; ": a
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


# ---- parameters, gradients, optimizer ----


def _weights(lay: _Layout) -> _Term:
    n = lay.local_params + lay.lora
    note = f"{n:,} params" + (f" of {lay.shape.params:,} (tp {lay.tp})" if lay.tp > 1 else "")
    note += f" x {lay.w} B" + (f" / {lay.shard} (FSDP)" if lay.shard > 1 else "")
    note += f", {lay.lora:,} of them LoRA's" if lay.lora else ""
    return lay.placed("weights", lay.weight_bytes, note + (" (cpu_offload)" if lay.cpu_offload else ""))


def _sharded_gradients(lay: _Layout) -> _Term:
    """FSDP's sharded gradients (in the master weights' dtype: the MixedPrecisionPolicy reduces in fp32).
    DDP's gradients are views into its buckets (``gradient_as_bucket_view``)."""
    if lay.data_parallel == "ddp":
        return _Term("gradients", 0)
    note = "FSDP's sharded gradients, freed between forward and backward (Lightning's zero_grad)"
    return lay.placed("gradients", lay.grad_bytes, note)


def _optimizer_state(lay: _Layout) -> _Term:
    """torch.optim keeps its states in the parameter dtype (Lightning's bf16-mixed: fp32 weights, no master
    copy), for the trainable parameters only (LoRA: the adapters)."""
    note = f"{lay.optimizer}: {lay.states} x trainable params x {lay.w} B" + (
        " + foreach temporary" if lay.states else ""
    )
    return lay.placed("optimizer state", lay.states * lay.grad_bytes, note)


def _optimizer_step_temporary(lay: _Layout) -> _Term:
    """foreach AdamW: one temporary per state (sqrt of exp_avg_sq) during the step (noted with the state); on
    the host with ``cpu_offload``, where the step runs."""
    return lay.placed("optimizer state", lay.states * lay.grad_bytes // 2 if lay.states else 0)


def _ddp_gradient_buckets(lay: _Layout) -> _Term:
    """DDP's all-reduce buckets of the trainable parameters, allocated for the whole run (the strategy wraps
    in DDP even on one rank)."""
    if lay.data_parallel != "ddp":
        return _Term("DDP gradient buckets", 0)
    note = "the gradients, as views into DDP's buckets (gradient_as_bucket_view=True)"
    return _Term("DDP gradient buckets", lay.trainable * lay.w, note=note)


def _fsdp_root_params(lay: _Layout) -> _Term:
    """FSDP's root (embedding, head, final norm) stays unsharded for the step (``reshard_after_forward=False``),
    in the compute dtype (the MixedPrecisionPolicy all-gathers bf16); with tp its TP-local part."""
    if lay.data_parallel != "fsdp":
        return _Term("FSDP unsharded params/grads", 0)
    return _Term("FSDP unsharded params/grads", lay.root_local * lay.pw, note="root params")


def _fsdp_blocks_in_flight(lay: _Layout) -> _Term:
    """Two unsharded transformer blocks: the one running and the one prefetched (TP-local with tp)."""
    if lay.data_parallel != "fsdp":
        return _Term("FSDP unsharded params/grads", 0)
    block = lay.block_local + lay.lora_block
    return _Term("FSDP unsharded params/grads", 2 * block * lay.pw, note="2 blocks in flight")


def _fsdp_block_gradients(lay: _Layout) -> _Term:
    """One block's unsharded gradients and their reduce-scatter input (a flat copy, in fp32 under the
    MixedPrecisionPolicy), and the root's unsharded gradients (trainable parameters only)."""
    if lay.data_parallel != "fsdp":
        return _Term("FSDP unsharded params/grads", 0)
    block, root = (lay.lora_block, 0) if lay.lora else (lay.block_local, lay.root_local)
    reduce_bytes = 4 if lay.mp_policy else lay.w  # the policy's reduce_dtype: fp32
    nbytes = block * (lay.pw + reduce_bytes) + root * lay.pw
    return _Term("FSDP unsharded params/grads", nbytes, note="block + root grads in backward")


def _autocast_weight_copies(lay: _Layout) -> _Term:
    """The low-precision weight casts linear saves for backward; FPDT's tiled MLP and chunked loss cast per
    chunk instead (their working sets count those)."""
    if not lay.casting:
        return _Term("autocast weight copies", 0)
    cast_params = lay.matmul_local - (lay.mlp_layers * lay.mlp_weights + lay.head_local if lay.fpdt else 0)
    return _Term("autocast weight copies", cast_params * lay.m,
                 note=f"{lay.m}-byte casts of the weights linear keeps for backward")  # fmt: skip


# ---- activations kept for backward ----


def _attention_store_bytes(lay: _Layout) -> int:
    """One layer's attention tensors in head layout: q, out, k, v and the log-sum-exp (FPDT: every chunk's,
    in host memory with offload). FPDT's blocks run in the autocast dtype, the lse too; else it is fp32."""
    lse = lay.m if (lay.autocast and lay.fpdt) else max(4, lay.m)
    return 2 * lay.q_elems * lay.qa + lay.kv_elems * (lay.qa + lay.m) + lay.bn * lay.heads_per_rank * lse


def _norm_bytes(lay: _Layout) -> int:
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


def _mixer_bytes(lay: _Layout, kind: str) -> int:
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


def _layer_attention_bytes(lay: _Layout, block: _Block = _LLAMA_BLOCK) -> int:
    """One layer's saved tensors up to its MLP: the first RMSNorm's and its mixers' (:func:`_mixer_bytes`)."""
    if not block.mixers:
        return 0
    return _norm_bytes(lay) + sum(_mixer_bytes(lay, kind) for kind in block.mixers)


def _layer_mlp_bytes(lay: _Layout, block: _Block = _LLAMA_BLOCK) -> int:
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


def _offloaded_bytes(lay: _Layout, block: _Block) -> int:
    """FPDT offload: the attention chunks of a layer with attention are in host memory."""
    return _attention_store_bytes(lay) if lay.offload and ATTENTION in block.mixers else 0


def _layer_device_bytes(lay: _Layout, block: _Block = _LLAMA_BLOCK) -> int:
    """One layer's saved tensors on the device (FPDT's offloaded chunks are on the host)."""
    return _layer_attention_bytes(lay, block) + _layer_mlp_bytes(lay, block) - _offloaded_bytes(lay, block)


def _saved_activations(lay: _Layout) -> _Term:
    """Without checkpointing: every layer's saved tensors but the last one's (see the next two terms)."""
    if lay.checkpointing:
        return _Term(_ACTS, 0)
    note = "per layer: norms, q/k/v/out/lse, projections" + (", MLP" if not lay.fpdt else "")
    kinds = sorted({kind for b in lay.blocks for kind in b.mixers} - {ATTENTION})
    if kinds:
        note += f"; {', '.join(kinds)} layers: projections, conv, fp32 chunk matrices and states"
    return _Term(_ACTS, sum(_layer_device_bytes(lay, b) for b in lay.blocks[:-1]), note=note)


def _attention_o_proj_bytes(lay: _Layout) -> int:
    """The o_proj's saved input (the attention output in sequence layout, this TP rank's heads)."""
    return lay.heads_tp * lay.shape.head_dim * lay.m * lay.t


def _o_proj_input_bytes(lay: _Layout, block: _Block = _LLAMA_BLOCK) -> int:
    """A layer's attention o_proj input: freed by the o_proj's backward, before the attention's backward runs
    (a recurrent mixer's out_proj input is counted with the mixer)."""
    return _attention_o_proj_bytes(lay) if ATTENTION in block.mixers else 0


def _last_layer_attention_activations(lay: _Layout) -> _Term:
    """Without checkpointing: the last layer's saved tensors up to its MLP (on the device), but its o_proj
    input (:func:`_last_layer_o_proj_input`)."""
    if lay.checkpointing:
        return _Term(_ACTS, 0)
    last = lay.blocks[-1]
    return _Term(
        _ACTS, _layer_device_bytes(lay, last) - _layer_mlp_bytes(lay, last) - _o_proj_input_bytes(lay, last)
    )


def _last_layer_o_proj_input(lay: _Layout) -> _Term:
    """Without checkpointing: the last layer's o_proj input, alive until the layer's attention backward."""
    return _Term(_ACTS, 0 if lay.checkpointing else _o_proj_input_bytes(lay, lay.blocks[-1]))


def _last_layer_mlp_activations(lay: _Layout) -> _Term:
    """Without checkpointing: the last layer's MLP tensors. They do not exist yet while its attention runs
    forward, and are freed when its attention runs backward."""
    return _Term(_ACTS, 0 if lay.checkpointing else _layer_mlp_bytes(lay, lay.blocks[-1]))


def _checkpointed_inputs(lay: _Layout) -> _Term:
    """With checkpointing: each layer's input ``(b, N/P, d)`` on the device (on the host with activation
    offload: :func:`_activation_offload_store`)."""
    if not lay.checkpointing:
        return _Term(_ACTS, 0)
    inputs = 0 if lay.activation_offload else lay.shape.layers * lay.shape.d * lay.r * lay.t
    return _Term(_ACTS, inputs, note="layer inputs (checkpointed)")


def _model_inputs(lay: _Layout) -> _Term:
    """The batch's int64 ids (input_ids, labels, shift_labels, position_ids) and the RoPE cos/sin tables."""
    return _Term(_ACTS, 4 * 8 * lay.t + 2 * lay.shape.head_dim * lay.r * lay.t)


def _final_norm_and_head_input(lay: _Layout) -> _Term:
    """The final RMSNorm's saved tensors and the head's input (FPDT's chunked loss: hidden states + lse;
    Hugging Face: lm_head's matmul-dtype input); freed in the loss backward."""
    s, t = lay.shape, lay.t
    head_in = s.d * lay.r * t + 4 * t if lay.fpdt else s.d * lay.m * t
    return _Term(_ACTS, _norm_bytes(lay) + head_in)


def _running_layer_input(lay: _Layout) -> _Term:
    """Activation offload: the running layer's input stays on the device while it runs forward."""
    return _Term(_ACTS, lay.shape.d * lay.r * lay.t if lay.activation_offload else 0)


def _prefetched_layer_inputs(lay: _Layout) -> _Term:
    """Activation offload, backward: the recomputed layer's input and the one prefetched for the layer
    before it."""
    if not lay.activation_offload:
        return _Term(_ACTS, 0)
    return _Term(_ACTS, min(2, lay.shape.layers) * lay.shape.d * lay.r * lay.t)


def _fpdt_chunk_store(lay: _Layout) -> _Term:
    """FPDT offload without checkpointing: every layer's attention chunks in host memory (saved tensors of
    its autograd node). With checkpointing the checkpoint drops them after each layer's forward: see
    :func:`_running_layer_chunk_store` and the recomputed layer's."""
    if not lay.offload or lay.checkpointing:
        return _Term(_ACTS, 0)
    host = lay.attention_layers * _attention_store_bytes(lay)
    return _Term(_ACTS, 0, host, note="host: FPDT chunks (offload)")


def _running_layer_chunk_store(lay: _Layout) -> _Term:
    """FPDT offload with checkpointing: the running layer's chunks, on the host until its forward ends."""
    if not (lay.offload and lay.checkpointing and lay.attention_layers):
        return _Term(_ACTS, 0)
    return _Term(_ACTS, 0, _attention_store_bytes(lay), note="host: one layer's FPDT chunks (offload)")


def _activation_offload_store(lay: _Layout) -> _Term:
    """Activation offload: every layer's checkpointed input in host memory."""
    if not lay.activation_offload:
        return _Term(_ACTS, 0)
    inputs = lay.shape.layers * lay.shape.d * lay.r * lay.t
    return _Term(_ACTS, 0, inputs, note="host: the layer inputs (activation offload)")


# ---- the loss ----


def _loss_forward(lay: _Layout) -> _Term:
    """FPDT's chunked lm_head + loss: one logits block (+ its matmul-dtype original) and logsumexp's exp, the
    head's per-chunk cast. Hugging Face: the whole logits (+ their fp32 copy) and the log-softmax. (The
    row's note is the backward's.)"""
    s, ct = lay.shape, lay.ct
    if lay.fpdt:  # vocabulary parallel: (chunk, V / tp) blocks of this rank's rows
        low = lay.m if lay.m != ct else 0  # autocast: the matmul-dtype logits beside the fp32 block
        return _Term("loss working set", min(lay.loss_chunk, lay.t) * lay.vocab_local * (ct + low)
                     + lay.head_local * lay.chunk_casts)  # fmt: skip
    return _Term("loss working set", lay.t * s.vocab * (lay.m + ct + (ct if lay.m != ct else 0)))


def _loss_backward(lay: _Layout) -> _Term:
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


def _fpdt_score_tile_bytes(lay: _Layout) -> int:
    """One math score tile ``(b, H/P, tile, tile)`` in the blocks' dtype and its boolean mask."""
    b, tile = lay.b, lay.tile
    return b * lay.heads_per_rank * tile * tile * (lay.m if lay.autocast else lay.ct) + b * tile * tile


def _residual_gradient_bytes(lay: _Layout) -> int:
    """The residual stream's gradient in backward (Hugging Face's norm backward runs in fp32; FPDT's tiled
    norm in fp32 per chunk only)."""
    return lay.shape.d * (lay.r if lay.fpdt else max(lay.r, 4)) * lay.t


def _attention_forward(lay: _Layout) -> _Term:
    """FPDT: the outputs gathered so far, one segment (q, its fp32 accumulator and merge, the next q and kv
    in flight), a score tile and, with offload, the double-buffered kv prefetch (2 fetched k, v steps).
    Ulysses: none (the kernel's out and lse are kept activations; O(1) workspace). (Noted with the
    backward.)"""
    if not lay.fpdt or not lay.attention_layers:
        return _Term("attention working set", 0)
    qa, hd, seg_kv = lay.qa, lay.shape.head_dim, lay.segment * lay.kv_per_rank * lay.shape.head_dim
    seg_q = lay.segment * lay.heads_per_rank * hd
    ahead = seg_q * qa + 2 * seg_kv * qa
    kv_buffer = 4 * seg_kv * qa if lay.offload else 0
    nbytes = lay.q_elems * qa + seg_q * (qa + 8) + ahead + _fpdt_score_tile_bytes(lay) + kv_buffer
    return _Term("attention working set", nbytes)


def _attention_backward(lay: _Layout) -> _Term:
    """FPDT: the output's gradient throughout; early: every segment's dout and fp32 dq accumulator (the first
    kv segment reaches all q segments), two score tiles and, with offload, the chunks fetched back from the
    host; late: dq/dk/dv of every chunk and their concatenation. Ulysses: the output's gradient in both
    layouts, dq/dk/dv in head layout and back in sequence layout. Both: the residual stream's gradient."""
    qa, m, q, kv = lay.qa, lay.m, lay.q_elems, lay.kv_elems
    if not lay.attention_layers:  # attention-free (Mamba-2): the residual stream's gradient only
        return _Term(
            "attention working set", _residual_gradient_bytes(lay), note="residual gradient (no attention)"
        )
    if lay.fpdt:
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


def _all_to_all_buffers(lay: _Layout) -> _Term:
    """FPDT: send + receive of one chunk; Ulysses (head_to_seq): the reshaped copy and the send buffer. Both of
    this TP rank's heads."""
    hd = lay.shape.head_dim
    if not lay.attention_layers:
        return _Term("all-to-all buffers", 0)
    if lay.fpdt:
        nbytes = 2 * lay.b * lay.chunk * lay.heads_tp * hd * lay.qa
    else:
        nbytes = 2 * lay.t * lay.heads_tp * hd * lay.m
    note = "send + receive of one all-to-all" + (" (attention layers only)" if lay.shape.blocks else "")
    return _Term("all-to-all buffers", nbytes, note=note)


def _state_exchange_buffers(lay: _Layout) -> _Term:
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


def _mlp_forward(lay: _Layout) -> _Term:
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


def _mlp_backward(lay: _Layout) -> _Term:
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


def _recomputed_block(lay: _Layout) -> _Block:
    """The layer kind whose recompute holds the most (a hybrid's heaviest layer: its backward is the peak)."""
    return max(set(lay.blocks), key=lambda b: (_layer_device_bytes(lay, b), b.mixers))


def _recomputed_layer_attention(lay: _Layout) -> _Term:
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


def _recomputed_o_proj_input(lay: _Layout) -> _Term:
    """Checkpointing: the recomputed layer's o_proj input, freed before its attention runs backward."""
    return _Term(_RECOMPUTE, _o_proj_input_bytes(lay, _recomputed_block(lay)) if lay.checkpointing else 0)


def _recomputed_layer_mlp(lay: _Layout) -> _Term:
    """Checkpointing: the recomputed layer's MLP tensors (freed by the time its attention runs backward)."""
    return _Term(_RECOMPUTE, _layer_mlp_bytes(lay, _recomputed_block(lay)) if lay.checkpointing else 0)


# ---------------------------------------------------------------------------------------------------
# The phase table: which terms are alive at each moment of the step
# ---------------------------------------------------------------------------------------------------
# A phase is a candidate peak. A layer phase has two moments (its attention, its MLP) and counts as the
# larger: the last layer's forward, its backward (the first backward of a layer). In the table, ``x``: the
# term is alive at that moment. Lightning frees the previous step's gradients between forward and backward.
_MOMENTS = (
    ("layer forward", "attention"),
    ("layer forward", "MLP"),
    ("loss forward", ""),
    ("loss backward", ""),
    ("layer backward", "attention"),
    ("layer backward", "MLP"),
    ("optimizer step", ""),
)

# fmt: off
_PHASE_TABLE: tuple[tuple[Callable[[_Layout], _Term], str], ...] = (
    #                                     layer fwd   loss   loss   layer bwd   optimizer
    #                                     attn  MLP   fwd    bwd    attn  MLP   step
    (_weights,                           "x     x     x      x      x     x     x"),
    (_sharded_gradients,                 "x     x     x      -      -     -     x"),
    (_optimizer_state,                   "x     x     x      x      x     x     x"),
    (_optimizer_step_temporary,          "-     -     -      -      -     -     x"),
    (_ddp_gradient_buckets,              "x     x     x      x      x     x     x"),
    (_fsdp_root_params,                  "x     x     x      x      x     x     x"),
    (_fsdp_blocks_in_flight,             "x     x     -      -      x     x     -"),
    (_fsdp_block_gradients,              "-     -     -      -      x     x     -"),
    (_autocast_weight_copies,            "x     x     x      x      x     x     -"),
    (_saved_activations,                 "x     x     x      x      x     x     -"),
    (_last_layer_attention_activations,  "x     x     x      x      x     x     -"),
    (_last_layer_o_proj_input,           "x     x     x      x      -     x     -"),
    (_last_layer_mlp_activations,        "-     x     x      x      -     x     -"),
    (_checkpointed_inputs,               "x     x     x      x      x     x     -"),
    (_model_inputs,                      "x     x     x      x      x     x     -"),
    (_final_norm_and_head_input,         "x     x     x      x      -     -     -"),
    (_running_layer_input,               "x     x     -      -      -     -     -"),
    (_prefetched_layer_inputs,           "-     -     -      -      x     x     -"),
    (_fpdt_chunk_store,                  "x     x     x      x      x     x     -"),
    (_running_layer_chunk_store,         "x     -     -      -      -     -     -"),
    (_activation_offload_store,          "x     x     x      x      x     x     -"),
    (_loss_forward,                      "-     -     x      -      -     -     -"),
    (_loss_backward,                     "-     -     -      x      -     -     -"),
    (_attention_forward,                 "x     -     -      -      -     -     -"),
    (_attention_backward,                "-     -     -      -      x     -     -"),
    (_all_to_all_buffers,                "x     -     -      -      x     -     -"),
    (_state_exchange_buffers,            "x     -     -      -      x     -     -"),
    (_mlp_forward,                       "-     x     -      -      -     -     -"),
    (_mlp_backward,                      "-     -     -      -      -     x     -"),
    (_recomputed_layer_attention,        "-     -     -      -      x     x     -"),
    (_recomputed_o_proj_input,           "-     -     -      -      -     x     -"),
    (_recomputed_layer_mlp,              "-     -     -      -      -     x     -"),
)
# fmt: on

#: allocated between steps (MemoryPlan.between_steps)
_BETWEEN_STEPS = (_weights, _sharded_gradients, _optimizer_state, _ddp_gradient_buckets)


@dataclass(frozen=True)
class _Moment:
    """The bytes of each row (device, host) at one moment of a phase."""

    phase: str
    device: dict[str, int]
    host: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def _moments(terms: list[tuple[_Term, str]]) -> list[_Moment]:
    """Each moment of :data:`_MOMENTS` with the rows of the terms alive then (marked ``x``)."""
    alive = [marks.split() for _, marks in terms]
    assert all(len(a) == len(_MOMENTS) for a in alive) and all(t.row in _ORDER for t, _ in terms)
    moments = []
    for col, (phase, _) in enumerate(_MOMENTS):
        device: dict[str, int] = {}
        host: dict[str, int] = {}
        for (term, _), marks in zip(terms, alive):
            if marks[col] == "x":
                device[term.row] = device.get(term.row, 0) + term.device
                host[term.row] = host.get(term.row, 0) + term.host
        moments.append(_Moment(phase, device, host))
    return moments


def _plan(lay: _Layout) -> MemoryPlan:
    """Evaluate the phase table for a layout: the peak of every phase, and the rows of the peak phase."""
    terms = [(term(lay), marks) for term, marks in _PHASE_TABLE]
    moments = _moments(terms)
    phases = {phase: [mo for mo in moments if mo.phase == phase] for phase, _ in _MOMENTS}
    # a phase peaks at its larger moment (the first on a tie)
    at = {phase: max(group, key=lambda mo: mo.total) for phase, group in phases.items()}
    peak = max(at, key=lambda phase: at[phase].total)

    def largest(row: str) -> int:
        """The most the row holds on the device at any moment of any phase."""
        return max(mo.device.get(row, 0) for mo in moments)

    components = []
    for row in _ORDER:
        top = largest(row)
        # the host column is the most the row holds on the host in any phase, whatever the device's peak (the
        # activations' stores are freed by the optimizer step, which is when offloaded model state peaks)
        hosts = [mo.host.get(row, 0) for mo in moments]
        if top == 0 and max(hosts) == 0:
            continue
        note = "; ".join(term.note for term, _ in terms if term.row == row and term.note)
        if top != at[peak].device.get(row, 0):
            note += f" (largest {format_bytes(top)})"
        components.append(MemoryComponent(row, at[peak].device.get(row, 0), max(hosts), top, note))
    return MemoryPlan(
        model=lay.shape.model_name,
        params=lay.shape.params,
        seq_len=lay.seq_len,
        padded_seq_len=lay.padded,
        tokens_per_device=lay.t,
        sequence_parallel_size=lay.sp,
        data_parallel_size=lay.dp,
        mode=lay.mode,
        fpdt_chunk_size=lay.chunk,
        loss_chunk_size=lay.loss_chunk,
        mlp_chunk_size=lay.mlp_chunk,
        offload=lay.offload,
        activation_checkpointing=lay.checkpointing,
        activation_offload=lay.activation_offload,
        data_parallel=lay.data_parallel,
        micro_batch_size=lay.b,
        precision=lay.precision,
        param_bytes=lay.w,
        optimizer=lay.optimizer,
        components=tuple(components),
        phases=tuple((p, mo.total, max(m.host_total for m in phases[p])) for p, mo in at.items()),
        peak_phase=peak,
        device_total=at[peak].total,
        host_total=max(mo.host_total for mo in moments),  # the host's peak: any moment, not the device's
        combined=max(mo.total + mo.host_total for mo in moments),
        between_steps=sum(term(lay).device + term(lay).host for term in _BETWEEN_STEPS),
        cpu_offload=lay.cpu_offload,
        mp_policy=lay.mp_policy,
        lora_rank=lay.lora_rank,
        trainable_params=lay.trainable,
        device_reserve=lay.device_reserve(at[peak].total),
        host_reserve=lay.host_reserve,
        devices_per_host=lay.devices_per_host,
        device_memory=lay.device_memory,
        host_memory=lay.host_memory,
        tensor_parallel_size=lay.tp,
        vocab_parallel=lay.vocab_parallel,
        local_params=lay.local_params,
    )


def plan_memory(
    config: Any,
    *,
    seq_len: int,
    sequence_parallel_size: int,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
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
    cpu_offload: bool = False,
    lora_rank: int | None = None,
    lora_targets: str | tuple[str, ...] | list[str] = ALL_LINEAR,
    device_memory: int | str | None = None,
    host_memory: int | str | None = None,
    devices_per_host: int | None = None,
    device_reserve: int | str | None = None,
    host_reserve: int | str | None = None,
) -> MemoryPlan:
    """Plan the memory of one training step per device and per host (no GPU, no weights needed).

    Args:
        config: a transformers config (e.g. ``AutoConfig.from_pretrained(path)``) or a dict with
            ``model_type``, as in a LightningCLI ``model_config``.
        seq_len: tokens per sequence (global); padded like ``shard_batch`` pads it (to a multiple of
            ``P``, or of ``P * chunk`` with FPDT).
        sequence_parallel_size: P, ranks that share one sequence. data_parallel_size: dp (matters
            for FSDP, which shards over dp x sp).
        tensor_parallel_size: tp, ranks that split every layer by the model's Hugging Face TP plan (the world
            is dp x sp x tp; needs ``data_parallel="fsdp"``, heads and kv heads divisible by tp, no LoRA).
            Per rank: the plan's split weights (q/k/v, o, the MLP's, a MoE's experts) / tp, and FSDP shards
            that over dp x sp; the embedding, norms and router stay whole; the lm_head is split over the
            vocabulary only in FPDT mode when it is untied and ``vocab % tp == 0`` (vocabulary-parallel
            chunked loss, ``(chunk, V / tp)`` blocks), else replicated. Activations of hidden width (residual
            stream, norms, the o/down projections' outputs, checkpointed layer inputs) are replicated over tp;
            those per head (q/k/v, attention output, lse, all-to-all buffers) and the MLP's intermediates / tp.
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
        cpu_offload: FSDP2's ``CPUOffloadPolicy`` (the strategy's ``cpu_offload``, needs ``data_parallel="fsdp"``):
            weights, gradients and optimizer state on the host, the optimizer step there.
        lora_rank / lora_targets: LoRA adapters of rank r on the blocks' linear layers (``"all-linear"``, or
            their names, e.g. ``("q_proj", "v_proj")``): the base weights are frozen, so only the adapters
            carry gradients and optimizer state (their rank-r activations, r/hidden of a projection's input,
            are not counted).
        device_memory: bytes (or ``"80GiB"``) per device, to say whether the plan fits.
        host_memory: bytes per host (a node: ``"1.9TB"``), for ``devices_per_host`` devices (default: the
            job's devices, at most 8).
        device_reserve: device bytes outside the plan's tensors; default ``CUDA_CONTEXT_BYTES`` (1 GiB: the
            CUDA context, cuBLAS / NCCL workspaces) + ``ALLOCATOR_RESERVE`` (5 %) of the peak (the caching
            allocator's slack). host_reserve: host bytes per rank outside the plan (the process, its data
            loader); default ``HOST_PROCESS_BYTES`` (4 GiB). ``fits`` adds both.

    Returns a :class:`MemoryPlan`; ``plan.table()`` prints it.
    """
    shape = _shape(_as_config(config))
    P = _check_int("sequence_parallel_size", sequence_parallel_size)
    dp = _check_int("data_parallel_size", data_parallel_size)
    tp = _check_int("tensor_parallel_size", tensor_parallel_size)
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
    if cpu_offload and data_parallel != "fsdp":
        raise ValueError(
            f"cpu_offload=True with data_parallel={data_parallel!r}: state offload is FSDP2's CPUOffloadPolicy; "
            "set data_parallel='fsdp'"
        )
    if tp > 1 and shape.blocks:
        raise ValueError(
            f"tensor_parallel_size={tp}: {shape.model_name} is a hybrid model; plan_memory does not model its "
            "recurrent layers under tensor parallelism; use tensor_parallel_size=1"
        )
    if tp > 1:
        _check_tp(shape, tp, data_parallel)
    w, pw, m, r, autocast, mp = _dtypes(precision, param_dtype, data_parallel)
    memory = None if device_memory is None else parse_bytes(device_memory)
    host = None if host_memory is None else parse_bytes(host_memory)
    per_host = min(P * dp * tp, DEFAULT_DEVICES_PER_HOST) if devices_per_host is None else devices_per_host
    _check_int("devices_per_host", per_host)
    lora, lora_block = _lora_params(shape, lora_rank, lora_targets, tp)

    # the strategy's rule (tensor_parallel.vocab_parallel_head): FPDT's chunked loss on this rank's V / tp rows
    vocab_parallel = tp > 1 and mode == "fpdt" and shape.tp.head > 0 and shape.vocab % tp == 0
    chunk = loss_chunk = mlp_chunk = None
    if mode == "fpdt":
        chunk = chunk_for(seq_len, P, fpdt_chunk_size or DEFAULT_FPDT_CHUNK_SIZE)  # the strategy's rule
        # the default chunk is of the rows the loss sees (chunked_lm_head_cross_entropy: the local weight's)
        loss_chunk = loss_chunk_size or default_loss_chunk_size(
            shape.vocab // tp if vocab_parallel else shape.vocab
        )
        mlp_chunk = mlp_chunk_size or fpdt_chunk_size or DEFAULT_FPDT_CHUNK_SIZE
    multiple = P * (chunk or 1)
    padded = -(-seq_len // multiple) * multiple
    heads, kv_heads = shape.heads // tp, shape.kv_heads // tp  # the TP-local heads the attention receives
    kv = kv_heads * kv_repeat_factor(heads, kv_heads, P)
    lay = _Layout(
        shape=shape, seq_len=seq_len, padded=padded, sp=P, dp=dp, b=b, t=b * padded // P, bn=b * padded,
        mode=mode, chunk=chunk, loss_chunk=loss_chunk, mlp_chunk=mlp_chunk, offload=bool(offload),
        checkpointing=bool(activation_checkpointing or activation_offload),  # offload implies it
        activation_offload=bool(activation_offload), data_parallel=data_parallel, optimizer=optimizer.lower(),
        states=OPTIMIZER_STATES[optimizer.lower()], precision=str(precision), w=w, pw=pw, m=m, r=r,
        autocast=autocast, mp_policy=mp, cpu_offload=bool(cpu_offload), lora=lora, lora_block=lora_block,
        kv_heads=kv, heads_per_rank=-(-heads // P), kv_per_rank=-(-kv // P), lora_rank=lora_rank, tp=tp,
        vocab_parallel=vocab_parallel,
        device_memory=memory, host_memory=host, devices_per_host=per_host,
        fixed_device_reserve=None if device_reserve is None else parse_bytes(device_reserve),
        host_reserve=HOST_PROCESS_BYTES if host_reserve is None else parse_bytes(host_reserve),
    )  # fmt: skip
    return _plan(lay)


def _check_tp(shape: _Shape, tp: int, data_parallel: str) -> None:
    """What the strategy refuses for ``tensor_parallel_size > 1`` (``SequenceParallelConfig``,
    ``tensor_parallel.check_tp``), with the same messages."""
    from lightning_longctx.tensor_parallel import TESTED_STYLES

    name = shape.model_name
    if data_parallel != "fsdp":
        raise ValueError(
            f"tensor_parallel_size={tp} with data_parallel={data_parallel!r}: DDP cannot wrap the DTensor weights "
            "tensor parallelism makes; set data_parallel='fsdp' (FSDP2 over data x sequence parallel)"
        )
    if not shape.tp.styles:
        raise ValueError(
            f"tensor_parallel_size={tp}: {name} declares no tensor-parallel plan (config.base_model_tp_plan), so "
            "its layers cannot be split; use tensor_parallel_size=1 (sequence parallelism alone)"
        )
    untested = sorted(set(shape.tp.styles) - set(TESTED_STYLES))
    if untested:
        raise ValueError(
            f"tensor_parallel_size={tp}: {name}'s plan uses {untested}, which this package has not checked for "
            f"exactness under sequence parallelism (checked: {list(TESTED_STYLES)}); use tensor_parallel_size=1"
        )
    if shape.heads % tp or shape.kv_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide {name}'s attention heads ({shape.heads}) and key/value heads "
            f"({shape.kv_heads}): each TP rank takes whole heads; pick a common divisor"
        )


#: the row-wise linears of the Hugging Face plans (their LoRA ``A`` splits over tp); the others are column-wise
_ROWWISE_LINEARS = ("o_proj", "down_proj")


def _lora_params(shape: _Shape, rank: int | None, targets: Any, tp: int = 1) -> tuple[int, int]:
    """(all blocks', one block's) LoRA adapter parameters on one tensor-parallel rank: ``rank * (in + out)``
    per targeted linear; with ``tp`` the half on the split side of the base linear is ``/ tp``
    (``tensor_parallel._through_adapters``: ``B`` of a column-wise layer, ``A`` of a row-wise one)."""
    if rank is None:
        return 0, 0
    _check_int("lora_rank", rank)
    names = {name for name, _, _ in shape.block_linears}
    wanted = names if targets == ALL_LINEAR else set([targets] if isinstance(targets, str) else targets)
    if not wanted or wanted - names:
        raise ValueError(
            f"lora_targets={targets!r}: {sorted(wanted - names) or 'nothing'} is not a linear layer of "
            f"{shape.model_name}'s blocks; use {ALL_LINEAR!r} or some of {sorted(names)}"
        )

    def local(name: str, i: int, o: int) -> int:
        return rank * (-(-i // tp) + o if name in _ROWWISE_LINEARS else i + -(-o // tp))

    block = sum(local(name, i, o) for name, i, o in shape.block_linears if name in wanted)
    return shape.layers * block, block


def parallel_kwargs(parallel: ResolvedConfig) -> dict[str, Any]:
    """The :func:`plan_memory` / :func:`longest_sequence` keywords a resolved strategy configuration fixes
    (``SequenceParallelConfig(...).resolve(...)``): the one mapping from the strategy's settings to the
    plan, so ``plan_memory(model_config, seq_len=N, **parallel_kwargs(cfg))`` plans what the strategy runs."""
    given = parallel.settings
    return {
        "sequence_parallel_size": parallel.sp,
        "data_parallel_size": parallel.dp,
        "tensor_parallel_size": parallel.tp,
        "mode": parallel.mode,
        "fpdt_chunk_size": given.fpdt_chunk_size,
        "offload": parallel.offload,
        "activation_checkpointing": parallel.activation_checkpointing,
        "activation_offload": given.activation_offload,
        "data_parallel": given.data_parallel,
        "loss_chunk_size": given.loss_chunk_size,
        "mlp_chunk_size": given.mlp_chunk_size,
        "cpu_offload": given.cpu_offload,
        "devices_per_host": parallel.layout.devices_per_node or None,
    }


def longest_sequence(
    config: Any, *, device_memory: int | str, sequence_parallel_size: int, **kwargs: Any
) -> int:
    """The largest ``seq_len`` whose plan (:func:`plan_memory`) fits ``device_memory`` per device, with its
    reserve, and ``host_memory`` per host when given (both are :attr:`MemoryPlan.fits`).

    Searched over multiples of ``P * fpdt_chunk_size`` (FPDT) or of ``P * 1024`` (Ulysses); the other
    keyword arguments are :func:`plan_memory`'s (``tensor_parallel_size`` among them: the search step does not
    depend on it). Returns 0 when not even one multiple fits.
    """
    if "seq_len" in kwargs:
        raise TypeError("longest_sequence() searches seq_len; do not pass it")
    memory = parse_bytes(device_memory)
    P = _check_int("sequence_parallel_size", sequence_parallel_size)
    chunk = kwargs.get("fpdt_chunk_size") or DEFAULT_FPDT_CHUNK_SIZE
    step = P * (chunk if kwargs.get("mode", "ulysses") == "fpdt" else 1024)

    def fits(k: int) -> bool:
        plan = plan_memory(config, seq_len=k * step, sequence_parallel_size=P, device_memory=memory, **kwargs)
        return bool(plan.fits)

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
