"""Rotary position embeddings under sequence parallelism: every rank rotates as one process would.

Most of Hugging Face's rope types (``default``, ``linear``, ``yarn``, ``llama3``) compute their frequencies
from the config alone: with the GLOBAL ``position_ids`` of ``shard_batch`` they are exact as they are. Two
read the sequence length: transformers' ``dynamic_rope_update`` decorator on a rotary embedding's forward
takes ``max(position_ids) + 1`` and, for ``dynamic`` (dynamic NTK), rescales the base from it; for
``longrope``, switches between the short and the long factors at ``original_max_position_embeddings``.
Each rank sees only its shard, so each would take its own length. :func:`patch_rotary` gives such an
embedding an instance ``forward`` that runs transformers' own update on the batch's GLOBAL length (the
context knows the batch: :meth:`SequenceParallelContext.sequence_length`), then the embedding on the
rank's positions. A rotary embedding that reads the length anywhere else (PhiMoE's longrope mscale, in its
forward) is refused at patch time.

:func:`rope_limit` is the other half: the longest sequence the model's RoPE covers. The strategy refuses a
batch past it (positions no training ever saw, used silently) and names the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_longctx.integrations.context import SequenceParallelContext

_UNSET = object()
#: Layer types whose attention spans a window or a chunk: relative distances stay within it at any length.
_WINDOWED = ("sliding", "chunked")


def reads_length(rope_type: str) -> bool:
    """Whether transformers' ``dynamic_rope_update`` recomputes this rope type's frequencies from the
    sequence length (its own test: ``"dynamic" in rope_type`` or ``longrope``)."""
    return "dynamic" in rope_type or rope_type == "longrope"


def _noop(self: Any, x: Any, position_ids: Any) -> None:
    return None


def _is_decorated(module: nn.Module) -> bool:
    """Whether the module's class forward is wrapped in transformers' ``dynamic_rope_update`` (every wrapper
    it makes shares one code object)."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    forward = type(module).forward
    return hasattr(forward, "__wrapped__") and getattr(forward, "__code__", None) is (
        dynamic_rope_update(_noop).__code__
    )


def _rope_types(module: nn.Module) -> dict[str | None, str]:
    """``{layer_type: rope_type}``; ``None`` for an embedding with one rope type."""
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, dict):
        return {k: str(v) for k, v in rope_type.items()}
    return {None: str(rope_type)} if rope_type is not None else {}


def _forward_reads_length(module: nn.Module, layer_type: str | None, decorated: bool) -> bool:
    """Probe the embedding's own forward (under transformers' decorator, when it has one): do the rotations of
    positions 0 and 1 change when a far position joins the call? A forward the probe cannot call (multimodal
    positions, buffers on the meta device) is taken as not reading the length."""
    inner = type(module).forward.__wrapped__ if decorated else type(module).forward
    buffer = next(module.buffers(), None)
    if buffer is None or buffer.is_meta:
        return False
    limit = int(getattr(getattr(module, "config", None), "max_position_embeddings", 0) or 0)
    far = 4 * max(limit, 1024) + 1  # past any pretraining length a switch could sit at
    x = torch.zeros(1, dtype=torch.float32, device=buffer.device)
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    try:
        with torch.no_grad():
            near = inner(module, x, torch.tensor([[0, 1]], device=buffer.device), **kwargs)
            both = inner(module, x, torch.tensor([[0, 1, far]], device=buffer.device), **kwargs)
    except Exception:  # a probe that cannot run tells nothing
        return False
    return any(not torch.allclose(a, b[..., :2, :], rtol=1e-6, atol=0.0) for a, b in zip(near, both))


def _refusal(name: str, module: nn.Module, layer_type: str | None, rope_type: str, where: str) -> ValueError:
    layer = "" if layer_type is None else f" (layer type {layer_type!r})"
    return ValueError(
        f"{name}'s rotary embedding {type(module).__name__}{layer} computes its rotation from the length of the "
        f"sequence it sees ({where}, rope_type {rope_type!r}); under sequence parallelism each rank sees only its "
        "shard, so the ranks would rotate differently. Use a rope type whose frequencies do not depend on the "
        "length (default, linear, yarn, llama3), or train this model without sequence parallelism"
    )


