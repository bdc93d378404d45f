"""Export: a checkpoint this package wrote, as a Hugging Face ``save_pretrained`` folder.

::

    lightning-longctx export run/checkpoints/step-00001000.ckpt out/      # or the run directory: its newest
    AutoModelForCausalLM.from_pretrained("out/")

:func:`export_pretrained` reads a committed sharded directory or a single ``.ckpt`` file (also what
:func:`~lightning_longctx.lightning.checkpoint.consolidate` writes), rebuilds the Hugging Face model from the checkpoint's
hyper-parameters (a :class:`~lightning_longctx.recipes.CausalLM`: its ``model_config`` or ``pretrained_path``'s
``config.json``, then its ``config_overrides``) or from a config the caller names, loads the ``model.``-prefixed
weights into it and writes ``model.safetensors`` + ``config.json`` (+ the run's tokenizer). A peft LoRA model
is merged into a plain model (``merge_lora``) or saved as its adapter folder.

Memory: the model once, in the dtype it is written in. A sharded directory is read by
``torch.distributed.checkpoint.load`` straight into the rebuilt model's tensors, in this process, no process
group: only the model's entries are read (never the optimizer state), with no temporary file. A single file
is memory-mapped and copied tensor by tensor. Nothing is written under ``out`` until the folder is complete:
it is written next to it (``.<name>.partial``) and renamed into place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_longctx.integrations.hf_config import apply_overrides
from lightning_longctx.lightning.checkpoint import (
    META_FILE,
    MODEL_KEY,
    PARTIAL_PREFIX,
    commit_info,
    is_sharded_checkpoint,
    latest_checkpoint,
)

__all__ = ["export_pretrained", "hf_config", "main", "resolve_checkpoint"]

#: the prefix of the Hugging Face model's keys in a LightningModule's state dict (``self.model``)
PREFIX = "model."
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: files that make a folder a tokenizer's (``AutoTokenizer.from_pretrained`` reads it)
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint at ``path``: a committed sharded directory, a checkpoint file, or (a run directory) the
    newest committed checkpoint under it (:func:`~lightning_longctx.lightning.checkpoint.latest_checkpoint`). An
    uncommitted directory (``.partial-*``: being written, or its save was killed) is refused."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path}: no such file or directory")
    if path.name.startswith(PARTIAL_PREFIX):
        raise ValueError(
            f"{path} is an uncommitted checkpoint (being written, or its save was killed mid-way); export a "
            "committed one: pass the run directory, or latest_checkpoint(run_dir) "
            "(lightning_longctx.lightning.checkpoint) to find its newest"
        )
    if path.is_file() or commit_info(path) is not None:
        return path
    found = latest_checkpoint(path)
    if found is not None:
        return found
    what = (
        "an uncommitted sharded checkpoint (no commit.json)"
        if is_sharded_checkpoint(path)
        else "no checkpoint"
    )
    raise ValueError(
        f"{path} is {what}, and no committed checkpoint lies under it (checked by "
        "lightning_longctx.lightning.checkpoint.latest_checkpoint); pass a checkpoint file, a committed checkpoint "
        "directory (commit.json inside), or the run directory that holds one"
    )


def export_pretrained(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    merge_lora: bool = False,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    model_config: dict[str, Any] | str | os.PathLike[str] | None = None,
    lora_config: dict[str, Any] | str | os.PathLike[str] | None = None,
    tokenizer: str | os.PathLike[str] | bool | None = None,
) -> Path:
    """Write the Hugging Face model in ``checkpoint`` to ``out`` as a ``save_pretrained`` folder; returns ``out``.

    Args:
        checkpoint: a committed sharded checkpoint directory, a checkpoint file (``checkpoint_format="full"``,
            or what ``consolidate`` writes), or a run directory (its newest committed checkpoint).
        out: the folder to write (``model.safetensors`` or its shards, ``config.json``, the tokenizer's
            files); refused when it exists and is not empty, unless ``overwrite`` (then replaced whole).
        merge_lora: a peft LoRA model: merge the adapters into the base weights and save a plain model.
            Without it such a model is saved as its adapter folder (peft's ``save_pretrained``).
        dtype: ``"float32" | "bfloat16" | "float16"`` (or a ``torch.dtype``) for the saved weights; ``None``:
            as the checkpoint holds them.
        model_config: the config to rebuild the model from, for a checkpoint whose module is not a
            ``CausalLM`` (a dict with ``model_type``, a ``config.json`` or a folder holding one); it replaces
            a ``CausalLM``'s own ``model_config`` / ``pretrained_path`` (e.g. one not on this machine). The run's
            ``config_overrides`` apply on top either way.
        lora_config: a LoRA model's ``peft.LoraConfig`` (its keyword arguments, an ``adapter_config.json`` or
            a folder holding one), for a module that does not record it (a ``CausalLM`` records ``lora``).
        tokenizer: a tokenizer folder to save with the model; ``None``: the run's (the module's or the
            datamodule's ``tokenizer`` hyper-parameter, else ``pretrained_path`` when a tokenizer is there);
            ``False``: none.
    """
    source = resolve_checkpoint(checkpoint)
    out = Path(out)
    _check_out(out, source, overwrite)
    torch_dtype = _torch_dtype(dtype)
    reader = _Reader(source)
    hparams = dict(reader.meta.get("hyper_parameters") or {})
    config = hf_config(hparams, model_config)
    lora = _lora_config(lora_config if lora_config is not None else hparams.get("lora"), reader.keys)
    source_tokenizer = _tokenizer_source(tokenizer, hparams, reader.meta)
    tok = None if source_tokenizer is None else _load_tokenizer(source_tokenizer)  # before the long part

    # built in the dtype it is saved in (the checkpoint's, or ``dtype``); a merge runs in the checkpoint's
    build_dtype = reader.dtype if torch_dtype is None or (lora is not None and merge_lora) else torch_dtype
    model = _build(config, build_dtype, lora)
    reader.load_into(model)
    if lora is not None and merge_lora:
        model = model.merge_and_unload()
    elif lora is not None and hparams.get("pretrained_path") is not None:
        # the adapter folder names its base, for peft's AutoPeftModelForCausalLM.from_pretrained(out)
        model.peft_config["default"].base_model_name_or_path = str(hparams["pretrained_path"])
    if torch_dtype is not None:
        model.to(torch_dtype)

    partial = out.with_name(f".{out.name}.partial")
    _remove_tree(partial)
    partial.mkdir(parents=True)
    try:
        # safetensors is save_pretrained's default in every transformers this package supports (>= 5.24)
        model.save_pretrained(partial)
        if tok is not None:
            tok.save_pretrained(partial)
    except BaseException:
        _remove_tree(partial)
        raise
    if out.exists():  # empty, or `overwrite` (checked above)
        _remove_tree(out)
    os.replace(partial, out)
    return out


# ---- the checkpoint ----


class _Reader:
    """The model entries of a checkpoint: their names, dtype and a load into a model; ``meta``: the rest."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sharded = is_sharded_checkpoint(path)
        if self.sharded:
            import torch.distributed.checkpoint as dcp

            # the loops, callbacks and hyper-parameters: small, rank 0's (pickled objects: trust the checkpoint)
            self.meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
            metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            head = f"{MODEL_KEY}."
            self.dtypes = {
                k[len(head) :]: md.properties.dtype
                for k, md in metadata.items()
                if k.startswith(head) and hasattr(md, "properties")
            }
        else:
            # memory-mapped: only the pages of the tensors read are touched (never the optimizer state)
            self.meta = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            if not isinstance(self.meta, dict) or MODEL_KEY not in self.meta:
                raise ValueError(f"{path} is not a Lightning checkpoint (no '{MODEL_KEY}' entry)")
            self.dtypes = {k: v.dtype for k, v in self.meta[MODEL_KEY].items() if isinstance(v, torch.Tensor)}
        self.keys = sorted(k[len(PREFIX) :] for k in self.dtypes if k.startswith(PREFIX))
        if not self.keys:
            raise ValueError(
                f"{path}: its state_dict has no '{PREFIX}'-prefixed keys (first keys: {sorted(self.dtypes)[:4]}); "
                "export reads the Hugging Face model a LightningModule holds as `self.model`"
            )

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype most of the model's entries are saved in."""
        counts: dict[torch.dtype, int] = {}
        for key in self.keys:
            dtype = self.dtypes[PREFIX + key]
            if dtype.is_floating_point:
                counts[dtype] = counts.get(dtype, 0) + 1
        return max(counts, key=counts.__getitem__) if counts else torch.float32

    def load_into(self, model: nn.Module) -> None:
        """Copy the checkpoint's ``model.*`` entries into ``model``'s own tensors (cast to their dtype)."""
        own = model.state_dict()
        unexpected = [k for k in self.keys if k not in own]
        missing = _missing(model, set(self.keys))
        if unexpected or missing:
            raise ValueError(
                f"{self.path} does not fit the model rebuilt from its config ({type(model).__name__}): "
                f"{len(unexpected)} saved weights it lacks {unexpected[:4]}, {len(missing)} of its weights "
                f"not saved {missing[:4]}; is the config (model_config / config_overrides / lora) the run's?"
            )
        targets = {PREFIX + k: own[k] for k in self.keys}
        if self.sharded:
            import torch.distributed.checkpoint as dcp

            # public API, this process only: each saved piece is read into its box of the target tensor; only
            # the keys asked for are read (the optimizer's entries stay on disk)
            with warnings.catch_warnings():  # "... assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message=".*load in a single process", category=UserWarning)
                dcp.load({MODEL_KEY: targets}, checkpoint_id=self.path, no_dist=True)
            return
        saved = self.meta[MODEL_KEY]
        with torch.no_grad():
            for key, target in targets.items():
                if saved[key].shape != target.shape:
                    raise ValueError(
                        f"{self.path}: {key} is saved with shape {tuple(saved[key].shape)}, the model rebuilt "
                        f"from its config has {tuple(target.shape)}; is the config the run's?"
                    )
                target.copy_(saved[key])


