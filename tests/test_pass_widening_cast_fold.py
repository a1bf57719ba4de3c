"""passes/widening_cast_fold.py and its kernel (codegen/triton/widened_gemm.py): Before/Expected on a
hand-written router (cast + linear), equal results of both graphs in the interpreter, casts left alone
(another reader, a narrowing cast, an f32 source), k31-tiny (counter, verifier, text round trip, numerics
equal to the unfused model), and the fused kernel against the two kernels it replaces (the cast, then the
f32 GEMM with the same config: bitwise) and a float64 formula, for the decode GEMV and the tile path."""

from __future__ import annotations

import pytest
import torch

from codegen.triton.gemm import gemm, heuristic as gemm_heuristic
from codegen.triton.widened_gemm import widened_linear
from ir.interpreter import Interpreter
from ir.parser import parse_module
from tests.conftest import tiny_model
from tests.helpers import assert_close_rel
from tests.test_pass_pipeline import assert_rewrites, assert_same_numerics, layer_counts, rewritten, run_pass_on_text

NAME = "widening_cast_fold"

HEAD = """module @router {
  param @gate : f32[6,4] {shard="rep"}
  func @decode(%h: bf16[T,4]) -> (f32[T,6])
      attrs {kind="decode"} {"""
BEFORE = HEAD + """
    %h32 = cast(%h) {dtype="f32"} : f32[T,4]
    %logits = linear(%h32, @gate) : f32[T,6]
    return %logits
  }
}"""
EXPECTED = HEAD + """
    %logits = fused.widened_linear(%h, @gate) {dtype="f32"} : f32[T,6] body (%in0: bf16[T,4], %in1: f32[6,4]) {
      %h32 = cast(%in0) {dtype="f32"} : f32[T,4]
      %logits = linear(%h32, %in1) : f32[T,6]
      return %logits
    }
    return %logits
  }
}"""


def test_before_expected_and_equal_results():
    m = assert_rewrites(NAME, BEFORE, EXPECTED, 1)
    g = torch.Generator().manual_seed(0)
    weights = {"gate": torch.randn(6, 4, generator=g)}
    h = torch.randn(5, 4, generator=g).to(torch.bfloat16)
    before = Interpreter(parse_module(BEFORE), weights).run("decode", {"h": h})[0]
    after = Interpreter(m, weights).run("decode", {"h": h})[0]
    assert after.dtype == torch.float32 and torch.equal(after, before)


def test_casts_the_gemm_cannot_absorb_are_left_alone():
    read_twice = BEFORE.replace("-> (f32[T,6])", "-> (f32[T,6], f32[T,4])").replace("return %logits\n",
                                                                                  "return %logits, %h32\n")
    from_f32 = BEFORE.replace("%h: bf16[T,4]", "%h: f32[T,4]")
    to_f16 = (BEFORE.replace('{dtype="f32"} : f32[T,4]', '{dtype="f16"} : f16[T,4]')
              .replace("param @gate : f32[6,4]", "param @gate : f16[6,4]").replace("f32[T,6]", "f16[T,6]"))
    for text in (read_twice, from_f32, to_f16):
        m, ctx = run_pass_on_text(NAME, text)
        assert ctx.counters[NAME] == 0 and "fused.widened_linear" not in m.op_counts()


def test_k31_tiny_fires_per_router_and_lm_head_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME)
    assert ctx.counters[NAME] == 3 * (layer_counts(cfg)["moe"] + 1)  # routers + LM head, x 3 entry functions
    assert m.op_counts().get("fused.widened_linear") == ctx.counters[NAME]
    assert_same_numerics(m)


@pytest.mark.parametrize("M, x_dtype, w_dtype", [(1, torch.bfloat16, torch.float32), (1, torch.float16, torch.bfloat16),
                                                 (5, torch.bfloat16, torch.bfloat16), (5, torch.float16, torch.float32)])
def test_kernel_equals_cast_then_gemm_and_float64(M, x_dtype, w_dtype):
    g = torch.Generator().manual_seed(M)
    K, N = 96, 40
    x = (torch.randn(M, K, generator=g) * 3).to(x_dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(w_dtype)
    key = {"M": M, "N": N, "K": K, "x": "f32", "w": "f32", "gk": 0, "bi": 0}
    configs = [gemm_heuristic(key, "cpu")]
    if M == 1:  # the decode GEMV (dot-free, pipelined K loop), also split over K
        configs += [dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=32, GROUP_M=1, SPLIT_K=s, GEMV=1, num_warps=4, num_stages=2)
                    for s in (1, 2)]
    for config in configs:
        fused = widened_linear(x, w, "f32", config)
        unfused = gemm(x.float(), w, config)
        assert fused.dtype == torch.float32 and torch.equal(fused, unfused), (config, (fused - unfused).abs().max())
    assert_close_rel(fused, x.double() @ w.double().T, 1e-5, f"widened GEMM M={M}")


def test_inexact_widenings_are_refused():
    with pytest.raises(ValueError, match="cannot be read exactly"):
        gemm(torch.randn(2, 8), torch.randn(4, 8), gemm_heuristic({"M": 2, "N": 4, "K": 8, "x": "f32", "w": "f32",
                                                                  "gk": 0, "bi": 0}, "cpu"), as_dtype=torch.float16)


def test_the_compiler_selects_the_widened_gemm_for_every_fused_node():
    """supports() runs on symbolic compile-time types: every fused node of k31-tiny gets the kernel."""
    from codegen.select import select_kernels

    m, _ = rewritten("k31-tiny", NAME)
    for target in ("cpu", "h200"):
        picks = [c for c in select_kernels(m, target) if c.op == "fused.widened_linear"]
        assert picks and {c.kernel for c in picks} == {"widened_gemm"}, [(c.kernel, c.reason) for c in picks]
