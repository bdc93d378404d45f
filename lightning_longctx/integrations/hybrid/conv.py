"""Short causal depthwise convolutions (``causal_conv1d_fn``: gated DeltaNet, Kimi delta attention, Mamba-1/2,
LFM2): each segment gets the last ``k-1`` inputs of the segment before it in global order (a halo), the
model's own function runs on ``[halo | segment]`` and the first ``k-1`` outputs are dropped.

Exact: output t reads inputs t-k+1..t, all of which ``[halo | segment]`` holds; the first segment's halo
is zeros, the function's own left padding. Bytes per rank: ``(k-1) * channels * u * b`` elements each way.

Packed documents (:class:`~lightning_longctx.integrations.hybrid.base.Documents`): the function runs on the
pieces of each segment, one document each, right-aligned behind zeros (the conv's own padding); the first
piece is preceded by the halo, masked to the tokens of its own document (ids from the batch's global
positions: no collective beyond the halo itself). So no tap reads across a document start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_longctx.integrations.hybrid.base import MixerCall, from_segments, to_segments


def causal_conv1d(
    sp: MixerCall,
    original: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``hidden_states`` ``(b, channels, s/P)``, ``weight`` ``(channels, k)``; returns ``(b, channels, s/P)``."""
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        sp.refuse("its convolution with packed-sequence indices (seq_idx / cu_seqlens)")
    halo = weight.shape[-1] - 1
    local = hidden_states.shape[-1]
    c = sp.check(local, halo=halo)
    u = local // c
    docs = sp.documents(local, hidden_states.shape[0], halo, hidden_states.device)
    if halo == 0 and docs is None:
        return original(hidden_states, weight, bias, activation=activation, **kwargs)
    segs = to_segments(hidden_states, 2, c)  # (u*b, channels, c)
    before = segs[..., :0]
    if halo:
        before = sp.halo_exchange(segs[..., c - halo :].unflatten(0, (u, -1)), local).flatten(0, 1)
    if (
        docs is not None
    ):  # each document's piece with its own halo (zeros unless it continues): (pieces, ch, h+L)
        out = original(docs.gather(segs, 2, before), weight, bias, activation=activation, **kwargs)
        return from_segments(docs.scatter(out, 2), 2, u)
    out = original(torch.cat([before, segs], dim=-1), weight, bias, activation=activation, **kwargs)
    return from_segments(out[..., halo:], 2, u)


PACKED = True
ADAPTERS = {"causal_conv1d_fn": causal_conv1d}
REFUSED = {"causal_conv1d_update"}
