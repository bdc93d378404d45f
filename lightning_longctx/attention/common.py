"""Shape rules, masks and small helpers shared by every attention path (kernels, Ulysses, FPDT).

Layout ``bshd`` = (batch, seq, heads, head_dim) throughout.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_longctx.comm import Group, group_rank_size, head_split


@dataclass(frozen=True)
class MaskSpec:
    """Which (query, key) pairs may attend, for a block of queries against a block of keys.

    ``q_start`` / ``k_start`` are the global token indices of the first query / key of the blocks
    (causality and the sliding window compare global indices). ``q_doc`` ``(b, s_q)`` and ``k_doc``
    ``(b, s_k)`` are document ids (packed sequences): tokens attend only within their document.
    """

    causal: bool = True
    sliding_window: int | None = None
    q_start: int = 0
    k_start: int = 0
    q_doc: torch.Tensor | None = None
    k_doc: torch.Tensor | None = None

    def dense(self, s_q: int, s_k: int, device: torch.device) -> torch.Tensor | None:
        """Boolean ``(b or 1, s_q, s_k)`` mask of allowed pairs, or ``None`` when all are allowed."""
        mask = None
        if self.causal or self.sliding_window is not None:
            qi = torch.arange(self.q_start, self.q_start + s_q, device=device)[:, None]
            ki = torch.arange(self.k_start, self.k_start + s_k, device=device)[None, :]
            if self.causal and self.k_start + s_k - 1 > self.q_start:
                mask = ki <= qi
            if (
                self.sliding_window is not None
                and self.q_start + s_q - 1 - self.k_start >= self.sliding_window
            ):
                window = ki > qi - self.sliding_window
                mask = window if mask is None else mask & window
            mask = None if mask is None else mask[None]
        if self.q_doc is not None and self.k_doc is not None:
            same = self.q_doc[:, :, None] == self.k_doc[:, None, :]
            mask = same if mask is None else mask & same
        return mask

    def is_plain_causal(self, s_q: int, s_k: int) -> bool:
        """True when the mask is exactly the usual square causal mask (SDPA/flash ``is_causal``)."""
        return (
            self.causal
            and self.sliding_window is None
            and self.q_doc is None
            and self.q_start == self.k_start
            and s_q == s_k
        )


def doc_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids ``(b, s)`` from GLOBAL position ids ``(b, s)``: a position 0 after the first token
    starts a new document (packed sequences)."""
    starts = position_ids == 0
    starts[:, 0] = True
    return torch.cumsum(starts.to(torch.int32), dim=1)


def has_resets(position_ids: torch.Tensor | None) -> bool:
    """Whether ``position_ids`` packs more than one document (any 0 after the first token)."""
    return position_ids is not None and bool((position_ids[:, 1:] == 0).any())


#: ``id(root tensor) -> (weak reference to it, key, docs)``: a memo of :func:`global_docs`. Entries leave
#: with their tensor (the weak reference's callback); nothing else reads it. Not an attribute on the
#: tensor: that would travel with ``torch.save`` / pickle (and break ``weights_only`` loading).
_DOCS_MEMO: dict[int, tuple[weakref.ref, tuple, torch.Tensor | None]] = {}


def _forget(ref: weakref.ref, key: int) -> None:
    entry = _DOCS_MEMO.get(key)
    if entry is not None and entry[0] is ref:
        del _DOCS_MEMO[key]


