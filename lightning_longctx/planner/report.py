"""The planner's answer: :class:`MemoryPlan` (bytes per device and per host, by component and by phase), its
table and JSON, and the memory-size text the planner reads and writes (:func:`parse_bytes`,
:func:`format_bytes`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from lightning_longctx.config import Mode

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_UNITS.update({f"{u}ib": v for u, v in list(_UNITS.items()) if u not in ("", "b")})
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"80G"`` (= GiB), ``"141GB"`` (10^9), ``"512MiB"`` or a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a memory size; write e.g. 80GiB, 80G (= GiB), 141GB (10^9 bytes) or 512MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``1.50 GiB``-style text (binary units)."""
    if n == 0:
        return "0 B"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


@dataclass(frozen=True)
class MemoryComponent:
    """One row of a plan: bytes on one device and on its host in the peak phase, the largest it gets
    in any phase, and what it is."""

    name: str
    device: int
    host: int
    largest: int
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Bytes per device and per host of one training step, by component (see the package docstring).

    ``device_total``: the device's peak (its largest phase); ``host_total``: one rank's peak in host memory
    (its largest moment; a host of ``devices_per_host`` ranks needs :attr:`host_needed`). ``combined``: the
    largest ``device + host`` of any moment (what a CPU run, whose device IS the host, peaks at).
    ``phases``: ``(phase, device bytes, host bytes)`` of every phase modelled (the device's at the phase's
    peak moment, the host's largest in the phase).
    """

    model: str
    params: int
    seq_len: int  # as asked
    padded_seq_len: int  # what shard_batch pads it to
    tokens_per_device: int  # micro_batch_size * padded_seq_len / sp
    sequence_parallel_size: int
    data_parallel_size: int
    mode: str  # a Mode's value
    fpdt_chunk_size: int | None  # tokens per chunk per rank actually used
    loss_chunk_size: int | None
    mlp_chunk_size: int | None
    offload: bool
    activation_checkpointing: bool
    activation_offload: bool
    data_parallel: str  # a DataParallel's value
    micro_batch_size: int
    precision: str
    param_bytes: int
    optimizer: str
    components: tuple[MemoryComponent, ...]
    phases: tuple[tuple[str, int, int], ...]
    peak_phase: str
    device_total: int
    host_total: int
    combined: int
    between_steps: int  # allocated between steps: weights, gradients, optimizer state, DDP buckets
    cpu_offload: bool = False
    mp_policy: bool = False
    lora_rank: int | None = None
    trainable_params: int = 0
    device_reserve: int = 0  # CUDA context + allocator slack, beside device_total
    host_reserve: int = 0  # per rank, beside host_total
    devices_per_host: int = 1
    device_memory: int | None = None
    host_memory: int | None = None  # per host
    tensor_parallel_size: int = 1
    vocab_parallel: bool = False  # the lm_head split over the vocabulary across the tp ranks (FPDT's loss)
    local_params: int = 0  # one tensor-parallel rank's parameters (all of them with tp = 1), before FSDP
    ring_size: int = 1  # ring attention's r (Ulysses over sp / r ranks); 1: Ulysses alone
    #: "cuda" or "cpu": what the table says the device reserve holds (an init argument, not a field, so the
    #: JSON of a plan keeps its keys)
    device_type: dataclasses.InitVar[str] = "cuda"

    def __post_init__(self, device_type: str) -> None:
        parts = (
            "CUDA context, allocator slack" if device_type == "cuda" else "allocator slack; no CUDA context"
        )
        object.__setattr__(self, "_reserve_parts", parts)

    def __getitem__(self, name: str) -> MemoryComponent:
        for comp in self.components:
            if comp.name == name:
                return comp
        raise KeyError(f"{name!r} is not a component; components: {[c.name for c in self.components]}")

    @property
    def device_needed(self) -> int:
        """What one device must have: the peak plus the reserve (CUDA context, allocator slack)."""
        return self.device_total + self.device_reserve

    @property
    def host_needed(self) -> int:
        """What one host must have: ``devices_per_host`` ranks' peak host bytes plus each one's process."""
        return self.devices_per_host * (self.host_total + self.host_reserve)

    def _slack(self) -> dict[str, float]:
        """Free fraction of each limit given (negative: over)."""
        out = {}
        if self.device_memory is not None:
            out["device"] = 1 - self.device_needed / self.device_memory
        if self.host_memory is not None:
            out["host"] = 1 - self.host_needed / self.host_memory
        return out

    @property
    def fits(self) -> bool | None:
        """Whether the device needs fit ``device_memory`` and the host needs ``host_memory`` (those given;
        None when neither was)."""
        slack = self._slack()
        return None if not slack else min(slack.values()) >= 0

    @property
    def binding(self) -> str | None:
        """The limit with the least room: ``"device"`` or ``"host"`` (None when no memory size was given)."""
        slack = self._slack()
        return min(slack, key=slack.__getitem__) if slack else None

    def phase(self, name: str) -> tuple[int, int]:
        """``(device, host)`` bytes of one phase."""
        for phase, device, host in self.phases:
            if phase == name:
                return device, host
        raise KeyError(f"{name!r} is not a phase; phases: {[p for p, _, _ in self.phases]}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data: settings, components, phases and totals (bytes)."""
        out = dataclasses.asdict(self)
        if self.ring_size == 1:  # the key comes with a ring: a plan without one keeps the JSON it always had
            del out["ring_size"]
        out["components"] = [dataclasses.asdict(c) for c in self.components]
        out["phases"] = [{"phase": p, "device": d, "host": h} for p, d, h in self.phases]
        out.update(fits=self.fits, binding=self.binding, device_needed=self.device_needed,
                   host_needed=self.host_needed)  # fmt: skip
        return out

    def describe(self) -> str:
        """One line: model, sequence, layout, mode and precision."""
        n = f"{self.seq_len:,} tokens"
        if self.padded_seq_len != self.seq_len:
            n += f" (padded to {self.padded_seq_len:,})"
        mode = "Ulysses"
        if self.mode == Mode.FPDT:
            chunks = self.tokens_per_device // (self.micro_batch_size * self.fpdt_chunk_size)
            mode = f"FPDT chunk {self.fpdt_chunk_size:,} ({chunks} per rank)" + (
                " + offload" if self.offload else ""
            )
        extras = [self.precision, self.data_parallel.upper()]
        if self.mp_policy:
            extras.append("MixedPrecisionPolicy (16-bit compute params, fp32 reduce)")
        if self.cpu_offload:
            extras.append("cpu_offload")
        if self.tensor_parallel_size > 1:
            head = "vocab-parallel lm_head" if self.vocab_parallel else "replicated lm_head"
            extras.append(f"{_count(self.local_params)} params per TP rank, {head}")
        if self.lora_rank:
            extras.append(f"LoRA r={self.lora_rank} ({_count(self.trainable_params)} trainable)")
        if self.activation_offload:
            extras.append("activation checkpointing + offload")
        elif self.activation_checkpointing:
            extras.append("activation checkpointing")
        if self.micro_batch_size > 1:
            extras.append(f"micro batch {self.micro_batch_size}")
        tp = f" x tp {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        if self.ring_size > 1:
            sp = self.sequence_parallel_size
            tp = f" (ring {self.ring_size} x Ulysses {sp // self.ring_size}){tp}"
            mode = (
                f"FPDT x ring, {mode.removeprefix('FPDT ')}" if self.mode == Mode.FPDT else "Ulysses x ring"
            )
        return (
            f"{self.model} ({_count(self.params)} params), {n}, sp {self.sequence_parallel_size}{tp} x dp "
            f"{self.data_parallel_size}, {mode}, {', '.join(extras)}: {self.tokens_per_device:,} tokens per device"
        )

    def table(self) -> str:
        """A printable table: component, bytes per device and per host in the peak phase, and notes."""
        rows = [(c.name, format_bytes(c.device) if c.device else "-", format_bytes(c.host) if c.host else "-",
                 c.note) for c in self.components]  # fmt: skip
        rows.append((f"total at peak ({self.peak_phase})", format_bytes(self.device_total),
                     format_bytes(self.host_total) if self.host_total else "-", ""))  # fmt: skip
        heads = ("component", "per device", "per host", "note")
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
        line = "-" * (sum(widths) + 6)

        def fmt(r: tuple[str, ...]) -> str:
            return f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip()

        out = [self.describe(), fmt(heads), line, *map(fmt, rows[:-1]), line, fmt(rows[-1])]
        out.append("phases (device / host): " + ", ".join(
            f"{p} {format_bytes(d)} / {format_bytes(h)}" for p, d, h in self.phases))  # fmt: skip
        out.append(f"reserve: {format_bytes(self.device_reserve)} per device ({self._reserve_parts}), "
                   f"{format_bytes(self.host_reserve)} per rank on its host (the process)")  # fmt: skip
        for name, memory, needed, per in (
            ("device", self.device_memory, self.device_needed, "per device"),
            ("host", self.host_memory, self.host_needed, f"per host of {self.devices_per_host} devices"),
        ):
            if memory is not None:
                ok = needed <= memory
                out.append(f"{name} memory {format_bytes(memory)} {per}: needs {format_bytes(needed)}, "
                           f"{'fits' if ok else 'does NOT fit'} ({format_bytes(abs(memory - needed))} "
                           f"{'free' if ok else 'over'})")  # fmt: skip
        if self.binding is not None:
            out.append(f"binding limit: {self.binding} memory")
        return "\n".join(out)
