"""xLSTM's mLSTM (transformers' own torch implementation, ``xLSTMBackend``) across ranks by state passing.

Per head, with ``f_t = sigmoid(f̃_t)`` and ``i_t = exp(ĩ_t)``, the real state evolves as
``C_t = f_t C_{t-1} + i_t k_t v_tᵀ`` (``d_qk x d_v``) and ``n_t = f_t n_{t-1} + i_t k_t``, and
``h_t = q̂_tᵀ C_t / max(|q̂_tᵀ n_t|, 1)`` (``q̂ = q / sqrt(d_qk)``): the state is affine in the entry state,
``S_out = F S_in + B`` with the scalar ``F = exp(Σ log f_t)`` per head; the output is not (a ratio). The model
keeps the state in log scale, ``(C, n, m)`` with real value ``C e^m``, and its kernels (chunkwise, or
step-by-step for what is left of a chunk) take an entry state in that form. Ours: (1) the model's backend
from a zero state gives each segment's ``B`` as ``(C, n, m)``; (2)
:func:`~lightning_longctx.parallel.comm.exclusive_affine_scan` folds the summaries in log scale (the ``apply`` below
does the max-shifted sum, as the kernels update ``m``; ``B`` travels inside ``M``, the scan's additive term
being zero); (3) the backend runs each segment again from its entry state. Every output is thus the
model's own kernel from the state a single-device run reaches there. The real values are exact; only the
stabiliser ``m`` may be chosen differently (the model's own choice already depends on its chunk
boundaries), which moves the output by the kernel's ``eps`` (1e-6) in the stabilised denominator, as
changing ``chunk_size`` does on one device. Autograd runs through both runs and the fold; the scan's
backward carries the state gradients across ranks. Cost: the mLSTM twice, one all-gather of
``u * b * heads * (d_qk * d_v + d_qk + 2)`` values.

Segment lengths: ``mode="train"`` runs the chunkwise kernel, which needs a multiple of ``chunk_size``
tokens; ``"train_with_padding"`` pads with zeros, which would decay the state it returns. For other
segment lengths, and for that mode, both runs take the backend's ``"inference"`` path: the same recurrence
(chunkwise over whole chunks, step by step for the rest) that returns exact last states at any length.

Packed documents (:class:`~lightning_longctx.integrations.hybrid.base.Documents`): the first run is on the
document pieces of the segments, each from the zero state behind padding tokens that add nothing and forget
nothing (``q = k = v = 0``, ``ĩ = -inf``: ``i = 0``, ``f̃ = +inf``: ``f = 1``), so neither the normaliser nor the
max tracker ``m`` sees them, in the step and in the chunkwise kernels alike: the first real token meets the
zero state, as the document alone does. The pieces are widened by such padding to a multiple of
``chunk_size``, so the chunkwise kernel takes them whole (no token-by-token rest). ``B`` is the last piece's
final state, ``log F = -inf`` (``M = 0``) for a segment holding a document start. The entry state is never
given to a piece: the second run is on the segments, where the first piece starts at the segment start, and
only the tokens of a first piece that continues a document take its outputs (``Documents.entry``); every
other token keeps its piece's. The summaries are cast to one dtype (the kernels return float32 states from
their steps, the inputs' dtype from their chunks), so that every rank all-gathers the same bytes.

The external ``xlstm`` package's blocks (used when it is installed) are not adapted: such models stay
refused. Caches (an entry state) are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lightning_longctx.integrations.hybrid.base import Documents, MixerCall, from_segments, to_segments

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _pack(C: torch.Tensor, n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``C`` ``(..., d_qk, d_v)``, ``n`` ``(..., d_qk)``, ``m`` ``(..., 1)`` -> ``(..., d_qk*d_v + d_qk + 1)``."""
    return torch.cat([C.flatten(-2), n, m], dim=-1)


def _unpack(x: torch.Tensor, d_qk: int, d_v: int) -> State:
    C, n, m = x.split([d_qk * d_v, d_qk, 1], dim=-1)
    return C.unflatten(-1, (d_qk, d_v)), n, m


