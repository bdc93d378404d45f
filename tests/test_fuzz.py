"""Randomized differential tests (hypothesis): the attention core against a float64 reference, and one
Trainer step of the strategy against a single-process loop, every parameter.

CI runs a fixed sample: ``derandomize=True`` (the same examples every run, chosen from the test's name)
and no example database. ``python benchmarks/fuzz.py --trials N --seed S`` runs long searches with
the same strategies and prints what it finds failing as cases ready to paste into ``REGRESSIONS``.

A refusal passes only where the target's table of documented refusals (``EXPECTED_REFUSALS`` of
``fuzz_strategy`` / ``fuzz_attention``) names it for the drawn configuration; the tests at the end show that a
configuration the package promises to run, refused, fails the fuzz (a sabotage of the package), and that the
strategy's draws are mostly sequence parallel.
"""

from __future__ import annotations

import re

import pytest
from fuzz_attention import EXPECTED_REFUSALS as ATTN_EXPECTED
from fuzz_attention import TIMEOUT_S as EXAMPLE_TIMEOUT_S
from fuzz_attention import TOLERANCE as ATTN_TOLERANCE
from fuzz_attention import AttnCase, attention_cases, run_attention
from fuzz_common import draw_examples, expected_refusals, judge, run_verdict
from fuzz_strategy import EXPECTED_REFUSALS as STRATEGY_EXPECTED
from fuzz_strategy import TIMEOUT_S as STRATEGY_TIMEOUT_S
from fuzz_strategy import TOLERANCE as STRATEGY_TOLERANCE
from fuzz_strategy import StratCase, distribution, run_strategy, strategy_cases
from hypothesis import HealthCheck, given, settings

from lightning_longctx.testing import Sabotage, assert_catches, sabotaged

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


def _strategy_trial(dist_pool, fn, case: StratCase):
    """One strategy trial: ``fn(case)`` on ``case.world`` ranks, judged with the strategy's documented refusals."""
    return run_verdict(
        dist_pool, case.world, fn, case, STRATEGY_TOLERANCE, STRATEGY_TIMEOUT_S, STRATEGY_EXPECTED
    )


def _attention_trial(dist_pool, fn, case: AttnCase):
    """One attention trial, judged with the attention core's documented refusals."""
    return run_verdict(dist_pool, case.world, fn, case, ATTN_TOLERANCE, EXAMPLE_TIMEOUT_S, ATTN_EXPECTED)


def _assert_exact_or_refused(verdict, case) -> None:
    """What a fuzz trial must be: exact, or refused as documented (``verdict.expected`` names the class)."""
    if verdict.kind not in ("exact", "refused"):
        raise AssertionError(f"{case!r} is {verdict.kind}: {verdict.detail}")


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
    verdict = _strategy_trial(dist_pool, run_strategy, case)
    assert verdict.kind == "exact", (case, verdict)


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_attention_regressions(dist_pool, name):
    case = REGRESSIONS[name]
    verdict = _attention_trial(dist_pool, run_attention, case)
    want = "refused" if case.backend == "sdpa" and case.ring_size > 1 else "exact"  # sdpa: not the ring's
    assert verdict.kind == want, (case, verdict)


@settings(CI, max_examples=40)
@given(case=attention_cases())
def test_attention_matches_reference_or_refuses(dist_pool, case):
    _assert_exact_or_refused(_attention_trial(dist_pool, run_attention, case), case)


@settings(CI, max_examples=12)
@given(case=attention_cases(worlds=(2, 4), ring_only=True))
def test_usp_attention_matches_reference_or_refuses(dist_pool, case):
    """Ulysses x ring alone (the sample above draws it in about a fifth of its examples): r | P, r > 1,
    zigzag and contiguous, with the features the ring takes."""
    _assert_exact_or_refused(_attention_trial(dist_pool, run_attention, case), case)


@settings(CI, max_examples=8)
@given(case=strategy_cases())
def test_trainer_step_matches_single_process_or_refuses(dist_pool, case):
    _assert_exact_or_refused(_strategy_trial(dist_pool, run_strategy, case), case)


# ---- the fuzz can fail on a refusal, and draws what the package exists for ----------------------------------


def _no_block_backends(original: tuple[str, ...]) -> tuple[str, ...]:
    """A regression: no backend counts as one of FPDT's block backends (``FPDT_BACKENDS`` empty), so the package
    refuses the ring (``config.py``) or FPDT (``attention/fpdt.py``) for any backend, in its own code."""
    return ()


