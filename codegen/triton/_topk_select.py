"""Exact top-k selection over unique 64-bit keys for the DSA indexer (`indexer_topk`): key encoding, the
radix-select helpers and the serial radix-select merge kernel.

A score s of position p becomes key = (orderable(s) << 32) | (2^32 - 1 - p) (`_score_keys`), so signed
int64 order is exactly the selection order (score desc, position asc) and keys are unique. The merge
(`_merge_kernel`, grid: rows) finds theta, the topk-th largest key among a row's candidates, by radix
select (first 11-bit digit from the score pass's histogram, then 8-bit steps with tl.histogram until the
boundary bucket is taken whole), gathers the boundary bucket into a work row, and writes the keys
>= theta in position order as positions or (through the block table) physical pool rows. PHASE 1 also
flags rows whose overflow witnesses were selected; PHASE 2 re-selects those over candidates + rescored
tiles. The parallel kernels built on these helpers live in `_topk_parallel`: `_filter_kernel` (FILTER)
pre-selects in parallel for the merge; `_select_kernel` + `_place_kernel` (SELECT) replace the merge's
PHASE 1 by parts of a row in parallel, the last part to arrive finishing over the survivors. See
`indexer_topk`'s docstring for the whole pipeline.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._paging import rows_of
from ._pdl import pdl_enter

INVALID = tl.constexpr(-(2 ** 63))


@triton.jit
def _low32():  # an int64 constant (a bare 0xFFFFFFFF literal would be uint32)
    return tl.full([], 0xFFFFFFFF, tl.int64)


@triton.jit
def _score_ord(s):
    """fp32 scores as int32 whose signed order is the float order (-0 -> +0: they tie in the reference)."""
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _ord_keys(ordv, p, valid):
    """Keys of orderable scores (`_score_ord`) at positions p; invalid lanes get INVALID."""
    key = (ordv.to(tl.int64) << 32) | (_low32() - p.to(tl.int64))
    return tl.where(valid, key, INVALID)


@triton.jit
def _row_keys(ptr, lo, o, n, ctx, SRC32: tl.constexpr):
    """Keys of a row's entries lo + o (o < n): stored int64 keys, or (SRC32) keys formed from the row's
    materialised orderable scores (int32, entry = position; positions >= ctx are INVALID)."""
    if SRC32:
        p = lo + o
        m = (o < n) & (p < ctx)
        return _ord_keys(tl.load(ptr + p, mask=m, other=0), p, m)
    else:
        return tl.load(ptr + lo + o, mask=o < n, other=INVALID)


@triton.jit
def _score_keys(s, p, valid):
    """Unique int64 keys ordered like (score desc, position asc); invalid lanes get INVALID."""
    return _ord_keys(_score_ord(s), p, valid)


@triton.jit
def _digit0(k):
    """The top 11 bits of a key in unsigned order (sign flipped): the first radix digit, 0 .. 2047."""
    return ((k >> 53) & 2047).to(tl.int32) ^ 1024


@triton.jit
def _ord_digit0(v):
    """`_digit0` of the key an orderable int32 score (`_score_ord`) makes, from the score alone."""
    return ((v >> 21) & 2047) ^ 1024


@triton.jit
def _select_all(orow, tblrow, ctx, TOPK, TILE: tl.constexpr, ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr):
    """A row whose context holds <= TOPK positions: every position 0..ctx-1 (as pool rows when ROWS_OUT), then -1,
    written TILE entries at a time."""
    for off in range(0, TOPK, TILE):
        j = off + tl.arange(0, TILE)
        jj = rows_of(tblrow, j, j < ctx, LOG_BS) if ROWS_OUT else j.to(tl.int64)
        tl.store(orow + j, tl.where(j < ctx, jj, -1), mask=j < TOPK)


@triton.jit
def _part_range(n_c, part, PARTS: tl.constexpr, ALIGN: tl.constexpr):
    """Program `part` of PARTS over a row's n_c keys: (lo, n, per), its keys [lo, lo + n) of a range of per =
    ceil(n_c / PARTS) keys rounded up to ALIGN (the last ranges may be short or empty)."""
    per = tl.cdiv(tl.cdiv(n_c, PARTS), ALIGN) * ALIGN
    lo = part * per
    return lo, tl.maximum(0, tl.minimum(per, n_c - lo)), per


@triton.jit
def _radix_step(hist, idx, need, prefix, pmask, shift: tl.constexpr, NBITS: tl.constexpr, FLIP: tl.constexpr):
    """One radix-select step: given the histogram (unsigned digit order) of the NBITS-bit digit at `shift`
    of the keys matching prefix/pmask, fix the digit of the need-th largest key (stored bits = digit ^
    FLIP: the sign bit's flip when the digit holds it). Returns (need, prefix, pmask, done); done: the
    boundary bucket is taken whole (or fewer keys than need remain: all of them are selected)."""
    total = tl.sum(hist, 0)
    suffix = total - tl.cumsum(hist, 0) + hist     # keys with digit >= idx
    b = tl.sum((suffix >= need).to(tl.int32), 0) - 1
    cnt_b = tl.sum(tl.where(idx == b, hist, 0), 0)
    new_need = need - (tl.sum(tl.where(idx == b, suffix, 0), 0) - cnt_b)
    bits = b ^ FLIP
    new_prefix = prefix | (bits.to(tl.int64) << shift)
    new_pmask = pmask | (tl.full([], (1 << NBITS) - 1, tl.int64) << shift)
    few = total <= need
    return (tl.where(few, need, new_need), tl.where(few, prefix, new_prefix), tl.where(few, pmask, new_pmask),
            (few | (cnt_b == new_need)).to(tl.int32))


@triton.jit
def _gather_eq_vals(k, m, prefix, pmask, dst, cnt, LIMIT):
    """Append the keys k (mask m) whose masked bits equal prefix to dst[cnt:LIMIT]; returns the new count
    (every such key counted, also past LIMIT)."""
    sel = m & (k != INVALID) & ((k & pmask) == prefix)
    at = cnt + tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(dst + at, k, mask=sel & (at < LIMIT))
    return cnt + tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _gather_ge(ptr, n, prefix, pmask, dst, cnt, LIMIT, TILE: tl.constexpr):
    """Append the keys of ptr[0:n] whose masked bits are >= prefix (the keys a threshold selects) to
    dst[cnt:LIMIT], TILE at a time; returns the new count (every such key counted, also past LIMIT)."""
    for off in range(0, n, TILE):
        o = off + tl.arange(0, TILE)
        k = tl.load(ptr + o, mask=o < n, other=INVALID)
        sel = (o < n) & (k != INVALID) & ((k & pmask) >= prefix)
        at = cnt + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(dst + at, k, mask=sel & (at < LIMIT))
        cnt += tl.sum(sel.to(tl.int32), 0)
    return cnt


@triton.jit
def _select_sorted(v, m, orow, tblrow, TOPK, KP: tl.constexpr, ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr):
    """Write the positions v (mask m: the selected ones, <= TOPK of them, any order) to orow ascending (as pool
    rows when ROWS_OUT), -1 padded to TOPK."""
    v = tl.sort(tl.where(m, v, 1 << 62))
    j = tl.arange(0, KP)
    cnt = tl.sum(m.to(tl.int32), 0)
    if ROWS_OUT:
        v = rows_of(tblrow, v, j < cnt, LOG_BS)
    tl.store(orow + j, tl.where(j < cnt, v, -1), mask=j < TOPK)


@triton.jit
def _gather_eq(ptr, n, prefix, pmask, dst, LIMIT, TILE: tl.constexpr):
    """`_gather_eq_vals` over keys ptr[0:n], TILE at a time, from dst[0]."""
    cnt = tl.zeros([], tl.int32)
    for off in range(0, n, TILE):
        o = off + tl.arange(0, TILE)
        m = o < n
        cnt = _gather_eq_vals(tl.load(ptr + o, mask=m, other=INVALID), m, prefix, pmask, dst, cnt, LIMIT)
    return cnt


@triton.jit
def _rot32(k):  # swap the 32-bit halves (an involution): orders by position, INVALID stays smallest
    return tl.where(k == INVALID, INVALID, (k << 32) | ((k >> 32) & _low32()))


@triton.jit
def _hist_vals(k, m, prefix, pmask, shift: tl.constexpr):
    """Histogram of the 8-bit digit at `shift` (unsigned order) of the valid keys k (mask m) matching prefix."""
    match = m & (k != INVALID) & ((k & pmask) == prefix)
    d = ((k >> shift) & 255).to(tl.int32)
    if shift == 56:
        d = d ^ 128
    return tl.histogram(d, 256, mask=match)


@triton.jit
def _hist_pass(ptr, n, prefix, pmask, shift: tl.constexpr, TILE: tl.constexpr):
    """`_hist_vals` over keys ptr[0:n], TILE at a time."""
    hist = tl.zeros([256], dtype=tl.int32)
    for off in range(0, n, TILE):
        o = off + tl.arange(0, TILE)
        m = o < n
        hist += _hist_vals(tl.load(ptr + o, mask=m, other=INVALID), m, prefix, pmask, shift)
    return hist


@triton.jit
def _finish_streamed(ptr, n, need, prefix, pmask, done, idx, per, SH0: tl.constexpr, STEPS: tl.constexpr,
                     BLOCK_N: tl.constexpr, KT: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr):
    """The radix select finished over keys ptr[0:n] in passes (8-bit digits at SH0, SH0 - 8, ..., the last at 0),
    then the selected keys counted by owning part (entry range per of a row whose tiles hold KT keys each).
    Returns (prefix, pmask, per-part counts)."""
    for s in tl.static_range(STEPS):
        if done == 0:
            sh = SH0 - 8 * s if s < STEPS - 1 else 0
            need, prefix, pmask, done = _radix_step(_hist_pass(ptr, n, prefix, pmask, sh, TILE), idx, need, prefix,
                                                    pmask, sh, 8, 0)
    hsel = tl.zeros([PARTS], tl.int32)
    for s0 in range(0, n, TILE):
        o = s0 + tl.arange(0, TILE)
        k = tl.load(ptr + o, mask=o < n, other=INVALID, cache_modifier=".cg")
        sel = (o < n) & (k != INVALID) & ((k & pmask) >= prefix)
        hsel += tl.histogram(((_low32() - (k & _low32())) // BLOCK_N * KT // per).to(tl.int32), PARTS, mask=sel)
    return prefix, pmask, hsel


@triton.jit
def _collect_vals(k, m, prefix, pmask, dst, cnt, tblrow, LIMIT, ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr):
    """Append (in order) the position (its pool row when ROWS_OUT) of every selected key of k to dst[cnt:]."""
    sel = m & (k != INVALID) & ((k & pmask) >= prefix)
    c = tl.cumsum(sel.to(tl.int32), 0)
    at = cnt + c - 1
    pos = _low32() - (k & _low32())
    if ROWS_OUT:
        pos = rows_of(tblrow, pos, sel, LOG_BS)
    tl.store(dst + at, pos, mask=sel & (at < LIMIT))
    return cnt + tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _collect(ptr, n, prefix, pmask, dst, cnt, tblrow, LIMIT, TILE: tl.constexpr, ROWS_OUT: tl.constexpr,
             LOG_BS: tl.constexpr, lo=0, ctx=0, SRC32: tl.constexpr = False):
    """`_collect_vals` over the keys of entries lo .. lo+n-1 of row ptr (`_row_keys`: stored keys, or SRC32 keys
    formed from orderable scores, positions >= ctx invalid) in stored order, TILE at a time; returns cnt."""
    for off in range(0, n, TILE):
        o = off + tl.arange(0, TILE)
        cnt = _collect_vals(_row_keys(ptr, lo, o, n, ctx, SRC32), o < n, prefix, pmask, dst, cnt, tblrow, LIMIT,
                            ROWS_OUT, LOG_BS)
    return cnt


@triton.jit
def _flag_overflow_tiles(tmin_ptr, ovf_ptr, row, ctx, NT, MAX_OVF, prefix, pmask, n_ovf, BLOCK_N: tl.constexpr,
                         TILE: tl.constexpr):
    """Append to the row's overflow list (at most MAX_OVF) every score tile whose smallest kept candidate (its
    witness, tmin) is at or above the threshold (prefix, pmask): such a tile may hold more winners than it
    kept. Returns the count of flagged tiles, n_ovf included (it may exceed MAX_OVF)."""
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    for t0 in range(0, n_tiles, TILE):
        tt = t0 + tl.arange(0, TILE)
        m = tt < n_tiles
        last = tl.load(tmin_ptr + row.to(tl.int64) * NT + tt, mask=m, other=INVALID)
        ov = m & (last != INVALID) & ((last & pmask) >= prefix)
        at = n_ovf + tl.cumsum(ov.to(tl.int32), 0) - 1
        tl.store(ovf_ptr + row * MAX_OVF + at, tt, mask=ov & (at < MAX_OVF))
        n_ovf += tl.sum(ov.to(tl.int32), 0)
    return n_ovf


@triton.jit
def _merge_kernel(cand_ptr, tmin_ptr, hist_ptr, ext_ptr, ovf_ptr, novf_ptr, work_ptr, th_ptr, out_ptr, tbl_ptr, req_ptr,
                  MB, pos_ptr, ncomp_ptr,
                  NT, TOPK, MAX_OVF, BLOCK_N: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr, KW: tl.constexpr,
                  PHASE: tl.constexpr, ROWS_OUT: tl.constexpr, TILE: tl.constexpr, LOG_BS: tl.constexpr,
                  RESIDENT: tl.constexpr, COMPACT: tl.constexpr, PDL: tl.constexpr):
    """PHASE 1 radix-selects theta over a row's candidates, flags overflowed tiles and, without overflow,
    writes the output; PHASE 2 redoes the selection over candidates + rescored tiles (8-bit digits).
    PHASE 1 takes its first digit (the top 11 bits) from the histogram the score kernel counted, copies
    the boundary bucket's keys to the work row when they fit (KP) and finishes the select there, on
    registers (else: 8-bit passes over all candidates, RESIDENT: loaded once when they fit one TILE);
    one last pass over the candidates writes the selection. PHASE 1 also stores its threshold (prefix, pmask)
    in th_ptr: the true top-k only holds keys above it (the candidates of PHASE 2 are a superset of PHASE
    1's), so PHASE 2 gathers the candidates and rescored keys at or above it into the work row (KW keys:
    top-k plus the rescored tiles' survivors) and selects there, in registers; only when they do not fit
    does it radix-select over every candidate and rescored key (8 passes).
    The work rows are KW keys apart; PHASE 1 uses the first KP of its row.
    COMPACT: cand_ptr holds `_filter_kernel`'s compacted rows (ncomp_ptr[row] keys, position order), which
    keep every candidate that can reach the selection: the passes above run over those instead."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    ctx = tl.load(pos_ptr + row) + 1
    tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
    orow = out_ptr + row.to(tl.int64) * TOPK
    if PHASE == 1:
        n_ovf = tl.zeros([], tl.int32)
        active = ctx > TOPK
        if ctx <= TOPK:  # everything is selected
            _select_all(orow, tblrow, ctx, TOPK, TILE, ROWS_OUT, LOG_BS)
    else:
        n_ovf = tl.load(novf_ptr + row)
        active = (ctx > TOPK) & (n_ovf > 0)
    if active:
        if COMPACT:
            n_c = tl.load(ncomp_ptr + row)
        else:
            n_c = tl.cdiv(ctx, BLOCK_N) * KT
        crow = cand_ptr + row.to(tl.int64) * NT * KT
        erow = ext_ptr + row.to(tl.int64) * MAX_OVF * BLOCK_N
        n_e = n_ovf * BLOCK_N
        # ---- radix select of the TOPK-th largest key (most significant digit first)
        prefix = tl.zeros([], tl.int64)
        pmask = tl.zeros([], tl.int64)
        need = TOPK + tl.zeros([], tl.int32)
        idx = tl.arange(0, 256)
        if PHASE == 1:
            if RESIDENT:
                o_r = tl.arange(0, TILE)
                m_r = o_r < n_c
                k_r = tl.load(crow + o_r, mask=m_r, other=INVALID)
            i11 = tl.arange(0, 2048)
            need, prefix, pmask, done = _radix_step(tl.load(hist_ptr + row * 2048 + i11), i11, need, prefix, pmask,
                                                    53, 11, 1024)
            wrow = work_ptr + row.to(tl.int64) * KW
            n_w = tl.zeros([], tl.int32)
            if done == 0:   # the boundary bucket's keys -> work row (when they fit), refined there
                if RESIDENT:
                    n_w = _gather_eq_vals(k_r, m_r, prefix, pmask, wrow, n_w, KP)
                else:
                    n_w = _gather_eq(crow, n_c, prefix, pmask, wrow, KP, TILE)
                if n_w <= KP:
                    tl.debug_barrier()
                    wo = tl.arange(0, KP)
                    wm = wo < n_w
                    wk = tl.load(wrow + wo, mask=wm, other=INVALID)
                    for p in tl.static_range(6):   # digits at bits 45, 37, ..., 5, then the last at 0
                        if done == 0:
                            need, prefix, pmask, done = _radix_step(_hist_vals(wk, wm, prefix, pmask, 45 - 8 * p),
                                                                    idx, need, prefix, pmask, 45 - 8 * p, 8, 0)
                    if done == 0:
                        need, prefix, pmask, done = _radix_step(_hist_vals(wk, wm, prefix, pmask, 0), idx, need,
                                                                prefix, pmask, 0, 8, 0)
            if n_w > KP:    # a huge boundary bucket: 8-bit passes over every candidate
                for p in tl.static_range(7):
                    if done == 0:
                        sh = 45 - 8 * p if p < 6 else 0
                        if RESIDENT:
                            h = _hist_vals(k_r, m_r, prefix, pmask, sh)
                        else:
                            h = _hist_pass(crow, n_c, prefix, pmask, sh, TILE)
                        need, prefix, pmask, done = _radix_step(h, idx, need, prefix, pmask, sh, 8, 0)
        else:
            wrow = work_ptr + row.to(tl.int64) * KW
            p1 = tl.load(th_ptr + row.to(tl.int64) * 2)
            m1 = tl.load(th_ptr + row.to(tl.int64) * 2 + 1)
            n_w = _gather_ge(crow, n_c, p1, m1, wrow, tl.zeros([], tl.int32), KW, TILE)
            n_w = _gather_ge(erow, n_e, p1, m1, wrow, n_w, KW, TILE)
            done = (n_w <= KW).to(tl.int32)   # done: selected in the work row, below; else 8 passes over all keys
            for p in tl.static_range(8):
                if done == 0:
                    hist = _hist_pass(crow, n_c, prefix, pmask, 56 - 8 * p, TILE) + \
                        _hist_pass(erow, n_e, prefix, pmask, 56 - 8 * p, TILE)
                    need, prefix, pmask, done = _radix_step(hist, idx, need, prefix, pmask, 56 - 8 * p, 8,
                                                            128 if p == 0 else 0)
        if PHASE == 1:
            if KT < BLOCK_N:  # tiles whose last candidate is selected may hold more winners
                n_ovf = _flag_overflow_tiles(tmin_ptr, ovf_ptr, row, ctx, NT, MAX_OVF, prefix, pmask, n_ovf, BLOCK_N,
                                             TILE)
            tl.store(novf_ptr + row, tl.minimum(n_ovf, MAX_OVF))
            tl.store(th_ptr + row.to(tl.int64) * 2, prefix)
            tl.store(th_ptr + row.to(tl.int64) * 2 + 1, pmask)
            if n_ovf == 0:  # candidates are in position order: compaction gives the sorted output
                if RESIDENT:
                    cnt = _collect_vals(k_r, m_r, prefix, pmask, orow, tl.zeros([], tl.int32), tblrow, TOPK, ROWS_OUT,
                                        LOG_BS)
                else:
                    cnt = _collect(crow, n_c, prefix, pmask, orow, tl.zeros([], tl.int32), tblrow, TOPK, TILE,
                                   ROWS_OUT, LOG_BS)
                for off in range(0, TOPK, TILE):
                    j = off + tl.arange(0, TILE)
                    tl.store(orow + j, tl.full([TILE], -1, tl.int64), mask=(j >= cnt) & (j < TOPK))
        elif n_w <= KW:   # the threshold's survivors in the work row: the top-k among them, in registers
            tl.debug_barrier()
            wo = tl.arange(0, KW)
            wm = wo < n_w
            wk = tl.load(wrow + wo, mask=wm, other=INVALID)
            done = tl.zeros([], tl.int32)
            for p in tl.static_range(8):
                if done == 0:
                    need, prefix, pmask, done = _radix_step(_hist_vals(wk, wm, prefix, pmask, 56 - 8 * p), idx, need,
                                                            prefix, pmask, 56 - 8 * p, 8, 128 if p == 0 else 0)
            sel = wm & (wk != INVALID) & ((wk & pmask) >= prefix)
            pos = _low32() - (wk & _low32())
            cnt = tl.sum(sel.to(tl.int32), 0)
            at = tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.debug_barrier()
            tl.store(wrow + at, pos, mask=sel & (at < KP))   # compacted positions, then sorted
            tl.debug_barrier()
            j = tl.arange(0, KP)
            _select_sorted(tl.load(wrow + j, mask=j < cnt, other=0), j < cnt, orow, tblrow, TOPK, KP, ROWS_OUT, LOG_BS)
        else:
            cnt = _collect(crow, n_c, prefix, pmask, wrow, tl.zeros([], tl.int32), tblrow, KP, TILE, False, LOG_BS)
            cnt = _collect(erow, n_e, prefix, pmask, wrow, cnt, tblrow, KP, TILE, False, LOG_BS)
            tl.debug_barrier()
            j = tl.arange(0, KP)
            _select_sorted(tl.load(wrow + j, mask=j < cnt, other=0), j < cnt, orow, tblrow, TOPK, KP, ROWS_OUT, LOG_BS)
