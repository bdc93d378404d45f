"""Every transformers symbol lightning_longctx patches, rebinds, reads or calls, checked before a model is made
sequence-parallel: each exists and takes what we pass it, or one error names all that do not.

Sequence parallelism is exact only while transformers' internals are where and what we expect: our attention
and mask functions are registered in its interfaces and stand in for its own, a model's ``loss_function`` is
replaced, the kernel functions of hybrid mixers are rebound to our adapters, the closures of its mask
functions and the decorator of its rotary embeddings are read. A renamed symbol rarely fails loudly: a kernel
reached through a helper we do not rebind runs on this rank's shard alone, a keyword we no longer receive
disappears into ``**kwargs`` (transformers 5.25 did the one to our gated-DeltaNet hybrids, and its hub
kernels erased our patched forwards). :func:`check_symbols` looks at each of them at the start of every
``enable_sequence_parallel``, before anything is patched, and raises one :class:`TransformersSymbolError`
listing every missing or changed symbol with what we use it for, the installed transformers version and the fix.

The table, one :class:`Symbol` per dependency:

* :data:`TRANSFORMERS_SYMBOLS`: what every model relies on, by import path (``"transformers.masking_utils:sdpa_mask"``)
  or on the model's own class / config class (``"<model>:set_attn_implementation"``, ``"<config>:get_text_config"``);
* :data:`KERNELS`: the kernel functions and methods the hybrid adapters wrap (``"*:causal_conv1d_fn"``, ``*`` the
  modeling file of the mixer that reaches it), checked for each mixer the model holds;
* :data:`MIXERS`: the tested hybrids' mixer classes and the kernels their methods must reach by name, directly
  or through a helper of their modeling file (what ``integrations/hybrid`` rebinds), checked for every model
  built from that modeling file.

Four rules read the model's own classes: every attention module calls the attention interface with no keyword
our attention function would drop (:data:`ATTENTION_KEYWORDS`); every rotary embedding's forward takes what
``integrations/rope.py`` passes it; a CausalLM forward that takes ``labels`` computes its loss through
``self.loss_function``; the router outputs its decoder records name their class. Models that do not use a feature are not refused for it: a dense model is not asked about
mixers, a model without ``labels`` about its loss.

Cost: ``inspect.signature`` and code-object reads of ~30 generic symbols and of the model's own classes (each
attention forward parsed once per process): a few milliseconds per model (``tests/test_hf_symbols.py``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_longctx.integrations.hybrid import ADAPTERS, METHODS, _adapted_methods, _function_of, _reach

#: What lightning_longctx does with a symbol: replace it (on an instance, or in a registry with a function of
#: ours that takes what it takes), rebind it (a copy of a mixer's method whose call of it reaches our adapter),
#: read it (its value, code or closure), or call it.
USES = ("patch", "rebind", "read", "call")
#: The newest transformers release the test suite has run on (the floor is the package's requirement).
TESTED_UP_TO = "5.25"

_MISSING = object()


@dataclass(frozen=True, kw_only=True)
class Symbol:
    """One transformers symbol lightning_longctx depends on, and what it must look like.

    ``where``: ``"module:attribute.path"``; the module ``<model>`` / ``<config>`` is the model's class / its config's
    class, ``*`` the modeling file of the class that uses it (:data:`KERNELS`). ``use``: one of :data:`USES`.
    ``why``: what we use it for (it goes into the refusal). ``params``: its leading parameters, in this order
    (``self`` left out): what is passed positionally. ``keywords``: parameters it must have, anywhere: what is
    passed or received by name. ``names``: names its code must use: attributes, closure variables, string
    constants (``"a|b"``: either). ``attributes``: attributes it must have; for a method of :data:`KERNELS`,
    every instance of its class in the model (an adapter that replaces the method reads them). ``optional``:
    absent is fine (our code has a fallback, or the feature is not in older releases); ``when``: checked only
    where this other symbol exists (the feature it serves)."""

    where: str
    use: str
    why: str
    params: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    optional: bool = False
    when: str | None = None

    def __post_init__(self) -> None:
        if self.use not in USES:
            raise ValueError(f"{self.where}: use={self.use!r}; choose one of {USES}")
        if ":" not in self.where:
            raise ValueError(f"where={self.where!r} must be 'module:attribute'")

    @property
    def attribute(self) -> str:
        return self.where.partition(":")[2]


@dataclass(frozen=True, kw_only=True)
class Mixer:
    """A tested hybrid's mixer class: ``cls`` in the modeling file ``module``, whose methods must reach the kernel
    functions ``reaches`` by name (the :data:`~lightning_longctx.integrations.hybrid.ADAPTERS` they are rebound
    to). A class whose kernel is a method (:data:`~lightning_longctx.integrations.hybrid.METHODS`) reaches none."""

    module: str
    cls: str
    reaches: tuple[str, ...] = ()
    why: str


_DELTA = ("g", "beta", "chunk_size", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
_MASK_KEYWORDS = ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "mask_function",
                  "attention_mask", "local_size", "use_vmap", "device")  # fmt: skip
_XLSTM_PARAMS = ("query", "key", "value", "igate", "fgate", "c_initial", "n_initial", "m_initial",
                 "return_last_states", "mode")  # fmt: skip
_MINIMAX_ATTRIBUTES = ("block_size", "slope_rate", "diagonal_decay", "query_decay", "key_decay", "act_fn",
                       "qkv_proj", "num_attention_heads", "head_dim", "norm", "output_gate", "out_proj")  # fmt: skip

TRANSFORMERS_SYMBOLS: tuple[Symbol, ...] = (
    # attention: our function under the model's own key
    Symbol(
        where="transformers:AttentionInterface.register",
        use="call",
        why="registers our attention function under the model's key",
        params=("key", "value"),
    ),
    Symbol(
        where="transformers:AttentionInterface._global_mapping",
        use="patch",
        why="the attention registry our key is removed from on undo (transformers has no public unregister)",
        attributes=("pop", "get"),
    ),
    Symbol(
        where="transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS",
        use="read",
        why="the attention registry models look the key up in",
    ),
    Symbol(
        where="<model>:set_attn_implementation",
        use="call",
        why="points the model's attention layers at our key",
        params=("attn_implementation",),
    ),
    Symbol(
        where="<model>:_supports_attention_backend",
        use="read",
        why="tells a model whose attention goes through the interface from one that computes it inline",
    ),
    Symbol(
        where="<config>:_attn_implementation",
        use="patch",
        why="the key of our attention and mask functions (set directly on attention-free models)",
    ),
    Symbol(
        where="<config>:get_text_config",
        use="call",
        why="the text config whose layer_types, RoPE and heads we read",
    ),
    Symbol(
        where="<config>:nested_rope_parameter_keys",
        use="call",
        why="the per-layer-type RoPE parameters whose length limit we check",
        optional=True,
    ),
    # masks: our mask function in place of sdpa_mask, reading the model's mask function
    Symbol(
        where="transformers.masking_utils:AttentionMaskInterface.register",
        use="call",
        why="registers our mask function under the model's key",
        params=("key", "value"),
    ),
    Symbol(
        where="transformers.masking_utils:AttentionMaskInterface._global_mapping",
        use="patch",
        why="the mask registry our key is removed from on undo",
        attributes=("pop", "get"),
    ),
    Symbol(
        where="transformers.masking_utils:sdpa_mask",
        use="patch",
        why="our SequenceParallelMask stands in for it and is called with its keywords",
        keywords=_MASK_KEYWORDS,
    ),
    Symbol(
        where="transformers.masking_utils:causal_mask_function",
        use="call",
        why="mask functions are probed on global indices as (batch, head, q, kv)",
        params=("batch_idx", "head_idx", "q_idx", "kv_idx"),
    ),
    Symbol(
        where="transformers.masking_utils:and_masks",
        use="read",
        why="its closure holds the mask functions under the packed-sequence wrapper",
        names=("mask_functions",),
    ),
    Symbol(
        where="transformers.masking_utils:packed_sequence_mask_function",
        use="read",
        why="recognised and looked through (our kernels take documents from the global position ids)",
    ),
    Symbol(
        where="transformers.masking_utils:remap_positions_for_packed_sequence",
        use="read",
        why="its closure holds the model's own mask function under the packed-sequence wrapper",
        names=("mask_function",),
        optional=True,
    ),
    # loss: our sequence-parallel cross-entropy in place of the model's
    Symbol(
        where="transformers.loss.loss_utils:ForCausalLMLoss",
        use="patch",
        why="a CausalLM's loss_function, replaced by our cross-entropy that takes its arguments",
        keywords=("logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index", "shift_labels"),
    ),
    Symbol(
        where="<model>:loss_function",
        use="patch",
        why="the instance's loss function we replace and restore",
        names=("_loss_function",),
    ),
    Symbol(
        where="transformers.models.mixtral.modeling_mixtral:load_balancing_loss_func",
        use="read",
        why="the MoE load-balancing formula computed across ranks (its copies recognised by bytecode)",
        params=("gate_logits", "num_experts", "top_k", "attention_mask"),
    ),
    Symbol(
        where="transformers.modeling_outputs:CausalLMOutputWithPast",
        use="read",
        why="the output of FPDT's chunked loss for a forward without a return annotation",
    ),
    Symbol(
        where="transformers.utils:ModelOutput",
        use="read",
        why="the base class of the output FPDT's chunked loss returns",
    ),
    Symbol(
        where="transformers.modeling_utils:slice_logits_to_keep",
        use="read",
        why="recognised in a CausalLM forward read by FPDT's chunked loss",
        optional=True,
    ),
    # RoPE whose frequencies depend on the sequence length: fed the global length
    Symbol(
        where="transformers.modeling_rope_utils:dynamic_rope_update",
        use="read",
        why="recognises the rotary embeddings that read the sequence length; rerun on the global length",
        names=("rope_type", "dynamic", "longrope"),
    ),
    # hub kernels (transformers >= 5.25 kernelizes at load and at every train() / eval())
    Symbol(
        where="<model>:reset_kernels",
        use="call",
        why="turns the hub kernels off, which would erase our patched forwards",
        when="<model>:kernels_mode",
    ),
    Symbol(
        where="<model>:set_use_kernels",
        use="call",
        why="turns the hub kernels back on, in their mode, on undo",
        params=("use_kernels",),
        keywords=("mode",),
        when="<model>:kernels_mode",
    ),
    Symbol(
        where="<model>:use_kernels",
        use="read",
        why="the flag a forward hook reads to refuse a model kernelized after it was patched",
        names=("_use_kernels",),
        optional=True,
    ),
    # activation checkpointing (the strategy's, and its offloaded variant)
    Symbol(
        where="<model>:activation_checkpointing_enable",
        use="call",
        why="non-reentrant checkpointing of the decoder layers",
        keywords=("activation_checkpointing_kwargs",),
        optional=True,
    ),
    Symbol(
        where="<model>:gradient_checkpointing_enable",
        use="call",
        why="non-reentrant checkpointing of the decoder layers (before activation_checkpointing_enable)",
        keywords=("gradient_checkpointing_kwargs",),
    ),
    Symbol(
        where="<model>:_set_gradient_checkpointing",
        use="read",
        why="sets the per-layer flag and function our offloaded checkpoint replaces",
        names=("gradient_checkpointing", "_gradient_checkpointing_func"),
    ),
    Symbol(
        where="transformers.modeling_layers:GradientCheckpointingLayer",
        use="read",
        why="the layers that call the checkpoint function our offloaded checkpoint replaces",
        names=("gradient_checkpointing", "_gradient_checkpointing_func"),
    ),
    Symbol(
        where="<model>:enable_input_require_grads",
        use="read",
        why="the input-embedding hook checkpointing adds, removed again on teardown",
        names=("_require_grads_hooks|_require_grads_hook",),
    ),
    Symbol(
        where="<model>:disable_input_require_grads",
        use="call",
        why="removes that hook on teardown",
    ),
    Symbol(
        where="<model>:get_decoder",
        use="call",
        why="the decoder FPDT's chunked loss calls and whose recorded router outputs we read",
    ),
    Symbol(
        where="<model>:get_output_embeddings",
        use="call",
        why="the lm_head FPDT's chunked loss computes in chunks",
    ),
    # tensor parallelism (transformers >= 5; tensor_parallel.py refuses tp > 1 on older releases)
    Symbol(
        where="transformers.distributed.tensor_parallel:apply_tensor_parallelism",
        use="call",
        why="applies the model's own tensor-parallel plan on our mesh",
        params=("model", "tp_mesh", "tp_plan"),
        optional=True,
    ),
    Symbol(
        where="transformers.distributed.tensor_parallel:ALL_PARALLEL_STYLES",
        use="read",
        why="the tensor-parallel styles a plan may name",
        optional=True,
    ),
)

KERNELS: tuple[Symbol, ...] = (
    Symbol(
        where="*:causal_conv1d_fn",
        use="rebind",
        why="the short causal convolution, given the halo of the segment before",
        params=("hidden_states", "weight", "bias"),
        keywords=("activation",),
    ),
    Symbol(
        where="*:torch_chunk_gated_delta_rule",
        use="rebind",
        why="gated DeltaNet's chunked delta rule, made exact across ranks by state passing",
        params=("query", "key", "value"),
        keywords=_DELTA,
    ),
    Symbol(
        where="*:chunk_kimi_delta_attention",
        use="rebind",
        why="Kimi delta attention, made exact across ranks by state passing",
        params=("query", "key", "value"),
        keywords=_DELTA,
    ),
    Symbol(
        where="*:mamba2_chunk_scan",
        use="rebind",
        why="the Mamba-2 SSD scan, made exact across ranks by state passing",
        params=("hidden_states", "dt", "A", "B", "C", "chunk_size"),
        keywords=("D", "dt_bias", "dt_softplus", "dt_limit", "return_final_states"),
    ),
    Symbol(
        where="*:mamba_selective_scan",
        use="rebind",
        why="the Mamba-1 selective scan, made exact across ranks by state passing",
        params=("hidden_states", "dt", "A", "B", "C"),
        keywords=("D", "z", "delta_bias", "delta_softplus", "return_last_state"),
    ),
    Symbol(
        where="*:rwkv_linear_attention",
        use="rebind",
        why="RWKV-4's WKV recurrence, made exact across ranks by state passing",
        params=("time_decay", "time_first", "key", "value"),
        keywords=("state", "return_state"),
    ),
    Symbol(
        where="*:rwkv_linear_attention_cpu",
        use="call",
        why="the torch WKV our RWKV adapter runs from each segment's entry state",
        params=("time_decay", "time_first", "key", "value"),
        keywords=("state", "return_state"),
        when="*:rwkv_linear_attention",
    ),
    Symbol(
        where="*:xLSTMBackend.forward",
        use="patch",
        why="the mLSTM backend, rerun from each segment's entry state",
        params=_XLSTM_PARAMS,
        attributes=("config",),
    ),
    Symbol(
        where="*:RecurrentGemmaRglru._rnn_scan",
        use="patch",
        why="the RG-LRU scan, corrected by each segment's entry state",
        params=("hidden_states", "recurrent_gate", "reset", "recurrent_states", "acc_dtype"),
    ),
    Symbol(
        where="*:RecurrentGemmaRecurrentBlock.forward",
        use="patch",
        why="the recurrent block, rebuilt from its submodules around a convolution with a halo",
        params=("input_states", "position_ids", "attention_mask", "use_cache"),
        attributes=("act_fn", "linear_y", "linear_x", "conv_1d", "rg_lru", "linear_out"),
    ),
    Symbol(
        where="*:MiniMaxLightningAttention.forward",
        use="patch",
        why="lightning attention, rebuilt from its submodules and decays around the state passing",
        params=("hidden_states", "position_embeddings", "attention_mask", "cache"),
        attributes=_MINIMAX_ATTRIBUTES,
    ),
    Symbol(
        where="*:RwkvSelfAttention.extract_key_value",
        use="patch",
        why="RWKV's time-mixing token shift, given the token before each segment",
        params=("hidden", "state"),
        attributes=("layer_id",),
    ),
    Symbol(
        where="*:RwkvFeedForward.forward",
        use="patch",
        why="RWKV's channel-mixing token shift, given the token before each segment",
        params=("hidden", "state"),
        attributes=("layer_id",),
    ),
)

_CONV_DELTA = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
_MAMBA2 = ("causal_conv1d_fn", "mamba2_chunk_scan")
_MAMBA1 = ("causal_conv1d_fn", "mamba_selective_scan")


def _m(model: str, cls: str, reaches: tuple[str, ...], why: str) -> Mixer:
    return Mixer(module=f"transformers.models.{model}.modeling_{model}", cls=cls, reaches=reaches, why=why)


MIXERS: tuple[Mixer, ...] = (
    _m("lfm2", "Lfm2ShortConv", ("causal_conv1d_fn",), "LFM2's gated short convolution"),
    _m("qwen3_next", "Qwen3NextGatedDeltaNet", _CONV_DELTA, "Qwen3-Next's gated DeltaNet"),
    _m("qwen3_5", "Qwen3_5GatedDeltaNet", _CONV_DELTA, "Qwen3.5's gated DeltaNet"),
    _m("olmo_hybrid", "OlmoHybridGatedDeltaNet", _CONV_DELTA, "OLMo-hybrid's gated DeltaNet"),
    _m(
        "kimi_linear",
        "KimiLinearDeltaAttention",
        ("causal_conv1d_fn", "chunk_kimi_delta_attention"),
        "Kimi-Linear's delta attention",
    ),
    _m("bamba", "BambaMixer", _MAMBA2, "Bamba's Mamba-2 mixer"),
    _m("falcon_h1", "FalconH1Mixer", _MAMBA2, "Falcon-H1's Mamba-2 mixer"),
    _m("granitemoehybrid", "GraniteMoeHybridMambaLayer", _MAMBA2, "Granite-4 hybrid's Mamba-2 mixer"),
    _m("nemotron_h", "NemotronHMamba2Mixer", _MAMBA2, "Nemotron-H's Mamba-2 mixer"),
    _m("mamba2", "Mamba2Mixer", _MAMBA2, "Mamba-2's mixer"),
    _m("jamba", "JambaMambaMixer", _MAMBA1, "Jamba's Mamba mixer"),
    _m("mamba", "MambaMixer", _MAMBA1, "Mamba's mixer"),
    _m("falcon_mamba", "FalconMambaMixer", _MAMBA1, "Falcon-Mamba's mixer"),
    _m("minimax", "MiniMaxLightningAttention", (), "MiniMax's lightning attention"),
    _m("recurrent_gemma", "RecurrentGemmaRecurrentBlock", (), "RecurrentGemma's recurrent block"),
    _m("recurrent_gemma", "RecurrentGemmaRglru", (), "RecurrentGemma's RG-LRU"),
    _m("rwkv", "RwkvSelfAttention", ("rwkv_linear_attention",), "RWKV's time mixing"),
    _m("rwkv", "RwkvFeedForward", (), "RWKV's channel mixing"),
    _m("xlstm", "xLSTMBackend", (), "xLSTM's mLSTM backend"),
)

#: The keywords our attention function reads (``transformers.py``'s ``_hf_attention``; ``s_aux`` from its
#: ``**kwargs``): an attention module that passes any other one by name would have it dropped.
ATTENTION_KEYWORDS = frozenset(
    {"attention_mask", "scaling", "dropout", "sliding_window", "softcap", "position_ids", "s_aux"}
)
#: Positional arguments of an attention interface call: module, query, key, value, attention_mask.
ATTENTION_POSITIONAL = 5


class TransformersSymbolError(RuntimeError):
    """transformers symbols that sequence parallelism patches, rebinds, reads or calls are missing or changed in
    the installed release (:func:`check_symbols`). ``problems``: one line per symbol."""

    def __init__(self, model_name: str, problems: list[str]) -> None:
        import transformers

        self.problems = tuple(problems)
        self.version = transformers.__version__
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"{model_name} cannot be made sequence-parallel with the installed transformers {self.version}: "
            f"{len(self.problems)} of the transformers symbols lightning_longctx patches, rebinds, reads or calls "
            f"{'is' if len(self.problems) == 1 else 'are'} missing or changed, and training on without "
            f"{'it' if len(self.problems) == 1 else 'them'} would be silently wrong (a layer mixing only its own "
            f"shard, an argument dropped):\n{lines}\n"
            f"Install a transformers version in the tested window ({_floor()}, up to {TESTED_UP_TO}; e.g. "
            f'pip install "transformers~={TESTED_UP_TO}.0"), or, if this release should work, report the model '
            f"class and transformers {self.version} to lightning_longctx. There is no switch to skip this check: "
            "a changed symbol means wrong results, not a slower run"
        )


@functools.cache
def _floor() -> str:
    """The package's transformers requirement (e.g. ``transformers>=5.24``), read from its metadata."""
    from importlib import metadata

    try:
        requires = metadata.requires("lightning-longctx") or []
    except metadata.PackageNotFoundError:
        requires = []
    for req in requires:
        found = re.match(r"transformers\s*([<>=!~][^;]*)", req)
        if found:
            return f"transformers{found.group(1).strip()}"
    return "the transformers floor in pyproject.toml"


