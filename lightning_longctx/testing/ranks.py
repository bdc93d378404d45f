"""The one way the tests and the benchmarks start ranks: real processes, real ``torch.distributed``.

* :class:`DistPool` ``(P)``: P spawned processes started once, each in a gloo group of size P, that then
  run any picklable function on all ranks: ``pool.run(fn, *args)`` returns ``[fn(*args) on rank 0, ...]``.
  The tests keep one warm pool per world size (:class:`WarmPools`, the ``dist_pool`` fixture).
* :func:`process_groups`: what a function on a warm pool's ranks builds (a world mesh, a process group) is
  destroyed when it ends: the ranks outlive every test, and each gloo group keeps threads until destroyed.
* :func:`launch` ``(fn, P, *args)``: P FRESH processes for one call, no group created (the caller's
  ``fn`` picks the backend), each rank's output in a log shown when it fails. The benchmarks use it: every
  measured point starts from a clean process (no allocation, no CUDA context of an earlier point). It is a
  one-shot :class:`DistPool` forked from a server that imported :data:`PRELOAD` once (a rank starts in
  ~1 s instead of ~15 s of imports on 2 loaded cores).

Every rank gets the variables torchrun sets (:func:`rank_environment`): a ``lightning.Trainer`` inside
takes the processes as launched externally. A rank that raises, dies or gives no result in time ends the
call with an error that names the ranks, how they ended and the call (``fn`` and its arguments); the
pool is then torn down (the other ranks may be stuck in a collective). ``fn`` is pickled by reference: it
must be importable by its module's name in a fresh process (a module of an installed package, or of the
running script's folder, which Python puts on ``sys.path`` and the ranks inherit).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "DistPool",
    "Launch",
    "RanksFailed",
    "WarmPools",
    "free_port",
    "launch",
    "process_groups",
    "rank_environment",
    "run_spawned",
]

RESULT_TIMEOUT_S = float(os.environ.get("LONGCTX_TEST_TIMEOUT", "240"))
#: imported once by :func:`launch`'s fork server
PRELOAD = ["__main__", "torch", "lightning", "transformers.models.llama.modeling_llama", "lightning_longctx"]
#: inherited variables that would make Lightning or torch.distributed join another job
LAUNCHER_VARS = ("TORCHELASTIC", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_", "GROUP_", "SLURM_")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for ``rank`` of ``world`` on one node; ``LOCAL_RANK`` tells Lightning the
    processes exist already (it launches none itself)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "NODE_RANK": "0",
    }


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


@dataclass(frozen=True)
class _Setup:
    """How a pool's ranks start (picklable: it travels to each process)."""

    world_size: int
    port: int
    init_group: bool  # a gloo default group (the tests), or none (launch: fn picks its backend)
    threads: int | None  # intra-op threads per rank (None: torch's default)
    logdir: str | None  # each rank's stdout and stderr go to <logdir>/rank<r>.log


