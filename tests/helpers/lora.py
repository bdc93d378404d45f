"""peft LoRA models for the strategy tests: the tiny models, a probe that the strategy patched the model
inside the PeftModel, and the comparison with one process (LoRA weights close, base weights bit-identical)."""

from __future__ import annotations

import lightning as L
import torch

from lightning_longctx.integrations.transformers import context_of
from lightning_longctx.testing.hf_models import TokenDataset, reference_training, tiny_model

SEQ, STEPS = 24, 2
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


class SeenPatched(L.Callback):
    """Records, before the strategy unpatches it, that the model inside the PeftModel was sequence-parallel."""

    def __init__(self) -> None:
        self.mode = None
        self.attention_calls = 0

    def on_train_end(self, trainer, pl_module) -> None:
        ctx = context_of(pl_module.model.get_base_model())
        self.mode, self.attention_calls = (ctx.config.mode, ctx.attention_calls) if ctx else (None, 0)


def lora_errors(arch: str, results, steps: int = STEPS, seq: int = SEQ) -> dict[str, float]:
    """Per-parameter relative errors against one process; asserts what must hold of every rank."""
    ref_model = lora_model(arch)
    init = {k: v.clone() for k, v in ref_model.state_dict().items()}
    trainable = {n for n, p in ref_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), sorted(trainable)[:4]
    ref_losses = reference_training(ref_model, TokenDataset(steps, seq), dp=1, batch_size=1, steps=steps)
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
