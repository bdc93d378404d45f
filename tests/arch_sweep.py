"""Architecture sweep: tiny random Hugging Face causal LMs under Ulysses and FPDT at P = 2, against the plain model.

Every architecture in :data:`ARCHS` is built from its config class (hidden 32, 2 layers unless a layer pattern
needs more, 4 heads / 2 kv heads where the architecture allows it, vocab 96, float32, dropout and router noise
off), once per mode on each rank. The plain model on the whole batch (one process) gives the reference loss
and gradients; a deep copy goes through ``enable_sequence_parallel(model, group=WORLD, mode=...)`` and
``shard_batch`` and must reproduce the loss on every rank and EVERY parameter gradient summed over the ranks
(what the strategy's gradient reduction does), relative error <= :data:`TOLERANCE`. SFT-style labels: a
prompt of each row and a few scattered targets are ``-100``. MoE models run with ``output_router_logits=True``
and ``router_aux_loss_coef=0.1``, so their load-balancing loss is part of the loss compared.

Verdict per (architecture, mode): ``exact``; ``refused`` (a ValueError / TypeError / RuntimeError raised by
lightning_longctx itself, at patch time or in the first forward); ``WRONG`` (it ran and the loss or a
gradient differs, or it crashed somewhere that is not a deliberate refusal).

``python tests/arch_sweep.py --write-docs`` runs the sweep on 2 gloo processes and writes
docs/architectures.md; tests/test_arch_sweep.py runs the same sweep, fails on any WRONG and when the page is
stale. ``python tests/arch_sweep.py --only llama,mixtral`` prints the numbers of a few architectures.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "architectures.md"
PACKAGE_DIR = str(ROOT / "lightning_longctx")

WORLD = 2
BATCH, SEQ, VOCAB = 2, 32, 96
#: FPDT tokens per chunk per rank: 16 local tokens -> 4 chunks per rank.
FPDT_CHUNK = 4
MODES = {"ulysses": None, "fpdt": FPDT_CHUNK}
#: Relative error allowed for the loss and for each parameter's gradient (max |g - ref| / max |ref|).
TOLERANCE = 1e-4
#: A parameter whose reference gradient is below this fraction of the model's largest one is compared
#: against that fraction instead: a gradient that is zero up to cancellation (a key bias, which softmax
#: ignores) is float32 noise of ~1e-7 of the largest gradient, whatever its own size. Any error above
#: ``TOLERANCE * GRAD_FLOOR`` = 1e-7 of the largest gradient still fails.
GRAD_FLOOR = 1e-3
#: Exceptions that count as a refusal when lightning_longctx raises them deliberately.
REFUSALS = (ValueError, TypeError, RuntimeError)
WINDOW = 8  # sliding windows / attention chunks: smaller than the 32-token sequence, so they matter

DROP = object()  # an override that removes a base key (configs where it is a read-only property)

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    use_cache=False,
)
MOE: dict[str, Any] = dict(
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.1,
    moe_intermediate_size=24,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
)
SLIDING_FULL = ["sliding_attention", "full_attention"]
MLA = dict(  # DeepSeek-style multi-head latent attention, tiny
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    num_key_value_heads=4,
)


@dataclass(frozen=True)
class Arch:
    """One architecture of the sweep: ``name`` is its transformers ``model_type``."""

    name: str
    model_class: str
    config_class: str
    what: str  # what it exercises, for the docs
    overrides: dict[str, Any] = field(default_factory=dict)
    moe: bool = False


def _a(name: str, model: str, config: str, what: str, moe: bool = False, **overrides: Any) -> Arch:
    return Arch(name, model, config, what, overrides, moe)


ARCHS: list[Arch] = [
    # ---- dense attention ----
    _a("llama", "LlamaForCausalLM", "LlamaConfig", "RoPE, GQA 4/2: the baseline"),
    _a(
        "mistral",
        "MistralForCausalLM",
        "MistralConfig",
        "sliding window 8 on every layer",
        sliding_window=WINDOW,
    ),
    _a(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        "qkv bias; sliding window 8 from layer 1 on (use_sliding_window, max_window_layers=1)",
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
    _a("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "q/k RMSNorm per head"),
    _a("gemma", "GemmaForCausalLM", "GemmaConfig", "embedding scaling, GeGLU, (1 + w) RMSNorm"),
    _a(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        "sliding window 8 / full layer_types, attention soft-cap 1.5, final logit soft-cap 3.0",
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
        query_pre_attn_scalar=8,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
    ),
    _a(
        "gemma3_text",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        "sliding window 8 / full layer_types, two RoPE bases, q/k norm",
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
        query_pre_attn_scalar=8,
    ),
    _a(
        "vaultgemma",
        "VaultGemmaForCausalLM",
        "VaultGemmaConfig",
        "sliding window 8 / full, attention soft-cap 1.5, final soft-cap 3.0",
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
        query_pre_attn_scalar=8,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0,
    ),
    _a(
        "cohere",
        "CohereForCausalLM",
        "CohereConfig",
        "logit_scale 0.25, parallel attention + MLP",
        logit_scale=0.25,
    ),
    _a(
        "cohere2",
        "Cohere2ForCausalLM",
        "Cohere2Config",
        "sliding window 8 / full layer_types (RoPE on sliding layers only), logit_scale 0.25",
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
        logit_scale=0.25,
    ),
    _a(
        "phi",
        "PhiForCausalLM",
        "PhiConfig",
        "partial rotary, parallel block, biases",
        partial_rotary_factor=0.5,
    ),
    _a("phi3", "Phi3ForCausalLM", "Phi3Config", "fused qkv and gate/up projections"),
    _a(
        "starcoder2",
        "Starcoder2ForCausalLM",
        "Starcoder2Config",
        "sliding window 8, biases, LayerNorm",
        sliding_window=WINDOW,
    ),
    _a("olmo", "OlmoForCausalLM", "OlmoConfig", "non-parametric LayerNorm"),
    _a("olmo2", "Olmo2ForCausalLM", "Olmo2Config", "post-norm, q/k norm over all heads"),
    _a(
        "olmo3",
        "Olmo3ForCausalLM",
        "Olmo3Config",
        "sliding window 8 / full layer_types",
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
    ),
    _a("glm", "GlmForCausalLM", "GlmConfig", "interleaved partial rotary"),
    _a("glm4", "Glm4ForCausalLM", "Glm4Config", "interleaved partial rotary, sandwich norms"),
    _a(
        "granite",
        "GraniteForCausalLM",
        "GraniteConfig",
        "attention multiplier 0.2, residual 0.5 and embedding 2.0 multipliers, logits divided by 2",
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        embedding_multiplier=2.0,
        logits_scaling=2.0,
    ),
    _a(
        "granite_swa",
        "GraniteSWAForCausalLM",
        "GraniteSWAConfig",
        "Granite with attention sinks, sliding window 8 / full layer_types",
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
        logits_scaling=2.0,
    ),
    _a("helium", "HeliumForCausalLM", "HeliumConfig", "Llama-like, attention and MLP biases off"),
    _a("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", "partial rotary 0.25, parallel residual"),
    _a("gpt2", "GPT2LMHeadModel", "GPT2Config", "learned absolute positions, Conv1D projections", n_inner=48),
    _a("gpt_bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", "multi-query attention", n_inner=48),
    _a(
        "opt",
        "OPTForCausalLM",
        "OPTConfig",
        "learned positions with an offset of 2",
        ffn_dim=48,
        word_embed_proj_dim=32,
    ),
    _a("persimmon", "PersimmonForCausalLM", "PersimmonConfig", "q/k LayerNorm, partial rotary, squared ReLU"),
    _a("nemotron", "NemotronForCausalLM", "NemotronConfig", "LayerNorm1P, partial rotary, squared ReLU"),
    _a(
        "smollm3",
        "SmolLM3ForCausalLM",
        "SmolLM3Config",
        "NoPE on every 2nd layer (no_rope_layer_interval=2)",
        no_rope_layer_interval=2,
    ),
    _a(
        "exaone4",
        "Exaone4ForCausalLM",
        "Exaone4Config",
        "sliding window 8 / full layer_types, NoPE on full layers, post-norm",
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
    ),
    _a("seed_oss", "SeedOssForCausalLM", "SeedOssConfig", "qkv bias"),
    _a("arcee", "ArceeForCausalLM", "ArceeConfig", "ReLU² MLP without gate"),
    _a("apertus", "ApertusForCausalLM", "ApertusConfig", "xIELU activation, q/k norm"),
    _a("ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config", "interleaved RoPE"),
    _a("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", "q/k norm after RoPE"),
    _a("bitnet", "BitNetForCausalLM", "BitNetConfig", "ternary-quantised linear layers, sub-norm"),
    _a("diffllama", "DiffLlamaForCausalLM", "DiffLlamaConfig", "differential attention (two softmax maps)"),
    _a(
        "ministral",
        "MinistralForCausalLM",
        "MinistralConfig",
        "sliding window 8 / full layer_types",
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
    ),
    _a(
        "cwm",
        "CwmForCausalLM",
        "CwmConfig",
        "Llama-3 RoPE scaling, sliding window 8 / full layer_types",
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
    ),
    _a("jais2", "Jais2ForCausalLM", "Jais2Config", "LayerNorm, ReLU² MLP"),
    _a(
        "nanochat",
        "NanoChatForCausalLM",
        "NanoChatConfig",
        "q/k norm, final logit soft-cap 3.0",
        final_logit_softcapping=3.0,
    ),
    _a(
        "modernbert-decoder",
        "ModernBertDecoderForCausalLM",
        "ModernBertDecoderConfig",
        "ModernBERT as a causal decoder: sliding window 8 / full layer_types",
        sliding_window=WINDOW,
        local_attention=WINDOW,
        layer_types=SLIDING_FULL,
    ),
    _a(
        "doge",
        "DogeForCausalLM",
        "DogeConfig",
        "dynamic mask attention (a learned, input-dependent bias on the mask)",
        keep_window_size=WINDOW,
    ),
    # ---- legacy: attention computed inline, not through AttentionInterface ----
    _a(
        "bloom",
        "BloomForCausalLM",
        "BloomConfig",
        "ALiBi; attention inline (no AttentionInterface)",
        n_head=4,
    ),
    _a(
        "mpt",
        "MptForCausalLM",
        "MptConfig",
        "ALiBi; attention inline",
        d_model=32,
        n_heads=4,
        n_layers=2,
        expansion_ratio=1,
    ),
    _a(
        "falcon",
        "FalconForCausalLM",
        "FalconConfig",
        "multi-query, parallel attention; attention inline",
        head_dim=DROP,
    ),
    _a(
        "gpt_neo",
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        "global / local (window 8) layers; attention inline",
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=WINDOW,
    ),
    _a(
        "gptj",
        "GPTJForCausalLM",
        "GPTJConfig",
        "rotary on 4 dims; attention inline",
        rotary_dim=4,
        n_inner=48,
    ),
    _a("stablelm", "StableLmForCausalLM", "StableLmConfig", "partial rotary, LayerNorm; attention inline"),
    # ---- mixture of experts (output_router_logits=True, router_aux_loss_coef=0.1) ----
    _a("mixtral", "MixtralForCausalLM", "MixtralConfig", "4 experts top-2, load-balancing loss", moe=True),
    _a(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        "experts + gated shared expert, load-balancing loss (use_sliding_window=False: the config sets the window to 0)",
        moe=True,
        shared_expert_intermediate_size=24,
    ),
    _a(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        "q/k norm, experts, load-balancing loss",
        moe=True,
    ),
    _a("olmoe", "OlmoeForCausalLM", "OlmoeConfig", "q/k norm, experts, load-balancing loss", moe=True),
    _a(
        "phimoe",
        "PhimoeForCausalLM",
        "PhimoeConfig",
        "sparsemixer routing, sliding window 8, load-balancing loss",
        moe=True,
        sliding_window=WINDOW,
    ),
    _a(
        "gpt_oss",
        "GptOssForCausalLM",
        "GptOssConfig",
        "attention sinks, sliding window 8 / full layer_types, experts, load-balancing loss",
        moe=True,
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
    ),
    _a(
        "granitemoe",
        "GraniteMoeForCausalLM",
        "GraniteMoeConfig",
        "Granite multipliers, experts",
        moe=True,
        logits_scaling=2.0,
    ),
    _a(
        "granitemoeshared",
        "GraniteMoeSharedForCausalLM",
        "GraniteMoeSharedConfig",
        "experts + shared MLP",
        moe=True,
        shared_intermediate_size=24,
    ),
    _a(
        "jetmoe",
        "JetMoeForCausalLM",
        "JetMoeConfig",
        "mixture of attention heads and of MLPs, aux_loss_coef 0.1",
        moe=True,
        kv_channels=8,
        aux_loss_coef=0.1,
    ),
    _a(
        "dbrx",
        "DbrxForCausalLM",
        "DbrxConfig",
        "fused Wqkv with qkv clipping, experts top-2, moe_loss_weight 0.1",
        moe=True,
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_seq_len=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2, "moe_loss_weight": 0.1},
    ),
    _a(
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        "multi-head latent attention, shared + routed experts",
        moe=True,
        n_shared_experts=1,
        first_k_dense_replace=1,
        **MLA,
    ),
    _a(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        "multi-head latent attention, group-limited sigmoid routing (no aux loss)",
        moe=True,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **{**MLA, "head_dim": 4},  # the rotary part of the q/k heads
    ),
    _a(
        "ernie4_5_moe",
        "Ernie4_5_MoeForCausalLM",
        "Ernie4_5_MoeConfig",
        "experts from layer 1 on, load-balancing loss",
        moe=True,
        moe_num_experts=4,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    ),
    _a("flex_olmo", "FlexOlmoForCausalLM", "FlexOlmoConfig", "experts, load-balancing loss", moe=True),
    _a(
        "minimax_m2",
        "MiniMaxM2ForCausalLM",
        "MiniMaxM2Config",
        "sigmoid routing with bias, load-balancing loss",
        moe=True,
    ),
    _a(
        "glm4_moe",
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        "dense layer 0, routed + shared experts (no aux loss)",
        moe=True,
        n_shared_experts=1,
    ),
    _a(
        "hunyuan_v1_moe",
        "HunYuanMoEV1ForCausalLM",
        "HunYuanMoEV1Config",
        "experts top-2 + shared MLP",
        moe=True,
        moe_topk=2,
    ),
    _a(
        "dots1",
        "Dots1ForCausalLM",
        "Dots1Config",
        "routed + shared experts (no aux loss)",
        moe=True,
        n_shared_experts=1,
        first_k_dense_replace=1,
    ),
    _a(
        "cohere2_moe",
        "Cohere2MoeForCausalLM",
        "Cohere2MoeConfig",
        "sliding window 8 / full layer_types, logit_scale 0.25, experts",
        moe=True,
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
        logit_scale=0.25,
    ),
    _a(
        "exaone_moe",
        "ExaoneMoeForCausalLM",
        "ExaoneMoeConfig",
        "sliding window 8 / full layer_types, dense layer 0, experts",
        moe=True,
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
    ),
    _a(
        "afmoe",
        "AfmoeForCausalLM",
        "AfmoeConfig",
        "sliding window 8 / full layer_types, gated attention, experts",
        moe=True,
        sliding_window=WINDOW,
        layer_types=SLIDING_FULL,
        num_dense_layers=1,
    ),
    _a(
        "llama4_text",
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        "chunked attention (chunks of 8) with RoPE, NoPE + temperature tuning on layer 1, experts top-1",
        moe=True,
        attention_chunk_size=WINDOW,
        intermediate_size_mlp=48,
        num_experts_per_tok=1,
        no_rope_layers=[1, 0],
        floor_scale=4,
    ),
    # ---- hybrids: other sequence mixers beside attention (integrations/hybrid: exact, or refused) ----
    _a(
        "lfm2",
        "Lfm2ForCausalLM",
        "Lfm2Config",
        "hybrid: gated short convolution (kernel 3) + attention layers",
        layer_types=["conv", "full_attention"],
        block_auto_adjust_ff_dim=False,
    ),
    _a(
        "qwen3_next",
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        "hybrid: gated DeltaNet linear attention + gated attention, experts",
        moe=True,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        shared_expert_intermediate_size=24,
    ),
    _a(
        "qwen3_5_text",
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        "hybrid: gated DeltaNet linear attention + gated attention",
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    _a(
        "minimax",
        "MiniMaxForCausalLM",
        "MiniMaxConfig",
        "hybrid: lightning (linear) attention + softmax attention, experts",
        moe=True,
        layer_types=["linear_attention", "full_attention"],
        block_size=WINDOW,
    ),
    _a(
        "jamba",
        "JambaForCausalLM",
        "JambaConfig",
        "hybrid: Mamba + attention layers, experts on layer 1",
        moe=True,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=4,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    ),
    _a(
        "bamba",
        "BambaForCausalLM",
        "BambaConfig",
        "hybrid: Mamba-2 + attention layers",
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=8,
    ),
    _a(
        "falcon_h1",
        "FalconH1ForCausalLM",
        "FalconH1Config",
        "hybrid: Mamba-2 and attention in parallel in every layer",
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=8,
    ),
    _a(
        "granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridConfig",
        "hybrid: Mamba-2 + attention layers, experts",
        moe=True,
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=8,
        shared_intermediate_size=24,
    ),
    _a(
        "nemotron_h",
        "NemotronHForCausalLM",
        "NemotronHConfig",
        "hybrid: Mamba-2 + attention blocks",
        layers_block_type=["linear_attention", "full_attention"],
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=1,
        chunk_size=8,
    ),
    _a(
        "olmo_hybrid",
        "OlmoHybridForCausalLM",
        "OlmoHybridConfig",
        "hybrid: gated DeltaNet + attention layers",
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    _a(
        "recurrent_gemma",
        "RecurrentGemmaForCausalLM",
        "RecurrentGemmaConfig",
        "hybrid: RG-LRU recurrence + short convolution, local attention (window 8)",
        block_types=["recurrent", "attention"],
        lru_width=32,
        attention_window_size=WINDOW,
        num_key_value_heads=4,
    ),
    _a(
        "kimi_linear",
        "KimiLinearForCausalLM",
        "KimiLinearConfig",
        "hybrid: Kimi delta attention (linear) + latent attention, experts",
        moe=True,
        layer_types=["linear_attention", "full_attention"],
        linear_head_dim=8,
        linear_num_heads=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        **MLA,
    ),
    # ---- no attention at all ----
    _a(
        "mamba",
        "MambaForCausalLM",
        "MambaConfig",
        "selective state space (Mamba-1), no attention",
        state_size=4,
    ),
    _a(
        "mamba2",
        "Mamba2ForCausalLM",
        "Mamba2Config",
        "chunked state space duality (Mamba-2), no attention",
        num_heads=4,
        head_dim=16,
        state_size=8,
        n_groups=1,
        chunk_size=8,
    ),
    _a(
        "falcon_mamba",
        "FalconMambaForCausalLM",
        "FalconMambaConfig",
        "Mamba-1 with extra norms, no attention",
        state_size=4,
    ),
    _a(
        "xlstm",
        "xLSTMForCausalLM",
        "xLSTMConfig",
        "mLSTM recurrence, no attention",
        embedding_dim=32,
        num_blocks=2,
    ),
    _a("rwkv", "RwkvForCausalLM", "RwkvConfig", "RWKV-4 time mixing, no attention", attention_hidden_size=32),
]

#: The hybrid (attention + another token mixer) and attention-free architectures among :data:`ARCHS`.
HYBRIDS = ("lfm2", "qwen3_next", "qwen3_5_text", "minimax", "jamba", "bamba", "falcon_h1", "granitemoehybrid",
           "nemotron_h", "olmo_hybrid", "recurrent_gemma", "kimi_linear", "mamba", "mamba2", "falcon_mamba",
           "xlstm", "rwkv")  # fmt: skip

#: Causal-LM model types of transformers 5.24 left out of the sweep, and why (decoder-only text models only).
SKIPPED: dict[str, str] = {
    "gemma3n_text": "per-layer input embeddings and KV sharing across layers need a config this builder does not make",
    "blt": "byte-latent transformer: its patcher and local encoders need far more memory than a tiny config allows",
    "zamba": "hybrid Mamba + shared attention: its hybrid layer map needs a config this builder does not make "
    "(the same mixers are swept in Jamba and Bamba)",
    "zamba2": "hybrid Mamba-2 + shared attention: as zamba (swept: Bamba, Falcon-H1, Granite-MoE-hybrid)",
    "reformer": "LSH / local attention with axial positions; needs special sequence lengths",
    "xlnet": "permutation language model with two streams, not a causal decoder",
    "gemma3": "Gemma3ForConditionalGeneration is multimodal; its text model gemma3_text is swept",
    "llama4": "Llama4ForConditionalGeneration is multimodal; its text model llama4_text is swept",
    "qwen3_5": "multimodal wrapper; its text model qwen3_5_text is swept",
    "mllama": "Llama-3.2-Vision: cross-attention to image tokens (multimodal only)",
    "bart": "encoder-decoder family (bart, mbart, marian, pegasus, blenderbot, ...): not decoder-only",
    "bert": "encoder families used as decoders (bert, roberta, electra, ...): not decoder-only causal LMs",
}


# ---------------------------------------------------------------------------------------------------
# Models and inputs
# ---------------------------------------------------------------------------------------------------


def arch_by_name(name: str) -> Arch:
    for arch in ARCHS:
        if arch.name == name:
            return arch
    raise KeyError(f"{name!r} is not in the sweep; known: {', '.join(a.name for a in ARCHS)}")


def build_config(arch: Arch) -> Any:
    """A tiny config: :data:`BASE` (+ :data:`MOE`) + the architecture's overrides; dropout and noise off."""
    import transformers

    kw = {**BASE, **(MOE if arch.moe else {}), **arch.overrides}
    kw = {k: v for k, v in kw.items() if v is not DROP}
    config = getattr(transformers, arch.config_class)(**kw)
    for key, value in config.to_dict().items():  # exactness needs determinism: no dropout, no router jitter
        if isinstance(value, float) and re.search(r"dropout|pdrop|jitter", key) and value:
            setattr(config, key, 0.0)
    return config