RING_REFUSED = Sabotage(
    "the ring refused for every backend", "lightning_longctx.config:FPDT_BACKENDS", _no_block_backends
)
FPDT_REFUSED = Sabotage(
    "FPDT refused for every backend", "lightning_longctx.attention.fpdt:FPDT_BACKENDS", _no_block_backends
)


def test_a_promised_configuration_refused_fails_the_strategy_fuzz(dist_pool):
    """Llama, sp 2 x ring 2: no documented refusal applies; with the ring refused in the package's own code, the
    trial is failing, naming the refusal. A documented refusal (OPT under tensor parallelism: no TP plan) stays
    ``refused``, with its class named."""
    promised = StratCase(arch="llama", world=2, sp=2, seq=16, ring_size=2)
    assert expected_refusals(promised, STRATEGY_EXPECTED) == []
    broken = sabotaged(RING_REFUSED, run_strategy)
    error = assert_catches(
        lambda: _assert_exact_or_refused(_strategy_trial(dist_pool, broken, promised), promised),
        RING_REFUSED,
        match=r"unexpected refusal \(no expected refusal applies.*ValueError: ring_size=2 with attention_backend",
    )
    assert " is failing: unexpected refusal" in str(error)

    documented = StratCase(arch="opt", world=2, sp=1, seq=16, data_parallel="fsdp", tensor_parallel_size=2)
    verdict = _strategy_trial(dist_pool, run_strategy, documented)
    assert (verdict.kind, verdict.expected) == ("refused", "no tensor-parallel plan"), verdict


def test_a_refusal_inside_the_first_step_under_fsdp_reaches_the_user(dist_pool):
    """Doge edits its own mask, refused in the self-test's forward while FSDP2 has the parameters gathered. The
    teardown used to move that half-gathered model to the CPU and die with FSDP's AttributeError
    ('_local_tensor'), a dead rank hiding the refusal (found by the fuzz, issue 43)."""
    case = StratCase(arch="doge", world=2, sp=2, seq=16, data_parallel="fsdp")
    verdict = _strategy_trial(dist_pool, run_strategy, case)
    assert verdict.kind == "refused" and "MaskEditedError" in verdict.refusal, verdict


def test_a_promised_call_refused_fails_the_attention_fuzz(dist_pool):
    """FPDT at P = 2 with backend "auto": with FPDT's block backends emptied the package refuses it, and the
    trial is failing; sdpa in the ring stays ``refused``, as documented."""
    promised = AttnCase(world=2, mode="fpdt", b=1, h=2, h_kv=1, d=8, chunk_size=2, chunks=2)
    broken = sabotaged(FPDT_REFUSED, run_attention)
    assert_catches(
        lambda: _assert_exact_or_refused(_attention_trial(dist_pool, broken, promised), promised),
        FPDT_REFUSED,
        match=r"unexpected refusal \(no expected refusal applies.*computes its blocks with kernels",
    )
    documented = AttnCase(world=2, mode="ulysses", b=1, h=2, h_kv=1, d=8, chunk_size=2, chunks=2, backend="sdpa",
                          ring_size=2)  # fmt: skip
    verdict = _attention_trial(dist_pool, run_attention, documented)
    assert (verdict.kind, verdict.expected) == ("refused", "sdpa in the ring"), verdict


