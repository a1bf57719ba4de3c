"""passes/overlapped_mla_query.py: Before/Expected on a hand-written MLA layer whose q_b is packed with the
indexer's wq_b and whose indexer nodes come first (the pass splits the pack, fuses the query path and
schedules it before the indexer); the independence precondition in both directions; on k31-tiny the
counter, placement, verifier, text round trip and numerics equal to the unfused model."""

from __future__ import annotations

import pytest

from passes.base import PassError
from tests.conftest import tiny_model
from tests.test_pass_pipeline import (assert_ir, assert_same_numerics, expected_counts, layer_counts, rewritten,
                                      run_pass_on_text)

NAME = "overlapped_mla_query"

HEAD = """module @mq {
  param @q_b : bf16[12,6] {shard="rep"}
  param @wq_b : bf16[8,6] {shard="rep"}
  param @kv_norm : bf16[4] {shard="rep"}
  param @kv_b : bf16[16,4] {shard="rep"}
  func @decode(%c_q: bf16[T,6], %kv_a: bf16[T,6], %w: bf16[T,2], %latent: f32[N,6], %keys: f8e4m3[N,4], %scales: f32[N],
               %req: i64[T], %pos: i64[T], %tbl: i32[R,MB]) -> (bf16[T,2,4], f32[N,6]) attrs {kind="decode"} {
"""
PACK = """
    %q, %iq = fused.packed_linear(%c_q, @q_b, @wq_b) {splits=[12, 8]} : bf16[T,12], bf16[T,8]
        body (%in0: bf16[T,6], %in1: bf16[12,6], %in2: bf16[8,6]) {
      %q = linear(%in0, %in1) : bf16[T,12]
      %iq = linear(%in0, %in2) : bf16[T,8]
      return %q, %iq
    }"""
INDEXER = """
    %iq3 = reshape(%iq) {shape=[-1, 2, 4]} : bf16[T,2,4]
    %q8, %qs = quantize_fp8_pow2(%iq3) : f8e4m3[T,2,4], f32[T,2]
    %sel = indexer_topk(%q8, %qs, %w, %keys, %scales, %pos, %req, %tbl) {block_size=4, topk=3} : i64[T,3]"""
QUERY = """
    %q3 = reshape(%q) {shape=[-1, 2, 6]} : bf16[T,2,6]
    %q_nope = slice(%q3) {axis=2, start=0, stop=4} : bf16[T,2,4]
    %q_pe = slice(%q3) {axis=2, start=4, stop=6} : bf16[T,2,2]
    %ckv = slice(%kv_a) {axis=1, start=0, stop=4} : bf16[T,4]
    %c = rms_norm(%ckv, @kv_norm) {eps=1e-06} : bf16[T,4]
    %k_pe = slice(%kv_a) {axis=1, start=4, stop=6} : bf16[T,2]
    %lat = concat(%c, %k_pe) {axis=1} : bf16[T,6]
    %lat32 = cast(%lat) {dtype="f32"} : f32[T,6]
    %latent2 = cache_write(%latent, %lat32, %req, %pos, %tbl) {block_size=4} : f32[N,6]"""
TAIL = """
    %o = mla_attention(%q_nope, %q_pe, %latent2, @kv_b, %pos, %req, %tbl, %sel) {block_size=4, scale=0.4} : bf16[T,2,4]
    return %o, %latent2
  }
}"""

