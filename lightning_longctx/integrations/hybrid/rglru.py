"""RecurrentGemma (Griffin) recurrent blocks across ranks: the temporal convolution by a halo, the RG-LRU
recurrence by state passing.

Convolution. ``RecurrentGemmaRecurrentBlock`` runs an ``nn.Conv1d`` (depthwise, kernel ``k``, padding
``k-1``) inline and keeps the first ``L`` outputs: causal. Its forward is replaced by the same computation
(its own submodules, in the same order) in which the convolution reads ``[halo | segment]``, the halo being
the last ``k-1`` conv inputs of the segment before in global order (zeros before the first, the module's
own padding), and the outputs ``k-1 .. k-1+c`` are kept. Bytes: ``(k-1) * lru_width * u * b`` elements
each way.

RG-LRU. ``RecurrentGemmaRglru._rnn_scan`` runs ``h_t = a'_t ⊙ h_{t-1} + x_t`` with ``a'_t = a_t ⊙ ¬reset_t``
(``reset``: position id 0, a document start; unpacked, only the global sequence start, which only the first
segment of rank 0 holds: the positions are global) in float32, ``h`` ``(b, lru_width)``. A diagonal recurrence is affine in its entry
state: ``h_t = h⁰_t + P_t ⊙ S_in`` with ``h⁰`` the model's own scan from a zero state and
``P_t = ∏_{s<=t} a'_s`` (``torch.cumprod``; its backward is exact at the reset's zero), so
``S_out = M ⊙ S_in + B`` with ``M = P_last``, ``B = h⁰_last``.
:func:`~lightning_longctx.parallel.comm.exclusive_affine_scan` gives each segment its ``S_in`` (one all-gather of
``2 * lru_width * u * b`` floats); autograd runs through the model's scan and the cumulative product, the
scan's backward carries the state gradient across ranks. The normalisation ``sqrt(1 - a²)`` and the gates
are per token (the Rglru's own forward, unchanged); at position 0 the model skips the normalisation, and
only the segment holding global position 0 sees ``reset``, exactly as on one device.

Packed documents (position ids restarting at 0): the convolution runs on one piece per document (its halo
masked to the document, as ``conv.py`` does); the RG-LRU needs nothing more, since the model resets at every
position 0 (``a'_t = 0`` there, no normalisation), so ``P_t = 0`` from a segment's first document start on:
that segment passes no earlier state on, and the tokens before it still take the entry state.

Caches (``use_cache=True``, decoding, an entry state given to ``_rnn_scan``) are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_longctx.integrations.hybrid.base import MixerCall, from_segments, to_segments


def _causal_conv(sp: MixerCall, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """``conv`` (depthwise, padding ``k-1``) applied causally to ``x`` ``(b, channels, s/P)`` over the
    global sequence; returns ``(b, channels, s/P)``."""
    k = conv.kernel_size[0]
    halo = k - 1
    if conv.padding != (halo,) or conv.stride != (1,) or conv.dilation != (1,):
        sp.refuse(f"a convolution other than a causal one (kernel {k}, padding {conv.padding})")
    local = x.shape[-1]
    c = sp.check(local, halo=halo)
    u = local // c
    docs = sp.documents(local, x.shape[0], halo, x.device)
    segs = to_segments(x, 2, c)  # (u*b, channels, c)
    before = segs[..., :0]
    if halo:
        before = sp.halo_exchange(segs[..., c - halo :].unflatten(0, (u, -1)), local).flatten(0, 1)
    if docs is not None:  # one piece per document, right-aligned behind zeros, its halo masked to it
        pieces = docs.gather(segs, 2, before)  # (pieces, channels, h + L)
        return from_segments(docs.scatter(conv(pieces)[..., : pieces.shape[-1]], 2), 2, u)
    segs = torch.cat([before, segs], dim=-1)
    # output j of the padded conv reads inputs j-(k-1)..j: with the halo in front, outputs halo..halo+c-1
    # are the segment's tokens, each reading only real inputs (the halo or the segment itself)
    out = conv(segs)[..., halo : halo + c]
    return from_segments(out, 2, u)


def recurrent_block_forward(
    sp: MixerCall,
    original: Callable[..., tuple[torch.Tensor, None]],
    input_states: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    use_cache: bool | None = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``RecurrentGemmaRecurrentBlock.forward`` without a cache: ``input_states`` ``(b, s/P, hidden)``;
    returns ``((b, s/P, hidden), None)``. The model's non-cache branch, its convolution made global."""
    block = original.__self__  # type: ignore[attr-defined]
    if use_cache:
        sp.refuse("its recurrent block with use_cache=True (a convolution and RG-LRU cache)")
    block.conv1d_state = None  # as the model's non-cache branch: no state from an earlier call
    block.rg_lru.recurrent_states = None
    y_branch = block.act_fn(block.linear_y(input_states))
    x_branch = _causal_conv(sp, block.conv_1d, block.linear_x(input_states).transpose(1, 2))
    x_branch = block.rg_lru(x_branch.transpose(1, 2), position_ids)
    return block.linear_out(x_branch * y_branch), None


def rnn_scan(
    sp: MixerCall,
    original: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    hidden_states: torch.Tensor,
    recurrent_gate: torch.Tensor,
    reset: torch.Tensor,
    recurrent_states: torch.Tensor | None,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RecurrentGemmaRglru._rnn_scan``: ``hidden_states`` and ``recurrent_gate`` ``(b, s/P, w)``, ``reset``
    ``(b, s/P, 1)``; returns ``((b, s/P, w), (b, w))``: the outputs and the exit state of this rank's last
    segment (the model keeps it on the module; it is read only by decoding, which is refused)."""
    if recurrent_states is not None:
        sp.refuse("its RG-LRU scan with a recurrent state in (a cache)")
    local = hidden_states.shape[1]
    c = sp.check(local)
    u = local // c
    x, a, rs = (to_segments(t, 1, c) for t in (hidden_states, recurrent_gate, reset))  # (u*b, c, ...)
    out0, last = original(x, a, rs, None, acc_dtype)  # every segment from a zero entry state
    # the transfer from the entry state to h_t, as the model's scan forms its gate (reset zeroes it)
    P = torch.cumprod((a * ~rs).to(acc_dtype), dim=1)  # (u*b, c, w)
    M, B = P[:, -1], last.to(acc_dtype)  # (u*b, w)
    S = sp.exclusive_affine_scan(M.unflatten(0, (u, -1)), B.unflatten(0, (u, -1)), torch.mul, local)
    S = S.flatten(0, 1)  # (u*b, w): each segment's entry state
    out = out0 + (P * S[:, None]).to(out0.dtype)
    exit_state = (M * S + B).unflatten(0, (u, -1))[-1]  # the last local segment's (u-major)
    return from_segments(out, 1, u), exit_state


PACKED = (
    True  # the conv by pieces; the RG-LRU resets itself where position ids restart (P_t = 0 after a reset)
)
METHODS = {
    "RecurrentGemmaRecurrentBlock": {"forward": recurrent_block_forward},
    "RecurrentGemmaRglru": {"_rnn_scan": rnn_scan},
}
