"""The fused block kernels (attention/fused.py) against the math blocks and an fp64 reference.

Every fused block kind — the causal diagonal block, a full off-diagonal block, a block under an
additive mask (packed documents + sliding window, with rows that no key is allowed), grouped-query
kv — is compared with the math blocks, forward (out, lse) and backward. The backward is the one
FPDT runs: each block of a row split over two kv blocks, given the MERGED (out, lse) of the row.
fp64: equal to rounding. fp32: at most twice the error plain PyTorch makes in fp32 against the fp64
reference (flash-attention's rule), plus a small floor. Then the probe: a failing or wrong op falls
back to the math blocks (tested, exact), an op without GQA or mask support gets expanded kv / math
tiles.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from lightning_longctx.attention import fused
from lightning_longctx.attention import kernels as math
from lightning_longctx.attention.common import MaskSpec
from lightning_longctx.attention.fpdt import fpdt_attention

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_probes():
    fused.clear_probe_cache()
    yield
    fused.clear_probe_cache()


def _kernel(dtype: torch.dtype = torch.float64) -> fused.FusedKernel:
    kern = fused.fused_kernel(CPU, dtype)
    assert kern is not None and kern.name == "cpu_flash" and kern.gqa and kern.bias, kern
    return kern


# A query segment of S rows (global rows S..2S) against kv rows 0..2S: block 0 is full (or masked),
# block 1 is the causal diagonal.
B, S, H, D = 2, 40, 4, 16
DOCS = torch.tensor([[0] * 13 + [1] * 40 + [2] * 27, [0] * 45 + [1] * 35])  # (B, 2S) doc ids


def _inputs(h_kv: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, 2 * S, h_kv, D, generator=g, dtype=torch.float64) for _ in range(2))
    return [x.to(dtype) for x in (q, k, v, dout)]


def _specs(masked: bool) -> list[tuple[slice, MaskSpec, bool]]:
    out = []
    for j in (0, 1):
        spec = MaskSpec(causal=True, q_start=S, k_start=j * S)
        if masked:
            spec = MaskSpec(
                causal=True,
                sliding_window=30,
                q_start=S,
                k_start=j * S,
                q_doc=DOCS[:, S:],
                k_doc=DOCS[:, j * S : (j + 1) * S],
            )
        out.append((slice(j * S, (j + 1) * S), spec, j == 1 and not masked))
    return out


def _run(q, k, v, dout, *, masked: bool, kern: fused.FusedKernel | None):
    """Blocks of the row, merged; each block's backward from the merged row. kern None: math."""
    scale = D**-0.5
    specs = _specs(masked)
    acc = None
    for ks, spec, causal in specs:
        if kern is None:
            blk = math.block_forward(q, k[:, ks], v[:, ks], scale=scale, mask=spec)
        else:
            bias = fused.additive_mask(spec, S, S, q.dtype, CPU) if masked else None
            blk = fused.block_forward(kern, q, k[:, ks], v[:, ks], scale=scale, causal=causal, bias=bias)
        acc = blk if acc is None else math.merge_blocks(*acc, *blk)
    out, lse = acc
    out_q = out.to(q.dtype)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    delta = (dout.to(ct) * out_q.to(ct)).sum(-1).transpose(1, 2)
    dq = torch.zeros(q.shape, dtype=ct)
    dk, dv = torch.zeros(k.shape, dtype=ct), torch.zeros(v.shape, dtype=ct)
    for ks, spec, causal in specs:
        if kern is None:
            g = math.block_backward(dout, q, k[:, ks], v[:, ks], lse, delta, scale=scale, mask=spec)
        else:
            bias = fused.additive_mask(spec, S, S, q.dtype, CPU) if masked else None
            g = fused.block_backward(
                kern, dout, q, k[:, ks], v[:, ks], out_q, lse, scale=scale, causal=causal, bias=bias
            )
        dq += g[0]
        dk[:, ks] += g[1]
        dv[:, ks] += g[2]
    return [out, lse, dq, dk, dv]


