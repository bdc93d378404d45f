"""MFUMonitor / MemoryMonitor: FLOP formula, peaks, MFU math, real Trainer runs, max over ranks."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig

from lightning_longctx.lightning.callbacks import MemoryMonitor, MFUMonitor, max_over_ranks
from lightning_longctx.lightning.callbacks import memory as memory_mod
from lightning_longctx.lightning.callbacks.mfu import count_tokens, local_running_sum, throughput_metrics
from lightning_longctx.planner import flops as F

VOCAB = 128


def _llama_config(**overrides) -> LlamaConfig:
    kw = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        attn_implementation="eager",  # FlopCounterMode does not see CPU SDPA; eager bmm counts full S×S
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


# --- FLOP formula ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        {},  # GQA 4 q heads / 2 kv heads, untied
        {"num_key_value_heads": 4, "tie_word_embeddings": True},  # MHA, tied head still a matmul
        {"head_dim": 32, "num_key_value_heads": 1},  # H·hd != d, MQA
    ],
    ids=["gqa", "mha-tied", "headdim-mqa"],
)
def test_flops_match_flop_counter_forward_backward(overrides):
    torch.manual_seed(0)
    config = _llama_config(**overrides)
    model = LlamaForCausalLM(config)
    batch, seq = 2, 96
    ids = torch.randint(0, VOCAB, (batch, seq))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops()
    # FlopCounterMode counts the full S×S scores: compare the non-causal formula.
    predicted = F.model_flops_per_step(model, tokens=batch * seq, seq_len=seq, causal=False)
    assert predicted == pytest.approx(measured, rel=0.05)
    assert predicted == pytest.approx(measured, rel=1e-9)  # matmuls only, so it is in fact exact


def test_flops_match_lightning_measure_flops_forward_only_long_rows():
    config = _llama_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, VOCAB, (1, 2048))
    measured = measure_flops(model, lambda: model(input_ids=ids))
    predicted = F.model_flops_per_step(config, tokens=2048, seq_len=2048, causal=False, training=False)
    assert predicted == pytest.approx(measured, rel=0.05)


def test_causal_halves_the_attention_term_only():
    config = _llama_config()
    d, layers, seq = 64, 2, 4096
    full = F.flops_per_token(config, seq, causal=False)
    causal = F.flops_per_token(config, seq, causal=True)
    assert full - causal == pytest.approx(0.5 * 12 * layers * d * seq)  # 12·L·d·S, halved
    assert F.attention_flops_per_token(config, seq, causal=True) == pytest.approx(6 * layers * d * seq)
    assert causal - F.attention_flops_per_token(config, seq) == pytest.approx(6 * F.matmul_params(config))
    assert F.flops_per_token(config, seq, training=False) == pytest.approx(causal / 3)


def test_sliding_window_attends_fewer_keys():
    kw = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    kw["vocab_size"] = VOCAB
    full = F.flops_per_token(_llama_config(), 1024)
    assert F.flops_per_token(MistralConfig(sliding_window=4096, **kw), 1024) == pytest.approx(full)
    w, seq = 256, 1024
    windowed = F.attention_flops_per_token(MistralConfig(sliding_window=w, **kw), seq)
    assert windowed == pytest.approx(3 * 4 * 64 * 2 * w * (1 - w / (2 * seq)))


def test_flops_errors_are_clear():
    with pytest.raises(ValueError, match="intermediate_size"):
        F.flops_per_token(object(), 128)
    with pytest.raises(ValueError, match="seq_len"):
        F.flops_per_token(_llama_config(), 0)
    with pytest.raises(ValueError, match="no Hugging Face decoder config"):
        F.model_flops_per_step(torch.nn.Linear(2, 2), tokens=1, seq_len=1)


# --- peaks ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA GH200 480GB", "bf16", 989e12),
        ("NVIDIA H100 80GB HBM3", "fp32", 67e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA A10G", "bf16", 125e12),
        ("NVIDIA L40S", "bf16", 362e12),
        ("NVIDIA L40", "bf16", 181e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
        ("AMD Instinct MI300X", "bf16", 1307e12),
    ],
)
def test_peak_table_lookup(name, dtype, peak):
    assert F.get_peak_flops(name, dtype) == peak


def test_peak_unknown_and_precision_mapping():
    assert F.get_peak_flops("Some Future Accelerator", "bf16") is None
    assert F.get_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert F.precision_to_dtype("bf16-mixed") == "bf16"
    assert F.precision_to_dtype("16-mixed") == "fp16"
    assert F.precision_to_dtype("32-true", "cpu") == "fp32"


def test_measured_peak_is_positive_and_cached():
    first = F.measure_peak_flops("cpu", "fp32", n=256, reps=2)
    assert first > 0
    assert F.measure_peak_flops("cpu", "fp32", n=256, reps=2) == first


# --- MFU math and token counting ------------------------------------------------------------------
def test_throughput_metrics_math():
    m = throughput_metrics(tokens=8192, flops=4e12, seconds=2.0, world_size=4, peak_flops=1e12)
    assert m["perf/tokens_per_sec"] == 4096
    assert m["perf/tokens_per_sec_per_device"] == 1024
    assert m["perf/tflops_per_device"] == pytest.approx(0.5)
    assert m["perf/mfu"] == pytest.approx(0.5)
    assert m["perf/mfu"] * 1e12 == pytest.approx(m["perf/tflops_per_device"] * 1e12)


def test_tokens_counted_once_per_sp_group():
    b, n = 2, 64
    shard = {"input_ids": torch.zeros(b, n // 2, dtype=torch.long)}  # sp=2: each rank holds N/2
    assert count_tokens(shard, world_size=2, sp_size=2) == (b * n, n)  # dp=1: one sample of N, not 2N
    assert count_tokens(shard, world_size=4, sp_size=2) == (2 * b * n, n)  # dp=2
    assert count_tokens(torch.zeros(b, n), world_size=2) == (2 * b * n, n)  # plain DDP
    assert count_tokens({"x": 1}, world_size=1) is None


def test_running_sum_window():
    s = local_running_sum(2)
    for v in (1.0, 2.0, 1e17):
        s.update(torch.tensor(v, dtype=torch.float64))
    assert s.compute().item() == 1e17 + 2.0  # float64, last two only


def test_monitor_argument_validation():
    with pytest.raises(ValueError, match="peak_flops"):
        MFUMonitor(peak_flops=0)
    with pytest.raises(ValueError, match="window"):
        MFUMonitor(window=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        MFUMonitor(warmup_steps=-1)


# --- real Trainer runs ----------------------------------------------------------------------------
class _Tokens(Dataset):
    def __init__(self, n: int, seq: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class _TinyLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(
            _llama_config(hidden_size=32, intermediate_size=64, attn_implementation="sdpa")
        )

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


BATCH, SEQ, STEPS, WARMUP = 2, 32, 4, 1


def _fit(root: str, callbacks: list, **trainer_kw) -> L.Trainer:
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=CSVLogger(root),
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        **trainer_kw,
    )
    trainer.fit(_TinyLlama(), DataLoader(_Tokens(16, SEQ), batch_size=BATCH))
    return trainer


def _rows(trainer: L.Trainer, column: str) -> list[dict[str, float]]:
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get(column)]
    return [{k: float(v) for k, v in r.items() if v != ""} for r in rows]


def test_trainer_run_logs_perf_and_memory(tmp_path: Path):
    mfu, mem = MFUMonitor(peak_flops=2e12, warmup_steps=WARMUP), MemoryMonitor()
    trainer = _fit(str(tmp_path), [mfu, mem], devices=1)

    perf = _rows(trainer, "perf/mfu")
    assert len(perf) == STEPS - WARMUP
    for row in perf:
        assert row["perf/tokens_per_sec"] > 0
        assert row["perf/tokens_per_sec_per_device"] == pytest.approx(row["perf/tokens_per_sec"])
        assert row["perf/mfu"] * 2e12 == pytest.approx(row["perf/tflops_per_device"] * 1e12, rel=1e-5)
        # TFLOP/s = (model FLOPs per token) × tokens/s: the HF-config formula at S = SEQ.
        per_token = F.flops_per_token(trainer.lightning_module.model.config, SEQ)
        assert row["perf/tflops_per_device"] * 1e12 == pytest.approx(
            per_token * row["perf/tokens_per_sec"], rel=1e-5
        )
    assert {"perf/tokens_per_sec", "perf/mfu"} <= set(trainer.progress_bar_metrics)
    assert mfu.peak_source == "argument"

    memory = _rows(trainer, "mem/host_rss_gib")
    assert len(memory) == STEPS
    assert all(r["mem/host_rss_gib"] > 0 and r["mem/offloaded_gib"] >= 0 for r in memory)
    assert "mem/peak_allocated_gib" not in memory[0]  # CUDA-only metrics are not faked as 0 on CPU
    assert mem.summary is not None and "mem/host_rss_gib" in mem.summary and "perf/mfu" in mem.summary
    assert mem.plot_path == os.path.join(trainer.log_dir, "memory.png")
    assert Path(mem.plot_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trainer_run_measures_cpu_peak_and_honours_flops_override(tmp_path: Path):
    mfu = MFUMonitor(warmup_steps=WARMUP, flops_per_token=1e6)
    trainer = _fit(str(tmp_path), [mfu], devices=1)
    assert mfu.peak_source.startswith("measured: cpu fp32")
    for row in _rows(trainer, "perf/mfu"):
        assert row["perf/tflops_per_device"] * 1e12 == pytest.approx(
            1e6 * row["perf/tokens_per_sec"], rel=1e-5
        )
        assert row["perf/mfu"] * mfu.peak_flops == pytest.approx(
            row["perf/tflops_per_device"] * 1e12, rel=1e-5
        )


# --- two gloo ranks -------------------------------------------------------------------------------
def _max_over_ranks_on_rank() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    values = torch.tensor([rank + 1.0, 10.0 - rank, 2.0**40 + rank], dtype=torch.float64)
    reduced = max_over_ranks(values)
    running = local_running_sum(3)
    running.update(torch.tensor(float(rank + 1), dtype=torch.float64))
    return {"input": values, "reduced": reduced, "running": running.compute()}


def test_max_over_ranks_two_ranks(dist_pool):
    out = dist_pool(2).run(_max_over_ranks_on_rank)
    for rank, result in enumerate(out):
        assert result["reduced"].tolist() == [2.0, 10.0, 2.0**40 + 1]
        assert result["input"][0].item() == rank + 1  # the input is not reduced in place
        assert result["running"].item() == rank + 1  # running sums stay per rank: no hidden all-gather


def _ddp_fit_on_rank(root: str) -> dict:
    """A real 2-rank DDP Trainer run inside the pool's process group, with rank-dependent memory."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    rank = dist.get_rank()
    saved_env = os.environ.get("LOCAL_RANK")
    saved_rss = memory_mod.host_rss_bytes
    os.environ["LOCAL_RANK"] = str(rank)
    memory_mod.host_rss_bytes = lambda: (rank + 1) << 30  # rank r "uses" r+1 GiB
    try:
        mfu, mem = MFUMonitor(peak_flops=1e12, warmup_steps=WARMUP), MemoryMonitor(plot=False)
        strategy = DDPStrategy(cluster_environment=LightningEnvironment(), process_group_backend="gloo")
        trainer = _fit(root, [mfu, mem], devices=2, strategy=strategy)
        return {"mem": mem.history, "perf": mfu.history, "world_size": trainer.world_size}
    finally:
        memory_mod.host_rss_bytes = saved_rss
        if saved_env is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved_env


