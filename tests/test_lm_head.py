"""FPDT's reading of a CausalLM's logits transform (``integrations/lm_head.py``): the soft-cap forms are read by
meaning (``c * tanh(x / c)`` by one config value, directly, through a local name, through a module-level
helper, behind a branch known only at run time), with the cap taken from the config at patch time; near
misses are refused. test_mask_semantics.py covers the logit scales and the Gemma-2/3 form in P = 2 runs."""

from __future__ import annotations

import arch_sweep
import pytest
import torch
import transformers
from torch import nn
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightning_longctx import disable_sequence_parallel, enable_sequence_parallel, shard_batch
from lightning_longctx.integrations.lm_head import read_chunked_head


def _arch_model(name: str, **config: object) -> nn.Module:
    arch = arch_sweep.arch_by_name(name)
    cfg = arch_sweep.build_config(arch)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return getattr(transformers, arch.model_class)(cfg).float().train()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_recurrent_gemma_and_xlstm_soft_caps_are_read(training):
    rg = _arch_model("recurrent_gemma", logits_soft_cap=7.5).train(training)
    head = read_chunked_head(
        rg, "rg"
    )  # cap = self.config.logits_soft_cap; nn.functional.tanh(logits / cap) * cap
    assert (head.decoder, head.logit_scale, head.softcap) == ("model", None, 7.5)
    xl = _arch_model("xlstm", output_logit_soft_cap=4.0).train(training)
    head = read_chunked_head(xl, "xlstm")  # soft_cap(logits, cap); in eval, the same in place, tile by tile
    assert (head.decoder, head.logit_scale, head.softcap) == ("backbone", None, 4.0)
    assert head.output_cls.__name__ == "xLSTMCausalLMOutput"


@pytest.mark.parametrize(
    "name, config, training",
    [
        ("recurrent_gemma", dict(logits_soft_cap=0.5), True),
        ("xlstm", dict(output_logit_soft_cap=0.5), True),
        # the CausalLM alone in eval, tiles of 5 tokens: it soft-caps its logits in place in its inference
        # branch (its backbone stays in training mode: its own eval path steps through the sequence)
        ("xlstm", dict(output_logit_soft_cap=0.5, max_inference_chunksize=5), False),
    ],
    ids=["recurrent_gemma", "xlstm", "xlstm_eval_tiled"],
)
def test_fpdt_loss_equals_the_soft_capped_model(name, config, training):
    """One process: the chunked loss with the cap read equals the model's own loss (a cap of 0.5 bites)."""
    plain, model = _arch_model(name, **config), _arch_model(name, **config)
    plain.training = model.training = training  # the CausalLM's own flag: its head's branch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, plain.config.vocab_size, (2, 16), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    ref = plain(**batch, use_cache=False).loss
    enable_sequence_parallel(model, mode="fpdt", chunk_size=4)
    try:
        loss = model(**shard_batch(batch, chunk_size=4)).loss
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        if training:
            ref.backward()
            loss.backward()
            want, got = plain.get_output_embeddings().weight.grad, model.get_output_embeddings().weight.grad
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    finally:
        disable_sequence_parallel(model)


# ---- forms, by meaning (a tiny Llama whose forward is replaced) ----


def _soft_cap(values, cap_value=None):
    """xLSTM's helper, as a test-module function."""
    if cap_value is None:
        return values
    return cap_value * torch.tanh(values / cap_value)


def _soft_cap_unguarded(values, cap_value):
    return torch.tanh(values / cap_value) * cap_value


def _half_soft_cap(values, cap_value):
    return cap_value * torch.tanh(values / (2 * cap_value))


