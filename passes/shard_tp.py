"""TP head sharding: materialise the params' `shard` annotations for `tp` ranks (issue 8 item 1).

Pattern (per param, from `k31c/model/params.py`'s table):
    col / heads   dim 0 split in `tp` contiguous blocks     (head-major: block r = heads r·H/tp ..)
    row           dim 1 split in `tp` contiguous blocks
    rep, expert   untouched (experts are the EP pass's)
and per node, in every entry function:
    %y = linear(%x, @w_row)            ->  %y.p = linear(%x, @w_row);  %y = all_reduce(%y.p) {group="tp"}
    reshape {shape=[-1, H, D]}         ->  reshape {shape=[-1, H/tp, D]}   (input shrank by tp: the leading
                                                                         explicit dim is divided)
    slice {axis=a, start=s, stop=e}    ->  slice {start=s/tp, stop=e/tp}  (input axis a shrank by tp)
    kda / causal_conv1d state pools    ->  [S, H/tp, D, D] / [S, K-1, 3P/tp]   (function inputs retyped)
    a returned non-pool value that shrank (the col-parallel lm_head's logits [T, V/tp])
                                       ->  all_gather(axis) before the return
Every other result type is re-derived with the op's type rule. The IR is the same on every rank (ranks
differ only in their weight shards: `k31c.parallel.weights.shard_weights`). The MLA latent cache, the
indexer (its projections, keys and top-k) and the router stay replicated; the model's head counts are
read from the shapes, so MLA/KDA/gate/output projections follow from the annotations.

Context options: `tp` (int, default 1: the pass does nothing), `tp_group` (group name, default "tp").
Preconditions (all problems collected, then PassError): run before the fusion phase (no node has a
body); every split dim divisible by tp; every reshape/slice on a sharded axis divides evenly.
Postconditions: params carry attrs tp_dim, tp_parts; module attr tp; one all_reduce per row-parallel
linear per function, one all_gather per shrunk returned value; counter `shard_tp` = inserted collectives.
"""

from __future__ import annotations

import json

import sympy

from ir.core import Function, Module, Node, TensorType, Value
from ir.ops import get_op
from ir.shapes import shapes_equal

from .base import PassContext, PassError
from .rewrite import Names

NAME = "shard_tp"
SPLIT_DIM = {"col": 0, "heads": 0, "row": 1}
STATE_OPS = {"kda": "state", "causal_conv1d": "conv_state"}


def run(module: Module, ctx: PassContext) -> int:
    tp = int(ctx.options.get("tp", 1))
    group = ctx.options.get("tp_group", "tp")
    if tp == 1:
        ctx.count(NAME, 0)
        return 0
    problems = _check(module, tp)
    if problems:
        raise PassError(f"{NAME} (tp={tp}): " + "; ".join(problems))
    _shard_params(module, tp)
    inserted = sum(_shard_function(module, fn, tp, group) for fn in module.functions.values())
    module.attrs["tp"] = tp
    ctx.count(NAME, inserted)
    return inserted


def _check(module: Module, tp: int) -> list[str]:
    problems = []
    for fn in module.functions.values():
        fused = sorted({n.op for n in fn.nodes if n.body is not None})
        if fused:
            problems.append(f"@{fn.name} has fused nodes {fused}: run {NAME} before the fusion phase")
    cfg = json.loads(module.attrs.get("config", "{}"))
    heads = {"KDA heads": cfg.get("linear_attn_config", {}).get("num_heads"),
             "MLA heads": cfg.get("num_attention_heads")}
    problems += [f"the {n} {what} are not divisible by tp={tp}" for what, n in heads.items() if n and n % tp]
    bad = [f"@{p.name} ({p.shard}) dim {SPLIT_DIM[p.shard]} = {p.type.shape[SPLIT_DIM[p.shard]]}"
           for p in module.params.values() if p.shard in SPLIT_DIM and int(p.type.shape[SPLIT_DIM[p.shard]]) % tp]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        problems.append(f"{len(bad)} split dims are not divisible by tp={tp}: {', '.join(bad[:3])}{more}")
    return problems


def _shard_params(module: Module, tp: int):
    for p in module.params.values():
        dim = SPLIT_DIM.get(p.shard)
        if dim is None:
            continue
        shape = list(p.type.shape)
        shape[dim] = shape[dim] / tp
        p.type = p.type.with_shape(shape)
        p.attrs.update(tp_dim=dim, tp_parts=tp)


