"""The fit check: before the first training step, plan that step with the memory planner (``planner/``) against
the device's memory, and where it does not fit, refuse it before any step memory is spent, with the figures and
the settings that would make it fit.

:class:`~lightning_longctx.UlyssesFPDTStrategy` calls :func:`check_first_step` on the first training batch (its
shape is known, the model is set up, nothing of the step is allocated yet) when :func:`enabled` says so:
``fit_check="auto"`` (the default) on CUDA, or wherever a capacity is given (``fit_check_device_memory``: a
size such as ``"80GiB"`` or a device kind of ``planner/devices.py`` such as ``"h100"``; on a CPU, which has no
device memory to read, and in the tests). It plans what ``lightning-longctx plan`` plans for the same
settings, through the same mapping (``planner.step_plan_kwargs``): the model's config and weights' dtype, the
trainer's precision, the device type (a CPU run's reserve holds no CUDA context), the strategy's resolved
settings (the dp x sp x tp mesh, Ulysses x ring or FPDT x ring with its ``ring_size``, DDP or FSDP,
``cpu_offload``, checkpointing and activation offload, FPDT chunking and offload), the module's own activation checkpointing, its
optimizer and LoRA adapters, and the batch's length and micro batch.

Decided here:

* **Capacity**: the device's total memory (``torch.cuda.get_device_properties``), the smallest of all ranks'
  (the strategy reduces it), or the size given. The plan fits when its peak plus the planner's reserve (1 GiB
  for the CUDA context on a GPU, 5 % of the peak for the allocator's slack) is within it (``MemoryPlan.fits``).
* **Refusal**: a ``ValueError`` on every rank (the strategy agrees on the verdict with one all-reduce) with
  the peak, its largest terms, the capacity, and the cheapest settings that fit (FSDP, activation
  checkpointing or offload, FPDT chunking and offload, ``cpu_offload``, a larger ``sequence_parallel_size`` in
  the same world), each with its figures; when none does, the longest sequence that fits.
* **Warning, not an error**, when it fits with less than :data:`WARN_MARGIN` of the capacity free: the plan is
  a model (a measured step within ~10 % on CPU, docs/benchmarks.md; not yet measured on a GPU) and its reserve
  already holds 5 % for the allocator's slack; a refusal there would stop runs that may fit.
* **Not checked**, with one info line saying why, when the planner cannot plan the model: no transformers
  model, several, an architecture it refuses (mixture of experts), an optimizer it does not count (it counts
  AdamW / Adam and SGD without momentum), frozen parameters that are not LoRA adapters, parameters outside
  the model, or a batch without ``input_ids``. The check never fails a run because of itself.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lightning_longctx.config import DEFAULT_FPDT_CHUNK_SIZE, ResolvedConfig
from lightning_longctx.planner import (
    ALL_LINEAR,
    MemoryPlan,
    device_spec,
    format_bytes,
    longest_sequence,
    parse_bytes,
    plan_memory,
    step_plan_kwargs,
)
from lightning_longctx.planner.shapes import model_shape, text_config

__all__ = [
    "WARN_MARGIN",
    "FitVerdict",
    "Unplannable",
    "check_first_step",
    "device_capacity",
    "enabled",
    "fit_check_capacity",
]

#: a step that fits with less than this fraction of the capacity free gets a warning
WARN_MARGIN = 0.05
#: the settings shown in a refusal, at most
MAX_SHOWN = 3
FitCheck = bool | Literal["auto"]


class Unplannable(Exception):
    """The planner cannot plan this model or step; the message says why (the check is skipped)."""


def fit_check_capacity(fit_check: Any, device_memory: int | str | None) -> int | None:
    """Validate the strategy's ``fit_check`` and ``fit_check_device_memory``; the capacity in bytes (None: the
    device's own). ``device_memory``: bytes, a size (``"80GiB"``, ``"141GB"``) or a device kind of the
    planner's table (``"h100"``, ``"a100-40gb"``, ``"h200"``, ``"b200"``; ``planner/devices.py``)."""
    if fit_check not in (True, False, "auto") or not isinstance(fit_check, (bool, str)):
        raise ValueError(f"fit_check={fit_check!r}: use 'auto' (on CUDA), True or False")
    if device_memory is None:
        return None
    if isinstance(device_memory, bool):
        raise ValueError(f"fit_check_device_memory={device_memory!r}: give a memory size or a device kind")
    try:
        capacity = parse_bytes(device_memory)
    except ValueError:
        try:
            capacity = device_spec(str(device_memory)).device_memory
        except ValueError:
            raise ValueError(
                f"fit_check_device_memory={device_memory!r} is neither a memory size (e.g. '80GiB', '141GB') nor "
                "a device kind of the planner (a100-40gb, a100-80gb, h100, h200, b200)"
            ) from None
    if capacity <= 0:
        raise ValueError(f"fit_check_device_memory={device_memory!r}: the memory size must be positive")
    return capacity


