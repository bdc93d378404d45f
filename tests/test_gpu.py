"""CUDA checks on one GPU (P = 1): kernels, FPDT offload with real streams and pinned memory, tiling.

Every test is marked ``cuda`` and skipped without CUDA; ``benchmarks/gpu/check.sh`` runs them with
``pytest -m cuda``. ``LONGCTX_GPU_TESTS_ON_CPU=1`` runs the same tests on the CPU instead (a dry run of
their logic; the pinned-memory and stream assertions are then skipped).

Accuracy rule (as flash-attention's tests): against a float64 reference on the CPU, our result may
make at most twice the error that plain PyTorch makes in the same dtype on the same device, plus a
small floor.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from helpers.hf_models import tiny_model
from helpers.reference import reference_attention
from lightning_longctx import chunked_lm_head_cross_entropy, enable_sequence_parallel, shard_batch, tile_mlp_
from lightning_longctx.attention import fused
from lightning_longctx.attention.common import MaskSpec
from lightning_longctx.attention.fpdt import fpdt_attention
from lightning_longctx.attention.offload import offloaded_bytes, track_offload_residency
from lightning_longctx.attention.ulysses import ulysses_attention

ON_CPU = os.environ.get("LONGCTX_GPU_TESTS_ON_CPU") == "1"
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLOOR = {"fp32": 1e-5, "bf16": 1e-3}  # absolute slack on top of 2x the plain error

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (CUDA or ON_CPU),
        reason="needs an NVIDIA GPU (run by benchmarks/gpu/check.sh; LONGCTX_GPU_TESTS_ON_CPU=1 dry-runs on CPU)",
    ),
]


def _qkvw(b: int, n: int, h: int, h_kv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, n, h, d), (b, n, h_kv, d), (b, n, h_kv, d), (b, n, h, d)]
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).double() for s in shapes]


def _attn_errors(fn, name: str, *, b=1, n=512, h=8, h_kv=4, d=64) -> tuple[list[float], list[float]]:
    """Max error of (out, dq, dk, dv) of ``fn`` and of plain PyTorch in dtype ``name``, vs float64."""
    dtype = DTYPES[name]
    q, k, v, w = _qkvw(b, n, h, h_kv, d, dtype)  # values representable in dtype: same inputs for all
    exact_in = [x.clone().requires_grad_() for x in (q, k, v)]
    exact = reference_attention(*exact_in)
    (exact * w).sum().backward()
    want = [exact.detach(), *(x.grad for x in exact_in)]

    def run(f):
        inp = [x.detach().to(DEVICE, dtype, copy=True).requires_grad_() for x in (q, k, v)]
        out = f(*inp)
        (out.float() * w.to(DEVICE, torch.float32)).sum().backward()
        got = [out.detach(), *(x.grad for x in inp)]
        return [(a.double().cpu() - e).abs().max().item() for a, e in zip(got, want)]

    return run(fn), run(reference_attention)


def _check(ours: list[float], plain: list[float], name: str) -> None:
    for what, o, p in zip(("out", "dq", "dk", "dv"), ours, plain):
        assert o <= 2 * p + FLOOR[name], f"{what}: ours {o:.3g} vs plain PyTorch {p:.3g} ({name})"


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_ulysses_single_gpu_matches_reference(backend, name):
    ours, plain = _attn_errors(lambda q, k, v: ulysses_attention(q, k, v, backend=backend), name)
    _check(ours, plain, name)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("window", [None, 200])
def test_fpdt_single_gpu_matches_reference(name, window):
    n, c = 1024, 256  # u = 4 segments of 256 tokens, two 128-token compute tiles each

    def fpdt(q, k, v):
        return fpdt_attention(q, k, v, chunk_size=c, block_size=128, sliding_window=window)

    def plain(q, k, v):
        return reference_attention(q, k, v, sliding_window=window)

    dtype = DTYPES[name]
    q, k, v, w = _qkvw(1, n, 8, 2, 64, dtype, seed=1)
    exact_in = [x.clone().requires_grad_() for x in (q, k, v)]
    exact = plain(*exact_in)
    (exact * w).sum().backward()
    want = [exact.detach(), *(x.grad for x in exact_in)]
    errs = []
    for f in (fpdt, plain):
        inp = [x.detach().to(DEVICE, dtype, copy=True).requires_grad_() for x in (q, k, v)]
        out = f(*inp)
        (out.float() * w.to(DEVICE, torch.float32)).sum().backward()
        got = [out.detach(), *(x.grad for x in inp)]
        errs.append([(a.double().cpu() - e).abs().max().item() for a, e in zip(got, want)])
    _check(*errs, name)


@pytest.mark.parametrize("name", list(DTYPES))
def test_fused_kernel_probe_finds_a_kernel(name):
    """A fused block kernel passes its probe on this device (CUDA: flash-attn, the flash or the
    memory-efficient SDPA op; CPU: the CPU flash op) and FPDT's unmasked blocks use it."""
    dtype = DTYPES[name]
    kern = fused.fused_kernel(DEVICE, dtype)
    masked = fused.fused_kernel(DEVICE, dtype, bias=True)
    print(f"{DEVICE} {name}: {kern}; with a mask: {masked}")
    assert kern is not None, f"no fused kernel passed its probe on {DEVICE} {name}: FPDT runs the math blocks"
    q, k, v = (torch.randn(1, 512, h, 64, device=DEVICE, dtype=dtype, requires_grad=True) for h in (8, 2, 2))
    out = fpdt_attention(q, k, v, chunk_size=128)
    assert out.grad_fn.call.plan.kernel_names() == {kern.name}  # the Function's ctx holds the plan


