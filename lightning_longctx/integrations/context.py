"""The state of one sequence-parallel Hugging Face model: its own module, so the patching
(``transformers.py``) and the mask machinery (``masks.py``) both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_longctx.parallel.comm import Group, all_reduce_no_grad, group_rank_size
from lightning_longctx.parallel.layout import SequenceLayout
from lightning_longctx.parallel.sharding import document_ids

if TYPE_CHECKING:
    from lightning_longctx.attention.dispatch import Attend
    from lightning_longctx.config import ResolvedConfig
    from lightning_longctx.integrations.lm_head import ChunkedHead
    from lightning_longctx.integrations.moe import MoEAuxLossPlan
    from lightning_longctx.integrations.rope import RopeLimit
    from lightning_longctx.ops.loss import TokenLossObserver


def _version(t: torch.Tensor) -> int:
    """``t._version``; inference tensors (validation under ``torch.inference_mode``) keep none: -1."""
    return -1 if t.is_inference() else t._version


@dataclass(eq=False)
class BatchPositions:
    """The GLOBAL position ids of one batch: ``local`` ``(b, s/P)`` this rank's shard, the very tensor the
    model is called with; ``full`` ``(b, N)`` the whole sequence in global order. Set once per batch where
    it is sharded (the strategy, from ``sharding.global_positions``, no collective) or by the model's
    forward hook (one all-gather) when a call brings other position ids. The document ids every attention
    layer needs are derived from ``full`` here and remembered on this object, which dies with the batch.
    ``length``: the batch's tokens before ``shard_batch`` padded the end (``None``: all of ``full``)."""

    local: torch.Tensor
    full: torch.Tensor
    version: int = -1  # ``local._version`` when recorded: an in-place write makes it a different batch
    length: int | None = None
    _documents: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    _sequence_length: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.version = _version(self.local)

    def describes(self, position_ids: torch.Tensor) -> bool:
        """Whether attention's ``position_ids`` are this batch's: the tensor itself, or a view with its
        shape, strides and offset (models pass them down layer by layer, checkpoint recomputes included)."""
        p, mine = position_ids, self.local
        if p is not mine and not (
            p._base is not None
            and p._base is (mine if mine._base is None else mine._base)
            and p.shape == mine.shape
            and p.stride() == mine.stride()
            and p.storage_offset() == mine.storage_offset()
        ):
            return False
        return _version(mine) == self.version

    def documents(self, chunk: int | None = None) -> torch.Tensor | None:
        """``(b, N)`` document ids in global order (``None``: one document per row); ``chunk``: chunked
        attention (Llama-4), each chunk of ``chunk`` positions of a document its own document."""
        if chunk not in self._documents:
            full = self.full if chunk is None else self.full % chunk
            self._documents[chunk] = document_ids(full)
        return self._documents[chunk]

    def sequence_length(self) -> torch.Tensor:
        """0-d: the largest position id of the batch (its pads left out) + 1, what a length-dependent RoPE
        reads on one process as ``max(position_ids) + 1`` (``integrations/rope.py``); stays on the device."""
        if self._sequence_length is None:
            self._sequence_length = self.full[..., : self.length].max() + 1
        return self._sequence_length


