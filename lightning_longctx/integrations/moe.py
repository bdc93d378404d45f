"""Exact MoE auxiliary (load-balancing) loss under sequence parallelism.

Mixture-of-experts causal LMs in transformers add, when ``output_router_logits`` is on,
``coef * load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`` to the loss
inside their forward (Switch Transformer eqs. 4-6). With ``m_t`` the padding weight of token t (1
without a mask), ``p_t = softmax(router_logits_t)`` and summing over the L MoE layers and all tokens::

    C_e = sum_{l,t} m_t * #[e in topk(p_{l,t}, k)]      # top-k assignments per expert (no gradient)
    S_e = sum_{l,t} m_t * p_{l,t,e}                     # router probability mass per expert
    R   = sum_{l,t} m_t                                 # routed rows (L x valid tokens)
    aux = E * sum_e (C_e / R) * (S_e / R)

Under sequence parallelism each rank sees only its shard, so the model's own value uses per-shard
C, S, R: a different loss on every rank and router gradients off by ~100%.
:func:`sequence_parallel_load_balancing_loss` sums the three statistics over the SP group first (one
all-reduce of ``2E + 1`` numbers): C_e, S_e, R are sums over tokens, so the global ones are the sums
of the per-rank ones, and the value equals the single-process function on the full sequence, on every
rank, for any layout (contiguous or FPDT chunks; tokens are only summed) and any per-rank token count.

Gradient. Only S is differentiable; C (top-k indices) and R (mask) are constants, and the
GLOBAL R normalises. ``d aux / d S_e = E * C_e / R**2``, the same number on every rank. The all-reduce
of the local sums ``S^r`` has an identity backward (:func:`~lightning_longctx.parallel.comm.all_reduce_sum_identity_grad`),
so rank r receives ``d aux / d S^r_e = d aux / d S_e`` (as ``dS / dS^r = 1``) and back-propagates it
through its own tokens' softmax only. The strategy SUMS parameter gradients over the SP ranks, giving
``sum_r sum_e (E C_e / R**2) dS^r_e/dθ = sum_e (E C_e / R**2) dS_e/dθ = d aux/dθ``: single-device
training, exactly, with top-k (it only enters C) and with padding (m_t weights C, S and R alike). It
is the contract of :func:`~lightning_longctx.sequence_parallel_cross_entropy`; both terms of
``CE + coef * aux`` obey it, so their sum does. Data parallelism is left as Hugging Face has it: each
dp replica's micro-batch has its own statistics (reduce over the SP group only).

Wiring into a CausalLM forward (what :mod:`lightning_longctx.integrations.transformers` should do).
At patch time, ``plan = moe_aux_loss_plan(model)`` (``None``: nothing to do; raises for a formula this
module does not implement when the config turns it on). At call time, when ``labels`` is given and
``plan.active(model.config, output_router_logits)`` (raises for an unsupported formula turned on by
the call), the model's own, per-shard aux term must NOT reach the loss. Ulysses mode (the model's own
forward, logits materialised)::

    out = type(model).forward(model, *args, labels=None, output_router_logits=True,
                              attention_mask=attention_mask, **kwargs)  # labels=None: no loss, no aux added
    ce = sequence_parallel_cross_entropy(out.logits, shift_labels, group=group)  # or model.loss_function(...)
    aux = plan.aux_loss(out.router_logits, attention_mask=attention_mask, group=group)
    return type(out)(**{**out, "loss": ce + plan.coef * aux, "aux_loss": aux})  # loss first in to_tuple()

FPDT mode (the chunked-loss forward calls the decoder itself): pass ``output_router_logits=True`` to
``model.get_decoder()(...)`` and add ``plan.coef * plan.aux_loss(decoder_out.router_logits,
attention_mask=attention_mask, group=group)`` to the chunked cross-entropy. ``attention_mask`` is the
rank's 2-D ``(b, s/P)`` shard from :func:`~lightning_longctx.shard_batch`. Every rank of the group must
make the call (it is a collective), also ranks whose shard is all padding.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch
from torch import nn

from lightning_longctx.parallel.comm import Group, all_reduce_sum_identity_grad

#: The one formula computed exactly: Mixtral's ``load_balancing_loss_func`` and its verbatim copies.
MIXTRAL = "mixtral"
#: What can turn a model's in-forward loss term on (see :class:`MoEAuxLossPlan`).
TRIGGERS = ("output_router_logits", "call", "z_loss_coefficient")


def _local_routing_statistics(
    router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``S`` (E,) with autograd, ``C`` (E,) and ``R`` () in float64, without autograd.

    Mirrors transformers' dtype choices so the top-k selection is the same: the softmax runs in the
    logits' dtype, the probability sums in at least float32. Counts are float64 (exact to 2**53)."""
    device = router_logits[0].device
    acc = torch.promote_types(router_logits[0].dtype, torch.float32)
    probs = torch.zeros(num_experts, dtype=acc, device=device)
    counts = torch.zeros(num_experts, dtype=torch.float64, device=device)
    rows = torch.zeros((), dtype=torch.float64, device=device)
    weight = None
    if attention_mask is not None:
        weight = attention_mask.reshape(-1).to(device=device, dtype=torch.float64)
    for layer, logits in enumerate(router_logits):
        if logits.shape[-1] != num_experts:
            raise ValueError(
                f"router logits of layer {layer} have {logits.shape[-1]} experts in their last dim "
                f"(shape {tuple(logits.shape)}), expected num_experts={num_experts}"
            )
        routing = torch.softmax(logits.to(device).reshape(-1, num_experts), dim=-1)  # (T, E)
        selected = torch.topk(routing, top_k, dim=-1).indices.reshape(-1)  # (T*k,), token-major
        if weight is None:
            counts.scatter_add_(0, selected, torch.ones_like(selected, dtype=torch.float64))
            probs = probs + routing.to(acc).sum(dim=0)
            rows += routing.shape[0]
        else:
            if weight.numel() != routing.shape[0]:
                raise ValueError(
                    f"attention_mask has {weight.numel()} tokens but the router logits of layer {layer} have "
                    f"{routing.shape[0]} rows (batch x local sequence); pass this rank's 2-D (b, s/P) mask"
                )
            counts.scatter_add_(0, selected, weight.repeat_interleave(top_k))
            probs = probs + (routing.to(acc) * weight.to(acc)[:, None]).sum(dim=0)
            rows += weight.sum()
    return probs, counts, rows


