"""FPDT mode: how a CausalLM's forward turns its decoder's output into logits, read from its source.

FPDT replaces the model's ``lm_head`` + loss by a chunked version that never builds ``(s/P, vocab)``
logits, so it must reproduce whatever the forward does in between: a logit scale (Cohere's
``logit_scale``, Granite's ``logits_scaling``), a hidden-state scale (MiniCPM), a final soft-cap
(Gemma-2/3). :func:`read_chunked_head` parses the forward (Python ``ast``) at patch time, keeps those,
and refuses anything else with an error naming the statement: a silently different loss is never run.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True, eq=False)
class ChunkedHead:
    """How a CausalLM's forward turns its decoder's output into logits, read from its source at patch time
    (FPDT mode), so the chunked loss computes ``softcap(logit_scale * lm_head(hidden))`` exactly as it does.

    ``decoder`` is the attribute path of the module the forward calls (``"model"``, ``"model.decoder"``);
    ``output_cls`` the forward's own output class.
    """

    decoder: str
    logit_scale: float | None
    softcap: float | None
    output_cls: type


class _Unrecognized(Exception):
    """A statement of a CausalLM forward that the chunked loss cannot reproduce."""


def _refuse_head(name: str, what: str) -> ValueError:
    return ValueError(
        f"{name}: FPDT computes the logits and the loss in chunks in place of the model's own forward, but {what}, "
        "which the chunked loss would not reproduce (a silently different loss). Use mode='ulysses' (the "
        "strategy's fpdt_chunk_size=None), which keeps the model's own logits"
    )


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _calls_self_attr(node: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == attr
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
        for n in ast.walk(node)
    )


def _self_path(node: ast.AST) -> str | None:
    """``"model.decoder"`` for ``self.model.decoder``, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(reversed(parts)) if isinstance(node, ast.Name) and node.id == "self" and parts else None


class _HeadReader:
    """Reads the statements of a CausalLM forward between its decoder call and its loss, keeping the
    product of the logit scales and the final soft-cap; anything else raises :class:`_Unrecognized`."""

    def __init__(self, model: nn.Module, head: str, out: str) -> None:
        self.model, self.head, self.out = model, head, out
        self.scale, self.softcap, self.seen_head = 1.0, None, False
        self.names: dict[str, Any] = {}

    def value(self, node: ast.AST) -> Any:
        """A config / attribute value: ``self.config.x``, ``self.config.get_text_config().x``, a walrus name."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name) and (node.id == "self" or node.id in self.names):
            return self.model if node.id == "self" else self.names[node.id]
        if isinstance(node, ast.Attribute):
            try:
                return getattr(self.value(node.value), node.attr)
            except AttributeError:
                raise _Unrecognized(ast.unparse(node)) from None
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and not node.args + node.keywords
        ):
            if node.func.attr == "get_text_config":
                return self.value(node.func.value).get_text_config()
        if isinstance(node, ast.NamedExpr):
            self.names[node.target.id] = self.value(node.value)
            return self.names[node.target.id]
        if (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and ast.unparse(node.comparators[0]) == "None"
        ):
            is_none = self.value(node.left) is None
            return is_none if isinstance(node.ops[0], ast.Is) else not is_none
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self.value(node.operand)
        raise _Unrecognized(ast.unparse(node))

    def number(self, node: ast.AST) -> float:
        v = self.value(node)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Unrecognized(ast.unparse(node))
        return float(v)

    def multiply(self, factor: float) -> None:
        if self.softcap is not None:  # the chunked loss scales first, then caps
            raise _Unrecognized("a logits scale after the soft-cap")
        self.scale *= factor

    def is_hidden(self, node: ast.AST) -> bool:
        """``hidden_states`` as the decoder left it (sliced for logits_to_keep, cast, indexed)."""
        text = ast.unparse(node)
        if text in ("hidden_states", f"{self.out}.last_hidden_state", f"{self.out}[0]"):
            return True
        if isinstance(node, ast.Call) and text.startswith("slice_logits_to_keep("):
            return self.is_hidden(node.args[0])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
            return self.is_hidden(node.func.value)
        if isinstance(node, ast.Subscript) and "slice_indices" in ast.unparse(node.slice):
            return self.is_hidden(node.value)
        return False

    def logits_value(self, node: ast.AST) -> None:
        """``logits = <node>`` once or after the head call."""
        if isinstance(node, ast.Call) and isinstance(
            node.func, ast.Attribute
        ):  # casts: the loss runs in fp32
            call = ast.unparse(node)[len(ast.unparse(node.func.value)) :]
            if call in (".float()", ".contiguous()", ".to(torch.float32)"):
                return self.logits_value(node.func.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            factor = self.number(node.right)
            self.logits_value(node.left)
            return self.multiply(factor if isinstance(node.op, ast.Mult) else 1.0 / factor)
        if isinstance(node, ast.Call) and _self_path(node.func) == self.head and len(node.args) == 1:
            if self.seen_head or not self.is_hidden(node.args[0]):
                raise _Unrecognized(ast.unparse(node))
            self.seen_head = True
            return None
        if isinstance(node, ast.Name) and node.id == "logits" and self.seen_head:
            return None
        raise _Unrecognized(ast.unparse(node))

    def softcap_at(self, stmts: list[ast.stmt], i: int) -> int:
        """``logits = logits / c; logits = torch.tanh(logits); logits = logits * c``: returns statements used."""
        texts = [ast.unparse(s) for s in stmts[i : i + 3]]
        if len(texts) == 3 and texts[1] in (
            "logits = torch.tanh(logits)",
            "logits = nn.functional.tanh(logits)",
        ):
            first, last = stmts[i].value, stmts[i + 2].value
            if (
                isinstance(first, ast.BinOp)
                and isinstance(first.op, ast.Div)
                and ast.unparse(first.left) in ("logits", "logits.float()")
                and isinstance(last, ast.BinOp)
                and isinstance(last.op, ast.Mult)
                and ast.unparse(last.left) == "logits"
                and ast.unparse(first.right) == ast.unparse(last.right)
            ):
                if self.softcap is not None:
                    raise _Unrecognized("a second soft-cap")
                self.softcap = self.number(first.right)
                return 3
        return 0

    def run(self, stmts: list[ast.stmt]) -> None:
        i = 0
        while i < len(stmts):
            used = self.softcap_at(stmts, i) if self.seen_head else 0
            if used:
                i += used
                continue
            try:
                self.statement(stmts[i])
            except _Unrecognized as e:
                if isinstance(stmts[i], ast.If) or e.args[0].startswith("`"):  # already names its statement
                    raise
                text = ast.unparse(stmts[i])
                raise _Unrecognized(f"`{text}`" + ("" if e.args[0] in text else f" ({e})")) from None
            i += 1

    def statement(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return  # a docstring or bare string
        if isinstance(stmt, ast.If):
            try:
                taken = stmt.body if self.value(stmt.test) else stmt.orelse
            except _Unrecognized:  # e.g. "if hidden_states.shape[1] == ...": only logits_to_keep slicing
                if all(self.is_slicing(s) for s in stmt.body + stmt.orelse):
                    return
                raise
            return self.run(taken)
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
            if not isinstance(target, ast.Name) or (isinstance(stmt, ast.Assign) and len(stmt.targets) > 1):
                raise _Unrecognized(ast.unparse(stmt))
            if self.is_slicing(stmt):
                return
            if target.id == "hidden_states" and not self.seen_head:
                node = stmt.value
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and self.is_hidden(node.left):
                    if getattr(self.model.get_output_embeddings(), "bias", None) is not None:
                        raise _Unrecognized(ast.unparse(stmt) + " before a biased lm_head")
                    return self.multiply(1.0 / self.number(node.right))
                if self.is_hidden(node):
                    return None
                raise _Unrecognized(ast.unparse(stmt))
            if target.id == "logits":
                return self.logits_value(stmt.value)
            if not {"logits", "hidden_states"} & _names(stmt.value):
                self.names[target.id] = self.value(stmt.value)  # e.g. "cap = self.config.logits_soft_cap"
                return None
        raise _Unrecognized(ast.unparse(stmt))

    def is_slicing(self, stmt: ast.stmt) -> bool:
        text = ast.unparse(stmt)
        if text.startswith("slice_indices = ") and "logits_to_keep" in text:
            return True
        return (
            isinstance(stmt, ast.Assign)
            and ast.unparse(stmt.targets[0]) == "hidden_states"
            and (text.startswith("hidden_states = slice_logits_to_keep(") and self.is_hidden(stmt.value))
        )


def _output_class(forward: Callable[..., Any]) -> type:
    """The ``ModelOutput`` class a CausalLM forward returns (from its return annotation)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    try:
        ret = typing.get_type_hints(forward).get("return")
    except Exception:  # unresolvable annotations: the plain CausalLM output
        ret = None
    for cls in typing.get_args(ret) or (ret,):
        if isinstance(cls, type) and issubclass(cls, ModelOutput):
            return cls
    return CausalLMOutputWithPast