@dataclass(eq=False)
class SequenceParallelContext:
    """Settings of one patched model, what ``disable_sequence_parallel`` restores, and the counters
    the strategy's guardrails read.

    ``config`` is the resolved configuration (``config.py``): the mode, the sequence layout
    (``config.sequence_layout``: the FPDT chunk per rank, a call whose local sequence is shorter uses one chunk
    of its length, ``SequenceLayout.local_chunk``; the ring), the offload switch, the kernel backend, the loss
    chunk. ``attend`` is the model's attention, chosen for that layout when the model was patched
    (``attention/dispatch.py``). ``positions`` are the current batch's
    (:class:`BatchPositions`: its documents, computed once per batch). ``call_position_ids`` are the GLOBAL
    ``position_ids`` of the forward call in progress (set and cleared by hooks on the model; the mask
    function copies them into the ``MaskPattern`` it returns, for models that do not pass them on to
    attention, such as Llama-4).

    A deep copy of a patched model shares its context (same group, same settings); pickling one is
    refused, since the process group cannot travel: unpatch it first.
    """

    group: Group
    config: ResolvedConfig
    model_name: str = ""
    key: str = ""
    num_attention_layers: int = 0
    attention_calls: int = 0
    num_mixers: int = 0  # hybrid models: the patched non-attention mixers (``integrations/hybrid``)
    mixer_calls: int = 0
    mixer_halo: int = 0  # the most tokens a mixer needs from before its segment (a conv's k-1)
    lm_head: ChunkedHead | None = None  # FPDT mode: read at patch time
    moe_plan: MoEAuxLossPlan | None = None  # the model's in-forward load-balancing loss, if any
    rope_limit: RopeLimit | None = None  # the longest sequence the model's RoPE covers (``rope.py``)
    call_position_ids: torch.Tensor | None = None
    positions: BatchPositions | None = None  # the current batch's, for the documents of every layer
    # handed every per-token loss the model's loss computes (``loss.TokenLossObserver``); set by a validation
    # callback for its runs (``callbacks/positional_loss.py``), ``None`` otherwise
    loss_observer: TokenLossObserver | None = None
    restore: dict[str, Any] = field(default_factory=dict)  # the model's settings before patching
    # Ulysses x ring (``ring_size > 1``): the two parts of ``group`` (``mesh.WorldMesh``); None otherwise
    ring_group: Group = None
    ulysses_group: Group = None
    attend: Attend | None = None  # the layout's attention, its groups and kernel settings bound
    # inside ``sequence_parallel_off``: the model computes as unpatched; the positions hooks do nothing
    off: bool = False

    def __deepcopy__(self, memo: dict[int, Any]) -> SequenceParallelContext:
        return self

    @property
    def attention_free(self) -> bool:
        """A model whose every token mixer is a patched hybrid mixer (RWKV, xLSTM, Mamba): no attention layer
        reads the key, which only names this context (``context_of``)."""
        return self.num_attention_layers == 0 and self.num_mixers > 0

    def __reduce__(self) -> Any:
        raise TypeError(
            "a sequence-parallel model holds its process group and cannot be pickled; call "
            "lightning_longctx.disable_sequence_parallel(model) first (state_dict() always works)"
        )

    @property
    def layout(self) -> SequenceLayout:
        """The sequence layout ``shard_batch`` cut the batch in (``config.sequence_layout``)."""
        return self.config.sequence_layout

    @property
    def ring(self) -> int:
        """The ring's degree (``ring_size``; 1: Ulysses or FPDT alone)."""
        return self.layout.ring

    @property
    def sp_size(self) -> int:
        return group_rank_size(self.group)[1]

    @property
    def chunk_size(self) -> int | None:
        """The configured FPDT chunk (tokens per rank), ``None`` under Ulysses."""
        return self.layout.chunk_size

    def local_chunk(self, local_len: int) -> int | None:
        """The FPDT chunk of a call whose shard holds ``local_len`` tokens (``None`` under Ulysses)."""
        return self.layout.local_chunk(local_len)

    def documents_for(self, position_ids: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
        """``(known, documents)`` for attention's ``position_ids``: the batch's document ids when they are
        the batch's positions (``known``), else ``(False, None)`` (attention gathers them itself)."""
        pos = self.positions
        if position_ids is None or pos is None or not pos.describes(position_ids):
            return False, None
        return True, pos.documents()

    def record_positions(self, position_ids: torch.Tensor) -> None:
        """Keep the batch of a forward call whose position ids are not the recorded batch's: one all-gather
        of them (every rank calls the forward, so every rank takes part)."""
        if self.positions is not None and self.positions.describes(position_ids):
            return
        local = position_ids.shape[-1]
        full = self.layout.for_local(local).gather(position_ids.reshape(-1, local), self.group)
        self.positions = BatchPositions(local=position_ids, full=full)

    def sequence_length(self, position_ids: torch.Tensor) -> torch.Tensor:
        """0-d: the GLOBAL sequence length of the batch whose shard is ``position_ids`` (largest position id
        + 1, ``shard_batch``'s pads left out): what one process would read on the whole sequence. From the
        recorded batch (no collective) or, for other positions, one all-reduce over the group (every rank
        runs the model's rotary embedding, so every rank takes part)."""
        pos = self.positions
        if pos is not None and pos.describes(position_ids):
            return pos.sequence_length()
        return all_reduce_no_grad(position_ids.max().reshape(1), group=self.group, op="max")[0] + 1

    def global_index(self, local_len: int, device: torch.device) -> torch.Tensor:
        """``(local_len,)`` global token index of each local token in this rank's layout (``shard_batch``'s)."""
        rank, _ = group_rank_size(self.group)
        return self.layout.for_local(local_len).global_index(local_len, rank, device)
