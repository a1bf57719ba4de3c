"""TVM GEMM and row-norm kernels (codegen/tvm/gemm.py, norms.py) vs the op references and float64
formulas: float and MXFP4 weights (dequantised in the kernel), packed projections, rms_norm, the AttnRes
mix and its fused prefix-add + RMSNorm form; every declared tunable value compiles and agrees; a row's
result does not depend on the batch it runs in; misaligned views (packed GEMM outputs) are accepted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("tvm", reason="apache-tvm is a test extra; the TVM backend needs it")

from codegen.tvm import gemm as G  # noqa: E402
from codegen.tvm import gemm_mxfp4 as GX  # noqa: E402
from codegen.tvm import norms as N  # noqa: E402
from ir.core import TensorType  # noqa: E402
from ir.formats import quantize_mxfp4  # noqa: E402
from ir.ops import OPS  # noqa: E402
from ir.packed import PackedMXFP4  # noqa: E402
from tests.helpers import assert_close_rel  # noqa: E402

TPL = {t.family: t for t in G.TEMPLATES + GX.TEMPLATES + N.TEMPLATES}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _run(t, a, attrs, config=None):
    key = t.key_dims(a, attrs)
    cfg = config or t.heuristic(key, "cpu")
    assert t.constraints(cfg, key, "cpu") == [], (cfg, key)
    return t.launch(a, attrs, cfg)


def _one_at_a_time(t, base: dict):
    """The base config, then each declared value of each tunable changed alone (legal ones)."""
    out = [dict(base)]
    for tun in t.tunables:
        out += [{**base, tun.name: v} for v in tun.values if v != base[tun.name]]
    return out


# ---- GEMM ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,n", [((1, 64), 96), ((5, 96), 40), ((2, 3, 64), 24)])
def test_linear_float_weights(shape, n):
    g = _gen(sum(shape) + n)
    x, w = torch.randn(*shape, generator=g), torch.randn(n, shape[-1], generator=g)
    a = OPS["linear"].bind([x, w])
    y = _run(TPL["tvm_gemm"], a, {})
    assert y.shape == (*shape[:-1], n) and y.dtype == x.dtype
    assert_close_rel(y, x.double() @ w.double().t(), 2e-6, "linear vs float64")
    assert_close_rel(y, OPS["linear"].reference(a, {}), 2e-6, "linear vs OpDef.reference")


@pytest.mark.parametrize("m,n,k,sweep", [(1, 16, 64, False), (6, 24, 96, True)])
def test_linear_mxfp4_weights_dequantised_in_kernel(m, n, k, sweep):
    g = _gen(m * n + k)
    x = torch.randn(m, k, generator=g)
    packed, scales = quantize_mxfp4(torch.randn(n, k, generator=g) * 3)
    scales[0, 0], scales[1, -1] = 0, 200  # the subnormal 2^-127 and a large scale
    w = PackedMXFP4(packed, scales)
    t = TPL["tvm_gemm_mxfp4"]
    y = _run(t, SimpleNamespace(x=x, w=w), {})
    want = x.double() @ w.dequantize(torch.float64).t()
    assert_close_rel(y, want, 2e-6, "MXFP4 linear vs float64 of the dequantised weight")
    if sweep:  # every declared value of every tunable compiles and agrees
        seen = {tun.name: set() for tun in t.tunables}
        for cfg in _one_at_a_time(t, {"BM": 2, "BN": 4, "VB": 8, "UNROLL": 1, "PAR": 1}):
            assert t.constraints(cfg, {"N": n, "K": k}, "cpu") == []
            assert_close_rel(GX.gemm_mxfp4(x, w, cfg), want, 2e-6, f"MXFP4 config {cfg}")
            for key, v in cfg.items():
                seen[key].add(v)
        assert all(seen[tun.name] == set(tun.values) for tun in t.tunables)


def test_every_gemm_config_value_compiles_and_agrees():
    g = _gen(3)
    x, w = torch.randn(7, 32, generator=g), torch.randn(40, 32, generator=g)
    want = x.double() @ w.double().t()
    t = TPL["tvm_gemm"]
    seen = {tun.name: set() for tun in t.tunables}
    for cfg in _one_at_a_time(t, {"BM": 2, "BN": 32, "UNROLL": 0, "PAR": 1}):
        assert t.constraints(cfg, {"N": 40, "K": 32}, "cpu") == []
        assert_close_rel(G.gemm(x, [w], cfg), want, 2e-6, f"config {cfg}")
        for k, v in cfg.items():
            seen[k].add(v)
    assert all(seen[tun.name] == set(tun.values) for tun in t.tunables)
    assert TPL["tvm_gemm_mxfp4"].constraints({"BM": 4, "BN": 8, "VB": 16, "UNROLL": 1, "PAR": 1},
                                             {"N": 12, "K": 40}, "cpu") == [
        "BN=8 does not divide N=12", "VB=16 must divide the 16 bytes of an MXFP4 block, and 32 must divide K=40",
        "BM*BN=32 accumulator vectors exceed 16 registers"]


def test_row_result_does_not_depend_on_the_batch():
    """The heuristic changes BM with M, but a row's reduction order depends on K and VEC only."""
    g = _gen(4)
    x, w = torch.randn(9, 64, generator=g), torch.randn(16, 64, generator=g)
    alone = _run(TPL["tvm_gemm"], SimpleNamespace(x=x[:1], w=w), {})
    batch = _run(TPL["tvm_gemm"], SimpleNamespace(x=x, w=w), {})
    assert torch.equal(alone[0], batch[0])


