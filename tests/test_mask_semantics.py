"""Mask-only attention semantics and CausalLM logits transforms under sequence parallelism.

Some models say what they attend to only through the mask transformers builds for them (PhiMoE and
Qwen2-MoE pick their sliding window from the config, Llama-4 its chunked attention, ``layer_types`` mixes
them per layer); FPDT's chunked loss must also reproduce what a CausalLM does to its logits (Cohere's
``logit_scale``, Granite's ``logits_scaling``, Gemma's final soft-cap). Each family trains one step on
real gloo groups of P = 1, 2, 4 ranks, Ulysses and FPDT (chunks of 4 tokens: 12, 6, 3 chunks per rank),
and the loss and every parameter gradient (summed over the ranks, as the strategy does) are compared with
the plain single-process model on the same batch. Windows and chunks are smaller than the sequence and
straddle the shard and chunk edges. Everything else is refused with an error that names it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers import AttentionInterface, LlamaForCausalLM
from transformers.masking_utils import (
    AttentionMaskInterface,
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    chunked_causal_mask_function,
    create_bidirectional_sliding_window_mask,
    create_causal_mask,
    packed_sequence_mask_function,
    remap_positions_for_packed_sequence,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from helpers.reference import packed_positions
from lightning_longctx import disable_sequence_parallel, enable_sequence_parallel, shard_batch
from lightning_longctx.attention.common import MaskSpec
from lightning_longctx.integrations.masks import MaskPattern, RefusedMask, classify_mask_function, pattern_of
from lightning_longctx.integrations.transformers import context_of

SEQ, CHUNK, VOCAB = 48, 4, 96
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    # window chosen only through the mask: no sliding_window reaches the attention function
    "phimoe_window_by_mask": ("Phimoe", dict(sliding_window=6, num_local_experts=4)),
    # config.layer_types mix, window by mask only: layer 0 sliding (6), layer 1 full
    "qwen2moe_layer_types": (
        "Qwen2Moe",
        dict(
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
    ),
    # chunks of 10 (not aligned with shards or FPDT chunks) on RoPE layers, full attention on NoPE layers
    # whose queries are temperature-scaled by the token index (floor_scale 4: from index 3 on)
    "llama4_chunked": (
        "Llama4Text",
        dict(
            head_dim=8,
            attention_chunk_size=10,
            num_local_experts=2,
            intermediate_size_mlp=48,
            num_hidden_layers=4,
            no_rope_layer_interval=2,
            floor_scale=4,
            attn_scale=0.5,
        ),
    ),
    "cohere_logit_scale": ("Cohere", dict(logit_scale=0.25)),
}
# logits transforms of the FPDT chunked loss (P = 2)
HEADS = {
    "granite_logits_scaling_divides": ("Granite", dict(logits_scaling=4.0)),
    "gemma3_final_softcap_and_window": (
        "Gemma3Text",
        dict(head_dim=8, sliding_window=6, final_logit_softcapping=2.0),
    ),
    "cohere2_logit_scale_window_kwarg": ("Cohere2", dict(logit_scale=0.25, sliding_window=6)),
}
MODEL_CLASS = {"Llama4Text": "Llama4ForCausalLM", "Gemma3Text": "Gemma3ForCausalLM"}


@pytest.fixture
def patch():
    """``enable_sequence_parallel`` for the test; every model it patched is unpatched afterwards."""
    models = []

    def enable(model, **kw):
        models.append(model)
        return enable_sequence_parallel(model, **kw)

    yield enable
    for model in models:
        disable_sequence_parallel(model)


def _model(arch: str, kw: dict, seed: int = 0) -> torch.nn.Module:
    config = getattr(transformers, f"{arch}Config")(**{**BASE, **kw})
    torch.manual_seed(seed)
    cls = getattr(transformers, MODEL_CLASS.get(arch, f"{arch}ForCausalLM"))
    return cls(config).float().eval()  # eval: PhiMoE's router samples in training mode


def _batch(kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    batch = {"input_ids": ids, "labels": labels}
    if kind == "packed":  # documents of 17 and 31 tokens: chunks restart with each document
        batch["position_ids"] = packed_positions(2, SEQ, [17, 31])
    if kind == "padded":  # row 1 has 10 real tokens: at P = 4, ranks 1-3 hold only its padding
        mask = torch.ones_like(ids)
        mask[1, 10:] = 0
        labels[1, 10:] = -100
        batch["attention_mask"] = mask
    return batch


def _errors(arch: str, kw: dict, mode: str, kind: str = "plain") -> dict:
    """This rank's loss and worst per-parameter gradient relative error against the plain model."""
    group = dist.group.WORLD
    ref, model = _model(arch, kw), _model(arch, kw)
    batch = _batch(kind)
    ref_out = ref(**batch, use_cache=False)  # with a cache transformers would not isolate packed documents
    ref_out.loss.backward()
    chunk = CHUNK if mode == "fpdt" else None
    enable_sequence_parallel(model, group=group, mode=mode, chunk_size=chunk)
    out = model(**shard_batch(batch, group=group, chunk_size=chunk))
    out.loss.backward()
    worst, worst_name, moved = 0.0, "", 0
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)  # parameters are replicated over the SP ranks: their gradients are summed
        want = torch.zeros_like(r) if r.grad is None else r.grad
        scale = want.abs().max().item()
        moved += scale > 0
        err = (g - want).abs().max().item() / max(scale, 1e-12)
        if err > worst:
            worst, worst_name = err, name
    disable_sequence_parallel(model)
    return {
        "loss": abs(out.loss.item() - ref_out.loss.item()) / ref_out.loss.item(),
        "grad": worst,
        "where": worst_name,
        "moved": moved / len(list(ref.parameters())),
        "output": type(out).__name__,
        "ref_output": type(ref_out).__name__,
    }


