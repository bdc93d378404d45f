"""The memory planner: exact arithmetic, saved-for-backward bytes of a real model, errors, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_longctx import enable_sequence_parallel, plan_memory, shard_batch
from lightning_longctx.cli import main
from lightning_longctx.planner import format_bytes, longest_sequence, parse_bytes

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
TINY = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}  # fmt: skip
BENCH = {**TINY, "vocab_size": 32000, "hidden_size": 128, "intermediate_size": 344, "num_key_value_heads": 4}


def _model(config: dict) -> torch.nn.Module:
    cfg = dict(config)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))


@pytest.mark.parametrize("tied", [False, True])
def test_weights_gradients_optimizer_are_the_real_parameter_count(tied):
    config = {**TINY, "tie_word_embeddings": tied}
    n = sum(p.numel() for p in _model(config).parameters())
    plan = plan_memory(config, seq_len=1024, sequence_parallel_size=2, precision="32-true")
    assert plan.params == n
    assert plan["weights"].largest == 4 * n
    # DDP: the gradients are views into its buckets (gradient_as_bucket_view=True), no second copy
    assert plan["DDP gradient buckets"].largest == 4 * n
    assert "gradients" not in [c.name for c in plan.components]
    assert plan.between_steps == 4 * 4 * n  # weights, 2 AdamW states, buckets (= the gradients)
    sgd = plan_memory(config, seq_len=1024, sequence_parallel_size=2, optimizer="sgd")
    assert sgd.between_steps == 2 * 4 * n
    half = plan_memory(config, seq_len=1024, sequence_parallel_size=2, precision="bf16-true")
    assert half["weights"].largest == 2 * n
    mixed = plan_memory(config, seq_len=1024, sequence_parallel_size=2, precision="bf16-mixed")
    assert mixed["weights"].largest == 4 * n  # Lightning's bf16-mixed keeps fp32 weights (no master copy)
    built_bf16 = plan_memory(config, seq_len=1024, sequence_parallel_size=2, precision="bf16-mixed",
                             param_dtype="bfloat16")  # fmt: skip
    assert built_bf16["weights"].largest == 2 * n
    fsdp = plan_memory(
        config, seq_len=1024, sequence_parallel_size=2, data_parallel_size=4, data_parallel="fsdp"
    )
    assert fsdp["weights"].largest == fsdp["gradients"].largest == -(-n // 8) * 4
    assert "DDP gradient buckets" not in [c.name for c in fsdp.components]


def _saved_bytes(model: torch.nn.Module, batch: dict, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(**batch)
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("mode", ["ulysses", "fpdt"])
def test_activations_match_what_autograd_saves(mode, precision):
    """The per-layer formula against a real forward (P = 1, GQA): every saved tensor, counted once."""
    torch.manual_seed(0)
    model = _model(TINY)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    chunk = 64 if mode == "fpdt" else None
    enable_sequence_parallel(model, mode=mode, chunk_size=chunk)
    ids = torch.randint(0, TINY["vocab_size"], (1, 256))
    batch = shard_batch({"input_ids": ids, "labels": ids.clone()}, chunk_size=chunk)
    saved = _saved_bytes(model, batch, autocast=precision == "bf16-mixed")
    plan = plan_memory(TINY, seq_len=256, sequence_parallel_size=1, mode=mode, fpdt_chunk_size=chunk,
                       precision=precision)  # fmt: skip
    planned = plan["activations kept for backward"].largest
    if precision == "bf16-mixed":
        planned += plan["autocast weight copies"].largest
    if mode == "ulysses":  # Hugging Face's loss saves its fp32 log-softmax (the loss working set) and targets
        planned += 256 * TINY["vocab_size"] * 4 + 256 * 8
    assert planned == pytest.approx(saved, rel=0.005)


OFFLOAD_CASES = {  # mode, FPDT offload, activation checkpointing, activation offload
    "fpdt_offload": ("fpdt", True, False, False),
    "fpdt_offload_checkpointing": ("fpdt", True, True, False),
    "fpdt_offload_activation_offload": ("fpdt", True, True, True),
    "ulysses_activation_offload": ("ulysses", False, True, True),
}


@pytest.mark.parametrize("case", list(OFFLOAD_CASES))
def test_offloaded_bytes_are_the_planned_host_activations(case):
    """What the host holds after the forward: FPDT's offloaded chunks of every layer, with checkpointing too
    (the chunk store lives on the autograd node, which checkpointing keeps), and with activation offload
    every layer's checkpointed input."""
    from lightning_longctx.attention.offload import offloaded_bytes
    from lightning_longctx.integrations.transformers import enable_activation_checkpointing

    mode, offload, checkpointing, activation_offload = OFFLOAD_CASES[case]
    chunk = 64 if mode == "fpdt" else None
    model = _model(TINY)
    enable_sequence_parallel(model, mode=mode, chunk_size=chunk, offload=offload)
    if checkpointing:
        enable_activation_checkpointing(model, offload=activation_offload)
    ids = torch.randint(0, TINY["vocab_size"], (1, 256))
    loss = model(**shard_batch({"input_ids": ids, "labels": ids.clone()}, chunk_size=chunk)).loss
    plan = plan_memory(TINY, seq_len=256, sequence_parallel_size=1, mode=mode, fpdt_chunk_size=chunk,
                       offload=offload, activation_checkpointing=checkpointing,
                       activation_offload=activation_offload)  # fmt: skip
    assert offloaded_bytes() == plan["activations kept for backward"].host > 0
    loss.backward()
    assert offloaded_bytes() == 0


