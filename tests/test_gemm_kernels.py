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
        cfgs = {str(gemm.heuristic(gemm.gemm_bucket(dict(M=m, N=14560, K=7168, x="bf16", w="bf16", gk=0, bi=1)), target))
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


# ---- decode paths: dot-free GEMV tile and deterministic split-K -----------------------------------
def _decode_cfg(m, gemv, split, bk=32, bn=16):
    bm = 1 << max(0, (m - 1).bit_length()) if gemv else 16
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=split, GEMV=gemv, num_warps=4, num_stages=1)


def _weight(kind, n, k, g):
    w = torch.randn(n, k, generator=g) * torch.linspace(0.2, 2.0, n)[:, None]
    if kind == "bf16":
        w = w.to(torch.bfloat16)
        return w, w.double()
    if kind == "fp8":
        f8 = gemm.FP8Weight.quantize(w)
        return f8, f8.dequantize(torch.float64)
    if kind == "fp8-block":
        f8 = gemm.FP8Weight.quantize(w, (16, 32))
        return f8, f8.dequantize(torch.float64)
    return w, w.double()


@pytest.mark.parametrize("gemv,split", [(1, 1), (1, 3), (0, 3)])
@pytest.mark.parametrize("m,xdt,wkind", [(1, torch.float32, "bf16"), (3, torch.float32, "f32"),
                                         (1, torch.bfloat16, "bf16"), (2, torch.float32, "fp8"),
                                         (1, torch.float32, "fp8-block")])
def test_decode_paths_match_float64(gemv, split, m, xdt, wkind):
    """N=37 (ragged against BLOCK_N=16), K=200 (not a multiple of BLOCK_K*SPLIT_K: chunks 96, 96, 8)."""
    g = torch.Generator().manual_seed(100 * gemv + 10 * split + m)
    w, w64 = _weight(wkind, 37, 200, g)
    x = torch.randn(m, 200, generator=g).to(xdt)
    y = gemm.gemm(x, w, _decode_cfg(m, gemv, split))
    assert y.dtype == xdt and y.shape == (m, 37)
    tol = 1e-2 if xdt == torch.bfloat16 else (1e-5 if not wkind.startswith("fp8") else 2e-5)
    assert_close_rel(y, x.double() @ w64.t(), tol, f"GEMV={gemv} SPLIT_K={split} M={m} x {xdt} w {wkind}")


def test_split_k_reduces_chunks_in_fixed_order_bitwise():
    """y == ((P_0 + P_1) + P_2) with P_s the same kernel run on chunk s alone, and identical run to run."""
    g = torch.Generator().manual_seed(31)
    x, w = torch.randn(2, 200, generator=g), torch.randn(37, 200, generator=g)
    cfg = _decode_cfg(2, 1, 3)
    chunk, n_split = gemm.k_chunk(200, cfg["BLOCK_K"], 3)
    assert (chunk, n_split) == (96, 3)
    y1, y2 = gemm.gemm(x, w, cfg), gemm.gemm(x, w, cfg)
    assert torch.equal(y1, y2), "split-K result changed between two runs"
    one = dict(cfg, SPLIT_K=1)
    parts = [gemm.gemm(x[:, lo:lo + chunk], w[:, lo:lo + chunk], one) for lo in range(0, 200, chunk)]
    assert torch.equal(y1, (parts[0] + parts[1]) + parts[2]), "partials not added in split order"
    with pytest.raises(ValueError, match="SPLIT_K >= 1"):
        gemm.k_chunk(200, 32, 0)


def test_decode_packed_linear_and_f64():
    g = torch.Generator().manual_seed(41)
    ws = [torch.randn(n, 96, generator=g) for n in (24, 13)]
    x = torch.randn(1, 96, generator=g)
    cfg = _decode_cfg(1, 1, 2, bn=8)
    got = PACKED.launch(SimpleNamespace(operands=[x, *ws]), {"splits": [24, 13], "batch_invariant": False}, cfg)
    for part, w in zip(got, ws):
        assert_close_rel(part, x.double() @ w.double().t(), 1e-5, "packed GEMV split-K")
    x64, w64 = x.double(), ws[0].double()
    assert gemm.gemm(x64, w64, cfg).dtype == torch.float64
    assert_close_rel(gemm.gemm(x64, w64, cfg), x64 @ w64.t(), 1e-12, "f64 GEMV split-K")