EXPECTED = HEAD + """
    %q_nope, %q_pe, %latent2 = fused.mla_query(%c_q, @q_b, %kv_a, @kv_norm, %latent, %req, %pos, %tbl)
        {overlap="indexer", heads=2, nope_dim=4, rope_dim=2, kv_lora_rank=4, eps=1e-06, block_size=4}
        : bf16[T,2,4], bf16[T,2,2], f32[N,6]
        body (%in0: bf16[T,6], %in1: bf16[12,6], %in2: bf16[T,6], %in3: bf16[4], %in4: f32[N,6], %in5: i64[T],
              %in6: i64[T], %in7: i32[R,MB]) {
      %q = linear(%in0, %in1) : bf16[T,12]
      %q3 = reshape(%q) {shape=[-1, 2, 6]} : bf16[T,2,6]
      %q_nope = slice(%q3) {axis=2, start=0, stop=4} : bf16[T,2,4]
      %q_pe = slice(%q3) {axis=2, start=4, stop=6} : bf16[T,2,2]
      %ckv = slice(%in2) {axis=1, start=0, stop=4} : bf16[T,4]
      %c = rms_norm(%ckv, %in3) {eps=1e-06} : bf16[T,4]
      %k_pe = slice(%in2) {axis=1, start=4, stop=6} : bf16[T,2]
      %lat = concat(%c, %k_pe) {axis=1} : bf16[T,6]
      %lat32 = cast(%lat) {dtype="f32"} : f32[T,6]
      %latent2 = cache_write(%in4, %lat32, %in5, %in6, %in7) {block_size=4} : f32[N,6]
      return %q_nope, %q_pe, %latent2
    }
    %iq = linear(%c_q, @wq_b) : bf16[T,8]""" + INDEXER + TAIL


def test_before_expected_splits_the_pack_and_schedules_before_the_indexer():
    m, ctx = run_pass_on_text(NAME, HEAD + PACK + INDEXER + QUERY + TAIL)
    assert ctx.counters[NAME] == 1
    assert_ir(m, EXPECTED)


def test_query_path_feeding_the_indexer_is_an_error():
    text = HEAD + PACK + QUERY + INDEXER.replace("quantize_fp8_pow2(%iq3)", "quantize_fp8_pow2(%q_nope)") + TAIL
    with pytest.raises(PassError, match=r"overlapped_mla_query: in @decode, the MLA query path feeds the indexer: "
                                        r"node \(%q8, %qs = quantize_fp8_pow2\) reads %q_nope .*cannot overlap"):
        run_pass_on_text(NAME, text)


def test_indexer_feeding_the_query_path_is_an_error():
    query = QUERY.replace("cache_write(%latent, %lat32, %req, %pos, %tbl)",
                          "cache_write(%latent, %lat32, %req, %p2, %tbl)")
    derived = """
    %s1 = slice(%sel) {axis=1, start=0, stop=1} : i64[T,1]
    %p2 = reshape(%s1) {shape=[-1]} : i64[T]"""
    with pytest.raises(PassError, match=r"the indexer feeds the MLA query path: node \(%latent2 = cache_write\) reads "
                                        r"%p2, computed from the indexer node \(%sel = indexer_topk\)"):
        run_pass_on_text(NAME, HEAD + PACK + INDEXER + derived + query + TAIL)


def test_without_an_indexer_nothing_to_overlap():
    text = (HEAD + PACK + INDEXER + QUERY + TAIL).replace("%tbl, %sel) {block_size=4, scale=0.4}", "%tbl) {block_size=4, scale=0.4}")
    m, ctx = run_pass_on_text(NAME, text)
    assert ctx.counters[NAME] == 0 and "fused.mla_query" not in m.op_counts()


def test_k31_tiny_overlaps_every_indexed_layer_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME)  # fused_indexer_front disabled: q_b is still packed with wq_b
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 3 * layer_counts(cfg)["mla"]
    for f in m.functions.values():
        fused = [i for i, n in enumerate(f.nodes) if n.op == "fused.mla_query"]
        assert len(fused) == layer_counts(cfg)["mla"]
        for i in fused:
            assert f.nodes[i].attrs["overlap"] == "indexer"
            later = [n.op for n in f.nodes[i + 1:]]
            wq_b = next(j for j, n in enumerate(f.nodes[i + 1:]) if n.op == "linear" and "wq_b" in n.inputs[1].name)
            assert later.index("indexer_topk") > wq_b >= 0  # the indexer starts after the query path
    assert_same_numerics(m)


def test_k3_tiny_has_nothing_to_overlap():
    assert rewritten("k3-tiny", NAME)[1].counters[NAME] == 0
