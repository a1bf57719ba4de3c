"""passes/glu_epilogue.py and its kernel (codegen/triton/packed_glu.py): Before/Expected on a hand-written
FFN (gate and up moved behind the plain output), equal results of both graphs in the interpreter, graphs
left alone, k31-tiny (counter, verifier, text round trip, numerics equal to the unfused model), and the
fused kernel against the unfused kernels it replaces (packed GEMM + activation, same config: bitwise) and
a float64 formula, for the decode GEMV and the tile path (interpreter, fp32)."""

from __future__ import annotations

import pytest
import torch

from codegen.triton.gemm import gemm, heuristic as gemm_heuristic, packed_weight
from codegen.triton.glu import binary
from codegen.triton.packed_glu import packed_linear_glu
from ir.ref.basic import situ_glu as situ_ref
from tests.conftest import tiny_model
from tests.helpers import assert_close_rel
from tests.test_pass_pipeline import (assert_equal_results, assert_rewrites, assert_same_numerics, layer_counts,
                                      rewritten, run_pass_on_text)

NAME = "glu_epilogue"

HEAD = """module @ffn {
  param @wz : f32[3,4] {shard="rep"}
  param @wg : f32[5,4] {shard="rep"}
  param @wu : f32[5,4] {shard="rep"}
  func @decode(%x: f32[T,4]) -> (f32[T,3], f32[T,5])
      attrs {kind="decode"} {"""
BEFORE = HEAD + """
    %g, %z, %u = fused.packed_linear(%x, @wg, @wz, @wu) {splits=[5, 3, 5]} : f32[T,5], f32[T,3], f32[T,5]
        body (%in0: f32[T,4], %in1: f32[5,4], %in2: f32[3,4], %in3: f32[5,4]) {
      %g = linear(%in0, %in1) : f32[T,5]
      %z = linear(%in0, %in2) : f32[T,3]
      %u = linear(%in0, %in3) : f32[T,5]
      return %g, %z, %u
    }
    %a = situ_glu(%g, %u) {beta1=4.0, beta2=25.0} : f32[T,5]
    return %z, %a
  }
}"""
EXPECTED = HEAD + """
    %z, %a = fused.packed_linear_glu(%x, @wz, @wg, @wu) {splits=[3, 5, 5], act="situ_glu", beta1=4.0, beta2=25.0}
        : f32[T,3], f32[T,5] body (%in0: f32[T,4], %in1: f32[3,4], %in2: f32[5,4], %in3: f32[5,4]) {
      %g, %z, %u = fused.packed_linear(%in0, %in2, %in1, %in3) {splits=[5, 3, 5]} : f32[T,5], f32[T,3], f32[T,5]
          body (%in0: f32[T,4], %in1: f32[5,4], %in2: f32[3,4], %in3: f32[5,4]) {
        %g = linear(%in0, %in1) : f32[T,5]
        %z = linear(%in0, %in2) : f32[T,3]
        %u = linear(%in0, %in3) : f32[T,5]
        return %g, %z, %u
      }
      %a = situ_glu(%g, %u) {beta1=4.0, beta2=25.0} : f32[T,5]
      return %z, %a
    }
    return %z, %a
  }
}"""


def test_before_expected_and_equal_results():
    m = assert_rewrites(NAME, BEFORE, EXPECTED, 1)
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(*s, generator=g) for n, s in {"wz": (3, 4), "wg": (5, 4), "wu": (5, 4)}.items()}
    assert_equal_results(BEFORE, m, weights, {"x": torch.randn(6, 4, generator=g)})


def test_shared_operands_or_other_readers_are_left_alone():
    gate_read_twice = BEFORE.replace("return %z, %a", "return %z, %g")
    same_operand = BEFORE.replace("situ_glu(%g, %u)", "situ_glu(%g, %g)")
    for text in (gate_read_twice, same_operand):
        m, ctx = run_pass_on_text(NAME, text)
        assert ctx.counters[NAME] == 0 and "fused.packed_linear_glu" not in m.op_counts()


