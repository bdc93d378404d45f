"""Fused, sequence-chunked ``lm_head`` + cross-entropy: the ``(tokens, vocab)`` logits never exist whole.

Forward computes the logits of ``chunk_size`` tokens at a time, keeps only each token's fp32
log-sum-exp and adds the chunk's loss to a running fp32 sum. Backward recomputes each chunk's logits
and turns ``softmax - onehot`` into the gradients of the hidden states, the weight and the bias. The
softmax, its gradient and the scale/soft-cap are computed in place in one ``(chunk_size, vocab)``
fp32 block (two with a soft-cap), freed before the next chunk; the weight gradient accumulates into
one fp32 ``(vocab, hidden)`` buffer. The default chunk keeps that block at :data:`LOGITS_BLOCK_BYTES`
(:func:`default_loss_chunk_size`). The result has the global-mean semantics of
:func:`lightning_longctx.sequence_parallel_cross_entropy` over the sequence-parallel group.

Vocabulary parallel (``vocab_group``, tensor parallelism): each rank of the group holds an equal, contiguous
block of the vocabulary's rows of the weight (rank order) and only ever builds ``(chunk_size, vocab / t)``
logits. Forward keeps each token's local log-sum-exp and, on the rank owning its target, the target logit;
one all-gather of the ``(tokens,)`` log-sum-exps and one all-reduce of the target logits make them global.
Backward computes the local softmax block against the global log-sum-exp; the hidden-state gradient is
partial over the group (each rank's vocabulary rows) and one all-reduce of it completes it. The weight and
bias gradients are the rank's own rows, exact.

Matmul dtype: the autocast dtype when autocast is on at the call (Lightning ``bf16-mixed``), else the
inputs' dtype; logits are upcast to fp32 (fp64 for fp64 inputs) before the softmax, as HF does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_longctx.ops.loss import TokenLossObserver, global_valid_count
from lightning_longctx.parallel.comm import (
    Group,
    all_gather_no_grad,
    all_reduce_,
    all_reduce_no_grad,
    all_reduce_sum_identity_grad,
    group_rank_size,
)
from lightning_longctx.parallel.sharding import IGNORE_INDEX

#: bytes of one fp32 ``(chunk, vocab)`` logits block when the loss chunk is not set (128 MiB: 1024 tokens
#: of a 32K vocabulary, 256 of Llama-3's 128K)
LOGITS_BLOCK_BYTES = 128 << 20


def default_loss_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk of the chunked lm_head + loss for a vocabulary: the most whose fp32 logits block
    fits :data:`LOGITS_BLOCK_BYTES`, a multiple of 64 (at least 64)."""
    return max(64, LOGITS_BLOCK_BYTES // (4 * vocab_size) // 64 * 64)


@dataclass(frozen=True)
class _Config:
    chunk_size: int
    ignore_index: int
    logit_scale: float | None
    softcap: float | None
    mm_dtype: torch.dtype  # dtype of the lm_head matmuls
    ct: torch.dtype  # dtype of the softmax / loss
    vocab_group: Group = None  # vocabulary parallel: the group whose ranks hold the vocabulary's row blocks
    vocab_start: int = 0  # the first vocabulary row of this rank's weight block
    vocab_parallel: bool = False
    observer: Callable[[torch.Tensor], None] | None = None  # gets the (T,) per-token losses, detached


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: _Config) -> torch.Tensor:
    """(t, H) -> (t, V) logits in the loss dtype, after scale and softcap (in place: one block)."""
    z = F.linear(h.to(cfg.mm_dtype), w, b).to(cfg.ct)
    if cfg.logit_scale is not None:
        z.mul_(cfg.logit_scale)
    if cfg.softcap:
        z.div_(cfg.softcap).tanh_().mul_(cfg.softcap)
    return z


