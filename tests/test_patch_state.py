"""A patched model's state lives in its own context; disable_sequence_parallel restores the model."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers import AttentionInterface

from helpers.hf_models import tiny_model
from lightning_longctx import disable_sequence_parallel, enable_sequence_parallel, shard_batch
from lightning_longctx.integrations.transformers import context_of
from lightning_longctx.ops.tiling import is_tiled


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("mode,chunk", [("ulysses", None), ("fpdt", 4)])
def test_disable_restores_the_plain_model_and_unregisters_its_key(mode, chunk):
    model = tiny_model("llama")
    before = model.config._attn_implementation
    plain = model(**_batch())

    enable_sequence_parallel(model, mode=mode, chunk_size=chunk)
    ctx = context_of(model)
    assert ctx is not None and ctx.key in AttentionInterface().keys()
    assert model.config._attn_implementation == ctx.key and model.config.use_cache is False
    patched = model(**shard_batch(_batch(), chunk_size=chunk))  # one process: the shard is the batch
    torch.testing.assert_close(patched.loss, plain.loss, rtol=1e-6, atol=1e-6)
    assert any(is_tiled(m) for m in model.modules()) == (mode == "fpdt")
    if mode == "fpdt":  # the MLPs and every norm (each layer's two and the final one)
        tiled = [type(m).__name__ for m in model.modules() if is_tiled(m)]
        layers = model.config.num_hidden_layers
        assert sorted(tiled) == sorted(["LlamaMLP"] * layers + ["LlamaRMSNorm"] * (2 * layers + 1))

    assert disable_sequence_parallel(model) is model
    assert context_of(model) is None and ctx.key not in AttentionInterface().keys()
    assert model.config._attn_implementation == before and model.config.use_cache is True
    assert "forward" not in model.__dict__ and "_loss_function" not in model.__dict__
    assert not any(is_tiled(m) for m in model.modules())
    again = model(**_batch())
    assert torch.equal(again.logits, plain.logits) and torch.equal(again.loss, plain.loss)
    assert disable_sequence_parallel(model) is model  # a plain model is returned unchanged


def test_keys_are_per_model_and_released():
    models = [enable_sequence_parallel(tiny_model("llama")) for _ in range(3)]
    keys = [context_of(m).key for m in models]
    assert len(set(keys)) == 3
    for m in models:
        disable_sequence_parallel(m)
    assert not set(keys) & set(AttentionInterface().keys())


def test_patching_twice_is_refused_and_copies_share_the_context():
    model = enable_sequence_parallel(tiny_model("llama"))
    with pytest.raises(ValueError, match="already sequence-parallel; call disable_sequence_parallel"):
        enable_sequence_parallel(model, mode="fpdt", chunk_size=4)
    clone = copy.deepcopy(model)
    assert context_of(clone) is context_of(model)
    with pytest.raises(
        TypeError, match=r"cannot be pickled; call lightning_longctx\.disable_sequence_parallel"
    ):
        pickle.dumps(model)
    disable_sequence_parallel(model)
    pickle.dumps(model)  # a plain model pickles again