# ---- resolving and inspecting -------------------------------------------------------------------------------


def _resolve(where: str, roots: dict[str, Any]) -> Any:
    """The object at ``where`` (``_MISSING`` if any part is absent): an import path, or an attribute path on one of
    ``roots`` (``"<model>"``, ``"<config>"``, ``"*"``). Class attributes are read statically (a property
    object, not its value)."""
    module, _, path = where.partition(":")
    if module in roots:
        obj = roots[module]
    else:
        try:
            obj = importlib.import_module(module)
        except ImportError:
            return _MISSING
    for part in path.split(".") if path else ():
        try:
            obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
        except AttributeError:
            return _MISSING
    return obj


def _callable_of(obj: Any) -> Any:
    """The function behind a class attribute (a static / class method, a hub-kernel module) or ``obj``."""
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    return _function_of(obj)


def _parameters(obj: Any) -> list[str] | None:
    """The parameter names of a callable without ``self`` / ``cls`` and ``*args`` / ``**kwargs``; ``None``: no
    signature can be read. A method's signature is its unbound function's."""
    fn = _callable_of(obj)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if isinstance(obj, classmethod) or (params and params[0].name in ("self", "cls")):
        params = params[1:]
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in params if p.kind not in kinds]


def _codes(obj: Any) -> Iterator[types.CodeType]:
    """Every code object of ``obj``: a function (unwrapped, its decorator's layers too), a property's accessors,
    a class's functions (its own and inherited from transformers' classes), with their nested code."""
    if isinstance(obj, property):
        fns: list[Any] = [f for f in (obj.fget, obj.fset) if f is not None]
    elif isinstance(obj, type):
        fns = [
            f
            for klass in obj.__mro__
            if klass.__module__.startswith("transformers")  # not torch's nn.Module
            for f in vars(klass).values()
            if isinstance(f, (types.FunctionType, staticmethod, classmethod, property))
        ]
    else:
        fns = [_callable_of(obj)]
    todo: list[Any] = []
    for fn in fns:
        if isinstance(fn, property):
            todo += [f for f in (fn.fget, fn.fset) if f is not None]
            continue
        fn = _callable_of(fn)
        while fn is not None:  # each layer: a decorator's wrapper, then the function it wraps
            code = getattr(fn, "__code__", None)
            if code is not None:
                todo.append(code)
            fn = getattr(fn, "__wrapped__", None)
    while todo:
        code = todo.pop()
        if isinstance(code, types.FunctionType):
            code = code.__code__
        yield code
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]


