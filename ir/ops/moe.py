"""Mixture-of-experts ops, SPEC §6: the router and the grouped expert computation."""

from __future__ import annotations

import sympy

from ..core import TensorType
from ..dtypes import f32, i64
from ..ref import moe as ref
from ..shapes import shapes_equal
from .basic import expect
from .registry import attr, defop


def _router_infer(a, at):
    t, e = a.logits.shape
    if a.bias is not None:
        expect(shapes_equal(a.bias.shape, (e,)), f"router bias {a.bias} must be [{e}]")
    expect(0 < at["topk"] and (not e.is_number or at["topk"] <= int(e)), f"router topk {at['topk']} vs {e} experts")
    expect(at["activation"] in ("sigmoid", "softmax"), f"router activation {at['activation']!r}")
    return [TensorType(f32, (t, at["topk"])), TensorType(i64, (t, at["topk"]))]


defop("moe_router", ["logits", "bias?"], ["weights", "ids"], _router_infer,
      lambda a, at: ref.moe_router(a.logits, a.bias, at["topk"], at["activation"], at["renormalize"], at["scaling"],
                                   at["n_group"], at["topk_group"]),
      attrs={"topk": attr(int), "activation": attr(str, default="sigmoid"), "renormalize": attr(bool, default=True),
             "scaling": attr(float, default=1.0), "n_group": attr(int, default=1), "topk_group": attr(int, default=1)},
      flops=lambda a, o, at: 6 * a.logits.numel(),
      doc="scores = act(logits); ids = top-k(scores + bias) (bias selects only); weights = scores[ids] "
          "(/ sum + 1e-20 when renormalize) * scaling")


def _experts_infer(a, at):
    t, ell = a.z.shape
    e, inter, ell1 = a.w1.shape
    expect(shapes_equal((ell1,), (ell,)) and shapes_equal(a.w3.shape, a.w1.shape)
           and shapes_equal(a.w2.shape, (e, ell, inter)),
           f"experts: w1 {a.w1}, w2 {a.w2}, w3 {a.w3} do not match z {a.z}")
    expect(shapes_equal(a.weights.shape, a.ids.shape) and a.ids.dtype == i64, "experts: weights/ids must match, ids i64")
    expect(at["act"] in ("situ", "silu"), f"experts: act must be situ|silu, found {at['act']!r}")
    return [a.z.with_dtype(f32)]  # the weighted expert sum is accumulated and kept in fp32 (SPEC §6)


def _experts_bytes(a, o, at):
    """Activations, routing and output, plus the experts' weights scaled by min(1, T·K/E): a step of T tokens
    with K experts each reads at most T·K of the E experts (a decode step reads K, not E)."""
    t, k = a.ids.shape
    touched = sympy.Min(1, sympy.sympify(t) * k / a.w1.shape[0])
    return (a.z.nbytes() + a.weights.nbytes() + a.ids.nbytes() + o[0].nbytes()
            + (a.w1.nbytes() + a.w2.nbytes() + a.w3.nbytes()) * touched)


defop("moe_experts", ["z", "weights", "ids", "w1", "w2", "w3"], ["y"], _experts_infer,
      lambda a, at: ref.moe_experts(a.z, a.weights, a.ids, a.w1, a.w2, a.w3, at["act"], at["beta1"], at["beta2"]),
      attrs={"act": attr(str), "beta1": attr(float, default=1.0), "beta2": attr(float, type(None), default=None)},
      flops=lambda a, o, at: 6 * a.ids.numel() * a.w1.shape[1] * a.w1.shape[2], bytes=_experts_bytes,
      doc="y = sum_k weights[:,k] * W2_e act(W1_e z, W3_e z), e = ids[:,k]")
