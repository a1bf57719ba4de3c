"""SCORES 1 of the DSA indexer (`indexer_topk`, decode at long contexts): the scores are materialised.

 1. `_scores_kernel`, grid (rows, SPLITS): program (row, split) scores tiles split, split + SPLITS, ... of its row
    (the same tile loads and fp32 score arithmetic as `_score_kernel`: `_tile_load`, `_tile_sums`) and stores one
    int32 per position, the score's orderable bits (`_score_ord`: signed int32 order == float order), to the row
    [rows, NT * BLOCK_N] of the workspace: no keys, no candidates, no int64. It also counts each score's first radix
    digit (the top 11 orderable bits, sign flipped: `_ord_digit0`) into the row's 2048-bin histogram (one
    relaxed global atomic per position). TMA s (FP8 keys, the default): `_scores_tma_kernel`, the same per position,
    its key tiles bulk tensor copies (TMA) pipelined s - 1 deep; `_scores_kernel` where no descriptor fits the pool.
 2. The select over the row (keys formed on load: entry p gives (ord << 32) | (2^32 - 1 - p), exactly the key
    `_score_kernel` would have made). BUCKET 1 (the default, `_topk_bucket`): lean parts count the scores above the
    boundary digit and append the boundary bucket, one program per row finishes the threshold over the bucket,
    then `_place_kernel` (SRC32). BUCKET 0: SELECT 1 (`_topk_parallel._select_kernel` / `_place_kernel`): the parts
    append the survivors (first digit >= the boundary digit) and count the boundary bucket's next 11 bits, the
    last to arrive finishes over the survivors, then every part writes its selected positions from its offset.
Every position is a candidate (KT = BLOCK_N): no witness, no rescore, exact by construction. Workspace per row
4 B x NT * BLOCK_N (scores) + 8 B x NT * BLOCK_N (survivor / bucket row, touched only by those keys).

H200, session 13 (benches/results/h200-2026-11-30-s13/attention_decode_indexer_scores.json; batch 32 at 128K, FP8
keys, rows out, graph replay, every config exact vs the IR reference / the default's rows): the score pass alone
(memset + this kernel, 138 registers, no spills) 248.7 us vs 315.8 for `_score_kernel` with group top-2
candidates. Counting the first digit in a pass of its own over the stored row (HIST 0: `_count_kernel`, 16 parts
per row, the same atomics without a dot to hide behind) instead: score pass + count 296.3 us, the whole launcher
405.7 vs 361.0: removed. Scoring on 8 warps 394.7, BLOCK_N 64 (SPLITS 66) 367.0, BLOCK_N 256 on 8 warps 458.1,
num_stages 2 365.6, SPLITS 66 357.4 (all with SELECT_RES 8192 on 8 warps, 361.0).
Second call (benches/results/h200-2026-11-30-s13/attention_decode_indexer_bucket.json, BUCKET 1 select, whole
launcher 312.0 us, score pass alone 246.9): the next tile's bytes requested before this tile's dot (PREFETCH, two
tiles in flight; 180 registers, 2 programs per SM) 347.9 (score pass 277.3); the same under a 168-register cap
(6 spills) 322.2 (254.3); SPLITS 66 310.9 (241.7). Removed / not adopted. Key tiles as bulk (TMA) copies from a
descriptor of the pool as blocks [NB, 64, DI] (BLOCK_N 64, num_stages 2-3, the loop's copies pipelined) did not
compile there (the tile index derives from the int64 context, and descriptor coordinates must be int32): not timed,
removed; to try again with the coordinates cast to int32.
Session 14 (benches/results/h200-2026-11-30-s14/attention_decode_indexer_tma.json; read bandwidth 4.33 TB/s, byte floor
128.1 us; every config the default's rows, the best exact vs the IR reference, graph == eager over 50 replays for each
TMA config): `_scores_tma_kernel` (int32 coordinates, 2-D descriptor over the pool's rows, 64-row boxes, 93-94 registers
and 25-41 KB of shared memory: 5 programs per SM) with num_stages 3 (two copies in flight), SPLITS 20 (640 programs: one
wave) measured 242.7 us for the whole launcher (52.8%) vs 305.0 for `_scores_kernel` (the previous default) in the same
run; the score pass alone 172.0 (74.5%) vs 247.5. num_stages 4 / 5: 249.7 / 254.4 (score pass 176.4 / 220.4; the same
4-stage score pass measured 184.6 in a BUCKET 2 config of this run: ~5 us spread); SPLITS 33 (num_stages 4) 252.5
(191.3); SPLITS 40 250.6 (179.9); an 80-register cap with SPLITS 24 (6 programs per SM, 2 spills) 267.1 (206.9).
`_scores_kernel` under a 128-register cap (4 programs per SM instead of 3, no spills) 262.7, SPLITS 16 266.6 (203.8):
not kept (the TMA kernel is faster; the cap is untried for MXFP4 keys). Without the vector of table entries the
pipeliner chained each box's copy behind its table load and gave the copies one buffer per two stages; scales loaded
inside the loop are not copied ahead (the pipeliner only copies loads that reach a dot), hence their load one box ahead.
Session 15 (benches/results/h200-2026-11-30-s15/attention_decode_indexer_select.json): the gathered tiles (the fallback
where no descriptor fits) at the TMA config's 20 programs per row measured 319.8 us whole / 258.4 score pass at batch
32 x 128K vs 312.8 / 250.0 at 33 (8 x 132 / T): hence GATHER_SPLITS. Batch 1: at 64K TMA 38.3 / 16.2 vs gathered 38.6 /
16.4 (256 programs; 128: 39.5 / 17.2), at 1M 329.7 / 196.3 vs 326.6 / 199.9 (660 programs; 1056: 324.7 / 196.5): equal
within the spread. TMA programs per row at batch 1: 64K 128 / 256 / 512 -> score pass 17.1 / 16.2 / 16.5; 1M 330 /
660 / 1320 -> 200.9 / 196.3 / 196.3.
Session 16, round 2 (benches/results/h200-2026-11-30-s16/attention_decode_indexer_scores_r2.json; read bandwidth 4.32
TB/s; every config the default's rows, graph == eager over 50 replays for each, the best per batch also vs the IR
reference): whole launcher / score pass alone (memset + scores), batch 32 at 128K: the default (vector entries)
222.4 / 171.8 us (PDL off 201.0), TMA_CARRY 1 221.5 / 199.9, with SPLITS 24 (6 programs per SM at 77 registers)
217.9 / 200.0, with 4 stages 218.7 / 193.5, both 223.3 / 202.1, TMA_J 32 (vector entries, a reduction within one
warp: 3 barriers a box, 4 table loads per program) 224.5 / 183.7; batch 8 at 128K: the default 88.9 / 83.2 (PDL off
81.7), TMA_CARRY 1 77.5 / 78.3 (the new default for 2..8 rows), SPLITS 99 90.9 / 76.5, 4 stages 80.4 / 76.3, both
92.5 / 75.1, TMA_J 32 78.1 / 76.9. Batch 32 keeps the vector entries (its score pass alone slower with CARRY, the whole
launcher within the run-to-run spread: the same default measured 209.2-222.4 us over three calls). Not timed at 1 row
or 9..31 rows. Diagnostic (no selection from it, removed): the score pass without the histogram atomics 156.8 / 159.7
us (default / CARRY) at batch 32, 46.2 / 47.0 at batch 8: the atomics (one per position, the hot first digits of a
row on the same addresses) cost 15-40 us at batch 32 and 31-37 at batch 8, the next lever (per-program private
histograms merged once per program, or spread over more addresses).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ._gemv import tile_counters
from ._indexer_tiles import _row_query, _tile_load, _tile_sums
from ._pdl import _target_supports, pdl_enter
from ._topk_select import _ord_digit0, _score_ord


@triton.jit
def _scores_kernel(q_ptr, w_ptr, qs_ptr, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tbl_ptr, req_ptr, MB, pos_ptr, sc_ptr,
                   hist_ptr, NT, TOPK, SPLITS, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
                   BLOCK_N: tl.constexpr, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr, LOG_BS: tl.constexpr,
                   IMPRECISE: tl.constexpr, PDL: tl.constexpr):
    """Step 1 of the module doc (rows whose context holds <= TOPK positions are skipped: all selected)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx > TOPK:
        tblrow, qa, qb, wq = _row_query(q_ptr, w_ptr, qs_ptr, tbl_ptr, req_ptr, MB, row, HI, DI, HP, KEY_FMT, DOT_DT)
        srow = sc_ptr + row.to(tl.int64) * NT * BLOCK_N
        for tile in range(tl.program_id(1), tl.cdiv(ctx, BLOCK_N), SPLITS):
            kt, ks, p, valid = _tile_load(k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, tile * BLOCK_N, DI,
                                          BLOCK_N, KEY_FMT, LOG_BS)
            v = _score_ord(_tile_sums(qa, qb, wq, kt, ks, KEY_FMT, DOT_DT, IMPRECISE))
            tl.store(srow + p, v, mask=valid)
            tl.atomic_add(hist_ptr + row * 2048 + _ord_digit0(v), 1, mask=valid, sem="relaxed")


