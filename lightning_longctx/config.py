"""The sequence-parallel settings: what a user asks for, and what it means on one world.

:class:`SequenceParallelConfig` holds the settings as given (``"auto"`` included), validated once; its
fields are the keyword arguments of :class:`~lightning_longctx.UlyssesFPDTStrategy`. Its
:meth:`~SequenceParallelConfig.resolve` settles them for a world size, devices per node and device type
into a :class:`ResolvedConfig` — the dp x sp layout, ``offload="auto"``, checkpointing implied by
activation offload, the chunk of a sequence — the ONE object the strategy, the Hugging Face patching
(``enable_sequence_parallel``), the memory planner and the CLI read, as torchtitan's ``ParallelDims``
is built once and passed down. A new setting is a field here and a read in its one consumer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from lightning_longctx.attention.fpdt import FPDT_BACKENDS
from lightning_longctx.parallel.layout import SequenceLayout
from lightning_longctx.parallel.mesh import ParallelDims
from lightning_longctx.parallel.sharding import IGNORE_INDEX


class Mode(str, Enum):
    """The sequence-parallel attention mode, derived from the settings (``fpdt_chunk_size``).

    A ``str`` enum: ``Mode.FPDT == "fpdt"`` and ``str(Mode.FPDT) == "fpdt"``, so user code, YAML and logs that
    compare or print the strings keep working; inside the package compare with the members."""

    #: Ulysses: one all-to-all each way per attention call, the whole local shard at once.
    ULYSSES = "ulysses"
    #: FPDT: the sequence in chunks (all-to-all, attention, offload per chunk), MLPs and loss tiled too.
    FPDT = "fpdt"

    __str__ = str.__str__  # the value, as the strings it replaces ("fpdt", not "Mode.FPDT")
    __format__ = str.__format__


class DataParallel(str, Enum):
    """How the dp x sp replicas of the model keep its parameters (``SequenceParallelConfig.data_parallel``).

    A ``str`` enum like :class:`Mode`: ``DataParallel.FSDP == "fsdp"``, so the settings keep taking the
    strings (YAML, keyword arguments); inside the package compare with the members."""

    #: DDP: every rank holds the whole model; gradients all-reduced in buckets over dp x sp.
    DDP = "ddp"
    #: FSDP2: ``fully_shard`` of every transformer block over all dp x sp ranks.
    FSDP = "fsdp"

    __str__ = str.__str__  # the value, as the strings it replaces ("fsdp", not "DataParallel.FSDP")
    __format__ = str.__format__


#: The sequence-parallel attention modes, as strings (the values of :class:`Mode`).
MODES = tuple(mode.value for mode in Mode)
#: Tokens per chunk per rank of the "ulysses_fpdt" preset.
DEFAULT_FPDT_CHUNK_SIZE = 4096
#: Lightning precisions the strategy and the planner accept.
SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def auto_ring_size(sp: int, heads: int) -> int:
    """``ring_size="auto"``: 1 while the Ulysses degree fits the heads (``sp <= heads``), else the smallest
    divisor r of ``sp`` with ``sp / r <= heads``; ``heads`` are the query heads each tensor-parallel rank
    holds (``num_attention_heads / tensor_parallel_size``). The all-to-all then keeps every rank busy and
    the ring is as short as the heads allow (its passes are the slower, cross-node links)."""
    if sp < 1 or heads < 1:
        raise ValueError(f"auto_ring_size needs sp >= 1 and heads >= 1, got sp={sp}, heads={heads}")
    return next(r for r in range(1, sp + 1) if sp % r == 0 and sp // r <= heads)


@dataclass(frozen=True, kw_only=True)
class SequenceParallelConfig:
    """The sequence-parallel settings, validated once. They are written only here: the fields are the
    keyword arguments of :class:`UlyssesFPDTStrategy` (its signature, which LightningCLI reads, and its
    docstring are derived from this class).

    Args:
        sequence_parallel_size: ranks that share one sequence; ``"auto"`` = all devices of a node (divided
            by ``tensor_parallel_size``). Must divide ``num_nodes * devices / tensor_parallel_size``; the rest
            is data parallelism.
        fpdt_chunk_size: tokens per FPDT chunk per rank; ``None`` = plain Ulysses. Short sequences use
            one chunk of their local length.
        offload: keep FPDT's cold key/value chunks and saved activations in host memory; ``"auto"`` =
            on when training on CUDA.
        attention_backend: local kernel, ``"auto" | "flash" | "sdpa" | "math"``.
        data_parallel: ``"ddp"`` (replicated parameters, DDP all-reduce over dp x sp) or ``"fsdp"``
            (FSDP2 ``fully_shard`` of every transformer block and of each HF model over all dp x sp
            ranks).
        tensor_parallel_size: ranks that split every layer's weights (the model's Hugging Face TP plan,
            ``config.base_model_tp_plan``: q/k/v and gate/up column-wise, o/down row-wise), innermost in the
            mesh; Ulysses / FPDT then act on each rank's heads. Needs ``data_parallel="fsdp"`` (FSDP2 over
            dp x sp) and heads and kv heads divisible by it.
        cpu_offload: keep the sharded parameters, their gradients and the optimizer states in host memory
            (FSDP2's ``CPUOffloadPolicy``, pinned on CUDA); each block's parameters visit the device for its
            forward and backward only, and the optimizer steps on the CPU. Needs ``data_parallel="fsdp"``
            (also at world size 1).
        activation_checkpointing: enable HF gradient checkpointing (non-reentrant) on patched models.
        activation_offload: checkpoint the decoder layers (as ``activation_checkpointing``) and keep each
            layer's checkpointed input in pinned host memory until its recompute in backward, prefetched
            back on a side stream; bit-identical results. On CPU it copies and saves nothing.
        fpdt_overlap: start FPDT's all-to-alls in the background so they travel while a block computes;
            ``False``: each completes before the next block (same results; for profiling communication).
        mlp_chunk_size: tokens per chunk of the FPDT-tiled MLP (default: ``fpdt_chunk_size``).
        loss_chunk_size: tokens per chunk of FPDT's chunked lm_head + loss (default: from the vocabulary, at
            most 128 MiB per fp32 logits block: 1024 tokens of a 32K vocabulary, 256 of a 128K one).
        pad_token_id: token that pads sequences whose length does not divide.
        ignore_index: label of tokens without a loss (padding gets it too).
        loss_normalization: ``"tokens"`` (default): the loss and every gradient of an optimizer step are
            those of one device on the whole global batch, the sum of token losses over all dp ranks and
            micro-batches of the accumulation window divided by its valid-token count;
            ``"micro_batch"``: Lightning's mean of per-micro-batch means (exact within an SP group).
        checkpoint_format: ``"sharded"`` (default): a ``torch.distributed.checkpoint`` directory in which every
            rank writes its own shards (no rank holds the full state); it resumes at any layout (dp, sp, tp,
            world size, offload, DDP or FSDP). ``"full"``: one file, gathered on rank 0 (loads anywhere with
            ``torch.load``; at 8B parameters with AdamW that is ~96 GB on one host).
        async_save: write sharded checkpoints in the background (on a gloo group of their own): training
            goes on after the state is copied to host memory; the next save, a preemption and the end of the
            run wait for it.
        ring_size: 2-D sequence parallelism (Ulysses x ring): the sp ranks form ``ring_size`` rings of
            ``sequence_parallel_size / ring_size`` Ulysses ranks; the all-to-all runs inside each Ulysses group
            (adjacent ranks) and ring attention passes key/value blocks between the groups, so only the
            Ulysses degree must fit the heads. Tokens are laid out zigzag over the ring (equal causal work).
            ``1`` (default): Ulysses alone. ``"auto"``: 1 while ``sequence_parallel_size`` fits the query heads
            per tensor-parallel rank, else the smallest ring that makes the Ulysses degree fit them
            (``auto_ring_size``; read from the model's config when the strategy sets up). Both modes: with
            ``fpdt_chunk_size`` FPDT's chunks run inside each ring rank (``attention/fpdt_ring.py``). Needs an
            ``attention_backend`` of FPDT's block kernels (``"auto"``, ``"fused"``, ``"math"``).
    """

    sequence_parallel_size: int | Literal["auto"] = "auto"
    fpdt_chunk_size: int | None = None
    offload: bool | Literal["auto"] = False
    attention_backend: str = "auto"
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    tensor_parallel_size: int = 1
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    activation_offload: bool = False
    fpdt_overlap: bool = True
    mlp_chunk_size: int | None = None
    loss_chunk_size: int | None = None
    pad_token_id: int = 0
    ignore_index: int = IGNORE_INDEX
    loss_normalization: Literal["tokens", "micro_batch"] = "tokens"
    checkpoint_format: Literal["sharded", "full"] = "sharded"
    async_save: bool = False
    ring_size: int | Literal["auto"] = 1

    def __post_init__(self) -> None:
        sp = self.sequence_parallel_size
        if sp != "auto" and (not isinstance(sp, int) or sp < 1):
            raise ValueError(
                f"sequence_parallel_size={sp!r}: use 'auto' (all devices of a node) or a positive int"
            )
        ring = self.ring_size
        if ring != "auto" and (isinstance(ring, bool) or not isinstance(ring, int) or ring < 1):
            raise ValueError(
                f"ring_size={ring!r}: use a positive int (1: Ulysses alone) or 'auto' (a ring only where the "
                "heads are fewer than the sequence-parallel ranks)"
            )
        if ring != "auto":
            self._check_ring(ring)
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r}: use a positive int (1: no tensor parallelism)")
        for name in ("fpdt_chunk_size", "mlp_chunk_size", "loss_chunk_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: use None (the default) or a positive token count")
        if self.offload not in (True, False, "auto"):
            raise ValueError(
                f"offload={self.offload!r}: use True, False or 'auto' (on when training on CUDA)"
            )
        for name in ("cpu_offload", "activation_checkpointing", "activation_offload", "fpdt_overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: use True or False")
        if self.offload is True and self.fpdt_chunk_size is None:
            raise ValueError("offload=True needs FPDT chunking: set fpdt_chunk_size (e.g. 4096)")
        if self.loss_normalization not in ("tokens", "micro_batch"):
            raise ValueError(
                f"loss_normalization={self.loss_normalization!r} is unknown; use 'tokens' (the token mean over the "
                "global batch, as one device) or 'micro_batch' (Lightning's mean of per-micro-batch means)"
            )
        if self.checkpoint_format not in ("sharded", "full"):
            raise ValueError(
                f"checkpoint_format={self.checkpoint_format!r} is unknown; use 'sharded' (every rank writes its "
                "shards; resumes at any layout) or 'full' (one file gathered on rank 0)"
            )
        if not isinstance(self.async_save, bool):
            raise ValueError(f"async_save={self.async_save!r}: use True or False")
        if self.async_save and self.checkpoint_format != "sharded":
            raise ValueError(
                "async_save=True writes sharded checkpoints only; set checkpoint_format='sharded' (the default)"
            )
        if self.data_parallel not in ("ddp", "fsdp"):
            raise ValueError(
                f"data_parallel={self.data_parallel!r} is unknown; use 'ddp' (replicated parameters) or 'fsdp' "
                "(FSDP2 fully_shard per transformer block over all dp x sp ranks)"
            )
        if tp > 1 and self.data_parallel != "fsdp":
            raise ValueError(
                f"tensor_parallel_size={tp} with data_parallel={self.data_parallel!r}: DDP cannot wrap the DTensor "
                "weights tensor parallelism makes; set data_parallel='fsdp' (FSDP2 over data x sequence parallel)"
            )
        if self.cpu_offload and self.data_parallel != "fsdp":
            raise ValueError(
                f"cpu_offload=True with data_parallel={self.data_parallel!r}: the parameters, gradients and "
                "optimizer states move to the host only when FSDP2 shards them; set data_parallel='fsdp'"
            )

    def _check_ring(self, ring: int) -> None:
        """The settings a ring of ``ring`` ranks cannot run with (at construction, or where ``"auto"`` resolves)."""
        if ring > 1 and self.attention_backend not in FPDT_BACKENDS:
            raise ValueError(
                f"ring_size={ring} with attention_backend={self.attention_backend!r}: ring attention runs FPDT's "
                f"block kernels (they return the log-sum-exp the ring merges); use one of {list(FPDT_BACKENDS)}"
            )

    @property
    def mode(self) -> Mode:
        return Mode.ULYSSES if self.fpdt_chunk_size is None else Mode.FPDT

    def resolve(
        self, world_size: int, devices_per_node: int, device_type: str, heads: int | None = None
    ) -> ResolvedConfig:
        """What these settings mean on ``world_size`` ranks with ``devices_per_node`` devices per node (0:
        unknown) of ``device_type``: ``"auto"`` settled, the dp x sp layout built and checked. Every consumer
        (the strategy, the model patching, the planner, the CLI) takes the result, so nothing is resolved twice.
        ``heads``: the model's query heads (all of them, before tensor parallelism), needed by
        ``ring_size="auto"`` only."""
        sp, tp = self.sequence_parallel_size, self.tensor_parallel_size
        if sp == "auto":
            sp = max(1, (devices_per_node or world_size) // tp)
        ring = self.ring_size
        if ring == "auto":
            if heads is None:
                raise ValueError(
                    "ring_size='auto' needs the model's number of attention heads when the strategy sets up, and "
                    "no transformers config was found in the LightningModule (build the model in __init__, not in "
                    "configure_model), or pass ring_size as an int (1: Ulysses alone)"
                )
            ring = auto_ring_size(sp, max(1, heads // tp))
            self._check_ring(ring)
        dims = ParallelDims(world_size=world_size, sp=sp, tp=tp, ring=ring, devices_per_node=devices_per_node)
        offload = (
            device_type == "cuda" and self.fpdt_chunk_size is not None
            if self.offload == "auto"
            else self.offload
        )
        return ResolvedConfig(
            settings=self,
            dims=dims,
            offload=bool(offload),
            activation_checkpointing=self.activation_checkpointing or self.activation_offload,
        )


@dataclass(frozen=True, kw_only=True)
class ResolvedConfig:
    """:class:`SequenceParallelConfig` settled for one world (:meth:`SequenceParallelConfig.resolve`).

    ``settings`` are the user's as given (read the plain ones there: ``config.settings.attention_backend``;
    a new setting needs no line here); ``dims`` the dp x sp x tp degrees (a ring inside sp); ``offload`` and
    ``activation_checkpointing`` the effective switches.
    """

    settings: SequenceParallelConfig
    dims: ParallelDims
    offload: bool
    activation_checkpointing: bool

    @property
    def layout(self) -> ParallelDims:
        """The old name of :attr:`dims` (before 0.6; "layout" now names :attr:`sequence_layout` only)."""
        return self.dims

    @property
    def mode(self) -> Mode:
        return self.settings.mode

    @property
    def sp(self) -> int:
        return self.dims.sp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @functools.cached_property
    def sequence_layout(self) -> SequenceLayout:
        """Which tokens each sp rank holds (``parallel/layout.py``): ``sp`` ranks, ``dims.ring``, and the
        configured ``fpdt_chunk_size``; built once, read by the batch sharding, the patched model and its
        attention."""
        return SequenceLayout(sp=self.sp, ring=self.dims.ring, chunk_size=self.settings.fpdt_chunk_size)

    def chunk_for(self, seq_len: int) -> int | None:
        """Tokens per FPDT chunk per rank for a global sequence of ``seq_len`` tokens (``None``: Ulysses)."""
        return self.sequence_layout.chunk_for(seq_len)

    def __str__(self) -> str:
        return f"{self.dims}, mode={self.mode}"
