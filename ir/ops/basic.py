"""Generic tensor ops: embedding, linear, norms, elementwise, activations, reshapes, AttnRes mix."""

from __future__ import annotations

import sympy
import torch

from ..core import TensorType
from ..ref import basic as ref
from ..shapes import as_dim, numel, shapes_equal, shape_str
from .registry import attr, defop

NoneType = type(None)


class TypeRuleError(ValueError):
    pass


def expect(cond: bool, msg: str):
    if not cond:
        raise TypeRuleError(msg)


def _same_shape(*ts: TensorType):
    for t in ts[1:]:
        expect(shapes_equal(t.shape, ts[0].shape), f"shapes differ: {shape_str(ts[0].shape)} vs {shape_str(t.shape)}")


def _elementwise(name, fn, flops_per=1, doc=""):
    defop(name, ["x"], ["y"], lambda a, at: [a.x], lambda a, at: fn(a.x),
          flops=lambda a, o, at: flops_per * a.x.numel(), doc=doc)


def _binary(name, fn, doc=""):
    def infer(a, at):
        _same_shape(a.a, a.b)
        return [a.a]
    defop(name, ["a", "b"], ["y"], infer, lambda a, at: fn(a.a, a.b), flops=lambda a, o, at: a.a.numel(), doc=doc)


# ---- embedding and linear ----------------------------------------------------------------------
def _embedding_infer(a, at):
    expect(a.table.rank == 2, f"embedding table must be 2-D, found {a.table}")
    expect(a.ids.dtype.kind == "int", f"embedding ids must be integers, found {a.ids}")
    return [TensorType(a.table.dtype, (*a.ids.shape, a.table.shape[1]))]


defop("embedding", ["table", "ids"], ["y"], _embedding_infer,
      lambda a, at: a.table[a.ids],
      bytes=lambda a, o, at: o[0].nbytes() * 2 + a.ids.nbytes(),
      doc="y[...] = table[ids[...]]")


def _linear_infer(a, at):
    expect(a.w.rank == 2, f"linear weight must be 2-D [out, in], found {a.w}")
    expect(a.x.rank >= 1 and sympy.simplify(a.x.shape[-1] - a.w.shape[1]) == 0,
           f"linear: input {a.x} does not match weight {a.w} (in features)")
    return [TensorType(a.x.dtype, (*a.x.shape[:-1], a.w.shape[0]))]


defop("linear", ["x", "w"], ["y"], _linear_infer, lambda a, at: a.x @ a.w.t().to(a.x.dtype),
      flops=lambda a, o, at: 2 * numel(a.x.shape[:-1]) * a.w.shape[0] * a.w.shape[1],
      doc="y = x @ w^T in x's dtype (w stored in any format, e.g. an fp32 router over bf16 weights; packed "
          "formats are dequantised by the reference)")


# ---- norms -------------------------------------------------------------------------------------
def _norm_infer(a, at):
    for w in (getattr(a, "weight", None), getattr(a, "bias", None)):
        if w is not None:
            expect(w.rank == 1 and sympy.simplify(w.shape[0] - a.x.shape[-1]) == 0,
                   f"norm weight {w} does not match input {a.x}")
    return [a.x]


defop("rms_norm", ["x", "weight?"], ["y"], _norm_infer, lambda a, at: ref.rms_norm(a.x, a.weight, at["eps"]),
      attrs={"eps": attr(float)}, flops=lambda a, o, at: 4 * a.x.numel(), doc="x / sqrt(mean(x^2) + eps) * weight")
defop("layer_norm", ["x", "weight", "bias"], ["y"], _norm_infer,
      lambda a, at: ref.layer_norm(a.x, a.weight, a.bias, at["eps"]),
      attrs={"eps": attr(float)}, flops=lambda a, o, at: 6 * a.x.numel(),
      doc="(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased variance)")
defop("l2_norm", ["x"], ["y"], lambda a, at: [a.x], lambda a, at: ref.l2_norm(a.x, at["eps"]),
      attrs={"eps": attr(float)}, flops=lambda a, o, at: 3 * a.x.numel(), doc="x / sqrt(sum(x^2) + eps), last axis")


def _gated_norm_infer(a, at):
    _same_shape(a.o, a.gate)
    return [a.o]


defop("gated_rms_norm", ["o", "gate", "weight"], ["y"], _gated_norm_infer,
      lambda a, at: ref.gated_rms_norm(a.o, a.gate, a.weight, at["eps"]),
      attrs={"eps": attr(float)}, flops=lambda a, o, at: 8 * a.o.numel(),
      doc="rms_norm(o, weight) * sigmoid(gate) over the last axis (KDA output norm)")

# ---- elementwise and activations ----------------------------------------------------------------
_elementwise("sigmoid", torch.sigmoid, 4, doc="1 / (1 + exp(-x))")
_elementwise("silu", torch.nn.functional.silu, 5, doc="x * sigmoid(x)")
_binary("add", torch.add, doc="a + b (same shapes)")
_binary("mul", torch.mul, doc="a * b (same shapes)")
defop("scale", ["x"], ["y"], lambda a, at: [a.x], lambda a, at: a.x * at["factor"],
      attrs={"factor": attr(float)}, flops=lambda a, o, at: a.x.numel(), doc="x * factor")


def _glu_infer(a, at):
    _same_shape(a.a, a.u)
    return [a.a]


