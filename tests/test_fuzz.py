"""Randomized differential tests (hypothesis): the attention core against a float64 reference, and one
Trainer step of the strategy against a single-process loop, every parameter.

CI runs a fixed sample: ``derandomize=True`` (the same examples every run, chosen from the test's name)
and no example database. ``python benchmarks/fuzz.py --trials N --seed S`` runs long searches with
the same strategies and prints what it finds failing as cases ready to paste into ``REGRESSIONS``.
"""

from __future__ import annotations

import pytest
from fuzz_attention import TIMEOUT_S as EXAMPLE_TIMEOUT_S
from fuzz_attention import TOLERANCE as ATTN_TOLERANCE
from fuzz_attention import AttnCase, attention_cases, run_attention
from fuzz_common import run_verdict
from fuzz_strategy import TIMEOUT_S as STRATEGY_TIMEOUT_S
from fuzz_strategy import TOLERANCE as STRATEGY_TOLERANCE
from fuzz_strategy import StratCase, run_strategy, strategy_cases
from hypothesis import HealthCheck, given, settings

CI = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)

#: Layouts that crashed or disagreed once, found by users or the fuzzer: each must stay exact (or refused).
REGRESSIONS = {
    # FPDT offload on packed documents whose boundary lets the block plan skip a whole kv chunk: the kv
    # prefetch ran ahead of the chunk's arrival (KeyError ('k', 1) in offload.py)
    "offload_docs_skip_chunk_softcap": AttnCase(
        world=2, mode="fpdt", b=2, h=4, h_kv=4, d=8, chunk_size=4, chunks=2,
        docs=((8, 8), (4, 4, 7, 1)), softcap=20.0, offload=True,
    ),
    "offload_docs_skip_chunk_gqa": AttnCase(
        world=2, mode="fpdt", b=2, h=8, h_kv=4, d=16, chunk_size=8, chunks=4,
        docs=((5, 27, 32), (32, 32)), offload=True,
    ),
    "offload_window_1": AttnCase(
        world=2, mode="fpdt", b=1, h=2, h_kv=1, d=8, chunk_size=2, chunks=3, sliding_window=1, offload=True,
    ),
    # fewer query heads than ranks: the ranks that own no head called the fused CPU kernel with zero heads
    # (SIGFPE, every rank dead)
    "fpdt_h2_p4": AttnCase(world=4, mode="fpdt", b=1, h=2, h_kv=1, d=8, chunk_size=4, chunks=1),
    "fpdt_h3_p4": AttnCase(world=4, mode="fpdt", b=1, h=3, h_kv=1, d=8, chunk_size=4, chunks=1),
    "ulysses_h2_p4_docs": AttnCase(
        world=4, mode="ulysses", b=1, h=2, h_kv=1, d=8, chunk_size=2, chunks=2, docs=((5, 11),),
    ),
    # Ulysses x ring with fewer query heads than Ulysses ranks (h 1, U 2): the ranks without a head skipped
    # the ring's checks and waited in the inverse all-to-all while the others refused sdpa (a hang), and
    # left sinks.grad None
    "usp_h1_u2_refusal_on_every_rank": AttnCase(
        world=4, mode="ulysses", b=1, h=1, h_kv=1, d=4, chunk_size=1, chunks=2, causal=False, docs=((8,),),
        softcap=0.5, backend="sdpa", dtype="float64", ring_size=2, ring_kind="contiguous",
    ),
    "usp_h1_u2_sinks_grad": AttnCase(
        world=4, mode="ulysses", b=2, h=1, h_kv=1, d=16, chunk_size=5, chunks=1, causal=False, softcap=0.5,
        sinks=True, backend="math", dtype="float32", seed=2, ring_size=2, ring_kind="zigzag",
    ),
}  # fmt: skip


