"""The self-test (``self_test.py``): the model as parallelized against itself with sequence parallelism off.

Negative controls: models that mix tokens where no swap can see it (a token shift in the MLP, a causal running
mean), a hybrid whose conv is reached through a helper the adapter does not rebind (transformers 5.25's failure
mode) and a broken collective (a permuted head order after the all-to-all). Each is refused with the right
module named, on every rank, before anything changed; and each trains silently wrong with ``self_test=False``.
A match leaves no trace: the trajectory is bit-identical with the check on and off.
"""

from __future__ import annotations

import contextlib
import types

import lightning as L
import pytest
import torch
import torch.distributed as dist

from helpers.hf_models import HFModule, TokenDataset, reference_training, tiny_model
from helpers.lightning import SEQ, lightning_env
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.parallel.self_test import TOLERANCE, SelfTestFailed, make_probe, probe_shape

MODES = {
    "ulysses": {},
    "fpdt": {"fpdt_chunk_size": 4},
    "ring": {"ring_size": 2},
}


def _token_shift(model):
    """Layer 0's MLP adds half of the previous token's input (RWKV-style "smear")."""
    mlp = model.model.layers[0].mlp
    own = mlp.forward

    def forward(self, x):
        previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        return own(x + 0.5 * previous)

    mlp.forward = types.MethodType(forward, mlp)
    return "model.layers.0.mlp"


def _running_mean(model):
    """Layer 1's MLP adds the causal running mean of its input: ``x + cumsum(x) / t``."""
    mlp = model.model.layers[1].mlp
    own = mlp.forward

    def forward(self, x):
        t = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return own(x + x.cumsum(1) / t)

    mlp.forward = types.MethodType(forward, mlp)
    return "model.layers.1.mlp"


CONTROLS = {"token_shift": _token_shift, "running_mean": _running_mean}


@contextlib.contextmanager
def _conv_behind_opaque_helper():
    """transformers 5.25's failure mode: Qwen3.5's gated DeltaNet reaches its causal conv through a helper the
    adapter cannot see into (here a wrapper defined outside transformers), so the conv runs on the shard. The
    symbol guard (``hf_symbols.check_symbols``) refuses this one at patch time; it is switched off here, as for
    a change no static check can see, to show that the self-test catches it where it runs."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    from lightning_longctx.integrations import transformers as patching

    own, guard = modeling.causal_conv1d_forward, patching.check_symbols

    def opaque(*args, **kwargs):
        return own(*args, **kwargs)

    modeling.causal_conv1d_forward = opaque
    patching.check_symbols = lambda model: None
    try:
        yield
    finally:
        modeling.causal_conv1d_forward, patching.check_symbols = own, guard


@contextlib.contextmanager
def _permuted_heads():
    """A broken collective: the query heads come out of Ulysses' all-to-all in reverse order."""
    from lightning_longctx.attention import ulysses

    own = ulysses.seq_to_head_packed

    def permuted(q, *rest, group=None):
        q_h, *others = own(q, *rest, group=group)
        return (q_h.flip(2), *others)

    ulysses.seq_to_head_packed = permuted
    try:
        yield
    finally:
        ulysses.seq_to_head_packed = own


