"""Swap attention (and, in FPDT mode, the MLP, the norms and the loss) of a Hugging Face model in place.

Mechanism: transformers' ``AttentionInterface``. We register one attention function per patched
model under a fresh key and point the model's config at it. The function receives q ``(b, H, s, d)``
and k/v ``(b, H_kv, s, d)`` already rotated with the GLOBAL ``position_ids`` that ``shard_batch``
produced and returns ``(out (b, s, H, d), None)``. It settles what the model asks for (mask, window, documents,
soft-cap, sinks) and hands q, k, v to the context's ``attend``: the attention of the configured sequence layout
(Ulysses, FPDT, Ulysses x ring, FPDT x ring), chosen once when the model is patched (``attention/dispatch.py``).

Masks. Some models say what they attend to only through the mask they build (a sliding window chosen
from ``config.sliding_window``, Llama-4's chunked attention, a ``config.layer_types`` mix), so the key
also gets its own mask function (``AttentionMaskInterface``). transformers calls it from
``create_causal_mask`` / ``create_sliding_window_causal_mask`` / ``create_chunked_causal_mask`` (one
call per layer type) with the model's ``mask_function``; we probe that function on global indices and
return a :class:`MaskPattern` — causal, sliding window W, chunks of C, or bidirectional: a few numbers,
never an O(s²) mask — which transformers hands to our attention function as ``attention_mask``.
Anything else is refused with an error, never dropped.

State lives in one place: the model's ``SequenceParallelContext`` (``context.py``), held by the functions
registered under the model's key (the model itself keeps only the key string in its config, two
forward hooks, plus instance overrides of ``loss_function``, in FPDT mode ``forward``, and the ``forward`` of a
rotary embedding whose frequencies depend on the sequence length, which reads the batch's GLOBAL length:
``rope.py``).
:func:`disable_sequence_parallel` restores the model and unregisters the key.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_longctx.attention.dispatch import AttentionSetup, choose_attention
from lightning_longctx.config import MODES, Mode, ResolvedConfig, SequenceParallelConfig
from lightning_longctx.integrations.context import SequenceParallelContext
from lightning_longctx.integrations.hf_symbols import check_symbols
from lightning_longctx.integrations.hybrid import find_mixers, patch_mixers, unpatch_mixers
from lightning_longctx.integrations.hybrid.base import halo_error, mixer_halo
from lightning_longctx.integrations.lm_head import read_chunked_head
from lightning_longctx.integrations.masks import (
    PositionsHook,
    SequenceParallelMask,
    check_layer_types,
    chunk_positions,
    llama4_query_temperature,
    pattern_of,
    resolve_sliding_window,
)
from lightning_longctx.integrations.moe import moe_aux_loss_plan
from lightning_longctx.integrations.rope import patch_rotary, rope_limit, unpatch_rotary
from lightning_longctx.ops.loss import sequence_parallel_cross_entropy
from lightning_longctx.parallel.comm import Group, group_rank_size
from lightning_longctx.parallel.sharding import IGNORE_INDEX
from lightning_longctx.parallel.tensor_parallel import local_head

_UNSET = object()


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
    from transformers.masking_utils import AttentionMaskInterface

    # transformers has register() but no public way to remove a key; this is the one place we touch it.
    AttentionInterface._global_mapping.pop(key, None)
    AttentionMaskInterface._global_mapping.pop(key, None)


def context_of(model: nn.Module) -> SequenceParallelContext | None:
    """The context of a model patched by :func:`enable_sequence_parallel`, else ``None``."""
    fn = _registered(getattr(getattr(model, "config", None), "_attn_implementation", None))
    return fn.context if isinstance(fn, _SequenceParallelAttention) else None


def _hf_attention(
    ctx: SequenceParallelContext,
    module: nn.Module,
    query: torch.Tensor,
    key_states: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    name = type(module).__name__
    if dropout:
        raise ValueError(
            f"{name} asks for attention dropout {dropout}; sequence-parallel attention has none. "
            "Set config.attention_dropout=0.0"
        )
    pattern = pattern_of(attention_mask, name)
    if position_ids is None and pattern is not None:  # models that keep them from attention (Llama-4)
        position_ids = pattern.position_ids
    q, k, v = (x.transpose(1, 2) for x in (query, key_states, value))  # (b, s, h, d)
    known, documents = ctx.documents_for(position_ids)  # the batch's, computed once per batch
    if position_ids is not None:
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        position_ids = position_ids.expand(q.shape[0], -1)
    q = llama4_query_temperature(ctx, module, q)
    causal = pattern.causal if pattern is not None else getattr(module, "is_causal", True)
    sliding_window = resolve_sliding_window(sliding_window, pattern, name)
    if pattern is not None and pattern.chunk is not None:
        position_ids = chunk_positions(ctx, position_ids, pattern.chunk, q)
        if known:
            documents = ctx.positions.documents(pattern.chunk)
    if documents is not None and documents.shape[0] != q.shape[0]:  # 1-D / one-row positions, as HF allows
        documents = documents.expand(q.shape[0], -1)
    # gpt-oss passes its sinks as s_aux (num_heads,): whole, each rank takes its own heads' slice
    out = ctx.attend(
        q, k, v, causal=causal, scale=scaling, documents=documents,
        position_ids=None if known else position_ids,  # known: the documents are the batch's, nothing to gather
        sliding_window=sliding_window, softcap=softcap or None, sinks=kwargs.get("s_aux"),
    )  # fmt: skip
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
    return sequence_parallel_cross_entropy(
        logits, shift_labels, group=ctx.group, ignore_index=ignore_index, observer=ctx.loss_observer
    )


def _aux_loss_on(ctx: SequenceParallelContext, model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether this call adds the model's MoE load-balancing loss (raises for a formula we cannot compute)."""
    plan = ctx.moe_plan
    return plan is not None and plan.active(model.config, kwargs.get("output_router_logits"))


