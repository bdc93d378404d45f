"""The benchmark scripts run end to end at toy sizes and write the JSON (and PNG) they promise.

Slow tier (``-m slow``; the full ``python -m pytest -q`` runs it): each test launches a script in fresh processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _run_script(args: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return proc


def test_bench_ulysses_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ulysses.json"
    proc = _run_script(
        [
            "benchmarks/bench_ulysses.py",
            *("--seq-lens", "256", "--world-sizes", "2", "--heads", "4", "--head-dim", "16"),
            *("--repeats", "1", "--warmup", "0", "--comm-repeats", "1", "--timeout", "60", "--out", str(out)),
        ],
        timeout=120,
    )
    assert "deepspeed:" in proc.stdout

    data = json.loads(out.read_text())
    assert {"benchmark", "config", "deepspeed", "environment", "checks_passed", "failures", "results"} <= set(
        data
    )
    assert data["checks_passed"] and not data["failures"]
    (row,) = data["results"]
    assert {"P", "N", "ours_ms", "ours_bytes_per_rank", "formula_bytes_per_rank", "ours_bytes_ratio"} <= set(
        row
    )
    assert (row["P"], row["N"]) == (2, 256)
    assert row["ours_bytes_ratio"] == 1.0
    # fwd + bwd: 8 * b * (N/P) * h * d * 4 bytes * (P-1)/P = 8 * 128 * 4 * 16 * 4 / 2
    assert row["ours_bytes_per_rank"] == row["formula_bytes_per_rank"] == [131072, 131072]
    # the package's own scoped counter (count_all_to_all) agrees with the benchmark's meter
    assert row["ours_comm_stats_bytes_per_rank"] == row["ours_bytes_per_rank"]
    if data["deepspeed"].startswith("ok"):
        assert row["deepspeed_bytes_ratio"] == 1.0
        assert row["diff_out"] <= 1e-5 and row["diff_grad"] <= 1e-5
        assert row["deepspeed_batch_dim_none_diff"] > 1e-3  # the batch_dim_idx=None trap is real


def test_bench_attention_smoke(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    _run_script(
        [
            "benchmarks/bench_attention.py",
            *(
                "--seq-lens",
                "256",
                "--world-sizes",
                "2",
                "--chunk-size",
                "32",
                "--heads",
                "4",
                "--kv-heads",
                "2",
            ),
            *("--head-dim", "16", "--repeats", "1", "--profile-seq-lens", "256", "--out", str(out)),
        ],
        timeout=150,
    )
    data = json.loads(out.read_text())
    assert data["benchmark"] == "attention" and data["checks_passed"] and not data["failures"]
    (row,) = data["results"]
    assert (row["P"], row["N"], row["chunk"]) == (2, 256, 32)
    assert row["fpdt_kernels"] == ["cpu_flash"]
    for v in ("fpdt", "fpdt_offload", "fpdt_no_overlap", "fpdt_math"):
        assert row[f"{v}_ms"] > 0 and row[f"{v}_ratio"] > 0 and row[f"{v}_diff"] < 1e-4
    assert set(row["profile_rank0"]) == {"ulysses", "fpdt", "fpdt_offload", "fpdt_no_overlap", "fpdt_math"}
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_memory_smoke(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    _run_script(
        [
            "benchmarks/bench_memory.py",
            *("--seq-lens", "256", "--modes", "ulysses", "fpdt", "fpdt_act_offload", "--chunk-size", "64"),
            *("--out", str(out)),
        ]
    )
    data = json.loads(out.read_text())
    assert data["benchmark"] == "memory" and len(data["rows"]) == 3
    assert all(r["status"] == "ok" and r["step_mib"] > 0 for r in data["rows"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_soak_smoke(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    _run_script(["benchmarks/bench_soak.py", "--steps", "5", "--fit-from", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "soak" and not data["failures"]
    assert [len(r["steps"]) for r in data["ranks"]] == [5, 5]
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    _run_script(["benchmarks/bench_throughput.py", "--smoke", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "throughput" and data["results"] and not data["failures"]


def test_plot_writes_pngs(tmp_path: Path) -> None:
    _run_script(["benchmarks/plot.py", "--results", "benchmarks/results", "--out", str(tmp_path)])
    names = {p.name for p in tmp_path.glob("*.png")}
    assert names >= {"ulysses_time.png", "memory.png", "throughput.png", "soak.png", "attention.png"}


def test_fuzz_smoke(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    # the script, its table and JSON (the fuzzing itself: tests/test_fuzz.py)
    proc = _run_script(["benchmarks/fuzz.py", "--trials", "2", "--seed", "3", "--out", str(out)], timeout=180)
    assert "| mode" in proc.stdout and "2 trials in" in proc.stdout
    data = json.loads(out.read_text())
    assert data["trials"] == 2 and sum(r["trials"] for r in data["summary"]) == 2
    assert data["failing"] == [] and sum(r["failing"] for r in data["summary"]) == 0


def test_bench_planner_smoke(tmp_path: Path) -> None:
    """Plan vs measured RSS, with DDP and with FSDP2 + state offload + the MixedPrecisionPolicy."""
    out = tmp_path / "planner.json"
    proc = _run_script(["benchmarks/bench_planner.py", "--smoke", "--out", str(out)], timeout=240)
    assert "rows within 15%" in proc.stdout  # toy sizes: no error target (RSS noise is MiBs of ~100)
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert len(rows) == 3 and all(r["status"] == "ok" for r in rows)
    offloaded = [r for r in rows if r["coff"]]
    assert offloaded and offloaded[0]["plan"]["cpu_offload"] and offloaded[0]["plan"]["mp_policy"]


def test_bench_frontier(tmp_path: Path) -> None:
    out = tmp_path / "frontier.json"
    proc = _run_script(["benchmarks/bench_frontier.py", "--out", str(out)], timeout=120)
    assert "ALST: 500K on 1 x H100 80GB" in proc.stdout and "llama3_8b_500k_1gpu.yaml" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["fits"] for r in data["rows"]] == ["yes", "yes", "NO", "yes", "yes", "yes"]
    assert all(r["fits"] == "yes" for r in data["configs"])


def test_bench_self_test_prices_every_gpu_config(tmp_path: Path) -> None:
    """The self-test priced on every shipped GPU config (planner only): the formula of the script's docstring,
    the probe of ``self_test.probe_shape``, and a small fraction of one step."""
    out = tmp_path / "self_test.json"
    proc = _run_script(["benchmarks/bench_self_test.py", "--planner-only", "--out", str(out)], timeout=120)
    assert "llama3_8b_500k_1gpu" in proc.stdout
    rows = json.loads(out.read_text())["priced"]
    gpu = {
        p.stem for p in (ROOT / "examples" / "configs").glob("*.yaml") if "accelerator: gpu" in p.read_text()
    }
    assert {r["config"] for r in rows} == gpu
    for r in rows:
        # FSDP2 under bf16-mixed: float32 (before sharding) then bf16, bf16 only with cpu_offload; FPDT: two
        # probe chunks of 8 per rank, one extra forward
        expected = ["bfloat16"] if "cpu_offload" in r["layout"] else ["float32", "bfloat16"]
        assert r["checks"] == len(expected) and r["check_dtypes"] == expected, r
        assert r["probe_chunk"] == 8 and r["probe_length"] % 16 == 0 and r["probe_rows"] == 1
        assert r["self_test_s"] == pytest.approx(r["checks"] * (2 * r["run_s"] + r["forward_s"]))
        assert r["logits_bytes"] == 4 * r["probe_rows"] * r["probe_length"] * r["vocab_size"] * 4
        assert 0 < r["ratio"] < 0.02 and r["logits_pct_of_peak"] < 1, r


def test_bench_tp_bytes_are_the_formula(tmp_path: Path) -> None:
    """Tensor x sequence parallelism at world 4: each rank's all-to-all bytes equal the formula with t (the
    TP-local heads: 1/t of the bytes at a given sp)."""
    out = tmp_path / "tp.json"
    _run_script(
        ["benchmarks/bench_tp.py", "--seq-len", "256", "--repeats", "1", "--out", str(out)], timeout=240
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["sp"], r["tp"]) for r in rows] == [(4, 1), (2, 2), (1, 4)]
    assert all(r["status"] == "ok" and r["bytes_sent_per_rank"] == r["formula_bytes"] for r in rows)
    assert rows[1]["bytes_sent_per_rank"] > 0 and rows[2]["bytes_sent_per_rank"] == 0


def test_bench_hybrid_bytes_are_the_formula(tmp_path: Path) -> None:
    """A hybrid at P = 2: the state exchange (conv halo + state scan) and the attention all-to-all move exactly
    their formulas' bytes per rank, and the exchange is a small fraction of the all-to-all."""
    out = tmp_path / "hybrid.json"
    _run_script(
        ["benchmarks/bench_hybrid.py", "--seq-len", "512", "--repeats", "1", "--out", str(out)], timeout=240
    )
    data = json.loads(out.read_text())
    exchange, attention = data["rows"]
    assert all(r["bytes_per_rank"] == r["formula"] for r in data["rows"])
    assert 0 < exchange["bytes_per_rank"] < attention["bytes_per_rank"]
    assert data["timing"]["per_rank_s"] > 0