def _code_names(obj: Any) -> set[str]:
    """The names the code of ``obj`` uses: globals and attributes, closure variables, string constants."""
    names: set[str] = set()
    for code in _codes(obj):
        names.update(code.co_names, code.co_cellvars, code.co_freevars)
        names.update(c for c in code.co_consts if isinstance(c, str))
    return names


def _mismatch(symbol: Symbol, obj: Any) -> list[str]:
    """What in ``obj`` differs from what ``symbol`` expects (empty: nothing)."""
    found = []
    if obj is None and (symbol.params or symbol.keywords):  # a kernel whose package is not installed
        return ["it is None, not a function"]
    if symbol.params or symbol.keywords:
        params = _parameters(obj)
        if params is None:
            found.append("its parameters cannot be read")
        else:
            if params[: len(symbol.params)] != list(symbol.params):
                found.append(
                    f"its leading parameters are ({', '.join(params[: len(symbol.params)])}), "
                    f"expected ({', '.join(symbol.params)})"
                )
            missing = [k for k in symbol.keywords if k not in params]
            if missing:
                found.append(f"it has no parameter {', '.join(map(repr, missing))}")
    if symbol.names:
        names = _code_names(obj)
        absent = [n for n in symbol.names if not set(n.split("|")) & names]
        if absent:
            found.append(f"its code no longer uses {', '.join(map(repr, absent))}")
    if symbol.attributes and not symbol.where.startswith("*:"):
        absent = [a for a in symbol.attributes if not hasattr(obj, a)]
        if absent:
            found.append(f"it has no attribute {', '.join(map(repr, absent))}")
    return found


