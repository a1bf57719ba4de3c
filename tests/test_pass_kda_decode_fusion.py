"""passes/kda_decode_fusion.py: Before/Expected on a hand-written KDA layer in decode (fused) and prefill
(left alone), equal results and state updates of both graphs in the interpreter, the precondition error,
and on k31-tiny and kimi-linear-tiny the counter, the verifier, the text round trip and numerics equal
to the unfused model. Verify: Before/Expected with the per-token states kept and returned, and the kept
state after token j (through the reference body and through the kda_decode kernel) equal to the unfused
layer's pools after running only the request's first j tokens."""

from __future__ import annotations

import pytest
import torch

from codegen.registry import templates_for
from codegen.select import Choice
from ir.interpreter import Interpreter
from ir.parser import parse_module
from passes.base import PassError
from k31c.runtime.executor import Executor
from tests.conftest import tiny_model
from tests.helpers import assert_close_rel
from tests.test_pass_pipeline import (assert_ir, assert_rewrites, assert_same_numerics, expected_counts, layer_counts,
                                      rewritten, run_pass_on_text)

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


def _weights_inputs(seed=0, lengths=(2, 1)):
    """Tokens of len(lengths) requests (2 + 1: request 0 verify-like); states at slots 1, 0, 2, ..."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    weights = {"qc": r(4, 2), "kc": r(4, 2), "vc": r(4, 2), "f_b": r(4, 3), "A_log": r(2), "dt_bias": r(4),
               "o_norm": r(2)}
    T, R = sum(lengths), len(lengths)
    slots = [1, 0] + list(range(2, R))
    inputs = {"q": r(T, 4), "k": r(T, 4), "v": r(T, 4), "f_a": r(T, 3), "b": r(T, 2), "gate": r(T, 4),
              "conv": r(max(R, 2), 1, 12), "state": r(max(R, 2), 2, 2, 2), "slot": torch.tensor(slots[:R]),
              "slot2": torch.tensor(slots[:R][::-1]),
              "cu": torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())}
    return weights, inputs


def _run(m, seed=0):
    weights, inputs = _weights_inputs(seed)
    return Interpreter(m, weights).run("decode", inputs)


def test_before_expected_and_equal_results():
    m = assert_rewrites(NAME, BEFORE, EXPECTED, 1)  # the chunked prefill layer is left alone
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
    kda_layers = [i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "kda"]
    before = tiny_model(preset)[1].function("verify").outputs
    kept = [v.name for v in m.function("verify").outputs[len(before):]]
    assert kept == [f"{p}_state.{i}.per_token" for i in kda_layers for p in ("kda", "conv")]
    assert len(m.function("decode").outputs) == len(tiny_model(preset)[1].function("decode").outputs)
    assert_same_numerics(m, preset)


VERIFY_SIG = SIG.replace("-> (bf16[T,4], f32[S,1,12], f32[S,2,2,2])",
                         "-> (bf16[T,4], f32[S,1,12], f32[S,2,2,2], f32[T,2,2,2], f32[T,1,12])")
VERIFY_EXPECTED = PARAMS + """
  func @verify""" + VERIFY_SIG + """ attrs {kind="verify"} {
    %out, %conv2, %state2, %state.per_token, %conv.per_token = fused.kda_decode(%q, %k, %v, @qc, @kc, @vc, %conv,
        %f_a, @f_b, @A_log, @dt_bias, %b, %state, %gate, @o_norm, %slot, %cu) {heads=2, head_dim=2, scale=0.7,
        lower_bound=-5.0, l2_eps=1e-06, norm_eps=1e-05, keep_states=true}
        : bf16[T,4], f32[S,1,12], f32[S,2,2,2], f32[T,2,2,2], f32[T,1,12]
        body (%in0: bf16[T,4], %in1: bf16[T,4], %in2: bf16[T,4], %in3: f32[4,2], %in4: f32[4,2], %in5: f32[4,2],
              %in6: f32[S,1,12], %in7: bf16[T,3], %in8: bf16[4,3], %in9: f32[2], %in10: f32[4], %in11: bf16[T,2],
              %in12: f32[S,2,2,2], %in13: bf16[T,4], %in14: f32[2], %in15: i64[R], %in16: i64[R+1]) {
      %qkv = concat(%in0, %in1, %in2) {axis=1} : bf16[T,12]
      %cw = concat(%in3, %in4, %in5) {axis=0} : f32[12,2]
      %y, %conv2, %conv.per_token = causal_conv1d(%qkv, %cw, %in6, %in15, %in16) {keep_states=true}
          : bf16[T,12], f32[S,1,12], f32[T,1,12]
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
      %o, %state2, %state.per_token = kda(%q3, %k3, %v2, %g, %beta, %in12, %in15, %in16)
          {scale=0.7, form="recurrent", keep_states=true} : bf16[T,2,2], f32[S,2,2,2], f32[T,2,2,2]
      %gate3 = reshape(%in13) {shape=[-1, 2, 2]} : bf16[T,2,2]
      %on = gated_rms_norm(%o, %gate3, %in14) {eps=1e-05} : bf16[T,2,2]
      %out = reshape(%on) {shape=[-1, 4]} : bf16[T,4]
      return %out, %conv2, %state2, %state.per_token, %conv.per_token
    }
    return %out, %conv2, %state2, %state.per_token, %conv.per_token
  }
}"""


def test_verify_keeps_per_token_states():
    m, ctx = run_pass_on_text(NAME, PARAMS + layer("verify") + "\n}")
    assert ctx.counters[NAME] == 1
    assert_ir(m, VERIFY_EXPECTED)


def _prefix_states(weights, inputs, r, j):
    """The unfused layer's pools after running only the first j tokens of request r (its own step)."""
    lo = int(inputs["cu"][r])
    one = dict(inputs, conv=inputs["conv"].clone(), state=inputs["state"].clone(), slot=inputs["slot"][r:r + 1],
               slot2=inputs["slot"][r:r + 1], cu=torch.tensor([0, j]))
    for name in ("q", "k", "v", "f_a", "b", "gate"):
        one[name] = inputs[name][lo:lo + j]
    _, conv, state = Interpreter(parse_module(PARAMS + layer() + "\n}"), weights).run("decode", one)
    slot = int(inputs["slot"][r])
    return state[slot], conv[slot]


