"""Local (single-device) attention kernels behind one signature, chosen from a dict.

All kernels take ``bshd`` tensors: q ``(b, s_q, h, d)``, k/v ``(b, s_k, h_kv, d)`` with
``h % h_kv == 0`` (grouped-query attention is expanded inside the kernel) and a :class:`MaskSpec`.
They return ``(out (b, s_q, h, d), lse)`` where ``lse`` is the fp32 log-sum-exp of the scaled
scores ``(b, h, s_q)``, or ``None`` where the kernel does not give it (SDPA; flash-attn's varlen
path for packed documents). Ulysses uses ``out`` only; FPDT uses the fused kernels of ``fused.py`` and,
as their reference and fallback, the math building blocks below.

Backends: ``"flash"`` (flash-attn's public ``flash_attn_func``/``flash_attn_varlen_func``, CUDA,
optional), ``"sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``) and ``"math"`` (plain
PyTorch; the exact reference, returns the LSE, supports every mask feature). ``"auto"`` picks the
fastest available that supports what the call needs.

Attention sinks (gpt-oss ``s_aux``): one learned logit ``sink_h`` per query head joins the softmax
denominator with no value attached, ``lse_total = logaddexp(lse, sink_h)``, ``out = out_keys *
exp(lse - lse_total)``. Only ``"math"`` serves them: SDPA returns no LSE, and flash-attn's public API
returns one that autograd does not differentiate (its backward drops the LSE's gradient), so an LSE
merge on top of it would give wrong dq/dk.

``block_forward`` / ``block_backward`` are the math building blocks FPDT uses for its online
softmax: a forward that returns the LSE and the flash-attention style backward given the final
output's LSE (``dS = P * (dP - delta)``), so blocks can be recomputed one pair at a time.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lightning_longctx.attention.common import MaskSpec, compute_dtype


class AttnOut(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor | None


def _expand_kv(k: torch.Tensor, num_heads: int) -> torch.Tensor:
    if k.shape[2] == num_heads:
        return k
    return k.repeat_interleave(num_heads // k.shape[2], dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    ct = compute_dtype(q.dtype)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(ct), k.to(ct)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> AttnOut:
    """Plain PyTorch attention (differentiable through autograd); returns the LSE ``(b, h, s_q)``.

    ``sinks`` ``(h,)``: one extra logit per head of q in the softmax denominator (no value); the
    returned LSE then includes it, and autograd gives the sinks their gradient.
    Rows with no allowed key give a zero output and ``lse = -inf`` (``= sink`` with sinks)."""
    h = q.shape[2]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    s = _scores(q, k, scale, softcap)  # (b, h, sq, sk)
    allowed = mask.dense(q.shape[1], k.shape[1], q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        return _math_with_sinks(q, v, s, sinks)
    lse = torch.logsumexp(s, dim=-1)  # (b, h, sq)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(p.dtype)).to(q.dtype)
    return AttnOut(out, lse.float() if lse.dtype != torch.float64 else lse)


def _math_with_sinks(q: torch.Tensor, v: torch.Tensor, s: torch.Tensor, sinks: torch.Tensor) -> AttnOut:
    """gpt-oss's eager formula without materialising the extra column: the sink joins the max and the
    denominator. The max is detached (any constant works) and always finite, so a fully masked row
    differentiates to 0, where ``logaddexp(logsumexp(s), sink)`` would give NaN."""
    sink = sinks.to(s.dtype)[None, :, None]  # (1, h, 1)
    m = torch.maximum(s.amax(dim=-1), sink).detach()  # (b, h, sq)
    e = torch.exp(s - m[..., None])
    denom = e.sum(dim=-1) + torch.exp(sink - m)
    p = e / denom[..., None]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(p.dtype)).to(q.dtype)
    lse = m + torch.log(denom)
    return AttnOut(out, lse.float() if lse.dtype != torch.float64 else lse)


def _sinks_error(backend: str) -> ValueError:
    return ValueError(
        f"the {backend!r} backend cannot add attention sinks (it gives no differentiable log-sum-exp); "
        "use backend='math' or 'auto'"
    )


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> AttnOut:
    """``scaled_dot_product_attention``; no LSE. Packed documents use a dense boolean mask."""
    if softcap:
        raise ValueError("the 'sdpa' backend cannot apply logit softcapping; use backend='math'")
    if sinks is not None:
        raise _sinks_error("sdpa")
    h = q.shape[2]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (b, h, s, d)
    if mask.is_plain_causal(q.shape[1], k.shape[1]):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        allowed = mask.dense(q.shape[1], k.shape[1], q.device)
        attn_mask = None if allowed is None else allowed[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, scale=scale)
    return AttnOut(out.transpose(1, 2), None)


def _flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> AttnOut:
    """flash-attn (public API only). Packed documents go through ``flash_attn_varlen_func``."""
    if sinks is not None:
        raise _sinks_error("flash")
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as e:  # pragma: no cover - GPU only
        raise ImportError("backend='flash' needs flash-attn: pip install 'lightning-longctx[flash]'") from e
    if mask.q_start != mask.k_start or q.shape[1] != k.shape[1]:
        raise ValueError("backend='flash' only serves square self-attention blocks; use backend='math'")
    window = (-1, -1) if mask.sliding_window is None else (mask.sliding_window - 1, 0)
    kw = {"softmax_scale": scale, "causal": mask.causal, "window_size": window, "softcap": softcap or 0.0}
    if mask.q_doc is None:  # pragma: no cover - GPU only
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        return AttnOut(out, lse)
    # Packed documents: flatten the batch and cut at document boundaries (cu_seqlens).
    b, s, h, d = q.shape  # pragma: no cover - GPU only
    docs = mask.q_doc + (torch.arange(b, device=q.device)[:, None] * (s + 1))
    _, counts = torch.unique_consecutive(docs.flatten(), return_counts=True)
    cu = F.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)
    flat = [x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(
        *flat, cu, cu, int(counts.max()), int(counts.max()), return_attn_probs=True, **kw
    )
    return AttnOut(out.view(b, s, h, d), None)


class Kernel(NamedTuple):
    fn: Callable[..., AttnOut]
    available: Callable[[], bool]
    softcap: bool = False  # applies logit soft-capping
    sinks: bool = False  # adds attention sinks (needs an LSE that autograd differentiates)


KERNELS: dict[str, Kernel] = {
    "flash": Kernel(flash_attention, _flash_available, softcap=True),
    "sdpa": Kernel(sdpa_attention, lambda: True),
    "math": Kernel(math_attention, lambda: True, softcap=True, sinks=True),
}


def resolve_backend(backend: str, *, softcap: float | None = None, sinks: bool = False) -> Kernel:
    """The kernel for ``backend`` ("auto" | "flash" | "sdpa" | "math"); "auto" = the first available of
    flash, sdpa, math that supports the call (SDPA cannot soft-cap; only math adds sinks)."""
    if backend == "auto":
        for name in ("flash", "sdpa", "math"):
            kern = KERNELS[name]
            if kern.available() and (kern.softcap or not softcap) and (kern.sinks or not sinks):
                return kern
    if backend not in KERNELS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {['auto', *KERNELS]}")
    kern = KERNELS[backend]
    if not kern.available():
        raise RuntimeError(
            f"attention backend {backend!r} is not available here (flash needs CUDA and "
            "`pip install 'lightning-longctx[flash]'`); use backend='auto'"
        )
    if sinks and not kern.sinks:
        raise _sinks_error(backend)
    return kern


# ---- building blocks for FPDT's online softmax (no autograd: FPDT has its own backward) ----


@torch.no_grad()
def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (q block, kv block) pair: ``(out (b, s_q, h, d) in fp32/fp64, lse (b, h, s_q))``.

    One pass over the score tile, in place: the scale is folded into q, ``softcap`` turns the scores
    into ``softcap * tanh(s / softcap)`` before the mask, and the exponential is taken once
    (``p = exp(s - max)``, ``lse = max + log(sum p)``). Rows with no allowed key give 0 and -inf.
    """
    ct = compute_dtype(q.dtype)
    h = q.shape[2]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(ct) * scale, k.to(ct))  # (b, h, sq, sk)
    if softcap:
        s.div_(softcap).tanh_().mul_(softcap)
    allowed = mask.dense(q.shape[1], k.shape[1], q.device)
    if allowed is not None:
        s.masked_fill_(~allowed[:, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = m.masked_fill(torch.isinf(m), 0.0)  # fully masked rows: exp(-inf - 0) = 0
    p = s.sub_(m).exp_()
    denom = p.sum(dim=-1, keepdim=True)  # (b, h, sq, 1)
    lse = (m + torch.log(denom)).squeeze(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(ct))
    out.div_(denom.clamp_min(torch.finfo(ct).tiny).permute(0, 2, 1, 3))
    return out, lse


def merge_blocks(
    out: torch.Tensor | None, lse: torch.Tensor | None, blk_out: torch.Tensor, blk_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of a running ``(out, lse)`` with a new block (``-inf`` rows are empty).

    out: ``(b, s, h, d)`` fp32; lse: ``(b, h, s)`` fp32. Returns new tensors (no in-place writes)."""
    if out is None or lse is None:
        return blk_out, blk_lse
    new_lse = torch.logaddexp(lse, blk_lse)
    safe = new_lse.masked_fill(torch.isinf(new_lse), 0.0)
    w_old = torch.exp(lse - safe).transpose(1, 2)[..., None]  # (b, s, h, 1)
    w_blk = torch.exp(blk_lse - safe).transpose(1, 2)[..., None]
    return out * w_old + blk_out * w_blk, new_lse


def merge_sinks(
    out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold attention sinks into a row's FINAL ``(out, lse)`` over all its keys.

    out: ``(b, s, h, d)``; lse: ``(b, h, s)`` (``-inf`` rows are empty); sink: ``(h,)`` logits in the
    dtype of lse. The sink is one more softmax column with no value: ``lse_total = logaddexp(lse,
    sink)`` and ``out * exp(lse - lse_total)``. Returns new tensors ``(out, lse_total)``."""
    lse_total = torch.logaddexp(lse, sink[None, :, None])  # always finite
    return out * torch.exp(lse - lse_total).transpose(1, 2)[..., None], lse_total


def sink_grad(lse_total: torch.Tensor, delta: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Gradient ``(h,)`` of the sinks from rows with FINAL ``lse_total`` and ``delta = rowsum(dout * out)``
    ``(b, h, s)``: the sink's probability is ``exp(sink - lse_total)`` and its column carries no value,
    so ``d sink = sum over rows of p_sink * (0 - delta)``."""
    return -(torch.exp(sink[None, :, None] - lse_total) * delta).sum(dim=(0, 2))


@torch.no_grad()
def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one (q block, kv block) pair given the FINAL lse ``(b, h, s_q)`` of the queries and
    ``delta = rowsum(dout * out)`` ``(b, h, s_q)``. Returns ``dq (b, s_q, h, d)``, ``dk``/``dv``
    ``(b, s_k, h_kv, d)``, all in the compute dtype (fp32 or fp64).

    The final lse may include attention sinks (:func:`merge_sinks`): the probabilities recomputed from
    it are then the sink-aware ones, and ``dS = P * (dP - delta)`` stays exact (the sink column has no
    value, so it adds nothing to dP or delta). With ``softcap`` the scores were ``z = c * tanh(x / c)``
    of the raw scaled scores ``x``; the chain rule multiplies dS by ``dz/dx = 1 - (z / c)^2``."""
    ct = compute_dtype(q.dtype)
    h, h_kv = q.shape[2], k.shape[2]
    ke, ve = _expand_kv(k, h).to(ct), _expand_kv(v, h).to(ct)
    qs, do = q.to(ct) * scale, dout.to(ct)  # the scale folded into q: dk = ds^T (q * scale)
    p = torch.einsum("bqhd,bkhd->bhqk", qs, ke)
    dcap = None
    if softcap:
        p.div_(softcap).tanh_()
        dcap = 1 - p * p  # tanh' = 1 - tanh^2 = 1 - (z / c)^2
        p.mul_(softcap)
    allowed = mask.dense(q.shape[1], k.shape[1], q.device)
    if allowed is not None:
        p.masked_fill_(~allowed[:, None], float("-inf"))
    p.sub_(lse.masked_fill(torch.isinf(lse), float("inf"))[..., None].to(ct)).exp_()  # probabilities
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    ds = torch.einsum("bqhd,bkhd->bhqk", do, ve).sub_(delta[..., None].to(ct)).mul_(p)
    if dcap is not None:
        ds.mul_(dcap)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke).mul_(scale)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qs)
    if h != h_kv:  # sum the gradients of the query heads that share a kv head
        b, sk = k.shape[:2]
        dk = dk.view(b, sk, h_kv, h // h_kv, -1).sum(3)
        dv = dv.view(b, sk, h_kv, h // h_kv, -1).sum(3)
    return dq, dk, dv
