"""Tiled MLP and chunked lm_head + loss equal their untiled versions in value and gradient."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers.launch import process_groups
from lightning_longctx import sequence_parallel_cross_entropy, shard_sequence
from lightning_longctx.ops.chunked_loss import chunked_lm_head_cross_entropy
from lightning_longctx.ops.tiling import is_tiled, tile_mlp_, tiled_forward, untile_mlp_


class SwiGLU(nn.Module):
    """Llama's MLP."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluDropout(nn.Module):
    """GPT-2 style MLP with dropout (the recompute must replay the same mask)."""

    def __init__(self, hidden: int, inter: int, p: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, inter)
        self.proj = nn.Linear(inter, hidden)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


def _grads(module: nn.Module, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xx = x.clone().requires_grad_()
    out = module(xx)
    (out * w).sum().backward()
    return (out.detach(), xx.grad, *(p.grad.clone() for p in module.parameters()))


@pytest.mark.parametrize("make", [lambda: SwiGLU(8, 24), lambda: GeluDropout(8, 24)], ids=["swiglu", "gelu"])
@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_tiled_mlp_equals_untiled(make, chunk):
    torch.manual_seed(0)
    mlp = make().double()
    x, w = torch.randn(2, 16, 8, dtype=torch.float64), torch.randn(2, 16, 8, dtype=torch.float64)
    want = _grads(mlp, x, w)
    tiled = tile_mlp_(copy.deepcopy(mlp), chunk)
    got = _grads(tiled, x, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert tiled.state_dict().keys() == mlp.state_dict().keys()


def test_tile_mlp_keeps_state_dict_and_untiles():
    mlp = SwiGLU(8, 24)
    keys = list(mlp.state_dict())
    tile_mlp_(mlp, 4)
    assert is_tiled(mlp) and list(mlp.state_dict()) == keys
    mlp.load_state_dict(SwiGLU(8, 24).state_dict())  # an untiled checkpoint loads unchanged
    clone = copy.deepcopy(mlp)  # the patched forward is rebound to the copy
    x = torch.randn(1, 6, 8)
    torch.testing.assert_close(clone(x), mlp(x))
    assert clone.forward.__self__ is clone
    tile_mlp_(mlp, 2)  # re-tiling changes the chunk size only
    torch.testing.assert_close(mlp(x), clone(x))
    untile_mlp_(mlp)
    assert not is_tiled(mlp) and "forward" not in mlp.__dict__
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), clone(x))
    with pytest.raises(ValueError, match="positive"):
        tile_mlp_(mlp, 0)


def test_public_untile_restores_an_instance_forward():
    """``lightning_longctx.untile_mlp_`` is the exported undo of ``tile_mlp_``: it puts back a forward that
    someone else installed on the instance, and does nothing to a module that is not tiled."""
    import lightning_longctx

    mlp = SwiGLU(8, 24)
    own = mlp.forward  # e.g. another library's wrapper, installed as an instance attribute
    mlp.forward = own
    assert lightning_longctx.tile_mlp_(mlp, 3) is mlp and is_tiled(mlp)
    x = torch.randn(2, 7, 8, requires_grad=True)
    tiled = mlp(x)
    tiled.sum().backward()
    assert x.grad is not None
    assert lightning_longctx.untile_mlp_(mlp) is mlp
    assert not is_tiled(mlp) and mlp.__dict__["forward"] is own
    torch.testing.assert_close(mlp(x), tiled)
    assert lightning_longctx.untile_mlp_(mlp) is mlp and mlp.__dict__["forward"] is own  # a no-op now


