"""SURV 1 of the BUCKET 1 select (`_topk_bucket`; `indexer_topk` config SURV 1, the default for decode at long contexts
and batch > 1): the exact top-k of a materialised score row (SCORES 1) in three launches, none with a global atomic or
a serial chain of loads:
 1. `_slot_parts_kernel`, grid (rows, PARTS): part p owns the row's entries [p*per, (p+1)*per) (per: a multiple of
    BLOCK_N). It derives the boundary digit b0 (top 11 orderable bits of the topk-th largest score) from the score
    pass's first-digit histogram while its first tile of scores is in flight, then streams its range (the next tile
    requested before the current one is scanned) and writes, in position order, its keys of digit >= b0 (the
    survivors) to its own range of the survivor row, and its keys of digit == b0 (the boundary bucket) to its own
    CAP slots of the row's slot buffer (keys past CAP are counted, not written). One scan packs both counts in the
    halves of an int32; no atomic: the slots and the survivor range are the part's own. It stores its survivor and
    bucket counts; part 0 also the first radix step.
 2. `_slot_threshold_kernel`, grid (rows): issues every load at once (the radix state, the counts, all PARTS x CAP
    slots), finishes the radix select over the boundary bucket in registers (an 8-bit histogram of the digit below
    b0; a boundary of at most SLOT_FEW keys left then is resolved by max reductions, more by further 8-bit digits) so
    that (k & pmask) >= prefix selects exactly the topk largest keys, and stores each part's output offset (an
    exclusive prefix of its survivors above b0 plus its selected bucket keys: the slot index gives the part, no
    division) and the threshold. When a part's bucket outgrew its CAP slots: 8-bit passes over the parts' survivor
    ranges instead. A row whose context holds <= topk positions is written whole here. ZERO: the row's histogram
    is zeroed after use (the program is its last reader), so no memset runs before the score pass.
 3. `_slot_place_kernel`, grid (rows, PARTS): each part writes its selected survivors (in position order) from its
    offset; its first TILE survivors are requested with the offset and threshold (one latency, not a chain).
Exact by the construction of `_topk_bucket` (unique keys, every key of digit > b0 selected, the bucket's selected
keys the largest of it). Workspace per row: the survivor row (8 B x NT * BLOCK_N, touched only by the survivors),
PARTS x CAP slots (8 B), 2 x PARTS counts, PARTS offsets, the radix state.

H200, session 16 (benches/results/h200-2026-11-30-s16/attention_decode_indexer_slots_call{1,2}.json; batch 32 at 128K,
FP8 keys, rows out, graph replay, read bandwidth 4.38 / 4.37 TB/s, byte floor 126.4 / 126.7 us; every config the
default's rows, the new default also vs the IR reference, graph == eager over 50 replays for each): this path with
SELECT_RES 4096 (256 slots a part) on 8 warps 214.8 / 209.2 us (58.9% / 60.6%) vs 221.8 / 220.2 for the session-15
SURV (`_topk_bucket`'s parts reserving bucket slots with a returning atomic per tile, int64 index arithmetic, an
int64 division per bucket key in the threshold program; removed). Prefixes over stored scores (call 1): parts 8.6 us,
threshold 8.9, placement 3.0 vs 12.1 / 13.4 / 3.2. Also measured: SELECT_RES 2048 on 8 / 4 warps 216.5 / 214.1 and
211.5 (but at batch 8 x 128K 134.4 vs 91.6, its threshold program ~35 us longer: presumably a part of a row outgrew
its 128 slots and the row took the passes over the survivors; hence 256 slots); 32 parts 216.9; MERGE_TILE 512 / 2048 227.2 / 226.7; SLOT_FEW 0
(histograms only) 218.0, its threshold ~2.6 us longer. SLOT_H2 (the parts also counting the bucket's next 8 key bits
with relaxed atomics, the threshold program taking that digit off their histogram instead of the slots): 215.5
(RES 4096, 8 warps), 214.8 (2048, 8), 225.5 (2048, 4 warps, 168 registers and a stack frame): removed. Batch 8 at
128K: 94.7 / 91.6 us vs 105.1 / 103.4 for the session-15 default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._pdl import pdl_enter
from ._topk_select import (INVALID, _collect_vals, _digit0, _hist_pass, _hist_vals, _ord_keys, _part_range,
                           _radix_step, _select_all)


@triton.jit
def _slot_parts_kernel(sc_ptr, hist_ptr, sv_ptr, ns_ptr, nb_ptr, slot_ptr, rad_ptr, pos_ptr, NT, TOPK,
                       BLOCK_N: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr, CAP: tl.constexpr,
                       PDL: tl.constexpr):
    """Step 1 of the module doc."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    ctx = (tl.load(pos_ptr + row) + 1).to(tl.int32)   # (int32 positions: half the index arithmetic of int64)
    if ctx > TOPK:
        lo, n, _ = _part_range(tl.cdiv(ctx, BLOCK_N) * BLOCK_N, part, PARTS, BLOCK_N)
        lo = tl.multiple_of(lo, BLOCK_N)
        end = tl.multiple_of(lo + n, BLOCK_N)   # (whole tiles of the row: the loads' masks hold per 4 entries)
        hi = tl.minimum(end, ctx)
        srow = sc_ptr + row.to(tl.int64) * NT * BLOCK_N
        o = tl.arange(0, TILE)
        v = tl.load(srow + lo + o, mask=lo + o < end, other=0)   # in flight during the radix step
        i11 = tl.arange(0, 2048)
        zero = tl.zeros([], tl.int64)
        need, prefix, pmask, done = _radix_step(tl.load(hist_ptr + row * 2048 + i11), i11,
                                                TOPK + tl.zeros([], tl.int32), zero, zero, 53, 11, 1024)
        vlo = (_digit0(prefix) ^ 1024) << 21   # the scores of digit b0: [vlo, vlo + 2^21) (signed int32 order)
        svrow = sv_ptr + row.to(tl.int64) * NT * BLOCK_N
        slrow = slot_ptr + (row * PARTS + part).to(tl.int64) * CAP
        ns = lo
        nb = tl.zeros([], tl.int32)
        for c0 in range(lo, hi, TILE):
            p = tl.multiple_of(c0, BLOCK_N) + o
            vn = tl.load(srow + p + TILE, mask=p + TILE < end, other=0)   # the next tile (entries >= ctx: unused)
            ge = (p < hi) & (v >= vlo)
            eq = ge & (v <= vlo + ((1 << 21) - 1))
            two = ge.to(tl.int32) + (eq.to(tl.int32) << 16)   # survivors in the low 16 bits, bucket keys in the high
            cs = tl.cumsum(two, 0)
            tot = tl.sum(two, 0)
            k = _ord_keys(v, p, ge)
            tl.store(svrow + ns + (cs & 65535) - 1, k, mask=ge)
            at = nb + (cs >> 16) - 1
            tl.store(slrow + at, k, mask=eq & (at < CAP))
            ns += tot & 65535
            nb += tot >> 16
            v = vn
        tl.store(ns_ptr + row * PARTS + part, ns - lo)
        tl.store(nb_ptr + row * PARTS + part, nb)
        if part == 0:
            rr = rad_ptr + row.to(tl.int64) * 4
            tl.store(rr, need.to(tl.int64))
            tl.store(rr + 1, prefix)
            tl.store(rr + 2, pmask)
            tl.store(rr + 3, done.to(tl.int64))


