"""What each layer of a patched model attends to, read off the model's own mask function.

Some models say what they attend to only through the mask they build (a sliding window chosen from
``config.sliding_window``, Llama-4's chunked attention, a ``config.layer_types`` mix). The patched
model's key gets its own mask function (:class:`SequenceParallelMask`, registered with transformers'
``AttentionMaskInterface``). transformers calls it from ``create_causal_mask`` /
``create_sliding_window_causal_mask`` / ``create_chunked_causal_mask`` (one call per layer type) with the
model's ``mask_function``; we probe that function on GLOBAL indices and return a :class:`MaskPattern` —
causal, sliding window W, chunks of C, or bidirectional: a few numbers, never an O(s²) mask — which
transformers hands to our attention function as ``attention_mask``. Anything else is refused.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_longctx.integrations.context import SequenceParallelContext
from lightning_longctx.parallel.comm import group_rank_size

#: ``config.layer_types`` entries whose mask sequence-parallel attention expresses exactly.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True, eq=False)
class MaskPattern:
    """Which (query, key) pairs one layer type attends to, as the model's mask function said; it reaches our
    attention function as ``attention_mask`` in place of an O(s²) mask.

    ``causal``: no key after the query. ``sliding_window`` W: only the last W tokens, the query included
    (HF's ``kv_idx > q_idx - W``, the same as :class:`~lightning_longctx.attention.common.MaskSpec`).
    ``chunk`` C: causal within chunks of C positions, boundaries at multiples of C of each document's
    positions (Llama-4's ``attention_chunk_size``; for one document these are global token indices).
    A window or chunk of at least ``seq_len`` (the global length it was classified on) is plain causal
    and stored as ``None``. ``position_ids``: the GLOBAL ``(b, s/P)`` position ids of the model call.
    """

    causal: bool = True
    sliding_window: int | None = None
    chunk: int | None = None
    seq_len: int = 0
    position_ids: torch.Tensor | None = None

    def describe(self) -> str:
        if not self.causal:
            return "bidirectional"
        if self.sliding_window is not None:
            return f"a sliding window of {self.sliding_window} tokens"
        if self.chunk is not None:
            return f"causal chunks of {self.chunk} tokens"
        return "causal"

    def __getattr__(self, name: str) -> Any:
        # Only reached for names it lacks: a model treating its attention mask as a tensor.
        raise MaskEditedError(
            f"the model read attention_mask.{name}, but under sequence parallelism the mask is a "
            f"MaskPattern ({', '.join(f.name for f in dataclasses.fields(MaskPattern))}), not a tensor: "
            "the model edits its mask itself (as Doge does), which sequence-parallel attention cannot follow. "
            "Train it without sequence parallelism"
        )


class MaskEditedError(ValueError, AttributeError):
    """A model read its attention mask as a tensor (to edit it): a refusal (``ValueError``) that is also an
    ``AttributeError``, as ``__getattr__`` must raise."""


@dataclass(frozen=True)
class RefusedMask:
    """A layer type's mask that sequence-parallel attention cannot express. Models build masks for layer
    types none of their layers use (Qwen2-MoE's unused sliding window): only a layer that receives this
    one raises, in :func:`pattern_of`."""

    reason: str


def _closure(fn: Callable[..., Any], factory: str) -> dict[str, Any] | None:
    """The free variables of ``fn`` if it is the inner function of transformers.masking_utils' ``factory``."""
    qualname = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", "") != "transformers.masking_utils" or not qualname.startswith(
        f"{factory}."
    ):
        return None
    return dict(inspect.getclosurevars(fn).nonlocals)


def _without_packing(mask_function: Callable[..., Any]) -> Callable[..., Any]:
    """The pattern under transformers' packed-sequence wrapper (``and_masks(remap_positions_for_packed_sequence(
    f, pos), packed_sequence_mask_function(...))``, added when the LOCAL position ids are not one run of
    consecutive numbers — in the FPDT layout at every chunk seam). Our kernels build documents from the
    GLOBAL position ids themselves, so only ``f`` matters."""
    parts = (_closure(mask_function, "and_masks") or {}).get("mask_functions", ())
    if len(parts) == 2 and _closure(parts[1], "packed_sequence_mask_function") is not None:
        remap = _closure(parts[0], "remap_positions_for_packed_sequence")
        if remap is not None:
            return remap["mask_function"]
    return mask_function


def _expected(
    kind: str, size: int, q: torch.Tensor, kv: torch.Tensor, left_padding: torch.Tensor
) -> torch.Tensor:
    """(B, R, M) allowed pairs of a candidate pattern at queries q (R, 1) and keys kv (R or 1, M);
    ``left_padding`` (B, 1, 1) as transformers counts it."""
    causal = (kv <= q).expand(left_padding.shape[0], -1, -1)
    if kind == "bidirectional":
        return torch.ones_like(causal)
    if kind == "sliding":
        return causal & (kv > q - size)
    if kind == "chunked":  # transformers' chunked_overlay, with its left-padding shift
        return causal & (
            torch.div(kv - left_padding, size, rounding_mode="floor")
            == torch.div(q - left_padding, size, rounding_mode="floor")
        )
    return causal


def _ranges(row: torch.Tensor, limit: int = 4) -> str:
    idx = row.nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"[{a}, {b}]" for a, b in runs[:limit]) + (" ..." if len(runs) > limit else "")
    return text or "none"


#: Keys of the last query row probed at a time: bounds the probe's memory at any sequence length.
_PROBE_BLOCK = 1 << 16


def classify_mask_function(
    mask_function: Callable[..., Any],
    *,
    seq_len: int,
    local_size: int | None = None,
    left_padding: torch.Tensor | None = None,
    model_name: str = "the model",
    device: torch.device | str = "cpu",
) -> MaskPattern:
    """Probe a transformers mask function (``mask_mod(batch_idx, head_idx, q_idx, kv_idx) -> bool``) on
    GLOBAL indices ``[0, seq_len)`` and name its pattern; raise ``ValueError`` for any pattern that is not
    causal, a sliding window, chunked or bidirectional.

    Probed: the last query against every key, and a dozen queries (around ``local_size``, its double, the
    middle and the ends) against the first ``2 * local_size + 64`` keys and as many either side of the
    query. ``local_size`` is the window / chunk size transformers passes with sliding and chunked masks
    (the candidates tried first); ``left_padding`` ``(b,)`` the leading padding per row (it shifts
    transformers' chunk boundaries; only rows that are padding on this rank have any, see ``shard_batch``).
    """
    n = seq_len
    lp = torch.zeros(1, dtype=torch.long, device=device) if left_padding is None else left_padding.to(device)
    lp3 = lp[:, None, None]
    batch = torch.arange(len(lp), device=device)[:, None, None, None]
    fn = _without_packing(mask_function)

    def probe(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q (R, 1), kv (R or 1, M) -> (B, R, M) allowed pairs."""
        try:
            got = fn(batch, batch.new_zeros(1, 1, 1, 1), q[None, None], kv[None, None])
        except (IndexError, RuntimeError, TypeError) as e:
            raise ValueError(
                f"{model_name}'s attention mask function depends on the batch's data ({type(e).__name__}: {e}), "
                "so its pattern cannot be read off global positions; sequence-parallel attention cannot express "
                "it. Train it without sequence parallelism"
            ) from None
        return (
            torch.as_tensor(got, device=device)
            .to(torch.bool)
            .expand(len(lp), 1, *torch.broadcast_shapes(q.shape, kv.shape))[:, 0]
        )

    # the last query against every key, a block at a time
    q_last = torch.tensor([[n - 1]], device=device)
    blocks = [
        torch.arange(s, min(s + _PROBE_BLOCK, n), device=device)[None] for s in range(0, n, _PROBE_BLOCK)
    ]
    last = torch.cat([probe(q_last, kv) for kv in blocks], dim=-1)  # (B, 1, n): a window shows as [n-W, n-1]
    first = int(last[0, 0].nonzero()[0]) if bool(last[0, 0].any()) else 0
    # a few more queries, against the keys where the known patterns change
    k = 2 * (local_size or 0) + 64
    rows = {0, 1, n // 3, n // 2, n - 2}
    for base in (local_size, 2 * local_size) if local_size else ():
        rows.update((base - 1, base, base + 1))
    cols = []
    for r in sorted(x for x in rows if 0 <= x < n):
        c = torch.cat([torch.arange(min(k, n)), torch.arange(max(0, r - k), min(n, r + k + 1))]).unique()
        cols.append((r, c))
    width = max(len(c) for _, c in cols)
    q = torch.tensor([[r] for r, _ in cols], device=device)
    kv = torch.stack([torch.cat([c, c[-1:].expand(width - len(c))]) for _, c in cols]).to(device)  # (R, M)
    got = probe(q, kv)

    candidates = [("sliding", local_size), ("chunked", local_size)] if local_size else []
    candidates += [("causal", 0), ("bidirectional", 0), ("sliding", n - first)]
    for kind, size in candidates:
        if torch.equal(got, _expected(kind, size, q, kv, lp3)) and all(
            torch.equal(part, _expected(kind, size, q_last, kv_b, lp3))
            for part, kv_b in zip(last.split(_PROBE_BLOCK, dim=-1), blocks)
        ):
            big = size >= n  # a window or chunk spanning the whole sequence is plain causal attention
            return MaskPattern(
                causal=kind != "bidirectional",
                sliding_window=size if kind == "sliding" and not big else None,
                chunk=size if kind == "chunked" and not big else None,
                seq_len=n,
            )
    raise ValueError(
        f"{model_name}'s attention mask (mask function {getattr(fn, '__qualname__', fn)!r}, local_size={local_size}) "
        f"is neither causal, a sliding window, chunked nor bidirectional: over {n} tokens, query {n - 1} attends "
        f"to keys {_ranges(last[0, 0])}. Sequence-parallel attention would silently drop it; train the model "
        "without sequence parallelism"
    )


class SequenceParallelMask:
    """The mask function registered under a patched model's key (``AttentionMaskInterface``).

    transformers calls it once per layer type and forward, from ``create_causal_mask`` and its siblings,
    with the LOCAL shard's sizes; it returns the layer type's :class:`MaskPattern`."""

    def __init__(self, context: SequenceParallelContext) -> None:
        self.context = context

    def __call__(
        self,
        *,
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: Any = 0,
        kv_offset: Any = 0,
        mask_function: Callable[..., Any],
        attention_mask: torch.Tensor | None = None,
        local_size: int | None = None,
        use_vmap: bool = False,
        device: torch.device | str = "cpu",
        **kwargs: Any,
    ) -> MaskPattern | RefusedMask:
        ctx = self.context
        name = ctx.model_name or "the model"
        if int(q_offset) or int(kv_offset) or kv_length != q_length:
            raise ValueError(
                f"{name} builds its attention mask for {q_length} queries against {kv_length} keys (offsets "
                f"{int(q_offset)}, {int(kv_offset)}): a cache or prefix is in use. Sequence-parallel training "
                "is self-attention over the batch only: use_cache=False, no past_key_values or prefix tuning"
            )
        if use_vmap:
            raise ValueError(
                f"{name} adds its own rule to the attention mask (an or/and mask function, e.g. image tokens "
                "attending to each other bidirectionally), which sequence-parallel attention cannot express. "
                "Train it without sequence parallelism (text-only causal LMs are fine)"
            )
        left_padding = None
        if attention_mask is not None:  # transformers' own count of leading padding per row
            mask = attention_mask.to(torch.long)
            left_padding = (mask.cumsum(dim=-1) == 0).sum(dim=-1)
        _, world = group_rank_size(ctx.group)
        try:
            pattern = classify_mask_function(
                mask_function,
                seq_len=world * q_length,  # both layouts: P equal shards of the (padded) global sequence
                local_size=local_size,
                left_padding=left_padding,
                model_name=name,
                device=device,
            )
        except ValueError as e:
            return RefusedMask(str(e))  # raised by the first layer that attends with it
        return dataclasses.replace(pattern, position_ids=ctx.call_position_ids)


class PositionsHook:
    """Forward hooks on a patched model: keep the GLOBAL position ids of the call in progress on its context,
    and the batch they belong to (``SequenceParallelContext.record_positions``: its documents). The batch
    stays recorded after the call: hybrid mixers recomputed by activation checkpointing in backward read
    their documents from it; a forward without position ids (one document per row) clears it.

    A class rather than closures, so that pickling a patched model reaches the context's clear refusal."""

    def __init__(self, context: SequenceParallelContext, index: int | None) -> None:
        self.context = context
        self.index = index  # position of ``position_ids`` among the forward's positional arguments

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.context.off:  # ``sequence_parallel_off``: a whole sequence, no group to gather over
            return
        # kernelized again after enable_sequence_parallel turned the hub kernels off
        if getattr(module, "_use_kernels", False):
            raise RuntimeError(
                f"{type(module).__name__} was kernelized (use_kernels=True) after it was made sequence-parallel: "
                "hub kernels replace the forwards sequence parallelism installed (tiled MLPs and norms, hybrid "
                "mixers), which would then see only this rank's shard. Leave use_kernels off, or call "
                "disable_sequence_parallel(model) first"
            )
        pos = kwargs.get("position_ids")
        if pos is None and self.index is not None and len(args) > self.index:
            pos = args[self.index]
        pos = pos if isinstance(pos, torch.Tensor) else None
        self.context.call_position_ids = pos
        if pos is not None:  # the batch's documents, once per call (nothing to do for the strategy's batch)
            self.context.record_positions(pos)
        else:  # one document per row: hybrid mixers (and their checkpoint recompute) must not read an older batch's
            self.context.positions = None

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        self.context.call_position_ids = None


def check_layer_types(model: nn.Module, name: str, mixers: int) -> int:
    """Patch time: every layer type the config declares has a mask we express exactly, or is a layer of a
    non-attention mixer that ``integrations/hybrid`` adapted (``mixers`` of them were found). Returns the
    number of attention layers (Falcon-H1's ``"hybrid"`` layers hold attention beside a mixer)."""
    config = model.config.get_text_config()
    layer_types = list(getattr(config, "layer_types", None) or ())
    if not layer_types:  # attention-free models (RWKV, xLSTM) declare none: one mixer per layer
        return max(0, int(getattr(config, "num_hidden_layers", 0) or 0) - mixers)
    other = [t for t in layer_types if t not in SUPPORTED_LAYER_TYPES and t != "hybrid"]
    if len(other) > mixers:
        bad = sorted(set(other))
        raise ValueError(
            f"{name} has layers of type {', '.join(map(repr, bad))} (config.layer_types), which sequence-parallel "
            f"attention cannot express (it supports {', '.join(SUPPORTED_LAYER_TYPES)}), and {len(other)} such "
            f"layers but {mixers} mixers with a sequence-parallel adapter (lightning_longctx/integrations/hybrid; "
            "docs/architectures.md lists the supported ones); the rest would each see only their own shard. "
            "Train this model without sequence parallelism"
        )
    return len(layer_types) - len(other)


def pattern_of(attention_mask: Any, name: str) -> MaskPattern | None:
    if attention_mask is None or isinstance(attention_mask, MaskPattern):
        return attention_mask
    if isinstance(attention_mask, RefusedMask):
        raise ValueError(attention_mask.reason)
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() == 4:
            raise ValueError(
                "a 4-D attention mask reached sequence-parallel attention; pass packed documents as position_ids "
                "that restart at 0 instead"
            )
        raise ValueError(
            f"{name} got a {attention_mask.dim()}-D attention mask tensor that transformers' masking_utils did not "
            "build for sequence parallelism: the model builds its masks some other way, which sequence-parallel "
            "attention cannot follow. Train it without sequence parallelism"
        )
    raise TypeError(
        f"{name} got an attention mask of type {type(attention_mask).__name__}; expected a MaskPattern"
    )


def resolve_sliding_window(kwarg: int | None, pattern: MaskPattern | None, name: str) -> int | None:
    """The window to attend with: the kwarg and the mask must agree (a window >= the sequence is causal)."""
    if pattern is None:  # the model built no mask: the kwarg is all there is
        return kwarg
    effective = None if kwarg is None or kwarg >= pattern.seq_len else int(kwarg)
    if kwarg is not None and effective != pattern.sliding_window:
        raise ValueError(
            f"{name} passes sliding_window={kwarg} to attention, but its mask for this layer is "
            f"{pattern.describe()} (over {pattern.seq_len} tokens); the two disagree, so the model's meaning is "
            "ambiguous. Fix config.sliding_window / config.layer_types so they describe the same window"
        )
    return pattern.sliding_window


def chunk_positions(
    ctx: SequenceParallelContext, position_ids: torch.Tensor | None, chunk: int, q: torch.Tensor
) -> torch.Tensor:
    """Position ids for the kernels that restart at 0 at every chunk boundary: our kernels' documents are
    runs between resets, so each chunk of each document becomes one (causal inside, nothing across)."""
    if position_ids is None:  # one document: positions are global token indices
        position_ids = ctx.global_index(q.shape[1], q.device)[None].expand(q.shape[0], -1)
    return position_ids % chunk


def llama4_query_temperature(
    ctx: SequenceParallelContext, module: nn.Module, q: torch.Tensor
) -> torch.Tensor:
    """Llama-4 NoPE layers (``attn_temperature_tuning``) scale each query by ``log1p(floor((i + 1) /
    floor_scale)) * attn_scale + 1`` of its token index i, which the model takes from the LOCAL index;
    rescale q ``(b, s/P, h, d)`` to the GLOBAL one (a factor of exactly 1 where they agree)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return q

    def scale(index: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((index.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    local = torch.arange(q.shape[1], device=q.device)
    ratio = scale(ctx.global_index(q.shape[1], q.device)) / scale(local)
    return (q * ratio[None, :, None, None]).to(q.dtype)