#: Drawn configurations and the documented refusals that apply to each (docs/troubleshooting.md, the sweep's page)
CLASSIFIED = [
    (StratCase(arch="llama", world=4, sp=4, seq=16, ring_size=4, packed=True), []),
    (StratCase(arch="qwen3_5_text", world=4, sp=4, seq=24, ring_size=4), []),  # 3 tokens per half: k-1 = 3
    (StratCase(arch="qwen3_5_text", world=4, sp=4, seq=16, ring_size=4), ["a segment shorter than a convolution's halo"]),
    (StratCase(arch="qwen3_5_text", world=4, sp=4, seq=8), ["a segment shorter than a convolution's halo"]),
    (StratCase(arch="olmo_hybrid", world=1, sp=1, seq=16, fpdt_chunk_size=2), ["a segment shorter than a convolution's halo"]),
    (StratCase(arch="lfm2", world=2, sp=2, seq=16, fpdt_chunk_size=2), []),  # kernel 3: chunks of 2 hold its halo
    (StratCase(arch="modernbert-decoder", world=2, sp=2, seq=16), []),
    (StratCase(arch="modernbert-decoder", world=2, sp=2, seq=16, fpdt_chunk_size=4), ["architecture the sweep refuses"]),
    (StratCase(arch="bloom", world=1, sp=1, seq=16), ["architecture the sweep refuses"]),
    (StratCase(arch="mamba", world=4, sp=2, seq=16, data_parallel="fsdp", tensor_parallel_size=2), ["no tensor-parallel plan"]),
    (StratCase(arch="apertus", world=4, sp=2, seq=16, data_parallel="fsdp", tensor_parallel_size=2), ["a parameter the TP plan misses"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "case, classes", CLASSIFIED, ids=lambda x: x.arch if isinstance(x, StratCase) else None
)
def test_documented_refusals_apply_to_their_configurations_alone(case, classes):
    """Which documented refusals apply to a case (no run); a refusal whose message is not one of them fails."""
    assert expected_refusals(case, STRATEGY_EXPECTED) == classes
    other = (
        "ValueError: tensor_parallel_size=2: X declares no tensor-parallel plan (config.base_model_tp_plan)"
    )
    if "no tensor-parallel plan" not in classes:
        verdict = judge([("refused", other)] * case.world, STRATEGY_TOLERANCE, case, STRATEGY_EXPECTED)
        assert verdict.kind == "failing" and "unexpected refusal" in verdict.detail, verdict


def _check_draws(n: int) -> dict[str, dict[str, int]]:
    """``n`` draws of the strategy fuzz (nothing run) must be mostly sequence parallel (sp >= 2 in 7 of 10), with
    the ring at 2 and 4, FPDT with offload, packed rows and the hybrids all common, and one process, data and
    tensor parallelism still drawn. Returns the distribution. The bounds leave room: hypothesis's
    ``sampled_from`` is not an independent uniform draw, and its draws move with the settings profile in effect
    (1000 draws gave hybrids 28-36 %, sp >= 2 78-84 %, FPDT offload 32-36 % between a lone run and the suite);
    the sabotages below land far outside (hybrids 1.5 %, sp >= 2 61 %)."""
    cases = draw_examples(strategy_cases(), n)
    dist = distribution(cases)
    share = {name: {v: k / len(cases) for v, k in counts.items()} for name, counts in dist.items()}
    sp, ring = share["sp"], share["ring"]
    checks = {
        "sp >= 2 in 7 of 10": sp.get("2", 0) + sp.get("4", 0) >= 0.7,
        "sp 2 and sp 4 each in 1 of 7": min(sp.get("2", 0), sp.get("4", 0)) >= 0.15,
        "a ring in 3 of 10, ring 4 in 1 of 20": ring.get("2", 0) + ring.get("4", 0) >= 0.3
        and ring.get("4", 0) >= 0.05,
        "FPDT with offload in 1 of 4": sum(c.offload for c in cases) / len(cases) >= 0.25,
        "packed rows in 11 of 20": share["packed"].get("True", 0) >= 0.55,
        "hybrids in 1 of 5": share["hybrid"].get("True", 0) >= 0.2,
        "one process, dp and tp still drawn": share["world"].get("1", 0) > 0
        and share["dp"].get("2", 0) >= 0.1
        and share["tp"].get("2", 0) >= 0.1,
    }
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        raise AssertionError(f"the strategy fuzz's draws miss {failed}: {dist}")
    return dist


def _uniform(weights: dict) -> dict:
    """Every key of ``weights`` at weight 1: layouts drawn without favouring sequence parallelism."""
    return dict.fromkeys(weights, 1)


def _no_hybrid_family(weights: dict) -> dict:
    """The architecture drawn as before the families: a model the sweep finds exact, now and then any dense one."""
    return {"attention": 5, "any": 1}


def test_strategy_draws_are_mostly_sequence_parallel():
    """1000 draws meet :func:`_check_draws`; 200 fail it with the layouts drawn uniformly (sp >= 2 in 4 of 7), or
    the architectures drawn as before (hybrids only among the others)."""
    _check_draws(1000)
    for target, wrap, missed in (
        ("fuzz_strategy:LAYOUTS", _uniform, "sp >= 2 in 7 of 10"),
        ("fuzz_strategy:FAMILIES", _no_hybrid_family, "hybrids in 1 of 5"),
    ):
        sabotage = Sabotage(f"{wrap.__name__} {target}", target, wrap)
        assert_catches(lambda: _check_draws(200), sabotage, match=f"draws miss .*{re.escape(missed)}")
