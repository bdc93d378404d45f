"""Fused attention blocks that return the log-sum-exp: the ONE adapter over private kernel ops.

FPDT merges block results with an online softmax and recomputes each block in its backward from the
row's FINAL ``(out, lse)``. No public PyTorch API gives both halves of that for a fused kernel (SDPA
returns no LSE; ``flex_attention``'s backward does not run on CPU), so, as PyTorch's own context
parallelism does, this module wraps the private ops — here and nowhere else:

======================  ===========================================================================
kernel                  ops (q/k/v ``(b, h, s, d)`` views of our ``bshd`` tensors)
======================  ===========================================================================
``cpu_flash``           ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``
``flash_attn``          flash-attn's ``_flash_attn_forward`` / ``_flash_attn_backward`` (CUDA, when
                        installed; signature read at run time)
``cuda_flash``          ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``): fp16/bf16
``cuda_efficient``      ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``): also fp32
                        and an additive mask
======================  ===========================================================================

:func:`fused_kernel` picks, per device and dtype, the first candidate that passes a **capability
probe**: an actual tiny call at first use (cached) that compares the forward, the LSE and the
backward given the MERGED ``(out, lse)`` of a row split over two kv blocks (one full, one causal)
against the math building blocks of ``kernels.py``; it also learns whether the op takes fewer kv
heads than query heads (GQA; otherwise the adapter expands them and sums their gradients) and
whether an additive mask works in the forward and the backward (packed documents, sliding
windows). A candidate whose op is missing, raises, or disagrees with math is skipped (a raising one
with a warning); with none left, ``None``: FPDT then uses the math blocks, which stay the reference.

Features no fused op here has — logit soft-capping — always use the math blocks. Attention sinks
need no kernel support: FPDT folds them into the merged ``(out, lse)`` after all blocks, and the
backward given that final ``(out, lse)`` is exact.

Conventions of :func:`block_forward` / :func:`block_backward`: ``bshd`` in and out; ``causal`` is
the square top-left causal mask of a diagonal block; ``bias`` an additive ``(b or 1, 1, s_q, s_k)``
float mask (0 allowed, ``-inf`` masked) in q's dtype. Rows with no allowed key give ``out = 0`` and
``lse = -inf``, as the math blocks.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from lightning_longctx.attention import kernels
from lightning_longctx.attention.common import MaskSpec, compute_dtype

# (q, k, v, scale, causal, bias) -> (out (b, h, s_q, d), lse (b, h, s_q)); q/k/v (b, h, s, d)
ForwardOp = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (dout, q, k, v, out, lse, scale, causal, bias) -> (dq, dk, dv), all (b, h, s, d)
BackwardOp = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class FusedKernel:
    """One fused block kernel: its two ops and what the probe found they accept."""

    name: str
    forward_op: ForwardOp
    backward_op: BackwardOp
    device_type: str
    gqa: bool = False  # takes h_kv < h (query head i reads kv head i // (h / h_kv))
    bias: bool = False  # takes an additive float mask, exact in forward and backward


# ---- the private ops, one small function each ----------------------------------------------------


def _cpu_forward(q, k, v, scale, causal, bias):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )


def _cpu_backward(dout, q, k, v, out, lse, scale, causal, bias):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def _no_philox() -> torch.Tensor:  # pragma: no cover - CUDA
    return torch.zeros((), dtype=torch.int64)  # dropout 0: the ops read no RNG state


def _cuda_flash_forward(q, k, v, scale, causal, bias):  # pragma: no cover - CUDA
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse


def _cuda_flash_backward(dout, q, k, v, out, lse, scale, causal, bias):  # pragma: no cover - CUDA
    # cum_seq_q/k None = undefined tensors: the dense (not varlen) path, as the forward returns them
    seed = _no_philox()
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, seed, scale=scale
    )[:3]


def _cuda_efficient_forward(q, k, v, scale, causal, bias):  # pragma: no cover - CUDA
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _aligned_bias(bias, q), True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]  # the op pads the LSE's rows to a multiple of 32


def _cuda_efficient_backward(dout, q, k, v, out, lse, scale, causal, bias):  # pragma: no cover - CUDA
    pad = -q.shape[2] % 32
    lse = F.pad(lse, (0, pad)).contiguous()  # the padded layout its forward returned
    seed = _no_philox()
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, _aligned_bias(bias, q), out, lse, seed, seed, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _aligned_bias(
    bias: torch.Tensor | None, q: torch.Tensor
) -> torch.Tensor | None:  # pragma: no cover - CUDA
    """The memory-efficient kernel wants the mask's rows 16-element aligned and all four dims given
    (what SDPA's own ``preprocess_mask`` does): pad the storage, slice back, expand over heads."""
    if bias is None:
        return None
    s_k = bias.shape[-1]
    padded = F.pad(bias, (0, -s_k % 16))[..., :s_k]
    return padded.expand(q.shape[0], q.shape[1], q.shape[2], s_k)


def _flash_attn_ops() -> tuple[Any, Any] | None:  # pragma: no cover - CUDA
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_interface as fai

    fwd, bwd = getattr(fai, "_flash_attn_forward", None), getattr(fai, "_flash_attn_backward", None)
    return None if fwd is None or bwd is None else (fwd, bwd)


def _flash_attn_kwargs(fn: Any, scale: float, causal: bool) -> dict[str, Any]:  # pragma: no cover - CUDA
    """Keyword arguments for the installed flash-attn version (2.5: ``window_size`` tuple; 2.6+:
    ``window_size_left/right``, ``softcap``, ``alibi_slopes``)."""
    names = inspect.signature(fn).parameters
    kw: dict[str, Any] = {"dropout_p": 0.0, "softmax_scale": scale, "causal": causal}
    optional = {
        "window_size": (-1, -1),
        "window_size_left": -1,
        "window_size_right": -1,
        "softcap": 0.0,
        "alibi_slopes": None,
        "return_softmax": False,
        "deterministic": False,
        "rng_state": None,
    }
    kw.update({k: val for k, val in optional.items() if k in names})
    return {k: val for k, val in kw.items() if k in names}


def _flash_attn_forward(q, k, v, scale, causal, bias):  # pragma: no cover - CUDA
    fwd, _ = _flash_attn_ops()
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # flash-attn is bshd
    out, lse, *_ = fwd(qt, kt, vt, **_flash_attn_kwargs(fwd, scale, causal))
    return out.transpose(1, 2), lse


def _flash_attn_backward(dout, q, k, v, out, lse, scale, causal, bias):  # pragma: no cover - CUDA
    _, bwd = _flash_attn_ops()
    do, qt, kt, vt, ot = (x.transpose(1, 2).contiguous() for x in (dout, q, k, v, out))
    dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
    bwd(do, qt, kt, vt, ot, lse.contiguous(), dq, dk, dv, **_flash_attn_kwargs(bwd, scale, causal))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


#: Candidates per device type, best first. ``flash_attn`` only where it is installed.
CANDIDATES: dict[str, list[FusedKernel]] = {
    "cpu": [FusedKernel("cpu_flash", _cpu_forward, _cpu_backward, "cpu")],
    "cuda": [
        FusedKernel("flash_attn", _flash_attn_forward, _flash_attn_backward, "cuda"),
        FusedKernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward, "cuda"),
        FusedKernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward, "cuda"),
    ],
}