def global_docs(
    position_ids: torch.Tensor,
    *,
    group: Group,
    layout: int | None,
    gather: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | None:
    """Document ids ``(b, N)`` of the whole sequence in global order from this rank's GLOBAL
    ``position_ids`` ``(b, s/P)``, or ``None`` when it holds one document. ``gather`` builds the
    ``(b, N)`` positions (a collective); ``layout`` names the sharding (FPDT's chunk size, None).

    Computed once per batch, not once per layer: a model passes the same tensor, or views of it such
    as ``expand``, to every layer, so the result is remembered for that tensor (its base for a view,
    held through a weak reference: the entry dies with the tensor), keyed by the view's shape, strides
    and offset, the tensor's version counter (an in-place write recomputes), the group (id, rank,
    size) and the layout. A new tensor is a new entry. Every rank of the group must hit or miss
    together — it does when all ranks run the same program on their shards (SPMD training); a rank
    that writes its position ids behind autograd's back (``.data``, numpy) would also defeat the
    version check. Inference tensors (no version counter) and tensor subclasses are never remembered."""
    root = position_ids if position_ids._base is None else position_ids._base
    cacheable = type(root) is torch.Tensor and not root.is_inference()
    key: tuple = ()
    if cacheable:
        key = (
            tuple(position_ids.shape),
            position_ids.stride(),
            position_ids.storage_offset(),
            root._version,
            layout,
            id(group),
            *group_rank_size(group),
        )
        entry = _DOCS_MEMO.get(id(root))
        if entry is not None and entry[0]() is root and entry[1] == key:
            return entry[2]
    full = gather(position_ids)  # (b, N), global order
    docs = doc_ids(full) if has_resets(full) else None
    if cacheable:
        ident = id(root)
        _DOCS_MEMO[ident] = (weakref.ref(root, lambda ref, ident=ident: _forget(ref, ident)), key, docs)
    return docs


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other dtype computes softmax statistics in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shape rules shared by the sequence-parallel attentions; errors name the value and the fix."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(
                f"{name} must be bshd (batch, seq, heads, head_dim), got {x.dim()}-D shape {tuple(x.shape)}; "
                "HF models give (b, h, s, d): transpose(1, 2) first"
            )
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(
            f"head_dim differs: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}; all three must be equal"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share (batch, local seq): self-attention only"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}) for grouped-query attention"
        )


def spread_kv_heads(
    k: torch.Tensor, v: torch.Tensor, num_heads: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the kv heads splittable over ``world`` ranks consistently with the query heads.

    With ``h % lcm(h_kv, P) == 0`` each kv head is repeated ``P // gcd(h_kv, P)`` times
    (``repeat_interleave``: copies stay next to their original, so query head i still maps to a copy
    of kv head ``i // (h / h_kv)``); otherwise (uneven head split) kv is expanded to ``h`` heads.
    """
    h_kv = k.shape[2]
    if num_heads % world == 0 and num_heads % math.lcm(h_kv, world) == 0:
        f = world // math.gcd(h_kv, world)
    else:
        f = num_heads // h_kv
    if f == 1:
        return k, v
    return k.repeat_interleave(f, dim=2), v.repeat_interleave(f, dim=2)


def check_softcap(softcap: float | None) -> None:
    """``softcap`` is ``None`` (off) or a positive cap; 0 or a negative value is a user error, not "off"."""
    if softcap is not None and not softcap > 0:
        raise ValueError(
            f"softcap must be a positive logit cap (scores become softcap * tanh(scores / softcap)), got "
            f"{softcap!r}; pass softcap=None to turn soft-capping off"
        )


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """``sinks`` is ``None`` or one float logit per GLOBAL query head, ``(h,)``, on q's device."""
    if sinks is None:
        return
    h = q.shape[2]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a tensor of shape ({h},), got {type(sinks).__name__}")
    if tuple(sinks.shape) != (h,):
        raise ValueError(
            f"sinks must have shape (num_heads,) = ({h},): one logit per GLOBAL query head, got "
            f"{tuple(sinks.shape)}; pass the attention module's whole sinks parameter (gpt-oss `s_aux`), "
            "not a per-rank slice: each rank picks the heads it owns after the all-to-all"
        )
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating-point tensor, got dtype {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(
            f"sinks is on {sinks.device} but q is on {q.device}; move it with sinks.to(q.device) (or keep the "
            "module that owns it on the same device as the activations)"
        )


def local_heads(num_heads: int, group: Group) -> slice:
    """The global query heads this rank owns after the seq->head all-to-all (``comm.head_split``)."""
    rank, world = group_rank_size(group)
    splits = head_split(num_heads, world)
    start = sum(splits[:rank])
    return slice(start, start + splits[rank])
