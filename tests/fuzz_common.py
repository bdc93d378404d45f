"""What the randomized differential tests share: the verdict of one drawn configuration, and the rule
that sorts a run's outcome into it.

A configuration is run on real gloo ranks (``lightning_longctx.testing.DistPool``) and compared with a
single-process reference. Its verdict is one of

* ``exact``: every rank returned and every compared tensor is within the tolerance;
* ``refused``: every rank raised the same ``ValueError`` / ``NotImplementedError`` from lightning_longctx's
  own code (a clear refusal naming the setting), before any rank got stuck in a collective, and the refusal is
  one the package documents for that configuration: an :class:`ExpectedRefusal` of the target's table
  (``fuzz_strategy.EXPECTED_REFUSALS``, ``fuzz_attention.EXPECTED_REFUSALS``) applies to the case and its
  message matches;
* ``failing``: anything else — a mismatch, another exception, a refusal some ranks raised and others did
  not, a refusal of a configuration the package promises to run (no class of the table applies, or none whose
  message matches), a dead rank or no result in bounded time (the pool names the ranks).

``tests/test_fuzz.py`` runs a fixed-seed sample in CI; ``tests/fuzz_search.py`` (``python benchmarks/fuzz.py``)
runs long searches.
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Exceptions that count as a deliberate refusal when lightning_longctx raises them.
REFUSALS = (ValueError, NotImplementedError)
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning_longctx")


@dataclass(frozen=True)
class Verdict:
    """``kind`` is ``"exact" | "refused" | "failing"``; ``error`` the worst relative error of an exact or
    mismatching run; ``detail`` the refusal's message or what failed; ``refusal`` the ``"Type: message"`` every
    rank refused with (a ``refused`` trial, or a ``failing`` one that refused a configuration the package promises
    to run); ``expected`` the name of the :class:`ExpectedRefusal` a ``refused`` trial is."""

    kind: str
    error: float | None = None
    detail: str = ""
    refusal: str = ""
    expected: str = ""


@dataclass(frozen=True)
class ExpectedRefusal:
    """A refusal the package documents for a class of configurations.

    ``applies(case)``: the drawn case is in the class; ``message``: a regular expression (or ``case -> regex``)
    searched in the refusal's ``"Type: message"``; ``reason``: where the refusal is documented and why it is
    expected. A refused case that no entry of its target's table applies to, or none whose message matches, is a
    configuration the package promises to run: the trial fails."""

    name: str
    applies: Callable[[Any], bool]
    message: str | Callable[[Any], str]
    reason: str

    def matches(self, case: Any, detail: str) -> bool:
        if not self.applies(case):
            return False
        pattern = self.message(case) if callable(self.message) else self.message
        return re.search(pattern, detail) is not None


def expected_refusals(case: Any, table: Sequence[ExpectedRefusal]) -> list[str]:
    """The names of the entries of ``table`` that apply to ``case`` (empty: the package promises to run it)."""
    return [e.name for e in table if e.applies(case)]


def classify_refusal(case: Any, detail: str, table: Sequence[ExpectedRefusal]) -> Verdict:
    """``refused`` (named) when an entry of ``table`` applies to ``case`` and matches ``detail``, else
    ``failing``: a configuration the package promises to run was refused."""
    for entry in table:
        if entry.matches(case, detail):
            return Verdict("refused", detail=detail, refusal=detail, expected=entry.name)
    applying = expected_refusals(case, table)
    why = (
        f"expected only {applying}, whose messages this is not"
        if applying
        else "no expected refusal applies: the package promises to run it"
    )
    return Verdict("failing", detail=f"unexpected refusal ({why}): {detail}", refusal=detail)


def refusal_or_raise(exc: BaseException) -> tuple[str, str]:
    """Inside a rank: ``("refused", "Type: message")`` when ``exc`` is a deliberate refusal raised in the
    package's own code; otherwise re-raise it (the pool reports it as a failure with its traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, REFUSALS) and frames and frames[-1].filename.startswith(PACKAGE_DIR):
        return "refused", f"{type(exc).__name__}: {exc}"
    raise exc


def judge(
    results: list[Any],
    tolerance: float,
    case: Any = None,
    expected: Sequence[ExpectedRefusal] | None = None,
) -> Verdict:
    """The verdict from every rank's result: ``("refused", message)`` or ``("ran", worst relative error)``.
    ``expected``: the target's table of documented refusals; a refusal of ``case`` must be one of them
    (:func:`classify_refusal`). ``None`` takes any clean refusal (the tests that ask for one refusal by name)."""
    kinds = {r[0] for r in results}
    if kinds == {"refused"}:
        messages = {r[1] for r in results}
        if len(messages) != 1:
            return Verdict("failing", detail=f"ranks refused differently: {sorted(messages)}")
        detail = messages.pop()
        return (
            Verdict("refused", detail=detail, refusal=detail)
            if expected is None
            else classify_refusal(case, detail, expected)
        )
    if kinds != {"ran"}:
        return Verdict("failing", detail=f"some ranks refused, others ran: {results}")
    worst = max(float(r[1]) for r in results)
    if not worst <= tolerance:  # NaN fails too
        return Verdict("failing", error=worst, detail=f"relative error {worst:.3e} > {tolerance:.0e}")
    return Verdict("exact", error=worst)


def run_verdict(
    pool_of: Any,
    world: int,
    fn: Any,
    case: Any,
    tolerance: float,
    timeout: float,
    expected: Sequence[ExpectedRefusal] | None = None,
) -> Verdict:
    """Run ``fn(case)`` on a pool of ``world`` ranks and judge it (:func:`judge`, ``expected`` the target's
    table of documented refusals); a dead rank, a hang past ``timeout`` seconds or an unexpected exception on
    any rank is ``failing`` with the pool's message (it names the ranks and the configuration).
    ``pool_of(world)`` gives a warm pool (rebuilt after a failure)."""
    try:
        results = pool_of(world).run(fn, case, timeout=timeout)
    except AssertionError as e:
        return Verdict("failing", detail=str(e)[-4000:])
    return judge(results, tolerance, case, expected)


def draw_examples(strategy: Any, n: int) -> list[Any]:
    """``n`` examples of the hypothesis ``strategy``, drawn (derandomized, no database), nothing run: what a
    fuzz run of ``n`` trials would draw, for its distribution."""
    from hypothesis import HealthCheck, Phase, given, settings

    cases: list[Any] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def collect(case: Any) -> None:
        cases.append(case)

    collect()
    return cases
