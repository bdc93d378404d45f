"""Hybrid mixers: the two communication primitives against a one-process reference (P = 1, 2, 4; contiguous
and FPDT layouts; forward and backward in float64), and the patching rules (refusals, undo, deep copy).
Whole models: tests/arch_sweep.py (every hybrid, both modes) and tests/test_strategy.py (Trainer runs);
packed documents: tests/test_hybrid_packed.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_longctx import disable_sequence_parallel, enable_sequence_parallel, shard_batch
from lightning_longctx.integrations.hybrid import find_mixers
from lightning_longctx.parallel.comm import count_all_to_all, halo_exchange
from lightning_longctx.parallel.sharding import shard_sequence

B, CH, HALO = 2, 3, 2  # rows, channels, halo (a kernel of 3)
EXACT_HYBRIDS = (
    17  # of the sweep's 17 hybrid / attention-free models, at least this many are exact (P = 1, 4)
)


def _halo_case(n: int, chunk: int | None) -> dict[str, float]:
    """halo_exchange vs slicing the global sequence: the values, the gradient and the bytes sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(B, n, CH, dtype=torch.float64, requires_grad=True)
    seg = n // world if chunk is None else chunk
    n_seg = n // seg
    W = torch.randn(n_seg, B, HALO, CH, dtype=torch.float64)
    padded = torch.cat([x.new_zeros(B, HALO, CH), x], dim=1)
    ref = torch.stack([padded[:, g * seg : g * seg + HALO] for g in range(n_seg)])  # (G, b, HALO, ch)
    (ref * W).sum().backward()
    ref_grad, x.grad = x.grad.clone(), None

    local = shard_sequence(x, group=dist.group.WORLD, chunk_size=chunk)  # differentiable: a slice of x
    segs = local.unflatten(1, (-1, seg)).transpose(0, 1)  # (u, b, seg, ch), global segment i * P + rank
    mine = list(range(rank, n_seg, world))
    with count_all_to_all() as count:
        halo = halo_exchange(segs[:, :, -HALO:], dist.group.WORLD)  # (u, b, HALO, ch)
    (halo * W[mine]).sum().backward()
    grad = x.grad.clone()
    dist.all_reduce(grad)  # each rank's x.grad covers what its own segments fed
    expected_bytes = 0 if world == 1 else halo.numel() * halo.element_size()
    return {
        "forward": (halo - ref[mine]).abs().max().item(),
        "backward": (grad - ref_grad).abs().max().item(),
        "bytes_ok": float(count.exchange_bytes == expected_bytes),
    }


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("chunk", [None, 2])
def test_halo_exchange_matches_the_global_sequence(dist_pool, world, chunk):
    for errs in dist_pool(world).run(_halo_case, 16, chunk):
        assert errs["forward"] == 0.0 and errs["backward"] < 1e-12, errs
        assert errs["bytes_ok"] == 1.0, "the exchange counter must equal the halo's bytes"


def _scan_case(n_seg_per_rank: int, kind: str) -> dict[str, float]:
    """exclusive_affine_scan (its default, strided order: global segment g = i * P + rank) vs the sequential
    fold over all segments in global order, and its gradients."""
    from helpers.reference import affine_scan_errors
    from lightning_longctx.parallel.comm import strided_order

    order = strided_order(dist.get_world_size(), n_seg_per_rank)
    return affine_scan_errors(order, kind, rows=B, pass_order=False)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("kind", ["dense", "scalar"])
def test_exclusive_affine_scan_matches_the_sequential_fold(dist_pool, world, segments, kind):
    for errs in dist_pool(world).run(_scan_case, segments, kind):
        assert max(errs.values()) < 1e-12, errs


# ---- patching rules --------------------------------------------------------------------------------


def _hybrid(seed: int = 0) -> nn.Module:
    from helpers.hf_models import tiny_model

    return tiny_model("qwen3_5", seed=seed)


def test_undo_and_deep_copy():
    model = _hybrid()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    enable_sequence_parallel(model)
    mixers = find_mixers(model)
    assert [type(m).__name__ for m in mixers] == ["Qwen3_5GatedDeltaNet"]
    assert "forward" in mixers[0].__dict__
    twin = copy.deepcopy(model)  # a deep copy calls its own mixers' copies, not the original's
    twin_mixer = find_mixers(twin)[0]
    assert twin_mixer.forward.__self__ is twin_mixer
    assert twin_mixer._longctx_forward.__self__ is twin_mixer
    ids = torch.randint(1, 60, (1, 8))
    out = twin(
        input_ids=ids, labels=ids, shift_labels=torch.roll(ids, -1, 1), position_ids=torch.arange(8)[None]
    )
    assert torch.isfinite(out.loss)
    disable_sequence_parallel(model)
    after = {name: dict(m.__dict__) for name, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name].keys() == before[name].keys(), f"{name} kept patched attributes"


