"""passes/router_epilogue.py and its kernel (codegen/triton/routed_gemm.py): Before/Expected on a hand-written
router (widened logits GEMM + router, and a plain linear without bias), equal results of both graphs in the
interpreter, logits read elsewhere left alone, k31-tiny (counter, verifier, text round trip, numerics equal
to the unfused model), and the fused kernel against the two kernels it replaces (the GEMM, then the router,
same configs: ids and top-2 weights bitwise) and a float64 formula, for the decode GEMV (also split over K),
the tile path, a grouped softmax router and the prefill fallback (interpreter, fp32)."""

from __future__ import annotations

import pytest
import torch

from codegen.triton.gemm import gemm, heuristic as gemm_heuristic
from codegen.triton.moe_router import router
from codegen.triton.routed_gemm import ROUTE_MAX_M, routed_linear
from ir.ref.moe import moe_router as router_ref
from tests.conftest import tiny_model
from tests.helpers import assert_close_rel
from tests.test_pass_pipeline import (assert_equal_results, assert_rewrites, assert_same_numerics, layer_counts,
                                      rewritten, run_pass_on_text)

NAME = "router_epilogue"
ATTRS = 'topk=2, activation="sigmoid", renormalize=true, scaling=2.5, n_group=1, topk_group=1'
HEAD = """module @moe {
  param @gate : f32[6,4] {shard="rep"}
  param @bias : f32[6] {shard="rep"}
  func @decode(%h: bf16[T,4]) -> (f32[T,2], i64[T,2])
      attrs {kind="decode"} {"""
BEFORE = HEAD + """
    %logits = fused.widened_linear(%h, @gate) {dtype="f32"} : f32[T,6] body (%in0: bf16[T,4], %in1: f32[6,4]) {
      %h32 = cast(%in0) {dtype="f32"} : f32[T,4]
      %logits = linear(%h32, %in1) : f32[T,6]
      return %logits
    }
    %w, %ids = moe_router(%logits, @bias) {""" + ATTRS + """} : f32[T,2], i64[T,2]
    return %w, %ids
  }
}"""
EXPECTED = HEAD + """
    %w, %ids = fused.routed_linear(%h, @gate, @bias) {""" + ATTRS + """, x_dtype="f32"} : f32[T,2], i64[T,2]
        body (%in0: bf16[T,4], %in1: f32[6,4], %in2: f32[6]) {
      %logits = fused.widened_linear(%in0, %in1) {dtype="f32"} : f32[T,6] body (%in0: bf16[T,4], %in1: f32[6,4]) {
        %h32 = cast(%in0) {dtype="f32"} : f32[T,4]
        %logits = linear(%h32, %in1) : f32[T,6]
        return %logits
      }
      %w, %ids = moe_router(%logits, %in2) {""" + ATTRS + """} : f32[T,2], i64[T,2]
      return %w, %ids
    }
    return %w, %ids
  }
}"""
PLAIN = """module @moe {
  param @gate : f32[6,4] {shard="rep"}
  func @decode(%x: f32[T,4]) -> (f32[T,2], i64[T,2])
      attrs {kind="decode"} {
    %logits = linear(%x, @gate) : f32[T,6]
    %w, %ids = moe_router(%logits) {""" + ATTRS + """} : f32[T,2], i64[T,2]
    return %w, %ids
  }
}"""


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(6, 4, generator=g), "bias": torch.randn(6, generator=g) * 0.1}


def test_before_expected_and_equal_results():
    m = assert_rewrites(NAME, BEFORE, EXPECTED, 1)
    h = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert_equal_results(BEFORE, m, _weights(), {"h": h})


def test_a_plain_linear_without_bias_is_fused_and_shared_logits_are_left_alone():
    m, ctx = run_pass_on_text(NAME, PLAIN)
    assert ctx.counters[NAME] == 1 and m.op_counts().get("fused.routed_linear") == 1
    assert "x_dtype" not in str(m.op_counts())
    shared = PLAIN.replace("-> (f32[T,2], i64[T,2])", "-> (f32[T,2], i64[T,2], f32[T,6])").replace(
        "return %w, %ids\n", "return %w, %ids, %logits\n")
    m, ctx = run_pass_on_text(NAME, shared)
    assert ctx.counters[NAME] == 0 and "fused.routed_linear" not in m.op_counts()


