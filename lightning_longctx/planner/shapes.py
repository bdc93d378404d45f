"""The model's shape, from a Hugging Face config: what the memory planner and the FLOP count read.

:func:`decoder_dims` reads ``(d, L, H, H_kv, hd, I, V)`` of a decoder config and :func:`matmul_params_of`
counts the weights a token goes through a matmul with; :mod:`lightning_longctx.planner.flops` counts its FLOPs
from the same two, so the planner and the MFU callback never disagree on a model. :func:`model_shape` adds
what only memory needs: every parameter counted on the meta device (the largest block, the root, one block's
linears for LoRA), how the model's tensor-parallel plan splits them, and each layer's kind for hybrid
models (gated DeltaNet, Mamba-2).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

#: Model types with a plain two-matrix MLP (up, down); every other decoder config is taken as gated.
NON_GATED_MODEL_TYPES = frozenset(
    {"phi", "starcoder2", "gpt_neox", "gpt2", "gpt_bigcode", "gptj", "falcon", "opt", "bloom", "codegen"}
)


def text_config(config: Any) -> Any:
    """The decoder (text) part of a config: ``get_text_config()`` of a multimodal one, else the config."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


#: the fields :func:`decoder_dims` needs
_DECODER_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None)
    return default if value is None else value


class Dims(NamedTuple):
    """A decoder's dims: hidden ``d``, ``layers``, query ``heads`` and ``kv_heads`` of ``head_dim``, the MLP's
    ``inter`` width and the ``vocab``."""

    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int