def _line(symbol: Symbol, where: str, what: str) -> str:
    return f"{where} ({symbol.use}: {symbol.why}): {what}"


def _check(symbol: Symbol, roots: dict[str, Any], where: str | None = None) -> list[str]:
    """The problems of one symbol resolved against ``roots`` (``where``: its name in the message)."""
    where = where or symbol.where
    if symbol.when is not None and _resolve(symbol.when, roots) is _MISSING:
        return []
    obj = _resolve(symbol.where, roots)
    if obj is _MISSING:
        return [] if symbol.optional else [_line(symbol, where, "missing")]
    return [_line(symbol, where, what) for what in _mismatch(symbol, obj)]


def _name_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# ---- the rules that read the model's own classes -------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _attention_calls(fn: Callable[..., Any]) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``(positional arguments, keywords)`` of each call of the attention interface in ``fn``'s source: a name
    assigned from an expression that reads ``ALL_ATTENTION_FUNCTIONS``, then called. Cached per function."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return ()
    interface: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            read = {getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(node.value)}
            if "ALL_ATTENTION_FUNCTIONS" in read:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                interface.update(t.id for t in targets if isinstance(t, ast.Name))
    return tuple(
        (len(node.args), tuple(k.arg for k in node.keywords if k.arg is not None))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in interface
    )


