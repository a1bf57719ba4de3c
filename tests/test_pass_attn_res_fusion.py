"""passes/attn_res_fusion.py: Before/Expected on hand-written AttnRes mixes (with and without the prefix
add), equal results of both graphs in the interpreter, the cases left unfused, and on k31-tiny the counter,
the verifier, the text round trip and numerics equal to the unfused model."""

from __future__ import annotations

import torch

from tests.conftest import tiny_model
from tests.test_pass_pipeline import (assert_equal_results, assert_rewrites, assert_same_numerics, expected_counts,
                                      rewritten, run_pass_on_text)

NAME = "attn_res_fusion"

HEAD = """module @ar {
  param @p1 : bf16[1,4] {shard="rep"}
  param @n1 : bf16[4] {shard="rep"}
  param @w1 : bf16[4] {shard="rep"}
  param @p2 : bf16[1,4] {shard="rep"}
  param @n2 : bf16[4] {shard="rep"}
  param @w2 : bf16[4] {shard="rep"}
  func @decode(%embed: bf16[T,4], %b1: bf16[T,4], %prev: bf16[T,4], %part: bf16[T,4])
      -> (bf16[T,4], bf16[T,4], bf16[T,4]) attrs {kind="decode"} {"""
BEFORE = HEAD + """
    %prefix = add(%prev, %part) : bf16[T,4]
    %x = attn_res_mix(@p1, @n1, %embed, %b1, %prefix) {eps=1e-05} : bf16[T,4]
    %h = rms_norm(%x, @w1) {eps=1e-06} : bf16[T,4]
    %x2 = attn_res_mix(@p2, @n2, %embed, %h) {eps=1e-05} : bf16[T,4]
    %h2 = rms_norm(%x2, @w2) {eps=1e-05} : bf16[T,4]
    return %prefix, %h, %h2
  }
}"""
EXPECTED = HEAD + """
    %prefix, %h = fused.attn_res_mix_norm(@p1, @n1, @w1, %embed, %b1, %prev, %part)
        {bank=2, prefix_add=true, eps=1e-05, norm_eps=1e-06} : bf16[T,4], bf16[T,4]
        body (%in0: bf16[1,4], %in1: bf16[4], %in2: bf16[4], %in3: bf16[T,4], %in4: bf16[T,4], %in5: bf16[T,4],
              %in6: bf16[T,4]) {
      %prefix = add(%in5, %in6) : bf16[T,4]
      %x = attn_res_mix(%in0, %in1, %in3, %in4, %prefix) {eps=1e-05} : bf16[T,4]
      %h = rms_norm(%x, %in2) {eps=1e-06} : bf16[T,4]
      return %prefix, %h
    }
    %h2 = fused.attn_res_mix_norm(@p2, @n2, @w2, %embed, %h) {bank=1, prefix_add=false, eps=1e-05, norm_eps=1e-05}
        : bf16[T,4] body (%in0: bf16[1,4], %in1: bf16[4], %in2: bf16[4], %in3: bf16[T,4], %in4: bf16[T,4]) {
      %x2 = attn_res_mix(%in0, %in1, %in3, %in4) {eps=1e-05} : bf16[T,4]
      %h2 = rms_norm(%x2, %in2) {eps=1e-05} : bf16[T,4]
      return %h2
    }
    return %prefix, %h, %h2
  }
}"""


def _weights_inputs(seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(*((1, 4) if n[0] == "p" else (4,)), generator=g)
               for n in ("p1", "n1", "w1", "p2", "n2", "w2")}
    return weights, {n: torch.randn(3, 4, generator=g) for n in ("embed", "b1", "prev", "part")}


def test_before_expected_and_equal_results():
    m = assert_rewrites(NAME, BEFORE, EXPECTED, 2)
    assert_equal_results(BEFORE, m, *_weights_inputs(0))


def test_prefix_read_only_by_the_mix_joins_and_stays_a_result():
    """The output mix's last prefix is read by nothing after the mix: the add still joins the fused node
    (one launch less), whose prefix result is then unused; numerics unchanged."""
    text = BEFORE.replace("return %prefix, %h, %h2", "return %part, %h, %h2")
    m, ctx = run_pass_on_text(NAME, text)
    assert ctx.counters[NAME] == 2
    f = m.function("decode")
    fused = [n for n in f.nodes if n.op == "fused.attn_res_mix_norm"]
    assert [n.attrs["prefix_add"] for n in fused] == [True, False]
    assert not any(n.op == "add" for n in f.nodes) and len(fused[0].outputs) == 2
    assert_equal_results(text, m, *_weights_inputs(1))


def test_prefix_read_between_the_add_and_the_norm_stays_outside():
    text = BEFORE.replace("""    %x = attn_res_mix(@p1, @n1, %embed, %b1, %prefix) {eps=1e-05} : bf16[T,4]
""", """    %x = attn_res_mix(@p1, @n1, %embed, %b1, %prefix) {eps=1e-05} : bf16[T,4]
    %early = add(%prefix, %b1) : bf16[T,4]
""").replace("return %prefix, %h, %h2", "return %early, %h, %h2")
    m, ctx = run_pass_on_text(NAME, text)
    assert ctx.counters[NAME] == 2
    fused = [n for n in m.function("decode").nodes if n.op == "fused.attn_res_mix_norm"]
    assert [n.attrs["prefix_add"] for n in fused] == [False, False]
    assert m.function("decode").nodes[0].op == "add"


def test_mix_read_by_more_than_its_norm_is_left_unfused():
    text = BEFORE.replace("return %prefix, %h, %h2", "return %prefix, %x2, %h2")
    m, ctx = run_pass_on_text(NAME, text)
    assert ctx.counters[NAME] == 1 and m.op_counts()["attn_res_mix"] == 2  # one inside a body, one left


def test_k31_tiny_fuses_every_mix_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME)
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 3 * 2 * cfg.num_hidden_layers
    for f in m.functions.values():
        assert not any(n.op == "attn_res_mix" for n in f.nodes)
        fused = [n for n in f.nodes if n.op == "fused.attn_res_mix_norm"]
        assert sum(n.attrs["prefix_add"] for n in fused) > 0 and all(len(n.inputs) == 3 + n.attrs["bank"] +
                                                                      1 + n.attrs["prefix_add"] for n in fused)
    assert_same_numerics(m)


def test_kimi_linear_has_no_attn_res():
    assert rewritten("kimi-linear-tiny", NAME)[1].counters[NAME] == 0
