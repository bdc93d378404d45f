"""The data-parallel x sequence-parallel x tensor-parallel layout of the world, and its ONE device mesh.

Every process group the package uses comes from :func:`build_world_mesh`: the sequence-parallel group (the
all-to-alls), the data-parallel group (the token-mean window's totals), the tensor-parallel mesh (TP's
DTensors) and the replica mesh, the flattened ``data_parallel x sequence_parallel`` view that FSDP2 shards
over and DDP reduces over. One mesh family: FSDP2 composes with TP only when both meshes share a root, and
no communicator is built twice.

The groups live as long as the mesh is used: :meth:`WorldMesh.destroy` ends them (the strategy calls it at
teardown), all but the default group, which belongs to whoever initialised it.
"""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass
from functools import cached_property
from typing import Any

#: the mesh's axes, outermost first: tensor parallelism innermost (NVLink), sequence parallelism next to it,
#: as torchtitan, Megatron and Accelerate order theirs
MESH_AXES = ("data_parallel", "sequence_parallel", "tensor_parallel")
DP_AXIS, SP_AXIS, TP_AXIS = MESH_AXES
#: with ``ring > 1`` the sequence-parallel axis is two: the ring outside (across nodes: one k/v block per step,
#: hidden behind compute), Ulysses inside (the all-to-alls on the fast links); sp rank ``s = j * U + u``
RING_AXIS, ULYSSES_AXIS = "sp_ring", "sp_ulysses"
#: the flattened ``data_parallel x sequence_parallel`` axis: the ranks holding one copy of the non-TP state,
#: over which FSDP2 shards and DDP averages (the name of the first axis of an FSDP2 + TP DTensor's mesh)
REPLICA_AXIS = "dp_sp"


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """``world_size = dp * sp * tp``; tensor-parallel innermost, sequence-parallel next to it: a TP group is
    ``tp`` consecutive ranks, an SP group ``sp`` ranks ``tp`` apart, and the ``sp * tp`` consecutive ranks of
    one dp index share one sequence (one node's GPUs when ``sp * tp`` divides the GPUs per node: the
    all-to-alls and TP's all-reduces stay on NVLink)."""

    world_size: int
    sp: int
    tp: int = 1
    ring: int = 1  # ring attention's degree inside sp (Ulysses degree sp / ring); 1: Ulysses alone
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
        if self.ring < 1 or self.sp % self.ring:
            raise ValueError(
                f"ring_size={self.ring} must divide sequence_parallel_size={self.sp}: the sequence-parallel ranks "
                f"are ring_size rings of sp / ring_size Ulysses ranks; pick a divisor of {self.sp}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.sp * self.tp)

    @property
    def ulysses(self) -> int:
        """The Ulysses degree U = sp / ring: the ranks of one all-to-all."""
        return self.sp // self.ring

    def sp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.sp

    def ring_rank(self, rank: int) -> int:
        """j of sp rank ``s = j * U + u``: the ring position."""
        return self.sp_rank(rank) // self.ulysses

    def ulysses_rank(self, rank: int) -> int:
        """u of sp rank ``s = j * U + u``: the position in the Ulysses group."""
        return self.sp_rank(rank) % self.ulysses

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
        ring = f" (ring {self.ring} x ulysses {self.ulysses})" if self.ring > 1 else ""
        return f"world {self.world_size} = data_parallel {self.dp} x sequence_parallel {self.sp}{ring}{tp}"


#: The name of :class:`ParallelDims` before 0.6 ("layout" now names the sequence layout only).
ParallelLayout = ParallelDims


@dataclass(frozen=True, kw_only=True)
class WorldMesh:
    """The world's one device mesh and the views of it that everything uses (:func:`build_world_mesh`).

    ``root``: the mesh itself, 3-D with axes :data:`MESH_AXES` (or, without ``DeviceMesh._flatten``, 2-D
    ``(dp_sp, tensor_parallel)``); ``replicas``: 1-D over the ``dp * sp`` ranks of one TP index (FSDP2's
    mesh, DDP's group); ``tp``: 1-D over the ``tp`` consecutive ranks (TP's DTensors); ``sp_group`` /
    ``dp_group``: the process groups of the sequence-parallel and data-parallel axes. ``flattened``: whether
    ``replicas`` is a flattened view of the 3-D root (else the fallback root; see :func:`build_world_mesh`).
    ``ring_group`` / ``ulysses_group``: with ``dims.ring > 1``, the two parts of the sp group (the ranks of
    one ring, ``U`` apart in sp order; the ``U`` consecutive ranks of one all-to-all); ``None`` otherwise."""

    dims: ParallelDims
    root: Any
    replicas: Any
    tp: Any
    sp_group: Any
    dp_group: Any
    flattened: bool
    ring_group: Any = None
    ulysses_group: Any = None

    @property
    def layout(self) -> ParallelDims:
        """The old name of :attr:`dims`."""
        return self.dims

    @property
    def tp_group(self) -> Any:
        return self.tp.get_group()

    @property
    def replica_group(self) -> Any:
        return self.replicas.get_group()

    @cached_property
    def _groups(self) -> tuple[Any, ...]:
        """This rank's groups of the mesh, each once, in the same order on every rank (read before any is
        destroyed: a destroyed group's name no longer resolves); some may be the default group itself."""
        groups = [*self.root.get_all_groups(), self.replica_group, self.tp_group, self.sp_group]
        groups += [g for g in (self.dp_group, self.ring_group, self.ulysses_group) if g is not None]
        return tuple({id(g): g for g in groups}.values())

    @cached_property
    def _sharding_groups(self) -> tuple[Any, ...]:
        """The groups FSDP2's and TP's DTensors live on: the replicas', and the tp axis's when ``tp > 1``."""
        return (self.replica_group, self.tp_group) if self.dims.tp > 1 else (self.replica_group,)

    def destroy(self, *, keep_sharding: bool = False) -> None:
        """Destroy the process groups this mesh created, so that their communicators end (each gloo group
        keeps threads until then). Every rank calls it, once nothing runs or will run on these groups; it is
        local (no collective) and idempotent.

        Never the default group, which belongs to whoever initialised it (Lightning, the user): an axis
        spanning the whole world IS that group (on CPU and with NCCL; torch gives it a group of its own on a
        CUDA machine whose default group is gloo, and that one is destroyed). ``keep_sharding``: keep the
        groups FSDP2's and TP's DTensors live on (``replicas``; ``tp`` when ``tp > 1``): a model sharded on
        this mesh uses them for as long as it lives (its full state dict after the fit, a checkpoint, its
        forward, its next fit, which does not shard it again), so they stay until the process ends."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return  # the default group is gone, and every other group went with it
        groups, sharding = self._groups, self._sharding_groups  # both read before any group is destroyed
        kept = sharding if keep_sharding else ()
        destroyed = []
        for group in groups:
            if group is dist.group.WORLD or any(group is k for k in kept):
                continue
            with suppress(ValueError):  # destroyed by an earlier call: torch knows it no more
                dist.destroy_process_group(group)
            destroyed.append(group.group_name)
        _forget_groups(self.root, destroyed)
        if destroyed:
            forget_dtensor_caches()


def _forget_groups(root: Any, names: list[str]) -> None:
    """Drop what torch's ``DeviceMesh`` keeps of destroyed groups (private attributes, each probed): torch
    2.13 holds the group objects in the root's ``_pg_registry``, and a group's communicator (a gloo group's
    threads) lasts as long as its object, i.e. as long as anything holds the root (a sharded model, DTensor's
    caches); older torch (2.5, 2.6, ...) caches flattened meshes in ``_mesh_resources`` keyed by the root's
    ranks and axis names, which would hand the next mesh of the same layout this one's destroyed groups."""
    from torch.distributed.device_mesh import _mesh_resources

    registry = getattr(root, "_pg_registry", None)
    if isinstance(registry, dict):
        for name in names:
            registry.pop(name, None)
    for cache in ("root_to_flatten_mapping", "flatten_name_to_root_dims", "flatten_name_to_root_layout"):
        mapping = getattr(_mesh_resources, cache, None)
        if isinstance(mapping, dict):
            mapping.pop(root, None)


def forget_dtensor_caches() -> None:
    """Clear DTensor's sharding-propagation and redistribution caches (private, each probed; torch 2.13's C++
    one is what matters): they key on mesh equality (ranks, shape, axis names, not the groups), and would hand
    the DTensors of the next equal mesh in this process the destroyed groups of this one ("Could not resolve
    the process group registered under the name ...")."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute as redistribute

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    for clear in (
        getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None),
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
        getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(redistribute, "clear_redistribute_planner_cache", None),
    ):
        if callable(clear):
            clear()


def can_flatten(mesh: Any) -> bool:
    """Whether this torch's ``DeviceMesh`` has the (private) ``_flatten`` that makes a 1-D view of several
    adjacent axes sharing the root (torch >= 2.5; torchtitan flattens the same way)."""
    return callable(getattr(mesh, "_flatten", None))


def build_world_mesh(dims: ParallelDims, device_type: str, *, flatten: bool | None = None) -> WorldMesh:
    """The world's one mesh (every rank must call it, with the same arguments). ``flatten=None``: probe.

    The one use of a private API of ``DeviceMesh`` is here: with ``_flatten`` (:func:`can_flatten`), the root
    is 3-D ``(data_parallel, sequence_parallel, tensor_parallel)`` and ``replicas`` its flattened
    ``("data_parallel", "sequence_parallel")`` view named :data:`REPLICA_AXIS`. Without it (``flatten=False``,
    or a torch that lacks it), the root is 2-D ``(dp_sp, tensor_parallel)`` with the same rank order, and the
    dp and sp groups are regrouped from its ranks (``new_subgroups_by_enumeration``): the FSDP2 and TP meshes
    still share one root, and every group is the one the 3-D mesh would give."""
    from torch.distributed.device_mesh import init_device_mesh

    if flatten is None:
        from torch.distributed.device_mesh import DeviceMesh

        flatten = can_flatten(DeviceMesh)
    if not flatten:
        return _enumerated_mesh(dims, device_type)
    if dims.ring > 1:
        return _ring_mesh(dims, device_type)
    root = init_device_mesh(device_type, (dims.dp, dims.sp, dims.tp), mesh_dim_names=MESH_AXES)
    return WorldMesh(
        dims=dims,
        root=root,
        replicas=root[DP_AXIS, SP_AXIS]._flatten(REPLICA_AXIS),
        tp=root[TP_AXIS],
        sp_group=root[SP_AXIS].get_group(),
        dp_group=root[DP_AXIS].get_group(),
        flattened=True,
    )


def _ring_mesh(dims: ParallelDims, device_type: str) -> WorldMesh:
    """:func:`build_world_mesh` with ``_flatten`` and the sp axis split into ``(sp_ring, sp_ulysses)``: the root
    is 4-D ``(data_parallel, sp_ring, sp_ulysses, tensor_parallel)``, the sp group its flattened ``(sp_ring,
    sp_ulysses)`` view (the same ranks as the 3-D mesh's sp axis) and ``replicas`` the flattened
    ``(data_parallel, sp_ring, sp_ulysses)``."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (dims.dp, dims.ring, dims.ulysses, dims.tp)
    root = init_device_mesh(device_type, shape, mesh_dim_names=(DP_AXIS, RING_AXIS, ULYSSES_AXIS, TP_AXIS))
    return WorldMesh(
        dims=dims,
        root=root,
        replicas=root[DP_AXIS, RING_AXIS, ULYSSES_AXIS]._flatten(REPLICA_AXIS),
        tp=root[TP_AXIS],
        sp_group=root[RING_AXIS, ULYSSES_AXIS]._flatten(SP_AXIS).get_group(),
        dp_group=root[DP_AXIS].get_group(),
        flattened=True,
        ring_group=root[RING_AXIS].get_group(),
        ulysses_group=root[ULYSSES_AXIS].get_group(),
    )


def _enumerated_mesh(dims: ParallelDims, device_type: str) -> WorldMesh:
    """The fallback without ``DeviceMesh._flatten``: a 2-D root ``(dp_sp, tensor_parallel)`` with the same rank
    order, the dp, sp (and with ``ring > 1`` the ring and Ulysses) groups enumerated from its ranks: the FSDP2
    and TP meshes still share one root, and every group is the one the full mesh would give."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_longctx.parallel.comm import new_subgroup  # every rank creates every group, in order

    root = init_device_mesh(device_type, (dims.replicas, dims.tp), mesh_dim_names=(REPLICA_AXIS, TP_AXIS))
    dp, r, u, tp = dims.dp, dims.ring, dims.ulysses, dims.tp
    ranks = root.mesh.reshape(dp, r, u, tp)  # global ranks at (dp, j, u, tp) coordinates; sp rank = j * U + u

    sp_group = new_subgroup([ranks[d, :, :, t].flatten().tolist() for d in range(dp) for t in range(tp)])
    dp_group = new_subgroup(
        [ranks[:, j, i, t].tolist() for j in range(r) for i in range(u) for t in range(tp)]
    )
    rings = None
    if r > 1:
        rings = (
            new_subgroup(
                [ranks[d, :, i, t].tolist() for d in range(dp) for i in range(u) for t in range(tp)]
            ),
            new_subgroup(
                [ranks[d, j, :, t].tolist() for d in range(dp) for j in range(r) for t in range(tp)]
            ),
        )
    return WorldMesh(
        dims=dims,
        root=root,
        replicas=root[REPLICA_AXIS],
        tp=root[TP_AXIS],
        sp_group=sp_group,
        dp_group=dp_group,
        flattened=False,
        ring_group=None if rings is None else rings[0],
        ulysses_group=None if rings is None else rings[1],
    )


def init_world(
    backend: str,
    *,
    rank: int,
    world_size: int,
    main_address: str,
    main_port: int,
    timeout: Any = None,
    device: Any = None,
) -> bool:
    """The default process group of ``world_size`` ranks (``torch.distributed.init_process_group`` over
    ``MASTER_ADDR`` / ``MASTER_PORT``), unless one exists already (a launcher, a test, a second fit made it);
    returns whether it was made here. ``device``: a CUDA device binds NCCL to it at once."""
    import os

    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(
            "torch.distributed is not available in this build of PyTorch; it cannot run in parallel"
        )
    if dist.is_initialized():
        return False
    os.environ["MASTER_ADDR"] = main_address
    os.environ["MASTER_PORT"] = str(main_port)
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        kwargs["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    if "nccl" in backend:  # torch warns about an NCCL group left undestroyed at exit
        import atexit

        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return True
