"""``tensor_parallel_size``: a Hugging Face model's own tensor-parallel plan, on the mesh's tensor_parallel axis.

Hugging Face models declare their plan in ``config.base_model_tp_plan`` (module-name patterns relative to
the base model, e.g. ``"layers.*.self_attn.q_proj": "colwise"``, ``"layers.*.self_attn.q_norm":
"replicated_with_grad_allreduce"``); transformers' public ``apply_tensor_parallelism`` applies a plan of
concrete names on any 1-D mesh (its ``from_pretrained(device_mesh=...)`` builds its own mesh and ignores
ours). :func:`apply_tp_plan` expands the patterns to the base model's modules and their parameters and
applies it on the world mesh's ``tensor_parallel`` axis (mesh.py). The embedding stays replicated (its
gradients are equal on every TP rank). In FPDT mode an untied ``lm_head`` whose vocabulary divides by ``tp`` is split over the vocabulary
(:func:`vocab_parallel_head`: Hugging Face's ``colwise_gather_output``, so a call of the module itself still
returns full logits) and the chunked loss runs vocabulary parallel on this rank's rows (:func:`local_head`):
no rank ever holds a ``(chunk, vocab)`` block or the whole head. Under Ulysses, or tied to the embedding, the
lm_head stays replicated (the model's own logits are full).

After it, q/k/v hold ``heads / tp`` and ``kv_heads / tp`` heads per rank; the attention function receives
those TP-local heads and Ulysses / FPDT split them further over the sp group (each rank ``heads / (tp *
sp)``: the all-to-all volume per rank drops by ``tp``). o_proj / down_proj all-reduce their outputs over
the tp group, so the residual stream, the norms and the loss are replicated over it.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from lightning_longctx.parallel.comm import all_gather_no_grad, all_gather_object, group_rank_size
from lightning_longctx.parallel.mesh import TP_AXIS

#: the plan styles checked exact against one process: Llama, Qwen2, Qwen3, Mistral, Mixtral (experts, where its
#: plan splits them, up to transformers 5.24: the packed gate/up column-wise, down row-wise, their sum
#: all-reduced; from 5.25 the plan leaves them whole) in tests/test_tensor_parallel.py, and the 35 dense
#: models of the architecture sweep that declare a plan (benchmarks/tp_sweep.py: Phi-3's and OLMo-2's gathered
#: q/k/v, GPT-NeoX's row-split embedding, Granite-SWA's local sinks)
TESTED_STYLES = (
    "colwise",
    "rowwise",
    "replicated_with_grad_allreduce",
    "packed_colwise",
    "moe_tp_experts",
    "colwise_gather_output",
    "rowwise_split_input",
    "embedding_rowwise",
    "local_params",
)


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _entries(name: str, module: nn.Module, style: str) -> dict[str, str]:
    """A plan's entries for one module: its forward and its own parameters, all in ``style``."""
    return {name: style, **{f"{name}.{p}": style for p, _ in module.named_parameters(recurse=False)}}


def tp_plan_of(model: nn.Module) -> dict[str, str]:
    """The model's plan with concrete names of its base model: each matched module and its own parameters."""
    plan = getattr(_text_config(model), "base_model_tp_plan", None) or {}
    base = model.base_model
    out: dict[str, str] = {}
    named: dict[str, str] = {}  # entries naming a parameter (Mixtral's ``experts.gate_up_proj``): they win
    for pattern, style in plan.items():
        rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        for name, module in base.named_modules():
            if rx.match(name):  # the module's forward, and its own parameters unless named themselves
                out.update(_entries(name, module, style))
        named.update({name: style for name, _ in base.named_parameters() if rx.match(name)})
    return _through_adapters(base, {**out, **named})


