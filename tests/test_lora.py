"""peft LoRA models under UlyssesFPDTStrategy: a real Trainer at sp = 2 (Ulysses and FPDT) against a
single-process loop, parameter by parameter. The strategy patches the PreTrainedModel inside the
PeftModel; the LoRA A/B weights must train exactly as on one process and the base weights stay frozen."""

from __future__ import annotations

import lightning as L
import pytest
import torch.distributed as dist

from helpers.hf_models import HFModule, TokenDataset
from helpers.lightning import lightning_env
from helpers.lora import MODES, TARGETS, SeenPatched, lora_errors, lora_model
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.integrations.transformers import context_of

SEQ, STEPS, SP = 24, 2, 2


def _fit_lora(arch: str, mode: str, tp: int = 1, ring: int = 1):
    lightning_env()
    model = lora_model(arch)
    module = HFModule(model, dataset=TokenDataset(STEPS, SEQ))
    seen = SeenPatched()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(
            sequence_parallel_size=SP,
            **MODES[mode],
            **({"tensor_parallel_size": tp, "data_parallel": "fsdp"} if tp > 1 else {}),
            ring_size=ring,
        ),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=STEPS,
        callbacks=[seen],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    assert context_of(model.get_base_model()) is None, "the strategy must hand the model back plain"
    if tp > 1:  # the adapter half on the split side of its base linear is split too (q_proj: B; o_proj: A)
        attn = model.get_base_model().model.layers[0].self_attn
        for half in (attn.q_proj.lora_B.default, attn.o_proj.lora_A.default):
            assert half.weight.device_mesh.mesh_dim_names == ("dp_sp", "tensor_parallel"), (
                half.weight.device_mesh
            )
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return state, module.losses, seen.mode, seen.attention_calls


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", list(TARGETS))
def test_lora_trains_like_one_process(dist_pool, arch, mode):
    results = dist_pool(SP).run(_fit_lora, arch, mode)
    assert {r[2] for r in results} == {mode}
    errors = lora_errors(arch, results)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst}: relative error {errors[worst]:.2e}"
    print(f"{arch} {mode}: {len(errors)} LoRA tensors, worst relative error {errors[worst]:.1e} ({worst})")


@pytest.mark.parametrize(("arch", "mode"), [("llama", "ulysses"), ("qwen2", "fpdt")])
def test_lora_under_tensor_parallelism(dist_pool, arch, mode):
    """tp 2 x sp 2: each LoRA layer split around its base linear (column-wise base: B split, A replicated;
    row-wise base: A split, B replicated), every adapter tensor as on one process, the base frozen."""
    results = dist_pool(2 * SP).run(_fit_lora, arch, mode, 2)
    errors = lora_errors(arch, results[:1])  # FSDP2's full state dict: on rank 0
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("mode", list(MODES))
def test_lora_under_the_ring(dist_pool, mode):
    """sp 2 as a ring of 2 (Ulysses x ring, FPDT x ring): every adapter tensor as on one process."""
    results = dist_pool(SP).run(_fit_lora, "llama", mode, 1, 2)
    assert {r[2] for r in results} == {mode}
    errors = lora_errors("llama", results)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst}: relative error {errors[worst]:.2e}"