def test_ddp_two_ranks_memory_is_max_over_ranks(tmp_path: Path, dist_pool):
    out = dist_pool(2).run(_ddp_fit_on_rank, str(tmp_path))
    assert [o["world_size"] for o in out] == [2, 2]
    for o in out:  # both ranks ran every step's collective and got the same reduced numbers
        assert len(o["mem"]) == STEPS
        assert all(row["mem/host_rss_gib"] == 2.0 for row in o["mem"])
    for row in out[0]["perf"]:
        assert row["perf/tokens_per_sec_per_device"] == pytest.approx(row["perf/tokens_per_sec"] / 2)
        assert math.isfinite(row["perf/mfu"]) and row["perf/mfu"] > 0


def _sp_fit_on_rank(root: str) -> dict:
    """sp=2 under UlyssesFPDTStrategy: tokens are counted once per SP group, memory is max over ranks."""
    from lightning_longctx import UlyssesFPDTStrategy

    rank = dist.get_rank()
    saved_rss = memory_mod.host_rss_bytes
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2", NODE_RANK="0")
    memory_mod.host_rss_bytes = lambda: (rank + 1) << 30
    seen: list = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(count_tokens(batch, world_size=trainer.world_size, sp_size=trainer.strategy.sp_size))

    try:
        mfu, mem = MFUMonitor(peak_flops=1e12, warmup_steps=WARMUP), MemoryMonitor(plot=False)
        trainer = _fit(
            root, [mfu, mem, Spy()], devices=2, strategy=UlyssesFPDTStrategy(sequence_parallel_size=2)
        )
        return {"mem": mem.history, "perf": mfu.history, "sp": trainer.strategy.sp_size, "seen": seen}
    finally:
        memory_mod.host_rss_bytes = saved_rss