def _attention_problems(cls: type) -> list[str]:
    """An attention module that passes the attention function a keyword ours would drop, or more positional
    arguments than it reads."""
    forward = inspect.unwrap(cls.forward)
    code = getattr(forward, "__code__", None)
    if code is None or "ALL_ATTENTION_FUNCTIONS" not in code.co_names:
        return []
    problems = []
    for positional, keywords in _attention_calls(forward):
        dropped = sorted(set(keywords) - ATTENTION_KEYWORDS)
        if dropped:
            problems.append(
                f"{_name_of(cls)}.forward (call: the attention interface, which our attention function answers): "
                f"passes {', '.join(f'{k}=' for k in dropped)}, which our attention function does not read "
                f"(it reads {', '.join(sorted(ATTENTION_KEYWORDS))})"
            )
        if positional > ATTENTION_POSITIONAL:
            problems.append(
                f"{_name_of(cls)}.forward (call: the attention interface, which our attention function answers): "
                f"passes {positional} positional arguments; ours takes {ATTENTION_POSITIONAL} "
                "(module, query, key, value, attention_mask) and the rest by keyword"
            )
    return problems


def _rotary_problems(module: nn.Module) -> list[str]:
    """A rotary embedding (it has ``rope_type``) whose forward does not take ``(x, position_ids)`` and, with one
    rope type per layer type, ``layer_type``: what ``rope.py`` probes and calls it with."""
    rope_type = getattr(module, "rope_type", None)
    if rope_type is None:
        return []
    cls = type(module)
    forward = getattr(cls.forward, "__wrapped__", cls.forward)  # under dynamic_rope_update, its own forward
    params = _parameters(forward)
    where = f"{_name_of(cls)}.forward (patch / call: rope.py probes it and feeds it the global length)"
    if params is None or len(params) < 2:
        return [f"{where}: takes ({', '.join(params or [])}), expected (x, position_ids, ...)"]
    if isinstance(rope_type, dict) and "layer_type" not in params:
        return [f"{where}: one rope type per layer type, but no layer_type parameter"]
    return []


