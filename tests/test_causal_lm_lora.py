"""``CausalLM(lora={...})``: peft LoRA from the recipe's hyper-parameters (what a YAML config gives) on a local
``pretrained_path``, trained by a real Trainer at sp = 2 (Ulysses and FPDT) against the same module stepped on
one process: every LoRA tensor close, the base weights bit-identical to the pretrained ones."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

from helpers.hf_models import TokenDataset, reference_training, tiny_model
from helpers.lightning import lightning_env
from helpers.lora import MODES, TARGETS, SeenPatched
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.recipes import CausalLM

SEQ, STEPS, SP = 24, 2, 2
#: as tests/helpers/lora.py's: B non-zero at init (peft's default B = 0 would make the trained B nothing but
#: AdamW's normalised first updates, whose relative error is the gradients' relative error: 1.5e-5 measured)
LORA = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS["llama"], "init_lora_weights": False}


def _module(base: str) -> CausalLM:
    torch.manual_seed(1)  # the adapters' initialisation, alike on every rank and in the reference
    return CausalLM(pretrained_path=base, lora=LORA, lr=1e-2)


class _Record(L.Callback):
    """The adapters as the first step finds them, and each step's loss."""

    def __init__(self) -> None:
        self.init: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.init = {k: v.clone() for k, v in pl_module.model.state_dict().items() if "lora_" in k}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(base: str, mode: str):
    lightning_env()
    module, record, seen = _module(base), _Record(), SeenPatched()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=SP, **MODES[mode]),
        accelerator="cpu", devices=dist.get_world_size(), max_steps=STEPS, callbacks=[record, seen],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, L.LightningDataModule.from_datasets(TokenDataset(STEPS, SEQ), batch_size=1))
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return state, record.init, record.losses, seen.mode


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=pytest.mark.slow) if m == "fpdt" else m for m in MODES]
)
def test_causal_lm_lora_trains_like_one_process(dist_pool, base, mode):
    ref = _module(base)
    ref.configure_model()
    init = {k: v.clone() for k, v in ref.model.state_dict().items()}
    trainable = {n for n, p in ref.model.named_parameters() if p.requires_grad}
    assert type(ref.model).__name__ == "PeftModelForCausalLM" and trainable
    assert all("lora_" in n for n in trainable), sorted(trainable)[:4]
    optimizer = ref.configure_optimizers()  # the module's own AdamW, over the adapters only
    ref_losses = reference_training(
        ref.model, TokenDataset(STEPS, SEQ), dp=1, batch_size=1, steps=STEPS, optimizer=lambda _: optimizer
    )
    want = ref.model.state_dict()
    worst, name = 0.0, ""
    for state, first, losses, seen_mode in dist_pool(SP).run(_fit, base, mode):
        assert seen_mode == mode, "the model inside the PeftModel was not made sequence-parallel"
        assert first.keys() == {k for k in init if "lora_" in k}
        assert all(torch.equal(first[k], init[k]) for k in first), "the ranks' adapters start elsewhere"
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (losses, ref_losses)
        assert state.keys() == want.keys()
        for key, ref_value in want.items():
            if key not in trainable:  # frozen: the pretrained weights, bit for bit
                assert torch.equal(state[key], init[key]) and torch.equal(ref_value, init[key]), key
                continue
            assert (ref_value - init[key]).abs().max() > 0, f"{key} never moved: the test would prove nothing"
            err = ((state[key] - ref_value).abs().max() / ref_value.abs().max()).item()
            worst, name = max((worst, name), (err, key))
    assert worst < 1e-5, f"{name}: relative error {worst:.2e}"
    print(
        f"CausalLM(lora=...) {mode} sp {SP}: {len(trainable)} LoRA tensors, worst relative error {worst:.1e}"
    )


def test_lora_config_is_checked_when_built():
    with pytest.raises(ValueError, match=r"not a valid peft\.LoraConfig .*unexpected keyword.*'rank'"):
        CausalLM(pretrained_path="/models/x", lora={"rank": 8})
    with pytest.raises(ValueError, match=r"lora\.task_type='SEQ_CLS'.*CAUSAL_LM"):
        CausalLM(pretrained_path="/models/x", lora={"r": 8, "task_type": "SEQ_CLS"})
