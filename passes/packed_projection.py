"""Packed input projection: linears that read the same input become one GEMM.

Pattern:     %a = linear(%x, @Wa); %b = linear(%x, @Wb); ...        (≥ 2 linears, same %x)
Rewrite:     %a, %b, ... = fused.packed_linear(%x, @Wa, @Wb, ...) {splits=[out_a, out_b, ...]}
             body: the original linears.
In the model: MLA layer q_a, kv_a, output gate, indexer key and head-weight projections; KDA layer
q, k, v, output gate, forget-gate down-projection, beta; the FFN's gate/up (and LatentMoE's latent
down-projection, which reads the same normalised input).

Preconditions: the weights are parameters of one plain dtype (packed formats are left alone), 2-D.
The later linears of a group are moved up next to the first one (legal: their only operands, %x and
parameters, are defined before it). Postconditions: one fused.packed_linear per (input, dtype) group;
results keep their names; numerics unchanged (the body is the unfused linears; a kernel computes
x @ concat(W)^T and splits the columns).
"""

from __future__ import annotations

from ir.core import Function, Module

from .base import PassContext
from .rewrite import PACKED_OP, Index, fuse, move_after

NAME = "packed_projection"
FUSED_OP = PACKED_OP


def _groups(fn: Function) -> list[list]:
    by_input: dict = {}
    for n in fn.nodes:
        if n.op == "linear" and n.inputs[1].is_param and not n.inputs[1].type.dtype.is_packed:
            key = (id(n.inputs[0]), n.inputs[1].type.dtype.name)
            by_input.setdefault(key, []).append(n)
    return [g for g in by_input.values() if len(g) >= 2]


def run(module: Module, ctx: PassContext) -> int:
    rewrites = 0
    for fn in module.functions.values():
        index = Index(fn)   # moves keep it valid (it holds no order); fuse keeps it current
        for group in _groups(fn):
            for prev, n in zip(group, group[1:]):  # gather the group right after its first member
                move_after(fn, n, prev)
            splits = [int(n.inputs[1].type.shape[0]) for n in group]
            fuse(fn, group, FUSED_OP, {"splits": splits}, index=index)
            rewrites += 1
    ctx.count(NAME, rewrites)
    return rewrites
