"""Per-chunk tensor store for FPDT: on the device, or in (pinned) host memory with prefetch.

FPDT keeps, per global segment, the tensors its backward needs (q, k, v, out, lse in head layout).
Either way the autograd Function saves the store's tensors with ``save_for_backward`` (:meth:`ChunkStore.saved`,
:meth:`ChunkStore.restore`), so whatever owns saved tensors owns them: under activation checkpointing the
checkpoint drops them after the layer's forward and its recompute rebuilds them, so the host holds ONE
layer's chunks, not every layer's. With ``offload=False`` they stay on the device. With ``offload=True``
each one is copied to host memory when it is produced and fetched back shortly before it is used:

* CUDA: device -> pinned host on a side stream (``record_stream`` keeps the source alive until the
  copy ran), host -> device on the same side stream, the consumer's stream waits on an event. The
  pinned buffers come from torch's caching host allocator, which is the buffer pool: a released
  store's blocks are reused by the next chunks and steps, and the event it records for each async
  copy keeps a block from reuse until its copy finished (no ``cudaHostAlloc`` / free per chunk).
* CPU: the "host copy" is a plain synchronous ``clone`` — the same code path, so the CPU tests
  exercise it, and results are bit-identical with offload on and off (copies are exact).

:meth:`ChunkStore.pipeline` walks a precomputed access order and prefetches step ``n+1`` while the
caller computes on step ``n`` (a double buffer: at most two steps' fetched tensors are alive when
the caller drops each step before asking for the next).

``offloaded_bytes()`` is the number of bytes in live host buffers, a process-wide gauge like
``torch.cuda.memory_allocated`` (the memory callback reads it): each host buffer gives its bytes back
when it is freed (backward ran, a checkpoint dropped it, a graph was dropped without backward).
:func:`track_offload_residency` counts fetched copies for tests and benchmarks only while it is open.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

Key = tuple[str, int]  # (tensor name, segment index), e.g. ("k", 3)

_HELD_BYTES = [0]  # bytes in host buffers of all live stores
_SIDE_STREAMS: dict[torch.device, Any] = {}


def offloaded_bytes() -> int:
    """Bytes currently held in host memory by live FPDT offload stores (0 when nothing is offloaded)."""
    return _HELD_BYTES[0]


@dataclass
class OffloadResidency:
    """How many fetched device copies were alive at once, per tensor name (``"k"``, ``"q"``, ...), while
    a :func:`track_offload_residency` block was open. Only offloaded fetches are counted."""

    resident: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak_resident: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def _fetched(self, name: str, tensor: torch.Tensor) -> None:
        self.resident[name] += 1
        self.peak_resident[name] = max(self.peak_resident[name], self.resident[name])
        weakref.finalize(tensor, self._dropped, name)

    def _dropped(self, name: str) -> None:
        self.resident[name] -= 1


#: The open :func:`track_offload_residency` blocks; empty (no per-tensor finalizer) unless one is open.
_OPEN_TRACKERS: list[OffloadResidency] = []


@contextmanager
def track_offload_residency() -> Iterator[OffloadResidency]:
    """Count the device copies that offloading stores fetch inside the block (tests, benchmarks: proves
    the double buffer). Costs nothing outside such a block."""
    tracker = OffloadResidency()
    _OPEN_TRACKERS.append(tracker)
    try:
        yield tracker
    finally:
        _OPEN_TRACKERS.remove(tracker)


def _give_back(nbytes: int) -> None:
    _HELD_BYTES[0] -= nbytes


def _side_stream(device: torch.device) -> Any:
    """One copy stream per CUDA device, created on first use (never at import)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class ChunkStore:
    """Tensors keyed by ``(name, segment)``, kept on the device or offloaded to host memory."""

    def __init__(self, *, offload: bool, device: torch.device) -> None:
        self.offload = offload
        self.device = device
        self._cuda = offload and device.type == "cuda"
        self._stream = _side_stream(device) if self._cuda else None
        self._data: dict[Key, torch.Tensor] = {}
        self._pending: dict[Key, tuple[torch.Tensor, Any]] = {}  # prefetched device copy, its ready event

    # ---- storing ----
    def put(self, key: Key, x: torch.Tensor) -> None:
        """Keep ``x`` under ``key``; never modified afterwards (no in-place writes into saved tensors)."""
        if not self.offload:
            self._data[key] = x
            return
        if self._cuda:
            current = torch.cuda.current_stream(self.device)
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self._stream.wait_stream(current)  # x is produced on the current stream
            with torch.cuda.stream(self._stream):
                host.copy_(x, non_blocking=True)
            x.record_stream(self._stream)  # the allocator must not reuse x before the copy ran
        else:
            host = x.detach().clone()  # CPU: a plain synchronous copy, same code path
        self._data[key] = host
        nbytes = host.numel() * host.element_size()
        _HELD_BYTES[0] += nbytes
        # the gauge follows the buffer, wherever it ends up (a store, autograd's saved tensors, a checkpoint)
        weakref.finalize(host, _give_back, nbytes)

    def saved(self) -> tuple[list[Key], list[torch.Tensor]]:
        """Keys and tensors (device tensors, or host buffers with offload) for ``ctx.save_for_backward``."""
        return list(self._data), list(self._data.values())

    @classmethod
    def restore(
        cls, keys: Sequence[Key], tensors: Sequence[torch.Tensor], *, offload: bool, device: torch.device
    ) -> ChunkStore:
        """The store :meth:`saved` described, again (in backward, from ``ctx.saved_tensors``)."""
        store = cls(offload=offload, device=device)
        store._data = dict(zip(keys, tensors))
        return store

    # ---- fetching ----
    def prefetch(self, key: Key) -> None:
        """Start bringing ``key`` back to the device (side stream on CUDA; a copy on CPU). A key not stored
        yet is skipped: a pipeline's look-ahead can reach a chunk that has not arrived (FPDT's causal
        diagonal k_i, when packed documents or a window leave segment i no earlier kv segment), and
        :meth:`get` fetches it when it is asked for."""
        if not self.offload or key in self._pending or key not in self._data:
            return
        host = self._data[key]
        event = None
        if self._cuda:
            with torch.cuda.stream(self._stream):  # ordered after this key's device->host copy
                dev = host.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            dev = host.clone()
        for tracker in _OPEN_TRACKERS:
            tracker._fetched(key[0], dev)
        self._pending[key] = (dev, event)

    def get(self, key: Key) -> torch.Tensor:
        """``key`` on the device, ready to use on the current stream."""
        if not self.offload:
            return self._data[key]
        self.prefetch(key)
        dev, event = self._pending.pop(key)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            dev.record_stream(current)  # allocated on the side stream, used on this one
        return dev

    def pipeline(self, steps: Sequence[Sequence[Key]]) -> Iterator[tuple[torch.Tensor, ...]]:
        """Yield the tensors of each step in order, prefetching the next step meanwhile.

        Drop the tensors of a step before asking for the next one: then at most two steps' fetched
        tensors are alive (the one in use and the one in flight).
        """
        for n, keys in enumerate(steps):
            got = tuple(self.get(key) for key in keys)
            if n + 1 < len(steps):
                for key in steps[n + 1]:
                    self.prefetch(key)
            yield got
            del got

    def release(self) -> None:
        """Drop this store's references to its buffers now (idempotent); each is freed with its last one."""
        self._data.clear()
        self._pending.clear()