class _Head(LlamaForCausalLM):
    def _out(self, logits, labels, kwargs):
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class _CapTimesTanh(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        logits = self.config.logits_soft_cap * torch.tanh(logits / self.config.logits_soft_cap)
        return self._out(logits, labels, kwargs)


class _AliasMethodTanh(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state).float()
        cap = self.config.logits_soft_cap
        logits = (logits / cap).tanh() * cap
        return self._out(logits, labels, kwargs)


class _ThreeStatementsCapFirst(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        cap = self.config.logits_soft_cap
        logits = logits / cap
        logits = nn.functional.tanh(logits)
        logits = cap * logits
        return self._out(logits, labels, kwargs)


class _ScaleThenHelper(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        logits = _soft_cap(logits * 0.5, cap_value=self.config.logits_soft_cap)
        return self._out(logits, labels, kwargs)


class _HelperAtRunTimeEitherWay(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        if self.training:
            logits = _soft_cap(logits, self.config.logits_soft_cap)
        else:
            logits = torch.tanh(logits / self.config.logits_soft_cap) * self.config.logits_soft_cap
        return self._out(logits, labels, kwargs)


@pytest.mark.parametrize(
    "cls, cap, scale",
    [
        (_CapTimesTanh, 7.5, None),
        (_AliasMethodTanh, 7.5, None),
        (_ThreeStatementsCapFirst, 7.5, None),
        (_ScaleThenHelper, 7.5, 0.5),
        (_ScaleThenHelper, None, 0.5),  # the helper's cap None: no cap
        (_HelperAtRunTimeEitherWay, 7.5, None),
    ],
)
def test_soft_cap_forms_are_read(cls, cap, scale):
    model = cls(_llama_config(logits_soft_cap=cap))
    head = read_chunked_head(model, cls.__name__)
    assert (head.softcap, head.logit_scale) == (cap, scale)


# ---- near misses ----


class _TanhTimesAnotherValue(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        cap = self.config.logits_soft_cap
        logits = nn.functional.tanh(logits / cap) * self.config.other_cap
        return self._out(logits, labels, kwargs)


class _SigmoidCap(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        cap = self.config.logits_soft_cap
        logits = nn.functional.sigmoid(logits / cap) * cap
        return self._out(logits, labels, kwargs)


class _NotASoftCapHelper(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        logits = _half_soft_cap(logits, self.config.logits_soft_cap)
        return self._out(logits, labels, kwargs)


class _UnguardedHelperNoCap(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        logits = _soft_cap_unguarded(logits, self.config.logits_soft_cap)
        return self._out(logits, labels, kwargs)


class _CapOnlyInEval(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        if not self.training:
            logits = _soft_cap(logits, self.config.logits_soft_cap)
        return self._out(logits, labels, kwargs)


class _OverlappingTiles(_Head):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        if not self.training and 4 < logits.shape[1]:
            offset = 0
            with torch.no_grad():
                while offset < logits.shape[1]:
                    logits[:, offset : offset + 4] = _soft_cap(
                        logits[:, offset : offset + 4], self.config.logits_soft_cap
                    )
                    offset += 2  # tiles overlap: some logits are capped twice
        else:
            logits = _soft_cap(logits, self.config.logits_soft_cap)
        return self._out(logits, labels, kwargs)


@pytest.mark.parametrize(
    "cls, cap, match",
    [
        (_TanhTimesAnotherValue, 7.5, r"tanh\(logits / cap\) \* self.config.other_cap.*\(a tanh scaled by"),
        (_SigmoidCap, 7.5, r"`logits = nn.functional.sigmoid\(logits / cap\) \* cap`"),
        (_NotASoftCapHelper, 7.5, r"`logits = _half_soft_cap\(logits, self.config.logits_soft_cap\)`"),
        (_UnguardedHelperNoCap, None, r"`logits = _soft_cap_unguarded\(.*its cap None"),
        (_CapOnlyInEval, 7.5, r"`if not self.training:` \(known only when the forward runs\) with branches"),
        (_OverlappingTiles, 7.5, r"`with torch.no_grad\(\):\n    while offset"),
    ],
)
def test_near_miss_soft_caps_are_refused(cls, cap, match):
    model = cls(_llama_config(logits_soft_cap=cap))
    with pytest.raises(ValueError, match=f"(?s){cls.__name__}: FPDT.*{match}.*mode='ulysses'"):
        read_chunked_head(model, cls.__name__)


def _llama_config(**extra: object) -> transformers.LlamaConfig:
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    config.other_cap = 5.0
    for key, value in extra.items():
        setattr(config, key, value)
    return config
