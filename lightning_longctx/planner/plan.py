"""The planner's entry points: :func:`plan_memory`, :func:`longest_sequence`, and the one mapping between their
keywords and the strategy's settings (:func:`resolve_parallel`, :func:`parallel_kwargs`), with a step's own
inputs (:func:`step_plan_kwargs`)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from lightning_longctx.config import (
    DEFAULT_FPDT_CHUNK_SIZE,
    MODES,
    Mode,
    ResolvedConfig,
    SequenceParallelConfig,
    auto_ring_size,
)
from lightning_longctx.planner.per_rank import ALL_LINEAR, _check_int, _PerRank, build_per_rank
from lightning_longctx.planner.phases import evaluate
from lightning_longctx.planner.report import MemoryPlan, parse_bytes
from lightning_longctx.planner.shapes import model_shape


def plan_memory(
    config: Any,
    *,
    seq_len: int,
    sequence_parallel_size: int,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    ring_size: int | str = 1,
    mode: str = "ulysses",
    fpdt_chunk_size: int | None = None,
    offload: bool = False,
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    data_parallel: str = "ddp",
    micro_batch_size: int = 1,
    precision: str = "32-true",
    param_dtype: Any = None,
    optimizer: str = "adamw",
    loss_chunk_size: int | None = None,
    mlp_chunk_size: int | None = None,
    cpu_offload: bool = False,
    lora_rank: int | None = None,
    lora_targets: str | tuple[str, ...] | list[str] = ALL_LINEAR,
    device_memory: int | str | None = None,
    host_memory: int | str | None = None,
    devices_per_host: int | None = None,
    device_reserve: int | str | None = None,
    host_reserve: int | str | None = None,
    device_type: str = "cuda",
) -> MemoryPlan:
    """Plan the memory of one training step per device and per host (no GPU, no weights needed).

    Args:
        config: a transformers config (e.g. ``AutoConfig.from_pretrained(path)``) or a dict with
            ``model_type``, as in a LightningCLI ``model_config``.
        seq_len: tokens per sequence (global); padded like ``shard_batch`` pads it (to a multiple of
            ``P``, or of ``P * chunk`` with FPDT).
        sequence_parallel_size: P, ranks that share one sequence. data_parallel_size: dp (matters
            for FSDP, which shards over dp x sp).
        tensor_parallel_size: tp, ranks that split every layer by the model's Hugging Face TP plan (the world
            is dp x sp x tp; needs ``data_parallel="fsdp"``, heads and kv heads divisible by tp, no LoRA).
            Per rank: the plan's split weights (q/k/v, o, the MLP's, a MoE's experts) / tp, and FSDP shards
            that over dp x sp; the embedding, norms and router stay whole; the lm_head is split over the
            vocabulary only in FPDT mode when it is untied and ``vocab % tp == 0`` (vocabulary-parallel
            chunked loss, ``(chunk, V / tp)`` blocks), else replicated. Activations of hidden width (residual
            stream, norms, the o/down projections' outputs, checkpointed layer inputs) are replicated over tp;
            those per head (q/k/v, attention output, lse, all-to-all buffers) and the MLP's intermediates / tp.
        ring_size: r, ring attention over r groups of ``U = P / r`` Ulysses ranks (the strategy's ``ring_size``;
            with FPDT: FPDT x ring, segments of ``U * chunk`` tokens, chunk capped at ``N / 2P``, padded to
            ``2 * P * chunk``): the all-to-all runs over U ranks (kv heads replicated for U, not P), each rank holds
            ``N / r`` tokens and ``H / U`` heads in head layout, and the ring's k/v blocks (two in flight) and
            fp32 dk/dv blocks are the **ring buffers** row; ``"auto"``: ``config.auto_ring_size`` of P and the
            TP-local heads (1 while P fits them). The sequence is padded to a multiple of ``2 * P``.
        mode: ``"ulysses"`` or ``"fpdt"``. fpdt_chunk_size: tokens per chunk per rank (FPDT; default
            4096, capped at the local length as the strategy does; read with ``mode="fpdt"`` only: the strategy's
            ``fpdt_chunk_size``). offload: FPDT's chunks in host memory.
        activation_checkpointing: checkpoint every decoder layer (the strategy's or ``CausalLM``'s flag).
        activation_offload: the checkpointed layer inputs in host memory (implies checkpointing).
        data_parallel: ``"ddp"`` (replicated parameters, gradient buckets) or ``"fsdp"`` (sharded).
        micro_batch_size: sequences per device per step.
        precision: a Lightning precision (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ...).
        param_dtype: the weights' dtype when the model is built in one (``CausalLM(dtype=...)``), e.g.
            ``"bfloat16"``; ``None``: what the precision gives (fp32 for ``-mixed`` and ``32-true``).
        optimizer: ``"adamw"`` / ``"adam"`` (2 states per parameter) or ``"sgd"`` (none).
        loss_chunk_size / mlp_chunk_size: FPDT's chunk of the lm_head + loss / the tiled MLP (defaults
            as the strategy's: 128 MiB fp32 logits blocks / the FPDT chunk size).
        cpu_offload: FSDP2's ``CPUOffloadPolicy`` (the strategy's ``cpu_offload``, needs ``data_parallel="fsdp"``):
            weights, gradients and optimizer state on the host, the optimizer step there.
        lora_rank / lora_targets: LoRA adapters of rank r on the blocks' linear layers (``"all-linear"``, or
            their names, e.g. ``("q_proj", "v_proj")``): the base weights are frozen, so only the adapters
            carry gradients and optimizer state (their rank-r activations, r/hidden of a projection's input,
            are not counted).
        device_memory: bytes (or ``"80GiB"``) per device, to say whether the plan fits.
        host_memory: bytes per host (a node: ``"1.9TB"``), for ``devices_per_host`` devices (default: the
            job's devices, at most 8).
        device_reserve: device bytes outside the plan's tensors; default ``CUDA_CONTEXT_BYTES`` (1 GiB: the
            CUDA context, cuBLAS / NCCL workspaces; on CUDA only) + ``ALLOCATOR_RESERVE`` (5 %) of the peak (the
            allocator's slack). host_reserve: host bytes per rank outside the plan (the process, its data
            loader); default ``HOST_PROCESS_BYTES`` (4 GiB). ``fits`` adds both.
        device_type: ``"cuda"`` (a GPU run) or ``"cpu"`` (a CPU run: no CUDA context in the default reserve).

    The sequence-parallel settings (``sequence_parallel_size`` to ``cpu_offload``, and ``devices_per_host`` as
    the devices per node) become a :class:`~lightning_longctx.config.SequenceParallelConfig`, resolved on a
    world of ``dp * sp * tp`` ranks (:func:`resolve_parallel`): they are validated there, with the strategy's
    errors. The rest is the planner's own input and is checked here.

    Returns a :class:`MemoryPlan`; ``plan.table()`` prints it.
    """
    per_rank = plan_per_rank(
        config,
        seq_len=seq_len,
        sequence_parallel_size=sequence_parallel_size,
        data_parallel_size=data_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
        ring_size=ring_size,
        mode=mode,
        fpdt_chunk_size=fpdt_chunk_size,
        offload=offload,
        activation_checkpointing=activation_checkpointing,
        activation_offload=activation_offload,
        data_parallel=data_parallel,
        micro_batch_size=micro_batch_size,
        precision=precision,
        param_dtype=param_dtype,
        optimizer=optimizer,
        loss_chunk_size=loss_chunk_size,
        mlp_chunk_size=mlp_chunk_size,
        cpu_offload=cpu_offload,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        device_memory=device_memory,
        host_memory=host_memory,
        devices_per_host=devices_per_host,
        device_reserve=device_reserve,
        host_reserve=host_reserve,
        device_type=device_type,
    )
    return evaluate(per_rank)


def resolve_parallel(
    *,
    sequence_parallel_size: int,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    ring_size: int | str = 1,
    attention_heads: int | None = None,
    mode: str = "ulysses",
    fpdt_chunk_size: int | None = None,
    offload: bool = False,
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    data_parallel: str = "ddp",
    loss_chunk_size: int | None = None,
    mlp_chunk_size: int | None = None,
    cpu_offload: bool = False,
    devices_per_host: int | None = None,
) -> ResolvedConfig:
    """:func:`plan_memory`'s sequence-parallel keywords as the strategy's settings, resolved on a world of
    ``dp * sp * tp`` ranks with ``devices_per_host`` devices per node (the inverse of :func:`parallel_kwargs`).

    ``SequenceParallelConfig`` validates them, so a bad setting raises the strategy's own error; only what has
    no field there is checked here: ``mode`` (``"fpdt"`` is a non-None ``fpdt_chunk_size``, 4096 by default),
    the data-parallel size (the world's) and the devices per host. The device type is CUDA (a plan is a GPU
    run's): ``offload="auto"`` is on with FPDT. ``ring_size="auto"`` is settled here, by
    :func:`~lightning_longctx.config.auto_ring_size` of the sp size and the model's ``attention_heads`` per
    tensor-parallel rank."""
    mode = _as_mode(mode)
    if sequence_parallel_size == "auto":
        raise ValueError(
            "sequence_parallel_size='auto' needs the world the strategy sees: pass the number of ranks that "
            "share one sequence, or plan SequenceParallelConfig(...).resolve(...) through parallel_kwargs"
        )
    dp = _check_int("data_parallel_size", data_parallel_size)
    if devices_per_host is not None:
        _check_int("devices_per_host", devices_per_host)
    auto = ring_size == "auto"
    if auto and attention_heads is None:
        raise ValueError(
            "ring_size='auto' picks r from the model's attention heads: pass attention_heads= (plan_memory reads "
            "them from the model config) or a ring_size"
        )
    chunk = DEFAULT_FPDT_CHUNK_SIZE if fpdt_chunk_size is None else fpdt_chunk_size
    settings = SequenceParallelConfig(
        sequence_parallel_size=sequence_parallel_size,
        tensor_parallel_size=tensor_parallel_size,
        ring_size=1 if auto else ring_size,  # type: ignore[arg-type]  # validated by the config
        fpdt_chunk_size=chunk if mode is Mode.FPDT else None,
        offload=offload,
        activation_checkpointing=activation_checkpointing,
        activation_offload=activation_offload,
        data_parallel=data_parallel,  # type: ignore[arg-type]  # validated by the config
        loss_chunk_size=loss_chunk_size,
        mlp_chunk_size=mlp_chunk_size,
        cpu_offload=cpu_offload,
    )
    if auto:  # the TP-local heads: the all-to-all splits those
        heads = max(1, int(attention_heads) // settings.tensor_parallel_size)  # type: ignore[arg-type]
        ring = auto_ring_size(int(settings.sequence_parallel_size), heads)
        settings = dataclasses.replace(settings, ring_size=ring)
    world = dp * int(settings.sequence_parallel_size) * settings.tensor_parallel_size
    return settings.resolve(world_size=world, devices_per_node=devices_per_host or 0, device_type="cuda")


def parallel_kwargs(parallel: ResolvedConfig) -> dict[str, Any]:
    """The :func:`plan_memory` / :func:`longest_sequence` keywords a resolved strategy configuration fixes
    (``SequenceParallelConfig(...).resolve(...)``): the one mapping from the strategy's settings to the
    plan, so ``plan_memory(model_config, seq_len=N, **parallel_kwargs(cfg))`` plans what the strategy runs (its
    Ulysses x ring layout included)."""
    given = parallel.settings
    return {
        "sequence_parallel_size": parallel.sp,
        "data_parallel_size": parallel.dp,
        "tensor_parallel_size": parallel.tp,
        "ring_size": parallel.dims.ring,  # settled ("auto" against the model's heads) when resolved
        "mode": parallel.mode,
        "fpdt_chunk_size": given.fpdt_chunk_size,
        "offload": parallel.offload,
        "activation_checkpointing": parallel.activation_checkpointing,
        "activation_offload": given.activation_offload,
        "data_parallel": given.data_parallel,
        "loss_chunk_size": given.loss_chunk_size,
        "mlp_chunk_size": given.mlp_chunk_size,
        "cpu_offload": given.cpu_offload,
        "devices_per_host": parallel.dims.devices_per_node or None,
    }


def step_plan_kwargs(
    parallel: ResolvedConfig,
    *,
    seq_len: int,
    micro_batch_size: int = 1,
    precision: str = "32-true",
    param_dtype: Any = None,
    activation_checkpointing: bool = False,
    device_type: str = "cuda",
) -> dict[str, Any]:
    """The :func:`plan_memory` keywords of one training step the strategy runs: :func:`parallel_kwargs` of its
    resolved settings and the step's own inputs, the batch (``seq_len`` tokens, ``micro_batch_size``
    sequences), the trainer's ``precision``, the weights' ``param_dtype``, the module's own
    ``activation_checkpointing`` (``CausalLM``'s flag: on top of the strategy's) and the ``device_type`` the
    step runs on. ``lightning-longctx plan`` reads them from a config, the strategy's fit check
    (``fit_check.py``) from the first batch and the model: one mapping, so both plan the same step."""
    kwargs = {
        "seq_len": int(seq_len),
        **parallel_kwargs(parallel),
        "micro_batch_size": int(micro_batch_size),
        "precision": str(precision),
        "param_dtype": param_dtype,
        "device_type": device_type,
    }
    if activation_checkpointing:
        kwargs["activation_checkpointing"] = True
    return kwargs


def longest_sequence(
    config: Any, *, device_memory: int | str, sequence_parallel_size: int, **kwargs: Any
) -> int:
    """The largest ``seq_len`` whose plan (:func:`plan_memory`) fits ``device_memory`` per device, with its
    reserve, and ``host_memory`` per host when given (both are :attr:`MemoryPlan.fits`).

    Searched over multiples of ``P * fpdt_chunk_size`` (FPDT; ``2 * P * fpdt_chunk_size`` in FPDT x ring) or of
    ``P * 1024`` (Ulysses); the other
    keyword arguments are :func:`plan_memory`'s (``tensor_parallel_size`` among them: the search step does not
    depend on it). Returns 0 when not even one multiple fits.
    """
    if "seq_len" in kwargs:
        raise TypeError("longest_sequence() searches seq_len; do not pass it")
    memory = parse_bytes(device_memory)
    names = inspect.signature(resolve_parallel).parameters
    parallel = resolve_parallel(
        sequence_parallel_size=sequence_parallel_size,
        attention_heads=model_shape(config).heads,
        **{k: v for k, v in kwargs.items() if k in names},
    )
    P, chunk = parallel.sp, parallel.settings.fpdt_chunk_size  # a chunk: FPDT
    step = P * (1024 if chunk is None else chunk)  # a multiple of 2P: a ring's zigzag padding too
    if chunk is not None and parallel.dims.ring > 1:  # FPDT x ring pads to 2 P c
        step *= 2

    def fits(k: int) -> bool:
        plan = plan_memory(config, seq_len=k * step, sequence_parallel_size=P, device_memory=memory, **kwargs)
        return bool(plan.fits)

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):  # memory grows with the length: double, then bisect
        lo, hi = hi, hi * 2
        if hi * step > 1 << 40:
            return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def plan_per_rank(config: Any, *, seq_len: int, sequence_parallel_size: int, **kwargs: Any) -> _PerRank:
    """What one rank holds for :func:`plan_memory`'s keywords (tokens and heads per rank, the ring's r and U,
    dtype sizes): what :func:`plan_memory` evaluates, the step-time model prices and ``ring_size.py`` reads.
    The keywords go to :func:`resolve_parallel` (the settings) and ``build_per_rank`` (the planner's own)."""
    parallel_names = inspect.signature(resolve_parallel).parameters
    per_rank_names = inspect.signature(build_per_rank).parameters
    unknown = sorted(set(kwargs) - set(parallel_names) - set(per_rank_names))
    if unknown:
        raise TypeError(f"plan_per_rank() got unknown keywords {unknown}; it takes plan_memory's keywords")
    shape = model_shape(config)
    parallel = resolve_parallel(
        sequence_parallel_size=sequence_parallel_size,
        attention_heads=shape.heads,
        **{k: v for k, v in kwargs.items() if k in parallel_names and k != "attention_heads"},
    )
    return build_per_rank(
        shape, parallel, seq_len=seq_len, **{k: v for k, v in kwargs.items() if k in per_rank_names}
    )


def _as_mode(mode: str | Mode) -> Mode:
    """``mode`` (``"ulysses"`` / ``"fpdt"`` or a :class:`~lightning_longctx.config.Mode`) as the member."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; use 'ulysses' or 'fpdt' (chunked, optionally offloaded)")
    return Mode(mode)
