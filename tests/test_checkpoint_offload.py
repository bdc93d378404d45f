"""Host-offloaded activation checkpoints: bit-identical results, and what stays resident.

"Resident" is proved without timing or RSS (on a CPU the host IS the device): each decoder layer's
input tensor is watched through a weak reference. With offload it is gone after the forward (the
autograd graph keeps only the host copy, whose bytes ``offloaded_bytes()`` counts exactly); without,
the graph keeps it. In backward ``track_offload_residency`` counts the device copies fetched back:
never more than two (the layer being recomputed and the one prefetched for the layer before it).
Parity with a single process under the strategy (P = 1, 2, 4, FPDT offload, FSDP) is in
``test_strategy.py``.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.distributed as dist

from helpers.hf_models import checkpointing_state, tiny_model
from lightning_longctx import UlyssesFPDTStrategy, enable_sequence_parallel, shard_batch
from lightning_longctx.attention.offload import offloaded_bytes, track_offload_residency
from lightning_longctx.integrations.transformers import enable_activation_checkpointing
from lightning_longctx.ops.activation_offload import OffloadedCheckpoint

B, S, LAYERS = 2, 24, 3


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 64, (B, S), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids, "labels": labels}


def _step(model: torch.nn.Module, batch: dict, offload: bool) -> dict:
    """Forward + backward with checkpointing (offloaded or not): loss, gradients and residency facts."""
    model = copy.deepcopy(model)
    model.train()
    enable_activation_checkpointing(model, offload=offload)
    inputs: list[weakref.ref] = []

    def watch(module, args, kwargs):
        inputs.append(weakref.ref(args[0] if args else kwargs["hidden_states"]))

    hooks = [layer.register_forward_pre_hook(watch, with_kwargs=True) for layer in model.model.layers]
    out = model(**batch)
    for h in hooks:
        h.remove()
    alive = [ref() is not None for ref in inputs]
    held = offloaded_bytes()
    with track_offload_residency() as residency:
        out.loss.backward()
    loss = out.loss.detach()
    del out
    return {
        "loss": loss,
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "alive": alive,
        "held": held,
        "fetched_at_once": residency.peak_resident.get("layer_input", 0),
        "held_after": offloaded_bytes(),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_offload_is_bit_identical_and_frees_the_layer_inputs(dtype):
    model = tiny_model("llama", layers=LAYERS, kv_heads=2).to(dtype)
    batch = _batch()
    plain, offloaded = _step(model, batch, offload=False), _step(model, batch, offload=True)
    assert torch.equal(plain["loss"], offloaded["loss"])
    for name, grad in plain["grads"].items():
        assert torch.equal(grad, offloaded["grads"][name]), name
    # without offload the graph keeps every layer's input; with it none, and the host holds exactly them
    assert plain["alive"] == [True] * LAYERS and plain["held"] == 0
    assert offloaded["alive"] == [False] * LAYERS
    hidden = model.config.hidden_size
    assert offloaded["held"] == LAYERS * B * S * hidden * torch.finfo(dtype).bits // 8
    assert offloaded["fetched_at_once"] == 2  # double buffer: recomputed layer + the prefetched one
    assert offloaded["held_after"] == 0  # backward freed the graph, and with it the host copies


def _sp_offload_is_bit_identical(mode: str) -> dict:
    """Under sequence parallelism (FPDT with its own offload, or Ulysses): activation offload on vs off."""
    chunk = 2 if mode == "fpdt" else None
    model = tiny_model("qwen2", layers=LAYERS, kv_heads=1)
    enable_sequence_parallel(
        model, group=dist.group.WORLD, mode=mode, chunk_size=chunk, offload=mode == "fpdt"
    )
    batch = shard_batch(_batch(), chunk_size=chunk)
    plain, offloaded = _step(model, batch, offload=False), _step(model, batch, offload=True)
    same = torch.equal(plain["loss"], offloaded["loss"]) and all(
        torch.equal(g, offloaded["grads"][n]) for n, g in plain["grads"].items()
    )
    return {"same": same, "alive": offloaded["alive"], "fetched": offloaded["fetched_at_once"]}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # world 4: ~14 s
@pytest.mark.parametrize("mode", ["ulysses", "fpdt"])
def test_offload_is_bit_identical_under_sequence_parallelism(dist_pool, world, mode):
    for result in dist_pool(world).run(_sp_offload_is_bit_identical, mode):
        assert result == {"same": True, "alive": [False] * LAYERS, "fetched": 2}


def test_reentrant_checkpointing_and_bad_settings_are_refused():
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        OffloadedCheckpoint()(torch.tanh, x, use_reentrant=True)
    with pytest.raises(ValueError, match=r"activation_offload='yes': use True or False"):
        UlyssesFPDTStrategy(activation_offload="yes")


def test_enable_returns_an_undo_that_restores_the_model_as_it_came():
    """The strategy undoes what it enabled at teardown: plain model -> no checkpointing, no input-grad hook;
    a model that checkpointed already (CausalLM's flag) -> its own checkpoint function back."""

    model = tiny_model("llama")
    plain = checkpointing_state(model)
    undo = enable_activation_checkpointing(model, offload=True)
    assert any(flag for _, flag, _ in checkpointing_state(model)[:-1]) and checkpointing_state(model) != plain
    undo()
    assert checkpointing_state(model) == plain and not any(
        flag for _, flag, _ in checkpointing_state(model)[:-1]
    )
    enable_activation_checkpointing(model)  # the model's own checkpointing
    own = checkpointing_state(model)
    undo = enable_activation_checkpointing(model, offload=True)
    assert any(isinstance(fn, OffloadedCheckpoint) for _, _, fn in checkpointing_state(model)[:-1])
    undo()
    assert checkpointing_state(model) == own
