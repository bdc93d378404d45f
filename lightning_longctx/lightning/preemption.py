"""Preemption and termination: a signal sets a flag; every rank saves at the next optimizer step and exits.

Lightning 2.6's SLURM handler saves the checkpoint INSIDE the SIGUSR1 handler, and its SIGTERM notifier
broadcasts inside the handler. A Python handler runs between two bytecodes of whatever the rank is doing:
mid-forward, inside an FSDP all-gather, between two parameter groups of ``optimizer.step``. A save is a chain
of collectives, so ranks that received the signal at different points issue different collectives (a hang
until SLURM's SIGKILL, or garbage), and the state saved is half a step (upstream Lightning issue #21406).

The protocol here (docs/slurm.md):

1. The handlers for ``signals`` (SIGUSR1 and SIGTERM by default) only record the signal in this object.
2. At every optimizer-step boundary (``on_train_batch_end`` after ``global_step`` advanced: never inside a
   gradient-accumulation window) every rank all-reduces the recorded signals with MAX over the world: one
   tiny all-reduce per step, entered by every rank at the same point. A signal that reached one rank only,
   or arrived during validation, is seen by all ranks at the same boundary.
3. If any rank recorded a signal, every rank calls ``trainer.save_checkpoint`` into
   ``step-<global_step>.ckpt`` (a committed checkpoint under
   :class:`~lightning_longctx.UlyssesFPDTStrategy`, found by
   :func:`lightning_longctx.lightning.checkpoint.latest_checkpoint`); on SLURM, after the requeue signal, rank 0 runs
   ``scontrol requeue``; then every rank raises :class:`Preempted` (a ``SystemExit``), which ends ``fit``.

:class:`~lightning_longctx.UlyssesFPDTStrategy` adds this callback by itself and turns off Lightning's own
SLURM requeue handler; add it yourself to use other settings.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_longctx.lightning.checkpoint import step_checkpoint_path
from lightning_longctx.parallel.comm import all_reduce_no_grad

__all__ = ["Preempted", "Preemption", "slurm_job_id"]

#: the signals handled by default: SLURM's ``--signal=SIGUSR1@<lead>`` and the SIGTERM of scancel, of a
#: preemption and of the time limit
DEFAULT_SIGNALS = ("SIGUSR1", "SIGTERM")
_SCONTROL_TIMEOUT_S = 60


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written: ``fit`` ends, the process exits.

    Attributes:
        signal: the signal that caused it (the highest-numbered one when ranks received different ones).
        step: the optimizer step the checkpoint holds (``trainer.global_step``).
        path: the checkpoint's path.
    """

    def __init__(self, code: int, *, signal: signal.Signals, step: int, path: Path) -> None:
        super().__init__(code)
        self.signal = signal
        self.step = step
        self.path = path

    def __reduce__(self) -> Any:  # picklable (a worker pool sends exceptions back)
        return _preempted, (self.code, self.signal, self.step, self.path)

    def __str__(self) -> str:
        return f"stopped by {self.signal.name} after optimizer step {self.step}; checkpoint: {self.path}"


def _preempted(code: int, sig: signal.Signals, step: int, path: Path) -> Preempted:
    return Preempted(code, signal=sig, step=step, path=path)


def _as_signal(value: int | str | signal.Signals) -> signal.Signals:
    if isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in signal.Signals.__members__:
            raise ValueError(f"signals: {value!r} is not a signal name on this platform; use e.g. 'SIGUSR1'")
        return signal.Signals[name]
    try:
        return signal.Signals(value)
    except ValueError:
        raise ValueError(
            f"signals: {value!r} is not a signal number; use e.g. 'SIGUSR1' or 'SIGTERM'"
        ) from None


