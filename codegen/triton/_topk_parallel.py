"""The parallel kernels of the DSA indexer's exact top-k (`indexer_topk`), over the keys and radix-select
helpers of `_topk_select` (which also holds the serial `_merge_kernel`):

- `_filter_kernel` (FILTER 1): parallel pre-selection of a row's candidates (22-bit prefix) that the merge
  then runs over;
- `_select_kernel` (SELECT 1, step 1): the threshold of a row's top-k by parts of the row in parallel, the
  last part to arrive finishing over the survivors;
- `_place_kernel` (SELECT 1, step 2): every part writes its selected keys from its output offset.

See `indexer_topk`'s docstring for the whole pipeline.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._pdl import pdl_enter
from ._topk_select import (INVALID, _collect, _finish_streamed, _flag_overflow_tiles, _gather_ge, _hist_vals,
                           _low32, _part_range, _radix_step, _row_keys, _select_all)


@triton.jit
def _filter_kernel(cand_ptr, hist_ptr, hist2_ptr, cnt_ptr, comp_ptr, ncomp_ptr, pos_ptr, NT, TOPK,
                   BLOCK_N: tl.constexpr, KT: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr,
                   STEP: tl.constexpr, PDL: tl.constexpr):
    """Parallel pre-selection of a row's candidates (grid: rows x PARTS; the serial merge then runs over the
    survivors). Program (row, part) owns candidates [part*per, (part+1)*per), per = ceil(n_c / PARTS).
    Every program first re-derives the boundary digit b0 (top 11 key bits) of the topk-th largest
    candidate from the score pass's histogram (`_radix_step`), then
      STEP 0: counts the next 11 bits (b1, bits 42..52) of its keys in bucket b0 into the row's second
              histogram (global atomics);
      STEP 1: takes b1 from that histogram and counts its keys whose top 22 bits are >= (b0, b1);
      STEP 2: writes those keys to the compact row at the exclusive prefix of the parts' counts (position
              order kept: parts are in order and each writes in order); part 0 stores the row's total.
    Exactness: a dropped key ranks below the topk-th largest candidate, and the true top-k's threshold is
    at least that (rescored keys are only added), so it can never be selected."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx > TOPK:
        n_c = tl.cdiv(ctx, BLOCK_N) * KT
        lo, n, _ = _part_range(n_c, part, PARTS, 1)
        src = cand_ptr + row.to(tl.int64) * NT * KT + lo
        i11 = tl.arange(0, 2048)
        need, prefix, pmask, done = _radix_step(tl.load(hist_ptr + row * 2048 + i11), i11, TOPK + tl.zeros([], tl.int32),
                                                tl.zeros([], tl.int64), tl.zeros([], tl.int64), 53, 11, 1024)
        if STEP == 0:
            if done == 0:
                for off in range(0, n, TILE):
                    o = off + tl.arange(0, TILE)
                    k = tl.load(src + o, mask=o < n, other=INVALID)
                    hit = (o < n) & (k != INVALID) & ((k & pmask) == prefix)
                    tl.atomic_add(hist2_ptr + row * 2048 + ((k >> 42) & 2047).to(tl.int32), 1, mask=hit, sem="relaxed")
        else:
            if done == 0:
                need, prefix, pmask, done = _radix_step(tl.load(hist2_ptr + row * 2048 + i11), i11, need, prefix,
                                                        pmask, 42, 11, 0)
            if STEP == 1:
                cnt = tl.zeros([], tl.int32)
                for off in range(0, n, TILE):
                    o = off + tl.arange(0, TILE)
                    k = tl.load(src + o, mask=o < n, other=INVALID)
                    cnt += tl.sum(((o < n) & (k != INVALID) & ((k & pmask) >= prefix)).to(tl.int32), 0)
                tl.store(cnt_ptr + row * PARTS + part, cnt)
            else:
                pp = tl.arange(0, PARTS)
                cnts = tl.load(cnt_ptr + row * PARTS + pp)
                base = tl.sum(tl.where(pp < part, cnts, 0), 0)
                _gather_ge(src, n, prefix, pmask, comp_ptr + row.to(tl.int64) * NT * KT, base, NT * KT, TILE)
                if part == 0:
                    tl.store(ncomp_ptr + row, tl.sum(cnts, 0))