def _log_combine(M: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``F S + B`` in the model's log scale, on packed states: ``M`` ``(..., 1 + D)`` = ``[log F, B]``, ``S``
    ``(..., D)``. ``m = max(log F + m_S, m_B)``, the kernels' update; the fold's zero state is the model's
    own (zeros, ``m = 0``), which a summary from that same state already accounts for."""
    log_f, B = M[..., :1], M[..., 1:]
    m_s, m_b = S[..., -1:] + log_f, B[..., -1:]
    m = torch.maximum(m_s, m_b)
    mixed = torch.exp(m_s - m) * S[..., :-1] + torch.exp(m_b - m) * B[..., :-1]
    return torch.cat([mixed, m], dim=-1)


def _mode(backend: torch.nn.Module, mode: str, length: int) -> str:
    """The backend mode for rows of ``length`` tokens: ``mode``, or ``"inference"`` where it cannot return
    exact last states (module docstring)."""
    if mode == "train" and length % backend.config.chunk_size == 0:
        return mode
    return "inference"  # the same recurrence, exact last states at any length


def _pieces(
    docs: Documents,
    chunk: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
) -> list[torch.Tensor]:
    """The document pieces of the segments ``q``/``k``/``v`` ``(n, heads, c, d)``, ``i``/``f`` ``(n, heads, c)``:
    each right-aligned behind padding that adds nothing and forgets nothing (``q = k = v = 0``, ``ĩ = -inf``,
    ``f̃ = +inf``), ``(pieces, heads, W, ...)`` with ``W`` widened to a multiple of the kernel's ``chunk``: the
    chunkwise kernel takes them whole, with no token-by-token rest."""
    real = docs.gather(torch.ones_like(i, dtype=torch.bool), 2)  # (pieces, heads, L)
    widen = -real.shape[2] % chunk

    def piece(x: torch.Tensor) -> torch.Tensor:  # (pieces, heads, widen + L, ...), zeros in front
        x = docs.gather(x, 2)
        return torch.cat([x.new_zeros(*x.shape[:2], widen, *x.shape[3:]), x], dim=2)

    pad = torch.cat([real.new_ones(*real.shape[:2], widen), ~real], dim=2)  # before each piece's first token
    return [
        piece(q),
        piece(k),
        piece(v),
        piece(i).masked_fill(pad, -float("inf")),
        piece(f).masked_fill(pad, float("inf")),
    ]


def mlstm_backend(
    sp: MixerCall,
    original: Callable[..., Any],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    c_initial: torch.Tensor | None = None,
    n_initial: torch.Tensor | None = None,
    m_initial: torch.Tensor | None = None,
    return_last_states: bool | None = None,
    mode: str | None = None,
) -> tuple[torch.Tensor, State]:
    """``xLSTMBackend.forward``: ``query``/``key`` ``(b, heads, s/P, d_qk)``, ``value`` ``(b, heads, s/P, d_v)``,
    ``igate``/``fgate`` ``(b, heads, s/P)`` (pre-activations); returns ``((b, heads, s/P, d_v), state)``, the
    state the exit state of this rank's last segment (the model keeps it only in a cache, refused here)."""
    backend = original.__self__  # type: ignore[attr-defined]
    if c_initial is not None or n_initial is not None or m_initial is not None:
        sp.refuse("its mLSTM with an entry state (a cache)")
    local = query.shape[2]
    c = sp.check(local)
    u = local // c
    mode = mode or backend.config.mode
    docs = sp.documents(local, query.shape[0], 0, query.device)
    q, k, v, i, f = (to_segments(x, 2, c) for x in (query, key, value, igate, fgate))  # (u*b, heads, c, ...)
    d_qk, d_v = k.shape[-1], v.shape[-1]

    seg_mode = _mode(backend, mode, c)
    if docs is None:
        _, (C_b, n_b, m_b) = original(q, k, v, i, f, return_last_states=True, mode=seg_mode)
    else:  # one row per document piece, behind padding with i = 0, f = 1 (module docstring)
        pieces = _pieces(docs, backend.config.chunk_size, q, k, v, i, f)
        width = pieces[0].shape[2]
        h0, last = original(*pieces, return_last_states=True, mode=_mode(backend, mode, width))
        h0 = docs.scatter(h0[:, :, width - docs.width :], 2)
        C_b, n_b, m_b = (x[docs.last] for x in last)  # the exit state: the last piece's
    log_f = F.logsigmoid(f.float()).sum(-1, keepdim=True)  # (u*b, heads, 1): the segment's total decay
    if docs is not None:  # e^{-inf} = 0: a document start passes no earlier state on
        log_f = log_f.masked_fill(docs.restarts[:, None, None], -float("inf"))
    # steps return float32 states, chunks the inputs' dtype: one dtype on every rank (module docstring)
    B = _pack(C_b, n_b, m_b).to(torch.promote_types(q.dtype, torch.float32))
    M = torch.cat([log_f.to(B.dtype), B], dim=-1).unflatten(0, (u, -1))  # B travels in M ...
    zero = B.new_zeros(B.shape).unflatten(0, (u, -1))  # ... so the fold adds nothing after _log_combine
    S = sp.exclusive_affine_scan(M, zero, _log_combine, local).flatten(0, 1)  # (u*b, heads, D)
    C_in, n_in, m_in = _unpack(S, d_qk, d_v)

    h, _ = original(
        q, k, v, i, f, c_initial=C_in, n_initial=n_in, m_initial=m_in, return_last_states=True, mode=seg_mode
    )
    if docs is not None:  # the entry state's run counts for a first piece that continues a document only
        h = torch.where(docs.entry[:, None, :, None], h, h0)
    exit_state = _unpack(_log_combine(M[-1], S.unflatten(0, (u, -1))[-1]), d_qk, d_v)
    return from_segments(h, 2, u), exit_state


PACKED = True
METHODS = {"xLSTMBackend": {"forward": mlstm_backend}}