def decoder_dims(config: Any) -> Dims:
    """The :class:`Dims` of a (text) decoder config; a clear error when a field is missing or the config is a
    mixture-of-experts one (its active weights are not modelled)."""
    missing = [name for name in _DECODER_FIELDS if getattr(config, name, None) is None]
    if missing:
        raise ValueError(
            f"{type(config).__name__} lacks {missing}: the FLOP count and the memory planner read Hugging Face "
            "decoder configs (Llama, Qwen, Mistral, Gemma, Phi-3, ...). Pass `flops_per_token=` to MFUMonitor "
            "for other models."
        )
    if _get(config, "num_experts_per_tok") is not None or _get(config, "num_local_experts") is not None:
        raise ValueError(
            f"{type(config).__name__} is a mixture-of-experts config; its active FLOPs and its experts' memory "
            "are not modelled here. Pass `flops_per_token=` to MFUMonitor."
        )
    d = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    return Dims(
        d=d,
        layers=int(config.num_hidden_layers),
        heads=heads,
        kv_heads=int(_get(config, "num_key_value_heads", heads)),
        head_dim=int(_get(config, "head_dim", d // heads)),
        inter=int(config.intermediate_size),
        vocab=int(config.vocab_size),
    )


def has_gated_mlp(config: Any) -> bool:
    """Whether the MLP has three matrices (gate, up, down: Llama, Qwen, Mistral, Gemma, Phi-3) or two."""
    return getattr(config, "model_type", None) not in NON_GATED_MODEL_TYPES


# ---------------------------------------------------------------------------------------------------
# What memory reads of a model
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """Everything the planner reads of a model: its :class:`Dims`, parameter counts, tensor-parallel split and
    layer kinds."""

    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    gated: bool
    params: int  # all parameters (tied ones once)
    block_params: int  # the largest transformer block (FSDP's unit)
    root_params: int  # parameters outside the blocks: embedding, head, final norm
    matmul_params: int  # weights that go through a matmul (autocast casts these)
    head_params: int  # the lm_head weight (its gradient comes first in backward)
    model_name: str
    softcap: bool  # a final-logit soft-cap (Gemma-2): the chunked loss backward keeps two blocks
    block_linears: tuple[tuple[str, int, int], ...]  # one block's nn.Linear: (name, in, out), for LoRA
    tp: _TPSplit  # how the model's tensor-parallel plan splits its parameters
    blocks: tuple[_Block, ...] = ()  # each decoder layer's mixers (hybrid models); empty: all Llama blocks
    gdn: _GDNDims | None = None  # the gated DeltaNet layers' dims, when the model has some
    mamba2: _Mamba2Dims | None = None  # the Mamba-2 layers' dims, when the model has some


#: ``(rows along the split dim, elements per row)`` of parameters split over tp, summed per row count
_Split = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _TPSplit:
    """What ``tensor_parallel_size`` splits (:func:`lightning_longctx.parallel.tensor_parallel.tp_plan_of`, applied by
    transformers' styles): colwise / packed_colwise parameters along their output dim (dim 0; dim 1 of a 3-D
    expert tensor), rowwise / packed_rowwise weights along their last dim (a rowwise bias stays replicated),
    everything else replicated (embedding, norms, Qwen3's q/k norms, a MoE router). A split of ``n`` rows
    leaves the largest rank ``ceil(n / tp)`` of them (DTensor's ``Shard``)."""

    styles: tuple[str, ...]  # the plan's styles, sorted (empty: the model declares no plan)
    blocks: _Split  # every block's split parameters
    block: _Split  # the largest block's
    head: int  # elements of an lm_head that can split over the vocabulary (an untied nn.Linear); 0: it cannot

    @staticmethod
    def removed(split: _Split, tp: int) -> int:
        """Elements of ``split`` one rank does not hold when split ``tp`` ways."""
        return sum((n - -(-n // tp)) * rest for n, rest in split)


# ---------------------------------------------------------------------------------------------------
# Layer kinds: which mixer each decoder layer runs (hybrid models)
# ---------------------------------------------------------------------------------------------------

ATTENTION, GATED_DELTANET, MAMBA2 = "attention", "gated_deltanet", "mamba2"
#: models whose ``linear_attention`` layers are gated DeltaNet (``torch_chunk_gated_delta_rule``)
_GDN_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next",
                              "olmo_hybrid"})  # fmt: skip
#: models whose ``linear_attention`` (``mamba``) layers are Mamba-2 SSD (``mamba2_chunk_scan``)
_MAMBA2_MODEL_TYPES = frozenset({"mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h"})
#: models (or layer kinds) whose recurrent layers the planner does not model, and what they run
_UNMODELLED = {
    "minimax": "MiniMax lightning attention",
    "kimi_linear": "Kimi delta attention (with MLA attention)",
    "mamba": "Mamba-1 selective scan",
    "falcon_mamba": "Mamba-1 selective scan",
    "jamba": "Mamba-1 selective scan",
    "recurrent_gemma": "RG-LRU recurrence",
    "rwkv": "RWKV time mixing",
    "xlstm": "xLSTM (mLSTM) recurrence",
    "zamba2": "Zamba2 shared hybrid blocks",
    "lfm2": "LFM2 short convolutions",
}
#: the chunk of HF's ``torch_chunk_gated_delta_rule`` (its callers leave the default)
GDN_CHUNK_SIZE = 64


@dataclass(frozen=True)
class _Block:
    """One decoder layer: its token mixers (Falcon-H1 runs attention and Mamba-2 side by side on one norm's
    output) and whether an MLP (with its own norm) follows (Mamba-2's blocks have none)."""

    mixers: tuple[str, ...]
    mlp: bool = True


_LLAMA_BLOCK = _Block((ATTENTION,))


@dataclass(frozen=True)
class _GDNDims:
    """A gated DeltaNet layer: ``key_heads`` q/k heads of ``dk``, ``heads`` value heads of ``dv`` (q/k are
    repeated to them), a causal conv of ``conv`` taps over q, k, v, chunks of ``chunk`` tokens."""

    key_heads: int
    heads: int
    dk: int
    dv: int
    conv: int
    chunk: int = GDN_CHUNK_SIZE

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (q, k, v): ``in_proj_qkv``'s width."""
        return 2 * self.key_heads * self.dk + self.heads * self.dv


@dataclass(frozen=True)
class _Mamba2Dims:
    """A Mamba-2 layer: ``heads`` of ``head_dim`` (``inner`` = their product), state size ``state`` shared by
    ``groups`` groups of heads (B, C), a causal conv of ``conv`` taps over x, B, C, SSD chunks of ``chunk``."""

    heads: int
    head_dim: int
    state: int
    groups: int
    conv: int
    chunk: int
    inner: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C."""
        return self.inner + 2 * self.groups * self.state


def _refuse_kind(config: Any, kind: str) -> None:
    raise ValueError(
        f"{type(config).__name__} has {kind} layers, which plan_memory does not model (it knows attention, "
        "gated DeltaNet and Mamba-2 layers); plan a model of those kinds, or measure this one"
    )


def _layer_types(config: Any) -> list[str] | None:
    """The per-layer kinds the config declares (``layer_types``, else ``layers_block_type``)."""
    for name in ("layer_types", "layers_block_type"):
        kinds = getattr(config, name, None)
        if kinds is not None:
            return [str(k) for k in kinds]
    return None


def _block_of(config: Any, kind: str) -> _Block:
    """One layer kind of a config as a :class:`_Block` (a ValueError naming a kind it does not model)."""
    model_type = getattr(config, "model_type", "")
    if kind == "linear_attention" or kind == "mamba":
        if model_type in _GDN_MODEL_TYPES:
            return _Block((GATED_DELTANET,))
        if model_type in _MAMBA2_MODEL_TYPES:  # Mamba-2 and Nemotron-H blocks are the mixer alone
            return _Block((MAMBA2,), mlp=model_type not in ("mamba2", "nemotron_h"))
        _refuse_kind(config, f"{kind!r} ({model_type})")
    if kind == "hybrid" and model_type == "falcon_h1":
        return _Block((ATTENTION, MAMBA2))
    if kind == "mlp" and model_type == "nemotron_h":
        return _Block((), mlp=True)
    if kind.endswith("attention") and kind != "linear_attention":
        return _Block((ATTENTION,), mlp=model_type != "nemotron_h")
    _refuse_kind(config, repr(kind))
    raise AssertionError  # unreachable: _refuse_kind raises


def _blocks_of(config: Any) -> tuple[_Block, ...]:
    """Each decoder layer's :class:`_Block`; ``()`` for a model of Llama blocks only. Recurrent kinds the
    planner does not model are refused here, naming the kind, before anything counts them as attention."""
    model_type = getattr(config, "model_type", "")
    if model_type in _UNMODELLED:
        _refuse_kind(config, _UNMODELLED[model_type])
    kinds = _layer_types(config)
    if model_type == "mamba2":  # attention-free: every layer is a Mamba-2 block
        kinds = ["mamba"] * int(config.num_hidden_layers)
    if kinds is None:
        return ()
    blocks = tuple(_block_of(config, kind) for kind in kinds)
    return () if all(b == _LLAMA_BLOCK for b in blocks) else blocks


def _gdn_dims(config: Any) -> _GDNDims:
    return _GDNDims(key_heads=int(config.linear_num_key_heads), heads=int(config.linear_num_value_heads),
                    dk=int(config.linear_key_head_dim), dv=int(config.linear_value_head_dim),
                    conv=int(config.linear_conv_kernel_dim))  # fmt: skip


def _mamba2_dims(config: Any) -> _Mamba2Dims:
    """The Mamba-2 fields, under each family's names (Mamba2 / Nemotron-H, or Bamba / Granite / Falcon-H1's
    ``mamba_*``)."""

    def get(*names: str) -> int:
        value = next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
        if value is None:
            raise ValueError(
                f"{type(config).__name__} lacks {names[0]!r}: its Mamba-2 layers cannot be planned"
            )
        return int(value)

    d = int(config.hidden_size)
    heads, head_dim = (
        get("mamba_n_heads", "mamba_num_heads", "num_heads"),
        get("mamba_d_head", "mamba_head_dim", "head_dim"),
    )
    inner = getattr(config, "mamba_d_ssm", None) or heads * head_dim or get("mamba_expand", "expand") * d
    return _Mamba2Dims(heads=heads, head_dim=head_dim, state=get("mamba_d_state", "ssm_state_size", "state_size"),
                       groups=get("mamba_n_groups", "n_groups"), conv=get("mamba_d_conv", "conv_kernel"),
                       chunk=get("mamba_chunk_size", "chunk_size"), inner=int(inner))  # fmt: skip


def _mixer_matmul_params(d: int, g: _GDNDims | None, m2: _Mamba2Dims | None, kind: str) -> int:
    """Weights of one recurrent mixer's projections (what autocast casts): GDN's in_proj_qkv, z, b, a and
    out_proj; Mamba-2's in_proj (x, z, B, C, dt) and out_proj."""
    if kind == GATED_DELTANET and g is not None:
        return d * (g.conv_dim + g.heads * g.dv + 2 * g.heads) + g.heads * g.dv * d
    if kind == MAMBA2 and m2 is not None:
        return d * (2 * m2.inner + 2 * m2.groups * m2.state + m2.heads) + m2.inner * d
    return 0


# ---------------------------------------------------------------------------------------------------
# Counting: parameters on the meta device, their tensor-parallel split, the matmul weights
# ---------------------------------------------------------------------------------------------------


def _as_config(config: Any) -> Any:
    if isinstance(config, Mapping):
        if "model_type" not in config:
            raise ValueError(
                f"a config dict needs a 'model_type' key (e.g. 'llama'), as in a LightningCLI model_config; got "
                f"keys {sorted(config)}"
            )
        from transformers import AutoConfig

        cfg = dict(config)
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if not hasattr(config, "hidden_size") and not hasattr(config, "get_text_config"):
        raise TypeError(
            f"config must be a transformers config or a dict with 'model_type', got {type(config).__name__}"
        )
    return config


def _split_dim(style: str, name: str, shape: tuple[int, ...]) -> int | None:
    """The dim a plan style splits a parameter along (transformers' ``shard_param``), ``None``: replicated."""
    if style in ("colwise", "packed_colwise", "colwise_gather_output"):
        return len(shape) - 2 if len(shape) > 1 else 0  # a 3-D expert tensor: (experts, out, in)
    if style in ("rowwise", "packed_rowwise"):
        return None if len(shape) == 1 or name.rsplit(".", 1)[-1] == "bias" else len(shape) - 1
    return None


def _summed(pairs: list[tuple[int, int]]) -> _Split:
    out: dict[int, int] = {}
    for n, rest in pairs:
        out[n] = out.get(n, 0) + rest
    return tuple(sorted(out.items()))


def _tp_split(model: Any, blocks: list[Any]) -> _TPSplit:
    """Each parameter's tensor-parallel split by the model's own plan (works on the meta device)."""
    from lightning_longctx.parallel.tensor_parallel import tp_plan_of, vocab_parallel_head

    plan = tp_plan_of(model)
    split = {}  # id(param) -> (rows, elements per row)
    for name, p in model.base_model.named_parameters():
        dim = _split_dim(plan[name], name, tuple(p.shape)) if name in plan else None
        if dim is not None:
            split[id(p)] = (p.shape[dim], p.numel() // p.shape[dim])
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    largest = blocks[sizes.index(max(sizes))] if blocks else None
    # the strategy's rule for an lm_head that can split (untied, linear); vocab % tp is checked per plan
    head = model.get_output_embeddings() if vocab_parallel_head(model, 1) is not None else None
    return _TPSplit(
        styles=tuple(sorted(set(plan.values()))),
        blocks=_summed([split[id(p)] for b in blocks for p in b.parameters() if id(p) in split]),
        block=_summed([split[id(p)] for p in largest.parameters() if id(p) in split] if largest else []),
        head=0 if head is None else sum(p.numel() for p in head.parameters()),
    )


def _count_params(config: Any) -> tuple[int, int, int, str, tuple[tuple[str, int, int], ...], _TPSplit]:
    """(all, largest block, outside blocks, class name, the largest block's linears, the tensor-parallel
    split) from the model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    block_sizes, in_block, linears, blocks = [], set(), (), []
    for module in model.modules():
        if type(module).__name__ in block_names:
            params = list(module.parameters())
            size = sum(p.numel() for p in params)
            if size > max(block_sizes, default=-1):
                linears = tuple((n.rsplit(".", 1)[-1], m.in_features, m.out_features)
                                for n, m in module.named_modules() if isinstance(m, torch.nn.Linear))  # fmt: skip
            block_sizes.append(size)
            blocks.append(module)
            in_block.update(id(p) for p in params)
    total = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_block)
    try:
        split = _tp_split(model, blocks)
    except Exception:  # a model whose plan cannot be read: no split (tp > 1 is refused), the counts stand
        split = _TPSplit((), (), (), 0)
    return total, max(block_sizes, default=0), root, type(model).__name__, linears, split


@functools.lru_cache(maxsize=32)
def _shape_cached(config_json: str, model_type: str) -> _Shape:
    from transformers import AutoConfig

    fields = json.loads(config_json)
    fields.pop("model_type", None)  # to_diff_dict has it; for_model takes it apart
    return _shape_of(AutoConfig.for_model(model_type, **fields))


def _hybrid_dims(text: Any, blocks: tuple[_Block, ...]) -> Dims:
    """The :class:`Dims` of a hybrid config; an attention-free one (Mamba-2) has no attention or MLP
    fields: one placeholder head of width 0 and no MLP, so the attention and MLP terms count nothing."""
    if any(ATTENTION in b.mixers for b in blocks):
        return decoder_dims(text)
    if getattr(text, "num_experts_per_tok", None) is not None or getattr(text, "num_local_experts", None):
        raise ValueError(
            f"{type(text).__name__} is a mixture-of-experts config; plan_memory does not model experts"
        )
    d, layers, vocab = int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)
    return Dims(d, layers, 1, 1, 0, int(getattr(text, "intermediate_size", 0) or 0), vocab)


def matmul_params_of(dims: Dims, gated: bool, blocks: tuple[_Block, ...] = (), gdn: _GDNDims | None = None,
                     m2: _Mamba2Dims | None = None) -> int:  # fmt: skip
    """Weights of the matmuls one token goes through (every layer and the LM head; no embedding lookup), layer
    by layer: attention's q, k, v, o ``2 * d * hd * (H + H_kv)`` (exact for GQA / MQA), the MLP's ``3 * d * I``
    when gated (else 2), a recurrent mixer's projections, the head ``d * V`` (a matmul even when tied).
    ``blocks=()``: every layer a Llama block."""
    d, layers, heads, kv_heads, head_dim, inter, vocab = dims
    attention = 2 * d * head_dim * (heads + kv_heads)
    mlp = (3 if gated else 2) * d * inter
    total = d * vocab
    for block in blocks or (_LLAMA_BLOCK,) * layers:
        total += mlp if block.mlp else 0
        for kind in block.mixers:
            total += attention if kind == ATTENTION else _mixer_matmul_params(d, gdn, m2, kind)
    return total


def _shape_of(config: Any) -> _Shape:
    text = text_config(config)
    blocks = _blocks_of(text)  # refuses the recurrent kinds it does not model, naming them
    kinds = {kind for b in blocks for kind in b.mixers}
    gdn = _gdn_dims(text) if GATED_DELTANET in kinds else None
    m2 = _mamba2_dims(text) if MAMBA2 in kinds else None
    d, layers, heads, kv_heads, head_dim, inter, vocab = dims = (
        _hybrid_dims(text, blocks) if blocks else decoder_dims(text)
    )
    gated = has_gated_mlp(text)
    n_matmul = matmul_params_of(dims, gated, blocks, gdn, m2)
    try:
        total, block, root, name, linears, tp = _count_params(config)
    except Exception:  # a model transformers cannot build: count the Llama-style weights (and plan)
        tied = bool(getattr(text, "tie_word_embeddings", False))
        block = (n_matmul - d * vocab) // layers + 2 * d
        root = d * vocab * (1 if tied else 2) + d
        total, name = layers * block + root, type(config).__name__.replace("Config", "")
        q, kv = heads * head_dim, kv_heads * head_dim
        linears = (("q_proj", d, q), ("k_proj", d, kv), ("v_proj", d, kv), ("o_proj", q, d),
                   *((("gate_proj", d, inter),) if gated else ()), ("up_proj", d, inter), ("down_proj", inter, d))  # fmt: skip
        # column-wise q/k/v/gate/up split their outputs, row-wise o/down their inputs: (rows, d) each
        one = _summed([(o, i) if n != "o_proj" and n != "down_proj" else (i, o) for n, i, o in linears])
        styles = tuple(sorted(set((getattr(text, "base_model_tp_plan", None) or {}).values())))
        tp = _TPSplit(styles, tuple((n, rest * layers) for n, rest in one), one, 0 if tied else d * vocab)
    return _Shape(d, layers, heads, kv_heads, head_dim, inter, vocab, gated, total, block, root, n_matmul,
                  d * vocab, name, bool(getattr(text, "final_logit_softcapping", None)), linears, tp,
                  blocks, gdn, m2)  # fmt: skip


def model_shape(config: Any) -> _Shape:
    """The :class:`_Shape` of a transformers config, or of a dict with ``model_type`` (as in a LightningCLI
    ``model_config``); cached by the config's contents: one meta-device build per model."""
    config = _as_config(config)
    to_dict = getattr(config, "to_diff_dict", None)
    model_type = getattr(config, "model_type", None)
    if callable(to_dict) and model_type:
        try:
            return _shape_cached(json.dumps(to_dict(), sort_keys=True, default=str), model_type)
        except (TypeError, ValueError):
            pass
    return _shape_of(config)
