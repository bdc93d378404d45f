"""Mamba-2 SSD (``mamba2_chunk_scan``: Mamba-2, Bamba, Falcon-H1, Granite-4 hybrid, Nemotron-H, Zamba2) across
ranks by state passing.

Per head the state ``S`` ``(p, n)`` evolves as ``S_t = a_t S_{t-1} + Δ_t x_t B_tᵀ`` with a *scalar* decay
``a_t = exp(A Δ_t)`` and ``y_t = S_t C_t + D x_t`` (``Δ_t = clamp(softplus(dt_t + dt_bias))``). So a segment
is affine in its entry state with a scalar ``M = exp(A ΣΔ)``: ``S_out = M S_in + B`` and
``y_t = y⁰_t + exp(A cumΔ_t) S_in C_t``, where ``y⁰`` and ``B`` (the final state) come from one call of the
model's own function from a zero entry state, and ``M`` and the decay ``exp(A cumΔ_t)`` in closed form from
``dt`` (the same discretisation as the kernel: bias, softplus, clamp, in float32). ``D x`` lives in ``y⁰``
only, so it is counted once. :func:`~lightning_longctx.parallel.comm.exclusive_affine_scan` (broadcast product: ``M``
is a scalar per head) gives each segment its ``S_in``. Autograd runs through the model's function and the
closed form; the scan's backward carries the state gradients across ranks.

Packed documents (:class:`~lightning_longctx.integrations.hybrid.base.Documents`): the model's function runs
on the document pieces of the segments, each behind zeros (``x = 0``: the zero state stays zero), so ``y⁰``
is every piece's output alone and the last piece's final state is the segment's ``B``. ``M = 0`` for a
segment holding a document start, and the correction reaches only the first piece of a segment that
continues a document (``exp(-inf) = 0`` elsewhere, with no gradient).

Why not identity rows (``x`` extended by ``n`` zero columns per head, entry state ``[0; I_n]``): exact too,
but it runs the whole SSD on ``p + n`` columns instead of ``p`` (3x for Mamba-2's p=64, n=128) and returns
the decay coefficients in the output dtype (bf16 under mixed precision); the closed form adds
``O(c·h·n)`` elementwise work and one ``c·h·p·n`` contraction, kept in float32.

Shapes: ``hidden_states`` ``(b, s/P, h, p)``, ``dt`` ``(b, s/P, h)``, ``B``/``C`` ``(b, s/P, g, n)``; the
summary all-gathered is ``h·(1 + p·n)`` floats per segment and row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lightning_longctx.integrations.hybrid.base import MixerCall, from_segments, to_segments


def _log_decay(
    dt: torch.Tensor,
    A: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """``A·cumΔ_t`` per segment, ``dt`` ``(N, c, h)`` -> ``(N, c, h)`` float32: the kernel's discretisation
    (mamba-ssm's and the torch fallback's: bias, softplus with threshold 20, clamp to ``dt_limit``)."""
    delta = dt.float()
    if dt_bias is not None:
        delta = delta + dt_bias.float()
    if dt_softplus:
        delta = F.softplus(delta)
    delta = delta.clamp(min=dt_limit[0], max=dt_limit[1])
    return torch.cumsum(A.float() * delta, dim=1)


def chunk_scan(
    sp: MixerCall,
    original: Callable[..., Any],
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """``hidden_states`` ``(b, s/P, h, p)``, ``dt`` ``(b, s/P, h)``, ``A`` ``(h,)``, ``B``/``C``
    ``(b, s/P, g, n)``; returns ``(b, s/P, h, p)``."""
    if initial_states is not None or return_final_states or kwargs.get("return_varlen_states"):
        sp.refuse("its Mamba-2 scan with a recurrent state in or out (a cache)")
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        sp.refuse("its Mamba-2 scan with packed-sequence indices (seq_idx / cu_seqlens)")
    if z is not None:
        # The gate multiplies after the state term, so the correction would have to go inside it, and the
        # torch fallback drops ``z`` while mamba-ssm applies it: there is no one reference to match. No
        # mixer of transformers 5.24 passes one.
        sp.refuse("its Mamba-2 scan with a fused output gate (z)")
    local = hidden_states.shape[1]
    c = sp.check(local)
    u = local // c
    docs = sp.documents(local, hidden_states.shape[0], 0, hidden_states.device)
    x, dt, B, C = (to_segments(t, 1, c) for t in (hidden_states, dt, B, C))  # (N = u*b, c, ...)
    # packed: one row per document piece behind zeros (x = 0 keeps the zero state zero)
    pieces = (x, dt, B, C) if docs is None else tuple(docs.gather(t, 1) for t in (x, dt, B, C))
    y0, final = original(  # from a zero entry state: y⁰ (with D x) and B (the final state, fp32)
        *pieces[:2],
        A,
        *pieces[2:],
        chunk_size,
        D=D,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        return_final_states=True,
        **kwargs,
    )
    n_seg, _, heads, p = x.shape
    groups, n = C.shape[-2:]
    log_decay = _log_decay(dt, A, dt_bias, dt_softplus, dt_limit)  # (N, c, h)
    M = torch.exp(log_decay[:, -1])  # (N, h): the segment's decay of its entry state
    if docs is not None:  # the exit state is the last piece's; a document start stops the entry state
        y0, final = docs.scatter(y0, 1), final[docs.last]
        M = M * ~docs.restarts[:, None]
        log_decay = log_decay.masked_fill(
            ~docs.entry[..., None], float("-inf")
        )  # no entry state after a start
    S = sp.exclusive_affine_scan(
        M.view(u, -1, heads, 1, 1), final.float().unflatten(0, (u, -1)), torch.mul, local
    ).flatten(0, 1)  # (N, h, p, n)
    # S_in C_t per head, contracted per group (heads of a group share C) so C is never repeated to h heads
    readout = torch.einsum("xlgn,xgkpn->xlgkp", C.float(), S.view(n_seg, groups, heads // groups, p, n))
    correction = readout.reshape(n_seg, c, heads, p) * torch.exp(log_decay)[..., None]
    return from_segments(y0 + correction.to(y0.dtype), 1, u)


PACKED = True
ADAPTERS = {"mamba2_chunk_scan": chunk_scan}
#: The fused conv + scan + gated norm + out-projection kernel cannot take a halo nor an entry state; without
#: it (the torch fallback returns None) every mixer takes its unfused conv -> chunk-scan path.
FUSED_OFF = {"mamba2_split_conv1d_scan_combined"}
#: One-token decoding against a cached state.
REFUSED = {"mamba2_selective_state_update"}
