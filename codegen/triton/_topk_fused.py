"""Exact top-k of the DSA indexer in two launches, no memset (`indexer_topk` config SELECT 2, every key a
candidate: KT = BLOCK_N), for short contexts at small batch (the rank decode step).

Keys: key = (orderable(score) << 32) | (2^32 - 1 - position) (`_score_keys`): signed int64 order is the selection
order (score desc, position asc) and keys are unique. t16 = the top 16 key bits in unsigned order (sign flipped);
its top 11 bits are the first radix digit d0 (`_digit0`).
 1. `_score_select_kernel`, grid (rows, P): program (row, split) scores tiles split, split + P, ... (BLOCK_N
    positions each), stores the keys in position order and counts each key three times with relaxed global
    atomics: by d0 (2048 bins), by t16 (65536 bins) and by w21 = (t16 mod 2048) * 32 + key bits 43..47 (65536
    bins: the 21-bit prefix, folded). It then arrives at the row's counter (acq_rel, after a barrier). The LAST
    program to arrive reads three small histograms (`_threshold`): all d0 bins (the topk-th largest key's digit
    b0), the 32 t16 bins under b0 (5 more bits), and the 32 w21 bins of that 16-bit prefix (5 more bits: used only
    when they sum to the 16-bit bucket's count, i.e. no other 16-bit bucket folds onto them). Each is a radix
    step (`_radix_step`) that stops once the boundary bucket is taken whole (scores are 32-bit floats, so a 21-bit
    prefix leaves ~0-2 keys per bucket at 8K keys). Only when it is not taken whole does it scan the row's keys
    (`_scan_refine`): a row of at most SELECT_SCAN keys held in registers gives the boundary bucket's need-th
    largest key by a few masked maxima or minima (`_pick`, up to SELECT_PICK passes), nothing stored; otherwise the
    bucket goes to a work row of WB keys, then 8-bit steps in registers (more than WB: 8-bit passes over every key).
    The exact threshold (prefix, pmask) -- the selection is exactly the keys with (k & pmask) >= prefix -- goes to
    `th`; the counter is reset.
 2. `_place_select_kernel`, grid (rows, PARTS): part p counts the selected keys before its range (a compare and a
    sum, no compaction), writes its selected keys from there in position order (as positions or pool rows: the
    output ascending) and stores 0 into the histogram bins its keys counted, so the buffer is zero again for the
    next launch (`zeroed_rows`, the counter protocol of `_gemv.combine_in_launch`).
The serial program touches ~2100 histogram bins, and the 8K keys only in the scan (one program streaming 4096 keys
costs ~4.5 µs on the H200: ~4000 SASS instructions per thread at 8 warps, session 9).
The scan is not rare. H200, session 20 (benches/indexer_b1_paths.py, one row at 8K, top-2048 of FP8 keys, 64 random
input sets, each timed alone under graph replay; benches/results/h200-2026-12-01-s20/indexer_b1_*.json): 5 of 64 sets
reach it (3 with a 21-bit bucket of 2 keys of which 1 is needed, 2 where another 16-bit bucket folded onto the w21
bins: 12 and 13 keys), and it cost them 23.5 us against 12.8 for the others (the score launch alone 5.8 us whatever
the set, and whatever the histograms' addresses: 8 processes with shifted buffers 5.8-6.1). Its previous form (the
bucket gathered 1024 keys a step with a block-wide cumsum, then 8-bit steps over the work row) 23.2-23.6 us on those
sets; gathered in one 8192-key step 20.1-20.5; ranked all-pairs (a 128 x 128 compare, measured and removed) 0.7-1.1 us
slower than the 8-bit steps; the masked maxima / minima over the row in registers (SELECT_SCAN 8192, the b1 default)
15.4-16.9 us, the other 59 sets unchanged (median 12.83 vs 12.86 us), every set's rows equal the previous form's and
the first 8 the IR reference's. In the rank decode graph the indexer's score launch had ended ~20 us after the
indexer front on some runtime instances (machine A in session 19, one machine in this session) and ~10 us on others:
most likely this scan (not reached in 12 rounds of refilled caches, benches/results/h200-2026-12-01-s20/
runtime_select_refill.json: the step 512.45 us with the change and 513.0 without, medians of 12 rounds).
A row whose context holds <= topk
positions is written whole by its program 0 of step 1. PDL: `pdl_enter` first in both kernels. Batch invariant:
each row from its own keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._indexer_tiles import _load_q, _tile_keys
from ._pdl import launch_kwargs, pdl_enter
from ._topk_select import INVALID, _collect_vals, _hist_vals, _part_range, _radix_step, _select_all

MAXKEY = tl.constexpr(2 ** 63 - 1)   # above every key (INVALID, -2^63, is below every key)
H0 = tl.constexpr(2048)        # d0 bins
H16 = tl.constexpr(65536)      # t16 bins (and folded w21 bins)
ROW_WORDS = 2048 + 2 * 65536 + 1   # int32 per row of the zeroed buffer: d0, t16, w21 histograms, arrival counter


@triton.jit
def _top16(k):
    """The top 16 key bits in unsigned order (0 .. 65535); `_digit0` is its top 11 bits."""
    return ((k >> 48) & 65535).to(tl.int32) ^ 32768


@triton.jit
def _fold21(t16, k):
    """The 21-bit prefix folded into 65536 bins: (t16 mod 2048) * 32 + key bits 43..47."""
    return (t16 & 2047) * 32 + ((k >> 43) & 31).to(tl.int32)


@triton.jit
def _pick(k, match, need, n_w):
    """The need-th largest of the n_w keys k where match: need passes of a masked maximum (each below the last) or
    n_w - need + 1 passes of a masked minimum (each above the last), whichever is fewer (keys are unique)."""
    if need <= n_w - need + 1:
        lim = tl.full([], MAXKEY, tl.int64)
        for _ in range(need):
            lim = tl.max(tl.where(match & (k < lim), k, INVALID), 0)
    else:
        lim = tl.full([], INVALID, tl.int64)
        for _ in range(n_w - need + 1):
            lim = tl.min(tl.where(match & (k > lim), k, MAXKEY), 0)
    return lim


@triton.jit
def _scan_refine(crow, n_c, wrow, need, prefix, pmask, TILE: tl.constexpr, WB: tl.constexpr, PICK: tl.constexpr):
    """The threshold inside the boundary bucket (keys matching prefix/pmask) from the row's keys (read through L2:
    other programs wrote them). A row of at most TILE keys is held in registers and, when the need-th largest of the
    bucket is at most PICK maxima or minima away (`_pick`; PICK 0: never), taken by masked reductions, nothing
    stored. Else the bucket is gathered into the work row, TILE keys a step, and fixed by 8-bit steps at bits 40,
    32, ..., 0 over it in registers (over every key when more than WB match). Returns (prefix, pmask)."""
    picked = tl.zeros([], tl.int32)
    if PICK > 0:
        if n_c <= TILE:
            o1 = tl.arange(0, TILE)
            k1 = tl.load(crow + o1, mask=o1 < n_c, other=INVALID, cache_modifier=".cg")
            match = (o1 < n_c) & (k1 != INVALID) & ((k1 & pmask) == prefix)
            n_m = tl.sum(match.to(tl.int32), 0)
            if tl.minimum(need, n_m - need + 1) <= PICK:
                prefix = _pick(k1, match, need, n_m)
                pmask = tl.full([], -1, tl.int64)
                picked += 1
    if picked == 0:
        prefix, pmask = _gather_refine(crow, n_c, wrow, need, prefix, pmask, TILE, WB)
    return prefix, pmask


@triton.jit
def _gather_refine(crow, n_c, wrow, need, prefix, pmask, TILE: tl.constexpr, WB: tl.constexpr):
    """`_scan_refine`'s gather into the work row and 8-bit steps."""
    n_w = tl.zeros([], tl.int32)
    for off in range(0, n_c, TILE):
        o = off + tl.arange(0, TILE)
        k = tl.load(crow + o, mask=o < n_c, other=INVALID, cache_modifier=".cg")
        hit = (o < n_c) & (k != INVALID) & ((k & pmask) == prefix)
        at = n_w + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(wrow + at, k, mask=hit & (at < WB))
        n_w += tl.sum(hit.to(tl.int32), 0)
    tl.debug_barrier()
    idx = tl.arange(0, 256)
    done = tl.zeros([], tl.int32)
    if n_w <= WB:
        wo = tl.arange(0, WB)
        wk = tl.load(wrow + wo, mask=wo < n_w, other=INVALID)
        for p in tl.static_range(6):
            if done == 0:
                need, prefix, pmask, done = _radix_step(_hist_vals(wk, wo < n_w, prefix, pmask, 40 - 8 * p), idx, need,
                                                        prefix, pmask, 40 - 8 * p, 8, 0)
    else:
        for p in tl.static_range(6):
            if done == 0:
                h = tl.zeros([256], tl.int32)
                for off in range(0, n_c, TILE):
                    o = off + tl.arange(0, TILE)
                    k = tl.load(crow + o, mask=o < n_c, other=INVALID, cache_modifier=".cg")
                    h += _hist_vals(k, o < n_c, prefix, pmask, 40 - 8 * p)
                need, prefix, pmask, done = _radix_step(h, idx, need, prefix, pmask, 40 - 8 * p, 8, 0)
    return prefix, pmask


