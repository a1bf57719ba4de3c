"""Parser for the text IR written by `ir.printer` (see its docstring for the grammar by example).

Errors name the line and column and what was expected. Result types are taken from the text (the
verifier, not the parser, checks them against the op's type rule), so a deliberately broken graph
can be parsed and then rejected by `verify`.
"""

from __future__ import annotations

import json
import re

from . import shapes as S
from .core import Function, Module, Node, Param, TensorType, Value
from .dtypes import DTYPES

_DT = "|".join(sorted(DTYPES, key=len, reverse=True))
_LEX = re.compile(
    rf"(?P<ws>\s+|#[^\n]*)"
    rf"|(?P<type>\b(?:{_DT})\[[^\]]*\])"
    r"|(?P<value>%[A-Za-z0-9_.]+)"
    r"|(?P<param>@[A-Za-z0-9_.\-]+)"
    r'|(?P<string>"(?:[^"\\]|\\.)*")'
    r"|(?P<number>-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+)|-inf\b)"
    r"|(?P<arrow>->)"
    r"|(?P<punct>[(){}\[\],:=])"
    r"|(?P<ident>[A-Za-z_][A-Za-z0-9_.]*)"
)


class ParseError(ValueError):
    pass


class _Tokens:
    def __init__(self, text: str):
        self.text, self.toks, pos = text, [], 0
        while pos < len(text):
            m = _LEX.match(text, pos)
            if not m:
                raise ParseError(f"{self._where(pos)}: unexpected character {text[pos]!r}")
            if m.lastgroup != "ws":
                self.toks.append((m.lastgroup, m.group(), pos))
            pos = m.end()
        self.i = 0

    def _where(self, pos: int) -> str:
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return f"line {line}, col {col}"

    def peek(self, k: int = 0):
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else ("eof", "", len(self.text))

    def error(self, expected: str):
        kind, text, pos = self.peek()
        return ParseError(f"{self._where(pos)}: expected {expected}, found {text or 'end of input'!r}")

    def take(self, kind: str, text: str | None = None) -> str:
        k, t, _ = self.peek()
        if k != kind or (text is not None and t != text):
            raise self.error(repr(text) if text else kind)
        self.i += 1
        return t

    def accept(self, kind: str, text: str | None = None) -> bool:
        k, t, _ = self.peek()
        if k == kind and (text is None or t == text):
            self.i += 1
            return True
        return False


def _comma(t: _Tokens, close: str):
    """Between list items: a ',' or else the closing bracket was expected."""
    if not t.accept("punct", ","):
        raise t.error(f"',' or '{close}'")


def _type(t: _Tokens) -> TensorType:
    pos = t.peek()[2]
    tok = t.take("type")
    try:
        return _parse_type(tok)
    except ValueError as e:
        raise ParseError(f"{t._where(pos)}: bad type {tok}: {e}") from None


def _parse_type(tok: str) -> TensorType:
    name, dims = tok[:-1].split("[", 1)
    parts = [d for d in dims.split(",")] if dims.strip() else []
    return TensorType(DTYPES[name], tuple(S.parse_dim(d) for d in parts))


def _attr_value(t: _Tokens):
    kind, text, _ = t.peek()
    if kind == "number":
        t.i += 1
        if text == "-inf":
            return float("-inf")
        return float(text) if any(c in text for c in ".eE") else int(text)
    if kind == "string":
        t.i += 1
        return json.loads(text)
    if kind == "ident" and text in ("true", "false", "none", "inf", "nan"):
        t.i += 1
        return {"true": True, "false": False, "none": None, "inf": float("inf"), "nan": float("nan")}[text]
    if t.accept("punct", "["):
        out = []
        while not t.accept("punct", "]"):
            if out:
                _comma(t, "]")
            out.append(_attr_value(t))
        return out
    raise t.error("an attribute value")


def _attrs(t: _Tokens) -> dict:
    out: dict = {}
    t.take("punct", "{")
    while not t.accept("punct", "}"):
        if out:
            _comma(t, "}")
        key = t.take("ident")
        t.take("punct", "=")
        out[key] = _attr_value(t)
    return out


