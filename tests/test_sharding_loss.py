"""shard_batch / shard_sequence / gather_sequence and the exact global loss, on gloo (P = 1, 2, 4)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_longctx import gather_sequence, sequence_parallel_cross_entropy, shard_batch, shard_sequence


def _roundtrip(chunk_size):
    x = torch.arange(2 * 48 * 3).view(2, 48, 3)
    local = shard_sequence(x, chunk_size=chunk_size)
    back = gather_sequence(local, chunk_size=chunk_size)
    return torch.equal(back, x), local[0, :, 0] // 3


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("chunk_size", [None, 2, 3, 6])
def test_roundtrip_and_layout(dist_pool, world, chunk_size):
    results = dist_pool(world).run(_roundtrip, chunk_size)
    for rank, (ok, token_index) in enumerate(results):
        assert ok
        if chunk_size is None:
            n = 48 // world
            assert token_index.tolist() == list(range(rank * n, (rank + 1) * n))
        else:  # rank r holds chunks r, r+P, r+2P, ...
            expect = [
                c * chunk_size + t for c in range(rank, 48 // chunk_size, world) for t in range(chunk_size)
            ]
            assert token_index.tolist() == expect


def _shard_batch(n, chunk_size, with_mask):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (2, n), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels, "meta": "kept"}
    if with_mask:
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, -2:] = 0
        batch["attention_mask"] = mask
    out = shard_batch(batch, chunk_size=chunk_size)
    full = {
        k: gather_sequence(v, chunk_size=chunk_size) for k, v in out.items() if isinstance(v, torch.Tensor)
    }
    return full, out["meta"], out["input_ids"].shape


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("n,chunk_size", [(16, None), (13, None), (16, 2), (21, 2)])
def test_shard_batch_shift_pad_positions(dist_pool, world, n, chunk_size):
    results = dist_pool(world).run(_shard_batch, n, chunk_size, True)
    multiple = world * (chunk_size or 1)
    n_pad = -(-n // multiple) * multiple
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (2, n), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    for full, meta, local_shape in results:
        assert meta == "kept" and local_shape == (2, n_pad // world)
        assert torch.equal(full["input_ids"][:, :n], ids) and (full["input_ids"][:, n:] == 0).all()
        expected_shift = torch.full((2, n_pad), -100)
        expected_shift[:, : n - 1] = labels[:, 1:]
        assert torch.equal(full["shift_labels"], expected_shift)
        assert torch.equal(full["labels"], expected_shift)  # kept so HF computes a loss, pre-shifted
        assert torch.equal(full["position_ids"], torch.arange(n_pad).expand(2, n_pad))
        assert full["attention_mask"][1, n - 2 :].sum() == 0 and full["attention_mask"][0, :n].all()


def test_shard_batch_errors_without_group():
    with pytest.raises(ValueError, match="dict batch with 'input_ids'"):
        shard_batch({"inputs_embeds": torch.zeros(1, 4, 2)})
    with pytest.raises(ValueError, match="only a 2-D padding mask"):
        shard_batch(
            {"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.ones(1, 1, 4, 4)}
        )
    with pytest.raises(ValueError, match="left padding"):
        shard_batch(
            {"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1]])}
        )
    with pytest.raises(ValueError, match="labels shape"):
        shard_batch(
            {"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 5, dtype=torch.long)}
        )


def _loss(n, ignore_rank_shard):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, n, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, n), generator=g)
    labels[:, ::3] = -100
    if ignore_rank_shard:  # everything rank 0 holds is ignored
        labels[:, : n // world] = -100
    ref_logits = logits.clone().requires_grad_()
    # single-device mean over valid targets; defined as 0 when there are none (torch gives NaN)
    ref_sum = F.cross_entropy(ref_logits.view(-1, 11), labels.view(-1), ignore_index=-100, reduction="sum")
    ref = ref_sum / max(int((labels != -100).sum()), 1)
    ref.backward()
    local = shard_sequence(logits).requires_grad_()
    loss = sequence_parallel_cross_entropy(local, shard_sequence(labels))
    loss.backward()
    return (
        abs(loss.item() - ref.item()),
        (gather_sequence(local.grad) - ref_logits.grad).abs().max().item(),
        bool(torch.isfinite(local.grad).all()),
        local.grad.abs().max().item() if rank == 0 else None,
    )


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("ignore_rank_shard", [False, True])
def test_global_loss_value_and_gradient(dist_pool, world, ignore_rank_shard):
    results = dist_pool(world).run(_loss, 16, ignore_rank_shard)
    for loss_err, grad_err, finite, _rank0_grad in results:
        assert loss_err < 1e-12 and grad_err < 1e-12 and finite
    if ignore_rank_shard and world > 1:
        assert results[0][3] == 0.0


def _all_ignored():
    logits = torch.randn(1, 4, 5, requires_grad=True)
    loss = sequence_parallel_cross_entropy(logits, torch.full((1, 4), -100))
    loss.backward()
    return loss.item(), logits.grad.abs().max().item()


def test_all_ignored_is_zero_not_nan(dist_pool):
    for value, grad in dist_pool(2).run(_all_ignored):
        assert value == 0.0 and grad == 0.0
