"""Tensor parallelism x sequence parallelism x FSDP2 (``tensor_parallel_size``): real Trainer runs on gloo
against one process, every parameter (full tensors gathered), and the refusals."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

from helpers.hf_models import HFModule, TokenDataset, reference_training, tiny_model
from helpers.lightning import SEQ, lightning_env
from helpers.marks import WORLD8
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.parallel.mesh import ParallelDims

STEPS = 3  # optimizer steps: the first moves the weights, the next two run on moved, split weights


def _fit(arch, sp, tp, strategy_kwargs, model_kwargs, clip=None):
    lightning_env()
    world = dist.get_world_size()
    dp = world // (sp * tp)
    module = HFModule(tiny_model(arch, **model_kwargs), dataset=TokenDataset(dp * STEPS, SEQ))
    strategy = UlyssesFPDTStrategy(
        sequence_parallel_size=sp, tensor_parallel_size=tp, data_parallel="fsdp", **strategy_kwargs
    )
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS, logger=False,
                        gradient_clip_val=clip,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module)
    layer, model = module.model.model.layers[0], module.model
    weights = {"q_proj": layer.self_attn.q_proj.weight, "lm_head": model.lm_head.weight}
    if hasattr(layer.mlp, "experts"):
        weights["experts"] = layer.mlp.experts.gate_up_proj
    # FSDP2 over dp x sp, TP over tp: a 2-D DTensor; FSDP2 alone: a 1-D one
    sharded = {k: (w.device_mesh.mesh_dim_names, [str(p) for p in w.placements]) for k, w in weights.items()}
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return (
        state,
        module.losses,
        (trainer.strategy.tp_size, trainer.strategy.sp_size, trainer.strategy.dp_size),
        sharded,
    )


CASES = {
    # name: (arch, world, sp, tp, strategy kwargs, model kwargs[, gradient clip])
    "llama_tp2_sp2": ("llama", 4, 2, 2, {}, {}),
    "llama_dp2_tp2": ("llama", 4, 1, 2, {}, {}),
    "llama_tp2_sp2_clip": ("llama", 4, 2, 2, {}, {}, 0.05),  # the norm of DTensor gradients on two meshes
    "llama_dp2_sp2_tp2": ("llama", 8, 2, 2, {"fpdt_chunk_size": 3}, {}),
    "qwen3_tp2_sp2_qk_norm": ("qwen3", 4, 2, 2, {}, {}),
    "qwen3_tp2_sp2_fpdt_tiled_qk_norm": ("qwen3", 4, 2, 2, {"fpdt_chunk_size": 4}, {}),
    "llama_tp2_sp2_fpdt_offloads": (
        "llama",
        4,
        2,
        2,
        {"fpdt_chunk_size": 4, "offload": True, "activation_offload": True, "cpu_offload": True},
        {},
    ),
    "mistral_tp2_sp2_window": ("mistral", 4, 2, 2, {}, {"sliding_window": 8}),
    # Ulysses x ring and FPDT x ring on the TP-local heads (tp splits the heads first; U = 1, r = 2)
    "llama_tp2_sp2_ring2": ("llama", 4, 2, 2, {"ring_size": 2}, {}),
    "llama_tp2_sp2_fpdt_ring2": ("llama", 4, 2, 2, {"ring_size": 2, "fpdt_chunk_size": 2}, {}),
    "qwen2_tp2_sp2_fpdt_biases": ("qwen2", 4, 2, 2, {"fpdt_chunk_size": 4}, {}),
    "mixtral_tp2_sp2_experts_aux_loss": ("mixtral", 4, 2, 2, {}, {}),
    "mixtral_tp2_sp2_fpdt_experts_aux_loss": ("mixtral", 4, 2, 2, {"fpdt_chunk_size": 4}, {}),
    # tied embeddings: the lm_head is the embedding, so it stays replicated and the loss is the plain chunked one
    "llama_tied_tp2_sp2_fpdt": ("llama", 4, 2, 2, {"fpdt_chunk_size": 4}, {"tie_word_embeddings": True}),
    "llama_tp2_sp2_fpdt_checkpointing": (
        "llama",
        4,
        2,
        2,
        {"fpdt_chunk_size": 3, "activation_checkpointing": True},
        {},
    ),
}


#: the fast tier keeps one case per feature (TP x SP, the offloads, experts, clipping, FPDT checkpointing); world 8
#: starts a pool of its own (a minute of imports on 2 cores)
SLOW = {
    "llama_dp2_sp2_tp2",
    "llama_dp2_tp2",
    "qwen3_tp2_sp2_qk_norm",
    "mistral_tp2_sp2_window",
    "qwen2_tp2_sp2_fpdt_biases",
    "mixtral_tp2_sp2_experts_aux_loss",
    "llama_tied_tp2_sp2_fpdt",
    "llama_tp2_sp2_fpdt_ring2",
}


def _marks(name: str) -> list:
    return [pytest.mark.slow] * (name in SLOW) + [WORLD8] * (CASES[name][1] == 8)


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CASES])
def test_tensor_parallel_matches_one_process(dist_pool, name):
    arch, world, sp, tp, skw, mkw, *clip = CASES[name]
    clip = clip[0] if clip else None
    dp = world // (sp * tp)
    results = dist_pool(world).run(_fit, arch, sp, tp, skw, mkw, clip)
    ref = tiny_model(arch, **mkw)
    init = tiny_model(arch, **mkw).state_dict()
    data = TokenDataset(dp * STEPS, SEQ)
    ref_losses = reference_training(ref, data, dp=dp, batch_size=1, steps=STEPS, clip=clip)
    state, losses, sizes, sharded = results[0]
    assert sizes == (tp, sp, dp)
    # q_proj's rows split over the TP group (column-wise), then sharded by FSDP2 over dp x sp; in FPDT mode the
    # lm_head's vocabulary rows too (the vocabulary-parallel chunked loss), under Ulysses it stays replicated
    assert sharded["q_proj"][0] == ("dp_sp", "tensor_parallel") and sharded["q_proj"][1][1] == "S(0)", sharded
    vocab_parallel = skw.get("fpdt_chunk_size") is not None and not mkw.get("tie_word_embeddings")
    assert sharded["lm_head"][0] == (("dp_sp", "tensor_parallel") if vocab_parallel else ("dp_sp",)), sharded
    if "experts" in sharded:  # the packed gate/up of every expert split over tp, where the model's plan does
        split = any("experts" in k for k in type(ref.config).base_model_tp_plan)  # not from transformers 5.25
        want = (("dp_sp", "tensor_parallel"), ["S(0)", "_S(1, 2)"]) if split else (("dp_sp",), ["S(0)"])
        assert sharded["experts"] == want, sharded
    worst = 0.0
    for key, want in ref.state_dict().items():
        moved = (want - init[key]).abs().max().item()
        err = (state[key] - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
        assert moved > 0 or "bias" in key, f"{key} never changed: the test would prove nothing"
        assert err < 1e-5, f"{key}: relative error {err:.2e}"
        worst = max(worst, err)
    if dp == 1:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5


def test_layout_puts_tp_innermost_and_sp_next():
    lay = ParallelDims(world_size=8, sp=2, tp=2)
    assert lay.dp == 2 and lay.replicas == 4
    assert [lay.tp_rank(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [lay.sp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the world size 8"):
        ParallelDims(world_size=8, sp=1, tp=3)
    with pytest.raises(
        ValueError, match="sequence_parallel_size=3 must divide the world size 8 / tensor_parallel"
    ):
        ParallelDims(world_size=8, sp=3, tp=2)


def test_refusals_name_the_rule():
    from lightning_longctx.parallel.tensor_parallel import check_tp

    with pytest.raises(ValueError, match="tensor_parallel_size=2 with data_parallel='ddp'"):
        UlyssesFPDTStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        UlyssesFPDTStrategy(tensor_parallel_size=0, data_parallel="fsdp")
    model = tiny_model("llama")  # 4 heads, 2 kv heads
    assert check_tp(model, 2)["layers.0.self_attn.q_proj.weight"] == "colwise"
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=4 must divide .* attention heads \(4\) and key/value heads \(2\)",
    ):
        check_tp(model, 4)
    model.config.base_model_tp_plan = None
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        check_tp(model, 2)
    model.config.base_model_tp_plan = {
        "layers.*.input_layernorm": "sequence_parallel",  # Megatron-style SP inside TP: not checked
        "layers.*.self_attn.q_proj": "colwise",
    }
    with pytest.raises(
        ValueError, match=r"plan uses \['sequence_parallel'\], which this package has not checked"
    ):
        check_tp(model, 2)
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(
        tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    )
    with pytest.raises(ValueError, match=r"q_proj: lora_dropout > 0 under tensor_parallel_size"):
        check_tp(lora.base_model.model, 2)
    dora = LoraConfig(r=4, target_modules=["o_proj"], lora_dropout=0.0, use_dora=True)
    with pytest.raises(ValueError, match=r"o_proj: an adapter layer \(Linear\) on a 'rowwise' layer"):
        check_tp(get_peft_model(tiny_model("llama"), dora).base_model.model, 2)


def _plan_miss() -> object:
    """Apertus' learnable xIELU activation (alpha_p, alpha_n) sits between its column-wise up_proj and
    row-wise down_proj and is not in its Hugging Face plan: its gradients are partial over the TP group."""
    from fuzz_strategy import StratCase

    return StratCase(
        arch="apertus", world=4, sp=2, seq=24, data_parallel="fsdp", tensor_parallel_size=2, seed=1
    )


def test_a_parameter_the_plan_misses_is_refused_before_the_first_update(dist_pool):
    from fuzz_common import run_verdict
    from fuzz_strategy import TIMEOUT_S, run_strategy

    verdict = run_verdict(dist_pool, 4, run_strategy, _plan_miss(), 1e-5, TIMEOUT_S)
    assert verdict.kind == "refused", verdict  # every rank raised the same error: none waits in a collective
    assert (
        "mlp.act_fn.alpha_n" in verdict.detail and "differ across the tensor-parallel ranks" in verdict.detail
    )


def _round_trip(root: str) -> dict:
    """Train at tp 2 x sp 2, then load a plain (one-device) full checkpoint file back into the TP + FSDP2 model
    through the strategy, and read it out again: the full format is the plain Hugging Face one."""
    lightning_env()
    module = HFModule(tiny_model("llama"), dataset=TokenDataset(1, SEQ))
    strategy = UlyssesFPDTStrategy(sequence_parallel_size=2, tensor_parallel_size=2, data_parallel="fsdp")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module)
    saved = trainer.strategy.full_state_dict()  # full, on rank 0
    other = {f"model.{k}": v for k, v in tiny_model("llama", seed=1).state_dict().items()}  # one device's
    want = {k: v.clone() for k, v in other.items()}  # torch's loader may turn the dict's values into shards
    path = f"{root}/one_device.ckpt"
    if dist.get_rank() == 0:
        torch.save({"state_dict": other}, path)
    dist.barrier()
    trainer.strategy.load_checkpoint(path)
    back = trainer.strategy.full_state_dict()
    return {"saved_keys": sorted(saved), "back": back, "other": want}


def test_a_plain_checkpoint_loads_into_the_tp_model_and_back(dist_pool, tmp_path):
    res = dist_pool(4).run(_round_trip, str(tmp_path))[0]
    plain = tiny_model("llama")
    assert res["saved_keys"] == sorted(
        f"model.{k}" for k in plain.state_dict()
    )  # loads into one device's model
    assert res["back"].keys() == res["other"].keys()
    for key, want in res["other"].items():
        assert torch.equal(res["back"][key], want), key
