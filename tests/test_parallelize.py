"""The one world mesh (mesh.py) and ``parallelize`` (parallelize.py) without Lightning."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.launch import process_groups
from lightning_longctx.config import MODES, Mode, SequenceParallelConfig
from lightning_longctx.parallel.mesh import REPLICA_AXIS, TP_AXIS, ParallelDims, build_world_mesh


def _mesh_groups(sp: int, tp: int, flatten: bool) -> dict:
    layout = ParallelDims(world_size=dist.get_world_size(), sp=sp, tp=tp)
    with process_groups() as own:
        mesh = own(build_world_mesh(layout, "cpu", flatten=flatten))
        ranks = dist.get_process_group_ranks
        return {
            "flattened": mesh.flattened,
            "sp": ranks(mesh.sp_group),
            "dp": ranks(mesh.dp_group),
            "tp": ranks(mesh.tp_group),
            "replicas": ranks(mesh.replica_group),
            "names": (mesh.replicas.mesh_dim_names, mesh.tp.mesh_dim_names),
            # FSDP2 composes the replica and TP meshes only when they share one root
            "one_root": mesh.replicas._get_root_mesh() is mesh.tp._get_root_mesh(),
        }


@pytest.mark.parametrize("sp, tp", [(2, 2), (2, 1), (1, 2)])
def test_world_mesh_groups_follow_the_layout_with_and_without_flatten(dist_pool, sp, tp):
    pool = dist_pool(4)
    flat, fallback = pool.run(_mesh_groups, sp, tp, True), pool.run(_mesh_groups, sp, tp, False)
    layout = ParallelDims(world_size=4, sp=sp, tp=tp)
    for rank, (a, b) in enumerate(zip(flat, fallback)):
        assert a["flattened"] and not b["flattened"]
        want_sp = sorted(
            r for r in range(4) if layout.dp_rank(r) == layout.dp_rank(rank) and r % tp == rank % tp
        )
        want_dp = sorted(
            r for r in range(4) if layout.sp_rank(r) == layout.sp_rank(rank) and r % tp == rank % tp
        )
        want_tp = sorted(r for r in range(4) if r // tp == rank // tp)
        want_replicas = sorted(r for r in range(4) if r % tp == rank % tp)
        for got in (a, b):
            assert (got["sp"], got["dp"], got["tp"], got["replicas"]) == (
                want_sp,
                want_dp,
                want_tp,
                want_replicas,
            )
            assert got["names"] == ((REPLICA_AXIS,), (TP_AXIS,)) and got["one_root"], got


def _ring_mesh_groups(sp: int, ring: int, tp: int, flatten: bool) -> dict:
    layout = ParallelDims(world_size=dist.get_world_size(), sp=sp, tp=tp, ring=ring)
    with process_groups() as own:
        mesh = own(build_world_mesh(layout, "cpu", flatten=flatten))
        ranks = dist.get_process_group_ranks
        return {
            "sp": ranks(mesh.sp_group),
            "dp": ranks(mesh.dp_group),
            "tp": ranks(mesh.tp_group),
            "replicas": ranks(mesh.replica_group),
            "ring": ranks(mesh.ring_group),
            "ulysses": ranks(mesh.ulysses_group),
            "one_root": mesh.replicas._get_root_mesh() is mesh.tp._get_root_mesh(),
        }


@pytest.mark.parametrize("sp, ring, tp", [(4, 2, 1), (4, 4, 1), (2, 2, 2), (2, 2, 1)])
def test_ring_axis_splits_the_sp_group_ring_outside_ulysses_inside(dist_pool, sp, ring, tp):
    """``ring > 1`` (issue 32): sp rank ``s = j * U + u``; a ring group holds the ranks of one (dp, u, tp), U apart
    in sp order; a Ulysses group the U consecutive sp ranks of one (dp, j, tp); the sp, dp, tp and replica
    groups are those of the same layout without a ring. Both with ``_flatten`` and the enumerated fallback."""
    pool = dist_pool(4)
    plain = pool.run(_mesh_groups, sp, tp, True)
    layout = ParallelDims(world_size=4, sp=sp, tp=tp, ring=ring)
    for flatten in (True, False):
        for rank, (got, want) in enumerate(zip(pool.run(_ring_mesh_groups, sp, ring, tp, flatten), plain)):
            for key in ("sp", "dp", "tp", "replicas"):
                assert got[key] == want[key], (flatten, rank, key)
            same = [r for r in got["sp"] if r % tp == rank % tp]  # this rank's sp group, in sp order
            assert got["ring"] == [r for r in same if layout.ulysses_rank(r) == layout.ulysses_rank(rank)]
            assert got["ulysses"] == [r for r in same if layout.ring_rank(r) == layout.ring_rank(rank)]
            assert len(got["ring"]) == ring and len(got["ulysses"]) == sp // ring and got["one_root"]
    assert [layout.sp_rank(r) for r in range(4)] == [
        layout.ring_rank(r) * layout.ulysses + layout.ulysses_rank(r) for r in range(4)
    ]


def test_ring_size_must_divide_the_sp_size():
    with pytest.raises(ValueError, match=r"ring_size=3 must divide sequence_parallel_size=4"):
        ParallelDims(world_size=4, sp=4, ring=3)
    assert "ring 2 x ulysses 2" in str(ParallelDims(world_size=8, sp=4, ring=2))


def test_mode_is_a_string_enum():
    assert SequenceParallelConfig(fpdt_chunk_size=8).mode is Mode.FPDT
    assert (
        SequenceParallelConfig().mode == "ulysses"
        and str(Mode.FPDT) == "fpdt"
        and f"{Mode.ULYSSES}" == "ulysses"
    )
    assert MODES == ("ulysses", "fpdt") and Mode("fpdt") is Mode.FPDT
    assert {"fpdt": 1}[Mode.FPDT] == 1  # hashes as its string


def test_parallelize_module_is_not_shadowed():
    """``parallelize`` lives in ``lightning_longctx.parallel.parallelize`` and is not re-exported at the top: a function
    of the submodule's name there would shadow the module (``import lightning_longctx.parallel.parallelize as m``)."""
    import lightning_longctx
    import lightning_longctx.parallel.parallelize as module

    assert callable(module.parallelize) and "parallelize" not in lightning_longctx.__all__