def _fused_recipe(kern, q, k, v, dout, masked: bool):
    """FPDT's recipe on one q segment (rows S..2S) and two kv blocks: forward merged, backward per
    block from the merged row. [out, dq, dk, dv] (fused; ``kern`` None: the math blocks)."""
    from lightning_longctx.attention import kernels as math

    b, s, _, d = q.shape
    docs = torch.tensor([[0] * (s // 3) + [1] * (2 * s - s // 3)] * b, device=q.device)
    specs = []
    for j in (0, 1):
        spec = MaskSpec(causal=True, q_start=s, k_start=j * s)
        if masked:
            spec = MaskSpec(causal=True, sliding_window=s // 2 + 7, q_start=s, k_start=j * s,
                            q_doc=docs[:, s:], k_doc=docs[:, j * s : (j + 1) * s])  # fmt: skip
        specs.append((slice(j * s, (j + 1) * s), spec, j == 1 and not masked))
    acc = None
    for ks, spec, causal in specs:
        if kern is None:
            blk = math.block_forward(q, k[:, ks], v[:, ks], scale=d**-0.5, mask=spec)
        else:
            bias = fused.additive_mask(spec, s, s, q.dtype, q.device) if masked else None
            blk = fused.block_forward(kern, q, k[:, ks], v[:, ks], scale=d**-0.5, causal=causal, bias=bias)
        acc = blk if acc is None else math.merge_blocks(*acc, *blk)
    out, lse = acc[0].to(q.dtype), acc[1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    delta = (dout.to(ct) * out.to(ct)).sum(-1).transpose(1, 2)
    grads = [torch.zeros(x.shape, dtype=ct, device=q.device) for x in (q, k, v)]
    for ks, spec, causal in specs:
        if kern is None:
            g = math.block_backward(dout, q, k[:, ks], v[:, ks], lse, delta, scale=d**-0.5, mask=spec)
        else:
            bias = fused.additive_mask(spec, s, s, q.dtype, q.device) if masked else None
            g = fused.block_backward(kern, dout, q, k[:, ks], v[:, ks], out, lse, scale=d**-0.5, causal=causal,
                                     bias=bias)  # fmt: skip
        grads[0] += g[0]
        grads[1][:, ks] += g[1]
        grads[2][:, ks] += g[2]
    return [out, *grads]


def _plain_row(q, k, v, dout, masked: bool):
    """Plain PyTorch in the inputs' dtype (autograd through a softmax) over the same row: [out, dq, dk, dv]."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    _, s, h, d = q.shape
    ke, ve = (x.repeat_interleave(h // k.shape[2], dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, ke) * d**-0.5
    qi, ki = torch.arange(s, 2 * s, device=q.device)[:, None], torch.arange(2 * s, device=q.device)[None]
    allowed = ki <= qi
    if masked:
        docs = (torch.arange(2 * s, device=q.device) >= s // 3).long()
        allowed = allowed & (ki > qi - (s // 2 + 7)) & (docs[s:, None] == docs[None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), ve)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("masked", [False, True], ids=["causal_full", "docs_window"])
def test_fused_blocks_on_device_within_2x_plain(name, masked):
    """Every fused block kind on this device vs float64 on the CPU: at most 2x the error of plain
    PyTorch in the same dtype on the same device, plus the floor (flash-attention's rule). In bf16 the
    fused op rounds each block's gradient to bf16 before FPDT sums them in fp32."""
    dtype = DTYPES[name]
    kern = fused.fused_kernel(DEVICE, dtype, bias=masked)
    if kern is None:
        pytest.skip(
            f"no fused kernel {'with a mask ' if masked else ''}on {DEVICE} {name}: math tiles serve it"
        )
    g = torch.Generator().manual_seed(7)
    b, s, h, h_kv, d = 2, 256, 8, 2, 64
    q, dout = (torch.randn(b, s, h, d, generator=g).to(dtype).double() for _ in range(2))
    k, v = (torch.randn(b, 2 * s, h_kv, d, generator=g).to(dtype).double() for _ in range(2))
    exact = _plain_row(q, k, v, dout, masked)
    assert (
        max((a - e).abs().max().item() for a, e in zip(_fused_recipe(None, q, k, v, dout, masked), exact))
        < 1e-10
    )
    on = [x.to(DEVICE, dtype) for x in (q, k, v, dout)]
    ours = _fused_recipe(kern, *on, masked)
    plain = _plain_row(*on, masked)
    for what, o, p, e in zip(("out", "dq", "dk", "dv"), ours, plain, exact):
        err_o, err_p = ((x.double().cpu() - e).abs().max().item() for x in (o, p))
        assert err_o <= 2 * err_p + FLOOR[name], (
            f"{kern.name} {what}: {err_o:.3g} vs plain {err_p:.3g} ({name})"
        )


def _fpdt_step(q, k, v, w, *, offload: bool, chunk: int):
    inp = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fpdt_attention(*inp, chunk_size=chunk, block_size=256, offload=offload)
    before_backward = torch.cuda.memory_allocated() if CUDA else 0
    host = offloaded_bytes()
    store = getattr(out.grad_fn, "store", None)  # the Function's ctx: host buffers when offloading
    pinned = None if store is None else all(t.is_pinned() for t in store._data.values())
    (out.float() * w).sum().backward()
    return [out.detach(), *(x.grad for x in inp)], before_backward, host, pinned


@pytest.mark.parametrize("side_stream", [False, True])
def test_fpdt_offload_bit_identical_with_streams_and_pinned_memory(side_stream):
    """offload=True (device->pinned host copies and prefetches on a side stream) == offload=False, bitwise."""
    n, chunk = (8192 if CUDA else 1024), 512 // (1 if CUDA else 4)  # 16 segments: chunks go out and come back
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, h, 64, generator=g).to(DEVICE, torch.bfloat16) for h in (8, 2, 2))
    w = torch.randn(1, n, 8, 64, generator=g).to(DEVICE)
    stream = torch.cuda.Stream() if (CUDA and side_stream) else None
    ctx = torch.cuda.stream(stream) if stream is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        base = torch.cuda.memory_allocated() if CUDA else 0
        plain, mem_plain, host_plain, _ = _fpdt_step(q, k, v, w, offload=False, chunk=chunk)
        with track_offload_residency() as residency:
            off, mem_off, host_off, pinned = _fpdt_step(q, k, v, w, offload=True, chunk=chunk)
    if CUDA:
        torch.cuda.synchronize()
    for a, b in zip(plain, off):
        assert torch.equal(a, b), "offload changed the result"
    assert host_plain == 0 and host_off > 0, (host_plain, host_off)
    assert offloaded_bytes() == 0, "host buffers not given back after backward"
    assert 1 <= residency.peak_resident["k"] <= 2, dict(residency.peak_resident)  # double buffer
    if CUDA:
        assert pinned is True, "offloaded chunks must live in pinned host memory"
        assert mem_off - base < mem_plain - base, (mem_off - base, mem_plain - base)


@pytest.mark.parametrize("name", list(DTYPES))
def test_chunked_loss_on_gpu(name):
    b, s, hdim, vocab = 2, 300, 64, 3000
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(b, s, hdim, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hdim, generator=g, dtype=torch.float64) / hdim**0.5
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[:, :37] = -100

    def run(h, wt, chunked: bool, device, dtype):
        h = h.detach().to(device, dtype, copy=True).requires_grad_()
        wt = wt.detach().to(device, dtype, copy=True).requires_grad_()
        lab = labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=name == "bf16"):
            if chunked:
                loss = chunked_lm_head_cross_entropy(h, wt, lab, chunk_size=128)
            else:
                logits = F.linear(h, wt).float()
                loss = F.cross_entropy(logits.view(-1, vocab), lab.view(-1), ignore_index=-100)
        loss.backward()
        return [loss.detach().double().cpu(), h.grad.double().cpu(), wt.grad.double().cpu()]

    exact = run(hidden, weight, False, torch.device("cpu"), torch.float64)
    ours = run(hidden, weight, True, DEVICE, torch.float32)
    plain = run(hidden, weight, False, DEVICE, torch.float32)
    for what, o, p, e in zip(("loss", "dhidden", "dweight"), ours, plain, exact):
        err_o, err_p = (o - e).abs().max().item(), (p - e).abs().max().item()
        assert err_o <= 2 * err_p + FLOOR[name], f"{what}: ours {err_o:.3g} vs plain {err_p:.3g} ({name})"


@pytest.mark.parametrize("name", list(DTYPES))
def test_tiled_mlp_on_gpu(name):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(4)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=256)).double()
    x = torch.randn(2, 333, 64, dtype=torch.float64)

    def run(module, device, dtype):
        module = copy.deepcopy(module).to(device, dtype if dtype == torch.float64 else torch.float32)
        inp = x.to(device, dtype if dtype == torch.float64 else torch.float32, copy=True).requires_grad_()
        with torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=name == "bf16" and dtype != torch.float64
        ):
            out = module(inp)
        out.float().square().sum().backward()
        grads = [inp.grad, *(p.grad for p in module.parameters())]
        return [t.detach().double().cpu() for t in (out, *grads)]

    exact = run(mlp, torch.device("cpu"), torch.float64)
    plain = run(mlp, DEVICE, torch.float32)
    ours = run(tile_mlp_(copy.deepcopy(mlp), 100), DEVICE, torch.float32)
    for i, (o, p, e) in enumerate(zip(ours, plain, exact)):
        err_o, err_p = (o - e).abs().max().item(), (p - e).abs().max().item()
        scale = e.abs().max().item()
        assert err_o <= 2 * err_p + FLOOR[name] * scale, f"tensor {i}: ours {err_o:.3g} vs plain {err_p:.3g}"


