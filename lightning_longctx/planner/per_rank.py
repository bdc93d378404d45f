"""What one rank holds in one plan, resolved once from the model's shape, the resolved sequence-parallel
config and the planner's own inputs.

:func:`build_per_rank` takes a :class:`~lightning_longctx.config.ResolvedConfig` (the settings, validated in
``config.py`` only) and validates what only the planner asks: the sequence, the micro batch, the precision and
the weights' dtype, the optimizer, LoRA, the memory sizes, and what tensor parallelism needs of this model.
The :class:`_PerRank` it returns is all a memory term (``terms.py``) and the step-time model read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_longctx.attention.common import kv_repeat_factor
from lightning_longctx.config import SUPPORTED_PRECISION, DataParallel, Mode, ResolvedConfig
from lightning_longctx.ops.chunked_loss import default_loss_chunk_size
from lightning_longctx.parallel.fsdp import MIXED_PRECISION_DTYPES
from lightning_longctx.planner.report import parse_bytes
from lightning_longctx.planner.shapes import _LLAMA_BLOCK, ATTENTION, _Block, _Shape, _TPSplit

#: LoRA target meaning every linear layer of the blocks (peft's name; the lm_head is not one of them)
ALL_LINEAR = "all-linear"
#: Device memory the plan's tensors cannot use: the CUDA context with cuBLAS / NCCL workspaces (a GPU only),
#: plus the allocator's slack (reserved but not allocated: fragmentation), as a fraction of the peak.
CUDA_CONTEXT_BYTES = 1 << 30
ALLOCATOR_RESERVE = 0.05
#: the device types a plan is made for: a GPU run's ("cuda", the default) or a CPU run's (no CUDA context)
DEVICE_TYPES = ("cuda", "cpu")
#: Host memory per rank outside the plan: the process itself (Python, torch and CUDA libraries, the CUDA
#: context's host side), its data loader.
HOST_PROCESS_BYTES = 4 << 30
#: devices per host when neither ``devices_per_host`` nor the config's devices per node is given: the job's
#: world, at most 8 (one GPU node)
DEFAULT_DEVICES_PER_HOST = 8
#: optimizer name -> state tensors per parameter (kept in the parameter's dtype by torch.optim)
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
#: FPDT's score tile (``fpdt_attention(block_size=1024)``)
FPDT_BLOCK_SIZE = 1024
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float64": 8, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
#: the row-wise linears of the Hugging Face plans (their LoRA ``A`` splits over tp); the others are column-wise
_ROWWISE_LINEARS = ("o_proj", "down_proj")


def _dtype_bytes(name: Any) -> int:
    key = str(name).replace("torch.", "").lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(
            f"param_dtype={name!r} is unknown; use 'float32', 'bfloat16', 'float16' or 'float64'"
        )
    return _DTYPE_BYTES[key]


def _dtypes(
    precision: str, param_dtype: Any, data_parallel: DataParallel
) -> tuple[int, int, int, int, bool, bool]:
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
        if data_parallel is DataParallel.FSDP and p in MIXED_PRECISION_DTYPES:
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


@dataclass(frozen=True, kw_only=True)
class _PerRank:
    """What one rank holds in one plan: the model's shape, the sequence as ``shard_batch`` pads and splits
    it, heads per rank after the all-to-all, dtype sizes and the mode flags. Notation as in the package
    docstring: ``t`` local tokens, ``w`` / ``m`` / ``r`` parameter / matmul / residual bytes."""

    shape: _Shape
    seq_len: int  # as asked
    padded: int  # what shard_batch pads it to: a multiple of sp (or of sp * chunk with FPDT)
    sp: int  # P, ranks that share one sequence
    dp: int
    b: int  # micro batch: sequences per device
    t: int  # tokens per rank: b * padded / sp
    bn: int  # tokens each rank sees in head layout: b * padded (with a ring: its ring rank's, b * padded / ring)
    ring: int  # ring_size r: ring attention over r groups of U = sp / r Ulysses ranks (1: Ulysses alone)
    mode: Mode
    chunk: int | None  # FPDT tokens per chunk per rank (capped at the local length)
    loss_chunk: int | None  # FPDT's lm_head + loss chunk (tokens)
    mlp_chunk: int | None  # FPDT's tiled-MLP chunk (tokens)
    offload: bool  # FPDT's chunks in host memory
    checkpointing: bool  # every decoder layer checkpointed (implied by activation_offload)
    activation_offload: bool  # the checkpointed layer inputs in host memory
    fpdt_overlap: bool  # FPDT's all-to-alls in the background, behind a block's compute
    data_parallel: DataParallel
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
    kv_heads: int  # TP-local kv heads after the replication for the all-to-all over U (spread_kv_heads)
    heads_per_rank: int  # query heads per rank after the all-to-all over U (the largest rank's: uneven split)
    kv_per_rank: int  # kv heads per rank after the all-to-all over U
    tp: int  # tensor_parallel_size: ranks that split every layer's weights (and its heads, its MLP width)
    vocab_parallel: bool  # FPDT + tp: the untied lm_head split over the vocabulary (V / tp rows per rank)
    lora_rank: int | None
    device_memory: int | None
    host_memory: int | None  # per host
    devices_per_host: int
    fixed_device_reserve: int | None  # bytes given; None: CUDA context (on CUDA) + allocator slack
    host_reserve: int  # per rank
    device_type: str  # "cuda" or "cpu": whether a CUDA context takes device memory

    def device_reserve(self, peak: int) -> int:
        if self.fixed_device_reserve is not None:
            return self.fixed_device_reserve
        context = CUDA_CONTEXT_BYTES if self.device_type == "cuda" else 0
        return context + int(ALLOCATOR_RESERVE * peak)

    @property
    def fpdt(self) -> bool:
        return self.mode is Mode.FPDT

    @property
    def ulysses(self) -> int:
        """U = sp / ring: the ranks of one all-to-all (sp without a ring)."""
        return self.sp // self.ring

    @property
    def ring_block_bytes(self) -> int:
        """One k/v message of the ring, ``(2, b, N/r, H_kv'/U, hd)`` in the k/v dtype: what each ring step
        passes, at kv-head size (``H_kv'``: the kv heads spread for U; never expanded to the query heads); FPDT x
        ring stacks k and v in q's dtype (:attr:`qa`). 0 without a ring."""
        return 2 * self.kv_elems * self.qa if self.ring > 1 else 0

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
        """Segments of one sequence the recurrent mixers' state scan (and conv halo) runs over: one per rank, one
        per local FPDT chunk in the FPDT layout (FPDT x ring too); Ulysses x ring: two per rank, its two zigzag
        halves of ``N / 2P`` tokens."""
        per_rank = self.t // (self.b * self.chunk) if self.fpdt else 2 if self.ring > 1 else 1
        return self.sp * per_rank

    @property
    def casting(self) -> bool:
        """Autocast makes (and linear saves) low-precision copies of the weights and inputs (not of the
        MixedPrecisionPolicy's bf16 parameters: they are in the matmul dtype already)."""
        return self.autocast and self.pw != self.m

    @property
    def shard(self) -> int:
        """Ranks a parameter is split over: dp * sp with FSDP (the replicas of a TP-local block), 1 with DDP."""
        return self.dp * self.sp if self.data_parallel is DataParallel.FSDP else 1

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
        """One rank's q (or out) in head layout: ``(b, N, H/P, hd)`` elements (a ring: ``(b, N/r, H/U, hd)``)."""
        return self.bn * self.heads_per_rank * self.shape.head_dim

    @property
    def kv_elems(self) -> int:
        """One rank's k (or v) in head layout: ``(b, N, H_kv'/P, hd)`` elements (a ring: ``(b, N/r, H_kv'/U,
        hd)``)."""
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
        """Tokens of one FPDT segment (one chunk of every rank of the all-to-all: ``U * c``, after it; ``P * c``
        without a ring); Ulysses: all of them."""
        return self.b * self.ulysses * self.chunk if self.fpdt else self.bn

    @property
    def tile(self) -> int:
        """Side of FPDT's score tile (``fpdt_attention(block_size=1024)``), 0 for Ulysses."""
        return min(FPDT_BLOCK_SIZE, self.segment // self.b) if self.fpdt else 0


def build_per_rank(
    shape: _Shape,
    parallel: ResolvedConfig,
    *,
    seq_len: int,
    micro_batch_size: int = 1,
    precision: str = "32-true",
    param_dtype: Any = None,
    optimizer: str = "adamw",
    lora_rank: int | None = None,
    lora_targets: str | tuple[str, ...] | list[str] = ALL_LINEAR,
    device_memory: int | str | None = None,
    host_memory: int | str | None = None,
    device_reserve: int | str | None = None,
    host_reserve: int | str | None = None,
    device_type: str = "cuda",
) -> _PerRank:
    """What one rank of ``parallel``'s layout holds for ``shape``: the settings read from the resolved config,
    the planner's own inputs (keywords as :func:`~lightning_longctx.planner.plan_memory`'s) checked here.
    Devices per host: the config's devices per node, else the world up to ``DEFAULT_DEVICES_PER_HOST``."""
    settings, P, dp, tp = parallel.settings, parallel.sp, parallel.dp, parallel.tp
    b = _check_int("micro_batch_size", micro_batch_size)
    _check_inputs(shape, tp, seq_len=seq_len, optimizer=optimizer, device_type=device_type)
    ring = parallel.dims.ring
    data_parallel = DataParallel(settings.data_parallel)  # validated by the config: "ddp" or "fsdp"
    w, pw, m, r, autocast, mp = _dtypes(precision, param_dtype, data_parallel)
    memory = None if device_memory is None else parse_bytes(device_memory)
    host = None if host_memory is None else parse_bytes(host_memory)
    per_host = parallel.dims.devices_per_node or min(parallel.dims.world_size, DEFAULT_DEVICES_PER_HOST)
    lora, lora_block = _lora_params(shape, lora_rank, lora_targets, tp)

    # the strategy's rule (tensor_parallel.vocab_parallel_head): FPDT's chunked loss on this rank's V / tp rows
    vocab_parallel = tp > 1 and parallel.mode is Mode.FPDT and shape.tp.head > 0 and shape.vocab % tp == 0
    chunk, loss_chunk, mlp_chunk = _fpdt_chunks(shape, parallel, seq_len, vocab_parallel)
    # shard_batch's padding: sp (x chunk with FPDT; x 2 with a ring: its 2r zigzag chunks, each split over U;
    # FPDT x ring: 2 * P * c, its chunk capped at N / 2P by chunk_for)
    multiple = P * (chunk or 1) * (2 if ring > 1 else 1)
    padded = -(-seq_len // multiple) * multiple
    heads, kv_heads = shape.heads // tp, shape.kv_heads // tp  # the TP-local heads the attention receives
    U = P // ring  # the all-to-all's ranks: kv heads are spread for U, not P (usp_attention)
    kv = kv_heads * kv_repeat_factor(heads, kv_heads, U)
    return _PerRank(
        shape=shape, seq_len=seq_len, padded=padded, sp=P, dp=dp, b=b, t=b * padded // P,
        bn=b * padded // ring, ring=ring,
        mode=parallel.mode, chunk=chunk, loss_chunk=loss_chunk, mlp_chunk=mlp_chunk,
        offload=parallel.offload, checkpointing=parallel.activation_checkpointing,  # activation offload implies it
        activation_offload=settings.activation_offload, fpdt_overlap=settings.fpdt_overlap,
        data_parallel=data_parallel,
        optimizer=optimizer.lower(), states=OPTIMIZER_STATES[optimizer.lower()], precision=str(precision), w=w,
        pw=pw, m=m, r=r, autocast=autocast, mp_policy=mp, cpu_offload=settings.cpu_offload, lora=lora,
        lora_block=lora_block, kv_heads=kv, heads_per_rank=-(-heads // U), kv_per_rank=-(-kv // U),
        lora_rank=lora_rank, tp=tp, vocab_parallel=vocab_parallel,
        device_memory=memory, host_memory=host, devices_per_host=per_host,
        fixed_device_reserve=None if device_reserve is None else parse_bytes(device_reserve),
        host_reserve=HOST_PROCESS_BYTES if host_reserve is None else parse_bytes(host_reserve),
        device_type=device_type,
    )  # fmt: skip


def _check_inputs(shape: _Shape, tp: int, *, seq_len: int, optimizer: str, device_type: str) -> None:
    """The planner's own inputs that no config validates: the sequence, the device type, the optimizer, and what
    tensor parallelism needs of this model."""
    _check_int("seq_len", seq_len)
    if device_type not in DEVICE_TYPES:
        raise ValueError(
            f"device_type={device_type!r} is unknown; use 'cuda' (a GPU run: its reserve holds the CUDA context) "
            "or 'cpu'"
        )
    if optimizer.lower() not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is unknown; use one of {sorted(OPTIMIZER_STATES)}")
    if tp > 1 and shape.blocks:
        raise ValueError(
            f"tensor_parallel_size={tp}: {shape.model_name} is a hybrid model; plan_memory does not model its "
            "recurrent layers under tensor parallelism; use tensor_parallel_size=1"
        )
    if tp > 1:
        _check_tp(shape, tp)


def _fpdt_chunks(
    shape: _Shape, parallel: ResolvedConfig, seq_len: int, vocab_parallel: bool
) -> tuple[int | None, int | None, int | None]:
    """FPDT's ``(chunk, loss chunk, MLP chunk)`` in tokens, as the strategy picks them (all None for Ulysses)."""
    if parallel.mode is not Mode.FPDT:
        return None, None, None
    settings = parallel.settings
    chunk = parallel.chunk_for(seq_len)  # the strategy's rule: capped at the local length
    # the default chunk is of the rows the loss sees (chunked_lm_head_cross_entropy: the local weight's)
    loss_chunk = settings.loss_chunk_size or default_loss_chunk_size(
        shape.vocab // parallel.tp if vocab_parallel else shape.vocab
    )
    return chunk, loss_chunk, settings.mlp_chunk_size or settings.fpdt_chunk_size


def _check_tp(shape: _Shape, tp: int) -> None:
    """What the strategy refuses for ``tensor_parallel_size > 1`` of this model (``tensor_parallel.check_tp``),
    with the same messages, read from the shape (no model is built); the settings' own rules (FSDP) are
    ``SequenceParallelConfig``'s."""
    from lightning_longctx.parallel.tensor_parallel import TESTED_STYLES

    name = shape.model_name
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
