"""Train a Hugging Face causal LM with sequence parallelism from a plain Python script.

The LightningModule below is ordinary user code: ``training_step`` returns
``self.model(**batch).loss`` and knows nothing about sequence parallelism. Choosing the strategy
is all it takes; the strategy shards each batch along the sequence, swaps the model's attention
(and, for FPDT, its MLP and loss) and makes the gradients equal to one-device training.

CPU, 2 processes sharing each sequence (Lightning starts the second one)::

    python examples/train_hf.py --devices 2 --max-steps 200

The same under torchrun, which starts the processes itself: ``--devices`` and ``--num-nodes`` default to what
it started (``LOCAL_WORLD_SIZE`` per node, ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes)::

    torchrun --standalone --nproc_per_node 2 examples/train_hf.py --max-steps 200

Llama-3.1-8B (131,072 positions) at 131,072 tokens on one node of 8 x 80 GB GPUs: FSDP2 shards the fp32
weights and AdamW state (fp32 master weights; ``bf16-mixed`` computes in bf16 over them), FPDT chunks of 4,096
tokens with their cold key/value chunks in host memory, every decoder layer checkpointed. ``lightning-longctx
plan`` puts it at
22.81 GiB per GPU at its peak, 24.95 GiB with the reserve (the ``ulysses_fpdt`` preset, DDP with every
weight and AdamW state on every GPU, would need 176 GiB)::

    torchrun --nproc_per_node 8 examples/train_hf.py --accelerator gpu --fsdp --fpdt-chunk-size 4096 \\
        --activation-checkpointing --precision bf16-mixed --seq-len 131072 \\
        --pretrained /models/Llama-3.1-8B --text /data/corpus

A sequence longer than the model's ``max_position_embeddings`` is refused (Llama-3-8B has 8,192): extend the
context with ``lightning_longctx.recipes.CausalLM(config_overrides={"rope_parameters": ...})``. Every process
loads the model on its host before FSDP2 shards it (32 GB in fp32 for 8B parameters); ``CausalLM`` builds it
straight on the device instead. The same with the ready-made module and a YAML file: ``lightning-longctx fit
--config ...`` (see ``examples/configs/``).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.cli import torchrun_world
from lightning_longctx.data import TextFilesDataModule
from lightning_longctx.lightning.callbacks import MemoryMonitor, MFUMonitor
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=None, help="per node (default: torchrun's, else 2)")
    p.add_argument("--num-nodes", type=int, default=None, help="default: torchrun's, else 1")
    p.add_argument(
        "--sp", type=int, default=None, help="sequence_parallel_size (default: every device of a node)"
    )
    p.add_argument("--fpdt-chunk-size", type=int, default=None, help="FPDT tokens per chunk per rank (default: Ulysses)")  # fmt: skip
    p.add_argument(
        "--fsdp", action="store_true", help="FSDP2 over the devices (default: DDP, replicated weights)"
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every decoder layer")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--pretrained", default=None, help="local HF model directory (default: a tiny Llama)")
    p.add_argument("--text", default=None, help="local .txt/.jsonl files or folder (default: recall task)")
    return p.parse_args(argv)


def strategy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``UlyssesFPDTStrategy``'s keyword arguments from the command line (FPDT's offload: on with CUDA)."""
    return {
        "sequence_parallel_size": "auto" if args.sp is None else args.sp,
        "fpdt_chunk_size": args.fpdt_chunk_size,
        "offload": "auto",
        "data_parallel": "fsdp" if args.fsdp else "ddp",
        "activation_checkpointing": args.activation_checkpointing,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # under torchrun its world (a --devices / --num-nodes that disagrees is refused); else 2 processes, 1 node
    devices, num_nodes = torchrun_world(args.devices or "auto", args.num_nodes or 1)
    devices = 2 if devices == "auto" else devices

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
        # fp32 master weights (transformers would load the checkpoint's bf16): bf16-mixed computes in bf16
        model = AutoModelForCausalLM.from_pretrained(
            args.pretrained, local_files_only=True, dtype=torch.float32
        )
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
        devices=devices,
        num_nodes=num_nodes,
        strategy=UlyssesFPDTStrategy(**strategy_kwargs(args)),
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=0,
        log_every_n_steps=10,
        callbacks=[MFUMonitor(), MemoryMonitor(plot=False)],
    )
    trainer.fit(LitLM(model), data)
    if trainer.is_global_zero:
        strategy = trainer.strategy
        print(f"sp={strategy.sp_size} dp={strategy.dp_size}, done")


if __name__ == "__main__":
    main()