class _Scope:
    def __init__(self, module: Module, t: _Tokens):
        self.module, self.t, self.values = module, t, {}

    def define(self, v: Value, pos: int | None = None):
        if v.name in self.values:
            where = self.t._where(self.t.peek()[2] if pos is None else pos)
            raise ParseError(f"{where}: value %{v.name} defined twice")
        self.values[v.name] = v

    def operand(self) -> Value:
        kind, text, pos = self.t.peek()
        if kind == "value":
            self.t.i += 1
            if text[1:] not in self.values:
                raise ParseError(f"{self.t._where(pos)}: use of undefined value {text}")
            return self.values[text[1:]]
        if kind == "param":
            self.t.i += 1
            if text[1:] not in self.module.params:
                raise ParseError(f"{self.t._where(pos)}: use of undeclared param {text}")
            return self.module.params[text[1:]].value()
        raise self.t.error("an operand (%value or @param)")


def _signature(t: _Tokens, scope: _Scope) -> list[Value]:
    t.take("punct", "(")
    out: list[Value] = []
    while not t.accept("punct", ")"):
        if out:
            _comma(t, ")")
        pos = t.peek()[2]
        name = t.take("value")[1:]
        t.take("punct", ":")
        v = Value(name, _type(t))
        scope.define(v, pos)
        out.append(v)
    return out


def _body(t: _Tokens, scope: _Scope, fn: Function):
    """Statements up to and including `return ...` and the closing brace."""
    while True:
        if t.accept("ident", "return"):
            while t.peek()[0] == "value":
                fn.outputs.append(scope.operand())
                if not t.accept("punct", ","):
                    break
            t.take("punct", "}")
            return
        fn.nodes.append(_statement(t, scope))


def _statement(t: _Tokens, scope: _Scope) -> Node:
    positions = [t.peek()[2]]
    names = [t.take("value")[1:]]
    while t.accept("punct", ","):
        positions.append(t.peek()[2])
        names.append(t.take("value")[1:])
    t.take("punct", "=")
    op = t.take("ident")
    t.take("punct", "(")
    inputs: list[Value] = []
    while not t.accept("punct", ")"):
        if inputs:
            _comma(t, ")")
        inputs.append(scope.operand())
    attrs = _attrs(t) if t.peek()[:2] == ("punct", "{") else {}
    t.take("punct", ":")
    types = [_type(t)]
    while t.accept("punct", ","):
        types.append(_type(t))
    if len(types) != len(names):
        raise t.error(f"{len(names)} result types")
    node = Node(op, inputs, attrs)
    if t.accept("ident", "body"):
        inner = _Scope(scope.module, t)
        body = Function(f"{op}.body")
        body.inputs = _signature(t, inner)
        t.take("punct", "{")
        _body(t, inner, body)
        node.body = body
    for name, ty, pos in zip(names, types, positions):
        v = Value(name, ty, node)
        scope.define(v, pos)
        node.outputs.append(v)
    return node


def parse_module(text: str) -> Module:
    t = _Tokens(text)
    t.take("ident", "module")
    m = Module(t.take("param")[1:])
    t.take("punct", "{")
    while not t.accept("punct", "}"):
        kw = t.take("ident")
        if kw == "attr":
            key = t.take("ident")
            t.take("punct", "=")
            m.attrs[key] = _attr_value(t)
        elif kw == "param":
            name = t.take("param")[1:]
            t.take("punct", ":")
            ty = _type(t)
            attrs = _attrs(t) if t.peek()[:2] == ("punct", "{") else {}
            shard = attrs.pop("shard", "rep")
            m.add_param(Param(name, ty, shard, attrs))
        elif kw == "func":
            m.add_function(_function(t, m))
        else:
            t.i -= 1
            raise t.error("'attr', 'param' or 'func'")
    if t.peek()[0] != "eof":
        raise t.error("end of input")
    return m


def _function(t: _Tokens, m: Module) -> Function:
    name = t.take("param")[1:]
    scope = _Scope(m, t)
    f = Function(name)
    f.inputs = _signature(t, scope)
    t.take("arrow")
    decl_pos = t.peek()[2]
    t.take("punct", "(")
    declared = []
    while not t.accept("punct", ")"):
        if declared:
            _comma(t, ")")
        declared.append(_type(t))
    if t.accept("ident", "attrs"):
        f.attrs = _attrs(t)
    t.take("punct", "{")
    _body(t, scope, f)
    got = [v.type for v in f.outputs]
    if len(got) != len(declared) or not all(a.same_as(b) for a, b in zip(got, declared)):
        raise ParseError(f"{t._where(decl_pos)}: function @{name}: expected the declared results "
                         f"({', '.join(map(str, declared))}), but it returns ({', '.join(map(str, got))})")
    return f