def _loss_problems(cls: type) -> list[str]:
    """A CausalLM forward that takes ``labels`` but never reads ``self.loss_function`` (which we replace): its loss
    would be this shard's, shifted locally."""
    forward = inspect.unwrap(cls.forward)
    params = _parameters(forward) or []
    if "labels" not in params:
        return []
    for klass in cls.__mro__:  # its own forward, or one it reaches through super()
        fn = vars(klass).get("forward")
        if fn is not None and "loss_function" in _code_names(fn):
            return []
    return [
        f"{_name_of(cls)}.forward (read: the loss goes through self.loss_function, which we replace): it takes "
        "labels but computes its loss without self.loss_function"
    ]


def _router_problems(model: nn.Module) -> list[str]:
    """The decoder's recorded router outputs (``_can_record_outputs["router_logits"]``): a class, or a recorder
    with ``target_class``; FPDT keeps MoE blocks of that class untiled."""
    try:
        decoder = model.get_decoder()
    except Exception:  # no decoder to read: nothing recorded
        return []
    recorded = getattr(decoder, "_can_record_outputs", None)
    recorder = recorded.get("router_logits") if isinstance(recorded, dict) else None
    if recorder is None or isinstance(recorder, type) or hasattr(recorder, "target_class"):
        return []
    return [
        f"{_name_of(type(decoder))}._can_record_outputs['router_logits'] (read: FPDT leaves the router's MoE "
        f"blocks untiled): a {type(recorder).__name__} without target_class"
    ]


