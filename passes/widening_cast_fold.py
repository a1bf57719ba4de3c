"""Widening cast fold: a GEMM reads its bf16/f16 input and widens it in registers, instead of a cast
kernel writing an f32 copy for it.

Pattern:
    %y = cast(%x) {dtype="f32"}          %x: bf16 or f16 (the widening is exact)
    %z = linear(%y, @W)                  the only reader of %y (%y is not returned)
Rewrite:
    %z = fused.widened_linear(%x, @W) {dtype="f32"}
        body: the cast and the linear
In the model: the MoE router logits (the router runs in f32 on the bf16 hidden state) and the LM head,
in every entry function.

The fused op (`a.operands`): x [.., K] (bf16/f16), W [N, K]; attrs dtype="f32"; result z [.., N] f32.
A kernel (codegen/triton/widened_gemm.py) loads x, converts each tile to f32 and then runs the f32
GEMM's arithmetic unchanged, so z equals the unfused pair bit for bit.

Preconditions: the pattern; a cast read by anything else, a narrowing or non-float cast, or a linear whose
weight is not a parameter is left alone. Postconditions: one fused.widened_linear per match; numerics
unchanged (the body is the original nodes).
"""

from __future__ import annotations

from ir.core import Function, Node

from .rewrite import Index, fuse, order_signature, rewrite_each

NAME = "widening_cast_fold"
FUSED_OP = "fused.widened_linear"
EXACT = {"f32": ("bf16", "f16")}   # widened dtype -> the dtypes it holds exactly


def _rewrite(fn: Function, linear: Node, index: Index) -> bool:
    y, w = linear.inputs
    cast = index.producer(y)
    if cast is None or cast.op != "cast" or not w.is_param or index.single_user(y) is not linear:
        return False
    x, wide = cast.inputs[0], cast.attrs.get("dtype")
    if x.type.dtype.name not in EXACT.get(wide, ()):
        return False
    fused = fuse(fn, [cast, linear], FUSED_OP, {"dtype": wide}, index=index)
    order_signature(fused, [x, w], [linear.outputs[0].name])
    return True


def run(module, ctx) -> int:
    return rewrite_each(module, ctx, NAME, "linear", _rewrite, indexed=True)
