"""BUCKET 1: the exact top-k of a materialised score row (SCORES 1, `_indexer_scores`) in three launches, no program
carrying another's registers:
 1. `_bucket_kernel`, grid (rows, PARTS): part p owns the row's entries [p*per, (p+1)*per) (per: a multiple of
    BLOCK_N, as `_place_kernel` splits them). From the score pass's first-digit histogram it derives the boundary
    digit b0 (top 11 orderable bits of the topk-th largest score), counts its scores of digit > b0 (stored per part,
    no atomic) and appends the keys of its scores of digit == b0 (the boundary bucket) to the row's bucket buffer
    (one slot reservation per tile that has any). Nothing else: int32 loads and compares, few registers.
 2. `_threshold_kernel`, grid (rows): finishes the radix select over the boundary bucket only (8-bit digits of the
    key below b0, in registers when the bucket fits RES, else passes over the buffer), so that (k & pmask) >= prefix
    selects exactly the topk largest keys; counts the selected bucket keys by owning part and stores each part's
    output offset (exclusive prefix of its count above b0 plus its selected bucket keys) and the threshold. A row
    whose context holds <= topk positions is written whole here.
 3. `_topk_parallel._place_kernel` (SRC32): every part writes its selected positions from its offset.
SURV 1 (the default at batch > 1: the parts keep their survivors and place them) is `_topk_slots`. ZERO 1: the
histogram and bucket count come from the stream's zeroed counter set (`_gemv.tile_counters`) and the threshold
program, their last reader, zeroes them, so no memset runs before the score pass.
Exact by construction: keys are unique ((score desc, position asc) order), every key of digit > b0 is selected, the
bucket's selected keys are the topk - (count above b0) largest of the bucket. Workspace per row: the bucket buffer
(8 B x NT * BLOCK_N, touched only by the bucket's keys), PARTS counts and offsets, one zeroed counter.

Session 14 (benches/results/h200-2026-11-30-s14/attention_decode_indexer_tma.json, batch 32 at 128K, FP8 keys, rows
out, graph replay; every config the default's rows, graph == eager over 50 replays): BUCKET 2, the parts also counting
the bucket's next 11 key bits into a second histogram so that the threshold program takes that digit off it, then one
pass over the bucket counting the keys above the fixed 22 bits by part and compacting the sub-bucket in place, then
the 8-bit digits over the sub-bucket only (in registers up to RES): whole launcher 304.7 us (RES 2048, 8 warps) /
305.3 (RES 512, 4 warps) vs 305.0 for this path; the select alone 66.2 / 63.6 vs 64.0 (`_bucket_kernel` 96 -> 128
registers with the second atomic); with TMA key tiles (num_stages 4) 259.9 vs 249.7, their identical score passes
184.6 / 176.4 (run-to-run spread of ~5 us). No gain: removed. The threshold program's radix steps over a resident
bucket are not where the select's ~70 us go.
Session 15 (benches/results/h200-2026-11-30-s15/attention_decode_indexer_select.json, the same shape; the launches
timed as prefixes over stored scores, `indexer_topk`'s stop_after "memset" / "bucket" / "threshold"): bucket parts ~14
us (96 registers), the threshold program ~14 (232), `_place_kernel` ~25 (154); the boundary bucket holds ~1000 keys
a row. HIST2 (the bucket's next 11 bits, for BUCKET 3's placement parts, `_topk_bucket_place`) makes the parts ~17.
Session 15, round 2 (benches/results/h200-2026-11-30-s15/attention_decode_indexer_place.json, the same shape, every
config the default's rows, graph == eager over 50 replays): whole launcher, BUCKET 1 as above 244.0 us (PDL off
236.7); SURV 241.7 (MERGE_TILE 2048: parts at 150 registers, 3 programs per SM), SURV + ZERO 245.3; MERGE_TILE 1024
(parts 96 registers) 219.3 with 32 parts, 217.0 with 16 (58.3% of the read bandwidth: the new default), 221.3 with 64;
SELECT_RES 2048 on 4 warps 240.2; placement tiles of 1024 survivors 222.7 (removed: PLACE_TILE 256 kept). Prefixes
over stored scores (SURV + ZERO, MERGE_TILE 1024, 32 parts; memset back with scores_in): memset 8.6, + parts 29.0,
+ threshold 42.2 vs 11.0 / 23.7 / 36.5 for BUCKET 1 (whole select 62.0): the parts cost ~8 us more (the survivors'
stores; 96 registers, 2 spilled), the threshold the same, the placement over ~100 survivors a part (instead of 4096
scores) and no memset ~33 less. ZERO alone was not isolated (at MERGE_TILE 2048: +3.6 us, within the run's spread).
Session 16: that SURV (here: one scan per tile, a returning atomic per tile reserving the bucket's slots, the survivors
as int64 keys, a threshold program dividing each bucket key's position by the part size) replaced by `_topk_slots`
(214.8 / 209.2 vs 221.8 / 220.2 us; figures there) and removed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_enter
from ._topk_select import (INVALID, _digit0, _finish_streamed, _hist_vals, _low32, _ord_digit0, _ord_keys,
                           _part_range, _radix_step, _select_all)


@triton.jit
def _bucket_kernel(sc_ptr, hist_ptr, hist2_ptr, gt_ptr, nb_ptr, bkt_ptr, pos_ptr, NT, TOPK, BLOCK_N: tl.constexpr,
                   PARTS: tl.constexpr, TILE: tl.constexpr, HIST2: tl.constexpr, PDL: tl.constexpr):
    """Step 1 of the module doc (HIST2, BUCKET 3: the bucket's next 11 bits also counted into hist2)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx > TOPK:
        lo, n, _ = _part_range(tl.cdiv(ctx, BLOCK_N) * BLOCK_N, part, PARTS, BLOCK_N)
        i11 = tl.arange(0, 2048)
        zero = tl.zeros([], tl.int64)
        need, prefix, pmask, done = _radix_step(tl.load(hist_ptr + row * 2048 + i11), i11,
                                                TOPK + tl.zeros([], tl.int32), zero, zero, 53, 11, 1024)
        b0 = _digit0(prefix)   # the TOPK-th largest key's first digit
        srow = sc_ptr + row.to(tl.int64) * NT * BLOCK_N
        brow = bkt_ptr + row.to(tl.int64) * NT * BLOCK_N
        gt = tl.zeros([], tl.int32)
        for c0 in range(0, n, TILE):
            p = lo + c0 + tl.arange(0, TILE)
            m = (p < lo + n) & (p < ctx)
            v = tl.load(srow + p, mask=m, other=0)
            d = _ord_digit0(v)
            eq = m & (d == b0)
            gt += tl.sum((m & (d > b0)).to(tl.int32), 0)
            c = tl.sum(eq.to(tl.int32), 0)
            if c > 0:
                at = tl.atomic_add(nb_ptr + row, c, sem="relaxed") + tl.cumsum(eq.to(tl.int32), 0) - 1
                tl.store(brow + at, _ord_keys(v, p, eq), mask=eq)
                if HIST2:   # key bits 42..52 = score bits 10..20
                    tl.atomic_add(hist2_ptr + row * 2048 + ((v >> 10) & 2047), 1, mask=eq, sem="relaxed")
        tl.store(gt_ptr + row * PARTS + part, gt)


@triton.jit
def _threshold_kernel(hist_ptr, gt_ptr, nb_ptr, bkt_ptr, poff_ptr, th_ptr, out_ptr, tbl_ptr, req_ptr, MB, pos_ptr, NT,
                      TOPK, BLOCK_N: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr, RES: tl.constexpr,
                      ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr, ZERO: tl.constexpr, PDL: tl.constexpr):
    """Step 2 of the module doc (ZERO: the row's histogram and bucket count zeroed after use, the program being their
    last reader)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    ctx = tl.load(pos_ptr + row) + 1
    i11 = tl.arange(0, 2048)
    if ctx <= TOPK:
        _select_all(out_ptr + row.to(tl.int64) * TOPK, tbl_ptr + tl.load(req_ptr + row) * MB, ctx, TOPK, TILE,
                    ROWS_OUT, LOG_BS)
    else:
        _, _, per = _part_range(tl.cdiv(ctx, BLOCK_N) * BLOCK_N, 0, PARTS, BLOCK_N)
        zero = tl.zeros([], tl.int64)
        need, prefix, pmask, done = _radix_step(tl.load(hist_ptr + row * 2048 + i11), i11,
                                                TOPK + tl.zeros([], tl.int32), zero, zero, 53, 11, 1024)
        n_b = tl.load(nb_ptr + row)
        brow = bkt_ptr + row.to(tl.int64) * NT * BLOCK_N
        idx = tl.arange(0, 256)
        if n_b <= RES:   # the bucket in registers
            o_r = tl.arange(0, RES)
            m_r = o_r < n_b
            k_r = tl.load(brow + o_r, mask=m_r, other=INVALID)
            for s in tl.static_range(7):   # digits at bits 45, 37, 29, 21, 13, 5, then the last at 0
                if done == 0:
                    sh = 45 - 8 * s if s < 6 else 0
                    need, prefix, pmask, done = _radix_step(_hist_vals(k_r, m_r, prefix, pmask, sh), idx, need,
                                                            prefix, pmask, sh, 8, 0)
            sel = m_r & ((k_r & pmask) >= prefix)
            hsel = tl.histogram(((_low32() - (k_r & _low32())) // per).to(tl.int32), PARTS, mask=sel)
        else:   # passes over the bucket buffer
            prefix, pmask, hsel = _finish_streamed(brow, n_b, need, prefix, pmask, done, idx, per, 45, 7, BLOCK_N,
                                                   BLOCK_N, PARTS, TILE)
        pp = tl.arange(0, PARTS)
        cnt = tl.load(gt_ptr + row * PARTS + pp) + hsel
        tl.store(poff_ptr + row * PARTS + pp, tl.cumsum(cnt, 0) - cnt)
        tl.store(th_ptr + row.to(tl.int64) * 2, prefix)
        tl.store(th_ptr + row.to(tl.int64) * 2 + 1, pmask)
    if ZERO:   # every read of them is done (this program's, and the parts' in the launch before)
        tl.debug_barrier()
        tl.store(hist_ptr + row * 2048 + i11, tl.zeros([2048], tl.int32))
        tl.store(nb_ptr + row, 0)


def bucket_parts(cand, hist, hist2, nb, bkt, pos, NT, topk, tile, bn, parts, pdl):
    """Step 1 (`_bucket_kernel`, grid rows x parts; `hist2` given: HIST2) into the bucket buffer `bkt`; returns the
    parts' counts above the boundary digit (int32 [rows, parts])."""
    n = cand.shape[0]
    gt = torch.empty(n, parts, dtype=torch.int32, device=cand.device)
    _bucket_kernel[(n, parts)](cand, hist, hist if hist2 is None else hist2, gt, nb, bkt, pos, NT, topk, BLOCK_N=bn,
                               PARTS=parts, TILE=tile, HIST2=hist2 is not None, num_warps=4, **pdl)
    return gt


def bucket_select(cand, hist, nb, bkt, poff, th, out, tbl, req, MB, pos, NT, topk, cfg, bn, parts, rows_out, log_bs,
                  pdl, stop_after=None, zero=False):
    """Steps 1-2 of the module doc over `cand` (int32 scores [n, NT * BLOCK_N]) with `hist` (their first-digit
    histogram), `nb` (zeroed int32 [n]) and the bucket buffer `bkt` (int64 [n, NT * BLOCK_N]); `_place_kernel`
    (step 3) follows in `indexer_topk`. `stop_after` "bucket": step 1 only (bench breakdown). `zero` (ZERO 1): the
    threshold program leaves hist and nb at zero."""
    n, tile = cand.shape[0], int(cfg.get("MERGE_TILE", 2048))
    gt = bucket_parts(cand, hist, None, nb, bkt, pos, NT, topk, tile, bn, parts, pdl)
    if stop_after == "bucket":
        return
    _threshold_kernel[(n,)](hist, gt, nb, bkt, poff, th, out, tbl, req, MB, pos, NT, topk, BLOCK_N=bn, PARTS=parts,
                            TILE=tile, RES=int(cfg.get("SELECT_RES", 8192)), ROWS_OUT=rows_out, LOG_BS=log_bs,
                            ZERO=zero, num_warps=int(cfg.get("MERGE_WARPS", 8)), **pdl)
