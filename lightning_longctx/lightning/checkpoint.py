"""Checkpoints: committed directories (or files) that a kill mid-save never leaves looking valid, and the
resolver that finds a run's newest one.

A checkpoint is written under a hidden name (``.partial-<name>``) next to its final path; when every rank
has written its part, rank 0 writes the commit marker (:data:`COMMIT_FILE`, inside a directory, or
``<file>.commit.json`` beside a single file) and renames it into place. The resolver
(:func:`latest_checkpoint`) only reads committed checkpoints, so a half-written one (a rank killed mid-save,
a stray ``.partial``) is never chosen, and neither is a name that merely looks like a step.

Sharded format (the default, ``checkpoint_format="sharded"``): a ``torch.distributed.checkpoint`` directory in
Lightning's layout — ``.metadata``, one ``__<rank>_<n>.distcp`` shard file per rank, ``meta.pt`` (the loops,
callbacks, schedulers, hyper-parameters) — plus the commit marker. Each rank writes its own shards of the
model (``state_dict``) and of each optimizer (``optimizer_<i>``, keyed by parameter name); no rank holds the
full state. On load every rank reads the pieces of ITS current layout, so a checkpoint resumes at any dp /
sp / tp / world size, with state offload on or off, DDP or FSDP.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_longctx.parallel import comm

__all__ = [
    "COMMIT_FILE",
    "commit_info",
    "consolidate",
    "is_sharded_checkpoint",
    "latest_checkpoint",
    "step_checkpoint_path",
]

#: written last inside a committed checkpoint directory (beside a single file: ``<file>.commit.json``)
COMMIT_FILE = "commit.json"
#: the prefix of a checkpoint being written; never resolved, never deleted by retention
PARTIAL_PREFIX = ".partial-"
#: how deep below its root the resolver looks (``root/lightning_logs/version_0/checkpoints/x`` is 4)
_SEARCH_DEPTH = 4


def step_checkpoint_path(dirpath: str | os.PathLike[str], step: int) -> Path:
    """The path of the checkpoint of optimizer step ``step`` in ``dirpath`` (``step-00000123.ckpt``): the naming
    the periodic saves and the preemption save share, so the newest is also the highest step."""
    return Path(dirpath) / f"step-{int(step):08d}.ckpt"


def _marker(path: Path) -> Path:
    return path / COMMIT_FILE if path.is_dir() else path.with_name(path.name + ".commit.json")


def commit_info(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The commit record of the checkpoint at ``path`` (format, global step, layout, versions), or ``None``
    when it is not a committed checkpoint (half-written, or not written by this package)."""
    path = Path(path)
    if path.name.startswith(PARTIAL_PREFIX) or not path.exists():
        return None
    try:
        return json.loads(_marker(path).read_text())
    except (OSError, ValueError):
        return None


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``root`` (searched down to 4 levels: a run's
    ``default_root_dir`` finds its ``checkpoints/`` and ``lightning_logs/version_*/checkpoints/``), by global
    step, then by commit time; ``None`` when there is none. Hidden entries (``.partial-*``) are skipped."""
    root = Path(root)
    best: tuple[tuple[int, float], Path] | None = None
    if not root.is_dir():
        return None
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        depth = len(here.relative_to(root).parts)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        candidates = [here / d for d in dirnames] + [
            here / f for f in filenames if not f.startswith(".") and not f.endswith(".commit.json")
        ]
        for path in candidates:
            info = commit_info(path)
            if info is None:
                continue
            key = (int(info.get("global_step", -1)), float(info.get("time", 0.0)))
            if best is None or key > best[0]:
                best = (key, path)
        # a committed checkpoint directory is a leaf: its shards are not searched
        dirnames[:] = [d for d in dirnames if commit_info(here / d) is None]
        if depth >= _SEARCH_DEPTH - 1:
            dirnames[:] = []
    return None if best is None else best[1]


def partial_path(path: str | os.PathLike[str]) -> Path:
    """Where the checkpoint bound for ``path`` is written before its commit."""
    path = Path(path)
    return path.with_name(PARTIAL_PREFIX + path.name)


def commit(partial: Path, path: Path, info: dict[str, Any]) -> None:
    """Rank 0, after every rank has written: the marker, then the rename into place. A checkpoint already at
    ``path`` is moved aside first and deleted after, so no moment shows a half-new checkpoint under ``path``."""
    info = {**info, "time": time.time()}
    if partial.is_dir():
        (partial / COMMIT_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))
    old = path.with_name(f"{PARTIAL_PREFIX}old-{path.name}")
    if path.exists() or path.is_symlink():
        _remove(old)
        os.replace(path, old)
        _remove(_marker_beside(path))
    os.replace(partial, path)
    if not path.is_dir():  # a single file: its marker beside it, written once the file is in place
        _marker_beside(path).write_text(json.dumps(info, indent=1, sort_keys=True))
    _remove(old)


def _marker_beside(path: Path) -> Path:
    return path.with_name(path.name + ".commit.json")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint (a directory or a file) and its marker."""
    path = Path(path)
    _remove(_marker_beside(path))
    _remove(path)


