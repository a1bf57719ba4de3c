"""GEMM kernels (codegen/triton/gemm.py): `linear` and `fused.packed_linear` vs the reference, FP8
weights vs a reference applying the same quantisation, batch invariance, configs and bad input.
CPU: Triton interpreter, fp32, tiny shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from codegen.registry import templates_for
from codegen.triton import gemm
from ir.core import Module
from ir.interpreter import Interpreter
from k31c.model.build import build_module
from k31c.model.presets import get_preset
from passes import packed_projection
from passes.base import PassContext
from tests.helpers import assert_close_rel

LINEAR = next(t for t in templates_for("linear") if t.family == "gemm")
PACKED = next(t for t in templates_for("fused.packed_linear") if t.family == "packed_gemm")


def _run(t, a, attrs, target="cpu"):
    return t.launch(a, attrs, t.heuristic(t.key_dims(a, attrs), target))


@pytest.mark.parametrize("shape,n", [((6, 96), 100), ((2, 3, 72), 40)])
def test_linear_matches_reference(shape, n):
    g = torch.Generator().manual_seed(sum(shape) + n)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(n, shape[-1], generator=g)
    y = _run(LINEAR, SimpleNamespace(x=x, w=w), {"batch_invariant": False})
    assert y.shape == (*shape[:-1], n) and y.dtype == x.dtype
    assert_close_rel(y, x.double() @ w.double().t(), 1e-5, "linear fp32")


def test_linear_strided_input_and_odd_config():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 160, generator=g)[:, 16:112]  # a strided view, K = 96
    w = torch.randn(50, 96, generator=g)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=1)
    assert_close_rel(gemm.gemm(x, w, cfg), x.double() @ w.double().t(), 1e-5, "strided x, K % BLOCK_K != 0")


@pytest.mark.parametrize("block", [None, (16, 32)])
def test_fp8_weights_match_same_quantisation(block):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 128, generator=g)
    w = torch.randn(72, 128, generator=g) * torch.linspace(0.1, 3.0, 72)[:, None]
    f8 = gemm.FP8Weight.quantize(w, block)
    y = _run(LINEAR, SimpleNamespace(x=x, w=f8), {"batch_invariant": False})
    assert_close_rel(y, x.double() @ f8.dequantize(torch.float64).t(), 2e-2, f"fp8 block={block}")
    assert_close_rel(y, x.double() @ w.double().t(), 0.1, "fp8 close to the unquantised weight")


def _packed_node():
    m = build_module(get_preset("k31-tiny"))
    assert packed_projection.run(m, PassContext()) > 0
    return next(n for n in m.function("decode").nodes if n.op == "fused.packed_linear" and len(n.inputs) > 5)


def test_packed_linear_matches_its_body():
    node = _packed_node()
    g = torch.Generator().manual_seed(5)
    rows = 6
    ops = [torch.randn(*[rows if not d.is_number else int(d) for d in v.type.shape], generator=g) for v in node.inputs]
    want = Interpreter(Module("body"), {}).run(node.body, ops)
    got = _run(PACKED, SimpleNamespace(operands=ops), {**node.attrs, "batch_invariant": False})
    assert len(got) == len(want) == len(node.attrs["splits"])
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, 1e-5, f"packed result {i}")


def test_packed_weights_are_concatenated_once():
    g = torch.Generator().manual_seed(6)
    ws = [torch.randn(n, 64, generator=g) for n in (24, 8, 40)]
    p1 = gemm.packed_weight(ws)
    assert gemm.packed_weight(ws) is p1, "second call must hit the cache"
    ws[1].mul_(2.0)  # in-place update (e.g. a LoRA merge): the cache must notice
    p2 = gemm.packed_weight(ws)
    assert p2 is not p1 and torch.equal(p2[24:32], ws[1])
    fp8 = [gemm.FP8Weight.quantize(w) for w in ws]
    pf = gemm.packed_weight(fp8)
    assert pf.q.shape == (72, 64) and pf.scale.shape == (72,)
    blocked = gemm.packed_weight([gemm.FP8Weight.quantize(w, (16, 32)) for w in ws])  # 24 rows: a partial block
    assert blocked.block == (1, 32) and torch.equal(blocked.dequantize(),
                                                    torch.cat([gemm.FP8Weight.quantize(w, (16, 32)).dequantize()
                                                               for w in ws]))
    x = torch.randn(3, 64, generator=g)
    y = gemm.gemm(x, blocked, gemm.heuristic(dict(M=3, N=72, K=64, x="f32", w="f8e4m3", gk=32, bi=0), "cpu"))
    assert_close_rel(y, x.double() @ blocked.dequantize(torch.float64).t(), 2e-2, "fp8 per-row block scales")
    with pytest.raises(ValueError, match="mix FP8 and plain"):
        gemm.packed_weight([ws[0], fp8[1]])


@pytest.mark.parametrize("which", ["linear", "packed"])
def test_batch_invariant_row_alone_equals_row_in_batch(which):
    g = torch.Generator().manual_seed(21)
    ws = [torch.randn(n, 80, generator=g) for n in (48, 16)]
    batch = torch.randn(6, 80, generator=g)
    attrs = {"batch_invariant": True, "splits": [48, 16]}

    def run(x):
        if which == "linear":
            return _run(LINEAR, SimpleNamespace(x=x, w=ws[0]), attrs)
        return torch.cat(_run(PACKED, SimpleNamespace(operands=[x, *ws]), attrs), dim=1)

    together = run(batch)
    for r in (0, 3, 5):
        assert torch.equal(run(batch[r:r + 1].clone()), together[r:r + 1]), f"row {r} differs alone vs in batch"


def test_batch_invariant_config_ignores_batch_size():
    for target in ("cpu", "h200"):
        cfgs = {str(gemm.heuristic(gemm._bucket(dict(M=m, N=14560, K=7168, x="bf16", w="bf16", gk=0, bi=1)), target))
                for m in (1, 6, 64, 4096)}
        assert len(cfgs) == 1, f"{target}: batch-invariant configs depend on M: {cfgs}"


def test_heuristic_configs_fit_shared_memory():
    for x, w in (("bf16", "bf16"), ("f32", "bf16"), ("f32", "f32"), ("bf16", "f8e4m3")):
        for m in (1, 8, 64, 4096):
            key = dict(M=m, N=49376, K=7168, x=x, w=w, bi=0)
            cfg = gemm.heuristic(key, "h200")
            assert gemm.constraints(cfg, key, "h200") == [], (key, cfg)
    big = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=5)
    assert any("shared memory" in p for p in gemm.constraints(big, dict(M=4096, N=1, K=1, x="bf16", w="bf16", bi=0),
                                                             "h200"))


def test_dot_numerics_per_operand_dtypes():
    import triton.language as tl

    assert gemm.dot_numerics(torch.bfloat16, torch.bfloat16, interpret=True)["DOT_DTYPE"] == tl.float32
    assert gemm.dot_numerics(torch.bfloat16, torch.bfloat16, interpret=False)["DOT_DTYPE"] == tl.bfloat16
    assert gemm.dot_numerics(torch.bfloat16, torch.float8_e4m3fn, interpret=False)["DOT_DTYPE"] == tl.bfloat16
    logits = gemm.dot_numerics(torch.float32, torch.bfloat16, interpret=False)
    assert logits["DOT_DTYPE"] == tl.bfloat16 and logits["X_SPLITS"] == 3
    assert gemm.dot_numerics(torch.float32, torch.float32, interpret=False, backend="cuda")["PRECISION"] == "tf32x3"
    # AMD (gfx950) accepts only ieee / bf16x3 / bf16x6: no TF32 spelling may reach its compiler
    for x, w in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)):
        assert gemm.dot_numerics(x, w, interpret=False, backend="hip")["PRECISION"] == "ieee", (x, w)


def test_supports_and_bad_input():
    from ir.core import TensorType

    x = TensorType.of("bf16", ("B", 256))
    assert LINEAR.supports(SimpleNamespace(x=x, w=TensorType.of("bf16", (64, 256))), {}, "h200") is None
    why = LINEAR.supports(SimpleNamespace(x=x, w=TensorType.of("mxfp4", (64, 256))), {}, "h200")
    assert why and "mxfp4" in why
    with pytest.raises(ValueError, match="does not match input"):
        gemm.gemm(torch.randn(2, 8), torch.randn(4, 6), gemm.heuristic(dict(M=2, N=4, K=8, x="f32", w="f32", bi=0), "cpu"))
    with pytest.raises(ValueError, match="splits"):
        PACKED.launch(SimpleNamespace(operands=[torch.randn(2, 8), torch.randn(4, 8)]), {"splits": [5]},
                      gemm.heuristic(dict(M=2, N=4, K=8, x="f32", w="f32", bi=0), "cpu"))
    with pytest.raises(ValueError, match="BLOCK_K"):
        f8 = gemm.FP8Weight.quantize(torch.randn(8, 64), (8, 32))
        gemm.gemm(torch.randn(2, 64), f8, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4,
                                                num_stages=1))
