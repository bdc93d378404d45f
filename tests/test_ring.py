"""Ring attention vs float64 full attention of the whole sequence, on real gloo rings (r = 1, 2, 4): outputs
and dq/dk/dv/dsinks of every rank, both layouts, both block backends; the layout's maps, the causal balance,
the bytes per rank and the refusals."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from helpers.launch import process_groups
from helpers.marks import WORLD8
from helpers.ring import CASES, TOL, D, N, check_rank_errors, inputs, reference, usp_errors
from lightning_longctx.attention.ring import RING_LAYOUTS, RingLayout, ring_attention, ring_work
from lightning_longctx.parallel.comm import count_all_to_all
from lightning_longctx.parallel.sharding import document_ids

BACKENDS = ("auto", "math")


def _ring(cfg: dict, layout: RingLayout, rank: int, group, backend: str, q, k, v, w, pos, sinks):
    """This rank's (out, dq, dk, dv) in local order, its partial dsinks, the kernels run and the work."""
    ins = [layout.shard(x, rank).requires_grad_() for x in (q, k, v)]
    s = None if sinks is None else sinks.clone().requires_grad_()
    docs = None if pos is None else document_ids(pos)
    out = ring_attention(
        *ins,
        group=group,
        layout=layout,
        causal=cfg.get("causal", True),
        softmax_scale=cfg.get("scale"),
        sliding_window=cfg.get("window"),
        documents=docs,
        softcap=cfg.get("softcap"),
        sinks=s,
        backend=backend,
        block_size=cfg.get("block", 1024),
    )
    call = out.grad_fn.call
    (out * layout.shard(w, rank)).sum().backward()
    return (
        (out.detach(), *(x.grad for x in ins)),
        None if s is None else s.grad,
        call.plan.kernel_names(),
        call.work,
    )


def _errors(cfg: dict, group=None, n: int = N, seed: int = 0, backends=BACKENDS) -> dict:
    """{(kind, backend): {"out", "dq", "dk", "dv": max abs error of this rank's shard, "finite", "dsinks"
    (partial), "ref_dsinks", "kernels", "work_ok"}}, against the reference of the whole sequence."""
    rank, world = (0, 1) if not dist.is_initialized() else (dist.get_rank(group), dist.get_world_size(group))
    q, k, v, w, pos, sinks = inputs(cfg, n, seed)
    ref = reference(cfg, q, k, v, w, pos, sinks)
    found = {}
    for kind in RING_LAYOUTS:
        layout = RingLayout(ring_size=world, seq_len=n, kind=kind)
        want = [layout.shard(x, rank) for x in ref[:4]]
        for backend in backends:
            got, dsinks, kernels, work = _ring(cfg, layout, rank, group, backend, q, k, v, w, pos, sinks)
            docs = None if pos is None else document_ids(pos)
            expected_work = ring_work(
                layout,
                causal=cfg.get("causal", True),
                sliding_window=cfg.get("window"),
                documents=docs,
                block_size=cfg.get("block", 1024),
            )[rank]
            found[kind, backend] = {
                **{nm: (a - b).abs().max().item() for nm, a, b in zip(("out", "dq", "dk", "dv"), got, want)},
                "finite": all(bool(torch.isfinite(x).all()) for x in got),
                "dsinks": dsinks,
                "ref_dsinks": ref[4],
                "kernels": kernels,
                "work_ok": backend == "auto" or work == expected_work,
            }
    return found


def _all_cases() -> dict:
    return {name: _errors(cfg) for name, cfg in CASES.items()}


def _check(name: str, cfg: dict, per_rank: list[dict]) -> None:
    """Every rank's shard within TOL, finite; dsinks summed over the ring within TOL; the kernels expected."""
    for key in per_rank[0]:
        res = [r[key] for r in per_rank]
        worst = {nm: max(x[nm] for x in res) for nm in ("out", "dq", "dk", "dv")}
        assert max(worst.values()) < TOL, (name, key, worst)
        assert all(x["finite"] for x in res), (name, key)
        assert all(x["work_ok"] for x in res), (name, key)
        if res[0]["ref_dsinks"] is not None:
            err = (sum(x["dsinks"] for x in res) - res[0]["ref_dsinks"]).abs().max().item()
            assert err < TOL, (name, key, err)
        backend = key[1]
        fused_ok = backend == "auto" and "softcap" not in cfg
        assert all(x["kernels"] == ({"cpu_flash"} if fused_ok else {"math"}) for x in res), (name, key)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_matches_full_attention(dist_pool, world):
    """Every case of CASES x both layouts x both block backends in one pool call per ring size: out, dq, dk,
    dv of every rank and the ring-summed dsinks within 1e-10 of float64 full attention, all finite."""
    per_rank = dist_pool(world).run(_all_cases)
    for name in CASES:
        _check(name, CASES[name], [r[name] for r in per_rank])


