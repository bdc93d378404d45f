"""``data_parallel="fsdp"``: FSDP2 ``fully_shard`` over all dp x sp ranks (the world mesh's ``replicas``).

:func:`~lightning_longctx.parallel.parallelize.parallelize` shards with it (its last step); the DDP path is
``ddp.py``, so each path reads straight through. Why all dp x sp ranks: FSDP2's reduce-scatter averages gradients over every
rank it shards across; with the loss scaled by ``sp`` (the strategy's ``backward``) the average over
dp x sp ranks is "sum over sp, mean over dp", exactly as DDP's all-reduce over the world.

Checkpoints are ``checkpoint.py``'s: each rank writes its own shards (torch.distributed.checkpoint), or
with ``checkpoint_format="full"`` one file gathered on rank 0.

``cpu_offload``: FSDP2's ``CPUOffloadPolicy`` on every ``fully_shard``. The sharded (fp32) parameters, their
gradients and hence the optimizer states live in host memory (pinned on CUDA); a block's parameters are
copied to the device for its all-gather, its gradients back after the reduce-scatter, and the optimizer
steps on the CPU. Buffers (rotary ``inv_freq``) are not sharded: ``fully_shard`` moves them to the mesh's
device with the parameters and only the sharded parameters return to the host.

Mixed precision the FSDP2 way (Lightning's ``bf16-mixed`` / ``16-mixed``): ``MixedPrecisionPolicy`` over the
fp32 sharded parameters: the all-gathered parameters, hence the activations and the residual stream, are
in the low dtype; gradients are reduced in fp32 and the optimizer steps on fp32 master weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_longctx.parallel.mesh import WorldMesh

#: Lightning's mixed precisions -> the dtype FSDP2 computes in (the sharded master weights stay fp32).
MIXED_PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _fsdp2() -> Any:
    """torch's FSDP2 module: ``fully_shard`` and its policies."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "fully_shard"):  # torch 2.5 has FSDP2 under its composable API only
        import torch.distributed._composable.fsdp as fsdp
    return fsdp


def outermost_models(model: nn.Module) -> list[nn.Module]:
    from transformers import PreTrainedModel

    roots = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    return [m for m in roots if not any(m is not r and m in set(r.modules()) for r in roots)]


def move_all_but_models(module: nn.Module, device: torch.device) -> None:
    """Move ``module`` to ``device`` except its transformers models, which stay where they are (on the host
    under ``cpu_offload``: ``fully_shard`` moves them one block at a time and shards them back to the host)."""
    roots = outermost_models(module)
    if any(module is r for r in roots):
        return
    if not roots:
        module.to(device)
        return
    for name, buffer in list(module.named_buffers(recurse=False)):
        setattr(module, name, buffer.to(device))
    for child in module.children():
        move_all_but_models(child, device)


class FSDP2Sharding:
    """Shards the transformers models of a LightningModule with ``fully_shard`` over the world mesh's
    ``replicas`` (:class:`~lightning_longctx.parallel.mesh.WorldMesh`: the flattened dp x sp axis, which shares its
    root with the TP mesh, so FSDP2 composes with TP's DTensors).

    ``cpu_offload``: parameters, gradients and optimizer states in host memory (pinned when the mesh is on
    CUDA)."""

    #: whether the piece shards the parameters (FSDP2 computes in its ``param_dtype``) or replicates them (DDP)
    shards = True

    def __init__(self, mesh: WorldMesh, *, cpu_offload: bool = False) -> None:
        fsdp = _fsdp2()
        self.mesh = mesh.replicas
        self.cpu_offload = cpu_offload
        device_type = self.mesh.device_type
        # pinned host memory needs CUDA; on the CPU the same FSDP2 offload path runs unpinned
        self.offload_policy = (
            fsdp.CPUOffloadPolicy(pin_memory=device_type == "cuda") if cpu_offload else fsdp.OffloadPolicy()
        )

    def model_to_device(self, module: nn.Module, device: torch.device) -> None:
        """Move ``module`` to ``device`` before sharding; under ``cpu_offload`` its transformers models stay on
        the host (``fully_shard`` moves one block at a time to the device and keeps only its shard, on the host
        again), so no rank ever holds the whole model on the device."""
        if self.cpu_offload:
            move_all_but_models(module, device)
        else:
            module.to(device)

    def wrap(self, module: nn.Module, device_ids: list[int] | None = None) -> nn.Module:
        """``module`` as it is: :meth:`shard` (in ``parallelize``) sharded it in place; no wrapper, unlike DDP."""
        return module

    def shard(self, model: nn.Module, *, param_dtype: torch.dtype | None = None) -> nn.Module:
        """``fully_shard`` every transformer block (the model's ``_no_split_modules``) and each outermost
        ``PreTrainedModel``; parameters outside them are refused (they would stay unsynchronised).
        ``param_dtype``: compute in it over the fp32 sharded parameters, reduce gradients in fp32 (FSDP2's
        ``MixedPrecisionPolicy``); ``None``: compute in the parameters' dtype."""
        roots = outermost_models(model)
        covered = {id(p) for r in roots for p in r.parameters()}
        stray = [n for n, p in model.named_parameters() if id(p) not in covered]
        if not roots or stray:
            raise ValueError(
                "data_parallel='fsdp' shards transformers models; parameters outside them "
                f"({stray[:3] or 'no transformers model found'}) are not handled. Use data_parallel='ddp'"
            )
        fsdp = _fsdp2()
        sharded = (fsdp.FSDPModule,) if hasattr(fsdp, "FSDPModule") else ()
        mp_policy = (
            fsdp.MixedPrecisionPolicy()
            if param_dtype is None
            else fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        )
        kwargs = {"mesh": self.mesh, "mp_policy": mp_policy, "offload_policy": self.offload_policy}
        for root in roots:
            block_names = set(getattr(root, "_no_split_modules", None) or [])
            # innermost first: FSDP2 needs a nested unit sharded before the one around it (Mamba lists both
            # its block and its mixer in _no_split_modules; outer first left the mixer's weights sharded)
            for module in reversed(list(root.modules())):
                if type(module).__name__ in block_names and not isinstance(module, sharded):
                    fsdp.fully_shard(module, **kwargs)
            if not isinstance(root, sharded):  # a model sharded by an earlier fit stays as it is
                fsdp.fully_shard(root, **kwargs)
        return model