@triton.jit
def _select_kernel(cand_ptr, tmin_ptr, hist_ptr, hist2_ptr, ncomp_ptr, arrive_ptr, comp_ptr, poff_ptr,
                   ovf_ptr, novf_ptr, th_ptr, out_ptr, tbl_ptr, req_ptr, MB, pos_ptr, NT, TOPK, MAX_OVF,
                   BLOCK_N: tl.constexpr, KT: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr,
                   RES: tl.constexpr, ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr, SRC32: tl.constexpr,
                   PDL: tl.constexpr):
    """SELECT 1, step 1 (grid rows x PARTS; `_place_kernel` is step 2): the threshold of a row's top-k with no
    program passing over all candidates. Program (row, part) owns the candidates [part*per, (part+1)*per)
    (per a multiple of KT: a tile's candidates share a part) and
      - re-derives (b0, need0): the top-11-bit digit of the topk-th largest candidate and how many keys of
        its bucket are selected, from the score pass's histogram (`_radix_step`);
      - appends its keys with digit >= b0 (the survivors: a superset of the selection) to the row's
        survivor buffer (one atomic slot reservation per tile, order free), counts the keys of bucket
        b0 by their next 11 bits (bits 42..52) into hist2, and stores its survivor count;
      - arrives at the row's counter; the LAST program to arrive (the counter's acq_rel atomic orders every
        program's writes before it) finishes alone over the few survivors: the next digit from hist2, then
        8-bit digits over the survivors matching the prefix (in registers when they fit RES) until the
        boundary bucket is taken whole, so (prefix, pmask) selects exactly the topk largest candidates
        ((k & pmask) >= prefix). It stores them in th (PHASE 2 of `_merge_kernel` reads it), flags
        overflowed tiles (witness selected) as `_merge_kernel` does, histograms the selected survivors by
        owning part and stores each part's output offset (exclusive prefix) for `_place_kernel`, and pads
        the output with -1 past the selected count.
    A row whose context holds <= topk positions is written whole by its part 0. The survivor buffer is what
    PHASE 2 re-selects from (COMPACT: ncomp keys). SRC32 (SCORES 1, KT = BLOCK_N): the row is the materialised
    orderable scores (int32, one per position: `_indexer_scores`), keys formed on load (`_row_keys`). Every part
    carries the last arriver's registers (H200 session 13, SRC32 at batch 32 x 128K, 16 parts: 241 registers at RES
    2048 on 4 warps, 255 and spills at RES 8192 on 8 warps), so few parts are resident per SM."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
    orow = out_ptr + row.to(tl.int64) * TOPK
    if ctx <= TOPK:
        if part == 0:
            _select_all(orow, tblrow, ctx, TOPK, TILE, ROWS_OUT, LOG_BS)
    else:
        n_c = tl.cdiv(ctx, BLOCK_N) * KT
        lo, n, per = _part_range(n_c, part, PARTS, KT)
        crow = cand_ptr + row.to(tl.int64) * NT * KT
        srow = comp_ptr + row.to(tl.int64) * NT * KT
        i11 = tl.arange(0, 2048)
        need, prefix, pmask, done = _radix_step(tl.load(hist_ptr + row * 2048 + i11), i11, TOPK + tl.zeros([], tl.int32),
                                                tl.zeros([], tl.int64), tl.zeros([], tl.int64), 53, 11, 1024)
        for c0 in range(0, n, TILE):   # survivors appended (one slot reservation per tile), bucket b0 counted
            o = c0 + tl.arange(0, TILE)
            k = _row_keys(crow, lo, o, n, ctx, SRC32)
            live = (o < n) & (k != INVALID)
            sel = live & ((k & pmask) >= prefix)
            c = tl.sum(sel.to(tl.int32), 0)
            at = tl.atomic_add(ncomp_ptr + row, c, sem="relaxed") + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(srow + at, k, mask=sel)
            if done == 0:
                tl.atomic_add(hist2_ptr + row * 2048 + ((k >> 42) & 2047).to(tl.int32), 1,
                              mask=live & ((k & pmask) == prefix), sem="relaxed")
        tl.debug_barrier()
        ticket = tl.atomic_add(arrive_ptr + row, 1, sem="acq_rel")
        if ticket == PARTS - 1:   # the last program of the row: every survivor and count is visible
            tl.debug_barrier()
            n_s = tl.load(ncomp_ptr + row, cache_modifier=".cg")
            if done == 0:
                need, prefix, pmask, done = _radix_step(tl.load(hist2_ptr + row * 2048 + i11, cache_modifier=".cg"),
                                                        i11, need, prefix, pmask, 42, 11, 0)
            idx = tl.arange(0, 256)
            pp = tl.arange(0, PARTS)
            if n_s <= RES:
                o_r = tl.arange(0, RES)
                m_r = o_r < n_s
                k_r = tl.load(srow + o_r, mask=m_r, other=INVALID, cache_modifier=".cg")
                for p in tl.static_range(6):   # digits at bits 34, 26, 18, 10, 2, then the last at 0
                    if done == 0:
                        sh = 34 - 8 * p if p < 5 else 0
                        need, prefix, pmask, done = _radix_step(_hist_vals(k_r, m_r, prefix, pmask, sh), idx, need,
                                                                prefix, pmask, sh, 8, 0)
                sel = m_r & (k_r != INVALID) & ((k_r & pmask) >= prefix)
                owner = ((_low32() - (k_r & _low32())) // BLOCK_N * KT // per).to(tl.int32)
                hsel = tl.histogram(owner, PARTS, mask=sel)
            else:
                prefix, pmask, hsel = _finish_streamed(srow, n_s, need, prefix, pmask, done, idx, per, 34, 6, BLOCK_N,
                                                       KT, PARTS, TILE)
            total = tl.sum(hsel, 0)
            tl.store(poff_ptr + row * PARTS + pp, tl.cumsum(hsel, 0) - hsel)
            tl.store(th_ptr + row.to(tl.int64) * 2, prefix)
            tl.store(th_ptr + row.to(tl.int64) * 2 + 1, pmask)
            n_ovf = tl.zeros([], tl.int32)
            if KT < BLOCK_N:  # tiles whose witness is selected may hold more winners (see `_merge_kernel`)
                n_ovf = _flag_overflow_tiles(tmin_ptr, ovf_ptr, row, ctx, NT, MAX_OVF, prefix, pmask, n_ovf, BLOCK_N,
                                             TILE)
            tl.store(novf_ptr + row, tl.minimum(n_ovf, MAX_OVF))
            if n_ovf == 0:
                for p0 in range(0, TOPK, TILE):
                    jp = p0 + tl.arange(0, TILE)
                    tl.store(orow + jp, tl.full([TILE], -1, tl.int64), mask=(jp >= total) & (jp < TOPK))


@triton.jit
def _place_kernel(cand_ptr, novf_ptr, th_ptr, poff_ptr, out_ptr, tbl_ptr, req_ptr, MB, pos_ptr, NT, TOPK,
                  BLOCK_N: tl.constexpr, KT: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr,
                  ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr, SRC32: tl.constexpr, PDL: tl.constexpr):
    """SELECT 1, step 2 (grid rows x PARTS): program (row, part) writes the selected keys ((k & pmask) >=
    prefix, from `_select_kernel`) of its candidates, which are in position order, as positions (pool rows
    when ROWS_OUT) from its part's offset: the row's output ascending. Rows with overflowed tiles are left to
    PHASE 2 of `_merge_kernel`; rows with context <= topk were written by `_select_kernel`. SRC32: as there."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx > TOPK:
        if tl.load(novf_ptr + row) == 0:
            n_c = tl.cdiv(ctx, BLOCK_N) * KT
            lo, n, _ = _part_range(n_c, part, PARTS, KT)
            prefix = tl.load(th_ptr + row.to(tl.int64) * 2)
            pmask = tl.load(th_ptr + row.to(tl.int64) * 2 + 1)
            tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
            _collect(cand_ptr + row.to(tl.int64) * NT * KT, n, prefix, pmask, out_ptr + row.to(tl.int64) * TOPK,
                     tl.load(poff_ptr + row * PARTS + part), tblrow, TOPK, TILE, ROWS_OUT, LOG_BS, lo, ctx, SRC32)
