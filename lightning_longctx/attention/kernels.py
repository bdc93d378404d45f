"""Local (single-device) attention kernels behind one signature, chosen from a dict.

All kernels take ``bshd`` tensors: q ``(b, s_q, h, d)``, k/v ``(b, s_k, h_kv, d)`` with
``h % h_kv == 0`` (grouped-query attention is expanded inside the kernel) and a :class:`MaskSpec`.
They return ``(out (b, s_q, h, d), lse)`` where ``lse`` is the fp32 log-sum-exp of the scaled
scores ``(b, h, s_q)``, or ``None`` where the kernel does not give it (SDPA; flash-attn's varlen
path for packed documents). Ulysses uses ``out`` only; FPDT uses the math building blocks below.

Backends: ``"flash"`` (flash-attn's public ``flash_attn_func``/``flash_attn_varlen_func``, CUDA,
optional), ``"sdpa"`` (``torch.nn.functional.scaled_dot_product_attention``) and ``"math"`` (plain
PyTorch; the exact reference, returns the LSE, supports every mask feature). ``"auto"`` picks the
fastest available that supports what the call needs.

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
) -> AttnOut:
    """Plain PyTorch attention (differentiable through autograd); returns the LSE ``(b, h, s_q)``.

    Rows with no allowed key give a zero output and ``lse = -inf`` (FPDT blocks off the diagonal)."""
    h = q.shape[2]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    s = _scores(q, k, scale, softcap)  # (b, h, sq, sk)
    allowed = mask.dense(q.shape[1], k.shape[1], q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (b, h, sq)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(p.dtype)).to(q.dtype)
    return AttnOut(out, lse.float() if lse.dtype != torch.float64 else lse)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    softcap: float | None = None,
) -> AttnOut:
    """``scaled_dot_product_attention``; no LSE. Packed documents use a dense boolean mask."""
    if softcap:
        raise ValueError("the 'sdpa' backend cannot apply logit softcapping; use backend='math'")
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
) -> AttnOut:
    """flash-attn (public API only). Packed documents go through ``flash_attn_varlen_func``."""
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


KERNELS: dict[str, Kernel] = {
    "flash": Kernel(flash_attention, _flash_available),
    "sdpa": Kernel(sdpa_attention, lambda: True),
    "math": Kernel(math_attention, lambda: True),
}


def resolve_backend(backend: str, *, softcap: float | None = None) -> Kernel:
    """The kernel for ``backend`` ("auto" | "flash" | "sdpa" | "math"); "auto" = the first available of
    flash, sdpa, math that supports the call (SDPA cannot soft-cap)."""
    if backend == "auto":
        for name in ("flash", "sdpa", "math"):
            if KERNELS[name].available() and (name != "sdpa" or not softcap):
                return KERNELS[name]
    if backend not in KERNELS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {['auto', *KERNELS]}")
    kern = KERNELS[backend]
    if not kern.available():
        raise RuntimeError(
            f"attention backend {backend!r} is not available here (flash needs CUDA and "
            "`pip install 'lightning-longctx[flash]'`); use backend='auto'"
        )
    return kern


# ---- building blocks for FPDT's online softmax (no autograd: FPDT has its own backward) ----


@torch.no_grad()
def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: MaskSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (q block, kv block) pair: ``(out (b, s_q, h, d) in fp32/fp64, lse (b, h, s_q))``.

    One pass over the score tile, in place: the scale is folded into q and the exponential is taken
    once (``p = exp(s - max)``, ``lse = max + log(sum p)``). Rows with no allowed key give 0 and -inf.
    """
    ct = compute_dtype(q.dtype)
    h = q.shape[2]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(ct) * scale, k.to(ct))  # (b, h, sq, sk)
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one (q block, kv block) pair given the FINAL lse ``(b, h, s_q)`` of the queries and
    ``delta = rowsum(dout * out)`` ``(b, h, s_q)``. Returns ``dq (b, s_q, h, d)``, ``dk``/``dv``
    ``(b, s_k, h_kv, d)``, all in the compute dtype (fp32 or fp64)."""
    ct = compute_dtype(q.dtype)
    h, h_kv = q.shape[2], k.shape[2]
    ke, ve = _expand_kv(k, h).to(ct), _expand_kv(v, h).to(ct)
    qs, do = q.to(ct) * scale, dout.to(ct)  # the scale folded into q: dk = ds^T (q * scale)
    p = torch.einsum("bqhd,bkhd->bhqk", qs, ke)
    allowed = mask.dense(q.shape[1], k.shape[1], q.device)
    if allowed is not None:
        p.masked_fill_(~allowed[:, None], float("-inf"))
    p.sub_(lse.masked_fill(torch.isinf(lse), float("inf"))[..., None].to(ct)).exp_()  # probabilities
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    ds = torch.einsum("bqhd,bkhd->bhqk", do, ve).sub_(delta[..., None].to(ct)).mul_(p)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke).mul_(scale)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qs)
    if h != h_kv:  # sum the gradients of the query heads that share a kv head
        b, sk = k.shape[:2]
        dk = dk.view(b, sk, h_kv, h // h_kv, -1).sum(3)
        dv = dv.view(b, sk, h_kv, h // h_kv, -1).sum(3)
    return dq, dk, dv