#: Trainer configurations worth keeping (found by benchmarks/fuzz.py --target strategy).
STRATEGY_REGRESSIONS = {
    # OPT's key biases start at 0 and get a gradient softmax cancels (1e-11 either way): compared against
    # the model's largest parameter (fuzz_strategy.FLOOR), not their own size
    "opt_zero_key_bias_fsdp_packed": StratCase(
        arch="opt", world=2, sp=2, seq=23, activation_checkpointing=True, activation_offload=True,
        data_parallel="fsdp", packed=True, seed=1,
    ),
    # tensor x sequence parallelism on packed documents with FPDT offload and two micro-batches (the TP tests
    # run unpacked batches); Qwen2's sliding window from layer 1 and its q/k/v biases split column-wise
    "qwen2_tp2_sp2_fpdt_offload_packed": StratCase(
        arch="qwen2", world=4, sp=2, seq=24, accumulate=2, fpdt_chunk_size=3, offload=True,
        data_parallel="fsdp", tensor_parallel_size=2, packed=True, seed=3,
    ),
    "gemma_tp2_dp2_fpdt_packed_ckpt": StratCase(
        arch="gemma", world=4, sp=1, seq=23, fpdt_chunk_size=4, activation_checkpointing=True, data_parallel="fsdp",
        tensor_parallel_size=2, packed=True, seed=5,
    ),
    # Mamba lists its block AND its mixer in _no_split_modules: FSDP2 sharded the block first and left the
    # nested mixer's weights sharded in forward (mixed Tensor / DTensor matmul); units now go innermost first
    "falcon_mamba_fsdp_nested_units_ckpt": StratCase(
        arch="falcon_mamba", world=4, sp=2, seq=16, accumulate=2, activation_checkpointing=True,
        activation_offload=True, data_parallel="fsdp", cpu_offload=True, seed=203,
    ),
    # a hybrid under FPDT with offload, sp 4 with 2 chunks of 3 tokens (the conv halo)
    "qwen3_5_fpdt_sp4_chunk3": StratCase(
        arch="qwen3_5_text", world=4, sp=4, seq=24, fpdt_chunk_size=3, offload=True, data_parallel="fsdp", seed=7,
    ),
    # packed documents on hybrids (issue 33): the Trainer path, the reference running each document alone
    "qwen3_5_packed_fpdt_sp2": StratCase(
        arch="qwen3_5_text", world=2, sp=2, seq=24, fpdt_chunk_size=4, packed=True, seed=11,
    ),
    "mamba_packed_sp2_ckpt": StratCase(
        arch="mamba", world=2, sp=2, seq=16, activation_checkpointing=True, packed=True, seed=13,
    ),
    "recurrent_gemma_packed_fpdt_sp2_ckpt": StratCase(
        arch="recurrent_gemma", world=2, sp=2, seq=24, fpdt_chunk_size=4, activation_checkpointing=True,
        packed=True, seed=23,
    ),
    # ... under tensor parallelism: the plan splits attention and the MLPs, the mixers stay whole on each TP rank
    # and exchange halos and states over their own sp group
    "qwen3_5_packed_tp2_sp2_fpdt": StratCase(
        arch="qwen3_5_text", world=4, sp=2, seq=24, fpdt_chunk_size=4, data_parallel="fsdp",
        tensor_parallel_size=2, packed=True, seed=17,
    ),
    "bamba_packed_tp2_sp2": StratCase(
        arch="bamba", world=4, sp=2, seq=16, data_parallel="fsdp", tensor_parallel_size=2, packed=True, seed=19,
    ),
    # ... RWKV's and xLSTM's log-scale normalisers behind the pieces' padding; documents at 0, 4, 13 (a chunk
    # start, across ranks) and 0, 6, 13 (across the shard edge)
    "rwkv_packed_fpdt_sp2": StratCase(arch="rwkv", world=2, sp=2, seq=24, fpdt_chunk_size=4, packed=True, seed=35),
    "xlstm_packed_sp2_ckpt": StratCase(
        arch="xlstm", world=2, sp=2, seq=16, activation_checkpointing=True, packed=True, seed=43,
    ),
    # refused until RWKV took packed rows (tests/test_hybrid.py REFUSED_RUNS): dp 2, offloaded activations
    "rwkv_dp2_packed_offload": StratCase(
        arch="rwkv", world=2, sp=1, seq=16, activation_offload=True, packed=True, seed=39962,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(STRATEGY_REGRESSIONS))
def test_strategy_regressions(dist_pool, name):
    case = STRATEGY_REGRESSIONS[name]
    verdict = run_verdict(dist_pool, case.world, run_strategy, case, STRATEGY_TOLERANCE, STRATEGY_TIMEOUT_S)
    assert verdict.kind == "exact", (case, verdict)


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_attention_regressions(dist_pool, name):
    case = REGRESSIONS[name]
    verdict = run_verdict(dist_pool, case.world, run_attention, case, ATTN_TOLERANCE, EXAMPLE_TIMEOUT_S)
    want = "refused" if case.backend == "sdpa" and case.ring_size > 1 else "exact"  # sdpa: not the ring's
    assert verdict.kind == want, (case, verdict)


@settings(CI, max_examples=40)
@given(case=attention_cases())
def test_attention_matches_reference_or_refuses(dist_pool, case):
    verdict = run_verdict(dist_pool, case.world, run_attention, case, ATTN_TOLERANCE, EXAMPLE_TIMEOUT_S)
    assert verdict.kind in ("exact", "refused"), (case, verdict)


@settings(CI, max_examples=12)
@given(case=attention_cases(worlds=(2, 4), ring_only=True))
def test_usp_attention_matches_reference_or_refuses(dist_pool, case):
    """Ulysses x ring alone (the sample above draws it in about a fifth of its examples): r | P, r > 1,
    zigzag and contiguous, with the features the ring takes."""
    verdict = run_verdict(dist_pool, case.world, run_attention, case, ATTN_TOLERANCE, EXAMPLE_TIMEOUT_S)
    assert verdict.kind in ("exact", "refused"), (case, verdict)


@settings(CI, max_examples=8)
@given(case=strategy_cases())
def test_trainer_step_matches_single_process_or_refuses(dist_pool, case):
    verdict = run_verdict(dist_pool, case.world, run_strategy, case, STRATEGY_TOLERANCE, STRATEGY_TIMEOUT_S)
    assert verdict.kind in ("exact", "refused"), (case, verdict)
