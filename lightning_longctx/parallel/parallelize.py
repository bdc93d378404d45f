"""``parallelize(model, mesh, config)``: every transformation that makes a model sequence-, tensor- and
data-parallel, in one place and one order, usable without Lightning (torchtitan's ``parallelize_llama``).

The order, and why:

1. **Attention swap** (``enable_sequence_parallel``, on every Hugging Face model not yet patched): the
   attention function, the mask, the loss, and in FPDT mode the tiled MLPs and norms and the chunked
   ``lm_head`` + loss. It reads the model's modules as the user built them (the ``lm_head`` it reads for the
   chunked loss is a plain ``nn.Linear`` still), and changes no parameter.
2. **Tensor-parallel plan** (``tensor_parallel.apply_tp_plan``, ``tensor_parallel_size > 1``): the weights
   become DTensors on the world mesh's ``tensor_parallel`` axis; in FPDT mode an untied ``lm_head`` over the
   vocabulary. Before FSDP2, which then shards the TP-local weights over the replicas (FSDP2 + TP).
3. **Activation checkpointing** (``enable_activation_checkpointing``, also implied by
   ``activation_offload``): flags on the decoder layers, non-reentrant, so it wraps whatever the layers
   became above.
4. **FSDP2** (``fully_shard`` per transformer block, then per model, over the world mesh's ``replicas``;
   ``data_parallel="fsdp"`` only): last, as FSDP2 must see the final modules and parameters.

Under ``data_parallel="ddp"`` steps 2 and 4 do nothing: wrap the result in DDP over the replica group
(:class:`~lightning_longctx.parallel.ddp.DDPReplication`), as the strategy does. Steps 1 and 3 are undone by the
returned handle (the strategy calls it at teardown, so a model leaves ``fit`` as it came); TP and FSDP2 are
not undone, and a model sharded before keeps its shards (calling ``parallelize`` again after ``undo`` swaps
the attention back in and skips what is already split or sharded).

Without Lightning (every rank runs this; see docs/user_guide.md, "Without Lightning")::

    config = SequenceParallelConfig(sequence_parallel_size=2, data_parallel="fsdp").resolve(world, 0, "cuda")
    mesh = build_world_mesh(config.dims, "cuda")
    undo = parallelize(model, mesh, config)
    ...  # train on shard_batch(batch, group=mesh.sp_group) with the loss multiplied by config.sp
    undo()
    mesh.destroy()  # its process groups (every rank), once the model is done with them
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_longctx.config import Mode, ResolvedConfig
from lightning_longctx.integrations.context import SequenceParallelContext
from lightning_longctx.integrations.transformers import (
    context_of,
    disable_sequence_parallel,
    enable_activation_checkpointing,
    enable_sequence_parallel,
)
from lightning_longctx.parallel.fsdp import FSDP2Sharding, outermost_models
from lightning_longctx.parallel.mesh import TP_AXIS, WorldMesh


@dataclass
class Parallelized:
    """The handle :func:`parallelize` returns: call it (or :meth:`undo`) to put the attention, loss, MLPs and
    activation checkpointing of the patched models back as they were. ``contexts``: the patched models'
    :class:`SequenceParallelContext` (their guardrail counters and current batch positions)."""

    models: list[nn.Module] = field(default_factory=list)
    contexts: list[SequenceParallelContext] = field(default_factory=list)
    restore_checkpointing: list[Callable[[], None]] = field(default_factory=list)

    def undo(self) -> None:
        """Restore checkpointing first (its restore reads the flags as the swap left them), then the swap.
        Idempotent: a second call does nothing."""
        for restore in reversed(self.restore_checkpointing):
            restore()
        for model in self.models:
            disable_sequence_parallel(model)
        self.models.clear()
        self.contexts.clear()
        self.restore_checkpointing.clear()

    def __call__(self) -> None:
        self.undo()


def _tp_split(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` is already a DTensor on the tensor-parallel axis."""
    return any(
        TP_AXIS in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())
        for p in model.parameters()
    )


