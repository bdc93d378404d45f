"""The world mesh's process groups end with the fit that built them (``WorldMesh.destroy``, called at the
strategy's teardown): fits in one process leave the groups and threads they found (each gloo group keeps
threads until its communicator is freed), and the default group, which is Lightning's or the user's, lives on.

Where the default group is gloo on a CUDA machine, torch gives the mesh axes that span the world groups of
their own (on CPU and with NCCL they are the default group): an FSDP2 model keeps its replicas group then, one
group per FSDP2 fit, as it shards over it for as long as it lives."""

from __future__ import annotations

import gc
import os
from contextlib import nullcontext
from itertools import accumulate
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from helpers.lightning import fit_hf
from lightning_longctx.parallel.mesh import ParallelDims, build_world_mesh

#: one process's fits, one after another: DDP, FSDP2 (its sharded model is read after the fit), Ulysses x ring
FITS = [{}, {"data_parallel": "fsdp"}, {"ring_size": 2}] * 2


def _live_groups() -> list[str]:
    """The names of the process groups torch knows in this process (the default group among them)."""
    from torch.distributed.distributed_c10d import _world

    return sorted(_world.pg_names.values())


def _threads() -> int:
    """This process's threads, as the OS counts them (gloo's own threads included)."""
    gc.collect()  # what the last trainer held (its DDP wrapper holds the replica group) is freed
    return len(os.listdir("/proc/self/task"))


def _fit_six_times() -> dict:
    before = _live_groups()
    groups, threads = [], []
    for kwargs in FITS:
        state, _losses, _sp = fit_hf("llama", 2, 1, kwargs, {})  # reads the full state after the fit
        assert state or dist.get_rank()  # (a collective under FSDP, gathered on rank 0)
        groups.append(_live_groups())
        threads.append(_threads())
    return {"before": before, "groups": groups, "threads": threads, "cuda": torch.cuda.is_available()}


@pytest.mark.slow  # six Trainer fits
def test_fits_leave_no_process_groups_or_threads_behind(dist_pool):
    for rank, got in enumerate(dist_pool(2).run(_fit_six_times)):
        kept = list(accumulate(int(got["cuda"] and "data_parallel" in fit) for fit in FITS))
        assert [len(g) - len(got["before"]) for g in got["groups"]] == kept, (rank, got)
        assert all(set(got["before"]) <= set(g) for g in got["groups"]), (rank, got)
        # each fit builds at least two gloo groups of three threads: a leak adds as many threads every fit
        for k in range(1, len(FITS)):
            if kept[k] == kept[k - 1]:
                assert got["threads"][k] <= got["threads"][k - 1], (rank, got["threads"])


def _destroy(degrees: dict, flatten: bool, keep_sharding: bool, cuda_gloo: bool) -> dict:
    before = _live_groups()
    layout = ParallelDims(world_size=dist.get_world_size(), **degrees)
    with mock.patch.object(torch.cuda, "is_available", return_value=True) if cuda_gloo else nullcontext():
        mesh = build_world_mesh(layout, "cpu", flatten=flatten)
    names = {"replicas": mesh.replica_group.group_name, "tp": mesh.tp_group.group_name}  # resolvable now only
    built = _live_groups()
    mesh.destroy(keep_sharding=keep_sharding)
    kept = _live_groups()
    mesh.destroy(keep_sharding=keep_sharding)  # idempotent
    mesh.destroy()  # the kept groups too
    mesh.destroy(keep_sharding=True)  # nothing left to destroy or keep
    default = torch.ones(1)
    dist.all_reduce(default)  # the default group survives every destroy
    return {
        "before": before,
        "built": built,
        "kept": kept,
        "after": _live_groups(),
        "default": default.item(),
    } | names


@pytest.mark.parametrize(
    "degrees, flatten, cuda_gloo",
    [
        ({"sp": 2}, True, False),
        ({"sp": 2}, False, False),
        ({"sp": 2, "ring": 2}, True, False),
        ({"sp": 1, "tp": 2}, True, False),
        ({"sp": 2}, True, True),
        ({"sp": 2, "ring": 2}, False, True),
    ],
    ids=["flattened", "enumerated", "ring", "tp", "flattened_cuda_gloo", "enumerated_ring_cuda_gloo"],
)
def test_destroy_ends_the_groups_the_mesh_built_and_never_the_default(dist_pool, degrees, flatten, cuda_gloo):
    for got in dist_pool(2).run(_destroy, degrees, flatten, False, cuda_gloo):
        # the layout built groups of its own (else the test proves nothing), and destroyed them all
        assert len(got["built"]) > len(got["before"])
        assert got["kept"] == got["after"] == got["before"]
        assert got["default"] == 2


@pytest.mark.parametrize("cuda_gloo", [False, True], ids=["cpu", "cuda_gloo"])
def test_keep_sharding_keeps_the_groups_a_sharded_model_lives_on(dist_pool, cuda_gloo):
    """tp 2 on two ranks: the replicas (dp x sp = 1) are a group of one rank; the tp axis spans the world, the
    default group itself unless the default group is gloo on a CUDA machine."""
    for got in dist_pool(2).run(_destroy, {"sp": 1, "tp": 2}, True, True, cuda_gloo):
        own = [got["replicas"], got["tp"]] if cuda_gloo else [got["replicas"]]
        assert not set(own) & set(got["before"])
        assert got["kept"] == sorted([*got["before"], *own])
        assert got["after"] == got["before"] and got["default"] == 2