def test_decode_heuristic_configs_and_buckets():
    shapes = [(20480, 7168, "f32"), (112, 7168, "f32"), (3808, 7168, "bf16"), (6284, 7168, "bf16"),
              (7168, 1536, "bf16"), (7168, 3072, "bf16"), (7168, 4224, "bf16"), (112, 16384, "f32")]
    for n, k, xd in shapes:
        for m in (1, 2, 3, 8, 16, 64):
            key = dict(M=m, N=n, K=k, x=xd, w="bf16", gk=0, bi=0)
            cfg = gemm.heuristic(key, "h200")
            assert gemm.constraints(cfg, key, "h200") == [], (key, cfg)
            assert cfg["BLOCK_M"] >= gemm.gemm_bucket(key)["M"], "one M tile covers the whole bucket"
            assert cfg["COMBINE"] == 1, "split-K partials are added in the launch"
            if m == 1:
                assert cfg["GEMV"] == 1 and cfg["BLOCK_M"] == 1, (key, cfg)
            else:
                assert cfg["GEMV"] == 0, "measured: the [M, BLOCK_N, BLOCK_K] GEMV loses to tensor-core tiles at M=8"
            chunks = gemm.k_chunk(k, cfg["BLOCK_K"], cfg["SPLIT_K"])[1]
            tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"]) * chunks
            assert tiles >= 66, f"{key}: {tiles} programs cannot stream the weights at the HBM bandwidth"
    router = gemm.heuristic(dict(M=1, N=112, K=7168, x="f32", w="bf16", gk=0, bi=0), "h200")
    assert (router["BLOCK_N"], router["BLOCK_K"], router["SPLIT_K"]) == (1, 8192, 1), "router: a row per program"
    long_router = gemm.heuristic(dict(M=1, N=112, K=16384, x="f32", w="bf16", gk=0, bi=0), "h200")
    assert long_router["SPLIT_K"] > 1 and long_router["COMBINE"] == 1, "K beyond one tile: split, one launch"
    head = gemm.heuristic(dict(M=1, N=20480, K=7168, x="f32", w="bf16", gk=0, bi=0), "h200")
    assert head["SPLIT_K"] == 1 and head["GEMV"] == 1
    assert gemm.heuristic(dict(M=8, N=112, K=7168, x="f32", w="bf16", gk=0, bi=0), "h200")["SPLIT_K"] > 1
    assert len({gemm.gemm_bucket(dict(M=m, N=1, K=1, x="f32", w="bf16", gk=0, bi=0))["M"] for m in (1, 2, 8, 16)}) == 4


def test_batch_invariant_mode_declines_decode_paths():
    key = dict(M=1, N=112, K=7168, x="f32", w="bf16", gk=0, bi=1)
    cfg = gemm.heuristic(key, "h200")
    assert cfg["GEMV"] == 0 and cfg["SPLIT_K"] == 1
    split = dict(cfg, SPLIT_K=4, GEMV=1, BLOCK_M=1, BLOCK_N=8, BLOCK_K=256)
    assert any("batch-invariant" in p for p in gemm.constraints(split, key, "h200"))
    with pytest.raises(ValueError, match="batch-invariant"):
        LINEAR.launch(SimpleNamespace(x=torch.randn(1, 64), w=torch.randn(8, 64)), {"batch_invariant": True},
                      _decode_cfg(1, 1, 2))


# ---- split-K combined in the same launch (COMBINE=1), pipelined GEMV loops, whole-K tiles -----------
@pytest.mark.parametrize("gemv,m,wkind", [(1, 1, "bf16"), (1, 2, "fp8-block"), (0, 3, "f32"), (0, 1, "fp8")])
def test_in_launch_combine_matches_two_launches_bitwise(gemv, m, wkind):
    """COMBINE=1 (the last split of a tile adds the partials) == COMBINE=0 (a second launch) bit for bit, both
    close to float64, and every tile counter is back at 0 afterwards (ready for the next launch / replay)."""
    from codegen.triton import _gemv

    g = torch.Generator().manual_seed(300 + 10 * gemv + m)
    w, w64 = _weight(wkind, 37, 200, g)
    x = torch.randn(m, 200, generator=g)
    cfg = dict(_decode_cfg(m, gemv, 3), COMBINE=1)
    y = gemm.gemm(x, w, cfg)
    assert torch.equal(y, gemm.gemm(x, w, dict(cfg, COMBINE=0))), "in-launch combine changed the bits"
    assert torch.equal(y, gemm.gemm(x, w, cfg)), "in-launch combine changed between two runs"
    assert all(int(c.abs().sum()) == 0 for c in _gemv._COUNTERS.values()), "a tile counter was left non-zero"
    tol = 1e-5 if not wkind.startswith("fp8") else 2e-5
    assert_close_rel(y, x.double() @ w64.t(), tol, f"COMBINE=1 GEMV={gemv} M={m} w {wkind}")


@pytest.mark.parametrize("bn,bk,stages,split", [(8, 32, 3, 1), (1, 256, 1, 1), (4, 64, 2, 2), (2, 128, 1, 2)])
def test_gemv_pipelined_and_whole_k_tiles(bn, bk, stages, split):
    """K=200: pipelined loops (num_stages > 1 on the GEMV loop), one masked tile wider than K (BLOCK_K=256),
    and splits whose last chunk is partial; f32 x against bf16 weights keeps fp32 accuracy."""
    g = torch.Generator().manual_seed(bn + bk + stages)
    w, w64 = _weight("bf16", 21, 200, g)
    x = torch.randn(1, 200, generator=g)
    cfg = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=split, GEMV=1, COMBINE=int(split > 1),
               num_warps=4, num_stages=stages)
    assert_close_rel(gemm.gemm(x, w, cfg), x.double() @ w64.t(), 1e-5, f"GEMV {cfg}")


def test_tile_counters_per_stream_and_kept_when_outgrown():
    from codegen.triton import _gemv

    dev = torch.device("cpu")
    first = _gemv.tile_counters(dev, 10)
    assert first.dtype == torch.int32 and int(first.abs().sum()) == 0 and _gemv.tile_counters(dev, 10) is first
    bigger = _gemv.tile_counters(dev, first.numel() + 1)
    assert bigger.numel() > first.numel() and any(t is first for t in _gemv._RETIRED), \
        "an outgrown counter set must stay alive (a captured graph may still use it)"