def test_bench_ring_bytes_are_the_formula(tmp_path: Path) -> None:
    """Ulysses, USP (2 x 2) and a ring of 4 at P = 4: every rank's bytes equal their formula, the outputs agree;
    the balance table (zigzag exactly balanced on causal work, contiguous not) and the plot."""
    out, png = tmp_path / "ring.json", tmp_path / "ring.png"
    _run_script(
        ["benchmarks/bench_ring.py", "--world-sizes", "4", "--seq-len", "64", "--head-dim", "8", "--repeats", "1",
         "--balance-seq-len", "1024", "--block-size", "64", "--out", str(out), "--png", str(png)],
        timeout=240,
    )  # fmt: skip
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["ring"], r["ulysses"]) for r in rows] == [(1, 4), (2, 2), (4, 1)]
    assert all(r["bytes_ratio"] == 1.0 and r["diff_out"] < 1e-5 for r in rows), rows
    assert rows[0]["ring_mib"] == 0 and rows[2]["a2a_mib"] == 0
    balance = {(b["mask"], b["ring"]): b for b in data["balance"]}
    assert {m for m, _ in balance} == {"-", "4 documents", "8 documents", "16 documents", "window 128"}
    for r in (2, 4, 8):
        assert balance["-", r]["zigzag_max"] == balance["-", r]["zigzag_min"] == 1.0
        assert balance["-", r]["contiguous_max"] > 1.1 > 0.9 > balance["-", r]["contiguous_min"]
    assert png.stat().st_size > 0


