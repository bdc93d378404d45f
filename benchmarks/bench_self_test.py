"""What the strategy's self-test (``lightning_longctx/parallel/self_test.py``) costs: priced on the shipped GPU configs,
measured on the CPU demos.

1. **Priced** (``estimate_step_time`` on an H100, ``plan_memory``; no GPU, no weights): each shipped GPU config
   (``accelerator: gpu``) read as ``lightning-longctx plan`` reads it (``plan_kwargs_from_config``; the
   ``pretrained_path`` of Qwen3-8B from its published ``config.json``, written to a temporary folder). One step is
   ``estimate_step_time`` at the config's sequence length and micro-batch. The self-test, per model:

   * the probe (``self_test.probe_shape``): ``N = sp x L`` tokens, ``L = 2 min(chunk, max(8, halo))`` in FPDT
     mode, else ``2 max(4, halo)`` (``halo = 0`` here: plain decoders), ``b' = min(micro-batch, 2)`` rows;
   * ``checks`` (``self_test.checks_for``): 2 under a ``*-mixed`` precision (float32, then the compute dtype;
     under FSDP2 the float32 one runs before it shards, priced here as the same run: the probe is latency-bound),
     1 with ``cpu_offload`` (the bf16 check only);
   * ``run`` = ``estimate_step_time`` with the config's own settings at ``seq_len = N``, ``micro_batch_size =
     b'`` and, in FPDT mode, the probe's chunk, minus its optimizer term: compute + exposed communication (FSDP
     all-gathers and reduce-scatter included: the self-test reduces no gradient, so this over-counts) + exposed
     host transfers (``cpu_offload``'s shards). The backward is priced as a full one (``autograd.grad`` with
     respect to the input embeddings skips the weight-gradient GEMMs: over-counted too);
   * ``forward`` = ``run / 3`` in FPDT mode (the chunked loss keeps no logits: one more forward without labels),
     else 0 (a forward is a third of forward + backward; with checkpointing a quarter: over-counted);

   ``self_test_s = checks x (2 x run + forward)``: the parallel run, the reference priced as the parallel run
   (the same probe's FLOPs, all on every rank), the extra forward. ``self_test_priced_s = checks x (run + forward
   + reference)`` prices the reference on its own: ``estimate_step_time`` at ``sequence_parallel_size = 1``
   (Ulysses mode, no FPDT, no offload; the world's ranks as data parallel; FSDP, checkpointing, ``cpu_offload``
   as configured) on the N tokens, minus its optimizer term. ``ratio`` = ``self_test_s`` / one step.

   Memory: ``logits_bytes = 4 x b' x N x vocab x 4`` (both runs' fp32 logits of the whole probe, and the two
   model-dtype logits they come from, counted as fp32) beside ``plan_memory``'s peak of one step
   (``device_total``; ``device_needed`` adds the reserve); the probe's activations beside them: the largest
   bytes of the probe step's plan components that grow with the tokens (:data:`PROBE_ACTIVATIONS`, device and
   host). The self-test runs before the first step, before AdamW
   has allocated its state, so these bytes are not added to the step's peak.

2. **Measured** on this CPU: ``examples/configs/demo_cpu.yaml`` (Llama, Ulysses, sp 2) and
   ``qwen3_5_hybrid_cpu.yaml`` (Qwen3.5 gated DeltaNet + attention, FPDT chunk 16, sp 2), each run as the README
   runs it, ``python -m lightning_longctx fit --config ...`` (Lightning starts the second process), for
   ``--steps`` steps without checkpoints, with the self-test on (the default) and off
   (``--trainer.strategy.init_args.self_test=false``), ``--repeats`` times each, on and off alternating. A
   callback of this file (``SelfTestProbe``, appended with ``--trainer.callbacks+=``) records on every rank: the
   self-test's reports (``trainer.strategy.self_test_reports``: checks, errors, seconds), the first step
   (``on_train_epoch_start`` to the first ``on_train_batch_end``: the first batch's transfer hook, where the
   self-test runs, and the step), the median of the later steps, and the peak RSS
   (``resource.getrusage(RUSAGE_SELF).ru_maxrss``). The whole run is the command's wall time (start-up
   included); the strategy's info line ("self-test passed in X s") is read from its log. Medians over the
   repeats; max over ranks for memory.

    python benchmarks/bench_self_test.py                  # both parts: ~10 min on 2 loaded cores
    python benchmarks/bench_self_test.py --planner-only   # part 1 only: a few seconds
    python benchmarks/bench_self_test.py --repeats 1 --steps 2 --configs demo_cpu.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from common import GIB, MIB, format_table, save_results

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
#: the shipped configs whose accelerator is a GPU, planned on the GPU their headers name
GPU_CONFIGS = (
    "llama3_8b_1m_fpdt_8gpu.yaml",
    "llama3_8b_500k_1gpu.yaml",
    "qwen3_8b_512k_yarn_8gpu.yaml",
    "llama3_8b_4node_slurm.yaml",
)
GPU = "h100"
DEVICE_MEMORY = "80GiB"
#: the published config.json of each pretrained model a GPU config names (``pretrained_path``)
PRETRAINED = {
    "/models/Qwen3-8B": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
                         "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
                         "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False},
}  # fmt: skip
#: the components of a plan that grow with the tokens (the loss working set is left out: at the probe's few tokens
#: its largest moment is the lm_head's gathered weight and gradient, which the step has too)
PROBE_ACTIVATIONS = ("activations kept for backward", "attention working set", "MLP working set",
                     "all-to-all buffers", "layer recompute (checkpointing)")  # fmt: skip
CPU_CONFIGS = ("demo_cpu.yaml", "qwen3_5_hybrid_cpu.yaml")
PASSED = re.compile(r"self-test passed in ([0-9.]+) s")

PLAN_COLUMNS = [
    ("config", "config", ""),
    ("layout", "layout", ""),
    ("seq_len", "N", ","),
    ("step_s", "step s", ".1f"),
    ("probe", "probe b' x N (chunk)", ""),
    ("checks", "checks", ""),
    ("run_s", "run s", ".3f"),
    ("self_test_s", "self-test s", ".2f"),
    ("self_test_priced_s", "self-test s, ref. priced", ".2f"),
    ("ratio_pct", "self-test / step %", ".3f"),
    ("logits_mib", "logits MiB", ".0f"),
    ("probe_activations_mib", "probe act. MiB", ".0f"),
    ("plan_peak_gib", "plan peak GiB", ".2f"),
    ("logits_pct_of_peak", "logits % of peak", ".2f"),
]
CPU_COLUMNS = [
    ("config", "config", ""),
    ("self_test", "self-test", ""),
    ("self_test_s", "self-test s", ".3f"),
    ("logged_s", "logged s", ".2f"),
    ("first_step_s", "first step s", ".3f"),
    ("later_step_s", "later steps s", ".3f"),
    ("run_s", "whole run s", ".1f"),
    ("run_range", "min-max", ""),
    ("maxrss_mib", "peak RSS MiB", ".1f"),
    ("checks", "checks", ""),
]


# ---- part 1: priced on the shipped GPU configs ----
def _pretrained_folders(tmp: Path) -> dict[str, str]:
    """A folder holding only the ``config.json`` of each model in :data:`PRETRAINED`."""
    from transformers import AutoConfig

    folders = {}
    for path, shape in PRETRAINED.items():
        cfg = dict(shape)
        folder = tmp / Path(path).name
        AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(folder)
        folders[path] = str(folder)
    return folders


def _resolved(config: dict[str, Any]) -> Any:
    """The strategy's resolved settings of a config (``probe_shape`` and ``checks_for`` read them)."""
    from lightning_longctx.config import SequenceParallelConfig

    trainer = config["trainer"]
    fields = {f.name for f in dataclasses.fields(SequenceParallelConfig)}
    init = trainer["strategy"].get("init_args") or {}
    devices, nodes = int(trainer.get("devices", 1)), int(trainer.get("num_nodes", 1))
    given = SequenceParallelConfig(**{k: v for k, v in init.items() if k in fields})
    return given.resolve(world_size=devices * nodes, devices_per_node=devices, device_type="cuda")


