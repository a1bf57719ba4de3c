"""ORIENT 0 of the absorbed MLA decode (mla_sparse.py): `_mla_sparse_kernel`, the rows-major kernel,
which the heuristic keeps for bf16 and NVFP4 latent pools (FP8 pools take mla_sparse's heads-major
`_mla_heads_kernel`). Same grid, partial layout and numerics as ORIENT 1 (one program per token, block of
BLOCK_H heads and CHUNK context entries; online softmax in fp32 with exp2; partials merged by
`_combine_kernel`); the math is in mla_sparse's docstring, the row gathers and dequantisation in
_mla_tiles.py. Only ORIENT 0 takes SUB (column blocks per row). Launched by
`mla_sparse.sparse_latent_attention`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._mla_tiles import _k_pe, _program_span, _rows_at, _softmax_tail, _sub_tile
from ._pdl import pdl_enter


@triton.jit
def _q_sub(qa_ptr, th, hm, kb: tl.constexpr, KB: tl.constexpr, KV: tl.constexpr, DOT_DT: tl.constexpr):
    """q~^T rows kb*KB .. (kb+1)*KB-1: [KB, BLOCK_H]."""
    d = kb * KB + tl.arange(0, KB)
    return tl.load(qa_ptr + th[None, :] * KV + d[:, None], mask=hm[None, :], other=0.0).to(DOT_DT)


@triton.jit
def _mla_sparse_kernel(qa_ptr, qp_ptr, lat_ptr, idx_ptr, tbl_ptr, req_ptr, MB, pos_ptr, o_ptr, lse_ptr,
                       H, KSEL, NSPLIT, CHUNK, sb, sr, qk_scale, v_scale, pe_scale,
                       KV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       FMT: tl.constexpr, SPARSE: tl.constexpr, DOT_DT: tl.constexpr,
                       PREC: tl.constexpr, SUB: tl.constexpr, PAGED: tl.constexpr, LOG_BS: tl.constexpr,
                       PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """FMT 0: float pool, 1: fp8 pool, 2: nvfp4 pool; qk_scale = softmax scale * log2(e);
    logits = (q~.c) v_scale + (q_pe.k_pe) pe_scale, values c v_scale.
    Orientation: context rows are the M dimension of both dots (wgmma-sized), the few heads are N,
    so q~ sits in shared memory (an M = heads operand would be copied into every warp's registers).
    SUB = 1: whole rows per step (Triton pipelines the loads; bf16 pools). SUB = 4: the row is taken
    in four column blocks and read twice (logits pass, then a value pass that re-reads the bytes from
    L1/L2): a dequantised tile never has to live in registers whole.
    PREFETCH = 1: the next step's rows (selection entries, then block ids) are resolved one step ahead,
    so a step's gathers never wait on an index or block-table read. (A PREFETCH 2 that held the next
    step's bytes in registers ran 6x slower on the H200, 2026-11-29: spills; removed.)
    PAGED: context entries are request positions, mapped to pool rows through the token's block-table
    row; otherwise they are pool rows already (a selection of rows)."""
    pdl_enter(PDL)
    t, h, hm, th, sp, tblrow, start, end = _program_span(pos_ptr, tbl_ptr, req_ptr, MB, H, KSEL, CHUNK, BLOCK_H,
                                                         SPARSE)
    r = tl.arange(0, DR)
    qpT = tl.load(qp_ptr + th[None, :] * DR + r[:, None], mask=hm[None, :], other=0.0).to(DOT_DT)
    KB: tl.constexpr = KV // SUB
    acc0 = tl.zeros([KB, BLOCK_H], dtype=tl.float32)
    if SUB == 1:
        qaT = _q_sub(qa_ptr, th, hm, 0, KV, KV, DOT_DT)
    else:
        acc1 = tl.zeros([KB, BLOCK_H], dtype=tl.float32)
        acc2 = tl.zeros([KB, BLOCK_H], dtype=tl.float32)
        acc3 = tl.zeros([KB, BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if PREFETCH == 1:
        nro, nvalid = _rows_at(idx_ptr, t, KSEL, start, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED, LOG_BS)
    for j in range(start, end, BLOCK_N):
        if PREFETCH == 1:   # this step's rows were resolved a step ago; request the next step's now
            ro, valid = nro, nvalid
            nro, nvalid = _rows_at(idx_ptr, t, KSEL, j + BLOCK_N, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED, LOG_BS)
        else:
            ro, valid = _rows_at(idx_ptr, t, KSEL, j, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED, LOG_BS)
        kp = _k_pe(lat_ptr, ro, valid, KV, DR, FMT, DOT_DT)
        s = tl.dot(kp, qpT, input_precision=PREC) * pe_scale              # [BLOCK_N, BLOCK_H]
        if SUB == 1:
            c0 = _sub_tile(lat_ptr, ro, valid, 0, KV, KB, FMT, DOT_DT, "")
            sc = tl.dot(c0, qaT, input_precision=PREC)
        else:
            sc = tl.dot(_sub_tile(lat_ptr, ro, valid, 0, KV, KB, FMT, DOT_DT, "evict_last"),
                        _q_sub(qa_ptr, th, hm, 0, KB, KV, DOT_DT), input_precision=PREC)
            sc += tl.dot(_sub_tile(lat_ptr, ro, valid, 1, KV, KB, FMT, DOT_DT, "evict_last"),
                         _q_sub(qa_ptr, th, hm, 1, KB, KV, DOT_DT), input_precision=PREC)
            sc += tl.dot(_sub_tile(lat_ptr, ro, valid, 2, KV, KB, FMT, DOT_DT, "evict_last"),
                         _q_sub(qa_ptr, th, hm, 2, KB, KV, DOT_DT), input_precision=PREC)
            sc += tl.dot(_sub_tile(lat_ptr, ro, valid, 3, KV, KB, FMT, DOT_DT, "evict_last"),
                         _q_sub(qa_ptr, th, hm, 3, KB, KV, DOT_DT), input_precision=PREC)
        s = tl.where(valid[:, None], (s + sc * v_scale) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        pd = p.to(DOT_DT)
        if SUB == 1:
            acc0 = acc0 * alpha[None, :] + tl.dot(tl.trans(c0), pd, input_precision=PREC)
        else:
            c = _sub_tile(lat_ptr, ro, valid, 0, KV, KB, FMT, DOT_DT, "evict_first")
            acc0 = acc0 * alpha[None, :] + tl.dot(tl.trans(c), pd, input_precision=PREC)
            c = _sub_tile(lat_ptr, ro, valid, 1, KV, KB, FMT, DOT_DT, "evict_first")
            acc1 = acc1 * alpha[None, :] + tl.dot(tl.trans(c), pd, input_precision=PREC)
            c = _sub_tile(lat_ptr, ro, valid, 2, KV, KB, FMT, DOT_DT, "evict_first")
            acc2 = acc2 * alpha[None, :] + tl.dot(tl.trans(c), pd, input_precision=PREC)
            c = _sub_tile(lat_ptr, ro, valid, 3, KV, KB, FMT, DOT_DT, "evict_first")
            acc3 = acc3 * alpha[None, :] + tl.dot(tl.trans(c), pd, input_precision=PREC)
        m_i = m_new
    inv, lse = _softmax_tail(m_i, l_i, v_scale)
    ob = o_ptr + (th * NSPLIT + sp)[None, :] * KV
    kk = tl.arange(0, KB)[:, None]
    tl.store(ob + kk, acc0 * inv[None, :], mask=hm[None, :])
    if SUB != 1:
        tl.store(ob + KB + kk, acc1 * inv[None, :], mask=hm[None, :])
        tl.store(ob + 2 * KB + kk, acc2 * inv[None, :], mask=hm[None, :])
        tl.store(ob + 3 * KB + kk, acc3 * inv[None, :], mask=hm[None, :])
    tl.store(lse_ptr + th * NSPLIT + sp, lse, mask=hm)