def read_chunked_head(model: nn.Module, name: str) -> ChunkedHead:
    """Patch time, FPDT: what the model's forward does between its decoder and its loss, or a refusal."""
    head_module = model.get_output_embeddings()
    head = next((n for n, m in model.named_children() if m is head_module), None)
    forward = inspect.unwrap(type(model).forward)
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError) as e:
        raise _refuse_head(
            name, f"the source of its forward cannot be read to check its logits ({e})"
        ) from None
    at_head = next((i for i, s in enumerate(body) if head and _calls_self_attr(s, head)), None)
    if at_head is None:
        raise _refuse_head(name, f"its forward never calls its output embeddings (self.{head}) directly")
    decoder = out = None
    start = 0
    for i in range(at_head):
        s = body[i]
        target = s.targets[0] if isinstance(s, ast.Assign) else getattr(s, "target", None)
        if isinstance(s, (ast.Assign, ast.AnnAssign)) and isinstance(s.value, ast.Call):
            path = _self_path(s.value.func)
            if path is not None and path != head and isinstance(target, ast.Name):
                decoder, out, start = path, target.id, i + 1
    if decoder is None:
        raise _refuse_head(name, "its forward does not call a decoder module before its lm_head")
    segment = []
    for s in body[start:]:
        if isinstance(s, ast.Return) or {"loss", "labels"} & _names(s):
            break
        segment.append(s)
    reader = _HeadReader(model, head, out)
    try:
        reader.run(segment)
        if not reader.seen_head:
            raise _Unrecognized(f"`self.{head}(...)` (the head call) only in a form it does not read")
    except _Unrecognized as e:
        raise _refuse_head(name, f"its forward does {e} between its decoder and its loss") from None
    try:
        module = functools.reduce(getattr, decoder.split("."), model)
    except AttributeError:
        module = None
    if not isinstance(module, nn.Module):
        raise _refuse_head(name, f"its forward calls self.{decoder}, which is not a module of the model")
    return ChunkedHead(
        decoder=decoder,
        logit_scale=None if reader.scale == 1.0 else reader.scale,
        softcap=reader.softcap or None,
        output_cls=_output_class(forward),
    )
