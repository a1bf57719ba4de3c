"""KDA (Kimi Delta Attention) ops, SPEC §3: causal conv with state, forget gate, the delta-rule
recurrence over a ragged batch of requests with a state pool updated in place."""

from __future__ import annotations

import sympy

from ..core import TensorType
from ..dtypes import f32
from ..ref import kda as ref
from ..shapes import shapes_equal
from .basic import expect
from .registry import attr, defop

NoneType = type(None)


def _conv_infer(a, at):
    t, c = a.x.shape
    expect(shapes_equal(a.weight.shape[:1], (c,)), f"conv weight {a.weight} does not match input {a.x}")
    k = a.weight.shape[1]
    expect(a.conv_state.rank == 3 and shapes_equal(a.conv_state.shape[1:], (k - 1, c)),
           f"conv_state {a.conv_state} must be [S, {k - 1}, {c}]")
    kept = [TensorType(a.conv_state.dtype, (t, k - 1, c))] if at.get("keep_states") else []
    return [a.x, a.conv_state] + kept


def _conv_ref(a, at):
    if at.get("keep_states"):
        y, tails = ref.causal_conv1d(a.x, a.weight, a.conv_state, a.state_slot, a.cu_seqlens, keep_states=True)
        return y, a.conv_state, tails
    return ref.causal_conv1d(a.x, a.weight, a.conv_state, a.state_slot, a.cu_seqlens), a.conv_state


defop("causal_conv1d", ["x", "weight", "conv_state", "state_slot", "cu_seqlens"],
      ["y", "conv_state_out", "conv_states"], _conv_infer, _conv_ref,
      attrs={"keep_states": attr(bool, default=False)},
      flops=lambda a, o, at: 2 * a.x.numel() * a.weight.shape[1] + 5 * a.x.numel(),
      # the R = len(cu_seqlens) - 1 state rows of the step are read and written, not the whole pool
      bytes=lambda a, o, at: 2 * a.x.nbytes() + a.weight.nbytes() + a.state_slot.nbytes() + a.cu_seqlens.nbytes()
      + 2 * a.conv_state.nbytes() * (a.cu_seqlens.shape[0] - 1) / a.conv_state.shape[0]
      + sum((t.nbytes() for t in o[2:]), sympy.Integer(0)),
      inplace={1: "conv_state"},
      doc="depthwise causal conv per request continuing from its conv_state row, then SiLU; "
          "conv_state[state_slot[r]] <- last K-1 inputs; keep_states: also the conv tail after every token")


def _gate_infer(a, at):
    t, p = a.f.shape
    h = a.A_log.shape[0]
    return [TensorType(f32, (t, h, sympy.simplify(p / h)))]


defop("kda_gate", ["f", "A_log", "dt_bias"], ["g"], _gate_infer,
      lambda a, at: ref.kda_gate(a.f, a.A_log, a.dt_bias, at["lower_bound"]),
      attrs={"lower_bound": attr(float, NoneType)}, flops=lambda a, o, at: 8 * a.f.numel(),
      doc="lower_bound*sigmoid(exp(A_log)*(f+dt_bias)), or -exp(A_log)*softplus(f+dt_bias) when lower_bound is none")


def _kda_infer(a, at):
    t, h, d = a.q.shape
    expect(shapes_equal(a.k.shape, a.q.shape) and shapes_equal(a.g.shape, a.q.shape),
           f"kda: q {a.q}, k {a.k}, g {a.g} must have one shape")
    expect(shapes_equal(a.beta.shape, (t, h)), f"kda: beta {a.beta} must be [{t},{h}]")
    dv = a.v.shape[2]
    expect(a.state.rank == 4 and shapes_equal(a.state.shape[1:], (h, d, dv)), f"kda: state {a.state} must be [S,{h},{d},{dv}]")
    expect(at["form"] in ("recurrent", "chunked"), f"kda: form must be recurrent|chunked, found {at['form']!r}")
    if at.get("keep_states"):
        expect(at["form"] == "recurrent", "kda: keep_states (per-token states) needs form=recurrent")
        return [a.v, a.state, TensorType(f32, (t, h, d, dv))]
    return [a.v, a.state]


def _kda_ref(a, at):
    args = (a.q, a.k, a.v, a.g, a.beta, a.state, a.state_slot, a.cu_seqlens)
    if at.get("keep_states"):
        o, states = ref.kda_recurrence(*args, scale=at["scale"], keep_states=True)
        return o, a.state, states
    if at["form"] == "chunked":
        o = ref.kda_chunked(*args, scale=at["scale"])
    else:
        o = ref.kda_recurrence(*args, scale=at["scale"])
    return o, a.state


defop("kda", ["q", "k", "v", "g", "beta", "state", "state_slot", "cu_seqlens"], ["o", "state_out", "states"],
      _kda_infer, _kda_ref,
      attrs={"scale": attr(float), "form": attr(str, default="recurrent"), "keep_states": attr(bool, default=False)},
      flops=lambda a, o, at: 6 * a.q.numel() * a.v.shape[2],
      bytes=lambda a, o, at: sum((x.nbytes() for x in (a.q, a.k, a.v, a.g, a.beta)), sympy.Integer(0))
      + o[0].nbytes() + 2 * a.state.nbytes() * a.cu_seqlens.shape[0] / a.state.shape[0]
      + sum((t.nbytes() for t in o[2:]), sympy.Integer(0)),
      inplace={1: "state"},
      doc="S' = diag(exp g) S; S = S' + beta k (v - S'^T k)^T; o = S^T (q*scale), per request from "
          "state[state_slot[r]], final state written back (form: recurrent | chunked WY, equal results); "
          "keep_states (recurrent): also the state after every token, f32[T, H, D, Dv] (verification)")