def _plain(q, k, v, dout, *, masked: bool):
    """Plain PyTorch (autograd through softmax) over the whole row: [out, lse, dq, dk, dv]."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    h_kv = k.shape[2]
    ke, ve = (x.repeat_interleave(H // h_kv, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, ke) * D**-0.5
    qi, ki = torch.arange(S, 2 * S)[:, None], torch.arange(2 * S)[None, :]
    allowed = (ki <= qi)[None]
    if masked:
        allowed = allowed & (ki > qi - 30)[None] & (DOCS[:, S:, None] == DOCS[:, None, :])
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), ve)
    out.backward(dout)
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


NAMES = ["out", "lse", "dq", "dk", "dv"]
KINDS = {  # (h_kv, masked)
    "causal_and_full_mha": (4, False),
    "causal_and_full_gqa": (2, False),
    "causal_and_full_mqa": (1, False),
    "masked_docs_window_gqa": (2, True),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_blocks_match_math_fp64(kind):
    h_kv, masked = KINDS[kind]
    inp = _inputs(h_kv, torch.float64)
    got = _run(*inp, masked=masked, kern=_kernel())
    want = _run(*inp, masked=masked, kern=None)
    exact = _plain(*inp, masked=masked)
    for name, a, b, e in zip(NAMES, got, want, exact):
        assert (a - b).abs().max().item() < 1e-12, name
        assert (a - e).abs().max().item() < 1e-12, name


@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_blocks_fp32_within_2x_plain(kind):
    h_kv, masked = KINDS[kind]
    inp64 = _inputs(h_kv, torch.float64, seed=1)
    inp32 = [x.float() for x in inp64]
    exact = _plain(*inp64, masked=masked)
    ours = _run(*inp32, masked=masked, kern=_kernel(torch.float32))
    mathb = _run(*inp32, masked=masked, kern=None)
    plain = _plain(*inp32, masked=masked)
    for name, o, m, p, e in zip(NAMES, ours, mathb, plain, exact):
        err_o, err_m, err_p = ((x.double() - e).abs().max().item() for x in (o, m, p))
        # floor: ~2 fp32 ulps of values near 1 (the max over a few thousand values is itself noisy)
        assert err_o <= 2 * err_p + 2e-7, f"{name}: fused {err_o:.3g} vs plain fp32 {err_p:.3g}"
        assert err_m <= 2 * err_p + 2e-7, f"{name}: math {err_m:.3g} vs plain fp32 {err_p:.3g}"


def test_masked_rows_have_minus_inf_lse():
    """A row the mask empties gives out = 0 and lse = -inf (the op itself says lse = 0)."""
    q, k, v, _ = _inputs(4, torch.float64)
    spec = _specs(masked=True)[0][1]  # batch 1: rows of document 1 see nothing of kv block 0
    bias = fused.additive_mask(spec, S, S, q.dtype, CPU)
    out, lse = fused.block_forward(_kernel(), q, k[:, :S], v[:, :S], scale=0.25, bias=bias)
    dead = ~spec.dense(S, S, CPU).any(-1)  # (B, S)
    assert dead.any()
    assert torch.isinf(lse.transpose(1, 2)[dead]).all() and (out[dead] == 0).all()


def _fpdt_kernels(**kw) -> tuple[set[str], list[torch.Tensor]]:
    """Single-process FPDT (u = 4 segments of 8): which kernels ran, and [out, dq, dk, dv]."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 32, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 32, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 32, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = fpdt_attention(q, k, v, chunk_size=8, block_size=3, **kw)
    out.sum().backward()
    return out.grad_fn.call.plan.kernel_names(), [out.detach(), q.grad, k.grad, v.grad]


POS = torch.tensor([list(range(5)) + list(range(11)) + list(range(16))] * 2)


def _replace_cpu_candidate(monkeypatch, **changes) -> None:
    cand = fused.CANDIDATES["cpu"][0]
    monkeypatch.setitem(fused.CANDIDATES, "cpu", [replace(cand, **changes)])
    fused.clear_probe_cache()


def test_fpdt_uses_the_fused_kernel_for_every_block_kind():
    names, got = _fpdt_kernels(position_ids=POS, sliding_window=6)
    assert names == {"cpu_flash"}
    _, want = _fpdt_kernels(position_ids=POS, sliding_window=6, backend="math")
    assert _fpdt_kernels(backend="math")[0] == {"math"}
    assert _fpdt_kernels(softcap=2.0)[0] == {"math"}  # no fused op soft-caps
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-12


def test_probe_failure_falls_back_to_math_exactly(monkeypatch):
    _, want = _fpdt_kernels(position_ids=POS)

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel here")

    _replace_cpu_candidate(monkeypatch, forward_op=broken)
    with pytest.warns(UserWarning, match="failed its probe"):
        assert fused.fused_kernel(CPU, torch.float64) is None
    names, got = _fpdt_kernels(position_ids=POS)
    assert names == {"math"}
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-12
    with pytest.raises(RuntimeError, match=r"backend='fused'.*no fused attention kernel passed its probe"):
        _fpdt_kernels(backend="fused")


def test_probe_rejects_a_wrong_kernel(monkeypatch):
    def wrong(q, k, v, scale, causal, bias):
        out, lse = fused._cpu_forward(q, k, v, scale, causal, bias)
        return out * 1.01, lse

    _replace_cpu_candidate(monkeypatch, forward_op=wrong)
    with pytest.warns(UserWarning, match="disagrees with the math blocks"):
        assert fused.fused_kernel(CPU, torch.float32) is None


def test_op_without_gqa_or_mask_support(monkeypatch):
    """An op that refuses h_kv < h gets expanded kv (gradients summed back); one that refuses a mask
    leaves the masked tiles to math. Both exact."""
    _, want = _fpdt_kernels(position_ids=POS, sliding_window=6, backend="math")

    def mha_only(q, k, v, scale, causal, bias):
        if k.shape[1] != q.shape[1] or bias is not None:
            raise RuntimeError("MHA without a mask only")
        return fused._cpu_forward(q, k, v, scale, causal, bias)

    _replace_cpu_candidate(monkeypatch, forward_op=mha_only)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing feature is not a failed probe
        kern = fused.fused_kernel(CPU, torch.float64)
    assert kern is not None and not kern.gqa and not kern.bias
    assert fused.fused_kernel(CPU, torch.float64, bias=True) is None
    names, got = _fpdt_kernels(position_ids=POS, sliding_window=6)
    assert names == {"cpu_flash", "math"}  # whole blocks fused, masked tiles math
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 1e-12


def test_mixed_dtypes_run_in_the_promoted_dtype():
    """Autocast can hand FPDT q in fp32 and k/v in bf16: the fused blocks run in fp32, as the math ones."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 32, 4, 8, generator=g)
    k, v = (torch.randn(1, 32, 2, 8, generator=g).bfloat16() for _ in range(2))
    res = {}
    for backend in ("auto", "math"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fpdt_attention(*leaves, chunk_size=8, position_ids=POS[:1], backend=backend)
        out.sum().backward()
        res[backend] = [out.detach(), *(x.grad for x in leaves)]
        assert out.grad_fn.call.plan.kernel_names() == ({"cpu_flash"} if backend == "auto" else {"math"})
    for a, b in zip(res["auto"], res["math"]):
        assert a.dtype == b.dtype and (a.float() - b.float()).abs().max().item() < 1e-2
