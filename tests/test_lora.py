"""peft LoRA models under UlyssesFPDTStrategy: a real Trainer at sp = 2 (Ulysses and FPDT) against a
single-process loop, parameter by parameter. The strategy patches the PreTrainedModel inside the
PeftModel; the LoRA A/B weights must train exactly as on one process and the base weights stay frozen."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from hf_models import HFModule, TokenDataset, reference_training, tiny_model
from test_strategy import _env_for_lightning

from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.integrations.transformers import context_of

SEQ, STEPS, SP = 24, 2, 2
#: LoRA on the attention projections of Llama; on every linear layer of Qwen2 (the MLP too, which FPDT tiles).
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj"], "qwen2": "all-linear"}
MODES = {"ulysses": {}, "fpdt": {"fpdt_chunk_size": 4}}  # FPDT: 12 local tokens in 3 chunks per rank


def lora_model(arch: str) -> torch.nn.Module:
    """A tiny HF model wrapped by peft; ``init_lora_weights=False`` makes B non-zero, so both A and B get
    a gradient from the first step (with peft's default B = 0, A's first gradient is exactly zero)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model(arch)
    torch.manual_seed(1)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[arch], init_lora_weights=False
    )
    return get_peft_model(base, config)


class _SeenPatched(L.Callback):
    """Records, before the strategy unpatches it, that the model inside the PeftModel was sequence-parallel."""

    def __init__(self) -> None:
        self.mode = None
        self.attention_calls = 0

    def on_train_end(self, trainer, pl_module) -> None:
        ctx = context_of(pl_module.model.get_base_model())
        self.mode, self.attention_calls = (ctx.config.mode, ctx.attention_calls) if ctx else (None, 0)


def _fit_lora(arch: str, mode: str, tp: int = 1):
    _env_for_lightning()
    model = lora_model(arch)
    module = HFModule(model, dataset=TokenDataset(STEPS, SEQ))
    seen = _SeenPatched()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(
            sequence_parallel_size=SP,
            **MODES[mode],
            **({"tensor_parallel_size": tp, "data_parallel": "fsdp"} if tp > 1 else {}),
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
            assert half.weight.device_mesh.mesh_dim_names == ("dp_sp", "tp"), half.weight.device_mesh
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.lightning_module_state_dict().items()}
    return state, module.losses, seen.mode, seen.attention_calls


def _errors(arch: str, results) -> dict[str, float]:
    """Per-parameter relative errors against one process; asserts what must hold of every rank."""
    ref_model = lora_model(arch)
    init = {k: v.clone() for k, v in ref_model.state_dict().items()}
    trainable = {n for n, p in ref_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), sorted(trainable)[:4]
    ref_losses = reference_training(ref_model, TokenDataset(STEPS, SEQ), dp=1, batch_size=1, steps=STEPS)
    ref_state = ref_model.state_dict()
    errors: dict[str, float] = {}
    for state, losses, mode, calls in results:
        assert mode is not None and calls > 0, "the model inside the PeftModel was not made sequence-parallel"
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            if name in trainable:
                assert (ref - init[name]).abs().max() > 0, f"{name} never moved: the test would prove nothing"
                err = (state[name] - ref).abs().max().item() / ref.abs().max().item()
                errors[name] = max(errors.get(name, 0.0), err)
            else:  # frozen base weights: bit-identical to their initial values, here and in the reference
                assert torch.equal(state[name], init[name]), f"frozen {name} changed under the strategy"
                assert torch.equal(ref, init[name]), name
    return errors


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", list(TARGETS))
def test_lora_trains_like_one_process(dist_pool, arch, mode):
    results = dist_pool(SP).run(_fit_lora, arch, mode)
    assert {r[2] for r in results} == {mode}
    errors = _errors(arch, results)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst}: relative error {errors[worst]:.2e}"
    print(f"{arch} {mode}: {len(errors)} LoRA tensors, worst relative error {errors[worst]:.1e} ({worst})")


@pytest.mark.parametrize(("arch", "mode"), [("llama", "ulysses"), ("qwen2", "fpdt")])
def test_lora_under_tensor_parallelism(dist_pool, arch, mode):
    """tp 2 x sp 2: each LoRA layer split around its base linear (column-wise base: B split, A replicated;
    row-wise base: A split, B replicated), every adapter tensor as on one process, the base frozen."""
    results = dist_pool(2 * SP).run(_fit_lora, arch, mode, 2)
    errors = _errors(arch, results[:1])  # FSDP2's full state dict: on rank 0
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst}: relative error {errors[worst]:.2e}"
