"""RoPE under sequence parallelism: every rope type trains as one process does on the whole sequence, or is
refused; a sequence past what the model's RoPE covers is refused; ``CausalLM(config_overrides=...)``.

The sequences (64 tokens) are longer than the tiny models' ``max_position_embeddings`` (16, or the original
length of a scaling) so that ``dynamic`` rescales and ``longrope`` switches to its long factors. Without
the fix a rank would read its own shard's length (``integrations/rope.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.hf_models import tiny_config, tiny_model
from helpers.lightning import compare_to_reference, fit_hf
from lightning_longctx import disable_sequence_parallel, enable_sequence_parallel
from lightning_longctx.integrations.rope import rope_limit

SEQ = 64
HALF_HEAD = 4  # tiny_config: head_dim 32 / 4 = 8, so 4 frequencies

ROPES = {  # name: model kwargs (tiny_config fields)
    "default": {"max_position_embeddings": SEQ},  # nothing scales: it needs the whole length as its limit
    "linear": {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "dynamic": {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "yarn": {
        "max_position_embeddings": SEQ,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    },
    "llama3": {
        "max_position_embeddings": SEQ,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    # the switch at 32: with 2 ranks, rank 0's own positions (0..31) would pick the short factors
    "longrope": {
        "max_position_embeddings": SEQ,
        "rope_scaling": {
            "rope_type": "longrope",
            "factor": 2.0,
            "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.2, 1.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
        },
    },
}
MODES = {"ulysses": {}, "fpdt": {"fpdt_chunk_size": 8}}
FAST = [  # (rope, P, mode, seq): the case, padding + FPDT's strided layout, the longrope switch, yarn
    ("dynamic", 2, "ulysses", SEQ),
    ("dynamic", 4, "fpdt", SEQ - 2),  # 62 tokens: shard_batch pads to 64; one process reads 62
    ("longrope", 2, "ulysses", SEQ),
    ("yarn", 2, "fpdt", SEQ),
]
MATRIX = [
    (rope, p, mode, SEQ)
    for rope in ROPES
    for p in (1, 2, 4)
    for mode in MODES
    if (rope, p, mode, SEQ) not in FAST
]


def _model_kwargs(rope: str) -> dict:
    return copy.deepcopy(ROPES[rope])  # transformers completes the rope dict in place


def _check_exact(dist_pool, rope, p, mode, seq):
    mkw = _model_kwargs(rope)
    results = dist_pool(p).run(fit_hf, "llama", p, 2, MODES[mode], mkw, 1, 1, None, seq)
    compare_to_reference(results, "llama", p, p, 2, _model_kwargs(rope), seq=seq)


@pytest.mark.parametrize("rope,p,mode,seq", FAST, ids=[f"{r}-sp{p}-{m}-{s}" for r, p, m, s in FAST])
def test_rope_types_train_exactly(dist_pool, rope, p, mode, seq):
    _check_exact(dist_pool, rope, p, mode, seq)


@pytest.mark.slow
@pytest.mark.parametrize("rope,p,mode,seq", MATRIX, ids=[f"{r}-sp{p}-{m}" for r, p, m, _ in MATRIX])
def test_every_rope_type_trains_exactly(dist_pool, rope, p, mode, seq):
    _check_exact(dist_pool, rope, p, mode, seq)


def _fit_error(model_kwargs, seq, strategy_kwargs):
    try:
        fit_hf("llama", 2, 1, strategy_kwargs, model_kwargs, seq=seq)
    except ValueError as e:
        return str(e)
    return "NO ERROR"


@pytest.mark.parametrize("mode", list(MODES))
def test_sequence_past_max_position_embeddings_is_refused(dist_pool, mode):
    for msg in dist_pool(2).run(_fit_error, {"max_position_embeddings": 16}, SEQ, MODES[mode]):
        assert "a sequence of 64 positions" in msg and "covers 16" in msg, msg
        assert "max_position_embeddings=16" in msg and "rope_parameters" in msg and "'yarn'" in msg, msg
        assert "'factor': 4" in msg and "raise max_position_embeddings to >= 64" in msg, msg


def test_rope_limit_follows_the_scaling():
    def limit(**kw):
        found = rope_limit(tiny_config(**kw))
        return None if found is None else found.limit

    assert limit(max_position_embeddings=16) == 16
    for rope in ("linear", "yarn", "llama3", "longrope"):
        assert limit(**_model_kwargs(rope)) == SEQ, rope
    assert limit(**_model_kwargs("dynamic")) is None  # dynamic NTK rescales to any length
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama31["original_max_position_embeddings"] = 8192
    assert limit(max_position_embeddings=131072, rope_scaling=llama31) == 131072


def test_length_dependent_rotary_is_patched_and_restored():
    model = tiny_model("llama", **_model_kwargs("dynamic"))
    rotary = model.model.rotary_emb
    enable_sequence_parallel(model)
    assert "forward" in rotary.__dict__
    disable_sequence_parallel(model)
    assert "forward" not in rotary.__dict__
    plain = tiny_model("llama", **_model_kwargs("yarn"))
    enable_sequence_parallel(plain)
    assert "forward" not in plain.model.rotary_emb.__dict__  # nothing to do for a config-only rope type
    disable_sequence_parallel(plain)


def test_rotary_reading_the_length_in_its_own_forward_is_refused():
    import transformers

    scaling = copy.deepcopy(ROPES["longrope"]["rope_scaling"])
    scaling.update(short_mscale=1.0, long_mscale=1.5)  # PhiMoE picks its mscale from max(position_ids)
    config = transformers.PhimoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        max_position_embeddings=SEQ,
        rope_scaling=scaling,
    )
    model = transformers.PhimoeForCausalLM(config)
    with pytest.raises(ValueError, match="computes its rotation from the length of the sequence it sees"):
        enable_sequence_parallel(model)
    assert "forward" not in model.model.rotary_emb.__dict__  # refused before anything changed


# ---- CausalLM(config_overrides=...) ----

TINY = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
    "rope_theta": 500000.0,
}
YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 64}


def _check_yarn(config):
    rope = config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["rope_theta"] == 500000.0, "a new rope dict keeps the model's rope_theta"
    assert rope["original_max_position_embeddings"] == 16, "the pretraining length, not the new one"
    assert config.max_position_embeddings == 64


def test_causal_lm_config_overrides_from_model_config():
    from lightning_longctx.recipes import CausalLM

    module = CausalLM(model_config=TINY, config_overrides=YARN)
    assert module.hparams.config_overrides == YARN
    module.configure_model()
    _check_yarn(module.hf_model.config)
    assert rope_limit(module.hf_model.config).limit == 64
    with pytest.raises(
        ValueError, match=r"\['max_position_embedings'\].*did you mean 'max_position_embeddings'"
    ):
        CausalLM(model_config=TINY, config_overrides={"max_position_embedings": 64})


def test_causal_lm_config_overrides_before_the_weights_load(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_longctx.recipes import CausalLM

    cfg = dict(TINY)
    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    saved.save_pretrained(tmp_path)
    module = CausalLM(pretrained_path=str(tmp_path), config_overrides=YARN)
    module.configure_model()
    _check_yarn(module.hf_model.config)
    for name, value in saved.state_dict().items():
        assert torch.equal(module.hf_model.state_dict()[name], value), name
    with pytest.raises(ValueError, match="does not have: \\['rope_skaling'\\]"):
        CausalLM(pretrained_path=str(tmp_path), config_overrides={"rope_skaling": {}}).configure_model()
