"""Graph-rewriting helpers shared by the passes: use lists, and `fuse` — replace a group of nodes by
one fused node that keeps the group as its body (so the reference interpreter can still run it and
its kernel can be checked against it).

`fuse(fn, group, op)`:
- the fused node's operands are the values the group reads but does not define (function inputs,
  earlier results, `@params`), in order of first use; its body takes them as `%in0, %in1, ...`;
- its results are the group's values used after the group (or returned), under their own names;
- it takes the place of the group's last node. Precondition (checked): no node outside the group
  that lies between the group's first and last node reads a value the group defines.
"""

from __future__ import annotations

from ir.core import Function, Node, Value


class RewriteError(ValueError):
    pass


def uses(fn: Function) -> dict[int, list[Node]]:
    """id(Value) -> nodes reading it (function outputs not included)."""
    out: dict[int, list[Node]] = {}
    for n in fn.nodes:
        for v in n.inputs:
            out.setdefault(id(v), []).append(n)
    return out


def producer_index(fn: Function) -> dict[int, int]:
    return {id(o): i for i, n in enumerate(fn.nodes) for o in n.outputs}


def single_user(fn: Function, v: Value, use_map=None) -> Node | None:
    users = (use_map or uses(fn)).get(id(v), [])
    returned = any(o is v for o in fn.outputs)
    return users[0] if len(users) == 1 and not returned else None


def _param_key(v: Value):
    return ("@", v.name) if v.is_param else ("%", id(v))


def fuse(fn: Function, group: list[Node], op: str, attrs: dict | None = None) -> Node:
    index = {id(n): i for i, n in enumerate(fn.nodes)}
    missing = [n.op for n in group if id(n) not in index]
    if missing:
        raise RewriteError(f"fuse {op}: nodes {missing} are not in @{fn.name}")
    group = sorted(group, key=lambda n: index[id(n)])
    members = {id(n) for n in group}
    defined = {id(o) for n in group for o in n.outputs}
    first, last = index[id(group[0])], index[id(group[-1])]
    for n in fn.nodes[first:last + 1]:
        if id(n) not in members and any(id(v) in defined for v in n.inputs):
            raise RewriteError(f"fuse {op}: node {n.op} ({', '.join(o.ref for o in n.outputs)}) between the group's "
                               f"nodes reads a value the group defines")
    # operands: values read but not defined by the group, in first-use order
    operands: list[Value] = []
    seen: dict = {}
    for n in group:
        for v in n.inputs:
            if id(v) not in defined and _param_key(v) not in seen:
                seen[_param_key(v)] = len(operands)
                operands.append(v)
    # results: group values read after the group or returned
    later_reads = {id(v) for n in fn.nodes[last + 1:] for v in n.inputs} | {id(v) for v in fn.outputs}
    escaping = [o for n in group for o in n.outputs if id(o) in later_reads]
    # body: the group with operands replaced by body inputs
    body_inputs = [Value(f"in{i}", v.type) for i, v in enumerate(operands)]
    body_nodes = []
    for n in group:
        new_inputs = [body_inputs[seen[_param_key(v)]] if id(v) not in defined else v for v in n.inputs]
        body_nodes.append(Node(n.op, new_inputs, dict(n.attrs), list(n.outputs), n.body))
    body = Function(f"{op}.body", body_inputs, body_nodes, list(escaping))
    fused = Node(op, list(operands), dict(attrs or {}), body=body)
    fused.outputs = [Value(o.name, o.type, fused) for o in escaping]
    replace = {id(old): new for old, new in zip(escaping, fused.outputs)}
    for n in fn.nodes[last + 1:]:
        n.inputs = [replace.get(id(v), v) for v in n.inputs]
    fn.outputs = [replace.get(id(v), v) for v in fn.outputs]
    fn.nodes = [n for n in fn.nodes[:last + 1] if id(n) not in members] + [fused] + fn.nodes[last + 1:]
    return fused


def move_after(fn: Function, node: Node, anchor: Node):
    """Move `node` to just after `anchor` (the caller guarantees its operands are defined before)."""
    fn.nodes.remove(node)
    fn.nodes.insert(fn.nodes.index(anchor) + 1, node)
