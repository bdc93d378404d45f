"""``data_parallel="ddp"``: the model replicated on every rank, its gradients averaged by DDP over dp x sp.

The counterpart of ``fsdp.py``'s :class:`~lightning_longctx.parallel.fsdp.FSDP2Sharding`: the run's
:class:`~lightning_longctx.parallel.plan.ParallelPlan` holds one of the two (chosen once, when it is built) and
calls the same methods on it, so neither path branches on the other. Why every dp x sp rank: parameters are replicated over the sequence-parallel ranks
too, and each holds only its tokens' share of the gradient; DDP's average over the world's replicas with
the loss scaled by ``sp`` (the strategy's ``backward``) is "sum over sp, mean over dp" (docs/architecture.md,
"Gradient reduction"). The reduction runs on the world mesh's replica group (mesh.py), which under DDP
(``tensor_parallel_size=1``) is the whole world.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from lightning_longctx.parallel.mesh import WorldMesh


class DDPReplication:
    """Wraps a model in ``DistributedDataParallel`` over the world mesh's replica group.

    ``ddp_kwargs``: ``DistributedDataParallel``'s own (``find_unused_parameters``, ``gradient_as_bucket_view``,
    ...); the module, devices and process group are set here. ``comm_hook`` (optionally wrapped by
    ``comm_wrapper``) with its ``comm_state``: a DDP communication hook, registered on CUDA only (as
    Lightning's ``DDPStrategy`` does: its hooks target NCCL)."""

    #: whether the piece shards the parameters (FSDP2 computes in its ``param_dtype``) or replicates them (DDP)
    shards = False

    def __init__(
        self,
        mesh: WorldMesh,
        *,
        comm_state: Any = None,
        comm_hook: Callable[..., Any] | None = None,
        comm_wrapper: Callable[..., Any] | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        self.group = mesh.replica_group
        self.comm_state, self.comm_hook, self.comm_wrapper = comm_state, comm_hook, comm_wrapper
        self.ddp_kwargs = ddp_kwargs

    def model_to_device(self, module: nn.Module, device: torch.device) -> None:
        module.to(device)

    def wrap(self, module: nn.Module, device_ids: list[int] | None) -> DistributedDataParallel:
        """``module`` in DDP (a collective: every rank calls it; DDP broadcasts rank 0's parameters)."""
        # DDP's buckets on a side stream (https://pytorch.org/docs/stable/notes/cuda.html#id5), as Lightning's
        with torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext():
            ddp = DistributedDataParallel(
                module=module, device_ids=device_ids, process_group=self.group, **self.ddp_kwargs
            )
        if self.comm_hook is not None and device_ids is not None:
            hook = self.comm_hook if self.comm_wrapper is None else self.comm_wrapper(self.comm_hook)
            ddp.register_comm_hook(state=self.comm_state, hook=hook)
        return ddp