def _both_modes(arch: str, kw: dict, kinds: tuple[str, ...] = ("plain",)) -> dict:
    return {(mode, kind): _errors(arch, kw, mode, kind) for mode in ("ulysses", "fpdt") for kind in kinds}


def _check(results: list[dict], tol: float) -> None:
    for rank_results in results:
        for (mode, kind), e in rank_results.items():
            where = f"{mode}/{kind}"
            assert e["output"] == e["ref_output"], f"{where}: {e['output']} instead of {e['ref_output']}"
            assert e["moved"] > 0.9, f"{where}: most gradients are zero; the test would prove nothing"
            assert e["loss"] < tol, f"{where}: loss relative error {e['loss']:.2e}"
            assert e["grad"] < tol, f"{where}: {e['where']} gradient relative error {e['grad']:.2e}"


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mask_semantics_match_single_process(dist_pool, family, world):
    arch, kw = FAMILIES[family]
    kinds = ("plain",)
    if family == "llama4_chunked" and world == 2:
        kinds = ("plain", "packed")
    if family == "llama4_chunked" and world == 4:
        kinds = ("plain", "padded")
    _check(dist_pool(world).run(_both_modes, arch, kw, kinds), tol=1e-5)


@pytest.mark.parametrize("case", list(HEADS))
def test_fpdt_loss_reproduces_the_model_logits(dist_pool, case):
    arch, kw = HEADS[case]
    _check(dist_pool(2).run(_both_modes, arch, kw), tol=1e-5)


def test_chunked_head_is_read_from_the_forward(patch):
    ctx = context_of(patch(_model(*HEADS["granite_logits_scaling_divides"]), mode="fpdt", chunk_size=4))
    assert ctx.lm_head.decoder == "model" and ctx.lm_head.logit_scale == 0.25 and ctx.lm_head.softcap is None
    ctx = context_of(patch(_model(*HEADS["gemma3_final_softcap_and_window"]), mode="fpdt", chunk_size=4))
    assert ctx.lm_head.softcap == 2.0 and ctx.lm_head.logit_scale is None
    ctx = context_of(patch(_model(*FAMILIES["llama4_chunked"]), mode="fpdt", chunk_size=4))
    assert ctx.lm_head.decoder == "model" and ctx.lm_head.output_cls.__name__ == "MoeCausalLMOutputWithPast"