def _logsumexp_(z: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(z, -1)`` computed in ``z``'s own storage (destroys it): no second block."""
    m = z.amax(dim=-1, keepdim=True)
    m.masked_fill_(m.isinf(), 0.0)  # as torch.logsumexp: a row of -inf stays -inf, not NaN
    return z.sub_(m).exp_().sum(-1).log_().add_(m[:, 0])


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


def _targets(y: torch.Tensor, rows: int, cfg: _Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(valid, owned, local index)`` of targets ``y``: ``owned`` are the valid targets among this rank's
    ``rows`` vocabulary rows (all valid ones without vocabulary parallelism); the index never points outside."""
    valid = y != cfg.ignore_index
    local = y - cfg.vocab_start
    owned = valid & (local >= 0) & (local < rows) if cfg.vocab_parallel else valid
    return valid, owned, torch.where(owned, local, 0)


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
        lse = torch.empty(hidden.shape[0], dtype=cfg.ct, device=hidden.device)
        target = torch.zeros(hidden.shape[0], dtype=cfg.ct, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], cfg.chunk_size):
                sl = slice(s, s + cfg.chunk_size)
                z = _logits(hidden[sl], w, b, cfg)  # (c, V) or (c, V / t): the only logits alive
                _, owned, index = _targets(labels[sl], w.shape[0], cfg)
                target[sl] = torch.where(owned, z.gather(1, index[:, None])[:, 0], 0.0)
                lse[sl] = _logsumexp_(z)
                del z
        if cfg.vocab_parallel:  # the log-sum-exp over every rank's vocabulary rows; the owner's target logit
            lse = torch.logsumexp(all_gather_no_grad(lse[None], cfg.vocab_group), dim=0)
            target = all_reduce_no_grad(target, cfg.vocab_group)
        per_token = torch.where(labels != cfg.ignore_index, lse - target, 0.0)  # (T,): lse's size
        if cfg.observer is not None:
            cfg.observer(per_token.detach())
        total = per_token.sum()
        ctx.cfg = cfg
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        cfg: _Config = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w, b = weight.to(cfg.mm_dtype), _cast(bias, cfg.mm_dtype)
        # vocabulary parallel: each rank's contribution to the hidden-state gradient is partial, summed in fp32
        h_dtype = torch.promote_types(hidden.dtype, torch.float32) if cfg.vocab_parallel else hidden.dtype
        grad_h = torch.empty(hidden.shape, dtype=h_dtype, device=hidden.device) if need_h else None
        # fp32 accumulators: chunk contributions are summed without rounding to a low-precision dtype
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], cfg.chunk_size):
                sl = slice(s, s + cfg.chunk_size)
                h = hidden[sl].to(cfg.mm_dtype)
                z = _logits(h, w, b, cfg)  # recompute (c, V)
                valid, owned, index = _targets(labels[sl], w.shape[0], cfg)
                if cfg.softcap:  # z = cap * tanh(x / cap)  ->  dz/dx = 1 - (z / cap)^2, kept in z's block
                    g = (z - lse[sl, None]).exp_()
                    dcap = z.div_(cfg.softcap).square_().neg_().add_(1)
                else:
                    g, dcap = z.sub_(lse[sl, None]).exp_(), None  # softmax, in z's block
                del z
                neg_onehot = -owned.to(cfg.ct)[:, None]  # -1 at valid targets (this rank's rows)
                g.scatter_add_(1, index[:, None], neg_onehot)  # softmax - onehot
                g.mul_(torch.where(valid, grad, 0.0)[:, None])  # ignored tokens: exactly 0
                if dcap is not None:
                    g.mul_(dcap)
                    del dcap
                if cfg.logit_scale is not None:
                    g.mul_(cfg.logit_scale)
                g_mm = g.to(cfg.mm_dtype)  # no copy in fp32
                if need_h:
                    grad_h[sl] = (g_mm @ w).to(h_dtype)
                if need_w:
                    if g_mm.dtype == grad_w.dtype:
                        grad_w.addmm_(g_mm.t(), h)  # no (V, H) temporary
                    else:
                        grad_w.add_(g_mm.t() @ h)
                if need_b:
                    grad_b.add_(g.sum(0))
                del g, g_mm  # before the next chunk's block exists
        if need_h and cfg.vocab_parallel:
            all_reduce_(grad_h, cfg.vocab_group)  # in place: no second (s, hidden) buffer
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
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
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    logit_scale: float | None = None,
    softcap: float | None = None,
    vocab_group: Group = None,
    observer: TokenLossObserver | None = None,
) -> torch.Tensor:
    """Global-mean cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits.

    Args:
        hidden: ``(b, s, H)`` final hidden states of this rank's tokens (any leading dims).
        weight: ``(V, H)`` the ``lm_head`` weight (tied embeddings work: gradients flow normally).
        shift_labels: ``(b, s)`` targets already shifted before sharding (``shard_batch`` does it).
        bias: optional ``(V,)``.
        chunk_size: tokens per chunk; at most a ``(chunk_size, V)`` fp32 logits block is alive (two with a
            soft-cap). ``None``: :func:`default_loss_chunk_size` of ``V``.
        logit_scale: multiply the logits (Cohere's ``logit_scale``). softcap: ``cap * tanh(z / cap)``
            (Gemma-2's ``final_logit_softcapping``), applied after the scale.
        vocab_group: vocabulary parallel (a tensor-parallel ``lm_head``): ``weight`` (and ``bias``) are this
            rank's block of ``V / t`` vocabulary rows, rank ``r`` of the group holding rows ``[r V/t, (r+1) V/t)``;
            every rank of the group passes the same ``hidden`` and labels. The loss and the hidden-state
            gradient are the full vocabulary's; the weight gradient is this block's. ``None``: full weight.
        observer: also hands this rank's per-token losses, ``(b, s)`` like ``shift_labels``, to it
            (:data:`~lightning_longctx.ops.loss.TokenLossObserver`): the chunks' log-sum-exps minus target logits,
            a ``(tokens,)`` vector the forward keeps anyway; never the logits. No collective.

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
    if chunk_size is None:
        chunk_size = default_loss_chunk_size(weight.shape[0])
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        mm_dtype = torch.get_autocast_dtype(device_type)
    else:
        mm_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    vocab_rank, vocab_ranks = group_rank_size(vocab_group) if vocab_group is not None else (0, 1)
    cfg = _Config(
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        logit_scale=None if logit_scale is None else float(logit_scale),
        softcap=None if not softcap else float(softcap),
        mm_dtype=mm_dtype,
        ct=torch.promote_types(mm_dtype, torch.float32),
        vocab_group=vocab_group,
        vocab_start=vocab_rank * weight.shape[0],
        vocab_parallel=vocab_ranks > 1,
        observer=None
        if observer is None
        else lambda losses: observer(losses.view(shift_labels.shape), shift_labels != ignore_index),
    )
    local_sum = _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, shift_labels.reshape(-1), cfg
    )
    count = global_valid_count(shift_labels, group=group, ignore_index=ignore_index)
    return all_reduce_sum_identity_grad(local_sum, group) / count.clamp(min=1)
