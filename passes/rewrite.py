"""Graph-rewriting helpers shared by the passes: use lists, and `fuse` — replace a group of nodes by
one fused node that keeps the group as its body (so the reference interpreter can still run it and
its kernel can be checked against it).

`fuse(fn, group, op)`:
- the fused node's operands are the values the group reads but does not define (function inputs,
  earlier results, `@params`), in order of first use; its body takes them as `%in0, %in1, ...`;
- its results are the group's values used after the group (or returned), under their own names, plus any
  value of `keep` (a result the fused op's signature always has, even when nothing reads it);
- it takes the place of the group's last node. Precondition (checked): no node outside the group
  that lies between the group's first and last node reads a value the group defines.

`Index(fn)`: the function's producers and readers, built once and kept current by `fuse(..., index=)`, so that a
pass that rewrites node by node (`rewrite_each(..., indexed=True)`) does not rebuild them for every node: on the
full-size model (10k nodes a function) the rebuilt use lists made the per-node passes quadratic.
"""

from __future__ import annotations

from contextlib import contextmanager

from ir.core import Function, Node, Value

from .base import PassError

PACKED_OP = "fused.packed_linear"  # created by packed_projection; split again by take_from_pack


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


class Index:
    """Producers (id(Value) -> top-level node) and readers (id(Value) -> top-level nodes, function outputs not
    included) of `fn`, as `producers(fn)` / `uses(fn)` give them; valid while `fn` changes only through
    `fuse(..., index=self)`."""

    def __init__(self, fn: Function):
        self.fn, self.made_by, self.users = fn, producers(fn), uses(fn)
        self._names: Names | None = None

    def fresh_name(self, base: str) -> str:
        """`fresh_name(fn, base)` through one `Names` of the function (collected on first use)."""
        self._names = self._names or Names(self.fn)
        return self._names.fresh(base)

    def producer(self, v: Value) -> Node | None:
        return self.made_by.get(id(v))

    def single_user(self, v: Value) -> Node | None:
        return single_user(self.fn, v, self.users)

    def readers(self, v: Value) -> list[Node]:
        """The top-level nodes reading `v`, each once (a node reading it twice is listed once), in index order."""
        return list({id(n): n for n in self.users.get(id(v), ())}.values())

    @contextmanager
    def rewired(self, node: Node):
        """`drop` the node, let the pass change its inputs or outputs in place inside the block, then `add` it."""
        self.drop(node)
        yield node
        self.add(node)

    def drop(self, node: Node):
        """Forget `node` as a reader of its inputs and as the producer of its outputs: call before a pass changes
        its inputs or outputs in place (then `add` it again) or removes it from the function."""
        for v in node.inputs:
            if id(v) in self.users:
                self.users[id(v)] = [r for r in self.users[id(v)] if r is not node]
        for o in node.outputs:
            if self.made_by.get(id(o)) is node:
                del self.made_by[id(o)]

    def add(self, node: Node):
        """Record `node`, placed in the function by the pass itself (not by `fuse`), as a reader and producer."""
        for v in node.inputs:
            self.users.setdefault(id(v), []).append(node)
        for o in node.outputs:
            self.made_by[id(o)] = node

    def escapes(self, group: list[Node]) -> set[int]:
        """`group_escapes(fn, group)` from the maps: ids of the group's values read outside it or returned."""
        members = {id(n) for n in group}
        returned = {id(v) for v in self.fn.outputs}
        return {id(o) for n in group for o in n.outputs
                if id(o) in returned or any(id(r) not in members for r in self.users.get(id(o), ()))}

    def _fused(self, group: list[Node], fused: Node, replace: dict):
        """Bring the maps up to date after `fuse` replaced `group` by `fused` (escaping value id -> fused result)."""
        members = {id(n) for n in group}
        for n in group:     # in program order: a value is defined before the group reads it
            for v in n.inputs:
                if id(v) in self.users:
                    self.users[id(v)] = [r for r in self.users[id(v)] if id(r) not in members]
            for o in n.outputs:
                self.made_by.pop(id(o), None)
                readers = self.users.pop(id(o), [])
                if id(o) in replace:
                    self.users[id(replace[id(o)])] = [r for r in readers if id(r) not in members]
        for v in fused.inputs:
            self.users.setdefault(id(v), []).append(fused)
        for o in fused.outputs:
            self.made_by[id(o)] = fused


def value_key(v: Value):
    """Operand identity as `fuse` sees it: a parameter by name, any other value by object."""
    return ("@", v.name) if v.is_param else ("%", id(v))


