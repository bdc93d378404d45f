"""Hybrid models under sequence parallelism: the token mixers that are not attention (causal convolutions,
linear attention, state-space scans) made exact across ranks by halo exchange and state passing.

Mechanism. transformers' mixers call their kernels as module-level functions (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ...), each the fla / causal-conv1d / mamba-ssm
kernel when installed, else the torch fallback. :func:`patch_mixers` finds every module of a model whose
methods call one of the names in :data:`ADAPTERS` and gives that module (only that instance) copies of those
methods in which the names resolve to our adapter around the model's own function: the same adapter serves
the GPU kernels and the CPU fallbacks. Fused paths that cannot take an entry state are switched off
(:data:`FUSED_OFF`: the model then takes its unfused path), decoding paths refuse (:data:`REFUSED`). Where the
recurrence is a method or written inline (RecurrentGemma, MiniMax, RWKV's token shift, xLSTM's backend),
:data:`METHODS` replaces that one method of the instance with an adapter around it.

Packed rows (position ids restarting at 0) are exact for the kinds whose module sets ``PACKED = True``: every
kind of the package (short convolutions, the delta rule, Mamba-2, Mamba-1, RecurrentGemma's RG-LRU, MiniMax's
lightning attention, RWKV-4, xLSTM); a packed row equals its documents run one by one, on one device too. A
mixer calling an adapter of a kind without it would refuse them by name (:func:`packed_documents_refusal`).

A mixer whose forward runs without calling an adapter (a path we did not adapt) raises at that call; a
model with mixers that no adapter covers is refused at patch time (``integrations/masks.py``).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_longctx.integrations.hybrid import (
    conv,
    delta_rule,
    lightning,
    mamba2,
    rglru,
    rwkv,
    selective_scan,
    xlstm,
)
from lightning_longctx.integrations.hybrid.base import MixerCall, global_names, packed_documents_error, rebind

if TYPE_CHECKING:
    from lightning_longctx.integrations.context import SequenceParallelContext

_KINDS = (conv, delta_rule, mamba2, selective_scan, rglru, lightning, rwkv, xlstm)

#: Kernel functions (module globals of transformers' modeling files) -> adapter(call, original, *args, **kw).
ADAPTERS: dict[str, Callable[..., Any]] = {}
#: Fused kernels that return ``None`` when unavailable, upon which the model takes its unfused path.
FUSED_OFF: set[str] = set()
#: Kernels of decoding with a cache (one token against a state): never reached in training, refused if so.
REFUSED: set[str] = set()
#: Mixer class name -> {method name: adapter(call, original bound method, *args, **kw)}: for mixers whose
#: kernel is a method rather than a module global (RecurrentGemma's ``_rnn_scan``).
METHODS: dict[str, dict[str, Callable[..., Any]]] = {}
#: Adapters (kernel names of :data:`ADAPTERS`, mixer class names of :data:`METHODS`) whose kind resets its
#: state at document starts (``PACKED = True`` in its module): a mixer that calls only these takes packed rows.
PACKED: set[str] = set()

for _kind in _KINDS:  # one module per mixer kind, each declaring what it adapts
    ADAPTERS.update(getattr(_kind, "ADAPTERS", {}))
    if getattr(_kind, "PACKED", False):
        PACKED.update(getattr(_kind, "ADAPTERS", {}), getattr(_kind, "METHODS", {}))
    FUSED_OFF.update(getattr(_kind, "FUSED_OFF", ()))
    REFUSED.update(getattr(_kind, "REFUSED", ()))
    METHODS.update(getattr(_kind, "METHODS", {}))
_KNOWN = ADAPTERS.keys() | FUSED_OFF | REFUSED


def _fused_off(*args: Any, **kwargs: Any) -> None:
    return None


def _refused(call: MixerCall, name: str, *args: Any, **kwargs: Any) -> None:
    call.refuse(name)


@dataclass(eq=False)
class PatchedMixer:
    """One mixer module made sequence-parallel: the methods it got (instance attributes, removed on undo)."""

    module: nn.Module
    call: MixerCall
    methods: list[str]


def _adapted_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The methods of ``cls`` (its own or inherited) whose bodies call an adapted kernel by name, and those
    :data:`METHODS` adapts for its class."""
    found: dict[str, Callable[..., Any]] = {}
    for klass in reversed(cls.__mro__[:-1]):  # subclasses override
        for attr, fn in vars(klass).items():
            if isinstance(fn, types.FunctionType) and _reach(fn).keys() & ADAPTERS.keys():
                found[attr] = fn
            elif attr in found:
                del found[attr]
    for name in METHODS.get(cls.__name__, {}):  # after the scan, which drops methods that name no kernel
        found[name] = getattr(cls, name)
    return found