def slurm_job_id() -> str | None:
    """The id ``scontrol requeue`` takes for this job (``<array job>_<task>`` for an array task), or None."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID")
    return job if job and re.fullmatch(r"[0-9_]+", job) else None


def _is_lightning_handler(handler: Any) -> bool:
    """One of Lightning's own signal-connector handlers (the SIGTERM notifier broadcasts inside the handler,
    the SLURM handler saves a checkpoint there): never chained to."""
    owner = getattr(handler, "__self__", None)
    return type(owner).__name__ == "_SignalConnector"


def _chainable(previous: Any) -> list[Callable[[int, FrameType | None], Any]]:
    """The handlers to call after ours: a user's own (they run in any case), never Lightning's."""
    handlers = getattr(previous, "signal_handlers", None)  # Lightning's _HandlersCompose
    candidates = list(handlers) if handlers is not None else [previous]
    return [h for h in candidates if callable(h) and not _is_lightning_handler(h)]


class Preemption(L.Callback):
    """Save and exit at the next optimizer-step boundary after a preemption or termination signal.

    Args:
        dirpath: where the checkpoint goes (``step-<global_step>.ckpt``); default: the first
            ``ModelCheckpoint``'s folder, else ``<default_root_dir>/checkpoints``.
        signals: the signals handled (names or numbers); ``()`` handles none. A handler of your own that was
            installed before training starts is still called, after ours: it must run no collective.
            Lightning's (its SIGTERM notifier, its SLURM handler) are not; the step-boundary reduction tells
            every rank instead, including the processes Lightning launched itself.
        requeue: on SLURM, after the requeue signal (``SLURMEnvironment.requeue_signal``, SIGUSR1: the sbatch's
            ``--signal``), rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` once the checkpoint is committed.
            SIGTERM (``scancel``, a preemption SLURM requeues itself) never requeues.
        exit_code: the exit status of every process after the save (``Preempted``'s code).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        signals: Sequence[int | str] = DEFAULT_SIGNALS,
        requeue: bool = True,
        exit_code: int = 0,
    ) -> None:
        if isinstance(signals, (str, int)):
            raise TypeError(f"signals={signals!r}: pass a list, e.g. ['SIGUSR1', 'SIGTERM']")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code={exit_code!r}: use a process exit status, 0..255")
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.signals = tuple(dict.fromkeys(_as_signal(s) for s in signals))
        self.requeue = requeue
        self.exit_code = exit_code
        self._received: set[signal.Signals] = set()  # written by the handler only
        self._previous: dict[signal.Signals, Any] = {}  # the handlers ours replaced
        self._chained: dict[signal.Signals, list[Callable[..., Any]]] = {}
        self._last_step = -1

    # ---- the handler: record, nothing else ----
    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler. It only records the signal (and calls a user's own previous handler): no
        collective, no I/O, no logging (a handler may run inside a collective, or inside logging's lock)."""
        sig = signal.Signals(signum)
        self._received.add(sig)
        for handler in self._chained.get(sig, ()):
            handler(signum, frame)

    @property
    def received(self) -> frozenset[signal.Signals]:
        """The signals this rank has received since training started."""
        return frozenset(self._received)

    def _install(self) -> None:
        try:
            for sig in self.signals:
                previous = signal.getsignal(sig)
                signal.signal(sig, self.handle)
                self._previous[sig] = previous
                self._chained[sig] = _chainable(previous)
        except ValueError as err:  # Python handles signals in the main thread only
            self._restore()
            rank_zero_warn(
                f"Preemption: cannot install signal handlers ({err}); fit runs outside the main thread, so a "
                "preemption signal is not turned into a checkpoint. Run trainer.fit in the main thread"
            )

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self.handle:  # not replaced by someone else since
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self._chained.clear()

    # ---- Lightning hooks ----
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after Lightning's register_signal_handlers (trainer.py, just before the stage runs): ours replace
        # its SIGTERM notifier (a broadcast inside the handler) and, where it installed one, its SLURM handler
        self._received.clear()
        self._last_step = trainer.global_step
        if self.signals:
            self._install()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # inside a gradient-accumulation window: no optimizer step, no collective
        self._last_step = step
        if not self.signals:
            return
        received = self._reduce(trainer)
        if not received:
            return
        self._save_and_exit(trainer, received)

    def _reduce(self, trainer: L.Trainer) -> list[signal.Signals]:
        """The signals any rank received: one all-reduce (MAX) of a tiny tensor, every rank, every step."""
        flags = torch.tensor(
            [sig in self._received for sig in self.signals],
            dtype=torch.int32,
            device=trainer.strategy.root_device,
        )
        flags = all_reduce_no_grad(flags, op="max").cpu()
        return [sig for sig, flag in zip(self.signals, flags.tolist()) if flag]

    def _save_and_exit(self, trainer: L.Trainer, received: list[signal.Signals]) -> None:
        step = trainer.global_step
        path = step_checkpoint_path(self.checkpoint_dir(trainer), step)
        names = ", ".join(s.name for s in received)
        rank_zero_info(f"Preemption: {names} received; saving {path} at optimizer step {step}, then exiting")
        trainer.save_checkpoint(path)  # every rank
        wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if wait is not None:  # async_save: committed before the requeue and the exit
            wait()
        requeue_signal = self._requeue_signal(trainer)
        if requeue_signal in received and trainer.is_global_zero:
            self._scontrol_requeue()
        raise Preempted(self.exit_code, signal=max(received), step=step, path=path)

    def checkpoint_dir(self, trainer: L.Trainer) -> Path:
        """Where the preemption checkpoint goes: ``dirpath``, the first ``ModelCheckpoint``'s, or
        ``<default_root_dir>/checkpoints``."""
        if self.dirpath is not None:
            return self.dirpath
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                return Path(callback.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def _requeue_signal(self, trainer: L.Trainer) -> signal.Signals | None:
        environment = getattr(trainer.strategy, "cluster_environment", None)  # none on one device
        if not self.requeue or not isinstance(environment, SLURMEnvironment):
            return None
        return signal.Signals(environment.requeue_signal or signal.SIGUSR1)

    def _scontrol_requeue(self) -> None:
        job = slurm_job_id()
        if job is None:
            rank_zero_warn("Preemption: no SLURM_JOB_ID in the environment; the job is not requeued")
            return
        try:
            result = subprocess.run(
                ["scontrol", "requeue", job], capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            # common inside containers (pyxis/enroot): the checkpoint is committed, only the requeue is missing
            rank_zero_warn(
                f"Preemption: `scontrol requeue {job}` could not run ({err}); the job is not requeued. "
                "Resubmit the sbatch script: it resumes from the newest checkpoint (--ckpt_path auto)"
            )
            return
        if result.returncode != 0:
            rank_zero_warn(
                f"Preemption: `scontrol requeue {job}` exited {result.returncode}: {result.stderr.strip()}. "
                "Resubmit the sbatch script: it resumes from the newest checkpoint (--ckpt_path auto)"
            )
        else:
            rank_zero_info(f"Preemption: requeued SLURM job {job}")

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()
        if not isinstance(exception, Preempted) or self not in trainer.callbacks:
            return
        # The step was just saved: an OnExceptionCheckpoint after this callback would write the same state a
        # second time, inside the lead time the scheduler gives. It skips this one call (on every rank alike).
        for callback in trainer.callbacks[trainer.callbacks.index(self) + 1 :]:
            if isinstance(callback, OnExceptionCheckpoint) and "on_exception" not in vars(callback):
                callback.on_exception = _skip_once(callback)  # type: ignore[method-assign]

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # before Lightning's signal connector restores the handlers it found (trainer._teardown)
        self._restore()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()


def _skip_once(callback: Checkpoint) -> Callable[..., None]:
    def skip(*args: Any, **kwargs: Any) -> None:
        del callback.on_exception  # type: ignore[attr-defined]

    return skip


def insert_before_checkpoints(callbacks: list[L.Callback], callback: L.Callback) -> None:
    """Put ``callback`` before the first checkpoint callback (Lightning keeps those last): its
    ``on_train_batch_end`` and ``on_exception`` run before theirs."""
    index = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
    callbacks.insert(index, callback)


def install(trainer: L.Trainer) -> None:
    """What :class:`~lightning_longctx.UlyssesFPDTStrategy` does in ``setup``: add a :class:`Preemption`
    (unless the user gave one) and turn off Lightning's SLURM requeue handler, which saves inside the signal
    handler (its SIGTERM notifier is replaced when training starts)."""
    environment = getattr(trainer.strategy, "cluster_environment", None)  # none on one device
    if isinstance(environment, SLURMEnvironment):
        environment.auto_requeue = False
    if not any(isinstance(c, Preemption) for c in trainer.callbacks):
        insert_before_checkpoints(trainer.callbacks, Preemption())
