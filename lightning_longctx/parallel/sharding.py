"""Cut a batch into this rank's piece of the sequence, and put pieces back together.

Two layouts of a global sequence of N tokens over P ranks:

* contiguous (``chunk_size=None``, Ulysses): rank r holds tokens ``[r*N/P, (r+1)*N/P)``.
* FPDT (``chunk_size=c``): the sequence is cut into chunks of c tokens and rank r holds chunks
  ``r, r+P, r+2P, ...`` in that order, so that after the all-to-all of its i-th local chunk every
  rank holds the contiguous global segment i (``P*c`` tokens).
* 2-D, Ulysses x ring (``ring=r > 1``, ``U = P / r``): the sequence is cut into ``2r`` chunks, ring rank j
  holds chunks j and ``2r-1-j`` (zigzag: equal causal work) and sp rank ``s = j*U + u`` holds piece u of U
  equal pieces of them (``attention/ring.py``'s ``RingLayout.sp_shard``), so the Ulysses all-to-all gives
  ring rank j its two chunks in order.
* 2-D with FPDT chunks (``ring=r > 1`` and ``chunk_size=c``): ring rank j's ``N/r`` tokens (its two zigzag
  chunks, in order) are laid out over its U Ulysses ranks as FPDT lays a sequence out over P ranks: cut
  into segments of ``U*c`` tokens, sp rank ``(j, u)`` holds chunk u of each. ``N % (2*P*c) == 0``, so no
  segment straddles the two zigzag chunks: every local chunk is a run of c consecutive global tokens.
  Without ``chunk_size`` this is the same layout with one segment (``c = N/P``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_longctx.parallel.comm import Group, all_gather_no_grad, group_rank_size

#: The label of a token that is not trained on (PyTorch's and Hugging Face's convention).
IGNORE_INDEX = -100

#: Keys of a batch dict that carry a sequence dimension (dim 1) and are sharded.
SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "token_type_ids")


def _segment(n: int, world: int, chunk_size: int | None) -> int:
    """Tokens per layout segment: ``chunk_size``, or the whole local shard (contiguous layout)."""
    if chunk_size is None:
        if n % world:
            raise ValueError(
                f"sequence length {n} is not divisible by the sequence-parallel size {world}; "
                "pad it to a multiple of it (shard_batch does this for you)"
            )
        return n // world
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if n % (world * chunk_size):
        raise ValueError(
            f"sequence length {n} is not divisible by sequence-parallel size x chunk_size = "
            f"{world} x {chunk_size} = {world * chunk_size}; pad the sequence (shard_batch does) "
            "or pick a chunk_size that divides the local length"
        )
    return chunk_size


def chunk_for(seq_len: int, world: int, chunk_size: int | None, ring: int = 1) -> int | None:
    """Tokens per FPDT chunk per rank for a global sequence of ``seq_len`` tokens over ``world`` ranks:
    ``chunk_size``, or one chunk of the local length for a sequence shorter than ``world * chunk_size``
    (half of it with a ring: a chunk never straddles the two zigzag chunks of a ring rank) (``None``: the
    contiguous layout). The one place this rule lives."""
    if chunk_size is None:
        return None
    per = world * (2 if ring > 1 else 1)
    return min(chunk_size, -(-seq_len // per))


def local_chunk(chunk_size: int, local_len: int, ring: int = 1) -> int:
    """The chunk of a rank holding ``local_len`` tokens of a sequence laid out by :func:`chunk_for` (the same
    rule, seen from the local length that ``shard_batch`` produced)."""
    return min(chunk_size, local_len // 2 if ring > 1 else local_len)


def _ring_index(
    n: int, world: int, ring: int, chunk_size: int | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """``(world, n / world)``: the global index of every sp rank's tokens in the 2-D layout (module doc)."""
    c = n // world if chunk_size is None else chunk_size
    if n % (2 * world) or (chunk_size is not None and n % (2 * world * chunk_size)):
        unit = 2 * world if chunk_size is None else 2 * world * chunk_size
        raise ValueError(
            f"sequence length {n} is not divisible by {unit} (ring_size={ring}: 2 x {ring} zigzag chunks, each "
            f"ring rank's split over {world // ring} Ulysses ranks"
            + ("" if chunk_size is None else f" in FPDT chunks of {chunk_size}")
            + "); pad the sequence (shard_batch does)"
        )
    z = n // (2 * ring)
    j = torch.arange(ring, device=device)[:, None]
    t = torch.arange(z, device=device)
    per_ring = torch.cat([j * z + t, (2 * ring - 1 - j) * z + t], dim=1)  # (r, 2z): chunks j and 2r-1-j
    # (r, K, U, c) segments of U*c tokens, chunk u of each to Ulysses rank u: sp rank j * U + u
    pieces = per_ring.reshape(ring, -1, world // ring, c).transpose(1, 2)
    return pieces.reshape(world, n // world)


def _check_ring(ring: int, world: int) -> None:
    if ring < 1 or world % ring:
        raise ValueError(f"ring={ring} must be a positive divisor of the sequence-parallel size {world}")


def global_index(
    local_len: int,
    *,
    rank: int,
    world: int,
    chunk_size: int | None,
    ring: int = 1,
    device: torch.device | None = None,
) -> torch.Tensor:
    """``(local_len,)`` global token index of each of rank ``rank``'s tokens in the layout (the inverse of
    :func:`shard_sequence` on ``arange(N)``, computed without a collective)."""
    _check_ring(ring, world)
    if ring > 1:
        c = None if chunk_size is None else local_chunk(chunk_size, local_len, ring)
        return _ring_index(local_len * world, world, ring, c, device)[rank]
    t = torch.arange(local_len, device=device)
    if chunk_size is None:
        return rank * local_len + t
    c = local_chunk(chunk_size, local_len)  # rank r holds chunks r, r+P, ... of c tokens
    return (t // c * world + rank) * c + t % c


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
    rank, world = group_rank_size(group)
    dim = dim % x.dim()
    n = x.shape[dim]
    _check_ring(ring, world)
    if ring > 1:
        return x.index_select(dim, _ring_index(n, world, ring, chunk_size, x.device)[rank])
    seg = _segment(n, world, chunk_size)
    parts = x.unflatten(dim, (n // (world * seg), world, seg))  # (..., u, P, seg, ...)
    return parts.select(dim + 1, rank).flatten(dim, dim + 1).contiguous()


def gather_sequence(
    x: torch.Tensor, *, group: Group = None, dim: int = 1, chunk_size: int | None = None, ring: int = 1
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence on every rank (no autograd)."""
    _, world = group_rank_size(group)
    dim = dim % x.dim()
    local = x.shape[dim]
    _check_ring(ring, world)
    if ring > 1:  # the ranks' shards in rank order, then each token to its global index
        stacked = all_gather_no_grad(x, group, dim=dim)  # (..., P * local, ...)
        index = _ring_index(local * world, world, ring, chunk_size, x.device).flatten()
        return torch.empty_like(stacked).index_copy_(dim, index, stacked)
    seg = local if chunk_size is None else chunk_size
    if local % seg:
        raise ValueError(f"local length {local} is not a multiple of chunk_size {seg}")
    stacked = all_gather_no_grad(x.unsqueeze(dim), group, dim=dim)  # (..., P, local, ...)
    parts = stacked.unflatten(dim + 1, (local // seg, seg)).transpose(dim, dim + 1)  # (..., u, P, seg, ...)
    return parts.flatten(dim, dim + 2).contiguous()


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


def _pad_length(n: int, group: Group, chunk_size: int | None, ring: int = 1) -> int:
    """Tokens ``shard_batch`` appends to a sequence of ``n``: up to a multiple of ``P`` (``P * chunk``; ``2P``
    with a ring: its 2r zigzag chunks, each ring rank's split over U)."""
    _, world = group_rank_size(group)
    return -n % (world * (chunk_size or 1) * (2 if ring > 1 else 1))


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
    return _padded_positions(
        batch.get("position_ids"), ids, _pad_length(ids.shape[1], group, chunk_size, ring)
    )


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

    ``ring`` > 1: the 2-D Ulysses x ring layout (module doc; ``group`` is the whole sp group, ranks in
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
    pad = _pad_length(ids.shape[1], group, chunk_size, ring)

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
    out = dict(batch)
    for key, val in seqs.items():
        if key != "position_ids":
            val = _pad(val, pad, pad_value.get(key, 0))
        out[key] = shard_sequence(val, group=group, dim=1, chunk_size=chunk_size, ring=ring)
    return out
