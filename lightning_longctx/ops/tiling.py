"""Sequence-tiled position-wise modules (the MLP of a transformer block), recomputed in backward.

An MLP maps ``(b, s, hidden) -> (b, s, hidden)`` through a ``(b, s, intermediate)`` activation that
is several times larger than its input. ``tiled_forward`` runs it on ``chunk_size`` tokens at a time
without keeping that activation; backward recomputes each chunk with grad enabled and back-propagates
it, so no ``(s, intermediate)`` tensor ever exists at once — only ``(chunk_size, intermediate)``.

``tile_mlp_(module, chunk_size)`` patches one module's forward IN PLACE (an instance attribute), so
``state_dict`` keys are unchanged and Hugging Face checkpoints load into the tiled model as they are.
The wrapped function must be position-wise (each token's output depends on that token only).
Dropout stays exact: the RNG state at forward is restored for the recompute, and chunks replay in
the same order. Autocast state is replayed too (Lightning's ``bf16-mixed``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

_TILE_ATTR = "_longctx_tile_chunk"
_ORIG_ATTR = "_longctx_untiled_forward"
#: the instance attributes :func:`tile_mlp_` sets on a module (what ``sequence_parallel_off`` puts back)
TILED_ATTRS = ("forward", _TILE_ATTR, _ORIG_ATTR)


def _chunks(n: int, chunk_size: int) -> list[slice]:
    return [slice(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


class _RngState:
    """CPU (and the input's CUDA device) RNG state, to replay the forward's random draws."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def fork(self) -> Any:
        return torch.random.fork_rng(devices=[self.device] if self.cuda is not None else [])

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class _AutocastState:
    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type)

    def __call__(self) -> Any:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[[torch.Tensor], torch.Tensor],
        chunk_size: int,
        preserve_rng: bool,
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.fn, ctx.chunk_size, ctx.params = fn, chunk_size, params
        ctx.rng = _RngState(x.device) if preserve_rng else None
        ctx.autocast = _AutocastState(x.device.type)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])  # (tokens, hidden)
        # Function.forward runs without grad: each chunk's (chunk, intermediate) activation dies here.
        outs = [fn(flat[sl].unsqueeze(0)).squeeze(0) for sl in _chunks(flat.shape[0], chunk_size)]
        return torch.cat(outs, dim=0).reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        params = ctx.params
        need_x = ctx.needs_input_grad[3]
        need_p = list(ctx.needs_input_grad[4:])
        flat_x = x.reshape(-1, x.shape[-1])
        flat_g = grad.reshape(flat_x.shape[0], -1)
        grad_x = torch.empty_like(flat_x) if need_x else None
        grad_p: list[torch.Tensor | None] = [None] * len(params)
        wanted = [p for p, need in zip(params, need_p) if need]
        with ctx.rng.fork() if ctx.rng is not None else nullcontext():
            if ctx.rng is not None:
                ctx.rng.restore()  # chunks replay in forward order: same random draws
            for sl in _chunks(flat_x.shape[0], ctx.chunk_size):
                xc = flat_x[sl].detach().requires_grad_(need_x)
                with torch.enable_grad(), ctx.autocast():
                    y = ctx.fn(xc.unsqueeze(0)).squeeze(0)  # (chunk, hidden): recompute
                inputs = ([xc] if need_x else []) + wanted
                grads = list(torch.autograd.grad(y, inputs, flat_g[sl], allow_unused=True)) if inputs else []
                if need_x:
                    grad_x[sl] = grads.pop(0)
                gi = iter(grads)
                for n, need in enumerate(need_p):
                    if need:
                        g = next(gi)
                        if g is not None:
                            grad_p[n] = g if grad_p[n] is None else grad_p[n] + g
                del y, grads
        gx = None if grad_x is None else grad_x.view_as(x)
        return (None, None, None, gx, *grad_p)


def tiled_forward(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    chunk_size: int,
    params: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
    preserve_rng_state: bool = True,
) -> torch.Tensor:
    """``fn(x)`` computed ``chunk_size`` tokens at a time, recomputed per chunk in backward.

    Args:
        fn: a position-wise function ``(1, t, hidden) -> (1, t, out)``, e.g. an MLP module's forward.
        x: ``(..., hidden)``, e.g. ``(b, s, hidden)``; the leading dims are flattened into tokens.
        chunk_size: tokens per chunk (the last chunk may be shorter).
        params: the tensors ``fn`` reads that need gradients (a module's parameters); their gradients
            are summed over chunks and returned through autograd like any other input's.

    Returns ``(..., out)``, equal to ``fn(x)`` in value and gradient.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}")
    params = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        flat = x.reshape(-1, x.shape[-1])
        outs = [fn(flat[sl].unsqueeze(0)).squeeze(0) for sl in _chunks(flat.shape[0], chunk_size)]
        return torch.cat(outs, dim=0).reshape(*x.shape[:-1], -1)
    return _TiledFunction.apply(fn, chunk_size, preserve_rng_state, x, *params)


def _tiled_module_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if args or kwargs:
        raise TypeError(
            f"a tiled {type(self).__name__} takes one tensor (b, s, hidden); got extra arguments. Tile only "
            "position-wise modules with a single input (untile_mlp_ restores the original forward)"
        )
    orig = self.__dict__.get(_ORIG_ATTR)
    fn = orig if orig is not None else types.MethodType(type(self).forward, self)
    params = [p for p in self.parameters() if p.requires_grad]
    return tiled_forward(fn, x, chunk_size=getattr(self, _TILE_ATTR), params=params)


def tile_mlp_(module: nn.Module, chunk_size: int) -> nn.Module:
    """Make ``module`` (any position-wise ``(b, s, hidden) -> (b, s, hidden)`` MLP) sequence-tiled, in place.

    Its forward then runs ``chunk_size`` tokens at a time and recomputes each chunk in backward.
    Parameters, buffers and ``state_dict`` keys are untouched. Calling it again changes the chunk size.
    Returns ``module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"tile_mlp_ expects an nn.Module, got {type(module).__name__}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}")
    if not is_tiled(module):
        # keep an instance-level forward someone else installed; None means "the class's forward"
        object.__setattr__(module, _ORIG_ATTR, module.__dict__.get("forward"))
        module.forward = types.MethodType(_tiled_module_forward, module)  # deepcopy rebinds it to the copy
    object.__setattr__(module, _TILE_ATTR, chunk_size)
    return module


def untile_mlp_(module: nn.Module) -> nn.Module:
    """Undo :func:`tile_mlp_`; returns ``module``."""
    if is_tiled(module):
        orig = module.__dict__.pop(_ORIG_ATTR)
        del module.__dict__[_TILE_ATTR]
        if orig is None:  # (a hub-kernel re-kernelization may have deleted ours already)
            module.__dict__.pop("forward", None)
        else:
            module.forward = orig
    return module


def is_tiled(module: nn.Module) -> bool:
    return _TILE_ATTR in module.__dict__
