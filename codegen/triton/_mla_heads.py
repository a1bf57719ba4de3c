"""ORIENT 1 of the absorbed MLA decode (mla_sparse.py): `_mla_heads_kernel`, the heads-major kernel the
heuristic picks for FP8 latent pools (ORIENT 0, rows-major, is _mla_rows.py). The math, grid and the partial
layout are in mla_sparse's docstring; row gathers, and dequantisation are _mla_tiles.py's.
Launched by `mla_sparse.sparse_latent_attention`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._mla_tiles import (_fp8_to, _k_pe, _k_pe_raw, _program_span, _rows_at, _softmax_tail, _sub_deq, _sub_raw,
                         _sub_tile)
from ._pdl import pdl_enter


@triton.jit
def _pow2_scale(amax, TOP: tl.constexpr = 13):
    """(2^n, 2^-n) per element of amax >= 0, n = TOP - floor(log2 amax) clamped to [-126, 126] (so amax * 2^n lies
    in [2^TOP, 2^(TOP+1)): 13 stays below fp16's 65504, 7 below e4m3's 448), built from the exponent bits (exact;
    amax 0 or subnormal: n = 126)."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    n = tl.minimum(tl.maximum(TOP - e, -126), 126)
    return ((n + 127) << 23).to(tl.float32, bitcast=True), ((127 - n) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_to_f16(x):
    """e4m3 codes (fp8 or uint8 tensor) -> fp16 with `cvt.rn.f16x2.e4m3x2` (sm_89+), 4 codes per instance: exact.
    Opaque to the compiler, so the tile is widened in the layout it was loaded in and only 16-bit tiles are
    re-laid out for the dots (the compiler's own conversion is moved after the re-layout, which for a
    transposed 8-bit operand means byte-wise shared-memory loads)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _mla_heads_kernel(qa_ptr, qp_ptr, lat_ptr, idx_ptr, tbl_ptr, req_ptr, MB, pos_ptr, o_ptr, lse_ptr,
                      H, KSEL, NSPLIT, CHUNK, sb, sr, qk_scale, v_scale, pe_scale,
                      KV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      FMT: tl.constexpr, SPARSE: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,
                      PAGED: tl.constexpr, LOG_BS: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                      QSCALE: tl.constexpr = 0, CVT: tl.constexpr = 0, LSUM: tl.constexpr = 0):
    """ORIENT 1 (heads-major): the program's BLOCK_H heads are the M dimension of both dots, the
    BLOCK_N context rows of a step the N (logits) and K (values) dimension, one pass per step:
        S = [q~ ; q_pe] [c_KV ; k_pe]^T   [BLOCK_H, BLOCK_N]  (q~ and q_pe held in registers, loaded once)
        acc = alpha acc + P c_KV          [BLOCK_H, KV]       (the dequantised tile serves both dots)
    Each row's stored bytes are read once (one gather per step, dequantised in registers); the
    accumulator is BLOCK_H x KV fp32 whatever BLOCK_N is, so short steps keep registers low and a
    step's loads can be software-pipelined (num_stages) or prefetched by hand (PREFETCH 2: the next step's
    stored bytes are loaded into registers before this step's dots, its rows resolved two steps ahead, so
    no gather waits on an index read and every byte is in flight while the previous step computes). The grid's third axis splits a token's rows
    (selected rows, or its causal context) into CHUNK-row pieces merged by `_combine_kernel`; with one
    piece the program writes the final o~ (in o_ptr's dtype) and lse itself. Same partial layout and
    numerics contract as `_mla_sparse_kernel` (fp32 accumulation, exp2 online softmax).
    QSCALE 1 (the launcher's F16 option: DOT_DT fp16 for FP8 / NVFP4 pools, whose codes are exact in fp16 and
    convert in one instruction per pair, where bf16 takes a detour through fp32): each head's q~ and q_pe are
    multiplied by powers of two 2^n (`_pow2_scale`: max |q| * 2^n in [2^13, 2^14), no fp16 overflow, 11
    significant bits kept) before the conversion, and the head's logits by 2^-n after the dots (exact).
    CVT 1 (F16 on an FP8 pool, GPU): rows widened by `_e4m3_to_f16` right after the load.
    LSUM 1: the softmax denominators are kept per (head, row lane) and summed over the lanes once after the loop,
        l[h, n] = alpha_h l[h, n] + p[h, n],   l_h = sum_n l[h, n]
    (the same sum in another order; a step then reduces over its rows only for the maximum, one cross-warp
    reduction instead of two)."""
    pdl_enter(PDL)
    t, h, hm, th, sp, tblrow, start, end = _program_span(pos_ptr, tbl_ptr, req_ptr, MB, H, KSEL, CHUNK, BLOCK_H,
                                                         SPARSE)
    k = tl.arange(0, KV)
    r = tl.arange(0, DR)
    qa = tl.load(qa_ptr + th[:, None] * KV + k[None, :], mask=hm[:, None], other=0.0)   # [BLOCK_H, KV]
    qp = tl.load(qp_ptr + th[:, None] * DR + r[None, :], mask=hm[:, None], other=0.0)   # [BLOCK_H, DR]
    if QSCALE:   # per-head factors of the two dots: the scales times 2^-n of each head's query scaling
        up, down = _pow2_scale(tl.max(tl.abs(qa.to(tl.float32)), 1))
        qa = (qa.to(tl.float32) * up[:, None]).to(DOT_DT)
        sa = v_scale * down[:, None]
        up, down = _pow2_scale(tl.max(tl.abs(qp.to(tl.float32)), 1))
        qp = (qp.to(tl.float32) * up[:, None]).to(DOT_DT)
        spe = pe_scale * down[:, None]
    else:
        qa = qa.to(DOT_DT)
        qp = qp.to(DOT_DT)
        sa = v_scale
        spe = pe_scale
    acc = tl.zeros([BLOCK_H, KV], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    if LSUM:
        l_i = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if PREFETCH >= 1:
        nro, nvalid = _rows_at(idx_ptr, t, KSEL, start, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED, LOG_BS)
    if PREFETCH == 2:   # this step's bytes in flight one step ahead, its rows resolved two steps ahead
        xn, sn = _sub_raw(lat_ptr, nro, nvalid, 0, KV, KV, FMT, "")
        kn = _k_pe_raw(lat_ptr, nro, nvalid, KV, DR, FMT)
        vn = nvalid
        nro, nvalid = _rows_at(idx_ptr, t, KSEL, start + BLOCK_N, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED, LOG_BS)
    for j in range(start, end, BLOCK_N):
        if PREFETCH == 2:
            x, xs, kr, valid = xn, sn, kn, vn
            xn, sn = _sub_raw(lat_ptr, nro, nvalid, 0, KV, KV, FMT, "")
            kn = _k_pe_raw(lat_ptr, nro, nvalid, KV, DR, FMT)
            vn = nvalid
            nro, nvalid = _rows_at(idx_ptr, t, KSEL, j + 2 * BLOCK_N, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED,
                                   LOG_BS)
            if CVT:
                c = _e4m3_to_f16(x)
                kp = _e4m3_to_f16(kr)
            else:
                c = _sub_deq(x, xs, KV, FMT, DOT_DT)
                kp = kr.to(DOT_DT) if FMT == 0 else _fp8_to(kr, DOT_DT)
        else:
            if PREFETCH == 1:   # this step's rows were resolved a step ago; request the next step's now
                ro, valid = nro, nvalid
                nro, nvalid = _rows_at(idx_ptr, t, KSEL, j + BLOCK_N, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED,
                                       LOG_BS)
            else:
                ro, valid = _rows_at(idx_ptr, t, KSEL, j, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED, LOG_BS)
            if CVT:
                x, xs = _sub_raw(lat_ptr, ro, valid, 0, KV, KV, FMT, "")
                c = _e4m3_to_f16(x)                                          # [BLOCK_N, KV]
                kp = _e4m3_to_f16(_k_pe_raw(lat_ptr, ro, valid, KV, DR, FMT))  # [BLOCK_N, DR]
            else:
                c = _sub_tile(lat_ptr, ro, valid, 0, KV, KV, FMT, DOT_DT, "")    # [BLOCK_N, KV]
                kp = _k_pe(lat_ptr, ro, valid, KV, DR, FMT, DOT_DT)            # [BLOCK_N, DR]
        s = tl.dot(qa, tl.trans(c), input_precision=PREC) * sa + tl.dot(qp, tl.trans(kp), input_precision=PREC) * spe
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        if LSUM:
            l_i = l_i * alpha[:, None] + p
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DT), c, input_precision=PREC)
        m_i = m_new
    if LSUM:
        l_i = tl.sum(l_i, 1)
    inv, lse = _softmax_tail(m_i, l_i, v_scale)
    tl.store(o_ptr + (th * NSPLIT + sp)[:, None] * KV + k[None, :], acc * inv[:, None], mask=hm[:, None])
    tl.store(lse_ptr + th * NSPLIT + sp, lse, mask=hm)
