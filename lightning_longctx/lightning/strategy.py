"""``UlyssesFPDTStrategy``: Ulysses / FPDT sequence parallelism as a Lightning strategy.

Thin Lightning glue on ``ParallelStrategy`` over the run's :class:`~lightning_longctx.parallel.plan.ParallelPlan`
(``parallel/plan.py``), which does the work and runs without Lightning:

  * ``setup_environment``: the processes (``mesh.init_world``), the settings resolved for the world, the plan
    (its dp x sp x tp device mesh, from which every process group comes, and its data-parallel piece);
  * ``setup``: the plan's model half (attention swap, TP plan, activation checkpointing, then FSDP2 shards or
    DDP wraps), the optimizers;
  * ``batch_to_device``: the plan's batch half (sharding, positions, every batch refusal); before the first
    training batch's forward, the fit check (``fit_check.py``) and the self-test (``parallel/self_test.py``);
  * the sampler over data-parallel ranks only (every rank of an SP group reads the same sample);
  * the gradient reduction: DDP / FSDP2 average over all dp*sp ranks; ``backward`` rescales the loss to the
    token mean of the global batch (``ops/token_mean.py``), or multiplies it by ``sp``, so that the average
    becomes "sum over sp, mean over dp" (docs/user_guide.md, "Loss semantics");
  * checkpoints (``checkpoint.py``): sharded directories every rank writes, which resume at any layout;
    the preemption flag (``preemption.py``).

What it takes from Lightning beyond the public hooks: its launchers (``_SubprocessScriptLauncher``,
``_MultiProcessingLauncher``) and DDP's forward redirection for manual optimisation, as its own strategies do.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_longctx.config import (
    DEFAULT_FPDT_CHUNK_SIZE,
    SUPPORTED_PRECISION,
    ResolvedConfig,
    SequenceParallelConfig,
)
from lightning_longctx.integrations.context import SequenceParallelContext
from lightning_longctx.lightning import checkpoint as ckpt
from lightning_longctx.lightning import preemption
from lightning_longctx.lightning.arguments import (
    CONFIG_FIELDS,
    SET_BY_STRATEGY,
    check_keywords,
    config_arguments,
)
from lightning_longctx.lightning.checkpoint_hooks import CheckpointHooks
from lightning_longctx.lightning.first_step import FirstStepChecks
from lightning_longctx.ops.token_mean import TokenMeanWindow
from lightning_longctx.parallel.comm import (
    barrier,
    broadcast_module_,
    broadcast_object,
    reduce_mean_or_sum,
)
from lightning_longctx.parallel.fsdp import MIXED_PRECISION_DTYPES
from lightning_longctx.parallel.mesh import ParallelDims, WorldMesh, build_world_mesh, init_world
from lightning_longctx.parallel.plan import ParallelPlan
from lightning_longctx.planner.flops import find_hf_config
from lightning_longctx.planner.shapes import text_config


@config_arguments(SequenceParallelConfig)
class UlyssesFPDTStrategy(FirstStepChecks, CheckpointHooks, ParallelStrategy):
    """Sequence parallelism (Ulysses, optionally FPDT-chunked) x data parallelism for Lightning.

    Args:
        {config_args}
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as in Lightning's
            ``ParallelStrategy`` (the Trainer fills them in).
        process_group_backend: ``"nccl"`` on CUDA, ``"gloo"`` on CPU by default.
        timeout: of the process groups' collectives.
        start_method: how ``Trainer(devices=n)`` starts its processes: ``"popen"`` (Lightning's script launcher,
            the default) or ``"spawn"`` / ``"fork"`` / ``"forkserver"`` (multiprocessing).
        ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper: a DDP communication hook (CUDA only), as in
            Lightning's ``DDPStrategy``.
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
        kwargs: the settings above, and ``DistributedDataParallel``'s own (e.g. ``find_unused_parameters``).
            Any other keyword raises a ``TypeError`` naming the closest setting, and so do DDP's
            keywords away from their defaults with ``data_parallel="fsdp"`` (FSDP2 would ignore them).
    """

    strategy_name = "ulysses_fpdt"

    def __init__(
        self,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        gradient_as_bucket_view: bool = True,
        ddp_comm_state: Any = None,
        ddp_comm_hook: Any = None,
        ddp_comm_wrapper: Any = None,
        fit_check: bool | Literal["auto"] = "auto",
        fit_check_device_memory: int | str | None = None,
        self_test: bool | Literal["auto"] = "auto",
        **kwargs: Any,
    ) -> None:
        settings = {name: kwargs.pop(name) for name in CONFIG_FIELDS if name in kwargs}
        self.sp_config = SequenceParallelConfig(**settings)  # bad settings fail before anything is set up
        comm = {
            "ddp_comm_state": ddp_comm_state,
            "ddp_comm_hook": ddp_comm_hook,
            "ddp_comm_wrapper": ddp_comm_wrapper,
        }
        named = {"gradient_as_bucket_view": gradient_as_bucket_view, **comm}
        check_keywords(
            kwargs,
            self.sp_config.data_parallel,
            named,
            dict(inspect.signature(type(self).__init__).parameters),
        )
        self._init_first_step_checks(fit_check, fit_check_device_memory, self_test)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        for name in SET_BY_STRATEGY:  # at their defaults (else refused above): not passed on
            kwargs.pop(name, None)
        #: ``DistributedDataParallel``'s keywords (``data_parallel="ddp"``); gradients live in its buckets
        self._ddp_kwargs: dict[str, Any] = {}
        if self.sp_config.data_parallel == "ddp":
            self._ddp_kwargs = {"gradient_as_bucket_view": gradient_as_bucket_view, **kwargs}
        #: the DDP piece's communication hook: ``DDPReplication``'s ``comm_state`` / ``comm_hook`` / ``comm_wrapper``
        self._ddp_comm = {name.removeprefix("ddp_"): value for name, value in comm.items()}
        self._forward_redirection = _DDPForwardRedirection()  # manual optimisation under DDP: its sync flag
        self._config: ResolvedConfig | None = None
        #: the run's parallel plan (parallel/plan.py): mesh, model half, batch half; setup_environment to teardown
        self._plan: ParallelPlan | None = None
        self._precision = "32-true"  # Lightning's, read in setup
        self._fitting = False
        self._token_mean: TokenMeanWindow | None = None
        self._saver = ckpt.Saver()  # sharded checkpoint writes, synchronous or in the background
        self._tp_gradients_checked = False  # the first optimizer step checks the replicated gradients (TP)
        self._verified = False
        #: tokens per FPDT chunk per rank for the current batch (plain models pass it to fpdt_attention)
        self.current_chunk_size: int | None = None

    # ---- the world: processes, devices, the plan ----
    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

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
    def plan(self) -> ParallelPlan:
        """The run's :class:`~lightning_longctx.parallel.plan.ParallelPlan` (its mesh, its model and batch halves)."""
        if self._plan is None:
            raise RuntimeError(
                "the device mesh exists between the strategy's setup and its teardown (the end of fit, which "
                "destroys its process groups); it was read outside them"
            )
        return self._plan

    @property
    def dims(self) -> ParallelDims:
        """The world's dp x sp x tp degrees (a ring inside sp): ``config.dims``."""
        return self.config.dims

    @property
    def layout(self) -> ParallelDims:
        """The old name of :attr:`dims`."""
        return self.dims

    @property
    def world_mesh(self) -> WorldMesh:
        """The one device mesh and its views (mesh.py); every process group the strategy uses is in it."""
        return self.plan.mesh

    @property
    def device_mesh(self) -> Any:
        """The root ``DeviceMesh``: axes ``("data_parallel", "sequence_parallel", "tensor_parallel")`` (``(dp_sp,
        tensor_parallel)`` on a torch without ``DeviceMesh._flatten``; see ``mesh.build_world_mesh``)."""
        return self.world_mesh.root

    @property
    def sp_size(self) -> int:
        return self.dims.sp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def sp_rank(self) -> int:
        return self.dims.sp_rank(self.global_rank)

    @property
    def tp_rank(self) -> int:
        return self.dims.tp_rank(self.global_rank)

    @property
    def tp_group(self) -> Any:
        return self.world_mesh.tp_group

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.global_rank)

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
        super().setup_environment()  # the accelerator's device
        self._init_processes()
        self._config = None  # resolved again now that the world is known
        cfg, layout = self.config, self.dims
        if layout.spans_nodes:
            rank_zero_warn(
                f"sequence_parallel_size={layout.sp} spans nodes ({layout.devices_per_node} devices per "
                "node): its all-to-alls cross the network. Prefer a divisor of the devices per node"
            )
        self._plan = ParallelPlan(
            cfg, build_world_mesh(layout, self.root_device.type), ddp={**self._ddp_comm, **self._ddp_kwargs}
        )
        if cfg.settings.loss_normalization == "tokens":
            # the gradient reduction averages over the dp x sp replicas (TP peers hold the same loss)
            self._token_mean = TokenMeanWindow(
                world_size=layout.replicas, dp_size=layout.dp, ignore_index=cfg.settings.ignore_index
            )
        rank_zero_info(f"UlyssesFPDTStrategy: {cfg}")

    def _init_processes(self) -> None:
        """This process's ranks, then the default process group (unless one exists)."""
        reset_seed()  # a process Lightning started seeds itself again from PL_GLOBAL_SEED
        self.set_world_ranks()
        env = self.cluster_environment
        self._process_group_backend = self._get_process_group_backend()
        init_world(
            self._process_group_backend,
            rank=self.global_rank,
            world_size=self.world_size,
            main_address=env.main_address,
            main_port=env.main_port,
            timeout=self._timeout,
            device=self.root_device,
        )

    def set_world_ranks(self) -> None:
        """This process's global rank and the world size, from the node and local rank (Lightning's connector
        calls it when the Trainer is built, before any process group exists)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @property
    def is_distributed(self) -> bool:
        """Always: Lightning then adds its distributed sampler (spanning the data-parallel ranks only)."""
        return True

    def _get_process_group_backend(self) -> str:
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        if self.sp_config.cpu_offload and self.root_device.type != "cpu" and ":" not in backend:
            # the sharded gradients live on the host: gradient clipping's norm is reduced over CPU tensors
            return f"{self.root_device.type}:{backend},cpu:gloo"
        return backend

    @override
    def _configure_launcher(self) -> None:
        env = self.cluster_environment
        if not env.creates_processes_externally:
            if self._start_method == "popen":
                self._launcher = _SubprocessScriptLauncher(env, self.num_processes, self.num_nodes)
            else:
                self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)
            return
        # Lightning checks SLURM's --ntasks-per-node against `devices` only inside its own launcher,
        # which srun makes it skip; a mismatch would otherwise surface later as an IndexError.
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The sampler spans data-parallel ranks only: all ranks of an SP group read the same sample.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    # ---- collectives Lightning asks for (through comm.py) ----
    def _device_ids(self) -> list[int] | None:
        return None if self.root_device.type == "cpu" else [self.root_device.index]

    @override
    def barrier(self, name: str | None = None) -> None:
        barrier(device_ids=self._device_ids())

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return reduce_mean_or_sum(tensor, group, reduce_op) if isinstance(tensor, Tensor) else tensor

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
        if self.dims.tp > 1:  # gradient clipping by norm over the gradients of both meshes (TP, dp x sp)
            from lightning_longctx.parallel.tensor_parallel import clip_grad_norm_

            plugin = self.precision_plugin
            plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(
                plugin.main_params(optimizer), clip_val
            )
        self.accelerator.setup(trainer)
        if self._fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not self._fitting:  # nothing else makes the replicas equal (DDP broadcasts when it wraps)
            broadcast_module_(self.model)
        # the model half of the plan: attention swap, TP plan, activation checkpointing, then FSDP2 shards or
        # (fitting) DDP wraps. bf16-mixed / 16-mixed: FSDP2 computes in the low dtype over fp32 master weights
        # (Lightning's autocast stays on: harmless over low-precision parameters, and it keeps its fp32 ops in
        # fp32); DDP reads no param_dtype
        self.model = self.plan.parallelize(
            self.model,
            param_dtype=MIXED_PRECISION_DTYPES.get(self._precision),
            before_sharding=self._float32_self_test,
            replicate=self._fitting,
            device_ids=self._device_ids(),
        )
        if self.dims.ring > 1 and not self._contexts:  # a plain module's own attention reads no ring layout
            raise ValueError(
                f"ring_size={self.dims.ring} needs a transformers model in the LightningModule (the strategy "
                "swaps its attention for Ulysses x ring and shards batches zigzag over the ring); a plain module "
                "calling ulysses_attention / fpdt_attention itself would attend in the wrong order. Use "
                "ring_size=1, or call lightning_longctx.attention.ring.usp_attention in your module with "
                "batches from shard_batch(..., ring=ring_size)"
            )
        if self._fitting:
            self.plan.check_data_positions(trainer.datamodule)
        self._announce_self_test()
        if self._fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self._fitting:
            for optimizer in self.optimizers:  # a state the user gave the optimizer follows its parameters
                optimizer.state.update(move_data_to_device(dict(optimizer.state), self.root_device))

    @property
    def _contexts(self) -> list[SequenceParallelContext]:
        """The patched models' contexts (their guardrail counters, the current batch's positions)."""
        return [] if self._plan is None else self._plan.contexts

    @override
    def teardown(self) -> None:
        self._saver.close()  # a checkpoint still being written in the background is finished and committed
        # The models leave the strategy as they came: plain attention, loss, forward and checkpointing again
        # (TP and FSDP2 stay: a model sharded once keeps its shards); DDP's wrapper goes.
        if self._plan is not None:
            self._plan.undo()
        module = self.lightning_module
        if isinstance(self.model, DistributedDataParallel):
            self.model = module
        if module is not None and self._fitting and self._layer_sync:
            self.model = self._layer_sync.revert(self.model)
        if self.sp_config.data_parallel == "fsdp":
            # as Lightning's own FSDP strategies: the shards stay where they are. Moving them (Strategy.teardown's
            # ``module.cpu()``) fails on a model whose forward stopped with its parameters gathered (a refusal
            # raised inside the first step), which would hide the refusal behind an FSDP AttributeError.
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
        else:
            super().teardown()
        # the mesh's groups end here (a gloo group keeps threads), but not those an FSDP2 / TP model's shards
        # live on: it uses them after the fit (full_state_dict, save_checkpoint, its next fit)
        if self._plan is not None:
            self._plan.close()
            self._plan = None

    @override
    def model_to_device(self) -> None:
        # under cpu_offload FSDP2's piece keeps the transformers models on the host (where tensor_init_context
        # built them): fully_shard moves one block at a time to the device and keeps its shard on the host
        self.plan.model_to_device(self.model, self.root_device)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # manual optimisation under DDP: DDP must learn which parameters this loss reaches (as DDPStrategy does)
        if (
            isinstance(self.model, DistributedDataParallel)
            and not self.lightning_module.automatic_optimization
        ):
            prepare_for_backward(self.model, closure_loss)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # configure_model runs in it: under cpu_offload the model is built on the host, never whole on the device
        with (
            super().tensor_init_context(empty_init),
            torch.device("cpu") if self.sp_config.cpu_offload else nullcontext(),
        ):
            yield

    # ---- batches ----
    def chunk_size_for(self, seq_len: int) -> int | None:
        """Tokens per FPDT chunk per rank for a global sequence of ``seq_len`` tokens (None for Ulysses)."""
        return self.config.chunk_for(seq_len)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        training = self.lightning_module.trainer.training
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        self.current_chunk_size = self.chunk_size_for(ids.shape[1]) if isinstance(ids, Tensor) else None
        if self._fit_check_pending and training:
            self._check_first_step_fits(batch)
        if self._token_mean_active and training:
            self._token_mean.count(batch, self.lightning_module.trainer.accumulate_grad_batches)
        out = self.plan.shard(batch)  # the batch half: sharding, positions, every batch refusal
        if self._self_test_pending and training:
            self._run_self_test(batch)
        return out

    # ---- steps ----
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.plan.batches_sharded == 0:
            raise RuntimeError(
                "the training batch never went through UlyssesFPDTStrategy.batch_to_device, so it was not sharded "
                "along the sequence (training_step(dataloader_iter) bypasses it). Use training_step(batch, batch_idx)"
            )
        if self._verified:
            return super().training_step(*args, **kwargs)
        self.plan.start_first_step()
        out = super().training_step(*args, **kwargs)
        self.plan.verify_first_step(out.get("loss") if isinstance(out, Mapping) else out)
        self._verified = True
        return out

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
        if self.dims.tp > 1 and not self._tp_gradients_checked:
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

        def closure_then_check() -> Any:
            out = closure()
            self.plan.check_replicated_gradients(self.lightning_module)
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
