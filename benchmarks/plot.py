"""PNG plots of the benchmark results: ``benchmarks/results/*.json`` -> ``docs/img/*.png``.

    python benchmarks/plot.py [--results benchmarks/results] [--out docs/img]

Each JSON names its benchmark in its ``benchmark`` field; one plot function per kind, also used by
the scripts that write a PNG beside their JSON (``bench_memory.py``, ``bench_soak.py``):

| benchmark            | written by                        | PNG                                      |
| ulysses_attention    | bench_ulysses.py                  | ulysses_time.png                         |
| attention            | bench_attention.py                | attention.png                            |
| throughput           | bench_throughput.py               | throughput.png (+ ``<stem>.png`` others) |
| memory               | bench_memory.py                   | memory.png (+ ``<stem>.png`` others)     |
| soak                 | bench_soak.py                     | soak.png                                 |
| gpu_mfu              | gpu/longctx.py mfu (check.sh)     | gpu_mfu.png                              |
| checkpoint           | bench_checkpoint.py               | checkpoint.png                           |
| ring                 | bench_ring.py                     | ring.png                                 |

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

MODE_COLORS = {"single": "C0", "ulysses": "C1", "fpdt": "C2", "fpdt_offload": "C3", "fpdt_ckpt": "C4",
               "fpdt_act_offload": "C5"}  # fmt: skip
PNG_NAMES = {"ulysses": "ulysses_time", "mfu": "gpu_mfu"}  # JSON stem -> PNG name, where they differ
MIB = float(1 << 20)


def _figure(ncols: int = 1, width: float = 6.5, nrows: int = 1, height: float = 4.4) -> Any:
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, sharex=nrows > 1, squeeze=False).ravel()
    return fig, list(axes)


def _footer(fig: Any, data: dict[str, Any]) -> None:
    env = data.get("environment") or {}
    machine = env.get("gpu") or f"{env.get('processor', '?')}, {env.get('cpu_count', '?')} CPUs"
    argv = " ".join(env.get("argv") or [])
    text = f"{env.get('time_utc', '?')} | {machine} | torch {env.get('torch', '?')} | {argv}"
    fig.get_layout_engine().set(h_pad=0.1)
    fig.supxlabel(text if len(text) < 160 else text[:157] + "...", fontsize=7, color="gray")


def _log2_axes(
    ax: Any, xlabel: str, ylabel: str, title: str, *, logy: bool = True, legend: str = "small"
) -> None:
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="small")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=legend)


def plot_ulysses(data: dict[str, Any]) -> Any:
    rows = data["results"]
    fig, (ax_t, ax_c) = _figure(2)
    for i, world in enumerate(sorted({r["P"] for r in rows})):
        rs = sorted((r for r in rows if r["P"] == world), key=lambda r: r["N"])
        n = [r["N"] for r in rs]
        for ax, key in ((ax_t, "ms"), (ax_c, "comm_ms")):
            ax.plot(n, [r.get(f"ours_{key}") for r in rs], "-o", color=f"C{i}", label=f"ours, P={world}")
            if any(r.get(f"deepspeed_{key}") is not None for r in rs):
                ds = [r.get(f"deepspeed_{key}") for r in rs]
                ax.plot(n, ds, "--s", color=f"C{i}", alpha=0.7, label=f"DeepSpeed, P={world}")
    cfg = data.get("config", {})
    shape = f"b={cfg.get('batch', 1)} h={cfg.get('heads')} d={cfg.get('head_dim')} {cfg.get('dtype', '')}"
    for ax, title in (
        (ax_t, f"Ulysses attention fwd+bwd, median ms ({shape})"),
        (ax_c, "all-to-alls + layout copies only (kernel replaced by q+k+v)"),
    ):
        _log2_axes(ax, "global sequence length N", "ms (slowest rank)", title, legend="x-small")
    return fig


def plot_attention(data: dict[str, Any]) -> Any:
    """FPDT vs Ulysses attention: ms per fwd+bwd by N (one line per variant and P), and the ratios."""
    rows = data["results"]
    fig, (ax_t, ax_r) = _figure(2)
    variants = [k[: -len("_ms")] for k in rows[0] if k.endswith("_ms") and not k.endswith("_repeats")]
    styles = {0: "-o", 1: "--s", 2: ":^"}
    for i, world in enumerate(sorted({r["P"] for r in rows})):
        rs = sorted((r for r in rows if r["P"] == world), key=lambda r: r["N"])
        n = [r["N"] for r in rs]
        for vi, v in enumerate(variants):
            color = f"C{vi}"
            ax_t.plot(
                n, [r[f"{v}_ms"] for r in rs], styles.get(i, "-o"), color=color, label=f"{v}, P={world}"
            )
            if v != "ulysses":
                ax_r.plot(n, [r.get(f"{v}_ratio") for r in rs], styles.get(i, "-o"), color=color,
                          label=f"{v}, P={world}")  # fmt: skip
    ax_r.axhline(1.15, color="gray", linestyle=":", label="target 1.15")
    cfg = data.get("config", {})
    shape = (
        f"b={cfg.get('batch', 1)} h={cfg.get('heads')} d={cfg.get('head_dim')} chunk {cfg.get('chunk_size')}"
    )
    _log2_axes(ax_t, "global sequence length N", "ms (slowest rank)", f"attention fwd+bwd, median ({shape})",
               legend="x-small")  # fmt: skip
    _log2_axes(ax_r, "global sequence length N", "time / Ulysses", "paired per-round ratio to Ulysses",
               logy=False, legend="x-small")  # fmt: skip
    return fig


def plot_throughput(data: dict[str, Any]) -> Any:
    rows = [r for r in data["results"] if r.get("status") == "ok" and r.get("tokens_per_sec")]
    fig, (ax_b, ax_o) = _figure(2)
    lengths = sorted({r["seq_len"] for r in rows})
    rows.sort(key=lambda r: r["seq_len"])  # stable: the run order within one N
    labels = [
        r["mode"]
        + (f"\nc={r['chunk_size']}" if r.get("chunk_size") else "")
        + (f"\nN={r['seq_len']}" if len(lengths) > 1 else "")
        for r in rows
    ]
    bars = ax_b.bar(range(len(rows)), [r["tokens_per_sec"] for r in rows],
                    color=[MODE_COLORS.get(r["mode"], "C7") for r in rows])  # fmt: skip
    for bar, r in zip(bars, rows):
        if r.get("mfu") is not None:
            xy = (bar.get_x() + bar.get_width() / 2, bar.get_height())
            ax_b.annotate(f"{100 * r['mfu']:.1f}%", xy, ha="center", va="bottom", fontsize=7)
    ax_b.set_xticks(range(len(labels)), labels, fontsize=7)
    ax_b.set_ylabel("global tokens/s (label: MFU)")
    model, cfg = data.get("model", {}), data.get("config", {})
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
                (o["chunk_size"], 100 * o["overhead"]) for o in over if (o["seq_len"], o["mode"]) == (n, mode)
            )
            if pts:
                alpha = 1 if mode == "fpdt" else 0.6
                ax_o.plot(*zip(*pts), marker, color=f"C{i}", label=f"{mode}, N={n}", alpha=alpha)
    ax_o.axhline(15, color="gray", linestyle=":", label="target 15%")
    title, ylabel = "FPDT overhead = ulysses tokens/s / fpdt tokens/s - 1", "overhead over Ulysses, %"
    _log2_axes(ax_o, "FPDT chunk size (tokens per rank)", ylabel, title, logy=False, legend="x-small")
    return fig


def plot_memory(data: dict[str, Any]) -> Any:
    rows = [r for r in data.get("rows", data.get("results", [])) if r.get("status") == "ok"]
    cfg = data.get("config", {})
    fig, (ax,) = _figure(1, width=7)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["N"])
        label = mode if mode == "single" else f"{mode} (P={rs[0].get('P', 1)})"
        style = "--o" if mode in ("fpdt_offload", "fpdt_act_offload") else "-o"
        color = MODE_COLORS.get(mode, "C7")
        ax.plot([r["N"] for r in rs], [r["step_mib"] for r in rs], style, color=color, label=label)
    if cfg.get("budget_gib"):
        budget = cfg["budget_gib"]
        ax.axhline(budget * 1024, color="gray", linestyle=":", label=f"budget {budget:g} GiB")
    title = (
        f"one training step, Llama h={cfg.get('hidden')} L={cfg.get('layers')} V={cfg.get('vocab')}, "
        f"FPDT chunk {cfg.get('chunk_size')}"
    )
    ylabel = f"step memory per rank, MiB\n({data.get('measure', 'peak')} - before the step, max over ranks)"
    _log2_axes(ax, "global sequence length N", ylabel, title)
    return fig


def plot_soak(data: dict[str, Any]) -> Any:
    fig, (top, bottom) = _figure(1, width=7, nrows=2, height=5)
    for r in data["ranks"]:
        steps, rank = r["steps"], r["rank"]
        xs = [s["step"] for s in steps]
        top.plot(xs, [s["rss_trimmed_bytes"] / MIB for s in steps], label=f"rank {rank}, after malloc_trim")
        top.plot(xs, [s["rss_bytes"] / MIB for s in steps], ":", alpha=0.6, label=f"rank {rank}, raw")
        bottom.plot(
            xs, [s["offloaded_before_backward"] / MIB for s in steps], label=f"rank {rank}, before backward"
        )
        bottom.plot(xs, [s["offloaded_bytes"] / MIB for s in steps], "--", label=f"rank {rank}, after step")
    fit_from = data["config"]["fit_from"]
    top.axvline(fit_from, color="gray", linestyle=":", label=f"slope fit from step {fit_from}")
    top.set_ylabel("RSS, MiB")
    top.set_title("FPDT + offload soak (sp=2, CPU/gloo)", fontsize="small")
    bottom.set_ylabel("offloaded_bytes(), MiB")
    bottom.set_xlabel("optimizer step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def plot_gpu_mfu(data: dict[str, Any]) -> Any:
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
    params = data.get("parameters")
    title = f"{f'{params / 1e9:.2f}B' if params else '~1B'} Llama, bf16, Ulysses mode (SDPA), P=1"
    _log2_axes(ax, "sequence length N (one GPU)", "MFU, % of dense bf16 peak", title, logy=False)
    return fig


def plot_checkpoint(data: dict[str, Any]) -> Any:
    """Full vs sharded vs async checkpoints: save / load seconds, and the peak RSS each adds per rank."""
    rows = [r for r in data["rows"] if r.get("status") == "ok"]
    fig, (ax_t, ax_m) = _figure(2)
    xs = range(len(rows))
    bars = {"save_s": "save (committed)", "blocking_s": "save, blocking part", "load_s": "load"}
    for i, (key, label) in enumerate(bars.items()):
        ax_t.bar([x + (i - 1) * 0.27 for x in xs], [r.get(key) or 0 for r in rows], 0.27, label=label)
    mems = {"save_mem_peak_rank0": "save, rank 0", "save_mem_peak_others": "save, max other rank",
            "load_mem_peak_rank0": "load, rank 0", "load_mem_peak_others": "load, max other rank"}  # fmt: skip
    for i, (key, label) in enumerate(mems.items()):
        ax_m.bar([x + (i - 1.5) * 0.2 for x in xs], [(r.get(key) or 0) / MIB for r in rows], 0.2, label=label)
    cfg = data.get("config", {})
    shape = f"{(data.get('parameters') or 0) / 1e6:.0f}M-param Llama + AdamW, world {cfg.get('world')}, FSDP"
    for ax, ylabel, title in ((ax_t, "seconds (max over ranks)", f"checkpoint time, {shape}"),
                              (ax_m, "peak RSS - RSS before, MiB", "host memory added per rank")):  # fmt: skip
        ax.set_xticks(list(xs), [r["format"] for r in rows])
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize="small")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="x-small")
    return fig


def plot_ring(data: dict[str, Any]) -> Any:
    """Ulysses x ring: fwd+bwd ms and the bytes one rank sends (all-to-all, ring, total) against the ring degree
    r, one colour per P (r = 1: Ulysses alone, r = P: a pure ring)."""
    rows = data["rows"]
    fig, (ax_t, ax_b) = _figure(2)
    for i, world in enumerate(sorted({r["P"] for r in rows})):
        rs = sorted((r for r in rows if r["P"] == world), key=lambda r: r["ring"])
        rings, color = [r["ring"] for r in rs], f"C{i}"
        ax_t.plot(rings, [r["ms"] for r in rs], "-o", color=color, label=f"P={world}")
        ax_b.plot(
            rings, [r["a2a_mib"] + r["ring_mib"] for r in rs], "-o", color=color, label=f"total, P={world}"
        )
        ax_b.plot(
            rings, [r["a2a_mib"] for r in rs], "--s", color=color, alpha=0.6, label=f"all-to-all, P={world}"
        )
        ax_b.plot(rings, [r["ring_mib"] for r in rs], ":^", color=color, alpha=0.6, label=f"ring, P={world}")
    cfg = data.get("config", {})
    shape = f"N={cfg.get('seq_len')} b={cfg.get('batch', 1)} h={cfg.get('heads')} d={cfg.get('head_dim')}"
    _log2_axes(ax_t, "ring degree r (Ulysses U = P / r)", "ms (slowest rank)",
               f"one causal attention layer fwd+bwd, median ({shape})", logy=False, legend="x-small")  # fmt: skip
    _log2_axes(ax_b, "ring degree r (Ulysses U = P / r)", "MiB sent per rank (max over ranks)",
               "bytes per rank, forward + backward (= formula)", logy=False, legend="x-small")  # fmt: skip
    rings = sorted({r["ring"] for r in rows})
    for ax in (ax_t, ax_b):
        ax.set_xticks(rings, [str(r) for r in rings])
    return fig


PLOTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "checkpoint": plot_checkpoint,
    "ulysses_attention": plot_ulysses,
    "attention": plot_attention,
    "throughput": plot_throughput,
    "memory": plot_memory,
    "soak": plot_soak,
    "gpu_mfu": plot_gpu_mfu,
    "ring": plot_ring,
}


def save_plot(data: dict[str, Any], path: str | Path) -> Path | None:
    """Draw the result ``data`` (by its ``benchmark`` field) into the PNG ``path``; None without matplotlib."""
    if Figure is None:
        print("matplotlib is not installed (`pip install matplotlib`): no plot")
        return None
    fig = PLOTS[data["benchmark"]](data)
    _footer(fig, data)
    fig.savefig(path, dpi=110)
    return Path(path)


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
        if kind not in PLOTS:
            print(f"skip {path}: no plot for benchmark {kind!r}")
            continue
        try:
            print(f"{path} -> {save_plot(data, args.out / f'{PNG_NAMES.get(path.stem, path.stem)}.png')}")
        except (KeyError, TypeError, ValueError, IndexError) as e:
            failed += 1
            print(f"FAILED {path} ({kind}): {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