def enabled(fit_check: FitCheck, capacity: int | None, device_type: str) -> bool:
    """Whether the check runs: ``True``; ``"auto"`` on CUDA or with a given capacity; never with ``False``.
    ``True`` on a device other than CUDA needs the capacity."""
    if fit_check is True and capacity is None and device_type != "cuda":
        raise ValueError(
            f"fit_check=True on a {device_type!r} device needs the memory to plan against: set "
            "fit_check_device_memory (e.g. '80GiB' or a device kind such as 'h100')"
        )
    return fit_check is True or (fit_check == "auto" and (device_type == "cuda" or capacity is not None))


def device_capacity(device: torch.device) -> tuple[int, str]:
    """The total memory of a CUDA ``device`` and its name."""
    props = torch.cuda.get_device_properties(device)
    return int(props.total_memory), str(props.name)


@dataclass(frozen=True)
class _ModelInputs:
    """What the planner reads of the module beyond the strategy's settings."""

    config: Any  # the transformers config
    param_dtype: str
    activation_checkpointing: bool  # the module's own (CausalLM's flag), or the strategy's
    optimizer: str
    lora_rank: int | None
    lora_targets: Any
    params: int  # the module's parameters (DTensors counted whole), tied ones once
    trainable: int


def _optimizer_name(optimizers: list[Any]) -> str:
    if not optimizers:
        return "sgd"  # no optimizer state (manual optimisation without one, or none configured)
    if len(optimizers) > 1:
        raise Unplannable(f"{len(optimizers)} optimizers (the planner counts one)")
    opt = optimizers[0]
    groups = opt.param_groups
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and not any(g.get("amsgrad") for g in groups):
        return "adamw"
    if type(opt) is torch.optim.SGD and not any(g.get("momentum") for g in groups):
        return "sgd"
    raise Unplannable(
        f"optimizer {type(opt).__name__} (the planner counts AdamW / Adam: 2 states per parameter, and SGD "
        "without momentum: none)"
    )


def _lora(module: nn.Module) -> tuple[int | None, Any]:
    """``(rank, targets)`` of the module's one peft LoRA adapter, ``(None, ALL_LINEAR)`` without peft."""
    configs = {id(c): c for m in module.modules() for c in (getattr(m, "peft_config", None) or {}).values()}
    if not configs:
        return None, ALL_LINEAR
    if len(configs) > 1:
        raise Unplannable(f"{len(configs)} peft adapters (the planner counts one LoRA adapter)")
    (config,) = configs.values()
    kind = str(getattr(config, "peft_type", ""))
    targets = getattr(config, "target_modules", None)
    if "LORA" not in kind.upper() or getattr(config, "rank_pattern", None) or not targets:
        raise Unplannable(f"peft adapter {type(config).__name__} (the planner counts LoRA of one rank)")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        raise Unplannable(f"LoRA target_modules={targets!r} (a pattern; the planner takes names)")
    return int(config.r), targets if isinstance(targets, str) else tuple(sorted(targets))


def _read_model(module: nn.Module, models: list[nn.Module], optimizers: list[Any]) -> _ModelInputs:
    if len(models) != 1:
        what = "no transformers model" if not models else f"{len(models)} transformers models"
        raise Unplannable(f"{what} in the LightningModule (the planner plans one)")
    (model,) = models
    params = {id(p): p for p in module.parameters()}.values()
    inside = {id(p) for p in model.parameters()}
    outside = sum(p.numel() for p in params if id(p) not in inside)
    if outside:
        raise Unplannable(
            f"{outside:,} parameters outside {type(model).__name__} (the planner counts its config's)"
        )
    embedding = model.get_input_embeddings()
    dtype = (embedding.weight if embedding is not None else next(iter(params))).dtype
    rank, targets = _lora(module)
    return _ModelInputs(
        config=model.config,
        param_dtype=str(dtype).removeprefix("torch."),
        activation_checkpointing=any(
            getattr(m, "gradient_checkpointing", False) is True for m in model.modules()
        ),
        optimizer=_optimizer_name(optimizers),
        lora_rank=rank,
        lora_targets=targets,
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
    )


