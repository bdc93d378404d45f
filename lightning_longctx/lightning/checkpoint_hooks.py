"""The strategy's checkpoint hooks: sharded directories (``torch.distributed.checkpoint``) every rank writes, or one
full file from rank 0, committed atomically (``checkpoint.py``), that resume at any layout (dp, sp, tp, DDP or
FSDP2, offload). A mixin of :class:`~lightning_longctx.UlyssesFPDTStrategy`, as Lightning's ``ModelParallelStrategy``
owns its saving and loading: it reads the strategy's settings, saver, ranks and optimizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from lightning_longctx.lightning import checkpoint as ckpt


class CheckpointHooks:
    """Lightning's checkpoint hooks for the strategy (``self._saver`` is its ``checkpoint.Saver``)."""

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a checkpoint loads into the model and optimizers as set up (sharded, offloaded, TP-split): each
        # rank reads the pieces of its own layout, whatever layout saved them
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself, in both formats

    @property
    def _sharded_checkpoints(self) -> bool:
        return self.sp_config.checkpoint_format == "sharded"

    def _raw_optimizers(self) -> list[Any]:
        return [getattr(optimizer, "_optimizer", optimizer) for optimizer in self.optimizers]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The state a checkpoint saves: each rank's own shards (``checkpoint_format="sharded"``) or the full
        state on rank 0 (``"full"``). A collective under FSDP: every rank calls it."""
        return ckpt.model_state(self.lightning_module, full=not self._sharded_checkpoints)

    def full_state_dict(self) -> dict[str, Any]:
        """The LightningModule's full state dict, keys as ``lightning_module.state_dict()``: under FSDP gathered
        to the host of rank 0 (the other ranks get an empty dict; a collective: every rank calls it), under
        DDP every rank's own replica."""
        if self.sp_config.data_parallel == "ddp":
            return dict(self.lightning_module.state_dict())
        return ckpt.model_state(self.lightning_module, full=True)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return ckpt.optimizer_state(self.lightning_module, optimizer, full=not self._sharded_checkpoints)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model already, into its current layout

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # and the optimizers

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``filepath`` (every rank calls it): into ``.partial-<name>`` first, committed
        by rank 0 (marker, then rename) once every rank has written its part (checkpoint.py)."""
        if storage_options is not None:
            raise TypeError(
                "UlyssesFPDTStrategy writes its checkpoints itself and takes no `storage_options`; "
                f"got {storage_options!r}. Remove it"
            )
        path = Path(self.broadcast(str(filepath)))
        record = self._commit_record(checkpoint)
        self._saver.wait()  # one save in flight at a time; its directory is committed before the next starts
        partial = ckpt.partial_path(path)
        if self.is_global_zero:
            ckpt.remove(partial)  # a previous attempt killed mid-save
            (partial if self._sharded_checkpoints else partial.parent).mkdir(parents=True, exist_ok=True)
        if not self._sharded_checkpoints:
            if self.is_global_zero:
                # torch.save straight to the file: Lightning's CheckpointIO serialises the whole checkpoint in
                # memory first (twice the state at the peak); atomicity comes from the rename in commit()
                torch.save(checkpoint, partial)
                ckpt.commit(partial, path, record)
            self.barrier("save_checkpoint")
            return
        state = {ckpt.MODEL_KEY: checkpoint.pop("state_dict")}
        for index, optimizer in enumerate(checkpoint.pop("optimizer_states", ())):
            state[ckpt.optimizer_key(index)] = optimizer
        self.barrier("save_checkpoint")  # rank 0 made the partial directory
        self._saver.save(
            state,
            checkpoint,
            partial,
            path,
            record,
            is_zero=self.is_global_zero,
            background=self.sp_config.async_save,
        )
        self.barrier("save_checkpoint")

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint written in the background (``async_save=True``) is on disk and committed
        (every rank calls it); a failed write raises here. The next save, a preemption save and teardown call
        it themselves; a no-op when nothing is in flight."""
        self._saver.wait()

    def _commit_record(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        import lightning
        import transformers

        layout = self.dims
        return {
            "format": self.sp_config.checkpoint_format,
            "global_step": int(checkpoint.get("global_step", -1)),
            "epoch": int(checkpoint.get("epoch", -1)),
            "layout": {
                "world_size": layout.world_size,
                "data_parallel": layout.dp,
                "sequence_parallel": layout.sp,
                "tensor_parallel": layout.tp,
                "data_parallel_mode": self.sp_config.data_parallel,
                "mode": str(self.config.mode),
                "cpu_offload": self.sp_config.cpu_offload,
            },
            # torch.distributed.checkpoint promises no compatibility across torch versions
            "versions": {
                "torch": torch.__version__,
                "lightning": lightning.__version__,
                "transformers": transformers.__version__,
            },
        }

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of either format into the set-up model and optimizers (each rank its own
        pieces; a full file memory-mapped) and return the rest (loops, callbacks, schedulers) for Lightning."""
        path = Path(checkpoint_path)
        strict = self.lightning_module.strict_loading
        optimizers = self._raw_optimizers() if self._fitting else []
        if ckpt.is_sharded_checkpoint(path):
            ckpt.load_sharded(path, self.lightning_module, optimizers, strict)
            return torch.load(path / ckpt.META_FILE, map_location="cpu", weights_only=False)
        if path.is_dir():
            raise ValueError(
                f"ckpt_path={str(path)!r} is a directory without .metadata: not a (committed) sharded checkpoint. "
                "Pass a committed checkpoint, e.g. lightning_longctx.lightning.checkpoint.latest_checkpoint(run_dir)"
            )
        loaded = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        ckpt.load_full_state(self.lightning_module, optimizers, loaded, strict)
        return loaded

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # retention: after the save in flight (async_save) is committed
            self._saver.remove_after_commit(filepath)