def build_model(arch: Arch, seed: int = 0) -> torch.nn.Module:
    import transformers

    config = build_config(arch)
    torch.manual_seed(seed)
    return getattr(transformers, arch.model_class)(config).float().train()


def make_batch(vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """``(BATCH, SEQ)`` tokens with SFT-style labels: a prompt per row and a few scattered targets ignored."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[1, :19] = -100  # rank 0's whole half of row 1 is prompt
    labels[0, [12, 13, 27]] = -100
    return {"input_ids": ids, "labels": labels}


# ---------------------------------------------------------------------------------------------------
# One (architecture, mode) on every rank
# ---------------------------------------------------------------------------------------------------


def _clean(message: str) -> str:
    """The first line of an error, without object ids (stable across runs, for the docs)."""
    line = (message.strip().splitlines() or [""])[0]
    line = re.sub(r"longctx_(ulysses|fpdt)_[0-9a-f]+", r"longctx_\1_<id>", line)
    return re.sub(r"0x[0-9a-f]+", "0x…", line)


def _first_forward_failed(row: dict[str, Any], e: BaseException) -> dict[str, Any]:
    """``row`` for a first forward that raised: ``refused`` when the package raised it, else a crash."""
    row["where"] = _where(e)
    if _raised_by_package(e):
        row.update(verdict="refused", reason=_clean(str(e)))
    else:
        row["reason"] = f"crashed in the first forward ({type(e).__name__}: {_clean(str(e))})"
    return row


def _raised_by_package(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(PACKAGE_DIR)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    path = last.filename
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{last.lineno}"


def _flat_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


def _run_one(arch: Arch, mode: str, group: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_longctx import disable_sequence_parallel, enable_sequence_parallel, shard_batch

    chunk = MODES[mode]
    start = time.perf_counter()
    model = build_model(arch)
    sp_model = copy.deepcopy(model)
    batch = make_batch()
    ref = model(**batch)
    ref.loss.backward()
    ref_loss = ref.loss.item()
    ref_grads = _flat_grads(model)
    names = [n for n, _ in model.named_parameters()]
    del model, ref

    row: dict[str, Any] = {"arch": arch.name, "mode": mode, "verdict": "WRONG", "reason": "", "where": ""}
    try:
        try:
            enable_sequence_parallel(sp_model, group=group, mode=mode, chunk_size=chunk)
            out = sp_model(**shard_batch(batch, group=group, chunk_size=chunk))
            if out.loss is None:
                raise AssertionError("the sequence-parallel model returned no loss")
        except REFUSALS as e:
            return _first_forward_failed(row, e)
        except Exception as e:
            row.update(
                reason=f"crashed in the first forward ({type(e).__name__}: {_clean(str(e))})", where=_where(e)
            )
            return row
        loss = out.loss.item()
        try:
            out.loss.backward()
        except Exception as e:
            row.update(reason=f"crashed in backward ({type(e).__name__}: {_clean(str(e))})", where=_where(e))
            return row
        grads = _flat_grads(sp_model)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if group is not None:
            dist.all_reduce(flat, group=group)  # the strategy SUMS gradients over the SP ranks
        grads = list(flat.split([g.numel() for g in grads]))
        scale = max(r.abs().max().item() for r in ref_grads)
        errs = {}
        for name, g, r in zip(names, grads, ref_grads):
            denom = max(r.abs().max().item(), GRAD_FLOOR * scale, 1e-30)
            errs[name] = (g.reshape(r.shape) - r).abs().max().item() / denom
        worst = max(errs, key=errs.get)
        loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
        row.update(loss_err=loss_err, grad_err=errs[worst], worst_param=worst, ref_loss=ref_loss, loss=loss)
        if loss_err <= TOLERANCE and errs[worst] <= TOLERANCE:
            row["verdict"] = "exact"
            try:  # an exact model must pass the strategy's self-test too, in fp32 and bf16 (no false refusal)
                row["self_test"] = self_test_errors(sp_model, batch, group)
            except Exception as e:
                row.update(verdict="WRONG", reason=f"exact, but the self-test refused it: {_clean(str(e))}")
        else:
            bad = sorted(n for n, e in errs.items() if e > TOLERANCE)
            row["bad_params"] = bad
            row["reason"] = (
                "the loss differs" if loss_err > TOLERANCE else "the loss matches but gradients differ"
            )
        return row
    finally:
        disable_sequence_parallel(sp_model)
        row["seconds"] = time.perf_counter() - start


#: The precisions the self-test runs each exact architecture in, and their autocast.
SELF_TEST_PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16}


def self_test_errors(
    sp_model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    group: Any,
    precisions: dict[str, torch.dtype | None] = SELF_TEST_PRECISIONS,
) -> dict[str, float | None]:
    """The strategy's self-test (``self_test.run_self_test``) of a patched model in each of ``precisions`` (a
    precision -> its autocast dtype): its largest relative error in the precision's own dtype; it raises on a
    refusal. ``None`` where the plain model itself cannot run in that precision (DBRX's experts under CPU bf16
    autocast: ``index_add_`` of bf16 into fp32), which the self-test then cannot judge either."""
    import contextlib

    from lightning_longctx.integrations.transformers import context_of, sequence_parallel_off
    from lightning_longctx.parallel.self_test import SelfTestFailed, run_self_test

    ctx = context_of(sp_model)
    worst: dict[str, float | None] = {}
    for precision, dtype in precisions.items():
        autocast = (
            contextlib.nullcontext if dtype is None else (lambda d=dtype: torch.autocast("cpu", dtype=d))
        )
        try:
            (report,) = run_self_test(
                [sp_model], [ctx], batch, config=ctx.config, group=group, precision=precision,
                autocast=autocast, device=torch.device("cpu"), fp32_layout=False,  # "32-true" runs that one
            )  # fmt: skip
        except SelfTestFailed:
            raise
        except Exception as e:
            with sequence_parallel_off(sp_model), autocast(), torch.no_grad():
                try:
                    sp_model(**batch)
                except type(e):
                    worst[precision] = None  # the plain model fails alike
                    continue
            raise
        worst[precision] = max(report.checks[-1].errors.values())  # the check in the precision's own dtype
    return worst


def sweep(mode: str, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Run on every rank of the default gloo group: the verdict table of ``mode``, the same on every rank."""
    import torch.distributed as dist

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {list(MODES)}")
    group = dist.group.WORLD
    archs = ARCHS if names is None else [arch_by_name(n) for n in names]
    rows = [_run_one(arch, mode, group) for arch in archs]
    return _merge(rows)