def _lightning_free_step(chunk: int | None, flatten: bool, ring: int = 1) -> dict:
    """The user guide's "Without Lightning" recipe on 4 ranks (a ``ParallelPlan``: sp 2 x tp 2, FSDP2,
    checkpointing; or sp 4 = ring 2 x Ulysses 2 under DDP): one forward and backward against the same model in
    one process."""
    import copy

    from helpers.hf_models import tiny_model
    from lightning_longctx.integrations.transformers import context_of
    from lightning_longctx.parallel.plan import ParallelPlan

    fsdp = ring == 1
    settings = SequenceParallelConfig(
        sequence_parallel_size=2 if fsdp else 4,
        tensor_parallel_size=2 if fsdp else 1,
        ring_size=ring,
        data_parallel="fsdp" if fsdp else "ddp",
        fpdt_chunk_size=chunk,
        activation_checkpointing=True,
    )
    config = settings.resolve(dist.get_world_size(), 0, "cpu")
    with process_groups() as own:  # the FSDP2 / TP model runs on the mesh's groups to the end
        plan = ParallelPlan(config, own(build_world_mesh(config.dims, "cpu", flatten=flatten)))
        model = tiny_model("llama")
        reference = copy.deepcopy(model)
        torch.manual_seed(1)
        ids = torch.randint(0, 64, (1, 32))
        batch = {"input_ids": ids, "labels": ids.clone()}
        want = reference(**batch).loss
        want.backward()

        run = plan.parallelize(model, replicate=not fsdp)
        loss = run(**plan.shard(batch)).loss
        # FSDP2 / DDP average over the dp x sp replicas: x sp makes it the sum over sp
        (loss * config.sp).backward()
        errors = {}
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            errors[name] = ((grad - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-12)).item()
        patched = context_of(model) is not None
        plan.undo()
        return {
            "loss": abs(loss.item() - want.item()),
            "errors": errors,
            "patched": patched,
            "wrapped": type(run).__name__,
            "undone": context_of(model) is None and not model.model.gradient_checkpointing,
        }


@pytest.mark.parametrize(
    "chunk, flatten, ring", [(None, True, 1), (4, False, 1), (None, True, 2), (4, True, 2)]
)
def test_parallelize_without_lightning_matches_one_process(dist_pool, chunk, flatten, ring):
    for rank, got in enumerate(dist_pool(4).run(_lightning_free_step, chunk, flatten, ring)):
        assert got["patched"] and got["undone"], got
        assert got["wrapped"] == ("FSDPLlamaForCausalLM" if ring == 1 else "DistributedDataParallel"), got
        assert got["loss"] < 1e-5, (rank, got["loss"])
        bad = {name: err for name, err in got["errors"].items() if not err < 1e-5}
        assert not bad, (rank, bad)


def _plan_refuses(case: str) -> str:
    """A ``ParallelPlan``'s batch half on 2 ranks (sp 2) with a first batch that differs across the ranks:
    other samples, another shape, or no ``input_ids`` on rank 1 alone."""
    from lightning_longctx.parallel.plan import ParallelPlan

    config = SequenceParallelConfig(sequence_parallel_size=2).resolve(dist.get_world_size(), 0, "cpu")
    with process_groups() as own:
        plan = ParallelPlan(config, own(build_world_mesh(config.dims, "cpu")))
        rank = dist.get_rank()
        n = 20 if case == "shapes" and rank == 1 else 16
        ids = torch.full((1, n), rank if case == "samples" else 1)
        batch = {"tokens": ids} if case == "one_rank_refuses" and rank == 1 else {"input_ids": ids}
        try:
            plan.shard(batch)
        except (RuntimeError, ValueError) as err:
            return str(err)
        return "sharded"


@pytest.mark.parametrize("case", ["samples", "shapes", "one_rank_refuses"])
def test_plan_refuses_a_batch_that_differs_across_ranks_on_every_rank(dist_pool, case):
    """The first batch's check is one collective: every rank raises (none waits forever in the next one)."""
    got = dist_pool(2).run(_plan_refuses, case)
    if case == "one_rank_refuses":  # rank 1 its own error, rank 0 that rank 1 refused
        assert (
            "ranks [1] refused their batch" in got[0] and "needs a dict batch with 'input_ids'" in got[1]
        ), got
        return
    want = "received different samples" if case == "samples" else "shapes differ across ranks"
    assert all(want in message for message in got), got
