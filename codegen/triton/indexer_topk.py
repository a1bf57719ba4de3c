"""DSA indexer scorer + exact top-k (IR op `indexer_topk`, SPEC §5 steps 6-7), decode and prefill.

Math. Token i (request r, position p_i) scores the positions s <= p_i at their paged pool rows (`_paging.rows_of`):
    I(i, s) = sum_j w_j ReLU(deq(q_j) . deq(k_s)) = ks_s * sum_j (w_j qs_j) ReLU(q8_j . k8_s)
(FP8: power-of-two fp32 scales per (token, head) and per key row; fp8 values are exact in bf16, the
tensor-core dot accumulates in fp32). MXFP4 keys (E2M1, one E8M0 scale per 32 values, SPEC §7) are
dequantised in registers (exact in bf16) and dotted with the even/odd halves of q. Sel(i) = top-k by
(score desc, position asc), ascending, -1 padded; a context of <= topk positions selects all of it.

The [rows x context] score matrix never exists in memory. Each score becomes a unique 64-bit key
    key = (orderable(score) << 32) | (2^32 - 1 - position)            (signed int64 order)
whose order is exactly the selection order; four kernels:
 1. score    grid (rows, SPLITS): per tile of BLOCK_N positions, keys in registers; KT candidates in
             position order go to `cand[row, tile]`, an overflow witness to `tmin[row, tile]`:
             CAND 0: the tile's KT best (tl.topk), witness = the KT-th best;
             CAND 1: the best two of each of KT/2 groups of consecutive positions (max reductions, no
             sort), witness = the best unsent key. PREFETCH: next tile's bytes (and the block ids of
             the one after) in flight while a tile is scored.
 2. merge 1  grid (rows): theta = topk-th largest candidate, 8-bit radix select (tl.histogram, stops once
             the boundary bucket is taken whole). A tile whose witness is selected "overflowed" (it holds
             >= KT (CAND 1: 2) winners, so <= topk/KT (topk/2) tiles can). Without overflow the selected
             candidates ARE the exact top-k (an unsent element ranks at most its tile's witness < theta,
             with topk elements above theta); they are in position order, so compaction writes the
             ascending output directly.
 3. rescore  grid (rows, <= 16): overflowed tiles are rescored whole into `ext`, their candidates dropped.
 4. merge 2  rows that overflowed: radix select over candidates + ext, then one tl.sort.
Workspace per row 8 B x (NT*(KT+1) + (topk/KT)*BLOCK_N + pow2(topk)); prefill runs in row chunks.

API: `indexer_topk(...)` (positions: the IR op), `output="rows"` (the positions' pool rows, -1
padded: what attention kernels read), `key_format="mxfp4"`. Tunables: BLOCK_N, KT, SPLITS (programs
per row), CAND, PREFETCH, num_warps / num_stages (score kernel), MERGE_TILE. Batch invariant (each row
on its own).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from ..kernel import KernelTemplate, Tunable, pow2_bucket
from ._paging import paging_args, rows_of
from .mla_sparse import e2m1_to_f32, e8m0_to_f32

INVALID = tl.constexpr(-(2 ** 63))
WORKSPACE_BYTES = 1 << 28
RESCORE_PROGRAMS = 16   # programs per row rescoring overflowed tiles


@triton.jit
def _low32():  # an int64 constant (a bare 0xFFFFFFFF literal would be uint32)
    return tl.full([], 0xFFFFFFFF, tl.int64)


@triton.jit
def _score_keys(s, p, valid):
    """Unique int64 keys ordered like (score desc, position asc); invalid lanes get INVALID."""
    s = tl.where(s == 0.0, 0.0, s)                     # -0 -> +0 (they tie in the reference)
    bits = s.to(tl.int32, bitcast=True)
    ordv = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed int order == float order
    key = (ordv.to(tl.int64) << 32) | (_low32() - p.to(tl.int64))
    return tl.where(valid, key, INVALID)


@triton.jit
def _rot32(k):  # swap the 32-bit halves (an involution): orders by position, INVALID stays smallest
    return tl.where(k == INVALID, INVALID, (k << 32) | ((k >> 32) & _low32()))


@triton.jit
def _load_q(q_ptr, wq_ptr, row, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
            KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr):
    """q^T operands ([DI, HP], or even/odd halves [DI/2, HP] for MXFP4) and per-head weights w*qs."""
    h = tl.arange(0, HP)
    hm = h < HI
    wq = tl.load(wq_ptr + row * HI + h, mask=hm, other=0.0)
    qrow = q_ptr + row * HI * DI
    if KEY_FMT == 0:
        d = tl.arange(0, DI)
        qa = tl.load(qrow + h[None, :] * DI + d[:, None], mask=hm[None, :], other=0)
        qa = qa.to(tl.float8e4nv, bitcast=True).to(DOT_DT)
        qb = qa
    else:
        d = tl.arange(0, DI // 2)
        qa = tl.load(qrow + h[None, :] * DI + 2 * d[:, None], mask=hm[None, :], other=0)
        qb = tl.load(qrow + h[None, :] * DI + 2 * d[:, None] + 1, mask=hm[None, :], other=0)
        qa = qa.to(tl.float8e4nv, bitcast=True).to(DOT_DT)
        qb = qb.to(tl.float8e4nv, bitcast=True).to(DOT_DT)
    return qa, qb, wq


@triton.jit
def _tile_rows(tblrow, ctx, start, BLOCK_N: tl.constexpr, LOG_BS: tl.constexpr):
    """(pool rows, valid) of positions start .. start+BLOCK_N-1 (lanes >= ctx invalid: no table read)."""
    p = start + tl.arange(0, BLOCK_N)
    valid = p < ctx
    return rows_of(tblrow, p, valid, LOG_BS), valid


@triton.jit
def _tile_bytes(k_ptr, ks_ptr, rows, valid, DI: tl.constexpr, BLOCK_N: tl.constexpr, KEY_FMT: tl.constexpr):
    """Raw key bytes and scales of the rows (invalid lanes masked: no traffic). FP8: ([BLOCK_N, DI]
    codes, [BLOCK_N] fp32 scales); MXFP4: ([BLOCK_N, DI/2] E2M1 pairs, E8M0 scale bytes broadcast to
    [BLOCK_N, DI/2]). A tile covers whole table blocks (BLOCK_N >= block_size) or one block's
    contiguous part, so each key row's DI bytes are one contiguous read."""
    if KEY_FMT == 0:
        d = tl.arange(0, DI)
        kt = tl.load(k_ptr + rows[:, None] * DI + d[None, :], mask=valid[:, None], other=0)
        ks = tl.load(ks_ptr + rows, mask=valid, other=0.0)
    else:
        d = tl.arange(0, DI // 2)
        kt = tl.load(k_ptr + rows[:, None] * (DI // 2) + d[None, :], mask=valid[:, None], other=0)
        ks = tl.load(ks_ptr + rows[:, None] * (DI // 32) + (d // 16)[None, :], mask=valid[:, None], other=127)
    return kt, ks


@triton.jit
def _tile_score(kt, ks, qa, qb, wq, ctx, start, BLOCK_N: tl.constexpr, KEY_FMT: tl.constexpr,
                DOT_DT: tl.constexpr):
    """Keys (`_score_keys`) of the loaded tile; positions >= ctx are INVALID."""
    p = start + tl.arange(0, BLOCK_N)
    valid = p < ctx
    if KEY_FMT == 0:
        acc = tl.dot(kt.to(tl.float8e4nv, bitcast=True).to(DOT_DT), qa)          # [BLOCK_N, HP]
        s = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], 1) * ks
    else:
        sc = e8m0_to_f32(ks)
        lo = (e2m1_to_f32(kt & 15) * sc).to(DOT_DT)
        hi = (e2m1_to_f32(kt >> 4) * sc).to(DOT_DT)
        acc = tl.dot(lo, qa) + tl.dot(hi, qb)
        s = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], 1)
    return _score_keys(s, p, valid)


@triton.jit
def _tile_keys(qa, qb, wq, k_ptr, ks_ptr, tblrow, ctx, start, DI: tl.constexpr, BLOCK_N: tl.constexpr,
               KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr, LOG_BS: tl.constexpr):
    """Keys of positions start .. start+BLOCK_N-1 (>= ctx are INVALID)."""
    rows, valid = _tile_rows(tblrow, ctx, start, BLOCK_N, LOG_BS)
    kt, ks = _tile_bytes(k_ptr, ks_ptr, rows, valid, DI, BLOCK_N, KEY_FMT)
    return _tile_score(kt, ks, qa, qb, wq, ctx, start, BLOCK_N, KEY_FMT, DOT_DT)


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
def _score_kernel(q_ptr, wq_ptr, k_ptr, ks_ptr, tbl_ptr, req_ptr, MB, pos_ptr, cand_ptr, tmin_ptr, NT, TOPK, SPLITS,
                  HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr,
                  KT: tl.constexpr, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr, LOG_BS: tl.constexpr,
                  CAND: tl.constexpr, PREFETCH: tl.constexpr):
    """PREFETCH: the next tile's bytes are loaded (into registers) before this tile is scored, and the
    block ids of the tile after it are requested then too, so each program keeps a tile in flight while
    it computes and no key load waits on a block-table read (independent of the compiler's pipeliner)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx > TOPK:
        tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
        qa, qb, wq = _load_q(q_ptr, wq_ptr, row, HI, DI, HP, KEY_FMT, DOT_DT)
        n_tiles = tl.cdiv(ctx, BLOCK_N)
        crow = cand_ptr + row.to(tl.int64) * NT * KT
        if PREFETCH:
            rows, valid = _tile_rows(tblrow, ctx, split * BLOCK_N, BLOCK_N, LOG_BS)
            kt, ks = _tile_bytes(k_ptr, ks_ptr, rows, valid, DI, BLOCK_N, KEY_FMT)
            rows, valid = _tile_rows(tblrow, ctx, (split + SPLITS) * BLOCK_N, BLOCK_N, LOG_BS)
        for tile in range(split, n_tiles, SPLITS):
            if PREFETCH:   # keys of tile + SPLITS (rows known) in flight, block ids of tile + 2 SPLITS requested
                kc, sc = kt, ks
                kt, ks = _tile_bytes(k_ptr, ks_ptr, rows, valid, DI, BLOCK_N, KEY_FMT)
                rows, valid = _tile_rows(tblrow, ctx, (tile + 2 * SPLITS) * BLOCK_N, BLOCK_N, LOG_BS)
                key = _tile_score(kc, sc, qa, qb, wq, ctx, tile * BLOCK_N, BLOCK_N, KEY_FMT, DOT_DT)
            else:
                key = _tile_keys(qa, qb, wq, k_ptr, ks_ptr, tblrow, ctx, tile * BLOCK_N, DI, BLOCK_N, KEY_FMT,
                                 DOT_DT, LOG_BS)
            if KT < BLOCK_N:
                key, witness = _candidates(key, BLOCK_N, KT, CAND)
                tl.store(tmin_ptr + row.to(tl.int64) * NT + tile, witness)
            tl.store(crow + tile * KT + tl.arange(0, KT), key)


@triton.jit
def _rescore_kernel(q_ptr, wq_ptr, k_ptr, ks_ptr, tbl_ptr, req_ptr, MB, pos_ptr, cand_ptr, ovf_ptr, novf_ptr, ext_ptr,
                    NT, MAX_OVF, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
                    BLOCK_N: tl.constexpr, KT: tl.constexpr, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr,
                    LOG_BS: tl.constexpr):
    """Program (row, i) rescores overflowed tiles i, i + P, ... of the row (P = programs per row)."""
    row = tl.program_id(0)
    n_ovf = tl.load(novf_ptr + row)
    if tl.program_id(1) < n_ovf:
        ctx = tl.load(pos_ptr + row) + 1
        tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
        qa, qb, wq = _load_q(q_ptr, wq_ptr, row, HI, DI, HP, KEY_FMT, DOT_DT)
        for i in range(tl.program_id(1), n_ovf, tl.num_programs(1)):
            tile = tl.load(ovf_ptr + row * MAX_OVF + i)
            key = _tile_keys(qa, qb, wq, k_ptr, ks_ptr, tblrow, ctx, tile * BLOCK_N, DI, BLOCK_N, KEY_FMT, DOT_DT,
                             LOG_BS)
            tl.store(ext_ptr + (row.to(tl.int64) * MAX_OVF + i) * BLOCK_N + tl.arange(0, BLOCK_N), key)
            tl.store(cand_ptr + row.to(tl.int64) * NT * KT + tile * KT + tl.arange(0, KT),
                     tl.full([KT], INVALID, tl.int64))


@triton.jit
def _hist_pass(ptr, n, prefix, pmask, shift: tl.constexpr, TILE: tl.constexpr):
    """Histogram of the 8-bit digit at `shift` (unsigned order) of the valid keys matching prefix."""
    hist = tl.zeros([256], dtype=tl.int32)
    for off in range(0, n, TILE):
        o = off + tl.arange(0, TILE)
        m = o < n
        k = tl.load(ptr + o, mask=m, other=INVALID)
        match = m & (k != INVALID) & ((k & pmask) == prefix)
        d = ((k >> shift) & 255).to(tl.int32)
        if shift == 56:
            d = d ^ 128
        hist += tl.histogram(d, 256, mask=match)
    return hist


@triton.jit
def _collect(ptr, n, prefix, pmask, dst, cnt, tblrow, LIMIT, TILE: tl.constexpr, ROWS_OUT: tl.constexpr,
             LOG_BS: tl.constexpr):
    """Append (in stored order) the position (its pool row when ROWS_OUT) of every selected key to
    dst[cnt:]; returns cnt."""
    for off in range(0, n, TILE):
        o = off + tl.arange(0, TILE)
        m = o < n
        k = tl.load(ptr + o, mask=m, other=INVALID)
        sel = m & (k != INVALID) & ((k & pmask) >= prefix)
        c = tl.cumsum(sel.to(tl.int32), 0)
        at = cnt + c - 1
        pos = _low32() - (k & _low32())
        if ROWS_OUT:
            pos = rows_of(tblrow, pos, sel, LOG_BS)
        tl.store(dst + at, pos, mask=sel & (at < LIMIT))
        cnt += tl.sum(sel.to(tl.int32), 0)
    return cnt


@triton.jit
def _merge_kernel(cand_ptr, tmin_ptr, ext_ptr, ovf_ptr, novf_ptr, work_ptr, out_ptr, tbl_ptr, req_ptr, MB, pos_ptr,
                  NT, TOPK, MAX_OVF, BLOCK_N: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr,
                  PHASE: tl.constexpr, ROWS_OUT: tl.constexpr, TILE: tl.constexpr, LOG_BS: tl.constexpr):
    row = tl.program_id(0)
    ctx = tl.load(pos_ptr + row) + 1
    tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
    orow = out_ptr + row.to(tl.int64) * TOPK
    if PHASE == 1:
        n_ovf = tl.zeros([], tl.int32)
        active = ctx > TOPK
        if ctx <= TOPK:  # everything is selected
            for off in range(0, TOPK, TILE):
                j = off + tl.arange(0, TILE)
                jj = rows_of(tblrow, j, j < ctx, LOG_BS) if ROWS_OUT else j.to(tl.int64)
                tl.store(orow + j, tl.where(j < ctx, jj, -1), mask=j < TOPK)
    else:
        n_ovf = tl.load(novf_ptr + row)
        active = (ctx > TOPK) & (n_ovf > 0)
    if active:
        n_c = tl.cdiv(ctx, BLOCK_N) * KT
        crow = cand_ptr + row.to(tl.int64) * NT * KT
        erow = ext_ptr + row.to(tl.int64) * MAX_OVF * BLOCK_N
        n_e = n_ovf * BLOCK_N
        # ---- radix select of the TOPK-th largest key (8-bit digits, most significant first)
        prefix = tl.zeros([], tl.int64)
        pmask = tl.zeros([], tl.int64)
        need = TOPK + tl.zeros([], tl.int32)
        done = tl.zeros([], tl.int32)
        idx = tl.arange(0, 256)
        for p in tl.static_range(8):
            if done == 0:
                hist = _hist_pass(crow, n_c, prefix, pmask, 56 - 8 * p, TILE)
                if PHASE == 2:
                    hist += _hist_pass(erow, n_e, prefix, pmask, 56 - 8 * p, TILE)
                total = tl.sum(hist, 0)
                if total <= need:          # fewer valid keys than TOPK: select them all
                    done = tl.full([], 1, tl.int32)
                else:
                    suffix = total - tl.cumsum(hist, 0) + hist     # keys with digit >= idx
                    b = tl.sum((suffix >= need).to(tl.int32), 0) - 1
                    cnt_b = tl.sum(tl.where(idx == b, hist, 0), 0)
                    need -= tl.sum(tl.where(idx == b, suffix, 0), 0) - cnt_b
                    bits = b ^ 128 if p == 0 else b
                    prefix = prefix | (bits.to(tl.int64) << (56 - 8 * p))
                    pmask = pmask | (tl.full([], 255, tl.int64) << (56 - 8 * p))
                    done = (cnt_b == need).to(tl.int32)
        if PHASE == 1:
            if KT < BLOCK_N:  # tiles whose last candidate is selected may hold more winners
                n_tiles = tl.cdiv(ctx, BLOCK_N)
                for t0 in range(0, n_tiles, TILE):
                    tt = t0 + tl.arange(0, TILE)
                    m = tt < n_tiles
                    last = tl.load(tmin_ptr + row.to(tl.int64) * NT + tt, mask=m, other=INVALID)
                    ov = m & (last != INVALID) & ((last & pmask) >= prefix)
                    at = n_ovf + tl.cumsum(ov.to(tl.int32), 0) - 1
                    tl.store(ovf_ptr + row * MAX_OVF + at, tt, mask=ov & (at < MAX_OVF))
                    n_ovf += tl.sum(ov.to(tl.int32), 0)
            tl.store(novf_ptr + row, tl.minimum(n_ovf, MAX_OVF))
            if n_ovf == 0:  # candidates are in position order: compaction gives the sorted output
                cnt = _collect(crow, n_c, prefix, pmask, orow, tl.zeros([], tl.int32), tblrow, TOPK, TILE, ROWS_OUT,
                               LOG_BS)
                for off in range(0, TOPK, TILE):
                    j = off + tl.arange(0, TILE)
                    tl.store(orow + j, tl.full([TILE], -1, tl.int64), mask=(j >= cnt) & (j < TOPK))
        else:
            wrow = work_ptr + row.to(tl.int64) * KP
            cnt = _collect(crow, n_c, prefix, pmask, wrow, tl.zeros([], tl.int32), tblrow, KP, TILE, False, LOG_BS)
            cnt = _collect(erow, n_e, prefix, pmask, wrow, cnt, tblrow, KP, TILE, False, LOG_BS)
            tl.debug_barrier()
            j = tl.arange(0, KP)
            v = tl.load(wrow + j, mask=j < cnt, other=(1 << 62))
            v = tl.sort(v)
            if ROWS_OUT:
                v = rows_of(tblrow, v, j < cnt, LOG_BS)
            tl.store(orow + j, tl.where(j < cnt, v, -1), mask=j < TOPK)


# ------------------------------------------------------------------------------------ host API
def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def default_kt(block_n: int, topk: int, context: int) -> int:
    """Candidates per tile: the expected winners per tile mu = BLOCK_N*topk/context plus 2 sigma + 2,
    a power of two (a tile with more winners is exact but rescored; H200: KT 8 at mu 2 was fastest)."""
    mu = block_n * topk / max(1, context)
    return int(min(block_n, max(4, _pow2(math.ceil(mu + 2 * math.sqrt(mu) + 2)))))


def default_kt_pairs(block_n: int, topk: int, context: int) -> int:
    """CAND 1 candidates per tile: groups of G = pow2(context / (8 topk)) positions (>= 4, <= BLOCK_N/2),
    so a group expects <= 1/8 winner and holding 3 (an overflow) is rare; KT = 2 BLOCK_N / G."""
    g = min(block_n // 2, max(4, _pow2(max(1, context // (8 * max(1, topk))))))
    return 2 * block_n // g


def heuristic(key: dict, target: str) -> dict:
    """cpu: few, big programs. GPU (H200, context 128K x 32 rows, paged block_size 64, 2026-11-29):
    BLOCK_N 128 with 4 warps; SPLITS fills about one wave of 3 x 132 programs, at least 4 tiles per
    program; PREFETCH 1 (the next tile's bytes in flight while this one is scored) beat the compiler's
    pipeliner (num_stages 3) 0.67 vs 0.81 ms; tile top-k candidates (CAND 0, KT from `default_kt`)
    beat group top-2 (CAND 1) whose witness then was the second best (every row overflowed; fixed since:
    re-measure CAND 1, `default_kt_pairs`)."""
    L, K, T = max(1, key["L"]), key["K"], max(1, key["T"])
    if target == "cpu":
        bn = 32 if L <= 256 else 128
        return dict(BLOCK_N=bn, KT=default_kt(bn, K, L), SPLITS=1, num_warps=4, num_stages=1, MERGE_TILE=256,
                    CAND=0, PREFETCH=0)
    bn = 128
    splits = max(1, min(max(1, -(-L // bn) // 4), round(396 / T)))
    return dict(BLOCK_N=bn, KT=default_kt(bn, K, L), SPLITS=splits, num_warps=4, num_stages=1, MERGE_TILE=2048,
                CAND=0, PREFETCH=1)


def indexer_topk(q, q_scale, w, keys, key_scale, token_pos, token_req, block_table, block_size: int, topk: int, *,
                 key_format: str = "fp8", output: str = "positions", config: dict | None = None,
                 max_context: int | None = None, stats: dict | None = None,
                 stop_after: str | None = None) -> torch.Tensor:
    """Exact DSA top-k. q f8e4m3 [T, HI, DI], q_scale fp32 [T, HI], w [T, HI];
    key_format "fp8": keys f8e4m3 (or its uint8 view) [N, DI], key_scale fp32 [N];
    key_format "mxfp4": keys uint8 [N, DI/2] (low nibble = even element), key_scale uint8 E8M0 [N, DI/32].
    Keys of request r's position p are at pool row block_table[r, p // block_size] * block_size + p % block_size.
    Returns int64 [T, topk]: ascending positions (output="positions") or their pool rows
    (output="rows"), -1 padded. `max_context` (>= every token_pos + 1) avoids a host sync;
    `stats` (a dict) receives overflowed_rows / overflowed_tiles (a host sync; tests and benches).
    `stop_after="score"` runs the score kernel only (a profiling aid for benches: `out` is then garbage)."""
    T, HI, DI = q.shape
    fmt = {"fp8": 0, "mxfp4": 1}.get(key_format)
    width = DI if fmt == 0 else DI // 2
    problems = [f"key_format must be 'fp8' or 'mxfp4', found {key_format!r}"] * (fmt is None) + \
        [f"output must be 'positions' or 'rows', found {output!r}"] * (output not in ("positions", "rows")) + \
        [f"topk must be positive, found {topk}"] * (topk < 1) + \
        [f"keys {tuple(keys.shape)} do not match q {tuple(q.shape)} (need [N, {width}], DI a power of two "
         f">= 32)"] * (fmt is not None and (keys.dim() != 2 or keys.shape[1] != width or DI % 32 or DI & (DI - 1)))
    if problems:
        raise ValueError("indexer_topk: " + "; ".join(problems))
    dev = q.device
    out = torch.empty(T, topk, dtype=torch.int64, device=dev)
    if T == 0:
        return out
    L = int(max_context) if max_context is not None else int(token_pos.max()) + 1
    cfg = dict(config or heuristic({"T": T, "L": L, "K": topk, "HI": HI, "DI": DI},
                                   "cpu" if dev.type == "cpu" else "gpu"))
    bn, kt = int(cfg["BLOCK_N"]), int(cfg["KT"])
    if kt > bn or kt & (kt - 1) or bn & (bn - 1) or bn < 16:
        raise ValueError(f"indexer_topk: config {cfg} needs powers of two KT <= BLOCK_N, BLOCK_N >= 16")
    q8, k8 = (x if x.dtype == torch.uint8 else x.view(torch.uint8) for x in (q, keys))
    ks = key_scale.to(torch.float32) if fmt == 0 else key_scale.view(torch.uint8)
    wq = (w.to(torch.float32) * q_scale.to(torch.float32)).contiguous()
    pos = token_pos.to(device=dev, dtype=torch.int64).contiguous()
    tbl, req, MB, log_bs = paging_args(block_table, token_req, block_size, dev)
    NT = -(-L // bn)
    cand_mode, prefetch = int(cfg.get("CAND", 0)), int(cfg.get("PREFETCH", 0))
    if cand_mode not in (0, 1) or prefetch not in (0, 1) or (cand_mode == 1 and kt < 2):
        raise ValueError(f"indexer_topk: config {cfg} needs CAND in (0, 1), PREFETCH in (0, 1), KT >= 2 for CAND 1")
    max_ovf = max(1, topk // (kt if cand_mode == 0 else 2))   # an overflowed tile holds >= KT (CAND 1: 2) winners
    KP = _pow2(topk)
    per_row = 8 * (NT * kt + NT + max_ovf * bn + KP) + 4 * (max_ovf + 1)
    chunk = max(1, min(T, WORKSPACE_BYTES // per_row))
    dot_dt = tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16
    HP = max(16, _pow2(HI))
    mt = int(cfg.get("MERGE_TILE", 1024))
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        n = r1 - r0
        cand, tmin, ext, work = (torch.empty(n, m, dtype=torch.int64, device=dev) for m in (NT * kt, NT, max_ovf * bn, KP))
        ovf, novf = torch.empty(n, max_ovf, dtype=torch.int32, device=dev), torch.zeros(n, dtype=torch.int32, device=dev)
        qc, wc, rc, pc, oc = q8[r0:r1], wq[r0:r1], req[r0:r1], pos[r0:r1], out[r0:r1]
        common = dict(HI=HI, DI=DI, HP=HP, BLOCK_N=bn, KT=kt, KEY_FMT=fmt, DOT_DT=dot_dt, LOG_BS=log_bs)
        splits = max(1, min(int(cfg["SPLITS"]), NT))
        _score_kernel[(n, splits)](qc, wc, k8, ks, tbl, rc, MB, pc, cand, tmin, NT, topk, splits,
                                   num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
                                   CAND=cand_mode, PREFETCH=prefetch, **common)
        if stop_after == "score":
            continue
        merge = dict(BLOCK_N=bn, KT=kt, KP=KP, ROWS_OUT=output == "rows", TILE=mt, LOG_BS=log_bs,
                     num_warps=8 if mt >= 1024 else 4)
        _merge_kernel[(n,)](cand, tmin, ext, ovf, novf, work, oc, tbl, rc, MB, pc, NT, topk, max_ovf, PHASE=1, **merge)
        if kt < bn and L > topk:
            _rescore_kernel[(n, min(max_ovf, RESCORE_PROGRAMS))](qc, wc, k8, ks, tbl, rc, MB, pc, cand, ovf, novf, ext, NT, max_ovf,
                                          num_warps=int(cfg["num_warps"]), **common)
            _merge_kernel[(n,)](cand, tmin, ext, ovf, novf, work, oc, tbl, rc, MB, pc, NT, topk, max_ovf, PHASE=2, **merge)
        if stats is not None:
            stats["overflowed_rows"] = stats.get("overflowed_rows", 0) + int((novf > 0).sum())
            stats["overflowed_tiles"] = stats.get("overflowed_tiles", 0) + int(novf.sum())
    return out


# ------------------------------------------------------------------------------------ template
_NAMES = ("q", "q_scale", "w", "keys", "key_scale", "token_pos", "token_req", "block_table")


def _fused(a):
    """fused.indexer_select binds `a.operands` in indexer_topk's order: give them indexer_topk's names."""
    return SimpleNamespace(**dict(zip(_NAMES, a.operands))) if hasattr(a, "operands") else a


def _launch(a, attrs, config):
    """indexer_topk -> positions; fused.indexer_select (passes/fused_indexer_select.py) -> pool rows."""
    rows, a = hasattr(a, "operands"), _fused(a)
    if rows and attrs.get("emits", "rows") != "rows":
        raise ValueError(f"fused.indexer_select: emits={attrs.get('emits')!r}, this kernel writes 'rows'")
    return indexer_topk(*(getattr(a, n) for n in _NAMES), int(attrs["block_size"]), int(attrs["topk"]),
                        key_format=attrs.get("key_format", "fp8"),
                        output="rows" if rows else "positions", config=config)


def _key(a, attrs) -> dict:
    a = _fused(a)
    tp = a.token_pos   # compile time binds meta tensors: context unknown (0)
    L = int(tp.max()) + 1 if isinstance(tp, torch.Tensor) and tp.numel() and tp.device.type != "meta" else 0
    T, HI, DI = (int(x) if hasattr(x, "__index__") else 0 for x in a.q.shape)
    return {"T": T, "HI": HI, "DI": DI, "L": L, "K": int(attrs["topk"])}


def _bucket(key: dict) -> dict:
    return dict(key, T=pow2_bucket(key["T"]), L=pow2_bucket(key["L"], 1024))


def _constraints(config: dict, key: dict, target: str) -> list[str]:
    bn, kt, smem = config["BLOCK_N"], config["KT"], config["BLOCK_N"] * key.get("DI", 128) * config["num_stages"]
    return [f"KT {kt} > BLOCK_N {bn}"] * (kt > bn) + \
        [f"key tiles BLOCK_N*DI*num_stages = {smem} B of shared memory"] * (target != "cpu" and smem > 200 * 1024)


def _supports(a, attrs, target) -> str | None:
    di = _fused(a).q.shape[2]
    ok = getattr(di, "is_Integer", isinstance(di, int)) and int(di) % 32 == 0 and int(di) & (int(di) - 1) == 0
    return None if ok else f"index_head_dim {di} is not a power of two >= 32"


TUNABLES = (Tunable("BLOCK_N", (64, 128, 256)), Tunable("KT", (4, 8, 16, 32, 64)),
            Tunable("SPLITS", (1, 2, 4, 8, 12, 16, 24, 32, 64)), Tunable("num_warps", (4, 8)),
            Tunable("num_stages", (1, 2, 3, 4)), Tunable("MERGE_TILE", (512, 1024, 2048)), Tunable("CAND", (0, 1)),
            Tunable("PREFETCH", (0, 1)))

TEMPLATES = [
    KernelTemplate(family="indexer_topk", backend="triton", ops=("indexer_topk",), launch=_launch, key_dims=_key,
                   heuristic=heuristic, tunables=TUNABLES, bucket=_bucket, constraints=_constraints,
                   supports=_supports, batch_invariant=True,
                   doc="fused FP8/MXFP4 indexer scorer + exact top-k (per-tile candidates, radix merge), positions"),
    KernelTemplate(family="indexer_select_rows", backend="triton", ops=("fused.indexer_select",), launch=_launch,
                   key_dims=_key, heuristic=heuristic, tunables=TUNABLES, bucket=_bucket, constraints=_constraints,
                   supports=_supports, batch_invariant=True,
                   doc="the same kernels emitting the physical pool rows of the positions (what attention reads)"),
]
