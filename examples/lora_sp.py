"""Fine-tune a peft LoRA adapter with sequence parallelism.

The LoRA model goes into an ordinary LightningModule; the strategy finds the Hugging Face model inside
the ``PeftModel``, swaps its attention and shards each batch along the sequence. Only the LoRA A/B weights
train (the base weights stay frozen), and their gradients equal one-device training (tests/test_lora.py).

CPU, 2 processes sharing each sequence, a tiny random Llama (about 15 seconds)::

    python examples/lora_sp.py

FPDT chunking, a local checkpoint, the adapter saved at the end::

    python examples/lora_sp.py --strategy ulysses_fpdt --pretrained /models/Llama-3-8B \\
        --accelerator gpu --devices 8 --seq-len 65536 --precision bf16-true --save-adapter lora_out
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import lightning_longctx  # registers "ulysses_fpdt", "ulysses" and "fpdt_offload"
from lightning_longctx.recipes import RecallDataModule


class LoRALM(L.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss  # unchanged user code: the strategy makes it the global loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # the LoRA weights only
        return torch.optim.AdamW(trainable, lr=self.lr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="ulysses", choices=["ulysses", "ulysses_fpdt", "fpdt_offload"])
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument(
        "--pretrained", default=None, help="local HF model directory (default: a tiny random Llama)"
    )
    p.add_argument("--save-adapter", default=None, help="directory for the trained adapter (peft format)")
    args = p.parse_args(argv)

    L.seed_everything(0)
    data = RecallDataModule(
        seq_len=args.seq_len, vocab_size=64, num_pairs=4, batch_size=4, train_samples=4096
    )
    if args.pretrained is not None:
        base = AutoModelForCausalLM.from_pretrained(args.pretrained, local_files_only=True)
    else:
        config = LlamaConfig(
            vocab_size=data.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.seq_len,
        )
        base = LlamaForCausalLM(config)
    lora = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)

    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=0,
        log_every_n_steps=5,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(LoRALM(model), data)
    if trainer.is_global_zero:
        trainable, total = model.get_nb_trainable_parameters()
        strategy = trainer.strategy
        print(
            f"{lightning_longctx.__name__}: sp={strategy.sp_size} dp={strategy.dp_size}, "
            f"{trainable}/{total} parameters trained (LoRA r={args.rank})"
        )
        if args.save_adapter:
            model.save_pretrained(args.save_adapter)  # the strategy handed the model back plain after fit
            print(f"adapter saved to {args.save_adapter}")


if __name__ == "__main__":
    main()
