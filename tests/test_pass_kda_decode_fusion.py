"""passes/kda_decode_fusion.py: Before/Expected on a hand-written KDA layer in decode (fused) and prefill
(left alone), equal results and state updates of both graphs in the interpreter, the precondition error,
and on k31-tiny and kimi-linear-tiny the counter, the verifier, the text round trip and numerics equal
to the unfused model."""

from __future__ import annotations

import pytest
import torch

from ir.interpreter import Interpreter
from ir.parser import parse_module
from passes.base import PassError
from tests.conftest import tiny_model
from tests.test_pass_pipeline import (assert_ir, assert_same_numerics, expected_counts, layer_counts, rewritten,
                                      run_pass_on_text)

NAME = "kda_decode_fusion"

PARAMS = """module @kda {
  param @qc : f32[4,2] {shard="rep"}
  param @kc : f32[4,2] {shard="rep"}
  param @vc : f32[4,2] {shard="rep"}
  param @f_b : bf16[4,3] {shard="rep"}
  param @A_log : f32[2] {shard="rep"}
  param @dt_bias : f32[4] {shard="rep"}
  param @o_norm : f32[2] {shard="rep"}"""
SIG = """(%q: bf16[T,4], %k: bf16[T,4], %v: bf16[T,4], %f_a: bf16[T,3], %b: bf16[T,2], %gate: bf16[T,4],
      %conv: f32[S,1,12], %state: f32[S,2,2,2], %slot: i64[R], %slot2: i64[R], %cu: i64[R+1])
      -> (bf16[T,4], f32[S,1,12], f32[S,2,2,2])"""


def layer(kind="decode", form="recurrent", kda_slot="%slot"):
    return f"""
  func @{kind}{SIG} attrs {{kind="{kind}"}} {{
    %qkv = concat(%q, %k, %v) {{axis=1}} : bf16[T,12]
    %cw = concat(@qc, @kc, @vc) {{axis=0}} : f32[12,2]
    %y, %conv2 = causal_conv1d(%qkv, %cw, %conv, %slot, %cu) : bf16[T,12], f32[S,1,12]
    %q1 = slice(%y) {{axis=1, start=0, stop=4}} : bf16[T,4]
    %q2 = reshape(%q1) {{shape=[-1, 2, 2]}} : bf16[T,2,2]
    %q3 = l2_norm(%q2) {{eps=1e-06}} : bf16[T,2,2]
    %k1 = slice(%y) {{axis=1, start=4, stop=8}} : bf16[T,4]
    %k2 = reshape(%k1) {{shape=[-1, 2, 2]}} : bf16[T,2,2]
    %k3 = l2_norm(%k2) {{eps=1e-06}} : bf16[T,2,2]
    %v1 = slice(%y) {{axis=1, start=8, stop=12}} : bf16[T,4]
    %v2 = reshape(%v1) {{shape=[-1, 2, 2]}} : bf16[T,2,2]
    %f = linear(%f_a, @f_b) : bf16[T,4]
    %g = kda_gate(%f, @A_log, @dt_bias) {{lower_bound=-5.0}} : f32[T,2,2]
    %beta = sigmoid(%b) : bf16[T,2]
    %o, %state2 = kda(%q3, %k3, %v2, %g, %beta, %state, {kda_slot}, %cu) {{scale=0.7, form="{form}"}}
        : bf16[T,2,2], f32[S,2,2,2]
    %gate3 = reshape(%gate) {{shape=[-1, 2, 2]}} : bf16[T,2,2]
    %on = gated_rms_norm(%o, %gate3, @o_norm) {{eps=1e-05}} : bf16[T,2,2]
    %out = reshape(%on) {{shape=[-1, 4]}} : bf16[T,4]
    return %out, %conv2, %state2
  }}"""