def _missing(model: nn.Module, saved: set[str]) -> list[str]:
    """``model``'s state-dict keys not in ``saved``, except aliases of a saved one (tied embeddings)."""
    by_storage: dict[tuple[int, int], list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        by_storage.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), []).append(key)
    return sorted(k for keys in by_storage.values() if not saved & set(keys) for k in keys)


# ---- the model ----


def hf_config(
    hparams: dict[str, Any], model_config: dict[str, Any] | str | os.PathLike[str] | None = None
) -> Any:
    """The transformers config a checkpoint's module was built from: ``model_config`` when given, else a
    ``CausalLM``'s hyper-parameters (``model_config``, or ``pretrained_path``'s ``config.json``), with the
    run's ``config_overrides`` applied as ``CausalLM`` applies them."""
    from transformers import AutoConfig

    if model_config is not None:
        fields = _config_dict(model_config)
    elif hparams.get("model_config") is not None:
        fields = dict(hparams["model_config"])
    elif hparams.get("pretrained_path") is not None:
        path = Path(hparams["pretrained_path"])
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"the checkpoint's model was loaded from pretrained_path={str(path)!r}, which holds no "
                "config.json on this machine; pass its config: model_config= (--model-config) a config.json "
                "or the folder holding it"
            )
        fields = _config_dict(path)
    else:
        named = hparams.get("_class_path", "a LightningModule that is not a CausalLM")
        raise ValueError(
            f"the checkpoint does not say how to build its model ({named}; hyper-parameters: "
            f"{sorted(hparams) or 'none'}); pass the Hugging Face config to rebuild it from: model_config= "
            "(--model-config) a config.json, the folder holding it, or a dict with 'model_type'"
        )
    if "model_type" not in fields:
        raise ValueError(f"the model's config needs a 'model_type' (e.g. 'llama'); got keys {sorted(fields)}")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return apply_overrides(config, hparams.get("config_overrides"))


