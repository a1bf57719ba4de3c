"""passes/fused_indexer_select.py and the IR forms it adds (`selection_to_rows`, mla_attention's
`selection_kind="rows"`): Before/Expected on a hand-written indexer + attention, equal results of both
graphs in the interpreter, rows == positions in the reference, the preconditions, and on k31-tiny the
counter, the verifier, the text round trip and numerics equal to the unfused model."""

from __future__ import annotations

import re

import pytest
import torch

from ir.interpreter import Interpreter
from ir.parser import parse_module
from ir.ref import mla as ref_mla
from ir.verifier import VerifyError, verify
from passes.base import PassError
from tests.conftest import tiny_model
from tests.test_pass_pipeline import (assert_rewrites, assert_same_numerics, expected_counts, layer_counts, rewritten,
                                      run_pass_on_text)

NAME = "fused_indexer_select"

HEAD = """module @sel {
  param @kv_b : bf16[16,4] {shard="rep"}
  func @decode(%q8: f8e4m3[T,2,4], %qs: f32[T,2], %w: bf16[T,2], %keys: f8e4m3[N,4], %scales: f32[N],
               %q_nope: bf16[T,2,4], %q_pe: bf16[T,2,2], %latent: bf16[N,6], %req: i64[T], %req2: i64[T],
               %pos: i64[T], %tbl: i32[R,MB])
      -> (bf16[T,2,4]) attrs {kind="decode"} {
"""
BEFORE = HEAD + """
    %sel = indexer_topk(%q8, %qs, %w, %keys, %scales, %pos, %req, %tbl) {block_size=4, topk=3} : i64[T,3]
    %o = mla_attention(%q_nope, %q_pe, %latent, @kv_b, %pos, %req, %tbl, %sel) {block_size=4, scale=0.4} : bf16[T,2,4]
    return %o
  }
}"""
EXPECTED = HEAD + """
    %sel.rows = fused.indexer_select(%q8, %qs, %w, %keys, %scales, %pos, %req, %tbl) {topk=3, block_size=4, emits="rows", key_format="fp8"} : i64[T,3]
        body (%in0: f8e4m3[T,2,4], %in1: f32[T,2], %in2: bf16[T,2], %in3: f8e4m3[N,4], %in4: f32[N], %in5: i64[T],
              %in6: i64[T], %in7: i32[R,MB]) {
      %sel = indexer_topk(%in0, %in1, %in2, %in3, %in4, %in5, %in6, %in7) {block_size=4, topk=3} : i64[T,3]
      %sel.rows = selection_to_rows(%sel, %in6, %in7) {block_size=4} : i64[T,3]
      return %sel.rows
    }
    %o = mla_attention(%q_nope, %q_pe, %latent, @kv_b, %pos, %req, %tbl, %sel.rows) {block_size=4, scale=0.4, selection_kind="rows"}
        : bf16[T,2,4]
    return %o
  }
}"""


