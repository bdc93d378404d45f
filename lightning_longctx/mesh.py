"""The data-parallel x sequence-parallel layout of the world, and its process groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """``world_size = dp * sp``; sequence-parallel innermost, so an SP group is ``sp`` consecutive ranks
    (one node's GPUs when ``sp`` divides the GPUs per node: the all-to-alls stay on NVLink)."""

    world_size: int
    sp: int
    devices_per_node: int = 0  # 0: unknown

    def __post_init__(self) -> None:
        if self.sp < 1 or self.world_size % self.sp:
            raise ValueError(
                f"sequence_parallel_size={self.sp} must divide the world size {self.world_size} "
                f"(num_nodes x devices); pick a divisor of {self.world_size}, e.g. the devices per node"
            )

    @property
    def dp(self) -> int:
        return self.world_size // self.sp

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp

    def dp_rank(self, rank: int) -> int:
        return rank // self.sp

    @property
    def spans_nodes(self) -> bool:
        return bool(self.devices_per_node) and self.sp > self.devices_per_node

    def __str__(self) -> str:
        return f"world {self.world_size} = data_parallel {self.dp} x sequence_parallel {self.sp}"


def build_device_mesh(layout: ParallelLayout, device_type: str) -> Any:
    """A 2-D ``DeviceMesh`` with axes ``("data_parallel", "sequence_parallel")``; every rank must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type, (layout.dp, layout.sp), mesh_dim_names=("data_parallel", "sequence_parallel")
    )