def _through_adapters(base: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The plan with every peft LoRA layer (``q_proj`` -> ``q_proj.base_layer`` + ``lora_A`` / ``lora_B``)
    split around its base linear: ``y = W x + B A x``. Column-wise ``W`` (output rows split): ``B``
    column-wise, ``A`` replicated (its input is; ``B``'s input boundary all-reduces ``A``'s output
    gradient, so ``A``'s gradient is equal on every TP rank). Row-wise ``W`` (input columns split): ``A``
    row-wise (its partial output all-reduced), ``B`` replicated."""
    split = {"colwise": "lora_B", "rowwise": "lora_A"}  # the adapter half split like the base
    out = dict(plan)
    for name, module in base.named_modules():
        if name not in plan or not hasattr(module, "base_layer"):
            continue
        style = out.pop(name)
        if style not in split or getattr(module, "lora_variant", None) or not hasattr(module, "lora_A"):
            raise ValueError(
                f"{name}: an adapter layer ({type(module).__name__}) on a {style!r} layer of the tensor-parallel "
                "plan; tensor_parallel_size takes plain LoRA (no DoRA or other variant) on column- or row-wise "
                "linear layers: leave this layer out of the adapter's target_modules, or use "
                "tensor_parallel_size=1"
            )
        if any(getattr(d, "p", 0.0) for d in module.lora_dropout.values()):
            raise ValueError(
                f"{name}: lora_dropout > 0 under tensor_parallel_size: the TP ranks would each draw their own mask "
                "on the input they share (diverging replicated adapter weights); set lora_dropout=0.0"
            )
        out.update(_entries(f"{name}.base_layer", module.base_layer, style))
        for adapter, half in getattr(module, split[style]).items():
            out.update(_entries(f"{name}.{split[style]}.{adapter}", half, style))
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
            f"exactness under sequence parallelism (checked: {list(TESTED_STYLES)}); use tensor_parallel_size=1"
        )
    _styles()  # transformers new enough to apply it
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


def vocab_parallel_head(model: nn.Module, tp: int) -> str | None:
    """The module name of ``model``'s lm_head when it can be split ``tp`` ways over the vocabulary: a linear
    layer not tied to the input embedding, ``vocab % tp == 0`` (equal blocks). ``None``: it stays replicated."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.out_features % tp:
        return None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None and embed.weight is head.weight:
        return None
    return next(name for name, m in model.named_modules() if m is head)


def apply_tp_plan(model: nn.Module, tp_mesh: Any, *, tp: int, vocab_parallel: bool = False) -> nn.Module:
    """Shard ``model`` (a ``PreTrainedModel``) by its own plan over ``tp_mesh`` (1-D, ``tp`` ranks), in place;
    ``vocab_parallel``: its lm_head over the vocabulary too (:func:`vocab_parallel_head`, FPDT's chunked loss).
    Every rank must hold the same weights (each slices its own shard locally)."""
    plan = check_tp(model, tp)
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    apply_tensor_parallelism(model.base_model, tp_mesh, plan)
    head = vocab_parallel_head(model, tp) if vocab_parallel else None
    if head is not None:
        apply_tensor_parallelism(
            model, tp_mesh, _entries(head, model.get_submodule(head), "colwise_gather_output")
        )
    return model


def local_head(head: nn.Module) -> tuple[Any, Any, Any]:
    """``(weight, bias, vocab_group)`` of an lm_head for the chunked loss: this rank's vocabulary rows and the
    tp group when :func:`apply_tp_plan` split it (a DTensor ``Shard(0)`` on a 1-D mesh), else the full weight
    and ``None``. ``to_local`` keeps autograd: the rows' gradients land in the DTensor's."""
    from torch.distributed.tensor import DTensor, Shard

    weight, bias = head.weight, getattr(head, "bias", None)
    if not isinstance(weight, DTensor):
        return weight, bias, None
    # only the tp mesh's rows are vocabulary blocks (FSDP2's dp x sp shards are gathered before forward)
    if weight.device_mesh.mesh_dim_names != (TP_AXIS,) or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"the lm_head weight is a DTensor with placements {weight.placements} on mesh "
            f"{weight.device_mesh.mesh_dim_names}; the chunked loss takes a full weight or rows split over one "
            "tensor-parallel mesh (Shard(0)), as tensor_parallel_size does"
        )
    bias = bias.to_local() if isinstance(bias, DTensor) else bias
    return weight.to_local(), bias, weight.device_mesh.get_group()


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on several meshes (TP-split weights are DTensors on the
    (dp_sp, tensor_parallel) mesh, the replicated ones on its dp x sp axis; torch's version stacks them and fails): one
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


def check_replicated_gradients(parameters: Any, tp_group: Any, rtol: float = 1e-4) -> None:
    """Raise a ValueError naming the parameters not split by the plan whose gradients differ across the TP
    ranks. Every TP rank computes a replicated parameter's function on the same replicated inputs, so its
    gradient must be equal on all of them; a parameter that consumes split activations and is missing from
    the model's plan (Apertus' learnable xIELU activation between its column- and row-wise MLP projections;
    Qwen3's q/k norms without their plan entry) gets a partial one there, and training would silently
    diverge from one device. One all-gather of two numbers per parameter over the TP group (every rank calls
    it, with the same parameters in the same order), and one all-gather of the verdicts over the world."""
    import torch

    named = [(n, p) for n, p in parameters if p.grad is not None]
    replicated = [(n, p) for n, p in named if TP_AXIS not in (_mesh_names(p) or ())]
    if not replicated:
        return
    stats = torch.stack(
        [
            torch.stack([g.float().square().sum(), g.float().sum()])
            for g in (_local(p.grad) for _, p in replicated)
        ]
    )
    world = group_rank_size(tp_group)[1]
    every = all_gather_no_grad(stats[None], tp_group)  # (tp, params, 2)
    spread = (every.amax(0) - every.amin(0)).abs()
    scale = every.abs().amax(0)
    bad = [name for (name, _), s, m in zip(replicated, spread.tolist(), scale.tolist())
           if any(d > rtol * x + 1e-30 for d, x in zip(s, m))]  # fmt: skip
    # FSDP2 leaves a rank only its shard (a small parameter's can be empty): every rank learns every TP
    # group's verdict, so all raise the same error or none does (no rank waits in the next collective)
    bad = sorted({name for names in all_gather_object(bad) for name in names})
    if bad:
        raise ValueError(
            f"tensor_parallel_size={world}: the gradients of {bad[:4]}{' ...' if len(bad) > 4 else ''} differ "
            "across the tensor-parallel ranks: these parameters are not in the model's TP plan but consume "
            "activations it splits (e.g. a learnable activation function between column- and row-wise "
            "projections), so training would silently differ from one device. Use tensor_parallel_size=1 "
            "(sequence parallelism alone) for this model"
        )


def _mesh_names(p: Any) -> tuple[str, ...] | None:
    mesh = getattr(p, "device_mesh", None)
    return None if mesh is None else mesh.mesh_dim_names


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t
