"""FPDT x ring (``fpdt_chunk_size`` with ``ring_size``) vs float64 full attention of the whole sequence, on real
gloo groups of the world mesh: every rank's out and dq/dk/dv (and the sp-summed dsinks), with and without
offload, both block backends; the layout; Trainer runs against one process; ``ring_size="auto"``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.launch import process_groups
from helpers.marks import WORLD8
from helpers.ring import check_rank_errors, inputs, reference
from lightning_longctx.parallel.sharding import document_ids, gather_sequence, global_index, shard_sequence

N, C = 64, 2  # global tokens, FPDT chunk per rank (N % (2 * P * C) == 0 up to P = 8); head dim helpers.ring.D

CASES = {
    "causal": dict(),
    "noncausal": dict(causal=False),
    "gqa_4_1": dict(h=4, h_kv=1),  # fewer kv heads than U: spread, and travel at that count
    "uneven_heads": dict(h=3, h_kv=1),
    # documents across the zigzag seam and the ring ranks, rows with different boundaries
    "documents": dict(h=4, h_kv=2, packed=[5, 11, 3, 13, 9, 23]),
    "window": dict(window=7),  # cuts blocks; rows with nothing to see on a ring step
    "softcap": dict(softcap=1.5, scale=1.0),
    "sinks": dict(h=4, h_kv=2, sinks=[8.0, -8.0, 0.5, -3.0]),
    "everything": dict(
        h=4, h_kv=1, packed=[5, 11, 3, 13, 9, 23], window=6, sinks=[8.0, -8.0, 3.0, -3.0], block=3
    ),
}


def _errors(ring: int) -> dict:
    """{(case, backend, offload): (max error of this rank's out/dq/dk/dv, its partial dsinks, the reference's)}
    at sp = world, ``ring``, chunk C, the groups of the world mesh."""
    from lightning_longctx.attention.fpdt_ring import fpdt_ring_attention
    from lightning_longctx.parallel.mesh import ParallelDims, build_world_mesh

    world = dist.get_world_size()
    with process_groups() as own:
        mesh = own(build_world_mesh(ParallelDims(world_size=world, sp=world, ring=ring), "cpu"))
        sp = mesh.sp_group

        def shard(x):
            return shard_sequence(x, group=sp, chunk_size=C, ring=ring)

        found = {}
        for name, cfg in CASES.items():
            q, k, v, w, pos, sinks = inputs(cfg, n=N)
            *ref, ref_dsinks = reference(cfg, q, k, v, w, pos, sinks)
            want = [shard(x) for x in ref]
            variants = [("auto", False)]
            if name in ("documents", "everything"):  # offload and the math blocks: the same numbers
                variants += [("auto", True), ("math", True)]
            for backend, offload in variants:
                got_ins = [shard(x).requires_grad_() for x in (q, k, v)]
                gs = None if sinks is None else sinks.clone().requires_grad_()
                out = fpdt_ring_attention(
                    *got_ins, ulysses_group=mesh.ulysses_group, ring_group=mesh.ring_group, chunk_size=C,
                    causal=cfg.get("causal", True), softmax_scale=cfg.get("scale"),
                    sliding_window=cfg.get("window"), documents=None if pos is None else document_ids(pos),
                    softcap=cfg.get("softcap"), sinks=gs, backend=backend, block_size=cfg.get("block", 1024),
                    offload=offload,
                )  # fmt: skip
                (out * shard(w)).sum().backward()
                got = (out.detach(), *(x.grad for x in got_ins))
                err = max((a - b).abs().max().item() for a, b in zip(got, want))
                finite = all(bool(torch.isfinite(x).all()) for x in got)
                found[name, backend, offload] = (
                    err if finite else float("inf"),
                    None if gs is None else gs.grad,
                    ref_dsinks,
                )
        return found


@pytest.mark.parametrize(
    ("world", "ring"), [(2, 2), (4, 2), (4, 4), pytest.param(8, 2, marks=[WORLD8, pytest.mark.slow])]
)
def test_fpdt_ring_matches_full_attention(dist_pool, world, ring):
    """(U, r) = (1, 2), (2, 2), (1, 4), (4, 2) at world 8 (opt-in), chunks of 2 tokens (8 to 16 segments per ring rank): every rank's out,
    dq, dk, dv within 1e-10 of float64 full attention, dsinks summed over the sp group too; GQA with fewer kv
    heads than U, uneven heads, documents across the seams, windows, softcap, sinks; offload on and off, the
    fused and the math blocks."""
    check_rank_errors(dist_pool(world).run(_errors, ring))


def test_fpdt_ring_layout():
    """``shard_sequence(..., chunk_size=c, ring=r)``: sp rank ``(j, u)`` holds chunk u of each ``U*c`` segment of
    ring rank j's two zigzag chunks; every local chunk is a run of c consecutive tokens; ``global_index`` agrees; lengths that split a segment are refused."""
    from lightning_longctx.parallel.layout import SequenceLayout

    n, world, ring, c = 32, 4, 2, 2
    rows = SequenceLayout(sp=world, ring=ring, chunk_size=c).index(n)
    assert rows.tolist() == [
        [0, 1, 4, 5, 24, 25, 28, 29],
        [2, 3, 6, 7, 26, 27, 30, 31],
        [8, 9, 12, 13, 16, 17, 20, 21],
        [10, 11, 14, 15, 18, 19, 22, 23],
    ]
    for w, r, cc in ((2, 2, 2), (4, 2, 2), (4, 4, 1), (8, 2, 2), (8, 4, 1)):
        m = 2 * w * cc * 2
        rows = SequenceLayout(sp=w, ring=r, chunk_size=cc).index(m)
        assert sorted(rows.flatten().tolist()) == list(range(m))
        runs = rows.reshape(w, -1, cc)
        assert bool((runs[..., 1:] - runs[..., :-1] == 1).all())  # every chunk a run
        for rank in range(w):
            assert torch.equal(global_index(m // w, rank=rank, world=w, chunk_size=cc, ring=r), rows[rank])
    with pytest.raises(ValueError, match=r"sequence length 24 is not divisible by 16 \(ring_size=2"):
        SequenceLayout(sp=4, ring=2, chunk_size=2).index(24)


def _gather_roundtrip(ring: int) -> bool:
    from lightning_longctx.parallel.mesh import ParallelDims, build_world_mesh

    world = dist.get_world_size()
    with process_groups() as own:
        mesh = own(build_world_mesh(ParallelDims(world_size=world, sp=world, ring=ring), "cpu"))
        x = torch.arange(2 * N).reshape(2, N)
        part = shard_sequence(x, group=mesh.sp_group, chunk_size=C, ring=ring)
        return torch.equal(gather_sequence(part, group=mesh.sp_group, chunk_size=C, ring=ring), x)


def test_fpdt_ring_gather_inverts_shard(dist_pool):
    assert all(dist_pool(4).run(_gather_roundtrip, 2))


# ---- the strategy: fpdt_chunk_size with ring_size, and ring_size="auto", against one process -------------

TRAINER_CASES = {
    # name: (arch, world, sp, strategy kwargs, model kwargs)
    "llama_fpdt_sp2_ring2": ("llama", 2, 2, {"ring_size": 2, "fpdt_chunk_size": 2}, {}),
    "llama_fpdt_offload_sp4_ring2": (
        "llama", 4, 4, {"ring_size": 2, "fpdt_chunk_size": 1, "offload": True}, {"kv_heads": 1},
    ),
    "llama_fpdt_sp4_ring4": ("llama", 4, 4, {"ring_size": 4, "fpdt_chunk_size": 2}, {}),
    # 2 heads at sp 4: "auto" picks ring 2 (Ulysses 2 fits the heads)
    "llama_auto_sp4": ("llama", 4, 4, {"ring_size": "auto"}, {"heads": 2, "kv_heads": 1}),
}  # fmt: skip


def _fit_with_ring(arch, sp, skw, mkw):
    """``fit_hf``'s results, the ring the strategy resolved, and the attention functions the model ran."""
    import lightning_longctx.attention.dispatch as hf
    import lightning_longctx.lightning.strategy as strategy_module
    from helpers.lightning import fit_hf

    seen, calls = [], {}
    original = strategy_module.UlyssesFPDTStrategy.setup_environment

    def spy(self):
        original(self)
        seen.append(self.layout.ring)

    def counted(name):
        fn = getattr(hf, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return fn, wrapper

    wrapped = {name: counted(name) for name in ("fpdt_ring_attention", "usp_attention")}
    strategy_module.UlyssesFPDTStrategy.setup_environment = spy
    for name, (_, wrapper) in wrapped.items():
        setattr(hf, name, wrapper)
    try:
        return fit_hf(arch, sp, 2, skw, mkw), seen, calls
    finally:
        strategy_module.UlyssesFPDTStrategy.setup_environment = original
        for name, (fn, _) in wrapped.items():
            setattr(hf, name, fn)


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_strategy_fpdt_ring_matches_one_process(dist_pool, name):
    """Trainer runs with FPDT chunks over a ring (offload too) and with ``ring_size="auto"``: every parameter
    after 2 steps and the losses against one process."""
    from helpers.lightning import compare_to_reference

    arch, world, sp, skw, mkw = TRAINER_CASES[name]
    out = dist_pool(world).run(_fit_with_ring, arch, sp, skw, mkw)
    compare_to_reference([r[0] for r in out], arch, sp, world, 2, mkw)
    assert all(r[1] == [skw["ring_size"] if skw["ring_size"] != "auto" else 2] for r in out), [
        r[1] for r in out
    ]
    used = "fpdt_ring_attention" if "fpdt_chunk_size" in skw else "usp_attention"
    assert all(r[2].get(used, 0) >= 4 and len(r[2]) == 1 for r in out), [
        r[2] for r in out
    ]  # 2 layers x 2 steps


def test_auto_ring_size():
    """The rule: 1 while sp fits the TP-local heads, else the smallest divisor of sp that makes U fit; its
    error without a model config; the backend check where "auto" resolves to a ring."""
    from lightning_longctx.config import SequenceParallelConfig, auto_ring_size

    assert [auto_ring_size(8, h) for h in (32, 8, 4, 3, 2, 1)] == [1, 1, 2, 4, 4, 8]
    assert auto_ring_size(6, 4) == 2 and auto_ring_size(12, 5) == 3
    cfg = SequenceParallelConfig(sequence_parallel_size=8, ring_size="auto")
    assert cfg.resolve(8, 0, "cpu", heads=32).layout.ring == 1
    assert cfg.resolve(8, 0, "cpu", heads=4).layout.ring == 2
    tp = SequenceParallelConfig(
        sequence_parallel_size=4, tensor_parallel_size=2, data_parallel="fsdp", ring_size="auto"
    )
    assert tp.resolve(8, 0, "cpu", heads=4).layout.ring == 2  # 2 heads per tp rank
    with pytest.raises(ValueError, match=r"ring_size='auto' needs the model's number of attention heads"):
        cfg.resolve(8, 0, "cpu")
    sdpa = SequenceParallelConfig(sequence_parallel_size=8, ring_size="auto", attention_backend="sdpa")
    assert sdpa.resolve(8, 0, "cpu", heads=8).layout.ring == 1
    with pytest.raises(ValueError, match=r"ring_size=2 with attention_backend='sdpa'"):
        sdpa.resolve(8, 0, "cpu", heads=4)
    with pytest.raises(ValueError, match=r"ring_size='ring': use a positive int .* or 'auto'"):
        SequenceParallelConfig(ring_size="ring")


@pytest.mark.parametrize(("value", "want"), [("auto", "auto"), ("2", 2)])
def test_ring_size_from_the_cli(value, want):
    """``--trainer.strategy.ring_size`` takes an int or ``auto`` (LightningCLI / YAML)."""
    import lightning as L

    from lightning_longctx import UlyssesFPDTStrategy
    from lightning_longctx.cli import LongCtxCLI

    cli = LongCtxCLI(
        L.LightningModule,
        None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.logger=false",
            "--trainer.strategy=lightning_longctx.UlyssesFPDTStrategy",
            f"--trainer.strategy.ring_size={value}",
            "--trainer.strategy.fpdt_chunk_size=2048",
            '--model.model_config={"model_type": "llama"}',
        ],
    )
    assert isinstance(cli.trainer.strategy, UlyssesFPDTStrategy)
    assert cli.trainer.strategy.sp_config.ring_size == want
    assert cli.trainer.strategy.sp_config.fpdt_chunk_size == 2048


def test_fpdt_ring_refusals():
    """Single process (both groups None: a ring of one, Ulysses of one): each error names the value and the fix;
    the ring's own checks (documents, window, tiles, backend) run before any collective."""
    from lightning_longctx.attention.fpdt_ring import fpdt_ring_attention

    q, k, v, _, pos, _ = inputs(dict(h=4, h_kv=2, packed=[5, 11, 3, 13, 9, 23]), n=N)
    docs = document_ids(pos)

    def call(**kw):
        args = dict(ulysses_group=None, ring_group=None, chunk_size=C)
        args.update(kw)
        return fpdt_ring_attention(q, k, v, **args)

    with pytest.raises(ValueError, match=r"chunk_size 3 must be .* whose double divides the local sequence"):
        call(chunk_size=3)
    with pytest.raises(
        ValueError, match=r"documents shape \(2, 8\) must be \(batch, whole sequence\) = \(2, 64\)"
    ):
        call(documents=docs[:, :8])
    with pytest.raises(ValueError, match="documents must not decrease along a row"):
        call(documents=docs.flip(1))
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        call(sliding_window=0)
    with pytest.raises(ValueError, match="block_size must be a positive"):
        call(block_size=0)
    with pytest.raises(ValueError, match=r"fpdt_ring_attention computes its blocks .* backend .sdpa."):
        call(backend="sdpa")
