"""RWKV-4 across ranks: the token shift by a one-token halo, the WKV recurrence by state passing.

Token shift. Time mixing (``RwkvSelfAttention.extract_key_value``) and channel mixing
(``RwkvFeedForward.forward``) mix each token with the one before it (``time_shift``, zeros before the first):
a causal convolution of width 2. Both take the previous token of their first position from the model's own
recurrent state (``state[1]``, ``state[0]``, the generation cache), so we call the model's methods on the
segments with a state holding, per segment, the last token of the segment before in global order
(:func:`~lightning_longctx.parallel.comm.halo_exchange`; zeros before the first, the shift's own padding). Bytes:
``hidden * u * b`` elements each way per shift.

WKV. Per channel, with ``w = -exp(time_decay)`` and ``u = time_first``, the real state ``(a, b)`` evolves as
``a_t = e^w a_{t-1} + e^{k_t} v_t``, ``b_t = e^w b_{t-1} + e^{k_t}``, and
``wkv_t = (a_{t-1} + e^{u+k_t} v_t) / (b_{t-1} + e^{u+k_t})``: the state is affine in the entry state,
``S_out = e^{w c} S_in + B`` (diagonal), the output is not (a ratio). The model keeps the state in log
scale, ``(num, den, max)`` with ``a = num e^max``, which ours follows: (1) the model's own
``rwkv_linear_attention_cpu`` from a zero state gives each segment's ``B`` as ``(num, den, max)``;
(2) :func:`~lightning_longctx.parallel.comm.exclusive_affine_scan` folds the summaries in log scale (the ``apply``
below does the max-shifted sum; ``B`` travels inside ``M``, the scan's additive term being zero); (3) the
same function runs each segment again from its entry state, so every output is computed exactly as on one
device, from the state a single-device run reaches there. Autograd runs through both runs and the fold,
the scan's backward carries the state gradients across ranks. Cost: the WKV twice (it is elementwise),
one all-gather of ``4 * attention_hidden * u * b`` floats.

The torch function is used on every device: the CUDA kernel's backward drops the gradient of its state.
Caches (``state`` in or out, ``use_cache=True``) are refused.

Packed documents (:class:`~lightning_longctx.integrations.hybrid.base.Documents`). Token shifts: the model's
method runs on the document pieces of the segments, each right-aligned behind zero tokens with the halo in
front of a first piece that continues a document (masked to it), so a document's first token is shifted
against a zero, as alone. WKV: zero tokens are not neutral (``e^0 = 1`` would count in the denominator and
the max), so the first run's padding keys are a huge negative number (:func:`_pad_key`): their terms
vanish (``e^{k - max} = 0``) and the first real token meets an empty state, as the document alone does.
``B`` is the last piece's final state, the decay ``W = -inf`` (``M = 0``) for a segment holding a document
start. The entry state is never given to a piece (its decay would run through the padding): the second run
is on the segments, where the first piece starts at the segment start, and only the tokens of a first piece
that continues a document take its outputs (``Documents.entry``); every other token keeps its piece's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from lightning_longctx.integrations.hybrid.base import MixerCall, from_segments, to_segments

#: The model's "no state yet" max (``rwkv_linear_attention_cpu`` starts from ``-1e38``): ``e^{max}`` is 0.
_EMPTY_MAX = -1e38


def _shifted(
    sp: MixerCall,
    hidden: torch.Tensor,
    run: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, ...]],
) -> list[torch.Tensor]:
    """A token-shift method across segments: ``hidden`` ``(b, s/P, hidden)``; ``run(x, before)`` calls it on
    rows ``x`` ``(n, W, hidden)`` with ``before`` ``(n, hidden)`` the token before each row (``None``: zeros,
    the shift's own padding) and returns its per-token outputs ``(n, W, ...)``; those in ``(b, s/P, ...)``."""
    local = hidden.shape[1]
    c = sp.check(local, halo=1)
    u = local // c
    segs = to_segments(hidden, 1, c)  # (u*b, c, hidden)
    # the token before each segment in global order (zeros before the sequence start)
    before = sp.halo_exchange(segs[:, -1].unflatten(0, (u, -1)), local).flatten(0, 1)
    docs = sp.documents(local, hidden.shape[0], 1, hidden.device)
    if docs is None:
        outs = run(segs, before)
    else:  # one piece per document behind zeros, the halo (masked to its document) before a first piece
        outs = tuple(docs.scatter(x, 1) for x in run(docs.gather(segs, 1, before[:, None]), None))
    return [from_segments(x, 1, u) for x in outs]


def _shift_state(before: torch.Tensor, layer_id: int) -> torch.Tensor:
    """The model's token-shift state ``(n, hidden, layers)``: ``before`` at this layer's index (the only one
    its method reads; it writes its own last token there, into this throwaway tensor)."""
    pad = before.new_zeros(*before.shape, layer_id)
    return torch.cat([pad, before[..., None]], dim=-1)


def time_mix_inputs(
    sp: MixerCall,
    original: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]],
    hidden: torch.Tensor,
    state: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """``RwkvSelfAttention.extract_key_value``: ``hidden`` ``(b, s/P, hidden)``; returns receptance, key and
    value ``(b, s/P, attention_hidden)`` and no state."""
    if state is not None:
        sp.refuse("its time mixing with a recurrent state (a cache)")
    layer_id = original.__self__.layer_id  # type: ignore[attr-defined]

    def run(x: torch.Tensor, before: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        shift = None if before is None else [None, _shift_state(before, layer_id)]
        return original(x, state=shift)[:3]

    receptance, key, value = _shifted(sp, hidden, run)
    return receptance, key, value, None


def channel_mix(
    sp: MixerCall,
    original: Callable[..., tuple[torch.Tensor, Any]],
    hidden: torch.Tensor,
    state: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, None]:
    """``RwkvFeedForward.forward``: ``hidden`` ``(b, s/P, hidden)``; returns ``((b, s/P, hidden), None)``."""
    if state is not None:
        sp.refuse("its channel mixing with a recurrent state (a cache)")
    layer_id = original.__self__.layer_id  # type: ignore[attr-defined]

    def run(x: torch.Tensor, before: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        return original(x, state=None if before is None else [_shift_state(before, layer_id)])[:1]

    return _shifted(sp, hidden, run)[0], None


def _pad_key(dtype: torch.dtype) -> float:
    """The key of a piece's leading padding: ``e^{k - max}`` is 0 against any real token's max, yet above
    the model's empty-state max ``-1e38`` (so that a padding token sees a denominator of 1, not 0 / 0)."""
    return max(-1e30, torch.finfo(dtype).min / 4)


def _log_combine(M: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``e^{W} S + B`` in the model's log scale: ``M`` ``(..., 4, A)`` = ``[W, num_B, den_B, max_B]``, ``S``
    ``(..., 3, A)`` = ``[num, den, max]``. The scan's zero state (``den`` 0) holds nothing: its max is
    ignored, as the model's ``-1e38``."""
    W, num_b, den_b, max_b = M.unbind(-2)
    num_s, den_s, max_s = S.unbind(-2)
    max_s = torch.where(den_s > 0, max_s + W, torch.full_like(max_s, _EMPTY_MAX))
    top = torch.maximum(max_s, max_b)
    e_s, e_b = torch.exp(max_s - top), torch.exp(max_b - top)
    return torch.stack([e_s * num_s + e_b * num_b, e_s * den_s + e_b * den_b, top], dim=-2)


def wkv(
    sp: MixerCall,
    original: Callable[..., tuple[torch.Tensor, Any]],
    time_decay: torch.Tensor,
    time_first: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: Any = None,
    return_state: bool = False,
) -> tuple[torch.Tensor, None]:
    """``rwkv_linear_attention``: ``time_decay``/``time_first`` ``(A,)``, ``key``/``value`` ``(b, s/P, A)``;
    returns ``((b, s/P, A), None)``."""
    if state is not None or return_state:
        sp.refuse("its WKV recurrence with a recurrent state in or out (a cache)")
    torch_wkv = inspect.unwrap(original).__globals__.get("rwkv_linear_attention_cpu")
    if torch_wkv is None:
        sp.refuse("its WKV recurrence, whose torch implementation (rwkv_linear_attention_cpu) is missing")
    local = key.shape[1]
    c = sp.check(local)
    u = local // c
    docs = sp.documents(local, key.shape[0], 0, key.device)
    k, v = to_segments(key, 1, c), to_segments(value, 1, c)  # (u*b, c, A)
    if docs is None:
        _, (num, den, top) = torch_wkv(time_decay, time_first, k, v, state=None, return_state=True)
    else:  # one row per document piece; its leading padding counts for nothing (module docstring)
        real = docs.gather(torch.ones_like(k[..., :1], dtype=torch.bool), 1)  # (pieces, L, 1)
        k_pieces = docs.gather(k, 1).masked_fill(~real, _pad_key(k.dtype))
        out0, (num, den, top) = torch_wkv(
            time_decay, time_first, k_pieces, docs.gather(v, 1), state=None, return_state=True
        )
        out0 = docs.scatter(out0, 1)
        num, den, top = num[docs.last], den[docs.last], top[docs.last]  # the exit state: the last piece's
    # a segment decays an earlier state by e^{w c}; B travels in M so that the fold is the log-scale sum
    W = (-torch.exp(time_decay.float()) * c).expand_as(num)
    if docs is not None:  # e^{-inf} = 0: a document start passes no earlier state on
        W = W.masked_fill(docs.restarts[:, None], float("-inf"))
    M = torch.stack([W, num, den, top], dim=-2).unflatten(0, (u, -1))  # (u, b, 4, A)
    zero = num.new_zeros(u, num.shape[0] // u, 3, num.shape[-1])
    S = sp.exclusive_affine_scan(M, zero, _log_combine, local).flatten(0, 1)  # (u*b, 3, A)
    num_in, den_in, max_in = S.unbind(-2)
    max_in = torch.where(den_in > 0, max_in, torch.full_like(max_in, _EMPTY_MAX))
    out, _ = torch_wkv(time_decay, time_first, k, v, state=[num_in, den_in, max_in])
    if docs is not None:  # the entry state's run counts for a first piece that continues a document only
        out = torch.where(docs.entry[..., None], out, out0)
    return from_segments(out, 1, u), None


PACKED = True
ADAPTERS = {"rwkv_linear_attention": wkv}
METHODS = {
    "RwkvSelfAttention": {"extract_key_value": time_mix_inputs},
    "RwkvFeedForward": {"forward": channel_mix},
}
