"""Memory, proved without timing: record every tensor any op produces during forward + backward.

Untiled, an MLP makes a ``(b, s, intermediate)`` activation and the loss a ``(b, s, vocab)`` logits
tensor. Tiled (FPDT mode), no tensor of ``s * intermediate`` or ``s * vocab`` elements is ever
created — only chunk-sized ones — in forward or in backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_longctx import sequence_parallel_cross_entropy
from lightning_longctx.attention.fpdt import fpdt_attention
from lightning_longctx.ops.chunked_loss import chunked_lm_head_cross_entropy
from lightning_longctx.ops.tiling import tile_mlp_

B, S, H, INTER, VOCAB, CHUNK = 2, 64, 8, 48, 96, 8


class LargestTensor(TorchDispatchMode):
    """Largest number of elements of any tensor an op returns, and the shapes seen."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
                self.shapes.add(tuple(t.shape))
        return out


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, INTER, bias=False)
        self.up_proj = nn.Linear(H, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _step(tiled: bool) -> tuple[LargestTensor, torch.Tensor]:
    torch.manual_seed(0)
    mlp, lm_head = SwiGLU(), nn.Linear(H, VOCAB, bias=False)
    if tiled:
        tile_mlp_(mlp, CHUNK)
    x = torch.randn(B, S, H, requires_grad=True)
    labels = torch.randint(0, VOCAB, (B, S))
    with LargestTensor() as mode:
        h = x + mlp(x)
        if tiled:
            loss = chunked_lm_head_cross_entropy(h, lm_head.weight, labels, chunk_size=CHUNK)
        else:
            loss = sequence_parallel_cross_entropy(lm_head(h), labels)
        loss.backward()
    return mode, loss.detach()


def test_untiled_materialises_activation_and_logits():
    mode, _ = _step(tiled=False)
    assert mode.max_numel >= B * S * VOCAB
    assert (B, S, INTER) in mode.shapes and (B, S, VOCAB) in mode.shapes


def test_tiled_never_creates_sequence_sized_activation_or_logits():
    mode, loss = _step(tiled=True)
    # Nothing as large as s * intermediate (the smaller threshold) exists at any time, forward or backward.
    assert mode.max_numel < S * INTER, (
        mode.max_numel,
        sorted(mode.shapes, key=lambda s: -torch.Size(s).numel())[:5],
    )
    # The biggest token-shaped tensors are one chunk of intermediate / vocab.
    assert (CHUNK, VOCAB) in mode.shapes and (1, CHUNK, INTER) in mode.shapes
    # ...and it is the same loss.
    _, plain = _step(tiled=False)
    torch.testing.assert_close(loss, plain)


def test_fpdt_attention_never_builds_sequence_scores():
    """FPDT (one rank, 8 chunks): score blocks are (b, h, c, c); a plain kernel makes (b, h, N, N)."""
    b, n, h, d, c = 2, 64, 4, 8, 8
    q, k, v = (torch.randn(b, n, h, d, requires_grad=True) for _ in range(3))
    with LargestTensor() as mode:
        fpdt_attention(q, k, v, chunk_size=c).sum().backward()
    assert mode.max_numel < b * h * n * n // 4, mode.max_numel
    assert (b, h, c, c) in mode.shapes and (b, h, n, n) not in mode.shapes


@pytest.mark.parametrize(
    "case",
    [dict(packed=True), dict(sliding_window=300), dict(softcap=2.0), dict(sinks=True)],
    ids=["packed_documents", "sliding_window", "softcap", "sinks"],
)
def test_ulysses_never_builds_an_n_by_n_mask_or_score_matrix(case):
    """Ulysses ``backend="auto"`` without flash-attn: what SDPA could run only with a dense (N, N) mask, or
    the math kernel only with (N, N) scores, runs as FPDT with one chunk per rank: tiles of at most
    (1024, 1024). ``backend="sdpa"`` / ``"math"`` (asked for by name) still build them: the check bites."""
    from lightning_longctx.attention.ulysses import ulysses_attention

    b, n, h, d = 1, 4096, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, generator=g, requires_grad=True) for _ in range(3))
    kw: dict = {}
    if case.get("packed"):
        kw["position_ids"] = torch.cat([torch.arange(m) for m in (1500, 1000, 1596)])[None]
    if "sliding_window" in case:
        kw["sliding_window"] = case["sliding_window"]
    if "softcap" in case:
        kw["softcap"] = case["softcap"]
    if case.get("sinks"):
        kw["sinks"] = torch.randn(h, generator=g)
    named = "math" if ("softcap" in case or "sinks" in case) else "sdpa"
    outs = {}
    for backend in ("auto", named):
        with LargestTensor() as mode:
            out = ulysses_attention(q, k, v, backend=backend, **kw)
            out.sum().backward()
        outs[backend] = (mode.max_numel, out.detach())
    assert outs["auto"][0] <= b * h * 1024 * 1024, outs["auto"][0]
    assert outs[named][0] >= n * n  # the dense path does build one
    torch.testing.assert_close(outs["auto"][1], outs[named][1], rtol=1e-5, atol=1e-5)
