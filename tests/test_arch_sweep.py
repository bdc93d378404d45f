"""The architecture sweep (tests/arch_sweep.py) at P = 2 on gloo: no architecture may train WRONG under Ulysses
or FPDT (exact, or refused with a clear error), and docs/architectures.md must show today's verdicts.

Slow tier (``-m slow``; the full ``python -m pytest -q`` runs it): every architecture is built and trained twice."""

from __future__ import annotations

import difflib

import pytest
from arch_sweep import ARCHS, DOCS, HYBRIDS, MODES, SEQ, SKIPPED, WORLD, format_table, render_docs, sweep

pytestmark = pytest.mark.slow

MIN_ARCHITECTURES = 40
_RESULTS: dict[str, list[dict]] = {}  # one pool call per mode, shared by the tests of this module


def _results(dist_pool, mode: str) -> list[dict]:
    if mode not in _RESULTS:
        _RESULTS[mode] = dist_pool(WORLD).run(sweep, mode)[0]  # every rank returns the same merged table
    return _RESULTS[mode]


def test_the_sweep_is_wide_enough():
    names = [arch.name for arch in ARCHS]
    assert len(set(names)) == len(names), "an architecture is listed twice"
    assert len(names) >= MIN_ARCHITECTURES, f"only {len(names)} architectures swept"
    assert not set(names) & set(SKIPPED), "an architecture is both swept and skipped"
    assert set(HYBRIDS) <= set(names) and len(HYBRIDS) == 17
    assert sum(arch.moe for arch in ARCHS) >= 10
    assert SEQ // WORLD // MODES["fpdt"] >= 2, "FPDT must run >= 2 chunks per rank"


@pytest.mark.parametrize("mode", list(MODES))
def test_no_architecture_trains_wrong(dist_pool, mode):
    rows = _results(dist_pool, mode)
    assert [r["arch"] for r in rows] == [arch.name for arch in ARCHS]
    assert {r["verdict"] for r in rows} <= {"exact", "refused", "WRONG"}
    for r in rows:
        if r["verdict"] == "refused":
            assert r["reason"], f"{r['arch']}: a refusal without a message"
    wrong = [r for r in rows if r["verdict"] == "WRONG"]
    details = "\n".join(f"  {r['arch']}: {r.get('bad_params', '')[:8]} at {r['where']}" for r in wrong)
    assert not wrong, (
        f"{len(wrong)} architectures train WRONG under {mode}:\n{format_table({mode: wrong})}\n{details}"
    )


def test_docs_show_todays_verdicts(dist_pool):
    expected = render_docs({mode: _results(dist_pool, mode) for mode in MODES})
    current = DOCS.read_text() if DOCS.exists() else ""
    if current != expected:
        diff = "".join(
            list(
                difflib.unified_diff(
                    current.splitlines(True), expected.splitlines(True), "docs/architectures.md", "today"
                )
            )[:60]
        )
        pytest.fail(f"docs/architectures.md is stale: run `python tests/arch_sweep.py --write-docs`\n{diff}")