def _with_aux_loss(
    ctx: SequenceParallelContext, loss: torch.Tensor, router_logits: Any, kwargs: dict[str, Any]
):
    """``loss + coef * aux`` with the aux loss over the whole SP group (``integrations/moe.py``); a collective."""
    aux = ctx.moe_plan.aux_loss(router_logits, attention_mask=kwargs.get("attention_mask"), group=ctx.group)
    return loss + ctx.moe_plan.coef * aux, aux


def _aux_loss_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Ulysses mode, MoE models: the model's own forward, with its per-shard load-balancing loss replaced by
    the exact one over the SP group (the model adds none when called without labels)."""
    ctx = context_of(self)
    if ctx is None or kwargs.get("labels") is None or not _aux_loss_on(ctx, self, kwargs):
        return type(self).forward(self, *args, **kwargs)
    labels, shift_labels = kwargs.pop("labels"), kwargs.pop("shift_labels", None)
    if shift_labels is None:
        _hf_loss(ctx, None, labels)  # raises the "not sharded" error
    kwargs["output_router_logits"] = True
    out = type(self).forward(self, *args, labels=None, **kwargs)
    ce = sequence_parallel_cross_entropy(
        out.logits, shift_labels, group=ctx.group, observer=ctx.loss_observer
    )
    loss, aux = _with_aux_loss(ctx, ce, out.router_logits, kwargs)
    return type(out)(**{**out, "loss": loss, "aux_loss": aux})  # rebuilt: `loss` first in to_tuple()


def _chunked_loss_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """CausalLM forward whose loss never materialises the ``(b, s/P, vocab)`` logits (FPDT mode)."""
    from lightning_longctx.ops.chunked_loss import chunked_lm_head_cross_entropy

    ctx = context_of(self)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    if labels is None or ctx is None or ctx.lm_head is None:
        return type(self).forward(self, *args, labels=labels, shift_labels=shift_labels, **kwargs)
    if shift_labels is None:
        _hf_loss(ctx, None, labels)  # raises the "not sharded" error
    head = ctx.lm_head
    kwargs["use_cache"] = False
    kwargs.pop("logits_to_keep", None)
    aux_on = _aux_loss_on(ctx, self, kwargs)
    if aux_on:
        kwargs["output_router_logits"] = True
    outputs = functools.reduce(getattr, head.decoder.split("."), self)(*args, **kwargs)
    hidden = getattr(outputs, "last_hidden_state", None)
    hidden = outputs[0] if hidden is None else hidden
    weight, bias, vocab_group = local_head(self.get_output_embeddings())  # rows over tp when split
    loss = chunked_lm_head_cross_entropy(
        hidden,
        weight,
        shift_labels,
        bias=bias,
        group=ctx.group,
        vocab_group=vocab_group,
        chunk_size=ctx.config.settings.loss_chunk_size,
        logit_scale=head.logit_scale,
        softcap=head.softcap,
        observer=ctx.loss_observer,
    )
    aux_loss = None
    if aux_on:
        loss, aux_loss = _with_aux_loss(ctx, loss, outputs.router_logits, kwargs)
    values = dict(
        loss=loss,
        aux_loss=aux_loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        router_logits=getattr(outputs, "router_logits", None),
    )
    names = {f.name for f in dataclasses.fields(head.output_cls)}
    return head.output_cls(**{k: v for k, v in values.items() if k in names})


def _decoder_mlps(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder layers' MLPs (``*.mlp``), never a module inside a mixture of experts (DBRX's
    ``ffn.experts.mlp`` is the experts' weights, not a position-wise block)."""
    return {
        name: m
        for name, m in model.named_modules()
        if name.endswith(".mlp") and "experts" not in name.split(".")[:-1]
    }


