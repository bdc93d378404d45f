"""What the randomized differential tests share: the verdict of one drawn configuration, and the rule
that sorts a run's outcome into it.

A configuration is run on real gloo ranks (``lightning_longctx.testing.DistPool``) and compared with a
single-process reference. Its verdict is one of

* ``exact``: every rank returned and every compared tensor is within the tolerance;
* ``refused``: every rank raised the same ``ValueError`` / ``NotImplementedError`` from lightning_longctx's
  own code (a clear refusal naming the setting), before any rank got stuck in a collective;
* ``failing``: anything else — a mismatch, another exception, a refusal some ranks raised and others did
  not, a dead rank or no result in bounded time (the pool names the ranks).

``tests/test_fuzz.py`` runs a fixed-seed sample in CI; ``tests/fuzz_search.py`` (``python benchmarks/fuzz.py``)
runs long searches.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any

#: Exceptions that count as a deliberate refusal when lightning_longctx raises them.
REFUSALS = (ValueError, NotImplementedError)
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning_longctx")


@dataclass(frozen=True)
class Verdict:
    """``kind`` is ``"exact" | "refused" | "failing"``; ``error`` the worst relative error of an exact or
    mismatching run; ``detail`` the refusal's message or what failed."""

    kind: str
    error: float | None = None
    detail: str = ""


def refusal_or_raise(exc: BaseException) -> tuple[str, str]:
    """Inside a rank: ``("refused", "Type: message")`` when ``exc`` is a deliberate refusal raised in the
    package's own code; otherwise re-raise it (the pool reports it as a failure with its traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, REFUSALS) and frames and frames[-1].filename.startswith(PACKAGE_DIR):
        return "refused", f"{type(exc).__name__}: {exc}"
    raise exc


def judge(results: list[Any], tolerance: float) -> Verdict:
    """The verdict from every rank's result: ``("refused", message)`` or ``("ran", worst relative error)``."""
    kinds = {r[0] for r in results}
    if kinds == {"refused"}:
        messages = {r[1] for r in results}
        if len(messages) == 1:
            return Verdict("refused", detail=messages.pop())
        return Verdict("failing", detail=f"ranks refused differently: {sorted(messages)}")
    if kinds != {"ran"}:
        return Verdict("failing", detail=f"some ranks refused, others ran: {results}")
    worst = max(float(r[1]) for r in results)
    if not worst <= tolerance:  # NaN fails too
        return Verdict("failing", error=worst, detail=f"relative error {worst:.3e} > {tolerance:.0e}")
    return Verdict("exact", error=worst)


def run_verdict(pool_of: Any, world: int, fn: Any, case: Any, tolerance: float, timeout: float) -> Verdict:
    """Run ``fn(case)`` on a pool of ``world`` ranks and judge it; a dead rank, a hang past ``timeout``
    seconds or an unexpected exception on any rank is ``failing`` with the pool's message (it names the
    ranks and the configuration). ``pool_of(world)`` gives a warm pool (rebuilt after a failure)."""
    try:
        results = pool_of(world).run(fn, case, timeout=timeout)
    except AssertionError as e:
        return Verdict("failing", detail=str(e)[-4000:])
    return judge(results, tolerance)