def fuse(fn: Function, group: list[Node], op: str, attrs: dict | None = None, keep: tuple = (),
         index: Index | None = None) -> Node:
    try:
        at = {id(n): fn.nodes.index(n) for n in group}
    except ValueError:
        present = {id(n) for n in fn.nodes}
        raise RewriteError(f"fuse {op}: nodes {[n.op for n in group if id(n) not in present]} are not in @{fn.name}") \
            from None
    group = sorted(group, key=lambda n: at[id(n)])
    members = {id(n) for n in group}
    defined = {id(o) for n in group for o in n.outputs}
    first, last = at[id(group[0])], at[id(group[-1])]
    for n in fn.nodes[first:last + 1]:
        if id(n) not in members and any(id(v) in defined for v in n.inputs):
            raise RewriteError(f"fuse {op}: node {n.op} ({', '.join(o.ref for o in n.outputs)}) between the group's "
                               f"nodes reads a value the group defines")
    # operands: values read but not defined by the group, in first-use order
    operands: list[Value] = []
    seen: dict = {}
    for n in group:
        for v in n.inputs:
            if id(v) not in defined and value_key(v) not in seen:
                seen[value_key(v)] = len(operands)
                operands.append(v)
    # results: group values read after the group, returned, or kept (readers outside the group come after it: SSA
    # order, and the check above)
    if index is None:
        later = fn.nodes[last + 1:]
        later_reads = {id(v) for n in later for v in n.inputs}
    else:
        later = None
        later_reads = {id(o) for n in group for o in n.outputs
                       if any(id(r) not in members for r in index.users.get(id(o), ()))}
    later_reads |= {id(v) for v in fn.outputs} | {id(v) for v in keep}
    escaping = [o for n in group for o in n.outputs if id(o) in later_reads]
    # body: the group with operands replaced by body inputs
    body_inputs = [Value(f"in{i}", v.type) for i, v in enumerate(operands)]
    body_nodes = []
    for n in group:
        new_inputs = [body_inputs[seen[value_key(v)]] if id(v) not in defined else v for v in n.inputs]
        body_nodes.append(Node(n.op, new_inputs, dict(n.attrs), list(n.outputs), n.body))
    body = Function(f"{op}.body", body_inputs, body_nodes, list(escaping))
    fused = Node(op, list(operands), dict(attrs or {}), body=body)
    fused.outputs = [Value(o.name, o.type, fused) for o in escaping]
    replace = {id(old): new for old, new in zip(escaping, fused.outputs)}
    if later is None:   # only the readers of escaping values change
        later = {id(r): r for o in escaping for r in index.users.get(id(o), ()) if id(r) not in members}.values()
    for n in later:
        if any(id(v) in replace for v in n.inputs):
            n.inputs = [replace.get(id(v), v) for v in n.inputs]
    fn.outputs = [replace.get(id(v), v) for v in fn.outputs]
    fn.nodes[last] = fused
    for i in sorted((at[id(n)] for n in group[:-1]), reverse=True):
        del fn.nodes[i]
    if index is not None:
        index._fused(group, fused, replace)
    return fused


def move_after(fn: Function, node: Node, anchor: Node):
    """Move `node` to just after `anchor` (the caller guarantees its operands are defined before)."""
    fn.nodes.remove(node)
    fn.nodes.insert(fn.nodes.index(anchor) + 1, node)


def move_before(fn: Function, node: Node, anchor: Node):
    """Move `node` to just before `anchor` (the caller guarantees its operands are defined before it)."""
    fn.nodes.remove(node)
    fn.nodes.insert(fn.nodes.index(anchor), node)


def ancestors(fn: Function, values) -> set[int]:
    """ids of the nodes that `values` are computed from (their producers, transitively)."""
    prod = producers(fn)
    out: set[int] = set()
    stack = [prod[id(v)] for v in values if id(v) in prod]
    while stack:
        n = stack.pop()
        if id(n) not in out:
            out.add(id(n))
            stack.extend(prod[id(v)] for v in n.inputs if id(v) in prod)
    return out


# ---- helpers shared by the fusion passes -----------------------------------------------------
def order_signature(node: Node, operands: list[Value], results: list[str] | None = None):
    """Put a node made by `fuse` into its documented signature: permute its operands (and body inputs,
    renamed %in0..) into the order of `operands`, and its results (and body outputs) into the order of
    the result names `results`.  Raises PassError when the sets differ (the pattern assumed wrongly)."""
    pos = {value_key(v): i for i, v in enumerate(node.inputs)}
    order = [pos.get(value_key(v), -1) for v in operands]
    if sorted(order) != list(range(len(node.inputs))):
        raise PassError(f"{node.op}: operands ({', '.join(v.ref for v in node.inputs)}) do not match the documented "
                        f"signature ({', '.join(v.ref for v in operands)})")
    node.inputs = [node.inputs[i] for i in order]
    node.body.inputs = [node.body.inputs[i] for i in order]
    for i, v in enumerate(node.body.inputs):
        v.name = f"in{i}"
    if results is not None:
        names = [o.name for o in node.outputs]
        if sorted(names) != sorted(results):
            raise PassError(f"{node.op}: results ({', '.join(names)}) are not the documented ({', '.join(results)})")
        rorder = [names.index(r) for r in results]
        node.outputs = [node.outputs[i] for i in rorder]
        node.body.outputs = [node.body.outputs[i] for i in rorder]


