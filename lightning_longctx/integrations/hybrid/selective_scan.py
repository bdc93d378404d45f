"""Mamba-1 selective scan (``mamba_selective_scan``: Mamba, Falcon-Mamba, Jamba) across ranks by state passing,
with a closed-form correction because the scan takes no entry state.

The state ``h`` ``(b, d, n)`` is diagonal: ``h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t x_t B_tᵀ`` (``A`` ``(d, n)``,
``Δ_t = softplus(dt_t + delta_bias)`` ``(d,)``, ``x_t`` ``(d,)``, ``B_t``/``C_t`` ``(n,)``), ``y_t = h_t C_t + D x_t``,
then ``y_t · silu(z_t)``. A segment entered with state ``S_in`` therefore has

- ``S_out = M ⊙ S_in + B_r`` with ``M = exp(A · ΣΔ)`` and ``B_r = Σ_t exp(A · Σ_{s>t} Δ_s) ⊙ Δ_t x_t B_tᵀ`` (the
  final state from zero),
- ``y_t = y⁰_t + (exp(A · Σ_{s≤t} Δ_s) ⊙ S_in) C_t``: the model's own scan from zero plus a correction that
  enters before the ``silu(z)`` gate, so the scan is called with ``z=None`` and the gate applied after.

Neither the torch fallback nor mamba-ssm's ``selective_scan_fn`` takes an entry state, and mamba-ssm's backward
drops the gradient of its ``last_state``; so ``B_r`` and the correction are computed here in closed form
(exact, not a truncation), :func:`~lightning_longctx.parallel.comm.exclusive_affine_scan` gives each segment ``S_in``
(``M`` diagonal: ``apply`` is ``torch.mul``), and autograd runs through everything (``dt``, ``delta_bias``,
``A``, ``x``, ``B``, ``C``). Every exponent is ``A`` (< 0) times a non-negative sum of ``Δ`` taken from the end
that matters (prefix sums for the correction, suffix sums for ``B_r``), so nothing overflows and no
decay is a difference of two large sums.

Packed documents (:class:`~lightning_longctx.integrations.hybrid.base.Documents`): the scan runs on the
document pieces of the segments, each behind zeros (``x = 0``: the zero state stays zero); ``B_r`` sums the
last piece's tokens only, ``M = 0`` for a segment holding a document start, and the correction reads ``C_t``
of the first piece of a segment that continues a document only.

Shapes: ``hidden_states``/``dt``/``z`` ``(b, d, s/P)``, ``B``/``C`` ``(b, n, s/P)``. Cost: two elementwise passes
over ``(u*b, d, n, c)`` (what the torch fallback already materialises several times), in time blocks of
at most :data:`_BLOCK_ELEMENTS` recomputed in backward, so the extra activation memory stays bounded when
the scan is mamba-ssm's kernel; one all-gather of ``2*u*b*d*n`` float32 per rank forward, half that
backward. The fused ``mamba_inner_fn`` (conv + scan + projections in one kernel) is switched off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_longctx.integrations.hybrid.base import MixerCall, from_segments, to_segments

#: Largest ``(segments, d, n, tokens)`` block of decays the closed forms materialise at once (float32).
_BLOCK_ELEMENTS = 1 << 24


def _final_from_zero(
    A: torch.Tensor, ahead: torch.Tensor, dtx: torch.Tensor, B: torch.Tensor
) -> torch.Tensor:
    """``Σ_t exp(A · ahead_t) ⊙ (Δx)_t B_tᵀ`` over a block: ``(N, d, n)``; ``ahead`` ``(N, d, T)``: the Δ still to
    come after token t within its segment."""
    decay = torch.exp(A[:, :, None] * ahead[:, :, None, :])  # (N, d, n, T)
    return torch.einsum("xdnt,xdt,xnt->xdn", decay, dtx, B)


def _entry_response(A: torch.Tensor, elapsed: torch.Tensor, C: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``(exp(A · elapsed_t) ⊙ S) C_t`` over a block: ``(N, d, T)``; ``elapsed`` ``(N, d, T)``: Δ summed from the
    segment start through token t."""
    decay = torch.exp(A[:, :, None] * elapsed[:, :, None, :])  # (N, d, n, T)
    return torch.einsum("xdnt,xdn,xnt->xdt", decay, S, C)


