"""FPDT mode: how a CausalLM's forward turns its decoder's output into logits, read from its source.

FPDT replaces the model's ``lm_head`` + loss by a chunked version that never builds ``(s/P, vocab)``
logits, so it must reproduce whatever the forward does in between: a logit scale (Cohere's
``logit_scale``, Granite's ``logits_scaling``), a hidden-state scale (MiniCPM), a final soft-cap
(Gemma-2/3). :func:`read_chunked_head` parses the forward (Python ``ast``) at patch time, keeps those,
and refuses anything else with an error naming the statement: a silently different loss is never run.

A soft-cap is ``c * tanh(x / c)`` by one value ``c`` read at patch time (the config's, directly or through
a local name): as three statements (Gemma-2), as one expression in either order (RecurrentGemma), or
through a module-level function whose body is exactly that expression, optionally behind
``if c is None: return x`` (xLSTM's ``soft_cap``). ``tanh`` is recognised by what the name resolves to in
the forward's module (``torch.tanh``, ``nn.functional.tanh``), not by its spelling. An ``if`` whose test is
known only when the forward runs (``self.training``, a shape) is read only when both branches do the same
to the logits; xLSTM's inference branch soft-caps the logits in place tile by tile, which is read as the
element-wise soft-cap of all of them (its ``torch.no_grad()`` changes no value).
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
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


_MISSING = object()
_TANH = (torch.tanh, torch.nn.functional.tanh)


def _stored_names(fn: ast.AST) -> set[str]:
    """The local names of a function: its parameters and every name it assigns."""
    names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names | {a.arg for a in ast.walk(fn) if isinstance(a, ast.arg)}


def _resolver(namespace: dict[str, Any], local: set[str]) -> Callable[[ast.AST], Any]:
    """The object a global name / attribute chain (``torch.tanh``, ``nn.functional.tanh``, ``soft_cap``) is
    in ``namespace`` (a function's globals, then builtins), or ``_MISSING``; names local to the function
    (``local``) are not globals."""

    def resolve(node: ast.AST) -> Any:
        if isinstance(node, ast.Name):
            if node.id in local:
                return _MISSING
            return namespace.get(node.id, getattr(builtins, node.id, _MISSING))
        if isinstance(node, ast.Attribute):
            owner = resolve(node.value)
            return _MISSING if owner is _MISSING else getattr(owner, node.attr, _MISSING)
        return _MISSING

    return resolve


def _tanh_of(node: ast.AST, resolve: Callable[[ast.AST], Any]) -> ast.expr | None:
    """``x`` for ``torch.tanh(x)`` / ``nn.functional.tanh(x)`` (by what the name resolves to) / ``x.tanh()``."""
    if not isinstance(node, ast.Call) or node.keywords:
        return None
    if len(node.args) == 1 and not isinstance(node.args[0], ast.Starred):
        fn = resolve(node.func)
        return node.args[0] if any(fn is t for t in _TANH) else None
    if not node.args and isinstance(node.func, ast.Attribute) and node.func.attr == "tanh":
        return node.func.value
    return None


def _softcap_parts(
    node: ast.AST, resolve: Callable[[ast.AST], Any]
) -> tuple[ast.expr, ast.expr, ast.expr] | None:
    """``(x, c, d)`` for ``c * tanh(x / d)`` or ``tanh(x / d) * c`` (a soft-cap when ``c`` equals ``d``)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return None
    for t, c in ((node.left, node.right), (node.right, node.left)):
        inner = _tanh_of(t, resolve)
        if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Div):
            return inner.left, c, inner.right
    return None


@dataclass(frozen=True)
class _SoftcapHelper:
    """A function that soft-caps its argument ``x`` by its argument ``cap`` (identity for ``cap=None`` when
    ``none_guard``)."""

    signature: inspect.Signature
    x: str
    cap: str
    none_guard: bool


