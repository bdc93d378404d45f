"""Swap attention (and, in FPDT mode, the MLP and the loss) of a Hugging Face model in place.

Mechanism: transformers' ``AttentionInterface``. We register one attention function per patched
model under a fresh key (no mask function: the model then builds no O(s²) mask) and point the
model's config at it. The function receives q ``(b, H, s, d)`` and k/v ``(b, H_kv, s, d)`` already
rotated with the GLOBAL ``position_ids`` that ``shard_batch`` produced and returns
``(out (b, s, H, d), None)``.

State lives in one place: the model's :class:`SequenceParallelContext`, held by the function
registered under the model's key (the model itself keeps only the key string in its config, plus
instance overrides of ``loss_function`` and, in FPDT mode, ``forward``). :func:`disable_sequence_parallel`
restores the model and unregisters the key.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_longctx.attention.fpdt import fpdt_attention
from lightning_longctx.attention.ulysses import ulysses_attention
from lightning_longctx.comm import Group
from lightning_longctx.loss import sequence_parallel_cross_entropy
from lightning_longctx.sharding import IGNORE_INDEX

MODES = ("ulysses", "fpdt")
_UNSET = object()


@dataclass(eq=False)
class SequenceParallelContext:
    """Settings of one patched model, what :func:`disable_sequence_parallel` restores, and the counters
    the strategy's guardrails read.

    ``chunk_size`` is the configured FPDT chunk (tokens per rank); a call whose local sequence is
    shorter uses one chunk of its length (``shard_batch`` pads to ``P * min(chunk_size, N/P)``).

    A deep copy of a patched model shares its context (same group, same settings); pickling one is
    refused, since the process group cannot travel: unpatch it first.
    """

    group: Group
    mode: str
    chunk_size: int | None
    offload: bool
    backend: str
    loss_chunk_size: int | None
    key: str = ""
    num_attention_layers: int = 0
    attention_calls: int = 0
    restore: dict[str, Any] = field(default_factory=dict)  # the model's settings before patching

    def __deepcopy__(self, memo: dict[int, Any]) -> SequenceParallelContext:
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            "a sequence-parallel model holds its process group and cannot be pickled; call "
            "lightning_longctx.disable_sequence_parallel(model) first (state_dict() always works)"
        )


class _SequenceParallelAttention:
    """The function registered under a patched model's key; it carries the model's context."""

    def __init__(self, context: SequenceParallelContext) -> None:
        self.context = context

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return _hf_attention(self.context, module, *args, **kwargs)


def _registered(key: str | None) -> Any:
    from transformers import AttentionInterface

    return AttentionInterface().get(key) if key else None  # a fresh instance reads the global mapping


def _unregister(key: str) -> None:
    from transformers import AttentionInterface

    # transformers has register() but no public way to remove a key; this is the one place we touch it.
    AttentionInterface._global_mapping.pop(key, None)


def context_of(model: nn.Module) -> SequenceParallelContext | None:
    """The context of a model patched by :func:`enable_sequence_parallel`, else ``None``."""
    fn = _registered(getattr(getattr(model, "config", None), "_attn_implementation", None))
    return fn.context if isinstance(fn, _SequenceParallelAttention) else None


def _unsupported(kwargs: dict[str, Any], model_name: str) -> None:
    if kwargs.get("s_aux") is not None:
        raise ValueError(
            f"{model_name} uses attention sinks (s_aux), which sequence-parallel attention does not implement; "
            "train it without sequence parallelism"
        )


def _hf_attention(
    ctx: SequenceParallelContext,
    module: nn.Module,
    query: torch.Tensor,
    key_states: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    name = type(module).__name__
    _unsupported(kwargs, name)
    if dropout:
        raise ValueError(
            f"{name} asks for attention dropout {dropout}; sequence-parallel attention has none. "
            "Set config.attention_dropout=0.0"
        )
    if attention_mask is not None and attention_mask.dim() == 4:
        raise ValueError(
            "a 4-D attention mask reached sequence-parallel attention; pass packed documents as position_ids "
            "that restart at 0 instead"
        )
    if position_ids is not None and position_ids.dim() == 1:
        position_ids = position_ids[None].expand(query.shape[0], -1)
    q, k, v = (x.transpose(1, 2) for x in (query, key_states, value))  # (b, s, h, d)
    causal = getattr(module, "is_causal", True)
    common = dict(
        group=ctx.group, causal=causal, softmax_scale=scaling, position_ids=position_ids, backend=ctx.backend
    )
    if ctx.mode == "ulysses":
        out = ulysses_attention(q, k, v, sliding_window=sliding_window, softcap=softcap, **common)
    else:
        if softcap:
            raise ValueError(
                f"{name} uses attention logit softcapping ({softcap}), which FPDT does not implement; "
                "use the 'ulysses' strategy (fpdt_chunk_size=None) for this model"
            )
        chunk = min(ctx.chunk_size, q.shape[1])  # short sequences: one chunk of their local length
        out = fpdt_attention(
            q, k, v, chunk_size=chunk, offload=ctx.offload, sliding_window=sliding_window, **common
        )
    ctx.attention_calls += 1
    return out, None


def _hf_loss(
    ctx: SequenceParallelContext,
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    if shift_labels is None:
        raise ValueError(
            "a sequence-parallel model got `labels` without `shift_labels`: the batch was not sharded with "
            "shard_batch (labels must be shifted BEFORE the sequence is cut, or targets at shard edges are lost). "
            "Use the UlyssesFPDTStrategy, or call lightning_longctx.shard_batch on the batch"
        )
    return sequence_parallel_cross_entropy(logits, shift_labels, group=ctx.group, ignore_index=ignore_index)


def _chunked_loss_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """CausalLM forward whose loss never materialises the ``(b, s/P, vocab)`` logits (FPDT mode)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from lightning_longctx.chunked_loss import chunked_lm_head_cross_entropy

    ctx = context_of(self)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    if labels is None or ctx is None:
        return type(self).forward(self, *args, labels=labels, shift_labels=shift_labels, **kwargs)
    if shift_labels is None:
        _hf_loss(ctx, None, labels)  # raises the "not sharded" error
    kwargs["use_cache"] = False
    kwargs.pop("logits_to_keep", None)
    outputs = self.get_decoder()(*args, **kwargs)
    head = self.get_output_embeddings()
    loss = chunked_lm_head_cross_entropy(
        outputs.last_hidden_state,
        head.weight,
        shift_labels,
        bias=head.bias,
        group=ctx.group,
        chunk_size=ctx.loss_chunk_size,
        softcap=getattr(self.config, "final_logit_softcapping", None),
    )
    return CausalLMOutputWithPast(
        loss=loss, logits=None, hidden_states=outputs.hidden_states, attentions=None
    )