def _blocked(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    # The decay block is the large tensor: recompute it in backward instead of keeping it alive.
    if torch.is_grad_enabled() and any(a.requires_grad for a in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _refuse_unadapted(
    sp: MixerCall,
    return_last_state: bool,
    kwargs: dict[str, Any],
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
) -> None:
    """The selective-scan calls the adapter cannot make exact, refused by name."""
    if return_last_state:  # the mixers ask for it only to fill a cache; the global state is not this rank's
        sp.refuse("its selective scan with its final state out (a cache)")
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        sp.refuse("its selective scan with packed-sequence indices (seq_idx / cu_seqlens)")
    if B.dim() != 3 or C.dim() != 3 or A.is_complex():
        sp.refuse("its selective scan with grouped or complex B/C/A (only real (b, n, l) B/C are adapted)")


def _scan_delta(dts: torch.Tensor, delta_bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    """Δ as the scan sees it, in float32 as mamba-ssm's kernel computes it (the torch fallback computes it in
    dt's dtype: the same for float32 models, within bf16 rounding of it otherwise)."""
    delta = dts.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[:, None]
    return F.softplus(delta) if softplus else delta


def selective_scan(
    sp: MixerCall,
    original: Callable[..., Any],
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """``hidden_states``/``dt``/``z`` ``(b, d, s/P)``, ``A`` ``(d, n)``, ``B``/``C`` ``(b, n, s/P)``, ``D``/``delta_bias``
    ``(d,)``; returns ``(b, d, s/P)``, as the model's function does."""
    _refuse_unadapted(sp, return_last_state, kwargs, A, B, C)
    local = hidden_states.shape[-1]
    c = sp.check(local)
    u = local // c
    docs = sp.documents(local, hidden_states.shape[0], 0, hidden_states.device)
    x, dts, Bs, Cs = (to_segments(t, 2, c) for t in (hidden_states, dt, B, C))  # (u*b, ., c)
    # packed: one row per document piece behind zeros (x = 0 keeps the zero state zero)
    pieces = (x, dts, Bs, Cs) if docs is None else tuple(docs.gather(t, 2) for t in (x, dts, Bs, Cs))

    # The local scans from zero: the model's own function (mamba-ssm kernel or torch fallback), gate held back.
    out = original(
        pieces[0],
        pieces[1],
        A,
        *pieces[2:],
        D=D,
        z=None,
        delta_bias=delta_bias,
        delta_softplus=delta_softplus,
        return_last_state=False,
        **kwargs,
    )
    if docs is not None:
        out = docs.scatter(out, 2)

    delta = _scan_delta(dts, delta_bias, delta_softplus)
    A32 = A.float()
    n_seg, d, _ = delta.shape
    n = A32.shape[-1]
    step = max(1, min(c, _BLOCK_ELEMENTS // max(1, n_seg * d * n)))
    blocks = [slice(s, min(s + step, c)) for s in range(0, c, step)]

    # Suffix sums built from the segment end (not total minus prefix): exact where the decay is not negligible.
    suffix = delta.flip(-1).cumsum(-1).flip(-1)  # Σ_{s≥t} Δ_s
    ahead = torch.cat([suffix[..., 1:], torch.zeros_like(suffix[..., :1])], dim=-1)  # Σ_{s>t} Δ_s
    dtx = delta * x.float()
    B32, C32 = Bs.float(), Cs.float()
    if docs is not None:  # the exit state holds the last piece only; a document start stops the entry state
        dtx = dtx * docs.final[:, None]
    final = sum(_blocked(_final_from_zero, A32, ahead[..., k], dtx[..., k], B32[..., k]) for k in blocks)
    M = torch.exp(A32 * suffix[..., 0, None])  # (u*b, d, n)
    if docs is not None:
        M = M * ~docs.restarts[:, None, None]
        C32 = C32 * docs.entry[:, None]  # the entry state reaches only a first piece that continues
    S = sp.exclusive_affine_scan(M.unflatten(0, (u, -1)), final.unflatten(0, (u, -1)), torch.mul, local)

    elapsed = delta.cumsum(-1)  # Σ_{s≤t} Δ_s
    S = S.flatten(0, 1)
    correction = torch.cat(
        [_blocked(_entry_response, A32, elapsed[..., k], C32[..., k], S) for k in blocks], -1
    )
    y = out.float() + correction
    if z is not None:  # the gate the model's function would have applied, after the entry-state term
        y = y * F.silu(to_segments(z, 2, c))
    return from_segments(y.to(out.dtype), 2, u)


PACKED = True
ADAPTERS = {"mamba_selective_scan": selective_scan}
#: mamba-ssm's fused conv + scan + projections: returns None without the kernel; the mixers then take the
#: unfused path (conv1d and scan as separate adapted calls).
FUSED_OFF = {"mamba_inner_fn"}
#: Single-token decoding against a cached state.
REFUSED = {"mamba_selective_state_update", "causal_conv1d_update"}