def _strided_rings() -> dict:
    """Two rings of 2 over 4 ranks, strided as USP lays them out ({0, 2} and {1, 3}): neighbours are found
    by ring rank, not global rank."""
    with process_groups() as own:
        rings = [own(dist.new_group([0, 2])), own(dist.new_group([1, 3]))]
        mine = rings[dist.get_rank() % 2]
        return _errors(CASES["everything"], group=mine, seed=dist.get_rank() % 2)


def test_ring_on_strided_subgroups(dist_pool):
    per_rank = dist_pool(4).run(_strided_rings)
    _check("everything", CASES["everything"], [per_rank[0], per_rank[2]])
    _check("everything", CASES["everything"], [per_rank[1], per_rank[3]])


def test_ring_of_one_without_torch_distributed():
    """r = 1 with no process group at all (group=None): plain attention, exact."""
    for name in ("everything", "softcap"):
        _check(name, CASES[name], [_errors(CASES[name])])


def _bytes(dtype_name: str) -> tuple[int, int, int, int, int]:
    """(forward bytes, forward passes, backward bytes, backward passes, all-to-all calls) of one GQA call."""
    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = RingLayout(ring_size=world, seq_len=N, kind="zigzag")
    q, k, v, w, _, _ = inputs(dict(h=4, h_kv=2))
    ins = [layout.shard(x, rank).to(dtype).requires_grad_() for x in (q, k, v)]
    with count_all_to_all() as fwd:
        out = ring_attention(*ins, group=None, layout=layout, backend="math")
    with count_all_to_all() as bwd:
        out.backward(layout.shard(w, rank).to(dtype))
    return (
        fwd.exchange_bytes,
        fwd.exchange_calls,
        bwd.exchange_bytes,
        bwd.exchange_calls,
        fwd.calls + bwd.calls,
    )


