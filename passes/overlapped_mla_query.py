"""Overlapped MLA query: the MLA query path does not depend on the indexer, so it runs beside it.

Pattern (per `mla_attention` that reads an indexer selection, SPEC §4 steps 1–2; `%q` may be one
result of a fused.packed_linear, e.g. packed with the indexer's wq_b: it is taken out of that pack):
    %q = linear(%c_q, @q_b)                 %ckv = slice(%kv_a) {axis=1, start=0, stop=kv}
    %q3 = reshape(%q) {shape=[-1, H, dn+dr]} %c = rms_norm(%ckv, @kv_a_layernorm) {eps}
    %q_nope = slice(%q3) {axis=2, 0:dn}     %k_pe = slice(%kv_a) {axis=1, start=kv, stop=kv+dr}
    %q_pe = slice(%q3) {axis=2, dn:dn+dr}   %lat = concat(%c, %k_pe) {axis=1} [; %lat = cast(%lat)]
                                            %pool' = cache_write(%pool, %lat, %req, %pos, %tbl) {block_size}
    %o = mla_attention(%q_nope, %q_pe, %pool', @kv_b, ..., %selection)
Rewrite:
    %q_nope, %q_pe, %pool' = fused.mla_query(%c_q, @q_b, %kv_a, @kv_a_layernorm, %pool, %req, %pos, %tbl)
        {overlap="indexer", heads=H, nope_dim=dn, rope_dim=dr, kv_lora_rank=kv, eps, block_size}
    placed before the first indexer node.

The fused op (`a.operands` in this order):
    c_q [T, q_lora], q_b [H*(dn+dr), q_lora], kv_a [T, kv+dr] (the packed input projection's c_KV|k_pe
    columns), kv_norm_w [kv], latent_pool [N, kv+dr] or a block
    view [NB, bs, kv+dr] (updated in place), token_req [T], token_pos [T],
    block_table [R, MB]
  attrs: overlap="indexer" (scheduling annotation: on GPU the node runs on a second stream, concurrently
    with the indexer nodes, joined before mla_attention), heads, nope_dim, rope_dim, kv_lora_rank, eps,
    block_size (of the cache write)
  results: q_nope [T, H, dn], q_pe [T, H, dr] (= per-head split of q_b c_q), latent_pool with row
    the paged row of (token_req[t], token_pos[t]) = [RMSNorm(kv_a[t, :kv]); kv_a[t, kv:]] (cast to the pool dtype).
The absorbed key projection q~ = W_UK^T q_nope stays inside `mla_attention` in this IR (the attention
kernel computes it from q_nope and kv_b).

Preconditions (PassError otherwise, naming the nodes): the query path is independent of the indexer —
no path between them. The indexer nodes are the ancestors of the selection that the query path's entry
values (c_q, kv_a) do not need; no query-path node may reach the selection, and no indexer node may
feed the query path. Only layers with an indexer are rewritten (nothing to overlap otherwise); layers
whose graph differs from the pattern are left unfused.
Postconditions: one fused.mla_query per indexed MLA layer, scheduled before every indexer node (only
it and its ancestors move); numerics unchanged.
"""

from __future__ import annotations

from ir.core import Function, Module, Node, Value
from ir.verifier import consumed_operands

from .base import PassContext, PassError
from .rewrite import (
    ancestors, fuse, group_escapes, linear_source, order_signature, producers, rewrite_each, single_user,
    take_from_pack
)

NAME = "overlapped_mla_query"
FUSED_OP = "fused.mla_query"


def _describe(n: Node) -> str:
    return f"{', '.join(o.ref for o in n.outputs)} = {n.op}"


# ---- the pattern ----------------------------------------------------------------------------------
def _splits(first: Node, second: Node, axis: int) -> bool:
    """`first` and `second` cut their common input along `axis` into [0:a] and [a:end]."""
    x = first.inputs[0]
    axes = {n.attrs["axis"] % x.type.rank for n in (first, second)}
    return second.inputs[0] is x and axes == {axis} and first.attrs["start"] == 0 and \
        first.attrs["stop"] == second.attrs["start"] and second.attrs["stop"] == int(x.type.shape[axis])