def _fit(
    arch, sp, strategy_kwargs, control=None, breakage=None, steps=1, model_kwargs=None, precision="32-true"
):
    """One fit; returns ``(outcome, losses, state)``: ``outcome`` the refusal's message or ``None``."""
    lightning_env()
    world = dist.get_world_size()
    model = tiny_model(arch, **(model_kwargs or {}))
    if control is not None:
        CONTROLS[control](model)
    data = TokenDataset((world // sp) * steps, SEQ)
    module = HFModule(model, dataset=data)
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=sp, **strategy_kwargs),
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with breakage() if breakage is not None else contextlib.nullcontext():
        try:
            trainer.fit(module)
        except SelfTestFailed as err:
            unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            return str(err), unchanged, trainer.global_step
    if strategy_kwargs.get("data_parallel") == "fsdp":  # sharded: the checks the self-test ran
        return None, module.losses, [[c.dtype for c in r.checks] for r in trainer.strategy.self_test_reports]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return None, module.losses, state


def _silently_wrong(arch, control, result, steps=1):
    """The fit without the self-test against one process on the same modified model: its largest relative
    parameter error (what the self-test prevents)."""
    _, _, state = result
    ref = tiny_model(arch)
    if control is not None:
        CONTROLS[control](ref)
    reference_training(ref, TokenDataset(steps, SEQ), dp=1, batch_size=1, steps=steps)
    return max(
        ((state[k] - v).abs().max() / v.abs().max().clamp(min=1e-12)).item()
        for k, v in ref.state_dict().items()
    )


@pytest.mark.slow  # Trainer fits (the fast tier keeps the broken collective's and the probe's tests)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_token_mixing_outside_attention_is_refused(dist_pool, control, mode):
    pool = dist_pool(2)
    refused = pool.run(_fit, "llama", 2, MODES[mode], control)
    module = CONTROLS[control](tiny_model("llama"))
    for rank, (message, unchanged, step) in enumerate(refused):
        assert message is not None, f"rank {rank} trained: the self-test missed the {control}"
        assert f"): {module} (its inputs agree" in message, message
        assert unchanged and step == 0, f"rank {rank}: the model changed before the refusal"
    # and without the self-test it trains, silently wrong
    quiet = pool.run(_fit, "llama", 2, {**MODES[mode], "self_test": False}, control)
    assert quiet[0][0] is None
    assert _silently_wrong("llama", control, quiet[0]) > 1e-3


@pytest.mark.slow  # Trainer fits (the fast tier keeps the broken collective's and the probe's tests)
def test_fsdp_bf16_mixed_checks_in_float32_before_sharding(dist_pool):
    """FSDP2 computes in bf16 under bf16-mixed, where bf16's noise (up to 3e-2) hides a token shift (2e-2):
    the float32 check runs before FSDP2 shards the model, and refuses it there."""
    pool = dist_pool(2)
    fsdp = {"data_parallel": "fsdp"}
    for message, unchanged, step in pool.run(
        _fit, "llama", 2, fsdp, "token_shift", None, 1, None, "bf16-mixed"
    ):
        assert message is not None and "First diverging module (in float32): model.layers.0.mlp" in message
        assert unchanged and step == 0
    for message, _, checks in pool.run(_fit, "llama", 2, fsdp, None, None, 1, None, "bf16-mixed"):
        assert message is None and checks == [[torch.float32], [torch.bfloat16]], checks


@pytest.mark.slow  # Trainer fits (the fast tier keeps the broken collective's and the probe's tests)
def test_conv_behind_unrebound_helper_is_refused(dist_pool):
    import transformers
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    if not hasattr(modeling, "causal_conv1d_forward"):
        pytest.skip(
            f"transformers {transformers.__version__} calls the conv kernel itself: the helper came in 5.25"
        )
    pool = dist_pool(2)
    refused = pool.run(_fit, "qwen3_5", 2, {}, None, _conv_behind_opaque_helper)
    for message, unchanged, _ in refused:
        assert message is not None and "): model.layers.0.linear_attn (its inputs agree" in message, message
        assert unchanged
    quiet = pool.run(_fit, "qwen3_5", 2, {"self_test": False}, None, _conv_behind_opaque_helper)
    assert _silently_wrong("qwen3_5", None, quiet[0]) > 1e-3


def test_broken_collective_is_refused(dist_pool):
    refused = dist_pool(2).run(_fit, "llama", 2, {}, None, _permuted_heads)
    for message, unchanged, _ in refused:
        assert message is not None and "): model.layers.0.self_attn (its inputs agree" in message, message
        assert unchanged


def test_probe_chunk_shorter_than_the_configured_one_passes(dist_pool):
    """FPDT with a configured chunk longer than the probe's (64 against 8): the probe runs the model's own
    attention rebound to the probe's chunk (the attention binds its layout at patch time), no false refusal."""
    for message, _, _ in dist_pool(2).run(_fit, "llama", 2, {"fpdt_chunk_size": 64}):
        assert message is None, message


#: dynamic NTK RoPE past its 16 positions: the probe (32 tokens at world 4) makes it register a new ``inv_freq``
#: and move ``max_seq_len_cached``, both of which must come back
DYNAMIC_ROPE = {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}


@pytest.mark.slow  # Trainer fits (the fast tier keeps the broken collective's and the probe's tests)
@pytest.mark.parametrize(("world", "model_kwargs"), [(2, None), (4, DYNAMIC_ROPE)])
def test_a_match_leaves_no_trace(dist_pool, world, model_kwargs):
    """The same three steps with the self-test on and off: bit-identical losses and parameters."""
    pool = dist_pool(world)
    on = pool.run(_fit, "llama", world, {"fpdt_chunk_size": 4}, None, None, 3, model_kwargs)
    off = pool.run(
        _fit, "llama", world, {"fpdt_chunk_size": 4, "self_test": False}, None, None, 3, model_kwargs
    )
    for (_, losses_on, state_on), (_, losses_off, state_off) in zip(on, off):
        assert losses_on == losses_off
        for k in state_on:
            assert torch.equal(state_on[k], state_off[k]), k


def test_probe_crosses_every_boundary():
    """Two FPDT chunks per rank, halos held by every ring run, the document edge inside a shard."""
    from lightning_longctx.config import SequenceParallelConfig

    def resolved(**kw):
        return SequenceParallelConfig(**kw).resolve(world_size=4, devices_per_node=0, device_type="cpu")

    fpdt = probe_shape(resolved(sequence_parallel_size=4, fpdt_chunk_size=4096), halo=3, packed=True)
    assert (fpdt.length, fpdt.chunk) == (4 * 2 * 8, 8)
    assert fpdt.document_edge % (fpdt.length // 4) != 0  # not on a shard edge
    ring = probe_shape(resolved(sequence_parallel_size=4, ring_size=2), halo=6, packed=False)
    assert ring.length == 4 * 12 and ring.document_edge is None  # each zigzag run holds the conv's halo
    probe = make_probe({"input_ids": torch.arange(10)[None]}, fpdt)
    assert probe["input_ids"].shape == (1, 64) and int(probe["position_ids"][0, fpdt.document_edge]) == 0
    assert probe["labels"][0, fpdt.document_edge] == -100


def test_tolerances_cover_the_dtypes():
    assert TOLERANCE[torch.float32] < TOLERANCE[torch.bfloat16]