def test_k31_tiny_fires_per_moe_layer_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", "widening_cast_fold", NAME)
    assert ctx.counters[NAME] == 3 * layer_counts(cfg)["moe"] > 0  # x 3 entry functions
    assert m.op_counts().get("fused.routed_linear") == ctx.counters[NAME]
    assert_same_numerics(m)


def _unfused(x, w, bias, attrs, config):
    logits = gemm(x, w, config, as_dtype=torch.float32 if attrs.get("x_dtype") else None)
    return router(logits, bias, attrs["topk"], attrs["activation"], attrs["renormalize"], attrs["scaling"],
                  attrs["n_group"], attrs["topk_group"])


GEMV = dict(BLOCK_M=1, BLOCK_K=32, GROUP_M=1, GEMV=1, num_warps=4, num_stages=2)
CASES = [  # (M, E, x dtype, router attrs, config overrides)
    (1, 24, torch.bfloat16, dict(topk=2, activation="sigmoid", n_group=1, topk_group=1), dict(GEMV, BLOCK_N=1)),
    (1, 24, torch.bfloat16, dict(topk=2, activation="sigmoid", n_group=1, topk_group=1),
     dict(GEMV, BLOCK_N=8, SPLIT_K=2)),
    (5, 24, torch.float32, dict(topk=2, activation="sigmoid", n_group=1, topk_group=1), None),
    (3, 32, torch.float32, dict(topk=4, activation="softmax", n_group=4, topk_group=2), dict(GEMV, BLOCK_M=4,
                                                                                           BLOCK_N=8)),
    (ROUTE_MAX_M + 6, 24, torch.bfloat16, dict(topk=2, activation="sigmoid", n_group=1, topk_group=1), None),
]


@pytest.mark.parametrize("M, E, x_dtype, route, over", CASES)
def test_kernel_equals_gemm_then_router_and_float64(M, E, x_dtype, route, over):
    g = torch.Generator().manual_seed(M + E)
    K = 96
    x = torch.randn(M, K, generator=g).to(x_dtype)
    w = torch.randn(E, K, generator=g) / K ** 0.5
    bias = torch.randn(E, generator=g) * 0.05
    attrs = dict(route, renormalize=True, scaling=2.5, **({"x_dtype": "f32"} if x_dtype != torch.float32 else {}))
    key = {"M": M, "N": E, "K": K, "x": "f32", "w": "f32", "gk": 0, "bi": 0}
    config = {**gemm_heuristic(key, "cpu"), "GROUP_M": 1, "SPLIT_K": 1, **(over or {})}
    wf, idf = routed_linear(x, w, bias, attrs, config)
    wu, idu = _unfused(x, w, bias, attrs, config)
    assert torch.equal(idf, idu), (idf, idu)
    if route["topk"] == 2:
        assert torch.equal(wf, wu)
    else:
        assert_close_rel(wf, wu, 1e-6, "routed weights vs unfused")
    logits64 = x.double() @ w.double().T
    w64, id64 = router_ref(logits64, bias.double(), route["topk"], route["activation"], True, 2.5,
                           route["n_group"], route["topk_group"])
    assert torch.equal(idf, id64), "ids vs float64 (random logits: no near-ties)"
    assert_close_rel(wf, w64, 1e-5, "routed weights vs float64")


def test_bad_shapes_are_refused():
    attrs = dict(topk=2, activation="sigmoid", renormalize=True, scaling=1.0, n_group=1, topk_group=1)
    cfg = dict(GEMV, BLOCK_N=1, SPLIT_K=1)
    with pytest.raises(ValueError, match="do not match"):
        routed_linear(torch.randn(1, 8), torch.randn(6, 9), None, attrs, cfg)
    with pytest.raises(ValueError, match="expert lanes"):
        routed_linear(torch.randn(1, 8), torch.randn(6, 8), None, attrs, dict(cfg, BLOCK_M=8192))


def test_the_compiler_selects_the_routed_gemm_for_every_fused_node():
    """supports() runs on symbolic compile-time types: every fused node of k31-tiny gets the kernel."""
    from codegen.select import select_kernels

    m, _ = rewritten("k31-tiny", "widening_cast_fold", NAME)
    for target in ("cpu", "h200"):
        picks = [c for c in select_kernels(m, target) if c.op == "fused.routed_linear"]
        assert picks and {c.kernel for c in picks} == {"routed_gemm"}, [(c.kernel, c.reason) for c in picks]