def _shrunk_axis(old: TensorType, new: TensorType, tp: int) -> int | None:
    """The axis along which `new` is `old` divided by tp (None if equal; PassError otherwise)."""
    if shapes_equal(old.shape, new.shape):
        return None
    diff = [i for i, (a, b) in enumerate(zip(old.shape, new.shape)) if sympy.simplify(a - b) != 0]
    if len(diff) == 1 and sympy.simplify(old.shape[diff[0]] - tp * new.shape[diff[0]]) == 0:
        return diff[0]
    raise PassError(f"{NAME}: cannot relate {old} to {new} by a split in {tp}")


def _div(x: int, tp: int, what: str) -> int:
    if x % tp:
        raise PassError(f"{NAME}: {what} = {x} is not divisible by tp={tp}")
    return x // tp


def _retarget_attrs(n: Node, old_in: TensorType, new_in: TensorType, tp: int):
    ax = _shrunk_axis(old_in, new_in, tp)
    if ax is None:
        return
    if n.op == "reshape":
        shape = list(n.attrs["shape"])
        i = next((j for j, d in enumerate(shape) if d != -1), None)
        if i is None:
            raise PassError(f"{NAME}: reshape of sharded {new_in} has no explicit dim to divide")
        shape[i] = _div(int(shape[i]), tp, f"reshape dim {i} of {n.outputs[0].ref}")
        n.attrs["shape"] = shape
    elif n.op == "slice" and n.attrs["axis"] % new_in.rank == ax:
        for k in ("start", "stop"):
            n.attrs[k] = _div(int(n.attrs[k]), tp, f"slice {k} of {n.outputs[0].ref}")


def _retype_state(fn: Function, n: Node, op, olds: dict):
    """Give a KDA state / conv state pool input the per-rank shape its op now needs."""
    a = op.bind([v.type for v in n.inputs])
    pool_name = STATE_OPS[n.op]
    pool = n.inputs[op.operand_index(pool_name)]
    if n.op == "kda":
        _, h, d = a.q.shape
        want = pool.type.with_shape((pool.type.shape[0], h, d, a.v.shape[2]))
    else:
        want = pool.type.with_shape((pool.type.shape[0], a.weight.shape[1] - 1, a.x.shape[1]))
    if not shapes_equal(want.shape, pool.type.shape):
        if pool.producer is not None or pool not in fn.inputs:
            raise PassError(f"{NAME}: {n.op} state {pool.ref} is not a function input; cannot retype it")
        olds.setdefault(id(pool), pool.type)
        pool.type = want


def _shard_function(module: Module, fn: Function, tp: int, group: str) -> int:
    olds: dict[int, TensorType] = {}  # id(value) -> type before sharding (values that changed)
    inserted, names = 0, Names(fn)
    for n in list(fn.nodes):
        for v in n.inputs:
            if v.is_param:
                v.type = module.params[v.name].type
        op = get_op(n.op)
        if n.op in STATE_OPS:
            _retype_state(fn, n, op, olds)
        if n.op in ("reshape", "slice") and id(n.inputs[0]) in olds:
            _retarget_attrs(n, olds[id(n.inputs[0])], n.inputs[0].type, tp)
        types = op.infer(op.bind([v.type for v in n.inputs]), op.full_attrs(n.attrs))
        for o, t in zip(n.outputs, types):
            if not shapes_equal(o.type.shape, t.shape):
                olds.setdefault(id(o), o.type)
            o.type = t
        if n.op == "linear" and n.inputs[1].is_param and module.params[n.inputs[1].name].shard == "row":
            _insert_after(fn, n, "all_reduce", {"group": group, "world": tp}, names.fresh(n.output.name + ".partial"))
            inserted += 1
    pools = _pool_outputs(fn)
    for i, v in enumerate(list(fn.outputs)):
        if id(v) in olds and id(v) not in pools:
            ax = _shrunk_axis(olds[id(v)], v.type, tp)
            _insert_after(fn, v.producer, "all_gather", {"axis": ax, "group": group, "world": tp},
                          names.fresh(v.name + ".shard"))
            inserted += 1
    return inserted


def _pool_outputs(fn: Function) -> set[int]:
    out = set()
    for n in fn.nodes:
        op = get_op(n.op) if n.body is None else None
        for idx in (op.inplace if op else {}):
            out.add(id(n.outputs[idx]))
    return out


def _insert_after(fn: Function, n: Node, opname: str, attrs: dict, local_name: str) -> Node:
    """Rename n's result to `local_name` and make `opname` of it produce the original value, so every
    later reader (and the return) now reads the collective's result."""
    result = n.output
    local = Value(local_name, result.type, n)
    n.outputs = [local]
    op = get_op(opname)
    (t,) = op.infer(op.bind([local.type]), op.full_attrs(attrs))
    result.type = t
    node = Node(opname, [local], dict(attrs), [result])
    result.producer = node
    fn.nodes.insert(fn.nodes.index(n) + 1, node)
    return node
