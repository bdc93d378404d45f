"""Host-offloaded activation checkpoints: each checkpointed layer's input waits in host memory.

With activation checkpointing a decoder layer keeps only its input ``(b, s/P, hidden)`` for backward;
at long sequences those L inputs are most of what stays on the device (ALST offloads them too).
:class:`OffloadedCheckpoint` is a checkpoint function (HF layers call it as
``_gradient_checkpointing_func``) that moves them out:

* Torch's non-reentrant checkpoint saves the layer's tensor inputs as saved tensors *before* it
  installs its own hooks, so a ``saved_tensors_hooks`` around the call sees exactly those inputs
  (what the layer saves inside is the checkpoint's business: dropped and recomputed).
* pack: the input goes into an offloading :class:`~lightning_longctx.attention.offload.ChunkStore`
  (pinned host memory, copied on the side stream; on CPU a plain copy: the same code path) and the
  device tensor is released.
* unpack (the layer's recompute in backward): the input comes back on the device, and the input of
  the layer packed before it, the next one backward recomputes, starts coming back on the side
  stream meanwhile: at most two layer inputs are fetched at once.

Results are bit-identical with and without offload (the copies are exact). Host bytes show in
``offloaded_bytes()``; fetched copies are counted under the name ``"layer_input"`` by
``track_offload_residency()``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from lightning_longctx.attention.offload import ChunkStore

#: the store key of a layer input (one tensor per store)
KEY = ("layer_input", 0)


class _HostCopy:
    """One offloaded checkpoint input, and the one packed before it (the next to be recomputed)."""

    __slots__ = ("__weakref__", "before", "store")

    def __init__(self, x: torch.Tensor, before: _HostCopy | None) -> None:
        self.store = ChunkStore(offload=True, device=x.device)
        self.store.put(KEY, x)
        # weak: a finished step's inputs must not be kept alive by the next step's
        self.before = None if before is None else weakref.ref(before)

    def fetch(self) -> torch.Tensor:
        x = self.store.get(KEY)
        before = self.before() if self.before is not None else None
        if before is not None:
            before.store.prefetch(KEY)  # overlaps this layer's recompute and backward
        return x


class OffloadedCheckpoint:
    """``checkpoint(function, *args, use_reentrant=False, **kwargs)`` with the tensor ``args`` kept in
    host memory until the recompute. One instance serves all layers of a model (it links each input to
    the one packed before it, for the prefetch)."""

    def __init__(self) -> None:
        self._last: weakref.ref[_HostCopy] | None = None

    def _pack(self, x: torch.Tensor) -> _HostCopy:
        held = _HostCopy(x, self._last() if self._last is not None else None)
        self._last = weakref.ref(held)
        return held

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_reentrant"):
            raise ValueError(
                "OffloadedCheckpoint needs non-reentrant checkpointing (use_reentrant=False): the reentrant "
                "variant does not save its inputs as saved tensors, so they could not be offloaded"
            )
        kwargs["use_reentrant"] = False
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _HostCopy.fetch):
            return checkpoint(function, *args, **kwargs)