# ---- the state: torch's distributed state-dict API, sharded (DTensor shards) or full ----


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A ``torch.distributed.checkpoint`` directory (``.metadata`` inside), as opposed to a single file."""
    return (Path(path) / ".metadata").is_file()


def _options(full: bool, strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # full: gathered and offloaded to the host on rank 0 only; sharded: each rank's own DTensor shards, on
    # the device they live on (replicated plain tensors under DDP: the saver writes each once)
    return StateDictOptions(full_state_dict=full, cpu_offload=full, strict=strict)


def model_state(module: nn.Module, *, full: bool) -> dict[str, Any]:
    """``module``'s state keyed by parameter name (a collective under FSDP: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(full))


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter name, so that it loads under any layout and mode.

    Before the optimizer's first step torch's API initialises its state with a step on zero gradients at
    lr 0, which leaves AdamW's step counter at 1: the next real step would then use the wrong bias correction.
    That initialisation is undone here, and the state saved is empty, as the optimizer's own."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fresh = not optimizer.state
    state = get_optimizer_state_dict(module, optimizer, options=_options(full))
    if fresh:
        optimizer.state.clear()
        if state:  # (full: ranks other than 0 hold nothing)
            state = {"state": {}, "param_groups": state["param_groups"]}
    return state


def _restore_groups(optimizer: torch.optim.Optimizer, groups: Sequence[dict[str, Any]]) -> None:
    """A state saved before the first step: only the hyper-parameters (torch's loader needs a state tensor to
    find the device, and would initialise the state with a step)."""
    optimizer.state.clear()
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


def load_full_state(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], checkpoint: dict[str, Any], strict: bool
) -> None:
    """Load a single-file checkpoint's ``state_dict`` and ``optimizer_states`` into the (possibly sharded)
    ``module`` and its optimizers; every rank holds the file memory-mapped."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    if "state_dict" in checkpoint:
        set_model_state_dict(module, checkpoint["state_dict"], options=_options(True, strict))
    for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", ())):
        # copies of what the optimizer would keep as loaded (and update in place), which would keep the
        # memory-mapped file resident for the run: torch's load_state_dict keeps every tensor of the right
        # dtype and device; for sharded (DTensor) parameters the distributed loader copies the moments into
        # new shards and keeps only AdamW's 0-dim step counters (cloning only those saves a full copy of the
        # moments on every rank)
        if not state.get("state"):  # stateless (plain SGD), or saved before the first step
            _restore_groups(optimizer, state["param_groups"])
            continue
        state = _copied(state, scalars_only=all(isinstance(p, DTensor) for p in module.parameters()))
        if all(isinstance(k, int) for k in state["state"]):  # keyed by index: torch's own state_dict()
            optimizer.load_state_dict(state)
        else:
            set_optimizer_state_dict(module, optimizer, state, options=_options(True, strict))


def _copied(state: Any, *, scalars_only: bool) -> Any:
    """``state`` with its tensors cloned (``scalars_only``: its 0-dim tensors only, the rest as they are)."""
    if isinstance(state, torch.Tensor):
        return state.clone() if state.dim() == 0 or not scalars_only else state
    if isinstance(state, dict):
        return {k: _copied(v, scalars_only=scalars_only) for k, v in state.items()}
    if isinstance(state, list):
        return [_copied(v, scalars_only=scalars_only) for v in state]
    return state


# ---- DTensors whose shard is not one box ----


def _needs_plain_placements(value: Any) -> bool:
    """A DTensor sharded with a split factor on its innermost shard of a dim (transformers' ``packed_colwise``:
    each TP rank holds two disjoint row blocks, the gate's and the up projection's). Its local piece is not
    one box of the global tensor, which the checkpoint format needs (the save plan refuses overlapping
    boxes). FSDP's strided shard over a TP shard of the same dim is one box and saves as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return False
    last: dict[int, Any] = {}
    for placement in value.placements:
        if _sharded_dim(placement) is not None:
            last[placement.dim] = placement
    return any(getattr(p, "split_factor", 1) > 1 for p in last.values())


