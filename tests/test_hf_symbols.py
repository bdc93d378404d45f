"""The import-time guard (``integrations/hf_symbols.py``): every transformers symbol sequence parallelism patches,
rebinds, reads or calls exists and takes what we pass it, or ``enable_sequence_parallel`` refuses the model
before patching anything, naming each symbol and the installed transformers version.

Every architecture of the sweep passes on the installed transformers; a renamed kernel, a kernel reached
through a helper we do not rebind, a changed mask-function or loss signature, an attention keyword we would
drop are each refused by name; the table agrees with the functions of ours that stand in for transformers'."""

from __future__ import annotations

import inspect
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
import transformers
from arch_sweep import ARCHS, HYBRIDS, arch_by_name, build_model
from transformers import AttentionInterface
from transformers.models.llama import modeling_llama

from helpers.hf_models import ARCHS as TINY_ARCHS
from helpers.hf_models import tiny_model
from lightning_longctx import enable_sequence_parallel
from lightning_longctx.integrations.hf_symbols import (
    ATTENTION_KEYWORDS,
    KERNELS,
    MIXERS,
    TRANSFORMERS_SYMBOLS,
    TransformersSymbolError,
    _floor,
    check_symbols,
)
from lightning_longctx.integrations.hybrid import ADAPTERS, METHODS, _reach, find_mixers
from lightning_longctx.integrations.masks import SequenceParallelMask
from lightning_longctx.integrations.transformers import _hf_attention, _hf_loss, context_of

VERSION = transformers.__version__


@pytest.fixture
def fresh_reach():
    """The hybrid kernel walk caches what each method reaches: forget it around a test that edits a modeling file."""
    _reach.cache_clear()
    yield
    _reach.cache_clear()


# ---- every model we test passes ---------------------------------------------------------------------------------


def test_every_swept_architecture_passes():
    """The 87 architectures of tests/arch_sweep.py (dense, MoE, legacy, hybrid, attention-free) and the tiny
    models of the strategy tests: none is refused on the installed transformers. The check stays cheap."""
    seconds = []
    for arch in ARCHS:
        model = build_model(arch)
        check_symbols(model)  # the first call per class parses its attention forward
        start = time.perf_counter()
        check_symbols(model)
        seconds.append(time.perf_counter() - start)
    for name in TINY_ARCHS:
        check_symbols(tiny_model(name))
    assert statistics.median(seconds) < 0.05, (
        f"check_symbols takes {statistics.median(seconds):.3f} s a model"
    )


def test_the_table_covers_every_tested_hybrid_and_every_adapter():
    """Each mixer class of the sweep's hybrids is in MIXERS with the kernels it reaches; each adapted kernel and
    each replaced method has a KERNELS entry."""
    declared = {m.cls: m for m in MIXERS}
    for name in HYBRIDS:
        for mixer in find_mixers(build_model(arch_by_name(name))):
            entry = declared.get(type(mixer).__name__)
            assert entry is not None, f"{name}: {type(mixer).__name__} is not in MIXERS"
            assert entry.module == type(mixer).__module__
    kernels = {symbol.attribute for symbol in KERNELS}
    assert set(ADAPTERS) <= kernels
    assert {f"{cls}.{method}" for cls, methods in METHODS.items() for method in methods} <= kernels


def _params(fn, skip: int) -> list[str]:
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in list(inspect.signature(fn).parameters.values())[skip:] if p.kind not in kinds]


def test_the_table_says_what_our_stand_ins_take():
    """What the table expects of transformers is what our functions take in their place: the adapters (after
    ``call, original``), the mask function, the loss, the attention function."""
    adapters = {**ADAPTERS, **{f"{c}.{m}": fn for c, ms in METHODS.items() for m, fn in ms.items()}}
    for symbol in KERNELS:
        adapter = adapters.get(symbol.attribute)
        if adapter is None:  # a companion the adapter calls (RWKV's torch WKV)
            continue
        params = _params(adapter, 2)
        assert params[: len(symbol.params)] == list(symbol.params), symbol.where
        assert set(symbol.keywords) <= set(params), symbol.where
    by_where = {symbol.where: symbol for symbol in TRANSFORMERS_SYMBOLS}
    mask = by_where["transformers.masking_utils:sdpa_mask"]
    assert set(mask.keywords) == set(_params(SequenceParallelMask.__call__, 1))
    loss = by_where["transformers.loss.loss_utils:ForCausalLMLoss"]
    assert set(loss.keywords) == set(_params(_hf_loss, 1))
    assert ATTENTION_KEYWORDS == {*_params(_hf_attention, 5), "s_aux"}  # after ctx, module, q, k, v


# ---- renamed or changed symbols are refused before anything is patched ------------------------------------------


def _refused(model: torch.nn.Module, *named: str) -> str:
    """``enable_sequence_parallel`` refuses ``model`` naming each of ``named`` and the installed version, with
    the model as it was: no context, its attention implementation, no instance forward or loss, no new key."""
    attn = model.config._attn_implementation
    keys = set(AttentionInterface._global_mapping)
    dicts = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with pytest.raises(TransformersSymbolError) as info:
        enable_sequence_parallel(model)
    message = str(info.value)
    for name in (*named, f"transformers {VERSION}", "tested window", _floor()):
        assert name in message, f"{name!r} not in the refusal:\n{message}"
    assert isinstance(info.value, RuntimeError)
    assert context_of(model) is None and model.config._attn_implementation == attn
    assert set(AttentionInterface._global_mapping) == keys
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == dicts, "the model was patched"
    return message


