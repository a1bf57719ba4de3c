"""Device helpers of the grouped expert GEMMs (moe_grouped_gemm.py): expert tile lookup, raster
swizzle, MXFP4 decode (pure Triton, or PTX on byte pairs / on 16-bit words (_moe_decode16.py) / on the per-pair
path's int32 words: code c and c+4 of a word as fp32 E2M1 · 2^-14, `_codes`), the MMA step over dense
or packed weights in the swapped orientation (weights as the MMA's M side, tokens as N), and the GLU
epilogue. Not a kernel family (no TEMPLATES).

Tiles are computed transposed: acc[n, m] = Σ_k W[n, k] · x[m, k] with n over BN weight rows and m
over BM routed rows, so the weight tile is the left operand (on Hopper: the dequantised weights in
registers, the small activation tile from shared memory; wgmma when BN >= 64 per warpgroup, else
mma.sync). An MXFP4 byte j holds K columns 2j (low nibble) and 2j+1 (high nibble): the byte decodes
yield the even and odd columns as two [BN, BK/2] tiles; the 16-bit-word decodes read int16 element j
(columns 4j .. 4j+3) and yield four [BN, BK/4] tiles, columns 4j + c. Each tile is dotted with the
activation columns split the same way (_load_bt), so nothing is interleaved.
"""

from __future__ import annotations

import triton
import triton.language as tl

from codegen.triton._moe_decode16 import (E2M1_ASM16, E2M1_ASM16_WIDE, E2M1_ASM16I, E2M1_ASM16I_WIDE,  # noqa: F401
                                          _asm16)

DENSE, MX_BYTES, MX_DOT_SCALED, MX_ASM, MX_BYTES16, MX_ASM16, MX_ASM16I = 0, 1, 2, 3, 4, 5, 6   # W_FMT (host side)
_DENSE, _MX_BYTES, _MX_DOT_SCALED, _MX_ASM, _MX_BYTES16, _MX_ASM16, _MX_ASM16I = (
    tl.constexpr(c) for c in (DENSE, MX_BYTES, MX_DOT_SCALED, MX_ASM, MX_BYTES16, MX_ASM16, MX_ASM16I))

# E2M1 -> bf16 for two packed bytes per instance (inline_asm_elementwise, pack=2): $2 holds bytes b0
# (element j, bits 0..7) and b1 (element j+1) (the 16-bit pair, zero-extended by LLVM; ptxas drops the
# extension after the 16-bit shared-memory load), $3 the bf16x2 block factors (f0, f1); $0 = (lo(b0),
# lo(b1)) · f, $1 = (hi(b0), hi(b1)) · f. prmt spreads the bytes to x = [b1, 0, b0, 0] (byte 3..0),
# so every nibble is a shift away from the bf16 field layout sign -> bit 15, e e m -> bits 8..6 (the
# E2M1 value · 2^-126, code 1 a subnormal), per 16-bit half: lo = (x << 4 | x >> 2) & 0x81C081C0 (the
# zero bytes keep the other nibbles out of the mask), hi = (x & 0x80008000) | (x >> 6 & 0x01C001C0);
# then one bf16x2 multiply by f = 2^(s-1). WIDE (a scale byte > 128): first · 2^126, then f = 2^(s-127).
# 2.25 instructions per weight element; tests/test_moe_kernels_gpu_paths.py emulates this text exactly.
_E2M1_BODY = """
.reg .b32 t, x, a, b, w;
mov.b32 t, $2;
prmt.b32 x, t, 0, 0x1404;
shl.b32 a, x, 4;
shr.b32 b, x, 2;
or.b32 a, a, b;
and.b32 a, a, 0x81C081C0;
and.b32 w, x, 0x80008000;
shr.b32 b, x, 6;
and.b32 b, b, 0x01C001C0;
or.b32 b, b, w;
"""
E2M1_ASM = tl.constexpr("{" + _E2M1_BODY + """mul.rn.bf16x2 $0, a, $3;
mul.rn.bf16x2 $1, b, $3;
}""")
E2M1_ASM_WIDE = tl.constexpr("{" + _E2M1_BODY + """mov.b32 w, 0x7E807E80;
mul.rn.bf16x2 a, a, w;
mul.rn.bf16x2 b, b, w;
mul.rn.bf16x2 $0, a, $3;
mul.rn.bf16x2 $1, b, $3;
}""")