# ---- the classifier, against transformers' own mask functions ----


def test_classifier_names_transformers_patterns():
    n = 40
    assert classify_mask_function(causal_mask_function, seq_len=n).describe() == "causal"
    assert not classify_mask_function(bidirectional_mask_function, seq_len=n).causal
    w = classify_mask_function(sliding_window_causal_mask_function(7), seq_len=n, local_size=7)
    assert w.sliding_window == 7 and w.chunk is None
    no_hint = classify_mask_function(sliding_window_causal_mask_function(7), seq_len=n)
    assert no_hint.sliding_window == 7
    c = classify_mask_function(
        chunked_causal_mask_function(10, torch.zeros(2, dtype=torch.long)), seq_len=n, local_size=10
    )
    assert c.chunk == 10 and c.sliding_window is None
    # a row that is all padding on this rank: transformers shifts its chunks; same pattern for us
    shifted = chunked_causal_mask_function(10, torch.tensor([0, 12]))
    assert (
        classify_mask_function(shifted, seq_len=n, local_size=10, left_padding=torch.tensor([0, 12])).chunk
        == 10
    )
    # windows / chunks spanning the sequence are plain causal attention
    assert (
        classify_mask_function(sliding_window_causal_mask_function(64), seq_len=n, local_size=64).describe()
        == "causal"
    )
    # transformers' packed-sequence wrapper (from LOCAL positions) is looked through
    pos = torch.arange(8)[None] % 4
    packed = and_masks(
        remap_positions_for_packed_sequence(sliding_window_causal_mask_function(3), pos),
        packed_sequence_mask_function(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])),
    )
    assert classify_mask_function(packed, seq_len=n, local_size=3).sliding_window == 3


def test_window_convention_is_transformers_own():
    """HF's sliding window W and MaskSpec(sliding_window=W) allow exactly the same pairs."""
    for w in (1, 3, 6):
        hf = sdpa_mask(
            batch_size=1,
            q_length=20,
            kv_length=20,
            mask_function=sliding_window_causal_mask_function(w),
            allow_is_causal_skip=False,
        )
        ours = MaskSpec(causal=True, sliding_window=w).dense(20, 20, torch.device("cpu"))
        assert torch.equal(hf[0, 0], ours[0]), w


def test_pattern_is_not_a_tensor():
    with pytest.raises(AttributeError, match=r"read attention_mask\.dtype.*not a tensor"):
        _ = MaskPattern(seq_len=8).dtype


# ---- refusals ----


def test_unsupported_layer_types_are_refused_at_patch_time(monkeypatch):
    """A layer type whose mixer has no sequence-parallel adapter (MiniMax's lightning attention, with its
    adapter taken away) is refused at patch time, with the count of layers and adapted mixers."""
    from lightning_longctx.integrations import hybrid

    monkeypatch.delitem(hybrid.METHODS, "MiniMaxLightningAttention")
    config = transformers.MiniMaxConfig(**{**BASE, "head_dim": 8, "num_local_experts": 2})
    assert config.layer_types == ["full_attention", "linear_attention"]
    with pytest.raises(
        ValueError,
        match=r"layers of type 'linear_attention' \(config.layer_types\).*1 such layers but 0 mixers",
    ):
        enable_sequence_parallel(transformers.MiniMaxForCausalLM(config))


