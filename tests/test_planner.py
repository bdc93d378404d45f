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
    # the batch's position_ids and shift_labels are alive (planned) but not saved: autograd saves input_ids
    # (the embedding's indices) and the labels (the loss's targets)
    planned = plan["activations kept for backward"].largest - 2 * 8 * 256
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
def test_offloaded_bytes_are_the_planned_host_activations(case, monkeypatch):
    """What the host holds, at its peak in the forward and after it: FPDT's offloaded chunks of every layer
    without checkpointing; with checkpointing one layer's (the checkpoint drops them after each layer's
    forward, its recompute rebuilds them); with activation offload every layer's checkpointed input."""
    from lightning_longctx.attention import offload
    from lightning_longctx.integrations.transformers import enable_activation_checkpointing

    peak = [0]
    put = offload.ChunkStore.put

    def counting_put(self: Any, key: Any, x: torch.Tensor) -> None:
        put(self, key, x)
        peak[0] = max(peak[0], offload.offloaded_bytes())

    monkeypatch.setattr(offload.ChunkStore, "put", counting_put)
    mode, fpdt_offload, checkpointing, activation_offload = OFFLOAD_CASES[case]
    chunk = 64 if mode == "fpdt" else None
    model = _model(TINY)
    enable_sequence_parallel(model, mode=mode, chunk_size=chunk, offload=fpdt_offload)
    if checkpointing:
        enable_activation_checkpointing(model, offload=activation_offload)
    ids = torch.randint(0, TINY["vocab_size"], (1, 256))
    assert offload.offloaded_bytes() == 0
    loss = model(**shard_batch({"input_ids": ids, "labels": ids.clone()}, chunk_size=chunk)).loss
    plan = plan_memory(TINY, seq_len=256, sequence_parallel_size=1, mode=mode, fpdt_chunk_size=chunk,
                       offload=fpdt_offload, activation_checkpointing=checkpointing,
                       activation_offload=activation_offload)  # fmt: skip
    after_forward, peak_in_forward = offload.offloaded_bytes(), peak[0]
    loss.backward()
    assert offload.offloaded_bytes() == 0
    assert after_forward == plan.phase("loss forward")[1]
    assert peak_in_forward == plan.phase("layer forward")[1] > 0
    one_layer = 4 * (2 * 256 * 4 * 16 + 2 * 256 * 2 * 16 + 4 * 256)  # q, out, k, v, lse (fp32)
    if fpdt_offload and checkpointing:
        assert peak_in_forward - after_forward == one_layer  # one layer's chunks, not every layer's
    elif fpdt_offload:
        assert after_forward == TINY["num_hidden_layers"] * one_layer


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
    budgets = [2 << 30, 3 << 30, 5 << 30]
    found = [longest_sequence(BENCH, device_memory=b, **kw) for b in budgets]
    assert found == sorted(found) and found[0] > 0
    for n, budget in zip(found, budgets):
        assert n % 2048 == 0
        fits, over = (plan_memory(BENCH, seq_len=x, **kw) for x in (n, n + 2048))
        assert fits.device_needed <= budget < over.device_needed  # the peak plus its reserve
        assert fits.device_reserve == (1 << 30) + fits.device_total // 20  # CUDA context + 5 % slack
    assert longest_sequence(BENCH, device_memory="1GiB", **kw) == 0  # the CUDA context alone fills it
    assert longest_sequence(BENCH, device_memory="1GiB", device_reserve=0, **kw) > found[0]
    ulysses = longest_sequence(BENCH, device_memory="3GiB", sequence_parallel_size=2)
    assert 0 < ulysses < found[1] and ulysses % 2048 == 0


