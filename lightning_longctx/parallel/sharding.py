"""Cut a batch into this rank's piece of the sequence, and put pieces back together.

The layouts (contiguous, FPDT's strided chunks, Ulysses x ring's zigzag, FPDT x ring) are encoded once, in
:class:`~lightning_longctx.parallel.layout.SequenceLayout` (``parallel/layout.py``, whose docstring describes
them). The functions here take a process group of P ranks and a call's ``chunk_size`` and ``ring`` and act on
``SequenceLayout(sp=P, ring=ring, chunk_size=chunk_size)`` at exactly that chunk; around it they shift the
labels (before the cut, so no target is lost at a shard edge), pad the end, and derive packed documents from
global positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from lightning_longctx.parallel.comm import Group, group_rank_size
from lightning_longctx.parallel.layout import SequenceLayout

#: The label of a token that is not trained on (PyTorch's and Hugging Face's convention).
IGNORE_INDEX = -100

#: Keys of a batch dict that carry a sequence dimension (dim 1) and are sharded.
SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "token_type_ids")


def _layout(group: Group, chunk_size: int | None, ring: int) -> SequenceLayout:
    """The layout over ``group``'s ranks at exactly ``chunk_size``."""
    _, world = group_rank_size(group)
    return SequenceLayout(sp=world, ring=ring, chunk_size=chunk_size)


def chunk_for(seq_len: int, world: int, chunk_size: int | None, ring: int = 1) -> int | None:
    """Tokens per FPDT chunk per rank for a global sequence of ``seq_len`` tokens over ``world`` ranks
    (:meth:`SequenceLayout.chunk_for <lightning_longctx.parallel.layout.SequenceLayout.chunk_for>`):
    ``chunk_size``, or one chunk of the local length for a shorter sequence (half of it with a ring)."""
    return SequenceLayout(sp=world, ring=ring, chunk_size=chunk_size).chunk_for(seq_len)


def local_chunk(chunk_size: int, local_len: int, ring: int = 1) -> int:
    """The chunk of a rank holding ``local_len`` tokens of a sequence laid out by :func:`chunk_for`
    (``SequenceLayout.local_chunk``, a rule that reads no sp size)."""
    return cast(int, SequenceLayout(sp=ring, ring=ring, chunk_size=chunk_size).local_chunk(local_len))


def global_index(
    local_len: int,
    *,
    rank: int,
    world: int,
    chunk_size: int | None,
    ring: int = 1,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``(local_len,)`` global token index of each of rank ``rank``'s tokens in the layout, at the chunk of a
    shard of ``local_len`` tokens (:func:`local_chunk`): the inverse of :func:`shard_sequence` on ``arange(N)``,
    computed without a collective."""
    layout = SequenceLayout(sp=world, ring=ring, chunk_size=chunk_size).for_local(local_len)
    return layout.global_index(local_len, rank, device)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document ids ``(b, N)`` from the GLOBAL position ids ``(b, N)`` of whole sequences: a position 0
    after the first token starts a new document (packed sequences). ``None`` when no row packs more than
    one document (nothing to mask)."""
    starts = position_ids == 0
    starts[:, 0] = True
    if not bool(starts[:, 1:].any()):
        return None
    return torch.cumsum(starts.to(torch.int32), dim=1)


def shard_sequence(
    x: torch.Tensor, *, group: Group = None, dim: int = 1, chunk_size: int | None = None, ring: int = 1
) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (length N) in the chosen layout; N must divide
    (``N % P == 0``, ``N % (P*chunk_size) == 0`` for the FPDT layout, ``N % 2P == 0`` with a ring,
    ``N % (2P*chunk_size) == 0`` with both)."""
    rank, _ = group_rank_size(group)
    return _layout(group, chunk_size, ring).shard(x, rank, dim)


def gather_sequence(
    x: torch.Tensor, *, group: Group = None, dim: int = 1, chunk_size: int | None = None, ring: int = 1
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence on every rank (no autograd)."""
    return _layout(group, chunk_size, ring).gather(x, group, dim)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``(b, s)`` targets aligned with the logits: ``shift[t] = labels[t+1]``, the last is ``ignore_index``.

    Done on the WHOLE sequence before it is cut, so no target is lost at a shard edge."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)


def _pad(x: torch.Tensor, pad: int, value: int | float) -> torch.Tensor:
    if pad == 0:
        return x
    return torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), value)], dim=1)


def _check_padding_mask(mask: torch.Tensor, shape: torch.Size) -> None:
    if mask.dim() != 2:
        raise ValueError(
            f"attention_mask has {mask.dim()} dims (shape {tuple(mask.shape)}); only a 2-D padding mask "
            "(batch, seq) is supported under sequence parallelism. For packed sequences pass position_ids "
            "that restart at 0 per document instead of a 4-D mask"
        )
    if mask.shape != shape:
        raise ValueError(
            f"attention_mask shape {tuple(mask.shape)} differs from input_ids shape {tuple(shape)}"
        )
    m = mask.to(torch.int8)
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError(
            "attention_mask has a 0 before a 1 (left padding or holes); sequence-parallel attention is causal "
            "and supports only right padding. Pad on the right (tokenizer.padding_side='right') or pack "
            "documents with position_ids that restart at 0"
        )


