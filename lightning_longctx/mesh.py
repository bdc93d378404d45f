"""The data-parallel x sequence-parallel x tensor-parallel layout of the world, and its process groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the mesh's axes, outermost first: tensor parallelism innermost (NVLink), sequence parallelism next to it,
#: as torchtitan, Megatron and Accelerate order theirs
MESH_AXES = ("data_parallel", "sequence_parallel", "tensor_parallel")


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """``world_size = dp * sp * tp``; tensor-parallel innermost, sequence-parallel next to it: a TP group is
    ``tp`` consecutive ranks, an SP group ``sp`` ranks ``tp`` apart, and the ``sp * tp`` consecutive ranks of
    one dp index share one sequence (one node's GPUs when ``sp * tp`` divides the GPUs per node: the
    all-to-alls and TP's all-reduces stay on NVLink)."""

    world_size: int
    sp: int
    tp: int = 1
    devices_per_node: int = 0  # 0: unknown

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world_size % self.tp:
            raise ValueError(
                f"tensor_parallel_size={self.tp} must divide the world size {self.world_size} (num_nodes x devices)"
            )
        if self.sp < 1 or (self.world_size // self.tp) % self.sp:
            tp = f" / tensor_parallel_size {self.tp}" if self.tp > 1 else ""
            raise ValueError(
                f"sequence_parallel_size={self.sp} must divide the world size {self.world_size}{tp} "
                f"(num_nodes x devices); pick a divisor of {self.world_size // self.tp}, e.g. the devices per node"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.sp * self.tp)

    def sp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.sp

    def dp_rank(self, rank: int) -> int:
        return rank // (self.sp * self.tp)

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    @property
    def replicas(self) -> int:
        """Ranks that hold one copy of the non-TP state and split the gradient reduction: dp * sp (FSDP's)."""
        return self.dp * self.sp

    @property
    def spans_nodes(self) -> bool:
        return bool(self.devices_per_node) and self.sp * self.tp > self.devices_per_node

    def __str__(self) -> str:
        tp = f" x tensor_parallel {self.tp}" if self.tp > 1 else ""
        return f"world {self.world_size} = data_parallel {self.dp} x sequence_parallel {self.sp}{tp}"


def build_device_mesh(layout: ParallelLayout, device_type: str) -> Any:
    """A 3-D ``DeviceMesh`` with axes :data:`MESH_AXES` (``tensor_parallel`` of size 1 without TP); every rank
    must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.dp, layout.sp, layout.tp), mesh_dim_names=MESH_AXES)