def _position_wise_norms(model: nn.Module) -> dict[str, nn.Module]:
    """The model's norms over the last dimension that take one tensor (every decoder layer's RMSNorm /
    LayerNorm, q/k norms, the final norm): row-wise, so FPDT tiles them as it tiles the MLP. Tiled, a norm
    keeps only its input for backward, not its fp32 copies (Hugging Face's RMSNorm keeps the fp32 input and
    the normalised copy: 6 bytes per element in bf16, 2 when tiled). A norm that takes more (a gate), has
    submodules or normalises over more than one dimension is left as it is."""
    norms = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) != 1:
            continue
        if not isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and not type(m).__name__.endswith(
            ("RMSNorm", "LayerNorm")
        ):
            continue
        args = list(inspect.signature(type(m).forward).parameters.values())[1:]
        one_tensor = len(args) == 1 and args[0].kind in (
            args[0].POSITIONAL_ONLY,
            args[0].POSITIONAL_OR_KEYWORD,
        )
        if hasattr(m, "num_heads"):  # a per-head norm reshapes (xLSTM's: (b, s, h, d) -> (b, s, h*d))
            continue
        if one_tensor and next(m.children(), None) is None and "experts" not in name.split("."):
            norms[name] = m
    return norms


def _routes_tokens(mlp: nn.Module, model: nn.Module) -> bool:
    """Whether ``mlp`` holds a router whose logits the model records (``output_router_logits``): tiling
    it would record them without autograd. The router class is the one transformers records
    (``_can_record_outputs["router_logits"]``); a module with ``experts`` counts too."""
    # transformers 5.x defaults `_can_record_outputs` to None on a model without recorded outputs
    recorder = (getattr(model.get_decoder(), "_can_record_outputs", None) or {}).get("router_logits")
    router = getattr(recorder, "target_class", recorder)
    return hasattr(mlp, "experts") or (
        isinstance(router, type) and any(isinstance(m, router) for m in mlp.modules())
    )


def _input_grads_hooked(model: nn.Module) -> bool:
    """Whether transformers' ``enable_input_require_grads`` hook is on (its attribute was renamed in 5.x)."""
    return bool(getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None))


