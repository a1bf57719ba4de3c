"""Building functions in Python: `FunctionBuilder` infers result types with the op's type rule and
names values readably (`%l3.q`, `%l3.q.1` on a clash), under optional name scopes."""

from __future__ import annotations

from contextlib import contextmanager

from .core import Function, Module, Node, TensorType, Value
from .ops import get_op


class FunctionBuilder:
    def __init__(self, module: Module, name: str, attrs: dict | None = None):
        self.module = module
        self.fn = Function(name, attrs=dict(attrs or {}))
        self._names: set[str] = set()
        self._scope: list[str] = []

    def _fresh(self, hint: str) -> str:
        base = ".".join([*self._scope, hint]) if hint else ".".join([*self._scope, "v"])
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}.{k}", k + 1
        self._names.add(name)
        return name

    @contextmanager
    def scope(self, name: str):
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def input(self, name: str, dtype, dims) -> Value:
        if name in self._names:
            raise ValueError(f"input %{name} declared twice")
        self._names.add(name)
        v = Value(name, TensorType.of(dtype, dims))
        self.fn.inputs.append(v)
        return v

    def param(self, name: str) -> Value:
        if name not in self.module.params:
            raise KeyError(f"module has no param @{name}")
        return self.module.params[name].value()

    def op(self, opname: str, *operands: Value, name: str | None = None, **attrs):
        """Append a node; returns its single result, or a tuple of results."""
        op = get_op(opname)
        attrs = {k: v for k, v in attrs.items()}
        problems = op.check_attrs(attrs)
        if problems:
            raise ValueError(f"{opname}: " + "; ".join(problems))
        types = op.infer(op.bind([v.type for v in operands]), op.full_attrs(attrs))
        node = Node(opname, list(operands), attrs)
        hints = [name or opname] if len(types) == 1 else [f"{name or opname}.{o}" for o in op.outputs]
        node.outputs = [Value(self._fresh(h), t, node) for h, t in zip(hints, types)]
        self.fn.nodes.append(node)
        return node.outputs[0] if len(types) == 1 else tuple(node.outputs)

    def ret(self, *values: Value) -> Function:
        self.fn.outputs = list(values)
        return self.fn