def _mixer_problems(classes: list[type], modules: list[nn.Module]) -> list[str]:
    """The hybrid mixers of the model: each tested mixer class of its modeling files exists and reaches its
    kernels by name (:data:`MIXERS`); every kernel a mixer reaches, and every method replaced on a mixer, takes
    what its adapter passes (:data:`KERNELS`)."""
    problems = []
    by_name = {cls.__name__: cls for cls in classes}
    files = {cls.__module__ for cls in classes}
    for mixer in MIXERS:
        if mixer.module not in files:
            continue
        cls = getattr(sys.modules[mixer.module], mixer.cls, None)
        where = f"{mixer.module}:{mixer.cls}"
        if not isinstance(cls, type):
            problems.append(f"{where} (rebind: {mixer.why}, made sequence-parallel by its adapter): missing")
            continue
        if cls.__name__ not in by_name or not mixer.reaches:
            continue
        reached: set[str] = set()
        for fn in _adapted_methods(cls).values():
            reached.update(_reach(fn))
        lost = [k for k in mixer.reaches if k not in reached]
        if lost:
            problems.append(
                f"{where} (rebind: {mixer.why}): its methods no longer call {', '.join(lost)} by that name, directly "
                "or through a helper of its modeling file, so the adapter would not run and the layer would mix "
                "only its own shard"
            )
    kernels = {symbol.attribute: symbol for symbol in KERNELS}
    for cls in classes:
        for fn in _adapted_methods(cls).values():
            for name, value in _reach(fn).items():
                symbol = kernels.get(name)
                if symbol is None or name not in ADAPTERS:
                    continue
                home = getattr(_callable_of(value), "__module__", None) or cls.__module__
                problems += [_line(symbol, f"{home}:{name}", what) for what in _mismatch(symbol, value)]
                scope = {"*": sys.modules.get(home, sys.modules[cls.__module__])}
                for companion in KERNELS:  # e.g. RWKV's torch WKV, read from the kernel's module
                    if companion.when == symbol.where:
                        problems += _check(companion, scope, f"{home}:{companion.attribute}")
    for module in modules:
        cls = type(module)
        for method in METHODS.get(cls.__name__, {}):
            symbol = kernels.get(f"{cls.__name__}.{method}")
            if symbol is None:
                continue
            problems += _check(symbol, {"*": sys.modules[cls.__module__]}, f"{_name_of(cls)}.{method}")
            absent = [a for a in symbol.attributes if not hasattr(module, a)]
            if absent:
                problems.append(
                    _line(
                        symbol,
                        _name_of(cls),
                        f"its instances have no attribute {', '.join(map(repr, absent))}",
                    )
                )
    return problems


