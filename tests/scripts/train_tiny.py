"""A tiny sequence-parallel training run for the fault tests, launched by torchrun or a faked srun.

Writes one JSON line per optimizer step (``step``, ``loss``) to ``{out}/losses_rank{R}.jsonl`` and
checkpoints after every step (``{out}/ckpt/last.ckpt``); after fit rank 0 writes the model's final
parameters (``{out}/final_params.pt``, the HF state-dict keys). ``--activation-offload`` also checkpoints
the decoder layers with their inputs kept in host memory. ``--kill-at K`` SIGKILLs rank 1 when step K
starts; ``--usr1-at K`` sends SIGUSR1 to every rank after step K (what SLURM does before the time
limit) and then exits like a requeued job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hf_models import HFModule, TokenDataset, tiny_model

from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.data import ResumableDataLoader


class Module(HFModule):
    def __init__(self, out: str, kill_at: int | None) -> None:
        super().__init__(tiny_model("llama"), lr=0.2, dataset=TokenDataset(8, 24))
        self.out, self.kill_at = out, kill_at

    def train_dataloader(self):
        return ResumableDataLoader(self.dataset, batch_size=1, shuffle=True)

    def training_step(self, batch, batch_idx):
        if self.kill_at is not None and self.global_step == self.kill_at and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().training_step(batch, batch_idx)
        with open(os.path.join(self.out, f"losses_rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.global_step, "loss": loss.item()}) + "\n")
        return loss


class SendUsr1(L.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)  # Lightning's SLURM handler: checkpoint + scontrol requeue
            dist.barrier()
            os._exit(0)  # SLURM would now end the job and requeue it


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--usr1-at", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--activation-offload", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    callbacks = [
        ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), every_n_train_steps=1, save_last=True)
    ]
    if args.usr1_at is not None:
        callbacks.append(SendUsr1(args.usr1_at))
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(
            sequence_parallel_size=2,
            fpdt_chunk_size=4,
            offload=True,
            activation_offload=args.activation_offload,
            process_group_backend="gloo",
        ),
        accelerator="cpu",
        devices=2,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        callbacks=callbacks,
    )
    module = Module(args.out, args.kill_at)
    trainer.fit(module, ckpt_path="last" if args.resume else None)
    if trainer.global_rank == 0:  # the strategy hands the model back plain: HF state-dict keys
        torch.save(
            {name: tensor.detach().clone() for name, tensor in module.model.state_dict().items()},
            os.path.join(args.out, "final_params.pt"),
        )


if __name__ == "__main__":
    main()