def _softcap_helper(fn: Any) -> _SoftcapHelper | None:
    """``fn`` as a soft-cap when its whole body (docstring aside) is ``return cap * tanh(x / cap)`` (either
    order), optionally after ``if cap is None: return x``; else None. Read from its source, undecorated."""
    if not inspect.isfunction(fn) or hasattr(fn, "__wrapped__"):
        return None
    try:
        defn = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        signature = inspect.signature(fn)
    except (OSError, TypeError, SyntaxError, IndexError, ValueError):
        return None
    if not isinstance(defn, ast.FunctionDef) or defn.decorator_list or defn.name != fn.__name__:
        return None
    body = list(defn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    parts = _softcap_parts(body[-1].value, _resolver(fn.__globals__, _stored_names(defn)))
    if parts is None or not all(isinstance(p, ast.Name) for p in parts):
        return None
    x, c, d = (typing.cast(ast.Name, p).id for p in parts)
    if c != d or x == c or not {x, c} <= set(signature.parameters):
        return None
    if len(body) == 1:
        return _SoftcapHelper(signature, x, c, none_guard=False)
    guard = body[0]
    if (
        len(body) == 2
        and isinstance(guard, ast.If)
        and not guard.orelse
        and ast.unparse(guard.test) == f"{c} is None"
        and len(guard.body) == 1
        and isinstance(guard.body[0], ast.Return)
        and ast.unparse(guard.body[0]) == f"return {x}"
    ):
        return _SoftcapHelper(signature, x, c, none_guard=True)
    return None


def _number(v: Any, text: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Unrecognized(text)
    return float(v)


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

    def __init__(self, model: nn.Module, head: str, out: str, resolve: Callable[[ast.AST], Any]) -> None:
        self.model, self.head, self.out, self.resolve = model, head, out, resolve
        self.scale, self.softcap, self.seen_head = 1.0, None, False
        self.names: dict[str, Any] = {}

    def fork(self) -> _HeadReader:
        other = _HeadReader(self.model, self.head, self.out, self.resolve)
        other.scale, other.softcap, other.seen_head = self.scale, self.softcap, self.seen_head
        other.names = dict(self.names)
        return other

    def value(self, node: ast.AST) -> Any:
        """A config / attribute value: ``self.config.x``, ``self.config.get_text_config().x``, a walrus name."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name) and (node.id == "self" or node.id in self.names):
            return self.model if node.id == "self" else self.names[node.id]
        if isinstance(node, ast.Attribute):
            owner = self.value(node.value)
            if node.attr == "training" and isinstance(owner, nn.Module):  # known only when the forward runs
                raise _Unrecognized(ast.unparse(node))
            try:
                return getattr(owner, node.attr)
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
        return _number(self.value(node), ast.unparse(node))

    def multiply(self, factor: float) -> None:
        if self.softcap is not None:  # the chunked loss scales first, then caps
            raise _Unrecognized("a logits scale after the soft-cap")
        self.scale *= factor

    def cap(self, value: float) -> None:
        if self.softcap is not None:
            raise _Unrecognized("a second soft-cap")
        if value == 0.0:
            raise _Unrecognized("a soft-cap by 0")
        self.softcap = value

    def softcap_of(self, x: ast.expr, c: ast.expr, d: ast.expr) -> None:
        """``c * tanh(x / d)``: the soft-cap of ``x`` when ``c`` and ``d`` are the same value."""
        cap = self.number(c)
        if self.number(d) != cap:
            raise _Unrecognized(f"a tanh scaled by {ast.unparse(c)} != 1 / {ast.unparse(d)} (not a soft-cap)")
        self.logits_value(x)
        self.cap(cap)

    def helper_call(self, node: ast.Call, helper: _SoftcapHelper) -> None:
        """``soft_cap(logits, cap)``, a call of a module-level soft-cap function."""
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            raise _Unrecognized(ast.unparse(node))
        try:
            bound = helper.signature.bind(*node.args, **{k.arg: k.value for k in node.keywords if k.arg})
        except TypeError:
            raise _Unrecognized(ast.unparse(node)) from None
        bound.apply_defaults()
        x, cap = bound.arguments[helper.x], bound.arguments[helper.cap]
        if not isinstance(x, ast.expr):
            raise _Unrecognized(ast.unparse(node))
        value = self.value(cap) if isinstance(cap, ast.expr) else cap
        self.logits_value(x)
        if value is None and helper.none_guard:
            return None  # no cap: the logits as they are
        self.cap(_number(value, f"{ast.unparse(node)} (its cap {value!r})"))

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
        parts = _softcap_parts(node, self.resolve)
        if parts is not None:
            return self.softcap_of(*parts)
        if isinstance(node, ast.Call):
            helper = _softcap_helper(self.resolve(node.func))
            if helper is not None:
                return self.helper_call(node, helper)
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
        three = stmts[i : i + 3]
        if len(three) < 3 or not all(
            isinstance(s, ast.Assign) and len(s.targets) == 1 and ast.unparse(s.targets[0]) == "logits"
            for s in three
        ):
            return 0
        first, middle, last = (typing.cast(ast.Assign, s).value for s in three)
        if not (isinstance(first, ast.BinOp) and isinstance(first.op, ast.Div)):
            return 0
        inner = _tanh_of(middle, self.resolve)
        if not (isinstance(inner, ast.Name) and inner.id == "logits"):
            return 0
        if not (isinstance(last, ast.BinOp) and isinstance(last.op, ast.Mult)):
            return 0
        sides = [ast.unparse(last.left), ast.unparse(last.right)]
        if "logits" not in sides:
            return 0
        c = last.right if sides[0] == "logits" else last.left
        self.softcap_of(first.left, c, first.right)
        return 3

    def tiled_at(self, stmts: list[ast.stmt], i: int) -> int:
        """``k = 0; [with torch.no_grad():] while k < logits.shape[d]: logits[:, ..., k : min(k + n,
        logits.shape[d])] = f(<that slice>); k += n`` (xLSTM's inference branch): ``logits = f(logits)`` in
        tiles along ``d``, for an element-wise ``f`` (all :meth:`logits_value` reads after the head call
        are). Returns statements used."""
        if i + 1 >= len(stmts):
            return 0
        init, loop = stmts[i], stmts[i + 1]
        if not (
            isinstance(init, ast.Assign)
            and len(init.targets) == 1
            and isinstance(init.targets[0], ast.Name)
            and isinstance(init.value, ast.Constant)
            and type(init.value.value) is int
            and init.value.value == 0
        ):
            return 0
        k = init.targets[0].id
        if (
            isinstance(loop, ast.With)
            and len(loop.items) == 1
            and loop.items[0].optional_vars is None
            and isinstance(call := loop.items[0].context_expr, ast.Call)
            and not call.args + call.keywords
            and self.resolve(call.func) is torch.no_grad
            and len(loop.body) == 1
        ):
            loop = loop.body[0]  # the same values; only the model's own gradient skips them
        if not (isinstance(loop, ast.While) and not loop.orelse and len(loop.body) == 2):
            return 0
        test, (assign, step) = loop.test, loop.body
        if not (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Lt)
            and ast.unparse(test.left) == k
            and isinstance(length := test.comparators[0], ast.Subscript)
            and ast.unparse(length.value) == "logits.shape"
            and isinstance(length.slice, ast.Constant)
            and type(dim := length.slice.value) is int
            and dim >= 0
        ):
            return 0
        if not (
            isinstance(step, ast.AugAssign)
            and isinstance(step.op, ast.Add)
            and ast.unparse(step.target) == k
            and isinstance(assign, ast.Assign)
            and len(assign.targets) == 1
            and isinstance(target := assign.targets[0], ast.Subscript)
            and ast.unparse(target.value) == "logits"
        ):
            return 0
        size = self.value(step.value)
        if type(size) is not int or size <= 0:
            raise _Unrecognized(f"tiles of {ast.unparse(step.value)} = {size!r}")
        index = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
        tile = index[-1]
        if not (
            len(index) == dim + 1
            and all(ast.unparse(e) == ":" for e in index[:-1])
            and isinstance(tile, ast.Slice)
            and tile.step is None
            and tile.lower is not None
            and ast.unparse(tile.lower) == k
            and tile.upper is not None
            and self.tile_end(tile.upper, k, size, ast.unparse(length))
        ):
            return 0
        sliced = ast.unparse(target)

        class _Whole(ast.NodeTransformer):
            def visit(self, node: ast.AST) -> ast.AST:
                if isinstance(node, ast.expr) and ast.unparse(node) == sliced:
                    return ast.Name(id="logits", ctx=ast.Load())
                return super().visit(node)

        f = _Whole().visit(ast.parse(ast.unparse(assign.value), mode="eval").body)
        if k in _names(f):  # f depends on the tile's position: not element-wise
            raise _Unrecognized(f"`{ast.unparse(assign)}`")
        self.logits_value(f)
        return 2

    def tile_end(self, node: ast.expr, k: str, size: int, length: str) -> bool:
        """``k + n`` or ``min(k + n, logits.shape[d])`` (either order), ``n`` the tile size."""

        def plus(e: ast.expr) -> bool:
            if not (isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add)):
                return False
            for a, b in ((e.left, e.right), (e.right, e.left)):
                if ast.unparse(a) == k:
                    try:
                        return self.value(b) == size
                    except _Unrecognized:
                        return False
            return False

        if plus(node):
            return True
        if (
            isinstance(node, ast.Call)
            and self.resolve(node.func) is builtins.min
            and not node.keywords
            and len(node.args) == 2
        ):
            a, b = node.args
            return (plus(a) and ast.unparse(b) == length) or (plus(b) and ast.unparse(a) == length)
        return False

    def either(self, stmt: ast.If) -> None:
        """``if <known only at run time>:``: both branches read, and they must do the same to the logits."""
        if any(
            isinstance(n, (ast.Call, ast.NamedExpr, ast.Await, ast.Yield, ast.Lambda))
            for n in ast.walk(stmt.test)
        ):
            raise _Unrecognized(f"`if {ast.unparse(stmt.test)}:` (a test that calls or assigns)")
        a, b = self.fork(), self.fork()
        a.run(stmt.body)
        b.run(stmt.orelse)
        if (a.scale, a.softcap, a.seen_head) != (b.scale, b.softcap, b.seen_head):
            raise _Unrecognized(
                f"`if {ast.unparse(stmt.test)}:` (known only when the forward runs) with branches that make "
                "different logits"
            )
        self.scale, self.softcap, self.seen_head = a.scale, a.softcap, a.seen_head
        self.names = {n: v for n, v in a.names.items() if n in b.names and b.names[n] is v}

    def run(self, stmts: list[ast.stmt]) -> None:
        i = 0
        while i < len(stmts):
            try:  # a soft-cap over three statements, a tiled loop over two, else one statement
                used = (self.softcap_at(stmts, i) or self.tiled_at(stmts, i)) if self.seen_head else 0
                if not used:
                    self.statement(stmts[i])
            except _Unrecognized as e:
                if isinstance(stmts[i], ast.If) or e.args[0].startswith("`"):  # already names its statement
                    raise
                text = ast.unparse(stmts[i])
                raise _Unrecognized(f"`{text}`" + ("" if e.args[0] in text else f" ({e})")) from None
            i += used or 1

    def statement(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return  # a docstring or bare string
        if isinstance(stmt, ast.If):
            try:
                taken = stmt.body if self.value(stmt.test) else stmt.orelse
            except _Unrecognized:  # e.g. "if hidden_states.shape[1] == ...": only logits_to_keep slicing
                if all(self.is_slicing(s) for s in stmt.body + stmt.orelse):
                    return
                return self.either(stmt)  # e.g. xLSTM's "if not self.training and ...", same either way
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
        defn = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
        body = defn.body
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
    reader = _HeadReader(model, head, out, _resolver(forward.__globals__, _stored_names(defn)))
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
