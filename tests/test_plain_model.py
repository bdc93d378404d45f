"""A plain PyTorch model (examples/nanogpt_sp.py) that calls the sequence-parallel attention itself.

Trained under UlyssesFPDTStrategy with sp=2 on gloo, every parameter after 2 SGD steps must match a
single-process run of the same model with ``group=None`` on the full sequence.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import lightning_longctx
from helpers.lightning import lightning_env
from lightning_longctx import UlyssesFPDTStrategy

# Spawned pool workers import this module by name to unpickle the functions below: they run this
# line too, so they find the example as well.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from nanogpt_sp import GPT, GPTConfig, NanoGPTModule, shift_labels_of

SEQ, VOCAB, STEPS, LR = 24, 64, 2, 0.5
GPT_KWARGS = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)


class Tokens(Dataset):
    """Random sequences with HF-style labels; a prompt without loss so shards differ in valid counts."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.labels = self.ids.clone()
        self.labels[:, : SEQ // 3] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _trainer(sp: int, fpdt_chunk_size: int | None) -> L.Trainer:
    return L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=sp, fpdt_chunk_size=fpdt_chunk_size),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _fit_plain(sp: int, fpdt_chunk_size: int | None) -> dict:
    lightning_env()
    torch.manual_seed(0)
    module = NanoGPTModule(lr=LR, optimizer="sgd", **GPT_KWARGS)
    trainer = _trainer(sp, fpdt_chunk_size)
    trainer.fit(module, train_dataloaders=DataLoader(Tokens(STEPS), batch_size=1, shuffle=False))
    return dict(module.model.state_dict())


def _reference() -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_KWARGS))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = Tokens(STEPS)
    for step in range(STEPS):
        batch = {k: v[None] for k, v in data[step].items()}
        logits = model(batch["input_ids"])  # group=None: the whole sequence on one process
        loss = lightning_longctx.sequence_parallel_cross_entropy(logits, shift_labels_of(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return dict(model.state_dict()), init


@pytest.mark.parametrize("fpdt_chunk_size", [None, 4], ids=["ulysses", "fpdt_chunk4"])
def test_plain_model_matches_single_process(dist_pool, fpdt_chunk_size):
    results = dist_pool(2).run(_fit_plain, 2, fpdt_chunk_size)
    ref, init = _reference()
    for rank, state in enumerate(results):
        assert state.keys() == ref.keys()
        for name, want in ref.items():
            moved = (want - init[name]).abs().max().item()
            assert moved > 0, f"{name} never changed: the comparison would prove nothing"
            err = (state[name] - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
            assert err < 1e-5, f"rank {rank}, {name}: relative error {err:.2e}"


class _LocalOnlyModule(L.LightningModule):
    """A plain model whose 'attention' never leaves the rank's shard: the strategy must refuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.emb(batch["input_ids"]))
        group = self.trainer.strategy.sp_group
        return lightning_longctx.sequence_parallel_cross_entropy(logits, batch["shift_labels"], group=group)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_local_only() -> str:
    lightning_env()
    try:
        _trainer(2, None).fit(
            _LocalOnlyModule(), train_dataloaders=DataLoader(Tokens(STEPS), batch_size=1, shuffle=False)
        )
    except RuntimeError as err:
        return str(err)
    return "NO ERROR"


def test_plain_model_without_sp_attention_is_refused(dist_pool):
    for msg in dist_pool(2).run(_fit_local_only):
        assert "ran no sequence-parallel attention" in msg, msg


def test_plain_model_is_an_ordinary_gpt_without_a_group():
    """group=None, no strategy: the example trains like any nanoGPT (positions default to arange)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_KWARGS))
    ids = torch.randint(0, VOCAB, (2, SEQ))
    full = model(ids)
    assert full.shape == (2, SEQ, VOCAB)
    # causal: the first half's logits do not depend on the second half
    torch.testing.assert_close(model(ids[:, : SEQ // 2]), full[:, : SEQ // 2])
