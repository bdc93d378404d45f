"""One test per entry of docs/troubleshooting.md that is not already covered next to its feature.

Each entry either gives the exact single-device result or raises an error naming value, rule, fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.hf_models import tiny_model
from helpers.lightning import compare_to_reference, fit_hf
from lightning_longctx import UlyssesFPDTStrategy, enable_sequence_parallel
from lightning_longctx.parallel.mesh import ParallelDims


@pytest.mark.parametrize(
    "name,arch,strategy_kwargs,model_kwargs",
    [
        ("mistral_sliding_window_ulysses", "mistral", {}, {"sliding_window": 5}),
        ("mistral_sliding_window_fpdt", "mistral", {"fpdt_chunk_size": 4}, {"sliding_window": 5}),
        ("gemma2_softcap_and_window_ulysses", "gemma2", {}, {}),
        ("gemma2_softcap_and_window_fpdt", "gemma2", {"fpdt_chunk_size": 4}, {}),
    ],
)
def test_sliding_window_and_softcap_are_honoured(dist_pool, name, arch, strategy_kwargs, model_kwargs):
    results = dist_pool(2).run(fit_hf, arch, 2, 2, strategy_kwargs, model_kwargs)
    compare_to_reference(results, arch, 2, 2, 2, model_kwargs)


def _direct_call_errors():
    model = enable_sequence_parallel(tiny_model("llama"), group=dist.group.WORLD)
    ids = torch.randint(0, 64, (1, 8))
    msgs = []
    try:
        model(input_ids=ids, labels=ids)  # a batch that never went through shard_batch
    except ValueError as e:
        msgs.append(str(e))
    dropout = enable_sequence_parallel(
        tiny_model("llama", attention_dropout=0.1), group=dist.group.WORLD
    ).train()
    try:
        dropout(input_ids=ids)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_unsharded_labels_and_attention_dropout_are_refused(dist_pool):
    for msgs in dist_pool(2).run(_direct_call_errors):
        assert "without `shift_labels`" in msgs[0] and "shard_batch" in msgs[0]
        assert "attention dropout 0.1" in msgs[1] and "attention_dropout=0.0" in msgs[1]


def test_layout_errors_and_cross_node_detection():
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 must divide the world size 8"):
        ParallelDims(world_size=8, sp=3)
    layout = ParallelDims(world_size=16, sp=16, devices_per_node=8)
    assert layout.spans_nodes and layout.dp == 1
    assert not ParallelDims(world_size=16, sp=8, devices_per_node=8).spans_nodes
    assert (
        ParallelDims(world_size=16, sp=8).sp_rank(13) == 5
        and ParallelDims(world_size=16, sp=8).dp_rank(13) == 1
    )


def test_unknown_backend_and_mode_are_refused():
    with pytest.raises(ValueError, match="mode='ring' is unknown"):
        enable_sequence_parallel(tiny_model("llama"), mode="ring")
    with pytest.raises(ValueError, match="mode='fpdt' needs chunk_size"):
        enable_sequence_parallel(tiny_model("llama"), mode="fpdt")
    with pytest.raises(TypeError, match="expects a transformers PreTrainedModel"):
        enable_sequence_parallel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="fpdt_chunk_size=0"):
        UlyssesFPDTStrategy(fpdt_chunk_size=0)
