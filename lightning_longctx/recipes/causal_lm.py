"""``CausalLM``: a ready LightningModule around a Hugging Face causal LM.

The training step is the code a user writes for one device, unchanged: ``self.model(**batch).loss``.
Under :class:`~lightning_longctx.UlyssesFPDTStrategy` the batch arrives sharded along the
sequence (``input_ids`` ``(b, s/P)``, pre-shifted ``shift_labels``, GLOBAL ``position_ids``) and
the model's attention and loss are already swapped; on one device the same step trains plainly.

The model is built in :meth:`CausalLM.configure_model`, inside the strategy's tensor-init
context (right device and dtype from the start; no fp32 copy of an 8B model in host memory).
``CausalLM.load_from_checkpoint`` calls ``configure_model`` before loading the weights.

A recipe: it uses only the core's public pieces (the strategy's ``sp_group``, ``step_loss`` and
``loss_is_token_mean``, :func:`~lightning_longctx.sequence_parallel_cross_entropy`,
:func:`~lightning_longctx.enable_activation_checkpointing`, ``shift_labels`` and ``IGNORE_INDEX`` of
:mod:`lightning_longctx.parallel.sharding`, the byte tokenizer of :mod:`lightning_longctx.data`) and the recall task's
accuracy. LoRA is peft's (``lora=``): the strategy patches the Hugging Face model inside the ``PeftModel``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_longctx import enable_activation_checkpointing, sequence_parallel_cross_entropy
from lightning_longctx.data import ByteTokenizer
from lightning_longctx.integrations.hf_config import build_config
from lightning_longctx.parallel.sharding import IGNORE_INDEX, shift_labels
from lightning_longctx.recipes.recall import RecallAccuracy

__all__ = ["CausalLM", "warmup_cosine"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LABEL_KEYS = ("labels", "shift_labels")
_LORA_TASK = "CAUSAL_LM"


def _lora_config(lora: dict[str, Any]) -> Any:
    """``peft.LoraConfig(**lora)`` for a causal LM (``task_type="CAUSAL_LM"``); a bad key or value is refused
    with peft's reason and the fix."""
    if not isinstance(lora, dict):
        raise TypeError(f"lora must be a dict of peft.LoraConfig's arguments, got {type(lora).__name__}")
    task = lora.get("task_type", _LORA_TASK)
    if task is not None and task != _LORA_TASK:
        raise ValueError(
            f"lora.task_type={task!r}: CausalLM trains a causal LM; drop it or use {_LORA_TASK!r}"
        )
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("CausalLM(lora=...) needs peft: pip install peft") from err
    try:
        return LoraConfig(**{**lora, "task_type": _LORA_TASK})
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"lora={lora!r} is not a valid peft.LoraConfig ({err}); its keys are LoraConfig's arguments, e.g. "
            "{'r': 16, 'lora_alpha': 32, 'target_modules': 'all-linear'}"
        ) from err


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int | None, min_ratio: float) -> float:
    """LR multiplier: linear warmup over ``warmup_steps``, then cosine from 1 to ``min_ratio`` at
    ``total_steps`` (constant 1 after warmup when ``total_steps`` is ``None``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps is None:
        return 1.0
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _shifted_labels(batch: dict[str, Tensor]) -> Tensor:
    """``(b, s)`` targets aligned with the logits: the strategy's pre-shifted ``shift_labels`` of
    this rank's shard, or (unsharded batch) ``labels`` shifted here."""
    return batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM, trained with AdamW and an optional warmup + cosine schedule.

    Args:
        model_config: a transformers config as a dict, e.g. ``{"model_type": "llama",
            "hidden_size": 64, ...}``; built with ``AutoConfig.for_model`` and
            ``AutoModelForCausalLM.from_config`` (random weights).
        pretrained_path: a LOCAL directory for ``AutoModelForCausalLM.from_pretrained(...,
            local_files_only=True)``. Exactly one of ``model_config`` / ``pretrained_path``.
        config_overrides: fields of the transformers config set before the model is built (with
            ``pretrained_path``: on its ``config.json``, before the weights load; with ``model_config``:
            merged into it), e.g. context extension: ``{"rope_parameters": {"rope_type": "yarn", "factor": 4.0},
            "max_position_embeddings": 32768}``. A new ``rope_parameters`` / ``rope_scaling`` keeps the
            config's ``rope_theta`` and takes the config's own length (``max_position_embeddings`` before the
            overrides) as ``original_max_position_embeddings`` unless it names one. A key the config does not
            have is refused (transformers would keep it silently).
        lora: peft LoRA adapters: the keyword arguments of ``peft.LoraConfig`` (``task_type`` is
            ``"CAUSAL_LM"``), e.g. ``{"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}``. The model
            is wrapped by ``peft.get_peft_model`` after its weights load: only the adapters train (the base
            weights frozen; peft keeps the adapters in float32 over ``bfloat16`` weights). Saved in the
            checkpoint's hyper-parameters, so ``lightning-longctx export --merge-lora`` rebuilds and merges it.
        lr, weight_decay, betas: AdamW; weight decay applies to matrices only (not norms/biases).
        warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr``.
        max_steps_schedule: cosine decay to ``min_lr_ratio * lr`` at this step; ``None`` keeps
            ``lr`` constant after warmup.
        min_lr_ratio: the floor of the cosine decay, as a fraction of ``lr``.
        activation_checkpointing: HF gradient checkpointing (non-reentrant) on the decoder layers.
        dtype: ``"bfloat16" | "float16" | "float32"`` for the weights; ``None`` = the trainer's
            precision decides (``bf16-true`` gives bf16 weights, ``bf16-mixed`` fp32 weights).
        eval_metric: in validation/test, compute the loss and the argmax accuracy
            (``val/recall_acc``) from logits at the labelled positions only (cheap for sparse
            labels such as the recall task; with dense labels it materialises the shard's full
            logits, so turn it off for long text). ``False``: ``val/loss`` only, from the model's
            own (chunked, under FPDT) loss.
    """

    def __init__(
        self,
        model_config: dict[str, Any] | None = None,
        pretrained_path: str | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        max_steps_schedule: int | None = None,
        min_lr_ratio: float = 0.1,
        activation_checkpointing: bool = False,
        dtype: str | None = None,
        eval_metric: bool = True,
        config_overrides: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if (model_config is None) == (pretrained_path is None):
            raise ValueError(
                "give exactly one of model_config (a dict with 'model_type', random weights) or "
                f"pretrained_path (a local directory); got model_config={model_config!r}, "
                f"pretrained_path={pretrained_path!r}"
            )
        if model_config is not None and "model_type" not in model_config:
            raise ValueError(
                f"model_config needs a 'model_type' key (e.g. 'llama'); got keys {sorted(model_config)}"
            )
        if config_overrides is not None and not isinstance(config_overrides, dict):
            raise TypeError(f"config_overrides must be a dict, got {type(config_overrides).__name__}")
        if model_config is not None and config_overrides:  # cheap here: refuse an unknown key before fit
            build_config(model_config=model_config, config_overrides=config_overrides)
        if lora is not None:  # peft validates its config: refuse a bad key before fit
            _lora_config(lora)
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: use one of {sorted(_DTYPES)} or None")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        if max_steps_schedule is not None and max_steps_schedule <= warmup_steps:
            raise ValueError(
                f"max_steps_schedule={max_steps_schedule} must exceed warmup_steps={warmup_steps}"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.val_acc = RecallAccuracy()
        self.test_acc = RecallAccuracy()

    # ---- model ----
    @override
    def configure_model(self) -> None:
        if self.model is not None:  # called again by load_from_checkpoint, or a second fit
            return
        from transformers import AutoModelForCausalLM

        hp = self.hparams
        dtype = _DTYPES[hp.dtype] if hp.dtype is not None else None
        kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
        overrides = hp.get("config_overrides")
        config = build_config(hp.model_config, hp.pretrained_path, overrides)
        if hp.pretrained_path is not None:
            model = AutoModelForCausalLM.from_pretrained(
                hp.pretrained_path, config=config, local_files_only=True, **kwargs
            )
        else:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        model.config.use_cache = False
        model.train()  # from_pretrained hands it back in eval mode (dropout off): this module trains it
        if hp.activation_checkpointing:
            enable_activation_checkpointing(model)
        self._check_vocab(model)
        if hp.get("lora") is not None:
            from peft import get_peft_model

            # after the weights load: the frozen base is the pretrained one; the strategy patches the
            # PreTrainedModel inside the PeftModel
            model = get_peft_model(model, _lora_config(hp.lora))
        self.model = model

    def _check_vocab(self, model: nn.Module) -> None:
        """A datamodule with more token ids than the model's vocabulary would index out of range; a pretrained
        model fed the byte tokenizer's ids (a datamodule with no tokenizer) would train on the wrong tokens."""
        trainer = self._trainer
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        data_vocab = getattr(datamodule, "vocab_size", None)
        model_vocab = getattr(model.config, "vocab_size", None)
        path = self.hparams.pretrained_path
        if path is not None and isinstance(getattr(datamodule, "tokenizer", None), ByteTokenizer):
            raise ValueError(
                f"{type(datamodule).__name__} has no tokenizer, so it encodes text with the byte tokenizer "
                f"({ByteTokenizer.vocab_size} ids), but CausalLM(pretrained_path={path!r}) was trained on its own "
                f"vocabulary ({model_vocab} ids): every token would mean something else to it. Set the "
                f"datamodule's tokenizer to the model's folder (YAML `data.init_args.tokenizer: {path}`, or "
                f"--data.tokenizer {path})"
            )
        if isinstance(data_vocab, int) and isinstance(model_vocab, int) and data_vocab > model_vocab:
            raise ValueError(
                f"the datamodule produces token ids up to {data_vocab - 1} but the model's vocab_size is "
                f"{model_vocab}; set model_config.vocab_size >= {data_vocab}"
            )

    @property
    def hf_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the model is built in configure_model(); call it (or trainer.fit) first")
        return self.model

    def _sp_group(self, batch: dict[str, Tensor]) -> Any:
        """The strategy's sequence-parallel group when this batch was sharded by it, else ``None``."""
        if "shift_labels" not in batch or self._trainer is None:
            return None
        return getattr(self.trainer.strategy, "sp_group", None)

    # ---- steps ----
    def _logs_step_loss(self) -> bool:
        return bool(getattr(self.trainer.strategy, "loss_is_token_mean", False))

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.hf_model(**batch).loss
        if not self._logs_step_loss():  # else logged once per step, token-weighted, below
            self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The strategy has just summed the window: the step's token mean over all ranks and micro-batches.
        if self._logs_step_loss():
            self.log("train/loss", float(self.trainer.strategy.step_loss), prog_bar=True, batch_size=1)

    def _eval_step(self, batch: dict[str, Tensor], prefix: str, metric: RecallAccuracy) -> Tensor:
        batch_size = batch["input_ids"].shape[0]
        if not self.hparams.eval_metric:
            loss = self.hf_model(**batch).loss
            self.log(f"{prefix}/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch_size)
            return loss
        targets = _shifted_labels(batch)  # (b, s_local), aligned with the logits
        keep = targets != IGNORE_INDEX
        inputs = {k: v for k, v in batch.items() if k not in _LABEL_KEYS}
        # A boolean logits_to_keep projects only the labelled positions onto the vocabulary:
        # logits (n_labelled, V) — never (b, s/P, V), which FPDT's chunked loss exists to avoid.
        logits = self.hf_model(**inputs, logits_to_keep=keep).logits
        loss = sequence_parallel_cross_entropy(logits, targets[keep], group=self._sp_group(batch))
        metric.update(logits, targets[keep], shifted=True)
        self.log(f"{prefix}/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch_size)
        self.log(f"{prefix}/recall_acc", metric, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val", self.val_acc)

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test", self.test_acc)

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Greedy next-token ids ``(b, s_local)`` for this rank's shard of the sequence."""
        inputs = {k: v for k, v in batch.items() if k not in _LABEL_KEYS}
        return self.hf_model(**inputs).logits.argmax(dim=-1)

    # ---- optimisation ----
    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.hf_model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # Sharded parameters on the host (``cpu_offload``, or FSDP on a CPU): torch's default there is a Python
        # loop over the parameters, one DTensor dispatch per parameter and op; foreach is the same arithmetic
        # (bit-identical) in one dispatch per op. (fused=True is faster still, but not bit-identical.)
        on_host = all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params)
        optimizer = torch.optim.AdamW(
            groups, lr=hp.lr, betas=tuple(hp.betas), **({"foreach": True} if params and on_host else {})
        )
        if hp.warmup_steps == 0 and hp.max_steps_schedule is None:
            return optimizer

        def factor(step: int) -> float:
            return warmup_cosine(
                step,
                warmup_steps=hp.warmup_steps,
                total_steps=hp.max_steps_schedule,
                min_ratio=hp.min_lr_ratio,
            )

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
