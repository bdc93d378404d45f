"""Helpers shared by the benchmark scripts; they know nothing about any one benchmark.

* :func:`run_ranks` runs a function on P freshly spawned CPU processes joined in a gloo group.
* :func:`time_interleaved` times several variants of a step round-robin, barrier before and after.
* :class:`AllToAllBytes` counts the bytes this rank sends to OTHER ranks through
  ``torch.distributed.all_to_all_single``, whoever calls it (our ``comm`` module or a peer library),
  so both sides of a comparison are measured by the same meter.
* :func:`write_json` / :func:`format_table` / :func:`environment` for the outputs.

Benchmark scripts import this as ``from common import ...``: run them as
``python benchmarks/<script>.py`` (the script's folder is then on ``sys.path``; spawned ranks inherit it).
"""

from __future__ import annotations

import json
import os
import platform
import queue
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    outbox: Any,
) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            outbox.put((rank, True, fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        outbox.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1, timeout_s: float = 600.0
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned processes sharing a gloo default group.

    Each rank uses ``threads`` intra-op threads. ``fn`` must be picklable (defined at module level)
    and return picklable values (plain Python objects are best). Returns the results in rank order;
    raises ``RuntimeError`` with the first failing rank's traceback, or when a rank gives nothing
    within ``timeout_s`` (a deadlock or a crash).
    """
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_entry, args=(r, world_size, port, threads, timeout_s, fn, args, outbox), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            try:
                rank, ok, payload = outbox.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                raise RuntimeError(
                    f"{fn.__name__}: ranks {missing} of {world_size} gave no result within {timeout_s:.0f}s"
                ) from None
            if not ok:
                raise RuntimeError(f"{fn.__name__} failed on rank {rank} of {world_size}:\n{payload}")
            results[rank] = payload
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def time_interleaved(
    steps: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Wall time (s) of each step, ``repeats`` times after ``warmup`` untimed rounds.

    The steps run round-robin and the order rotates every round, so drift (thermal, other load)
    hits all variants alike. Each timed call sits between two barriers: the time is the slowest
    rank's, including the collectives' waiting.
    """
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            barrier()
            t0 = time.perf_counter()
            steps[name]()
            barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def max_over_ranks(x: float) -> float:
    """The largest value of ``x`` over the default group (``x`` itself without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class AllToAllBytes:
    """Context manager: bytes this rank sends to OTHER ranks through ``all_to_all_single``.

    Patches ``torch.distributed.all_to_all_single`` in this process while active (callers that look
    it up at call time, as ``torch.distributed.all_to_all_single`` / ``dist.all_to_all_single``, are
    seen). The block a rank keeps for itself is not counted. ``bytes_sent`` and ``calls`` stay
    readable after exit.
    """

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.calls = 0
        self._orig: Callable[..., Any] | None = None

    def _count(self, inp: torch.Tensor, input_split_sizes: list[int] | None, group: Any) -> None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        total = inp.numel() * inp.element_size()
        if input_split_sizes:
            row = total // inp.shape[0] if inp.shape[0] else 0
            self.bytes_sent += (sum(input_split_sizes) - input_split_sizes[rank]) * row
        else:  # even split along dim 0
            self.bytes_sent += total - total // world
        self.calls += 1

    def __enter__(self) -> AllToAllBytes:
        orig = self._orig = dist.all_to_all_single

        def counted(
            output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
        ):
            self._count(input, input_split_sizes, group)
            return orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._orig


def environment() -> dict[str, Any]:
    """Where the numbers came from: versions, CPU, time."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "argv": sys.argv,
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
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


def token_lm_module(args: Any, *, num_samples: int, lr: float) -> Any:
    """A LightningModule training a seeded Llama (MHA, untied head, SDPA) with SGD, one sample per step.

    ``args`` carries ``vocab, hidden, intermediate, layers, heads, seq_len``; the ``num_samples``
    random sequences (seed 1) are their own labels. The module remembers the last loss."""
    import lightning as L
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    class TokenLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = LlamaConfig(
                vocab_size=args.vocab,
                hidden_size=args.hidden,
                intermediate_size=args.intermediate,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                num_key_value_heads=args.heads,
                max_position_embeddings=max(args.seq_len, 2048),
                tie_word_embeddings=False,
                attn_implementation="sdpa",
            )
            self.model = LlamaForCausalLM(config).float()
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(1, args.vocab, (num_samples, args.seq_len), generator=g)
            self.samples = [{"input_ids": x, "labels": x.clone()} for x in ids]
            self.loss = float("nan")

        def training_step(self, batch: dict, batch_idx: int) -> Any:
            loss = self.model(**batch, use_cache=False).loss
            self.loss = float(loss.detach())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=lr)

        def train_dataloader(self) -> Any:
            return DataLoader(self.samples, batch_size=1)

    return TokenLM()


def child_env(threads: int) -> dict[str, str]:
    """Environment for a launched benchmark job: no inherited launcher/cluster variables (a stray
    RANK or SLURM_* would make Lightning join the wrong job), ``threads`` OpenMP threads, the repo on
    ``PYTHONPATH``."""
    launcher = ("TORCHELASTIC", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_", "GROUP_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def launch_cmd(script: str | Path, world: int, *script_args: str, torchrun: bool | None = None) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=world script ...``, or plain
    ``python script ...`` (default: torchrun for more than one process)."""
    cmd = [sys.executable]
    if world > 1 if torchrun is None else torchrun:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    return [*cmd, str(Path(script).resolve()), *script_args]
