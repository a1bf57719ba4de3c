"""SCORES 1 of the DSA indexer (`indexer_topk`, decode at long contexts): the scores are materialised.

 1. `_scores_kernel`, grid (rows, SPLITS): program (row, split) scores tiles split, split + SPLITS, ... of its row
    (the same tile loads and fp32 score arithmetic as `_score_kernel`: `_tile_load`, `_tile_sums`) and stores one
    int32 per position, the score's orderable bits (`_score_ord`: signed int32 order == float order), to the row
    [rows, NT * BLOCK_N] of the workspace: no keys, no candidates, no int64. It also counts each score's first radix
    digit (the top 11 orderable bits, sign flipped: `_ord_digit0`) into the row's 2048-bin histogram (one
    relaxed global atomic per position).
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
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._indexer_tiles import _row_query, _tile_load, _tile_sums
from ._pdl import pdl_enter
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


def scores_launch(args, cand, hist, n, NT, topk, cfg, common):
    """Step 1 of the module doc into `cand` (int32 [n, NT * BLOCK_N]) and `hist` (zeroed int32 [n, 2048]); `args`
    are `_score_kernel`'s leading operands (q, w, q_scale, pools, table, req, MB, pos). `indexer_topk` then runs
    the select (step 2) over `cand`."""
    splits = max(1, min(int(cfg["SPLITS"]), NT))
    _scores_kernel[(n, splits)](*args, cand, hist, NT, topk, splits, num_warps=int(cfg["num_warps"]),
                                num_stages=int(cfg["num_stages"]), **common)