# ---- the adapter: bshd in and out, GQA, fully masked rows ----------------------------------------


def common_dtype(q: torch.Tensor, k: torch.Tensor) -> torch.dtype:
    """The dtype a block runs in: q's and kv's promoted (autocast can leave q in fp32 and k/v in bf16;
    the ops take one dtype). The kernel (:func:`fused_kernel`) and the mask are chosen for it."""
    return torch.promote_types(q.dtype, k.dtype)


def _heads_for(kernel: FusedKernel, k: torch.Tensor, h: int) -> torch.Tensor:
    """(b, h_kv, s, d) kv as the kernel takes it: as is with GQA support, else repeated to h heads."""
    if kernel.gqa or k.shape[1] == h:
        return k
    return k.repeat_interleave(h // k.shape[1], dim=1)


def _dead_rows(bias: torch.Tensor | None) -> torch.Tensor | None:
    """``(b or 1, 1, s_q)`` True where a row of the additive mask allows no key."""
    return None if bias is None else torch.isinf(bias).all(dim=-1)


@torch.no_grad()
def block_forward(
    kernel: FusedKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (q block, kv block) pair: q ``(b, s_q, h, d)``, k/v ``(b, s_k, h_kv, d)`` ->
    ``(out (b, s_q, h, d) in the compute dtype (fp32/fp64), lse (b, h, s_q))``. The op runs in
    :func:`common_dtype` (give ``bias`` in it)."""
    h, dt = q.shape[2], common_dtype(q, k)
    ct = compute_dtype(dt)
    if h == 0:  # a rank that owns no head (h < P): nothing to compute; the ops die (SIGFPE) on 0 heads
        b, s_q, _, d = q.shape
        return q.new_zeros((b, s_q, 0, d), dtype=ct), q.new_zeros((b, 0, s_q), dtype=ct)
    qt, kt, vt = (x.to(dt).transpose(1, 2) for x in (q, k, v))  # (b, h, s, d) views, no copy
    out, lse = kernel.forward_op(
        qt, _heads_for(kernel, kt, h), _heads_for(kernel, vt, h), scale, causal, bias
    )
    dead = _dead_rows(bias)
    if dead is not None:  # the op gives such rows lse = 0; the online softmax needs -inf
        lse = lse.masked_fill(dead, float("-inf"))
    return out.transpose(1, 2).to(ct), lse.to(ct)


@torch.no_grad()
def block_backward(
    kernel: FusedKernel,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the FINAL ``out`` ``(b, s_q, h, d)`` and ``lse`` ``(b, h, s_q)`` of
    its query rows (merged over every kv block, sinks included): ``dq (b, s_q, h, d)``, ``dk``/``dv``
    ``(b, s_k, h_kv, d)`` in the compute dtype. The op runs in :func:`common_dtype`."""
    h, h_kv, dt = q.shape[2], k.shape[2], common_dtype(q, k)
    ct = compute_dtype(dt)
    if h == 0:  # a rank that owns no head: zero-sized gradients (the ops die on 0 heads)
        return tuple(x.new_zeros(x.shape, dtype=ct) for x in (q, k, v))  # type: ignore[return-value]
    qt, kt, vt, dot, ot = (x.to(dt).transpose(1, 2) for x in (q, k, v, dout, out))
    ke, ve = _heads_for(kernel, kt, h), _heads_for(kernel, vt, h)
    lse = lse.float() if dt != torch.float64 else lse
    dq, dk, dv = kernel.backward_op(dot, qt, ke, ve, ot, lse.contiguous(), scale, causal, bias)
    if dk.shape[1] != h_kv:  # expanded here: sum the gradients of the copies of each kv head
        b, _, s_k, d = dk.shape
        dk = dk.reshape(b, h_kv, h // h_kv, s_k, d).sum(2)
        dv = dv.reshape(b, h_kv, h // h_kv, s_k, d).sum(2)
    return dq.transpose(1, 2).to(ct), dk.transpose(1, 2).to(ct), dv.transpose(1, 2).to(ct)


def additive_mask(
    mask: MaskSpec, s_q: int, s_k: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The mask of ``mask`` as the fused ops take it: ``(b or 1, 1, s_q, s_k)``, 0 / ``-inf``."""
    allowed = mask.dense(s_q, s_k, device)  # (b or 1, s_q, s_k) or None
    if allowed is None:
        return torch.zeros(1, 1, s_q, s_k, dtype=dtype, device=device)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return bias[:, None]


# ---- the capability probe -------------------------------------------------------------------------

#: how far a probe result may be from the math blocks (relative to the largest value): a check that
#: the op computes the right thing, not an accuracy test (tests/test_fused_kernels.py does that)
_PROBE_TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    a, b = a.double(), b.double()
    if not bool(torch.isfinite(a).all()):
        return False
    return float((a - b).abs().max()) <= _PROBE_TOL.get(dtype, 5e-2) * max(1.0, float(b.abs().max()))


def _probe_recipe(
    kernel: FusedKernel, device: torch.device, dtype: torch.dtype, h_kv: int, masked: bool
) -> bool:
    """FPDT's recipe at toy size: q (24 rows) against a full kv block and the causal diagonal block
    (or, ``masked``, both under an additive mask with a fully masked row), merged; the backward of
    each block from the merged row. Compared with the math blocks."""
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 24, 2, 16
    q, dout = (torch.randn(b, s, h, d, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(b, 2 * s, h_kv, d, generator=g).to(device, dtype) for _ in range(2))
    blocks = []  # (kv slice, math mask, causal flag, bias)
    for j, causal in ((0, False), (1, True)):
        spec = MaskSpec(causal=True, q_start=s, k_start=j * s)
        if masked:
            docs = torch.tensor([[0] * 10 + [1] * 38, [0] * 30 + [1] * 18], device=device)
            spec = replace(spec, q_doc=docs[:, s:], k_doc=docs[:, j * s : (j + 1) * s], sliding_window=20)
            bias = additive_mask(spec, s, s, dtype, device)
            blocks.append((slice(j * s, (j + 1) * s), spec, False, bias))
        else:
            blocks.append((slice(j * s, (j + 1) * s), spec, causal, None))
    scale = d**-0.5
    got = want = None
    for ks, spec, causal, bias in blocks:
        g_blk = block_forward(kernel, q, k[:, ks], v[:, ks], scale=scale, causal=causal, bias=bias)
        w_blk = kernels.block_forward(q, k[:, ks], v[:, ks], scale=scale, mask=spec)
        got = g_blk if got is None else kernels.merge_blocks(*got, *g_blk)
        want = w_blk if want is None else kernels.merge_blocks(*want, *w_blk)
    if not (_close(got[0], want[0], dtype) and _close(got[1], want[1], dtype)):
        return False
    out, lse = want[0].to(dtype), want[1]
    ct = compute_dtype(dtype)
    delta = (dout.to(ct) * out.to(ct)).sum(-1).transpose(1, 2)
    for ks, spec, causal, bias in blocks:
        g_grads = block_backward(
            kernel, dout, q, k[:, ks], v[:, ks], out, lse, scale=scale, causal=causal, bias=bias
        )
        w_grads = kernels.block_backward(dout, q, k[:, ks], v[:, ks], lse, delta, scale=scale, mask=spec)
        if not all(_close(a, c, dtype) for a, c in zip(g_grads, w_grads)):
            return False
    return True


def _try(kernel: FusedKernel, device: torch.device, dtype: torch.dtype, h_kv: int, masked: bool) -> bool:
    try:
        return _probe_recipe(kernel, device, dtype, h_kv, masked)
    except Exception:
        return False


@functools.cache
def _probe(name: str, device: torch.device, dtype: torch.dtype) -> FusedKernel | None:
    kernel = next(c for c in CANDIDATES[device.type] if c.name == name)
    if name == "flash_attn" and _flash_attn_ops() is None:
        return None  # not installed: nothing to warn about
    try:
        ok = _probe_recipe(kernel, device, dtype, 2, masked=False)
    except Exception as e:  # missing op, changed signature, unsupported dtype/device
        if device.type == "cpu":  # on CUDA some (kernel, dtype) pairs are expected to fail
            warnings.warn(
                f"fused attention kernel {name!r} failed its probe on {device} {dtype} "
                f"({type(e).__name__}: {e}); FPDT falls back to the math blocks",
                stacklevel=3,
            )
        return None
    if not ok:
        warnings.warn(f"fused attention kernel {name!r} disagrees with the math blocks on {device} {dtype}; "
                      "FPDT falls back to the math blocks", stacklevel=3)  # fmt: skip
        return None
    return replace(
        kernel,
        gqa=_try(replace(kernel, gqa=True), device, dtype, 1, masked=False),
        bias=_try(replace(kernel, gqa=False), device, dtype, 2, masked=True),
    )


def fused_kernel(device: torch.device, dtype: torch.dtype, *, bias: bool = False) -> FusedKernel | None:
    """The best fused block kernel for ``device`` and ``dtype`` that passed its probe (and, with
    ``bias=True``, takes an additive mask), or ``None`` (use the math blocks). Probed once per
    (candidate, device, dtype) and cached; :func:`clear_probe_cache` forgets the results."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # pragma: no cover - CUDA
        device = torch.device("cuda", torch.cuda.current_device())
    for cand in CANDIDATES.get(device.type, []):
        kern = _probe(cand.name, device, dtype)
        if kern is not None and (kern.bias or not bias):
            return kern
    if not bias and device.type == "cuda":  # pragma: no cover - CUDA
        _warn_no_kernel(device, dtype)
    return None


@functools.cache
def _warn_no_kernel(device: torch.device, dtype: torch.dtype) -> None:  # pragma: no cover - CUDA
    warnings.warn(
        f"no fused attention kernel passed its probe on {device} {dtype} (tried "
        f"{[c.name for c in CANDIDATES['cuda']]}); FPDT runs the math blocks, several times slower",
        stacklevel=3,
    )


def clear_probe_cache() -> None:
    """Forget every probe result (tests that replace a candidate's op call this)."""
    _probe.cache_clear()
    _warn_no_kernel.cache_clear()
