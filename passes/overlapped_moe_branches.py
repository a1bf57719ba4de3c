"""Overlapped MoE branches: in a decode or verify step, the two small parts of a LatentMoE layer that the
routed experts do not need, or that do not need the experts, run on the second CUDA stream beside the
main-stream kernels they are independent of.

Pattern (after router_epilogue, glu_epilogue and latent_moe_tail; per moe_experts node E):
    %w, %ids = fused.routed_linear(%x, @gate, @bias)      R: the producer of E's routing operands
    %z, %act = fused.packed_linear_glu(%x, ...)           P: the producer of E's activation z
    %e = moe_experts(%z, %w, %ids, @w1, @w2, @w3)         E
    %d = linear(%act, @shared_down)                       D: the shared expert's down projection
    %y = fused.latent_moe_tail(%e', @norm, @up, %d)       the tail reads D (and E, perhaps through a collective)
Rewrite (annotations and node order only; operands, results and numerics unchanged):
    R gets overlap="moe_latent_proj" when the node after it does not read the routing (in K3: P): it runs beside
      that node (the latent and shared-expert projection), and the main stream waits for it where E reads it;
    D gets overlap="moe_experts" and is placed just before E: it runs beside the routed experts, and the
      main stream waits for it where the tail reads %d.
Why: at decode sizes the router (a 112-row logits GEMM and a top-k) and the experts (few tokens, MXFP4
decode-bound) use a fraction of the HBM bandwidth, while the GEMV beside each streams weights at copy rate;
one stream runs them back to back, two let them share the GPU (k31c/runtime/executor.py runs `overlap`
nodes on its side stream; a CUDA graph captures the fork and the join as edges).

Preconditions: only functions of kind decode or verify (prefill GEMMs fill the GPU on their own). R is
annotated only when it is a fused.routed_linear followed by a node that does not read it (in Kimi-Linear the
experts read the normed hidden state right after the router: nothing to overlap); D only when it is a plain
`linear` with a parameter weight, read by the first fused.latent_moe_tail after E, not computed from E, and
whose input is defined before E. A layer that differs keeps its order.
Postconditions: at most two `overlap` annotations per MoE layer; every node still follows its operands.
"""

from __future__ import annotations

from ir.core import Function, Module, Node

from .base import PassContext
from .rewrite import ancestors, move_before, producers, rewrite_each

NAME = "overlapped_moe_branches"
KINDS = ("decode", "verify")
TAIL_OP = "fused.latent_moe_tail"
ROUTER_OP = "fused.routed_linear"


def _defined_before(fn: Function, node: Node, anchor: Node) -> bool:
    """Every operand of `node` is a parameter, a function input or the result of a node before `anchor`."""
    index = {id(n): i for i, n in enumerate(fn.nodes)}
    prod = producers(fn)
    return all(id(v) not in prod or index[id(prod[id(v)])] < index[id(anchor)] for v in node.inputs)


def _router(fn: Function, experts: Node) -> Node | None:
    router = producers(fn).get(id(experts.inputs[2]))
    if router is None or router.op != ROUTER_OP or "overlap" in router.attrs:
        return None
    after = fn.nodes[fn.nodes.index(router) + 1]
    if after is experts or any(id(v) in {id(o) for o in router.outputs} for v in after.inputs):
        return None  # nothing beside it: the next node waits for the routing anyway
    router.attrs["overlap"] = "moe_latent_proj"
    return router


def _shared_down(fn: Function, experts: Node) -> Node | None:
    prod = producers(fn)
    after = fn.nodes[fn.nodes.index(experts) + 1:]
    tail = next((n for n in after if n.op == TAIL_OP and id(experts) in ancestors(fn, n.inputs[:1])), None)
    down = prod.get(id(tail.inputs[-1])) if tail is not None else None  # the first tail after E is E's layer's
    if down is None or down.op != "linear" or not down.inputs[1].is_param or "overlap" in down.attrs:
        return None
    if id(experts) in ancestors(fn, down.inputs) or not _defined_before(fn, down, experts):
        return None
    move_before(fn, down, experts)
    down.attrs["overlap"] = "moe_experts"
    return down


def _rewrite(fn: Function, experts: Node) -> int:
    return (_router(fn, experts) is not None) + (_shared_down(fn, experts) is not None)


def run(module: Module, ctx: PassContext) -> int:
    return rewrite_each(module, ctx, NAME, "moe_experts", _rewrite, kinds=KINDS)