def unadapted_scan(x: torch.Tensor) -> torch.Tensor:  # a "kernel" of a modeling file we have no adapter for
    return x.cumsum(1)


unadapted_scan.__wrapped__ = unadapted_scan.__code__  # what the hub-kernel decorator leaves
unadapted_scan.__module__ = "transformers.models.fake.modeling_fake"


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    return x


class _HalfAdaptedMixer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return unadapted_scan(causal_conv1d_fn(x, torch.ones(1, 2)))


class _MixerContext:  # the fields MixerCall reads
    group = None
    ring = 1
    chunk_size = None
    call_position_ids = None
    positions = None
    mixer_calls = 0

    def __init__(self) -> None:
        from lightning_longctx.integrations.transformers import _config_of

        self.config = _config_of(None, "ulysses", None, False, "auto", None, None)

    def local_chunk(self, n: int) -> None:
        return None


class _SometimesMixer(nn.Module):
    def forward(self, x: torch.Tensor, mix: bool = True) -> torch.Tensor:
        return causal_conv1d_fn(x, torch.ones(x.shape[1], 2)) if mix else x


def test_a_mixer_with_an_unadapted_kernel_is_refused():
    with pytest.raises(
        ValueError, match=r"_HalfAdaptedMixer calls unadapted_scan, which has no sequence-parallel"
    ):
        find_mixers(nn.Sequential(_HalfAdaptedMixer()))


def test_a_mixer_call_that_skips_its_kernels_raises():
    from lightning_longctx.integrations.hybrid import patch_mixers, unpatch_mixers

    mixer = _SometimesMixer()
    patched = patch_mixers(nn.Sequential(mixer), _MixerContext())
    x = torch.randn(1, 3, 5)
    assert torch.equal(mixer(x), x)  # the adapter ran: a halo of zeros, then the model's own function
    with pytest.raises(RuntimeError, match="ran without its sequence-parallel kernels"):
        mixer(x, mix=False)
    unpatch_mixers(patched)
    assert "forward" not in mixer.__dict__


def conv_helper(x: torch.Tensor) -> torch.Tensor:  # transformers >= 5.25's causal_conv1d_forward, in short
    return causal_conv1d_fn(x, torch.ones(x.shape[1], 2))


conv_helper.__module__ = "transformers.models.fake.modeling_fake"


def _func_module(fn) -> nn.Module:
    """What ``kernels``' ``use_kernel_forward_from_hub`` turns a function into: a module instance whose class's
    forward closes over it (transformers >= 5.25 installs ``kernels``)."""

    class Func(nn.Module):
        kernel_layer_name = fn.__name__ if fn is not None else "opaque"

        def forward(self, *args, **kwargs):
            return fn(*args, **kwargs)

    return Func()


conv_module = _func_module(conv_helper)
opaque_module = _func_module(None)


class _HelperMixer(nn.Module):  # reaches its kernel only through a helper: plain, then as a kernels module
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv_module(conv_helper(x))


class _OpaqueMixer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return opaque_module(causal_conv1d_fn(x, torch.ones(1, 2)))


def test_a_kernel_reached_through_a_helper_is_adapted():
    """A mixer whose kernel call sits in a helper of its modeling file (transformers 5.25 moved every short
    conv into ``causal_conv1d_forward``) is found, and the helper runs with the adapter; a kernels function
    module whose function cannot be read is refused as a kernel nobody adapted."""
    from lightning_longctx.integrations.hybrid import patch_mixers, unpatch_mixers

    mixer = _HelperMixer()
    assert find_mixers(nn.Sequential(mixer)) == [mixer]
    patched = patch_mixers(nn.Sequential(mixer), _MixerContext())
    x = torch.randn(1, 3, 5)
    assert torch.equal(mixer(x), x)
    assert patched[0].call.kernel_calls == 2  # both paths reached the adapter
    unpatch_mixers(patched)
    with pytest.raises(ValueError, match=r"_OpaqueMixer calls opaque_module, which has no sequence-parallel"):
        find_mixers(nn.Sequential(_OpaqueMixer()))


