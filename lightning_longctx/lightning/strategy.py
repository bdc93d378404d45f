"""``UlyssesFPDTStrategy``: Ulysses / FPDT sequence parallelism as a Lightning strategy.

What it wires together (each part lives in its own module):
  * the dp x sp x tp layout and its one device mesh, from which every process group comes (``mesh.py``),
  * the sampler over data-parallel ranks only (every rank of an SP group reads the same sample),
  * ``shard_batch`` on every batch (``sharding.py``),
  * one ``parallelize`` call: attention swap, TP plan, activation checkpointing, FSDP2 (``parallelize.py``),
    and the data-parallel piece around it, DDP (``ddp.py``) or FSDP2 (``fsdp.py``), chosen once,
  * the gradient reduction: DDP / FSDP2 average over all dp*sp ranks; the loss is multiplied by ``sp``
    in ``backward`` so that the average becomes "sum over sp, mean over dp" — each SP rank holds
    only its tokens' share of the gradient of the SP group's global-mean loss (docs/user_guide.md,
    "Loss semantics").

Built on ``DDPStrategy`` rather than ``ModelParallelStrategy``: with ``data_parallel="ddp"`` the parameters
are replicated and DDP's bucketed all-reduce over the whole world is exactly the reduction needed; with
``"fsdp"`` (and tensor parallelism, ``tensor_parallel_size``) the one ``parallelize`` call shards them instead
and the DDP machinery is never built (docs/architecture.md). Checkpoints (``checkpoint.py``) are sharded
directories every rank writes that resume at any layout.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import textwrap
import time
import typing
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_longctx.config import (
    DEFAULT_FPDT_CHUNK_SIZE,
    SUPPORTED_PRECISION,
    ResolvedConfig,
    SequenceParallelConfig,
)
from lightning_longctx.integrations.context import BatchPositions, SequenceParallelContext
from lightning_longctx.integrations.hybrid import packed_documents_refusal
from lightning_longctx.integrations.hybrid.base import halo_error
from lightning_longctx.lightning import checkpoint as ckpt
from lightning_longctx.lightning import preemption
from lightning_longctx.lightning.fit_check import (
    Unplannable,
    check_first_step,
    device_capacity,
    enabled,
    fit_check_capacity,
)
from lightning_longctx.ops.token_mean import TokenMeanWindow
from lightning_longctx.parallel.comm import all_gather_object, all_reduce_no_grad, reaches_sequence_parallel
from lightning_longctx.parallel.fsdp import MIXED_PRECISION_DTYPES
from lightning_longctx.parallel.mesh import ParallelLayout, WorldMesh, build_world_mesh
from lightning_longctx.parallel.parallelize import Parallelized, data_parallel_for, parallelize
from lightning_longctx.parallel.sharding import global_positions, shard_batch
from lightning_longctx.planner import MemoryPlan
from lightning_longctx.planner.flops import find_hf_config
from lightning_longctx.planner.shapes import text_config


def _config_arguments(config_cls: type) -> Any:
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


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(SequenceParallelConfig))
#: ``DDPStrategy``'s own keywords that configure DDP (FSDP reads none of them).
_DDP_STRATEGY_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
#: ``DistributedDataParallel`` arguments the strategy sets itself: the reduction spans all dp x sp ranks.
_SET_BY_STRATEGY = ("module", "device_ids", "output_device", "process_group", "device_mesh")


def _is_default(value: Any, param: inspect.Parameter) -> bool:
    try:
        return value is param.default or bool(value == param.default)
    except Exception:  # a value without a plain ==
        return False


def _check_keywords(kwargs: dict[str, Any], data_parallel: str) -> None:
    """Refuse keywords that nothing would read (a typo, a setting of another strategy) and DDP's keywords
    under ``data_parallel="fsdp"``: silently dropped, they would leave the user believing a feature is on.
    What ``DDPStrategy`` reads: its named arguments, and the rest as ``DistributedDataParallel``'s. A DDP
    keyword at its default changes nothing and passes (LightningCLI gives every one of them)."""
    strategy = dict(inspect.signature(DDPStrategy.__init__).parameters)
    ddp = dict(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)
    for own in ("self", "kwargs"):
        strategy.pop(own)
        ddp.pop(own, None)
    ddp["gradient_as_bucket_view"] = ddp["gradient_as_bucket_view"].replace(default=True)  # our default
    ddp_only = {n: p for n, p in {**strategy, **ddp}.items() if n in ddp or n in _DDP_STRATEGY_ONLY}
    for name, value in kwargs.items():
        if name not in strategy and name not in ddp:
            known = sorted({*_CONFIG_FIELDS, *strategy, *ddp} - set(_SET_BY_STRATEGY))
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = (
                f"; did you mean {close[0]!r}?" if close else f"; known settings: {', '.join(_CONFIG_FIELDS)}"
            )
            raise TypeError(f"UlyssesFPDTStrategy got an unknown setting {name!r}{hint}")
        if name in _SET_BY_STRATEGY and not _is_default(value, ddp[name]):
            raise TypeError(
                f"UlyssesFPDTStrategy sets DistributedDataParallel's {name!r} itself (its gradient reduction "
                f"spans all data- x sequence-parallel ranks); remove {name}={value!r}"
            )
        if data_parallel == "fsdp" and name in ddp_only and not _is_default(value, ddp_only[name]):
            raise TypeError(
                f"{name}={value!r} configures DDP, but data_parallel='fsdp' shards with FSDP2, which would ignore "
                "it; remove it, or use data_parallel='ddp'"
            )


@_config_arguments(SequenceParallelConfig)
class UlyssesFPDTStrategy(DDPStrategy):
    """Sequence parallelism (Ulysses, optionally FPDT-chunked) x data parallelism for Lightning.

    Args:
        {config_args}
        process_group_backend: as in ``DDPStrategy`` (``"nccl"`` on CUDA, ``"gloo"`` on CPU by default).
        timeout: as in ``DDPStrategy``.
        gradient_as_bucket_view: DDP's, but True by default here (the gradients live in DDP's buckets,
            not in a second copy).
        fit_check: plan the first training step with the memory planner against the device's memory before
            it runs, and refuse it where it will not fit, naming the planned peak, its largest terms, the
            capacity and the cheapest settings that fit (``fit_check.py``; :attr:`fit_plan` holds the plan).
            ``"auto"`` (default): on CUDA, or wherever ``fit_check_device_memory`` is given; ``True``: always
            (off CUDA it needs ``fit_check_device_memory``); ``False``: never. A step that fits with less than
            5 % of the memory free is warned about; a model the planner cannot plan (no transformers model,
            mixture of experts, an optimizer other than AdamW / Adam / plain SGD, ...) is not checked (one
            info line says why).
        fit_check_device_memory: the memory per device to plan against instead of the device's total: a size
            (``"80GiB"``, ``"141GB"``, bytes) or a device kind of the planner (``"a100-40gb"``, ``"a100-80gb"``,
            ``"h100"``, ``"h200"``, ``"b200"``); on a CPU, which has no device memory to read, it turns the
            check on (a CPU run's plan reserves no CUDA context).
        self_test: before the first training step, run each transformers model as parallelized against the
            same model with sequence parallelism off on a short probe, on every rank, on these devices and
            kernels, and refuse the run (:class:`~lightning_longctx.parallel.self_test.SelfTestFailed`, naming the first
            module that diverges) where they differ beyond the compute dtype's tolerance (``self_test.py``,
            docs/user_guide.md). Nothing of the run changes when they agree. ``"auto"`` (default) and ``True``:
            on (a plain module, which calls our attention itself, cannot be tested: ``"auto"`` says so in the
            log, ``True`` refuses it at setup); ``False``: off, said in the log.
        kwargs: the settings above, and ``DDPStrategy``'s own (e.g. DDP's ``find_unused_parameters``).
            Any other keyword raises a ``TypeError`` naming the closest setting, and so do DDP's
            keywords away from their defaults with ``data_parallel="fsdp"`` (FSDP2 would ignore them).
    """

    strategy_name = "ulysses_fpdt"

    def __init__(
        self,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        gradient_as_bucket_view: bool = True,
        fit_check: bool | Literal["auto"] = "auto",
        fit_check_device_memory: int | str | None = None,
        self_test: bool | Literal["auto"] = "auto",
        **kwargs: Any,
    ) -> None:
        settings = {name: kwargs.pop(name) for name in _CONFIG_FIELDS if name in kwargs}
        self.sp_config = SequenceParallelConfig(**settings)  # bad settings fail before any DDP set-up
        # gradients as views into DDP's all-reduce buckets (DDP's default keeps a second full copy); a named
        # argument so that LightningCLI's value is ours, not DDP's default
        kwargs["gradient_as_bucket_view"] = gradient_as_bucket_view
        _check_keywords(kwargs, self.sp_config.data_parallel)
        for name in _SET_BY_STRATEGY:  # at their defaults (else refused above): LightningCLI passes them all
            kwargs.pop(name, None)
        if self.sp_config.data_parallel == "fsdp":
            del kwargs["gradient_as_bucket_view"]  # at its default (else refused above): nothing to pass on
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self._config: ResolvedConfig | None = None
        self._world: WorldMesh | None = None  # the one device mesh (mesh.py), built in setup_environment
        #: the data-parallel piece (parallelize.data_parallel_for): DDP over the replicas, or FSDP2
        self._data_parallel: Any = None
        self._precision = "32-true"  # Lightning's, read in setup
        self._fitting = False
        self._token_mean: TokenMeanWindow | None = None
        self._parallelized = Parallelized()  # what parallelize did to the models; teardown undoes it
        self._saver = ckpt.Saver()  # sharded checkpoint writes, synchronous or in the background
        self._tp_gradients_checked = False  # the first optimizer step checks the replicated gradients (TP)
        self._batches_sharded = 0
        self._verified = False
        self._checked_batch = False
        #: tokens per FPDT chunk per rank for the current batch (plain models pass it to fpdt_attention)
        self.current_chunk_size: int | None = None
        # the fit check (fit_check.py): the first training batch's step planned against the device's memory
        self._fit_check = fit_check
        self._fit_check_memory = fit_check_capacity(fit_check, fit_check_device_memory)  # None: the device's
        self._fit_check_device = fit_check_device_memory  # as given, for the messages
        self._fit_check_pending = fit_check is not False
        self._fit_plan: MemoryPlan | None = None
        if self_test not in (True, False, "auto"):
            raise ValueError(f"self_test={self_test!r} must be 'auto', True or False")
        self._self_test = self_test
        self._self_test_pending = self_test is not False
        #: the self-test's reports (``self_test.SelfTestReport``), one per model, once it ran
        self.self_test_reports: list[Any] = []

    # ---- layout ----
    @property
    def config(self) -> ResolvedConfig:
        """The settings resolved for this world (``SequenceParallelConfig.resolve``): the one object the
        model patching, the batch sharding and the loss read."""
        if self._config is None:
            self._config = self.sp_config.resolve(
                self.world_size, self.num_processes, self.root_device.type, heads=self._model_heads()
            )
        return self._config

    def _model_heads(self) -> int | None:
        """The query heads of the LightningModule's transformers model, read for ``ring_size="auto"`` only."""
        if self.sp_config.ring_size != "auto" or self.lightning_module is None:
            return None
        config = find_hf_config(self.lightning_module)
        heads = None if config is None else getattr(text_config(config), "num_attention_heads", None)
        return heads if isinstance(heads, int) and heads > 0 else None

    @property
    def layout(self) -> ParallelLayout:
        return self.config.layout

    @property
    def world_mesh(self) -> WorldMesh:
        """The one device mesh and its views (mesh.py); every process group the strategy uses is in it."""
        if self._world is None:
            raise RuntimeError(
                "the device mesh exists between the strategy's setup and its teardown (the end of fit, which "
                "destroys its process groups); it was read outside them"
            )
        return self._world

    @property
    def device_mesh(self) -> Any:
        """The root ``DeviceMesh``: axes ``("data_parallel", "sequence_parallel", "tensor_parallel")`` (``(dp_sp,
        tensor_parallel)`` on a torch without ``DeviceMesh._flatten``; see ``mesh.build_world_mesh``)."""
        return self.world_mesh.root

    @property
    def sp_size(self) -> int:
        return self.layout.sp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def sp_rank(self) -> int:
        return self.layout.sp_rank(self.global_rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.global_rank)

    @property
    def tp_group(self) -> Any:
        return self.world_mesh.tp_group

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.global_rank)

    @property
    def sp_group(self) -> Any:
        return self.world_mesh.sp_group

    @property
    def dp_group(self) -> Any:
        return self.world_mesh.dp_group

    @property
    def offload(self) -> bool:
        return self.config.offload

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._config = None  # resolved again now that the world is known
        cfg, layout = self.config, self.layout
        if layout.spans_nodes:
            rank_zero_warn(
                f"sequence_parallel_size={layout.sp} spans nodes ({layout.devices_per_node} devices per "
                "node): its all-to-alls cross the network. Prefer a divisor of the devices per node"
            )
        self._world = build_world_mesh(layout, self.root_device.type)
        self._data_parallel = data_parallel_for(
            self._world,
            cfg,
            comm_state=self._ddp_comm_state,
            comm_hook=self._ddp_comm_hook,
            comm_wrapper=self._ddp_comm_wrapper,
            **self._ddp_kwargs,
        )
        if cfg.settings.loss_normalization == "tokens":
            # the gradient reduction averages over the dp x sp replicas (TP peers hold the same loss)
            self._token_mean = TokenMeanWindow(
                world_size=layout.replicas, dp_size=layout.dp, ignore_index=cfg.settings.ignore_index
            )
        rank_zero_info(f"UlyssesFPDTStrategy: {cfg}")

    @override
    def _get_process_group_backend(self) -> str:
        backend = super()._get_process_group_backend()
        if self.sp_config.cpu_offload and self.root_device.type != "cpu" and ":" not in backend:
            # the sharded gradients live on the host: gradient clipping's norm is reduced over CPU tensors
            return f"{self.root_device.type}:{backend},cpu:gloo"
        return backend

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # Lightning checks SLURM's --ntasks-per-node against `devices` only inside its own launcher,
        # which srun makes it skip; a mismatch would otherwise surface later as an IndexError.
        if self.cluster_environment is not None and self.cluster_environment.creates_processes_externally:
            self.cluster_environment.validate_settings(
                num_devices=self.num_processes, num_nodes=self.num_nodes
            )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The sampler spans data-parallel ranks only: all ranks of an SP group read the same sample.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    # ---- model ----
    @override
    def setup(self, trainer: Any) -> None:
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"precision={precision!r} is not supported by UlyssesFPDTStrategy; use one of {SUPPORTED_PRECISION}"
            )
        self._precision = precision
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        if self._fitting:  # every fit checks its own first step
            self._self_test_pending, self.self_test_reports = self._self_test is not False, []
        # a preemption signal sets a flag; every rank saves at the next optimizer step (preemption.py)
        preemption.install(trainer)
        if self.layout.tp > 1:  # gradient clipping by norm over the gradients of both meshes (TP, dp x sp)
            from lightning_longctx.parallel.tensor_parallel import clip_grad_norm_

            plugin = self.precision_plugin
            plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(
                plugin.main_params(optimizer), clip_val
            )
        # DDPStrategy.setup's steps, with the one parallelize call between placing and wrapping the model
        self.accelerator.setup(trainer)
        if self._fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not self._fitting:  # nothing else makes the replicas equal (DDP broadcasts when it wraps)
            _sync_module_states(self.model)
        # attention swap, TP plan, activation checkpointing, FSDP2 (parallelize.py). bf16-mixed / 16-mixed:
        # FSDP2 computes in the low dtype over fp32 master weights (Lightning's autocast stays on: harmless over
        # low-precision parameters, and it keeps its fp32 ops in fp32); DDP reads no param_dtype
        self._parallelized = parallelize(
            self.model,
            self.world_mesh,
            self.config,
            param_dtype=MIXED_PRECISION_DTYPES.get(self._precision),
            before_sharding=self._float32_self_test,
        )
        if self.layout.ring > 1 and not self._contexts:  # a plain module's own attention reads no ring layout
            raise ValueError(
                f"ring_size={self.layout.ring} needs a transformers model in the LightningModule (the strategy "
                "swaps its attention for Ulysses x ring and shards batches zigzag over the ring); a plain module "
                "calling ulysses_attention / fpdt_attention itself would attend in the wrong order. Use "
                "ring_size=1, or call lightning_longctx.attention.ring.usp_attention in your module with "
                "batches from shard_batch(..., ring=ring_size)"
            )
        self._announce_self_test()
        if self._fitting:
            self.configure_ddp()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self._fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as post_localSGD

            if isinstance(self._ddp_comm_state, post_localSGD.PostLocalSGDState):
                self._enable_model_averaging()

    def _announce_self_test(self) -> None:
        """Setup: say when the self-test will not run, or refuse ``self_test=True`` where it cannot."""
        if not self._fitting or self._self_test is False:
            if self._fitting:
                rank_zero_info("UlyssesFPDTStrategy self-test off (self_test=False): the run is not checked")
            return
        if not self._contexts and self.sp_size > 1:
            why = (
                "the LightningModule holds no transformers model; a plain module calls our attention itself and "
                "has no sequence-parallel-off twin to compare with"
            )
            if self._self_test is True:
                raise ValueError(f"self_test=True cannot run: {why}. Use self_test='auto' or False")
            rank_zero_info(f"UlyssesFPDTStrategy self-test skipped: {why}")

    @property
    def _contexts(self) -> list[SequenceParallelContext]:
        """The patched models' contexts (their guardrail counters, the current batch's positions)."""
        return self._parallelized.contexts

    @override
    def teardown(self) -> None:
        self._saver.close()  # a checkpoint still being written in the background is finished and committed
        # The models leave the strategy as they came: plain attention, loss, forward and checkpointing again
        # (TP and FSDP2 stay: a model sharded once keeps its shards).
        self._parallelized.undo()
        super().teardown()
        # the mesh's groups end here (a gloo group keeps threads), but those an FSDP2 / TP model's shards live
        # on: it uses them after the fit (full_state_dict, save_checkpoint, its next fit)
        if self._world is not None:
            self._world.destroy(keep_sharding=self.sp_config.data_parallel == "fsdp")
            self._world = None

    # ---- the data-parallel piece: DDP (ddp.py) or FSDP2 (fsdp.py), chosen once in setup_environment ----
    @override
    def model_to_device(self) -> None:
        # under cpu_offload FSDP2's piece keeps the transformers models on the host (where tensor_init_context
        # built them): fully_shard moves one block at a time to the device and keeps its shard on the host
        self._data_parallel.model_to_device(self.model, self.root_device)

    @override
    def configure_ddp(self) -> None:
        # fitting only: DDP over the replicas with its comm hooks (ddp.py), or the model as parallelize
        # sharded it (FSDP2, whose modules Lightning's DDP hook registration must not see)
        self.model = self._data_parallel.wrap(self.model, self.determine_ddp_device_ids())

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # configure_model runs in it: under cpu_offload the model is built on the host, never whole on the device
        with (
            super().tensor_init_context(empty_init),
            torch.device("cpu") if self.sp_config.cpu_offload else nullcontext(),
        ):
            yield

    # ---- checkpoints (checkpoint.py) ----
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # a checkpoint loads into the model and optimizers as set up (sharded, offloaded, TP-split): each
        # rank reads the pieces of its own layout, whatever layout saved them
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself, in both formats

    @property
    def _sharded_checkpoints(self) -> bool:
        return self.sp_config.checkpoint_format == "sharded"

    def _raw_optimizers(self) -> list[Any]:
        return [getattr(optimizer, "_optimizer", optimizer) for optimizer in self.optimizers]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The state a checkpoint saves: each rank's own shards (``checkpoint_format="sharded"``) or the full
        state on rank 0 (``"full"``). A collective under FSDP: every rank calls it."""
        return ckpt.model_state(self.lightning_module, full=not self._sharded_checkpoints)

    def full_state_dict(self) -> dict[str, Any]:
        """The LightningModule's full state dict, keys as ``lightning_module.state_dict()``: under FSDP gathered
        to the host of rank 0 (the other ranks get an empty dict; a collective: every rank calls it), under
        DDP every rank's own replica."""
        if self.sp_config.data_parallel == "ddp":
            return dict(self.lightning_module.state_dict())
        return ckpt.model_state(self.lightning_module, full=True)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return ckpt.optimizer_state(self.lightning_module, optimizer, full=not self._sharded_checkpoints)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model already, into its current layout

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # and the optimizers

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``filepath`` (every rank calls it): into ``.partial-<name>`` first, committed
        by rank 0 (marker, then rename) once every rank has written its part (checkpoint.py)."""
        if storage_options is not None:
            raise TypeError(
                "UlyssesFPDTStrategy writes its checkpoints itself and takes no `storage_options`; "
                f"got {storage_options!r}. Remove it"
            )
        path = Path(self.broadcast(str(filepath)))
        record = self._commit_record(checkpoint)
        self._saver.wait()  # one save in flight at a time; its directory is committed before the next starts
        partial = ckpt.partial_path(path)
        if self.is_global_zero:
            ckpt.remove(partial)  # a previous attempt killed mid-save
            (partial if self._sharded_checkpoints else partial.parent).mkdir(parents=True, exist_ok=True)
        if not self._sharded_checkpoints:
            if self.is_global_zero:
                # torch.save straight to the file: Lightning's CheckpointIO serialises the whole checkpoint in
                # memory first (twice the state at the peak); atomicity comes from the rename in commit()
                torch.save(checkpoint, partial)
                ckpt.commit(partial, path, record)
            self.barrier("save_checkpoint")
            return
        state = {ckpt.MODEL_KEY: checkpoint.pop("state_dict")}
        for index, optimizer in enumerate(checkpoint.pop("optimizer_states", ())):
            state[ckpt.optimizer_key(index)] = optimizer
        self.barrier("save_checkpoint")  # rank 0 made the partial directory
        self._saver.save(
            state,
            checkpoint,
            partial,
            path,
            record,
            is_zero=self.is_global_zero,
            background=self.sp_config.async_save,
        )
        self.barrier("save_checkpoint")

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint written in the background (``async_save=True``) is on disk and committed
        (every rank calls it); a failed write raises here. The next save, a preemption save and teardown call
        it themselves; a no-op when nothing is in flight."""
        self._saver.wait()

    def _commit_record(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        import lightning
        import transformers

        layout = self.layout
        return {
            "format": self.sp_config.checkpoint_format,
            "global_step": int(checkpoint.get("global_step", -1)),
            "epoch": int(checkpoint.get("epoch", -1)),
            "layout": {
                "world_size": layout.world_size,
                "data_parallel": layout.dp,
                "sequence_parallel": layout.sp,
                "tensor_parallel": layout.tp,
                "data_parallel_mode": self.sp_config.data_parallel,
                "mode": str(self.config.mode),
                "cpu_offload": self.sp_config.cpu_offload,
            },
            # torch.distributed.checkpoint promises no compatibility across torch versions
            "versions": {
                "torch": torch.__version__,
                "lightning": lightning.__version__,
                "transformers": transformers.__version__,
            },
        }

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of either format into the set-up model and optimizers (each rank its own
        pieces; a full file memory-mapped) and return the rest (loops, callbacks, schedulers) for Lightning."""
        path = Path(checkpoint_path)
        strict = self.lightning_module.strict_loading
        optimizers = self._raw_optimizers() if self._fitting else []
        if ckpt.is_sharded_checkpoint(path):
            ckpt.load_sharded(path, self.lightning_module, optimizers, strict)
            return torch.load(path / ckpt.META_FILE, map_location="cpu", weights_only=False)
        if path.is_dir():
            raise ValueError(
                f"ckpt_path={str(path)!r} is a directory without .metadata: not a (committed) sharded checkpoint. "
                "Pass a committed checkpoint, e.g. lightning_longctx.lightning.checkpoint.latest_checkpoint(run_dir)"
            )
        loaded = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        ckpt.load_full_state(self.lightning_module, optimizers, loaded, strict)
        return loaded

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # retention: after the save in flight (async_save) is committed
            self._saver.remove_after_commit(filepath)

    # ---- batches ----
    def chunk_size_for(self, seq_len: int) -> int | None:
        """Tokens per FPDT chunk per rank for a global sequence of ``seq_len`` tokens (None for Ulysses)."""
        return self.config.chunk_for(seq_len)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if not self._checked_batch:
            self._check_batch_across_ranks(ids)
        if self._fit_check_pending and self.lightning_module.trainer.training:
            self._check_first_step_fits(batch)
        chunk = self.chunk_size_for(ids.shape[1]) if isinstance(ids, Tensor) else None
        self.current_chunk_size = chunk
        if self._token_mean_active and self.lightning_module.trainer.training:
            self._token_mean.count(batch, self.lightning_module.trainer.accumulate_grad_batches)
        out = shard_batch(
            batch,
            group=self.sp_group,
            chunk_size=chunk,
            ignore_index=self.config.settings.ignore_index,
            pad_token_id=self.config.settings.pad_token_id,
            ring=self.layout.ring,
        )
        if self._contexts and isinstance(out.get("position_ids"), Tensor):  # the documents, no collective
            full = global_positions(batch, group=self.sp_group, chunk_size=chunk, ring=self.layout.ring)
            for ctx in self._contexts:
                ctx.positions = BatchPositions(local=out["position_ids"], full=full, length=ids.shape[1])
            self._check_positions(batch, ids.shape[1])
            self._check_hybrid_batch(out["position_ids"].shape[-1], chunk)
        if self._self_test_pending and self.lightning_module.trainer.training:
            self._run_self_test(batch)
        self._batches_sharded += 1
        return out

    # ---- the self-test (self_test.py) ----
    @property
    def _float32_before_sharding(self) -> bool:
        """FSDP2 under a ``*-mixed`` precision computes in its low ``param_dtype``: no float32 run is possible
        after it shards, so the self-test's float32 check runs just before, on the model every device holds
        whole at that point (with ``cpu_offload`` the host holds it: not checked in float32)."""
        return (
            self._fitting
            and self._self_test is not False
            and self.sp_config.data_parallel == "fsdp"
            and self._precision.endswith("-mixed")
            and not self.sp_config.cpu_offload
        )

    def _float32_self_test(self, done: Parallelized) -> None:
        """``parallelize``'s hook before FSDP2: the float32 check on a probe of synthetic tokens (no batch is at
        hand yet), the same probe rules; two packed documents unless a mixer refuses them."""
        from lightning_longctx.parallel.self_test import synthetic_batch

        if not self._float32_before_sharding or not done.contexts:
            return
        try:
            self._self_test_run(
                done,
                synthetic_batch(done.models[0], self.root_device),
                "in float32, before FSDP2 shards the model, ",
                precision="32-true",
                autocast=lambda: torch.autocast(self.root_device.type, enabled=False),
                packed=all(packed_documents_refusal(ctx) is None for ctx in done.contexts),
            )
        except BaseException:
            done.undo()  # raised inside parallelize: the strategy holds no handle yet to undo it at teardown
            raise

    def _run_self_test(self, batch: Mapping[str, Any]) -> None:
        """The first training batch, after its checks, before its forward: every patched model against itself
        with sequence parallelism off (every rank; the verdict agreed inside)."""
        self._self_test_pending = False
        if not self._contexts:
            return  # said at setup
        self._self_test_run(
            self._parallelized,
            batch,
            "",
            precision=self._precision,
            autocast=self.precision_plugin.train_step_context,
            # FSDP2 computes in the low param_dtype of a "-mixed" precision: its float32 check ran before it sharded
            fp32_layout=self._precision.endswith("-mixed") and self.sp_config.data_parallel == "ddp",
        )

    def _self_test_run(
        self, done: Parallelized, batch: Mapping[str, Any], when: str, **settings: Any
    ) -> None:
        """``self_test.run_self_test`` of ``done``'s models on ``batch`` with this strategy's layout; its reports
        kept in :attr:`self_test_reports`, one info line on a match (it raises on a mismatch)."""
        from lightning_longctx.parallel.self_test import run_self_test

        start = time.perf_counter()
        reports = run_self_test(
            list(done.models),
            list(done.contexts),
            batch,
            config=self.config,
            group=self.sp_group,
            device=self.root_device,
            **settings,
        )
        self.self_test_reports += reports
        rank_zero_info(
            f"UlyssesFPDTStrategy self-test {when}passed in {time.perf_counter() - start:.2f} s: "
            + "; ".join(r.summary() for r in reports)
        )

    def _self_test_probe(self, batch: Any) -> tuple[int, int] | None:
        """``(rows, tokens)`` of the self-test's probe for ``batch`` (``None``: no self-test will run)."""
        if not self._self_test_pending or not self._contexts:
            return None
        from lightning_longctx.parallel.self_test import probe_shape

        rows = min(2, int(batch["input_ids"].shape[0]))
        halo = max(ctx.mixer_halo for ctx in self._contexts)
        return rows, probe_shape(self.config, halo, packed=False).length

    # ---- the fit check (fit_check.py) ----
    @property
    def fit_plan(self) -> MemoryPlan | None:
        """The memory plan of the first training step the fit check made (``plan.table()`` prints it): ``None``
        before it, or when the check was off or could not plan the model."""
        return self._fit_plan

    def _check_first_step_fits(self, batch: Any) -> None:
        """The first training batch, before its forward: plan its step (no collective; alike on every rank)
        against the device's memory, the smallest of all ranks', and refuse it on every rank where it does not
        fit (the verdicts agreed by one all-reduce); a model the planner cannot plan is not checked."""
        self._fit_check_pending = False
        capacity, device = self._fit_check_memory, self.root_device
        if not enabled(self._fit_check, capacity, device.type):
            return
        where = f"fit_check_device_memory={self._fit_check_device!r}"
        if capacity is None:
            total, where = device_capacity(device)
            capacity = int(all_reduce_no_grad(torch.tensor([total], device=device), op="min")[0])
        verdict = None
        try:
            verdict = check_first_step(
                self.lightning_module,
                list(self._parallelized.models),
                self._raw_optimizers(),
                self.config,
                batch,
                precision=self._precision,
                capacity=capacity,
                where=where,
                device_type=device.type,
                probe=self._self_test_probe(batch),
            )
        except Unplannable as why:
            rank_zero_info(
                f"UlyssesFPDTStrategy fit check skipped, the memory planner cannot plan this step: {why}"
            )
        except Exception as err:  # never fail a run because of the check itself
            rank_zero_info(f"UlyssesFPDTStrategy fit check skipped: {type(err).__name__}: {err}")
        refused = verdict is not None and not verdict.fits
        if all_reduce_no_grad(torch.tensor([float(refused)], device=device), op="max")[0]:
            raise ValueError(
                verdict.message if refused else "the fit check refused the first step on another rank"
            )
        if verdict is not None:
            self._fit_plan = verdict.plan
            (rank_zero_warn if verdict.warn else rank_zero_info)(verdict.message)

    def _check_positions(self, batch: Mapping[str, Any], seq_len: int) -> None:
        """RoPE models: no position past what the model's rotary embedding covers (``integrations/rope.py``),
        decided alike on every rank before the forward: from the sequence length (the same on every rank) when
        the batch brings no ``position_ids``, else from its largest position, one small all-reduce (packed
        documents restart their positions: a long row of short documents is fine)."""
        limits = [(ctx, ctx.rope_limit) for ctx in self._contexts if ctx.rope_limit is not None]
        if not limits or (seq_len <= min(r.limit for _, r in limits) and "position_ids" not in batch):
            return
        longest = seq_len
        if "position_ids" in batch:
            length = self._contexts[0].positions.sequence_length().reshape(1)
            longest = int(all_reduce_no_grad(length, op="max")[0])
        for ctx, limit in limits:
            if longest > limit.limit:
                raise limit.error(ctx.model_name, longest)

    def _check_hybrid_batch(self, local_len: int, chunk: int | None) -> None:
        """Hybrid models: what their mixers refuse (packed documents, segments shorter than a conv's halo),
        decided on every rank before the forward (one small all-reduce): data-parallel ranks see different
        samples, and a refusal raised on some ranks inside the forward would leave the others waiting."""
        hybrids = [ctx for ctx in self._contexts if ctx.num_mixers]
        if not hybrids:
            return
        # packed rows are exact where every mixer resets its state at a document start (hybrid/__init__.py)
        # (the refusal depends on the mixers only, so every rank raises the same one)
        refusal = next((r for r in map(packed_documents_refusal, hybrids) if r is not None), None)
        packed = refusal is not None and any(
            ctx.positions is not None and ctx.positions.documents() is not None for ctx in hybrids
        )
        segment = chunk or (local_len // 2 if self.layout.ring > 1 else local_len)  # a ring rank's two runs
        short = any(segment < ctx.mixer_halo for ctx in hybrids)
        flags = all_reduce_no_grad(
            torch.tensor([float(packed), float(short)], device=self.root_device), op="max"
        )
        ctx = hybrids[0]
        if flags[0]:
            raise refusal
        if flags[1]:
            raise halo_error(
                ctx.model_name,
                ctx.mixer_halo,
                segment,
                local_len,
                ring=self.layout.ring if chunk is None else 1,
            )

    def _check_batch_across_ranks(self, ids: Tensor | None) -> None:
        """First batch: every rank of an SP group must hold the same sample, and all shapes must agree
        (a mismatch would otherwise deadlock or silently mix samples inside the all-to-alls)."""
        if isinstance(ids, Tensor):
            digest = hashlib.sha1(ids.detach().cpu().numpy().tobytes()).hexdigest()
            mine: tuple[Any, ...] = (tuple(ids.shape), digest)
        else:
            mine = (None, None)
        everyone = all_gather_object(mine)
        shapes = {r: s for r, (s, _) in enumerate(everyone)}
        if len(set(shapes.values())) > 1:
            raise RuntimeError(
                f"batch input_ids shapes differ across ranks: {shapes}. All ranks must use the same batch size "
                "and sequence length (pad or pack to a fixed length in the dataset/collate_fn)"
            )
        share = (
            self.sp_size * self.tp_size
        )  # the consecutive ranks of one dp index (sp x tp) share a sequence
        for start in range(0, len(everyone), share):
            digests = {everyone[r][1] for r in range(start, start + share)}
            if len(digests) > 1:
                raise RuntimeError(
                    f"ranks {list(range(start, start + share))} share one sequence (sequence x tensor parallel) but received different "
                    "samples; the training sampler must span data-parallel ranks only. Do not pass your own "
                    "DistributedSampler (let Lightning add it: use_distributed_sampler=True)"
                )
        self._checked_batch = True

    # ---- steps ----
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._batches_sharded == 0:
            raise RuntimeError(
                "the training batch never went through UlyssesFPDTStrategy.batch_to_device, so it was not sharded "
                "along the sequence (training_step(dataloader_iter) bypasses it). Use training_step(batch, batch_idx)"
            )
        if self._verified:
            return super().training_step(*args, **kwargs)
        for ctx in self._contexts:
            ctx.attention_calls = ctx.mixer_calls = 0
        out = super().training_step(*args, **kwargs)
        self._verify_first_step(out.get("loss") if isinstance(out, Mapping) else out)
        self._verified = True
        return out

    def _verify_first_step(self, loss: Any) -> None:
        """Transformers models: every attention layer and mixer went through our functions (the counters on
        their contexts). Plain models: the loss depends on a sequence-parallel collective (its autograd
        graph; not checked when the graph cannot tell: manual optimisation, reentrant checkpointing)."""
        for ctx in self._contexts:
            if ctx.attention_calls < ctx.num_attention_layers:
                raise RuntimeError(
                    f"only {ctx.attention_calls} of {ctx.num_attention_layers} attention layers went through "
                    "sequence-parallel attention in the first step; the rest attended only to their local shard. "
                    "The model bypasses transformers' AttentionInterface somewhere and cannot be trained this way"
                )
            if ctx.mixer_calls < ctx.num_mixers:
                raise RuntimeError(
                    f"only {ctx.mixer_calls} of {ctx.num_mixers} hybrid mixers (convolutions, linear attention, "
                    "state-space layers) ran in the first step; the model calls them some way we did not patch"
                )
        if self.sp_size > 1 and not self._contexts and reaches_sequence_parallel(loss) is False:
            raise RuntimeError(
                f"sequence_parallel_size={self.sp_size} but the first training step ran no sequence-parallel "
                "attention: each rank would attend only to its own shard. Call lightning_longctx.ulysses_attention "
                "/ fpdt_attention with trainer.strategy.sp_group in your model, or use a transformers model"
            )

    # ---- loss normalisation (token_mean.py) ----
    @property
    def _token_mean_active(self) -> bool:
        # Manual optimisation calls backward and step itself: Lightning's semantics, x sp below.
        return self._token_mean is not None and self.lightning_module.automatic_optimization

    @property
    def loss_is_token_mean(self) -> bool:
        """Whether optimizer steps use the token mean over the global batch (see :attr:`step_loss`)."""
        return self._token_mean_active

    @property
    def step_loss(self) -> Tensor | None:
        """The last optimizer step's loss as one device computes it on the global batch: the sum of token
        losses over all dp ranks and micro-batches of the window / its valid-token count (a 0-dim fp32
        CPU tensor, equal on every rank). ``None`` with ``loss_normalization="micro_batch"``."""
        return None if self._token_mean is None else self._token_mean.step_loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._token_mean_active:
            loss = self._token_mean.backward_loss(
                closure_loss, self.lightning_module.trainer.accumulate_grad_batches
            )
        else:
            # DDP / FSDP average over the dp*sp replicas; SP ranks hold partial gradients that must be summed: x sp.
            loss = closure_loss * self.sp_size
        return super().backward(loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.layout.tp > 1 and not self._tp_gradients_checked:
            closure = self._checking_replicated_gradients(closure)
        if not self._token_mean_active:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        window = self._token_mean

        def closure_then_normalise() -> Any:
            # The closure runs the window's last micro-batch; Lightning clips and steps after it returns.
            out = closure()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            window.finish(params, self.dp_group)
            return out

        return super().optimizer_step(optimizer, closure_then_normalise, model, **kwargs)

    def _checking_replicated_gradients(self, closure: Any) -> Any:
        """The first optimizer step's closure, then the check that every parameter the TP plan does not split
        has the same gradient on all TP ranks (``tensor_parallel.check_replicated_gradients``): a model
        whose plan misses a parameter is refused before its first update."""
        from lightning_longctx.parallel.tensor_parallel import check_replicated_gradients

        def closure_then_check() -> Any:
            out = closure()
            check_replicated_gradients(self.lightning_module.named_parameters(), self.tp_group)
            self._tp_gradients_checked = True
            return out

        return closure_then_check

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets = {
            "ulysses_fpdt": (
                "Ulysses + FPDT chunking (4096 tokens per chunk per rank), host offload on CUDA",
                {"fpdt_chunk_size": DEFAULT_FPDT_CHUNK_SIZE, "offload": "auto"},
            ),
            "ulysses": ("Ulysses sequence parallelism, no chunking", {"fpdt_chunk_size": None}),
            "fpdt_offload": (
                "FPDT chunking with host offload of cold key/value chunks",
                {"fpdt_chunk_size": DEFAULT_FPDT_CHUNK_SIZE, "offload": True},
            ),
        }
        for name, (description, init_params) in presets.items():
            if name not in strategy_registry:  # idempotent: the module may be imported again in children
                strategy_registry.register(name, cls, description=description, **init_params)