@triton.jit
def _threshold(crow, hrow, n_c, wrow, TOPK, TILE: tl.constexpr, WB: tl.constexpr, PICK: tl.constexpr):
    """Step 1's last program: (prefix, pmask) of the row's top-k from its three histograms (module doc)."""
    i11 = tl.arange(0, H0)
    need, prefix, pmask, done = _radix_step(tl.load(hrow + i11, cache_modifier=".cg"), i11,
                                            TOPK + tl.zeros([], tl.int32), tl.zeros([], tl.int64),
                                            tl.zeros([], tl.int64), 53, 11, 1024)
    i5 = tl.arange(0, 32)
    if done == 0:
        b0 = ((prefix >> 53) & 2047).to(tl.int32) ^ 1024
        need, prefix, pmask, done = _radix_step(tl.load(hrow + H0 + b0 * 32 + i5, cache_modifier=".cg"), i5, need,
                                                prefix, pmask, 48, 5, 0)
    if done == 0:
        t16 = _top16(prefix)
        h21 = tl.load(hrow + H0 + H16 + (t16 & 2047) * 32 + i5, cache_modifier=".cg")
        if tl.sum(h21, 0) == tl.load(hrow + H0 + t16, cache_modifier=".cg"):   # no other 16-bit bucket folded in
            need, prefix, pmask, done = _radix_step(h21, i5, need, prefix, pmask, 43, 5, 0)
    if done == 0:
        prefix, pmask = _scan_refine(crow, n_c, wrow, need, prefix, pmask, TILE, WB, PICK)
    return prefix, pmask