@triton.jit
def _scores_tma_kernel(q_ptr, w_ptr, qs_ptr, k_desc, RPB, ks_ptr, s_sb, s_sr, tbl_ptr, req_ptr, MB, pos_ptr, sc_ptr,
                       hist_ptr, priv_ptr, NT, TOPK, SPLITS, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BOX: tl.constexpr, J: tl.constexpr, KEY_FMT: tl.constexpr,
                       DOT_DT: tl.constexpr, LOG_BS: tl.constexpr, IMPRECISE: tl.constexpr, PDL: tl.constexpr,
                       CARRY: tl.constexpr = 0, PRIV: tl.constexpr = 0):
    """`_scores_kernel` with FP8 key tiles as bulk tensor copies (TMA): program (row, split) scores boxes split,
    split + SPLITS, ... of BOX positions (BOX <= block size: one page each) from `k_desc`, a 2-D descriptor over the
    pool's rows (row blk * RPB + offset, int32 coordinates). CARRY 0: the block-table entries of J boxes at a time are
    loaded as one vector (each box's entry picked out by a reduction over the program's warps), so no load sits
    between a box index and its copy. CARRY 1: each box's entry is a scalar loaded one box ahead and carried: the
    pipeliner issues it with the copy two boxes ahead of the dot (77 registers, 3 barriers a box instead of 93 and 9;
    carried two boxes ahead, the pipeliner no longer pipelines the copies). Either way the software pipeliner keeps
    num_stages - 1 copies in flight. Each box's scales are loaded one box ahead (the pipeliner copies ahead only loads
    that reach a dot). PRIV 1: the program counts into a private 2048-bin histogram (`priv_ptr`, zero between launches)
    and adds its nonzero bins to the row's once at the end, restoring zeros (no two programs' atomics on one address)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    ctx = (tl.load(pos_ptr + row) + 1).to(tl.int32)
    if ctx > TOPK:
        tblrow, qa, qb, wq = _row_query(q_ptr, w_ptr, qs_ptr, tbl_ptr, req_ptr, MB, row, HI, DI, HP, KEY_FMT, DOT_DT)
        srow = sc_ptr + row.to(tl.int64) * NT * BLOCK_N
        hrow = hist_ptr + row * 2048
        crow = priv_ptr + (row * SPLITS + tl.program_id(1)).to(tl.int64) * 2048 if PRIV else hrow
        nbox = tl.cdiv(ctx, BOX)
        if CARRY:
            step = SPLITS * BOX
            start = tl.program_id(1) * BOX
            blk = tl.load(tblrow + (start >> LOG_BS), mask=start < ctx, other=0)
            ks = _box_scales(ks_ptr, s_sb, s_sr, blk, start, ctx, BOX, LOG_BS)
            for _ in range(0, tl.cdiv(nbox - tl.program_id(1), SPLITS)):
                kt = k_desc.load([blk * RPB + (start & ((1 << LOG_BS) - 1)), 0])
                nxt = start + step
                blk = tl.load(tblrow + (nxt >> LOG_BS), mask=nxt < ctx, other=0)   # (the next box's)
                ks_next = _box_scales(ks_ptr, s_sb, s_sr, blk, nxt, ctx, BOX, LOG_BS)
                _box_out(srow, crow, start, ctx, _tile_sums(qa, qb, wq, kt, ks, KEY_FMT, DOT_DT, IMPRECISE), BOX)
                ks = ks_next
                start = nxt
        else:
            jj = tl.arange(0, J)
            for c in range(tl.program_id(1), nbox, SPLITS * J):
                bx = c + jj * SPLITS
                blks = tl.load(tblrow + ((bx * BOX) >> LOG_BS), mask=bx < nbox, other=0)
                cnt = tl.minimum(J, tl.cdiv(nbox - c, SPLITS))
                ks = _box_scales(ks_ptr, s_sb, s_sr, tl.sum(tl.where(jj == 0, blks, 0), 0), c * BOX, ctx, BOX, LOG_BS)
                for j in range(0, cnt):
                    start = (c + j * SPLITS) * BOX
                    blk = tl.sum(tl.where(jj == j, blks, 0), 0)
                    kt = k_desc.load([blk * RPB + (start & ((1 << LOG_BS) - 1)), 0])
                    nxt = tl.where(j + 1 < cnt, start + SPLITS * BOX, ctx)   # (none: every lane masked)
                    ks_next = _box_scales(ks_ptr, s_sb, s_sr, tl.sum(tl.where(jj == j + 1, blks, 0), 0), nxt, ctx,
                                          BOX, LOG_BS)
                    _box_out(srow, crow, start, ctx, _tile_sums(qa, qb, wq, kt, ks, KEY_FMT, DOT_DT, IMPRECISE), BOX)
                    ks = ks_next
        if PRIV:   # the private counts (read and zeroed atomically: distinct addresses) into the row's histogram
            h = tl.atomic_xchg(crow + tl.arange(0, 2048), 0, sem="relaxed")
            tl.atomic_add(hrow + tl.arange(0, 2048), h, mask=h > 0, sem="relaxed")


@triton.jit
def _box_scales(ks_ptr, s_sb, s_sr, blk, start, ctx, BOX: tl.constexpr, LOG_BS: tl.constexpr):
    """fp32 scales of positions start .. start + BOX - 1 (>= ctx: 0), in pool block `blk`."""
    o = (start & ((1 << LOG_BS) - 1)) + tl.arange(0, BOX)
    return tl.load(ks_ptr + blk.to(tl.int64) * s_sb + o * s_sr, mask=start + tl.arange(0, BOX) < ctx, other=0.0)


@triton.jit
def _box_out(srow, hrow, start, ctx, s, BOX: tl.constexpr):
    """Orderable bits of the box's scores `s` to the score row, their first digits counted into the histogram."""
    p = start + tl.arange(0, BOX)
    v = _score_ord(s)
    tl.store(srow + p, v, mask=p < ctx)
    tl.atomic_add(hrow + _ord_digit0(v), 1, mask=p < ctx, sem="relaxed")