def test_sp2_tokens_counted_once_per_group(tmp_path: Path, dist_pool):
    out = dist_pool(2).run(_sp_fit_on_rank, str(tmp_path))
    for o in out:
        assert o["sp"] == 2
        # the global batch is BATCH rows of SEQ tokens (one SP group, dp=1): not 2x that
        assert all(tokens == BATCH * SEQ and seq == SEQ for tokens, seq in o["seen"])
        assert all(row["mem/host_rss_gib"] == 2.0 for row in o["mem"])
    assert out[0]["mem"] == out[1]["mem"]
    for row in out[0]["perf"]:
        assert row["perf/tokens_per_sec_per_device"] == pytest.approx(row["perf/tokens_per_sec"] / 2)
        assert row["perf/mfu"] * 1e12 == pytest.approx(row["perf/tflops_per_device"] * 1e12)


# --- every callback with its DEFAULT arguments, multi-process, fit then validate ----------------------
class _TinyLlamaWithVal(_TinyLlama):
    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("val/loss", loss, sync_dist=True, batch_size=BATCH)
        return loss


def _default_callbacks_on_rank(root: str, fpdt: bool, with_logger: bool) -> dict:
    """MFUMonitor() and MemoryMonitor() as a user writes them (plot on, measured peak), sp=2."""
    from lightning_longctx import UlyssesFPDTStrategy

    rank = dist.get_rank()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2", NODE_RANK="0")
    mfu, mem = MFUMonitor(), MemoryMonitor()
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=2, fpdt_chunk_size=8 if fpdt else None),
        max_steps=STEPS,
        logger=CSVLogger(root) if with_logger else False,
        default_root_dir=root,
        log_every_n_steps=1,
        callbacks=[mfu, mem],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    module = _TinyLlamaWithVal()
    train, val = (DataLoader(_Tokens(n, SEQ), batch_size=BATCH) for n in (16, 4))
    trainer.fit(module, train, val)
    validated = trainer.validate(module, val, verbose=False)
    return {
        "png": Path(mem.plot_path).read_bytes()[:8] if mem.plot_path else None,
        "plot_dir": os.path.dirname(mem.plot_path) if mem.plot_path else None,
        "summary": mem.summary,
        "steps": len(mem.history),
        "val_loss": validated[0]["val/loss"],
    }


