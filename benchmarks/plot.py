"""PNG plots of the benchmark results: ``benchmarks/results/*.json`` -> ``docs/img/*.png``.

    python benchmarks/plot.py [--results benchmarks/results] [--out docs/img]

Each JSON names its benchmark in its ``benchmark`` field; one plot function per kind:

| benchmark            | written by                        | PNG                                      |
| ulysses_attention    | bench_ulysses.py                  | ulysses_time.png                         |
| throughput           | bench_throughput.py               | throughput.png (+ ``<stem>.png`` others) |
| memory               | bench_memory.py                   | memory.png                               |
| gpu_mfu              | gpu/longctx.py mfu (check.sh)     | gpu_mfu.png                              |

Files of another kind, unreadable files and missing ones are skipped with a note; a plot that fails
prints why and the others are still written. Every figure's footer says the date, machine and command
from the JSON's ``environment``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ImportError:  # pragma: no cover - matplotlib is a dev dependency
    Figure = None

MODE_COLORS = {"single": "C0", "ulysses": "C1", "fpdt": "C2", "fpdt_offload": "C3"}


def _figure(ncols: int = 1, width: float = 6.5) -> Any:
    fig = Figure(figsize=(width * ncols, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _footer(fig: Any, data: dict[str, Any]) -> None:
    env = data.get("environment") or {}
    when = env.get("time_utc", "?")
    gpu = env.get("gpu")
    machine = gpu or f"{env.get('processor', '?')}, {env.get('cpu_count', '?')} CPUs"
    argv = " ".join(env.get("argv") or [])
    text = f"{when} | {machine} | torch {env.get('torch', '?')} | {argv}"
    fig.get_layout_engine().set(h_pad=0.1)
    fig.supxlabel(text if len(text) < 160 else text[:157] + "...", fontsize=7, color="gray")


def plot_ulysses(data: dict[str, Any], out: Path, stem: str) -> Path:
    rows = data["results"]
    fig, (ax_t, ax_c) = _figure(2)
    for i, world in enumerate(sorted({r["P"] for r in rows})):
        rs = sorted((r for r in rows if r["P"] == world), key=lambda r: r["N"])
        n = [r["N"] for r in rs]
        for ax, key, ds_key in (
            (ax_t, "ours_ms", "deepspeed_ms"),
            (ax_c, "ours_comm_ms", "deepspeed_comm_ms"),
        ):
            ax.plot(n, [r.get(key) for r in rs], "-o", color=f"C{i}", label=f"ours, P={world}")
            if any(r.get(ds_key) is not None for r in rs):
                ax.plot(
                    n,
                    [r.get(ds_key) for r in rs],
                    "--s",
                    color=f"C{i}",
                    alpha=0.7,
                    label=f"DeepSpeed, P={world}",
                )
    cfg = data.get("config", {})
    shape = f"b={cfg.get('batch', 1)} h={cfg.get('heads')} d={cfg.get('head_dim')} {cfg.get('dtype', '')}"
    ax_t.set_title(f"Ulysses attention fwd+bwd, median ms ({shape})", fontsize="small")
    ax_c.set_title("all-to-alls + layout copies only (kernel replaced by q+k+v)", fontsize="small")
    for ax in (ax_t, ax_c):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global sequence length N")
        ax.set_ylabel("ms (slowest rank)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="x-small")
    _footer(fig, data)
    path = out / ("ulysses_time.png" if stem == "ulysses" else f"{stem}.png")
    fig.savefig(path, dpi=110)
    return path


def plot_throughput(data: dict[str, Any], out: Path, stem: str) -> Path:
    rows = [r for r in data["results"] if r.get("status") == "ok" and r.get("tokens_per_sec")]
    fig, (ax_b, ax_o) = _figure(2)
    lengths = sorted({r["seq_len"] for r in rows})
    labels, heights, colors, mfus = [], [], [], []
    for n in lengths:
        for r in (r for r in rows if r["seq_len"] == n):
            chunk = f"\nc={r['chunk_size']}" if r.get("chunk_size") else ""
            labels.append(f"{r['mode']}{chunk}" + (f"\nN={n}" if len(lengths) > 1 else ""))
            heights.append(r["tokens_per_sec"])
            colors.append(MODE_COLORS.get(r["mode"], "C7"))
            mfus.append(r.get("mfu"))
    bars = ax_b.bar(range(len(heights)), heights, color=colors)
    for bar, mfu in zip(bars, mfus):
        if mfu is not None:
            ax_b.annotate(
                f"{100 * mfu:.1f}%",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax_b.set_xticks(range(len(labels)), labels, fontsize=7)
    ax_b.set_ylabel("global tokens/s (label: MFU)")
    model = data.get("model", {})
    cfg = data.get("config", {})
    ax_b.set_title(
        f"Trainer steps, Llama h={model.get('hidden_size')} L={model.get('num_hidden_layers')} "
        f"V={model.get('vocab_size')}, P={cfg.get('world_size')}, N={','.join(map(str, lengths))}",
        fontsize="small",
    )
    ax_b.grid(alpha=0.3, axis="y")
    over = data.get("fpdt_overhead") or []
    for i, n in enumerate(sorted({o["seq_len"] for o in over})):
        for mode, marker in (("fpdt", "-o"), ("fpdt_offload", "s")):
            pts = sorted(
                (o["chunk_size"], 100 * o["overhead"])
                for o in over
                if o["seq_len"] == n and o["mode"] == mode
            )
            if pts:
                ax_o.plot(
                    *zip(*pts),
                    marker,
                    color=f"C{i}",
                    label=f"{mode}, N={n}",
                    alpha=1 if mode == "fpdt" else 0.6,
                )
    ax_o.axhline(15, color="gray", linestyle=":", label="target 15%")
    ax_o.set_xscale("log", base=2)
    ax_o.set_xlabel("FPDT chunk size (tokens per rank)")
    ax_o.set_ylabel("overhead over Ulysses, %")
    ax_o.set_title("FPDT overhead = ulysses tokens/s / fpdt tokens/s - 1", fontsize="small")
    ax_o.grid(alpha=0.3, which="both")
    ax_o.legend(fontsize="x-small")
    _footer(fig, data)
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=110)
    return path


def plot_memory(data: dict[str, Any], out: Path, stem: str) -> Path:
    rows = [r for r in data.get("rows", data.get("results", [])) if r.get("status") == "ok"]
    cfg = data.get("config", {})
    fig, (ax,) = _figure(1, width=7)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["N"])
        world = rs[0].get("P", 1)
        label = mode if mode == "single" else f"{mode} (P={world})"
        style = "--o" if mode == "fpdt_offload" else "-o"
        ax.plot(
            [r["N"] for r in rs],
            [r["step_mib"] for r in rs],
            style,
            color=MODE_COLORS.get(mode, "C7"),
            label=label,
        )
    if cfg.get("budget_gib"):
        ax.axhline(
            cfg["budget_gib"] * 1024, color="gray", linestyle=":", label=f"budget {cfg['budget_gib']:g} GiB"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global sequence length N")
    ax.set_ylabel(f"step memory per rank, MiB ({data.get('measure', 'peak')})")
    ax.set_title(
        f"one training step, Llama h={cfg.get('hidden')} L={cfg.get('layers')} V={cfg.get('vocab')}, "
        f"FPDT chunk {cfg.get('chunk_size')}",
        fontsize="small",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    _footer(fig, data)
    path = out / ("memory.png" if stem == "memory" else f"{stem}.png")
    fig.savefig(path, dpi=110)
    return path


def plot_gpu_mfu(data: dict[str, Any], out: Path, stem: str) -> Path:
    rows = data["results"]
    ok = [r for r in rows if r.get("status") == "ok"]
    fig, (ax,) = _figure(1, width=7)
    for ckpt, marker in ((False, "o"), (True, "s")):
        pts = [(r["seq_len"], 100 * r["mfu"]) for r in ok if bool(r.get("activation_checkpointing")) == ckpt]
        if pts:
            ax.plot(
                *zip(*pts), marker, markersize=8, label=f"activation checkpointing {'on' if ckpt else 'off'}"
            )
    if ok:
        ax.plot([r["seq_len"] for r in ok], [100 * r["mfu"] for r in ok], "-", color="gray", alpha=0.5)
    for r in rows:
        if r.get("status") != "ok":
            ax.axvline(r["seq_len"], color="C3", linestyle=":", label=f"N={r['seq_len']}: {r.get('status')}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N (one GPU)")
    ax.set_ylabel("MFU, % of dense bf16 peak")
    params = data.get("parameters")
    size = f"{params / 1e9:.2f}B" if params else "~1B"
    ax.set_title(f"{size} Llama, bf16, Ulysses mode (SDPA), P=1", fontsize="small")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    _footer(fig, data)
    path = out / ("gpu_mfu.png" if stem in ("mfu", "gpu_mfu") else f"{stem}.png")
    fig.savefig(path, dpi=110)
    return path


PLOTS: dict[str, Callable[[dict[str, Any], Path, str], Path]] = {
    "ulysses_attention": plot_ulysses,
    "throughput": plot_throughput,
    "memory": plot_memory,
    "gpu_mfu": plot_gpu_mfu,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path("benchmarks/results"), help="folder of result JSONs")
    p.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for the PNGs")
    args = p.parse_args(argv)
    if Figure is None:
        print("matplotlib is not installed (pip install matplotlib): no plots")
        return 1
    files = sorted(args.results.glob("*.json"))
    if not files:
        print(f"no result JSON in {args.results}")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"skip {path}: unreadable ({e})")
            continue
        kind = data.get("benchmark") if isinstance(data, dict) else None
        plot = PLOTS.get(kind)
        if plot is None:
            print(f"skip {path}: no plot for benchmark {kind!r}")
            continue
        try:
            print(f"{path} -> {plot(data, args.out, path.stem)}")
        except (KeyError, TypeError, ValueError, IndexError) as e:
            failed += 1
            print(f"FAILED {path} ({kind}): {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