# ---- the check ---------------------------------------------------------------------------------------------------


def _problems(model: nn.Module) -> list[str]:
    """Every transformers symbol ``model`` (a ``PreTrainedModel``) would be made sequence-parallel through that is
    missing or changed, one line each (empty: none). :func:`check_symbols` raises them."""
    roots = {"<model>": type(model), "<config>": type(model.config)}
    problems = []
    for symbol in TRANSFORMERS_SYMBOLS:
        problems += _check(symbol, roots)
    classes: dict[type, None] = {}
    rotary, replaced = [], []  # rotary embeddings; mixers whose method an adapter replaces
    for module in model.modules():
        classes[type(module)] = None
        if getattr(module, "rope_type", None) is not None:
            rotary.append(module)
        if type(module).__name__ in METHODS:
            replaced.append(module)
    for module in rotary:
        problems += _rotary_problems(module)
    for cls in classes:
        problems += _attention_problems(cls)
    problems += _loss_problems(type(model))
    problems += _router_problems(model)
    problems += _mixer_problems(list(classes), replaced)
    return list(dict.fromkeys(problems))  # each once, in order


def check_symbols(model: nn.Module) -> None:
    """Raise :class:`TransformersSymbolError` naming every transformers symbol that ``model`` would be made
    sequence-parallel through and that is missing or changed in the installed release (see the module
    docstring); return ``None`` when all are as expected. ``enable_sequence_parallel`` calls it first."""
    problems = _problems(model)
    if problems:
        raise TransformersSymbolError(type(model).__name__, problems)
