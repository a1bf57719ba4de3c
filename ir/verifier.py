"""The verifier: structural and type checks of a module, every problem collected.

Checks: each value defined once and before use; params exist with the declared type; ops are
registered (or carry a body), operand counts and attributes match the op's declaration; result
types equal the op's type rule; a fused node's body takes its operands' types and returns its
result types; an operand updated in place (cache or state pool) is not used after that node and
is not returned; shape symbols are introduced by function inputs only.
"""

from __future__ import annotations

from .core import Function, Module, Node
from .ops import OPS
from .shapes import symbols_of


class VerifyError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"IR verification failed ({len(problems)} problem(s)):\n" +
                         "\n".join(f"  - {p}" for p in problems))


def verify(module: Module, raise_on_error: bool = True) -> list[str]:
    problems: list[str] = []
    for f in module.functions.values():
        _verify_function(module, f, f"@{f.name}", problems)
    if problems and raise_on_error:
        raise VerifyError(problems)
    return problems


def _verify_function(m: Module, f: Function, where: str, problems: list[str]):
    defined: dict[str, str] = {}  # value name -> "live" | "consumed by ..."
    syms = f.symbols()
    for v in f.inputs:
        if v.name in defined:
            problems.append(f"{where}: input %{v.name} declared twice")
        defined[v.name] = "live"
    for idx, n in enumerate(f.nodes):
        loc = f"{where} node {idx} ({', '.join(o.ref for o in n.outputs)} = {n.op})"
        for v in n.inputs:
            if v.is_param:
                p = m.params.get(v.name)
                if p is None:
                    problems.append(f"{loc}: undeclared param @{v.name}")
                elif not p.type.same_as(v.type):
                    problems.append(f"{loc}: param @{v.name} used as {v.type} but declared {p.type}")
            elif v.name not in defined:
                problems.append(f"{loc}: operand %{v.name} is not defined before use")
            elif defined[v.name] != "live":
                problems.append(f"{loc}: operand %{v.name} was already {defined[v.name]} and must not be used again")
        _check_node(m, n, loc, problems)
        for o in n.outputs:
            if o.name in defined:
                problems.append(f"{loc}: value %{o.name} defined twice")
            defined[o.name] = "live"
            extra = symbols_of(o.type.shape) - syms
            if extra:
                problems.append(f"{loc}: result {o.ref} uses shape symbols {sorted(extra)} not bound by the inputs")
        for i in consumed_operands(n):
            if i < len(n.inputs) and not n.inputs[i].is_param:
                defined[n.inputs[i].name] = f"updated in place by node {idx} ({n.op})"
    for v in f.outputs:
        if v.name not in defined:
            problems.append(f"{where}: returns undefined value %{v.name}")
        elif defined[v.name] != "live":
            problems.append(f"{where}: returns %{v.name}, which was {defined[v.name]}")


def consumed_operands(n: Node) -> list[int]:
    """Operand indices a node updates in place: declared by its op, or, for a node with a body,
    the body inputs that an op inside the body updates in place."""
    op = OPS.get(n.op)
    if op is not None and n.body is None:
        return [op.operand_index(name) for name in op.inplace.values()]
    if n.body is None:
        return []
    body_index = {id(v): i for i, v in enumerate(n.body.inputs)}
    out = []
    for inner in n.body.nodes:
        for i in consumed_operands(inner):
            j = body_index.get(id(inner.inputs[i])) if i < len(inner.inputs) else None
            if j is not None:
                out.append(j)
    return sorted(set(out))


def _check_node(m: Module, n: Node, loc: str, problems: list[str]):
    op = OPS.get(n.op)
    if op is None and n.body is None:
        problems.append(f"{loc}: unknown op {n.op!r} and no body to execute")
        return
    if n.body is not None:
        b = n.body
        if len(b.inputs) != len(n.inputs) or any(not x.type.same_as(y.type) for x, y in zip(b.inputs, n.inputs)):
            problems.append(f"{loc}: body takes ({', '.join(str(x.type) for x in b.inputs)}) "
                            f"but the node passes ({', '.join(str(x.type) for x in n.inputs)})")
        if len(b.outputs) != len(n.outputs) or any(not x.type.same_as(y.type) for x, y in zip(b.outputs, n.outputs)):
            problems.append(f"{loc}: body returns ({', '.join(str(x.type) for x in b.outputs)}) "
                            f"but the node declares ({', '.join(str(x.type) for x in n.outputs)})")
        _verify_function(m, b, f"{loc} body", problems)
    if op is None:
        return
    for p in op.check_attrs(n.attrs):
        problems.append(f"{loc}: {p}")
    try:
        a = op.bind([v.type for v in n.inputs])
        expected = op.infer(a, op.full_attrs(n.attrs))
    except (ValueError, TypeError, KeyError, IndexError) as e:
        problems.append(f"{loc}: type rule failed: {e}")
        return
    if len(expected) != len(n.outputs):
        problems.append(f"{loc}: op {n.op} produces {len(expected)} results, node declares {len(n.outputs)}")
        return
    for o, t in zip(n.outputs, expected):
        if not o.type.same_as(t):
            problems.append(f"{loc}: result {o.ref} declared {o.type} but op {n.op} gives {t}")