def test_packed_linear_and_misaligned_views():
    g = _gen(5)
    x = torch.randn(3, 64, generator=g)
    ws = [torch.randn(n, 64, generator=g) for n in (16, 8, 40)]
    a = SimpleNamespace(operands=[x, *ws])
    ys = _run(TPL["tvm_packed_gemm"], a, {"splits": [16, 8, 40]})
    for y, w in zip(ys, ws):
        assert_close_rel(y, x.double() @ w.double().t(), 2e-6, "packed part")
    # a column split of a packed output, one row: contiguous but its data starts mid-row (not 64-B aligned)
    view, w2 = ys[2][:1], torch.randn(8, 40, generator=g)
    assert view.is_contiguous() and view.data_ptr() % 64
    y = _run(TPL["tvm_gemm"], SimpleNamespace(x=view, w=w2), {})
    assert_close_rel(y, view.double() @ w2.double().t(), 2e-6, "misaligned input")


def test_gemm_supports(monkeypatch):
    monkeypatch.setenv("K31C_TVM", "all")
    t = TPL["tvm_gemm"]
    x, w = TensorType.of("bf16", ("B", 256)), TensorType.of("bf16", (512, 256))
    assert t.supports(OPS["linear"].bind([x, w]), {}, "cpu") is None
    mx = OPS["linear"].bind([x, TensorType.of("mxfp4", (512, 256))])
    assert "tvm_gemm_mxfp4" in t.supports(mx, {}, "cpu") and TPL["tvm_gemm_mxfp4"].supports(mx, {}, "cpu") is None
    assert "not mxfp4" in TPL["tvm_gemm_mxfp4"].supports(OPS["linear"].bind([x, w]), {}, "cpu")
    assert "host CPU" in t.supports(OPS["linear"].bind([x, w]), {}, "h200")
    assert "not a float" in t.supports(OPS["linear"].bind([TensorType.of("i64", ("B", 256)), w]), {}, "cpu")
    monkeypatch.setenv("K31C_TVM", "off")
    assert "K31C_TVM=off" in t.supports(OPS["linear"].bind([x, w]), {}, "cpu")


# ---- norms ---------------------------------------------------------------------------------------
def _rms64(x, w, eps):
    x = x.double()
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


@pytest.mark.parametrize("shape,with_w", [((1, 256), True), ((7, 96), False), ((2, 5, 64), True)])
def test_rms_norm(shape, with_w):
    g = _gen(shape[-1])
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g) if with_w else None
    a = OPS["rms_norm"].bind([x, w] if with_w else [x])
    y = _run(TPL["tvm_rms_norm"], a, {"eps": 1e-5})
    assert_close_rel(y, _rms64(x, w, 1e-5), 1e-6, "rms_norm vs float64")
    assert_close_rel(y, OPS["rms_norm"].reference(a, {"eps": 1e-5}), 1e-6, "rms_norm vs OpDef.reference")