@pytest.mark.parametrize(
    "mode, offload",
    [("ulysses", False), ("fpdt", False), ("fpdt", True)],
    ids=["ulysses", "fpdt", "fpdt_offload"],
)
def test_hf_model_sequence_parallel_p1_matches_plain(mode, offload):
    """A tiny Llama patched for P=1 on the GPU: loss and every gradient equal the plain model's (fp32)."""
    plain = tiny_model("llama").to(DEVICE)
    patched = copy.deepcopy(plain)
    chunk = 16 if mode == "fpdt" else None
    enable_sequence_parallel(patched, mode=mode, chunk_size=chunk, offload=offload)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 64, (2, 64), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[:, :9] = -100
    want = plain(input_ids=ids, labels=labels).loss
    want.backward()
    got = patched(**shard_batch({"input_ids": ids, "labels": labels}, chunk_size=chunk)).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(plain.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_activation_offload_bit_identical_and_frees_device_memory():
    """activation_offload on the GPU: pinned host copies and side-stream prefetches give bitwise the loss
    and gradients of plain checkpointing, and the device holds fewer bytes after the forward (the layer
    inputs: layers x tokens x hidden x 4 B)."""
    from lightning_longctx.integrations.transformers import enable_activation_checkpointing

    layers, b, s = 4, 2, 2048 if CUDA else 128
    base = tiny_model("llama", layers=layers).to(DEVICE)
    enable_sequence_parallel(base, mode="fpdt", chunk_size=s // 4)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 64, (b, s), generator=g).to(DEVICE)
    batch = shard_batch({"input_ids": ids, "labels": ids.clone()}, chunk_size=s // 4)
    results = {}
    for offload in (False, True):
        model = copy.deepcopy(base)
        enable_activation_checkpointing(model, offload=offload)
        if CUDA:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if CUDA else 0
        loss = model(**batch).loss
        held = (torch.cuda.memory_allocated() - before) if CUDA else 0
        host = offloaded_bytes()
        with track_offload_residency() as residency:
            loss.backward()
        grads = [p.grad for p in model.parameters()]
        results[offload] = (loss.detach(), grads, held, host, residency.peak_resident.get("layer_input", 0))
        del loss, model
    (l0, g0, held0, host0, _), (l1, g1, held1, host1, fetched) = results[False], results[True]
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, c) for a, c in zip(g0, g1))
    inputs = layers * b * s * base.config.hidden_size * 4
    assert host0 == 0 and host1 == inputs and fetched == 2
    if CUDA:
        assert held0 - held1 >= inputs, (held0, held1, inputs)


@pytest.mark.parametrize("arch", ["qwen3_5", "bamba"])
def test_hybrid_adapters_on_the_device(arch):
    """Hybrid mixers (causal conv halo + gated DeltaNet / Mamba-2 state passing) on the device at P = 1 in the
    FPDT layout: 4 segments of 8 tokens, each joined to the one before by the adapters, against the plain
    model on the whole sequence (fp32: loss and every gradient)."""
    torch.manual_seed(0)
    ref = tiny_model(arch).to(DEVICE)
    sp = copy.deepcopy(ref)
    ids = torch.randint(1, 64, (2, 32), device=DEVICE)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    enable_sequence_parallel(sp, mode="fpdt", chunk_size=8)
    batch = shard_batch({"input_ids": ids, "labels": ids}, chunk_size=8)
    loss = sp(**batch).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    for (name, p), q in zip(ref.named_parameters(), sp.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4 * scale, name
