"""The op registry. Each op is declared once with:

- `inputs`: operand names in order; `name?` marks a trailing optional operand, `*name` a trailing
  variadic list;
- `outputs`: result names;
- `attrs`: attribute name -> `Attr(kinds, default)`; kinds are Python types (int, float, str, bool,
  list, type(None));
- `infer(a, attrs) -> [TensorType]`: the type rule over bound operand types;
- `reference(a, attrs) -> Tensor | tuple`: the torch semantics over bound operand tensors (compute
  dtype chosen by the interpreter);
- `flops(a, outs, attrs)` and `bytes(a, outs, attrs)`: cost as sympy expressions (bytes defaults to
  every operand and result read or written once);
- `inplace`: result index -> operand name that the op updates in place (a cache or state pool). The
  operand is consumed: the verifier rejects any later use of it.

Every op also accepts the scheduling attributes of `SCHEDULING_ATTRS`, which say where a node runs, never
what it computes: `overlap="<what it runs beside>"` puts the node on the runtime's second CUDA stream
(k31c/runtime/executor.py; set by passes/overlapped_mla_query.py and passes/overlapped_moe_branches.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import sympy

_REQUIRED = object()


@dataclass(frozen=True)
class Attr:
    kinds: tuple
    default: Any = _REQUIRED

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


def attr(*kinds, default=_REQUIRED) -> Attr:
    return Attr(tuple(kinds), default)


SCHEDULING_ATTRS = {"overlap": attr(str)}


@dataclass
class OpDef:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    infer: Callable
    reference: Callable
    attrs: dict[str, Attr] = field(default_factory=dict)
    flops: Callable | None = None
    bytes: Callable | None = None
    inplace: dict[int, str] = field(default_factory=dict)
    doc: str = ""

    # ---- operand binding --------------------------------------------------------------------
    @property
    def min_inputs(self) -> int:
        return sum(1 for n in self.inputs if not n.endswith("?") and not n.startswith("*"))

    @property
    def variadic(self) -> bool:
        return bool(self.inputs) and self.inputs[-1].startswith("*")

    def bind(self, operands: list) -> SimpleNamespace:
        """Map positional operands (types or tensors) to names; absent optionals are None."""
        n = len(operands)
        fixed = [x for x in self.inputs if not x.startswith("*")]
        if n < self.min_inputs or (not self.variadic and n > len(fixed)):
            raise ValueError(f"op {self.name} takes operands ({', '.join(self.inputs)}), got {n}")
        ns = SimpleNamespace()
        for i, name in enumerate(fixed):
            setattr(ns, name.rstrip("?"), operands[i] if i < n else None)
        if self.variadic:
            setattr(ns, self.inputs[-1][1:], list(operands[len(fixed):]))
        return ns

    def operand_index(self, name: str) -> int:
        return [x.rstrip("?").lstrip("*") for x in self.inputs].index(name)

    def full_attrs(self, attrs: dict) -> dict:
        out = {k: a.default for k, a in self.attrs.items() if not a.required}
        out.update(attrs)
        return out

    def check_attrs(self, attrs: dict) -> list[str]:
        problems = []
        for k, v in attrs.items():
            if k in SCHEDULING_ATTRS and k not in self.attrs:
                if not isinstance(v, SCHEDULING_ATTRS[k].kinds):
                    problems.append(f"scheduling attribute {k}={v!r} must be a string")
            elif k not in self.attrs:
                problems.append(f"unknown attribute {k!r} (op {self.name} takes {', '.join(self.attrs) or 'none'})")
            elif not isinstance(v, self.attrs[k].kinds) or (isinstance(v, bool) and bool not in self.attrs[k].kinds
                                                                and int in self.attrs[k].kinds):
                kinds = "/".join(t.__name__ for t in self.attrs[k].kinds)
                problems.append(f"attribute {k}={v!r} must be {kinds}")
        for k, a in self.attrs.items():
            if a.required and k not in attrs:
                problems.append(f"missing attribute {k!r}")
        return problems

    # ---- cost ---------------------------------------------------------------------------------
    def cost(self, in_types: list, out_types: list, attrs: dict) -> tuple[sympy.Expr, sympy.Expr]:
        a = self.bind(in_types)
        attrs = self.full_attrs(attrs)
        fl = self.flops(a, out_types, attrs) if self.flops else sympy.Integer(0)
        if self.bytes:
            by = self.bytes(a, out_types, attrs)
        else:
            by = sum((t.nbytes() for t in in_types), sympy.Integer(0))
            by += sum((t.nbytes() for i, t in enumerate(out_types) if i not in self.inplace), sympy.Integer(0))
        return sympy.sympify(fl), sympy.sympify(by)


OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in OPS:
        raise ValueError(f"op {op.name} registered twice")
    if op.variadic and any(x.endswith("?") for x in op.inputs):
        raise ValueError(f"op {op.name}: optional and variadic operands cannot be combined")
    OPS[op.name] = op
    return op


def defop(name, inputs, outputs, infer, reference, **kw) -> OpDef:
    return register(OpDef(name, tuple(inputs), tuple(outputs), infer, reference, **kw))


def get_op(name: str) -> OpDef:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}")
    return OPS[name]
