"""passes/fused_indexer_front.py: Before/Expected on a hand-written indexer (its query projection packed
with two other linears reading c_Q), the precondition error, a non-matching graph left alone, and on
k31-tiny the counter, the verifier, the text round trip and numerics equal to the unfused model."""

from __future__ import annotations

import pytest

from passes.base import PassError
from tests.conftest import tiny_model
from tests.test_pass_pipeline import (assert_ir, assert_same_numerics, expected_counts, layer_counts, rewritten,
                                      run_pass_on_text)

NAME = "fused_indexer_front"

PARAMS = """
  param @q_b : bf16[12,6] {shard="rep"}
  param @wq_b : bf16[8,6] {shard="rep"}
  param @x_b : bf16[3,6] {shard="rep"}
  param @kn_w : bf16[4] {shard="rep"}
  param @kn_b : bf16[4] {shard="rep"}
  func @decode(%c_q: bf16[T,6], %ik: bf16[T,4], %iw: bf16[T,2], %keys: f8e4m3[N,4], %scales: f32[N], %req: i64[T],
               %pos: i64[T], %pos2: i64[T], %tbl: i32[R,MB])
      -> (bf16[T,12], bf16[T,3], i64[T,3], f8e4m3[N,4], f32[N]) attrs {kind="decode"} {
"""


def before(scale_pos="%pos", extra=""):
    return "module @front {" + PARAMS + f"""
    %q, %iq, %x = fused.packed_linear(%c_q, @q_b, @wq_b, @x_b) {{splits=[12, 8, 3]}} : bf16[T,12], bf16[T,8], bf16[T,3]
        body (%in0: bf16[T,6], %in1: bf16[12,6], %in2: bf16[8,6], %in3: bf16[3,6]) {{
      %q = linear(%in0, %in1) : bf16[T,12]
      %iq = linear(%in0, %in2) : bf16[T,8]
      %x = linear(%in0, %in3) : bf16[T,3]
      return %q, %iq, %x
    }}
    %iq3 = reshape(%iq) {{shape=[-1, 2, 4]}} : bf16[T,2,4]
    %qr = hadamard(%iq3) : bf16[T,2,4]
    %q8, %qs = quantize_fp8_pow2(%qr) : f8e4m3[T,2,4], f32[T,2]
    %kn = layer_norm(%ik, @kn_w, @kn_b) {{eps=1e-06}} : bf16[T,4]
    %kr = hadamard(%kn) : bf16[T,4]
    %k8, %ks = quantize_fp8_pow2(%kr) : f8e4m3[T,4], f32[T]
    %keys2 = cache_write(%keys, %k8, %req, %pos, %tbl) {{block_size=4}} : f8e4m3[N,4]
    %scales2 = cache_write(%scales, %ks, %req, {scale_pos}, %tbl) {{block_size=4}} : f32[N]
    %w = scale(%iw) {{factor=0.25}} : bf16[T,2]
    {extra}
    %sel = indexer_topk(%q8, %qs, %w, %keys2, %scales2, %pos, %req, %tbl) {{block_size=4, topk=3}} : i64[T,3]
    return %q, %x, %sel, %keys2, %scales2
  }}
}}"""


EXPECTED = "module @front {" + PARAMS + """
    %q, %x = fused.packed_linear(%c_q, @q_b, @x_b) {splits=[12, 3]} : bf16[T,12], bf16[T,3]
        body (%in0: bf16[T,6], %in1: bf16[12,6], %in2: bf16[3,6]) {
      %q = linear(%in0, %in1) : bf16[T,12]
      %x = linear(%in0, %in2) : bf16[T,3]
      return %q, %x
    }
    %q8, %qs, %w, %keys2, %scales2 = fused.indexer_front(%c_q, @wq_b, %ik, @kn_w, @kn_b, %iw, %keys, %scales, %req,
        %pos, %tbl) {heads=2, head_dim=4, eps=1e-06, weight_scale=0.25, quant="fp8_pow2", block_size=4}
        : f8e4m3[T,2,4], f32[T,2], bf16[T,2], f8e4m3[N,4], f32[N]
        body (%in0: bf16[T,6], %in1: bf16[8,6], %in2: bf16[T,4], %in3: bf16[4], %in4: bf16[4], %in5: bf16[T,2],
              %in6: f8e4m3[N,4], %in7: f32[N], %in8: i64[T], %in9: i64[T], %in10: i32[R,MB]) {
      %iq = linear(%in0, %in1) : bf16[T,8]
      %iq3 = reshape(%iq) {shape=[-1, 2, 4]} : bf16[T,2,4]
      %qr = hadamard(%iq3) : bf16[T,2,4]
      %q8, %qs = quantize_fp8_pow2(%qr) : f8e4m3[T,2,4], f32[T,2]
      %kn = layer_norm(%in2, %in3, %in4) {eps=1e-06} : bf16[T,4]
      %kr = hadamard(%kn) : bf16[T,4]
      %k8, %ks = quantize_fp8_pow2(%kr) : f8e4m3[T,4], f32[T]
      %keys2 = cache_write(%in6, %k8, %in8, %in9, %in10) {block_size=4} : f8e4m3[N,4]
      %scales2 = cache_write(%in7, %ks, %in8, %in9, %in10) {block_size=4} : f32[N]
      %w = scale(%in5) {factor=0.25} : bf16[T,2]
      return %q8, %qs, %w, %keys2, %scales2
    }
    %sel = indexer_topk(%q8, %qs, %w, %keys2, %scales2, %pos, %req, %tbl) {block_size=4, topk=3} : i64[T,3]
    return %q, %x, %sel, %keys2, %scales2
  }
}"""


def test_before_expected():
    m, ctx = run_pass_on_text(NAME, before())
    assert ctx.counters[NAME] == 1
    assert_ir(m, EXPECTED)


def test_key_and_scale_written_at_different_rows_is_an_error():
    with pytest.raises(PassError, match=r"fused_indexer_front: in @decode, the index-key write %keys2 .*"
                                        r"key-scale write %scales2 .*%pos2.*one row"):
        run_pass_on_text(NAME, before(scale_pos="%pos2"))


def test_intermediate_read_elsewhere_is_left_unfused():
    text = before().replace("return %q, %x, %sel", "return %q, %x, %sel").replace(
        "%sel = indexer_topk", "%probe = hadamard(%qr) : bf16[T,2,4]\n    %sel = indexer_topk")
    m, ctx = run_pass_on_text(NAME, text)
    assert ctx.counters[NAME] == 0
    assert "fused.indexer_front" not in m.op_counts() and m.op_counts()["fused.packed_linear"] == 1


def test_k31_tiny_fires_per_indexed_layer_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME)  # verifies after every pass
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 3 * layer_counts(cfg)["mla"]
    ops = m.op_counts()  # counts nodes inside bodies too
    assert ops["fused.indexer_front"] == ops["indexer_topk"] == ctx.counters[NAME]
    for f in m.functions.values():  # wq_b left the c_Q pack: q_b is a plain linear again
        assert not any(n.op == "fused.packed_linear" and any("wq_b" in v.name for v in n.inputs) for n in f.nodes)
    assert_same_numerics(m)


def test_k3_tiny_has_no_indexer():
    m, ctx = rewritten("k3-tiny", NAME)
    assert ctx.counters[NAME] == 0