def _padded_positions(pos: torch.Tensor | None, ids: torch.Tensor, pad: int) -> torch.Tensor:
    """``(b, N + pad)`` global positions: the batch's (``arange(N)`` when absent), continued over the pads."""
    b, n = ids.shape
    if pos is None:
        pos = torch.arange(n, device=ids.device).expand(b, n)
    if pad:
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
    return pos


def global_positions(
    batch: Mapping[str, Any], *, group: Group = None, chunk_size: int | None = None, ring: int = 1
) -> torch.Tensor:
    """``(b, N_pad)`` the GLOBAL position ids of a whole (unsharded) batch in sequence order, padded as
    :func:`shard_batch` pads it: what every rank's shard of ``position_ids`` comes from. Its
    :func:`document_ids` are the batch's packed documents, known here without a collective."""
    ids = batch["input_ids"]
    pad = -ids.shape[1] % _layout(group, chunk_size, ring).multiple
    return _padded_positions(batch.get("position_ids"), ids, pad)


def shard_batch(
    batch: Mapping[str, Any],
    *,
    group: Group = None,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    pad_token_id: int = 0,
    ring: int = 1,
) -> dict[str, Any]:
    """This rank's slice of a batch dict, with labels shifted BEFORE slicing and global positions.

    Input keys (all ``(b, N)``): ``input_ids`` (required), optional ``labels``, ``shift_labels``,
    ``position_ids``, ``attention_mask`` (2-D, right padding only), ``token_type_ids``. Other keys pass
    through untouched.

    Returns the same keys sharded to ``(b, N_pad/P)`` plus ``position_ids`` (GLOBAL; ``arange(N)`` when
    absent) and, when labels were given, ``shift_labels`` with ``shift[t] = labels[t+1]`` and the last
    token ``ignore_index`` — so no target is lost at a shard edge. ``labels`` then holds the same
    pre-shifted shard (HF computes a loss only when ``labels`` is given and uses ``shift_labels``).

    ``ring`` > 1: the 2-D Ulysses x ring layout (``parallel/layout.py``; ``group`` is the whole sp group, ranks in
    ``s = j*U + u`` order, as the world mesh's flattened sp axis).

    Lengths that don't divide are padded at the END to a multiple of ``P`` (``P*chunk_size`` in the FPDT
    layout, ``2P`` with a ring): ``input_ids`` with ``pad_token_id``, labels with ``ignore_index``, positions continue,
    ``attention_mask`` with 0. Causal attention keeps pads from changing any real token's output.
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        keys = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"sequence parallelism needs a dict batch with 'input_ids' of shape (batch, seq); got {keys}. "
            "Return a dict from your dataset/collate_fn (inputs_embeds is not supported)"
        )
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, seq) tensor, got {getattr(ids, 'shape', type(ids))}")
    layout = _layout(group, chunk_size, ring)  # at exactly chunk_size: a shorter sequence pads up to it
    pad = -ids.shape[1] % layout.multiple

    seqs: dict[str, torch.Tensor] = {}
    for key in SEQUENCE_KEYS:
        val = batch.get(key)
        if val is None:
            continue
        if key == "attention_mask":
            _check_padding_mask(val, ids.shape)
        elif not isinstance(val, torch.Tensor) or val.shape[:2] != ids.shape:
            raise ValueError(
                f"{key} shape {tuple(getattr(val, 'shape', ()))} differs from input_ids shape {tuple(ids.shape)}"
            )
        seqs[key] = val

    if "shift_labels" not in seqs and "labels" in seqs:
        seqs["shift_labels"] = shift_labels(seqs["labels"], ignore_index)
    if "shift_labels" in seqs:
        seqs["labels"] = seqs["shift_labels"]
    if pad and "attention_mask" not in seqs:
        # the pads must be known as pads to whatever counts tokens inside the model (an MoE router's
        # load-balancing statistics); attention itself is causal and never sees them from a real token
        seqs["attention_mask"] = torch.ones_like(ids)
    seqs["position_ids"] = _padded_positions(seqs.get("position_ids"), ids, pad)

    pad_value = {"input_ids": pad_token_id, "labels": ignore_index, "shift_labels": ignore_index}
    rank, _ = group_rank_size(group)
    out = dict(batch)
    for key, val in seqs.items():
        if key != "position_ids":
            val = _pad(val, pad, pad_value.get(key, 0))
        out[key] = layout.shard(val, rank, dim=1)
    return out