def enable_activation_checkpointing(model: nn.Module, *, offload: bool = False) -> Callable[[], None]:
    """Non-reentrant checkpointing of the decoder layers (the method was renamed in transformers 5.x).

    ``offload=True``: each layer's checkpointed input waits in pinned host memory until its recompute
    and is prefetched back on a side stream (:class:`~lightning_longctx.ops.activation_offload.OffloadedCheckpoint`).
    Returns a function that puts the model's checkpointing back as it was (flags, checkpoint functions,
    the input-embedding hook transformers adds); the strategy calls it at teardown.
    """
    before = [
        (m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func", _UNSET))
        for m in model.modules()
        if hasattr(m, "gradient_checkpointing")
    ]
    hooked = _input_grads_hooked(model)

    def restore() -> None:
        for module, flag, fn in before:
            module.gradient_checkpointing = flag
            if fn is _UNSET:
                module.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                module._gradient_checkpointing_func = fn
        if not hooked and _input_grads_hooked(model):
            model.disable_input_require_grads()

    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if offload:
        from lightning_longctx.ops.activation_offload import OffloadedCheckpoint

        # transformers' own convention (its _set_gradient_checkpointing): every module with the flag on calls
        # its `_gradient_checkpointing_func`; one instance for the model links the layers for the prefetch
        checkpoint_fn = OffloadedCheckpoint()
        for module in model.modules():
            if getattr(module, "gradient_checkpointing", False):
                module._gradient_checkpointing_func = checkpoint_fn
    return restore


def enable_sequence_parallel(
    model: nn.Module,
    *,
    group: Group = None,
    mode: str | Mode = "ulysses",
    chunk_size: int | None = None,
    offload: bool = False,
    backend: str = "auto",
    mlp_chunk_size: int | None = None,
    loss_chunk_size: int | None = None,
    config: ResolvedConfig | None = None,
    ring_groups: tuple[Group, Group] | None = None,
) -> nn.Module:
    """Make a Hugging Face model sequence-parallel over ``group``, in place; returns the model.

    ``mode="ulysses"``: Ulysses attention. ``mode="fpdt"``: FPDT attention with ``chunk_size`` tokens
    per chunk per rank, plus the MLPs and the norms tiled along the sequence (``mlp_chunk_size``, default
    ``chunk_size``; a tiled module keeps only its input for backward and recomputes the rest) and a chunked lm_head + loss (``loss_chunk_size``, default: 128 MiB fp32 logits blocks,
    ``chunked_loss.default_loss_chunk_size`` of the vocabulary). ``offload``: FPDT's chunks in host memory.
    Or ``config``: a :class:`~lightning_longctx.config.ResolvedConfig` (what the strategy passes) in place
    of those keywords, which are its thin wrapper. With ``config.dims.ring > 1`` (``ring_size``),
    ``ring_groups`` = ``(ring_group, ulysses_group)`` of the world mesh (``mesh.build_world_mesh``) and
    ``group`` its whole sp group: Ulysses x ring attention, batches sharded with ``shard_batch(..., ring=r)``.
    Batches must come from ``shard_batch`` (the strategy does this) with the matching layout.
    Every layer's mask (causal, sliding window, chunked; see :class:`MaskPattern`) and, in FPDT mode,
    the model's logit scale and soft-cap are honoured; anything else is refused here or at the first call.
    :func:`disable_sequence_parallel` undoes it.
    """
    if config is None:
        config = _config_of(group, mode, chunk_size, offload, backend, mlp_chunk_size, loss_chunk_size)
    mixers, attention_layers = _check_patchable(model, config, ring_groups)
    ctx = _new_context(model, group, config, ring_groups, mixers, attention_layers)
    _register(model, ctx)
    _patch_model(model, ctx, mixers)
    return model


def _check_patchable(
    model: nn.Module, config: ResolvedConfig, ring_groups: tuple[Group, Group] | None
) -> tuple[list[nn.Module], int]:
    """Every refusal :func:`enable_sequence_parallel` makes before it changes anything; returns the model's
    hybrid mixers and its number of attention layers."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"enable_sequence_parallel expects a transformers PreTrainedModel, got {type(model).__name__}. "
            "Plain PyTorch models call lightning_longctx.ulysses_attention / fpdt_attention themselves"
        )
    check_symbols(model)  # every transformers symbol we patch, rebind, read or call: present and as expected
    name = type(model).__name__
    if context_of(model) is not None:
        raise ValueError(
            f"this {name} is already sequence-parallel; call disable_sequence_parallel(model) before patching "
            "it again"
        )
    mixers = find_mixers(model)  # hybrid models: convolutions, linear attention, state-space scans
    ring = config.dims.ring
    if ring > 1 and (ring_groups is None or len(ring_groups) != 2):
        raise ValueError(
            f"ring_size={ring} needs ring_groups=(ring_group, ulysses_group), the world mesh's "
            "(mesh.build_world_mesh(ParallelDims(..., ring=r)).ring_group / .ulysses_group)"
        )
    attention_layers = check_layer_types(model, name, len(mixers))
    # transformers marks hybrids as not supporting attention backends for their mixers' sake; their
    # attention layers route through the interface (the strategy's first step counts them).
    if not getattr(model, "_supports_attention_backend", False) and not mixers:
        raise ValueError(
            f"{name} does not route attention through transformers' AttentionInterface (it computes attention "
            "inline, as Falcon, Bloom, MPT, GPT-Neo do) and has no token mixer with a sequence-parallel adapter "
            "(integrations/hybrid), so its token mixing cannot be made sequence-parallel. "
            "Use a model that supports attn_implementation='sdpa'/'flex_attention' (Llama, Qwen2/3, Mistral, ...)"
        )
    halo = mixer_halo(mixers)
    chunk = config.settings.fpdt_chunk_size if config.mode is Mode.FPDT else None
    if chunk is not None and chunk < halo:  # every FPDT chunk is a segment that needs its halo
        raise halo_error(name, halo, chunk)
    return mixers, attention_layers


def _new_context(
    model: nn.Module,
    group: Group,
    config: ResolvedConfig,
    ring_groups: tuple[Group, Group] | None,
    mixers: list[nn.Module],
    attention_layers: int,
) -> SequenceParallelContext:
    """The model's context: what it reads at patch time (its MoE loss, its chunked head), and its attention,
    chosen once for the configuration's sequence layout (``attention/dispatch.py``)."""
    name = type(model).__name__
    moe_plan = moe_aux_loss_plan(model)  # refuses an in-forward loss term it cannot compute over the group
    lm_head = None
    if config.mode is Mode.FPDT and model.get_output_embeddings() is not None:
        lm_head = read_chunked_head(model, name)  # refuses a logits transform it cannot reproduce
    ring_group, ulysses_group = ring_groups if config.dims.ring > 1 and ring_groups else (None, None)
    setup = AttentionSetup(
        layout=config.sequence_layout, group=group, ring_group=ring_group, ulysses_group=ulysses_group,
        backend=config.settings.attention_backend, offload=config.offload, overlap=config.settings.fpdt_overlap,
    )  # fmt: skip
    return SequenceParallelContext(
        group=group,
        config=config,
        model_name=name,
        num_attention_layers=attention_layers,
        num_mixers=len(mixers),
        mixer_halo=mixer_halo(mixers),
        lm_head=lm_head,
        moe_plan=moe_plan,
        rope_limit=rope_limit(model.config),
        ring_group=ring_group,
        ulysses_group=ulysses_group,
        attend=choose_attention(setup),
    )


def _register(model: nn.Module, ctx: SequenceParallelContext) -> None:
    """Register the model's attention and mask functions under a fresh key and point its config at it (its
    settings before that in ``ctx.restore``); the hub kernels off, length-dependent RoPE patched, the positions
    hooks on."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name, saved = ctx.model_name, ctx.restore
    saved["kernels_mode"] = _turn_off_hub_kernels(model)  # before any forward of ours is installed
    # length-dependent RoPE (dynamic NTK, longrope) reads the GLOBAL length; refused when it cannot (rope.py)
    saved["rotary"] = patch_rotary(model, ctx, name)
    saved["attn_implementation"] = model.config._attn_implementation
    saved["use_cache"] = model.config.use_cache
    saved["loss_function"] = model.__dict__.get("_loss_function", _UNSET)
    saved["forward"] = model.__dict__.get("forward", _UNSET)
    ctx.key = f"longctx_{ctx.config.mode}_{id(ctx):x}"  # unique among live keys: the registry keeps ctx alive
    AttentionInterface.register(ctx.key, _SequenceParallelAttention(ctx))
    AttentionMaskInterface.register(ctx.key, SequenceParallelMask(ctx))
    _set_attention(model, ctx, ctx.key)  # RWKV, xLSTM (attention-free): the key only names ctx
    if model.config._attn_implementation != ctx.key:
        _unregister(ctx.key)
        unpatch_rotary(saved["rotary"])
        raise RuntimeError(
            f"{name} ignored set_attn_implementation({ctx.key!r}); its attention cannot be swapped"
        )
    params = list(inspect.signature(type(model).forward).parameters)[1:]  # without self
    hook = PositionsHook(ctx, params.index("position_ids") if "position_ids" in params else None)
    saved["hooks"] = [
        model.register_forward_pre_hook(hook.before, with_kwargs=True),
        model.register_forward_hook(hook.after, with_kwargs=True, always_call=True),
    ]


def _patch_model(model: nn.Module, ctx: SequenceParallelContext, mixers: list[nn.Module]) -> None:
    """The model's loss, hybrid mixers and, in FPDT mode, its tiled MLPs and norms and chunked lm_head + loss
    (an MoE model's exact load-balancing loss under Ulysses): what it runs besides attention."""
    saved = ctx.restore
    model.config.use_cache = False
    model.loss_function = functools.partial(_hf_loss, ctx)
    saved["mixers"] = patch_mixers(model, ctx, mixers)
    if ctx.config.mode is Mode.FPDT:
        _tile_fpdt(model, ctx)
        if ctx.lm_head is not None:
            model.forward = types.MethodType(_chunked_loss_forward, model)
    elif ctx.moe_plan is not None:
        model.forward = types.MethodType(_aux_loss_forward, model)


def _tile_fpdt(model: nn.Module, ctx: SequenceParallelContext) -> None:
    """FPDT mode: tile the decoder layers' MLPs and the position-wise norms along the sequence."""
    from lightning_longctx.ops.tiling import is_tiled, tile_mlp_

    # MoE blocks stay untiled when the model has a load-balancing loss: the tiled forward runs without
    # autograd, so the router logits it records would carry no gradient.
    mlps = {
        name: m
        for name, m in _decoder_mlps(model).items()
        if not is_tiled(m) and not (ctx.moe_plan is not None and _routes_tokens(m, model))
    }
    norms = {name: m for name, m in _position_wise_norms(model).items() if not is_tiled(m)}
    settings = ctx.config.settings
    for module in (*mlps.values(), *norms.values()):
        tile_mlp_(module, settings.mlp_chunk_size or settings.fpdt_chunk_size)
    ctx.restore["tiled_mlps"], ctx.restore["tiled_norms"] = list(mlps), list(norms)


def _config_of(
    group: Group,
    mode: str | Mode,
    chunk_size: int | None,
    offload: bool,
    backend: str,
    mlp_chunk_size: int | None,
    loss_chunk_size: int | None,
) -> ResolvedConfig:
    """The resolved configuration of :func:`enable_sequence_parallel`'s keyword form: the group is the
    sequence-parallel group (no data parallelism of its own)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}")
    mode = Mode(mode)
    if mode is Mode.FPDT and not chunk_size:
        raise ValueError("mode='fpdt' needs chunk_size (tokens per chunk per rank), e.g. chunk_size=4096")
    settings = SequenceParallelConfig(
        fpdt_chunk_size=chunk_size if mode is Mode.FPDT else None,
        offload=bool(offload) and mode is Mode.FPDT,  # Ulysses keeps nothing to offload
        attention_backend=backend,
        mlp_chunk_size=mlp_chunk_size,
        loss_chunk_size=loss_chunk_size,
    )
    _, world = group_rank_size(group)
    return settings.resolve(world_size=world, devices_per_node=0, device_type="cpu")


def _turn_off_hub_kernels(model: nn.Module) -> Any:
    """Turn off the model's hub kernels; returns the mode they were on in (``None``: they were off).

    From transformers 5.25 (which depends on the ``kernels`` package) ``from_pretrained`` kernelizes the model
    by default and kernelizes it again at every ``train()`` / ``eval()`` switch: every module whose class is
    decorated ``use_kernel_forward_from_hub`` (the norms, gated DeltaNet, ...) gets its instance ``forward``
    replaced by a hub kernel or deleted. That erases the forwards installed here (tiled MLPs and norms, hybrid
    mixers), and a mixer back on its own forward mixes only this rank's shard. So the model runs without them
    (``use_kernels=False``); :func:`disable_sequence_parallel` turns them back on."""
    for module in model.modules():
        mode = getattr(module, "kernels_mode", None)
        if getattr(module, "use_kernels", False) and hasattr(module, "reset_kernels"):
            module.reset_kernels()  # each kernelized module's forward back to the class's
            return mode if mode is not None else True
    return None


def _set_attention(model: nn.Module, ctx: SequenceParallelContext, key: str) -> None:
    if ctx.attention_free:  # no interface to set: the key only names the context
        model.config._attn_implementation = key
    else:
        model.set_attn_implementation(key)


@contextmanager
def sequence_parallel_off(model: nn.Module) -> Iterator[SequenceParallelContext]:
    """Inside: the patched ``model`` computes as the model did before :func:`enable_sequence_parallel`, on a
    whole (unsharded) sequence, with no sequence-parallel collective: transformers' own attention and masks
    (the implementation it had), loss, forward, rotary embeddings, hybrid mixers and untiled MLPs and norms
    (an MLP may mix tokens: a token shift). What stays: the activation checkpointing, tensor-parallel and FSDP2
    wrapping around it. On exit every patched piece is back, the very objects, under the same key. The self-test (``self_test.py``) runs its reference inside. Yields the
    model's context; every rank need not enter it together (it runs no collective)."""
    from lightning_longctx.ops.tiling import TILED_ATTRS, untile_mlp_

    ctx = context_of(model)
    if ctx is None:
        raise ValueError(f"{type(model).__name__} is not sequence-parallel: nothing to turn off")
    saved = ctx.restore
    patched = [(m.module, attr) for m in saved.get("mixers", ()) for attr in m.methods] + [
        (module, "forward") for module, _ in saved.get("rotary", ())
    ]
    patched += [(model, "_loss_function"), (model, "forward")]
    modules = dict(model.named_modules())
    tiled = [modules[name] for name in (*saved.get("tiled_mlps", ()), *saved.get("tiled_norms", ()))]
    patched += [(module, attr) for module in tiled for attr in TILED_ATTRS]
    snapshot = [(obj, attr, obj.__dict__.get(attr, _UNSET)) for obj, attr in patched]
    _restore_instance(model, saved)
    for module in tiled:
        untile_mlp_(module)
    unpatch_mixers(saved.get("mixers", ()))
    unpatch_rotary(saved.get("rotary", ()))
    ctx.off = True  # the positions hooks stand aside (they would gather over the group)
    _set_attention(model, ctx, saved["attn_implementation"])
    try:
        yield ctx
    finally:
        ctx.off = False
        for obj, attr, value in snapshot:
            if value is _UNSET:
                obj.__dict__.pop(attr, None)
            else:
                obj.__dict__[attr] = value
        _set_attention(model, ctx, ctx.key)


def _restore_instance(model: nn.Module, saved: dict[str, Any]) -> None:
    """The model's own ``loss_function`` and ``forward`` instance attributes, as before the patch."""
    for attr, name in (("_loss_function", "loss_function"), ("forward", "forward")):
        if saved[name] is _UNSET:
            model.__dict__.pop(attr, None)
        else:
            model.__dict__[attr] = saved[name]


def disable_sequence_parallel(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_sequence_parallel`: the model's attention, cache setting, loss, forward and
    MLPs are as before, its hooks are removed and its attention and mask key are unregistered. Returns
    the model; a model that is not sequence-parallel is returned unchanged."""
    from lightning_longctx.ops.tiling import untile_mlp_

    ctx = context_of(model)
    if ctx is None:
        return model
    saved = ctx.restore
    _set_attention(model, ctx, saved["attn_implementation"])
    model.config.use_cache = saved["use_cache"]
    _restore_instance(model, saved)
    for handle in saved.get("hooks", ()):
        handle.remove()
    unpatch_mixers(saved.get("mixers", ()))
    unpatch_rotary(saved.get("rotary", ()))
    modules = dict(model.named_modules())
    for name in (*saved.get("tiled_mlps", ()), *saved.get("tiled_norms", ())):
        untile_mlp_(modules[name])
    _unregister(ctx.key)
    if saved.get("kernels_mode") is not None:  # the hub kernels it had before
        mode = saved["kernels_mode"]
        model.set_use_kernels(True, mode=None if mode is True else mode)
    return model