@triton.jit
def _score_select_kernel(q_ptr, w_ptr, qs_ptr, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tbl_ptr, req_ptr, MB, pos_ptr,
                         key_ptr, hist_ptr, arrive_ptr, work_ptr, th_ptr, out_ptr, NT, TOPK,
                         HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr,
                         KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr, LOG_BS: tl.constexpr, IMPRECISE: tl.constexpr,
                         TILE: tl.constexpr, WB: tl.constexpr, PICK: tl.constexpr, ROWS_OUT: tl.constexpr,
                         SCORE_ONLY: tl.constexpr, PDL: tl.constexpr):
    """Step 1 of the module doc. SCORE_ONLY (a profiling aid): score and count, no arrival, no threshold."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx <= TOPK:   # everything is selected
        if split == 0:
            _select_all(out_ptr + row.to(tl.int64) * TOPK, tbl_ptr + tl.load(req_ptr + row) * MB, ctx, TOPK, 1024,
                        ROWS_OUT, LOG_BS)
    else:
        tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
        qa, qb, wq = _load_q(q_ptr, w_ptr, qs_ptr, row, HI, DI, HP, KEY_FMT, DOT_DT)
        n_tiles = tl.cdiv(ctx, BLOCK_N)
        crow = key_ptr + row.to(tl.int64) * NT * BLOCK_N
        hrow = hist_ptr + row.to(tl.int64) * (H0 + 2 * H16)
        for tile in range(split, n_tiles, tl.num_programs(1)):
            key = _tile_keys(qa, qb, wq, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, tile * BLOCK_N, DI,
                             BLOCK_N, KEY_FMT, DOT_DT, LOG_BS, IMPRECISE)
            tl.store(crow + tile * BLOCK_N + tl.arange(0, BLOCK_N), key)
            live = key != INVALID
            t16 = _top16(key)
            tl.atomic_add(hrow + (t16 >> 5), 1, mask=live, sem="relaxed")
            tl.atomic_add(hrow + H0 + t16, 1, mask=live, sem="relaxed")
            tl.atomic_add(hrow + H0 + H16 + _fold21(t16, key), 1, mask=live, sem="relaxed")
        if not SCORE_ONLY:
            tl.debug_barrier()
            ticket = tl.atomic_add(arrive_ptr + row, 1, sem="acq_rel")
            if ticket == tl.num_programs(1) - 1:   # the last program of the row: every key and count is visible
                tl.debug_barrier()
                prefix, pmask = _threshold(crow, hrow, n_tiles * BLOCK_N, work_ptr + row.to(tl.int64) * WB, TOPK,
                                           TILE, WB, PICK)
                tl.store(th_ptr + row.to(tl.int64) * 2, prefix)
                tl.store(th_ptr + row.to(tl.int64) * 2 + 1, pmask)
                tl.atomic_xchg(arrive_ptr + row, 0, sem="relaxed")


@triton.jit
def _place_own(k, m, prefix, pmask, orow, cnt, hrow, tblrow, TOPK, ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr):
    """Write the selected keys of k (mask m) from cnt on and zero the histogram bins the keys counted."""
    cnt = _collect_vals(k, m, prefix, pmask, orow, cnt, tblrow, TOPK, ROWS_OUT, LOG_BS)
    live = m & (k != INVALID)   # zero the bins these keys counted (step 1)
    t16 = _top16(k)
    tl.store(hrow + (t16 >> 5), 0, mask=live)
    tl.store(hrow + H0 + t16, 0, mask=live)
    tl.store(hrow + H0 + H16 + _fold21(t16, k), 0, mask=live)
    return cnt


@triton.jit
def _place_select_kernel(key_ptr, hist_ptr, th_ptr, out_ptr, tbl_ptr, req_ptr, MB, pos_ptr, NT, TOPK,
                         BLOCK_N: tl.constexpr, PARTS: tl.constexpr, TILE: tl.constexpr, OWN: tl.constexpr,
                         ROWS_OUT: tl.constexpr, LOG_BS: tl.constexpr, PDL: tl.constexpr):
    """Step 2 of the module doc: part `part` of the row's keys (ranges of ceil(n_c / PARTS) keys), counted before
    its range TILE keys at a time, its own keys OWN at a time (OWN >= the range: one step); its first OWN keys are
    requested with the threshold, before the count (session 16, batch 1 at 8K: 13.09 / 13.13 us vs 13.51 / 13.66
    requested after it; with TILE 8192 on 8 warps, the default, 12.71 / 12.82)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx > TOPK:
        n_c = tl.cdiv(ctx, BLOCK_N) * BLOCK_N
        lo, n, _ = _part_range(n_c, part, PARTS, 1)
        prefix = tl.load(th_ptr + row.to(tl.int64) * 2)
        pmask = tl.load(th_ptr + row.to(tl.int64) * 2 + 1)
        crow = key_ptr + row.to(tl.int64) * NT * BLOCK_N
        hrow = hist_ptr + row.to(tl.int64) * (H0 + 2 * H16)
        orow = out_ptr + row.to(tl.int64) * TOPK
        tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
        o1 = tl.arange(0, OWN)
        k1 = tl.load(crow + lo + o1, mask=o1 < n, other=INVALID)
        cnt = tl.zeros([], tl.int32)
        for off in range(0, lo, TILE):   # selected keys before this part: the output offset
            o = off + tl.arange(0, TILE)
            k = tl.load(crow + o, mask=o < lo, other=INVALID)
            cnt += tl.sum(((o < lo) & (k != INVALID) & ((k & pmask) >= prefix)).to(tl.int32), 0)
        cnt = _place_own(k1, o1 < n, prefix, pmask, orow, cnt, hrow, tblrow, TOPK, ROWS_OUT, LOG_BS)
        for off in range(OWN, n, OWN):
            o = off + o1
            k = tl.load(crow + lo + o, mask=o < n, other=INVALID)
            cnt = _place_own(k, o < n, prefix, pmask, orow, cnt, hrow, tblrow, TOPK, ROWS_OUT, LOG_BS)
        if part == PARTS - 1:
            for j0 in range(0, TOPK, 1024):
                j = j0 + tl.arange(0, 1024)
                tl.store(orow + j, tl.full([1024], -1, tl.int64), mask=(j >= cnt) & (j < TOPK))


