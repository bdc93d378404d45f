"""Packed documents are a per-batch value: computed where the batch is sharded, carried on the model's
context, never gathered again per layer, and nothing about them outlives the batch in module state."""

from __future__ import annotations

import torch
import torch.distributed as dist

import lightning_longctx.attention.ulysses as ulysses_mod
import lightning_longctx.parallel.layout as layout_mod
from helpers.reference import packed_positions, reference_attention
from lightning_longctx import gather_sequence, shard_sequence
from lightning_longctx.attention import fpdt_attention, ulysses_attention
from lightning_longctx.parallel.sharding import document_ids, global_positions


class _CountGathers:
    """Counts the position all-gathers of the attention paths and the model hook (patched module names)."""

    NAMES = (
        (ulysses_mod, "all_gather_no_grad"),
        (layout_mod, "all_gather_no_grad"),
    )

    def __enter__(self):
        self.calls, self.saved = 0, []
        for mod, name in self.NAMES:
            fn = getattr(mod, name)
            self.saved.append((mod, name, fn))

            def counted(*a, _fn=fn, **k):
                self.calls += 1
                return _fn(*a, **k)

            setattr(mod, name, counted)
        return self

    def __exit__(self, *exc):
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)


def _documents_given_equal_positions(mode: str) -> dict:
    """ulysses / fpdt: ``documents`` (no collective) gives what ``position_ids`` (one all-gather) give."""
    g = torch.Generator().manual_seed(0)
    b, n, h = 2, 32, 4
    q, k, v = (torch.randn(b, n, h, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pos = packed_positions(b, n, [5, 11, 3, 13])
    c = 4 if mode == "fpdt" else None
    shard = lambda t: shard_sequence(t, chunk_size=c)  # noqa: E731
    fn = fpdt_attention if mode == "fpdt" else ulysses_attention
    kw = {"chunk_size": c} if mode == "fpdt" else {}
    with _CountGathers() as by_positions:
        a = fn(shard(q), shard(k), shard(v), position_ids=shard(pos), **kw)
    with _CountGathers() as by_documents:
        d = fn(shard(q), shard(k), shard(v), documents=document_ids(pos), **kw)
    ref = reference_attention(q, k, v, position_ids=pos)
    return {
        "gathers": (by_positions.calls, by_documents.calls),
        "same": torch.equal(a, d),
        "err": float((gather_sequence(d, chunk_size=c) - ref).abs().max()),
    }


def test_documents_argument_needs_no_collective(dist_pool):
    for mode in ("ulysses", "fpdt"):
        for r in dist_pool(2).run(_documents_given_equal_positions, mode):
            assert r["gathers"] == (1, 0) and r["same"] and r["err"] < 1e-12, (mode, r)


def test_global_positions_pads_like_shard_batch():
    from lightning_longctx import shard_batch

    batch = {"input_ids": torch.ones(2, 7, dtype=torch.long), "position_ids": packed_positions(2, 7, [3, 4])}
    full = global_positions(batch, chunk_size=None)
    assert full.shape == (2, 7) and torch.equal(full, batch["position_ids"])
    assert document_ids(torch.arange(6)[None]) is None  # one document: nothing to mask
    assert document_ids(full).tolist() == [[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 2, 2, 2]]
    assert torch.equal(shard_batch(batch)["position_ids"], full)


def _hf_step_gathers(through_strategy: bool, checkpointing: bool) -> dict:
    """A tiny Llama with packed documents, forward + backward: how many position all-gathers ran."""
    from helpers.hf_models import tiny_model
    from lightning_longctx import enable_sequence_parallel, shard_batch
    from lightning_longctx.integrations.context import BatchPositions
    from lightning_longctx.integrations.transformers import context_of, enable_activation_checkpointing

    model = tiny_model("llama", layers=3)
    enable_sequence_parallel(model, group=dist.group.WORLD, mode="fpdt", chunk_size=4)
    if checkpointing:
        enable_activation_checkpointing(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (2, 24), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": packed_positions(2, 24, [7, 9, 8])}
    sharded = shard_batch(batch, chunk_size=4)
    if through_strategy:  # what UlyssesFPDTStrategy.batch_to_device does
        ctx = context_of(model)
        ctx.positions = BatchPositions(
            local=sharded["position_ids"], full=global_positions(batch, chunk_size=4)
        )
    with _CountGathers() as count:
        loss = model(**sharded).loss
        loss.backward()
    return {"gathers": count.calls, "loss": loss.item()}


def test_a_batch_gathers_its_documents_at_most_once(dist_pool):
    """Strategy: none (shard_batch's full positions); a bare patched model: one, in its forward hook —
    not one per layer, and not again in the checkpoint recompute."""
    for through_strategy, checkpointing, want in (
        (True, False, 0),
        (True, True, 0),
        (False, False, 1),
        (False, True, 1),
    ):
        for r in dist_pool(2).run(_hf_step_gathers, through_strategy, checkpointing):
            assert r["gathers"] == want, (through_strategy, checkpointing, r)


def test_batch_positions_describe_their_batch_only():
    """The documents of a batch serve its position ids and views of them (HF passes those down, the
    checkpoint recompute too); an in-place edit or another tensor is another batch."""
    from lightning_longctx.integrations.context import BatchPositions

    full = packed_positions(2, 8, [3, 5])
    local = full[:, :4].clone()
    batch = BatchPositions(local=local, full=full)
    assert batch.describes(local) and batch.describes(local[:])
    assert not batch.describes(local[:, :2]) and not batch.describes(local.clone())
    assert batch.documents().tolist() == [[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 2, 2, 2]]
    assert batch.documents(2).tolist() == [[1, 1, 2, 3, 3, 4, 4, 5], [1, 1, 2, 2, 3, 4, 4, 5]]
    local[0, 0] = 0  # in place: the version changes
    assert not batch.describes(local)


def test_batch_positions_of_inference_tensors():
    """Validation runs under torch.inference_mode, whose tensors keep no version counter."""
    from lightning_longctx.integrations.context import BatchPositions

    with torch.inference_mode():
        full = packed_positions(1, 8, [3, 5])
        local = full[:, 4:].clone()
        batch = BatchPositions(local=local, full=full)
        assert batch.describes(local) and not batch.describes(local.clone())
        assert batch.documents().tolist() == [[1, 1, 1, 2, 2, 2, 2, 2]]