def _decoder_mlps(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if name.endswith(".mlp")}


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant checkpointing of the decoder layers (the method was renamed in transformers 5.x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def enable_sequence_parallel(
    model: nn.Module,
    *,
    group: Group = None,
    mode: str = "ulysses",
    chunk_size: int | None = None,
    offload: bool = False,
    backend: str = "auto",
    mlp_chunk_size: int | None = None,
    loss_chunk_size: int | None = None,
) -> nn.Module:
    """Make a Hugging Face model sequence-parallel over ``group``, in place; returns the model.

    ``mode="ulysses"``: Ulysses attention. ``mode="fpdt"``: FPDT attention with ``chunk_size`` tokens
    per chunk per rank, plus the MLPs tiled along the sequence (``mlp_chunk_size``, default
    ``chunk_size``) and a chunked lm_head + loss (``loss_chunk_size``, default ``chunk_size``).
    Batches must come from ``shard_batch`` (the strategy does this) with the matching layout.
    :func:`disable_sequence_parallel` undoes it.
    """
    from transformers import AttentionInterface, PreTrainedModel

    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}")
    if mode == "fpdt" and not chunk_size:
        raise ValueError("mode='fpdt' needs chunk_size (tokens per chunk per rank), e.g. chunk_size=4096")
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"enable_sequence_parallel expects a transformers PreTrainedModel, got {type(model).__name__}. "
            "Plain PyTorch models call lightning_longctx.ulysses_attention / fpdt_attention themselves"
        )
    name = type(model).__name__
    if context_of(model) is not None:
        raise ValueError(
            f"this {name} is already sequence-parallel; call disable_sequence_parallel(model) before patching "
            "it again"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{name} does not route attention through transformers' AttentionInterface (models such as Falcon, "
            "Bloom, MPT, GPT-Neo compute attention inline), so its attention cannot be swapped. "
            "Use a model that supports attn_implementation='sdpa'/'flex_attention' (Llama, Qwen2/3, Mistral, ...)"
        )
    if getattr(model.config, "logit_scale", None) not in (None, 1.0) and mode == "fpdt":
        raise ValueError(
            f"{name} scales its logits (config.logit_scale); the chunked FPDT loss does not; use mode='ulysses'"
        )
    ctx = SequenceParallelContext(
        group=group,
        mode=mode,
        chunk_size=chunk_size,
        offload=offload,
        backend=backend,
        loss_chunk_size=loss_chunk_size or chunk_size,
        num_attention_layers=int(getattr(model.config, "num_hidden_layers", 0)),
    )
    saved = ctx.restore
    saved["attn_implementation"] = model.config._attn_implementation
    saved["use_cache"] = model.config.use_cache
    saved["loss_function"] = model.__dict__.get("_loss_function", _UNSET)
    saved["forward"] = model.__dict__.get("forward", _UNSET)
    ctx.key = f"longctx_{mode}_{id(ctx):x}"  # unique among live keys: the registry keeps ctx alive
    AttentionInterface.register(ctx.key, _SequenceParallelAttention(ctx))
    model.set_attn_implementation(ctx.key)
    if model.config._attn_implementation != ctx.key:
        _unregister(ctx.key)
        raise RuntimeError(
            f"{name} ignored set_attn_implementation({ctx.key!r}); its attention cannot be swapped"
        )
    model.config.use_cache = False
    model.loss_function = functools.partial(_hf_loss, ctx)
    if mode == "fpdt":
        from lightning_longctx.tiling import is_tiled, tile_mlp_

        mlps = {name: m for name, m in _decoder_mlps(model).items() if not is_tiled(m)}
        for mlp in mlps.values():
            tile_mlp_(mlp, mlp_chunk_size or chunk_size)
        saved["tiled_mlps"] = list(mlps)
        if model.get_output_embeddings() is not None:
            model.forward = types.MethodType(_chunked_loss_forward, model)
    return model


def disable_sequence_parallel(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_sequence_parallel`: the model's attention, cache setting, loss, forward and
    MLPs are as before, and its attention key is unregistered. Returns the model; a model that is not
    sequence-parallel is returned unchanged."""
    from lightning_longctx.tiling import untile_mlp_

    ctx = context_of(model)
    if ctx is None:
        return model
    saved = ctx.restore
    model.set_attn_implementation(saved["attn_implementation"])
    model.config.use_cache = saved["use_cache"]
    for attr, name in (("_loss_function", "loss_function"), ("forward", "forward")):
        if saved[name] is _UNSET:
            model.__dict__.pop(attr, None)
        else:
            model.__dict__[attr] = saved[name]
    mlps = _decoder_mlps(model)
    for name in saved.get("tiled_mlps", ()):
        untile_mlp_(mlps[name])
    _unregister(ctx.key)
    return model
