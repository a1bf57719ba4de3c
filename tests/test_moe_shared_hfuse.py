"""The horizontally fused routed-expert / shared-expert decode launches (codegen/triton/_moe_shared_hfuse.py) in
the Triton interpreter, fp32, tiny shapes: each job's outputs equal its own kernels' with the same tile
parameters (the GV=2 routed launches, `packed_linear_glu`, the GEMM's dot-free tile) bit for bit, and a
float64 reference within fp32 tolerance; routings with foreign expert ids, one and several tokens, tiles that
do not divide the rows."""

from __future__ import annotations

import pytest
import torch

from codegen.triton import _moe_shared_hfuse as hf
from codegen.triton import gemm as gm
from codegen.triton._moe_gemv_words import _gemv_v2
from codegen.triton._moe_host import _gemv_weight
from codegen.triton.packed_glu import packed_linear_glu
from ir.formats import quantize_mxfp4
from ir.packed import PackedMXFP4
from ir.ref import moe as ref
from tests.helpers import assert_close_rel

E, L, I, D, IS = 8, 64, 96, 80, 48
B1, B2 = 4.0, 25.0


def _situ_glu64(g, u):
    return B1 * torch.tanh(g / B1) * torch.sigmoid(g) * B2 * torch.tanh(u / B2)


def _setup(seed: int, T: int, k: int):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (PackedMXFP4(*quantize_mxfp4(torch.randn(E, I, L, generator=g) / L ** 0.5)) for _ in range(2))
    w2 = PackedMXFP4(*quantize_mxfp4(torch.randn(E, L, I, generator=g) / I ** 0.5))
    z = torch.randn(T, L, generator=g)
    ids = torch.argsort(torch.rand(T, E + 2, generator=g), dim=1)[:, :k].to(torch.int64)  # E, E+1: another rank's; a column slice
    w = torch.rand(T, k, generator=g) + 0.1
    x = torch.randn(T, D, generator=g)
    wg, wu = (torch.randn(IS, D, generator=g) / D ** 0.5 for _ in range(2))
    wd = torch.randn(D, IS, generator=g) / IS ** 0.5
    return z, w, ids, (w1, w2, w3), x, (wg, wu, wd)


CFGS = [  # routed tiles (GN, GK, GN2, GK2), shared gate/up (SBN, SBK, SST), shared down (DBN, DBK, DST)
    dict(GN=16, GK=64, GN2=32, GK2=32, SBN=8, SBK=32, SST=3, DBN=8, DBK=16, DST=3, MIX=1),
    dict(GN=32, GK=32, GN2=16, GK2=64, SBN=2, SBK=64, SST=1, DBN=16, DBK=32, DST=1),   # partial row blocks
]


@pytest.mark.parametrize("T,k,ci", [(1, 2, 0), (3, 3, 1), (2, 1, 0)])
def test_hfused_equals_each_jobs_own_kernels(T, k, ci):
    z, w, ids, (w1, w2, w3), x, (wg, wu, wd) = _setup(100 + 7 * T + k, T, k)
    cfg = {**CFGS[ci], "PREF": 1, "XV": 1, "EARLY": 1, "num_warps": 4}
    g1, g3, g2 = (_gemv_weight(m, n, s, None, z.dtype) for m, n, s in
                  ((w1, "w1", (E, I, L)), (w3, "w3", (E, I, L)), (w2, "w2", (E, L, I))))
    act_kw = dict(betas=(B1, B2), ACT=0, HAS_BETA2=True)
    y, d = hf.hfused_experts_shared(z, w, ids, g1, g3, g2, act_kw, x, wg, wu, wd,
                                    dict(act="situ_glu", beta1=B1, beta2=B2), cfg)
    assert hf.supported(z, x, g1, g3, g2, wg, wu, wd) is None
    # each job alone, by its own kernels with the same tiles
    y_own = torch.empty_like(y)
    _gemv_v2(z, w, ids.contiguous(), g1, g3, g2, y_own, act_kw, {**cfg, "HX": 1})   # the raw launcher: flat ids
    a_own, = packed_linear_glu(x, [wg, wu], [IS, IS], "situ_glu",
                               dict(BLOCK_M=1, BLOCK_N=cfg["SBN"], BLOCK_K=cfg["SBK"], GROUP_M=1, SPLIT_K=1, GEMV=1,
                                    num_warps=4, num_stages=cfg["SST"]), B1, B2)
    d_own = gm.gemm(a_own, wd, dict(BLOCK_M=1, BLOCK_N=cfg["DBN"], BLOCK_K=cfg["DBK"], GROUP_M=1, SPLIT_K=1,
                                    GEMV=1, num_warps=4, num_stages=cfg["DST"]))
    assert torch.equal(y, y_own), (y - y_own).abs().max()
    assert torch.equal(d, d_own), (d - d_own).abs().max()
    # and the math, in float64
    keep = (ids >= 0) & (ids < E)
    y64 = ref.moe_experts(z.double(), torch.where(keep, w, torch.zeros_like(w)).double(), ids.clamp(0, E - 1),
                          *(m.dequantize(torch.float64) for m in (w1, w2, w3)), "situ", B1, B2)
    a64 = _situ_glu64(x.double() @ wg.double().T, x.double() @ wu.double().T)
    assert torch.isfinite(y).all() and torch.isfinite(d).all()
    assert_close_rel(y, y64, 1e-5)
    assert_close_rel(d, a64 @ wd.double().T, 1e-5)


def test_unsupported_operands_are_named():
    z, w, ids, (w1, w2, w3), x, (wg, wu, wd) = _setup(5, 1, 2)
    g1, g3, g2 = (_gemv_weight(m, n, s, None, z.dtype) for m, n, s in
                  ((w1, "w1", (E, I, L)), (w3, "w3", (E, I, L)), (w2, "w2", (E, L, I))))
    assert "shared down" in hf.supported(z, x, g1, g3, g2, wg, wu, wd.T)
    dense = _gemv_weight(torch.randn(E, I, L), "w1", (E, I, L), None, z.dtype)
    assert "MXFP4" in hf.supported(z, x, dense, g3, g2, wg, wu, wd)
    with pytest.raises(ValueError, match="gate/up pairs"):
        hf.hfused_experts_shared(z, w, ids, g1, g3, g2, dict(betas=(B1, B2), ACT=0, HAS_BETA2=True), x, wg, wu, wd,
                                 dict(act="situ_glu", beta1=B1, beta2=B2), {**CFGS[0], "SBN": 3})