def _merge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's rows -> one table, the same on every rank (a verdict the ranks disagree on is WRONG)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    merged = []
    for per_rank in zip(*gathered):
        row = dict(per_rank[0])
        if len({(r["verdict"], r["reason"]) for r in per_rank}) > 1:
            row.update(
                verdict="WRONG",
                reason=f"the ranks disagree: {[(r['verdict'], r['reason']) for r in per_rank]}",
            )
        if "loss_err" in row:
            row["loss_err"] = max(r["loss_err"] for r in per_rank)  # every rank returns the global loss
        merged.append(row)
    return merged


# ---------------------------------------------------------------------------------------------------
# Packed documents on hybrids: a packed row against its documents run alone through the plain model
# ---------------------------------------------------------------------------------------------------

#: Document lengths of the packed rows (:data:`SEQ` tokens each). Starts at 0, 5, 6, 8, 17, 24 and 0, 16, 17:
#: documents of one token (5, 16), starts exactly at a shard start (16 at P = 2; 8, 16, 24 at P = 4) and at
#: FPDT chunk starts (8, 16, 24 with chunks of 4), documents across shards and chunks (8..16, 17..31).
PACKED_DOCS = ((5, 1, 2, 9, 7, 8), (16, 1, 15))
#: The hybrids whose packed rows are exact; the others refuse them by name (``hybrid/base.py``).
PACKED_EXACT = ("lfm2", "qwen3_next", "qwen3_5_text", "minimax", "jamba", "bamba", "falcon_h1",
                "granitemoehybrid", "nemotron_h", "olmo_hybrid", "recurrent_gemma", "kimi_linear", "mamba",
                "mamba2", "falcon_mamba", "xlstm", "rwkv")  # fmt: skip
