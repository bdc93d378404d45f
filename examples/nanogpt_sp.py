"""A nanoGPT-style model that is sequence-parallel by itself: no Hugging Face, no patching.

The path for plain PyTorch models. The model's attention calls
``lightning_longctx.ulysses_attention`` (or ``fpdt_attention``) with the strategy's
sequence-parallel group, and the loss is ``sequence_parallel_cross_entropy`` on the pre-shifted
``shift_labels`` of the rank's shard. The group is NOT stored on the module (process groups break
deepcopy and pickling): the LightningModule reads ``self.trainer.strategy.sp_group`` at every step
and passes it into ``forward``. With ``group=None`` the same model is an ordinary GPT on the full
sequence, which is how the tests check it.

Run (2 CPU processes, each holding half of every sequence)::

    python examples/nanogpt_sp.py --devices 2 --sp 2 --max-steps 300
    python examples/nanogpt_sp.py --devices 2 --sp 2 --fpdt-chunk-size 32   # FPDT layout
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_longctx
from lightning_longctx.parallel.sharding import shift_labels
from lightning_longctx.recipes import RecallAccuracy, RecallDataModule


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 1024  # longest GLOBAL sequence (learned position embeddings)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor, position_ids: Tensor, group: Any, chunk_size: int | None) -> Tensor:
        B, T, C = x.shape  # T is this rank's share of the sequence
        # (B, T, nh, hs): the bshd layout the sequence-parallel attentions take
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in self.c_attn(x).split(C, dim=2))
        if chunk_size is None:  # contiguous shards (Ulysses)
            y = lightning_longctx.ulysses_attention(
                q, k, v, group=group, causal=True, position_ids=position_ids
            )
        else:  # FPDT layout: the batch was sharded with shard_batch(..., chunk_size=chunk_size)
            y = lightning_longctx.fpdt_attention(
                q, k, v, group=group, chunk_size=chunk_size, causal=True, position_ids=position_ids
            )
        return self.c_proj(y.reshape(B, T, C))  # (B, T, nh, hs) -> (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, position_ids: Tensor, group: Any, chunk_size: int | None) -> Tensor:
        x = x + self.attn(self.ln_1(x), position_ids, group, chunk_size)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT. ``forward(idx (B, T), position_ids (B, T) GLOBAL, group, chunk_size) -> logits (B, T, V)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        idx: Tensor,
        position_ids: Tensor | None = None,
        group: Any = None,
        chunk_size: int | None = None,
    ) -> Tensor:
        if position_ids is None:  # one unsharded sequence per row
            position_ids = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
        # The positions are GLOBAL (shard_batch made them): each rank embeds its own tokens' places.
        x = self.wte(idx) + self.wpe(position_ids)
        for block in self.h:
            x = block(x, position_ids, group, chunk_size)
        return self.lm_head(self.ln_f(x))


def shift_labels_of(batch: dict[str, Tensor]) -> Tensor:
    """The strategy's pre-shifted ``shift_labels``, or, for an unsharded batch, ``labels`` shifted here."""
    return batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])


class NanoGPTModule(L.LightningModule):
    """Trains :class:`GPT`; works under ``UlyssesFPDTStrategy`` and on one device alike."""

    def __init__(self, lr: float = 3e-3, optimizer: str = "adamw", **gpt_kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(**gpt_kwargs))
        self.val_acc = RecallAccuracy()

    def _parallel(self) -> tuple[Any, int | None]:
        """``(sp_group, fpdt chunk size)`` of the strategy, read at every step, never stored."""
        strategy = self.trainer.strategy
        return getattr(strategy, "sp_group", None), getattr(strategy, "current_chunk_size", None)

    def _loss_and_logits(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        group, chunk_size = self._parallel()
        logits = self.model(batch["input_ids"], batch.get("position_ids"), group, chunk_size)
        targets = shift_labels_of(batch)
        # The global mean over the SP group's valid tokens; the strategy makes the gradients exact.
        loss = lightning_longctx.sequence_parallel_cross_entropy(logits, targets, group=group)
        return loss, logits, targets

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, _, _ = self._loss_and_logits(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, logits, targets = self._loss_and_logits(batch)
        self.val_acc.update(logits, targets, shifted=True)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        self.log("val/recall_acc", self.val_acc, prog_bar=True, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--sp", type=int, default=2, help="sequence-parallel size")
    p.add_argument("--fpdt-chunk-size", type=int, default=None, help="tokens per FPDT chunk per rank")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args(argv)

    L.seed_everything(0)
    data = RecallDataModule(
        seq_len=args.seq_len, vocab_size=64, num_pairs=4, num_queries=4, batch_size=16, train_samples=100_000
    )
    model = NanoGPTModule(vocab_size=data.vocab_size, block_size=args.seq_len)
    strategy = lightning_longctx.UlyssesFPDTStrategy(
        sequence_parallel_size=args.sp, fpdt_chunk_size=args.fpdt_chunk_size
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=min(100, args.max_steps),
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
