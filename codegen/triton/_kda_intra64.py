"""KDA chunked prefill, kernel 1 in 64-row form (prefill config A64=1; `kda_prefill.py` has the math and the
sixteen-row form): the same workspace (W, U, QG, KG, Aqk, G_C) from [64, *] tiles only.

Per (chunk, head), over key-channel slices of BK (lc = cumulative decay since each row's 16-row sub-block start,
from phase 0, `decay_slices`; s_b = sub-block b's total decay on the slice):
    r = k e^{lc}, x = q e^{lc}            all 64 rows at once (each row relative to its own sub-block: <= 1)
    A   += (r masked to sub-block a) C_a^T,  Aqk += (x masked to sub-block a) C_a^T,   a = 0..3
    C_a[j] = k_j e^{G_{a0} - G_j}: for j in an earlier sub-block b, k e^{s_b - lc} times the decay of the sub-blocks
             between (<= 1); for j in sub-block a, k e^{-lc} (span-checked as in the sixteen-row form)
The four products per slice accumulate into ONE [64, 64] A and Aqk (rows of different sub-blocks never overlap):
M = 64 tensor-core products without the per-sub-block re-loads of k, q and lc. Then L^-1 = (I + A)^-1 as one
[64, 64] tile (`_inv_unit_lower64`) and W = L^-1 (beta k e^G), U = L^-1 (beta v) as [64, 64] x [64, BK] products.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._kda_common import BC
from ._kda_chunk_tiles import _diag_exact, _gate_slice, _key_columns, _key_slice, _load2, _spans, _st64, decay_slices


@triton.jit
def _stack4(x0, x1, x2, x3):
    """[64, n] from four [16, n] row blocks (rows 16a..16a+15 = x_a)."""
    x = tl.join(tl.join(x0, x2), tl.join(x1, x3))  # [16, n, 2, 2]: [i, j, m, p] = x_{2m+p}[i, j]
    return tl.reshape(tl.permute(x, (2, 3, 0, 1)), [64, x0.shape[1]])


@triton.jit
def _eye_plus(x):
    """I + x for a [64, 64] tile (the identity from index compares, never held as a tile)."""
    r = tl.arange(0, 64)
    return tl.where(r[:, None] == r[None, :], x + 1.0, x)


@triton.jit
def _inv_unit_lower64(a, PREC: tl.constexpr):
    """(I + a)^-1 for strictly lower [64, 64] a, exact in exact arithmetic: with d = a's 16x16 diagonal blocks and
    e = a - d (strictly block lower), I + a = (I + d)(I + M), M = (I + d)^-1 e, so
        (I + a)^-1 = (I - M)(I + M^2) (I + d)^-1      (M strictly block lower over 4 blocks: M^4 = 0)
        (I + d)^-1 = (I - d)(I + d^2)(I + d^4)(I + d^8) (d^16 = 0; the per-block product of `_inv_unit_lower`).
    Ten [64, 64] products; zero blocks stay exactly zero, so the block-diagonal inverse equals the per-block one."""
    r = tl.arange(0, 64)
    same = r[:, None] // 16 == r[None, :] // 16
    e, d = tl.where(same, 0.0, a), tl.where(same, a, 0.0)
    d2 = tl.dot(d, d, input_precision=PREC)
    t = tl.dot(_eye_plus(-d), _eye_plus(d2), input_precision=PREC)  # ordered so that few [64, 64] tiles stay live
    d4 = tl.dot(d2, d2, input_precision=PREC)
    t = tl.dot(t, _eye_plus(d4), input_precision=PREC)
    di = tl.dot(t, _eye_plus(tl.dot(d4, d4, input_precision=PREC)), input_precision=PREC)
    m = tl.dot(di, e, input_precision=PREC)
    t = tl.dot(_eye_plus(-m), _eye_plus(tl.dot(m, m, input_precision=PREC)), input_precision=PREC)
    return tl.dot(t, di, input_precision=PREC)


@triton.jit
def _masked_products(a: tl.constexpr, r, x, kend, kd, s1, s2, A, P, PREC: tl.constexpr, LOWP: tl.constexpr):
    """A += (r on sub-block a's rows) C_a^T, P += (x on those rows) C_a^T (C_a: the module docstring)."""
    blk = tl.arange(0, 64)[:, None] // BC
    cc = _key_columns(a, s1, s2, kend, kd)
    ra, xa = tl.where(blk == a, r, 0.0), tl.where(blk == a, x, 0.0)
    if LOWP:
        ra, xa, cc = ra.to(tl.bfloat16), xa.to(tl.bfloat16), cc.to(tl.bfloat16)
    return tl.dot(ra, tl.trans(cc), A, input_precision=PREC), tl.dot(xa, tl.trans(cc), P, input_precision=PREC)


@triton.jit
def _kda_intra64_kernel(q, k, v, g, beta, dtb, alog, chunk_start, chunk_len, W, U, QG, KG, AQK, GL, GW,
                        s_q, s_k, s_v, s_g, s_b, scale, lower_bound,
                        H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        GATE: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, LOWP_A: tl.constexpr,
                        LOWP_WU: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)
    L = tl.load(chunk_len + n)
    if L <= 0:
        return
    t0 = tl.load(chunk_start + n).to(tl.int64)
    q += h * D
    k += h * D
    v += h * DV
    base = (n.to(tl.int64) * H + h) * 64
    lw = GW + base * D
    rows = tl.arange(0, 64)
    decay_slices(g + h * D, dtb + h * D, alog, h, t0, L, s_g, lw, GL + (n.to(tl.int64) * H + h) * D, lower_bound,
                 D, BK, GATE, HAS_BIAS)
    A = tl.zeros([64, 64], dtype=tl.float32)
    P = tl.zeros([64, 64], dtype=tl.float32)
    n_unsafe = 0
    for kb in range(0, D, BK):
        cols = kb + tl.arange(0, BK)
        s1, s2, unsafe, kf, lf, kend, kd = _key_slice(lw, k, t0, L, s_k, cols, D)
        n_unsafe += unsafe
        e = tl.exp(lf)
        r, x = kf * e, _load2(q, t0, L, s_q, cols) * e
        A, P = _masked_products(0, r, x, kend, kd, s1, s2, A, P, PREC, LOWP_A)
        A, P = _masked_products(1, r, x, kend, kd, s1, s2, A, P, PREC, LOWP_A)
        A, P = _masked_products(2, r, x, kend, kd, s1, s2, A, P, PREC, LOWP_A)
        A, P = _masked_products(3, r, x, kend, kd, s1, s2, A, P, PREC, LOWP_A)
    if n_unsafe > 0:  # rare (|g| > ~4 per token over a whole sub-block): exact diagonal blocks
        z = tl.zeros([BC, 64], dtype=tl.float32)
        for kb in range(0, D, BK):
            cols = kb + tl.arange(0, BK)
            s0, s1, s2, s3, u0, u1, u2, u3 = _spans(lw, cols, D)
            e0, f0 = _diag_exact(0, k, q, lw, t0, L, s_k, s_q, cols, z, z, D)
            e1, f1 = _diag_exact(1, k, q, lw, t0, L, s_k, s_q, cols, z, z, D)
            e2, f2 = _diag_exact(2, k, q, lw, t0, L, s_k, s_q, cols, z, z, D)
            e3, f3 = _diag_exact(3, k, q, lw, t0, L, s_k, s_q, cols, z, z, D)
            A += _stack4(tl.where(u0, e0, z), tl.where(u1, e1, z), tl.where(u2, e2, z), tl.where(u3, e3, z))
            P += _stack4(tl.where(u0, f0, z), tl.where(u1, f1, z), tl.where(u2, f2, z), tl.where(u3, f3, z))
    b64 = tl.load(beta + h + (t0 + rows) * s_b, mask=rows < L, other=0.0).to(tl.float32)[:, None]
    _st64(AQK + base * 64, rows, 64, tl.where(rows[None, :] <= rows[:, None], P, 0.0) * scale)
    li = _inv_unit_lower64(tl.where(rows[None, :] < rows[:, None], A, 0.0) * b64, PREC)
    if LOWP_WU:  # bf16 tensor-core products (fp32 accumulation) for the two solves
        li = li.to(tl.bfloat16)
    for kb in range(0, D, BK):  # W = L^-1 (beta k e^G), QG = scale q e^G, KG = k e^{G_C - G}
        cols = kb + tl.arange(0, BK)
        kf, e, ec = _gate_slice(lw, k, t0, L, s_k, cols, D)     # k, e^G, e^{G_C - G}
        _st64(W + base * D, cols, D, tl.dot(li, (kf * e * b64).to(li.dtype), input_precision=PREC))
        _st64(QG + base * D, cols, D, _load2(q, t0, L, s_q, cols) * e * scale)
        _st64(KG + base * D, cols, D, kf * ec)
    for vb in range(0, DV, BV):               # U = L^-1 (beta v)
        cols = vb + tl.arange(0, BV)
        _st64(U + base * DV, cols, DV, tl.dot(li, (_load2(v, t0, L, s_v, cols) * b64).to(li.dtype),
                                              input_precision=PREC))


def run_intra64(views, starts, lens, ws, gw, dtb, alog, scale, lower_bound, *, gate_mode, has_bias, BK, BV, PREC,
                LOWP_A, LOWP_WU, num_warps, num_stages, cap):
    """Launch over the chunk table: views = (q, k, v, g or f, beta) as [T, width] rows; fills the workspace `ws`
    (W, U, QG, KG, AQK, GL) and the lc scratch gw [N, H, 64, D] fp32."""
    q, k, v, g, beta = views
    N, H, _, D = ws[0].shape
    _kda_intra64_kernel[(N, H)](
        q, k, v, g, beta, dtb, alog, starts, lens, *ws, gw, q.stride(0), k.stride(0), v.stride(0), g.stride(0),
        beta.stride(0), float(scale), float(lower_bound), H=H, D=D, DV=ws[1].shape[3], BK=BK, BV=BV,
        GATE=gate_mode, HAS_BIAS=has_bias, PREC=PREC, LOWP_A=LOWP_A, LOWP_WU=LOWP_WU, num_warps=num_warps,
        num_stages=num_stages, **cap)
