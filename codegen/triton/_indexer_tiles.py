"""Tile-level pieces of the DSA indexer (codegen/triton/indexer_topk.py, whose docstring has the math): the
query load, key-tile loads over the paged pool (FP8 or MXFP4, dequantised in registers), the tile scores
and their order-preserving 64-bit keys, the candidate choice per tile, and the two kernels built from
them: `_score_kernel` (grid rows x SPLITS: candidates + overflow witness per tile) and `_rescore_kernel`
(overflowed tiles rescored into `ext`, disjoint from their candidates)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._paging import row_offsets, rows_of
from ._pdl import pdl_enter
from ._topk_select import INVALID, _digit0, _low32, _rot32, _score_keys
from .mla_sparse import e2m1_to_f32, e8m0_to_f32


@triton.jit
def _load_q(q_ptr, w_ptr, qs_ptr, row, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
            KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr):
    """q^T operands ([DI, HP], or even/odd halves [DI/2, HP] for MXFP4) and per-head weights w*qs (fp32,
    formed here: no separate launch). DOT_DT fp8 (FP8 keys only): the e4m3 codes as they are (an fp8 x fp8
    tensor-core dot)."""
    h = tl.arange(0, HP)
    hm = h < HI
    wq = tl.load(w_ptr + row * HI + h, mask=hm, other=0.0).to(tl.float32) * \
        tl.load(qs_ptr + row * HI + h, mask=hm, other=0.0).to(tl.float32)
    qrow = q_ptr + row * HI * DI
    if KEY_FMT == 0:
        d = tl.arange(0, DI)
        qa = _fp8_as(tl.load(qrow + h[None, :] * DI + d[:, None], mask=hm[None, :], other=0.0), DOT_DT)
        qb = qa
    else:
        d = tl.arange(0, DI // 2)
        qa = _fp8_as(tl.load(qrow + h[None, :] * DI + 2 * d[:, None], mask=hm[None, :], other=0.0), DOT_DT)
        qb = _fp8_as(tl.load(qrow + h[None, :] * DI + 2 * d[:, None] + 1, mask=hm[None, :], other=0.0), DOT_DT)
    return qa, qb, wq


@triton.jit
def _row_query(q_ptr, w_ptr, qs_ptr, tbl_ptr, req_ptr, MB, row, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
               KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr):
    """(block-table row of the token's request, `_load_q`'s operands) of query row `row`."""
    qa, qb, wq = _load_q(q_ptr, w_ptr, qs_ptr, row, HI, DI, HP, KEY_FMT, DOT_DT)
    return tbl_ptr + tl.load(req_ptr + row) * MB, qa, qb, wq


@triton.jit
def _fp8_as(x, DT: tl.constexpr):
    """e4m3 codes (an fp8 load, or raw uint8 bytes in the interpreter) as DT (fp8 itself: no conversion)."""
    if x.dtype == tl.uint8:
        x = x.to(tl.float8e4nv, bitcast=True)
    if DT != tl.float8e4nv:
        x = x.to(DT)
    return x


@triton.jit
def _tile_load(k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, start, DI: tl.constexpr, BLOCK_N: tl.constexpr,
               KEY_FMT: tl.constexpr, LOG_BS: tl.constexpr):
    """Stored bytes of positions start .. start+BLOCK_N-1 (>= ctx read nothing): (codes, scales, p, valid).
    Pool rows through the block table (`rows_of`), element offsets through the pools' strides
    (`row_offsets`: flat pools or block views). FP8: codes [BLOCK_N, DI] (one contiguous DI-byte read per
    row) and fp32 scales; MXFP4: E2M1 pairs [BLOCK_N, DI/2] and E8M0 scale bytes broadcast to [BLOCK_N, DI/2]."""
    p = (start + tl.arange(0, BLOCK_N)).to(tl.int32)
    valid = p < ctx
    rows = rows_of(tblrow, p, valid, LOG_BS)
    ko = row_offsets(rows, LOG_BS, k_sb, k_sr)
    so = row_offsets(rows, LOG_BS, s_sb, s_sr)
    if KEY_FMT == 0:
        d = tl.arange(0, DI)
        kt = tl.load(k_ptr + ko[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        ks = tl.load(ks_ptr + so, mask=valid, other=0.0)
    else:
        d = tl.arange(0, DI // 2)
        kt = tl.load(k_ptr + ko[:, None] + d[None, :], mask=valid[:, None], other=0)
        ks = tl.load(ks_ptr + so[:, None] + (d // 16)[None, :], mask=valid[:, None], other=127)
    return kt, ks, p, valid


@triton.jit
def _tile_score(qa, qb, wq, kt, ks, p, valid, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr, IMPRECISE: tl.constexpr):
    """Keys (`_score_keys`) of a tile loaded by `_tile_load` (invalid positions are INVALID)."""
    return _score_keys(_tile_sums(qa, qb, wq, kt, ks, KEY_FMT, DOT_DT, IMPRECISE), p, valid)


@triton.jit
def _tile_sums(qa, qb, wq, kt, ks, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr, IMPRECISE: tl.constexpr):
    """fp32 scores [BLOCK_N] of a tile loaded by `_tile_load`: ks * sum_j wq_j ReLU(q8_j . k8) (FP8), or the
    MXFP4 keys dequantised in registers and dotted with the even / odd query halves."""
    if KEY_FMT == 0:
        if DOT_DT == tl.float8e4nv:   # FP8 tensor cores; IMPRECISE: K-steps summed before an exact fp32 add
            acc = tl.dot(_fp8_as(kt, DOT_DT), qa, max_num_imprecise_acc=IMPRECISE)          # [BLOCK_N, HP]
        else:
            acc = tl.dot(_fp8_as(kt, DOT_DT), qa)
        s = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], 1) * ks
    else:
        sc = e8m0_to_f32(ks)
        lo = (e2m1_to_f32(kt & 15) * sc).to(DOT_DT)
        hi = (e2m1_to_f32(kt >> 4) * sc).to(DOT_DT)
        acc = tl.dot(lo, qa) + tl.dot(hi, qb)
        s = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], 1)
    return s


@triton.jit
def _tile_keys(qa, qb, wq, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, start, DI: tl.constexpr,
               BLOCK_N: tl.constexpr, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr, LOG_BS: tl.constexpr,
               IMPRECISE: tl.constexpr):
    """Keys of positions start .. start+BLOCK_N-1: `_tile_load` then `_tile_score`."""
    kt, ks, p, valid = _tile_load(k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, start, DI, BLOCK_N, KEY_FMT,
                                  LOG_BS)
    return _tile_score(qa, qb, wq, kt, ks, p, valid, KEY_FMT, DOT_DT, IMPRECISE)


@triton.jit
def _candidates(key, BLOCK_N: tl.constexpr, KT: tl.constexpr, CAND: tl.constexpr):
    """(KT candidates of a tile in position order, overflow witness). CAND 0: the tile's KT best
    (tl.topk, a bitonic sort), witness = the KT-th best. CAND 1: the best two of each group of
    BLOCK_N/(KT/2) consecutive positions (three max reductions), witness = the best unsent key (the
    largest third-best): no unsent key can be selected unless the witness is."""
    if CAND == 0:
        top = tl.topk(key, KT)
        witness = tl.min(top, 0)
        cand = _rot32(tl.sort(_rot32(top), descending=True))
    else:
        NG: tl.constexpr = KT // 2
        k2 = tl.reshape(key, [NG, BLOCK_N // NG])
        m1 = tl.max(k2, 1)
        k2 = tl.where(k2 == m1[:, None], INVALID, k2)
        m2 = tl.max(k2, 1)
        witness = tl.max(tl.max(tl.where(k2 == m2[:, None], INVALID, k2), 1), 0)   # best unsent key
        m1_first = (m1 & _low32()) >= (m2 & _low32())        # larger low half = lower position
        cand = tl.reshape(tl.join(tl.where(m1_first, m1, m2), tl.where(m1_first, m2, m1)), [KT])
    return cand, witness


@triton.jit
def _score_kernel(q_ptr, w_ptr, qs_ptr, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tbl_ptr, req_ptr, MB, pos_ptr, cand_ptr,
                  tmin_ptr, hist_ptr, NT, TOPK, SPLITS, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
                  BLOCK_N: tl.constexpr, KT: tl.constexpr, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr,
                  LOG_BS: tl.constexpr, CAND: tl.constexpr, IMPRECISE: tl.constexpr, PREFETCH: tl.constexpr,
                  HIST: tl.constexpr, PDL: tl.constexpr):
    """Program (row, split) scores tiles split, split + SPLITS, ... of its row's context, and counts its
    candidates by their top 11 key bits into the row's histogram (the merge's first radix digit).
    PREFETCH 1: the next tile's bytes are requested before this tile's dots (two tiles in flight per
    program: the block-table gather defeats the compiler's own pipelining of these loads).
    HIST 1: the program's candidates are counted in a private 2048-bin histogram (tl.histogram per tile,
    summed in registers) and added to the row's once, its nonzero bins only, instead of one global atomic
    per candidate (scores cluster in a few top-11-bit bins: those atomics hit the same addresses)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx > TOPK:
        tblrow, qa, qb, wq = _row_query(q_ptr, w_ptr, qs_ptr, tbl_ptr, req_ptr, MB, row, HI, DI, HP, KEY_FMT, DOT_DT)
        n_tiles = tl.cdiv(ctx, BLOCK_N)
        crow = cand_ptr + row.to(tl.int64) * NT * KT
        hacc = tl.zeros([2048], tl.int32)
        if PREFETCH:
            nkt, nks, np_, nv = _tile_load(k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, split * BLOCK_N, DI,
                                           BLOCK_N, KEY_FMT, LOG_BS)
        for tile in range(split, n_tiles, SPLITS):
            if PREFETCH:   # this tile's bytes were requested a tile ago; request the next tile's now
                kt, ks, p, valid = nkt, nks, np_, nv
                nkt, nks, np_, nv = _tile_load(k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx,
                                               (tile + SPLITS) * BLOCK_N, DI, BLOCK_N, KEY_FMT, LOG_BS)
                key = _tile_score(qa, qb, wq, kt, ks, p, valid, KEY_FMT, DOT_DT, IMPRECISE)
            else:
                key = _tile_keys(qa, qb, wq, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, tile * BLOCK_N, DI,
                                 BLOCK_N, KEY_FMT, DOT_DT, LOG_BS, IMPRECISE)
            if KT < BLOCK_N:
                key, witness = _candidates(key, BLOCK_N, KT, CAND)
                tl.store(tmin_ptr + row.to(tl.int64) * NT + tile, witness)
            tl.store(crow + tile * KT + tl.arange(0, KT), key)
            if HIST:
                hacc += tl.histogram(_digit0(key), 2048, mask=key != INVALID)
            else:
                tl.atomic_add(hist_ptr + row * 2048 + _digit0(key), 1, mask=key != INVALID, sem="relaxed")
        if HIST:
            tl.atomic_add(hist_ptr + row * 2048 + tl.arange(0, 2048), hacc, mask=hacc > 0, sem="relaxed")


