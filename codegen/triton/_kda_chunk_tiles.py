"""Tile helpers of the chunked KDA prefill's kernels (kda_prefill.py: the math; _kda_intra64.py, _kda_wu.py):
a chunk is 64 rows = 4 sub-blocks of BC = 16; lc = the cumulative decay since each row's sub-block start (phase 0,
`decay_slices`), kept in a [64, D] fp32 scratch `lw`; the helpers load, store and combine [16 or 64, BK] tiles
of it and of q, k, v. Shared constants and the gate math: _kda_common.py."""

from __future__ import annotations

import triton
import triton.language as tl

from ._kda_common import _SAFE_SPAN, BC, kda_gate_math


@triton.jit
def _tile(base, t0, r0, L, s_t, cols):
    """Rows r0..r0+15 of a chunk starting at token t0 (rows >= L read as 0), columns cols, fp32."""
    r = tl.arange(0, BC) + r0
    p = base + (t0 + r).to(tl.int64)[:, None] * s_t + cols[None, :]
    return tl.load(p, mask=(r < L)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _load2(base, t0, L, s_t, cols):
    """The chunk's 64 rows as [64, len(cols)] fp32 (rows >= L read as 0)."""
    r = tl.arange(0, 64)
    p = base + (t0 + r).to(tl.int64)[:, None] * s_t + cols[None, :]
    return tl.load(p, mask=(r < L)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _inv_unit_lower(n, PREC: tl.constexpr):
    """(I + n)^-1 for strictly lower 16x16 n: (I - n)(I + n^2)(I + n^4)(I + n^8), exact as n^16 = 0."""
    rows = tl.arange(0, BC)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    n2 = tl.dot(n, n, input_precision=PREC)
    n4 = tl.dot(n2, n2, input_precision=PREC)
    m = tl.dot(eye - n, eye + n2, input_precision=PREC)
    m = tl.dot(m, eye + n4, input_precision=PREC)
    return tl.dot(m, eye + tl.dot(n4, n4, input_precision=PREC), input_precision=PREC)


@triton.jit
def _sub(x, b: tl.constexpr):
    """Columns 16b..16b+15 of a [16, 64] row block."""
    x3 = tl.reshape(x, [BC, 4, BC])
    return tl.sum(tl.where((tl.arange(0, 4) == b)[None, :, None], x3, 0.0), axis=1)


@triton.jit
def _st(base, r0, cols, ld, val):
    rows = tl.arange(0, BC) + r0
    tl.store(base + rows[:, None] * ld + cols[None, :], val.to(base.dtype.element_ty))


@triton.jit
def _st64(base, cols, ld, val):
    rows = tl.arange(0, 64)
    tl.store(base + rows[:, None] * ld + cols[None, :], val.to(base.dtype.element_ty))


@triton.jit
def _solve_store(base, ld, cols, x, l0, l1, l2, l3, PREC: tl.constexpr):
    """Rows of L^-1 x (x [64, n]) from the four [16, 64] row blocks of L^-1 (x rounded to their dtype:
    bf16 blocks make bf16 tensor-core products with fp32 accumulation)."""
    x = x.to(l0.dtype)
    _st(base, 0, cols, ld, tl.dot(l0, x, input_precision=PREC))
    _st(base, 16, cols, ld, tl.dot(l1, x, input_precision=PREC))
    _st(base, 32, cols, ld, tl.dot(l2, x, input_precision=PREC))
    _st(base, 48, cols, ld, tl.dot(l3, x, input_precision=PREC))


@triton.jit
def _spans(lw, cols, D: tl.constexpr):
    """Sub-block decay totals s_0..s_3 (last row of each sub-block of lc) and the span-check flags."""
    s0, s1 = tl.load(lw + 15 * D + cols), tl.load(lw + 31 * D + cols)
    s2, s3 = tl.load(lw + 47 * D + cols), tl.load(lw + 63 * D + cols)
    u0, u1 = tl.max(-s0, axis=0) >= _SAFE_SPAN, tl.max(-s1, axis=0) >= _SAFE_SPAN
    u2, u3 = tl.max(-s2, axis=0) >= _SAFE_SPAN, tl.max(-s3, axis=0) >= _SAFE_SPAN
    return s0, s1, s2, s3, u0, u1, u2, u3


@triton.jit
def _mask_rows(acc, a: tl.constexpr, beta, t0, L, s_b, INCL: tl.constexpr):
    """Row block a of A (strictly lower, times beta) or of Aqk (inclusive lower)."""
    i = tl.arange(0, BC) + a * BC
    j = tl.arange(0, 64)
    keep = (j[None, :] <= i[:, None]) if INCL else (j[None, :] < i[:, None])
    acc = tl.where(keep, acc, 0.0)
    if not INCL:
        acc = acc * tl.load(beta + (t0 + i) * s_b, mask=i < L, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def decay_slices(g, dtb, alog, h, t0, L, s_g, lw, gl, lower_bound, D: tl.constexpr, BK: tl.constexpr,
                 GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Phase 0 of kernel 1: lc [64, D] (fp32, cumulative decay since each 16-row sub-block's start; padded rows add
    0) to lw and G_C [D] to gl, from g (or from the raw gate input f with the fused gate: dtb, alog)."""
    rows = tl.arange(0, 64)
    for kb in range(0, D, BK):
        cols = kb + tl.arange(0, BK)
        gg = _load2(g, t0, L, s_g, cols)
        if GATE != 0:
            if HAS_BIAS:
                gg += tl.load(dtb + cols).to(tl.float32)[None, :]
            a_h = tl.exp(tl.load(alog + h).to(tl.float32))
            gg = tl.where((rows < L)[:, None], kda_gate_math(gg, a_h, lower_bound, GATE), 0.0)
        lc = tl.reshape(tl.cumsum(tl.reshape(gg, [4, BC, BK]), axis=1), [64, BK])
        tl.store(lw + rows[:, None] * D + cols[None, :], lc)
        tl.store(gl + cols, tl.sum(gg, axis=0))
    tl.debug_barrier()  # lc (written by other threads) is read next


@triton.jit
def _key_columns(a: tl.constexpr, s1, s2, kend, kd):
    """C_a [64, BK] of kernel 1's phase 1 for the rows of sub-block a: C_j = k_j e^{G_a0 - G_j}, i.e. for j in an
    earlier sub-block b, kend_j (decayed to b's end) times the decay of the sub-blocks between b and a (<= 1);
    kd_j for j in a itself; 0 after a."""
    blk = tl.arange(0, 64)[:, None] // BC
    one = tl.full(s1.shape, 1.0, tl.float32)
    d0, d1 = one, one                                   # decay between sub-block b's end and a's start
    if a == 2:
        d0 = tl.exp(s1)
    if a == 3:
        d0, d1 = tl.exp(s1 + s2), tl.exp(s2)
    dec = tl.where(blk == 0, d0[None, :], tl.where(blk == 1, d1[None, :], 1.0))
    return tl.where(blk < a, kend * dec, tl.where(blk == a, kd, 0.0))


@triton.jit
def _key_slice(lw, k, t0, L, s_k, cols, D: tl.constexpr):
    """Phase 1 of kernel 1, one key-channel slice, all 64 rows of the chunk: (s1, s2: sub-blocks 1 and 2's total
    decay on the slice; the number of sub-blocks whose decay span failed the check (`_spans`); k and lc [64, BK];
    kend = k e^{s_b - lc}, decayed to the end of its sub-block b (<= 1); kd = k e^{-lc}, 0 in a failed sub-block,
    whose diagonal block `_diag_exact` computes instead)."""
    blk = tl.arange(0, 64)[:, None] // BC
    s0, s1, s2, s3, u0, u1, u2, u3 = _spans(lw, cols, D)
    lf, kf = tl.load(lw + tl.arange(0, 64)[:, None] * D + cols[None, :]), _load2(k, t0, L, s_k, cols)
    s_row = tl.where(blk == 0, s0[None, :], tl.where(blk == 1, s1[None, :], tl.where(blk == 2, s2[None, :],
                                                                                      s3[None, :])))
    unsafe = tl.where(blk == 0, u0, tl.where(blk == 1, u1, tl.where(blk == 2, u2, u3)))
    n_unsafe = u0.to(tl.int32) + u1.to(tl.int32) + u2.to(tl.int32) + u3.to(tl.int32)
    return (s1, s2, n_unsafe, kf, lf, kf * tl.exp(s_row - lf),
            tl.where(unsafe, 0.0, kf * tl.exp(tl.minimum(-lf, _SAFE_SPAN))))


@triton.jit
def _gate_slice(lw, k, t0, L, s_k, cols, D: tl.constexpr):
    """Phase 2 of kernel 1, one key-channel slice: (k [64, BK], e^G and e^{G_C - G}), G the cumulative decay since
    the chunk start: lc plus the sub-blocks before the row's own (pre); G_C - G = the row's own and later
    sub-blocks' (suf) minus lc."""
    blk = tl.arange(0, 64)[:, None] // BC
    s0, s1, s2, s3, u0, u1, u2, u3 = _spans(lw, cols, D)
    lf, kf = tl.load(lw + tl.arange(0, 64)[:, None] * D + cols[None, :]), _load2(k, t0, L, s_k, cols)
    pre = tl.where(blk == 0, 0.0, tl.where(blk == 1, s0[None, :], tl.where(blk == 2, (s0 + s1)[None, :],
                                                                            (s0 + s1 + s2)[None, :])))
    suf = tl.where(blk == 0, (s0 + s1 + s2 + s3)[None, :], tl.where(blk == 1, (s1 + s2 + s3)[None, :],
                                                                     tl.where(blk == 2, (s2 + s3)[None, :],
                                                                              s3[None, :])))
    return kf, tl.exp(pre + lf), tl.exp(suf - lf)


@triton.jit
def _row_block(a: tl.constexpr, k, q, lw, t0, L, s_k, s_q, cols, kend, kd, s1, s2, acc, accq,
               D: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """acc[i, j] += sum_c r_ic C_jc (and accq with x) for the rows i of sub-block a and all 64 columns j:
    r = k e^{lc}, x = q e^{lc} (lc = decay since the sub-block start, so <= 1); C_j = k_j e^{G_a0 - G_j}:
    for an earlier sub-block b, kend = k e^{s_b - lc} (decayed to its end, <= 1) times the decay of the
    sub-blocks in between (<= 1); for sub-block a itself kd = k e^{-lc} (span-checked; 0 where
    `_diag_exact` takes over). Upper entries are masked later. LOWP: operands rounded to bf16 (same
    exponent range as fp32, so nothing overflows), fp32 accumulation."""
    la = tl.load(lw + (tl.arange(0, BC) + a * BC)[:, None] * D + cols[None, :])
    e = tl.exp(la)
    r, x = _tile(k, t0, a * BC, L, s_k, cols) * e, _tile(q, t0, a * BC, L, s_q, cols) * e
    cc = _key_columns(a, s1, s2, kend, kd)
    if LOWP:
        r, x, cc = r.to(tl.bfloat16), x.to(tl.bfloat16), cc.to(tl.bfloat16)
    acc = tl.dot(r, tl.trans(cc), acc, input_precision=PREC)
    accq = tl.dot(x, tl.trans(cc), accq, input_precision=PREC)
    return acc, accq


@triton.jit
def _diag_exact(a: tl.constexpr, k, q, lw, t0, L, s_k, s_q, cols, acc, accq, D: tl.constexpr):
    """Sub-block a's own columns exactly, sum_c {k,q}_ic k_jc e^{lc_ic - lc_jc} column by column (only
    differences <= 0 are exponentiated), for a slice whose sub-block decay span failed the check."""
    la = tl.load(lw + (tl.arange(0, BC) + a * BC)[:, None] * D + cols[None, :])
    ka, qa = _tile(k, t0, a * BC, L, s_k, cols), _tile(q, t0, a * BC, L, s_q, cols)
    rows, cols64 = tl.arange(0, BC), tl.arange(0, 64)
    for j in range(BC):
        sel = (rows == j)[:, None]
        e = tl.exp(tl.minimum(la - tl.sum(tl.where(sel, la, 0.0), axis=0)[None, :], 0.0))
        e = e * tl.sum(tl.where(sel, ka, 0.0), axis=0)[None, :]
        put = (cols64 == a * BC + j)[None, :]
        acc += tl.where(put, tl.sum(ka * e, axis=1)[:, None], 0.0)
        accq += tl.where(put, tl.sum(qa * e, axis=1)[:, None], 0.0)
    return acc, accq
