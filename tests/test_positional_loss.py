"""PositionalLoss: the validation loss by position of the GLOBAL sequence equals one process's, every layout.

Reference: the plain model on each whole sequence (packed rows: each document on its own, so attention never
crosses a document), per-token cross entropy in float64, bucketed here by hand.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from helpers.hf_models import HFModule, TokenDataset, tiny_model
from helpers.lightning import lightning_env
from helpers.reference import packed_positions
from lightning_longctx import UlyssesFPDTStrategy, sequence_parallel_cross_entropy
from lightning_longctx.integrations.transformers import context_of
from lightning_longctx.lightning.callbacks import PositionalLoss
from lightning_longctx.lightning.callbacks.positional_loss import METRIC_PREFIX, bucket_edges
from lightning_longctx.ops.chunked_loss import chunked_lm_head_cross_entropy

SEQ = 60  # not a multiple of P x chunk at P = 2 and 4 with chunk 8: shard_batch pads the end
N_SAMPLES, BATCH = 4, 2
DOCS = [20, 13, 31]  # packed rows: positions restart at 0 per document
BUCKETS = dict(first=4, log_base=2)  # 0-3, 4-7, 8-15, 16-31, 32-63
TOL = 1e-5


class _Tokens(TokenDataset):
    """TokenDataset's rows, some targets ignored throughout, optionally packed documents (``position_ids``)."""

    def __init__(self, packed: bool) -> None:
        super().__init__(N_SAMPLES, SEQ)
        self.labels = self.ids.clone()
        self.labels[:, 3::7] = -100  # ignored targets in every bucket, not only a prompt
        self.positions = packed_positions(N_SAMPLES, SEQ, DOCS) if packed else None

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        if self.positions is not None:
            item["position_ids"] = self.positions[i]
        return item


class _ValModule(HFModule):
    """A user's module: validation_step calls ``self.model(**batch)``."""

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("val/loss", loss, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return loss


def _reference(packed: bool, by: str) -> dict[str, float]:
    """One process, float64 per-token cross entropy, bucketed by hand."""
    model = tiny_model("llama").eval()
    data = _Tokens(packed)
    edges = bucket_edges(**BUCKETS)
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    with torch.no_grad():
        for i in range(len(data)):
            item = data[i]
            ids, labels = item["input_ids"], item["labels"]
            pos = item.get("position_ids", torch.arange(SEQ))
            starts = [t for t in range(SEQ) if t == 0 or int(pos[t]) == 0] + [SEQ]
            logits = torch.cat(
                [
                    model(ids[None, a:b], position_ids=torch.arange(b - a)[None]).logits[0]
                    for a, b in itertools.pairwise(starts)
                ]
            )
            targets = torch.cat([labels[1:], torch.tensor([-100])])
            ce = F.cross_entropy(logits.double(), targets, ignore_index=-100, reduction="none")
            where = torch.arange(SEQ) if by == "token" else pos
            for t in range(SEQ):
                if targets[t] == -100:
                    continue
                k = max(j for j in range(len(edges) - 1) if edges[j] <= int(where[t]))
                sums[k] = sums.get(k, 0.0) + float(ce[t])
                counts[k] = counts.get(k, 0) + 1
    return {f"{edges[k]}-{edges[k + 1] - 1}": sums[k] / counts[k] for k in sums}


def _logged(trainer: L.Trainer) -> dict[str, float]:
    return {
        name.removeprefix(METRIC_PREFIX): float(value)
        for name, value in trainer.callback_metrics.items()
        if name.startswith(METRIC_PREFIX)
    }


def _validate_on_rank(sp: int, chunk: int | None, packed: bool, by: str, root: str) -> dict:
    lightning_env()
    callback = PositionalLoss(**BUCKETS, by=by)
    module = _ValModule(tiny_model("llama"))
    extra = {} if chunk is None else {"fpdt_chunk_size": chunk, "loss_chunk_size": 8}  # several loss chunks
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=sp, **extra),
        accelerator="cpu",
        devices=dist.get_world_size(),
        logger=False,
        default_root_dir=root,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(module, DataLoader(_Tokens(packed), batch_size=BATCH), verbose=False)
    exact = {f"{a}-{b}": v for (a, b), v in callback.history[-1]["loss"].items()}  # before Lightning's fp32
    return {
        "logged": _logged(trainer),
        "exact": exact,
        "plot": callback.plot_path,
        "plain": context_of(module.model) is None,
    }


