"""passes/latent_moe_tail.py: Before/Expected on a hand-written LatentMoE tail, equal results of both
graphs in the interpreter, the norm-weight folding the docstring promises kernels, graphs left unfused,
and on k31-tiny the counter, the verifier, the text round trip and numerics equal to the unfused model."""

from __future__ import annotations

import torch

from ir.interpreter import Interpreter
from ir.parser import parse_module
from ir.ref.basic import rms_norm
from tests.conftest import tiny_model
from tests.test_pass_pipeline import (assert_rewrites, assert_same_numerics, expected_counts, layer_counts, rewritten,
                                      run_pass_on_text)

NAME = "latent_moe_tail"

HEAD = """module @moe {
  param @w1 : bf16[3,5,4] {shard="rep"}
  param @w2 : bf16[3,4,5] {shard="rep"}
  param @w3 : bf16[3,5,4] {shard="rep"}
  param @norm : bf16[4] {shard="rep"}
  param @up : bf16[6,4] {shard="rep"}
  func @decode(%z: bf16[T,4], %weights: f32[T,2], %ids: i64[T,2], %shared: bf16[T,6]) -> (bf16[T,6])
      attrs {kind="decode"} {
    %y = moe_experts(%z, %weights, %ids, @w1, @w2, @w3) {act="situ", beta1=4.0, beta2=25.0} : f32[T,4]"""
BEFORE = HEAD + """
    %yn = rms_norm(%y, @norm) {eps=1e-05} : f32[T,4]
    %yc = cast(%yn) {dtype="bf16"} : bf16[T,4]
    %yu = linear(%yc, @up) : bf16[T,6]
    %out = add(%shared, %yu) : bf16[T,6]
    return %out
  }
}"""
EXPECTED = HEAD + """
    %out = fused.latent_moe_tail(%y, @norm, @up, %shared) {eps=1e-05, dtype="bf16"} : bf16[T,6]
        body (%in0: f32[T,4], %in1: bf16[4], %in2: bf16[6,4], %in3: bf16[T,6]) {
      %yn = rms_norm(%in0, %in1) {eps=1e-05} : f32[T,4]
      %yc = cast(%yn) {dtype="bf16"} : bf16[T,4]
      %yu = linear(%yc, %in2) : bf16[T,6]
      %out = add(%in3, %yu) : bf16[T,6]
      return %out
    }
    return %out
  }
}"""


def test_before_expected_and_equal_results():
    m = assert_rewrites(NAME, BEFORE, EXPECTED, 1)
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(*s, generator=g) for n, s in
               {"w1": (3, 5, 4), "w2": (3, 4, 5), "w3": (3, 5, 4), "norm": (4,), "up": (6, 4)}.items()}
    inputs = {"z": torch.randn(5, 4, generator=g), "weights": torch.rand(5, 2, generator=g),
              "ids": torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0]]), "shared": torch.randn(5, 6, generator=g)}
    before = Interpreter(parse_module(BEFORE), weights).run("decode", inputs)[0]
    assert torch.equal(Interpreter(m, weights).run("decode", inputs)[0], before)


def test_norm_weight_folds_into_the_up_projection():
    """w_up (rmsnorm(y) * w) == (w_up diag(w)) (y / rms(y)): what a kernel may precompute."""
    g = torch.Generator().manual_seed(1)
    y, w, up = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, 4), (4,), (6, 4)))
    folded = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)) @ (up * w).t()
    torch.testing.assert_close(rms_norm(y, w, 1e-5) @ up.t(), folded, rtol=1e-12, atol=1e-12)


def test_without_latent_norm_or_shared_add_nothing_changes():
    no_norm = BEFORE.replace("%yn = rms_norm(%y, @norm) {eps=1e-05} : f32[T,4]\n", "").replace("cast(%yn)", "cast(%y)")
    no_add = BEFORE.replace("%out = add(%shared, %yu)", "%out = mul(%shared, %yu)")
    for text in (no_norm, no_add):
        m, ctx = run_pass_on_text(NAME, text)
        assert ctx.counters[NAME] == 0 and "fused.latent_moe_tail" not in m.op_counts()


def test_k31_tiny_fires_per_moe_layer_and_keeps_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME)
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 3 * layer_counts(cfg)["moe"]
    assert m.op_counts().get("fused.latent_moe_tail") == ctx.counters[NAME]
    assert_same_numerics(m)


def test_kimi_linear_has_no_latent_path():
    assert rewritten("kimi-linear-tiny", NAME)[1].counters[NAME] == 0