def test_activations_scale_as_one_over_p_and_offload_moves_them_to_the_host():
    acts = [plan_memory(BENCH, seq_len=65536, sequence_parallel_size=p)["activations kept for backward"].device
            for p in (1, 2, 4)]  # fmt: skip
    assert acts[0] == 2 * acts[1] == 4 * acts[2]
    kw = {"seq_len": 65536, "sequence_parallel_size": 2, "mode": "fpdt", "fpdt_chunk_size": 1024}
    on, off = plan_memory(BENCH, offload=True, **kw), plan_memory(BENCH, **kw)
    on_acts, off_acts = on["activations kept for backward"], off["activations kept for backward"]
    assert off_acts.host == 0 and on_acts.host > 0
    assert on_acts.device + on_acts.host == off_acts.device
    assert on.host_total >= on_acts.host and on.device_total < off.device_total


def test_fpdt_working_set_does_not_grow_with_the_sequence():
    def loss_ws(n: int, **kw) -> int:
        return plan_memory(BENCH, seq_len=n, sequence_parallel_size=2, **kw)["loss working set"].largest

    fpdt = {"mode": "fpdt", "fpdt_chunk_size": 1024}
    assert loss_ws(16384) * 4 == loss_ws(65536)  # Ulysses: the whole (s/P, vocab) logits
    # FPDT: one (1024, vocab) block; only the hidden states' gradient (d * 4 bytes per token) grows
    assert loss_ws(65536, **fpdt) - loss_ws(16384, **fpdt) == (65536 - 16384) // 2 * 128 * 4
    per_chunk = [plan_memory(BENCH, seq_len=n, sequence_parallel_size=2, **fpdt) for n in (16384, 65536)]
    assert per_chunk[0].fpdt_chunk_size == per_chunk[1].fpdt_chunk_size == 1024


def test_peak_is_the_largest_phase_and_the_rows_add_up():
    for kw in ({}, {"mode": "fpdt", "fpdt_chunk_size": 1024, "offload": True, "activation_checkpointing": True},
               {"precision": "bf16-mixed", "data_parallel": "fsdp", "data_parallel_size": 2}):  # fmt: skip
        plan = plan_memory(BENCH, seq_len=32768, sequence_parallel_size=2, **kw)
        assert plan.device_total == max(d for _, d, _ in plan.phases) == plan.phase(plan.peak_phase)[0]
        assert sum(c.device for c in plan.components) == plan.device_total
        assert plan.combined >= plan.device_total
        data = json.loads(json.dumps(plan.to_dict()))
        assert data["device_total"] == plan.device_total and data["components"]
        assert "total at peak" in plan.table()


def test_sequence_is_padded_like_shard_batch_and_the_chunk_capped_at_the_local_length():
    plan = plan_memory(BENCH, seq_len=10000, sequence_parallel_size=4, mode="fpdt", fpdt_chunk_size=1024)
    assert plan.padded_seq_len == 12288 and plan.tokens_per_device == 3072  # a multiple of P * chunk
    short = plan_memory(BENCH, seq_len=1000, sequence_parallel_size=4, mode="fpdt", fpdt_chunk_size=1024)
    assert short.fpdt_chunk_size == 250 and short.padded_seq_len == 1000  # one chunk of the local length
    assert plan_memory(BENCH, seq_len=1001, sequence_parallel_size=2).padded_seq_len == 1002