@dataclass(frozen=True)
class _Step:
    """The step's own inputs: the batch's shape, the trainer's precision, the device and its memory."""

    seq_len: int
    micro_batch_size: int
    precision: str
    capacity: int
    device_type: str  # the strategy's root device type

    @property
    def plan_device(self) -> str:
        """The planner's device type: a CPU run has no CUDA context in its reserve."""
        return "cpu" if self.device_type == "cpu" else "cuda"


def _plan_kwargs(inputs: _ModelInputs, parallel: ResolvedConfig, step: _Step) -> dict[str, Any]:
    kwargs = step_plan_kwargs(
        parallel,
        seq_len=step.seq_len,
        micro_batch_size=step.micro_batch_size,
        precision=step.precision,
        param_dtype=inputs.param_dtype,
        activation_checkpointing=inputs.activation_checkpointing,
        device_type=step.plan_device,
    )
    kwargs["optimizer"] = inputs.optimizer
    if inputs.lora_rank is not None:
        kwargs.update(lora_rank=inputs.lora_rank, lora_targets=inputs.lora_targets)
    return kwargs


def _probe_need(inputs: _ModelInputs, parallel: ResolvedConfig, step: _Step, probe: tuple[int, int]) -> int:
    """The self-test's device memory: the plan of a step whose every rank holds the whole probe (the reference
    runs it unsharded on each rank: ``sp x tokens`` planned over sp), plus the float32 logits it keeps, ``(rows,
    tokens, vocab)`` of each run and their gathered copies (four)."""
    rows, tokens = probe
    probe_step = dataclasses.replace(step, seq_len=tokens * parallel.sp, micro_batch_size=rows)
    plan = plan_memory(
        inputs.config, **_plan_kwargs(inputs, parallel, probe_step), device_memory=step.capacity
    )
    vocab = int(getattr(text_config(inputs.config), "vocab_size", 0) or 0)
    return plan.device_needed + 4 * rows * tokens * vocab * 4


def _check_counts(plan: MemoryPlan, inputs: _ModelInputs) -> None:
    """The module holds the parameters the plan counts: all trainable, or a frozen base and LoRA adapters."""
    if inputs.lora_rank is None:
        if inputs.trainable != inputs.params:
            raise Unplannable(
                f"{inputs.params - inputs.trainable:,} of {inputs.params:,} parameters are frozen, not by a LoRA "
                "adapter (the planner counts gradients and optimizer state of every parameter)"
            )
        base = inputs.params
    else:
        base = inputs.params - inputs.trainable
        if plan.tensor_parallel_size == 1 and inputs.trainable != plan.trainable_params:
            raise Unplannable(
                f"{inputs.trainable:,} trainable parameters, the planner's LoRA adapters {plan.trainable_params:,}"
            )
    if base != plan.params:
        raise Unplannable(
            f"the model has {base:,} parameters, the planner counts {plan.params:,} from its config"
        )


# ---- the settings that would fit ----


