"""MiniMax lightning attention (``MiniMaxLightningAttention``: decayed linear attention, computed inline in
its forward) across ranks by state passing.

Per head, with ``λ = exp(-s)`` (``s``: the layer's fixed ``slope_rate``), the state ``S`` ``(d, d)`` evolves as
``S_t = λ S_{t-1} + k_tᵀ v_t`` and ``o_t = q_t S_t``. The model evaluates this in blocks of ``block_size``
tokens (intra-block ``(QKᵀ ⊙ decay) V``, inter-block ``(Q ⊙ λ^{i+1}) S``): the same sums for any block
boundaries, so a segment may start anywhere. From a zero entry state, a segment of ``c`` tokens gives
``o⁰`` and ``B`` (its exit state); with entry state ``S_in``, ``o_t = o⁰_t + λ^{t+1} q_t S_in`` (``t``
counted from the segment start) and ``S_out = λ^c S_in + B``: ``M = λ^c`` is a constant per head.
:func:`~lightning_longctx.parallel.comm.exclusive_affine_scan` gives each segment ``S_in`` (one all-gather of
``u * b * h * d²`` values, ``M`` a few scalars). The correction is added before the output norm, gate and
projection, which are per token. Autograd runs through our block loop; the scan's backward carries the
state gradient across ranks.

The forward is replaced (its recurrence is inline, and its only entry state, the linear cache, switches it
to a per-token loop): the same projections, activation, padding mask, norm, gate and output projection, in
the model's order, around the per-segment block loop above. Cost as the model's, plus the correction
``u * b * h * c * d²``. A cache is refused.

Packed documents (:class:`~lightning_longctx.integrations.hybrid.base.Documents`): the block loop runs on the
document pieces of the segments, each from a zero state behind zero tokens (``k = v = 0`` add nothing to a
zero state), so ``o⁰`` is every piece's output alone and the last piece's final state is the segment's
``B``. The entry state is NOT given to a piece: ``λ`` would decay it through the piece's leading zeros. The
correction ``λ^(t+1) q_t S_in`` is added on the segment instead, where the first piece starts at ``t = 0``,
and only to the tokens of a first piece that continues a document (``Documents.entry``); ``M = 0`` for a
segment holding a document start, so gradients stop there too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_longctx.integrations.hybrid.base import MixerCall, from_segments, to_segments


def _blocks_from_zero(
    attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's block loop on segments ``q``/``k``/``v`` ``(n, h, c, d)`` from a zero state: returns
    ``o⁰`` ``(n, h, c, d)`` and the exit state ``(n, h, d, d)``. The same decay buffers and the same
    operations as ``MiniMaxLightningAttention.forward``'s first branch."""
    n, h, c, d = q.shape
    block = attn.block_size
    state = torch.zeros(n, h, d, d, device=v.device, dtype=v.dtype)
    out = []
    for start in range(0, c, block):
        end = min(start + block, c)
        size = end - start
        qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        intra = torch.matmul(
            torch.matmul(qb, kb.transpose(-1, -2)) * attn.diagonal_decay[:, :, :size, :size], vb
        )
        inter = torch.matmul(qb * attn.query_decay[:, :size], state)
        out.append(inter + intra)
        block_decay = torch.exp(-attn.slope_rate * size)
        state = state * block_decay + torch.matmul((kb * attn.key_decay[:, -size:]).transpose(-1, -2), vb)
    return torch.cat(out, dim=-2), state


def lightning_forward(
    sp: MixerCall,
    original: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MiniMaxLightningAttention.forward``: ``hidden_states`` ``(b, s/P, hidden)``; returns
    ``((b, s/P, hidden), (b, h, d, d))``, the second the exit state of this rank's last segment (the model
    returns its final state; the decoder layer drops it)."""
    attn = original.__self__  # type: ignore[attr-defined]
    if cache is not None or kwargs.get("past_key_values") is not None:
        sp.refuse("its lightning attention with a cache (a linear-attention state in or out)")
    b, local, _ = hidden_states.shape
    if attention_mask is not None and (
        not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2
    ):
        sp.refuse("its lightning attention with a mask other than a 2-D padding mask")
    c = sp.check(local)
    u = local // c
    heads, d = attn.num_attention_heads, attn.head_dim

    qkv = attn.act_fn(attn.qkv_proj(hidden_states))
    if attention_mask is not None:  # the model's padding mask (2-D, this shard's tokens): zero q, k, v there
        qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
    qkv = qkv.reshape(b, local, heads, 3 * d)
    q, k, v = (to_segments(x.transpose(1, 2), 2, c) for x in torch.split(qkv, d, dim=3))  # (u*b, h, c, d)

    docs = sp.documents(local, b, 0, hidden_states.device)
    slope = attn.slope_rate  # (h, 1, 1)
    M = torch.exp(-slope * c)  # (h, 1, 1): λ^c, the same for every segment
    # the entry state reaches token t of its segment decayed t+1 times, as the model's inter-block term
    decay = torch.exp(-slope * torch.arange(1, c + 1, device=q.device)[:, None]).to(q.dtype)  # (h, c, 1)
    q_in = q * decay  # (u*b, h, c, d): what reads the entry state
    if docs is None:
        out0, B = _blocks_from_zero(attn, q, k, v)
        M = M.to(B.dtype).expand(u, 1, heads, 1, 1)
    else:  # one row per document piece behind zeros, each from a zero state; the exit state is the last piece's
        out0, final = _blocks_from_zero(attn, *(docs.gather(x, 2) for x in (q, k, v)))
        out0, B = docs.scatter(out0, 2), final[docs.last]
        M = (M.to(B.dtype) * ~docs.restarts[:, None, None, None]).unflatten(0, (u, -1))  # 0 after a start
        q_in = q_in * docs.entry[:, None, :, None]  # only a first piece that continues a document reads it
    S = sp.exclusive_affine_scan(M, B.unflatten(0, (u, -1)), torch.mul, local).flatten(0, 1)  # (u*b, h, d, d)
    out = out0 + torch.matmul(q_in, S)

    out = from_segments(out, 2, u).transpose(1, 2).reshape(b, local, heads * d)
    out = attn.norm(out)
    out = F.sigmoid(attn.output_gate(hidden_states)) * out
    exit_state = M[-1] * S.unflatten(0, (u, -1))[-1] + B.unflatten(0, (u, -1))[-1]  # last local segment's
    return attn.out_proj(out), exit_state


PACKED = True
METHODS = {"MiniMaxLightningAttention": {"forward": lightning_forward}}