def test_masks_we_cannot_express_are_refused(patch):
    model = patch(_model("Mistral", dict(sliding_window=4)))
    embeds = torch.zeros(1, 16, 32)
    with pytest.raises(ValueError, match=r"adds its own rule to the attention mask"):
        create_causal_mask(model.config, embeds, None, None, or_mask_function=lambda b, h, q, kv: q >= 0)
    # a pattern we cannot express is refused by the first layer that attends with it (pattern_of), not
    # when it is built: models build masks for layer types no layer uses (Qwen2-MoE's unused window)
    refused = create_bidirectional_sliding_window_mask(model.config, embeds, None)
    assert isinstance(refused, RefusedMask)
    with pytest.raises(
        ValueError, match=r"neither causal, a sliding window, chunked nor bidirectional.*query 15"
    ):
        pattern_of(refused, "MistralAttention")
    blocks = torch.tensor([[-1] * 4 + [0] * 4 + [-1] * 8])  # image-like block attending bidirectionally
    with pytest.raises(ValueError, match=r"neither causal"):
        pattern_of(create_causal_mask(model.config, embeds, None, None, block_sequence_ids=blocks), "x")
    masker = AttentionMaskInterface()[context_of(model).key]
    with pytest.raises(ValueError, match=r"16 queries against 24 keys.*use_cache=False"):
        masker(batch_size=1, q_length=16, kv_length=24, mask_function=causal_mask_function)


def test_model_editing_its_mask_is_refused(patch):
    model = patch(_model("Doge", dict(sliding_window=6)))
    with pytest.raises(AttributeError, match=r"read attention_mask\.dtype"):
        model(**shard_batch(_batch("plain")))


def test_window_kwarg_disagreeing_with_the_mask_is_refused(patch):
    model = _model("Qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1))
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    model.model.layers[0].self_attn.sliding_window = 5  # a full-attention layer that passes a window
    patch(model)
    with pytest.raises(
        ValueError, match=r"passes sliding_window=5 to attention, but its mask for this layer is causal"
    ):
        model(**shard_batch(_batch("plain")))


class _ShiftedLlama(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits + 1.0
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_fpdt_refuses_logits_transforms_it_cannot_reproduce(patch):
    config = transformers.LlamaConfig(**BASE)
    with pytest.raises(ValueError, match=r"_ShiftedLlama: .*does `logits = logits \+ 1.0`.*mode='ulysses'"):
        patch(_ShiftedLlama(config), mode="fpdt", chunk_size=4)
    patch(_ShiftedLlama(copy.deepcopy(config)))  # Ulysses keeps the model's own logits


def test_fpdt_moe_with_router_logits_and_mask_only_window_is_exact(patch):
    """PhiMoE: a window set only through the mask AND its load-balancing loss (output_router_logits), FPDT:
    the model's own call equals the plain model (one process here; test_moe_aux_loss.py runs P = 2)."""
    kw = dict(sliding_window=6, num_local_experts=4, output_router_logits=True, router_aux_loss_coef=0.1)
    plain, model = _model("Phimoe", kw), patch(_model("Phimoe", kw), mode="fpdt", chunk_size=4)
    ref = plain(**_batch("plain"))
    out = model(**shard_batch(_batch("plain"), chunk_size=4))
    assert ref.aux_loss is not None and out.aux_loss is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    ref.loss.backward()
    out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        scale = q.grad.abs().max().clamp_min(1e-12)
        assert (p.grad - q.grad).abs().max() / scale < 1e-5, name


def test_disable_unregisters_the_mask_and_removes_the_hooks():
    model = _model("Llama4Text", FAMILIES["llama4_chunked"][1])
    enable_sequence_parallel(model, mode="fpdt", chunk_size=4)
    key = context_of(model).key
    assert key in AttentionMaskInterface._global_mapping and key in AttentionInterface().keys()
    assert model._forward_pre_hooks and model._forward_hooks
    disable_sequence_parallel(model)
    assert key not in AttentionMaskInterface._global_mapping and key not in AttentionInterface().keys()
    assert not model._forward_pre_hooks and not model._forward_hooks
