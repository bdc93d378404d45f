"""A tiny sequence-parallel training run for the fault tests, launched by torchrun or a faked srun.

Writes one JSON line per optimizer step (``step``, ``loss``) to ``{out}/losses_rank{R}.jsonl`` and a
committed checkpoint after every step (``{out}/ckpt/step-<N>.ckpt``, the newest two kept); after fit rank 0
writes the model's final parameters (``{out}/final_params.pt``, the HF state-dict keys).
``--activation-offload`` also checkpoints the decoder layers with their inputs kept in host memory.
``--kill-at K`` SIGKILLs rank 1 when step K starts. ``--signal-at K`` makes rank 1 alone send itself
``--signal`` (SIGUSR1: what SLURM sends before the time limit) in the middle of step K, before its forward:
the strategy's preemption handling then saves ``step-<K+1>`` on every rank, requeues on SLURM and exits.
``--resume`` starts from the newest committed checkpoint under ``{out}`` (what ``--ckpt_path auto`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import lightning as L
import torch

from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.data import ResumableDataLoader
from lightning_longctx.lightning.callbacks import PeriodicCheckpoint
from lightning_longctx.lightning.checkpoint import latest_checkpoint
from lightning_longctx.testing import HFModule, TokenDataset, tiny_model


class Module(HFModule):
    def __init__(self, out: str, kill_at: int | None, signal_at: int | None, sig: signal.Signals) -> None:
        super().__init__(tiny_model("llama"), lr=0.2, dataset=TokenDataset(8, 24))
        self.out, self.kill_at, self.signal_at, self.sig = out, kill_at, signal_at, sig

    def train_dataloader(self):
        return ResumableDataLoader(self.dataset, batch_size=1, shuffle=True)

    def training_step(self, batch, batch_idx):
        if self.kill_at is not None and self.global_step == self.kill_at and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.signal_at is not None and self.global_step == self.signal_at and self.global_rank == 1:
            os.kill(os.getpid(), self.sig)  # mid-step, one rank only: its handler only records it
        loss = super().training_step(batch, batch_idx)
        with open(os.path.join(self.out, f"losses_rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.global_step, "loss": loss.item()}) + "\n")
        return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--signal-at", type=int)
    p.add_argument("--signal", default="SIGUSR1", choices=["SIGUSR1", "SIGTERM"])
    p.add_argument("--resume", action="store_true")
    p.add_argument("--activation-offload", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    callbacks = [PeriodicCheckpoint(dirpath=os.path.join(args.out, "ckpt"), every_n_train_steps=1)]
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
    module = Module(args.out, args.kill_at, args.signal_at, signal.Signals[args.signal])
    resume = latest_checkpoint(args.out) if args.resume else None
    if args.resume and resume is None:
        raise SystemExit(f"--resume: no committed checkpoint under {args.out}")
    # a preemption ends fit with Preempted (a SystemExit, status 0) on every rank, after the save
    trainer.fit(module, ckpt_path=resume)
    if trainer.global_rank == 0:  # the strategy hands the model back plain: HF state-dict keys
        torch.save(
            {name: tensor.detach().clone() for name, tensor in module.model.state_dict().items()},
            os.path.join(args.out, "final_params.pt"),
        )


if __name__ == "__main__":
    main()
