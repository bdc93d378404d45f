"""Chunked delta-rule linear attention (``torch_chunk_gated_delta_rule``: Qwen3-Next, Qwen3.5, OLMo-hybrid;
``chunk_kimi_delta_attention``: Kimi-Linear) across ranks by state passing.

The state ``S`` ``(heads, d_k, d_v)`` evolves as ``S_t = A_t S_{t-1} + k_t b_tᵀ`` (``A_t`` a decayed
Householder-like ``d_k x d_k`` map) and ``o_t = S_tᵀ q_t``: affine in the entry state of a segment,
``S_out = M S_in + B`` and ``o_t = o⁰_t + R_t S_in``. One call of the model's own function computes all four
(the identity-column trick): values ``[v | 0]`` (``d_k`` zero columns) from the entry state ``[0 | I]``. The
columns evolve independently, so the outputs are ``[o⁰ | R]`` and the final state ``[B | M]``; cost: ``d_k``
extra value columns. :func:`~lightning_longctx.parallel.comm.exclusive_affine_scan` then gives each segment its
``S_in``, and ``o = o⁰ + R S_in``. Autograd runs through the model's function; the scan's backward carries
the state gradients across ranks.

Packed documents (:class:`~lightning_longctx.integrations.hybrid.base.Documents`): one call on every
document piece of every segment, each right-aligned behind neutral tokens (``q = k = v = 0``, ``β = 0``,
``g = 0``: the state passes them unchanged), all from ``[0 | I]``. The segment's exit state ``B`` is its last
piece's; ``M`` is its first piece's, or 0 when a document starts in the segment; only the first piece of a
segment that continues a document adds ``R S_in``. Gradients stop at the same document starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_longctx.integrations.hybrid.base import MixerCall, from_segments, to_segments


def chunk_delta_rule(
    sp: MixerCall,
    original: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query``/``key`` ``(b, s/P, h_k, d_k)``, ``value`` ``(b, s/P, h_v, d_v)``, ``g`` ``(b, s/P, h_v)`` (or
    ``(b, s/P, h_v, d_k)`` for Kimi), ``beta`` ``(b, s/P, h_v)``; returns ``((b, s/P, h_v, d_v), None)``."""
    if initial_state is not None or output_final_state:
        sp.refuse("its delta rule with a recurrent state in or out (a cache)")
    if kwargs.get("cu_seqlens") is not None:
        sp.refuse("its delta rule with packed-sequence offsets (cu_seqlens)")
    local = query.shape[1]
    c = sp.check(local)
    u = local // c
    docs = sp.documents(local, query.shape[0], 0, query.device)
    q, k, v, g, beta = (to_segments(x, 1, c) for x in (query, key, value, g, beta))  # (u*b, c, ...)
    if docs is not None:  # one row per document piece, behind neutral zeros (β = 0, g = 0: state unchanged)
        q, k, v, g, beta = (docs.gather(x, 1) for x in (q, k, v, g, beta))
    n, length, heads, d_v = v.shape
    d_k = k.shape[-1]
    identity = torch.eye(d_k, dtype=torch.float32, device=v.device).expand(n, heads, d_k, d_k)
    entry = torch.cat([identity.new_zeros(n, heads, d_k, d_v), identity], dim=-1)  # [0 | I]
    out, final = original(
        q,
        k,
        torch.cat([v, v.new_zeros(n, length, heads, d_k)], dim=-1),  # [v | 0]
        g=g,
        beta=beta,
        chunk_size=chunk_size,
        initial_state=entry,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        **kwargs,
    )
    if docs is None:
        B, M = final[..., :d_v], final[..., d_v:]  # (N, h, d_k, d_v), (N, h, d_k, d_k)
    else:  # the exit state is the last piece's; the entry state reaches only a first piece that continues
        out = docs.scatter(out, 1)
        B = final[docs.last, ..., :d_v]
        M = final[docs.first, ..., d_v:] * (~docs.restarts).view(-1, 1, 1, 1)
    o0, R = out[..., :d_v], out[..., d_v:]  # (N, c, h, d_v), (N, c, h, d_k)
    S = sp.exclusive_affine_scan(M.unflatten(0, (u, -1)), B.unflatten(0, (u, -1)), torch.matmul, local)
    correction = torch.einsum("nchk,nhkv->nchv", R.float(), S.flatten(0, 1))
    if docs is not None:
        correction = correction * docs.entry[..., None, None]
    return from_segments(o0 + correction.to(o0.dtype), 1, u), None


PACKED = True
ADAPTERS = {"torch_chunk_gated_delta_rule": chunk_delta_rule, "chunk_kimi_delta_attention": chunk_delta_rule}
REFUSED = {"torch_recurrent_gated_delta_rule", "recurrent_kimi_delta_attention"}