def test_tiled_mlp_dropout_replays_rng():
    """With dropout on, the tiled backward is the gradient of the tiled forward (same masks)."""
    torch.manual_seed(0)
    mlp = GeluDropout(8, 24, p=0.3).double().train()
    x, w = torch.randn(2, 16, 8, dtype=torch.float64), torch.randn(2, 16, 8, dtype=torch.float64)
    torch.manual_seed(1)
    ref_x = x.clone().requires_grad_()
    flat = ref_x.reshape(-1, 8)
    ref = torch.cat([mlp(flat[s : s + 5][None])[0] for s in range(0, 32, 5)]).view(2, 16, 8)
    (ref * w).sum().backward()
    ref_grads = [ref_x.grad, *(p.grad.clone() for p in mlp.parameters())]
    mlp.zero_grad()
    torch.manual_seed(1)
    got = _grads(tile_mlp_(mlp, 5), x, w)
    torch.testing.assert_close(got[0], ref.detach(), rtol=0, atol=0)
    for a, b in zip(got[1:], ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_tiled_forward_frozen_params_and_no_grad():
    mlp = SwiGLU(8, 24)
    mlp.gate_proj.weight.requires_grad_(False)
    x = torch.randn(3, 7, 8, requires_grad=True)
    out = tiled_forward(mlp, x, chunk_size=4, params=list(mlp.parameters()))
    out.sum().backward()
    assert mlp.gate_proj.weight.grad is None and mlp.up_proj.weight.grad is not None
    ref_x = x.detach().clone().requires_grad_()
    mlp.zero_grad()
    mlp(ref_x).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    with torch.no_grad():
        torch.testing.assert_close(tiled_forward(mlp, x, chunk_size=3), mlp(x))


def _loss_pair(hidden, weight, bias, labels, kw, chunk):
    """(loss, grads) of the chunked loss and of the plain logits + sequence_parallel_cross_entropy."""
    out = []
    for chunked in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        b = None if bias is None else bias.clone().requires_grad_()
        if chunked:
            loss = chunked_lm_head_cross_entropy(h, w, labels, bias=b, chunk_size=chunk, **kw)
        else:
            logits = F.linear(h, w, b)
            if kw.get("logit_scale") is not None:
                logits = logits * kw["logit_scale"]
            if kw.get("softcap"):
                logits = kw["softcap"] * torch.tanh(logits / kw["softcap"])
            loss = sequence_parallel_cross_entropy(logits, labels)
        loss.backward()
        out.append((loss.detach(), h.grad, w.grad, None if b is None else b.grad))
    return out


def _loss_inputs(case: str) -> tuple:
    """``(hidden (2, 24, 8), weight (40, 8), bias or None, labels (2, 24), logit kwargs)`` in float64, the
    same on every rank; every third target ignored."""
    g = torch.Generator().manual_seed(0)
    bsz, n, hid, vocab = 2, 24, 8, 40
    hidden = torch.randn(bsz, n, hid, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hid, generator=g, dtype=torch.float64)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) if case == "bias" else None
    labels = torch.randint(0, vocab, (bsz, n), generator=g)
    labels[:, ::3] = -100
    kw = dict(logit_scale=0.7, softcap=3.0) if case == "scale_softcap" else {}
    return hidden, weight, bias, labels, kw


def _check_loss(case: str, chunk: int) -> float:
    """Run on every rank of the pool with this rank's shard; max abs difference of loss and grads."""
    hidden, weight, bias, labels, kw = _loss_inputs(case)
    if case == "rank0_all_ignored" and dist.get_rank() == 0:
        labels[:] = -100
    h, y = shard_sequence(hidden), shard_sequence(labels)
    if case == "empty_shard":
        h, y = h[:, :0], y[:, :0]
    (loss, *grads), (ref_loss, *ref_grads) = _loss_pair(h, weight, bias, y, kw, chunk)
    assert loss.dtype == torch.float64 and torch.isfinite(loss)
    errs = [(loss - ref_loss).abs().item()]
    errs += [(a - b).abs().max().item() for a, b in zip(grads, ref_grads) if a is not None and a.numel()]
    return max(errs)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", ["plain", "bias", "scale_softcap", "rank0_all_ignored", "empty_shard"])
@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_chunked_loss_equals_untiled(dist_pool, world, case, chunk):
    for err in dist_pool(world).run(_check_loss, case, chunk):
        assert err < 1e-12, err