def _match(fn: Function, mla: Node):
    """The query-path nodes feeding `mla` (without the q projection), or None when the graph differs."""
    prod = producers(fn)

    def get(v: Value, op: str) -> Node | None:
        n = prod.get(id(v))
        return n if n is not None and n.op == op else None

    sn, sp, cw = get(mla.inputs[0], "slice"), get(mla.inputs[1], "slice"), get(mla.inputs[2], "cache_write")
    if not (sn and sp and cw and _splits(sn, sp, 2)):
        return None  # q_nope, q_pe: the two parts of each head's query
    rs = get(sn.inputs[0], "reshape")
    lat = cw.inputs[1]
    cast = get(lat, "cast")
    cat = get(cast.inputs[0] if cast else lat, "concat")
    if not (rs and cat and len(cat.inputs) == 2):
        return None
    norm, sk = get(cat.inputs[0], "rms_norm"), get(cat.inputs[1], "slice")
    sc = get(norm.inputs[0], "slice") if norm and len(norm.inputs) == 2 else None
    if not (sk and sc and _splits(sc, sk, 1) and linear_source(fn, rs.inputs[0])
            and single_user(fn, rs.inputs[0]) is rs):
        return None
    nodes = [rs, sn, sp, sc, norm, sk, cat, *([cast] if cast else []), cw]
    if group_escapes(fn, nodes) != {id(v) for v in mla.inputs[:3]}:
        return None  # an intermediate is read elsewhere
    return {"rs": rs, "sn": sn, "sp": sp, "sc": sc, "norm": norm, "cw": cw, "nodes": nodes}


def _check_independent(fn: Function, group: list[Node], entry: list[Value], selection: Value) -> set[int]:
    """The indexer nodes (ids); PassError when a path joins them and the query path."""
    members = {id(n) for n in group}
    defined = {id(o): n for n in group for o in n.outputs}
    to_selection = ancestors(fn, [selection])
    indexer = to_selection - ancestors(fn, entry)
    for n in fn.nodes:
        if id(n) in to_selection and id(n) not in members:
            for v in n.inputs:
                if id(v) in defined:
                    raise PassError(f"{NAME}: in @{fn.name}, the MLA query path feeds the indexer: node "
                                    f"({_describe(n)}) reads {v.ref} from the query path's "
                                    f"({_describe(defined[id(v)])}) and leads to the selection {selection.ref}; "
                                    f"the two cannot overlap")
    entry_ids = {id(v) for v in entry}
    for g in group:
        for v in g.inputs:
            if id(v) in defined or id(v) in entry_ids or v.is_param:
                continue
            hit = ancestors(fn, [v]) & indexer
            if hit:
                src = [n for n in fn.nodes if id(n) in hit][-1]
                raise PassError(f"{NAME}: in @{fn.name}, the indexer feeds the MLA query path: node "
                                f"({_describe(g)}) reads {v.ref}, computed from the indexer node ({_describe(src)}); "
                                f"the two cannot overlap")
    return indexer


def _schedule_before(fn: Function, fused: Node, indexer: set[int]):
    """Move `fused` (and the ancestors it needs) before the first indexer node; the rest keeps its order."""
    index = {id(n): i for i, n in enumerate(fn.nodes)}
    first, at = min((index[i] for i in indexer if i in index), default=len(fn.nodes)), index[id(fused)]
    if first > at:
        return
    needed = ancestors(fn, fused.inputs) | {id(fused)}
    window = fn.nodes[first:at + 1]
    head = [n for n in window if id(n) in needed]
    tail = [n for n in window if id(n) not in needed]
    for h in head:
        for i in consumed_operands(h):
            late = next((t for t in tail if h.inputs[i] in t.inputs), None)
            if late is not None:
                raise PassError(f"{NAME}: in @{fn.name}, cannot move ({_describe(h)}) before ({_describe(late)}): "
                                f"it updates {h.inputs[i].ref} in place, which the latter reads")
    fn.nodes[first:at + 1] = head + tail


def _rewrite(fn: Function, mla: Node) -> bool:
    if len(mla.inputs) < 8:
        return False  # no indexer: nothing to overlap
    m = _match(fn, mla)
    if m is None:
        return False
    lin = take_from_pack(fn, m["rs"].inputs[0])
    group = [lin, *m["nodes"]]
    kv_a = m["sc"].inputs[0]
    indexer = _check_independent(fn, group, [lin.inputs[0], kv_a], mla.inputs[7])
    heads, dn = (int(d) for d in mla.inputs[0].type.shape[1:])
    dr, kv = int(mla.inputs[1].type.shape[2]), int(m["norm"].outputs[0].type.shape[1])
    attrs = {"overlap": "indexer", "heads": heads, "nope_dim": dn, "rope_dim": dr, "kv_lora_rank": kv,
             "eps": m["norm"].attrs["eps"], "block_size": m["cw"].attrs["block_size"]}
    cw = m["cw"]
    results = [v.name for v in mla.inputs[:3]]
    fused = fuse(fn, group, FUSED_OP, attrs)
    order_signature(fused, [lin.inputs[0], lin.inputs[1], kv_a, m["norm"].inputs[1], cw.inputs[0], *cw.inputs[2:]],
                    results)
    _schedule_before(fn, fused, indexer)
    return True


def run(module: Module, ctx: PassContext) -> int:
    return rewrite_each(module, ctx, NAME, "mla_attention", _rewrite)
