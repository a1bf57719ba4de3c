"""The IR's data structures: TensorType, Value, Node, Function, Param, Module.

A `Module` holds parameters (`@name: dtype[shape]` with a sharding annotation and free-form attrs)
and entry functions. A `Function` is a straight-line SSA graph: typed inputs, nodes in execution
order, returned values. A `Node` applies a registered op (`ir/ops`) to operand values (function
inputs, earlier results, or `@param` references) with attributes, producing typed results. A node
created by a fusion pass may carry `body`, the `Function` it replaced, so the reference interpreter
can always execute it and its kernel can be checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from . import shapes as S
from .dtypes import DType, dtype as as_dtype


@dataclass(frozen=True)
class TensorType:
    dtype: DType
    shape: tuple  # tuple of sympy dims

    def __post_init__(self):
        object.__setattr__(self, "shape", S.shape(self.shape))

    @staticmethod
    def of(dt: str | DType, dims) -> "TensorType":
        return TensorType(as_dtype(dt), S.shape(dims))

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self):
        return S.numel(self.shape)

    def nbytes(self):
        return self.numel() * self.dtype.bits / 8

    def with_shape(self, dims) -> "TensorType":
        return TensorType(self.dtype, S.shape(dims))

    def with_dtype(self, dt) -> "TensorType":
        return TensorType(as_dtype(dt), self.shape)

    def same_as(self, other: "TensorType") -> bool:
        return self.dtype == other.dtype and S.shapes_equal(self.shape, other.shape)

    def __str__(self) -> str:
        return _type_str(self)


@lru_cache(maxsize=65536)
def _type_str(t: TensorType) -> str:
    """A type's text, once per distinct type (printing a full-size module's IR prints ~1M of them)."""
    return f"{t.dtype.name}{S.shape_str(t.shape)}"


class Value:
    """An SSA value: a function input, a node result, or a reference to a module parameter."""

    __slots__ = ("name", "type", "producer", "is_param")

    def __init__(self, name: str, type: TensorType, producer: "Node | None" = None, is_param: bool = False):
        self.name, self.type, self.producer, self.is_param = name, type, producer, is_param

    @property
    def ref(self) -> str:
        return ("@" if self.is_param else "%") + self.name

    def __repr__(self) -> str:
        return f"{self.ref}: {self.type}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Value]
    attrs: dict[str, Any]
    outputs: list[Value] = field(default_factory=list)
    body: "Function | None" = None

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise ValueError(f"node {self.op} has {len(self.outputs)} outputs")
        return self.outputs[0]


@dataclass(eq=False)
class Function:
    name: str
    inputs: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)

    def input(self, name: str) -> Value:
        for v in self.inputs:
            if v.name == name:
                return v
        raise KeyError(f"function @{self.name} has no input %{name}")

    def symbols(self) -> set[str]:
        out: set[str] = set()
        for v in self.inputs:
            out |= S.symbols_of(v.type.shape)
        return out

    def walk(self):
        """Every node, including nodes inside fused bodies (pre-order)."""
        for n in self.nodes:
            yield n
            if n.body is not None:
                yield from n.body.walk()


@dataclass
class Param:
    name: str
    type: TensorType
    shard: str = "rep"
    attrs: dict[str, Any] = field(default_factory=dict)

    def value(self) -> Value:
        return Value(self.name, self.type, None, is_param=True)


@dataclass(eq=False)
class Module:
    name: str
    params: dict[str, Param] = field(default_factory=dict)
    functions: dict[str, Function] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)

    def add_param(self, p: Param) -> Param:
        if p.name in self.params:
            raise ValueError(f"param @{p.name} declared twice")
        self.params[p.name] = p
        return p

    def add_function(self, f: Function) -> Function:
        if f.name in self.functions:
            raise ValueError(f"function @{f.name} declared twice")
        self.functions[f.name] = f
        return f

    def function(self, name: str) -> Function:
        if name not in self.functions:
            raise KeyError(f"module @{self.name} has no function @{name}; it has {', '.join(self.functions)}")
        return self.functions[name]

    def op_counts(self, fn: str | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in ([self.function(fn)] if fn else self.functions.values()):
            for n in f.walk():
                counts[n.op] = counts.get(n.op, 0) + 1
        return counts
