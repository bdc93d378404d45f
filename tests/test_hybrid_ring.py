"""Hybrid mixers under Ulysses x ring (``ring_size > 1``): every local shard is two zigzag halves, runs of the
sequence whose neighbours may sit on another rank, on the same rank, or nowhere.

* the segment order each layout gives (``hybrid.base.segment_order``: from the layout's global index);
* ``comm.halo_exchange`` and ``comm.exclusive_affine_scan`` with permuted segment orders (the ring's, and
  random ones) against a one-process reference, forward and gradients, and the bytes sent, at P = 2 and 4;
* whole models (float64, loss and every parameter gradient against one process, packed documents whose
  boundaries fall on and across the zigzag seams): a short convolution (LFM2), gated DeltaNet (Qwen3.5),
  Mamba-2 (Bamba, Mamba-2), attention-free RWKV and xLSTM, at (sp, ring) = (2, 2), (4, 2), (4, 4); and a
  Trainer run against one process.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist

from helpers.launch import process_groups
from lightning_longctx.integrations.hybrid.base import segment_order
from lightning_longctx.parallel.comm import (
    count_all_to_all,
    exclusive_affine_scan,
    halo_exchange,
    strided_order,
)
from lightning_longctx.parallel.sharding import global_index

B, CH, HALO = 2, 3, 2  # rows, channels, halo (a kernel of 3)
SEG = 4  # tokens per segment in the comm tests


# ---- the segment order of each layout ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "chunk", "ring"),
    [(2, None, 1), (4, None, 1), (2, 2, 1), (4, 2, 1), (2, None, 2), (4, None, 2), (4, None, 4)],
)
def test_segment_order_follows_the_layout(world, chunk, ring):
    """Each rank's segment g holds global tokens [g*L, (g+1)*L); Ulysses and FPDT keep the strided order
    (their halo stays one shift around the ring); the ring's halves are two segments, in zigzag order."""
    local = 16
    L = chunk or (local // 2 if ring > 1 else local)
    order = segment_order(local, L, world, chunk, ring)
    assert sorted(g for row in order for g in row) == list(range(world * local // L))
    for rank, row in enumerate(order):
        index = global_index(local, rank=rank, world=world, chunk_size=chunk, ring=ring)
        want = torch.cat([torch.arange(g * L, (g + 1) * L) for g in row])
        assert torch.equal(index, want), (rank, row)
    if ring == 1:
        assert order == strided_order(world, local // L)
    else:  # ring rank j = rank // U holds zigzag chunks j and 2r-1-j (of N / 2r tokens each)
        chunk_len = local * world // (2 * ring)
        for rank, row in enumerate(order):
            j = rank // (world // ring)
            assert {g * L // chunk_len for g in row} <= {j, 2 * ring - 1 - j}, (rank, row)
    if (world, ring) == (2, 2):  # U = 1: rank 1 holds chunks 1 and 2, the second continues the first locally
        assert order == ((0, 3), (1, 2))


# ---- the collectives with permuted orders ---------------------------------------------------------------


def _orders(world: int, u: int, seed: int) -> list[tuple[tuple[int, ...], ...]]:
    """Segment orders to test: the ring layouts' (u = 2) and random permutations (seeded, the same on every
    rank), one of them holding consecutive segments on one rank in reverse local order."""
    rng = random.Random(seed)
    orders = []
    if u == 2:
        orders += [segment_order(2 * SEG, SEG, world, None, r) for r in (2, world) if world % r == 0]
    for _ in range(3):
        ids = list(range(world * u))
        rng.shuffle(ids)
        orders.append(tuple(tuple(ids[r * u : (r + 1) * u]) for r in range(world)))
    if u >= 2:  # rank 0 holds segments 1 and 0 in that order: the local predecessor comes after it
        rest = list(range(2, world * u))
        rng.shuffle(rest)
        ids = [1, 0, *rest]
        orders.append(tuple(tuple(ids[r * u : (r + 1) * u]) for r in range(world)))
    return orders


def _halo_errors(u: int, seed: int) -> list[dict[str, float]]:
    """halo_exchange in each order of :func:`_orders` vs slicing the global sequence: the values, the gradient
    and the bytes (forward + backward) against the formula."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for order in _orders(world, u, seed):
        torch.manual_seed(seed)
        n_seg = world * u
        x = torch.randn(B, n_seg * SEG, CH, dtype=torch.float64, requires_grad=True)
        W = torch.randn(n_seg, B, HALO, CH, dtype=torch.float64)
        padded = torch.cat([x.new_zeros(B, HALO, CH), x], dim=1)
        ref = torch.stack([padded[:, g * SEG : g * SEG + HALO] for g in range(n_seg)])  # (G, b, HALO, ch)
        (ref * W).sum().backward()
        ref_grad, x.grad = x.grad.clone(), None

        mine = list(order[rank])
        segs = x.unflatten(1, (n_seg, SEG)).transpose(0, 1)[mine]  # (u, b, SEG, ch): my segments, local order
        with count_all_to_all() as count:
            halo = halo_exchange(segs[:, :, -HALO:], dist.group.WORLD, order=order)
            (halo * W[mine]).sum().backward()
        grad = x.grad.clone()
        dist.all_reduce(grad)  # each rank's x.grad covers what its own segments fed
        owner = {g: r for r, row in enumerate(order) for g in row}
        remote = sum(owner[g + 1] != rank for g in mine if g + 1 < n_seg)  # tails sent forward
        remote += sum(owner[g - 1] != rank for g in mine if g > 0)  # halo gradients sent back
        if order == strided_order(world, u):  # contiguous / FPDT: one shift of all u tails each way
            remote = 2 * u
        out.append(
            {
                "forward": (halo - ref[mine]).abs().max().item(),
                "backward": (grad - ref_grad).abs().max().item(),
                "bytes_ok": float(count.exchange_bytes == remote * B * HALO * CH * 8),
            }
        )
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("u", [1, 2, 3])
def test_halo_exchange_in_any_segment_order(dist_pool, world, u):
    """Each segment gets the tail of segment g-1 wherever it lives (zeros for g = 0), its gradient goes back to
    the owner; a neighbour on the same rank costs no bytes."""
    for per_order in dist_pool(world).run(_halo_errors, u, world * 10 + u):
        for errs in per_order:
            assert errs["forward"] == 0.0 and errs["backward"] < 1e-12, errs
            assert errs["bytes_ok"] == 1.0, "the exchange counter must equal the tails sent to other ranks"


def _scan_errors(u: int, kind: str, seed: int) -> list[dict[str, float]]:
    """exclusive_affine_scan in each order of :func:`_orders` vs the sequential fold in global order, and its
    gradients."""
    from helpers.reference import affine_scan_errors

    return [
        affine_scan_errors(order, kind, seed, rows=B) for order in _orders(dist.get_world_size(), u, seed)
    ]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("u", [1, 2])
@pytest.mark.parametrize("kind", ["dense", "scalar"])
def test_exclusive_affine_scan_in_any_segment_order(dist_pool, world, u, kind):
    for per_order in dist_pool(world).run(_scan_errors, u, kind, world * 10 + u):
        for errs in per_order:
            assert max(errs.values()) < 1e-12, errs


def test_segment_order_must_be_a_permutation():
    with pytest.raises(ValueError, match=r"not a permutation of the 2 global segments"):
        halo_exchange(torch.zeros(2, 1), order=((0, 0),))
    with pytest.raises(ValueError, match=r"expected 1 rows"):
        exclusive_affine_scan(torch.ones(1, 1), torch.zeros(1, 1), torch.mul, order=((0,), (1,)))


# ---- whole models against one process --------------------------------------------------------------------

#: relative error of the loss and of every parameter's gradient: float64 models, whose kernels' own float32
#: insides (gated DeltaNet, Mamba-2) and Hugging Face's causal-LM loss (it upcasts the logits to float32) set
#: the floor; unpacked rows compare that float32 loss with the plain model's, as the architecture sweep does
#: (1.2e-5 for Qwen3-Next at ring 1 already), packed rows with float64 documents run alone
TOL = {True: 1e-5, False: 1e-4}
#: (sp, ring): U = 1 (a pure ring: ring rank r-1's second half continues its first, the others' do not), U = 2
#: (a rank's halves are consecutive: the second one's predecessor is local), U = 1 at r = 4
LAYOUTS = ((2, 2), (4, 2), (4, 4))


def _model_errors(names: list[str], sp: int, ring: int, packed: bool, chunk: int | None = None) -> list[dict]:
    """Each model of the sweep (``arch_sweep``), float64, on every rank: the sequence-parallel loss and every
    gradient (summed over the sp group, as the strategy does) against one process: the plain model on the
    batch, or, for packed rows (``arch_sweep.PACKED_DOCS``: starts at 0, 5, 6, 8, 17, 24 and 0, 16, 17 of 32
    tokens, on the zigzag seams at 8, 16, 24 and across them), each document run alone."""
    import arch_sweep

    from lightning_longctx import disable_sequence_parallel, enable_sequence_parallel, shard_batch
    from lightning_longctx.config import SequenceParallelConfig
    from lightning_longctx.parallel.mesh import build_world_mesh

    config = SequenceParallelConfig(sequence_parallel_size=sp, ring_size=ring, fpdt_chunk_size=chunk).resolve(
        dist.get_world_size(), 0, "cpu"
    )
    with process_groups() as own:
        mesh = own(build_world_mesh(config.dims, "cpu"))
        rows = []
        for name in names:
            arch = arch_sweep.arch_by_name(name)
            arch = arch_sweep.Arch(arch.name, arch.model_class, arch.config_class, arch.what,
                                   {**arch.overrides, "output_router_logits": False}, arch.moe)  # fmt: skip
            model = arch_sweep.build_model(arch).double()
            model.config._experts_implementation = "eager"  # grouped_mm takes no float64
            sp_model = copy.deepcopy(model)
            if packed:
                batch = arch_sweep.make_packed_batch()
                ref_loss = arch_sweep._documents_alone(model, batch)
            else:
                batch = arch_sweep.make_batch()
                ref = model(**batch).loss
                ref.backward()
                ref_loss = ref.item()
            enable_sequence_parallel(
                sp_model,
                group=mesh.sp_group,
                config=config,
                ring_groups=(mesh.ring_group, mesh.ulysses_group),
            )
            try:
                loss = sp_model(**shard_batch(batch, group=mesh.sp_group, chunk_size=chunk, ring=ring)).loss
                loss.backward()
            finally:
                disable_sequence_parallel(sp_model)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in sp_model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=mesh.sp_group)  # the strategy SUMS gradients over the SP ranks
            refs = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            scale = max(r.abs().max().item() for r in refs)
            d_grad, rel_grad = 0.0, 0.0
            for g, r in zip(flat.split([g.numel() for g in grads]), refs):
                err = (g.reshape(r.shape) - r).abs().max().item()
                d_grad = max(d_grad, err)
                rel_grad = max(rel_grad, err / max(r.abs().max().item(), arch_sweep.GRAD_FLOOR * scale))
            d_loss = abs(loss.item() - ref_loss)
            rel_loss = d_loss / abs(ref_loss)
            rows.append(dict(arch=name, sp=sp, ring=ring, packed=packed, d_loss=d_loss, rel_loss=rel_loss,
                             d_grad=d_grad, rel_grad=rel_grad))  # fmt: skip
        return rows


def _check(rows: list[dict]) -> None:
    bad = [r for r in rows if not (r["rel_loss"] < TOL[r["packed"]] and r["rel_grad"] < TOL[r["packed"]])]
    assert not bad, bad


#: fast tier: every layout once, every mixer kind once, packed rows on the seams
FAST = {
    (2, 2): (["lfm2", "rwkv"], True),  # short conv (halo from the same rank at U = 1), RWKV token shift + WKV
    (4, 2): (["qwen3_5_text"], True),  # conv + gated DeltaNet + ring attention
    (4, 4): (["bamba", "xlstm"], True),  # Mamba-2 + ring attention; mLSTM, no attention
}


@pytest.mark.parametrize(("sp", "ring"), list(FAST))
def test_hybrids_under_the_ring_match_one_process(dist_pool, sp, ring):
    names, packed = FAST[sp, ring]
    for rows in dist_pool(sp).run(_model_errors, names, sp, ring, packed):
        _check(rows)


#: the slow sweep: every kind at every layout, packed and not
SWEEP = ["lfm2", "qwen3_5_text", "qwen3_next", "bamba", "mamba2", "mamba", "minimax", "recurrent_gemma", "rwkv",
         "xlstm"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sp", "ring", "chunk"), [*((sp, r, None) for sp, r in LAYOUTS), (2, 2, 4), (4, 2, 4)]
)
@pytest.mark.parametrize("packed", [False, True])
def test_hybrid_sweep_under_the_ring(dist_pool, sp, ring, chunk, packed):
    """Ten mixer kinds at every layout; ``chunk``: FPDT x ring (chunks of 4: 4 / 2 segments per rank, runs of
    the sequence in a permuted order), the same segment order read off the layout's global index."""
    for rows in dist_pool(sp).run(_model_errors, SWEEP, sp, ring, packed, chunk):
        _check(rows)


#: Trainer runs: (arch of helpers.hf_models, sp = world, ring)
TRAINER_CASES = {"qwen3_5_sp2_ring2": ("qwen3_5", 2, 2), "bamba_sp4_ring2": ("bamba", 4, 2)}


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_strategy_ring_trains_hybrids_as_one_process(dist_pool, name):
    """The strategy with ``ring_size`` on a hybrid (conv + gated DeltaNet, or conv + Mamba-2, and ring
    attention): every parameter after 2 SGD steps and the losses against one process (24 tokens: local
    shards of 12 / 6, halves of 6 / 3 for the convs' 3-token halo)."""
    from helpers.lightning import compare_to_reference, fit_hf

    arch, sp, ring = TRAINER_CASES[name]
    results = dist_pool(sp).run(fit_hf, arch, sp, 2, {"ring_size": ring}, {})
    compare_to_reference(results, arch, sp, sp, 2, {})


def _halves_too_short() -> str:
    from helpers.hf_models import tiny_model
    from lightning_longctx import enable_sequence_parallel, shard_batch
    from lightning_longctx.config import SequenceParallelConfig
    from lightning_longctx.parallel.mesh import build_world_mesh

    config = SequenceParallelConfig(sequence_parallel_size=4, ring_size=4).resolve(4, 0, "cpu")
    with process_groups() as own:
        mesh = own(build_world_mesh(config.dims, "cpu"))
        model = tiny_model("qwen3_5")  # a conv of kernel 4: 3 tokens of halo
        enable_sequence_parallel(
            model, group=mesh.sp_group, config=config, ring_groups=(mesh.ring_group, mesh.ulysses_group)
        )
        ids = torch.randint(1, 64, (1, 16))  # 4 tokens per rank: two halves of 2
        try:
            model(**shard_batch({"input_ids": ids, "labels": ids}, group=mesh.sp_group, ring=4))
        except ValueError as err:
            return str(err)
        return "NO ERROR"


def test_halves_shorter_than_the_halo_are_refused_on_every_rank(dist_pool):
    """Under the ring a segment is half a shard: a conv whose halo it cannot hold is refused by name."""
    for msg in dist_pool(4).run(_halves_too_short):
        assert "needs the last 3 tokens before each segment" in msg, msg
        assert "holds 2 tokens (half of local length 4: under ring_size=4" in msg, msg
        assert "a smaller ring_size" in msg, msg