def _checked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A patched mixer's ``forward``: its own (kernel names rebound), then the check that it reached them.
    A method over attributes of the module, so that a deep copy of the model calls its own copies."""
    call: MixerCall = self._longctx_mixer
    before = call.kernel_calls
    out = self._longctx_forward(*args, **kwargs)
    if call.kernel_calls == before:
        raise RuntimeError(
            f"{call.name}'s forward ran without its sequence-parallel kernels (it took a path they do not "
            "cover, such as a fused or cached one), so it mixed only this rank's shard. Train it with "
            "use_cache=False; if that is the case already, this model is not supported"
        )
    call.context.mixer_calls += 1
    return out


#: a ``kernels`` function module whose function we could not find: treated as a kernel nobody adapted
_OPAQUE = object()


def _function_of(value: Any) -> Any:
    """The function behind ``value``: itself, or for a function decorated with ``use_kernel_forward_from_hub``
    while the ``kernels`` package is installed (transformers >= 5.25 depends on it) the ``nn.Module`` instance
    that decorator returns, the function its class's forward closes over (:data:`_OPAQUE` if none)."""
    if isinstance(value, nn.Module) and hasattr(value, "kernel_layer_name"):
        cells = getattr(type(value).forward, "__closure__", None) or ()
        found = [c.cell_contents for c in cells if isinstance(c.cell_contents, types.FunctionType)]
        return found[0] if len(found) == 1 else _OPAQUE
    return value


def _is_kernel(value: Any) -> bool:
    """A kernel function of a transformers modeling file: wrapped by its hub-kernel decorator
    (``use_kernel_func_from_hub_with_fallback``: fla / mamba-ssm / causal-conv1d or the torch fallback)."""
    fn = _function_of(value)
    return fn is _OPAQUE or (
        isinstance(fn, types.FunctionType)
        and hasattr(fn, "__wrapped__")
        and (fn.__module__ or "").startswith("transformers.models.")
    )


def _helper(value: Any) -> types.FunctionType | None:
    """The plain function of a transformers modeling file (not a hub kernel) behind ``value``: a helper a mixer
    calls, whose body may call the kernels (transformers >= 5.25 runs every short conv through
    ``causal_conv1d_forward``); else ``None``."""
    fn = _function_of(value)
    if isinstance(fn, types.FunctionType) and not _is_kernel(fn):
        return fn if (fn.__module__ or "").startswith("transformers.models.") else None
    return None


@functools.cache
def _reach(fn: Callable[..., Any]) -> dict[str, Any]:
    """The kernels ``fn`` calls (adapted, fused, refused, or a kernel we do not know), by the global name that
    calls them: read in its own body and, transitively, in the bodies of the modeling file's helpers it
    calls. A kernel reached only through a helper would otherwise run unadapted, on this rank's shard."""
    found: dict[str, Any] = {}
    seen: set[Any] = set()
    todo = [fn]
    while todo:
        inner = inspect.unwrap(todo.pop())
        if inner in seen:
            continue
        seen.add(inner)
        scope = inner.__globals__
        for name in global_names(inner) & scope.keys():
            value = scope[name]
            if name in _KNOWN or _is_kernel(value):
                found[name] = value
            elif (helper := _helper(value)) is not None:
                todo.append(helper)
    return found


