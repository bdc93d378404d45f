"""What the step-time model (``step_time.py``) reads of a machine: a :class:`DeviceSpec` per device kind.

Every number is an *achieved* rate (what a kernel or a copy reaches), not a data-sheet peak, except
``peak_flops``, the MFU denominator. Rates are per device; ``host_memory_bandwidth`` is per host (node), shared
by its ranks. Sources, per field (``source`` of each spec names them again):

* ``peak_flops``: dense bf16 of the vendors' data sheets (``lightning_longctx.planner.flops.PEAK_FLOPS``; B200: 2.25
  PFLOP/s dense, NVIDIA HGX B200 data sheet).
* ``matmul_flops``: bf16 Maximum Achievable Matmul FLOPS (MAMF), S. Bekman, *ml-engineering*,
  ``compute/accelerator`` (mamf-finder.py): A100 SXM 267.9, H100 SXM 792.1, B200 1745.0 TFLOP/s. H200 runs
  H100's SMs at the same clock and power: H100's number.
* ``attention``: flash-attention forward and backward TFLOP/s at head dim 128, causal, 16K tokens, in
  FlashAttention's FLOP convention (forward ``4·s²·h·d/2``, backward 2.5× that). FA2 on A100 (fwd 197, bwd
  187) and H100 (fwd 335, bwd 325): T. Dao, *FlashAttention-2* (arXiv 2307.08691) Figs. 4 and 7, read from the
  plots (their fwd+bwd: 189 and 328 TFLOP/s, which these reproduce). FA3 and cuDNN 9 on H100 (FA3 fwd 610, bwd
  470; cuDNN fwd 580, bwd 450): J. Shah et al., *FlashAttention-3* (arXiv 2407.08608) Figs. 5-6, read from the
  plots. B200 (cuDNN fwd 1400, bwd 1000): an estimate from NVIDIA's cuDNN 9 Blackwell notes and FlashAttention-4
  talks; no paper figure, marked ``estimate`` in ``source``. Below ``ATTENTION_HALF_TOKENS`` keys a kernel's rate
  falls (``rate · L / (L + L_half)``, normalised at 16K): FA2's sequence sweep gives ~0.56 of its 16K rate at
  512 tokens and ~0.9 at 4K.
* ``memory_bandwidth``: HBM, 85 % of the data sheet (1555 / 2039 / 3350 / 4800 / 8000 GB/s): what a
  streaming copy reaches (elementwise kernels: norms, RoPE, SwiGLU, the loss's softmax).
* ``intra_node_bandwidth``: NCCL bus bandwidth per GPU per direction over NVLink (NVLink 3 / 4 / 5: 300 / 450 /
  900 GB/s per direction; nccl-tests on DGX A100 / H100 reach ~230 / ~360 GB/s, B200 taken at the same 80 %).
* ``inter_node_bandwidth``: one InfiniBand NIC per GPU at ~90 % of its line rate (DGX A100: HDR 200 Gb/s,
  DGX H100 / H200 / B200: NDR 400 Gb/s).
* ``host_link_bandwidth``: pinned host <-> device copies over PCIe per GPU (Gen4 x16 ~24 GB/s, Gen5 x16 ~50
  GB/s, ``bandwidthTest``).
* ``host_memory_bandwidth``: the node's DRAM, ~70 % of its channels' peak (STREAM): DGX A100 2 x EPYC 7742
  (16 x DDR4-3200, 410 GB/s), DGX H100 / H200 2 x Xeon 8480C (16 x DDR5-4800, 614 GB/s), DGX B200 2 x Xeon
  8570 (16 x DDR5-5600, 717 GB/s).
* ``op_latency``: seconds of host time to launch one operator from eager PyTorch (~8 µs on a GPU host); on
  a GPU it runs ahead of the device (a step costs at least its launches), on a CPU it adds to the compute.

A CPU "device" is measured, not tabled: ``benchmarks/calibrate_step_time.py`` writes its JSON (:func:`load_spec`
reads it); the planner itself measures nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

#: keys (L) at which a flash-attention kernel reaches half its long-sequence rate (FA2's sequence sweep)
ATTENTION_HALF_TOKENS = 400
#: the sequence at which the ``attention`` rates of the table were measured
ATTENTION_REFERENCE_TOKENS = 16384


@dataclass(frozen=True)
class KernelRate:
    """Achieved forward and backward FLOP/s of one attention kernel (FlashAttention's FLOP convention:
    backward = 2.5 x forward FLOPs), at ``reference_tokens`` keys; ``half_tokens`` is where the rate halves.
    ``measured``: rows ``(tokens, causal fwd, causal bwd, full fwd, full bwd)`` of a kernel timed at those
    lengths (a calibrated CPU); when given, :meth:`rates` interpolates them (log-linear in the length) instead
    of the ramp, for causal calls (a diagonal block) and full ones (an FPDT tile below the diagonal) apart."""

    forward: float
    backward: float
    half_tokens: int = ATTENTION_HALF_TOKENS
    reference_tokens: int = ATTENTION_REFERENCE_TOKENS
    measured: tuple[tuple[float, float, float, float, float], ...] = ()

    def ramp(self, tokens: float) -> float:
        """The fraction of the reference rate a kernel reaches over ``tokens`` keys per call."""
        if self.half_tokens <= 0:
            return 1.0
        h = self.half_tokens
        return (tokens / (tokens + h)) / (self.reference_tokens / (self.reference_tokens + h))

    def rates(self, tokens: float, causal: bool = True) -> tuple[float, float]:
        """(forward, backward) FLOP/s of one call over ``tokens`` queries and keys."""
        if not self.measured:
            return self.forward * self.ramp(tokens), self.backward * self.ramp(tokens)
        rows = sorted(self.measured)
        col = (1, 2) if causal else (3, 4)
        if tokens <= rows[0][0]:
            lo = hi = rows[0]
        elif tokens >= rows[-1][0]:
            lo = hi = rows[-1]
        else:
            hi = next(r for r in rows if r[0] >= tokens)
            lo = rows[rows.index(hi) - 1]
        x = (
            0.0
            if hi[0] == lo[0]
            else (math.log(tokens) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
        )
        return tuple(lo[c] + x * (hi[c] - lo[c]) for c in col)  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One device kind's achieved rates (module docstring for each field and its source)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s (data sheet): the MFU denominator
    matmul_flops: float  # achieved dense matmul FLOP/s
    attention: Mapping[str, KernelRate]  # kernel name -> achieved rates
    default_kernel: str  # the kernel this package runs there (flash-attn 2 / SDPA flash on A100/H100)
    memory_bandwidth: float  # device memory, bytes/s
    intra_node_bandwidth: float  # collective bus bandwidth per device per direction inside a node
    inter_node_bandwidth: float  # per device across nodes
    host_link_bandwidth: float  # host <-> device copies per device
    host_memory_bandwidth: float  # per host (node), shared by its ranks
    device_memory: int  # bytes
    op_latency: float = 8e-6  # host seconds to launch one operator
    overlap: bool = True  # copies and collectives run beside compute (side streams); False on a CPU
    cores: int = 0  # CPU only: cores the ranks share (0: a GPU, one device per rank)
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "matmul_flops", "memory_bandwidth", "intra_node_bandwidth",
                     "inter_node_bandwidth", "host_link_bandwidth", "host_memory_bandwidth"):  # fmt: skip
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"DeviceSpec {self.name!r}: {name}={value!r} must be a positive rate")
        if self.default_kernel not in self.attention:
            raise ValueError(
                f"DeviceSpec {self.name!r}: default_kernel={self.default_kernel!r} is not one of its attention "
                f"kernels {sorted(self.attention)}; add its rates or pick one of those"
            )
        object.__setattr__(self, "attention", MappingProxyType(dict(self.attention)))

    def kernel(self, name: str | None) -> KernelRate:
        """The rates of attention kernel ``name`` (None: the default kernel)."""
        key = self.default_kernel if name is None else name
        if key not in self.attention:
            raise ValueError(
                f"attention kernel {key!r} has no rates for {self.name}; use one of {sorted(self.attention)} "
                "or give its rates in a device spec (--device-spec)"
            )
        return self.attention[key]

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["attention"] = {k: dataclasses.asdict(v) for k, v in self.attention.items()}
        return out


def _fa2(fwd: float, bwd: float) -> KernelRate:
    return KernelRate(fwd * 1e12, bwd * 1e12)


_A100_KERNELS = {"fa2": _fa2(197, 187)}
_HOPPER_KERNELS = {"fa2": _fa2(335, 325), "fa3": _fa2(610, 470), "cudnn": _fa2(580, 450)}
_DGX_A100 = {"intra_node_bandwidth": 230e9, "inter_node_bandwidth": 22.5e9, "host_link_bandwidth": 24e9,
             "host_memory_bandwidth": 290e9}  # fmt: skip
_DGX_H100 = {"intra_node_bandwidth": 360e9, "inter_node_bandwidth": 45e9, "host_link_bandwidth": 50e9,
             "host_memory_bandwidth": 430e9}  # fmt: skip

DEVICES: Mapping[str, DeviceSpec] = MappingProxyType(
    {
        "a100-40gb": DeviceSpec(
            name="A100 40GB SXM",
            peak_flops=312e12,
            matmul_flops=267.9e12,
            attention=_A100_KERNELS,
            default_kernel="fa2",
            memory_bandwidth=0.85 * 1555e9,
            device_memory=40 << 30,
            **_DGX_A100,
            source="A100 data sheet; MAMF (ml-engineering); FA2 paper Fig. 4; nccl-tests DGX A100; HDR IB",
        ),
        "a100-80gb": DeviceSpec(
            name="A100 80GB SXM",
            peak_flops=312e12,
            matmul_flops=267.9e12,
            attention=_A100_KERNELS,
            default_kernel="fa2",
            memory_bandwidth=0.85 * 2039e9,
            device_memory=80 << 30,
            **_DGX_A100,
            source="A100 data sheet; MAMF (ml-engineering); FA2 paper Fig. 4; nccl-tests DGX A100; HDR IB",
        ),
        "h100": DeviceSpec(
            name="H100 80GB SXM",
            peak_flops=989e12,
            matmul_flops=792.1e12,
            attention=_HOPPER_KERNELS,
            default_kernel="fa2",
            memory_bandwidth=0.85 * 3350e9,
            device_memory=80 << 30,
            **_DGX_H100,
            source="H100 data sheet; MAMF (ml-engineering); FA2 paper Fig. 7, FA3 paper Figs. 5-6; NDR IB",
        ),
        "h200": DeviceSpec(
            name="H200 141GB SXM",
            peak_flops=989e12,
            matmul_flops=792.1e12,
            attention=_HOPPER_KERNELS,
            default_kernel="fa2",
            memory_bandwidth=0.85 * 4800e9,
            device_memory=141 * 10**9,
            **_DGX_H100,
            source="H200 data sheet (H100's SMs and clocks: H100's kernel rates); NDR IB",
        ),
        "b200": DeviceSpec(
            name="B200 180GB SXM",
            peak_flops=2250e12,
            matmul_flops=1745e12,
            attention={"cudnn": _fa2(1400, 1000)},
            default_kernel="cudnn",
            memory_bandwidth=0.85 * 8000e9,
            intra_node_bandwidth=720e9,
            inter_node_bandwidth=45e9,
            host_link_bandwidth=50e9,
            host_memory_bandwidth=500e9,
            device_memory=180 * 10**9,
            source="HGX B200 data sheet; MAMF (ml-engineering); attention rates an estimate (cuDNN 9 / FA4)",
        ),
    }
)
#: other spellings of the kinds above
ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "a100": "a100-80gb",
        "a100-40": "a100-40gb",
        "a100-80": "a100-80gb",
        "h100-80gb": "h100",
        "h200-141gb": "h200",
        "b200-180gb": "b200",
    }
)


def device_spec(kind: str | DeviceSpec) -> DeviceSpec:
    """A :class:`DeviceSpec` by name (``a100-40gb``, ``a100-80gb``, ``h100``, ``h200``, ``b200``), or a spec
    itself. A CPU is measured: ``benchmarks/calibrate_step_time.py`` writes a spec, :func:`load_spec` reads
    it."""
    if isinstance(kind, DeviceSpec):
        return kind
    key = str(kind).strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        raise ValueError(
            f"gpu={kind!r} is not a known device kind; use one of {sorted(DEVICES)}, 'cpu' (measured), or give "
            "your device's rates as JSON (--device-spec, fields of DeviceSpec)"
        )
    return DEVICES[key]


def spec_from_dict(data: Mapping[str, Any]) -> DeviceSpec:
    """A user-given device: the fields of :class:`DeviceSpec`; ``"base": "h100"`` starts from a known kind and
    overrides what is given. ``attention``: ``{kernel: {"forward": F, "backward": B}}`` in FLOP/s."""
    data = dict(data)
    base = data.pop("base", None)
    fields = {f.name for f in dataclasses.fields(DeviceSpec)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"device spec fields {unknown} are unknown; DeviceSpec has {sorted(fields)}")
    if "attention" in data:
        data["attention"] = {
            k: KernelRate(**{**v, "measured": tuple(tuple(r) for r in v.get("measured", ()))})
            for k, v in data["attention"].items()
        }
    if base is not None:
        return dataclasses.replace(device_spec(base), **data)
    missing = sorted(f.name for f in dataclasses.fields(DeviceSpec)
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                     and f.name not in data)  # fmt: skip
    if missing:
        raise ValueError(f'device spec lacks {missing}; give them, or start from a known kind with "base"')
    return DeviceSpec(**data)


def load_spec(path: str | Path) -> DeviceSpec:
    """:func:`spec_from_dict` of a JSON file (what ``benchmarks/calibrate_step_time.py --out`` writes)."""
    return spec_from_dict(json.loads(Path(path).read_text()))


__all__ = ["DEVICES", "DeviceSpec", "KernelRate", "device_spec", "load_spec", "spec_from_dict"]