@triton.jit
def _slot_threshold_kernel(hist_ptr, sv_ptr, ns_ptr, nb_ptr, slot_ptr, rad_ptr, poff_ptr, th_ptr, out_ptr, tbl_ptr,
                           req_ptr, MB, pos_ptr, NT, TOPK, BLOCK_N: tl.constexpr, PARTS: tl.constexpr,
                           CAP: tl.constexpr, TILE: tl.constexpr, ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr,
                           FEW: tl.constexpr, ZERO: tl.constexpr, PDL: tl.constexpr):
    """Step 2 of the module doc (FEW: after the digit below b0, a boundary of at most FEW keys is resolved by max
    reductions instead of further histograms)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    ctx = tl.load(pos_ptr + row) + 1
    o_r = tl.arange(0, PARTS * CAP)
    pp = tl.arange(0, PARTS)
    rr = rad_ptr + row.to(tl.int64) * 4   # every load issued at once (none depends on another)
    need, prefix, pmask, done = tl.load(rr).to(tl.int32), tl.load(rr + 1), tl.load(rr + 2), tl.load(rr + 3)
    ns = tl.load(ns_ptr + row * PARTS + pp)
    nb = tl.load(nb_ptr + row * PARTS + pp)
    nb_r = tl.load(nb_ptr + row * PARTS + o_r // CAP)
    k_r = tl.load(slot_ptr + row.to(tl.int64) * PARTS * CAP + o_r)
    idx = tl.arange(0, 256)
    done = done.to(tl.int32)
    if ctx <= TOPK:
        _select_all(out_ptr + row.to(tl.int64) * TOPK, tbl_ptr + tl.load(req_ptr + row) * MB, ctx, TOPK, TILE,
                    ROWS_OUT, LOG_BS)
    else:
        if tl.max(nb, 0) <= CAP:   # every part's bucket keys in its slots: the bucket in registers
            m_r = (o_r % CAP) < nb_r
            k_r = tl.where(m_r, k_r, INVALID)
            if done == 0:   # the digit at bits 45..52
                need, prefix, pmask, done = _radix_step(_hist_vals(k_r, m_r, prefix, pmask, 45), idx, need, prefix,
                                                        pmask, 45, 8, 0)
            if done == 0:
                hit = m_r & ((k_r & pmask) == prefix)
                if tl.sum(hit.to(tl.int32), 0) <= FEW:   # the need-th largest of a few: drop the largest need - 1
                    for _ in range(need - 1):
                        hit = hit & (k_r != tl.max(tl.where(hit, k_r, INVALID), 0))
                    prefix = tl.max(tl.where(hit, k_r, INVALID), 0)
                    pmask = tl.full([], -1, tl.int64)   # the selection: every key >= that key
                else:
                    for s in tl.static_range(6):   # digits at bits 37, 29, 21, 13, 5, then the last at 0
                        if done == 0:
                            sh = 37 - 8 * s if s < 5 else 0
                            need, prefix, pmask, done = _radix_step(_hist_vals(k_r, m_r, prefix, pmask, sh), idx,
                                                                    need, prefix, pmask, sh, 8, 0)
            sel = m_r & ((k_r & pmask) >= prefix)
            cnt = ns - nb + tl.histogram((o_r // CAP).to(tl.int32), PARTS, mask=sel)
        else:   # passes over the parts' survivor ranges
            per = _part_range(tl.cdiv(ctx, BLOCK_N) * BLOCK_N, 0, PARTS, BLOCK_N)[2]
            svrow = sv_ptr + row.to(tl.int64) * NT * BLOCK_N
            for s in tl.static_range(7):
                if done == 0:
                    sh = 45 - 8 * s if s < 6 else 0
                    h = tl.zeros([256], tl.int32)
                    for q in range(PARTS):
                        h += _hist_pass(svrow + q * per, tl.load(ns_ptr + row * PARTS + q), prefix, pmask, sh, TILE)
                    need, prefix, pmask, done = _radix_step(h, idx, need, prefix, pmask, sh, 8, 0)
            cnt = tl.zeros([PARTS], tl.int32)
            for q in range(PARTS):   # every selected survivor of part q
                n_q = tl.load(ns_ptr + row * PARTS + q)
                c = tl.zeros([], tl.int32)
                for off in range(0, n_q, TILE):
                    o = off + tl.arange(0, TILE)
                    k = tl.load(svrow + q * per + o, mask=o < n_q, other=INVALID)
                    c += tl.sum(((o < n_q) & (k != INVALID) & ((k & pmask) >= prefix)).to(tl.int32), 0)
                cnt += tl.where(pp == q, c, 0)
        tl.store(poff_ptr + row * PARTS + pp, tl.cumsum(cnt, 0) - cnt)
        tl.store(th_ptr + row.to(tl.int64) * 2, prefix)
        tl.store(th_ptr + row.to(tl.int64) * 2 + 1, pmask)
    if ZERO:   # every read of the histograms is done (the parts' in the launch before)
        i11 = tl.arange(0, 2048)
        tl.store(hist_ptr + row * 2048 + i11, tl.zeros([2048], tl.int32))


@triton.jit
def _slot_place_kernel(sv_ptr, ns_ptr, th_ptr, poff_ptr, out_ptr, tbl_ptr, req_ptr, MB, pos_ptr, NT, TOPK,
                       BLOCK_N: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr, ROWS_OUT: tl.constexpr,
                       LOG_BS: tl.constexpr, PDL: tl.constexpr):
    """Step 3 of the module doc (grid rows x PARTS)."""
    pdl_enter(PDL)
    row, part = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx > TOPK:   # (shorter rows: written whole by the threshold program)
        lo = _part_range(tl.cdiv(ctx, BLOCK_N) * BLOCK_N, part, PARTS, BLOCK_N)[0]
        th, at = th_ptr + row.to(tl.int64) * 2, row * PARTS + part
        svrow = sv_ptr + row.to(tl.int64) * NT * BLOCK_N + lo
        o = tl.arange(0, TILE)
        k = tl.load(svrow + o, mask=lo + o < NT * BLOCK_N, other=INVALID)   # with the counts, not after them
        n, prefix, pmask, cnt = tl.load(ns_ptr + at), tl.load(th), tl.load(th + 1), tl.load(poff_ptr + at)
        orow, tblrow = out_ptr + row.to(tl.int64) * TOPK, tbl_ptr + tl.load(req_ptr + row) * MB
        cnt = _collect_vals(k, o < n, prefix, pmask, orow, cnt, tblrow, TOPK, ROWS_OUT, LOG_BS)
        for off in range(TILE, n, TILE):   # (rare: more than TILE survivors)
            k = tl.load(svrow + off + o, mask=off + o < n, other=INVALID)
            cnt = _collect_vals(k, off + o < n, prefix, pmask, orow, cnt, tblrow, TOPK, ROWS_OUT, LOG_BS)


def slots_select(cand, hist, sv, poff, th, out, tbl, req, MB, pos, NT, topk, cfg, bn, parts, rows_out, log_bs, pdl,
                 stop_after=None, zero=False):
    """Steps 1-3 of the module doc over `cand` (int32 scores [n, NT * BLOCK_N]) with `hist` (their first-digit
    histogram), into the caller's survivor rows `sv` (int64 [n, NT * BLOCK_N]), part offsets `poff` (int32 [n, parts])
    and thresholds `th` (int64 [n, 2]). Config: MERGE_TILE (the parts' tile, <= 32768), SELECT_RES (PARTS x CAP
    bucket slots, a power of two >= PARTS), MERGE_WARPS (the threshold program's warps), PLACE_TILE (the placement's first step). `stop_after`
    "bucket" / "threshold": stop after that launch (bench breakdown). `zero` (ZERO 1): the threshold program leaves
    hist at zero."""
    n, dev = cand.shape[0], cand.device
    tile, res = int(cfg.get("MERGE_TILE", 1024)), int(cfg.get("SELECT_RES", 4096))
    if tile > 32768 or res < parts or res & (res - 1):
        raise ValueError(f"slots_select: config {cfg} needs MERGE_TILE <= 32768, SELECT_RES a power of two >= "
                         f"SELECT_PARTS")
    cap = res // parts
    slots = torch.empty(n, res, dtype=torch.int64, device=dev)
    cnts = torch.empty(2, n, parts, dtype=torch.int32, device=dev)
    rad = torch.empty(n, 4, dtype=torch.int64, device=dev)
    _slot_parts_kernel[(n, parts)](cand, hist, sv, cnts[0], cnts[1], slots, rad, pos, NT, topk, BLOCK_N=bn,
                                   PARTS=parts, TILE=tile, CAP=cap, num_warps=4, **pdl)
    if stop_after == "bucket":
        return
    _slot_threshold_kernel[(n,)](hist, sv, cnts[0], cnts[1], slots, rad, poff, th, out, tbl, req, MB, pos, NT, topk,
                                 BLOCK_N=bn, PARTS=parts, CAP=cap, TILE=1024, ROWS_OUT=rows_out, LOG_BS=log_bs,
                                 FEW=int(cfg.get("SLOT_FEW", 8)), ZERO=zero, num_warps=int(cfg.get("MERGE_WARPS", 8)),
                                 **pdl)
    if stop_after == "threshold":
        return
    _slot_place_kernel[(n, parts)](sv, cnts[0], th, poff, out, tbl, req, MB, pos, NT, topk, BLOCK_N=bn, PARTS=parts,
                                   TILE=int(cfg.get("PLACE_TILE", 256)), ROWS_OUT=rows_out, LOG_BS=log_bs,
                                   num_warps=4, **pdl)
