"""passes/embedding_norm.py and its kernel (codegen/triton/norm_quant.py GATHER): Before/Expected on a hand-written
embedding + RMSNorm, equal results of both graphs in the interpreter, the cases left alone, k31-tiny (counter,
verifier, text round trip, numerics equal to the unfused model), and the fused kernel against the two kernels
it replaces (embedding, then rms_norm with the same config: bitwise) and a float64 formula (interpreter, fp32)."""

from __future__ import annotations

import torch

from codegen.triton.embedding import embedding
from codegen.triton.norm_quant import embedding_rms_norm, norm_rot_quant, row_heuristic
from tests.conftest import tiny_model
from tests.helpers import assert_close_rel
from tests.test_pass_pipeline import (assert_equal_results, assert_rewrites, assert_same_numerics, expected_counts,
                                      rewritten, run_pass_on_text)

NAME = "embedding_norm"
HEAD = """module @emb {
  param @table : f32[10,8] {shard="rep"}
  param @w : f32[8] {shard="rep"}
  func @decode(%tokens: i64[T]) -> (f32[T,8], f32[T,8]) attrs {kind="decode"} {"""
BEFORE = HEAD + """
    %embed = embedding(@table, %tokens) : f32[T,8]
    %h = rms_norm(%embed, @w) {eps=1e-05} : f32[T,8]
    return %embed, %h
  }
}"""
EXPECTED = HEAD + """
    %embed, %h = fused.embedding_rms_norm(@table, %tokens, @w) {eps=1e-05} : f32[T,8], f32[T,8]
        body (%in0: f32[10,8], %in1: i64[T], %in2: f32[8]) {
      %embed = embedding(%in0, %in1) : f32[T,8]
      %h = rms_norm(%embed, %in2) {eps=1e-05} : f32[T,8]
      return %embed, %h
    }
    return %embed, %h
  }
}"""


def test_before_expected_and_equal_results():
    m = assert_rewrites(NAME, BEFORE, EXPECTED, 1)
    g = torch.Generator().manual_seed(0)
    weights = {"table": torch.randn(10, 8, generator=g), "w": torch.randn(8, generator=g)}
    assert_equal_results(BEFORE, m, weights, {"tokens": torch.tensor([3, 0, 9, -1])})


def test_embedding_read_only_by_the_norm_is_still_a_result():
    text = BEFORE.replace("-> (f32[T,8], f32[T,8])", "-> (f32[T,8])").replace("return %embed, %h", "return %h")
    m, ctx = run_pass_on_text(NAME, text)
    assert ctx.counters[NAME] == 1
    fused = m.function("decode").nodes[0]
    assert fused.op == "fused.embedding_rms_norm" and [o.name for o in fused.outputs] == ["embed", "h"]


def test_left_alone_without_gain_or_with_a_reader_between():
    no_gain = BEFORE.replace("rms_norm(%embed, @w)", "rms_norm(%embed)")
    assert run_pass_on_text(NAME, no_gain)[1].counters[NAME] == 0
    between = BEFORE.replace("""    %h = rms_norm""", """    %s = add(%embed, %embed) : f32[T,8]
    %h = rms_norm""").replace("return %embed, %h", "return %s, %h")
    assert run_pass_on_text(NAME, between)[1].counters[NAME] == 0


def test_k31_tiny_fuses_every_entry_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME)
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 3
    for f in m.functions.values():
        first = f.nodes[0]
        assert first.op == "fused.embedding_rms_norm" and not any(n.op == "embedding" for n in f.nodes)
    assert_same_numerics(m)


def test_kernel_equals_the_two_kernels_and_float64():
    g = torch.Generator().manual_seed(3)
    V, D = 37, 96
    table, w = torch.randn(V, D, generator=g), torch.rand(D, generator=g) + 0.5
    ids = torch.tensor([[5, 0, 36], [-1, 17, 5]])
    key = {"R": ids.numel(), "D": D, "rot": 0, "bi": 0}
    for cfg in (row_heuristic(key, "cpu"), {"BLOCK_R": 2, "BLOCK_D": 128, "num_warps": 4}):
        e, h = embedding_rms_norm(table, ids, w, 1e-5, cfg)
        e_ref = embedding(table, ids, {"BLOCK_R": 4, "BLOCK_D": 128, "num_warps": 4})
        h_ref = norm_rot_quant(e_ref, cfg, norm="rms", weight=w, eps=1e-5)[0]
        assert e.shape == (2, 3, D) and torch.equal(e, e_ref) and torch.equal(h, h_ref), cfg
        x = table.double()[ids % V]
        want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
        assert_close_rel(h, want, 1e-6, f"embedding_rms_norm {cfg}")