#: float64 models; the kernels' own float32 insides (gated DeltaNet, Mamba-2) set the error floor.
PACKED_TOLERANCE = 1e-5


def make_packed_batch(vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """:data:`PACKED_DOCS` packed into ``(BATCH, SEQ)`` rows: position ids restarting at 0 per document, the
    first token of every document without a target (a packed row predicts no token across a document start)
    and a 2-token prompt in the longest ones."""
    g = torch.Generator().manual_seed(4321)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    labels, pos = ids.clone(), torch.zeros_like(ids)
    for row, lengths in enumerate(PACKED_DOCS):
        assert sum(lengths) == SEQ and len(PACKED_DOCS) == BATCH
        start = 0
        for n in lengths:
            pos[row, start : start + n] = torch.arange(n)
            labels[row, start : start + (2 if n >= 8 else 1)] = -100
            start += n
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _documents_alone(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """The packed rows' loss as one process computes it from each document run ALONE through the plain
    model (summed token losses over the batch's valid targets); backward runs, gradients are left on."""
    import torch.nn.functional as F

    valid = int((batch["labels"][:, 1:] != -100).sum())  # every target is inside its document (see above)
    total = 0.0
    for row, lengths in enumerate(PACKED_DOCS):
        start = 0
        for n in lengths:
            if n > 1:  # a one-token document has no target
                ids = batch["input_ids"][row : row + 1, start : start + n]
                labels = batch["labels"][row, start + 1 : start + n]
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
                loss = F.cross_entropy(logits.double(), labels, ignore_index=-100, reduction="sum") / valid
                loss.backward()
                total += loss.item()
            start += n
    return total


def _run_packed(arch: Arch, mode: str, group: Any, checkpointing: bool = False) -> dict[str, Any]:
    """One hybrid, packed rows, float64: loss and every gradient against :func:`_documents_alone`;
    ``checkpointing``: the sequence-parallel model recomputes its layers in backward (transformers' gradient
    checkpointing), where the mixers read the batch's documents from the context."""
    import torch.distributed as dist

    from lightning_longctx import disable_sequence_parallel, enable_sequence_parallel, shard_batch

    chunk = MODES[mode]
    start = time.perf_counter()
    packed_arch = Arch(arch.name, arch.model_class, arch.config_class, arch.what,
                       {**arch.overrides, "output_router_logits": False}, arch.moe)  # fmt: skip
    model = build_model(packed_arch).double()
    model.config._experts_implementation = "eager"  # grouped_mm takes no float64
    sp_model = copy.deepcopy(model)
    batch = make_packed_batch()
    names = [n for n, _ in model.named_parameters()]
    row: dict[str, Any] = {"arch": arch.name, "mode": mode, "verdict": "WRONG", "reason": "", "where": ""}
    if checkpointing:
        sp_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        try:
            enable_sequence_parallel(sp_model, group=group, mode=mode, chunk_size=chunk)
            loss = sp_model(**shard_batch(batch, group=group, chunk_size=chunk)).loss
        except REFUSALS as e:
            return _first_forward_failed(row, e)
        ref_loss = _documents_alone(model, batch)  # after the forward: a refused model needs no reference
        ref_grads = _flat_grads(model)
        loss.backward()
        grads = _flat_grads(sp_model)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if group is not None:
            dist.all_reduce(flat, group=group)  # the strategy SUMS gradients over the SP ranks
        grads = list(flat.split([g.numel() for g in grads]))
        scale = max(r.abs().max().item() for r in ref_grads)
        errs = {
            name: (g.reshape(r.shape) - r).abs().max().item() / max(r.abs().max().item(), GRAD_FLOOR * scale)
            for name, g, r in zip(names, grads, ref_grads)
        }
        worst = max(errs, key=errs.get)
        loss_err = abs(loss.item() - ref_loss) / abs(ref_loss)
        row.update(
            loss_err=loss_err, grad_err=errs[worst], worst_param=worst, ref_loss=ref_loss, loss=loss.item()
        )
        if loss_err <= PACKED_TOLERANCE and errs[worst] <= PACKED_TOLERANCE:
            row["verdict"] = "exact"
            try:  # and the self-test on packed rows (its probe then packs two documents), in float64
                row["self_test"] = self_test_errors(sp_model, batch, group, {"64-true": None})
            except Exception as e:
                row.update(verdict="WRONG", reason=f"exact, but the self-test refused it: {_clean(str(e))}")
        else:
            row["bad_params"] = sorted(n for n, e in errs.items() if e > PACKED_TOLERANCE)
            row["reason"] = "the loss differs" if loss_err > PACKED_TOLERANCE else "gradients differ"
        return row
    except Exception as e:
        row.update(reason=f"crashed ({type(e).__name__}: {_clean(str(e))})", where=_where(e))
        return row
    finally:
        disable_sequence_parallel(sp_model)
        row["seconds"] = time.perf_counter() - start


def sweep_packed(
    mode: str, names: list[str] | None = None, checkpointing: bool = False
) -> list[dict[str, Any]]:
    """:func:`sweep` for packed rows of the hybrids (default: all of :data:`HYBRIDS`), on every rank."""
    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_initialized() else None  # None: one process, no process group
    rows = [_run_packed(arch_by_name(n), mode, group, checkpointing) for n in (names or HYBRIDS)]
    return rows if group is None else _merge(rows)


def run_all(names: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Both modes on a fresh pool of :data:`WORLD` gloo processes (the script entry; tests use ``dist_pool``)."""
    import arch_sweep  # the ranks unpickle functions of the importable module, not of __main__

    from lightning_longctx.testing import DistPool

    pool = DistPool(WORLD)
    try:
        return {mode: pool.run(arch_sweep.sweep, mode, names)[0] for mode in MODES}
    finally:
        pool.close()


# ---------------------------------------------------------------------------------------------------
# docs/architectures.md
# ---------------------------------------------------------------------------------------------------

HYBRID_SUPPORT = """\
## Hybrid and attention-free models

Sequence parallelism cuts the sequence across ranks. Attention sees every token after the all-to-all; a layer
that mixes tokens some other way sees only its own shard, so each kind of mixer needs its own exchange
(`lightning_longctx/integrations/hybrid/`, one module per kind, around the kernel function the model calls:
the fla / causal-conv1d / mamba-ssm kernel on GPU and the torch fallback on CPU take the same adapter):

| mixer (models) | what crosses a shard edge | how it is made exact | bytes per rank per layer | packed rows |
| --- | --- | --- | --- | --- |
| causal short convolution, kernel k (LFM2; the conv in front of gated DeltaNet, Kimi delta attention, Mamba-1/2) | the k-1 inputs before each segment | `halo_exchange`: every segment receives the last k-1 inputs of the segment before it (another rank), the model's function runs on `[halo \\| segment]`; the gradient goes back | (k-1) x channels, each way | exact: one piece per document behind zeros, the halo masked to its document |
| gated DeltaNet, Kimi delta attention (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi-Linear) | the state S (heads x d_k x d_v) | the segment is affine in its entry state, `S_out = M S_in + B`: one call of the model's function with values `[v \\| 0]` from the entry state `[0 \\| I]` gives `o⁰`, `R`, `B`, `M`; `exclusive_affine_scan` (one all-gather of `[M \\| B]`) gives `S_in`; `o = o⁰ + R S_in` | (P-1) x heads x d_k x (d_k + d_v) fp32 forward, (P-1) x heads x d_k x d_v backward | exact: one piece per document, neutral tokens (`β = 0, g = 0`) in front; `M = 0` where a document starts |
| Mamba-2 SSD (Mamba-2, Bamba, Falcon-H1, Granite-4 hybrid, Nemotron-H) | the state (heads x d_head x d_state) | the same scan with a scalar decay per head `M = exp(A ΣΔ)` in closed form; `y += exp(A cumΔ_t) S_in C_t` | (P-1) x heads x (1 + d_head x d_state) fp32 forward | exact: pieces from a zero state, the correction on the first piece only; `M = 0` where a document starts |
| Mamba-1 selective scan (Mamba, Falcon-Mamba, Jamba) | the diagonal state (d_inner x d_state) | the scan takes no entry state: `B_r` and the correction `C_t (exp(A cumΔ_t) ⊙ S_in)` (before the `silu(z)` gate) in closed form | (P-1) x 2 d_inner x d_state fp32 forward | exact: as Mamba-2 (`B_r` from the last piece) |
| RG-LRU and its conv (RecurrentGemma) | the diagonal state (lru_width) and k-1 conv inputs | halo for the conv; `h = h⁰ + (∏ a) ⊙ S_in`, the model's own reset at position 0 | (P-1) x 2 lru_width | exact (the conv by pieces; the RG-LRU resets itself) |
| lightning attention (MiniMax) | the state (heads x d x d), decay `λ` fixed per head | the forward's block loop per segment from zero, `o += λ^(t+1) q_t S_in`, `M = λ^c` | (P-1) x heads x d² | exact: pieces from a zero state; the correction on the segment, where the first piece starts at t = 0 (behind padding, `λ` would decay the entry state); `M = 0` where a document starts |
| RWKV-4 (token shift + WKV), xLSTM mLSTM | the previous token; a log-scale state `(num, den, max)` / `(C, n, m)` | a one-token halo for the shift; summaries from zero folded in log scale, then the model's own kernel run again from the true entry state (the output is a ratio, not affine) | (P-1) x 4 d_att (RWKV); (P-1) x heads x (d_qk d_v + d_qk + 2) (xLSTM) | exact: the shift by pieces (halo masked); the first run on pieces behind padding no sum or max sees (RWKV keys -1e30; xLSTM `i = 0, f = 1`), the rerun from the entry state kept for a first piece that continues a document; `M = 0` where a document starts |

Packed documents (position ids restarting at 0): a packed row equals its documents run one by one through the
plain model, on one device too (a plain Hugging Face model lets the state flow from one document into the next).
Each segment runs one piece per document, right-aligned behind neutral tokens (zeros; for RWKV's and xLSTM's
log-scale normalisers, tokens no sum or max sees); only its first piece takes the halo (masked to its own
document: ids from the batch's global positions, no extra collective) and the entry state, at the document's
first real token (a decay would act on it through the padding), and a segment holding a document start passes
no earlier state on (`M = 0`), so gradients stop there too. Exact in float64 against each document run alone,
P = 1, 2, 4, Ulysses and FPDT, activation checkpointing included (tests/test_hybrid_packed.py): all 17 hybrids
of the sweep, LFM2, Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi-Linear, MiniMax, Jamba, Bamba, Falcon-H1, Granite-4
hybrid, Nemotron-H, RecurrentGemma, Mamba, Mamba-2, Falcon-Mamba, xLSTM, RWKV (Zamba2 takes the same Mamba-2
adapter). A mixer kind whose adapter cannot reset its state refuses packed rows, naming the mixer.
"""


def _cell(row: dict[str, Any]) -> str:
    return {"exact": "exact", "refused": "refused", "WRONG": "**WRONG**"}[row["verdict"]]


def render_docs(results: dict[str, list[dict[str, Any]]]) -> str:
    """docs/architectures.md from the verdicts: deterministic (no error numbers), so a test can compare it."""
    modes = list(MODES)
    by_arch = {
        arch.name: {m: next(r for r in results[m] if r["arch"] == arch.name) for m in modes} for arch in ARCHS
    }
    lines = [
        "# Architecture sweep",
        "",
        "<!-- Generated by `python tests/arch_sweep.py --write-docs`; tests/test_arch_sweep.py fails when it is stale. -->",
        "",
        f"{len(ARCHS)} decoder-only causal LMs of transformers, each a tiny random model built from its config class "
        f"(hidden 32, 2 layers, 4 heads / 2 kv heads where allowed, vocab {VOCAB}, float32), run at sequence-parallel "
        f"size {WORLD} on gloo through `enable_sequence_parallel(model, group=..., mode=...)` and `shard_batch` on "
        f"{BATCH} sequences of {SEQ} tokens with SFT-style labels (`-100` on a prompt and a few targets). FPDT uses "
        f"`chunk_size={FPDT_CHUNK}`: {SEQ // WORLD // FPDT_CHUNK} chunks per rank. Mixture-of-experts models run with "
        "`output_router_logits=True` and `router_aux_loss_coef=0.1`, so their load-balancing loss is part of the loss.",
        "",
        f"* **exact**: the loss on every rank and every parameter's gradient, summed over the ranks (the strategy's "
        f"gradient reduction), equal the plain model's on one process within a relative error of {TOLERANCE:g}.",
        "* **refused**: `enable_sequence_parallel` or the first forward raised a clear error (the message is below) "
        "instead of training the model wrong.",
        "* **WRONG**: it ran and the result differs from the plain model (a bug: tests/test_arch_sweep.py fails).",
        "",
        "| verdicts | " + " | ".join(modes) + " |",
        "| --- | " + " | ".join("---" for _ in modes) + " |",
    ]
    for verdict in ("exact", "refused", "WRONG"):
        counts = [sum(r["verdict"] == verdict for r in results[m]) for m in modes]
        lines.append(f"| {verdict} | " + " | ".join(map(str, counts)) + " |")
    lines += ["", "| model type | class | what it exercises | " + " | ".join(modes) + " |"]
    lines.append("| --- | --- | --- | " + " | ".join("---" for _ in modes) + " |")
    for arch in ARCHS:
        cells = " | ".join(_cell(by_arch[arch.name][m]) for m in modes)
        lines.append(f"| `{arch.name}` | `{arch.model_class}` | {arch.what} | {cells} |")
    lines += ["", "## Refusals and failures", ""]
    for arch in ARCHS:
        rows = by_arch[arch.name]
        reasons: dict[str, list[str]] = {}
        for m in modes:
            if rows[m]["verdict"] != "exact":
                reasons.setdefault(f"{rows[m]['verdict']}: {rows[m]['reason']}", []).append(m)
        for reason, ms in reasons.items():
            lines.append(f"* `{arch.name}` ({', '.join(ms)}) {reason}")
    lines += ["", HYBRID_SUPPORT, "## Not swept", "", "| model type | why |", "| --- | --- |"]
    lines += [f"| `{name}` | {why} |" for name, why in SKIPPED.items()]
    return "\n".join(lines) + "\n"


def format_table(results: dict[str, list[dict[str, Any]]]) -> str:
    out = []
    for mode, rows in results.items():
        for r in rows:
            nums = (
                f"loss {r['loss_err']:.1e} grad {r['grad_err']:.1e} ({r['worst_param']})"
                if "loss_err" in r
                else ""
            )
            out.append(
                f"{mode:8s} {r['arch']:20s} {r['verdict']:8s} {r.get('seconds', 0):5.2f}s {nums} {r['reason'][:160]}"
                + (f" @ {r['where']}" if r["where"] and r["verdict"] != "exact" else "")
            )
    return "\n".join(out)


def self_test_floors(results: dict[str, list[dict[str, Any]]]) -> str:
    """The self-test's noise floor per mode and precision: its largest relative error over the exact
    architectures, and which architecture showed it (what ``self_test.TOLERANCE`` is set against)."""
    lines = ["self-test noise floor (largest relative error over the exact architectures):"]
    for mode, rows in results.items():
        for precision in SELF_TEST_PRECISIONS:
            seen = [
                (r["self_test"][precision], r["arch"])
                for r in rows
                if r.get("self_test", {}).get(precision) is not None
            ]
            if seen:
                err, arch = max(seen)
                lines.append(f"  {mode:8s} {precision:10s} {err:.1e} ({arch}; {len(seen)} architectures)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write-docs", action="store_true", help=f"write {DOCS.relative_to(ROOT)}")
    p.add_argument("--only", default=None, help="comma-separated model types (prints, never writes the docs)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = args.only.split(",") if args.only else None
    start = time.perf_counter()
    results = run_all(names)
    print(format_table(results))
    print(self_test_floors(results))
    print(f"{time.perf_counter() - start:.0f}s")
    if args.write_docs and names is None:
        DOCS.write_text(render_docs(results))
        print(f"wrote {DOCS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