def parallelize(
    model: nn.Module,
    mesh: WorldMesh,
    config: ResolvedConfig,
    *,
    param_dtype: torch.dtype | None = None,
    before_sharding: Callable[[Parallelized], None] | None = None,
    data_parallel: Any = None,
) -> Parallelized:
    """Make the Hugging Face models inside ``model`` (a ``PreTrainedModel``, or any module holding some, e.g.
    a LightningModule or a peft model) parallel over ``mesh``, in place, in the order of the module docstring:
    attention swap, TP plan, activation checkpointing, FSDP2.

    Args:
        model: the module; its parameters on their device already (under ``cpu_offload`` the transformers
            models on the host: ``FSDP2Sharding.model_to_device``). Every rank calls this with the same
            weights (TP slices and FSDP2 shards each rank's own copy).
        mesh: the world mesh (:func:`~lightning_longctx.parallel.mesh.build_world_mesh` of ``config.dims``).
        config: the resolved settings (:meth:`SequenceParallelConfig.resolve`).
        param_dtype: FSDP2's compute dtype over the fp32 sharded parameters (``MixedPrecisionPolicy``,
            gradients reduced in fp32), e.g. ``torch.bfloat16`` for ``bf16-mixed``; ``None``: the parameters'
            dtype. Under ``data_parallel="ddp"`` it is not read (mixed precision is the caller's autocast).
        before_sharding: called with the handle after step 3, before FSDP2 (every rank; the strategy's
            float32 self-test, which FSDP2's low ``param_dtype`` would make impossible after it).
        data_parallel: the run's data-parallel piece (:func:`data_parallel_for`; a
            :class:`~lightning_longctx.parallel.plan.ParallelPlan` holds one); ``None``: built here.

    Returns:
        a :class:`Parallelized` handle; calling it undoes the swap and the checkpointing.
    """
    done = Parallelized()
    from transformers import PreTrainedModel

    # 1. attention swap. modules() is pre-order: the outermost HF model is patched first; the models inside it
    # share its config, hence its context, and are skipped
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and context_of(module) is None:
            rings = (mesh.ring_group, mesh.ulysses_group) if mesh.dims.ring > 1 else None
            enable_sequence_parallel(module, group=mesh.sp_group, config=config, ring_groups=rings)
            done.models.append(module)
            done.contexts.append(context_of(module))
    # 2. tensor-parallel plan (config validation guarantees FSDP2 with it: DDP cannot wrap DTensors)
    if config.tp > 1:
        for root in outermost_models(model):
            if not _tp_split(root):
                from lightning_longctx.parallel.tensor_parallel import apply_tp_plan

                apply_tp_plan(root, mesh.tp, tp=config.tp, vocab_parallel=config.mode is Mode.FPDT)
    # 3. activation checkpointing of the patched models
    if config.activation_checkpointing:
        for module in done.models:
            done.restore_checkpointing.append(
                enable_activation_checkpointing(module, offload=config.settings.activation_offload)
            )
    if before_sharding is not None:
        before_sharding(done)
    # 4. FSDP2 over the replicas (the flattened dp x sp axis)
    if config.settings.data_parallel == "fsdp":
        (data_parallel or data_parallel_for(mesh, config)).shard(model, param_dtype=param_dtype)
    return done


def data_parallel_for(mesh: WorldMesh, config: ResolvedConfig, **ddp_kwargs: Any) -> Any:
    """The data-parallel piece around :func:`parallelize`, one of two with the same two methods:
    ``model_to_device(module, device)`` before it and ``wrap(module, device_ids)`` after it (fitting).
    :class:`~lightning_longctx.parallel.fsdp.FSDP2Sharding` under ``data_parallel="fsdp"`` (the host keeps the models
    under ``cpu_offload``; ``wrap`` returns the module, which ``parallelize`` sharded) or
    :class:`~lightning_longctx.parallel.ddp.DDPReplication` (``wrap``: DDP over the replicas; ``ddp_kwargs`` are its)."""
    if config.settings.data_parallel == "fsdp":
        return FSDP2Sharding(mesh, cpu_offload=config.settings.cpu_offload)
    from lightning_longctx.parallel.ddp import DDPReplication

    return DDPReplication(mesh, **ddp_kwargs)