def sequence_parallel_load_balancing_loss(
    router_logits: Sequence[torch.Tensor] | None,
    num_experts: int,
    top_k: int,
    *,
    group: Group = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixtral-style load-balancing loss over ALL tokens of the sequence-parallel group, on every rank.

    Args:
        router_logits: one tensor per MoE layer, ``(b * s_local, E)`` (or ``(b, s_local, E)``) for this
            rank's tokens, in the order of ``attention_mask`` (batch-major): ``outputs.router_logits`` of a
            model called with ``output_router_logits=True``. ``s_local`` may differ between ranks.
        num_experts: ``E``; top_k: experts per token.
        group: the sequence-parallel group (``None`` = default group, or a single process).
        attention_mask: this rank's ``(b, s_local)`` padding mask (1 = token, 0 = pad), or ``None``.

    Returns a 0-dim tensor (float32, or the logits' dtype if wider), equal on all ranks to
    ``load_balancing_loss_func(full_router_logits, E, top_k, full_attention_mask)`` on one process. Its
    gradient, with the strategy's SUM of parameter gradients over the SP ranks, is that of single-device
    training (see the module docstring). A group with no valid token gives 0, never NaN; ``None`` or no
    layers give 0 without communicating (as transformers returns 0).
    """
    if isinstance(router_logits, torch.Tensor):
        raise TypeError(
            "router_logits must be a tuple of per-layer tensors (outputs.router_logits), got one tensor"
        )
    if router_logits is None or len(router_logits) == 0:
        return torch.zeros(())
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    probs, counts, rows = _local_routing_statistics(router_logits, num_experts, top_k, attention_mask)
    # One collective: [S, C, R]; only the S slice carries a gradient (identity backward, see above).
    stats = all_reduce_sum_identity_grad(torch.cat([probs.to(torch.float64), counts, rows[None]]), group)
    probs, counts, rows = stats[:num_experts], stats[num_experts:-1], stats[-1].clamp(min=1)
    aux = num_experts * torch.sum((counts / rows) * (probs / rows))
    return aux.to(torch.promote_types(router_logits[0].dtype, torch.float32))


# --- which models compute which in-forward loss --------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MoEAuxLossPlan:
    """What a model's forward adds to its loss from token statistics, read at patch time.

    ``formula`` is :data:`MIXTRAL` (computed exactly by :meth:`aux_loss`) or ``None`` (not implemented:
    :meth:`active` raises ``ValueError(reason)`` whenever the term would be computed). ``module`` is the
    dotted name of the submodule whose forward adds the term (``""``: the model itself).
    ``num_experts``, ``top_k`` and ``coef`` are the values that forward passes (``coef``:
    ``router_aux_loss_coef``; JetMoe's ``aux_loss_coef``; DBRX's ``moe_loss_weight``); plan again after
    changing them. ``trigger`` says what turns the term on: ``"output_router_logits"`` (the config
    flag, which a call's ``output_router_logits`` overrides), ``"call"`` (the call's
    ``output_router_logits`` only: the forward never reads the config; Switch Transformers, the
    Qwen3-Omni talker) or ``"z_loss_coefficient"`` (Bamba's z-loss, on when the config's coefficient
    is > 0).
    """

    model_class: str
    formula: str | None
    module: str = ""
    num_experts: int = 0
    top_k: int = 0
    coef: float = 0.0
    trigger: str = "output_router_logits"
    reason: str = ""

    def __post_init__(self) -> None:
        if self.formula == MIXTRAL and not (0 < self.top_k <= self.num_experts):
            raise ValueError(
                f"{self.model_class}: top_k={self.top_k} and num_experts={self.num_experts} are inconsistent"
            )
        if self.formula is None and not self.reason:
            raise ValueError("an unsupported plan needs a reason")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"trigger={self.trigger!r} is unknown; choose one of {TRIGGERS}")

    def active(self, config: Any, output_router_logits: bool | None = None) -> bool:
        """Whether the forward would add the term, given the model's ``config`` now and the call's
        ``output_router_logits`` (``None`` = not passed). Raises ``ValueError`` if it would and
        :attr:`formula` is ``None``. (The term reaches the loss only when labels are given.)"""
        on = _flag(config, self.trigger, output_router_logits)
        if on and self.formula is None:
            raise ValueError(self.reason)
        return on

    def aux_loss(
        self,
        router_logits: Sequence[torch.Tensor] | None,
        *,
        group: Group = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The exact aux loss (without ``coef``): :func:`sequence_parallel_load_balancing_loss`."""
        if self.formula != MIXTRAL:
            raise ValueError(self.reason)
        return sequence_parallel_load_balancing_loss(
            router_logits, self.num_experts, self.top_k, group=group, attention_mask=attention_mask
        )


def _flag(config: Any, trigger: str, call_value: bool | None) -> bool:
    if trigger == "z_loss_coefficient":
        return float(getattr(config, "z_loss_coefficient", 0.0) or 0.0) > 0
    if getattr(config, "is_moe", True) is False:  # Doge: dense unless is_moe, whatever the flag says
        return False
    if call_value is not None or trigger == "call":
        return bool(call_value)
    if hasattr(config, "output_router_logits"):
        return bool(config.output_router_logits)
    # composite (vision-language) configs: the forward reads config.text_config.output_router_logits
    return bool(getattr(getattr(config, "text_config", None), "output_router_logits", False))


def _code_names(code: CodeType) -> set[str]:
    """Global and attribute names a function's code uses, nested code (comprehensions) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _code_names(const)
    return names


def _code_key(code: CodeType, doc: str | None) -> tuple[Any, ...]:
    """The bytecode of a function without its docstring and line numbers: equal for verbatim copies
    (transformers' ``# Copied from`` / modular files) in one interpreter."""
    consts = tuple(
        _code_key(c, None) if isinstance(c, CodeType) else (type(c).__name__, repr(c))
        for c in code.co_consts
        if not (doc is not None and c == doc)
    )
    return (code.co_code, code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount, consts)


def _mixtral_key() -> tuple[Any, ...]:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return _code_key(load_balancing_loss_func.__code__, load_balancing_loss_func.__doc__)


def _forward(cls: type) -> Any:
    fwd = inspect.unwrap(cls.forward)
    return fwd if hasattr(fwd, "__code__") else None


def _refusal(cls_name: str, what: str, fix: str) -> str:
    return (
        f"{cls_name} adds {what} to its loss inside forward, computed from statistics of the tokens it sees. "
        "Under sequence parallelism each rank sees only its shard of the sequence, so that term (and its "
        "gradient) would be wrong, and lightning_longctx does not implement this formula across the "
        f"sequence-parallel group. {fix}, or train this model without sequence parallelism"
    )


def _classify(cls: type, mixtral_key: tuple[Any, ...]) -> tuple[str | None, str, str] | None:
    """``(formula, trigger, reason)`` for a class whose forward adds a token-statistics loss, else None."""
    fwd = _forward(cls)
    if fwd is None:
        return None
    names = _code_names(fwd.__code__)
    name = cls.__name__
    # a forward that reads config.output_router_logits has it among its attribute names
    router_trigger = "output_router_logits" if "output_router_logits" in names else "call"
    off = "Set output_router_logits=False (in the config and in the call)"
    if "load_balancing_loss_func" in names:
        fn = fwd.__globals__.get("load_balancing_loss_func")
        code = getattr(fn, "__code__", None)
        same = code is not None and _code_key(code, fn.__doc__) == mixtral_key
        if same and {"num_experts", "num_experts_per_tok"} <= names:
            return MIXTRAL, router_trigger, ""
        where = f"{getattr(fn, '__module__', '?')}.load_balancing_loss_func"
        return None, router_trigger, _refusal(name, f"a router load-balancing loss ({where})", off)
    if "router_z_loss_func" in names:
        return None, router_trigger, _refusal(name, "a router z-loss", off)
    if "z_loss_coefficient" in names:
        return None, "z_loss_coefficient", _refusal(name, "a logit z-loss", "Set config.z_loss_coefficient=0")
    return None


def _lookup(module: nn.Module, *names: str) -> Any:
    """The first of ``names`` found on the module, then its ``config.text_config``, then its config."""
    config = getattr(module, "config", None)
    for owner in (module, getattr(config, "text_config", None), config):
        for attr in names:
            value = getattr(owner, attr, None) if owner is not None else None
            if value is not None:
                return value
    raise ValueError(f"{type(module).__name__}: cannot find {' or '.join(names)} on the model or its config")


def moe_aux_loss_plan(model: nn.Module) -> MoEAuxLossPlan | None:
    """Inspect a (transformers) model once, at patch time: does its forward add a loss term computed
    from statistics of the tokens it sees, and can it be made exact under sequence parallelism?

    Returns ``None`` when no submodule's forward adds such a term (dense models; MoE models whose
    balancing needs no loss term), else a :class:`MoEAuxLossPlan` for the outermost one (a peft or
    Lightning wrapper is looked through). Mixtral's ``load_balancing_loss_func`` and its verbatim copies
    (Qwen2/3-MoE, OLMoE, DBRX, JetMoe, Granite-MoE, GPT-OSS, Jamba, MiniMax, PhiMoE, ...; detected by
    bytecode, so future copies qualify) are supported. Other formulas (Doge, NLLB-MoE, Switch Transformers,
    Bamba's z-loss) give a plan with ``formula=None``; this function raises ``ValueError`` naming the
    model class and the fix if the model's config turns that term on now; :meth:`MoEAuxLossPlan.active`
    raises if a call turns it on later.
    """
    mixtral_key = _mixtral_key()
    seen: dict[type, Any] = {}
    for module_name, module in model.named_modules():
        cls = type(module)
        if cls not in seen:
            seen[cls] = _classify(cls, mixtral_key)
        found = seen[cls]
        if found is None:
            continue
        formula, trigger, reason = found
        if formula is None:
            plan = MoEAuxLossPlan(
                model_class=cls.__name__, formula=None, module=module_name, trigger=trigger, reason=reason
            )
            plan.active(getattr(module, "config", None))  # refuse now if the config turns the term on
            return plan
        names = _code_names(_forward(cls).__code__)
        coef = "router_aux_loss_coef" if "router_aux_loss_coef" in names else "aux_loss_coef"
        return MoEAuxLossPlan(
            model_class=cls.__name__,
            formula=MIXTRAL,
            module=module_name,
            num_experts=int(_lookup(module, "num_experts", "num_local_experts")),
            top_k=int(_lookup(module, "num_experts_per_tok")),
            coef=float(_lookup(module, coef)),
            trigger=trigger,
        )
    return None
