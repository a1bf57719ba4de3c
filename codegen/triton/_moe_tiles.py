"""Device helpers of the grouped expert GEMMs (moe_grouped_gemm.py): expert tile lookup, raster
swizzle, in-register MXFP4 decode (see moe_grouped_gemm's docstring for the bit tricks), the MMA step
over dense or packed weights, and the GLU epilogue. Not a kernel family (no TEMPLATES)."""

from __future__ import annotations

import triton
import triton.language as tl

DENSE, MX_BYTES, MX_DOT_SCALED = 0, 1, 2


@triton.jit
def _locate_tile(counts_ptr, offsets_ptr, tid, E, E_PAD: tl.constexpr, BM: tl.constexpr):
    """Tile `tid` of the expert-sorted pairs -> (tiles in all, expert, first row of expert, m0, rows)."""
    ev = tl.arange(0, E_PAD)
    cnt = tl.load(counts_ptr + ev, mask=ev < E, other=0)
    tiles = (cnt + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)
    e = tl.minimum(tl.sum((cum <= tid).to(tl.int32), 0), E - 1)
    sel = ev == e
    first = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    rows = tl.sum(tl.where(sel, cnt, 0), 0)
    return tl.sum(tiles, 0), e, tl.load(offsets_ptr + e), (tid - first) * BM, rows


