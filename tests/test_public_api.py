"""The public API (`lightning_longctx.__all__`, README.md "Use") is a contract: changing it must be deliberate."""

from __future__ import annotations

import inspect

import lightning_longctx
from lightning_longctx import callbacks
from lightning_longctx.attention import fpdt_attention, ulysses_attention

PUBLIC = {
    "CausalLM",
    "UlyssesFPDTStrategy",
    "__version__",
    "callbacks",
    "chunked_lm_head_cross_entropy",
    "disable_sequence_parallel",
    "enable_activation_checkpointing",
    "enable_sequence_parallel",
    "fpdt_attention",
    "gather_sequence",
    "longest_sequence",
    "plan_memory",
    "sequence_parallel_cross_entropy",
    "shard_batch",
    "shard_sequence",
    "tile_mlp_",
    "ulysses_attention",
    "untile_mlp_",
}


def test_all_is_frozen():
    assert set(lightning_longctx.__all__) == PUBLIC
    assert {"MFUMonitor", "MemoryMonitor"} <= set(callbacks.__all__)


def test_contract_signatures():
    def params(fn):
        return list(inspect.signature(fn).parameters)

    assert params(ulysses_attention)[:8] == [
        "q", "k", "v", "group", "causal", "softmax_scale", "position_ids", "backend"
    ]  # fmt: skip
    assert {"group", "chunk_size", "causal", "softmax_scale", "position_ids", "offload", "backend"} <= set(
        params(fpdt_attention)
    )
    assert params(lightning_longctx.shard_batch)[:4] == ["batch", "group", "chunk_size", "ignore_index"]
    assert params(lightning_longctx.sequence_parallel_cross_entropy)[:4] == [
        "logits", "shift_labels", "group", "ignore_index"
    ]  # fmt: skip
    strategy = params(lightning_longctx.UlyssesFPDTStrategy)
    assert strategy[:4] == ["sequence_parallel_size", "fpdt_chunk_size", "offload", "attention_backend"]
    assert params(callbacks.MFUMonitor)[0] == "peak_flops"


def test_version_comes_from_package_metadata():
    from importlib.metadata import version

    assert lightning_longctx.__version__ == version("lightning-longctx")