def test_hub_kernels_cannot_erase_the_patches(tmp_path):
    """transformers >= 5.25 kernelizes what ``from_pretrained`` loads and again at every train() / eval()
    switch, deleting instance forwards of hub-decorated modules (gated DeltaNet, the norms). Sequence
    parallelism turns the hub kernels off, keeps its forwards across the switches, refuses a model kernelized
    again, and turns them back on when undone."""
    pytest.importorskip("kernels")
    from transformers import AutoModelForCausalLM

    from lightning_longctx.ops.tiling import is_tiled

    _hybrid().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    if not getattr(model, "use_kernels", False):
        pytest.skip("this transformers does not kernelize what from_pretrained loads")
    enable_sequence_parallel(model, mode="fpdt", chunk_size=4)  # FPDT: the MLPs and norms tiled too
    assert model.use_kernels is False
    model.eval()
    model.train()
    mixer = find_mixers(model)[0]
    assert mixer.forward.__func__.__name__ == "_checked_forward"
    tiled = [m for m in model.modules() if is_tiled(m)]
    assert tiled and all("forward" in m.__dict__ for m in tiled)
    ids = torch.randint(1, 60, (1, 8))
    batch = dict(
        input_ids=ids, labels=ids, shift_labels=torch.roll(ids, -1, 1), position_ids=torch.arange(8)[None]
    )
    assert torch.isfinite(model(**batch).loss)
    model.use_kernels = True
    with pytest.raises(RuntimeError, match="was kernelized"):
        model(**batch)
    model.use_kernels = False
    disable_sequence_parallel(model)
    assert model.use_kernels is True


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("mode", ["ulysses", "fpdt"])
def test_hybrids_at_one_and_four_ranks(dist_pool, mode, world):
    """The sweep's hybrid and attention-free models at P = 1 and 4 (the sweep itself runs P = 2): exact or
    refused, never wrong. P = 4: 8 tokens per rank, FPDT in 2 chunks of 4; P = 1: FPDT in 8 segments of 4 joined
    by the adapters on one rank."""
    from arch_sweep import HYBRIDS, sweep

    rows = dist_pool(world).run(sweep, mode, list(HYBRIDS))[0]
    wrong = [(r["arch"], r["reason"], r.get("bad_params", [])[:4]) for r in rows if r["verdict"] == "WRONG"]
    assert not wrong, wrong
    assert sum(r["verdict"] == "exact" for r in rows) >= EXACT_HYBRIDS, [
        (r["arch"], r["verdict"]) for r in rows
    ]


#: Trainer runs a hybrid refuses on EVERY rank before the forward (fuzz finds, tests/fuzz_strategy.py)
REFUSED_RUNS = {
    # a chunk shorter than the conv's halo, refused at patch time (inside the forward, FSDP's teardown broke)
    "olmo_hybrid_fsdp_offload_chunk_below_halo": ("fpdt_chunk_size >= 3", dict(
        arch="olmo_hybrid", world=1, sp=1, seq=16, fpdt_chunk_size=2, offload=True, activation_offload=True,
        data_parallel="fsdp", cpu_offload=True, seed=1)),
    # Ulysses with 2 tokens per rank: a segment shorter than the halo, refused before the forward
    "qwen3_5_sp4_two_tokens_per_rank": ("needs the last 3 tokens", dict(
        arch="qwen3_5_text", world=4, sp=4, seq=8, data_parallel="fsdp", seed=3)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSED_RUNS))
def test_trainer_refuses_on_every_rank(dist_pool, name):
    from fuzz_common import run_verdict
    from fuzz_strategy import TIMEOUT_S, TOLERANCE, StratCase, run_strategy

    expected, fields = REFUSED_RUNS[name]
    case = StratCase(**fields)
    verdict = run_verdict(dist_pool, case.world, run_strategy, case, TOLERANCE, TIMEOUT_S)
    assert verdict.kind == "refused" and expected in verdict.detail, verdict


def _inference_losses(mode: str) -> dict[str, float]:
    """Every hybrid's loss under ``torch.inference_mode`` (validation), SP against one process: relative error."""
    from arch_sweep import HYBRIDS, MODES, arch_by_name, build_model, make_batch

    errors = {}
    for name in HYBRIDS:
        model = build_model(arch_by_name(name)).eval()
        batch = make_batch()
        with torch.inference_mode():
            ref = model(**batch).loss.item()
            enable_sequence_parallel(model, group=dist.group.WORLD, mode=mode, chunk_size=MODES[mode])
            try:
                got = model(**shard_batch(batch, group=dist.group.WORLD, chunk_size=MODES[mode])).loss.item()
            finally:
                disable_sequence_parallel(model)
        errors[name] = abs(got - ref) / abs(ref)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ulysses", "fpdt"])
def test_hybrids_under_inference_mode(dist_pool, mode):
    """Validation runs the adapters under ``torch.inference_mode`` (no autograd graph, inference tensors)."""
    for errors in dist_pool(2).run(_inference_losses, mode):
        assert max(errors.values()) < 1e-5, errors
