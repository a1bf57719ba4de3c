"""Overlapped MoE branches: in a decode or verify step, the routed experts' chain (their input projection z,
the experts, the tail) runs on the main CUDA stream while the router and the shared expert run on the second
stream beside it.

Pattern (after moe_expert_input_split, router_epilogue, glu_epilogue and latent_moe_tail; per moe_experts
node E):
    %w, %ids = fused.routed_linear(%x, @gate, @bias)                R: the producer of E's routing operands
    %z = linear(%x, @Wz)                                            Z: E's input (moe_expert_input_split)
    %act = fused.packed_linear_glu(%x, @Wg, @Wu)                    S: the shared expert's gate/up + GLU
    %e = moe_experts(%z, %w, %ids, @w1, @w2, @w3)                   E
    %d = linear(%act, @shared_down)                                 D: the shared expert's down projection
    %y = fused.latent_moe_tail(%e', @norm, @up, %d)                 the tail reads D (and E, perhaps through a
                                                                    collective)
Rewrite (node order and annotations only; operands, results and numerics unchanged):
    R {overlap="moe_router"}, S {overlap="moe_shared_expert"}, D {overlap="moe_shared_expert"}, then Z, E, ...
  R, S and D run in this order on the side stream; Z, E and the tail on the main stream, which waits for the
  routing where E reads it and for %d where the tail reads it.
Why: at decode sizes the experts are latency-bound (few tokens, MXFP4 decode) while the shared expert's GEMVs
stream 3 x d x I weights at copy rate: on two streams they share the GPU (k31c/runtime/executor.py runs
`overlap` nodes on its side stream in program order; a CUDA graph captures the fork and the joins as edges).
H200, rank preset, batch 1, 8K: 578-580 us per step before (z packed with S, R beside it, D beside E),
560-572 after. Session 13 (benches/results/h200-2026-11-30-s13/runtime_zfirst.json, runtime_side_narrow.json):
S and D moved after Z, so that z streams alone first (the side stream waits for the main stream's earlier work):
batch 1 568.5-579.2 us (with the experts' gate-up launched late 563.0-571.0) vs 552.4-561.5, batch 8 1105.7-1111.9
vs 1084.7-1086.5; in its trace z alone still takes 22.4 us in the first MoE layer (13.2 us behind one small
kernel in benches/bench_gemm_decode.py --isolated). S and D with 2x / 4x rows a program (fewer programs beside the
experts): 550.3-552.1 / 570.6-572.8 vs 549.1-551.0. Neither kept.
When z is still packed with S (moe_expert_input_split disabled), the layer keeps the earlier schedule: R
beside the node after it when that node does not read the routing, D moved just before E on the side stream.

Preconditions: only functions of kind decode or verify (prefill GEMMs fill the GPU on their own). R is a
fused.routed_linear; D a plain `linear` with a parameter weight, read by the first fused.latent_moe_tail after
E, not computed from E, whose input is defined before E; the split schedule needs Z to be a plain `linear`
and S (D's input's producer) a node other than Z that does not read Z, R and S defined from values before Z.
A layer that differs keeps its order (Kimi-Linear: the experts read the normed hidden state right after the
router, nothing to overlap: untouched).
Postconditions: at most three `overlap` annotations per MoE layer (the count: nodes annotated); every node
still follows its operands.
"""

from __future__ import annotations

from ir.core import Function, Module, Node

from .base import PassContext
from .rewrite import ancestors, move_before, producer_index, producers, rewrite_each

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
    return down


def _operands_first(fn: Function) -> bool:
    """Every node's operands are defined before it (parameters and function inputs always are)."""
    at = producer_index(fn)
    return all(at.get(id(v), -1) < i for i, n in enumerate(fn.nodes) for v in n.inputs)


def _schedule(fn: Function, experts: Node, router: Node, down: Node) -> int:
    """R, S, D moved just before Z, in this order, and annotated; 0 (order restored) when the layer is not in
    the split form or the moves would put a node before one of its operands."""
    prod = producers(fn)
    z_linear, shared = prod.get(id(experts.inputs[0])), prod.get(id(down.inputs[0]))
    if z_linear is None or z_linear.op != "linear" or shared is None or shared is z_linear:
        return 0
    before = list(fn.nodes)
    for n in (router, shared, down):
        move_before(fn, n, z_linear)
    if not _operands_first(fn):
        fn.nodes[:] = before
        return 0
    router.attrs["overlap"] = "moe_router"
    shared.attrs["overlap"] = down.attrs["overlap"] = "moe_shared_expert"
    return 3


def _fallback(fn: Function, experts: Node, router: Node | None, down: Node | None) -> int:
    """The schedule for a layer whose z cannot be split out: R beside the node after it, D beside E."""
    count = 0
    if router is not None:
        after = fn.nodes[fn.nodes.index(router) + 1]
        if after is not experts and not any(id(v) in {id(o) for o in router.outputs} for v in after.inputs):
            router.attrs["overlap"] = "moe_router"
            count += 1
    if down is not None:
        move_before(fn, down, experts)
        down.attrs["overlap"] = "moe_shared_expert"
        count += 1
    return count


def _rewrite(fn: Function, experts: Node) -> int:
    router, down = _router(fn, experts), _shared_down(fn, experts)
    if router is not None and down is not None:
        done = _schedule(fn, experts, router, down)
        if done:
            return done
    return _fallback(fn, experts, router, down)


def run(module: Module, ctx: PassContext) -> int:
    return rewrite_each(module, ctx, NAME, "moe_experts", _rewrite, kinds=KINDS)
