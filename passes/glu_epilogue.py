"""GLU epilogue: the gated activation of an FFN runs in the epilogue of the packed projection that makes
its two operands, so the gate and up halves never leave the GEMM.

Pattern:
    %p.., %g, %u = fused.packed_linear(%x, @Wp.., @Wg, @Wu) {splits=[..]}        (%g, %u: one output each)
    %a = situ_glu(%g, %u) {beta1, beta2}        or        %a = swiglu(%g, %u)
    where %g and %u are read by nothing else (and are not returned).
Rewrite:
    %p.., %a = fused.packed_linear_glu(%x, @Wp.., @Wg, @Wu)
                   {splits=[out_p.., I, I], act="situ_glu"|"swiglu", beta1=?, beta2=?}
    body: the original packed_linear node and the activation.
In the model: every FFN with a GLU, i.e. the dense MLP (packed gate/up) and the shared expert of a
LatentMoE layer (packed with the latent down-projection z, which stays a plain output).

The fused op (`a.operands` in this order): x [.., K]; the plain weights (their outputs come first, in
order); the gate weight [I, K]; the up weight [I, K]. Results: the plain outputs, then a [.., I] in x's
dtype. The operands are permuted so that gate and up come last (a packed GEMM's outputs are independent
columns, so the order of its weights changes no value). A kernel computes g and u as the packed GEMM
does, rounds them to x's dtype as its store would, and applies the activation to those rounded values
(`glu.binary_math`), so its results equal the unfused kernels' bit for bit.

Preconditions: the pattern; activations whose operands come from different packs or also feed other
nodes are left alone. Runs after the other fusions, which look for plain packed_linear producers.
Postconditions: one fused.packed_linear_glu per matched FFN; numerics unchanged (the body is the
original nodes).
"""

from __future__ import annotations

from ir.core import Function, Module, Node

from .base import PassContext
from .rewrite import PACKED_OP, Index, fuse, move_after, order_signature, single_user

NAME = "glu_epilogue"
FUSED_OP = "fused.packed_linear_glu"
ACTS = ("situ_glu", "swiglu")


def _match(fn: Function, act: Node, made_by: dict, use_map: dict):
    """(pack, gate index, up index) when `act` reads two distinct outputs of one packed_linear that
    nothing else reads, else None."""
    g, u = act.inputs
    pack = made_by.get(id(g))
    if pack is None or pack.op != PACKED_OP or made_by.get(id(u)) is not pack or g is u:
        return None
    if any(single_user(fn, v, use_map) is not act for v in (g, u)):
        return None
    weights = pack.inputs[1:]
    returned = {id(v) for v in fn.outputs}
    others = [o for o in pack.outputs if o is not g and o is not u]
    if len({w.name for w in weights}) != len(weights) or not all(use_map.get(id(o)) or id(o) in returned
                                                                 for o in others):
        return None  # a weight used twice, or a plain output nobody reads: left as it is
    return pack, pack.outputs.index(g), pack.outputs.index(u)


def _apply(fn: Function, pack: Node, gi: int, ui: int, act: Node, graph: Index):
    weights = pack.inputs[1:]  # a packed_linear's operands: x, then one weight per output, in order
    plain = [w for i, w in enumerate(weights) if i not in (gi, ui)]
    splits = [int(w.type.shape[0]) for w in plain] + [int(weights[gi].type.shape[0])] * 2
    attrs = {"splits": splits, "act": act.op, **act.attrs}
    plain_names = [o.name for i, o in enumerate(pack.outputs) if i not in (gi, ui)]
    x = pack.inputs[0]
    move_after(fn, act, pack)  # legal: it reads only the pack's results; nodes reading plain outputs stay after
    fused = fuse(fn, [pack, act], FUSED_OP, attrs, index=graph)
    order_signature(fused, [x, *plain, weights[gi], weights[ui]], plain_names + [act.outputs[0].name])


def run(module: Module, ctx: PassContext) -> int:
    rewrites = 0
    for fn in module.functions.values():
        graph = Index(fn)   # plans read it before any fuse; moves keep it valid, each fuse keeps it current
        plans = [(m, n) for n in fn.nodes
                 if n.op in ACTS and (m := _match(fn, n, graph.made_by, graph.users)) is not None]
        for (pack, gi, ui), act in plans:
            _apply(fn, pack, gi, ui, act, graph)
        rewrites += len(plans)
    ctx.count(NAME, rewrites)
    return rewrites