def _check(results: list[dict], packed: bool, by: str) -> tuple[float, float]:
    """``(max error of the logged values, of the fp64 values before logging)`` over ranks and buckets."""
    ref = _reference(packed, by)
    worst = {"logged": 0.0, "exact": 0.0}
    for rank, out in enumerate(results):
        assert out["plain"], "the strategy hands the model back unpatched"
        for kind in worst:
            assert set(out[kind]) == set(ref), (rank, kind, sorted(out[kind]), sorted(ref))
            worst[kind] = max(worst[kind], *(abs(out[kind][k] - v) for k, v in ref.items()))
    assert worst["logged"] < TOL and worst["exact"] < TOL, f"max error {worst} vs one process"
    assert results[0]["plot"] and Path(results[0]["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(out["plot"] is None for out in results[1:]), "the plot is rank 0's job"
    return worst["logged"], worst["exact"]


def _case(dist_pool, tmp_path, world, sp, chunk, packed, by) -> tuple[float, float]:
    results = dist_pool(world).run(_validate_on_rank, sp, chunk, packed, by, str(tmp_path))
    return _check(results, packed, by)


# ---- fast tier -----------------------------------------------------------------------------------
def test_fpdt_packed_rows_two_ranks_equal_one_process(dist_pool, tmp_path):
    _case(dist_pool, tmp_path, 2, 2, 8, True, "token")


def test_ulysses_document_positions_two_ranks_equal_one_process(dist_pool, tmp_path):
    _case(dist_pool, tmp_path, 2, 2, None, True, "document")


def test_one_device_without_the_strategy_writes_the_plot(tmp_path):
    """The plain model's logits (no strategy), two validation runs: two lines in the PNG, the hook removed."""
    callback = PositionalLoss(**BUCKETS)
    module = _ValModule(tiny_model("llama"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        default_root_dir=str(tmp_path),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    for _ in range(2):
        trainer.validate(module, DataLoader(_Tokens(False), batch_size=BATCH), verbose=False)
    ref = _reference(False, "token")
    logged = _logged(trainer)
    assert set(logged) == set(ref) == {"0-3", "4-7", "8-15", "16-31", "32-63"}
    assert max(abs(logged[k] - v) for k, v in ref.items()) < TOL
    assert len(callback.history) == 2 and callback.history[0]["loss"] == callback.history[1]["loss"]
    assert callback.plot_path == os.path.join(trainer.log_dir, "loss_by_position.png")
    assert Path(callback.plot_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not module.model._forward_hooks, "the observing hook outlives its validation run"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(buckets=[0]), "at least two integers"),
        (dict(buckets=[0, 4.5, 9]), "at least two integers"),
        (dict(buckets=[0, 8, 8]), "not strictly increasing"),
        (dict(buckets=[-1, 8]), "first edge must be >= 0"),
        (dict(buckets=[0, 8], first=4), "Give one of the two"),
        (dict(first=0), "positive integer"),
        (dict(log_base=1.0), "must be > 1"),
        (dict(log_base=1.0001), "larger log_base"),
        (dict(by="doc"), "choose 'token'"),
    ],
)
def test_bad_bucket_settings_say_what_and_how_to_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PositionalLoss(**kwargs)


def test_both_losses_hand_their_per_token_losses_to_the_observer():
    """Ulysses' loss from logits, FPDT's chunked loss from its chunks (3 tokens each): the same per-token
    losses as PyTorch's, 0 where ignored, and the same loss as without an observer."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 10, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    labels = torch.randint(0, 16, (2, 10))
    labels[0, 3] = labels[1, 9] = -100
    logits = hidden @ weight.T
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 10)
    seen = []
    for loss_fn in (
        lambda **kw: sequence_parallel_cross_entropy(logits, labels, **kw),
        lambda **kw: chunked_lm_head_cross_entropy(hidden, weight, labels, chunk_size=3, **kw),
    ):
        seen.clear()
        loss = loss_fn(observer=lambda *observed: seen.append(observed))
        ((losses, valid),) = seen
        assert torch.equal(valid, labels != -100) and not losses.requires_grad
        assert torch.allclose(losses, ref, atol=1e-6) and bool((losses[~valid] == 0).all())
        assert torch.allclose(loss, loss_fn(), atol=1e-7)


def test_bucket_edges():
    assert bucket_edges()[:5] == (0, 128, 256, 512, 1024)
    assert bucket_edges([0, 100, 1000]) == (0, 100, 1000)
    assert bucket_edges(first=10, log_base=1.5)[:5] == (0, 10, 15, 22, 34)


# ---- the full matrix -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("packed", "by"), [(False, "token"), (True, "token"), (True, "document")])
@pytest.mark.parametrize("chunk", [None, 8], ids=["ulysses", "fpdt"])
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_matrix_equals_one_process(dist_pool, tmp_path, sp, chunk, packed, by):
    _case(dist_pool, tmp_path, sp, sp, chunk, packed, by)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 8], ids=["ulysses", "fpdt"])
def test_data_parallel_times_sequence_parallel_equals_one_process(dist_pool, tmp_path, chunk):
    """dp = 2 x sp = 2: each dp rank validates half the samples; the sums are reduced over all four ranks."""
    _case(dist_pool, tmp_path, 4, 2, chunk, True, "token")
