"""passes/value_gate.py and the IR forms it adds (mla_attention form="latent", `mla_value_proj`):
Before/Expected on a hand-written absorbed (decode) and decompressed (prefill, left unfused) attention +
gate, equal results of both graphs in the interpreter, latent + value projection == absorbed in the
reference, the type rule, and on k31-tiny the counter, the verifier, the text round trip and numerics
equal to the unfused model."""

from __future__ import annotations

import pytest
import torch

from ir.interpreter import Interpreter
from ir.parser import parse_module
from ir.ref import mla as ref_mla
from ir.verifier import VerifyError, verify
from tests.conftest import tiny_model
from tests.test_pass_pipeline import (assert_rewrites, assert_same_numerics, expected_counts, layer_counts, rewritten,
                                      run_pass_on_text)

NAME = "value_gate"

SIG = """(%q_nope: bf16[T,2,4], %q_pe: bf16[T,2,2], %latent: bf16[N,8], %g: bf16[T,8], %req: i64[T], %pos: i64[T],
          %tbl: i32[R,MB]) -> (bf16[T,8])"""
PREFILL = """
  func @prefill""" + SIG + """ attrs {kind="prefill"} {
    %o3 = mla_attention(%q_nope, %q_pe, %latent, @kv_b, %pos, %req, %tbl) {block_size=4, scale=0.4, form="decompressed"}
        : bf16[T,2,4]
    %o = reshape(%o3) {shape=[-1, 8]} : bf16[T,8]
    %s = sigmoid(%g) : bf16[T,8]
    %y = mul(%s, %o) : bf16[T,8]
    return %y
  }
}"""
BEFORE = """module @vg {
  param @kv_b : bf16[16,6] {shard="rep"}
  func @decode""" + SIG + """ attrs {kind="decode"} {
    %o3 = mla_attention(%q_nope, %q_pe, %latent, @kv_b, %pos, %req, %tbl) {block_size=4, scale=0.4} : bf16[T,2,4]
    %o = reshape(%o3) {shape=[-1, 8]} : bf16[T,8]
    %s = sigmoid(%g) : bf16[T,8]
    %y = mul(%s, %o) : bf16[T,8]
    return %y
  }""" + PREFILL
EXPECTED = """module @vg {
  param @kv_b : bf16[16,6] {shard="rep"}
  func @decode""" + SIG + """ attrs {kind="decode"} {
    %o3.latent = mla_attention(%q_nope, %q_pe, %latent, @kv_b, %pos, %req, %tbl) {block_size=4, scale=0.4, form="latent"}
        : bf16[T,2,6]
    %y = fused.value_gate(%o3.latent, @kv_b, %g) {heads=2, nope_dim=4, v_head_dim=4} : bf16[T,8]
        body (%in0: bf16[T,2,6], %in1: bf16[16,6], %in2: bf16[T,8]) {
      %o3 = mla_value_proj(%in0, %in1) {nope_dim=4} : bf16[T,2,4]
      %o = reshape(%o3) {shape=[-1, 8]} : bf16[T,8]
      %s = sigmoid(%in2) : bf16[T,8]
      %y = mul(%s, %o) : bf16[T,8]
      return %y
    }
    return %y
  }""" + PREFILL


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"q_nope": torch.randn(3, 2, 4, generator=g), "q_pe": torch.randn(3, 2, 2, generator=g),
            "latent": torch.randn(16, 8, generator=g), "g": torch.randn(3, 8, generator=g),
            "req": torch.tensor([0, 0, 1]), "pos": torch.tensor([2, 3, 1]), "tbl": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)}


def test_before_expected_and_equal_results():
    m = assert_rewrites(NAME, BEFORE, EXPECTED, 1)  # the decompressed (prefill) attention is left unfused
    weights = {"kv_b": torch.randn(16, 6, generator=torch.Generator().manual_seed(1))}
    for fn in ("decode", "prefill"):
        before = Interpreter(parse_module(BEFORE), weights).run(fn, _inputs())[0]
        after = Interpreter(m, weights).run(fn, _inputs())[0]
        torch.testing.assert_close(after, before, rtol=1e-6, atol=0)
        assert before.abs().sum() > 0


def test_without_a_gate_nothing_changes():
    text = BEFORE.replace("%y = mul(%s, %o) : bf16[T,8]\n    return %y\n  }\n  func @prefill",
                          "%y = add(%s, %o) : bf16[T,8]\n    return %y\n  }\n  func @prefill")
    m, ctx = run_pass_on_text(NAME, text)
    assert ctx.counters[NAME] == 0 and "mla_value_proj" not in m.op_counts()


def test_reference_latent_form_then_value_projection_equals_absorbed():
    a = _inputs(2)
    kv_b = torch.randn(16, 6, dtype=torch.float64)
    args = (a["q_nope"].double(), a["q_pe"].double(), a["latent"].double(), kv_b, a["pos"], a["req"], a["tbl"], 4, 0.4)
    absorbed = ref_mla.mla_attention(*args, None, "absorbed")
    o_latent = ref_mla.mla_attention(*args, None, "latent")
    assert o_latent.shape == (3, 2, 6)
    torch.testing.assert_close(ref_mla.mla_value_proj(o_latent, kv_b, 4), absorbed, rtol=1e-12, atol=0)


def test_value_proj_type_rule():
    bad = EXPECTED.replace("mla_value_proj(%in0, %in1) {nope_dim=4}", "mla_value_proj(%in0, %in1) {nope_dim=8}")
    with pytest.raises(VerifyError, match=r"mla_value_proj: kv_b bf16\[16,6\] is not \[H\*\(dn\+dv\), kv\]"):
        verify(parse_module(bad))


def test_k31_tiny_fires_per_decode_mla_layer_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME)
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 2 * layer_counts(cfg)["mla"]
    assert m.op_counts("prefill").get("fused.value_gate", 0) == 0
    for fn in ("decode", "verify"):
        assert m.op_counts(fn)["fused.value_gate"] == layer_counts(cfg)["mla"]
        assert all(n.attrs["form"] == "latent" for n in m.function(fn).nodes if n.op == "mla_attention")
    assert_same_numerics(m)


def test_kimi_linear_has_no_output_gate():
    assert rewritten("kimi-linear-tiny", NAME)[1].counters[NAME] == 0


def test_dcp_attention_is_fused_too():
    """After shard_dcp the attention is dcp_mla (head-sharded prefill, decode, verify): the same pattern, the
    op returns this rank's o~ (form "latent") and the fused value gate applies W_UV and the gate. Numerics
    under a DCP group: tests/test_parallel_layouts.py::check_value_gate_under_dcp."""
    from k31c.model.build import build_module
    from k31c.parallel.serving import ParallelLayout, shard_module
    from passes import value_gate
    from passes.base import PassContext
    from tests.test_parallel_model import PAR_CFG

    m = shard_module(build_module(PAR_CFG), ParallelLayout(tp=2, dcp=2, ep=2))
    sites = {fn: m.op_counts(fn).get("dcp_mla", 0) for fn in m.functions}
    assert sites["decode"] == sites["prefill"] == 1
    ctx = PassContext()
    assert value_gate.run(m, ctx) == sum(sites.values()) == ctx.counters[NAME]
    for fn, n in sites.items():
        assert m.op_counts(fn).get("fused.value_gate", 0) == n
        assert all(x.attrs["form"] == "latent" for x in m.function(fn).nodes if x.op == "dcp_mla")
    verify(m)