def _worker(rank: int, setup: _Setup, inbox: Any, outbox: Any) -> None:
    if not setup.init_group:  # fn starts its own group (or a Trainer does) from torchrun's variables
        for key in [k for k in os.environ if k.startswith(LAUNCHER_VARS)]:
            del os.environ[key]
        if setup.world_size > 1:
            os.environ.update(rank_environment(rank, setup.world_size, setup.port))
    if setup.logdir is not None:  # before anything prints: Lightning's chatter goes to the log
        log = os.open(Path(setup.logdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
    if setup.threads is not None:
        torch.set_num_threads(setup.threads)
    if setup.init_group:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{setup.port}",
            rank=rank,
            world_size=setup.world_size,
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
        if dist.is_initialized():
            dist.destroy_process_group()


class RanksFailed(AssertionError):
    """A call that did not come back from every rank: ``results`` holds what did (None elsewhere)."""

    def __init__(self, message: str, results: list[Any], timed_out: bool) -> None:
        super().__init__(message)
        self.results = results
        self.timed_out = timed_out


class DistPool:
    """``world_size`` processes sharing one gloo process group (the default group).

    ``context="forkserver"`` forks the ranks from a server that imported :data:`PRELOAD`; ``init_group=False``
    creates no group and sets the torchrun variables instead (with ``logdir``: :func:`launch`)."""

    def __init__(
        self,
        world_size: int,
        *,
        context: str = "spawn",
        init_group: bool = True,
        threads: int | None = 1,
        logdir: str | None = None,
        daemon: bool = True,
    ) -> None:
        ctx = mp.get_context(context)
        if context == "forkserver":
            ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts: the first pool
        self.world_size = world_size
        setup = _Setup(world_size, free_port(), init_group, threads, logdir)
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        # daemon: the ranks die with the test process; launch's ranks may start processes of their own
        self._procs = [
            ctx.Process(target=_worker, args=(r, setup, self._inboxes[r], self._outbox), daemon=daemon)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def _dead(self, skip: set[int] = frozenset()) -> str:
        """``"rank 2 (SIGFPE), rank 3 (exit code 1)"`` for the processes that are gone, or ``""``."""
        parts = []
        for r, p in enumerate(self._procs):
            if r not in skip and not p.is_alive():
                code = p.exitcode
                why = signal.Signals(-code).name if code is not None and code < 0 else f"exit code {code}"
                parts.append(f"rank {r} ({why})")
        return ", ".join(parts)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``[fn(*args, **kwargs) on rank 0, ...]``. A rank's exception, a dead rank or no result within
        ``timeout`` seconds (default ``RESULT_TIMEOUT_S``) raises :class:`RanksFailed` (an ``AssertionError``)
        that names the ranks, how they ended and the call (``fn`` and its arguments: the configuration to
        reproduce)."""
        for box in self._inboxes:
            box.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        limit = RESULT_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + limit
        call = _describe(fn, args, kwargs)

        def failed(message: str, timed_out: bool = False) -> RanksFailed:
            self.broken = True
            return RanksFailed(message, [results.get(r) for r in range(self.world_size)], timed_out)

        while len(results) + len(errors) < self.world_size and not errors:
            try:
                rank, ok, payload = self._outbox.get(timeout=0.5)
            except queue.Empty:
                dead = self._dead(skip=set(results))
                if dead and self._outbox.empty():  # a result put before exiting is readable by now
                    missing = sorted(set(range(self.world_size)) - set(results))
                    raise failed(f"{call}: ranks {missing} gave no result: died: {dead}") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(results))
                    why = f"no result within {limit:.0f}s (deadlock?)"
                    raise failed(f"{call}: ranks {missing} gave no result: {why}", timed_out=True) from None
                continue
            (results if ok else errors)[rank] = payload
        if errors:
            time.sleep(0.5)  # a rank that died took the others' collectives down: name it too
            dead = self._dead()
            rank = min(errors)
            why = f" (ranks that died: {dead})" if dead else ""
            raise failed(f"{call} failed on rank {rank} of {self.world_size}{why}:\n{errors[rank]}")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        if not self.broken:
            for box in self._inboxes:
                box.put(None)
            for p in self._procs:
                p.join(timeout=30)  # a rank that returned is tearing down
        for p in self._procs:
            if p.is_alive():  # after a failure the others would wait in a collective forever
                p.kill()
                p.join(timeout=5)


class WarmPools:
    """One warm :class:`DistPool` per world size, rebuilt when a failure broke it: ``pools(world)``.
    The test fixture and the long searches (``tests/fuzz_search.py``) share it; :meth:`close` ends them
    all."""

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


_Owned = TypeVar("_Owned")


@contextmanager
def process_groups() -> Iterator[Callable[[_Owned], _Owned]]:
    """Destroy, when the block ends (however it ends), what its body hands to ``own``. A function that a warm
    pool runs (:class:`DistPool`: its ranks serve every test of the session) builds its meshes and groups in
    this block, so that the ranks do not keep them, and the threads of each gloo group, to the session's end::

        with process_groups() as own:
            mesh = own(build_world_mesh(layout, "cpu"))
            ring = own(dist.new_group([0, 2]))
            ...  # everything that runs on them, a model sharded on the mesh (FSDP2, TP) included

    ``own(x)`` returns ``x``: a world mesh (``WorldMesh.destroy``), a ``DeviceMesh`` (its groups) or a
    process group (``dist.new_group``, ``new_subgroups``, ``comm.new_gloo_group``). They are destroyed last
    first, each rank on its own (no collective), never the default group. After a mesh, DTensor's sharding
    caches are cleared too: they key on mesh equality (ranks, shape, axis names: not the groups), and would
    hand the next equal mesh's DTensors output specs on this one's destroyed groups ("Could not resolve the
    process group registered under the name ...")."""
    owned: list[Any] = []

    def own(thing: _Owned) -> _Owned:
        owned.append(thing)
        return thing

    from lightning_longctx.parallel.mesh import forget_dtensor_caches

    try:
        yield own
    finally:
        meshes = False
        for thing in reversed(owned):
            meshes |= _destroy(thing)
        if meshes:
            forget_dtensor_caches()


def _destroy(thing: Any) -> bool:
    """Destroy one thing :func:`process_groups` owns; whether it was a mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_longctx.parallel.mesh import WorldMesh, _forget_groups

    if not dist.is_initialized():
        return False  # the default group is gone, and every other group went with it
    if isinstance(thing, WorldMesh):
        thing.destroy()  # clears DTensor's caches itself
        return False
    if not isinstance(thing, DeviceMesh):  # a process group
        if thing is not dist.group.WORLD:
            with suppress(ValueError):  # destroyed already
                dist.destroy_process_group(thing)
        return False
    groups = [g for g in thing.get_all_groups() if g is not dist.group.WORLD]
    names = [g.group_name for g in groups]
    for group in groups:
        with suppress(ValueError):
            dist.destroy_process_group(group)
    _forget_groups(thing._get_root_mesh(), names)  # the root holds their objects (and their threads)
    return True


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """One-shot: start ``world_size`` fresh processes, run ``fn``, tear everything down."""
    pool = DistPool(world_size)
    try:
        return pool.run(fn, *args, **kwargs)
    finally:
        pool.close()


@dataclass
class Launch:
    """What :func:`launch` brought back: each rank's return value in rank order (None where none came)."""

    results: list[Any]
    error: str | None  # None when every rank returned
    timed_out: bool
    log: str  # the tail of every rank's output when something failed, else ""
    wall_s: float

    def check(self) -> list[Any]:
        """The results, or ``RuntimeError`` with the error and the ranks' logs."""
        if self.error:
            raise RuntimeError(f"{self.error}\n{self.log}")
        return self.results


def launch(
    fn: Callable[..., Any], world: int, *args: Any, threads: int | None = 1, timeout_s: float = 600.0
) -> Launch:
    """Run ``fn(*args)`` on ``world`` fresh processes and collect what each returns.

    No group is created here: each rank has the torchrun variables (``MASTER_ADDR/PORT``, ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``), so ``dist.init_process_group(backend)`` reads them and a
    ``lightning.Trainer`` takes them as launched externally; the backend (gloo, NCCL) is the caller's.
    ``threads`` intra-op threads per rank (None: torch's default). ``fn`` must be defined at module level and
    return something picklable. A rank that raises, dies or is still running after ``timeout_s`` ends the
    launch: every rank still alive is killed and ``error`` says why.
    """
    t0 = time.perf_counter()
    error, timed_out, log = None, False, ""
    with tempfile.TemporaryDirectory(prefix="ranks_") as logdir:
        pool = DistPool(
            world, context="forkserver", init_group=False, threads=threads, logdir=logdir, daemon=False
        )
        try:
            results = pool.run(fn, *args, timeout=timeout_s)
        except RanksFailed as failure:
            results, error, timed_out = failure.results, str(failure), failure.timed_out
        finally:
            pool.close()
        if error:
            logs = sorted(Path(logdir).glob("rank*.log"))
            log = "".join(f"--- {p.stem} ---\n{p.read_text(errors='replace')[-1500:]}" for p in logs)
    return Launch(results, error, timed_out, log, time.perf_counter() - t0)
