"""Ulysses sequence-parallel attention (DeepSpeed-Ulysses, arXiv 2309.14509).

Each of the P ranks of ``group`` holds a contiguous 1/P of the sequence. One all-to-all turns
"my tokens, all heads" into "all tokens, my heads", the local kernel attends over the whole
sequence, and a second all-to-all turns the result back.
"""

from __future__ import annotations

import math

import torch

from lightning_longctx.attention.kernels import MaskSpec, default_scale, doc_ids, has_resets, resolve_backend
from lightning_longctx.comm import Group, all_gather_no_grad, group_rank_size, head_to_seq, seq_to_head


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


def global_mask(
    position_ids: torch.Tensor | None, *, causal: bool, sliding_window: int | None, group: Group
) -> MaskSpec:
    """The mask of the gathered sequence; ``position_ids`` ``(b, s/P)`` are GLOBAL, contiguous layout."""
    docs = None
    if position_ids is not None:
        full = all_gather_no_grad(position_ids, group, dim=1)  # (b, N), rank order = sequence order
        if has_resets(full):
            docs = doc_ids(full)
    return MaskSpec(causal=causal, sliding_window=sliding_window, q_doc=docs, k_doc=docs)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    position_ids: torch.Tensor | None = None,
    backend: str = "auto",
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded contiguously over ``group``.

    Args:
        q: ``(b, s/P, h, d)`` local queries (rank r holds tokens ``[r*s/P, (r+1)*s/P)``).
        k, v: ``(b, s/P, h_kv, d)``; ``h % h_kv == 0``. Any ``h`` works with any P (uneven split).
        position_ids: ``(b, s/P)`` GLOBAL positions; a reset to 0 starts a new packed document and
            attention never crosses documents. ``None``: one document.
        sliding_window: attend only to the last ``sliding_window`` tokens (incl. itself), as HF.
        softcap: tanh logit soft-capping (Gemma-2 style); needs a kernel that applies it.

    Returns:
        ``(b, s/P, h, d)``, equal to full attention over the gathered sequence.
    """
    check_qkv(q, k, v)
    _, world = group_rank_size(group)
    kernel = resolve_backend(backend, softcap=softcap)
    h = q.shape[2]
    k, v = spread_kv_heads(k, v, h, world)
    mask = global_mask(position_ids, causal=causal, sliding_window=sliding_window, group=group)
    q_h, k_h, v_h = (seq_to_head(x, group) for x in (q, k, v))  # (b, s, h_r, d): all tokens, my heads
    out_h, _ = kernel.fn(
        q_h, k_h, v_h, scale=default_scale(q.shape[-1], softmax_scale), mask=mask, softcap=softcap
    )
    return head_to_seq(out_h, h, group)  # (b, s/P, h, d)