def test_longest_sequence_is_the_boundary_of_plan_memory():
    kw = {"sequence_parallel_size": 2, "mode": "fpdt", "fpdt_chunk_size": 1024}
    budgets = [1 << 30, 2 << 30, 4 << 30]
    found = [longest_sequence(BENCH, device_memory=b, **kw) for b in budgets]
    assert found == sorted(found) and found[0] > 0
    for n, budget in zip(found, budgets):
        assert n % 2048 == 0
        assert plan_memory(BENCH, seq_len=n, **kw).device_total <= budget
        assert plan_memory(BENCH, seq_len=n + 2048, **kw).device_total > budget
    assert longest_sequence(BENCH, device_memory="1MiB", **kw) == 0
    ulysses = longest_sequence(BENCH, device_memory="2GiB", sequence_parallel_size=2)
    assert 0 < ulysses < found[1] and ulysses % 2048 == 0


def test_fits_and_memory_sizes():
    assert parse_bytes("80GiB") == parse_bytes("80G") == 80 << 30
    assert (
        parse_bytes("141GB") == 141 * 10**9 and parse_bytes(512) == 512 and parse_bytes("1.5 MiB") == 3 << 19
    )
    assert format_bytes(3 << 29) == "1.50 GiB" and format_bytes(0) == "0 B"
    plan = plan_memory(BENCH, seq_len=4096, sequence_parallel_size=2, device_memory="64GiB")
    assert plan.fits is True and "fits" in plan.table()
    assert plan_memory(BENCH, seq_len=4096, sequence_parallel_size=2).fits is None
    assert plan_memory(BENCH, seq_len=4096, sequence_parallel_size=2, device_memory="64MiB").fits is False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "ring"}, "mode='ring' is unknown"),
        ({"offload": True}, "offload=True needs FPDT"),
        ({"precision": "8-true"}, "precision='8-true' is not supported"),
        ({"optimizer": "lion"}, "optimizer='lion' is unknown"),
        ({"data_parallel": "zero3"}, "data_parallel='zero3' is unknown"),
        ({"sequence_parallel_size": 0}, "sequence_parallel_size=0"),
        ({"seq_len": -1}, "seq_len=-1"),
        ({"mode": "fpdt", "fpdt_chunk_size": 0}, "fpdt_chunk_size=0"),
        ({"param_dtype": "int8"}, "param_dtype='int8' is unknown"),
        ({"device_memory": "lots"}, "'lots' is not a memory size"),
    ],
)
def test_bad_inputs_explain_themselves(kwargs, match):
    args = {"seq_len": 4096, "sequence_parallel_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_memory(BENCH, **args)


def test_config_must_say_its_model_type():
    with pytest.raises(ValueError, match="needs a 'model_type'"):
        plan_memory({"hidden_size": 64}, seq_len=1024, sequence_parallel_size=1)
    with pytest.raises(TypeError, match="transformers config or a dict"):
        plan_memory(42, seq_len=1024, sequence_parallel_size=1)


def test_cli_plans_the_8b_1m_config(capsys):
    assert (
        main(["plan", "--config", str(CONFIGS / "llama3_8b_1m_fpdt_8gpu.yaml"), "--device-memory", "141GB"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "LlamaForCausalLM (8.03B params), 1,048,576 tokens, sp 8 x dp 1, FPDT chunk 16,384 (8 per rank)"
        in out
    )
    assert "bf16-mixed, FSDP, activation checkpointing: 131,072 tokens per device" in out
    for row in (
        "weights",
        "optimizer state",
        "activations kept for backward",
        "loss working set",
        "total at peak",
    ):
        assert row in out
    assert "longest sequence within" in out


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_cli_plans_every_shipped_config(name, capsys):
    assert main(["plan", "--config", str(CONFIGS / name), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device_total"] > 0 and data["seq_len"] > 0


def test_cli_demo_config_and_overrides(capsys):
    assert (
        main(
            [
                "plan",
                "--config",
                str(CONFIGS / "demo_cpu.yaml"),
                "--seq-len",
                "4096",
                "--device-memory",
                "1GiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "4,096 tokens, sp 2 x dp 1, Ulysses, 32-true, DDP, micro batch 16" in out
    assert "device memory 1.00 GiB" in out and "longest sequence within 1.00 GiB per device" in out


def test_cli_refuses_what_it_cannot_plan(tmp_path, capsys):
    assert main(["plan", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  devices: auto\nmodel:\n  init_args:\n    model_config: {model_type: llama}\n")
    assert main(["plan", "--config", str(bad), "--seq-len", "1024"]) == 2
    assert "trainer.devices='auto'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Pinned numbers: plan_memory and longest_sequence over a broad grid, against tests/data/planner_grid.json
# ---------------------------------------------------------------------------------------------------

GRID = Path(__file__).resolve().parent / "data" / "planner_grid.json"
# the model shapes of the grid: GQA (TINY), MHA (BENCH), Llama-3-8B, heads that do not split over 8 ranks
# (uneven: kv expanded to all heads), a non-gated MLP and a final-logit soft-cap with head_dim != d / H
LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
             "tie_word_embeddings": False}  # fmt: skip
UNEVEN = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 192, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 4}  # fmt: skip
NON_GATED = {"model_type": "gpt_neox", "vocab_size": 50304, "hidden_size": 512, "intermediate_size": 2048,
             "num_hidden_layers": 4, "num_attention_heads": 8}  # fmt: skip
SOFTCAP = {"model_type": "gemma2", "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 1024,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 96}  # fmt: skip
GRID_MODELS: dict[str, dict] = {"tiny_gqa": TINY, "bench_mha": BENCH, "llama3_8b": LLAMA3_8B,
                                "qwen2_uneven_heads": UNEVEN, "gpt_neox_non_gated": NON_GATED,
                                "gemma2_softcap": SOFTCAP}  # fmt: skip


def _grid_points() -> list[tuple[str, dict]]:
    """``(model, plan_memory kwargs)``: a full cross of the layout flags on BENCH, then seeded random points
    over every argument and model. Only used to (re)write the JSON; the test reads the points from it."""
    import itertools
    import random

    points = []
    memory_modes = [("ulysses", False), ("fpdt", False), ("fpdt", True)]  # (mode, FPDT offload)
    checkpointing = [(False, False), (True, False), (True, True)]  # (activation checkpointing, offload)
    for (mode, offload), p, (ckpt, aoff), dp, precision in itertools.product(
        memory_modes, (1, 2, 4, 8), checkpointing, ("ddp", "fsdp"), ("32-true", "bf16-mixed")
    ):
        kw = {"seq_len": 65536, "sequence_parallel_size": p, "mode": mode, "offload": offload,
              "activation_checkpointing": ckpt, "activation_offload": aoff, "data_parallel": dp,
              "data_parallel_size": 2 if dp == "fsdp" else 1, "precision": precision}  # fmt: skip
        if mode == "fpdt":
            kw["fpdt_chunk_size"] = 2048
        points.append(("bench_mha", kw))
    rng = random.Random(19)
    precisions = ["32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
    for _ in range(180):
        mode, offload = rng.choice(memory_modes)
        kw = {
            "seq_len": rng.choice([4096, 10000, 32768, 65536, 131072, 262144, 1 << 20, 1 << 22, 1001]),
            "sequence_parallel_size": rng.choice([1, 2, 4, 8]),
            "data_parallel_size": rng.choice([1, 2, 4]),
            "mode": mode,
            "offload": offload,
            "activation_checkpointing": rng.random() < 0.5,
            "activation_offload": rng.random() < 0.3,  # also without the checkpointing flag: it implies it
            "data_parallel": rng.choice(["ddp", "fsdp"]),
            "micro_batch_size": rng.choice([1, 1, 2]),
            "precision": rng.choice(precisions),
            "optimizer": rng.choice(["adamw", "adamw", "adam", "sgd"]),
        }
        if kw["precision"] == "bf16-mixed" and rng.random() < 0.3:
            kw["param_dtype"] = "bfloat16"
        if mode == "fpdt":
            kw["fpdt_chunk_size"] = rng.choice([None, 1024, 3000, 16384])
            kw["loss_chunk_size"] = rng.choice([None, None, 512, 4096])
            kw["mlp_chunk_size"] = rng.choice([None, None, 1024, 8192])
        if rng.random() < 0.2:
            kw["device_memory"] = rng.choice(["80GiB", "141GB", "1GiB"])
        points.append((rng.choice(sorted(GRID_MODELS)), kw))
    return points


GRID_LONGEST = [  # (model, longest_sequence kwargs)
    ("bench_mha", {"device_memory": "1GiB", "sequence_parallel_size": 2, "mode": "fpdt", "fpdt_chunk_size": 1024}),
    ("bench_mha", {"device_memory": "4GiB", "sequence_parallel_size": 4}),
    ("tiny_gqa", {"device_memory": "512MiB", "sequence_parallel_size": 8, "mode": "fpdt", "offload": True,
                  "activation_offload": True}),
    ("llama3_8b", {"device_memory": "80GiB", "sequence_parallel_size": 8, "mode": "fpdt", "fpdt_chunk_size": 16384,
                   "precision": "bf16-mixed", "data_parallel": "fsdp", "activation_checkpointing": True}),
    ("llama3_8b", {"device_memory": "141GB", "sequence_parallel_size": 8, "data_parallel_size": 4, "mode": "fpdt",
                   "offload": True, "precision": "bf16-mixed", "data_parallel": "fsdp", "activation_offload": True}),
    ("llama3_8b", {"device_memory": "80GiB", "sequence_parallel_size": 4, "precision": "bf16-true",
                   "activation_checkpointing": True}),
]  # fmt: skip


def _grid_plan(plan: Any) -> dict:
    """Everything a plan says: every field and component (``to_dict``) and the table it prints."""
    return {**plan.to_dict(), "table": plan.table()}


def _compute_grid(plan_fn: Any, longest_fn: Any, points: list, longest: list) -> dict:
    configs = {}  # one config object per model: the shapes are cached by config

    def config(name: str) -> Any:
        if name not in configs:
            cfg = dict(GRID_MODELS[name])
            configs[name] = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        return configs[name]

    return {
        "plans": [
            {"model": m, "kwargs": kw, "plan": _grid_plan(plan_fn(config(m), **kw))} for m, kw in points
        ],
        "longest_sequence": [
            {"model": m, "kwargs": kw, "seq_len": longest_fn(config(m), **kw)} for m, kw in longest
        ],
    }


def write_grid(plan_fn: Any = plan_memory, longest_fn: Any = longest_sequence, path: Path = GRID) -> None:
    """(Re)write the pinned grid, one record per line (reviewable diffs)."""
    grid = {"models": GRID_MODELS, **_compute_grid(plan_fn, longest_fn, _grid_points(), GRID_LONGEST)}
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["{", f'"models": {json.dumps(grid["models"], sort_keys=True)},']
    for key in ("plans", "longest_sequence"):
        rows = [json.dumps(row, sort_keys=True) for row in grid[key]]
        lines.append(f'"{key}": [\n' + ",\n".join(rows) + "\n]" + ("," if key == "plans" else ""))
    path.write_text("\n".join([*lines, "}"]) + "\n")


def test_plans_are_pinned_to_the_grid():
    """Every number and line of text of a few hundred plans and of longest_sequence, exactly as pinned. A
    deliberate change of the model regenerates the file: ``python tests/test_planner.py`` (review its diff)."""
    pinned = json.loads(GRID.read_text())
    assert pinned["models"] == GRID_MODELS
    points = [(row["model"], row["kwargs"]) for row in pinned["plans"]]
    longest = [(row["model"], row["kwargs"]) for row in pinned["longest_sequence"]]
    assert len(points) >= 300 and len(longest) >= 5
    # through JSON as the pinned side went, so tuples compare as lists; ints (all of it) stay exact
    got = json.loads(
        json.dumps(_compute_grid(plan_memory, longest_sequence, points, longest), sort_keys=True)
    )
    for want, have in zip(pinned["plans"], got["plans"]):
        assert have == want, f"{want['model']} {want['kwargs']}"
    assert got["longest_sequence"] == pinned["longest_sequence"]


if __name__ == "__main__":
    write_grid()


def test_the_strategy_config_plans_through_one_mapping():
    """parallel_kwargs(resolved config) is what the strategy runs: "auto" settled once, the layout's dp x sp,
    checkpointing implied by activation offload; plan_memory takes it as it is."""
    from lightning_longctx.config import SequenceParallelConfig
    from lightning_longctx.planner import parallel_kwargs

    cfg = SequenceParallelConfig(fpdt_chunk_size=2048, offload="auto", activation_offload=True).resolve(
        world_size=16, devices_per_node=8, device_type="cuda"
    )
    kw = parallel_kwargs(cfg)
    assert kw["sequence_parallel_size"] == 8 and kw["data_parallel_size"] == 2 and kw["mode"] == "fpdt"
    assert (
        kw["offload"] is True and kw["activation_checkpointing"] is True and kw["activation_offload"] is True
    )
    config = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}  # fmt: skip
    assert plan_memory(config, seq_len=65536, **kw).to_dict() == plan_memory(
        config, seq_len=65536, sequence_parallel_size=8, data_parallel_size=2, mode="fpdt",
        fpdt_chunk_size=2048, offload=True, activation_offload=True,
    ).to_dict()  # fmt: skip