def _rebound(fn: Callable[..., Any], call: MixerCall) -> Callable[..., Any]:
    """``fn`` with every kernel it calls resolved to ``call``'s adapter (fused ones off, decoding ones
    refused), through the helpers that reach one: each helper rebound the same way."""
    inner = inspect.unwrap(fn)
    scope = inner.__globals__
    overrides: dict[str, Any] = {}
    for name in global_names(fn) & scope.keys():
        value = scope[name]
        if name in ADAPTERS:
            overrides[name] = functools.partial(ADAPTERS[name], call, value)
        elif name in FUSED_OFF:
            overrides[name] = _fused_off
        elif name in REFUSED:
            overrides[name] = functools.partial(_refused, call, name)
        elif (helper := _helper(value)) is not None and _reach(helper).keys() & _KNOWN:
            overrides[name] = _rebound(helper, call)  # the plain function, rebound (not its kernels module)
    return rebind(fn, overrides) if overrides else fn


def find_mixers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose methods call an adapted kernel (its hybrid mixers). A mixer that also
    calls a kernel we have no adapter for is refused: adapting only part of it would be silently wrong."""
    mixers = []
    for module in model.modules():
        methods = _adapted_methods(type(module))
        if not methods:
            continue
        kernels: dict[str, Any] = {}
        for fn in methods.values():
            kernels.update(_reach(fn))
        missing = sorted(kernels.keys() - _KNOWN)
        if missing:
            raise ValueError(
                f"{type(module).__name__} calls {', '.join(missing)}, which has no sequence-parallel adapter "
                f"(adapted: {', '.join(sorted(ADAPTERS))}); the layer would see only its own shard. Train this "
                "model without sequence parallelism"
            )
        mixers.append(module)
    return mixers


def patch_mixers(
    model: nn.Module, context: SequenceParallelContext, mixers: list[nn.Module] | None = None
) -> list[PatchedMixer]:
    """Give every mixer module of ``model`` (``mixers``: :func:`find_mixers`'s) sequence-parallel kernels;
    returns what was patched."""
    patched = []
    for module in find_mixers(model) if mixers is None else mixers:
        methods = _adapted_methods(type(module))
        names = set().union(*(_reach(fn).keys() for fn in methods.values()))
        cls = type(module).__name__
        packed = (names & ADAPTERS.keys()) <= PACKED and (cls not in METHODS or cls in PACKED)
        call = MixerCall(context, cls, packed=packed)
        own = METHODS.get(cls, {})
        for attr, fn in methods.items():
            method: Any = types.MethodType(_rebound(fn, call), module)
            if attr in own:  # the adapter wraps the model's own method (itself rebound, if it calls kernels)
                method = functools.partial(own[attr], call, method)  # a deep copy rebinds it to the copy
            setattr(module, attr, method)
        module._longctx_mixer, module._longctx_forward = call, module.forward
        module.forward = types.MethodType(_checked_forward, module)
        patched.append(
            PatchedMixer(module, call, [*methods, "forward", "_longctx_mixer", "_longctx_forward"])
        )
    return patched


def packed_documents_refusal(context: SequenceParallelContext) -> ValueError | None:
    """The error a packed batch meets in ``context``'s model (a patched mixer whose adapter cannot reset its
    state at a document start), or ``None`` when every mixer takes packed rows: what the strategy decides
    before the forward, on every rank."""
    for mixer in context.restore.get("mixers", ()):
        if not mixer.call.packed:
            return packed_documents_error(context.model_name or "the model", mixer.call.name)
    return None


def unpatch_mixers(patched: list[PatchedMixer]) -> None:
    for mixer in patched:
        for attr in set(mixer.methods):
            mixer.module.__dict__.pop(attr, None)