def _mix64(sources, proj, mnorm, eps):
    v = torch.stack([s.double() for s in sources])
    score = (v * (proj.double().reshape(-1) * mnorm.double())).sum(-1) / torch.sqrt(v.pow(2).mean(-1) + eps)
    return (torch.softmax(score, 0).unsqueeze(-1) * v).sum(0)


@pytest.mark.parametrize("n,rows,d", [(1, 3, 64), (2, 1, 256), (4, 6, 96)])
def test_attn_res_mix(n, rows, d):
    g = _gen(n * d + rows)
    srcs = [torch.randn(rows, d, generator=g) * (1 + i) for i in range(n)]
    proj, mnorm = torch.randn(1, d, generator=g), torch.randn(d, generator=g)
    a = OPS["attn_res_mix"].bind([proj, mnorm, *srcs])
    y = _run(TPL["tvm_attn_res_mix"], a, {"eps": 1e-5})
    assert_close_rel(y, _mix64(srcs, proj, mnorm, 1e-5), 1e-6, "mix vs float64")
    assert_close_rel(y, OPS["attn_res_mix"].reference(a, {"eps": 1e-5}), 1e-6, "mix vs OpDef.reference")


@pytest.mark.parametrize("bank,prefix_add", [(0, True), (2, True), (3, False)])
def test_fused_mix_norm(bank, prefix_add):
    g = _gen(10 * bank + prefix_add)
    rows, d = 5, 64
    srcs = [torch.randn(rows, d, generator=g) for _ in range(bank + 1 + prefix_add)]
    proj, mnorm, nw = torch.randn(d, generator=g), torch.randn(d, generator=g), torch.randn(d, generator=g)
    attrs = {"bank": bank, "prefix_add": prefix_add, "eps": 1e-5, "norm_eps": 1e-6}
    out = _run(TPL["tvm_attn_res_mix_norm"], SimpleNamespace(operands=[proj, mnorm, nw, *srcs]), attrs)
    last = srcs[bank].double() + srcs[bank + 1].double() if prefix_add else srcs[bank]
    want = _rms64(_mix64([*srcs[:bank], last], proj, mnorm, 1e-5), nw, 1e-6)
    h = out[1] if prefix_add else out
    assert_close_rel(h, want, 1e-6, "fused mix + norm vs float64")
    if prefix_add:
        assert_close_rel(out[0], last, 1e-7, "prefix = prev + part")


def test_embedding_rms_norm_equals_the_unfused_pair():
    g = _gen(77)
    table, w = torch.randn(40, 96, generator=g) * 2, torch.randn(96, generator=g)
    ids = torch.tensor([[3, -1, 39], [0, 17, 3]])
    e, h = _run(TPL["tvm_embedding_rms_norm"], SimpleNamespace(operands=[table, ids, w]), {"eps": 1e-5})
    assert torch.equal(e, table[ids])
    a = OPS["rms_norm"].bind([table[ids], w])
    assert torch.equal(h, _run(TPL["tvm_rms_norm"], a, {"eps": 1e-5}))   # same config: the unfused kernel's bits
    assert_close_rel(h, _rms64(table[ids], w, 1e-5), 1e-6, "embedding_rms_norm vs float64")


def test_every_norm_config_value_compiles_and_agrees():
    g = _gen(12)
    x, w = torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    srcs = [torch.randn(3, 32, generator=g) for _ in range(2)]
    for cfg in _one_at_a_time(TPL["tvm_rms_norm"], {"VEC": 4, "PAR": 1}):
        assert_close_rel(N.rms_norm(x, w, 1e-5, cfg), _rms64(x, w, 1e-5), 1e-6, f"rms_norm {cfg}")
        _, y = N.attn_res_mix(srcs[:1], srcs[1], w, w, 1e-5, cfg)
        assert_close_rel(y, _mix64(srcs, w, w, 1e-5), 1e-6, f"mix {cfg}")
    assert TPL["tvm_rms_norm"].constraints({"VEC": 16, "PAR": 1}, {"T": 1, "d": 40, "n": 1}, "cpu") \
        == ["VEC=16 does not divide d=40"]
