"""Embedding + RMSNorm: the first layer's input norm runs in the kernel that gathers the embedding rows.

Pattern:
    %e = embedding(@table, %ids)
    %h = rms_norm(%e, @w) {eps}                the first reader of %e that normalises it
Rewrite:
    %e, %h = fused.embedding_rms_norm(@table, %ids, @w) {eps}
        body: the two nodes
The fused op (`a.operands`): table [V, D] (a parameter), ids [..] (integers), w [D]; attrs eps; results
e [.., D] = table[ids] (kept even when only the norm reads it: one row per token) and h = rms_norm(e) * w.
The kernel (codegen/triton/norm_quant.py, GATHER) runs the RMSNorm kernel's code on the gathered row, so h
equals the unfused pair's bit for bit under the same config. In K3 / K3.1 and Kimi-Linear: the embedding and
layer 0's input_layernorm of every entry function (one launch less per step).

Preconditions: the pattern, with a parameter table and a parameter gain. Left alone: a norm without a gain,
an embedding that reaches the norm through another node (e.g. the vocabulary-parallel all-reduce under TP),
and a pair with a node between them that reads %e (the two could not become one node in place).
Postconditions: one fused.embedding_rms_norm per match; numerics unchanged (the body is the original nodes).
"""

from __future__ import annotations

from ir.core import Function, Node

from .rewrite import Index, fuse, order_signature, rewrite_each

NAME = "embedding_norm"
FUSED_OP = "fused.embedding_rms_norm"


def _rewrite(fn: Function, norm: Node, index: Index) -> bool:
    if len(norm.inputs) != 2 or not norm.inputs[1].is_param:
        return False
    emb = index.producer(norm.inputs[0])
    if emb is None or emb.op != "embedding" or not emb.inputs[0].is_param:
        return False
    i, j = fn.nodes.index(emb), fn.nodes.index(norm)
    if any(v is emb.outputs[0] for n in fn.nodes[i + 1:j] for v in n.inputs):
        return False  # read between the two
    table, ids = emb.inputs
    fused = fuse(fn, [emb, norm], FUSED_OP, {"eps": norm.attrs["eps"]}, keep=(emb.outputs[0],), index=index)
    order_signature(fused, [table, ids, norm.inputs[1]], [emb.outputs[0].name, norm.outputs[0].name])
    return True


def run(module, ctx) -> int:
    return rewrite_each(module, ctx, NAME, "rms_norm", _rewrite, indexed=True)