def _inputs(seed=0):
    """Three tokens of two requests (positions 4, 5 of request 0 at base 0; position 6 of request 1 at
    base 8): contexts longer than topk=3, so the selection is sparse."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"q8": r(3, 2, 4).to(torch.float8_e4m3fn), "qs": torch.full((3, 2), 0.5), "w": r(3, 2),
            "keys": r(16, 4).to(torch.float8_e4m3fn), "scales": torch.rand(16, generator=g) + 0.5,
            "q_nope": r(3, 2, 4), "q_pe": r(3, 2, 2), "latent": r(16, 6), "req": torch.tensor([0, 0, 1]),
            "req2": torch.tensor([0, 0, 1]), "pos": torch.tensor([4, 5, 6]), "tbl": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)}


def test_before_expected_and_equal_results():
    m = assert_rewrites(NAME, BEFORE, EXPECTED, 1)
    weights = {"kv_b": torch.randn(16, 4, generator=torch.Generator().manual_seed(1))}
    before = Interpreter(parse_module(BEFORE), weights).run("decode", _inputs())
    after = Interpreter(m, weights).run("decode", _inputs())
    assert torch.equal(before[0], after[0])


def test_mxfp4_key_format_is_carried_and_numerics_kept():
    """key_format="mxfp4" (u8 E2M1 pairs + u8 E8M0 scales per 32) reaches the fused node; both graphs,
    interpreted (the reference dequantises the MXFP4 keys), give the same attention output."""
    from ir import formats
    before = BEFORE.replace("%keys: f8e4m3[N,4], %scales: f32[N]", "%keys: u8[N,16], %scales: u8[N,1]")
    before = before.replace("%q8: f8e4m3[T,2,4]", "%q8: f8e4m3[T,2,32]").replace("%qs: f32[T,2]", "%qs: f32[T,2]")
    before = before.replace("{block_size=4, topk=3} : i64[T,3]", '{block_size=4, topk=3, key_format="mxfp4"} : i64[T,3]')
    m, ctx = run_pass_on_text(NAME, before)
    fused = [n for f in m.functions.values() for n in f.nodes if n.op == "fused.indexer_select"]
    assert ctx.counters[NAME] == 1 and fused[0].attrs["key_format"] == "mxfp4"
    g = torch.Generator().manual_seed(5)
    inputs = _inputs(5)
    inputs["q8"] = torch.randn(3, 2, 32, generator=g).to(torch.float8_e4m3fn)
    inputs["keys"], inputs["scales"] = formats.quantize_mxfp4(torch.randn(16, 32, generator=g))
    weights = {"kv_b": torch.randn(16, 4, generator=g)}
    want = Interpreter(parse_module(before), weights).run("decode", inputs)
    got = Interpreter(m, weights).run("decode", inputs)
    assert torch.equal(want[0], got[0]) and torch.isfinite(got[0]).all()
    with pytest.raises(VerifyError, match="key_format mxfp4 needs u8 keys"):
        verify(parse_module(before.replace("%keys: u8[N,16]", "%keys: f8e4m3[N,16]")))


def test_selection_read_as_positions_elsewhere_is_an_error():
    text = BEFORE.replace("return %o\n", "%first = slice(%sel) {axis=1, start=0, stop=1} : i64[T,1]\n    return %o\n")
    with pytest.raises(PassError, match=r"fused_indexer_select: in @decode, node \(%first = slice\) reads the "
                                        r"selection %sel other than as mla_attention's selection"):
        run_pass_on_text(NAME, text)


def test_attention_addressing_the_pool_differently_is_an_error():
    text = BEFORE.replace("@kv_b, %pos, %req, %tbl, %sel", "@kv_b, %pos, %req2, %tbl, %sel")
    with pytest.raises(PassError, match=r"node \(%o = mla_attention\) addresses its pool with \(%req2, %tbl\) "
                                        r"block_size 4 but the indexer with \(%req, %tbl\) block_size 4"):
        run_pass_on_text(NAME, text)


@pytest.mark.parametrize("form", ["absorbed", "decompressed"])
def test_reference_rows_equal_positions(form):
    a = _inputs(3)
    sel = torch.tensor([[1, 3, 4], [0, 2, 5], [2, 6, -1]])
    rows = ref_mla.selection_positions_to_rows(sel, a["req"], a["tbl"], 4)
    assert rows.tolist() == [[1, 3, 4], [0, 2, 5], [10, 14, -1]]
    assert torch.equal(ref_mla.selection_rows_to_positions(rows, a["req"], a["tbl"], 4), sel)
    kv_b = torch.randn(16, 4, dtype=torch.float64)
    args = (a["q_nope"].double(), a["q_pe"].double(), a["latent"].double(), kv_b, a["pos"], a["req"], a["tbl"], 4, 0.4)
    by_pos = ref_mla.mla_attention(*args, sel, form)
    by_rows = ref_mla.mla_attention(*args, rows, form, selection_kind="rows")
    assert torch.equal(by_pos, by_rows) and by_pos.abs().sum() > 0
    with pytest.raises(ValueError, match="in a block its request does not own"):
        ref_mla.mla_attention(*args, torch.tensor([[1, 3, 4], [0, 2, 5], [7, 14, -1]]), form, selection_kind="rows")


def test_verifier_checks_selection_kind():
    m = parse_module(EXPECTED.replace('selection_kind="rows"', 'selection_kind="pages"'))
    with pytest.raises(VerifyError, match=re.escape("selection_kind must be positions|rows, found 'pages'")):
        verify(m)


def test_k31_tiny_fires_per_indexed_layer_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME)
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 3 * layer_counts(cfg)["mla"]
    for f in m.functions.values():
        assert not any(n.op == "indexer_topk" for n in f.nodes)
        mla = [n for n in f.nodes if n.op == "mla_attention"]
        assert mla and all(n.attrs["selection_kind"] == "rows" for n in mla)
    assert_same_numerics(m)
