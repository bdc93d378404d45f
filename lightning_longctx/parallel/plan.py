"""``ParallelPlan``: one run's parallelism, both halves of a step, usable without Lightning.

* **The model half**, :meth:`ParallelPlan.parallelize`: the attention swap, the TP plan, activation checkpointing
  and the data parallelism (FSDP2 shards; DDP wraps), in :func:`~lightning_longctx.parallel.parallelize.parallelize`'s
  one order. The attention each patched model runs is chosen there, once.
* **The batch half**, :meth:`ParallelPlan.shard`: ``shard_batch`` in the run's sequence layout, the batch's
  global positions and packed documents handed to the patched models, and every refusal a batch can meet before
  its forward (ranks of one sequence given different samples, shapes that differ, positions past the model's
  RoPE, packed rows or short segments a hybrid mixer cannot take), decided alike on every rank with ONE small
  collective (none on a later batch that needs no check).

A hand-written loop is correct by construction (docs/user_guide.md, "Without Lightning")::

    plan = ParallelPlan.build(SequenceParallelConfig(sequence_parallel_size=2), "cuda")
    model = plan.parallelize(model, replicate=True)  # DDP-wrapped (FSDP2: sharded in place)
    for batch in loader:
        loss = model(**plan.shard(batch)).loss * plan.config.sp  # DDP averages over dp x sp
        loss.backward(); optimizer.step(); optimizer.zero_grad()
    plan.close()  # the swap undone, the process groups destroyed

The Lightning strategy (``lightning/strategy.py``) is this plan plus Lightning's hooks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_longctx.config import ResolvedConfig, SequenceParallelConfig
from lightning_longctx.integrations.context import BatchPositions, SequenceParallelContext
from lightning_longctx.integrations.hybrid import packed_documents_refusal
from lightning_longctx.integrations.hybrid.base import halo_error, segment_length
from lightning_longctx.parallel.comm import all_gather_no_grad, group_rank_size, reaches_sequence_parallel
from lightning_longctx.parallel.mesh import WorldMesh, build_world_mesh
from lightning_longctx.parallel.parallelize import Parallelized, data_parallel_for, parallelize
from lightning_longctx.parallel.sharding import global_positions, shard_batch

#: the facts one rank contributes to the batch check: fields of the gathered int64 row
_FACTS = ("refused", "rows", "length", "digest", "longest", "packed", "short")


def _digest(ids: Tensor) -> int:
    """An int64 fingerprint of a batch's token ids (60 bits of their SHA-1)."""
    return int(hashlib.sha1(ids.detach().cpu().numpy().tobytes()).hexdigest()[:15], 16)


