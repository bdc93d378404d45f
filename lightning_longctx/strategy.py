"""``UlyssesFPDTStrategy``: Ulysses / FPDT sequence parallelism as a Lightning strategy.

What it wires together (each part lives in its own module):
  * the dp x sp layout and its process groups (``mesh.py``),
  * the sampler over data-parallel ranks only (every rank of an SP group reads the same sample),
  * ``shard_batch`` on every batch (``sharding.py``),
  * attention / MLP / loss swapping in Hugging Face models (``integrations/transformers.py``),
  * the gradient reduction: DDP averages over all dp*sp ranks; the loss is multiplied by ``sp``
    in ``backward`` so that the average becomes "sum over sp, mean over dp" — each SP rank holds
    only its tokens' share of the gradient of the SP group's global-mean loss (docs/user_guide.md,
    "Loss semantics").

Built on ``DDPStrategy`` rather than ``ModelParallelStrategy``: the parameters are replicated (no
tensor parallelism), DDP's bucketed all-reduce over the whole world is exactly the reduction needed,
and checkpoints stay plain full state dicts that load into the unpatched HF model.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import textwrap
import typing
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from transformers import PreTrainedModel
from typing_extensions import override

from lightning_longctx.comm import all_gather_object, all_reduce_no_grad, count_all_to_all
from lightning_longctx.config import (
    DEFAULT_FPDT_CHUNK_SIZE,
    SUPPORTED_PRECISION,
    ResolvedConfig,
    SequenceParallelConfig,
)
from lightning_longctx.fsdp import MIXED_PRECISION_DTYPES, FSDP2Sharding, move_all_but_models
from lightning_longctx.integrations.context import BatchPositions, SequenceParallelContext
from lightning_longctx.integrations.hybrid.base import halo_error, packed_documents_error
from lightning_longctx.integrations.transformers import (
    context_of,
    disable_sequence_parallel,
    enable_activation_checkpointing,
    enable_sequence_parallel,
)
from lightning_longctx.mesh import ParallelLayout, build_device_mesh
from lightning_longctx.sharding import global_positions, shard_batch
from lightning_longctx.token_mean import TokenMeanWindow


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
        **kwargs: Any,
    ) -> None:
        settings = {name: kwargs.pop(name) for name in _CONFIG_FIELDS if name in kwargs}
        self.sp_config = SequenceParallelConfig(**settings)  # bad settings fail before any DDP set-up
        # gradients as views into DDP's all-reduce buckets (DDP's default keeps a second full copy); a named
        # argument so that LightningCLI's value is ours, not DDP's default
        kwargs["gradient_as_bucket_view"] = gradient_as_bucket_view
        _check_keywords(kwargs, self.sp_config.data_parallel)
        if self.sp_config.data_parallel == "fsdp":
            del kwargs["gradient_as_bucket_view"]  # at its default (else refused above): nothing to pass on
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self._config: ResolvedConfig | None = None
        self._mesh: Any = None
        self._fsdp: FSDP2Sharding | None = None
        self._precision = "32-true"  # Lightning's, read in setup
        self._fitting = False
        self._token_mean: TokenMeanWindow | None = None
        self._contexts: list[SequenceParallelContext] = []
        self._undo: list[Callable[[], None]] = []  # what teardown calls to restore the models' checkpointing
        self._tp_gradients_checked = False  # the first optimizer step checks the replicated gradients (TP)
        self._batches_sharded = 0
        self._verified = False
        self._checked_batch = False
        #: tokens per FPDT chunk per rank for the current batch (plain models pass it to fpdt_attention)
        self.current_chunk_size: int | None = None

    # ---- layout ----
    @property
    def config(self) -> ResolvedConfig:
        """The settings resolved for this world (``SequenceParallelConfig.resolve``): the one object the
        model patching, the batch sharding and the loss read."""
        if self._config is None:
            self._config = self.sp_config.resolve(self.world_size, self.num_processes, self.root_device.type)
        return self._config

    @property
    def layout(self) -> ParallelLayout:
        return self.config.layout

    @property
    def device_mesh(self) -> Any:
        if self._mesh is None:
            raise RuntimeError("Accessing the device mesh before the strategy is set up is not allowed")
        return self._mesh

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
        return self.device_mesh["tensor_parallel"].get_group()

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.global_rank)

    @property
    def sp_group(self) -> Any:
        return self.device_mesh["sequence_parallel"].get_group()

    @property
    def dp_group(self) -> Any:
        return self.device_mesh["data_parallel"].get_group()

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
        self._mesh = build_device_mesh(layout, self.root_device.type)
        if cfg.settings.data_parallel == "fsdp":
            self._fsdp = FSDP2Sharding(
                self.root_device.type, self.world_size, cpu_offload=cfg.settings.cpu_offload, tp=layout.tp
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
        if self.layout.tp > 1:  # gradient clipping by norm over the gradients of both meshes (TP, dp x sp)
            from lightning_longctx.tensor_parallel import clip_grad_norm_

            plugin = self.precision_plugin
            plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(
                plugin.main_params(optimizer), clip_val
            )
        self._patch_models()
        super().setup(trainer)

    def _patch_models(self) -> None:
        cfg = self.config
        for module in self.lightning_module.modules():
            # modules() is pre-order: the outermost HF model is patched first; inner ones share its config
            if not isinstance(module, PreTrainedModel) or context_of(module) is not None:
                continue
            enable_sequence_parallel(module, group=self.sp_group, config=cfg)
            if cfg.activation_checkpointing:
                self._undo.append(
                    enable_activation_checkpointing(module, offload=cfg.settings.activation_offload)
                )
            self._contexts.append(context_of(module))

    @override
    def teardown(self) -> None:
        # The models leave the strategy as they came: plain attention, loss, forward and checkpointing again.
        for undo in self._undo:
            undo()
        self._undo.clear()
        for module in self.lightning_module.modules() if self.lightning_module is not None else ():
            if isinstance(module, PreTrainedModel):
                disable_sequence_parallel(module)
        self._contexts.clear()
        super().teardown()

    # ---- DDP, or FSDP2 through its own object (fsdp.py) ----
    @override
    def model_to_device(self) -> None:
        if not (self._fitting and self.sp_config.cpu_offload):
            return super().model_to_device()
        # The transformers models stay on the host (where tensor_init_context built them): fully_shard (in
        # _setup_model) moves one block at a time to the device and keeps only its shard, on the host again.
        move_all_but_models(self.model, self.root_device)
        return None

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # configure_model runs in it: under cpu_offload the model is built on the host, never whole on the device
        with (
            super().tensor_init_context(empty_init),
            torch.device("cpu") if self.sp_config.cpu_offload else nullcontext(),
        ):
            yield

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self._fsdp is None:
            return super()._setup_model(model)
        if self._fsdp.tp_mesh is not None:  # TP first, FSDP2 over dp x sp on the same root mesh next
            from lightning_longctx.fsdp import outermost_models
            from lightning_longctx.tensor_parallel import apply_tp_plan

            for root in outermost_models(model):
                apply_tp_plan(
                    root, self._fsdp.tp_mesh, tp=self.layout.tp, vocab_parallel=self.config.mode == "fpdt"
                )
        # bf16-mixed / 16-mixed: FSDP2 computes in the low dtype over fp32 master weights (Lightning's
        # autocast stays on: harmless over low-precision parameters, and it keeps its fp32 ops in fp32)
        return self._fsdp.shard(model, param_dtype=MIXED_PRECISION_DTYPES.get(self._precision))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._fsdp is None:
            return super().lightning_module_state_dict()
        return self._fsdp.model_state_dict(self.lightning_module)  # a collective

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._fsdp is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        return self._fsdp.load_model_state_dict(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._fsdp is None:
            return super().optimizer_state(optimizer)
        return self._fsdp.optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._fsdp is None:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self._fsdp.load_optimizer_state(self.lightning_module, optimizer, state)
        return None

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
        )
        if self._contexts and isinstance(out.get("position_ids"), Tensor):  # the documents, no collective
            full = global_positions(batch, group=self.sp_group, chunk_size=chunk)
            for ctx in self._contexts:
                ctx.positions = BatchPositions(local=out["position_ids"], full=full)
            self._check_hybrid_batch(out["position_ids"].shape[-1], chunk)
        self._batches_sharded += 1
        return out

    def _check_hybrid_batch(self, local_len: int, chunk: int | None) -> None:
        """Hybrid models: what their mixers refuse (packed documents, segments shorter than a conv's halo),
        decided on every rank before the forward (one small all-reduce): data-parallel ranks see different
        samples, and a refusal raised on some ranks inside the forward would leave the others waiting."""
        hybrids = [ctx for ctx in self._contexts if ctx.num_mixers]
        if not hybrids:
            return
        packed = any(ctx.positions is not None and ctx.positions.documents() is not None for ctx in hybrids)
        short = any((chunk or local_len) < ctx.mixer_halo for ctx in hybrids)
        flags = all_reduce_no_grad(
            torch.tensor([float(packed), float(short)], device=self.root_device), op="max"
        )
        ctx = hybrids[0]
        if flags[0]:
            raise packed_documents_error(ctx.model_name)
        if flags[1]:
            raise halo_error(ctx.model_name, ctx.mixer_halo, chunk or local_len, local_len)

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
        with count_all_to_all() as count:
            out = super().training_step(*args, **kwargs)
        self._verify_first_step(count.calls + count.exchange_calls)
        self._verified = True
        return out

    def _verify_first_step(self, collectives: int) -> None:
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
        if self.sp_size > 1 and collectives == 0:
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
        from lightning_longctx.tensor_parallel import check_replicated_gradients

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
