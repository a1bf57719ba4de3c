"""Expert parallelism: split the routed experts across `ep` ranks (issue 8 item 5, SPEC §6).

Pattern (every MoE layer, every entry function):
    %y = moe_experts(%z, %weights, %ids, @w1, @w2, @w3)            @w*: [E, ...], shard="expert"
Rewrite:
    %weights.ep, %ids.ep = ep_local_routing(%weights, %ids) {experts_per_rank=E/ep, group, world=ep}
    %y.partial = moe_experts(%z, %weights.ep, %ids.ep, @w1, @w2, @w3)      @w*: [E/ep, ...] (rank's block)
    %y = all_reduce(%y.partial) {group, world=ep}
EP rank r (= TP rank % ep) holds experts r·E/ep .. (r+1)·E/ep − 1. The router runs replicated (its
logits, top-k and weights are identical on every rank), so dispatch needs no traffic: each rank keeps the
(token, expert) entries of its experts; the combine is one all-reduce of the fp32 latent partial sums
[T, ℓ], which lands before the latent RMSNorm as SPEC §6 requires (the norm is not linear, so it must see
the full sum). Every later op (latent norm, up-projection, shared experts) is unchanged.

Context options: `ep` (int, default 1: no-op), `ep_group` (default "ep"). An EP group may be the whole TP
group or a run of `ep` consecutive TP ranks (experts replicated once per group, k31c/parallel/groups.py,
which registers the group's handle under "ep"); an unregistered name means the default (world) group.
Preconditions: no fused nodes; E divisible by ep. Postconditions: expert params carry ep_dim=0,
ep_parts=ep; module attr ep; counter `shard_ep` = rewritten moe_experts nodes.
"""

from __future__ import annotations

from ir.core import Function, Module, Node, Value
from ir.ops import get_op

from .base import PassContext, PassError
from .rewrite import Names

NAME = "shard_ep"


def run(module: Module, ctx: PassContext) -> int:
    ep = int(ctx.options.get("ep", 1))
    group = ctx.options.get("ep_group", "ep")
    if ep == 1:
        ctx.count(NAME, 0)
        return 0
    experts = [p for p in module.params.values() if p.shard == "expert"]
    problems = [f"@{p.name}: {p.type.shape[0]} experts are not divisible by ep={ep}"
                for p in experts if int(p.type.shape[0]) % ep]
    problems += [f"@{fn.name} has fused nodes: run {NAME} before the fusion phase"
                 for fn in module.functions.values() if any(n.body is not None for n in fn.nodes)]
    if problems:
        raise PassError(f"{NAME} (ep={ep}): " + "; ".join(problems))
    for p in experts:
        p.type = p.type.with_shape((p.type.shape[0] / ep, *p.type.shape[1:]))
        p.attrs.update(ep_dim=0, ep_parts=ep)
    rewrites = 0
    for fn in module.functions.values():
        names = Names(fn)
        for n in [n for n in fn.nodes if n.op == "moe_experts"]:
            _rewrite(module, fn, n, ep, group, names)
            rewrites += 1
    module.attrs["ep"] = ep
    ctx.count(NAME, rewrites)
    return rewrites


def _rewrite(module: Module, fn: Function, n: Node, ep: int, group: str, names: Names):
    op = get_op("moe_experts")
    for v in n.inputs:
        if v.is_param:
            v.type = module.params[v.name].type
    w_idx, i_idx = op.operand_index("weights"), op.operand_index("ids")
    weights, ids = n.inputs[w_idx], n.inputs[i_idx]
    n_local = int(module.params[n.inputs[op.operand_index("w1")].name].type.shape[0])
    attrs = {"experts_per_rank": n_local, "group": group, "world": ep}
    route = get_op("ep_local_routing")
    wt, it = route.infer(route.bind([weights.type, ids.type]), route.full_attrs(attrs))
    routing = Node("ep_local_routing", [weights, ids], attrs)
    routing.outputs = [Value(names.fresh(weights.name + ".ep"), wt, routing),
                       Value(names.fresh(ids.name + ".ep"), it, routing)]
    n.inputs[w_idx], n.inputs[i_idx] = routing.outputs
    y = n.output
    partial = Value(names.fresh(y.name + ".partial"), y.type, n)
    n.outputs = [partial]
    reduce = Node("all_reduce", [partial], {"group": group, "world": ep}, [y])
    y.producer = reduce
    at = fn.nodes.index(n)
    fn.nodes[at:at + 1] = [routing, n, reduce]