@triton.jit
def _rescore_kernel(q_ptr, w_ptr, qs_ptr, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tbl_ptr, req_ptr, MB, pos_ptr,
                    ovf_ptr, novf_ptr, ext_ptr,
                    MAX_OVF, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
                    BLOCK_N: tl.constexpr, KT: tl.constexpr, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr,
                    LOG_BS: tl.constexpr, IMPRECISE: tl.constexpr, CAND: tl.constexpr, PDL: tl.constexpr):
    """Program (row, i) rescores overflowed tiles i, i + P, ... of the row (P = programs per row) and
    stores in `ext` the tile's keys that were NOT candidates (the score pass's choice, recomputed: CAND 0
    keys below the KT-th best, CAND 1 keys below the second best of their group), so that candidates and
    `ext` are disjoint and the candidate rows stay as written (the compacted rows of `_filter_kernel` too)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    n_ovf = tl.load(novf_ptr + row)
    if tl.program_id(1) < n_ovf:
        ctx = tl.load(pos_ptr + row) + 1
        tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
        qa, qb, wq = _load_q(q_ptr, w_ptr, qs_ptr, row, HI, DI, HP, KEY_FMT, DOT_DT)
        for i in range(tl.program_id(1), n_ovf, tl.num_programs(1)):
            tile = tl.load(ovf_ptr + row * MAX_OVF + i)
            key = _tile_keys(qa, qb, wq, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, tile * BLOCK_N, DI,
                             BLOCK_N, KEY_FMT, DOT_DT, LOG_BS, IMPRECISE)
            if CAND == 0:
                rest = tl.where(key >= tl.min(tl.topk(key, KT), 0), INVALID, key)
            else:
                NG: tl.constexpr = KT // 2
                k2 = tl.reshape(key, [NG, BLOCK_N // NG])
                m1 = tl.max(k2, 1)
                m2 = tl.max(tl.where(k2 == m1[:, None], INVALID, k2), 1)
                rest = tl.reshape(tl.where(k2 >= m2[:, None], INVALID, k2), [BLOCK_N])
            tl.store(ext_ptr + (row.to(tl.int64) * MAX_OVF + i) * BLOCK_N + tl.arange(0, BLOCK_N), rest)
