"""The strategy's keyword arguments: the settings' fields made explicit (for LightningCLI and ``help()``), and the
refusal of keywords nothing would read."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import textwrap
import typing
from typing import Any

import torch

from lightning_longctx.config import SequenceParallelConfig


def config_arguments(config_cls: type) -> Any:
    """Class decorator: the fields of ``config_cls`` become explicit keyword arguments of the class's
    ``__init__`` (for ``inspect.signature``, hence LightningCLI and ``help()``), in field order and
    before the class's own, and its ``{config_args}`` docstring placeholder becomes their docs."""
    hints = typing.get_type_hints(config_cls)  # real types: LightningCLI validates values with them
    fields = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in dataclasses.fields(config_cls)
    ]
    doc = inspect.getdoc(config_cls) or ""
    args = textwrap.dedent(doc[doc.index("Args:\n") + len("Args:\n") :]).strip()

    def apply(cls: type) -> type:
        sig = inspect.signature(cls.__init__)
        own_hints = typing.get_type_hints(cls.__init__)
        self_param, *own = (
            p.replace(annotation=own_hints.get(p.name, p.annotation)) for p in sig.parameters.values()
        )
        var_kw = [p for p in own if p.kind is p.VAR_KEYWORD]
        own = [p for p in own if p.kind is not p.VAR_KEYWORD]
        cls.__init__.__signature__ = sig.replace(parameters=[self_param, *fields, *own, *var_kw])
        indent = " " * 8
        cls.__doc__ = (cls.__doc__ or "").replace("{config_args}", textwrap.indent(args, indent).lstrip())
        return cls

    return apply


CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(SequenceParallelConfig))
#: the strategy's own keywords that configure DDP (FSDP2 reads none of them)
DDP_STRATEGY_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")
#: ``DistributedDataParallel`` arguments the strategy sets itself: the reduction spans all dp x sp ranks.
SET_BY_STRATEGY = ("module", "device_ids", "output_device", "process_group", "device_mesh")


def _is_default(value: Any, param: inspect.Parameter) -> bool:
    try:
        return value is param.default or bool(value == param.default)
    except Exception:  # a value without a plain ==
        return False


def check_keywords(
    kwargs: dict[str, Any], data_parallel: str, named: dict[str, Any], own: dict[str, inspect.Parameter]
) -> None:
    """Refuse keywords that nothing would read (a typo, a setting of another strategy) and DDP's keywords
    under ``data_parallel="fsdp"``: silently dropped, they would leave the user believing a feature is on.
    ``kwargs``: what is left after the strategy's named arguments (``named``, DDP's among them), which go to
    ``DistributedDataParallel``. A DDP keyword at its default changes nothing and passes."""
    if "model_averaging_period" in kwargs:
        raise TypeError(
            "model_averaging_period (DDP's post-local SGD) is not supported by UlyssesFPDTStrategy: it stops "
            "averaging gradients over the whole world, and the ranks of a sequence must sum theirs every step. "
            "Remove it"
        )
    ddp = dict(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)
    ddp.pop("self")
    ddp.pop("kwargs", None)
    ddp["gradient_as_bucket_view"] = ddp["gradient_as_bucket_view"].replace(default=True)  # our default
    for name, value in kwargs.items():
        if name not in ddp:
            known = sorted({*CONFIG_FIELDS, *own, *ddp} - set(SET_BY_STRATEGY) - {"self", "kwargs"})
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = (
                f"; did you mean {close[0]!r}?" if close else f"; known settings: {', '.join(CONFIG_FIELDS)}"
            )
            raise TypeError(f"UlyssesFPDTStrategy got an unknown setting {name!r}{hint}")
        if name in SET_BY_STRATEGY and not _is_default(value, ddp[name]):
            raise TypeError(
                f"UlyssesFPDTStrategy sets DistributedDataParallel's {name!r} itself (its gradient reduction "
                f"spans all data- x sequence-parallel ranks); remove {name}={value!r}"
            )
    if data_parallel != "fsdp":
        return
    ddp_only = {**ddp, **{n: own[n] for n in DDP_STRATEGY_ONLY}}
    for name, value in {**kwargs, **named}.items():
        if name in ddp_only and not _is_default(value, ddp_only[name]):
            raise TypeError(
                f"{name}={value!r} configures DDP, but data_parallel='fsdp' shards with FSDP2, which would ignore "
                "it; remove it, or use data_parallel='ddp'"
            )