PREFILL = layer("prefill", "chunked")
BEFORE = PARAMS + layer() + PREFILL + "\n}"
EXPECTED = PARAMS + """
  func @decode""" + SIG + """ attrs {kind="decode"} {
    %out, %conv2, %state2 = fused.kda_decode(%q, %k, %v, @qc, @kc, @vc, %conv, %f_a, @f_b, @A_log, @dt_bias, %b, %state,
        %gate, @o_norm, %slot, %cu) {heads=2, head_dim=2, scale=0.7, lower_bound=-5.0, l2_eps=1e-06, norm_eps=1e-05}
        : bf16[T,4], f32[S,1,12], f32[S,2,2,2]
        body (%in0: bf16[T,4], %in1: bf16[T,4], %in2: bf16[T,4], %in3: f32[4,2], %in4: f32[4,2], %in5: f32[4,2],
              %in6: f32[S,1,12], %in7: bf16[T,3], %in8: bf16[4,3], %in9: f32[2], %in10: f32[4], %in11: bf16[T,2],
              %in12: f32[S,2,2,2], %in13: bf16[T,4], %in14: f32[2], %in15: i64[R], %in16: i64[R+1]) {
      %qkv = concat(%in0, %in1, %in2) {axis=1} : bf16[T,12]
      %cw = concat(%in3, %in4, %in5) {axis=0} : f32[12,2]
      %y, %conv2 = causal_conv1d(%qkv, %cw, %in6, %in15, %in16) : bf16[T,12], f32[S,1,12]
      %q1 = slice(%y) {axis=1, start=0, stop=4} : bf16[T,4]
      %q2 = reshape(%q1) {shape=[-1, 2, 2]} : bf16[T,2,2]
      %q3 = l2_norm(%q2) {eps=1e-06} : bf16[T,2,2]
      %k1 = slice(%y) {axis=1, start=4, stop=8} : bf16[T,4]
      %k2 = reshape(%k1) {shape=[-1, 2, 2]} : bf16[T,2,2]
      %k3 = l2_norm(%k2) {eps=1e-06} : bf16[T,2,2]
      %v1 = slice(%y) {axis=1, start=8, stop=12} : bf16[T,4]
      %v2 = reshape(%v1) {shape=[-1, 2, 2]} : bf16[T,2,2]
      %f = linear(%in7, %in8) : bf16[T,4]
      %g = kda_gate(%f, %in9, %in10) {lower_bound=-5.0} : f32[T,2,2]
      %beta = sigmoid(%in11) : bf16[T,2]
      %o, %state2 = kda(%q3, %k3, %v2, %g, %beta, %in12, %in15, %in16) {scale=0.7, form="recurrent"}
          : bf16[T,2,2], f32[S,2,2,2]
      %gate3 = reshape(%in13) {shape=[-1, 2, 2]} : bf16[T,2,2]
      %on = gated_rms_norm(%o, %gate3, %in14) {eps=1e-05} : bf16[T,2,2]
      %out = reshape(%on) {shape=[-1, 4]} : bf16[T,4]
      return %out, %conv2, %state2
    }
    return %out, %conv2, %state2
  }""" + PREFILL + "\n}"


def _run(m, seed=0):
    """Three tokens: request 0 has two (verify-like), request 1 one; states at slots 1 and 0."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    weights = {"qc": r(4, 2), "kc": r(4, 2), "vc": r(4, 2), "f_b": r(4, 3), "A_log": r(2), "dt_bias": r(4),
               "o_norm": r(2)}
    inputs = {"q": r(3, 4), "k": r(3, 4), "v": r(3, 4), "f_a": r(3, 3), "b": r(3, 2), "gate": r(3, 4),
              "conv": r(2, 1, 12), "state": r(2, 2, 2, 2), "slot": torch.tensor([1, 0]), "slot2": torch.tensor([0, 1]),
              "cu": torch.tensor([0, 2, 3])}
    return Interpreter(m, weights).run("decode", inputs)


def test_before_expected_and_equal_results():
    m, ctx = run_pass_on_text(NAME, BEFORE)
    assert ctx.counters[NAME] == 1  # the chunked prefill layer is left alone
    assert_ir(m, EXPECTED)
    before, after = _run(parse_module(BEFORE)), _run(m)
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # output, conv state, recurrent state


def test_conv_and_recurrence_with_different_slots_is_an_error():
    text = PARAMS + layer(kda_slot="%slot2") + "\n}"
    with pytest.raises(PassError, match=r"kda_decode_fusion: in @decode, the conv \(%y\) reads its state at "
                                        r"\(%slot, %cu\) but the recurrence \(%o\) at \(%slot2, %cu\)"):
        run_pass_on_text(NAME, text)


def test_recurrent_form_outside_decode_and_verify_is_left_alone():
    m, ctx = run_pass_on_text(NAME, PARAMS + layer("prefill", "recurrent") + "\n}")
    assert ctx.counters[NAME] == 0 and "fused.kda_decode" not in m.op_counts()


@pytest.mark.parametrize("preset", ["k31-tiny", "kimi-linear-tiny"])
def test_fires_per_kda_layer_in_decode_and_verify_and_keeps_numerics(preset):
    cfg = tiny_model(preset)[0]
    m, ctx = rewritten(preset, NAME)
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 2 * layer_counts(cfg)["kda"]
    assert "fused.kda_decode" not in m.op_counts("prefill")
    for fn in ("decode", "verify"):
        assert m.op_counts(fn)["fused.kda_decode"] == layer_counts(cfg)["kda"]
    assert_same_numerics(m, preset)
