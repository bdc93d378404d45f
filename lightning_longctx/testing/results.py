"""What a measured run writes beside its numbers, and how: the machine and versions it ran on
(:func:`environment`), the JSON (:func:`write_json`, replaced atomically), a plain-text table
(:func:`format_table`), the host's memory (:func:`meminfo_bytes`) and a least-squares line through
measurements (:func:`linear_fit`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "GIB",
    "MIB",
    "Column",
    "environment",
    "format_table",
    "linear_fit",
    "meminfo_bytes",
    "write_json",
]

MIB = float(1 << 20)
GIB = float(1 << 30)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b·x``; returns ``(a, b)``. Needs two distinct ``xs`` or more."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def meminfo_bytes(field: str) -> int:
    """A field of ``/proc/meminfo`` (``MemAvailable``, ``MemTotal``) in bytes; 0 where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def environment() -> dict[str, Any]:
    """Where the numbers came from: versions, machine (GPU when there is one), time, command line."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "argv": sys.argv,
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    for name in ("transformers", "lightning", "torchmetrics", "jsonargparse", "triton", "deepspeed"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            torch_cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / GIB, 1),
            sms=props.multi_processor_count,
        )
    return env


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """``payload`` as indented JSON, replaced atomically: a run killed mid-write keeps the last file."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(out)
    return out


Column = tuple[str, str, str]  # (row key, header, format spec such as ".2f"; "" = str())


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A plain-text table (markdown pipe style); missing or ``None`` cells print as ``-``."""

    def cell(row: dict[str, Any], key: str, spec: str) -> str:
        val = row.get(key)
        if val is None:
            return "-"
        if spec and isinstance(val, (int, float)):
            return format(val, spec)
        return str(val)

    body = [[cell(r, k, s) for k, _, s in columns] for r in rows]
    heads = [h for _, h, _ in columns]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)
