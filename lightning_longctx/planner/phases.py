"""The phases of one training step: which memory terms are alive at each moment, and the peak.

The peak is the largest of five phases: the last layer's forward and the loss forward (with the previous
step's gradients still allocated: Lightning frees them between forward and backward), the loss backward, the
last layer's backward, and the optimizer step. A layer phase is the larger of its attention moment and its MLP
moment (the layer's MLP tensors do not exist yet, or are freed, while its attention runs). :func:`evaluate`
sums the terms alive at each moment and builds the :class:`~lightning_longctx.planner.report.MemoryPlan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_longctx.planner.per_rank import _PerRank
from lightning_longctx.planner.report import MemoryComponent, MemoryPlan, format_bytes
from lightning_longctx.planner.terms import (
    _ORDER,
    _activation_offload_store,
    _all_to_all_buffers,
    _attention_backward,
    _attention_forward,
    _autocast_weight_copies,
    _checkpointed_inputs,
    _ddp_gradient_buckets,
    _final_norm_and_head_input,
    _fpdt_chunk_store,
    _fsdp_block_gradients,
    _fsdp_blocks_in_flight,
    _fsdp_root_params,
    _last_layer_attention_activations,
    _last_layer_mlp_activations,
    _last_layer_o_proj_input,
    _loss_backward,
    _loss_forward,
    _mlp_backward,
    _mlp_forward,
    _model_inputs,
    _optimizer_state,
    _optimizer_step_temporary,
    _prefetched_layer_inputs,
    _recomputed_layer_attention,
    _recomputed_layer_mlp,
    _recomputed_o_proj_input,
    _ring_backward_buffers,
    _ring_forward_buffers,
    _running_layer_chunk_store,
    _running_layer_input,
    _saved_activations,
    _sharded_gradients,
    _state_exchange_buffers,
    _Term,
    _weights,
)

# A phase is a candidate peak. A layer phase has two moments (its attention, its MLP) and counts as the
# larger: the last layer's forward, its backward (the first backward of a layer). In the table, ``x``: the
# term is alive at that moment. Lightning frees the previous step's gradients between forward and backward.
_MOMENTS = (
    ("layer forward", "attention"),
    ("layer forward", "MLP"),
    ("loss forward", ""),
    ("loss backward", ""),
    ("layer backward", "attention"),
    ("layer backward", "MLP"),
    ("optimizer step", ""),
)

# fmt: off
_PHASE_TABLE: tuple[tuple[Callable[[_PerRank], _Term], str], ...] = (
    #                                     layer fwd   loss   loss   layer bwd   optimizer
    #                                     attn  MLP   fwd    bwd    attn  MLP   step
    (_weights,                           "x     x     x      x      x     x     x"),
    (_sharded_gradients,                 "x     x     x      -      -     -     x"),
    (_optimizer_state,                   "x     x     x      x      x     x     x"),
    (_optimizer_step_temporary,          "-     -     -      -      -     -     x"),
    (_ddp_gradient_buckets,              "x     x     x      x      x     x     x"),
    (_fsdp_root_params,                  "x     x     x      x      x     x     x"),
    (_fsdp_blocks_in_flight,             "x     x     -      -      x     x     -"),
    (_fsdp_block_gradients,              "-     -     -      -      x     x     -"),
    (_autocast_weight_copies,            "x     x     x      x      x     x     -"),
    (_saved_activations,                 "x     x     x      x      x     x     -"),
    (_last_layer_attention_activations,  "x     x     x      x      x     x     -"),
    (_last_layer_o_proj_input,           "x     x     x      x      -     x     -"),
    (_last_layer_mlp_activations,        "-     x     x      x      -     x     -"),
    (_checkpointed_inputs,               "x     x     x      x      x     x     -"),
    (_model_inputs,                      "x     x     x      x      x     x     -"),
    (_final_norm_and_head_input,         "x     x     x      x      -     -     -"),
    (_running_layer_input,               "x     x     -      -      -     -     -"),
    (_prefetched_layer_inputs,           "-     -     -      -      x     x     -"),
    (_fpdt_chunk_store,                  "x     x     x      x      x     x     -"),
    (_running_layer_chunk_store,         "x     -     -      -      -     -     -"),
    (_activation_offload_store,          "x     x     x      x      x     x     -"),
    (_loss_forward,                      "-     -     x      -      -     -     -"),
    (_loss_backward,                     "-     -     -      x      -     -     -"),
    (_attention_forward,                 "x     -     -      -      -     -     -"),
    (_attention_backward,                "-     -     -      -      x     -     -"),
    (_all_to_all_buffers,                "x     -     -      -      x     -     -"),
    (_ring_forward_buffers,              "x     -     -      -      -     -     -"),
    (_ring_backward_buffers,             "-     -     -      -      x     -     -"),
    (_state_exchange_buffers,            "x     -     -      -      x     -     -"),
    (_mlp_forward,                       "-     x     -      -      -     -     -"),
    (_mlp_backward,                      "-     -     -      -      -     x     -"),
    (_recomputed_layer_attention,        "-     -     -      -      x     x     -"),
    (_recomputed_o_proj_input,           "-     -     -      -      -     x     -"),
    (_recomputed_layer_mlp,              "-     -     -      -      -     x     -"),
)
# fmt: on

#: allocated between steps (MemoryPlan.between_steps)
_BETWEEN_STEPS = (_weights, _sharded_gradients, _optimizer_state, _ddp_gradient_buckets)


@dataclass(frozen=True)
class _Moment:
    """The bytes of each row (device, host) at one moment of a phase."""

    phase: str
    device: dict[str, int]
    host: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def _moments(terms: list[tuple[_Term, str]]) -> list[_Moment]:
    """Each moment of :data:`_MOMENTS` with the rows of the terms alive then (marked ``x``)."""
    alive = [marks.split() for _, marks in terms]
    assert all(len(a) == len(_MOMENTS) for a in alive) and all(t.row in _ORDER for t, _ in terms)
    moments = []
    for col, (phase, _) in enumerate(_MOMENTS):
        device: dict[str, int] = {}
        host: dict[str, int] = {}
        for (term, _), marks in zip(terms, alive):
            if marks[col] == "x":
                device[term.row] = device.get(term.row, 0) + term.device
                host[term.row] = host.get(term.row, 0) + term.host
        moments.append(_Moment(phase, device, host))
    return moments


def evaluate(lay: _PerRank) -> MemoryPlan:
    """Evaluate the phase table for what one rank holds (``lay``): the peak of every phase, and the rows of
    the peak phase."""
    terms = [(term(lay), marks) for term, marks in _PHASE_TABLE]
    moments = _moments(terms)
    phases = {phase: [mo for mo in moments if mo.phase == phase] for phase, _ in _MOMENTS}
    # a phase peaks at its larger moment (the first on a tie)
    at = {phase: max(group, key=lambda mo: mo.total) for phase, group in phases.items()}
    peak = max(at, key=lambda phase: at[phase].total)

    def largest(row: str) -> int:
        """The most the row holds on the device at any moment of any phase."""
        return max(mo.device.get(row, 0) for mo in moments)

    components = []
    for row in _ORDER:
        top = largest(row)
        # the host column is the most the row holds on the host in any phase, whatever the device's peak (the
        # activations' stores are freed by the optimizer step, which is when offloaded model state peaks)
        hosts = [mo.host.get(row, 0) for mo in moments]
        if top == 0 and max(hosts) == 0:
            continue
        note = "; ".join(term.note for term, _ in terms if term.row == row and term.note)
        if top != at[peak].device.get(row, 0):
            note += f" (largest {format_bytes(top)})"
        components.append(MemoryComponent(row, at[peak].device.get(row, 0), max(hosts), top, note))
    return MemoryPlan(
        model=lay.shape.model_name,
        params=lay.shape.params,
        seq_len=lay.seq_len,
        padded_seq_len=lay.padded,
        tokens_per_device=lay.t,
        sequence_parallel_size=lay.sp,
        data_parallel_size=lay.dp,
        mode=lay.mode.value,  # the report keeps plain strings (its JSON, its repr)
        fpdt_chunk_size=lay.chunk,
        loss_chunk_size=lay.loss_chunk,
        mlp_chunk_size=lay.mlp_chunk,
        offload=lay.offload,
        activation_checkpointing=lay.checkpointing,
        activation_offload=lay.activation_offload,
        data_parallel=lay.data_parallel.value,
        micro_batch_size=lay.b,
        precision=lay.precision,
        param_bytes=lay.w,
        optimizer=lay.optimizer,
        components=tuple(components),
        phases=tuple((p, mo.total, max(m.host_total for m in phases[p])) for p, mo in at.items()),
        peak_phase=peak,
        device_total=at[peak].total,
        host_total=max(mo.host_total for mo in moments),  # the host's peak: any moment, not the device's
        combined=max(mo.total + mo.host_total for mo in moments),
        between_steps=sum(term(lay).device + term(lay).host for term in _BETWEEN_STEPS),
        cpu_offload=lay.cpu_offload,
        mp_policy=lay.mp_policy,
        lora_rank=lay.lora_rank,
        trainable_params=lay.trainable,
        device_reserve=lay.device_reserve(at[peak].total),
        device_type=lay.device_type,
        host_reserve=lay.host_reserve,
        devices_per_host=lay.devices_per_host,
        device_memory=lay.device_memory,
        host_memory=lay.host_memory,
        tensor_parallel_size=lay.tp,
        vocab_parallel=lay.vocab_parallel,
        local_params=lay.local_params,
        ring_size=lay.ring,
    )