class _GlobalLengthRotary:
    """The instance ``forward`` of a rotary embedding whose frequencies depend on the sequence length:
    transformers' own update (``dynamic_rope_update``, with its cache and its reset) runs on a one-position
    call at the batch's largest GLOBAL position, then the undecorated forward on this rank's positions."""

    def __init__(self, context: SequenceParallelContext, module: nn.Module) -> None:
        self.context = context
        self.module = module

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        forward = type(self.module).forward
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        last = (self.context.sequence_length(position_ids) - 1).reshape(1, 1)  # (1, 1): the largest position
        forward(self.module, x, last, **kwargs)  # the update; its one rotation is not needed
        return forward.__wrapped__(self.module, x, position_ids, **kwargs)


def patch_rotary(model: nn.Module, context: SequenceParallelContext, name: str) -> list[Any]:
    """Give every rotary embedding of ``model`` whose frequencies depend on the sequence length the GLOBAL
    length (see the module docstring); refuse one we cannot, before any is changed. Returns what
    :func:`unpatch_rotary` restores."""
    to_patch = []
    for module in model.modules():
        types = _rope_types(module)
        decorated = bool(types) and _is_decorated(module)
        for layer_type, rope_type in types.items():  # a length read anywhere but in the decorator: refused
            if _forward_reads_length(module, layer_type, decorated):
                raise _refusal(name, module, layer_type, rope_type, "inside its forward")
        if decorated and any(reads_length(t) for t in types.values()):
            to_patch.append(module)
    patched = []
    for module in to_patch:
        patched.append((module, module.__dict__.get("forward", _UNSET)))
        module.forward = _GlobalLengthRotary(context, module)
    return patched


def unpatch_rotary(patched: list[Any]) -> None:
    """Undo :func:`patch_rotary`: the embeddings' forwards are their class's again (or what they were)."""
    for module, before in patched:
        if before is _UNSET:
            module.__dict__.pop("forward", None)
        else:
            module.forward = before


@dataclass(frozen=True)
class RopeLimit:
    """The longest sequence (largest position id + 1) a model's RoPE covers: ``limit`` tokens, from
    ``max_position_embeddings`` and, with a scaling, ``factor`` x ``original`` (the pretraining length)."""

    limit: int
    max_position_embeddings: int
    original: int
    rope_type: str

    def error(self, model_name: str, longest: int, holder: str = "this batch holds") -> ValueError:
        """The refusal of ``longest`` positions; ``holder`` says what holds them (a batch, the data's rows)."""
        factor = math.ceil(longest / self.original)
        scaled = "" if self.rope_type == "default" else f", rope_type {self.rope_type!r}"
        return ValueError(
            f"{model_name}: {holder} a sequence of {longest} positions, but the model's RoPE covers "
            f"{self.limit} (max_position_embeddings={self.max_position_embeddings}{scaled}): it would train on "
            "positions it never saw, silently. Extend the context with a rope scaling, e.g. "
            f"CausalLM(config_overrides={{'rope_parameters': {{'rope_type': 'yarn', 'factor': {factor}, "
            f"'original_max_position_embeddings': {self.original}}}, 'max_position_embeddings': {longest}}}) "
            "(rope_scaling / rope_parameters on a transformers config), or raise max_position_embeddings to "
            f">= {longest} explicitly to train the new positions without scaling"
        )


def rope_limit(config: Any) -> RopeLimit | None:
    """The :class:`RopeLimit` of a transformers config; ``None`` when nothing limits the length: no RoPE
    parameters, ``dynamic`` (it rescales to any length), or only windowed layers (sliding / chunked attention
    sees relative distances up to its window, and RoPE depends only on those)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(config, "rope_parameters", None)
    max_pos = getattr(config, "max_position_embeddings", None)
    if not isinstance(params, dict) or not params or not isinstance(max_pos, int):
        return None
    nested = getattr(config, "nested_rope_parameter_keys", None)
    keys = list(nested(params)) if callable(nested) else []
    entries = {k: params[k] for k in keys} if keys else {None: params}
    limits = []
    for key, p in entries.items():
        if not isinstance(p, dict) or (key is not None and any(w in key for w in _WINDOWED)):
            continue
        rope_type = str(p.get("rope_type", p.get("type", "default")))
        if "dynamic" in rope_type:
            continue
        original = int(p.get("original_max_position_embeddings") or max_pos)
        factor = p.get("factor") if rope_type != "default" else None
        covered = max(max_pos, int(factor * original)) if factor else max_pos
        limits.append(RopeLimit(covered, max_pos, original, rope_type))
    return min(limits, key=lambda r: r.limit, default=None)
