"""Router epilogue: the MoE router runs in the epilogue of the GEMM that makes its logits, one launch.

Pattern:
    %logits = linear(%x, @Wg)                      or   %logits = fused.widened_linear(%h, @Wg) {dtype="f32"}
    %w, %ids = moe_router(%logits[, @bias]) {topk, activation, renormalize, scaling, n_group, topk_group}
    where %logits is read by nothing else (and not returned).
Rewrite:
    %w, %ids = fused.routed_linear(%x | %h, @Wg[, @bias]) {router attrs [, x_dtype="f32"]}
        body: the logits node and the router.
In the model: every MoE layer's router, in every entry function (after widening_cast_fold, which turns the
router's cast + linear into fused.widened_linear).

The fused op (`a.operands`): x [.., K] (read as f32 when x_dtype="f32"), Wg [E, K], bias [E] when the
router has one; attrs: the router's, plus x_dtype for a widened x. Results: weights f32 [.., topk], ids i64
[.., topk]. A kernel (codegen/triton/routed_gemm.py) computes the logits with the GEMM's tiles and lets the
program that finishes a row block last route it with the router kernel's own code.

Preconditions: the pattern; logits read elsewhere, or a logits GEMM whose weight is not a parameter, are
left alone. Postconditions: one fused.routed_linear per MoE router; numerics unchanged (the body is the
original nodes).
"""

from __future__ import annotations

from ir.core import Function, Node

from .rewrite import Index, fuse, order_signature, rewrite_each

NAME = "router_epilogue"
FUSED_OP = "fused.routed_linear"
LOGITS_OPS = ("linear", "fused.widened_linear")


def _rewrite(fn: Function, route: Node, index: Index) -> bool:
    logits = route.inputs[0]
    gemm = index.producer(logits)
    if gemm is None or gemm.op not in LOGITS_OPS or index.single_user(logits) is not route:
        return False
    x, w = gemm.inputs
    if not w.is_param:
        return False
    attrs = dict(route.attrs)
    if gemm.op == "fused.widened_linear":
        attrs["x_dtype"] = gemm.attrs["dtype"]
    fused = fuse(fn, [gemm, route], FUSED_OP, attrs, index=index)
    order_signature(fused, [x, w, *route.inputs[1:]], [o.name for o in route.outputs])
    return True


def run(module, ctx) -> int:
    return rewrite_each(module, ctx, NAME, "moe_router", _rewrite, indexed=True)
