"""Shape rules, masks and small helpers shared by every attention path (kernels, Ulysses, FPDT).

Layout ``bshd`` = (batch, seq, heads, head_dim) throughout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_longctx.parallel.comm import Group, group_rank_size, head_split
from lightning_longctx.parallel.sharding import document_ids


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


def documents_of(
    position_ids: torch.Tensor | None,
    documents: torch.Tensor | None,
    *,
    shape: tuple[int, int],
    gather: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | None:
    """Document ids ``(b, N)`` of the whole sequence in global order, or ``None`` (one document per row).

    ``documents`` (``sharding.document_ids(sharding.global_positions(batch))``, what the strategy and the
    model hooks hand down once per batch) is used as given; otherwise they come from this rank's GLOBAL
    ``position_ids`` ``(b, s/P)``: ``gather`` builds the ``(b, N)`` positions, one collective per call.
    ``shape`` is ``(b, N)``. Nothing is remembered between calls."""
    if documents is not None:
        if tuple(documents.shape) != shape:
            raise ValueError(
                f"documents shape {tuple(documents.shape)} must be (batch, whole sequence) = {shape}: the document ids "
                "of the WHOLE sequence in global order (sharding.document_ids(sharding.global_positions(batch)))"
            )
        return documents
    if position_ids is None:
        return None
    return document_ids(gather(position_ids))


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


def kv_repeat_factor(num_heads: int, kv_heads: int, world: int) -> int:
    """Copies of each kv head :func:`spread_kv_heads` makes for ``world`` ranks (the planner counts them
    too): ``P // gcd(h_kv, P)`` when ``h % lcm(h_kv, P) == 0``, else ``h // h_kv`` (one per query head)."""
    if num_heads % world == 0 and num_heads % math.lcm(kv_heads, world) == 0:
        return world // math.gcd(kv_heads, world)
    return num_heads // kv_heads


def spread_kv_heads(
    k: torch.Tensor, v: torch.Tensor, num_heads: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the kv heads splittable over ``world`` ranks consistently with the query heads.

    With ``h % lcm(h_kv, P) == 0`` each kv head is repeated ``P // gcd(h_kv, P)`` times
    (``repeat_interleave``: copies stay next to their original, so query head i still maps to a copy
    of kv head ``i // (h / h_kv)``); otherwise (uneven head split) kv is expanded to ``h`` heads.
    """
    f = kv_repeat_factor(num_heads, k.shape[2], world)
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