def test_a_renamed_hybrid_kernel_is_refused(monkeypatch, fresh_reach):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    model = tiny_model("qwen3_5")
    monkeypatch.setattr(
        qwen3_5, "chunk_gated_delta_rule_v2", qwen3_5.torch_chunk_gated_delta_rule, raising=False
    )
    monkeypatch.delattr(qwen3_5, "torch_chunk_gated_delta_rule")
    message = _refused(model, "modeling_qwen3_5:Qwen3_5GatedDeltaNet", "torch_chunk_gated_delta_rule")
    assert "causal_conv1d_fn" not in message  # still reached: only what changed is named


def _conv_outside_transformers(conv1d, hidden_states, cache, layer_idx, activation=None, **kwargs):
    """A causal conv helper that no longer calls ``causal_conv1d_fn`` (what a release moving the kernel call
    elsewhere looks like): the adapter would never run."""
    out = F.conv1d(
        hidden_states, conv1d.weight, padding=conv1d.kernel_size[0] - 1, groups=hidden_states.shape[1]
    )
    return F.silu(out[..., : hidden_states.shape[-1]])


def test_a_kernel_reached_another_way_is_refused(monkeypatch, fresh_reach):
    """transformers 5.25's incident: the conv of gated DeltaNet moved into a helper. A helper that reaches the
    kernel by some other route than its name leaves the conv unadapted: refused, naming mixer and kernel."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    if not hasattr(qwen3_5, "causal_conv1d_forward"):
        pytest.skip(
            f"transformers {VERSION} calls the kernel itself: the helper of the incident came in 5.25"
        )
    model = tiny_model("qwen3_5")
    monkeypatch.setattr(qwen3_5, "causal_conv1d_forward", _conv_outside_transformers)
    _refused(model, "Qwen3_5GatedDeltaNet", "no longer call causal_conv1d_fn")


def _scan_reordered(hidden_states, dt, B, A, C, chunk_size, D=None, dt_bias=None, **kwargs):
    raise AssertionError("never called: refused before")


def test_a_kernel_with_another_signature_is_refused(monkeypatch, fresh_reach):
    from transformers.models.bamba import modeling_bamba as bamba

    model = tiny_model("bamba")
    _scan_reordered.__module__ = bamba.__name__
    monkeypatch.setattr(bamba, "mamba2_chunk_scan", _scan_reordered)
    _refused(
        model, "modeling_bamba:mamba2_chunk_scan", "(hidden_states, dt, B, A, C, chunk_size)", "'dt_softplus'"
    )


def _sdpa_mask_renamed(
    batch_size, query_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, **kw
):
    raise AssertionError("never called")


def _loss_without_shift_labels(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kw):
    raise AssertionError("never called")


def test_changed_mask_and_loss_signatures_are_refused_together(monkeypatch):
    """Two changed symbols, one refusal naming both (and only them): the dense model is not asked about mixers."""
    from transformers import masking_utils
    from transformers.loss import loss_utils

    monkeypatch.setattr(masking_utils, "sdpa_mask", _sdpa_mask_renamed)
    monkeypatch.setattr(loss_utils, "ForCausalLMLoss", _loss_without_shift_labels)
    message = _refused(
        tiny_model("llama"),
        "transformers.masking_utils:sdpa_mask",
        "'q_length'",
        "transformers.loss.loss_utils:ForCausalLMLoss",
        "'shift_labels'",
    )
    assert message.count("\n  - ") == 2, message


def test_a_missing_hub_kernel_switch_is_refused(monkeypatch):
    """Where transformers kernelizes at every train() / eval() (``kernels_mode``), the switch that turns its hub
    kernels off must be there: they would erase our forwards."""
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "kernels_mode"):
        pytest.skip("this transformers does not kernelize at train() / eval()")
    monkeypatch.delattr(PreTrainedModel, "reset_kernels")
    _refused(tiny_model("llama"), "<model>:reset_kernels", "missing")


class _AttentionWithSinks(modeling_llama.LlamaAttention):
    """Llama attention passing a keyword our attention function does not read (an attention-sink variant)."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (
            p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        attention_interface = modeling_llama.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling_llama.eager_attention_forward
        )
        out, weights = attention_interface(
            self, q, k, v, attention_mask, scaling=self.scaling, sinks=torch.zeros(1), **kwargs
        )
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


def test_an_attention_keyword_we_would_drop_is_refused():
    model = tiny_model("llama")
    for module in model.modules():
        if isinstance(module, modeling_llama.LlamaAttention):
            module.__class__ = _AttentionWithSinks
    _refused(model, "_AttentionWithSinks.forward", "sinks=")


def test_optional_symbols_may_be_absent(monkeypatch):
    """A symbol our code has a fallback for (absent from older releases) is not required."""
    from transformers import masking_utils, modeling_utils

    monkeypatch.delattr(masking_utils, "remap_positions_for_packed_sequence", raising=False)
    monkeypatch.delattr(modeling_utils, "slice_logits_to_keep", raising=False)
    check_symbols(tiny_model("llama"))
