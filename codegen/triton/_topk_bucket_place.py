"""BUCKET 3: the exact top-k of a materialised score row (SCORES 1) in two launches, no program per row alone:
 1. `_topk_bucket._bucket_kernel` with HIST2, grid (rows, PARTS): as BUCKET 1's parts (scores above the boundary
    digit b0 counted per part, the boundary bucket's keys appended to the row's bucket buffer), and the bucket's
    next 11 key bits counted into the row's second histogram.
 2. `_bucket_place_kernel`, grid (rows, PARTS): every part finishes the threshold itself (the same in each):
    b0 from the score pass's histogram, the next 11 bits from the second one, then 8-bit digits over the bucket's
    keys matching those 22 bits (in registers when the bucket fits RES, else passes over the buffer), until
    (k & pmask) >= prefix selects exactly the topk largest keys; its output offset is the count above b0 of the
    parts before it plus the selected bucket keys before its range; then it writes its selected positions in order
    (`_collect`, SRC32: the row's output ascending). A row whose context holds <= topk positions: part 0 writes it.
Exact by the construction of `_topk_bucket` (unique keys, every key of digit > b0 selected, the bucket's selected keys
the largest of it). ZERO 1: the histograms, the bucket count and an arrival counter live in a buffer that is zero
between launches (`zeroed_bucket_rows`): the last part of a row to arrive (acq_rel counter, after every part's reads)
zeroes them, so no memset runs before the score pass (the words come from the stream's shared counter set).

H200, session 15 (benches/results/h200-2026-11-30-s15/attention_decode_indexer_select.json; FP8 keys, rows out, graph
replay; every config the default's rows, graph == eager over 50 replays): one row, where the parts are one wave, it
saves the threshold program's serial ~12 us: 64K 29.0 us with 32 or 64 parts (ZERO; RES 16, the bucket streamed
through 96 registers instead of 236-254: 27.9) vs 38.3 for BUCKET 1; 1M with 256 parts 237.1 vs 238.0 for BUCKET 1
(329.7 with 32 parts): the default for one row (`indexer_topk.heuristic`). Batch 32 at 128K it loses: 253.5 us
(32 parts), with ZERO 274.2 (the acq_rel arrival in each of 1024 programs), 16 / 64 parts 259.6 / 303.0, the bucket
streamed 277.6 / 285.2 (64 parts) / 279.7 (16), MERGE_TILE 1024 265.6, vs 237.1 for BUCKET 1: 1024 placement parts
of 236-254 registers (two per SM) each running the threshold's dependent radix steps take ~4 waves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._gemv import tile_counters
from ._pdl import pdl_enter
from ._topk_bucket import bucket_parts
from ._topk_select import (INVALID, _collect, _finish_streamed, _hist_vals, _low32, _part_range, _radix_step,
                           _select_all)


@triton.jit
def _bucket_place_kernel(sc_ptr, hist_ptr, hist2_ptr, gt_ptr, nb_ptr, arrive_ptr, bkt_ptr, out_ptr, tbl_ptr, req_ptr,
                         MB, pos_ptr, NT, TOPK, BLOCK_N: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr,
                         RES: tl.constexpr, ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr, ZERO: tl.constexpr,
                         PDL: tl.constexpr):
    """Step 2 of the module doc."""
    pdl_enter(PDL)
    row, part = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    orow = out_ptr + row.to(tl.int64) * TOPK
    tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
    if ctx <= TOPK:
        if part == 0:
            _select_all(orow, tblrow, ctx, TOPK, TILE, ROWS_OUT, LOG_BS)
    else:
        lo, n, per = _part_range(tl.cdiv(ctx, BLOCK_N) * BLOCK_N, part, PARTS, BLOCK_N)
        i11 = tl.arange(0, 2048)
        zero = tl.zeros([], tl.int64)
        need, prefix, pmask, done = _radix_step(tl.load(hist_ptr + row * 2048 + i11), i11,
                                                TOPK + tl.zeros([], tl.int32), zero, zero, 53, 11, 1024)
        if done == 0:
            need, prefix, pmask, done = _radix_step(tl.load(hist2_ptr + row * 2048 + i11), i11, need, prefix, pmask,
                                                    42, 11, 0)
        n_b = tl.load(nb_ptr + row)
        brow = bkt_ptr + row.to(tl.int64) * NT * BLOCK_N
        idx = tl.arange(0, 256)
        pp = tl.arange(0, PARTS)
        if n_b <= RES:   # the bucket in registers
            o_r = tl.arange(0, RES)
            m_r = o_r < n_b
            k_r = tl.load(brow + o_r, mask=m_r, other=INVALID)
            for s in tl.static_range(6):   # digits at bits 34, 26, 18, 10, 2, then the last at 0
                if done == 0:
                    sh = 34 - 8 * s if s < 5 else 0
                    need, prefix, pmask, done = _radix_step(_hist_vals(k_r, m_r, prefix, pmask, sh), idx, need,
                                                            prefix, pmask, sh, 8, 0)
            sel = m_r & ((k_r & pmask) >= prefix)
            before = tl.sum((sel & (_low32() - (k_r & _low32()) < lo)).to(tl.int32), 0)
        else:   # passes over the bucket buffer
            prefix, pmask, hsel = _finish_streamed(brow, n_b, need, prefix, pmask, done, idx, per, 34, 6, BLOCK_N,
                                                   BLOCK_N, PARTS, TILE)
            before = tl.sum(tl.where(pp < part, hsel, 0), 0)
        before += tl.sum(tl.where(pp < part, tl.load(gt_ptr + row * PARTS + pp), 0), 0)
        if ZERO:   # the last part to have read the row's counts zeroes them for the next launch
            tl.debug_barrier()
            if tl.atomic_add(arrive_ptr + row, 1, sem="acq_rel") == PARTS - 1:
                tl.store(hist_ptr + row * 2048 + i11, tl.zeros([2048], tl.int32))
                tl.store(hist2_ptr + row * 2048 + i11, tl.zeros([2048], tl.int32))
                tl.store(nb_ptr + row, 0)
                tl.atomic_xchg(arrive_ptr + row, 0, sem="relaxed")
        _collect(sc_ptr + row.to(tl.int64) * NT * BLOCK_N, n, prefix, pmask, orow, before, tblrow, TOPK, TILE,
                 ROWS_OUT, LOG_BS, lo, ctx, True)


def bucket_workspace(device: torch.device, rows: int, persistent: bool):
    """(hist [rows, 2048], hist2 [rows, 2048], bucket counts [rows], arrival counters [rows]), int32, all zero: a
    fresh zeroed tensor (one memset), or (persistent, ZERO 1) words of the stream's shared counter set
    (`_gemv.tile_counters`: zero between launches, which the last part of each row restores)."""
    words = rows * 4098
    buf = tile_counters(device, words) if persistent else torch.zeros(words, dtype=torch.int32, device=device)
    return (buf[:rows * 2048].view(rows, 2048), buf[rows * 2048:rows * 4096].view(rows, 2048),
            buf[rows * 4096:rows * 4097], buf[rows * 4097:words])


def bucket_place_select(cand, ws, bkt, out, tbl, req, MB, pos, NT, topk, cfg, bn, parts, rows_out, log_bs, pdl,
                        zero, stop_after=None):
    """Steps 1-2 of the module doc over `cand` (int32 scores [n, NT * BLOCK_N]) with `ws` (`bucket_workspace`: the
    score pass counted the first digits into its hist) and the bucket buffer `bkt` (int64 [n, NT * BLOCK_N]).
    `stop_after` "bucket": step 1 only (bench breakdown)."""
    hist, hist2, nb, arrive = ws
    tile = int(cfg.get("MERGE_TILE", 2048))
    gt = bucket_parts(cand, hist, hist2, nb, bkt, pos, NT, topk, tile, bn, parts, pdl)
    if stop_after == "bucket":
        return
    _bucket_place_kernel[(cand.shape[0], parts)](cand, hist, hist2, gt, nb, arrive, bkt, out, tbl, req, MB, pos, NT,
                                                 topk, BLOCK_N=bn, PARTS=parts, TILE=tile,
                                                 RES=int(cfg.get("SELECT_RES", 2048)), ROWS_OUT=rows_out,
                                                 LOG_BS=log_bs, ZERO=zero, num_warps=int(cfg.get("MERGE_WARPS", 4)),
                                                 **pdl)