# E2M1 -> bf16 on 16-bit words (DEQ asm16 / asm16i): _moe_decode16.py


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
    """E8M0 bytes (int32) -> the factor the decode multiplies by, built from bits (exact).
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
def _step_scales(s_ptr, sbase, rn, n_ok, k0, K, stride_sn, BN: tl.constexpr, BK: tl.constexpr, W_FMT: tl.constexpr,
                 PF: tl.constexpr):
    """E8M0 bytes [BN, BK/32] (int32) of K columns k0 .. k0+BK (zeros for dense weights). Single bytes are
    below cp.async's 4-byte minimum, so the pipeliner leaves this load in the loop, its latency exposed
    at every K step (a tile carried across iterations instead, or read as int32 words through cp.async,
    stops Triton from moving the layout conversion onto the packed bytes: the decoded tile would pass
    through shared memory). Where it is issued is the kernels' SL choice; PF (CUDA) also asks L1 for the
    next step's bytes (prefetch.global.L1, no result), so the next load hits L1."""
    if W_FMT == _DENSE:
        return tl.zeros([BN, BK // 32], dtype=tl.int32)
    else:
        gi = k0 // 32 + tl.arange(0, BK // 32)
        rows = s_ptr + sbase + rn[:, None].to(tl.int64) * stride_sn
        s = tl.load(rows + gi[None, :], mask=n_ok[:, None] & (gi < K // 32)[None, :], other=0)
        if PF:
            nxt = tl.minimum(gi + BK // 32, K // 32 - 1)          # clamped: stays inside the row
            tl.inline_asm_elementwise("prefetch.global.L1 [$1];\nmov.b32 $0, 0;", "=r,l", [rows + nxt[None, :]],
                                      dtype=tl.int32, is_pure=False, pack=1)
        return s.to(tl.int32)


@triton.jit
def _top_scales(s_ptr, sbase, rn, n_ok, k0, K, stride_sn, BN: tl.constexpr, BK: tl.constexpr, W_FMT: tl.constexpr,
                SL: tl.constexpr, PF: tl.constexpr):
    """E8M0 bytes [BN, BK/32] (int32) of a K step: SL=0 zeros (read in the step), 1 and 3 bytes (_step_scales;
    SL=3's a step ahead), 2 int32 words (scales as int32 [E, N, K/128], strides in words; byte c of word w =
    group 4w + c) streamed by cp.async, the decoded tile then through shared memory (H200: 1.8x SL=1's time)."""
    if SL == 2 and W_FMT != _DENSE:
        gi = k0 // 32 + tl.arange(0, BK // 32)
        w = tl.load(s_ptr + sbase + rn[:, None].to(tl.int64) * stride_sn + (gi // 4)[None, :],
                    mask=n_ok[:, None] & (gi < K // 32)[None, :], other=0)
        return (w >> ((gi % 4) * 8)[None, :]) & 0xFF
    elif SL == 0:
        return tl.zeros([BN, BK // 32], dtype=tl.int32)
    else:
        return _step_scales(s_ptr, sbase, rn, n_ok, k0, K, stride_sn, BN, BK, W_FMT, PF)


@triton.jit
def _mxfp4_halves(q_ptr, s_ptr, qbase, sbase, rn, n_ok, k0, K, stride_qn, stride_sn, s_pre, BN: tl.constexpr,
                  BK: tl.constexpr, DT: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr, SL: tl.constexpr,
                  PF: tl.constexpr):
    """Dequantised even and odd K columns ([BN, BK/2] each, DT) of K columns k0 .. k0+BK of an MXFP4
    matrix stored [N, K/2] bytes; its E8M0 bytes [BN, BK/32]: s_pre (SL, loaded at the top of the K
    step) or read here after the weight tile (_step_scales). ASM: the PTX decode (bf16, CUDA only)."""
    G: tl.constexpr = BK // 32
    gi = k0 // 32 + tl.arange(0, G)
    g_ok = n_ok[:, None] & (gi < K // 32)[None, :]
    q = tl.load(q_ptr + qbase + rn[:, None, None].to(tl.int64) * stride_qn + gi[None, :, None] * 16
                + tl.arange(0, 16)[None, None, :], mask=g_ok[:, :, None], other=0)             # [BN, G, 16] u8
    s = s_pre if SL else _step_scales(s_ptr, sbase, rn, n_ok, k0, K, stride_sn, BN, BK, _MX_BYTES, PF)
    f = _scale_factor(s, DT, WIDE)[:, :, None]
    if ASM:
        f = tl.broadcast_to(f, (BN, G, 16))
        if WIDE:
            lo, hi = tl.inline_asm_elementwise(E2M1_ASM_WIDE, "=r,=r,r,r", [q, f], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=2)
        else:
            lo, hi = tl.inline_asm_elementwise(E2M1_ASM, "=r,=r,r,r", [q, f], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=2)
    else:
        qi = q.to(tl.int32)
        lo = _decode(qi << 28, f, DT, WIDE)
        hi = _decode(qi << 24, f, DT, WIDE)
    return tl.reshape(lo, (BN, BK // 2)), tl.reshape(hi, (BN, BK // 2))


@triton.jit
def _mxfp4_quarters(q_ptr, s_ptr, qbase, sbase, rn, n_ok, k0, K, stride_qn, stride_sn, s_pre, BN: tl.constexpr,
                    BK: tl.constexpr, DT: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr, SL: tl.constexpr,
                    PF: tl.constexpr):
    """Dequantised K columns k0 + 4j + c (c = 0..3; four [BN, BK/4] tiles, DT) of an MXFP4 matrix whose
    packed bytes q_ptr reads as int16 [N, K/4] (strides in int16 units); E8M0 bytes as _mxfp4_halves.
    ASM: the PTX decode E2M1_ASM16 (bf16, CUDA only); else the same bit placement in Triton ops."""
    G: tl.constexpr = BK // 32
    gi = k0 // 32 + tl.arange(0, G)
    g_ok = n_ok[:, None] & (gi < K // 32)[None, :]
    q = tl.load(q_ptr + qbase + rn[:, None, None].to(tl.int64) * stride_qn + gi[None, :, None] * 8
                + tl.arange(0, 8)[None, None, :], mask=g_ok[:, :, None], other=0)              # [BN, G, 8] i16
    s = s_pre if SL else _step_scales(s_ptr, sbase, rn, n_ok, k0, K, stride_sn, BN, BK, _MX_BYTES, PF)
    return _quarters(q, s, BN, BK, DT, WIDE, ASM)


@triton.jit
def _quarters(q, s, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr):
    """Packed words q [BN, BK/32, 8] (int16) under E8M0 bytes s [BN, BK/32] (int32) -> the four [BN, BK/4] tiles of
    K columns 4j + c (DT). ASM: 1 E2M1_ASM16, 2 asm16i (the shifts as multiplies, E2M1_ASM16I), 0 Triton ops."""
    G: tl.constexpr = BK // 32
    f = _scale_factor(s, DT, WIDE)[:, :, None]
    if ASM:
        f = tl.broadcast_to(f, (BN, G, 8))
        w0 = _asm16(q, f, 0, WIDE, ASM == 2)
        w1 = _asm16(q, f, 1, WIDE, ASM == 2)
        w2 = _asm16(q, f, 2, WIDE, ASM == 2)
        w3 = _asm16(q, f, 3, WIDE, ASM == 2)
    else:
        qi = q.to(tl.int32)
        w0 = _decode(qi << 28, f, DT, WIDE)
        w1 = _decode(qi << 24, f, DT, WIDE)
        w2 = _decode(qi << 20, f, DT, WIDE)
        w3 = _decode(qi << 16, f, DT, WIDE)
    return (tl.reshape(w0, (BN, BK // 4)), tl.reshape(w1, (BN, BK // 4)), tl.reshape(w2, (BN, BK // 4)),
            tl.reshape(w3, (BN, BK // 4)))


@triton.jit
def _load_bt(rows_ptr, row_ok, k0, K, W_FMT: tl.constexpr, DT: tl.constexpr, BK: tl.constexpr):
    """Activation rows' K columns k0 .. k0+BK, transposed, as four operands b0..b3 matching the weight
    tiles of W_FMT: [BK, BM] (dense weights, dot_scaled; b1..b3 unused), the even and odd columns
    [BK/2, BM] (MXFP4 bytes: b0, b1), or columns 4j + c [BK/4, BM] (MXFP4 16-bit words: b_c)."""
    rk = k0 + tl.arange(0, BK)
    a = tl.load(rows_ptr + rk[None, :], mask=row_ok[:, None] & (rk < K)[None, :], other=0.0).to(DT)
    if W_FMT == _MX_BYTES or W_FMT == _MX_ASM:
        even, odd = tl.split(tl.reshape(a, (a.shape[0], BK // 2, 2)))
        return tl.trans(even), tl.trans(odd), tl.trans(even), tl.trans(odd)
    elif W_FMT == _MX_BYTES16 or W_FMT == _MX_ASM16 or W_FMT == _MX_ASM16I:
        c02, c13 = tl.split(tl.reshape(a, (a.shape[0], BK // 4, 2, 2)))       # column 4j + 2p + q: split q
        c0, c2 = tl.split(c02)                                                  # then p
        c1, c3 = tl.split(c13)
        return tl.trans(c0), tl.trans(c1), tl.trans(c2), tl.trans(c3)
    else:
        return tl.trans(a), tl.trans(a), tl.trans(a), tl.trans(a)


@triton.jit
def _k_range(sk, K, BK: tl.constexpr, SPLIT: tl.constexpr):
    """K columns [lo, hi) of split sk of SPLIT: cdiv(cdiv(K, BK), SPLIT) whole BK steps each (the last
    shorter, possibly empty); SPLIT = 1: [0, K), the loop of the unsplit kernels."""
    if SPLIT == 1:
        return 0, K
    else:
        chunk = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
        lo = sk * chunk
        return lo, tl.minimum(lo + chunk, K)


@triton.jit
def _mma_step_t(acc, b, b1, b2, b3, w_ptr, s_ptr, wbase, sbase, rn, n_ok, k0, K, stride_wn, stride_sn, s_pre,
                BN: tl.constexpr, BK: tl.constexpr, W_FMT: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
                WIDE: tl.constexpr, SL: tl.constexpr, PF: tl.constexpr):
    """acc[BN, BM] += W[rn, k0:k0+BK] @ b for a dense or MXFP4 weight (W_FMT, see the module doc);
    b .. b3: the activation operands of _load_bt; the E8M0 bytes: s_pre when SL, else read after the
    weight tile (_step_scales; PF: prefetch the next step's)."""
    if W_FMT == _DENSE:
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + wbase + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=n_ok[:, None] & (rk < K)[None, :], other=0.0).to(DT)
        return _dot(w, b, acc, IEEE)
    elif W_FMT == _MX_DOT_SCALED:
        kb = k0 // 2 + tl.arange(0, BK // 2)
        q = tl.load(w_ptr + wbase + rn[:, None].to(tl.int64) * stride_wn + kb[None, :],
                    mask=n_ok[:, None] & (kb < K // 2)[None, :], other=0)
        s = s_pre if SL else _step_scales(s_ptr, sbase, rn, n_ok, k0, K, stride_sn, BN, BK, W_FMT, PF)
        return tl.dot_scaled(q, s.to(tl.uint8), "e2m1", b, None, "bf16", acc, fast_math=True)
    elif W_FMT == _MX_BYTES16 or W_FMT == _MX_ASM16 or W_FMT == _MX_ASM16I:
        w0, w1, w2, w3 = _mxfp4_quarters(w_ptr, s_ptr, wbase, sbase, rn, n_ok, k0, K, stride_wn, stride_sn, s_pre,
                                         BN, BK, DT, WIDE, (W_FMT == _MX_ASM16) + 2 * (W_FMT == _MX_ASM16I), SL, PF)
        return _dot(w3, b3, _dot(w2, b2, _dot(w1, b1, _dot(w0, b, acc, IEEE), IEEE), IEEE), IEEE)
    else:
        w_even, w_odd = _mxfp4_halves(w_ptr, s_ptr, wbase, sbase, rn, n_ok, k0, K, stride_wn, stride_sn, s_pre,
                                      BN, BK, DT, WIDE, W_FMT == _MX_ASM, SL, PF)
        return _dot(w_odd, b1, _dot(w_even, b, acc, IEEE), IEEE)


@triton.jit
def _mma_step_tma(acc, b0, b1, b2, b3, w_desc, row, k0, s, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                  DT: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr):
    """_mma_step_t for MXFP4 read as 16-bit words through a TMA descriptor (config TMA, sm_90): w_desc views the
    packed bytes as int16 [E·N, K/32, 8] with blocks [BN, BK/32, 8]; the tile at (row, k0/32, 0) lands in shared
    memory by a bulk tensor copy (Triton pipelines it over num_stages with mbarriers), then decodes as
    _mxfp4_quarters with the E8M0 bytes s [BN, BK/32] (int32) loaded by the caller (SL 1 / 2: loaded in the step;
    a carried tile, SL 3, stops Triton 3.6 from moving the dot operand's layout onto the packed tile, and the
    decoded tile then passes through shared memory). ASM: 1 asm16, 2 asm16i, 0 the Triton ops."""
    w0, w1, w2, w3 = _quarters(w_desc.load([row, k0 // 32, 0]), s, BN, BK, DT, WIDE, ASM)       # [BN, G, 8] i16
    return _dot(w3, b3, _dot(w2, b2, _dot(w1, b1, _dot(w0, b0, acc, IEEE), IEEE), IEEE), IEEE)


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


# ---- int32 words of 8 E2M1 codes (the per-pair decode path, _moe_gemv.py) ----
SIGN2 = tl.constexpr(0x80008000 - (1 << 32))     # bits 15 and 31 (as a signed int32)
MAG2 = tl.constexpr(0x0E000E00)                   # bits 9..11 and 25..27
UNBIAS = tl.constexpr(16384.0)                    # 2^14: the fp16 fields hold E2M1 · 2^-14


def _code_pair_ptx(c: int) -> tl.constexpr:
    """The same placement as _code_pair in PTX ($2 the word; $0, $1 codes c and c+4 as fp32): two shifts,
    and-or, then each 16-bit half converted straight from its register half (cvt.f32.f16), where
    Triton's int16 route re-packs halves of different words first (a PRMT per 2 codes)."""
    sa, sb = 12 - 4 * c, 9 - 4 * c
    sign = f"shl.b32 a, $2, {sa};\nand.b32 a, a, 0x80008000;" if sa else "and.b32 a, $2, 0x80008000;"
    mag = (f"shl.b32 b, $2, {sb};" if sb > 0 else f"shr.b32 b, $2, {-sb};") + "\nand.b32 b, b, 0x0E000E00;"
    return tl.constexpr("{\n.reg .b32 a, b;\n.reg .b16 l, h;\n" + sign + "\n" + mag + "\nor.b32 a, a, b;\n"
                        "mov.b32 {l, h}, a;\ncvt.f32.f16 $0, l;\ncvt.f32.f16 $1, h;\n}")


CODE_PAIR_PTX = (_PTX_0, _PTX_1, _PTX_2, _PTX_3) = tuple(_code_pair_ptx(c) for c in range(4))


@triton.jit
def _code_pair_asm(w, C: tl.constexpr):
    """_code_pair by CODE_PAIR_PTX[C] (CUDA only)."""
    if C == 0:
        return tl.inline_asm_elementwise(_PTX_0, "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    elif C == 1:
        return tl.inline_asm_elementwise(_PTX_1, "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    elif C == 2:
        return tl.inline_asm_elementwise(_PTX_2, "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_PTX_3, "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _codes(w, C: tl.constexpr, ASM: tl.constexpr):
    if ASM:
        return _code_pair_asm(w, C)
    else:
        return _code_pair(w, C)


@triton.jit
def _code_pair(w, C: tl.constexpr):
    """Codes C and C+4 of int32 words w as fp32 (E2M1 value · 2^-14, exact): one shift per field."""
    SA: tl.constexpr = 12 - 4 * C       # sign bit 4C+3 -> 15 (and 4C+19 -> 31)
    SB: tl.constexpr = 9 - 4 * C        # e e m bits 4C..4C+2 -> 9..11 (and 25..27)
    if SA > 0:
        sgn = w << SA
    else:
        sgn = w
    if SB > 0:
        mag = w << SB
    else:
        mag = w >> (-SB)
    h = (sgn & SIGN2) | (mag & MAG2)
    lo = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi
