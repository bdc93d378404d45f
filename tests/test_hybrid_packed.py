"""Packed documents on hybrid and attention-free models: a packed row equals its documents run ALONE through
the plain model (float64, loss and every gradient), on one device and at P = 2 and 4, Ulysses and FPDT, with
documents of one token, documents across shard and chunk edges and starting exactly at them
(``arch_sweep.PACKED_DOCS``), and under activation checkpointing (the recompute reads the batch's documents
from the context). A mixer kind that cannot reset its state (no ``PACKED``) refuses packed rows by name."""

from __future__ import annotations

import re
import types

import pytest
import torch
from arch_sweep import HYBRIDS, PACKED_EXACT, sweep_packed
from torch import nn

from lightning_longctx.integrations import hybrid
from lightning_longctx.integrations.hybrid.base import Documents, MixerCall, to_segments
from lightning_longctx.parallel.sharding import document_ids, global_index
from lightning_longctx.testing import Sabotage, assert_catches, sabotaged


def _exact(rows: list[dict]) -> None:
    bad = [(r["arch"], r["mode"], r["verdict"], r["reason"], r.get("bad_params", [])[:4]) for r in rows
           if r["verdict"] != ("exact" if r["arch"] in PACKED_EXACT else "refused")]  # fmt: skip
    assert not bad, bad


@pytest.mark.parametrize(("world", "chunk"), [(2, None), (2, 4), (4, 4)])
def test_document_pieces_of_each_segment(world, chunk):
    """Every segment's tokens split into one piece per document, right-aligned, the halo before the first piece
    only and only where that piece continues a document; scatter inverts gather."""
    pos = torch.stack(
        [torch.cat([torch.arange(n) for n in lengths]) for lengths in ((5, 1, 2, 9, 7, 8), (16, 1, 15))]
    )
    docs = document_ids(pos)
    for rank in range(world):
        local = 32 // world
        index = global_index(local, rank=rank, world=world, chunk_size=chunk)
        c = local if chunk is None else chunk
        d = Documents.build(docs, c, index, 2)
        values = index + 1 + 100 * torch.arange(2)[:, None]  # (b, local): 1 + global index, 100 per row
        x = to_segments(values.double()[..., None], 1, c)  # (N, c, 1)
        halo = torch.full((x.shape[0], 2, 1), -1.0, dtype=torch.float64)
        pieces = d.gather(x, 1, halo)[..., 0]  # (pieces, 2 + L)
        assert torch.equal(d.scatter(pieces[..., None], 1), x)
        for p, piece in enumerate(pieces):
            tokens = piece[piece > 0].long()
            row, at = int(tokens[0] // 100), tokens % 100 - 1  # the row and the global index of each token
            assert len(set(docs[row, at].tolist())) == 1, "a piece holds one document"
            assert torch.equal(at, torch.arange(int(at[0]), int(at[0]) + len(at))), (
                "consecutive, right-aligned"
            )
            assert bool((piece[-len(at) :] > 0).all())
            seg = int((d.first <= p).nonzero().max())
            continues = p == int(d.first[seg]) and at[0] > 0 and docs[row, at[0] - 1] == docs[row, at[0]]
            assert bool((piece == -1).any()) == bool(continues), (
                "the halo only before a continuing first piece"
            )


def test_packed_rows_on_one_device_with_checkpointing():
    """P = 1 (no process group): the packed-correct result the plain model does not give, recompute included;
    the three kinds whose padding needs care: MiniMax (a fixed decay), RWKV and xLSTM (log-scale normalisers)."""
    rows = sweep_packed("fpdt", ["qwen3_5_text", "mamba", "minimax", "rwkv", "xlstm"], checkpointing=True)
    _exact(rows)


def test_packed_qwen3_next_two_ranks_fpdt(dist_pool):
    """Gated DeltaNet + gated attention + experts, P = 2, FPDT chunks of 4: a document starting at a shard start,
    one-token documents, documents across chunks."""
    for rows in dist_pool(2).run(sweep_packed, "fpdt", ["qwen3_next"]):
        _exact(rows)


def _xlstm_chunkwise(mode: str) -> dict:
    """One rank's packed rows of xLSTM with ``chunk_size=4``: the chunkwise kernel runs on pieces of several
    chunks (some all padding) and on the segments from their entry states (the sweep's 64 steps through them)."""
    import dataclasses

    import arch_sweep
    import torch.distributed as dist

    arch = arch_sweep.arch_by_name("xlstm")
    arch = dataclasses.replace(arch, overrides={**arch.overrides, "chunk_size": 4})
    return arch_sweep._run_packed(arch, mode, dist.group.WORLD)


def test_packed_xlstm_chunkwise_two_ranks(dist_pool):
    """xLSTM's chunkwise kernels see no padding and continue a document from its entry state: exact at P = 2."""
    rows = dist_pool(2).run(_xlstm_chunkwise, "ulysses")
    assert all(r["verdict"] == "exact" for r in rows), rows


class _Context:  # the fields MixerCall and packed_documents_refusal read
    group = None
    ring = 1
    model_name = "FakeForCausalLM"
    mixer_calls = 0

    def __init__(self, documents: torch.Tensor) -> None:
        self.positions = types.SimpleNamespace(documents=lambda: documents)
        self.restore: dict = {}

    def local_chunk(self, n: int) -> None:
        return None


class _ScanMixer(nn.Module):
    """A mixer whose recurrence is a method (as RecurrentGemma's), adapted by a kind without ``PACKED``."""

    def scan(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scan(x)


def _scan_adapter(call: MixerCall, original, x: torch.Tensor) -> torch.Tensor:
    call.check(x.shape[1])
    return original(x)


def test_a_mixer_kind_without_packed_refuses_packed_rows_by_name(monkeypatch):
    """Every kind of the package takes packed rows; one that does not set ``PACKED`` refuses them at the call,
    naming the mixer (the strategy's check before the forward: the test below); one document per row runs."""
    monkeypatch.setitem(hybrid.METHODS, "_ScanMixer", {"scan": _scan_adapter})
    mixer = _ScanMixer()
    context = _Context(torch.tensor([[0, 0, 1, 1]]))  # a packed row: two documents
    patched = hybrid.patch_mixers(nn.Sequential(mixer), context)
    context.restore["mixers"] = patched
    message = (
        r"FakeForCausalLM: the batch packs several documents .* its mixer _ScanMixer cannot yet reset its"
    )
    x = torch.randn(1, 4, 2)
    try:
        assert not patched[0].call.packed
        with pytest.raises(ValueError, match=message):
            mixer(x)
        context.positions = None  # one document per row
        assert torch.equal(mixer(x), x.cumsum(1))
    finally:
        hybrid.unpatch_mixers(patched)


def _fit_packed_row() -> dict:
    """One Trainer step of a tiny Qwen3.5 (causal conv + gated DeltaNet, then attention) under
    ``UlyssesFPDTStrategy`` at sp = 2 on a packed row (two documents of 8 tokens), with no mixer kind resetting
    its state at a document start (this rank's :data:`hybrid.PACKED` emptied for the run): the error it raised
    and where (the traceback's function names), or ``None``."""
    import traceback

    import lightning as L

    from helpers.lightning import lightning_env
    from lightning_longctx import UlyssesFPDTStrategy
    from lightning_longctx.testing import HFModule, tiny_model

    lightning_env()
    ids = torch.randint(1, 60, (16,), generator=torch.Generator().manual_seed(0))
    row = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(16) % 8}
    module = HFModule(tiny_model("qwen3_5"), dataset=[row])
    saved = set(hybrid.PACKED)
    hybrid.PACKED.clear()
    try:
        trainer = L.Trainer(
            strategy=UlyssesFPDTStrategy(sequence_parallel_size=2), accelerator="cpu", devices=2, max_steps=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module)
    except ValueError as err:
        return {"error": str(err), "frames": [f.name for f in traceback.extract_tb(err.__traceback__)]}
    finally:
        hybrid.PACKED.update(saved)
    return {"error": None, "losses": module.losses}


def _refused_before_the_forward(results: list[dict]) -> None:
    message = (
        r"Qwen3_5ForCausalLM: the batch packs several documents \(position_ids restart at 0\), and its mixer "
        r"Qwen3_5GatedDeltaNet cannot yet reset its .* train this model on one document per row"
    )
    for rank, got in enumerate(results):
        assert got["error"] is not None and re.search(message, got["error"]), (rank, got)
        where = got["frames"]
        assert "_check_hybrid" in where and not {"training_step", "forward"} & set(where), (
            f"rank {rank}: refused in {where[-4:]}, not by the strategy's batch check before the forward"
        )


def _no_batch_check(original):
    """The sabotage: a strategy whose batch check lets packed rows through to the mixers."""

    def check_hybrid(self, packed: bool, short: bool) -> None:
        return None

    return check_hybrid


def test_the_strategy_refuses_packed_rows_before_the_forward(dist_pool):
    """A model whose mixers cannot reset their state at a document start (no ``PACKED`` kind: emptied for the
    run) meets a packed batch in a Trainer: the strategy's batch check (``ParallelPlan._check_hybrid``, from
    ``batch_to_device``) refuses it on every rank, naming the mixer, before any forward runs. Without that check
    the mixer's own refusal inside the forward is what stops the run, and the test fails."""
    pool = dist_pool(2)
    _refused_before_the_forward(pool.run(_fit_packed_row))
    sabotage = Sabotage(
        "no hybrid batch check", "lightning_longctx.parallel.plan:ParallelPlan._check_hybrid", _no_batch_check
    )
    assert_catches(
        lambda: _refused_before_the_forward(pool.run(sabotaged(sabotage, _fit_packed_row))),
        sabotage,
        match=r"refused in \[.*'forward'.*\], not by the strategy's batch check",
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("mode", ["ulysses", "fpdt"])
def test_packed_hybrids_match_their_documents_alone(dist_pool, mode, world):
    """Every hybrid of the sweep: exact (:data:`arch_sweep.PACKED_EXACT`) or refused by name, never wrong."""
    rows = dist_pool(world).run(sweep_packed, mode, list(HYBRIDS))[0]
    assert [r["arch"] for r in rows] == list(HYBRIDS)
    _exact(rows)