def _check_vocab_parallel(chunk: int, vocab_ranks: int) -> dict[str, float]:
    """The vocabulary-parallel loss (``vocab_group``: each rank holds ``V / t`` rows of the weight) against the
    full-weight chunked loss on the same tokens: loss, hidden gradient, this block's weight / bias gradient.
    Ranks ``[k t, (k+1) t)`` share a vocabulary group (tensor parallel, innermost); the others an sp group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with process_groups() as own:
        vocab_groups = [
            own(dist.new_group(list(range(k, k + vocab_ranks)))) for k in range(0, world, vocab_ranks)
        ]
        sp_groups = [own(dist.new_group(list(range(k, world, vocab_ranks)))) for k in range(vocab_ranks)]
        vocab_group, sp_group = vocab_groups[rank // vocab_ranks], sp_groups[rank % vocab_ranks]
        return {
            case: _vocab_parallel_error(case, chunk, vocab_ranks, vocab_group, sp_group)
            for case in ("plain", "bias", "scale_softcap")
        }


def _vocab_parallel_error(case, chunk, vocab_ranks, vocab_group, sp_group) -> float:
    rank = dist.get_rank()
    hidden, weight, bias, labels, kw = _loss_inputs(case)
    vocab = weight.shape[0]
    labels[0, 1:6] = 1  # targets all in the first rank's block
    h, y = shard_sequence(hidden, group=sp_group), shard_sequence(labels, group=sp_group)
    rows = slice(rank % vocab_ranks * vocab // vocab_ranks, (rank % vocab_ranks + 1) * vocab // vocab_ranks)
    out = []
    for shard in (False, True):
        hh = h.clone().requires_grad_()
        w = (weight[rows] if shard else weight).clone().requires_grad_()
        b = None if bias is None else (bias[rows] if shard else bias).clone().requires_grad_()
        loss = chunked_lm_head_cross_entropy(
            hh,
            w,
            y,
            bias=b,
            chunk_size=chunk,
            group=sp_group,
            vocab_group=vocab_group if shard else None,
            **kw,
        )
        loss.backward()
        grads = [w.grad if shard else w.grad[rows]] + (
            [] if b is None else [b.grad if shard else b.grad[rows]]
        )
        out.append((loss.detach(), hh.grad, *grads))
    return max((a - b).abs().max().item() for a, b in zip(*out))


@pytest.mark.parametrize("world,vocab_ranks", [(2, 2), (4, 2), (4, 4)])
def test_vocab_parallel_chunked_loss_equals_full_weight(dist_pool, world, vocab_ranks):
    for errors in dist_pool(world).run(_check_vocab_parallel, 7, vocab_ranks):
        assert max(errors.values()) < 1e-12, errors


def test_chunked_loss_all_ignored_is_zero_not_nan():
    h = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    loss = chunked_lm_head_cross_entropy(h, w, torch.full((2, 5), -100), chunk_size=3)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_chunked_loss_bf16_autocast_close_to_plain():
    torch.manual_seed(0)
    h, w = torch.randn(2, 16, 8, requires_grad=True), torch.randn(32, 8, requires_grad=True)
    y = torch.randint(0, 32, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_lm_head_cross_entropy(h, w, y, chunk_size=5)
        plain = sequence_parallel_cross_entropy(F.linear(h, w), y)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)  # same bf16 logits, fp32 softmax
    g_ours = torch.autograd.grad(ours, (h, w))
    g_plain = torch.autograd.grad(plain, (h, w))
    for a, b in zip(g_ours, g_plain):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_chunked_loss_bad_inputs():
    h, w = torch.randn(2, 5, 8), torch.randn(11, 8)
    with pytest.raises(ValueError, match="labels shape"):
        chunked_lm_head_cross_entropy(h, w, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(vocab, hidden\)"):
        chunked_lm_head_cross_entropy(h, w.t(), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="positive"):
        chunked_lm_head_cross_entropy(h, w, torch.zeros(2, 5, dtype=torch.long), chunk_size=0)
