"""What every hybrid-mixer adapter shares: the call's layout (segments), its refusals, and the rebinding
of a mixer's methods so that the kernel functions it calls by name resolve to our adapters.

A *segment* is a run of consecutive global tokens on one rank (``comm.py``): the whole shard in the
contiguous (Ulysses) layout, each of the ``u`` local chunks of ``c`` tokens in the FPDT layout. Adapters
run the model's own kernel function on all segments at once, stacked along the batch dimension
``(u*b, c, ...)`` (u-major), and join them with :func:`~lightning_longctx.comm.halo_exchange` (causal
convolutions) or :func:`~lightning_longctx.comm.exclusive_affine_scan` (recurrences).
"""

from __future__ import annotations

import inspect
import itertools
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_longctx.comm import Group

if TYPE_CHECKING:
    from lightning_longctx.integrations.context import SequenceParallelContext


def packed_documents_error(name: str) -> ValueError:
    return ValueError(
        f"{name} has recurrent / convolutional mixers and the batch packs several documents (position_ids "
        "restart at 0). Their state would flow from one document into the next: a plain Hugging Face model "
        "mixes them too, and sequence-parallel hybrids do not reset it yet. Train hybrid models on one "
        "document per row (pad instead of packing)"
    )


def halo_error(name: str, halo: int, segment: int, local_len: int | None = None) -> ValueError:
    where = f"local length {local_len}" if local_len is not None else f"fpdt_chunk_size={segment}"
    return ValueError(
        f"{name} needs the last {halo} tokens before each segment (its causal convolution), but a segment "
        f"holds {segment} tokens ({where}); use a longer sequence, fewer sequence-parallel ranks or "
        f"fpdt_chunk_size >= {halo}"
    )


def mixer_halo(mixers: list[Any]) -> int:
    """The most tokens any of ``mixers`` needs from before its segment: a depthwise causal ``nn.Conv1d``'s
    ``k-1`` (the functional convs take a Conv1d's weight too); 1 (RWKV's token shift) otherwise."""
    halo = 1 if mixers else 0
    for mixer in mixers:
        for m in mixer.modules():
            if isinstance(m, torch.nn.Conv1d):
                halo = max(halo, m.kernel_size[0] - 1)
    return halo


class MixerCall:
    """One patched mixer module's view of its model's sequence-parallel context (what adapters receive).

    ``kernel_calls`` counts adapter calls: a mixer forward that ran none took a path we did not adapt
    (a fused kernel, a cache) and is refused instead of mixing only its own shard. A deep copy of the model
    shares it, as it shares the context: the copied methods' kernel names are bound to this object."""

    def __init__(self, context: SequenceParallelContext, name: str) -> None:
        self.context = context
        self.name = name  # the module's class name, for errors
        self.kernel_calls = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> MixerCall:
        return self

    @property
    def group(self) -> Group:
        return self.context.group

    def chunk(self, local_len: int) -> int:
        """Tokens per segment of a call whose shard holds ``local_len`` tokens."""
        c = self.context.local_chunk(local_len)
        return local_len if c is None else c

    def check(self, local_len: int, halo: int = 0) -> int:
        """The segment length, after the refusals every adapter shares; ``halo``: tokens a segment needs
        from the one before it (a convolution's k-1)."""
        self.kernel_calls += 1
        ctx = self.context
        if (
            ctx.call_position_ids is not None
            and ctx.positions is not None
            and ctx.positions.documents() is not None
        ):
            raise packed_documents_error(
                self.name
            )  # the strategy refuses it before the forward, on every rank
        c = self.chunk(local_len)
        if halo > c:
            raise halo_error(self.name, halo, c, local_len)
        return c

    def refuse(self, what: str) -> None:
        raise ValueError(
            f"{self.name} called {what}, which sequence-parallel training does not support (a cache, "
            "decoding, or a fused kernel that cannot take an entry state). Train with use_cache=False"
        )


def to_segments(x: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """``x`` with local sequence dim ``dim`` (length u*c) -> segments stacked on the batch dim:
    ``(b, ..., u*c, ...)`` -> ``(u*b, ..., c, ...)``, u-major."""
    dim = dim % x.dim()
    u = x.shape[dim] // chunk
    return x.unflatten(dim, (u, chunk)).movedim(dim, 0).flatten(0, 1)


def from_segments(x: torch.Tensor, dim: int, u: int) -> torch.Tensor:
    """Inverse of :func:`to_segments`: ``(u*b, ..., c, ...)`` -> ``(b, ..., u*c, ...)``."""
    dim = dim % x.dim()
    return x.unflatten(0, (u, -1)).movedim(0, dim).flatten(dim, dim + 1)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def global_names(fn: Callable[..., Any]) -> set[str]:
    """The global names a function's innermost body (below its decorators) reads."""
    return _code_names(inspect.unwrap(fn).__code__)


def rebind(fn: Callable[..., Any], overrides: dict[str, Any]) -> Callable[..., Any]:
    """A copy of ``fn`` whose innermost body reads ``overrides`` in place of those module globals, its
    decorators kept: each wrapper layer (``functools.wraps``, which sets ``__wrapped__``) is copied with the
    closure cell that held the layer below pointing at the copy. The class and its other instances are
    untouched."""
    layers = [fn]
    while hasattr(layers[-1], "__wrapped__"):
        layers.append(layers[-1].__wrapped__)
    inner = layers[-1]
    scope = {**inner.__globals__, **overrides}
    new = types.FunctionType(inner.__code__, scope, inner.__name__, inner.__defaults__, inner.__closure__)
    new.__kwdefaults__ = inner.__kwdefaults__
    for layer, below in reversed(list(itertools.pairwise(layers))):
        cells = layer.__closure__ or ()
        if not any(cell.cell_contents is below for cell in cells):
            raise TypeError(
                f"cannot rebind {fn.__qualname__}: its decorator {layer.__qualname__} does not hold the function "
                "it wraps in a closure, so the sequence-parallel kernels cannot be put below it"
            )
        closure = tuple(types.CellType(new) if cell.cell_contents is below else cell for cell in cells)
        copy = types.FunctionType(
            layer.__code__, layer.__globals__, layer.__name__, layer.__defaults__, closure
        )
        copy.__kwdefaults__ = layer.__kwdefaults__
        copy.__wrapped__ = new
        new = copy
    return new
