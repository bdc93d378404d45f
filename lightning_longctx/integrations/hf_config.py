"""A transformers config from a dict or a local folder, with ``config_overrides`` applied: the one copy of
this logic, read by ``CausalLM`` (recipes), ``lightning-longctx plan`` and ``lightning-longctx export``, so a
run, its memory plan and its exported folder see the same config.

Overrides are checked (a key the config does not have is refused: transformers would keep it without
effect) and a new RoPE dict is completed from the one it replaces (``rope_theta``; for llama3 / yarn /
longrope the pretraining length as ``original_max_position_embeddings``), see :func:`apply_overrides`.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

__all__ = ["ROPE_KEYS", "apply_overrides", "build_config"]

#: Config fields that hold the RoPE parameters (``rope_scaling`` is the name before transformers 5).
ROPE_KEYS = ("rope_parameters", "rope_scaling")
#: What a new RoPE dict inherits from the config's own.
_ROPE_INHERITED = ("rope_theta", "partial_rotary_factor")
#: The rope types that scale from ``original_max_position_embeddings`` (transformers fills it in for these).
_ROPE_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def _with_rope(base: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters ``rope`` completed from those of the config ``base`` they replace (per layer type
    when ``rope`` is a dict of dicts): see :func:`_complete_rope`."""
    old = base.get("rope_parameters") or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return {
            k: _complete_rope(v, old.get(k) if isinstance(old.get(k), dict) else old, base)
            for k, v in rope.items()
        }
    return _complete_rope(rope, old, base)


def _complete_rope(rope: dict[str, Any], old: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """``rope`` with the config's ``rope_theta`` (a fresh dict would fall back to 10000, silently, for a
    Llama-3 at 500000) and, for the types that read it, the length the model was pretrained at: the config's
    ``original_max_position_embeddings``, else its ``max_position_embeddings`` BEFORE the overrides
    (transformers would take the new one, and yarn would scale from the wrong length)."""
    new = dict(rope)
    for key in _ROPE_INHERITED:
        value = old.get(key, base.get(key))
        if key not in new and value is not None:
            new[key] = value
    if new.get("rope_type", new.get("type")) in _ROPE_ORIGINAL_LENGTH:
        original = old.get("original_max_position_embeddings") or base.get("max_position_embeddings")
        if original is not None:
            new.setdefault("original_max_position_embeddings", original)
    return new


def build_config(
    model_config: dict[str, Any] | None = None,
    pretrained_path: str | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Any:
    """The transformers config of ``model_config`` (a dict with ``model_type``) or of the ``config.json`` in
    the LOCAL folder ``pretrained_path``, with ``config_overrides`` applied (:func:`apply_overrides`)."""
    from transformers import AutoConfig

    if pretrained_path is not None:
        config = AutoConfig.from_pretrained(pretrained_path, local_files_only=True)
    else:
        cfg = dict(model_config or {})
        if "model_type" not in cfg:
            raise ValueError(f"model_config needs a 'model_type' (e.g. 'llama'); got keys {sorted(cfg)}")
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    return apply_overrides(config, config_overrides)


def apply_overrides(config: Any, config_overrides: dict[str, Any] | None) -> Any:
    """``config`` (a transformers config) with the fields of ``config_overrides`` set, as a new config. Raises
    ``ValueError`` naming any key the config does not have. A new ``rope_parameters`` / ``rope_scaling`` keeps
    the config's ``rope_theta`` (a fresh dict would fall back to 10000) and, for the types that scale from it,
    takes the config's length BEFORE the overrides as ``original_max_position_embeddings``."""
    if not config_overrides:
        return config
    base = config.to_dict()
    known = {
        *base,
        *inspect.signature(type(config).__init__).parameters,
        *getattr(config, "attribute_map", {}),
    }
    unknown = sorted(k for k in config_overrides if k not in known and k not in ROPE_KEYS)
    if unknown:
        hints = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
        hint = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in hints.items() if m)
        raise ValueError(
            f"config_overrides has keys that {type(config).__name__} does not have: {unknown}"
            + (f" ({hint})" if hint else "")
            + ". transformers would keep them without effect; check the spelling against the model's config.json"
        )
    merged = {**base, **{k: v for k, v in config_overrides.items() if k not in ROPE_KEYS}}
    rope = next((config_overrides[k] for k in ROPE_KEYS if k in config_overrides), None)
    if rope is not None:
        merged.pop("rope_scaling", None)
        merged["rope_parameters"] = _with_rope(base, rope)
    return type(config).from_dict(merged)
