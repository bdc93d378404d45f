"""Negative checks: each exactness check below FAILS on a deliberately broken version of the code it guards
(``lightning_longctx.testing.sabotage``), with the error figure the CHANGELOG quotes for that break:

* ``usp_attention`` against float64 full attention, (U, r) = (2, 2) (``tests/test_ring.py``'s check): a
  reversed Ulysses piece order fails at 3.3 (the closing note of issue 32), 4.1 when the all-to-all reverses;
* the Trainer with ``ring_size=2`` against one process (``tests/test_ring.py``): the HF attention swap with a
  zigzag-blind layout (contiguous, on zigzag-sharded tokens) fails at 0.24;
* MiniMax, RWKV and xLSTM on packed rows against each document alone (``tests/test_hybrid_packed.py``), P = 2,
  FPDT: with the document handling of their recurrences off, gradients 1.3, 0.60, 3.0 off.

Each check is an existing test's own code (its rank function and its comparison) run under a
:class:`~lightning_longctx.testing.Sabotage` that every rank enters for that one call
(:func:`~lightning_longctx.testing.sabotaged`): the warm pools' ranks get the real code back after it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
from arch_sweep import PACKED_TOLERANCE, sweep_packed
from fuzz_attention import TIMEOUT_S, TOLERANCE, AttnCase, run_attention
from fuzz_common import run_verdict

from helpers.ring import check_rank_errors, usp_errors
from lightning_longctx.testing import Sabotage, assert_catches, assert_error_above, sabotaged

# ---- the sabotages (top-level functions, so that a Sabotage naming them pickles to the ranks) -----------


def _reverse_sp_pieces(sp_shard: Any) -> Any:
    """``RingLayout.sp_shard`` giving sp rank (j, u) piece ``U-1-u`` of ring rank j's tokens: the all-to-all
    (which concatenates the pieces in u order) then hands the ring its tokens out of layout order."""

    def reversed_pieces(
        self: Any, x: torch.Tensor, ring_rank: int, ulysses_rank: int, ulysses: int, dim: int = 1
    ) -> torch.Tensor:
        return sp_shard(self, x, ring_rank, ulysses - 1 - ulysses_rank, ulysses, dim)

    return reversed_pieces


def _reverse_all_to_all_pieces(seq_to_head_packed: Any) -> Any:
    """The Ulysses all-to-all of ``usp_attention`` with the U pieces of each output ``(b, U*s, h/U, d)``
    reversed."""

    def reversed_pieces(*xs: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, ...]:
        out = seq_to_head_packed(*xs, group=group)
        return tuple(y.unflatten(1, (-1, xs[0].shape[1])).flip(1).flatten(1, 2) for y in out)

    return reversed_pieces


def _zigzag_blind(usp_attention: Any) -> Any:
    """The HF swap's ``usp_attention`` told the ring's tokens are contiguous, while ``shard_batch`` laid them
    out zigzag."""

    def blind(*args: Any, layout: Any, **kwargs: Any) -> torch.Tensor:
        return usp_attention(*args, layout=dataclasses.replace(layout, kind="contiguous"), **kwargs)

    return blind


def _no_state_resets(documents: Any) -> Any:
    """``MixerCall.documents`` answering "one document per row" to the recurrences (the calls without a halo):
    their state runs on across document starts. Convolutions and token shifts (a halo) keep theirs."""

    def documents_unless_recurrent(self: Any, local_len: int, batch: int, halo: int, device: Any) -> Any:
        return None if halo == 0 else documents(self, local_len, batch, halo, device)

    return documents_unless_recurrent


SP_SHARD_REVERSED = Sabotage(
    "sp_shard's pieces reversed", "lightning_longctx.parallel.layout:RingLayout.sp_shard", _reverse_sp_pieces
)
ALL_TO_ALL_REVERSED = Sabotage(
    "the all-to-all's pieces reversed",
    "lightning_longctx.attention.ring:seq_to_head_packed",
    _reverse_all_to_all_pieces,
)
ZIGZAG_BLIND = Sabotage(
    "zigzag-blind HF swap", "lightning_longctx.attention.dispatch:usp_attention", _zigzag_blind
)
STATE_RESETS_OFF = Sabotage(
    "no state reset at document starts",
    "lightning_longctx.integrations.hybrid.base:MixerCall.documents",
    _no_state_resets,
)


def _swap_is_the_real_one() -> bool:
    from lightning_longctx.attention import dispatch, ring

    return dispatch.usp_attention is ring.usp_attention


# ---- the negative checks ---------------------------------------------------------------------------------


#: ``tests/test_ring.py``'s "causal" case (b 2, h 2, d 8, N 32, float64) at (U, r) = (2, 2), zigzag
USP_CAUSAL = AttnCase(world=4, mode="ulysses", b=2, h=2, h_kv=2, d=8, chunk_size=8, chunks=1, dtype="float64",
                      ring_size=2, ring_kind="zigzag")  # fmt: skip


@pytest.mark.parametrize(
    ("sabotage", "figure"),
    [(SP_SHARD_REVERSED, 3.34), (ALL_TO_ALL_REVERSED, 4.15)],
    ids=["sp_shard", "all_to_all"],
)
def test_usp_check_catches_a_reversed_piece_order(dist_pool, sabotage, figure):
    """``test_usp_matches_full_attention[4-2]``'s check (``helpers.ring.check_rank_errors``): every case, both layouts,
    out / dq / dk / dv of every rank within 1e-10 of float64 full attention. The figure is the causal zigzag
    case's absolute error (a piece order is invisible to non-causal attention, which permutes with its
    tokens)."""
    worst: list[float] = []

    def usp_attention_matches_reference() -> None:
        per_rank = dist_pool(4).run(sabotaged(sabotage, usp_errors), 2)
        worst.append(max(r["causal", "zigzag"][0] for r in per_rank))
        check_rank_errors(per_rank)

    assert_catches(usp_attention_matches_reference, sabotage)
    assert worst[0] == pytest.approx(figure, abs=0.05), worst


def test_strategy_ring_check_catches_a_zigzag_blind_layout(dist_pool):
    """``test_strategy_ring_matches_one_process[llama_sp2_ring2]``'s check: a tiny Llama, sp 2 = ring 2, 2
    steps, every parameter against one process (``compare_to_reference``), fails at 0.24. The strategy's
    self-test would refuse the run first (logits 0.22 off on its probe): ``self_test=False`` lets the step
    run, as a self-test blind to the layout would."""
    from helpers.lightning import compare_to_reference, fit_hf

    def strategy_ring_matches_one_process() -> None:
        skw = {"ring_size": 2, "self_test": False}
        compare_to_reference(
            dist_pool(2).run(sabotaged(ZIGZAG_BLIND, fit_hf), "llama", 2, 2, skw, {}), "llama", 2, 2, 2, {}
        )

    caught = assert_catches(strategy_ring_matches_one_process, ZIGZAG_BLIND, match=r"relative error \S+")
    error = float(re.search(r"relative error (\S+)", str(caught)).group(1))
    assert error == pytest.approx(0.24, abs=0.02), str(caught)
    assert dist_pool(2).run(_swap_is_the_real_one) == [True, True]  # the ranks got the real code back


@pytest.mark.parametrize(("arch", "grad_error"), [("minimax", 1.3), ("rwkv", 0.60), ("xlstm", 3.0)])
def test_packed_hybrid_check_catches_state_resets_off(dist_pool, arch, grad_error):
    """``sweep_packed``'s check (``tests/test_hybrid_packed.py``): packed rows at P = 2, FPDT, float64, loss
    and every gradient against each document run alone, within PACKED_TOLERANCE."""
    rows: list = []

    def packed_grad_error() -> float:
        rows[:] = dist_pool(2).run(sabotaged(STATE_RESETS_OFF, sweep_packed), "fpdt", [arch])[0]
        return rows[0].get("grad_err", float("nan"))  # a crash (no figure) fails the approx below

    error = assert_error_above(packed_grad_error, STATE_RESETS_OFF, tolerance=PACKED_TOLERANCE)
    assert rows[0]["verdict"] == "WRONG", rows[0]  # the test's own verdict (``_exact`` wants "exact")
    assert error == pytest.approx(grad_error, abs=0.05), rows[0]


def test_a_check_blind_to_its_sabotage_is_reported(dist_pool):
    """The same check on a NON-causal case cannot see sp_shard's reversed pieces (attention without a mask
    permutes with its tokens): the helper says so instead of passing."""
    noncausal = dataclasses.replace(USP_CAUSAL, causal=False)

    def usp_attention_matches_reference() -> None:
        check = sabotaged(SP_SHARD_REVERSED, run_attention)
        verdict = run_verdict(dist_pool, 4, check, noncausal, TOLERANCE, TIMEOUT_S)
        assert verdict.kind == "exact", verdict

    with pytest.raises(
        AssertionError, match=r"did not make usp_attention_matches_reference fail: the check cannot"
    ):
        assert_catches(usp_attention_matches_reference, SP_SHARD_REVERSED)


# ---- the helper itself ---------------------------------------------------------------------------------


def _always_zero(original: Any) -> Any:
    return lambda *args, **kwargs: 0.0


def test_the_helpers_fail_loudly_when_a_check_cannot_catch_its_sabotage():
    """In one process: a check that passes under its sabotage, one that fails another way, and a sabotage
    that puts the original back (after an error too) and pickles without what an entry saved."""
    import pickle

    from lightning_longctx.parallel import layout

    original = layout.RingLayout.sp_shard
    with pytest.raises(
        AssertionError, match=r"the sabotage sp_shard's pieces reversed did not make .* fail: the"
    ):
        assert_catches(lambda: None, SP_SHARD_REVERSED)
    with pytest.raises(AssertionError, match=r"raised ValueError, not AssertionError"):
        assert_catches(lambda: int("x"), SP_SHARD_REVERSED)
    with pytest.raises(AssertionError, match=r"does not match 'relative error'"):
        assert_catches(lambda: _fail("loss 0.3 off"), SP_SHARD_REVERSED, match="relative error")
    assert isinstance(assert_catches(lambda: _fail("x"), SP_SHARD_REVERSED), AssertionError)
    zero = Sabotage("zero error", "lightning_longctx.parallel.layout:RingLayout.sp_shard", _always_zero)
    with pytest.raises(AssertionError, match=r"its error 0 stays below the tolerance 1e-10"):
        assert_error_above(lambda: layout.RingLayout.sp_shard(), zero, tolerance=1e-10)
    assert layout.RingLayout.sp_shard is original
    with SP_SHARD_REVERSED:
        assert layout.RingLayout.sp_shard is not original
        copy = pickle.loads(pickle.dumps(SP_SHARD_REVERSED))
        assert (copy.name, copy.target, copy.wrap) == (
            "sp_shard's pieces reversed",
            SP_SHARD_REVERSED.target,
            _reverse_sp_pieces,
        )
        assert copy._saved == [] and len(SP_SHARD_REVERSED._saved) == 1  # the original stays home
    assert layout.RingLayout.sp_shard is original
    with pytest.raises(ValueError, match=r"target 'lightning_longctx.parallel.layout' must be 'module:attr'"):
        Sabotage("x", "lightning_longctx.parallel.layout", _always_zero)
    with pytest.raises(AttributeError, match=r"RingLayout.nope does not exist"):
        with Sabotage("x", "lightning_longctx.parallel.layout:RingLayout.nope", _always_zero):
            pass


def _fail(message: str) -> None:
    raise AssertionError(message)
