"""``UlyssesFPDTStrategy``: Ulysses / FPDT sequence parallelism as a Lightning strategy.

What it wires together (each part lives in its own module):
  * the dp x sp layout and its process groups (``mesh.py``),
  * the sampler over data-parallel ranks only (every rank of an SP group reads the same sample),
  * ``shard_batch`` on every batch (``sharding.py``),
  * attention / MLP / loss swapping in Hugging Face models (``integrations/transformers.py``),
  * the gradient reduction: DDP averages over all dp*sp ranks; the loss is multiplied by ``sp``
    in ``backward`` so that the average becomes "sum over sp, mean over dp" — each SP rank holds
    only its tokens' share of the gradient of the SP group's global-mean loss (DESIGN §4).

Built on ``DDPStrategy`` rather than ``ModelParallelStrategy``: the parameters are replicated (no
tensor parallelism), DDP's bucketed all-reduce over the whole world is exactly the reduction needed,
and checkpoints stay plain full state dicts that load into the unpatched HF model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_longctx.comm import COMM_STATS, all_gather_object
from lightning_longctx.mesh import ParallelLayout, build_device_mesh
from lightning_longctx.sharding import shard_batch

#: Tokens per chunk per rank of the "ulysses_fpdt" preset.
DEFAULT_FPDT_CHUNK_SIZE = 4096
SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


@dataclass(frozen=True, kw_only=True)
class SequenceParallelConfig:
    """The sequence-parallel settings of the strategy, validated once."""

    sequence_parallel_size: int | Literal["auto"] = "auto"
    fpdt_chunk_size: int | None = None
    offload: bool | Literal["auto"] = False
    attention_backend: str = "auto"
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    activation_checkpointing: bool = False
    mlp_chunk_size: int | None = None
    loss_chunk_size: int | None = None
    pad_token_id: int = 0
    ignore_index: int = -100

    def __post_init__(self) -> None:
        sp = self.sequence_parallel_size
        if sp != "auto" and (not isinstance(sp, int) or sp < 1):
            raise ValueError(
                f"sequence_parallel_size={sp!r}: use 'auto' (all devices of a node) or a positive int"
            )
        if self.fpdt_chunk_size is not None and self.fpdt_chunk_size < 1:
            raise ValueError(
                f"fpdt_chunk_size={self.fpdt_chunk_size}: use None (plain Ulysses) or a positive token count"
            )
        if self.offload not in (True, False, "auto"):
            raise ValueError(
                f"offload={self.offload!r}: use True, False or 'auto' (on when training on CUDA)"
            )
        if self.offload is True and self.fpdt_chunk_size is None:
            raise ValueError("offload=True needs FPDT chunking: set fpdt_chunk_size (e.g. 4096)")
        if self.data_parallel not in ("ddp", "fsdp"):
            raise ValueError(
                f"data_parallel={self.data_parallel!r} is unknown; use 'ddp' (replicated parameters) or 'fsdp' "
                "(FSDP2 fully_shard per transformer block over all dp x sp ranks)"
            )

    @property
    def mode(self) -> str:
        return "ulysses" if self.fpdt_chunk_size is None else "fpdt"


class UlyssesFPDTStrategy(DDPStrategy):
    """Sequence parallelism (Ulysses, optionally FPDT-chunked) x data parallelism for Lightning.

    Args:
        sequence_parallel_size: ranks that share one sequence; ``"auto"`` = all devices of a node.
            Must divide ``num_nodes * devices``; the rest is data parallelism.
        fpdt_chunk_size: tokens per FPDT chunk per rank; ``None`` = plain Ulysses. Short sequences use
            one chunk of their local length.
        offload: keep FPDT's cold key/value chunks and saved activations in host memory; ``"auto"`` =
            on when training on CUDA.
        attention_backend: local kernel, ``"auto" | "flash" | "sdpa" | "math"``.
        data_parallel: ``"ddp"`` (replicated parameters, DDP all-reduce over dp x sp) or ``"fsdp"`` (FSDP2
            ``fully_shard`` of every transformer block and of each HF model over all dp x sp ranks;
            checkpoints hold full, unsharded state dicts).
        activation_checkpointing: enable HF gradient checkpointing (non-reentrant) on patched models.
        mlp_chunk_size / loss_chunk_size: FPDT tiling of the MLP and of lm_head + loss (default: chunk size).
        pad_token_id / ignore_index: used when padding sequences that don't divide.
        process_group_backend, timeout: as in ``DDPStrategy``; other keyword arguments go to DDP.
    """

    strategy_name = "ulysses_fpdt"

    def __init__(
        self,
        sequence_parallel_size: int | Literal["auto"] = "auto",
        fpdt_chunk_size: int | None = None,
        offload: bool | Literal["auto"] = False,
        attention_backend: str = "auto",
        data_parallel: Literal["ddp", "fsdp"] = "ddp",
        activation_checkpointing: bool = False,
        mlp_chunk_size: int | None = None,
        loss_chunk_size: int | None = None,
        pad_token_id: int = 0,
        ignore_index: int = -100,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self.sp_config = SequenceParallelConfig(
            sequence_parallel_size=sequence_parallel_size,
            fpdt_chunk_size=fpdt_chunk_size,
            offload=offload,
            attention_backend=attention_backend,
            data_parallel=data_parallel,
            activation_checkpointing=activation_checkpointing,
            mlp_chunk_size=mlp_chunk_size,
            loss_chunk_size=loss_chunk_size,
            pad_token_id=pad_token_id,
            ignore_index=ignore_index,
        )
        self._layout: ParallelLayout | None = None
        self._mesh: Any = None
        self._fsdp_mesh: Any = None
        self._contexts: list[Any] = []
        self._batches_sharded = 0
        self._verified = False
        self._checked_batch = False
        #: tokens per FPDT chunk per rank for the current batch (plain models pass it to fpdt_attention)
        self.current_chunk_size: int | None = None

    # ---- layout ----
    def _resolve_layout(self) -> ParallelLayout:
        sp = self.sp_config.sequence_parallel_size
        per_node = self.num_processes
        return ParallelLayout(
            world_size=self.world_size, sp=per_node if sp == "auto" else sp, devices_per_node=per_node
        )

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            self._layout = self._resolve_layout()
        return self._layout

    @property
    def device_mesh(self) -> Any:
        if self._mesh is None:
            raise RuntimeError("Accessing the device mesh before the strategy is set up is not allowed")
        return self._mesh

    @property
    def sp_size(self) -> int:
        return self.layout.sp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def sp_rank(self) -> int:
        return self.layout.sp_rank(self.global_rank)

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.global_rank)

    @property
    def sp_group(self) -> Any:
        return self.device_mesh["sequence_parallel"].get_group()

    @property
    def dp_group(self) -> Any:
        return self.device_mesh["data_parallel"].get_group()

    @property
    def offload(self) -> bool:
        off = self.sp_config.offload
        return self.root_device.type == "cuda" if off == "auto" else bool(off)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._layout = self._resolve_layout()
        if self._layout.spans_nodes:
            rank_zero_warn(
                f"sequence_parallel_size={self._layout.sp} spans nodes ({self._layout.devices_per_node} devices per "
                "node): its all-to-alls cross the network. Prefer a divisor of the devices per node"
            )
        self._mesh = build_device_mesh(self._layout, self.root_device.type)
        if self.sp_config.data_parallel == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            # FSDP2 shards over every rank: with the sp-scaled loss its average over dp x sp is exact.
            self._fsdp_mesh = init_device_mesh(
                self.root_device.type, (self.world_size,), mesh_dim_names=("dp_sp",)
            )
        rank_zero_info(f"UlyssesFPDTStrategy: {self._layout}, mode={self.sp_config.mode}")

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # Lightning checks SLURM's --ntasks-per-node against `devices` only inside its own launcher,
        # which srun makes it skip; a mismatch would otherwise surface later as an IndexError.
        if self.cluster_environment is not None and self.cluster_environment.creates_processes_externally:
            self.cluster_environment.validate_settings(
                num_devices=self.num_processes, num_nodes=self.num_nodes
            )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The sampler spans data-parallel ranks only: all ranks of an SP group read the same sample.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    # ---- model ----
    @override
    def setup(self, trainer: Any) -> None:
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"precision={precision!r} is not supported by UlyssesFPDTStrategy; use one of {SUPPORTED_PRECISION}"
            )
        self._patch_models()
        super().setup(trainer)

    def _patch_models(self) -> None:
        try:
            from transformers import PreTrainedModel
        except ImportError:  # pragma: no cover - transformers is a dependency
            return
        from lightning_longctx.integrations.transformers import (
            context_of,
            enable_activation_checkpointing,
            enable_sequence_parallel,
        )

        cfg = self.sp_config
        for module in self.lightning_module.modules():
            # modules() is pre-order: the outermost HF model is patched first; inner ones share its config
            if not isinstance(module, PreTrainedModel) or context_of(module) is not None:
                continue
            enable_sequence_parallel(
                module,
                group=self.sp_group,
                mode=cfg.mode,
                chunk_size=cfg.fpdt_chunk_size,
                offload=self.offload,
                backend=cfg.attention_backend,
                mlp_chunk_size=cfg.mlp_chunk_size,
                loss_chunk_size=cfg.loss_chunk_size,
            )
            if cfg.activation_checkpointing:
                enable_activation_checkpointing(module)
            self._contexts.append(context_of(module))

    @property
    def _fsdp(self) -> bool:
        return self.sp_config.data_parallel == "fsdp"

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self._fsdp:
            return super()._setup_model(model)
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        from transformers import PreTrainedModel

        roots = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
        roots = [m for m in roots if not any(m is not r and m in set(r.modules()) for r in roots)]
        covered = {id(p) for r in roots for p in r.parameters()}
        stray = [n for n, p in model.named_parameters() if id(p) not in covered]
        if not roots or stray:
            raise ValueError(
                "data_parallel='fsdp' shards transformers models; parameters outside them "
                f"({stray[:3] or 'no transformers model found'}) are not handled. Use data_parallel='ddp'"
            )
        for root in roots:
            block_names = set(getattr(root, "_no_split_modules", None) or [])
            for module in root.modules():
                if type(module).__name__ in block_names:
                    fully_shard(module, mesh=self._fsdp_mesh)
            fully_shard(root, mesh=self._fsdp_mesh)
        return model

    def _state_dict_options(self, **kw: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._fsdp:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module, options=self._state_dict_options())  # collective

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self._fsdp:
            return super().load_model_state_dict(checkpoint, strict=strict)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(
            self.lightning_module, checkpoint["state_dict"], options=self._state_dict_options(strict=strict)
        )
        return None

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self._fsdp:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        opt = getattr(optimizer, "_optimizer", optimizer)
        return get_optimizer_state_dict(self.lightning_module, opt, options=self._state_dict_options())

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self._fsdp:
            return super().load_optimizer_state_dict(checkpoint)
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if not state.get("state"):
                # stateless optimizer (plain SGD, or no step yet): torch's loader needs a state tensor to
                # find the device, so restore the hyper-parameters only.
                for group, saved in zip(optimizer.param_groups, state["param_groups"]):
                    group.update({k: v for k, v in saved.items() if k != "params"})
                continue
            set_optimizer_state_dict(
                self.lightning_module, optimizer, state, options=self._state_dict_options()
            )
        return None

    # ---- batches ----
    def chunk_size_for(self, seq_len: int) -> int | None:
        """Tokens per FPDT chunk per rank for a global sequence of ``seq_len`` tokens (None for Ulysses)."""
        c = self.sp_config.fpdt_chunk_size
        if c is None:
            return None
        return min(c, -(-seq_len // self.sp_size))

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if not self._checked_batch:
            self._check_batch_across_ranks(ids)
        chunk = self.chunk_size_for(ids.shape[1]) if isinstance(ids, Tensor) else None
        self.current_chunk_size = chunk
        for ctx in self._contexts:
            ctx.chunk_size = chunk
            ctx.mlp_chunk_size = self.sp_config.mlp_chunk_size or chunk
            ctx.loss_chunk_size = self.sp_config.loss_chunk_size or chunk
        out = shard_batch(
            batch,
            group=self.sp_group,
            chunk_size=chunk,
            ignore_index=self.sp_config.ignore_index,
            pad_token_id=self.sp_config.pad_token_id,
        )
        self._batches_sharded += 1
        return out

    def _check_batch_across_ranks(self, ids: Tensor | None) -> None:
        """First batch: every rank of an SP group must hold the same sample, and all shapes must agree
        (a mismatch would otherwise deadlock or silently mix samples inside the all-to-alls)."""
        if isinstance(ids, Tensor):
            digest = hashlib.sha1(ids.detach().cpu().numpy().tobytes()).hexdigest()
            mine: tuple[Any, ...] = (tuple(ids.shape), digest)
        else:
            mine = (None, None)
        everyone = all_gather_object(mine)
        shapes = {r: s for r, (s, _) in enumerate(everyone)}
        if len(set(shapes.values())) > 1:
            raise RuntimeError(
                f"batch input_ids shapes differ across ranks: {shapes}. All ranks must use the same batch size "
                "and sequence length (pad or pack to a fixed length in the dataset/collate_fn)"
            )
        sp = self.sp_size
        for start in range(0, len(everyone), sp):
            digests = {everyone[r][1] for r in range(start, start + sp)}
            if len(digests) > 1:
                raise RuntimeError(
                    f"ranks {list(range(start, start + sp))} form one sequence-parallel group but received different "
                    "samples; the training sampler must span data-parallel ranks only. Do not pass your own "
                    "DistributedSampler (let Lightning add it: use_distributed_sampler=True)"
                )
        self._checked_batch = True

    # ---- steps ----
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._batches_sharded == 0:
            raise RuntimeError(
                "the training batch never went through UlyssesFPDTStrategy.batch_to_device, so it was not sharded "
                "along the sequence (training_step(dataloader_iter) bypasses it). Use training_step(batch, batch_idx)"
            )
        if self._verified:
            return super().training_step(*args, **kwargs)
        for ctx in self._contexts:
            ctx.attention_calls = 0
        calls_before = COMM_STATS.calls
        out = super().training_step(*args, **kwargs)
        self._verify_first_step(COMM_STATS.calls - calls_before)
        self._verified = True
        return out

    def _verify_first_step(self, collectives: int) -> None:
        for ctx in self._contexts:
            if ctx.attention_calls < ctx.num_attention_layers:
                raise RuntimeError(
                    f"only {ctx.attention_calls} of {ctx.num_attention_layers} attention layers went through "
                    "sequence-parallel attention in the first step; the rest attended only to their local shard. "
                    "The model bypasses transformers' AttentionInterface somewhere and cannot be trained this way"
                )
        if self.sp_size > 1 and collectives == 0:
            raise RuntimeError(
                f"sequence_parallel_size={self.sp_size} but the first training step ran no sequence-parallel "
                "attention: each rank would attend only to its own shard. Call lightning_longctx.ulysses_attention "
                "/ fpdt_attention with trainer.strategy.sp_group in your model, or use a transformers model"
            )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # DDP averages over dp*sp ranks; SP ranks hold partial gradients that must be summed: x sp.
        return super().backward(closure_loss * self.sp_size, optimizer, *args, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets = {
            "ulysses_fpdt": (
                "Ulysses + FPDT chunking (4096 tokens per chunk per rank), host offload on CUDA",
                {"fpdt_chunk_size": DEFAULT_FPDT_CHUNK_SIZE, "offload": "auto"},
            ),
            "ulysses": ("Ulysses sequence parallelism, no chunking", {"fpdt_chunk_size": None}),
            "fpdt_offload": (
                "FPDT chunking with host offload of cold key/value chunks",
                {"fpdt_chunk_size": DEFAULT_FPDT_CHUNK_SIZE, "offload": True},
            ),
        }
        for name, (description, init_params) in presets.items():
            if name not in strategy_registry:  # idempotent: the module may be imported again in children
                strategy_registry.register(name, cls, description=description, **init_params)
