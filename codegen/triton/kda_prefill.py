"""KDA chunked prefill (chunk 64, WY/UT form) for ragged batches, and the KDA forget-gate kernel.

Math (SPEC §3.6, `ir.ref.kda.kda_chunked`): per request, head and chunk of C <= 64 tokens with
initial state S0 [D, Dv], inclusive cumulative log decay G_t = sum_{i<=t} g_i (per key channel):
    A_ti = beta_t sum_c k_tc k_ic e^{G_tc - G_ic}  (i < t),   L = I + A (unit lower triangular)
    W = L^-1 (beta e^G * K),  U = L^-1 (beta V),  d = U - W S0        (the delta-rule "new values")
    o = (scale q e^G) S0 + Aqk d,   Aqk_ti = scale sum_c q_tc k_ic e^{G_tc - G_ic}  (i <= t)
    S_C = diag(e^{G_C}) S0 + (e^{G_C - G} * K)^T d.
Two kernels:
  1. `_kda_intra_kernel`, one program per (chunk, head), fully parallel: the chunk is cut into four
     16-row sub-blocks; off-diagonal blocks of A and Aqk are dots of factors that are all <= 1
     (rows decayed from the sub-block start, columns decayed to it), diagonal blocks use the
     sub-block start as reference when its decay span is < 60 (always for the K3 gate, |g| < 5) and
     an exact per-column form otherwise, so nothing overflows for any g <= 0. L^-1 is built blockwise
     (16x16 diagonal inverses as (I-N)(I+N^2)(I+N^4)(I+N^8), N nilpotent). Writes W, U,
     QG = scale q e^G, KG = k e^{G_C - G}, Aqk and e^{G_C} to a workspace (input dtype).
  2. `_kda_state_kernel`, one program per (request, head, Dv block), sequential over the request's
     chunks with S in registers (fp32): d, o and the next S, writing o, optional checkpoint states,
     and the final state back to the pool row `state_slot[r]` in place.
Chunks are cut from each request's first token (the last one partial; padded rows are exact no-ops).
`kda_prefill(..., checkpoint_positions=...)` also cuts chunks at the requested positions so the
states there come out of kernel 2 exactly. The optional fused gate computes g from raw f in the load
path (GATE 1: lower_bound*sigmoid(exp(A_log)(f+dt_bias)); GATE 2: -exp(A_log) softplus(f+dt_bias)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel import KernelTemplate, Tunable, pow2_bucket

CHUNK = 64
BC = tl.constexpr(16)
_SAFE_SPAN = tl.constexpr(60.0)  # max |within-sub-block log decay| for the factorised diagonal


@triton.jit
def kda_gate_math(x, a, lower_bound, GATE: tl.constexpr):
    """x = f + dt_bias, a = exp(A_log[h]) (fp32). GATE 1: lower_bound*sigmoid(a x); 2: -a*softplus(x)
    (torch threshold 20; log1p(e) by its series for small e so tiny gates keep their precision)."""
    if GATE == 1:
        return lower_bound * tl.sigmoid(a * x)
    else:
        e = tl.exp(-tl.abs(x))
        l1p = tl.where(e < 1e-3, e * (1.0 - e * (0.5 - e / 3.0)), tl.log(1.0 + e))
        return -a * tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)


@triton.jit
def _kda_gate_kernel(f, s_f, alog, dtb, g, n, lower_bound, P: tl.constexpr, D: tl.constexpr,
                     BLOCK: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    t, c = idx // P, idx % P
    x = tl.load(f + t * s_f + c, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(dtb + c, mask=m, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(alog + c // D, mask=m, other=0.0).to(tl.float32))
    tl.store(g + idx, kda_gate_math(x, a, lower_bound, GATE), mask=m)


@triton.jit
def _load3(base, t0, L, s_t, cols):
    """The chunk's 64 rows as [4 sub-blocks, 16, len(cols)] fp32 (rows >= L read as 0)."""
    r3 = tl.arange(0, 4)[:, None, None] * BC + tl.arange(0, BC)[None, :, None]
    p = base + (t0 + r3).to(tl.int64) * s_t + cols[None, None, :]
    return tl.load(p, mask=r3 < L, other=0.0).to(tl.float32)


