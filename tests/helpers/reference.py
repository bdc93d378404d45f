"""Single-process references, written independently of the package's kernels."""

from __future__ import annotations

import torch


def reference_attention(
    q, k, v, *, causal=True, position_ids=None, scale=None, sliding_window=None, softcap=None, sinks=None
):
    """Naive attention over the FULL sequence. q (b, N, h, d), k/v (b, N, h_kv, d) -> (b, N, h, d).

    ``sinks`` (h,): gpt-oss's eager formula — the sinks are one extra column of the scores, the row max
    is subtracted, softmax, and the column is dropped (it carries no value)."""
    b, n, h, d = q.shape
    group = h // k.shape[2]
    kv_index = torch.arange(h) // group  # query head i reads kv head i // group
    k, v = k[:, :, kv_index], v[:, :, kv_index]
    scale = d**-0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    allowed = torch.ones(b, n, n, dtype=torch.bool)
    i = torch.arange(n)
    if causal:
        allowed &= i[None, :, None] >= i[None, None, :]
    if sliding_window is not None:
        allowed &= (i[None, :, None] - i[None, None, :]) < sliding_window
    if position_ids is not None:
        doc = torch.zeros(b, n, dtype=torch.long)
        for bi in range(b):
            cur = 0
            for t in range(n):
                if t > 0 and int(position_ids[bi, t]) == 0:
                    cur += 1
                doc[bi, t] = cur
        allowed &= doc[:, :, None] == doc[:, None, :]
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        col = sinks.to(s.dtype).reshape(1, h, 1, 1).expand(b, h, n, 1)
        s = torch.cat([s, col], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1)[..., :-1], v)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def packed_positions(b: int, n: int, lengths: list[int]) -> torch.Tensor:
    """(b, n) position ids of documents of the given lengths (cycled), restarting at 0 per document."""
    rows = []
    for bi in range(b):
        row: list[int] = []
        j = bi
        while len(row) < n:
            row.extend(range(lengths[j % len(lengths)]))
            j += 1
        rows.append(row[:n])
    return torch.tensor(rows)