def test_k31_tiny_fires_per_ffn_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME)
    assert ctx.counters[NAME] == 3 * cfg.num_hidden_layers  # dense MLP or shared expert, x 3 entry functions
    assert layer_counts(cfg)["moe"] > 0  # both forms (with the latent z beside gate/up, and without) occur
    assert m.op_counts().get("fused.packed_linear_glu") == ctx.counters[NAME]
    assert_same_numerics(m)


def _unfused(x, ws, splits, config, act, beta1, beta2):
    """The two kernels the fusion replaces: the packed GEMM (same config), then the activation."""
    y = gemm(x, packed_weight(ws), config)
    parts = torch.split(y, splits, dim=1)
    return (*parts[:-2], binary(act, parts[-2], parts[-1], {"BLOCK_R": 4, "BLOCK_C": 256, "num_warps": 4},
                                beta1, beta2))


@pytest.mark.parametrize("M, plain, act", [(1, [24], "situ_glu"), (5, [24, 8], "situ_glu"), (5, [], "swiglu")])
def test_kernel_equals_the_unfused_kernels_and_float64(M, plain, act):
    g = torch.Generator().manual_seed(M + len(plain))
    K, I = 96, 40  # I is not a multiple of a pair tile, the plain rows not of BLOCK_N
    ws = [torch.randn(n, K, generator=g) / K ** 0.5 for n in (*plain, I, I)]
    x = torch.randn(M, K, generator=g) * 3
    splits = [*plain, I, I]
    key = {"M": M, "N": sum(splits), "K": K, "x": "f32", "w": "f32", "gk": 0, "bi": 0}
    beta1, beta2 = (4.0, 25.0) if act == "situ_glu" else (None, None)
    configs = [dict(gemm_heuristic(key, "cpu"), SPLIT_K=1)]
    if M == 1:  # the decode GEMV (dot-free, pipelined K loop)
        configs.append(dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=32, GROUP_M=1, SPLIT_K=1, GEMV=1, num_warps=4,
                            num_stages=2))
    for config in configs:
        fused = packed_linear_glu(x, ws, splits, act, config, beta1, beta2)
        unfused = _unfused(x, ws, splits, config, act, beta1, beta2)
        assert len(fused) == len(unfused) == len(plain) + 1
        for f, u in zip(fused, unfused):
            if config["GEMV"]:  # elementwise products and sums in a fixed order: the same bits
                assert torch.equal(f, u), (config, (f - u).abs().max())
            else:  # the interpreter's tl.dot is numpy's matmul, whose rounding of a column can depend on where the
                # column sits in the tile (seen on an AMD EPYC host); on a GPU the two tiles' dots are the same
                assert_close_rel(f, u, 1e-6, f"fused vs unfused dot tiles {config}")
    x64, w64 = x.double(), [w.double() for w in ws]
    gate, up = x64 @ w64[-2].T, x64 @ w64[-1].T
    ref = situ_ref(gate, up, beta1, beta2) if act == "situ_glu" else torch.nn.functional.silu(gate) * up
    assert_close_rel(fused[-1], ref, 1e-5, f"{act} M={M}")
    for f, w in zip(fused[:-1], w64):
        assert_close_rel(f, x64 @ w.T, 1e-5, "plain output")


def test_bad_splits_and_configs_are_refused():
    ws = [torch.randn(6, 8), torch.randn(5, 8), torch.randn(4, 8)]
    with pytest.raises(ValueError, match="gate and up of equal rows"):
        packed_linear_glu(torch.randn(2, 8), ws, [6, 5, 4], "situ_glu", {"BLOCK_N": 4}, 4.0)
    with pytest.raises(ValueError, match="SPLIT_K=1"):
        packed_linear_glu(torch.randn(2, 8), ws[:1] + [ws[2], ws[2]], [6, 4, 4], "swiglu", {"BLOCK_N": 4, "SPLIT_K": 2})