def _key_descriptor(k8, k_sb, k_sr, block_size, box):
    """2-D TMA descriptor [R, DI] over the FP8 pool's rows (row blk * RPB + offset, RPB = k_sb / k_sr), and RPB; None
    where the target or the pool's layout does not allow one (CUDA sm_90+ or the interpreter; 16-byte aligned base
    and row stride, block stride a whole number of rows, rows addressable by int32, boxes of >= 16 rows on a GPU)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    di = k8.shape[-1]
    nb = k8.shape[0] if k8.dim() == 3 else -(-k8.shape[0] // block_size)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if not (interp or _target_supports()) or k_sb % k_sr or k_sr % 16 or k8.data_ptr() % 16 or box > block_size or \
            di > 256 or (box < 16 and not interp):
        return None, 0
    rpb = k_sb // k_sr
    rows = (nb - 1) * rpb + block_size if k8.dim() == 3 else k8.shape[0]
    if rows >= 2 ** 31:
        return None, 0
    return TensorDescriptor(k8, [rows, di], [k_sr, 1], [box, di]), rpb


ROW_COUNTS = 2048 + 2  # a row's words at the head of the zeroed counter set: first-digit histogram, two counts


def _private_counts(device, n: int, size: int):
    """int32 per-program histograms (PRIV 1) from the stream's zeroed counter set (`_gemv.tile_counters`), past the
    n * ROW_COUNTS words indexer_topk may take from the same set for the rows' histograms and counts; each launch
    leaves them at zero."""
    head = n * ROW_COUNTS
    return tile_counters(device, head + size)[head:head + size]


def scores_launch(args, cand, hist, n, NT, topk, cfg, common):
    """Step 1 of the module doc into `cand` (int32 [n, NT * BLOCK_N]) and `hist` (zeroed int32 [n, 2048]); `args`
    are `_score_kernel`'s leading operands (q, w, q_scale, pools, table, req, MB, pos). `indexer_topk` then runs
    the select (step 2) over `cand`. Config TMA s > 0 (FP8 keys): `_scores_tma_kernel` at num_stages s, boxes of
    min(BLOCK_N, block size) positions, SPLITS programs per row, TMA_J table entries a vector (default 128; TMA_CARRY
    1: scalar entries carried one box ahead instead), where the pool allows a descriptor (`_key_descriptor`); otherwise
    `_scores_kernel` at the config's num_stages (under TMA s: GATHER_SPLITS programs per row, default SPLITS)."""
    splits = max(1, min(int(cfg["SPLITS"]), NT))
    kw = dict(num_warps=int(cfg["num_warps"]), **common)
    if int(cfg.get("TMA", 0)) and common["KEY_FMT"] == 0:
        q, w, qs, k8, ks, k_sb, k_sr, s_sb, s_sr, tbl, req, MB, pos = args
        box = min(common["BLOCK_N"], 1 << common["LOG_BS"])
        desc, rpb = _key_descriptor(k8, k_sb, k_sr, 1 << common["LOG_BS"], box)
        if desc is not None:
            splits = max(1, min(int(cfg["SPLITS"]), NT * common["BLOCK_N"] // box))
            priv = _private_counts(hist.device, n, n * splits * 2048) if cfg.get("TMA_PRIV") else hist
            _scores_tma_kernel[(n, splits)](q, w, qs, desc, rpb, ks, s_sb, s_sr, tbl, req, MB, pos, cand, hist, priv,
                                            NT, topk, splits, BOX=box, J=int(cfg.get("TMA_J", 128)),
                                            CARRY=int(cfg.get("TMA_CARRY", 0)), PRIV=int(cfg.get("TMA_PRIV", 0)),
                                            num_stages=int(cfg["TMA"]), **kw)
            return
    if int(cfg.get("TMA", 0)):   # no descriptor (or MXFP4 keys): the gathered tiles, GATHER_SPLITS programs per row
        splits = max(1, min(int(cfg.get("GATHER_SPLITS", splits)), NT))
    _scores_kernel[(n, splits)](*args, cand, hist, NT, topk, splits, num_stages=int(cfg["num_stages"]), **kw)
