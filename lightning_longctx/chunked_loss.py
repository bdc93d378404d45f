"""Fused, sequence-chunked ``lm_head`` + cross-entropy: the ``(tokens, vocab)`` logits never exist whole.

Forward computes the logits of ``chunk_size`` tokens at a time, keeps only each token's fp32
log-sum-exp and adds the chunk's loss to a running fp32 sum. Backward recomputes each chunk's logits
and turns ``softmax - onehot`` into the gradients of the hidden states, the weight and the bias, so
at most a ``(chunk_size, vocab)`` block is alive. The result has the global-mean semantics of
:func:`lightning_longctx.sequence_parallel_cross_entropy` over the sequence-parallel group.

Matmul dtype: the autocast dtype when autocast is on at the call (Lightning ``bf16-mixed``), else the
inputs' dtype; logits are upcast to fp32 (fp64 for fp64 inputs) before the softmax, as HF does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_longctx.comm import Group, all_reduce_sum_identity_grad
from lightning_longctx.loss import global_valid_count
from lightning_longctx.sharding import IGNORE_INDEX


@dataclass(frozen=True)
class _Config:
    chunk_size: int
    ignore_index: int
    logit_scale: float | None
    softcap: float | None
    mm_dtype: torch.dtype  # dtype of the lm_head matmuls
    ct: torch.dtype  # dtype of the softmax / loss


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: _Config) -> torch.Tensor:
    """(t, H) -> (t, V) logits in the loss dtype, after scale and softcap."""
    z = F.linear(h.to(cfg.mm_dtype), w, b).to(cfg.ct)
    if cfg.logit_scale is not None:
        z = z * cfg.logit_scale
    if cfg.softcap:
        z = cfg.softcap * torch.tanh(z / cfg.softcap)
    return z


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over valid tokens of ``CE(hidden @ weight.T + bias, labels)``; hidden ``(T, H)``, labels ``(T,)``."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        cfg: _Config,
    ) -> torch.Tensor:
        w, b = weight.to(cfg.mm_dtype), _cast(bias, cfg.mm_dtype)
        total = torch.zeros((), dtype=cfg.ct, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=cfg.ct, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], cfg.chunk_size):
                sl = slice(s, s + cfg.chunk_size)
                z = _logits(hidden[sl], w, b, cfg)  # (c, V): the only logits alive
                y = labels[sl]
                valid = y != cfg.ignore_index
                target = z.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]  # ignore_index never indexes
                lse_c = torch.logsumexp(z, dim=-1)
                total = total + torch.where(valid, lse_c - target, 0.0).sum()
                lse[sl] = lse_c
                del z
        ctx.cfg = cfg
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        cfg: _Config = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w, b = weight.to(cfg.mm_dtype), _cast(bias, cfg.mm_dtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 accumulators: chunk contributions are summed without rounding to a low-precision dtype
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], cfg.chunk_size):
                sl = slice(s, s + cfg.chunk_size)
                h = hidden[sl].to(cfg.mm_dtype)
                z = _logits(h, w, b, cfg)  # recompute (c, V)
                y = labels[sl]
                valid = y != cfg.ignore_index
                p = torch.exp(z - lse[sl, None])  # softmax
                neg_onehot = -valid.to(cfg.ct)[:, None]  # -1 at valid targets
                g = p.scatter_add(1, torch.where(valid, y, 0)[:, None], neg_onehot)  # softmax - onehot
                g = torch.where(valid[:, None], g, 0.0) * grad  # ignored tokens: exactly 0
                del p
                if cfg.softcap:  # z = cap * tanh(x / cap)  ->  dz/dx = 1 - (z / cap)^2
                    g = g * (1 - (z / cfg.softcap) ** 2)
                if cfg.logit_scale is not None:
                    g = g * cfg.logit_scale
                del z
                g_mm = g.to(cfg.mm_dtype)
                if need_h:
                    grad_h[sl] = (g_mm @ w).to(hidden.dtype)
                if need_w:
                    grad_w.add_(g_mm.t() @ h)
                if need_b:
                    grad_b.add_(g.sum(0))
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
        )


def chunked_lm_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    group: Group = None,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    logit_scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Global-mean cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits.

    Args:
        hidden: ``(b, s, H)`` final hidden states of this rank's tokens (any leading dims).
        weight: ``(V, H)`` the ``lm_head`` weight (tied embeddings work: gradients flow normally).
        shift_labels: ``(b, s)`` targets already shifted before sharding (``shard_batch`` does it).
        bias: optional ``(V,)``.
        chunk_size: tokens per chunk; at most a ``(chunk_size, V)`` logits block is alive.
        logit_scale: multiply the logits (Cohere's ``logit_scale``). softcap: ``cap * tanh(z / cap)``
            (Gemma-2's ``final_logit_softcapping``), applied after the scale.

    Returns a 0-dim fp32 tensor (fp64 for fp64 inputs), equal on all ranks of ``group``, identical in
    value and gradient to ``sequence_parallel_cross_entropy(logits, shift_labels)``: the local sum
    over valid tokens divided by the group's valid count. Shards with no valid (or no) token
    contribute 0 and get zero gradients; no NaN.
    """
    if hidden.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be labels shape {tuple(shift_labels.shape)} + (hidden,); "
            "pass the shift_labels that shard_batch produced for this rank"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (vocab, hidden) = (V, {hidden.shape[-1]}), got {tuple(weight.shape)}; pass lm_head.weight"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be (vocab,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        mm_dtype = torch.get_autocast_dtype(device_type)
    else:
        mm_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    cfg = _Config(
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        logit_scale=None if logit_scale is None else float(logit_scale),
        softcap=None if not softcap else float(softcap),
        mm_dtype=mm_dtype,
        ct=torch.promote_types(mm_dtype, torch.float32),
    )
    local_sum = _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, shift_labels.reshape(-1), cfg
    )
    count = global_valid_count(shift_labels, group=group, ignore_index=ignore_index)
    return all_reduce_sum_identity_grad(local_sum, group) / count.clamp(min=1)
