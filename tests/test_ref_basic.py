import math

import pytest
import torch

from ir.ref import basic
try:
    from tests.helpers import assert_close_rel
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(g, *shape, dtype=torch.float64, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float64).mul(scale).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_rms_norm(dtype, tol):
    g = _gen(1)
    x = _rand(g, 5, 7, 48, dtype=dtype, scale=3.0)
    w = _rand(g, 48, dtype=dtype)
    x64, w64 = x.double(), w.double()
    ref = torch.empty_like(x64)
    for idx in range(5 * 7):
        i, j = divmod(idx, 7)
        row = x64[i, j]
        ms = sum(float(v) ** 2 for v in row) / 48
        ref[i, j] = row / math.sqrt(ms + 1e-5) * w64
    out = basic.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype
    assert_close_rel(out, ref, tol, "rms_norm")
    assert_close_rel(basic.rms_norm(x, None, 1e-5), ref / w64, tol, "rms_norm no weight")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_layer_norm(dtype, tol):
    g = _gen(2)
    x = _rand(g, 6, 32, dtype=dtype, scale=2.0) + 1.5
    w, b = _rand(g, 32, dtype=dtype), _rand(g, 32, dtype=dtype)
    x64 = x.double()
    mu = x64.mean(-1, keepdim=True)
    var = ((x64 - mu) ** 2).sum(-1, keepdim=True) / 32
    ref = (x64 - mu) / torch.sqrt(var + 1e-6) * w.double() + b.double()
    out = basic.layer_norm(x, w, b, 1e-6)
    assert out.dtype == dtype
    assert_close_rel(out, ref, tol, "layer_norm")
    assert_close_rel(out, torch.nn.functional.layer_norm(x, (32,), w, b, 1e-6), 10 * tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_l2_norm(dtype, tol):
    g = _gen(3)
    x = _rand(g, 4, 3, 64, dtype=dtype)
    x64 = x.double()
    ref = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) + 1e-6)
    out = basic.l2_norm(x, 1e-6)
    assert out.dtype == dtype
    assert_close_rel(out, ref, tol, "l2_norm")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_situ_glu_and_swiglu(dtype, tol):
    g = _gen(4)
    a = _rand(g, 8, 40, dtype=dtype, scale=6.0)   # large enough for tanh to saturate
    u = _rand(g, 8, 40, dtype=dtype, scale=40.0)
    a64, u64 = a.double(), u.double()
    sig = 1 / (1 + torch.exp(-a64))
    ref = (4.0 * torch.tanh(a64 / 4.0) * sig) * (25.0 * torch.tanh(u64 / 25.0))
    assert_close_rel(basic.situ_glu(a, u, 4.0, 25.0), ref, tol, "situ")
    ref_raw = (4.0 * torch.tanh(a64 / 4.0) * sig) * u64
    assert_close_rel(basic.situ_glu(a, u, 4.0, None), ref_raw, tol, "situ raw up")
    ref_b1 = (torch.tanh(a64) * sig) * u64
    assert_close_rel(basic.situ_glu(a, u, None, None), ref_b1, tol, "situ defaults")
    assert_close_rel(basic.swiglu(a, u), a64 * sig * u64, tol, "swiglu")
    assert basic.situ_glu(a, u, 4.0, 25.0).dtype == dtype


def test_gated_rms_norm():
    g = _gen(5)
    o, gate, w = _rand(g, 3, 4, 64), _rand(g, 3, 4, 64), _rand(g, 64)
    ref = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-5) * w / (1 + torch.exp(-gate))
    assert_close_rel(basic.gated_rms_norm(o, gate, w, 1e-5), ref, 1e-13, "gated_rms_norm")
    o32 = o.float()
    assert_close_rel(basic.gated_rms_norm(o32, gate.float(), w.float(), 1e-5), ref, 1e-6)


def test_hadamard():
    for d in (1, 2, 4, 8, 32, 64):
        h = basic.hadamard_matrix(d, torch.float64)
        hn = h / math.sqrt(d)
        assert_close_rel(hn @ hn.T, torch.eye(d, dtype=torch.float64), 1e-14, f"H{d} orthonormal")
        expected = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(d)]
                                 for i in range(d)], dtype=torch.float64)
        assert torch.equal(h, expected)
    g = _gen(6)
    x = _rand(g, 5, 3, 32)
    ref = torch.einsum("bij,jk->bik", x, basic.hadamard_matrix(32, torch.float64)) / math.sqrt(32)
    out = basic.hadamard_rotate(x)
    assert_close_rel(out, ref, 1e-14, "rotate")
    assert_close_rel(out.norm(dim=-1), x.norm(dim=-1), 1e-13, "norm preserved")
    assert_close_rel(basic.hadamard_rotate(out), x, 1e-13, "involution")
    out32 = basic.hadamard_rotate(x.float())
    assert out32.dtype == torch.float32
    assert_close_rel(out32, ref, 1e-6)
    with pytest.raises(ValueError):
        basic.hadamard_rotate(torch.ones(2, 12))
    with pytest.raises(ValueError):
        basic.hadamard_matrix(0)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_attn_res_mix(n):
    g = _gen(10 + n)
    B, d = 6, 48
    srcs = [_rand(g, B, d, scale=0.5 + i) for i in range(n)]
    proj, norm = _rand(g, d), _rand(g, d, scale=0.3) + 1.0
    eps = 1e-5
    ref = torch.empty(B, d, dtype=torch.float64)
    for b in range(B):
        scores = []
        for v in srcs:
            row = v[b]
            rms = math.sqrt(sum(float(c) ** 2 for c in row) / d + eps)
            scores.append(sum(float(row[c]) / rms * float(norm[c]) * float(proj[c])
                              for c in range(d)))
        m = max(scores)
        ex = [math.exp(s - m) for s in scores]
        alpha = [e / sum(ex) for e in ex]
        ref[b] = sum(a * v[b] for a, v in zip(alpha, srcs))
    assert_close_rel(basic.attn_res_mix(srcs, proj, norm, eps), ref, 1e-12, "mix fp64")
    out32 = basic.attn_res_mix([s.float() for s in srcs], proj.float(), norm.float(), eps)
    assert out32.dtype == torch.float32
    assert_close_rel(out32, ref, 1e-6, "mix fp32")
