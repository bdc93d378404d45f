"""Negative checks: a test that a check FAILS on a deliberately broken version of the code it guards.

An exactness or refusal check that passes proves something only if it can fail. Each such check ships with a
sabotage, a deliberate bug, under which it must fail; the suite runs both (``tests/test_negative_checks.py``).

* :class:`Sabotage` ``(name, target, wrap)``: while entered, the attribute ``target``
  (``"package.module:Class.attr"``) is replaced by ``wrap(original)``, and put back on exit, even after an
  error. It pickles by its three fields, so a test can send it to a pool's ranks (:func:`sabotaged`).
* :func:`sabotaged` ``(sabotage, fn)``: ``fn`` run under the sabotage; ``pool.run(sabotaged(sabotage, fn),
  ...)`` breaks the code on every rank for that one call only (a warm pool's ranks outlive the test).
* :func:`assert_catches` ``(check, sabotage)``: runs a zero-argument ``check`` (which raises on failure) under
  the sabotage, requires it to raise, and returns the exception (its message carries the measured error).
* :func:`assert_error_above` ``(measure, sabotage, tolerance=...)``: the same for a function that returns the
  error figure a check compares with ``tolerance``; returns the figure.

Both fail loudly when the check passes under the sabotage: ``the sabotage <name> did not make <check> fail:
the check cannot catch it``. Both enter the sabotage in the calling process too, so a check that runs there is
broken as well; a check that runs on other processes must take the sabotage there itself (:func:`sabotaged`),
and if it does not, the check passes and the helper says so.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["Sabotage", "assert_catches", "assert_error_above", "sabotaged"]

T = TypeVar("T")


class Sabotage:
    """A deliberate bug, as a re-entrant context manager: ``target`` is ``"module:attr"`` or
    ``"module:Class.attr"`` (a function, a method or any attribute), replaced by ``wrap(original)`` while
    entered. ``wrap`` must be importable by name (a top-level function) for the sabotage to pickle.

    Example: ``Sabotage("contiguous layout", "pkg.attention:usp_attention", blind)`` where ``blind(original)``
    returns a function that calls ``original`` with the wrong layout."""

    def __init__(self, name: str, target: str, wrap: Callable[[Any], Any]) -> None:
        module, sep, attr = target.partition(":")
        if not sep or not module or not attr:
            raise ValueError(
                f"target {target!r} must be 'module:attr' or 'module:Class.attr' (a colon between the module "
                "and the attribute), e.g. 'lightning_longctx.parallel.layout:RingLayout.sp_shard'"
            )
        self.name = name
        self.target = target
        self.wrap = wrap
        self._saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) per entry, innermost last

    def __reduce__(self) -> tuple[type[Sabotage], tuple[str, str, Callable[[Any], Any]]]:
        return Sabotage, (self.name, self.target, self.wrap)  # never what an entry saved

    def __repr__(self) -> str:
        return f"Sabotage({self.name!r}, {self.target!r})"

    def _owner(self) -> tuple[Any, str]:
        module, _, path = self.target.partition(":")
        *parents, attr = path.split(".")
        owner: Any = importlib.import_module(module)
        for part in parents:
            owner = getattr(owner, part)
        if attr not in vars(owner):
            raise AttributeError(
                f"sabotage {self.name!r}: {self.target} does not exist (was it renamed?); point the target "
                "at the attribute where it is defined, so that the sabotage breaks the code the check guards"
            )
        return owner, attr

    def __enter__(self) -> Sabotage:
        owner, attr = self._owner()
        original = vars(owner)[attr]  # as stored: a staticmethod / classmethod stays one
        setattr(owner, attr, self.wrap(original))
        self._saved.append((owner, attr, original))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        owner, attr, original = self._saved.pop()
        setattr(owner, attr, original)


class _Sabotaged:
    """``fn`` run with ``sabotage`` entered (:func:`sabotaged`); pickles when both do."""

    def __init__(self, sabotage: AbstractContextManager[Any], fn: Callable[..., Any]) -> None:
        self.sabotage = sabotage
        self.fn = fn
        self.__name__ = f"{_name(fn)} under the sabotage {_name(sabotage)}"  # for a pool's error messages

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.sabotage:
            return self.fn(*args, **kwargs)


def sabotaged(sabotage: AbstractContextManager[Any], fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` wrapped to run with ``sabotage`` entered and undone after each call. On a pool's ranks:
    ``pool.run(sabotaged(sabotage, fn), *args)`` breaks the code on every rank for that one call (``sabotage``
    and ``fn`` must pickle: a :class:`Sabotage`, a top-level function)."""
    return _Sabotaged(sabotage, fn)


def _name(obj: Any) -> str:
    return str(getattr(obj, "name", None) or getattr(obj, "__name__", None) or repr(obj))


def assert_catches(
    check: Callable[[], object],
    sabotage: AbstractContextManager[Any],
    *,
    expect: type[BaseException] | tuple[type[BaseException], ...] = AssertionError,
    match: str | None = None,
) -> BaseException:
    """Run ``check()`` with ``sabotage`` entered; it must raise ``expect`` whose message matches ``match``
    (``re.search``, as ``pytest.raises``). Returns the exception, for the test to assert the figure in it.

    ``check``: zero arguments, runs an exactness or refusal check and raises when it fails. ``sabotage``: any
    context manager that breaks the code the check guards (a :class:`Sabotage`, ``unittest.mock.patch``, ...).
    Raises ``AssertionError`` when the check passes, or fails another way (another type, another message)."""
    what = f"the sabotage {_name(sabotage)} did not make {_name(check)} fail"
    try:
        with sabotage:
            check()
    except expect as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(
                f"{what} as expected: it raised {type(e).__name__}({str(e)[:500]!r}), which does not match "
                f"{match!r}; fix the pattern, or the sabotage so that it reaches the check"
            ) from e
        return e
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        names = expect.__name__ if isinstance(expect, type) else " / ".join(x.__name__ for x in expect)
        raise AssertionError(
            f"{what} as expected: it raised {type(e).__name__}, not {names}: {str(e)[:500]}"
        ) from e
    raise AssertionError(
        f"{what}: the check cannot catch it (it passed on the broken version; make the check compare what "
        "the sabotage breaks, or the sabotage break what the check compares)"
    )


def assert_error_above(
    measure: Callable[[], float], sabotage: AbstractContextManager[Any], *, tolerance: float
) -> float:
    """Run ``measure()`` with ``sabotage`` entered and return the error figure it gives, which must be above
    ``tolerance``, the bound its check compares it with (a NaN counts as above: no ``<`` passes it).

    The second form of :func:`assert_catches`, for a check written as ``assert measure() < tolerance``."""
    with sabotage:
        error = float(measure())
    if error < tolerance:
        raise AssertionError(
            f"the sabotage {_name(sabotage)} did not make {_name(measure)} fail: the check cannot catch it "
            f"(its error {error:.3g} stays below the tolerance {tolerance:.3g} on the broken version)"
        )
    return error