class ParallelPlan:
    """One run's parallel plan over ``mesh`` with the resolved settings ``config``.

    Args:
        config: :meth:`SequenceParallelConfig.resolve` for this world.
        mesh: :func:`~lightning_longctx.parallel.mesh.build_world_mesh` of ``config.dims``.
        ddp: ``data_parallel="ddp"``: the DDP piece's keywords (``DistributedDataParallel``'s own, and
            ``comm_hook`` / ``comm_wrapper`` / ``comm_state``); not read under FSDP2.
    """

    def __init__(
        self, config: ResolvedConfig, mesh: WorldMesh, *, ddp: Mapping[str, Any] | None = None
    ) -> None:
        self.config = config
        self.mesh = mesh
        #: DDP over the replicas or FSDP2, chosen once (``parallelize.data_parallel_for``)
        self.data_parallel = data_parallel_for(mesh, config, **dict(ddp or {}))
        #: what the model half did; :meth:`undo` puts it back
        self.parallelized = Parallelized()
        self.batches_sharded = 0
        self._checked_first = False

    @classmethod
    def build(
        cls,
        settings: SequenceParallelConfig,
        device_type: str,
        *,
        devices_per_node: int = 0,
        heads: int | None = None,
        ddp: Mapping[str, Any] | None = None,
    ) -> ParallelPlan:
        """The plan of ``settings`` on the initialized default process group (every rank calls it)."""
        _, world = group_rank_size(None)
        config = settings.resolve(world, devices_per_node, device_type, heads=heads)
        return cls(config, build_world_mesh(config.dims, device_type), ddp=ddp)

    # ---- the model half ----
    @property
    def contexts(self) -> list[SequenceParallelContext]:
        """The patched models' contexts (their guardrail counters, the current batch's positions)."""
        return self.parallelized.contexts

    def model_to_device(self, module: nn.Module, device: torch.device) -> None:
        """Place ``module`` before :meth:`parallelize` (under ``cpu_offload`` its transformers models stay on
        the host: FSDP2 moves one block at a time)."""
        self.data_parallel.model_to_device(module, device)

    def parallelize(
        self,
        module: nn.Module,
        *,
        param_dtype: torch.dtype | None = None,
        before_sharding: Callable[[Parallelized], None] | None = None,
        replicate: bool = False,
        device_ids: list[int] | None = None,
    ) -> nn.Module:
        """The model half (every rank): :func:`parallelize` with this plan's data-parallel piece; returns the
        module to run, ``module`` itself or, with ``replicate`` under ``data_parallel="ddp"``, its DDP wrapper
        (a collective: DDP broadcasts rank 0's parameters)."""
        self.parallelized = parallelize(
            module,
            self.mesh,
            self.config,
            param_dtype=param_dtype,
            before_sharding=before_sharding,
            data_parallel=self.data_parallel,
        )
        return self.data_parallel.wrap(module, device_ids) if replicate else module

    def undo(self) -> None:
        """Put the attention, loss, MLPs and checkpointing of the patched models back (TP and FSDP2 stay)."""
        self.parallelized.undo()

    def close(self) -> None:
        """:meth:`undo`, then the mesh's process groups (every rank); under FSDP2 the groups its shards live on
        stay (the model uses them after the run: ``full_state_dict``, its next fit)."""
        self.undo()
        self.mesh.destroy(keep_sharding=self.config.settings.data_parallel == "fsdp")

    # ---- the first step's guards ----
    def start_first_step(self) -> None:
        """Before the first training step: zero the patched models' attention and mixer counters."""
        for ctx in self.contexts:
            ctx.attention_calls = ctx.mixer_calls = 0

    def verify_first_step(self, loss: Any) -> None:
        """After it: transformers models ran every attention layer and mixer through our functions (the counters
        on their contexts); a plain model's loss depends on a sequence-parallel collective (its autograd graph;
        not checked when the graph cannot tell: manual optimisation, reentrant checkpointing)."""
        for ctx in self.contexts:
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
        sp = self.config.sp
        if sp > 1 and not self.contexts and reaches_sequence_parallel(loss) is False:
            raise RuntimeError(
                f"sequence_parallel_size={sp} but the first training step ran no sequence-parallel "
                "attention: each rank would attend only to its own shard. Call lightning_longctx.ulysses_attention "
                "/ fpdt_attention with trainer.strategy.sp_group in your model, or use a transformers model"
            )

    def check_replicated_gradients(self, module: nn.Module) -> None:
        """Tensor parallelism, after the first backward: every parameter the TP plan does not split has the same
        gradient on all TP ranks (``tensor_parallel.check_replicated_gradients``), else the model is refused."""
        from lightning_longctx.parallel.tensor_parallel import check_replicated_gradients

        check_replicated_gradients(module.named_parameters(), self.mesh.tp_group)

    # ---- the batch half ----
    def chunk_for(self, seq_len: int) -> int | None:
        """Tokens per FPDT chunk per rank for a global sequence of ``seq_len`` (``None``: no chunking)."""
        return self.config.chunk_for(seq_len)

    def shard(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's part of ``batch`` (``shard_batch`` in the run's layout), its positions handed to the patched
        models, after the batch checks (every rank calls it with its own batch; one small collective on the
        first batch and on every batch a RoPE or hybrid check needs, none otherwise)."""
        check = self._needs_check(batch)
        try:
            out = self._shard_locally(batch)
            facts, error = self._facts(batch, out), None
        except Exception as err:  # joins the check first: the other ranks are waiting in it
            if not check:
                raise
            facts, error = dict.fromkeys(_FACTS, 0) | {"refused": 1}, err
        if check:
            self._agree(facts, error)
        self.batches_sharded += 1
        return out

    def _needs_check(self, batch: Mapping[str, Any]) -> bool:
        """Alike on every rank without communication: the first batch, a hybrid model, a RoPE limit with
        position ids to read."""
        if not self._checked_first:
            return True
        if any(ctx.num_mixers for ctx in self.contexts):
            return True
        return "position_ids" in batch and any(ctx.rope_limit is not None for ctx in self.contexts)

    def _shard_locally(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        chunk = self.chunk_for(ids.shape[1]) if isinstance(ids, Tensor) and ids.dim() == 2 else None
        settings, ring = self.config.settings, self.config.dims.ring
        out = shard_batch(
            batch,
            group=self.mesh.sp_group,
            chunk_size=chunk,
            ignore_index=settings.ignore_index,
            pad_token_id=settings.pad_token_id,
            ring=ring,
        )
        if self.contexts and isinstance(out.get("position_ids"), Tensor):  # the documents, no collective
            full = global_positions(batch, group=self.mesh.sp_group, chunk_size=chunk, ring=ring)
            for ctx in self.contexts:
                ctx.positions = BatchPositions(local=out["position_ids"], full=full, length=ids.shape[1])
            # without position ids the length decides, alike on every rank (with them, every rank's largest)
            if "position_ids" not in batch:
                self._check_rope(ids.shape[1])
        return out

    def _facts(self, batch: Mapping[str, Any], out: Mapping[str, Any]) -> dict[str, int]:
        """This rank's row of the batch check (``_FACTS``)."""
        ids = batch["input_ids"]
        facts = dict.fromkeys(_FACTS, 0) | {"rows": ids.shape[0], "length": ids.shape[1]}
        if not self._checked_first:
            facts["digest"] = _digest(ids)
        positions = self.contexts[0].positions if self.contexts else None
        if positions is not None and "position_ids" in batch:
            facts["longest"] = int(positions.sequence_length())
        hybrids = [ctx for ctx in self.contexts if ctx.num_mixers]
        if hybrids and positions is not None:
            refusal = next((r for r in map(packed_documents_refusal, hybrids) if r is not None), None)
            facts["packed"] = int(refusal is not None and positions.documents() is not None)
            local_len = out["position_ids"].shape[-1]
            facts["short"] = int(any(segment_length(ctx, local_len) < ctx.mixer_halo for ctx in hybrids))
        return facts

    def _agree(self, facts: dict[str, int], error: Exception | None) -> None:
        """One all-gather of every rank's facts, then the refusals in order, alike on every rank."""
        row = torch.tensor(
            [[facts[k] for k in _FACTS]], dtype=torch.int64, device=torch.device(self.mesh.root.device_type)
        )
        everyone = all_gather_no_grad(row, dim=0).cpu()  # (world, len(_FACTS))
        table = [dict(zip(_FACTS, map(int, r))) for r in everyone]
        if error is not None:
            raise error
        refused = [rank for rank, r in enumerate(table) if r["refused"]]
        if refused:
            raise ValueError(
                f"ranks {refused} refused their batch (their error says why); this rank's was fine"
            )
        if not self._checked_first:
            self._check_samples(table)
            self._checked_first = True
        self._check_rope(max(r["longest"] for r in table))
        self._check_hybrid(any(r["packed"] for r in table), any(r["short"] for r in table))

    def _check_samples(self, table: list[dict[str, int]]) -> None:
        """First batch: every rank of an SP group holds the same sample, and all shapes agree (a mismatch
        would otherwise deadlock or silently mix samples inside the all-to-alls)."""
        shapes = {rank: (r["rows"], r["length"]) for rank, r in enumerate(table)}
        if len(set(shapes.values())) > 1:
            raise RuntimeError(
                f"batch input_ids shapes differ across ranks: {shapes}. All ranks must use the same batch size "
                "and sequence length (pad or pack to a fixed length in the dataset/collate_fn)"
            )
        share = self.config.sp * self.config.tp  # the consecutive ranks of one dp index share a sequence
        for start in range(0, len(table), share):
            ranks = list(range(start, start + share))
            if len({table[r]["digest"] for r in ranks}) > 1:
                raise RuntimeError(
                    f"ranks {ranks} share one sequence (sequence x tensor parallel) but received different "
                    "samples; the training sampler must span data-parallel ranks only. Do not pass your own "
                    "DistributedSampler (let Lightning add it: use_distributed_sampler=True)"
                )

    def _check_rope(self, longest: int, holder: str = "this batch holds") -> None:
        """RoPE models: no position past what the model's rotary embedding covers (``integrations/rope.py``),
        from the largest position of every rank's batch (packed documents restart their positions), or of the
        data's rows (:meth:`check_data_positions`)."""
        for ctx in self.contexts:
            if ctx.rope_limit is not None and longest > ctx.rope_limit.limit:
                raise ctx.rope_limit.error(ctx.model_name, longest, holder)

    def check_data_positions(self, datamodule: Any) -> None:
        """Before the first step: a data module that knows its rows (``max_positions()``: the largest position
        id + 1 of any training or validation row, as :class:`~lightning_longctx.data.TextFilesDataModule` and
        :class:`~lightning_longctx.data.HFDatasetDataModule` give) is checked against the model's RoPE here,
        rather than at the batch that first holds the position, hours into the run."""
        known = getattr(datamodule, "max_positions", None)
        longest = known() if callable(known) else None
        if longest is not None:
            self._check_rope(int(longest), "the datamodule's rows hold")

    def _check_hybrid(self, packed: bool, short: bool) -> None:
        """Hybrid models: what their mixers refuse (packed documents, segments shorter than a conv's halo);
        raised on every rank before the forward, where a refusal inside it would leave the others waiting."""
        hybrids = [ctx for ctx in self.contexts if ctx.num_mixers]
        if not hybrids or not (packed or short):
            return
        if packed:
            raise next(r for r in map(packed_documents_refusal, hybrids) if r is not None)
        ctx = hybrids[0]
        local_len = ctx.positions.local.shape[-1]
        ring = self.config.dims.ring if ctx.local_chunk(local_len) is None else 1
        raise halo_error(ctx.model_name, ctx.mixer_halo, segment_length(ctx, local_len), local_len, ring=ring)