def _config_dict(source: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(
            f"model config {path}: no such file (a config.json, or the folder holding it)"
        )
    return json.loads(path.read_text())


def _lora_config(source: dict[str, Any] | str | os.PathLike[str] | None, keys: Sequence[str]) -> Any:
    """A ``peft.LoraConfig`` from its keyword arguments or ``adapter_config.json``; ``None`` for a model with
    no LoRA weights (refused when the checkpoint holds some and nothing describes them)."""
    has_lora = any(".lora_A." in k or ".lora_B." in k for k in keys)
    if source is not None and not isinstance(source, (dict, str, os.PathLike)):
        raise TypeError(
            f"lora config: expected LoraConfig's keyword arguments or an adapter_config.json, got {source!r}"
        )
    if source is None:
        if has_lora:
            raise ValueError(
                "the checkpoint holds LoRA weights (e.g. "
                f"{next(k for k in keys if '.lora_A.' in k)}) but not their peft config; pass lora_config= "
                "(--lora-config) the LoraConfig's arguments or an adapter_config.json"
            )
        return None
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("exporting a LoRA model needs peft: pip install peft") from err
    if not isinstance(source, dict):
        path = Path(source)
        source = json.loads((path / "adapter_config.json" if path.is_dir() else path).read_text())
    names = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    fields = {k: v for k, v in source.items() if k in names}
    # the model is a causal LM (a CausalLM's `lora` leaves it implicit): its adapter folder says so, for
    # peft's AutoPeftModelForCausalLM
    fields["task_type"] = fields.get("task_type") or "CAUSAL_LM"
    return LoraConfig(**fields)


def _build(config: Any, dtype: torch.dtype, lora: Any) -> nn.Module:
    """The model, with random weights that the checkpoint's overwrite (peft-wrapped when ``lora``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora is None:
        return model
    from peft import get_peft_model

    return get_peft_model(model, lora)


def _torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(
            f"dtype={dtype!r}: use one of {sorted(_DTYPES)} or None (as the checkpoint holds it)"
        )
    return _DTYPES[dtype]


# ---- the tokenizer ----


def _tokenizer_source(
    tokenizer: str | os.PathLike[str] | bool | None, hparams: dict[str, Any], meta: dict[str, Any]
) -> str | None:
    """Where the run's tokenizer is: the given one, the module's or the datamodule's ``tokenizer``, else
    ``pretrained_path`` when it holds one; ``None`` for none (the byte tokenizer, or ``tokenizer=False``)."""
    if tokenizer is False:
        return None
    if tokenizer is not None and tokenizer is not True:
        return str(tokenizer)
    for named in (hparams.get("tokenizer"), (meta.get("datamodule_hyper_parameters") or {}).get("tokenizer")):
        if isinstance(named, (str, os.PathLike)):
            return str(named)
    pretrained = hparams.get("pretrained_path")
    if pretrained is not None and any((Path(pretrained) / f).is_file() for f in _TOKENIZER_FILES):
        return str(pretrained)
    return None


def _load_tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"the run's tokenizer {source!r} is not on this machine ({type(err).__name__}: {err}); pass "
            "tokenizer= (--tokenizer) its folder, or tokenizer=False (--no-tokenizer) to export without one"
        ) from err


# ---- the output folder ----


def _check_out(out: Path, source: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"out={out} is a file; export writes a folder")
    src, dst = source.resolve(), out.resolve()
    if src == dst or dst in src.parents or src in dst.parents:
        raise ValueError(f"out={out} overlaps the checkpoint {source}; export into another folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"out={out} is not empty; pass overwrite=True (--overwrite) to replace it, or an empty folder"
        )


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# ---- ``lightning-longctx export`` ----


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-longctx export",
        description="Write a Hugging Face save_pretrained folder (model.safetensors, config.json, the run's "
        "tokenizer) from a checkpoint this package wrote: a sharded directory, a .ckpt file, or a run "
        "directory (its newest committed checkpoint). AutoModelForCausalLM.from_pretrained(OUT) then loads it.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or file, or a run directory")
    p.add_argument(
        "out", metavar="OUT", help="the folder to write (must be empty or absent, unless --overwrite)"
    )
    p.add_argument("--merge-lora", action="store_true", help="merge LoRA adapters into the base weights")
    p.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="weights' dtype (default: as saved)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT when it is not empty")
    p.add_argument(
        "--model-config",
        default=None,
        metavar="PATH",
        help="config.json (or its folder) to rebuild the model from, when the module is not a CausalLM or its "
        "pretrained_path is not on this machine",
    )
    p.add_argument(
        "--lora-config",
        default=None,
        metavar="PATH",
        help="the LoRA model's adapter_config.json (or its folder)",
    )
    tok = p.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer", default=None, metavar="PATH", help="tokenizer folder (default: the run's)"
    )
    tok.add_argument("--no-tokenizer", action="store_true", help="export without a tokenizer")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on a bad argument or checkpoint, like argparse)."""
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        source = resolve_checkpoint(args.checkpoint)
        out = export_pretrained(
            source,
            args.out,
            merge_lora=args.merge_lora,
            dtype=args.dtype,
            overwrite=args.overwrite,
            model_config=args.model_config,
            lora_config=args.lora_config,
            tokenizer=False if args.no_tokenizer else args.tokenizer,
        )
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as err:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    step = (commit_info(source) or {}).get("global_step")
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"exported {source}" + ("" if step is None else f" (step {step})") + f" to {out}: {files}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