defop("situ_glu", ["a", "u"], ["y"], _glu_infer,
      lambda a, at: ref.situ_glu(a.a, a.u, at["beta1"], at["beta2"]),
      attrs={"beta1": attr(float), "beta2": attr(float, NoneType)}, flops=lambda a, o, at: 12 * a.a.numel(),
      doc="beta1*tanh(a/beta1)*sigmoid(a) * beta2*tanh(u/beta2) (SiTU-GLU)")
defop("swiglu", ["a", "u"], ["y"], _glu_infer, lambda a, at: ref.swiglu(a.a, a.u),
      flops=lambda a, o, at: 6 * a.a.numel(), doc="silu(a) * u")


def _cast_infer(a, at):
    return [a.x.with_dtype(at["dtype"])]


def _cast_ref(a, at):
    """Widened floats are converted by the interpreter; FP8 is part of the semantics: saturate to +-448,
    then round to e4m3 (SPEC §8: e4m3fn has no inf)."""
    if at["dtype"] == "f8e4m3":
        return a.x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return a.x


defop("cast", ["x"], ["y"], _cast_infer, _cast_ref, attrs={"dtype": attr(str)},
      doc="change storage dtype; the reference computes every float in its compute dtype, so it is the identity")


# ---- shape ops ---------------------------------------------------------------------------------
def _reshape_infer(a, at):
    dims = list(at["shape"])
    expect(dims.count(-1) <= 1, f"reshape: at most one -1 in {dims}")
    known = numel([as_dim(d) for d in dims if d != -1])
    out = [sympy.simplify(a.x.numel() / known) if d == -1 else as_dim(d) for d in dims]
    expect(all(d.is_integer is not False for d in out), f"reshape {a.x} to {dims}: sizes do not divide")
    expect(sympy.simplify(numel(out) - a.x.numel()) == 0, f"reshape {a.x} to {dims}: element counts differ")
    return [a.x.with_shape(out)]


defop("reshape", ["x"], ["y"], _reshape_infer, lambda a, at: a.x.reshape(at["shape"]),
      attrs={"shape": attr(list)}, bytes=lambda a, o, at: sympy.Integer(0), doc="view with a new shape (-1 once)")


def _slice_infer(a, at):
    ax, start, stop = at["axis"] % a.x.rank, at["start"], at["stop"]
    size = a.x.shape[ax]
    expect(0 <= start < stop and (not size.is_number or stop <= size),
           f"slice [{start}:{stop}] out of range for axis {ax} of {a.x}")
    shape = list(a.x.shape)
    shape[ax] = sympy.Integer(stop - start)
    return [a.x.with_shape(shape)]


defop("slice", ["x"], ["y"], _slice_infer, lambda a, at: a.x.narrow(at["axis"], at["start"], at["stop"] - at["start"]),
      attrs={"axis": attr(int), "start": attr(int), "stop": attr(int)}, doc="x[..., start:stop, ...] along axis")


def _concat_infer(a, at):
    xs = a.xs
    expect(len(xs) >= 1, "concat needs at least one operand")
    ax = at["axis"] % xs[0].rank
    for t in xs[1:]:
        expect(t.rank == xs[0].rank and t.dtype == xs[0].dtype and all(
            shapes_equal((t.shape[i],), (xs[0].shape[i],)) for i in range(t.rank) if i != ax),
            f"concat: {t} does not match {xs[0]} outside axis {ax}")
    shape = list(xs[0].shape)
    shape[ax] = sum((t.shape[ax] for t in xs), sympy.Integer(0))
    return [xs[0].with_shape(shape)]


defop("concat", ["*xs"], ["y"], _concat_infer, lambda a, at: torch.cat(a.xs, dim=at["axis"]),
      attrs={"axis": attr(int)}, doc="join the operands along axis (same dtype, equal sizes elsewhere)")


def _hadamard_infer(a, at):
    d = a.x.shape[-1]
    expect(d.is_number and int(d) & (int(d) - 1) == 0, f"hadamard needs a power-of-two last axis, found {a.x}")
    return [a.x]


defop("hadamard", ["x"], ["y"], _hadamard_infer, lambda a, at: ref.hadamard_rotate(a.x),
      flops=lambda a, o, at: a.x.numel() * sympy.log(a.x.shape[-1], 2),
      doc="x @ H_D / sqrt(D), H_D the Sylvester Hadamard matrix")


# ---- Attention Residuals -----------------------------------------------------------------------
def _mix_infer(a, at):
    expect(len(a.sources) >= 1, "attn_res_mix needs at least one source")
    _same_shape(*a.sources)
    d = a.sources[0].shape[-1]
    expect(sympy.simplify(numel(a.proj.shape) - d) == 0 and sympy.simplify(a.norm.shape[0] - d) == 0,
           f"attn_res_mix: proj {a.proj} / norm {a.norm} do not match sources {a.sources[0]}")
    return [a.sources[0]]


defop("attn_res_mix", ["proj", "norm", "*sources"], ["y"], _mix_infer,
      lambda a, at: ref.attn_res_mix(a.sources, a.proj.reshape(-1), a.norm, at["eps"]),
      attrs={"eps": attr(float)}, flops=lambda a, o, at: 8 * len(a.sources) * a.sources[0].numel(),
      doc="softmax over sources of (rmsnorm(V_i) . norm*proj), weighted sum of V_i (SPEC §2)")