def _axes(
    parallel: ResolvedConfig, module_checkpointing: bool, world: int
) -> list[list[tuple[dict[str, Any], int]]]:
    """Per axis, the changes of the strategy's settings that save device memory, with a rough cost (how much a
    step slows down or the run changes); the first entry of each axis is "no change"."""
    given, none = parallel.settings, ({}, 0)
    activations = [none]
    if not given.activation_offload:
        if not (parallel.activation_checkpointing or module_checkpointing):
            activations.append(({"activation_checkpointing": True}, 2))  # ~1/3 more compute
        activations.append(({"activation_offload": True}, 3))  # + host copies, overlapped
    sharding = [none]
    if given.data_parallel == "ddp":
        sharding.append(({"data_parallel": "fsdp"}, 1))  # gathers overlap the compute
    if not given.cpu_offload:
        sharding.append(({"data_parallel": "fsdp", "cpu_offload": True}, 5))  # the optimizer steps on the CPU
    chunking = [none]
    if given.fpdt_chunk_size is None:
        chunking.append(({"fpdt_chunk_size": DEFAULT_FPDT_CHUNK_SIZE}, 1))
        chunking.append(({"fpdt_chunk_size": DEFAULT_FPDT_CHUNK_SIZE, "offload": True}, 2))
    elif not parallel.offload:
        chunking.append(({"offload": True}, 1))
    sequence = [none]
    per_node = parallel.dims.devices_per_node
    for sp in range(parallel.sp + 1, world // parallel.tp + 1):
        if (world // parallel.tp) % sp == 0:  # fewer sequences per step: dp shrinks
            across = bool(per_node) and sp * parallel.tp > per_node
            sequence.append(({"sequence_parallel_size": sp}, 2 + 2 * across))
    return [activations, sharding, chunking, sequence]


@dataclass(frozen=True)
class _Alternative:
    changes: dict[str, Any]
    cost: int
    plan: MemoryPlan

    def text(self, dp: int) -> str:
        out = ", ".join(f"{k}={v!r}" for k, v in self.changes.items())
        if "sequence_parallel_size" in self.changes:
            out += f" (dp {dp} -> {self.plan.data_parallel_size}: fewer sequences per step)"
        host = f"; host {format_bytes(self.plan.host_total)} per rank" if self.plan.host_total else ""
        free = self.plan.device_memory - self.plan.device_needed
        room = f"{format_bytes(free)} free" if free >= 0 else f"{format_bytes(-free)} over"
        room += ", tight" if 0 <= free < WARN_MARGIN * self.plan.device_memory else ""
        return f"{out}: needs {format_bytes(self.plan.device_needed)} ({room}){host}"


def _alternatives(inputs: _ModelInputs, parallel: ResolvedConfig, step: _Step) -> list[_Alternative]:
    """Every combination of :func:`_axes`'s changes, planned on the same world, cheapest first (total cost,
    then fewer changes, then less memory)."""
    layout, out = parallel.dims, []
    for combo in itertools.product(*_axes(parallel, inputs.activation_checkpointing, layout.world_size)):
        given = parallel.settings  # a change to a value already set is no change (FSDP with cpu_offload)
        changes = {k: v for change, _ in combo for k, v in change.items() if getattr(given, k) != v}
        if not changes:
            continue
        try:
            settings = dataclasses.replace(parallel.settings, **changes)
            # ring_size="auto" settles again for the new sp, against the model's heads
            heads = {"heads": model_shape(inputs.config).heads} if settings.ring_size == "auto" else {}
            resolved = settings.resolve(layout.world_size, layout.devices_per_node, step.device_type, **heads)
            plan = plan_memory(
                inputs.config, **_plan_kwargs(inputs, resolved, step), device_memory=step.capacity
            )
        except ValueError:  # a combination the settings or the planner refuse for this model
            continue
        out.append(_Alternative(changes, sum(cost for _, cost in combo), plan))
    return sorted(out, key=lambda a: (a.cost, len(a.changes), a.plan.device_needed))


def _implied(changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` with what they imply (activation offload is checkpointing plus offload)."""
    return {**changes, "activation_checkpointing": True} if changes.get("activation_offload") else changes


def _cheapest_fitting(found: list[_Alternative]) -> list[_Alternative]:
    """The fitting alternatives, cheapest first, without those that only add changes to a shown one."""
    shown: list[_Alternative] = []
    for alt in found:
        more = _implied(alt.changes).items()
        if alt.plan.fits and not any(s.changes.items() <= more for s in shown):
            shown.append(alt)
    return shown[:MAX_SHOWN]


# ---- the verdict ----


@dataclass(frozen=True)
class FitVerdict:
    """The check's answer: the plan of the first step, whether it fits, and what to say (a refusal's message,
    a warning or an info line)."""

    plan: MemoryPlan
    fits: bool
    message: str
    warn: bool = False
    probe_need: int | None = None  # the self-test's device memory (``_probe_need``), when it will run


def _terms(plan: MemoryPlan) -> str:
    largest = sorted((c for c in plan.components if c.device), key=lambda c: -c.device)[:3]
    return ", ".join(f"{c.name} {format_bytes(c.device)}" for c in largest)


def _refusal(
    plan: MemoryPlan, where: str, found: list[_Alternative], inputs: _ModelInputs, kwargs: dict[str, Any]
) -> str:
    capacity = plan.device_memory
    reserve = "CUDA context, allocator slack" if kwargs["device_type"] == "cuda" else "allocator slack"
    lines = [
        f"UlyssesFPDTStrategy fit check: the first training step does not fit the device. It needs "
        f"{format_bytes(plan.device_needed)} per device, {where} has {format_bytes(capacity)} "
        f"({format_bytes(plan.device_needed - capacity)} over).",
        f"  planned: {plan.describe()}",
        f"  peak {format_bytes(plan.device_total)} in the {plan.peak_phase} + {format_bytes(plan.device_reserve)} "
        f"reserve ({reserve}); largest terms: {_terms(plan)}",
    ]
    fitting = _cheapest_fitting(found)
    if fitting:
        lines.append("  settings of UlyssesFPDTStrategy that fit, cheapest first:")
        lines += [f"    {alt.text(plan.data_parallel_size)}" for alt in fitting]
    else:
        least = min(found, key=lambda a: a.plan.device_needed, default=None)
        search = {k: v for k, v in kwargs.items() if k not in ("seq_len", "sequence_parallel_size")}
        longest = longest_sequence(inputs.config, device_memory=capacity,
                                   sequence_parallel_size=kwargs["sequence_parallel_size"], **search)  # fmt: skip
        lines.append(
            f"  no setting of UlyssesFPDTStrategy makes it fit in this world (FSDP, cpu_offload, activation "
            f"checkpointing / offload, FPDT chunking and offload, a larger sequence_parallel_size); at these "
            f"settings the longest sequence that fits is {longest:,} tokens"
        )
        if least is not None:
            lines.append(f"  the least it needs: {least.text(plan.data_parallel_size)}")
        lines.append(
            "  use more devices (a larger sequence_parallel_size), a shorter sequence or a smaller model"
        )
    lines.append(
        "  The plan is the memory planner's (`lightning-longctx plan` prints its table for a config); "
        "fit_check=False skips this check."
    )
    return "\n".join(lines)


def check_first_step(
    module: nn.Module,
    models: list[nn.Module],
    optimizers: list[Any],
    parallel: ResolvedConfig,
    batch: Any,
    *,
    precision: str,
    capacity: int,
    where: str,
    device_type: str,
    probe: tuple[int, int] | None = None,
) -> FitVerdict:
    """Plan the step of ``batch`` (its ``input_ids`` ``(micro_batch, seq_len)``) for ``module`` under the
    resolved settings ``parallel`` against ``capacity`` bytes per device (``where`` names them in the message)
    on a ``device_type`` device (the planner's reserve holds a CUDA context except on ``"cpu"``). No collective: every rank given the same inputs decides alike. Raises :class:`Unplannable` when the
    planner cannot plan it. ``probe``: the self-test's ``(rows, tokens)`` (``self_test.probe_shape``), run
    before the step on the same states; its peak is planned too (:func:`_probe_need`) and must fit as well."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise Unplannable("the batch has no 2-D input_ids")
    step = _Step(int(ids.shape[1]), int(ids.shape[0]), precision, capacity, device_type)
    inputs = _read_model(module, models, optimizers)
    try:
        kwargs = _plan_kwargs(inputs, parallel, step)
        plan = plan_memory(inputs.config, **kwargs, device_memory=capacity)
    except ValueError as err:  # an architecture or setting the planner refuses
        raise Unplannable(str(err)) from None
    _check_counts(plan, inputs)
    free = capacity - plan.device_needed
    probe_need = None if probe is None else _probe_need(inputs, parallel, step, probe)
    if plan.fits and probe_need is not None and probe_need > capacity:
        return FitVerdict(
            plan,
            False,
            probe_need=probe_need,
            message=f"UlyssesFPDTStrategy fit check: the first training step fits ({format_bytes(plan.device_needed)} per "
            f"device), but the self-test before it needs {format_bytes(probe_need)} (its probe of {probe[0]} x "
            f"{probe[1]} tokens and their logits), more than the {format_bytes(capacity)} of {where}. Turn the "
            "self-test off (self_test=False) or free memory",
        )
    if plan.fits:
        text = (
            f"UlyssesFPDTStrategy fit check: the first training step needs {format_bytes(plan.device_needed)} per "
            f"device (peak {format_bytes(plan.device_total)} in the {plan.peak_phase} + reserve), {where} has "
            f"{format_bytes(capacity)}: {format_bytes(free)} free"
        )
        if probe_need is not None:
            text += f"; the self-test before it needs {format_bytes(probe_need)}"
        warn = free < WARN_MARGIN * capacity
        if warn:
            text += (
                f", less than {WARN_MARGIN:.0%}: the plan is a model, and allocator fragmentation or a tensor it "
                f"does not count may still run out of memory; largest terms: {_terms(plan)}"
            )
        return FitVerdict(plan, True, text, warn, probe_need)
    return FitVerdict(
        plan,
        False,
        _refusal(plan, where, _alternatives(inputs, parallel, step), inputs, kwargs),
        False,
        probe_need,
    )