@pytest.mark.parametrize("with_logger", [True, False], ids=["logger", "no-logger"])
@pytest.mark.parametrize("fpdt", [False, True], ids=["ulysses", "fpdt"])
def test_default_callbacks_survive_multi_process_fit_and_validate(
    tmp_path: Path, dist_pool, fpdt, with_logger
):
    """No collective under rank-zero-only code: MemoryMonitor's end-of-fit plot reads trainer.log_dir (a
    broadcast under DDP) on every rank. Before the fix rank 1 returned early and rank 0 died in the
    broadcast ("Connection closed by peer"; a hang on NCCL)."""
    out = dist_pool(2).run(_default_callbacks_on_rank, str(tmp_path), fpdt, with_logger)
    zero, one = out
    assert zero["png"] == b"\x89PNG\r\n\x1a\n", "rank 0 wrote no memory plot"
    expected_dir = (
        os.path.join(str(tmp_path), "lightning_logs", "version_0") if with_logger else str(tmp_path)
    )
    assert zero["plot_dir"] == expected_dir
    assert zero["summary"] is not None and "mem/host_rss_gib" in zero["summary"]
    assert one["png"] is None and one["summary"] is None  # the summary and the plot are rank 0's job
    assert zero["steps"] == one["steps"] == STEPS
    assert zero["val_loss"] == pytest.approx(one["val_loss"]) and math.isfinite(zero["val_loss"])
