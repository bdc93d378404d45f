"""Run functions on real gloo process groups (spawned CPU processes).

``DistPool(P)`` starts P processes once, initialises a gloo group of size P in each and then runs
any picklable function on all ranks: ``pool.run(fn, *args)`` returns ``[fn(*args) on rank 0, ...]``.
A failure on any rank raises with that rank's traceback; the pool is then torn down (the other ranks
may be stuck in a collective) and the fixture builds a fresh one for the next test.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULT_TIMEOUT_S = float(os.environ.get("LONGCTX_TEST_TIMEOUT", "240"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _describe(fn: Callable[..., Any], args: tuple, kwargs: dict) -> str:
    """``fn(arg, ..., key=value)``, each argument's repr cut to 200 characters."""
    parts = [repr(a)[:200] for a in args] + [f"{k}={v!r}"[:200] for k, v in kwargs.items()]
    return f"{fn.__name__}({', '.join(parts)})"


def _worker(rank: int, world_size: int, port: int, inbox: Any, outbox: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=RESULT_TIMEOUT_S),
    )
    try:
        while True:
            job = inbox.get()
            if job is None:
                break
            fn, args, kwargs = job
            try:
                outbox.put((rank, True, _to_cpu(fn(*args, **kwargs))))
            except BaseException:
                outbox.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class DistPool:
    """P spawned processes sharing one gloo process group (the default group)."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, port, self._inboxes[r], self._outbox), daemon=True
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def _dead(self) -> str:
        """``"rank 2 (SIGFPE), rank 3 (SIGFPE)"`` for the processes that are gone, or ``""``."""
        parts = []
        for r, p in enumerate(self._procs):
            if not p.is_alive():
                code = p.exitcode
                why = signal.Signals(-code).name if code is not None and code < 0 else f"exit code {code}"
                parts.append(f"rank {r} ({why})")
        return ", ".join(parts)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``[fn(*args, **kwargs) on rank 0, ...]``. A rank's exception, a dead rank or no result within
        ``timeout`` seconds (default ``RESULT_TIMEOUT_S``) raises an ``AssertionError`` that names the ranks,
        how they ended and the call (``fn`` and its arguments: the configuration to reproduce)."""
        for box in self._inboxes:
            box.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        limit = RESULT_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + limit
        call = _describe(fn, args, kwargs)
        while len(results) + len(errors) < self.world_size and not errors:
            try:
                rank, ok, payload = self._outbox.get(timeout=0.5)
            except queue.Empty:
                dead = self._dead()
                if dead or time.monotonic() > deadline:
                    self.broken = True
                    missing = sorted(set(range(self.world_size)) - set(results))
                    why = f"died: {dead}" if dead else f"no result within {limit:.0f}s (deadlock?)"
                    raise AssertionError(f"{call}: ranks {missing} gave no result: {why}") from None
                continue
            (results if ok else errors)[rank] = payload
        if errors:
            self.broken = True
            time.sleep(0.5)  # a rank that died took the others' collectives down: name it too
            dead = self._dead()
            rank = min(errors)
            why = f" (ranks that died: {dead})" if dead else ""
            raise AssertionError(f"{call} failed on rank {rank} of {self.world_size}{why}:\n{errors[rank]}")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        if not self.broken:
            for box in self._inboxes:
                box.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class WarmPools:
    """One warm :class:`DistPool` per world size, rebuilt when a failure broke it: ``pools(world)``.
    The test fixture and ``benchmarks/fuzz.py`` share it; :meth:`close` ends them all."""

    def __init__(self) -> None:
        self._pools: dict[int, DistPool] = {}

    def __call__(self, world_size: int) -> DistPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = self._pools[world_size] = DistPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """One-shot: start ``world_size`` fresh processes, run ``fn``, tear everything down."""
    pool = DistPool(world_size)
    try:
        return pool.run(fn, *args, **kwargs)
    finally:
        pool.close()
