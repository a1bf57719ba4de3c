"""MoE expert input split: in a decode or verify step, the routed experts' input projection z is not packed
with the other projections of the same input (the shared expert's gate/up): it gets its own GEMM.

Pattern (after packed_projection; per moe_experts node E of a decode/verify function):
    %z, %g, %u = fused.packed_linear(%x, @Wz, @Wg, @Wu) {splits=[l, I, I]}
    %e = moe_experts(%z, %w, %ids, @w1, @w2, @w3)
Rewrite:
    %z = linear(%x, @Wz)
    %g, %u = fused.packed_linear(%x, @Wg, @Wu) {splits=[I, I]}     (a single remaining member: a plain linear)
Why: a kernel ends as a whole, so packed with the shared expert the experts' input waits for 3 x I x d more
weight bytes than its own l x d (K3 rank preset: 139 MB instead of 51 MB, ~21 us at copy rate, on the
critical path of every MoE layer at batch 1). Alone, z ends first and overlapped_moe_branches runs the
shared expert (its gate/up, now fused with the GLU by glu_epilogue, and its down projection) on the second
stream beside the experts. Prefill keeps the pack: its GEMMs fill the GPU on their own.

Preconditions: the function's kind is decode or verify; E's input z is one result of a fused.packed_linear
of plain linears with parameter weights (`rewrite.linear_source`); otherwise the layer is left alone.
Postconditions: z is the result of a plain `linear` at the pack's place; the pack's other members keep
their results and order; numerics unchanged (a packed GEMM's columns are independent). Counts one per
split.
"""

from __future__ import annotations

from ir.core import Function, Module, Node

from .base import PassContext
from .rewrite import PACKED_OP, Index, linear_source, rewrite_each, take_from_pack

NAME = "moe_expert_input_split"
KINDS = ("decode", "verify")


def _split(fn: Function, experts: Node, index: Index) -> bool:
    z = experts.inputs[0]
    pack = index.producer(z)
    if pack is None or pack.op != PACKED_OP or not linear_source(fn, z, index):
        return False
    take_from_pack(fn, z, index)
    return True


def run(module: Module, ctx: PassContext) -> int:
    return rewrite_each(module, ctx, NAME, "moe_experts", _split, kinds=KINDS, indexed=True)
