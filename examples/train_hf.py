"""Train a Hugging Face causal LM with sequence parallelism from a plain Python script.

The LightningModule below is ordinary user code: ``training_step`` returns
``self.model(**batch).loss`` and knows nothing about sequence parallelism. Choosing the strategy
by name is all it takes; the strategy shards each batch along the sequence, swaps the model's
attention (and, for FPDT, its MLP and loss) and makes the gradients equal to one-device training.

CPU, 2 processes sharing each sequence (Lightning starts the second one)::

    python examples/train_hf.py --devices 2 --strategy ulysses --max-steps 200

One GPU node, a local checkpoint and local text::

    python examples/train_hf.py --accelerator gpu --devices 8 --strategy ulysses_fpdt \\
        --pretrained /models/Meta-Llama-3-8B --text /data/corpus --seq-len 131072 --precision bf16-true

The same with the ready-made module and a YAML file: ``lightning-longctx fit --config ...``
(see ``examples/configs/``).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import lightning_longctx  # registers "ulysses_fpdt", "ulysses" and "fpdt_offload"
from lightning_longctx.callbacks import MemoryMonitor, MFUMonitor
from lightning_longctx.data import TextFilesDataModule
from lightning_longctx.recipes import RecallDataModule


class LitLM(L.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", default="ulysses", choices=["ulysses", "ulysses_fpdt", "fpdt_offload"])
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--pretrained", default=None, help="local HF model directory (default: a tiny Llama)")
    p.add_argument("--text", default=None, help="local .txt/.jsonl files or folder (default: recall task)")
    args = p.parse_args(argv)

    L.seed_everything(0)
    if args.text is not None:
        data = TextFilesDataModule([args.text], seq_len=args.seq_len, tokenizer=args.pretrained)
    else:
        data = RecallDataModule(
            seq_len=args.seq_len,
            vocab_size=64,
            num_pairs=4,
            num_queries=4,
            batch_size=16,
            train_samples=100_000,
        )
    if args.pretrained is not None:
        model = AutoModelForCausalLM.from_pretrained(args.pretrained, local_files_only=True)
    else:
        config = LlamaConfig(
            vocab_size=data.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=args.seq_len,
        )
        model = LlamaForCausalLM(config)

    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=0,
        log_every_n_steps=10,
        callbacks=[MFUMonitor(), MemoryMonitor(plot=False)],
    )
    trainer.fit(LitLM(model), data)
    if trainer.is_global_zero:
        strategy = trainer.strategy
        print(f"{lightning_longctx.__name__}: sp={strategy.sp_size} dp={strategy.dp_size}, done")


if __name__ == "__main__":
    main()