@pytest.mark.parametrize("through", ["reference body", "kda_decode kernel"])
def test_kept_state_after_token_j_equals_the_recurrence_after_j_tokens(through):
    """Requests of 3, 1 and 8 tokens (verification of 1-8): row cu[r] + j - 1 of the kept states is the
    state (and conv tail) the unfused layer holds after the request's first j tokens; the pools hold the
    state after all of them, as without keeping."""
    m, _ = run_pass_on_text(NAME, PARAMS + layer("verify") + "\n}")
    lengths = (3, 1, 8)
    weights, inputs = _weights_inputs(3, lengths)
    fused = m.function("verify")
    if through == "reference body":
        engine = Interpreter(m, weights)
    else:
        node = next(i for i, n in enumerate(fused.nodes) if n.op == "fused.kda_decode")
        kernel = templates_for("fused.kda_decode")[0]
        engine = Executor(m, weights, [Choice("verify", node, "fused.kda_decode", "", kernel)])
    pools = {"conv": inputs["conv"].clone(), "state": inputs["state"].clone()}
    out, conv, state, kept, kept_conv = engine.run("verify", dict(inputs, **pools))
    if through != "reference body":
        assert engine.calls["kda_decode"] == 1
    want = Interpreter(parse_module(PARAMS + layer("verify") + "\n}"), weights).run(
        "verify", dict(inputs, conv=inputs["conv"].clone(), state=inputs["state"].clone()))
    assert_close_rel(out, want[0], 1e-5, f"{through}: layer output")
    assert_close_rel(state, want[2], 1e-5, f"{through}: state pool after the step")
    for r, n in enumerate(lengths):
        for j in range(1, n + 1):
            s_ref, c_ref = _prefix_states(weights, inputs, r, j)
            row = int(inputs["cu"][r]) + j - 1
            assert_close_rel(kept[row], s_ref, 1e-5, f"{through}: request {r}, state after {j} tokens")
            assert_close_rel(kept_conv[row], c_ref, 1e-6, f"{through}: request {r}, conv tail after {j} tokens")