@pytest.mark.parametrize("world", [2, 4])
def test_ring_bytes_equal_the_formula(dist_pool, world):
    """Forward: r-1 passes of one k/v block at kv-head size; backward: k/v again plus fp32 (fp64) dk/dv home
    after r hops. B = 2 b (N/r) h_kv d elements per block."""
    r, block = world, 2 * 2 * (N // world) * 2 * D  # b = 2, h_kv = 2
    for dtype_name, e, e_acc in (("float64", 8, 8), ("bfloat16", 2, 4)):
        for fwd, fwd_calls, bwd, bwd_calls, all_to_alls in dist_pool(world).run(_bytes, dtype_name):
            assert (fwd, fwd_calls) == ((r - 1) * block * e, r - 1), dtype_name
            assert (bwd, bwd_calls) == ((r - 1) * block * e + r * block * e_acc, 2 * r - 1), dtype_name
            assert all_to_alls == 0


@pytest.mark.parametrize("r", [2, 4])
def test_zigzag_balances_causal_work(r):
    """Score elements per rank (causal, one tile per block): zigzag within 10 % of the mean (equal, in
    fact: (2r + 1) chunk_len^2 each), contiguous not (rank j computes (j + 1) (N/r)^2)."""
    n = 64
    for kind in RING_LAYOUTS:
        work = ring_work(RingLayout(ring_size=r, seq_len=n, kind=kind))
        mean = sum(work) / r
        spread = max(abs(x - mean) for x in work) / mean
        if kind == "zigzag":
            assert spread <= 0.10 and work == [(2 * r + 1) * (n // (2 * r)) ** 2] * r, work
        else:
            assert spread > 0.10 and work == [(j + 1) * (n // r) ** 2 for j in range(r)], work


@pytest.mark.parametrize("r", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("kind", RING_LAYOUTS)
def test_layout_maps(r, kind):
    n = 48 * r
    layout = RingLayout(ring_size=r, seq_len=n, kind=kind)
    x = torch.arange(n)[None].repeat(2, 1)  # (b, N) global order
    shards = [layout.shard(x, j) for j in range(r)]
    assert torch.equal(layout.unshard(torch.cat(shards, dim=1)), x)
    assert sorted(torch.cat(shards, dim=1)[0].tolist()) == list(range(n))  # every token once
    for j, shard in enumerate(shards):
        assert torch.equal(shard[0], layout.global_index(j))
        runs = layout.runs(j)
        assert torch.equal(shard[0], torch.cat([torch.arange(s, s + m) for s, m in runs]))
        c, local = layout.chunk_len, layout.local_len
        if kind == "contiguous":
            assert layout.chunks(j) == (j,) and runs == ((j * local, local),)
        elif j == r - 1:  # chunks r-1 and r follow each other: one run
            assert layout.chunks(j) == (j, r) and runs == ((j * c, 2 * c),)
        else:
            assert layout.chunks(j) == (j, 2 * r - 1 - j) and runs == ((j * c, c), ((2 * r - 1 - j) * c, c))


def test_layout_refusals():
    with pytest.raises(ValueError, match=r"seq_len 30 is not divisible by 2 x ring_size = 8.*pad"):
        RingLayout(ring_size=4, seq_len=30)
    with pytest.raises(ValueError, match=r"seq_len 30 is not divisible by ring_size = 4"):
        RingLayout(ring_size=4, seq_len=30, kind="contiguous")
    with pytest.raises(ValueError, match=r"kind 'stripe' is unknown.*zigzag"):
        RingLayout(ring_size=2, seq_len=32, kind="stripe")
    with pytest.raises(ValueError, match="ring_size must be a positive"):
        RingLayout(ring_size=0, seq_len=32)
    layout = RingLayout(ring_size=2, seq_len=32)
    with pytest.raises(ValueError, match=r"ring rank 2 is outside the ring of 2"):
        layout.chunks(2)
    with pytest.raises(ValueError, match=r"has 16 tokens, the layout's seq_len is 32"):
        layout.shard(torch.zeros(1, 16), 0)
    with pytest.raises(TypeError):
        RingLayout(2, 32)  # keyword-only


def test_ring_refusals():
    """Single process (group None = a ring of one): each error names the value, the rule and the fix."""
    q, k, v, _, pos, _ = inputs(dict(h=4, h_kv=2, packed=[5, 11]), n=16)
    one = RingLayout(ring_size=1, seq_len=16)
    docs = document_ids(pos)

    def call(**kw):
        args = dict(group=None, layout=one)
        args.update(kw)
        x = args.pop("q", q)
        return ring_attention(x, args.pop("k", k), args.pop("v", v), **args)

    with pytest.raises(ValueError, match=r"ring group has 1 ranks but layout.ring_size is 2.*process group"):
        call(layout=RingLayout(ring_size=2, seq_len=32))
    with pytest.raises(
        ValueError, match=r"q holds 16 tokens per ring rank.*seq_len / ring_size = 32.*layout.shard"
    ):
        call(layout=RingLayout(ring_size=1, seq_len=32))
    with pytest.raises(TypeError, match="layout must be a RingLayout"):
        call(layout=(1, 16))
    with pytest.raises(ValueError, match=r"sinks must have shape \(num_heads,\) = \(4,\)"):
        call(sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"backend 'nope' is unknown"):
        call(backend="nope")
    with pytest.raises(ValueError, match=r"backend .sdpa. is not used there.*.auto."):
        call(backend="sdpa")
    with pytest.raises(ValueError, match="no fused block kernel applies logit soft-capping"):
        call(backend="fused", softcap=2.0)
    with pytest.raises(ValueError, match="softcap must be a positive"):
        call(softcap=0.0)
    with pytest.raises(
        ValueError, match=r"documents shape \(2, 8\) must be \(batch, whole sequence\) = \(2, 16\)"
    ):
        call(documents=docs[:, :8])
    with pytest.raises(ValueError, match="documents must not decrease along a row"):
        call(documents=docs.flip(1))
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        call(sliding_window=0)
    with pytest.raises(ValueError, match="block_size must be a positive"):
        call(block_size=0)
    with pytest.raises(ValueError, match="must have the same dtype"):
        call(v=v.float())
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        call(k=k[:, :, :1].repeat(1, 1, 3, 1), v=v[:, :, :1].repeat(1, 1, 3, 1))
    with pytest.raises(ValueError, match="bshd"):
        call(q=q[0])


def _sweep(seed: int) -> list[tuple[dict, dict]]:
    """Random configurations at N = 64: heads, GQA, documents, windows, softcap, sinks, tiles, scale."""
    rng = random.Random(seed)
    out = []
    for trial in range(6):
        h_kv = rng.choice([1, 2, 3])
        cfg = dict(h=h_kv * rng.choice([1, 2]), h_kv=h_kv, causal=rng.random() < 0.8, b=rng.choice([1, 2]))
        if rng.random() < 0.6:
            cfg["packed"] = [rng.randint(1, 30) for _ in range(5)]
        if rng.random() < 0.5:
            cfg["window"] = rng.randint(1, 40)
        if rng.random() < 0.3:
            cfg["softcap"] = rng.choice([0.5, 3.0])
        if rng.random() < 0.5:
            cfg["sinks"] = [rng.choice([-8.0, 8.0, 0.0, 2.5]) for _ in range(cfg["h"])]
        if rng.random() < 0.5:
            cfg["block"] = rng.choice([3, 5, 7])
        cfg["scale"] = rng.choice([None, 0.7])
        out.append((cfg, _errors(cfg, n=64, seed=seed * 100 + trial)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_random_sweep(dist_pool, world):
    """Six random configurations per ring size, both layouts and backends, N = 64."""
    per_rank = dist_pool(world).run(_sweep, world)
    for trial, (cfg, _) in enumerate(per_rank[0]):
        _check(f"sweep {trial} {cfg}", cfg, [r[trial][1] for r in per_rank])


# ---- 2-D sequence parallelism: Ulysses inside, the ring outside (usp_attention) -------------------------


@pytest.mark.parametrize(
    ("world", "ring"), [(2, 2), (4, 2), (4, 4), pytest.param(8, 2, marks=[WORLD8, pytest.mark.slow])]
)
def test_usp_matches_full_attention(dist_pool, world, ring):
    """(U, r) = (1, 2), (2, 2), (1, 4), and (4, 2) at world 8 (opt-in): every rank's out, dq, dk, dv within 1e-10 of float64 full attention,
    dsinks summed over the sp group too; both layouts; GQA with fewer kv heads than U, uneven heads, documents,
    windows, sinks."""
    check_rank_errors(dist_pool(world).run(usp_errors, ring))


# ---- the strategy: ring_size (Ulysses x ring) against one process --------------------------------------

TRAINER_CASES = {
    # name: (arch, world, sp, strategy kwargs, model kwargs)
    "llama_sp2_ring2": ("llama", 2, 2, {"ring_size": 2}, {}),  # U = 1: a pure ring
    "llama_sp4_ring2": ("llama", 4, 4, {"ring_size": 2}, {}),  # U = 2, r = 2
    "llama_gqa_kv1_sp4_ring4": ("llama", 4, 4, {"ring_size": 4}, {"kv_heads": 1}),
    "qwen2_fsdp_dp2_sp2_ring2": ("qwen2", 4, 2, {"ring_size": 2, "data_parallel": "fsdp"}, {}),
}


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_strategy_ring_matches_one_process(dist_pool, name):
    """Trainer runs with ``ring_size``: every parameter after 2 steps and the losses against one process (24
    tokens: padded to a multiple of 2P, the zigzag chunks split over the Ulysses ranks)."""
    from helpers.lightning import compare_to_reference, fit_hf

    arch, world, sp, skw, mkw = TRAINER_CASES[name]
    results = dist_pool(world).run(fit_hf, arch, sp, 2, skw, mkw)
    compare_to_reference(results, arch, sp, world, 2, mkw)


def test_strategy_ring_refusals():
    """A ring that does not divide sp and a backend the ring cannot use are refused by name."""
    from lightning_longctx.config import SequenceParallelConfig
    from lightning_longctx.planner.plan import parallel_kwargs

    with pytest.raises(ValueError, match=r"ring_size=3 must divide sequence_parallel_size=4"):
        SequenceParallelConfig(sequence_parallel_size=4, ring_size=3).resolve(4, 0, "cpu")
    with pytest.raises(
        ValueError, match=r"ring_size=2 with attention_backend='sdpa': ring attention runs FPDT"
    ):
        SequenceParallelConfig(ring_size=2, attention_backend="sdpa")
    with pytest.raises(ValueError, match=r"ring_size=0: use a positive int"):
        SequenceParallelConfig(ring_size=0)
    resolved = SequenceParallelConfig(sequence_parallel_size=4, ring_size=2).resolve(8, 0, "cpu")
    assert parallel_kwargs(resolved)["ring_size"] == 2  # the planner plans the ring (tests/test_planner.py)


def test_shard_batch_ring_layout_is_the_ring_layouts():
    """``shard_batch(..., ring=r)`` gives sp rank ``j*U + u`` ``RingLayout.sp_shard``'s tokens, pads to 2P, and
    ``gather_sequence`` / ``global_index`` invert it (one process standing in for each rank's view)."""
    from lightning_longctx.parallel.layout import SequenceLayout
    from lightning_longctx.parallel.sharding import global_index

    for world, ring in ((2, 2), (4, 2), (4, 4), (8, 2)):
        n, u_size = 16 * world, world // ring
        layout = RingLayout(ring_size=ring, seq_len=n, kind="zigzag")
        x = torch.arange(n)[None]
        rows = SequenceLayout(sp=world, ring=ring).index(n)
        for s in range(world):
            j, u = divmod(s, u_size)
            assert torch.equal(rows[s], layout.sp_shard(x, j, u, u_size)[0])
            assert torch.equal(
                global_index(n // world, rank=s, world=world, chunk_size=None, ring=ring), rows[s]
            )
        assert sorted(rows.flatten().tolist()) == list(range(n))


# ---- world 8: sp 8 = ring 2 x Ulysses 4 under the Trainer (opt-in) -------------------------------------


def _fit_usp_world8_grads() -> tuple:
    """One pool rank: ``fit_hf``'s results for a tiny Llama at sp 8, ring 2, and every parameter's gradient
    at the last optimizer step (what SGD applies: after the strategy's reduction)."""
    import lightning as L

    from helpers.lightning import fit_hf

    grads: dict = {}

    class LastGradients(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.update(
                (n.removeprefix("model."), p.grad.detach().clone())
                for n, p in pl_module.named_parameters()
                if p.grad is not None
            )

    results = fit_hf("llama", 8, 2, {"ring_size": 2}, {}, trainer_kwargs={"callbacks": [LastGradients()]})
    return results, grads


@pytest.mark.slow
@WORLD8
def test_strategy_usp_world8_matches_one_process(dist_pool):
    """sp 8 = ring 2 x Ulysses 4 (8 processes on 2 cores: opt-in, ``LONGCTX_WORLD8=1``): a tiny Llama (4 heads,
    2 kv heads: one query head per Ulysses rank, the kv heads spread; 24 tokens padded to 2P = 16 x 2), every
    parameter after 2 steps and the losses (``compare_to_reference``), and every parameter's gradient of the
    second step on every rank, against one process."""
    from helpers.hf_models import TokenDataset, reference_training, tiny_model
    from helpers.lightning import SEQ, compare_to_reference

    per_rank = dist_pool(8).run(_fit_usp_world8_grads)
    compare_to_reference([r[0] for r in per_rank], "llama", 8, 8, 2, {})
    ref = tiny_model("llama")
    reference_training(ref, TokenDataset(2, SEQ), dp=1, batch_size=1, steps=2)  # leaves step 2's gradients
    want = {n: p.grad for n, p in ref.named_parameters()}
    for rank, (_, grads) in enumerate(per_rank):
        assert set(grads) == set(want), (rank, sorted(set(grads) ^ set(want)))
        for name, g in want.items():
            err = (grads[name] - g).abs().max().item() / g.abs().max().item()
            assert err < 1e-5, f"rank {rank} {name}: gradient relative error {err:.2e}"
