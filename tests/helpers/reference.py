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


def affine_scan_errors(
    order: tuple[tuple[int, ...], ...], kind: str, seed: int = 0, rows: int = 2, pass_order: bool = True
) -> dict[str, float]:
    """``comm.exclusive_affine_scan`` on this rank's segments of ``order`` (``order[r][i]``: the global id of
    rank r's segment i) against the sequential fold over all segments in global order: the largest error of
    the entry states and of the gradients of M and B. ``kind``: ``"dense"`` (gated DeltaNet: (heads, dk, dk)
    maps of (heads, dk, dv) states) or ``"scalar"`` (Mamba: one decay per head). ``pass_order=False`` calls
    the scan without ``order`` (its default, the strided order)."""
    import torch.distributed as dist

    from lightning_longctx.parallel.comm import exclusive_affine_scan

    rank = dist.get_rank()
    torch.manual_seed(seed)
    total = len(order) * len(order[0])
    if kind == "dense":
        M = torch.randn(total, rows, 2, 3, 3, dtype=torch.float64) * 0.5
        apply = torch.matmul
    else:
        M = torch.rand(total, rows, 2, 1, 1, dtype=torch.float64)
        apply = torch.mul
    Bs = torch.randn(total, rows, 2, 3, 4, dtype=torch.float64)
    W = torch.randn(total, rows, 2, 3, 4, dtype=torch.float64)
    M.requires_grad_(), Bs.requires_grad_()
    states = [torch.zeros_like(Bs[0])]
    for g in range(total - 1):
        states.append(apply(M[g], states[-1]) + Bs[g])
    ref = torch.stack(states)
    (ref * W).sum().add(0 * (M.sum() + Bs.sum())).backward()  # one segment: nothing depends on them
    mine = list(order[rank])
    m_local = M.detach()[mine].clone().requires_grad_()
    b_local = Bs.detach()[mine].clone().requires_grad_()
    extra = {"order": order} if pass_order else {}
    got = exclusive_affine_scan(m_local, b_local, apply, dist.group.WORLD, **extra)
    (got * W[mine]).sum().backward()
    return {
        "forward": (got - ref.detach()[mine]).abs().max().item(),
        "dM": (m_local.grad - M.grad[mine]).abs().max().item(),
        "dB": (b_local.grad - Bs.grad[mine]).abs().max().item(),
    }