@triton.jit
def _load2(base, t0, L, s_t, cols):
    """The chunk's 64 rows as [64, len(cols)] fp32 (rows >= L read as 0)."""
    r = tl.arange(0, 64)
    p = base + (t0 + r).to(tl.int64)[:, None] * s_t + cols[None, :]
    return tl.load(p, mask=(r < L)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _store2(base, val, cols, ld):
    r = tl.arange(0, 64)
    tl.store(base + r[:, None] * ld + cols[None, :], tl.reshape(val, [64, cols.shape[0]]).to(base.dtype.element_ty))


@triton.jit
def _pick(x3, a: tl.constexpr):
    """Sub-block a of a [4, 16, n] tensor."""
    return tl.sum(tl.where((tl.arange(0, 4) == a)[:, None, None], x3, 0.0), axis=0)


@triton.jit
def _pick2(x2, a: tl.constexpr):
    """Row a of a [4, n] tensor."""
    return tl.sum(tl.where((tl.arange(0, 4) == a)[:, None], x2, 0.0), axis=0)


@triton.jit
def _row_block(a: tl.constexpr, r3, x3, kend, kd, p_ex, p_in, acc, accq, PREC: tl.constexpr):
    """acc[i, j] += sum_c r_ic C_jc and accq with x, rows i of sub-block a, all 64 columns j, where
    C_j = k_j e^{P_a - G_j}: for earlier sub-blocks kend (decayed to its end, <= 1) times e^{P_a - P_b+1}
    (<= 1); for sub-block a itself kd = k e^{-lc} (>= 1, bounded by the span check; zero when the span
    is too large: `_diag_exact` adds those). Upper entries are masked by the caller."""
    blk = tl.arange(0, 4)
    dec = tl.exp(tl.minimum(_pick2(p_ex, a)[None, :] - p_in, 0.0))
    cc = tl.where((blk < a)[:, None, None], kend * dec[:, None, :], tl.where((blk == a)[:, None, None], kd, 0.0))
    cc = tl.reshape(cc, [64, cc.shape[2]])
    acc = tl.dot(_pick(r3, a), tl.trans(cc), acc, input_precision=PREC)
    accq = tl.dot(_pick(x3, a), tl.trans(cc), accq, input_precision=PREC)
    return acc, accq


@triton.jit
def _diag_exact(a: tl.constexpr, k3, q3, lc, unsafe, acc, accq):
    """Sub-block a's own columns exactly, sum_c {k,q}_ic k_jc e^{lc_ic - lc_jc} column by column
    (only differences <= 0 are exponentiated), when its decay span failed the check."""
    if tl.sum(tl.where(tl.arange(0, 4) == a, unsafe, 0), axis=0) > 0:
        ka, qa, la = _pick(k3, a), _pick(q3, a), _pick(lc, a)
        rows, cols = tl.arange(0, BC), tl.arange(0, 64)
        for j in range(BC):
            sel = (rows == j)[:, None]
            e = tl.exp(tl.minimum(la - tl.sum(tl.where(sel, la, 0.0), axis=0)[None, :], 0.0))
            e = e * tl.sum(tl.where(sel, ka, 0.0), axis=0)[None, :]
            put = (cols == a * BC + j)[None, :]
            acc += tl.where(put, tl.sum(ka * e, axis=1)[:, None], 0.0)
            accq += tl.where(put, tl.sum(qa * e, axis=1)[:, None], 0.0)
    return acc, accq


@triton.jit
def _gated3(g, t0, L, s_g, cols, dtb, a_h, lower_bound, GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """g for the chunk as [4, 16, len(cols)], from g itself or from raw f through the fused gate."""
    g3 = _load3(g, t0, L, s_g, cols)
    if GATE != 0:
        if HAS_BIAS:
            g3 += tl.load(dtb + cols).to(tl.float32)[None, None, :]
        r3 = tl.arange(0, 4)[:, None, None] * BC + tl.arange(0, BC)[None, :, None]
        g3 = tl.where(r3 < L, kda_gate_math(g3, a_h, lower_bound, GATE), 0.0)
    return g3


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
def _mask_rows(acc, a: tl.constexpr, beta, t0, L, s_b, INCL: tl.constexpr):
    """Row block a of A (strictly lower, times beta) or of Aqk (inclusive lower)."""
    i = a * BC + tl.arange(0, BC)
    j = tl.arange(0, 64)
    keep = (j[None, :] <= i[:, None]) if INCL else (j[None, :] < i[:, None])
    acc = tl.where(keep, acc, 0.0)
    if not INCL:
        acc = acc * tl.load(beta + (t0 + i) * s_b, mask=i < L, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _kda_intra_kernel(q, k, v, g, beta, dtb, alog, chunk_start, chunk_len, W, U, QG, KG, AQK, GL,
                      s_q, s_k, s_v, s_g, s_b, scale, lower_bound,
                      H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      GATE: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)
    L = tl.load(chunk_len + n)
    if L <= 0:
        return
    t0 = tl.load(chunk_start + n).to(tl.int64)
    q += h * D
    k += h * D
    v += h * DV
    g += h * D
    dtb += h * D
    beta += h
    a_h = 0.0
    if GATE != 0:
        a_h = tl.exp(tl.load(alog + h).to(tl.float32))
    r3 = tl.arange(0, 4)[:, None, None] * BC + tl.arange(0, BC)[None, :, None]
    b3 = tl.load(beta + (t0 + r3) * s_b, mask=r3 < L, other=0.0).to(tl.float32)    # [4, 16, 1]
    base = (n.to(tl.int64) * H + h) * 64
    wb = W + base * D
    z = tl.zeros([BC, 64], dtype=tl.float32)
    a0, a1, a2, a3, p0, p1, p2, p3 = z, z, z, z, z, z, z, z
    n_unsafe = 0
    # ---- pass 1 over key-channel slices: row blocks of A (keys x keys) and Aqk (queries x keys);
    # QG = scale q e^G, KG = k e^{G_C - G}, G_C (log space), X = beta k e^G (into W, solved in pass 2)
    for kb in range(0, D, BK):
        cols = kb + tl.arange(0, BK)
        g3 = _gated3(g, t0, L, s_g, cols, dtb, a_h, lower_bound, GATE, HAS_BIAS)
        k3, q3 = _load3(k, t0, L, s_k, cols), _load3(q, t0, L, s_q, cols)
        lc = tl.cumsum(g3, axis=1)                 # decay within the sub-block, <= 0
        s = tl.sum(g3, axis=1)                     # [4, BK] sub-block totals
        p_in = tl.cumsum(s, axis=0)                # G at each sub-block end
        p_ex = p_in - s                            # G before each sub-block
        e = tl.exp(lc)
        rr, xx = k3 * e, q3 * e                    # rows decayed from their sub-block start (<= 1)
        kend = k3 * tl.exp(s[:, None, :] - lc)     # columns decayed to their sub-block end (<= 1)
        unsafe = tl.max(tl.max(tl.abs(lc), axis=2), axis=1) >= _SAFE_SPAN
        n_unsafe += tl.sum(unsafe.to(tl.int32), axis=0)
        kd = tl.where(unsafe[:, None, None], 0.0, k3 * tl.exp(tl.minimum(-lc, _SAFE_SPAN)))
        a0, p0 = _row_block(0, rr, xx, kend, kd, p_ex, p_in, a0, p0, PREC)
        a1, p1 = _row_block(1, rr, xx, kend, kd, p_ex, p_in, a1, p1, PREC)
        a2, p2 = _row_block(2, rr, xx, kend, kd, p_ex, p_in, a2, p2, PREC)
        a3, p3 = _row_block(3, rr, xx, kend, kd, p_ex, p_in, a3, p3, PREC)
        eg = tl.exp(p_ex)[:, None, :]
        _store2(QG + base * D, xx * eg * scale, cols, D)
        _store2(wb, rr * eg * b3, cols, D)
        g_c = tl.sum(s, axis=0)
        _store2(KG + base * D, kend * tl.exp(g_c[None, :] - p_in)[:, None, :], cols, D)
        tl.store(GL + (n.to(tl.int64) * H + h) * D + cols, g_c)
    if n_unsafe > 0:  # rare (|g| > ~4 per token over a whole sub-block): exact diagonal blocks
        for kb in range(0, D, BK):
            cols = kb + tl.arange(0, BK)
            lc = tl.cumsum(_gated3(g, t0, L, s_g, cols, dtb, a_h, lower_bound, GATE, HAS_BIAS), axis=1)
            unsafe = (tl.max(tl.max(tl.abs(lc), axis=2), axis=1) >= _SAFE_SPAN).to(tl.int32)
            k3, q3 = _load3(k, t0, L, s_k, cols), _load3(q, t0, L, s_q, cols)
            a0, p0 = _diag_exact(0, k3, q3, lc, unsafe, a0, p0)
            a1, p1 = _diag_exact(1, k3, q3, lc, unsafe, a1, p1)
            a2, p2 = _diag_exact(2, k3, q3, lc, unsafe, a2, p2)
            a3, p3 = _diag_exact(3, k3, q3, lc, unsafe, a3, p3)
    aq = AQK + base * 64
    cc = tl.arange(0, 64)
    tl.store(aq + tl.arange(0, BC)[:, None] * 64 + cc[None, :], (_mask_rows(p0, 0, beta, t0, L, s_b, True) * scale).to(aq.dtype.element_ty))
    tl.store(aq + (16 + tl.arange(0, BC))[:, None] * 64 + cc[None, :], (_mask_rows(p1, 1, beta, t0, L, s_b, True) * scale).to(aq.dtype.element_ty))
    tl.store(aq + (32 + tl.arange(0, BC))[:, None] * 64 + cc[None, :], (_mask_rows(p2, 2, beta, t0, L, s_b, True) * scale).to(aq.dtype.element_ty))
    tl.store(aq + (48 + tl.arange(0, BC))[:, None] * 64 + cc[None, :], (_mask_rows(p3, 3, beta, t0, L, s_b, True) * scale).to(aq.dtype.element_ty))
    a0, a1 = _mask_rows(a0, 0, beta, t0, L, s_b, False), _mask_rows(a1, 1, beta, t0, L, s_b, False)
    a2, a3 = _mask_rows(a2, 2, beta, t0, L, s_b, False), _mask_rows(a3, 3, beta, t0, L, s_b, False)
    # ---- L^-1 by row blocks: Li_a = (I + A_aa)^-1 (E_a - sum_{m<a} A_am Li_m), E_a = rows a of I
    ii = tl.arange(0, BC)
    l0 = tl.dot(_inv_unit_lower(_sub(a0, 0), PREC), (cc[None, :] == ii[:, None]).to(tl.float32), input_precision=PREC)
    t = (cc[None, :] == 16 + ii[:, None]).to(tl.float32) - tl.dot(_sub(a1, 0), l0, input_precision=PREC)
    l1 = tl.dot(_inv_unit_lower(_sub(a1, 1), PREC), t, input_precision=PREC)
    t = (cc[None, :] == 32 + ii[:, None]).to(tl.float32) - tl.dot(_sub(a2, 0), l0, input_precision=PREC)
    t -= tl.dot(_sub(a2, 1), l1, input_precision=PREC)
    l2 = tl.dot(_inv_unit_lower(_sub(a2, 2), PREC), t, input_precision=PREC)
    t = (cc[None, :] == 48 + ii[:, None]).to(tl.float32) - tl.dot(_sub(a3, 0), l0, input_precision=PREC)
    t -= tl.dot(_sub(a3, 1), l1, input_precision=PREC) + tl.dot(_sub(a3, 2), l2, input_precision=PREC)
    l3 = tl.dot(_inv_unit_lower(_sub(a3, 3), PREC), t, input_precision=PREC)
    tl.debug_barrier()  # X (written by other threads in pass 1) is read back below
    # ---- pass 2: W = L^-1 X in place, U = L^-1 (beta v)
    for kb in range(0, D, BK):
        cols = kb + tl.arange(0, BK)
        x = _load2(wb, 0, 64, D, cols)
        tl.debug_barrier()
        _st(wb, 0, cols, D, tl.dot(l0, x, input_precision=PREC))
        _st(wb, 16, cols, D, tl.dot(l1, x, input_precision=PREC))
        _st(wb, 32, cols, D, tl.dot(l2, x, input_precision=PREC))
        _st(wb, 48, cols, D, tl.dot(l3, x, input_precision=PREC))
    b64 = tl.reshape(b3, [64, 1])
    for vb in range(0, DV, BV):
        cols = vb + tl.arange(0, BV)
        y = _load2(v, t0, L, s_v, cols) * b64
        ub = U + base * DV
        _st(ub, 0, cols, DV, tl.dot(l0, y, input_precision=PREC))
        _st(ub, 16, cols, DV, tl.dot(l1, y, input_precision=PREC))
        _st(ub, 32, cols, DV, tl.dot(l2, y, input_precision=PREC))
        _st(ub, 48, cols, DV, tl.dot(l3, y, input_precision=PREC))


@triton.jit
def _st(base, r0, cols, ld, val):
    rows = r0 + tl.arange(0, BC)
    tl.store(base + rows[:, None] * ld + cols[None, :], val.to(base.dtype.element_ty))


@triton.jit
def _kda_state_kernel(W, U, QG, KG, AQK, GL, o, s_o, state, slots, chunk_start, chunk_len, req_chunks,
                      CK, ck_index, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                      HAS_CK: tl.constexpr, PREC: tl.constexpr):
    r, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + r).to(tl.int64)
    c_lo, c_hi = tl.load(req_chunks + r).to(tl.int64), tl.load(req_chunks + r + 1).to(tl.int64)
    dk = tl.arange(0, D)
    cv = vb * BV + tl.arange(0, BV)
    rows = tl.arange(0, 64)
    sp = state + ((slot * H + h) * D + dk[:, None]) * DV + cv[None, :]
    S = tl.load(sp).to(tl.float32)
    for c in range(c_lo, c_hi):
        base = c * H + h  # int64: the loop bounds are
        t0 = tl.load(chunk_start + c).to(tl.int64)
        L = tl.load(chunk_len + c)
        w = tl.load(W + (base * 64 + rows[:, None]) * D + dk[None, :])
        qg = tl.load(QG + (base * 64 + rows[:, None]) * D + dk[None, :])
        kg = tl.load(KG + (base * 64 + rows[:, None]) * D + dk[None, :])
        u = tl.load(U + (base * 64 + rows[:, None]) * DV + cv[None, :]).to(tl.float32)
        aqk = tl.load(AQK + (base * 64 + rows[:, None]) * 64 + rows[None, :])
        gl = tl.exp(tl.load(GL + base * D + dk))
        sd = S.to(w.dtype)
        d = u - tl.dot(w, sd, input_precision=PREC)
        dd = d.to(w.dtype)
        out = tl.dot(aqk, dd, tl.dot(qg, sd, input_precision=PREC), input_precision=PREC)
        tl.store(o + (t0 + rows)[:, None] * s_o + h * DV + cv[None, :], out.to(o.dtype.element_ty),
                 mask=(rows < L)[:, None])
        S = S * gl[:, None] + tl.dot(tl.trans(kg), dd, input_precision=PREC)
        if HAS_CK:
            ci = tl.load(ck_index + c)
            if ci >= 0:
                tl.store(CK + ((ci.to(tl.int64) * H + h) * D + dk[:, None]) * DV + cv[None, :], S)
    tl.store(sp, S.to(state.dtype.element_ty))


# ---------------------------------------------------------------------------------- host side
def _device_chunk_table(cu: torch.Tensor, n_tokens: int):
    """Chunks cut every 64 tokens from each request's start, built on the device (no host sync):
    (chunk_start[N], chunk_len[N] (0 for the unused tail of the upper bound N), req_chunks[R+1])."""
    R = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    req_chunks = torch.zeros(R + 1, dtype=torch.int64, device=cu.device)
    req_chunks[1:] = torch.cumsum((lens + CHUNK - 1) // CHUNK, 0)
    n_max = max(1, (n_tokens + (CHUNK - 1) * R) // CHUNK)  # >= sum_r ceil(len_r / 64)
    idx = torch.arange(n_max, device=cu.device)
    req = torch.searchsorted(req_chunks[1:].contiguous(), idx, right=True).clamp(max=max(R - 1, 0))
    start = cu[req] + (idx - req_chunks[req]) * CHUNK
    length = torch.where(idx < req_chunks[-1], torch.clamp(cu[req + 1] - start, max=CHUNK), 0)
    return start.to(torch.int32), length.to(torch.int32), req_chunks.to(torch.int32)


def _host_chunk_table(cu: list[int], positions: list[list[int]], device):
    """Chunks cut at every requested checkpoint position too; ck_index[c] = checkpoint written after
    chunk c (-1: none). Returns the table and, per request, the checkpoint row of each position."""
    starts, lens, ck, req_chunks, rows_of = [], [], [], [0], []
    n_ck = 0
    for r in range(len(cu) - 1):
        n = cu[r + 1] - cu[r]
        pos = [int(p) for p in positions[r]]
        bad = [p for p in pos if not 0 < p <= n]
        if bad:
            raise ValueError(f"kda_prefill: checkpoint positions {bad} of request {r} not in 1..{n} "
                             f"(position 0 is the initial state: read the pool row)")
        cut_row = {}
        seg = 0
        for cut in sorted(set(pos)):
            for s in range(seg, cut, CHUNK):
                starts.append(cu[r] + s)
                lens.append(min(CHUNK, cut - s))
                ck.append(-1)
            ck[-1], cut_row[cut] = n_ck, n_ck
            n_ck, seg = n_ck + 1, cut
        for s in range(seg, n, CHUNK):
            starts.append(cu[r] + s)
            lens.append(min(CHUNK, n - s))
            ck.append(-1)
        req_chunks.append(len(starts))
        rows_of.append([cut_row[p] for p in pos])
    t = lambda x: torch.tensor(x or [0], dtype=torch.int32, device=device)  # noqa: E731
    return t(starts), t(lens if lens else [0]), t(req_chunks), t(ck), n_ck, rows_of


def _heads_view(x: torch.Tensor, T: int, H: int, D: int, what: str) -> torch.Tensor:
    """[T, H, D] (or [T, H*D]) with unit stride inside a token; returns it with its token stride."""
    if x.numel() != T * H * D:
        raise ValueError(f"kda_prefill: {what} has shape {tuple(x.shape)}, expected [{T}, {H}, {D}]")
    x = x.reshape(T, H * D)
    return x if x.stride(1) == 1 else x.contiguous()


def kda_prefill(q, k, v, g, beta, state, state_slot, cu_seqlens, scale: float, *, checkpoint_positions=None,
                f=None, A_log=None, dt_bias=None, lower_bound=None, config: dict | None = None):
    """Chunked KDA over a ragged batch (semantics of `ir.ref.kda.kda_chunked`), pool updated in place.

    q, k: [T, H, D] (L2-normalised), v: [T, H, Dv], g: [T, H, D] log decay (<= 0), beta: [T, H],
    state: pool [S, H, D, Dv], state_slot: [R] (distinct), cu_seqlens: [R+1]. Returns o [T, H, Dv].
    Fused gate: pass g=None and f [T, H*D] (raw), A_log [H], dt_bias [H*D] or None, lower_bound
    (float: K3 sigmoid gate; None: Kimi-Linear softplus gate).
    checkpoint_positions: one list per request of token counts p (1 <= p <= len_r); then returns
    (o, [states_r [len(positions_r), H, D, Dv] fp32]) with the state after the first p tokens.
    """
    T, H, D = q.shape
    Dv = v.shape[-1]
    R = state_slot.numel()
    cfg = dict(heuristic({"H": H, "D": D, "Dv": Dv}, "cuda" if q.is_cuda else "cpu"), **(config or {}))
    gate_mode = 0 if g is not None else (1 if lower_bound is not None else 2)
    graw = g if g is not None else f
    if graw is None:
        raise ValueError("kda_prefill: pass g, or the raw gate input f with A_log (fused gate)")
    qv, kv_, vv = (_heads_view(x, T, H, d, n) for x, d, n in ((q, D, "q"), (k, D, "k"), (v, Dv, "v")))
    gv = _heads_view(graw, T, H, D, "g" if g is not None else "f")
    bv = beta.reshape(T, H)
    low = q.dtype in (torch.bfloat16, torch.float16)
    ws_dt, prec = (q.dtype, "tf32") if low else (torch.float32, "ieee")
    dev = q.device
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    if checkpoint_positions is None:
        starts, lens, req_chunks = _device_chunk_table(cu, T)
        ck_index, n_ck, rows_of = lens, 0, None
    else:
        if len(checkpoint_positions) != R:
            raise ValueError(f"kda_prefill: checkpoint_positions needs one list per request ({R}), "
                             f"got {len(checkpoint_positions)}")
        starts, lens, req_chunks, ck_index, n_ck, rows_of = _host_chunk_table(cu.tolist(), checkpoint_positions, dev)
    N = starts.numel()
    W = torch.empty(N, H, CHUNK, D, device=dev, dtype=ws_dt)
    QG, KG = torch.empty_like(W), torch.empty_like(W)
    U = torch.empty(N, H, CHUNK, Dv, device=dev, dtype=ws_dt)
    AQK = torch.empty(N, H, CHUNK, CHUNK, device=dev, dtype=ws_dt)
    GL = torch.empty(N, H, D, device=dev, dtype=torch.float32)
    dummy = torch.zeros(1, device=dev, dtype=torch.float32)
    alog = A_log if A_log is not None else dummy
    dtb = dt_bias if dt_bias is not None else dummy
    lb = float(lower_bound) if lower_bound is not None else 0.0
    _kda_intra_kernel[(N, H)](qv, kv_, vv, gv, bv, dtb, alog, starts, lens, W, U, QG, KG, AQK, GL,
                              qv.stride(0), kv_.stride(0), vv.stride(0), gv.stride(0), bv.stride(0),
                              float(scale), lb, H=H, D=D, DV=Dv, BK=min(cfg["BK"], D),
                              BV=min(cfg["BV_INTRA"], Dv), GATE=gate_mode, HAS_BIAS=dt_bias is not None,
                              PREC=prec, num_warps=cfg["WARPS_INTRA"])
    o = torch.empty(T, H, Dv, device=dev, dtype=q.dtype)
    CK = torch.empty(max(n_ck, 1), H, D, Dv, device=dev, dtype=torch.float32)
    slots = state_slot.to(device=dev, dtype=torch.int32)
    bv2 = min(cfg["BV"], Dv)
    if R > 0:
        _kda_state_kernel[(R, H, Dv // bv2)](W, U, QG, KG, AQK, GL, o, H * Dv, state, slots, starts, lens,
                                             req_chunks, CK, ck_index, H=H, D=D, DV=Dv, BV=bv2,
                                             HAS_CK=n_ck > 0, PREC=prec, num_warps=cfg["WARPS"],
                                             num_stages=cfg["STAGES"])
    if rows_of is None:
        return o
    return o, [CK[torch.tensor(rw, dtype=torch.int64, device=dev)] if rw else CK[:0] for rw in rows_of]


def kda_gate(f, A_log, dt_bias, lower_bound, block: int = 1024):
    """g [T, H, D] fp32 = kda_gate(f [T, H*D], A_log [H], dt_bias [H*D] | None) (see `ir.ref.kda`)."""
    T, P = f.shape
    H = A_log.numel()
    f2 = f if f.stride(1) == 1 else f.contiguous()
    g = torch.empty(T, H, P // H, device=f.device, dtype=torch.float32)
    n = T * P
    dtb = dt_bias if dt_bias is not None else A_log
    _kda_gate_kernel[(max(1, triton.cdiv(n, block)),)](
        f2, f2.stride(0), A_log, dtb, g, n, float(lower_bound) if lower_bound is not None else 0.0,
        P=P, D=P // H, BLOCK=block, GATE=1 if lower_bound is not None else 2, HAS_BIAS=dt_bias is not None)
    return g


# ---------------------------------------------------------------------------------- templates
def _dims(x, i):
    return int(x.shape[i])


def key_dims(a, attrs):
    return {"H": _dims(a.q, 1), "D": _dims(a.q, 2), "Dv": _dims(a.v, 2), "T": _dims(a.q, 0),
            "R": _dims(a.state_slot, 0)}


def bucket(key):
    return {**key, "T": pow2_bucket(key["T"], 64), "R": pow2_bucket(key["R"])}


def heuristic(key, target):
    """Big tiles on the CPU interpreter (cost is per program step); GPU: BV 32 so B=1, H=32 gives
    4 programs per head in the sequential kernel (128 programs on 132 SMs)."""
    D, Dv = key["D"], key["Dv"]
    if str(target).startswith("cpu"):
        return {"BK": D, "BV_INTRA": Dv, "WARPS_INTRA": 4, "BV": Dv, "WARPS": 4, "STAGES": 1}
    return {"BK": min(64, D), "BV_INTRA": min(64, Dv), "WARPS_INTRA": 4, "BV": min(32, Dv), "WARPS": 4,
            "STAGES": 2}


def constraints(config, key, target):
    out = []
    for name, dim in (("BK", "D"), ("BV_INTRA", "Dv"), ("BV", "Dv")):
        if config[name] > key[dim] or key[dim] % config[name]:
            out.append(f"{name}={config[name]} must divide {dim}={key[dim]}")
    return out


def _static_pow2(dim) -> int | None:
    try:
        d = int(dim)
    except TypeError:
        return None
    return d if d >= 16 and d & (d - 1) == 0 else None


def supports(a, attrs, target):
    D, Dv = _static_pow2(a.q.shape[2]), _static_pow2(a.v.shape[2])
    if D is None or Dv is None or D > 256 or Dv > 256:
        return f"head dims must be static powers of two in 16..256, got D={a.q.shape[2]}, Dv={a.v.shape[2]}"
    return None


def _launch_kda(a, attrs, config):
    o = kda_prefill(a.q, a.k, a.v, a.g, a.beta, a.state, a.state_slot, a.cu_seqlens, attrs["scale"], config=config)
    return o, a.state


def _launch_gate(a, attrs, config):
    return kda_gate(a.f, a.A_log, a.dt_bias, attrs.get("lower_bound"), block=config["BLOCK"])


TEMPLATES = [
    KernelTemplate(
        family="kda_prefill", backend="triton", ops=("kda",), launch=_launch_kda, key_dims=key_dims,
        heuristic=heuristic, bucket=bucket, constraints=constraints, supports=supports, batch_invariant=True,
        tunables=(Tunable("BK", (16, 32, 64)), Tunable("BV_INTRA", (32, 64)), Tunable("WARPS_INTRA", (2, 4, 8)),
                  Tunable("BV", (16, 32, 64)), Tunable("WARPS", (2, 4, 8)), Tunable("STAGES", (1, 2, 3))),
        doc="chunked (64) WY/UT KDA over ragged requests; form recurrent|chunked give the same result"),
    KernelTemplate(
        family="kda_gate", backend="triton", ops=("kda_gate",), launch=_launch_gate,
        key_dims=lambda a, attrs: {"P": _dims(a.f, 1), "T": _dims(a.f, 0)},
        heuristic=lambda key, target: {"BLOCK": 1024}, bucket=lambda key: {**key, "T": pow2_bucket(key["T"])},
        tunables=(Tunable("BLOCK", (256, 512, 1024, 2048)),), batch_invariant=True,
        doc="KDA forget gate in log space, both variants, fp32 output"),
]