def test_fits_respects_device_and_host_and_names_the_binding_limit():
    assert parse_bytes("80GiB") == parse_bytes("80G") == 80 << 30
    assert (
        parse_bytes("141GB") == 141 * 10**9 and parse_bytes(512) == 512 and parse_bytes("1.5 MiB") == 3 << 19
    )
    assert parse_bytes("1.9TB") == 19 * 10**11
    assert format_bytes(3 << 29) == "1.50 GiB" and format_bytes(0) == "0 B"
    kw = {"seq_len": 65536, "sequence_parallel_size": 2, "mode": "fpdt", "fpdt_chunk_size": 1024,
          "offload": True, "activation_offload": True}  # fmt: skip
    plan = plan_memory(BENCH, device_memory="64GiB", **kw)
    assert plan.fits is True and plan.binding == "device" and "fits" in plan.table()
    assert plan_memory(BENCH, **kw).fits is None and plan_memory(BENCH, **kw).binding is None
    assert plan_memory(BENCH, device_memory="64MiB", **kw).fits is False
    # the host: devices_per_host ranks' host peak plus each one's process (4 GiB by default)
    assert plan.devices_per_host == 2 and plan.host_needed == 2 * (plan.host_total + (4 << 30))
    tight = plan_memory(BENCH, device_memory="64GiB", host_memory="8GiB", **kw)
    assert tight.fits is False and tight.binding == "host"
    table = tight.table()
    assert "host memory 8.00 GiB per host of 2 devices" in table and "binding limit: host" in table
    eight = plan_memory(BENCH, devices_per_host=8, host_reserve=0, host_memory="1TiB", **kw)
    assert eight.host_needed == 8 * eight.host_total and eight.fits is True and eight.binding == "host"
    assert plan_memory(BENCH, device_reserve="2GiB", **kw).device_needed == plan.device_total + (2 << 30)
    # longest_sequence honours the host too: a small host budget binds first
    search = {k: v for k, v in kw.items() if k != "seq_len"}
    free = longest_sequence(BENCH, device_memory="64GiB", **search)
    host_bound = longest_sequence(BENCH, device_memory="64GiB", host_memory="10GiB", **search)
    assert 0 < host_bound < free


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
    assert (
        "bf16-mixed, FSDP, MixedPrecisionPolicy (16-bit compute params, fp32 reduce), activation checkpointing: "
        "131,072 tokens per device" in out
    )
    for row in (
        "weights",
        "optimizer state",
        "activations kept for backward",
        "loss working set",
        "total at peak",
    ):
        assert row in out
    assert "longest sequence within" in out
    assert main(["plan", "--config", str(CONFIGS / "llama3_8b_500k_1gpu.yaml"), "--device-memory", "80GiB",
                 "--host-memory", "1TB"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "cpu_offload" in out and "host memory 931.32 GiB per host of 1 devices: needs" in out
    assert "longest sequence within 80.00 GiB per device and 931.32 GiB per host: 950,272 tokens" in out


#: every shipped GPU config and the GPU (and host) its header names
GPU_CONFIGS = {
    "llama3_8b_1m_fpdt_8gpu.yaml": ["--device-memory", "80GiB"],  # "80 GB+ each, e.g. H100/H200"
    "llama3_8b_4node_slurm.yaml": ["--device-memory", "80GiB"],
    "llama3_8b_500k_1gpu.yaml": ["--device-memory", "80GiB", "--host-memory", "1TB"],
    "qwen3_8b_512k_yarn_8gpu.yaml": ["--device-memory", "80GiB"],  # "8 x H100 80 GB"
}
#: the config.json of each pretrained model a shipped config names (``pretrained_path``), as published: the
#: configs are planned from it alone (``plan --pretrained-path``), no weights
PRETRAINED = {
    "/models/Qwen3-8B": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
                         "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
                         "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
                         "bos_token_id": 151643, "eos_token_id": 151645},
}  # fmt: skip


@pytest.fixture(scope="module")
def pretrained_folders(tmp_path_factory) -> dict[str, Path]:
    """A folder holding only the ``config.json`` of each model in ``PRETRAINED``."""
    folders = {}
    for path, shape in PRETRAINED.items():
        cfg = dict(shape)
        folders[path] = tmp_path_factory.mktemp(Path(path).name)
        AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(folders[path])
    return folders


def _plan_argv(name: str, folders: dict[str, Path]) -> list[str]:
    """``lightning-longctx plan`` of a shipped config, its ``pretrained_path`` read from ``folders``."""
    import yaml

    path = CONFIGS / name
    pretrained = yaml.safe_load(path.read_text())["model"]["init_args"].get("pretrained_path")
    return [
        "plan",
        "--config",
        str(path),
        *(["--pretrained-path", str(folders[pretrained])] if pretrained else []),
    ]


def test_every_gpu_config_is_listed_with_its_gpu():
    gpu = {p.name for p in CONFIGS.glob("*.yaml") if "accelerator: gpu" in p.read_text()}
    assert gpu == set(GPU_CONFIGS)


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_every_gpu_config_fits_its_gpu_with_fp32_master_weights(name, capsys, pretrained_folders):
    """Planned against the GPU its header names, each GPU config fits, with fp32 master weights, and its
    comments quote the plan's figures: the peak and the need per GPU, the host's need, the longest sequence."""
    assert main([*_plan_argv(name, pretrained_folders), *GPU_CONFIGS[name], "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"], (name, plan["device_needed"], plan["host_needed"])
    # bf16-mixed over fp32 parameters: fp32 master weights and AdamW state (a bf16 model dtype would round
    # most updates of a fine-tune away)
    assert plan["precision"] == "bf16-mixed" and plan["param_bytes"] == 4 and plan["mp_policy"], plan
    text = (CONFIGS / name).read_text()
    figures = [format_bytes(plan[k]) for k in ("device_total", "device_needed", "host_needed")]
    for figure in [*figures, f"{plan['longest_seq_len']:,} tokens"]:
        assert figure in text, f"{name}: its comments do not quote the plan's {figure}"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_cli_plans_every_shipped_config(name, capsys, pretrained_folders):
    assert main([*_plan_argv(name, pretrained_folders), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device_total"] > 0 and data["seq_len"] > 0


def test_the_qwen3_config_extends_the_context_with_yarn_to_its_sequence(pretrained_folders):
    """The planned (and trained) model is Qwen3-8B with the config's YaRN scaling: its RoPE covers exactly the
    sequence (factor x the pretraining length), rope_theta kept from the model's config."""
    import yaml

    from lightning_longctx.cli.plan import plan_kwargs_from_config
    from lightning_longctx.integrations.rope import rope_limit

    config = yaml.safe_load((CONFIGS / "qwen3_8b_512k_yarn_8gpu.yaml").read_text())
    folder = pretrained_folders[config["model"]["init_args"]["pretrained_path"]]
    model, kwargs, _ = plan_kwargs_from_config(config, pretrained_path=str(folder))
    rope = model.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("yarn", 16.0, 1000000.0)
    limit = rope_limit(model)
    assert limit.limit == model.max_position_embeddings == kwargs["seq_len"] == 524288
    assert limit.original * rope["factor"] == kwargs["seq_len"]


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
    parallel = [("ddp", False), ("fsdp", False), ("fsdp", True)]  # (data parallel, cpu_offload)
    for (mode, offload), p, (ckpt, aoff), (dp, cpu_offload), precision in itertools.product(
        memory_modes, (1, 2, 4, 8), checkpointing, parallel, ("32-true", "bf16-mixed")
    ):
        kw = {"seq_len": 65536, "sequence_parallel_size": p, "mode": mode, "offload": offload,
              "activation_checkpointing": ckpt, "activation_offload": aoff, "data_parallel": dp,
              "data_parallel_size": 2 if dp == "fsdp" else 1, "precision": precision}  # fmt: skip
        if cpu_offload:
            kw["cpu_offload"] = True
        if mode == "fpdt":
            kw["fpdt_chunk_size"] = 2048
        points.append(("bench_mha", kw))
    rng = random.Random(19)
    more = random.Random(20)  # the settings added later: the points above keep their draws
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
        if kw["data_parallel"] == "fsdp" and more.random() < 0.4:
            kw["cpu_offload"] = True
        if more.random() < 0.15:
            kw["lora_rank"] = more.choice([4, 16, 64])
        if more.random() < 0.25:
            kw["host_memory"] = more.choice(["64GiB", "1TB", "1.9TB"])
            kw["devices_per_host"] = more.choice([1, 4, 8])
        if more.random() < 0.15:
            kw["device_reserve"] = more.choice([0, "2GiB"])
        model = rng.choice(sorted(GRID_MODELS))
        points.append((model, kw))
    return points


GRID_LONGEST = [  # (model, longest_sequence kwargs)
    ("bench_mha", {"device_memory": "1GiB", "device_reserve": 0, "sequence_parallel_size": 2, "mode": "fpdt",
                   "fpdt_chunk_size": 1024}),
    ("bench_mha", {"device_memory": "4GiB", "sequence_parallel_size": 4}),
    ("tiny_gqa", {"device_memory": "512MiB", "device_reserve": "16MiB", "sequence_parallel_size": 8, "mode": "fpdt", "offload": True,
                  "activation_offload": True}),
    ("llama3_8b", {"device_memory": "80GiB", "sequence_parallel_size": 8, "mode": "fpdt", "fpdt_chunk_size": 16384,
                   "precision": "bf16-mixed", "data_parallel": "fsdp", "activation_checkpointing": True}),
    ("llama3_8b", {"device_memory": "141GB", "sequence_parallel_size": 8, "data_parallel_size": 4, "mode": "fpdt",
                   "offload": True, "precision": "bf16-mixed", "data_parallel": "fsdp", "activation_offload": True}),
    ("llama3_8b", {"device_memory": "80GiB", "sequence_parallel_size": 4, "precision": "bf16-true",
                   "activation_checkpointing": True}),
    ("llama3_8b", {"device_memory": "80GiB", "host_memory": "1TB", "sequence_parallel_size": 1, "mode": "fpdt",
                   "fpdt_chunk_size": 16384, "offload": True, "activation_offload": True, "data_parallel": "fsdp",
                   "cpu_offload": True, "precision": "bf16-mixed"}),
    ("llama3_8b", {"device_memory": "80GiB", "host_memory": "1.9TB", "devices_per_host": 8,
                   "sequence_parallel_size": 8, "mode": "fpdt", "fpdt_chunk_size": 16384, "offload": True,
                   "activation_offload": True, "data_parallel": "fsdp", "precision": "bf16-mixed", "lora_rank": 16}),
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


# ---------------------------------------------------------------------------------------------------
# The frontier: state offload, FSDP2's mixed precision, LoRA, the leaner recompute, the published points
# ---------------------------------------------------------------------------------------------------


def _layer_saved_bytes(tile_norms: bool, config: dict = TINY) -> tuple[int, int]:
    """(bytes decoder layer 0 saves for backward on the device, its tokens): a bf16 Llama in FPDT mode with
    offload (the attention chunks go to the host: left out), the layer's input left out (under
    checkpointing the checkpoint holds it), each storage counted once."""
    from lightning_longctx.attention import offload
    from lightning_longctx.ops.tiling import untile_mlp_

    torch.manual_seed(0)
    model = _model(config).to(torch.bfloat16)
    enable_sequence_parallel(model, mode="fpdt", chunk_size=64, offload=True)
    if not tile_norms:
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                untile_mlp_(m)
    host: set[int] = set()
    put = offload.ChunkStore.put

    def recording_put(self: Any, key: Any, x: torch.Tensor) -> None:
        put(self, key, x)
        host.add(self._data[key].untyped_storage().data_ptr())

    layer, seen, recording = model.model.layers[0], {}, [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if recording[0]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def start(module: Any, args: Any, kwargs: Any) -> None:
        recording[0] = True  # its inputs (hidden states, RoPE tables) are not its own
        tensors = [*args, *kwargs.values(), *kwargs.get("position_embeddings", ())]
        inputs.update(t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor))

    inputs: set[int] = set()
    handles = [layer.register_forward_pre_hook(start, with_kwargs=True),
               layer.register_forward_hook(lambda *a: recording.__setitem__(0, False))]  # fmt: skip
    ids = torch.randint(0, config["vocab_size"], (1, 256))
    offload.ChunkStore.put = recording_put
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**shard_batch({"input_ids": ids, "labels": ids.clone()}, chunk_size=64))
    finally:
        offload.ChunkStore.put = put
        for h in handles:
            h.remove()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in host | params | inputs), 256


def test_the_recomputed_layer_keeps_under_half_the_bytes_per_token():
    """Measured on CPU (bf16, the hidden size is the attention width as in Llama-3-8B): what one decoder layer
    saves for backward per token, which is what its recompute holds, drops from 18 to 8 bytes per hidden unit
    (72 to 32 KiB per token at hidden 4096) with FPDT's tiled norms; the planner says the same."""
    tiled, tokens = _layer_saved_bytes(tile_norms=True)
    untiled, _ = _layer_saved_bytes(tile_norms=False)
    d = TINY["hidden_size"]
    assert untiled == pytest.approx(18 * d * tokens, rel=0.02)  # HF's two norms: fp32 input + normed, each
    assert tiled == 8 * d * tokens
    assert 1 - tiled / untiled >= 0.30
    plan = plan_memory(TINY, seq_len=256, sequence_parallel_size=1, mode="fpdt", fpdt_chunk_size=64,
                       offload=True, activation_checkpointing=True, precision="bf16-true")  # fmt: skip
    assert plan["layer recompute (checkpointing)"].largest == tiled
    big = plan_memory(LLAMA3_8B, seq_len=1 << 21, sequence_parallel_size=4, mode="fpdt", fpdt_chunk_size=16384,
                      offload=True, activation_offload=True, precision="bf16-true")  # fmt: skip
    assert big["layer recompute (checkpointing)"].largest == 32 * 1024 * big.tokens_per_device  # was 72 KiB


def test_cpu_offload_puts_the_model_state_on_the_host():
    kw = {"seq_len": 65536, "sequence_parallel_size": 2, "data_parallel_size": 2, "data_parallel": "fsdp",
          "mode": "fpdt", "fpdt_chunk_size": 1024, "activation_checkpointing": True}  # fmt: skip
    on, off = plan_memory(BENCH, cpu_offload=True, **kw), plan_memory(BENCH, **kw)
    for row in ("weights", "optimizer state"):
        assert on[row].device == 0 and on[row].host == off[row].largest > 0  # AdamW's step temporary too
    assert on["gradients"].largest == 0 and on.phase("optimizer step")[1] > 0
    assert on.device_total < off.device_total and on.between_steps == off.between_steps
    assert on["FSDP unsharded params/grads"].largest == off["FSDP unsharded params/grads"].largest
    with pytest.raises(ValueError, match=r"cpu_offload=True with data_parallel='ddp'.*data_parallel='fsdp'"):
        plan_memory(BENCH, seq_len=4096, sequence_parallel_size=2, cpu_offload=True)


def test_fsdp_mixed_precision_computes_in_bf16_over_fp32_master_weights():
    """fsdp + bf16-mixed: fp32 weights, gradients and AdamW state (sharded), bf16 blocks in flight and a bf16
    residual stream: the activations of a model built in bf16 under autocast; no autocast weight copies."""
    kw = {"seq_len": 65536, "sequence_parallel_size": 2, "data_parallel": "fsdp", "mode": "fpdt",
          "fpdt_chunk_size": 1024, "activation_checkpointing": True, "precision": "bf16-mixed"}  # fmt: skip
    mp = plan_memory(BENCH, **kw)
    ddp = plan_memory(BENCH, **{**kw, "data_parallel": "ddp"})
    bf16_built = plan_memory(BENCH, param_dtype="bfloat16", **kw)
    assert mp.mp_policy and bf16_built.mp_policy and not ddp.mp_policy  # the policy also over bf16 weights
    assert mp["weights"].largest == 2 * bf16_built["weights"].largest  # fp32 master weights
    assert mp["activations kept for backward"].largest == bf16_built["activations kept for backward"].largest
    assert "autocast weight copies" not in [c.name for c in mp.components]
    assert mp["activations kept for backward"].largest < ddp["activations kept for backward"].largest
    assert "MixedPrecisionPolicy" in mp.describe()


def test_lora_trains_only_the_adapters():
    """Frozen base weights carry no gradient or optimizer state; the adapter count is peft's."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(TINY), LoraConfig(r=8, target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in _model(TINY).parameters())
    kw = {"seq_len": 4096, "sequence_parallel_size": 2}
    lora, full = plan_memory(TINY, lora_rank=8, **kw), plan_memory(TINY, **kw)
    assert lora.trainable_params == trainable and full.trainable_params == base
    assert lora["weights"].largest == 4 * (base + trainable)
    assert lora["DDP gradient buckets"].largest == 4 * trainable
    assert lora["optimizer state"].device == 2 * 4 * trainable
    assert lora["activations kept for backward"].largest == full["activations kept for backward"].largest
    qv = plan_memory(TINY, lora_rank=8, lora_targets=("q_proj", "v_proj"), **kw)
    q = get_peft_model(_model(TINY), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    assert qv.trainable_params == sum(p.numel() for p in q.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match=r"lora_targets=\('qproj',\).*'qproj'.*q_proj"):
        plan_memory(TINY, lora_rank=8, lora_targets=("qproj",), **kw)


def test_lora_under_tensor_parallelism_counts_each_ranks_adapter_halves():
    """With tp the adapters are split as the strategy splits them (tensor_parallel._through_adapters): B of
    a column-wise layer and A of a row-wise one per rank; the count equals the real plan's local shards."""
    from peft import LoraConfig, get_peft_model

    from lightning_longctx.parallel.tensor_parallel import check_tp

    tp = 2
    model = get_peft_model(_model(TINY), LoraConfig(r=8, target_modules="all-linear"))
    inner = model.base_model.model
    plan = check_tp(inner, tp)
    local = 0
    for name, p in inner.base_model.named_parameters():
        if not p.requires_grad:
            continue
        style = plan.get(name)
        dim = {"colwise": 0, "rowwise": p.dim() - 1}.get(style)
        local += p.numel() if dim is None else p.numel() // p.shape[dim] * -(-p.shape[dim] // tp)
    kw = {"seq_len": 4096, "sequence_parallel_size": 2, "data_parallel": "fsdp", "lora_rank": 8}
    plan_tp = plan_memory(TINY, tensor_parallel_size=tp, **kw)
    assert plan_tp.trainable_params == local < plan_memory(TINY, **kw).trainable_params


def _frontier() -> Any:
    """benchmarks/bench_frontier.py: the published points and our settings for them (one list, printed there);
    its module level imports nothing of the benchmarks' harness."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_frontier", ROOT / "benchmarks" / "bench_frontier.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("index", range(6))
def test_the_published_frontier_fits(index):
    """Every published point fits by the plan with our features on, the reserve included; the stretch point
    (2M on 4 x 40 GB) does not yet, and says the device binds."""
    frontier = _frontier()
    assert len(frontier.FRONTIER) == 6 and frontier.LLAMA3_8B == LLAMA3_8B
    point = frontier.FRONTIER[index]
    plan = plan_memory(LLAMA3_8B, seq_len=point[1], **frontier.frontier_kwargs(point))
    assert plan.device_reserve > 1 << 30  # the CUDA context and the allocator's slack are in
    if "stretch" in point[0]:
        assert plan.fits is False and plan.binding == "device"
    else:
        assert plan.fits, plan.table()


# ---------------------------------------------------------------------------------------------------
# Tensor parallelism: the plan's shards, the activations per head and of the MLP / tp, the refusals
# ---------------------------------------------------------------------------------------------------


def _tp_local_numel(name: str, p: torch.Tensor, style: str | None, tp: int) -> int:
    """One rank's elements of a parameter under a plan style (transformers' ``shard_param``): column-wise the
    output dim (dim 1 of a 3-D expert tensor), row-wise the last dim (its bias replicated), else whole."""
    if style in ("colwise", "packed_colwise"):
        dim = 1 if p.dim() == 3 else 0
    elif style == "rowwise" and not name.endswith("bias"):
        dim = p.dim() - 1
    else:
        return p.numel()
    return p.numel() // p.shape[dim] * -(-p.shape[dim] // tp)


def _tp_local_counts(model: torch.nn.Module, tp: int, vocab_parallel: bool) -> tuple[int, int, int]:
    """(all, block 0, outside the blocks) elements one tp rank holds: the model's concrete plan applied by rule,
    the lm_head over the vocabulary when vocabulary parallel (tensor_parallel.vocab_parallel_head)."""
    from lightning_longctx.parallel.tensor_parallel import tp_plan_of, vocab_parallel_head

    plan = tp_plan_of(model)
    local = {
        f"model.{n}": _tp_local_numel(n, p, plan.get(n), tp) for n, p in model.base_model.named_parameters()
    }
    head = vocab_parallel_head(model, tp) if vocab_parallel else None
    for n, p in model.named_parameters():
        if n not in local:
            local[n] = p.numel() // tp if head is not None and n.startswith(f"{head}.") else p.numel()
    block = sum(v for n, v in local.items() if n.startswith("model.layers.0."))
    root = sum(v for n, v in local.items() if not n.startswith("model.layers."))
    return sum(local.values()), block, root


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["fpdt", "ulysses"])
def test_tensor_parallel_state_is_the_plans_local_shards(arch, mode):
    """Per-rank parameters, gradients, AdamW state and FSDP's unsharded blocks at tp = 2 are the local shards
    of the model's own plan (q/k/v/gate/up column-wise, o/down row-wise; norms, Qwen3's q/k norms and the
    embedding whole; the untied lm_head over the vocabulary in FPDT mode only), then / (dp * sp) by FSDP."""
    from helpers.hf_models import tiny_config, tiny_model

    model, config = tiny_model(arch), tiny_config(arch)
    local, block, root = _tp_local_counts(model, 2, vocab_parallel=mode == "fpdt")
    chunk = 64 if mode == "fpdt" else None
    for sp in (1, 2):
        plan = plan_memory(config, seq_len=256, sequence_parallel_size=sp, tensor_parallel_size=2,
                           data_parallel="fsdp", mode=mode, fpdt_chunk_size=chunk)  # fmt: skip
        assert plan.local_params == local < plan.params == sum(p.numel() for p in model.parameters())
        assert plan.vocab_parallel is (mode == "fpdt") and plan.tensor_parallel_size == 2
        assert plan["weights"].largest == plan["gradients"].largest == -(-local // sp) * 4
        assert plan["optimizer state"].device == 2 * -(-local // sp) * 4
        # backward: the root and two blocks unsharded, one block's and the root's gradients (fp32, 32-true)
        assert plan["FSDP unsharded params/grads"].largest == 4 * (root + 2 * block) + 4 * (2 * block + root)
    if arch == "llama" and mode == "fpdt":  # the real plan applied on a 2-rank fake process group said so
        assert local == 10912


def test_tensor_parallel_counts_mixtrals_experts_as_its_plan_splits_them():
    """Mixtral: the router (``mlp.gate``) and norms whole; the experts as the model's own plan says. Up to
    transformers 5.24 the plan splits the packed gate/up column-wise and down row-wise; from 5.25 it leaves the
    experts to an expert-parallel plan, so under tensor parallelism they stay whole (FSDP still shards them).
    (plan_memory itself does not plan mixture-of-experts configs: their dims; this is its parameter count.)"""
    from helpers.hf_models import tiny_config, tiny_model
    from lightning_longctx.planner.shapes import _count_params, _TPSplit

    model = tiny_model("mixtral")
    total, block, root, _, _, split = _count_params(tiny_config("mixtral"))
    local, local_block, local_root = _tp_local_counts(model, 2, vocab_parallel=True)
    assert total == sum(p.numel() for p in model.parameters())
    assert total - _TPSplit.removed(split.blocks, 2) - split.head // 2 == local
    assert block - _TPSplit.removed(split.block, 2) == local_block
    assert root - split.head // 2 == local_root
    experts = model.model.layers[0].mlp.experts
    whole_experts = sum(p.numel() for p in experts.parameters()) * len(model.model.layers)
    if any("experts" in k for k in type(model.config).base_model_tp_plan):
        assert "moe_tp_experts" in split.styles and "packed_colwise" in split.styles
        assert local == 24992  # the real plan applied on a 2-rank fake process group said so
    else:
        assert not {"moe_tp_experts", "packed_colwise"} & set(split.styles)
        assert local - whole_experts == 24992 - whole_experts // 2  # the same count, its experts whole


def _tp_pair(config: dict, **kw: Any) -> tuple[Any, Any]:
    base = {"seq_len": 4096, "sequence_parallel_size": 1, "data_parallel": "fsdp", **kw}
    return plan_memory(config, tensor_parallel_size=1, **base), plan_memory(
        config, tensor_parallel_size=2, **base
    )


@pytest.mark.parametrize("mode", ["ulysses", "fpdt"])
def test_tensor_parallel_halves_exactly_the_per_head_and_mlp_activations(mode):
    """The planner's breakdown at tp = 2 against tp = 1: every layer's saved q/k/v/out, lse and o_proj input
    (and, without FPDT's tiled MLP, its gate/act/up/act*up) halve; the residual stream, the norms and the
    MLP's input do not. The all-to-all buffers halve."""
    d, h, kv, inter, layers = (BENCH[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                  "intermediate_size", "num_hidden_layers"))  # fmt: skip
    hd, n = d // h, 4096
    kw = {"mode": mode, "fpdt_chunk_size": 1024 if mode == "fpdt" else None}
    one, two = _tp_pair(BENCH, **kw)  # 32-true: 4 bytes everywhere, P = 1: no kv replication
    per_head = (2 * h + 2 * kv) * hd * 4 + 4 * h + h * hd * 4  # q, out, k, v; lse; o_proj input
    mlp = 0 if mode == "fpdt" else 4 * inter * 4  # gate, act, up, act*up
    acts = "activations kept for backward"
    assert one[acts].largest - two[acts].largest == layers * n * (per_head + mlp) // 2
    assert one["all-to-all buffers"].largest == 2 * two["all-to-all buffers"].largest
    ckpt_one, ckpt_two = _tp_pair(BENCH, activation_checkpointing=True, **kw)
    assert ckpt_one[acts].largest == ckpt_two[acts].largest  # checkpointed layer inputs: hidden width


def test_the_recomputed_tp_layer_saves_what_a_tp_local_layer_saves():
    """One decoder layer's saved tensors (exact, measured as above) of a layer with one TP rank's shapes: heads,
    kv heads and intermediate width / 2, head_dim and hidden size kept (what the plan leaves a rank; its
    all-reduces save nothing). Needs no processes; the planner at tp = 2 says the same bytes."""
    tp_local = {
        **TINY,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 80,
        "head_dim": 16,
    }
    saved, tokens = _layer_saved_bytes(tile_norms=True, config=tp_local)
    plan = plan_memory(TINY, seq_len=256, sequence_parallel_size=1, tensor_parallel_size=2, data_parallel="fsdp",
                       mode="fpdt", fpdt_chunk_size=64, offload=True, activation_checkpointing=True,
                       precision="bf16-true")  # fmt: skip
    assert plan["layer recompute (checkpointing)"].largest == saved
    d = TINY["hidden_size"]
    assert saved == (8 * d - 2 * d // 2) * tokens  # the o_proj input (hidden width in TINY) halves


def test_fpdt_loss_is_vocabulary_parallel_with_an_fp32_hidden_gradient():
    """FPDT + tp: (chunk, V / tp) logits blocks, a (V / tp, H) fp32 head gradient, the hidden states' gradient in
    fp32 during the loss backward; the default chunk covers the local rows. Ulysses keeps the full logits."""
    kw = {"mode": "fpdt", "fpdt_chunk_size": 1024, "loss_chunk_size": 512, "precision": "bf16-mixed"}
    one, two = _tp_pair(BENCH, **kw)  # the MixedPrecisionPolicy: bf16 hidden states
    d, v, t = BENCH["hidden_size"], BENCH["vocab_size"], 4096
    # fp32 block, bf16 gradient copy; the fp32 accumulator + the bf16 cast of the head; the hidden gradient
    want_one = 512 * v * (4 + 2) + d * v * (4 + 2) + d * t * 2
    want_two = 512 * (v // 2) * (4 + 2) + d * (v // 2) * (4 + 2) + d * t * 4
    assert one["loss working set"].largest == want_one and two["loss working set"].largest == want_two
    assert (
        two.vocab_parallel and "(512 x 16,000) blocks (vocabulary parallel)" in two["loss working set"].note
    )
    assert two.loss_chunk_size == 512
    default = plan_memory(BENCH, seq_len=4096, sequence_parallel_size=1, tensor_parallel_size=2,
                          data_parallel="fsdp", mode="fpdt", fpdt_chunk_size=1024)  # fmt: skip
    assert default.loss_chunk_size == 2048  # 128 MiB of fp32 (chunk, 16000) blocks, a multiple of 64
    uly_one, uly_two = _tp_pair(BENCH)
    assert (
        not uly_two.vocab_parallel
        and uly_one["loss working set"].largest == uly_two["loss working set"].largest
    )
    tied = {**BENCH, "tie_word_embeddings": True}
    assert not _tp_pair(tied, **kw)[1].vocab_parallel  # tied to the embedding: replicated


def test_parallel_kwargs_plans_tensor_parallelism_and_the_refusals_name_the_rule():
    from lightning_longctx.config import SequenceParallelConfig
    from lightning_longctx.planner import parallel_kwargs

    cfg = SequenceParallelConfig(tensor_parallel_size=2, data_parallel="fsdp", fpdt_chunk_size=1024).resolve(
        world_size=8, devices_per_node=8, device_type="cpu"
    )
    kw = parallel_kwargs(cfg)
    assert (
        kw["tensor_parallel_size"] == 2
        and kw["sequence_parallel_size"] == 4
        and kw["data_parallel_size"] == 1
    )
    plan = plan_memory(BENCH, seq_len=16384, **kw)
    assert plan.tensor_parallel_size == 2 and "sp 4 x tp 2 x dp 1" in plan.table()
    assert plan.to_dict()["tensor_parallel_size"] == 2 and plan.devices_per_host == 8
    base = {"seq_len": 4096, "sequence_parallel_size": 2, "tensor_parallel_size": 2}
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 with data_parallel='ddp'.*data_parallel='fsdp'"
    ):
        plan_memory(BENCH, **base)
    with pytest.raises(
        ValueError, match=r"must divide LlamaForCausalLM's attention heads \(4\) and key/value heads \(2\)"
    ):
        plan_memory(TINY, **{**base, "tensor_parallel_size": 4}, data_parallel="fsdp")
    # GPT-NeoX's row-split embedding is an accepted style (benchmarks/tp_sweep.py); the planner keeps it whole
    assert plan_memory(NON_GATED, **base, data_parallel="fsdp").tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        plan_memory(BENCH, **{**base, "tensor_parallel_size": 0}, data_parallel="fsdp")


def test_cli_plans_a_tensor_parallel_config(tmp_path, capsys):
    """``lightning-longctx plan`` on a config whose strategy sets ``tensor_parallel_size`` (through
    parallel_kwargs: no CLI flag, as for sp)."""
    import yaml

    config = {
        "trainer": {"accelerator": "gpu", "devices": 8, "precision": "bf16-mixed",
                    "strategy": {"class_path": "lightning_longctx.UlyssesFPDTStrategy",
                                 "init_args": {"tensor_parallel_size": 2, "data_parallel": "fsdp",
                                               "fpdt_chunk_size": 16384, "activation_checkpointing": True}}},
        "model": {"init_args": {"model_config": LLAMA3_8B}},
        "data": {"init_args": {"seq_len": 1 << 20}},
    }  # fmt: skip
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["plan", "--config", str(path), "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert (
        "1,048,576 tokens, sp 4 x tp 2 x dp 1, FPDT chunk 16,384" in out and "vocab-parallel lm_head" in out
    )
    assert "longest sequence within 80.00 GiB per device" in out
    assert main(["plan", "--config", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["tensor_parallel_size"] == 2 and data["sequence_parallel_size"] == 4 and data["vocab_parallel"]
    )


def test_tensor_parallelism_lengthens_the_8b_sequence():
    """Llama-3-8B on 80 GiB devices (FSDP, bf16-mixed, FPDT chunk 16K, checkpointing): at the same sp, tp = 2
    and 4 fit longer sequences (the per-head and MLP activations and the state / tp), pinned."""
    kw = {"device_memory": "80GiB", "sequence_parallel_size": 4, "mode": "fpdt", "fpdt_chunk_size": 16384,
          "precision": "bf16-mixed", "data_parallel": "fsdp", "activation_checkpointing": True}  # fmt: skip
    found = {tp: longest_sequence(LLAMA3_8B, tensor_parallel_size=tp, **kw) for tp in (1, 2, 4)}
    assert found == {1: 524288, 2: 720896, 4: 851968}
    assert found[1] <= found[2] <= found[4]


# ---- hybrid models: gated DeltaNet and Mamba-2 layers ----

GDN_TINY = {"model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]}  # fmt: skip
MAMBA2_TINY = {"model_type": "mamba2", "vocab_size": 1000, "hidden_size": 16, "num_hidden_layers": 2,
               "num_heads": 4, "head_dim": 8, "state_size": 32, "n_groups": 2, "expand": 2, "chunk_size": 64}  # fmt: skip


def _mixer_saved_bytes(module: torch.nn.Module, x: torch.Tensor, autocast: bool) -> int:
    """Bytes of the distinct storages one mixer forward saves for backward, but its input and parameters."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            module(x)
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2"])
def test_recurrent_mixers_save_what_the_formula_says(kind, precision):
    """The per-token formula of a GDN / Mamba-2 layer (HF's torch fallbacks: fp32 chunk matrices and chunk
    states) against the bytes autograd saves in one mixer forward, at two lengths (linear in the length)."""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from lightning_longctx.planner.shapes import _blocks_of, _gdn_dims, _mamba2_dims
    from lightning_longctx.planner.terms import _gdn_token_bytes, _mamba2_token_bytes

    cfg = dict(GDN_TINY if kind == "gated_deltanet" else MAMBA2_TINY)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    assert {k for b in _blocks_of(config) for k in b.mixers} <= {kind, "attention"}
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    autocast = precision == "bf16-mixed"
    m, pw = (4, 4) if precision == "32-true" else (2, 2 if precision == "bf16-true" else 4)
    torch.manual_seed(0)
    if kind == "gated_deltanet":
        module = Qwen3_5GatedDeltaNet(config, 0).to(dtype)
        # under autocast each of in_proj_qkv, z, b, a keeps its own bf16 copy of the input
        per_token = _gdn_token_bytes(_gdn_dims(config), m, pw, autocast, adapter=False)
        per_token += 4 * config.hidden_size * m if autocast else 0
    else:
        module = Mamba2Mixer(config, 0).to(dtype)
        per_token = _mamba2_token_bytes(_mamba2_dims(config), m, autocast, adapter=False)
        per_token += config.hidden_size * m if autocast else 0
    for n in (256, 512):
        x = (
            torch.randn(1, n, config.hidden_size, dtype=dtype, requires_grad=True) * 1.0
        )  # not a leaf: no cast cache
        assert per_token * n == pytest.approx(_mixer_saved_bytes(module, x, autocast), rel=0.1)


def test_hybrid_layers_are_planned_by_kind():
    """Qwen3.5 (3 GDN layers, 1 attention layer): the GDN layers save their own bytes, not attention's; the
    all-to-all is the attention layers' only; the state exchange is one fp32 [M | B] per rank."""
    from lightning_longctx.planner.shapes import _gdn_dims
    from lightning_longctx.planner.terms import _gdn_token_bytes

    P, n = 2, 1024
    hybrid = plan_memory(GDN_TINY, seq_len=n, sequence_parallel_size=P)
    attention = plan_memory(
        {**GDN_TINY, "layer_types": ["full_attention"] * 4}, seq_len=n, sequence_parallel_size=P
    )
    cfg = dict(GDN_TINY)
    g = _gdn_dims(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    t, d = n // P, GDN_TINY["hidden_size"]
    gdn_layer = t * (d * 4 + _gdn_token_bytes(g, 4, 4, False, adapter=True))  # fp32: one projections' input
    hd, heads, kv = 16, 4, 2
    attention_layer = (
        t * d * 4 + 4 * (2 * heads + 2 * kv) // P * hd * n + 4 * heads // P * n + heads * hd * 4 * t
    )
    acts = "activations kept for backward"
    assert hybrid[acts].largest - attention[acts].largest == pytest.approx(
        3 * (gdn_layer - attention_layer), abs=8
    )
    assert hybrid["all-to-all buffers"].largest == attention["all-to-all buffers"].largest
    assert hybrid["state exchange buffers"].largest == P * g.heads * g.dk * (g.dk + g.dv) * 4
    assert "state exchange buffers" not in [c.name for c in attention.components]
    with pytest.raises(ValueError, match="hybrid model"):
        plan_memory(
            GDN_TINY, seq_len=n, sequence_parallel_size=P, tensor_parallel_size=2, data_parallel="fsdp"
        )


def test_attention_free_mamba2_has_no_attention_mlp_or_all_to_all():
    plan = plan_memory(MAMBA2_TINY, seq_len=1024, sequence_parallel_size=2, mode="fpdt", fpdt_chunk_size=128)
    rows = [c.name for c in plan.components]
    assert "all-to-all buffers" not in rows and "MLP working set" not in rows
    assert plan.params == sum(p.numel() for p in _model(MAMBA2_TINY).parameters())
    # 2 ranks x 4 local FPDT chunks: each a segment of the state scan, (1 + p n) fp32 per head
    assert plan["state exchange buffers"].largest == 2 * 4 * 4 * (1 + 8 * 32) * 4


@pytest.mark.parametrize(
    "model_type, kind",
    [("minimax", "MiniMax lightning attention"), ("mamba", "Mamba-1"), ("falcon_mamba", "Mamba-1"),
     ("recurrent_gemma", "RG-LRU"), ("rwkv", "RWKV"), ("xlstm", "xLSTM")],
)  # fmt: skip
def test_unmodelled_recurrent_layers_are_refused_by_name(model_type, kind):
    with pytest.raises(ValueError, match=f"has {kind}.*does not model"):
        plan_memory({"model_type": model_type}, seq_len=4096, sequence_parallel_size=2)


def test_the_cli_plans_the_model_with_its_config_overrides():
    """``CausalLM(config_overrides=...)`` changes the trained model: the plan must see the same one (one
    function builds the config for CausalLM, ``plan`` and ``export``)."""
    import yaml

    from lightning_longctx.cli.plan import plan_kwargs_from_config

    config = yaml.safe_load((CONFIGS / "demo_cpu.yaml").read_text())
    config["model"]["init_args"]["config_overrides"] = {"num_hidden_layers": 7}
    model, _, _ = plan_kwargs_from_config(config)
    assert model.num_hidden_layers == 7
    config["model"]["init_args"]["config_overrides"] = {"num_hiden_layers": 7}
    with pytest.raises(ValueError, match="did you mean 'num_hidden_layers'"):
        plan_kwargs_from_config(config)


# ---- plan on this machine: a pretrained_path that is not here, a CPU run's reserve ----


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


def test_plan_of_a_pretrained_path_not_here_says_so_in_one_line(tmp_path, capsys):
    """A ``pretrained_path`` that is not on this machine: one line naming it and the fix, exit 2; a folder
    holding only the model's config.json (no weights) plans the model, with the config's overrides."""
    import yaml

    config = yaml.safe_load((CONFIGS / "demo_cpu.yaml").read_text())
    args = config["model"]["init_args"]
    shape = args.pop("model_config")
    path = tmp_path / "c.yaml"

    def plan(pretrained: str, *extra: str) -> int:
        path.write_text(
            yaml.safe_dump({**config, "model": {"init_args": {**args, "pretrained_path": pretrained}}})
        )
        return main(["plan", "--config", str(path), *extra])

    missing = str(tmp_path / "models" / "Llama-3-8B")
    assert plan(missing) == 2
    err = _one_line_error(capsys)
    assert f"pretrained_path={missing!r}: not on this machine" in err and "--pretrained-path DIR" in err
    (tmp_path / "empty").mkdir()
    assert plan(str(tmp_path / "empty")) == 2
    assert "no config.json in that folder" in _one_line_error(capsys)
    assert plan(missing, "--pretrained-path", str(tmp_path / "empty")) == 2
    assert "--pretrained-path=" in _one_line_error(capsys)

    weightless = tmp_path / "weightless"
    cfg = dict(shape)
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(weightless)
    assert sorted(p.name for p in weightless.iterdir()) == ["config.json"]
    args["config_overrides"] = {"num_hidden_layers": 3}
    assert plan(str(weightless), "--json") == 0
    from_folder = json.loads(capsys.readouterr().out)
    assert plan(missing, "--pretrained-path", str(weightless), "--json") == 0
    assert json.loads(capsys.readouterr().out) == from_folder
    want = plan_memory({**shape, "num_hidden_layers": 3}, seq_len=128, sequence_parallel_size=2, micro_batch_size=16,
                       device_type="cpu")  # fmt: skip
    assert from_folder["device_total"] == want.device_total and from_folder["params"] == want.params


def test_a_cpu_plan_reserves_no_cuda_context(capsys):
    """On a CPU (``accelerator: cpu``) the device reserve is the allocator's slack alone: no 1 GiB CUDA context
    (which left 0 tokens within 1 GiB); a GPU plan keeps it."""
    from lightning_longctx.planner import CUDA_CONTEXT_BYTES

    kw = {"seq_len": 4096, "sequence_parallel_size": 2}
    cpu, gpu = plan_memory(TINY, device_type="cpu", **kw), plan_memory(TINY, **kw)
    assert cpu.device_total == gpu.device_total and cpu.device_reserve == cpu.device_total // 20
    assert gpu.device_reserve == cpu.device_reserve + CUDA_CONTEXT_BYTES
    assert (
        "(allocator slack; no CUDA context)" in cpu.table()
        and "(CUDA context, allocator slack)" in gpu.table()
    )
    assert longest_sequence(TINY, device_memory="1GiB", sequence_parallel_size=2, device_type="cpu") > 0
    assert longest_sequence(TINY, device_memory="1GiB", sequence_parallel_size=2) == 0
    with pytest.raises(ValueError, match="device_type='tpu' is unknown"):
        plan_memory(TINY, device_type="tpu", **kw)

    assert (
        main(["plan", "--config", str(CONFIGS / "demo_cpu.yaml"), "--device-memory", "1GiB", "--json"]) == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["device_reserve"] == int(0.05 * plan["device_total"]) and plan["longest_seq_len"] > 0


# ---- the README's first snippet and examples/train_hf.py's GPU command fit the model they name ----


def _readme_settings() -> tuple[dict, dict, str]:
    """The README's first snippet: ``UlyssesFPDTStrategy(...)`` and ``L.Trainer(...)`` keyword arguments, and the
    text after it."""
    import ast
    import re

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S)
    calls = {}
    for node in ast.walk(ast.parse(block.group(1))):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            calls[name] = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg != "strategy"}
    return calls["UlyssesFPDTStrategy"], calls["Trainer"], readme[block.end() : block.end() + 600]


def _train_hf() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_hf", ROOT / "examples" / "train_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan_llama3_8b_at_128k(strategy: dict, devices: int, precision: str) -> Any:
    """Llama-3(.1)-8B (one shape) at 131,072 tokens with these strategy settings, as the strategy resolves them
    on one node of ``devices`` GPUs; fp32 weights (loaded with dtype=float32, as both say)."""
    from lightning_longctx.config import SequenceParallelConfig
    from lightning_longctx.planner import parallel_kwargs

    resolved = SequenceParallelConfig(**strategy).resolve(
        world_size=devices, devices_per_node=devices, device_type="cuda"
    )
    return plan_memory(LLAMA3_8B, seq_len=131072, precision=precision, param_dtype="float32",
                       device_memory="80GiB", **parallel_kwargs(resolved))  # fmt: skip


def test_the_readme_snippet_and_train_hf_fit_the_8b_model_they_name():
    """An 8B model at 128K tokens on 8 x 80 GB: the README's first snippet and examples/train_hf.py's GPU command
    fit by the planner, and quote its figures (the DDP preset they replaced needs 176 GiB per GPU)."""
    import shlex

    strategy, trainer, after = _readme_settings()
    assert trainer["accelerator"] == "gpu" and trainer["devices"] == 8
    plan = _plan_llama3_8b_at_128k(strategy, trainer["devices"], trainer["precision"])
    assert plan.fits and plan.mp_policy, plan.table()
    assert f"{format_bytes(plan.device_needed)} per GPU" in after

    example = _train_hf()
    doc = example.__doc__.replace("\\\n", " ")
    line = next(line for line in doc.splitlines() if line.strip().startswith("torchrun --nproc_per_node 8"))
    argv = shlex.split(line)
    args = example.parse_args(argv[argv.index("examples/train_hf.py") + 1 :])
    assert args.accelerator == "gpu" and args.seq_len == 131072 and "8B" in args.pretrained
    plan = _plan_llama3_8b_at_128k(example.strategy_kwargs(args), int(argv[2]), args.precision)
    assert plan.fits and plan.mp_policy, plan.table()
    assert f"{format_bytes(plan.device_total)} per GPU at its peak, {format_bytes(plan.device_needed)}" in doc

    from lightning.pytorch.strategies import StrategyRegistry

    preset = _plan_llama3_8b_at_128k(StrategyRegistry["ulysses_fpdt"]["init_params"], 8, "bf16-mixed")
    assert not preset.fits and f"{format_bytes(preset.device_needed)} per GPU" in after


def test_a_causal_lm_lora_config_is_planned_with_its_adapters():
    """``model.init_args.lora`` (CausalLM's peft LoRA) reaches the plan: frozen base weights, rank-r adapters."""
    import yaml

    from lightning_longctx.cli.plan import plan_kwargs_from_config

    config = yaml.safe_load((ROOT / "examples" / "configs" / "demo_cpu.yaml").read_text())
    model, full, _ = plan_kwargs_from_config(config)
    config["model"]["init_args"]["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    _, lora, _ = plan_kwargs_from_config(config)
    assert (lora["lora_rank"], lora["lora_targets"]) == (4, ["q_proj", "v_proj"])
    assert "lora_rank" not in full
    with_lora, without = plan_memory(model, **lora), plan_memory(model, **full)
    names = [c.name for c in without.components]
    optimizer = next(n for n in names if n.startswith("optimizer"))
    assert 0 < with_lora[optimizer].largest < without[optimizer].largest / 10


# ---- Ulysses x ring (ring_size): the all-to-all over U = P / r ranks, the ring's blocks and buffers ----

GIB, MIB = 1 << 30, 1 << 20
#: Llama-3-8B at 1M tokens on 8 GPUs as ring 2 x Ulysses 4, as the strategy runs it on a GPU
RING_8B = {"seq_len": 1 << 20, "sequence_parallel_size": 8, "precision": "bf16-mixed", "data_parallel": "fsdp",
           "activation_checkpointing": True}  # fmt: skip


def test_ring_size_1_and_auto_within_the_heads_are_todays_plan():
    """r = 1 (given, or what "auto" picks while sp fits the heads) plans exactly what the planner planned before
    the ring (the pinned grid checks every figure of the default); the JSON gains no key without a ring."""
    for model, kw in (
        (BENCH, {"seq_len": 65536, "sequence_parallel_size": 4}),
        (LLAMA3_8B, {**RING_8B, "mode": "fpdt", "fpdt_chunk_size": 16384, "offload": True}),
        (UNEVEN, {"seq_len": 10000, "sequence_parallel_size": 8, "precision": "bf16-mixed"}),
    ):
        today = plan_memory(model, **kw).to_dict()
        assert "ring_size" not in today
        assert plan_memory(model, **kw, ring_size=1).to_dict() == today
        assert plan_memory(model, **kw, ring_size="auto").to_dict() == today  # sp <= heads: auto is 1


def test_ring_terms_are_the_hand_computed_formulas():
    """Llama-3-8B (h 32, h_kv 8, d 128), N = 1M, P = 8 as ring r = 2 x Ulysses U = 4, bf16 (e = 2), fp32
    accumulators: each rank holds N/r = 524,288 tokens and h/U = 8 heads, kv h_kv^U / U = 2 (8 kv heads divide
    over U = 4: no copies); one k/v block is 2 (N/r)(h_kv^U/U) d e = 512 MiB (usp.md §5)."""
    from lightning_longctx.planner.plan import plan_per_rank
    from lightning_longctx.planner.terms import _ring_backward_moment, _ring_forward_moment

    n_r, d, e = (1 << 20) // 2, 128, 2
    lay = plan_per_rank(LLAMA3_8B, **RING_8B, ring_size=2)
    assert (lay.ring, lay.ulysses, lay.heads_per_rank, lay.kv_per_rank, lay.bn) == (2, 4, 8, 2, n_r)
    q, kv = n_r * 8 * d, n_r * 2 * d  # elements of q (and out), of k (and v) in head layout
    block = 2 * n_r * 2 * d * e
    assert lay.ring_block_bytes == block == 512 * MIB
    lse = n_r // 2 * 8 * 4  # one kernel call's rows (a zigzag chunk, N/(2r)), fp32
    # forward: two k/v blocks; the fp32 output accumulator, one call's fp32 output, the merge's 2 products + sum
    assert _ring_forward_moment(lay) == (2 * block, q * 4 + 4 * (q // 2) * 4 + 5 * lse)
    assert _ring_forward_moment(lay) == (1 * GIB, 6 * GIB + 40 * MIB)
    # backward, the last step computing: the visiting k/v block, three fp32 dk/dv blocks (accumulating, sent,
    # received); dout, delta, the fp32 dq accumulator, the previous call's fp32 dq/dk/dv and this call's (+ bf16)
    half = (q + 2 * kv) // 2
    base = q * e + n_r * 8 * 4 + q * 4
    assert _ring_backward_moment(lay) == (block + 3 * 2 * kv * 4, base + half * (2 * 4 + e))
    assert _ring_backward_moment(lay) == (int(3.5 * GIB), int(6.75 * GIB) + 16 * MIB)

    ring, ulysses = plan_memory(LLAMA3_8B, **RING_8B, ring_size=2), plan_memory(LLAMA3_8B, **RING_8B)
    assert ring.ring_size == 2 and ring.to_dict()["ring_size"] == 2
    assert (
        ring["ring buffers"].largest == int(3.5 * GIB) and "sp 8 (ring 2 x Ulysses 4) x dp 1" in ring.table()
    )
    assert "k/v blocks of 512.00 MiB (524,288 tokens x 2 kv heads; ring 2 x Ulysses 4)" in ring.table()
    # (N/r) x (h/U) = (N/P) x h: the per-rank activations are Ulysses' (kv heads divide over U and P alike)
    for row in ("weights", "activations kept for backward", "layer recompute (checkpointing)"):
        assert ring[row].largest == ulysses[row].largest, row
    # the forward's ring working set (two blocks, the accumulator and one call's merge: 7 GiB + 40 MiB) instead
    # of Ulysses' all-to-all buffers (2 (N/P) h d e = 2 GiB: a ring's are not alive during its loop)
    a2a = 2 * (1 << 20) // 8 * 32 * d * e
    assert ulysses["all-to-all buffers"].largest == a2a == 2 * GIB
    assert "all-to-all buffers" not in [c.name for c in ring.components]
    assert ring.phase("layer forward")[0] - ulysses.phase("layer forward")[0] == 7 * GIB + 40 * MIB - a2a


def test_ring_replicates_kv_for_u_and_pads_to_2p():
    """GQA kv copies follow U, not P (spread_kv_heads over the Ulysses group); the sequence pads to 2P."""
    from lightning_longctx.planner.plan import plan_per_rank

    # 8 heads, 2 kv heads: Ulysses over P = 8 spreads kv to 8 heads; ring 2 x U 4 spreads it to 4
    gqa = {**TINY, "hidden_size": 128, "num_attention_heads": 8}
    lay = plan_per_rank(gqa, seq_len=1001, sequence_parallel_size=8, ring_size=2)
    assert (lay.ulysses, lay.kv_heads, lay.kv_per_rank, lay.heads_per_rank) == (4, 4, 1, 2)
    assert lay.padded == 1008 and lay.bn == 504  # a multiple of 2 x 8; N / r per ring rank
    assert plan_per_rank(gqa, seq_len=1001, sequence_parallel_size=8).kv_heads == 8


def test_ring_auto_is_the_config_rule_and_the_refusals_name_the_rule():
    from lightning_longctx.config import SequenceParallelConfig, auto_ring_size
    from lightning_longctx.planner import parallel_kwargs, resolve_parallel, ring_choice

    # TINY has 4 heads: sp 8 needs a ring of 2, sp 16 at tp 2 (2 heads per tp rank) a ring of 8
    assert plan_memory(TINY, seq_len=4096, sequence_parallel_size=8, ring_size="auto").ring_size == 2
    assert auto_ring_size(16, 2) == 8 == plan_memory(
        TINY, seq_len=8192, sequence_parallel_size=16, tensor_parallel_size=2, data_parallel="fsdp",
        ring_size="auto").ring_size  # fmt: skip
    choice = ring_choice(TINY, seq_len=4096, sequence_parallel_size=8, ring_size="auto")
    assert choice.text() == (
        "ring_size 2 (auto): Ulysses 4 fits 4 heads per tp rank; ring 2 passes 256.00 KiB k/v blocks (2,048 tokens "
        "per ring rank, 2 kv heads per tp rank)"
    )
    assert choice.hint() is None
    one = ring_choice(TINY, seq_len=4096, sequence_parallel_size=8)
    assert one.hint() == (
        "Ulysses 8 (sequence_parallel_size 8 / ring_size 1) > 4 heads per tp rank: 4 of each all-to-all's ranks "
        "hold no head; ring_size='auto' would pick 2 (Ulysses 4 x ring 2)"
    )
    # the strategy's resolved settings plan their ring (parallel_kwargs no longer refuses it)
    resolved = SequenceParallelConfig(sequence_parallel_size=4, ring_size=2).resolve(8, 8, "cuda")
    assert parallel_kwargs(resolved)["ring_size"] == 2
    assert plan_memory(TINY, seq_len=4096, **parallel_kwargs(resolved)).ring_size == 2
    assert longest_sequence(BENCH, device_memory="4GiB", sequence_parallel_size=4, ring_size=2) % 8 == 0
    base = {"seq_len": 4096, "sequence_parallel_size": 4}
    for kwargs, match in (
        ({"ring_size": 3}, "ring_size=3 must divide sequence_parallel_size=4"),
        ({"ring_size": 0}, "ring_size=0"),
        ({"ring_size": "two"}, "ring_size='two'"),
    ):
        with pytest.raises(ValueError, match=match):
            plan_memory(BENCH, **base, **kwargs)
    with pytest.raises(ValueError, match="ring_size='auto' picks r from the model's attention heads"):
        resolve_parallel(sequence_parallel_size=4, ring_size="auto")


def test_cli_prints_the_ring_choice_and_hints_auto(tmp_path, capsys):
    """``plan --ring-size auto`` names r and why; a plan whose sp exceeds the heads at ring_size 1 hints what auto
    picks; the strategy's own ring_size is read from the config."""
    import yaml

    strategy = {
        "class_path": "lightning_longctx.UlyssesFPDTStrategy",
        "init_args": {"sequence_parallel_size": 8},
    }
    config = {"trainer": {"accelerator": "cpu", "devices": 8, "strategy": strategy},
              "model": {"init_args": {"model_config": TINY}}, "data": {"init_args": {"seq_len": 4096}}}  # fmt: skip
    path = tmp_path / "sp8.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["plan", "--config", str(path), "--ring-size", "auto"]) == 0
    out = capsys.readouterr().out
    assert "sp 8 (ring 2 x Ulysses 4) x dp 1, Ulysses x ring" in out
    assert (
        "\nring_size 2 (auto): Ulysses 4 fits 4 heads per tp rank; ring 2 passes 256.00 KiB k/v blocks" in out
    )
    assert main(["plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "note: Ulysses 8 (sequence_parallel_size 8 / ring_size 1) > 4 heads per tp rank" in out
    assert "ring_size='auto' would pick 2 (Ulysses 4 x ring 2)" in out and "\nring_size " not in out
    strategy["init_args"]["ring_size"] = 4
    path.write_text(yaml.safe_dump(config))
    assert main(["plan", "--config", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ring_size"] == 4 and plan["ring_choice"]["ulysses"] == 2 and plan["notes"] == []
    assert plan["ring_choice"]["text"].startswith("ring_size 4: Ulysses 2 fits 4 heads per tp rank; ring 4")
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(path), "--ring-size", "two"])
    assert "'two': use a positive int (1: Ulysses alone) or auto" in capsys.readouterr().err


class _LiveBytes:
    """The bytes of the storages that ops create while the mode is on, as long as they live (a finalizer per
    storage), and their peak since :meth:`reset`. Built lazily: the class derives from TorchDispatchMode."""

    @staticmethod
    def mode() -> Any:
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class Mode(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.live, self.peak, self.seen = 0, 0, set()

            def _free(self, key: int, nbytes: int) -> None:
                self.seen.discard(key)
                self.live -= nbytes

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and not t._is_view():
                        storage = t.untyped_storage()
                        key, nbytes = storage.data_ptr(), storage.nbytes()
                        if nbytes and key not in self.seen:
                            self.seen.add(key)
                            self.live += nbytes
                            self.peak = max(self.peak, self.live)
                            weakref.finalize(storage, self._free, key, nbytes)
                return out

            def reset(self) -> int:
                self.peak = self.live
                return self.live

        return Mode()


def _ring_working_sets(heads: int, kv_heads: int, dtype: str) -> tuple[int, int]:
    """On each rank of a 2-rank ring: the bytes ring attention's forward and backward allocate beyond what it
    keeps (the planner's moments): forward peak minus the inputs, the kept lse (and in fp32 the output, which is
    the accumulator itself); backward peak minus what the forward kept, plus dout (the planner counts it)."""
    import torch.distributed as dist

    from lightning_longctx.attention.ring import RingLayout, ring_attention

    torch.set_num_threads(1)
    n, d, rank = 4096, 32, dist.get_rank()
    layout, dt = RingLayout(ring_size=2, seq_len=n), getattr(torch, dtype)
    live = _LiveBytes.mode()
    with live:
        g = torch.Generator().manual_seed(rank)
        q, k, v = (
            torch.randn(1, n // 2, hh, d, generator=g).to(dt).requires_grad_()
            for hh in (heads, kv_heads, kv_heads)
        )
        dout = torch.randn(1, n // 2, heads, d, generator=g).to(dt)
        before = live.reset()
        out = ring_attention(q, k, v, group=None, layout=layout)
        forward, kept = live.peak - before, live.reset()
        out.backward(dout)
        backward = live.peak - kept
    q_bytes, ct = out.numel() * out.element_size(), 4
    lse = n // 2 * heads * ct
    return forward - lse - (q_bytes if dt == torch.float32 else 0), backward + q_bytes


@pytest.mark.parametrize("heads, kv_heads, dtype", [(4, 4, "float32"), (4, 2, "bfloat16")])
def test_ring_moments_are_what_ring_attention_allocates(dist_pool, heads, kv_heads, dtype):
    """The ring's forward and backward moments (buffers + working set) equal the live tensor bytes of a real
    ring attention at r = 2 (gloo; the fused CPU kernel, a chunk per call), MHA in fp32 and GQA in bf16."""
    from lightning_longctx.planner.plan import plan_per_rank
    from lightning_longctx.planner.terms import _ring_backward_moment, _ring_forward_moment

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": heads * 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads}  # fmt: skip
    precision = {"float32": "32-true", "bfloat16": "bf16-true"}[dtype]
    lay = plan_per_rank(config, seq_len=4096, sequence_parallel_size=2, ring_size=2, precision=precision)
    planned = (sum(_ring_forward_moment(lay)), sum(_ring_backward_moment(lay)))
    for measured in dist_pool(2).run(_ring_working_sets, heads, kv_heads, dtype):
        assert measured == planned


# ---- FPDT x ring (fpdt_chunk_size with ring_size): attention/fpdt_ring.py's stores, accumulators, k/v blocks ----

#: 4 heads, 2 kv heads, head dim 32: the FPDT x ring configs below
FR_MODEL = {"model_type": "llama", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
FR = dict(seq_len=4096, mode="fpdt", fpdt_chunk_size=256)


def test_fpdt_ring_terms_are_the_hand_computed_formulas():
    """h 4, h_kv 2, d 32, N = 4096, P = 4 as ring r = 2 x Ulysses U = 2, c = 256, fp32: K = 4 local segments
    of S = U c = 512 tokens with h/U = 2 heads (kv 1), N/r = 2048 tokens per ring rank; a k/v segment of 128 KiB,
    a block of 512 KiB, a 512 x 512 score tile."""
    from lightning_longctx.planner.plan import plan_per_rank
    from lightning_longctx.planner.terms import (
        _attention_store_bytes,
        _fpdt_ring_backward_moment,
        _fpdt_ring_forward_moment,
        _fpdt_score_tile_bytes,
    )

    lay = plan_per_rank(FR_MODEL, **FR, sequence_parallel_size=4, ring_size=2)
    assert (lay.ring, lay.ulysses, lay.chunk, lay.segment, lay.bn, lay.t) == (2, 2, 256, 512, 2048, 1024)
    assert (lay.heads_per_rank, lay.kv_per_rank, lay.tile, lay.segments) == (2, 1, 512, 16)
    q, kv, seg_q, seg_kv, e = 2048 * 2 * 32, 2048 * 32, 512 * 2 * 32, 512 * 32, 4
    kv_seg, block, seg_lse, lse = 2 * seg_kv * e, 2 * kv * e, 512 * 2 * e, 2048 * 2 * e
    tile = 2 * 512 * 512 * e + 512 * 512
    assert (
        (kv_seg, block, _fpdt_score_tile_bytes(lay))
        == (128 << 10, 512 << 10, tile)
        == (131072, 524288, 2359296)
    )
    assert lay.ring_block_bytes == block and _attention_store_bytes(lay) == 2 * q * e + 2 * kv * e + lse
    accs, unit = q * e + lse, 4 * seg_q * e + 5 * seg_lse
    assert _fpdt_ring_forward_moment(lay) == (block, 0, accs + unit + tile) == (524288, 0, 3444736)
    dkv_seg, dkv_block, dout_delta = 2 * seg_kv * e, 2 * kv * e, q * e + lse
    work = q * e + q * e + 2 * (seg_q + 2 * seg_kv) * e + seg_lse + 2 * tile
    want = (block + 2 * dkv_seg + 2 * dkv_block, 0, work + dout_delta, 0)
    assert _fpdt_ring_backward_moment(lay) == want == (1835008, 0, 6836224, 0)
    # offload: the stores on the host, one k/v segment fetched back and one received on the device
    off = plan_per_rank(FR_MODEL, **FR, sequence_parallel_size=4, ring_size=2, offload=True)
    assert _fpdt_ring_forward_moment(off) == (2 * kv_seg, block - kv_seg, accs + unit + seg_q * e + tile)
    fetched = 3 * seg_q * e + 2 * seg_lse
    assert _fpdt_ring_backward_moment(off) == (
        2 * kv_seg + 2 * dkv_seg + 2 * dkv_block,
        block - kv_seg,
        work + fetched,
        dout_delta,
    )
    # a ring of 4 (U = 1): the visiting store (the previous step's arriving one) beside the arriving one
    r4 = plan_per_rank(FR_MODEL, **FR, sequence_parallel_size=4, ring_size=4)
    assert _fpdt_ring_forward_moment(r4)[0] == 2 * r4.ring_block_bytes
    # the plan: the rows, the store on the host with offload, the table's ring line
    plan, plan_off = (
        plan_memory(FR_MODEL, **FR, sequence_parallel_size=4, ring_size=2, offload=o) for o in (False, True)
    )
    assert plan.ring_size == 2 and plan.mode == "fpdt" and plan.padded_seq_len == 4096
    assert plan["ring buffers"].largest == 1835008 and plan_off["ring buffers"].host == block - kv_seg
    assert plan_off["activations kept for backward"].host >= _attention_store_bytes(off)
    assert "as 4 segments of 512 tokens" in plan.table() and "(host: offload)" in plan_off.table()
    assert "sp 4 (ring 2 x Ulysses 2) x dp 1, FPDT x ring, chunk 256 (4 per rank), 32-true" in plan.table()


def test_fpdt_ring_pads_to_2pc_and_caps_the_chunk_and_hybrids_count_their_segments():
    """FPDT x ring pads to 2 P c and caps c at N / 2P (``sharding.chunk_for``); a hybrid's recurrent scan runs
    over two zigzag halves per rank in Ulysses x ring and over the FPDT chunks in FPDT x ring."""
    from lightning_longctx.planner.plan import plan_per_rank

    lay = plan_per_rank(
        FR_MODEL, seq_len=5000, sequence_parallel_size=4, ring_size=2, mode="fpdt", fpdt_chunk_size=256
    )
    assert lay.padded == 6144 and lay.chunk == 256  # a multiple of 2 x 4 x 256
    short = plan_per_rank(
        FR_MODEL, seq_len=1000, sequence_parallel_size=4, ring_size=2, mode="fpdt", fpdt_chunk_size=256
    )
    assert (
        short.chunk == 125 and short.padded == 1000 and short.segment == 250
    )  # c = N / 2P: two chunks per rank
    uly = plan_per_rank(GDN_TINY, seq_len=4096, sequence_parallel_size=4, ring_size=2)
    fpdt = plan_per_rank(GDN_TINY, seq_len=4096, sequence_parallel_size=4, ring_size=2, mode="fpdt",
                       fpdt_chunk_size=256)  # fmt: skip
    assert (uly.segments, fpdt.segments) == (8, 16)  # 2 per rank; 4 chunks of 256 per rank
    plain = plan_memory(GDN_TINY, seq_len=4096, sequence_parallel_size=4)
    for ring in (plan_memory(GDN_TINY, seq_len=4096, sequence_parallel_size=4, ring_size=2),):
        assert ring.ring_size == 2
        assert ring["state exchange buffers"].largest == 2 * plain["state exchange buffers"].largest


def _fpdt_ring_live(heads: int, kv_heads: int, offload: bool) -> tuple[int, int, int]:
    """On each rank of sp 2 = ring 2 (U = 1), N = 4096, c = 256, fp32: ``fpdt_ring_attention``'s forward peak
    above its inputs, what its forward keeps (its output included), its backward peak above that."""
    import torch.distributed as dist

    from helpers.launch import process_groups
    from lightning_longctx.attention.fpdt_ring import fpdt_ring_attention
    from lightning_longctx.parallel.mesh import ParallelDims, build_world_mesh

    torch.set_num_threads(1)
    n, d, rank = 4096, 32, dist.get_rank()
    with process_groups() as own:
        mesh = own(build_world_mesh(ParallelDims(world_size=2, sp=2, ring=2), "cpu"))
        live = _LiveBytes.mode()
        with live:
            g = torch.Generator().manual_seed(rank)
            q, k, v = (
                torch.randn(1, n // 2, hh, d, generator=g).requires_grad_()
                for hh in (heads, kv_heads, kv_heads)
            )
            dout = torch.randn(1, n // 2, heads, d, generator=g)
            before = live.reset()
            out = fpdt_ring_attention(q, k, v, ulysses_group=mesh.ulysses_group, ring_group=mesh.ring_group,
                                      chunk_size=256, offload=offload)  # fmt: skip
            forward, kept = live.peak - before, live.reset() - before
            out.backward(dout)
            backward = live.peak - kept - before
        return forward, kept, backward


@pytest.mark.parametrize(
    "heads, kv_heads, offload", [(4, 4, False), (4, 4, True), (4, 2, False), (4, 2, True)]
)
def test_fpdt_ring_moments_are_what_fpdt_ring_attention_allocates(dist_pool, heads, kv_heads, offload):
    """FPDT x ring's forward and backward moments (ring buffers + working set, device and host) equal the live
    tensor bytes of a real ``fpdt_ring_attention`` at r = 2, U = 1 (gloo, fp32, the fused CPU kernel: no math
    score tile), offload off and on (on CPU the "host" copies are clones, counted too), MHA and GQA. At U = 1 the
    all-to-all gives views: q (and without offload out and dout) are the caller's or the store's tensors, not
    copies. The forward peaks in the ring steps, or at the end (GQA with offload: the outputs and their
    concatenation beside the whole store)."""
    from lightning_longctx.planner.plan import plan_per_rank
    from lightning_longctx.planner.terms import (
        _attention_store_bytes,
        _fpdt_ring_backward_moment,
        _fpdt_ring_forward_moments,
        _fpdt_score_tile_bytes,
    )

    config = {**FR_MODEL, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    lay = plan_per_rank(config, **FR, sequence_parallel_size=2, ring_size=2, offload=offload)
    tile, q_bytes = _fpdt_score_tile_bytes(lay), lay.q_elems * 4
    loop, end = _fpdt_ring_forward_moments(lay)
    views = 0 if offload else q_bytes  # U = 1 without offload: the store's q, the outputs' out are no copies
    # in the ring steps the store holds the stacked k/v (and q's host copy); at the end all of it
    forward = max(lay.ring_block_bytes + q_bytes - views + sum(loop) - tile,
                  _attention_store_bytes(lay) - views + sum(end) - views)  # fmt: skip
    backward = sum(_fpdt_ring_backward_moment(lay)) - 2 * tile
    for fwd, kept, bwd in dist_pool(2).run(_fpdt_ring_live, heads, kv_heads, offload):
        assert fwd == forward
        assert kept == _attention_store_bytes(lay) + (q_bytes if offload else 0)  # and the returned output
        # the planner counts the output's gradient and its dout segments (views of it at U = 1 without offload)
        assert bwd + q_bytes * (1 if offload else 2) == backward


def test_the_planner_takes_the_strings_and_reads_the_config_enums():
    """``mode`` and ``data_parallel`` are taken as the strings or as the config's members, converted once:
    what one rank holds carries the members, the plan (its JSON) the plain strings; both plan alike."""
    from lightning_longctx.config import DataParallel, Mode
    from lightning_longctx.planner.plan import plan_per_rank

    kw = {"seq_len": 8192, "sequence_parallel_size": 2, "data_parallel_size": 2, "fpdt_chunk_size": 1024}
    lay = plan_per_rank(TINY, mode="fpdt", data_parallel="fsdp", **kw)
    assert lay.mode is Mode.FPDT and lay.data_parallel is DataParallel.FSDP and lay.shard == 4
    as_strings = plan_memory(TINY, mode="fpdt", data_parallel="fsdp", **kw)
    as_members = plan_memory(TINY, mode=Mode.FPDT, data_parallel=DataParallel.FSDP, **kw)
    assert as_members.to_dict() == as_strings.to_dict() and as_members.table() == as_strings.table()
    assert type(as_strings.mode) is str and type(as_strings.data_parallel) is str
    assert (as_strings.mode, as_strings.data_parallel) == ("fpdt", "fsdp")
    ddp = plan_per_rank(TINY, seq_len=8192, sequence_parallel_size=2)
    assert ddp.mode is Mode.ULYSSES and ddp.data_parallel is DataParallel.DDP and ddp.shard == 1
    with pytest.raises(ValueError, match="mode='chunked' is unknown"):
        plan_memory(TINY, seq_len=8192, sequence_parallel_size=2, mode="chunked")