def _sharded_dim(placement: Any) -> int | None:
    # a strided shard is not `is_shard()` in torch 2.13, but has the tensor dim it splits
    return getattr(placement, "dim", None)


def _plain(value: Any) -> Any:
    from torch.distributed.tensor import Shard

    placements = [Shard(p.dim) if _sharded_dim(p) is not None else p for p in value.placements]
    return value.redistribute(placements=placements)


def _walk(state: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _walk(value, (*prefix, key))
    else:
        yield prefix, state


def _set(state: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value


@contextmanager
def plain_placements(state: dict[str, Any], *, load: bool) -> Iterator[dict[str, Any]]:
    """``state`` with every strided-packed DTensor replaced by a copy on plain shards (one all-to-all each)
    for the checkpoint; ``load``: on exit the values read into those copies go back into the originals."""
    swapped = [(path, value) for path, value in _walk(state) if _needs_plain_placements(value)]
    copies = {path: _plain(value) for path, value in swapped}
    for path, copy in copies.items():
        _set(state, path, copy)
    yield state
    if load:
        for path, original in swapped:
            original.copy_(copies[path].redistribute(placements=original.placements))
            _set(state, path, original)


# ---- sharded directories ----

#: the keys of a sharded checkpoint's tensors, as Lightning's ModelParallelStrategy writes them
MODEL_KEY = "state_dict"


def optimizer_key(index: int) -> str:
    """The key of optimizer ``index``'s state in a sharded checkpoint."""
    return f"optimizer_{index}"


def save_sharded(state: dict[str, Any], directory: Path, *, thread_count: int = 1) -> None:
    """Every rank writes its shards of ``state`` into ``directory`` (fresh: the writer refuses to overwrite)."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(directory, thread_count=thread_count, overwrite=False)
    with plain_placements(state, load=False):
        dcp.save(state, storage_writer=writer)


def load_sharded(
    directory: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool
) -> None:
    """Load a sharded checkpoint into ``module`` and ``optimizers`` as they are laid out NOW: each rank reads
    the overlap of its own shards with the saved ones (any dp / sp / tp / world size, offload, DDP or FSDP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    model = {MODEL_KEY: model_state(module, full=False)}
    with plain_placements(model, load=True):
        dcp.load(model, checkpoint_id=directory, planner=planner)
    set_model_state_dict(module, model[MODEL_KEY], options=_options(False, strict))
    saved = _saved_keys(directory)
    for index, optimizer in enumerate(optimizers):
        key = optimizer_key(index)
        if key not in saved:
            continue  # a weights-only checkpoint
        if f"{key}.state" not in saved:  # saved before its first step (or stateless): the groups alone
            groups = {key: {"param_groups": optimizer_state(module, optimizer, full=False)["param_groups"]}}
            dcp.load(groups, checkpoint_id=directory, planner=DefaultLoadPlanner(allow_partial_load=True))
            _restore_groups(optimizer, groups[key]["param_groups"])
            continue
        # torch's API initialises a fresh optimizer's state (a step at lr 0) to have tensors to load into;
        # every one of them is overwritten by the checkpoint's
        state = {key: get_optimizer_state_dict(module, optimizer, options=_options(False))}
        with plain_placements(state, load=True):
            dcp.load(state, checkpoint_id=directory, planner=planner)
        set_optimizer_state_dict(module, optimizer, state[key], options=_options(False, strict))


def _saved_keys(directory: Path) -> set[str]:
    """The top-level keys a sharded checkpoint holds (``state_dict``, ``optimizer_0``, ...), and
    ``optimizer_<i>.state`` for an optimizer whose per-parameter state it holds."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(directory).read_metadata()
    keys = set()
    for fqn in metadata.state_dict_metadata:
        top, _, rest = fqn.partition(".")
        keys.add(top)
        if rest.startswith("state."):
            keys.add(f"{top}.state")
    return keys


def consolidate(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """One process, no process group: turn the sharded checkpoint at ``path`` into one Lightning ``.ckpt``
    file at ``out`` (``state_dict`` and ``optimizer_states`` full, plus ``meta.pt``'s entries), which
    ``LightningModule.load_from_checkpoint`` and ``torch.load`` read. The whole state is held in host memory."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, out = Path(path), Path(out)
    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path} is not a sharded checkpoint directory (no .metadata inside)")
    flat = out.with_name(out.name + ".tensors")
    dcp_to_torch_save(path, flat)
    tensors = torch.load(flat, map_location="cpu", weights_only=False, mmap=True)
    checkpoint = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    checkpoint[MODEL_KEY] = tensors.pop(MODEL_KEY)
    indices = sorted(int(k.split("_", 1)[1]) for k in tensors if k.startswith("optimizer_"))
    if indices:
        checkpoint["optimizer_states"] = [tensors[optimizer_key(i)] for i in indices]
    torch.save(checkpoint, out)
    flat.unlink()
    return out


#: the non-tensor state of a sharded checkpoint (loops, callbacks, schedulers, hyper-parameters), rank 0's
META_FILE = "meta.pt"


class Saver:
    """Writes sharded checkpoints, one at a time, synchronously or in the background.

    In the background (``async_save``), ``torch.distributed.checkpoint.async_save`` copies the state to host
    memory and returns; the writes, and the collectives that plan and finish them, run in a thread on a gloo
    group of their own (created at the first save: every rank saves). Rank 0 commits the directory when its
    write is done (the coordinator finishes last, after gathering every rank's result). :meth:`wait` blocks
    until the save in flight is written and committed; the next save, a preemption and teardown call it."""

    def __init__(self) -> None:
        self._group: Any = None
        self._pending: Any = None  # the future of the save in flight
        self._commit: Any = None  # rank 0: what commits it
        self._doomed: list[Path] = []  # rank 0: deleted once the save in flight is committed

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def remove_after_commit(self, path: str | os.PathLike[str]) -> None:
        """Delete ``path`` when the save in flight is committed (at once when none is): retention never leaves
        fewer committed checkpoints than it keeps while a newer one is still being written."""
        if self._pending is None:
            remove(path)
        elif Path(path) not in self._doomed:
            self._doomed.append(Path(path))

    def save(
        self,
        state: dict[str, Any],
        meta: dict[str, Any],
        partial: Path,
        path: Path,
        record: dict[str, Any],
        *,
        is_zero: bool,
        background: bool = False,
    ) -> None:
        """Write ``state`` (every rank's shards) and ``meta`` (rank 0) into ``partial``; rank 0 commits it to
        ``path`` once written (at once, or at :meth:`wait` in the background)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        if is_zero:
            torch.save(meta, partial / META_FILE)
        commit_it = (lambda: commit(partial, path, record)) if is_zero else None
        if not background:
            save_sharded(state, partial)
            comm.barrier()  # every rank's shards are on disk
            if commit_it is not None:
                commit_it()
            return
        if self._group is None:
            self._group = comm.new_gloo_group()
        writer = dcp.FileSystemWriter(partial, overwrite=False)
        with plain_placements(state, load=False):
            self._pending = dcp.async_save(state, storage_writer=writer, process_group=self._group)
        self._commit = commit_it

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and, on rank 0, committed. A failed write raises
        here (``CheckpointException`` is a ``BaseException``) and leaves the previous checkpoint the newest."""
        pending, commit_it = self._pending, self._commit
        self._pending = self._commit = None
        if pending is None:
            return
        result = getattr(pending, "upload_completion", pending)  # an AsyncSaveResponse, or a Future
        doomed, self._doomed = self._doomed, []
        result.result()
        if commit_it is not None:
            commit_it()
        for path in doomed:
            remove(path)

    def close(self) -> None:
        """:meth:`wait`, then destroy the gloo group of the background saves (its threads end with it); a later
        save makes a new one. Every rank calls it (teardown)."""
        try:
            self.wait()
        finally:
            group, self._group = self._group, None
            if group is not None:
                import torch.distributed as dist

                dist.destroy_process_group(group)