@triton.jit
def _swizzle(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """Program id -> (m tile, n block), GROUP_M m tiles sweeping all n blocks together, so the
    activation rows of a group stay in L2 while every weight column block passes over them."""
    width = GROUP_M * n_n
    first = (pid // width) * GROUP_M
    rows = tl.minimum(n_m - first, GROUP_M)
    return first + (pid % width) % rows, (pid % width) // rows


@triton.jit
def _scale_factor(s, DT: tl.constexpr, WIDE: tl.constexpr):
    """E8M0 bytes (int32) -> the factor `_decode` multiplies by, built from bits (exact).
    bf16: 2^(s-1) (s <= 128), or 2^(s-127) when WIDE (1 <= s <= 254); else fp32 2^(s-113) (s <= 240)."""
    if DT == tl.bfloat16:
        if WIDE:
            return (s << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return ((s + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return ((s + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _decode(t, f, DT: tl.constexpr, WIDE: tl.constexpr):
    """E2M1 code in bits 31..28 of int32 t (sign = bit 31) times the block factor f, in DT.
    bf16: sign -> bit 15 and magnitude e e m -> bits 8..6 (an arithmetic shift fills the gap, the mask
    clears it): the bf16 value is the E2M1 value · 2^-126 (code 1 subnormal), scaled by f = 2^(s-1).
    Otherwise: magnitude -> bits 11..9 of an fp16 (E2M1 value · 2^-14, exact), then fp32 · 2^(s-113)."""
    if DT == tl.bfloat16:
        v = ((t >> 22) & 0x81C0).to(tl.int16).to(tl.bfloat16, bitcast=True)
        if WIDE:
            v = v * 8.507059e37
        return v * f
    else:
        v = ((t >> 19) & 0x8E00).to(tl.int16).to(tl.float16, bitcast=True)
        return (v.to(tl.float32) * f).to(DT)


@triton.jit
def _mxfp4_halves_t(q_ptr, s_ptr, qbase, sbase, rn, n_ok, k0, K, stride_qn, stride_sn,
                    BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, WIDE: tl.constexpr):
    """Dequantised even and odd K columns ([BK/2, BN] each) of an MXFP4 matrix stored [N, K/2] (+ scales
    [N, K/32]) for K columns k0 .. k0+BK: byte j holds column 2j (low nibble) and 2j+1 (high nibble).
    Splitting by parity spares the interleave: the caller dots them with z's even and odd columns."""
    G: tl.constexpr = BK // 32
    gi = k0 // 32 + tl.arange(0, G)
    g_ok = n_ok[:, None] & (gi < K // 32)[None, :]
    q = tl.load(q_ptr + qbase + rn[:, None, None].to(tl.int64) * stride_qn + gi[None, :, None] * 16
                + tl.arange(0, 16)[None, None, :], mask=g_ok[:, :, None], other=0).to(tl.int32)   # [BN, G, 16]
    s = tl.load(s_ptr + sbase + rn[:, None].to(tl.int64) * stride_sn + gi[None, :], mask=g_ok, other=0)
    f = _scale_factor(s.to(tl.int32), DT, WIDE)[:, :, None]
    lo = _decode(q << 28, f, DT, WIDE)
    hi = _decode(q << 24, f, DT, WIDE)
    return tl.trans(tl.reshape(lo, (BN, BK // 2))), tl.trans(tl.reshape(hi, (BN, BK // 2)))


@triton.jit
def _load_a(rows_ptr, row_ok, k0, K, W_FMT: tl.constexpr, DT: tl.constexpr, BK: tl.constexpr):
    """Activation tile for K columns k0 .. k0+BK: ([BM, BK], same) | DEQ bytes: (even, odd) [BM, BK/2]."""
    rk = k0 + tl.arange(0, BK)
    a = tl.load(rows_ptr + rk[None, :], mask=row_ok[:, None] & (rk < K)[None, :], other=0.0).to(DT)
    if W_FMT == 1:
        return tl.split(tl.reshape(a, (a.shape[0], BK // 2, 2)))
    else:
        return a, a


@triton.jit
def _mma_step(acc, a, a_odd, w_ptr, s_ptr, wbase, sbase, rn, n_ok, k0, K, stride_wn, stride_sn,
              BN: tl.constexpr, BK: tl.constexpr, W_FMT: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
              WIDE: tl.constexpr):
    """acc += a @ W[rn, k0:k0+BK]^T for a dense (0) or MXFP4 weight: DEQ bytes (1) or dot_scaled (2)."""
    if W_FMT == 0:
        rk = k0 + tl.arange(0, BK)
        b = tl.load(w_ptr + wbase + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=n_ok[None, :] & (rk < K)[:, None], other=0.0).to(DT)
        return _dot(a, b, acc, IEEE)
    elif W_FMT == 1:
        w_even, w_odd = _mxfp4_halves_t(w_ptr, s_ptr, wbase, sbase, rn, n_ok, k0, K, stride_wn, stride_sn, BN, BK,
                                        DT, WIDE)
        return _dot(a_odd, w_odd, _dot(a, w_even, acc, IEEE), IEEE)
    else:
        return _scaled_dot(a, w_ptr, s_ptr, wbase, sbase, rn, n_ok, k0, K, stride_wn, stride_sn, acc, BK)


@triton.jit
def _scaled_dot(a, q_ptr, s_ptr, qbase, sbase, rn, n_ok, k0, K, stride_qn, stride_sn, acc, BK: tl.constexpr):
    """acc += a @ dequant(W[rn, k0:k0+BK])^T through tl.dot_scaled (bf16 a, e2m1 W)."""
    kb = k0 // 2 + tl.arange(0, BK // 2)
    q = tl.load(q_ptr + qbase + rn[None, :].to(tl.int64) * stride_qn + kb[:, None],
                mask=n_ok[None, :] & (kb < K // 2)[:, None], other=0)
    gi = k0 // 32 + tl.arange(0, BK // 32)
    s = tl.load(s_ptr + sbase + rn[:, None].to(tl.int64) * stride_sn + gi[None, :],
                mask=n_ok[:, None] & (gi < K // 32)[None, :], other=0)
    return tl.dot_scaled(a, None, "bf16", q, s, "e2m1", acc, fast_math=True)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _glu(a, u, beta1, beta2, ACT: tl.constexpr, HAS_BETA2: tl.constexpr):
    """ACT 0: SiTU-GLU β1·tanh(a/β1)·sigmoid(a) · (β2·tanh(u/β2) | u);  ACT 1: SwiGLU silu(a)·u."""
    if ACT == 0:
        gate = beta1 * _tanh(a / beta1) * tl.sigmoid(a)
        if HAS_BETA2:
            u = beta2 * _tanh(u / beta2)
    else:
        gate = a * tl.sigmoid(a)
    return gate * u


# ---------------------------------------------------------------------------------------- kernels