_ZEROED: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []   # outgrown buffers: a captured CUDA graph may still point at them


def zeroed_rows(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(histograms int32 [rows, 2048 + 2 * 65536], arrival counters int32 [rows]) that are all 0 between launches
    (step 2 zeroes the bins step 1 counted, step 1 resets the counter), one buffer per (device, stream) as
    `_gemv.tile_counters`: launches on one stream run one after another. Zeroed once when made (inside a graph
    capture the zeroing is captured too, harmless); an outgrown buffer is replaced but kept alive."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    bins = ROW_WORDS - 1
    need = rows * ROW_WORDS
    buf = _ZEROED.get(key)
    if buf is None or buf.numel() < need:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(need, 4 * ROW_WORDS), dtype=torch.int32, device=device)
        _ZEROED[key] = buf
    return buf[:rows * bins].view(rows, bins), buf[rows * bins:need]


FUSED_ROWS = 64         # rows per launch pair (the zeroed histograms take 520 KB a row)
PICK_PASSES = 16        # SELECT_PICK's default: the most masked max / min passes `_pick` makes over a row in registers


def fused_launch(qc, wc, sc, pools, tbl, rc, MB, pc, oc, NT, topk, cfg, rows_out, score_only, consts):
    """SELECT 2 (`_topk_fused`): `_score_select_kernel` over grid (rows, SPLITS), then `_place_select_kernel` over
    grid (rows, SELECT_PARTS); at most FUSED_ROWS rows per launch pair (the zeroed histograms: 520 KB a row).
    SELECT_TILE: keys per step of the placement's count; SELECT_SCAN: keys per step of the last arriver's scan of the
    row (default 1024: fewer registers; a row of at most this many keys is held in registers); SELECT_PICK: the most
    passes of `_pick` over such a row (0: none); SELECT_WB: the boundary bucket's work row; SELECT_WARPS: the
    placement's warps."""
    n_all, bn, dev = qc.shape[0], consts["BLOCK_N"], qc.device
    tile, wb, parts, pick, scan = (int(cfg.get(k, d)) for k, d in (
        ("SELECT_TILE", 4096), ("SELECT_WB", 256), ("SELECT_PARTS", 16), ("SELECT_PICK", PICK_PASSES),
        ("SELECT_SCAN", 1024)))
    if any(v & (v - 1) or v < 16 for v in (tile, wb, scan)) or parts & (parts - 1) or not 1 <= parts <= 1024 \
            or not 0 <= pick <= 64:
        raise ValueError(f"indexer_topk: config {cfg}: SELECT_TILE / SELECT_WB / SELECT_SCAN must be powers of two >= "
                         f"16, SELECT_PARTS a power of two in 1..1024, SELECT_PICK in 0..64")
    splits = max(1, min(int(cfg["SPLITS"]), NT))
    for r0 in range(0, n_all, FUSED_ROWS):
        r1 = min(n_all, r0 + FUSED_ROWS)
        n = r1 - r0
        keys = torch.empty(n, NT * bn, dtype=torch.int64, device=dev)
        work = torch.empty(n, wb, dtype=torch.int64, device=dev)
        th = torch.empty(n, 2, dtype=torch.int64, device=dev)
        if score_only:   # profiling: counts go to scratch, the zeroed buffer stays zero
            hist = torch.empty(n, ROW_WORDS - 1, dtype=torch.int32, device=dev)
            arrive = hist
        else:
            hist, arrive = zeroed_rows(dev, n)
        _score_select_kernel[(n, splits)](qc[r0:r1], wc[r0:r1], sc[r0:r1], *pools, tbl, rc[r0:r1], MB, pc[r0:r1], keys,
                                          hist, arrive, work, th, oc[r0:r1], NT, topk, TILE=scan, WB=wb,
                                          PICK=pick,
                                          ROWS_OUT=rows_out, SCORE_ONLY=score_only, num_warps=int(cfg["num_warps"]),
                                          num_stages=int(cfg["num_stages"]), **consts)
        if not score_only:
            _place_select_kernel[(n, parts)](keys, hist, th, oc[r0:r1], tbl, rc[r0:r1], MB, pc[r0:r1], NT, topk,
                                             BLOCK_N=bn, PARTS=parts, TILE=tile, ROWS_OUT=rows_out,
                                             OWN=min(tile, max(16, triton.next_power_of_2(-(-NT * bn // parts)))),
                                             LOG_BS=consts["LOG_BS"], num_warps=int(cfg.get("SELECT_WARPS", 8)),
                                             **launch_kwargs())