def producers(fn: Function) -> dict[int, Node]:
    return {id(o): n for n in fn.nodes for o in n.outputs}


class Names:
    """Fresh value names in one function: its names are collected once, then every `fresh` adds its own, so a
    pass that names many new values (a collective after every sharded linear) does not rescan the function for
    each. Valid while the pass names its new values only through it."""

    def __init__(self, fn: Function):
        self.taken = {v.name for v in fn.inputs} | {o.name for n in fn.nodes for o in n.outputs}

    def fresh(self, base: str) -> str:
        """`base`, or `base.1`, `base.2`, ... : a name not yet taken (now taken)."""
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}.{k}", k + 1
        self.taken.add(name)
        return name


def fresh_name(fn: Function, base: str) -> str:
    """`base`, or `base.1`, `base.2`, ... : a value name not yet used in `fn`."""
    return Names(fn).fresh(base)


def linear_source(fn: Function, value: Value, index: Index | None = None) -> bool:
    """Whether `value` is the result of a plain `linear`, or one linear of a fused.packed_linear, with
    a parameter weight (what `take_from_pack` accepts)."""
    node = index.producer(value) if index else producers(fn).get(id(value))
    if node is not None and node.op == "linear":
        return node.inputs[1].is_param
    if node is None or node.op != PACKED_OP or node.body is None:
        return False
    return all(n.op == "linear" and n.inputs[0] is node.body.inputs[0] for n in node.body.nodes) and \
        all(v.is_param for v in node.inputs[1:])


def take_from_pack(fn: Function, value: Value, index: Index | None = None) -> Node:
    """The plain `linear` producing `value`. When `value` is one result of a fused.packed_linear, that
    pack is split: `value` gets its own linear at the pack's place and the other members stay packed
    (a single remaining member becomes a plain linear). Precondition: `linear_source(fn, value)`.
    With `index`, the index is kept current."""
    node = index.producer(value) if index else producers(fn)[id(value)]
    if node.op == "linear":
        return node
    body_in = {id(v): i for i, v in enumerate(node.body.inputs)}
    returned = {id(v): i for i, v in enumerate(node.body.outputs)}
    members = []
    for inner in node.body.nodes:
        j = returned.get(id(inner.output))
        if j is not None:
            out = node.outputs[j]
            members.append(Node("linear", [node.inputs[0], node.inputs[body_in[id(inner.inputs[1])]]], {}, [out]))
            out.producer = members[-1]
    at = fn.nodes.index(node)
    fn.nodes[at:at + 1] = members
    if index is not None:
        index.drop(node)
        for m in members:
            index.add(m)
    mine = next(m for m in members if m.output is value)
    rest = [m for m in members if m is not mine]
    if len(rest) >= 2:
        fuse(fn, rest, PACKED_OP, {"splits": [int(m.inputs[1].type.shape[0]) for m in rest]}, index=index)
    return mine


def group_escapes(fn: Function, group: list[Node]) -> set[int]:
    """ids of the group's values read outside the group or returned."""
    members = {id(n) for n in group}
    defined = {id(o) for n in group for o in n.outputs}
    read = {id(v) for n in fn.nodes if id(n) not in members for v in n.inputs} | {id(v) for v in fn.outputs}
    return defined & read


def rewrite_each(module, ctx, name: str, op: str, rewrite, kinds: tuple[str, ...] | None = None,
                 indexed: bool = False) -> int:
    """The usual `run` of a pass: call `rewrite(fn, node)` on every node of op `op` in every function (of a
    kind in `kinds`, when given; a snapshot of the nodes taken before rewriting) and count the rewrites under
    the pass name: `rewrite` returns whether it rewrote (bool) or how many rewrites it made (int). `indexed`:
    `rewrite(fn, node, index)` with one `Index` of the function, which the rewrite keeps current by changing `fn`
    only through `fuse(..., index=index)`."""
    rewrites = 0
    for fn in module.functions.values():
        if kinds is not None and fn.attrs.get("kind") not in kinds:
            continue
        index = Index(fn) if indexed else None
        for node in [n for n in fn.nodes if n.op == op]:
            rewrites += int((rewrite(fn, node, index) if indexed else rewrite(fn, node)) or 0)
    ctx.count(name, rewrites)
    return rewrites