def _checks(precision: str, resolved: Any, param_dtype: str | None) -> list[str]:
    """The dtypes the self-test compares in (``checks_for`` with the strategy's ``fp32_layout``)."""
    import torch

    from lightning_longctx.parallel.self_test import checks_for

    dtype = getattr(torch, param_dtype) if param_dtype else torch.float32
    # the strategy's float32 check: after the fact under DDP, before FSDP2 shards (not with cpu_offload)
    fp32_layout = precision.endswith("-mixed") and not resolved.settings.cpu_offload
    checks = checks_for(precision, torch.nn.Linear(1, 1, dtype=dtype), lambda: None, fp32_layout,
                        torch.device("cpu"))  # fmt: skip
    return [str(d).removeprefix("torch.") for d, _ in checks]


def _bytes(component: Any) -> int:
    """A plan component's largest bytes, device and host."""
    return max(component.largest, component.device + component.host)


def _run_s(est: Any) -> float:
    """One forward + backward of an estimate: the step without its optimizer term."""
    return est.step_time_s - est.optimizer_s


def price(name: str, folders: dict[str, str]) -> dict[str, Any]:
    """One shipped GPU config: one step and the self-test, priced (module docstring)."""
    import yaml

    from lightning_longctx.cli.plan import plan_kwargs_from_config
    from lightning_longctx.parallel.self_test import probe_shape
    from lightning_longctx.planner import plan_memory
    from lightning_longctx.planner.step_time import estimate_step_time

    config = yaml.safe_load((CONFIGS / name).read_text())
    pretrained = config["model"]["init_args"].get("pretrained_path")
    model, kw, _ = plan_kwargs_from_config(config, pretrained_path=folders.get(pretrained))
    resolved = _resolved(config)
    packed = (config.get("data") or {}).get("init_args", {}).get("packing") == "documents"
    shape = probe_shape(resolved, halo=0, packed=packed)
    rows = min(int(kw["micro_batch_size"]), 2)
    fpdt = shape.chunk is not None
    checks = _checks(kw["precision"], resolved, kw.get("param_dtype"))

    step = estimate_step_time(model, gpu=GPU, **kw)
    plan = plan_memory(model, device_memory=DEVICE_MEMORY, **kw)
    probe_kw = {**kw, "seq_len": shape.length, "micro_batch_size": rows}
    if fpdt:
        probe_kw["fpdt_chunk_size"] = shape.chunk
    run = estimate_step_time(model, gpu=GPU, **probe_kw)
    world = kw["sequence_parallel_size"] * kw["data_parallel_size"]
    ref_kw = {**probe_kw, "sequence_parallel_size": 1, "data_parallel_size": world // kw["tensor_parallel_size"],
              "ring_size": 1, "mode": "ulysses", "fpdt_chunk_size": None, "offload": False}  # fmt: skip
    reference = estimate_step_time(model, gpu=GPU, **ref_kw)
    probe_plan = plan_memory(model, **probe_kw)

    run_s, ref_s = _run_s(run), _run_s(reference)
    forward_s = run_s / 3 if fpdt else 0.0
    self_test_s = len(checks) * (2 * run_s + forward_s)
    vocab = int(getattr(model, "vocab_size", None) or model["vocab_size"])
    logits = 4 * rows * shape.length * vocab * 4
    layout = f"sp {kw['sequence_parallel_size']} x dp {kw['data_parallel_size']}, {kw['mode'].value}"
    layout += f", {kw['data_parallel']}{', cpu_offload' if kw['cpu_offload'] else ''}, {kw['precision']}"
    return {
        "config": name.removesuffix(".yaml"),
        "layout": layout,
        "seq_len": kw["seq_len"],
        "micro_batch_size": kw["micro_batch_size"],
        "step_s": step.step_time_s,
        "step": {"compute_s": step.compute_s, "exposed_communication_s": step.exposed_communication_s,
                 "exposed_host_s": step.exposed_host_s, "optimizer_s": step.optimizer_s, "mfu": step.mfu},
        "probe": f"{rows} x {shape.length}" + (f" ({shape.chunk})" if fpdt else ""),
        "probe_rows": rows,
        "probe_length": shape.length,
        "probe_chunk": shape.chunk,
        "probe_packed": packed,
        "checks": len(checks),
        "check_dtypes": checks,
        "run_s": run_s,
        "run": {"compute_s": run.compute_s, "exposed_communication_s": run.exposed_communication_s,
                "exposed_host_s": run.exposed_host_s, "binding": run.binding},
        "forward_s": forward_s,
        "reference_s": ref_s,
        "self_test_s": self_test_s,
        "self_test_priced_s": len(checks) * (run_s + forward_s + ref_s),
        "ratio": self_test_s / step.step_time_s,
        "ratio_pct": 100 * self_test_s / step.step_time_s,
        "vocab_size": vocab,
        "logits_bytes": logits,
        "logits_mib": logits / MIB,
        "probe_activations_mib": sum(_bytes(probe_plan[c]) for c in PROBE_ACTIVATIONS) / MIB,
        "plan_peak_gib": plan.device_total / GIB,
        "plan_device_needed_gib": plan.device_needed / GIB,
        "plan_peak_phase": plan.peak_phase,
        "logits_pct_of_peak": 100 * logits / plan.device_total,
    }  # fmt: skip