def test_calibrate_step_time_writes_a_spec_the_planner_reads(tmp_path: Path) -> None:
    """``calibrate_cpu`` at its smallest (the attention up to its 2048-token reference, the shortest budget):
    the DeviceSpec JSON it writes loads with ``planner.devices.load_spec``, every measured figure positive, and
    the step-time model prices a step with it."""
    from lightning_longctx.planner import estimate_step_time
    from lightning_longctx.planner.devices import load_spec

    out = tmp_path / "cpu.json"
    proc = _run_script(
        ["benchmarks/calibrate_step_time.py", "--out", str(out), "--seconds", "0.05", "--max-tokens", "2048"],
        timeout=240,
    )
    assert f"wrote {out}" in proc.stdout
    spec = load_spec(out)
    rates = {
        name: getattr(spec, name)
        for name in ("peak_flops", "matmul_flops", "memory_bandwidth", "intra_node_bandwidth",
                     "inter_node_bandwidth", "host_link_bandwidth", "host_memory_bandwidth", "device_memory",
                     "op_latency", "cores")
    }  # fmt: skip
    assert all(v > 0 for v in rates.values()), rates
    assert spec.default_kernel == "cpu-flash" and not spec.overlap
    kernel = spec.attention["cpu-flash"]
    assert kernel.forward > 0 and kernel.backward > 0 and kernel.reference_tokens == 2048
    assert [row[0] for row in kernel.measured] == [256, 512, 1024, 2048]
    assert all(rate > 0 for row in kernel.measured for rate in row[1:]), kernel.measured
    config = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
              "max_position_embeddings": 65536}  # fmt: skip
    est = estimate_step_time(config, seq_len=2048, sequence_parallel_size=2, gpu=spec)
    assert est.step_time_s > 0 and 0 < est.mfu < 1


def test_bench_checkpoint_smoke(tmp_path: Path) -> None:
    """Full vs sharded vs async checkpoints at world 2: every format saves, loads back what it saved (the script
    checks), and the sharded ones are torch.distributed.checkpoint directories with one shard file per rank."""
    out, ckpts = tmp_path / "checkpoint.json", tmp_path / "ckpts"
    _run_script(["benchmarks/bench_checkpoint.py", "--smoke", "--out", str(out), "--ckpt-dir", str(ckpts)])
    data = json.loads(out.read_text())
    rows = {r["format"]: r for r in data["rows"]}
    assert list(rows) == ["full", "sharded", "async"] and all(r["status"] == "ok" for r in rows.values())
    assert all(r["save_s"] > 0 and r["load_s"] > 0 and r["disk_bytes"] > 0 for r in rows.values())
    assert rows["async"]["blocking_s"] <= rows["async"]["save_s"]
    assert (ckpts / "full-0.ckpt").is_file() and (ckpts / "full-0.ckpt.commit.json").is_file()
    for fmt in ("sharded", "async"):
        names = {p.name for p in (ckpts / f"{fmt}-0.ckpt").iterdir()}
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", "commit.json"} <= names, names
    assert out.with_suffix(".png").is_file()
