"""``tensor_parallel_size``: a Hugging Face model's own tensor-parallel plan applied on the tp sub-mesh.

Hugging Face models declare their plan in ``config.base_model_tp_plan`` (module-name patterns relative to
the base model, e.g. ``"layers.*.self_attn.q_proj": "colwise"``, ``"layers.*.self_attn.q_norm":
"replicated_with_grad_allreduce"``); transformers' public ``apply_tensor_parallelism`` applies a plan of
concrete names on any 1-D mesh (its ``from_pretrained(device_mesh=...)`` builds its own mesh and ignores
ours). :func:`apply_tp_plan` expands the patterns to the base model's modules and their parameters and
applies it on the strategy's tp sub-mesh. The lm_head and the embedding stay replicated (the chunked loss
and the vocabulary need full rows; their gradients are equal on every TP rank).

After it, q/k/v hold ``heads / tp`` and ``kv_heads / tp`` heads per rank; the attention function receives
those TP-local heads and Ulysses / FPDT split them further over the sp group (each rank ``heads / (tp *
sp)``: the all-to-all volume per rank drops by ``tp``). o_proj / down_proj all-reduce their outputs over
the tp group, so the residual stream, the norms and the loss are replicated over it.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

#: the plan styles checked exact against one process (tests/test_tensor_parallel.py): Llama, Qwen2, Qwen3, Mistral
TESTED_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def tp_plan_of(model: nn.Module) -> dict[str, str]:
    """The model's plan with concrete names of its base model: each matched module and its own parameters."""
    plan = getattr(_text_config(model), "base_model_tp_plan", None) or {}
    base = model.base_model
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        for name, module in base.named_modules():
            if rx.match(name):
                out[name] = style
                out.update({f"{name}.{p}": style for p, _ in module.named_parameters(recurse=False)})
    return out


def check_tp(model: nn.Module, tp: int) -> dict[str, str]:
    """The model's concrete plan, or a ValueError naming what cannot be split ``tp`` ways. (Fewer TP-local heads
    than sequence-parallel ranks is fine: the ranks without a head still take part in every all-to-all.)"""
    name, cfg = type(model).__name__, _text_config(model)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    plan = tp_plan_of(model)
    if not plan:
        raise ValueError(
            f"tensor_parallel_size={tp}: {name} declares no tensor-parallel plan (config.base_model_tp_plan), so "
            "its layers cannot be split; use tensor_parallel_size=1 (sequence parallelism alone)"
        )
    untested = sorted({s for s in plan.values()} - set(TESTED_STYLES))
    if untested:
        raise ValueError(
            f"tensor_parallel_size={tp}: {name}'s plan uses {untested}, which this package has not checked for "
            f"exactness under sequence parallelism (checked: {list(TESTED_STYLES)}; mixture-of-experts plans are "
            "not yet); use tensor_parallel_size=1"
        )
    _styles()  # transformers new enough to apply it
    adapters = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "base_layer")})
    if adapters:
        raise ValueError(
            f"tensor_parallel_size={tp} with adapter layers ({adapters}, e.g. peft LoRA): the plan would split the "
            "adapter's wrapper, not its base linear; LoRA under tensor parallelism is not supported yet"
        )
    if heads is None or heads % tp or kv % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide {name}'s attention heads ({heads}) and key/value heads ({kv}): "
            f"each TP rank takes whole heads; pick a common divisor"
        )
    return plan


def _styles() -> dict[str, Any]:
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    except ImportError as err:  # transformers < 5
        raise ImportError(
            "tensor_parallel_size > 1 needs transformers >= 5 (transformers.distributed.tensor_parallel); "
            "pip install -U transformers"
        ) from err
    return ALL_PARALLEL_STYLES


def apply_tp_plan(model: nn.Module, tp_mesh: Any, *, tp: int) -> nn.Module:
    """Shard ``model`` (a ``PreTrainedModel``) by its own plan over ``tp_mesh`` (1-D, ``tp`` ranks), in place.
    Every rank must hold the same weights (each slices its own shard locally)."""
    plan = check_tp(model, tp)
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    apply_tensor_parallelism(model.base_model, tp_mesh, plan)
    return model


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on several meshes (TP-split weights are DTensors on the
    (dp x sp, tp) mesh, the replicated ones on its dp x sp axis; torch's version stacks them and fails): one
    total norm per mesh (a full tensor: DTensor reduces over the mesh), combined, then every gradient scaled.
    Returns the total norm."""
    import torch

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    groups: dict[Any, list[Any]] = {}  # the parameters by their gradient's mesh
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    norms = [n.to(norms[0].device) for n in norms]
    total = torch.stack(norms).max() if norm_type == float("inf") else torch.stack(norms).norm(norm_type)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