# ---- part 2: measured on the CPU demos ----
class SelfTestProbe(L.Callback):
    """Appended to a demo's callbacks (``--trainer.callbacks+=bench_self_test.SelfTestProbe``): every rank writes
    ``<out>.rank<r>.json`` at the end of fit (module docstring: what it records)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.epoch_start: float | None = None
        self.batch_ends: list[float] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.epoch_start is None:
            self.epoch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.batch_ends.append(time.perf_counter())

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ends = [self.epoch_start or 0.0, *self.batch_ends]
        steps = [b - a for a, b in itertools.pairwise(ends)]
        reports = [
            {"model": r.model_name, "seconds": r.seconds, "rows": r.rows, "probe_length": r.probe.length,
             "probe_chunk": r.probe.chunk, "summary": r.summary(),
             "checks": [{"dtype": str(c.dtype).removeprefix("torch."), "errors": c.errors, "tolerance": c.tolerance,
                         "passed": c.passed} for c in r.checks]}
            for r in getattr(trainer.strategy, "self_test_reports", [])
        ]  # fmt: skip
        record = {"rank": trainer.global_rank, "step_s": steps, "reports": reports,
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}  # fmt: skip
        Path(f"{self.out}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def fit_once(name: str, self_test: bool, args: argparse.Namespace, work: Path, index: int) -> dict[str, Any]:
    """One demo run through the CLI; its wall time, log and every rank's record."""
    out = work / f"{name.removesuffix('.yaml')}_{'on' if self_test else 'off'}_{index}"
    argv = [sys.executable, "-m", "lightning_longctx", "fit", "--config", str(CONFIGS / name),
            f"--trainer.max_steps={args.steps}", "--trainer.enable_checkpointing=false",
            f"--trainer.logger.init_args.save_dir={work / 'logs'}",
            "--trainer.callbacks+=bench_self_test.SelfTestProbe", f"--trainer.callbacks.out={out}"]  # fmt: skip
    if not self_test:
        argv.append("--trainer.strategy.init_args.self_test=false")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
    }
    log = out.with_suffix(".log")
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(
            argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout
        )
    wall = time.perf_counter() - start
    text = log.read_text()
    if proc.returncode != 0:
        return {"status": f"exit {proc.returncode}", "log_tail": text[-3000:], "run_s": wall}
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob(f"{out.name}.rank*.json"))]
    logged = PASSED.search(text)
    return {
        "status": "ok",
        "run_s": wall,
        "ranks": ranks,
        "logged_s": float(logged.group(1)) if logged else None,
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(name: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """The demo ``name`` with the self-test on and off, alternating, ``--repeats`` times each; one row each."""
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for i in range(args.repeats):
        for on in (True, False):
            got = fit_once(name, on, args, work, i)
            print(f"  {name} self_test={on} #{i}: {got['status']}, {got['run_s']:.1f} s", flush=True)
            runs[on].append(got)
    rows = []
    for on in (True, False):
        ok = [r for r in runs[on] if r["status"] == "ok"]
        ranks = [rank for r in ok for rank in r["ranks"]]
        reports = [rep for rank in ranks for rep in rank["reports"]]
        # per run: the slowest rank's self-test, first step and later steps
        per_run = [
            {"self_test_s": max((sum(rep["seconds"] for rep in rank["reports"]) for rank in r["ranks"]), default=0.0),
             "first_step_s": max(rank["step_s"][0] for rank in r["ranks"]),
             "later_step_s": max(statistics.median(rank["step_s"][1:] or [0.0]) for rank in r["ranks"]),
             "maxrss_mib": max(rank["maxrss_kib"] for rank in r["ranks"]) / 1024}
            for r in ok
        ]  # fmt: skip
        walls = [r["run_s"] for r in ok]
        rows.append({
            "config": name.removesuffix(".yaml"), "self_test": "on" if on else "off", "runs": len(ok),
            "failed": [r for r in runs[on] if r["status"] != "ok"],
            "self_test_s": _median([p["self_test_s"] for p in per_run]) if on else None,
            "logged_s": _median([r["logged_s"] for r in ok if r["logged_s"] is not None]),
            "first_step_s": _median([p["first_step_s"] for p in per_run]),
            "later_step_s": _median([p["later_step_s"] for p in per_run]),
            "run_s": _median(walls), "run_all_s": walls,
            "run_range": f"{min(walls):.1f}-{max(walls):.1f}" if walls else None,
            "maxrss_mib": _median([p["maxrss_mib"] for p in per_run]),
            "checks": "; ".join(rep["summary"].split("relative errors ")[-1] for rep in reports[:1]) or None,
            "reports": reports[:1], "per_run": per_run,
        })  # fmt: skip
    return rows


def differences(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config: on minus off of the first step, the whole run and the peak RSS (medians)."""
    out = []
    for on, off in zip(rows[::2], rows[1::2]):

        def diff(key: str, a: dict[str, Any] = on, b: dict[str, Any] = off) -> float | None:
            return None if a.get(key) is None or b.get(key) is None else a[key] - b[key]

        out.append({"config": on["config"], "self_test_s": on["self_test_s"], "first_step_s": diff("first_step_s"),
                    "run_s": diff("run_s"), "maxrss_mib": diff("maxrss_mib")})  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--planner-only", action="store_true", help="part 1 only (no CPU runs)")
    p.add_argument("--configs", nargs="+", default=list(CPU_CONFIGS), help="the CPU demos of part 2")
    p.add_argument("--steps", type=int, default=3, help="training steps per demo run")
    p.add_argument("--repeats", type=int, default=3, help="runs with the self-test on, and as many off")
    p.add_argument("--timeout", type=float, default=600, help="seconds per demo run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "self_test.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folders = _pretrained_folders(Path(tmp))
        priced = [price(name, folders) for name in GPU_CONFIGS]
    print(f"priced on {GPU} by the step-time model; self-test = checks x (2 x run + forward), run = one forward + "
          "backward of the probe (the step at N = probe without its optimizer term)")  # fmt: skip
    print(format_table(priced, PLAN_COLUMNS))
    fields: dict[str, Any] = {"gpu": GPU, "device_memory": DEVICE_MEMORY, "priced": priced}
    failed = False
    if not args.planner_only:
        load_before = os.getloadavg()
        with tempfile.TemporaryDirectory() as tmp:
            rows = [row for name in args.configs for row in measure(name, args, Path(tmp))]
        failed = any(r["failed"] or not r["runs"] for r in rows)
        print(
            f"\nmeasured on this CPU ({os.cpu_count()} cores), {args.steps} steps, medians of {args.repeats} runs:"
        )
        print(format_table(rows, CPU_COLUMNS))
        diffs = differences(rows)
        print("\nself-test on minus off (medians):")
        print(format_table(diffs, [("config", "config", ""), ("self_test_s", "self-test s", ".3f"),
                                   ("first_step_s", "first step s", "+.3f"), ("run_s", "whole run s", "+.1f"),
                                   ("maxrss_mib", "peak RSS MiB", "+.1f")]))  # fmt: skip
        fields.update(measured=rows, on_minus_off=diffs, load_before=load_before, load_after=os.getloadavg())
    fields["elapsed_s"] = round(time.perf_counter() - t0, 1)
    save_results("self_test", vars(args), fields, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
