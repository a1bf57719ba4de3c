"""DSA indexer scorer + exact top-k (IR op `indexer_topk`, SPEC §5 steps 6-7), decode and prefill.

Math. Token i (request r, position p_i) scores the positions s <= p_i at their paged pool rows (`_paging.rows_of`):
    I(i, s) = sum_j w_j ReLU(deq(q_j) . deq(k_s)) = ks_s * sum_j (w_j qs_j) ReLU(q8_j . k8_s)
(FP8: power-of-two fp32 scales per (token, head) and per key row; fp8 values are exact in bf16, the
tensor-core dot accumulates in fp32; DOT 1/2: the e4m3 codes straight into FP8 tensor-core dots, see
`indexer_topk`). MXFP4 keys (E2M1, one E8M0 scale per 32 values, SPEC §7) are
dequantised in registers (exact in bf16) and dotted with the even/odd halves of q. Sel(i) = top-k by
(score desc, position asc), ascending, -1 padded; a context of <= topk positions selects all of it.

Workspace, not a score matrix: the launcher processes rows in chunks whose workspace fits WORKSPACE_BYTES, so a
prefill's [rows x context] scores never exist at once. Within a chunk, the paths below keep per-tile candidates
(CAND 0 / 1) or, with KT = BLOCK_N (short contexts) and SCORES 1 (decode at long contexts while T x L x 4 B fits
SCORES_WORKSPACE, 64 MB: 16.8 MB at 32 tokens x 128K), every position's key or int32 score: for those rows the
chunk's score row is in memory (issue 4 asks for no full score matrix; this is the bounded departure, config
SCORES 0 avoids it at long contexts). Each score becomes a unique 64-bit key
    key = (orderable(score) << 32) | (2^32 - 1 - position)            (signed int64 order)
whose order is exactly the selection order; four kernels:
 1. score    grid (rows, SPLITS): a lean streaming pass (nothing held across tiles; num_stages lets the
             pipeliner copy key tiles into shared memory ahead of the dot). Per tile of BLOCK_N positions,
             keys in registers; KT candidates in position order go to `cand[row, tile]`, an overflow
             witness to `tmin[row, tile]`:
             CAND 0: the tile's KT best (tl.topk), witness = the KT-th best;
             CAND 1: the best two of each of KT/2 groups of consecutive positions (max reductions, no
             sort), witness = the best unsent key.
 2. merge 1  grid (rows): theta = topk-th largest candidate, 8-bit radix select (tl.histogram, stops once
             the boundary bucket is taken whole; candidates held in registers when they fit MERGE_TILE). A tile whose witness is selected "overflowed" (it holds
             >= KT (CAND 1: 2) winners, so <= topk/KT (topk/2) tiles can). Without overflow the selected
             candidates ARE the exact top-k (an unsent element ranks at most its tile's witness < theta,
             with topk elements above theta); they are in position order, so compaction writes the
             ascending output directly.
 3. rescore  grid (rows, <= 16): overflowed tiles are rescored into `ext` minus their candidates (disjoint sets).
 4. merge 2  rows that overflowed: the keys of candidates + ext at or above merge 1's threshold (a superset
             of the true top-k: adding keys only raises the topk-th largest) are gathered into a work row of
             2 pow2(topk) keys and selected there in registers, then one tl.sort (when they do not fit: radix
             select over all candidates + ext).
With KT = BLOCK_N (short contexts, see `heuristic`) every key is a candidate: no witness, steps 3-4 never run.
FILTER 1 inserts between 1 and 2 a parallel pre-selection (`_filter_kernel`, grid rows x FILTER_PARTS, three
launches): the boundary's next 11 key bits are counted, and only candidates whose top 22 bits reach the
topk-th largest candidate's are compacted (in position order) for the merges, which then stream a few
thousand keys instead of every candidate (exact: the dropped keys rank below a key the selection beats).
SELECT 1 replaces 2 (and FILTER) by two launches over grid rows x SELECT_PARTS (`_select_kernel`,
`_place_kernel`), no program passing over all of a row's candidates: each part derives the boundary digit b0
from the score pass's histogram, appends its keys of digit >= b0 (the survivors) to a survivor row and counts
bucket b0's next 11 bits; the last part to arrive at the row's counter (atomic acq_rel) takes that digit, then
8-bit digits over the survivors (in registers when they fit SELECT_RES) to the exact threshold, flags
overflowed tiles, and stores each part's output offset; `_place_kernel` writes every part's selected keys
from its offset (position order: the output ascending). Merge 2 then re-selects over the survivors.
SELECT 2 (KT = BLOCK_N; `_topk_fused`): two launches, no memset: the score programs also count their keys in three
histograms, the last to arrive reads the exact threshold off them, a parallel kernel places the selection.
(A SELECT 3 without a last arriver, every placement part reading the threshold off the histograms itself, was
measured slower in session 11 and removed: see `heuristic`.)
SCORES 1 (decode at long contexts, `_indexer_scores`): the score kernel stores each position's orderable fp32 score
bits (int32) to a [rows, NT * BLOCK_N] workspace and counts their first digit, nothing else; SELECT 1 then runs over
that row (`_select_kernel` / `_place_kernel` with SRC32 form each key from its score and position on load), or with
BUCKET 1 (`_topk_bucket`, the default) three launches none of which carries another's registers: lean parts count
the scores above the boundary digit and append the boundary bucket's keys, one program per row finishes the exact
threshold over that bucket and stores each part's offset, then `_place_kernel` (SURV 1, the default: `_topk_slots`,
the parts keep their survivors and the bucket in slots of their own, no atomics, and ZERO 1 leaves no memset); or
(one row, the default there) with BUCKET 3 (`_topk_bucket_place`) two: the same parts also count the bucket's next 11 bits, then every placement part
finishes the threshold itself (ZERO 1: over counts the select leaves at zero, no memset).
Workspace per row 8 B x (NT*(KT+1) + (topk/KT)*BLOCK_N + 2 pow2(topk) + 2); prefill runs in row chunks.
Pools: flat [N, ...] or block views [NB, block_size, ...] of a packed pool (`_paging.pool_strides`), read
in place through `row_offsets`.

API: `indexer_topk(...)` (positions: the IR op), `output="rows"` (the positions' pool rows, -1
padded: what attention kernels read), `key_format="mxfp4"`. Tunables: BLOCK_N, KT, SPLITS (programs
per row), CAND, DOT, PREFETCH (score kernel: next tile in flight), num_warps / num_stages (score kernel),
MERGE_TILE, MERGE_WARPS, FILTER / FILTER_PARTS, SCORES, BUCKET, SURV / SLOT_FEW (BUCKET 1: `_topk_slots`), TMA / TMA_J
/ TMA_CARRY / TMA_PRIV (SCORES 1 with FP8 keys: key tiles as pipelined bulk tensor copies,
`_indexer_scores.scores_launch`), GATHER_SPLITS (their fallback's programs), ZERO (BUCKET 3 / BUCKET 1: no memset, `_topk_bucket_place` /
`_topk_bucket`), SELECT / SELECT_PARTS / SELECT_RES (SELECT 2: SELECT_PARTS, SELECT_TILE, SELECT_SCAN, SELECT_PICK, SELECT_WB, SELECT_WARPS:
`_topk_fused.fused_launch`), HIST (score kernel: per-program first-digit histogram).
Every kernel keeps the PDL contract (`_pdl`: `pdl_enter` first, the caches they read are written earlier in the
step). Batch invariant (each row on its own).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import torch
import triton.language as tl

from ..kernel import KernelTemplate, Tunable, pow2_bucket
from ._paging import context_bound, paging_args, pool_strides
from ._indexer_scores import ROW_COUNTS, scores_launch
from ._indexer_tiles import _rescore_kernel, _score_kernel
from ._pdl import launch_kwargs
from ._topk_bucket import bucket_select
from ._topk_bucket_place import bucket_place_select, bucket_workspace
from ._gemv import tile_counters
from ._topk_fused import fused_launch
from ._topk_parallel import _filter_kernel, _place_kernel, _select_kernel
from ._topk_slots import slots_select
from ._topk_select import _merge_kernel

WORKSPACE_BYTES = 1 << 28
SCORES_WORKSPACE = 1 << 26   # the heuristic materialises the scores (SCORES 1) when T x L x 4 B fit this
RESCORE_PROGRAMS = 16   # programs per row rescoring overflowed tiles
WORK_ROW_FACTOR = 2     # second merge: survivors of the first merge's threshold held in a work row of 2 pow2(topk) keys


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def default_kt(block_n: int, topk: int, context: int) -> int:
    """Candidates per tile: the expected winners per tile mu = BLOCK_N*topk/context plus 3 sigma + 4, a
    power of two, so that a tile holding more (an overflow: rescored, exact but slow) is rare (H200,
    128K x 32 rows: KT 8 at mu 2 overflowed in 21 of 32 rows, KT 16 in none)."""
    mu = block_n * topk / max(1, context)
    return int(min(block_n, max(4, _pow2(math.ceil(mu + 3 * math.sqrt(mu) + 4)))))


def default_kt_pairs(block_n: int, topk: int, context: int) -> int:
    """CAND 1 candidates per tile: groups of G = pow2(context / (8 topk)) positions (>= 4, <= BLOCK_N/2),
    so a group expects <= 1/8 winner and holding 3 (an overflow) is rare; KT = 2 BLOCK_N / G."""
    g = min(block_n // 2, max(4, _pow2(max(1, context // (8 * max(1, topk))))))
    return 2 * block_n // g


def heuristic(key: dict, target: str) -> dict:
    """cpu: few, big programs. GPU: the score pass is a stream of key tiles, so programs must be lean (~140
    registers at BLOCK_N 128 / 4 warps, nothing held across tiles) and many (SPLITS: ~8 programs per SM).
    Short contexts (L <= ~8 topk: a 128-key tile then holds >= 32 winners on average): every key is a candidate
    (KT = BLOCK_N: no per-tile sort, no witness, never a rescore), one tile per program, SELECT 1 (parallel
    threshold, last arriver over the survivors, `_place_kernel`), FILTER once a row holds > 4 x 2048 candidates.
    Long contexts: decode (T x L x 4 B <= SCORES_WORKSPACE; batch invariant: any T, the choice depends on L only)
    materialises the scores (SCORES 1, then the BUCKET 1 select over them); prefill keeps the best two of each group of
    consecutive positions (CAND 1, `default_kt_pairs`), fp16 dots (DOT 3) at num_stages 1, FILTER 1; the few tiles
    that hold more winners are rescored exactly.
    DOT is numerics, not a tunable: SPEC §5.6 asks fp32 accumulation, which DOT 0 and DOT 3 (e4m3 codes widened
    exactly to bf16 / fp16, fp32-accumulating tensor-core dots) give. DOT 1 (FP8 tensor-core dots, reduced-precision
    sums promoted to fp32 every 32-deep step) differs from the reference at near-ties within 1e-4; DOT 2 (no
    promotion) fails the check: both kept for an explicit config only.
    H200 history (benches/bench_attention_decode.py, FP8 keys, 32 x 128 heads, top-2048, rows out, graph replay,
    every selection exact): batch 1 at 8K: serial merge 25.3-25.7 us (score pass 6.1-6.8), SELECT 1 with 16 parts
    21.1 us (8 / 32 / 64 parts 21.2 / 22.0 / 22.2; BLOCK_N 64 20.9), MERGE_WARPS 4 / 16 and MERGE_TILE 4096 / 8192
    worse; 32K: serial merge 73.7, FILTER 34.1, SELECT 1 (+FILTER) 26.4-27.1. Batch 32 at 128K: 424-430 us (29.3%
    of the read bandwidth): score pass 291-303, + filter and merge 1 45, + rescore and merge 2 82; slower and not
    kept: L2 bulk prefetch (513-571), 128-register cap (482), SPLITS 66 / 16, PREFETCH 1 (656), 8 warps (642),
    SELECT 1 (527), KT 16 / 64 (520 / 549), CAND 0 KT 16 (670). The score loop is instruction-bound (~800 SASS
    instructions per thread per 128-key tile: int64 key compares, head-sum shuffles).
    Session 9 (one H200 call): batch 1, the previous path at 8K 21.06 us = score pass + memset 6.41 + select and
    place 14.5. A one-launch select (the last program to arrive streaming all of the row's keys) measured 22.4-27.8
    us at 8K and 62.9-78.7 at 32K: one program streaming 4096 keys costs ~4.5 us (ptxas sm_90a: ~4000 SASS
    instructions per thread at 8 warps for the pass), so the serial part must not touch the keys. SELECT 2
    (`_topk_fused`: three histograms counted while scoring, the last arriver reads the threshold off ~2100 bins,
    parallel placement, no memset) replaced it. Timed in the lead's call (benches/results/h200-2026-11-30-s9/
    attention_decode_select2.json): batch 1 at 8K 13.67 us with 64 place parts on 4 warps, 8-warp score programs
    (16 / 32 parts 15.6 / 14.9; 4-warp scoring 16.0; BLOCK_N 64 15.3) vs SELECT 1 21.45 in the same run; two
    indexers in a row 29.3 vs 40.5 (PDL on). At 32K it loses (56.6-68.0 vs 26.7: the place pass scans the whole
    row), so SELECT 2 runs for contexts up to 8K; and for one query row only: in the rank decode graph at batch 8
    (8K) the select node took 39.8 us with it vs 34.2 with SELECT 1 (session 8), at batch 1 19.4 vs 27.8
    (per node, gaps included; benches/results/h200-2026-11-30-s9/runtime_final.json).
    Session 11 (one H200 call, benches/bench_attention_decode.py): batch 1 at 8K 13.54 us (score pass alone 4.88);
    a one-launch SELECT 2 whose score programs (all resident) spin until the last arriver publishes the threshold,
    publish their tiles' selected counts, spin until all are in and place their own tiles (exact; graph == eager over
    50 replays) measured 13.36-14.34 us (4 / 8 warps, BLOCK_N 64, two tiles per program), and 28.4 vs 25.4 us in the
    indexer + MLA chain: an in-kernel wait costs what the placement launch does under PDL. Not kept. What is left
    is the serial part: the last arriver's dependent histogram reads and radix steps, then the placement.
    SELECT 3 (every placement part reading the threshold off two launch-parity histogram sets, no last arriver)
    measured 13.82-14.19 us vs SELECT 2's 13.37 at batch 1 8K and 26.59 vs 25.51 in the indexer + MLA chain
    (benches/results/h200-2026-11-30-s11/attention_decode_final.json): removed.
    Session 13 (one H200 call, benches/results/h200-2026-11-30-s13/attention_decode_indexer_scores.json; read
    bandwidth 4.45 TB/s, byte floor 124.6 us): batch 32 at 128K, SCORES 1 with SELECT_RES 2048 on 4 warps 342.4 us
    (36.4%) vs 445.0 (28.0%) for the group top-2 path in the same run (its score pass alone 315.8); the SCORES score
    pass alone (memset + scores) 248.7 (50.1%): select and placement take the other ~94 us. With SELECT_RES
    8192 on 8 warps 361.0 (PDL off 366.7): `_select_kernel` then holds 255 registers and spills, and the parts
    carry the last arriver's registers (241 at RES 2048 / 4 warps: 2 programs per SM for 512 parts). SELECT_PARTS 32
    364.5; score-kernel variants in `_indexer_scores`. Batch 1 at 8K unchanged (SELECT 2, 13.65 us).
    Session 13, second call (benches/results/h200-2026-11-30-s13/attention_decode_indexer_bucket.json; read bandwidth
    4.33 TB/s, byte floor 127.9 us; every config exact: the default vs the IR reference, the others the same rows,
    graph == eager over 50 replays for the default and the best): BUCKET 1 (`_topk_bucket`: lean parts, one threshold
    program per row over the boundary bucket, placement) with 16 parts, SELECT_RES 4096 on 8 warps 312.0 us (41.0%;
    PDL off 317.2) vs 346.6 (36.9%) for the SELECT 1 default above; the select alone (memset + select + placement over
    stored scores) 68.3 vs 88.4, the score pass alone 246.9. 32 parts 307.8 (41.6%: the new default), 64 parts 308.9,
    SELECT_RES 2048 on 4 warps 310.7, SELECT_RES 8192 335.6 (the threshold program's pass over the resident bucket
    costs with its size), MERGE_TILE 4096 322.6 (`_place_kernel` then 249 registers), SPLITS 66 310.9 (score pass
    241.7). Batch 1 at 8K unchanged (SELECT 2, 13.66 us).
    Session 14 (one H200 call, benches/results/h200-2026-11-30-s14/attention_decode_indexer_tma.json; read bandwidth
    4.33 TB/s, byte floor 128.1 us; the new default exact vs the IR reference, every config the old default's rows,
    graph == eager over 50 replays): the score pass's key tiles as pipelined bulk tensor copies (TMA 3:
    `_indexer_scores._scores_tma_kernel`, 3 stages, SPLITS 20 = one wave of 5 programs per SM) 242.7 us (52.8%) vs
    305.0 (42.0%) for the gather tiles at SPLITS 33 in the same run; score pass alone 172.0 (74.5%) vs 247.5, the select
    (memset + parts + threshold + placement) the other ~70. Other figures in `_indexer_scores` (TMA stages / programs,
    register caps) and `_topk_bucket` (BUCKET 2, removed). Batch 1 at 8K unchanged (SELECT 2, 13.67 us).
    Session 15 (one H200 call, benches/results/h200-2026-11-30-s15/attention_decode_indexer_select.json; read bandwidth
    4.36 TB/s; the default exact vs the IR reference, every other config the default's rows (batch 1: each also vs the
    reference), graph == eager over 50 replays for every TMA config): batch 32 at 128K, the default 237.1 us (53.6%;
    PDL off 235.6), its score pass alone (memset + scores) 182.4. The select's launches as prefixes over stored scores
    (one call per graph replay: ~7 us of each figure is the replay's own cost): memset 8.7, + bucket parts 22.7, +
    threshold program 36.4, + placement 61.5, so bucket parts ~14, threshold ~14, placement ~25. BUCKET 3
    (`_topk_bucket_place`: every placement part finishes the threshold itself, two launches) 253.5 (bucket parts with
    the second histogram ~17), with ZERO 274.2 (16 / 64 parts 259.6 / 303.0, the bucket streamed 277.6, MERGE_TILE
    1024 265.6): slower at batch 32, where 1024 parts of 236-254 registers run the serial threshold in ~4 waves. The
    gathered tiles (no descriptor) at the TMA config's 20 programs per row 319.8 (score pass 258.4) vs 312.8 (250.0) at
    session 13's 8 x 132 / T = 33: GATHER_SPLITS. Batch 1, one wave of parts: at 64K the default was 38.3 us (select
    23.1: memset 1.2, bucket parts 4.5, threshold program 12.3, placement 5.1), BUCKET 3 + ZERO 29.0 with 32 or 64
    parts (64, bucket streamed: 27.9), BUCKET 1 with 64 parts 37.7, SPLITS 128 / 512 39.3 / 38.5, gathered tiles 38.6
    (score pass 16.4 vs 16.2); at 1M 329.7 (PDL off 317.2; select 117.6 with 32 parts: bucket parts 53.1, threshold
    12.9, placement 50.4), 256 parts 238.0 (BUCKET 1) / 237.1 (BUCKET 3 + ZERO) / 241.3 (bucket streamed), BUCKET 3
    with 32 parts 336.4, SPLITS 330 / 1320 323.9 / 328.7, gathered tiles 326.6 (score pass 199.9 vs 196.3). New default
    for one row (T <= 1): BUCKET 3 + ZERO with a part per 1024 positions, 32..256 (measured: 64K, 64 parts 29.0 us;
    1M, 256 parts 237.1; between them interpolated, not timed). Batch 1 at 8K unchanged (SELECT 2, 13.47 us).
    Session 15, round 2 (one H200 call, benches/results/h200-2026-11-30-s15/attention_decode_indexer_place.json; read
    bandwidth 4.38 TB/s; every config the old default's rows, the new one also vs the IR reference, graph == eager
    over 50 replays for each): batch 32 at 128K, the old default 244.0 us (51.8%; PDL off 236.7), SURV (`_topk_bucket`:
    the parts also write their survivors, the placement reads those, not the 128K-score row) + ZERO (no memset) with
    MERGE_TILE 1024 and 16 parts 217.0 us (58.3%: the new default for T > 1; 32 / 64 parts 219.3 / 221.3, at MERGE_TILE
    2048 241.7 without ZERO, 245.3 with; other figures in `_topk_bucket`). Not timed at batches between 2 and 31.
    Batch 1 at 8K unchanged (SELECT 2, 13.70 us).
    Session 16 (two H200 calls, benches/results/h200-2026-11-30-s16/attention_decode_indexer_slots_call{1,2}.json;
    read bandwidth 4.38 / 4.37 TB/s; every config the old default's rows, the new ones also vs the IR reference, graph
    == eager over 50 replays for each): batch 32 at 128K, SURV 1 is now `_topk_slots` (no atomic in the parts, the
    bucket in 256 slots a part, int32 index arithmetic, a few-key boundary resolved by max reductions): 214.8 / 209.2
    us (58.9% / 60.6%) vs 221.8 / 220.2 for session 15's SURV (PDL off 222.7 / 221.2); other configs in `_topk_slots`.
    Batch 8 at 128K (first timed): 94.7 / 91.6 us vs 105.1 / 103.4 (PDL off 98.9 / 99.4), score pass alone 64.9 / 68.5.
    Batch 1 at 8K: SELECT 2's placement parts request their own keys with the threshold (`_topk_fused`) and count the
    keys before them in one step of 8192 on 8 warps: 12.71 / 12.82 us vs 13.51 / 13.66 (the early request alone 13.09 /
    13.13; 32 / 128 parts 12.84 / 12.98; PDL off 14.15 / 14.15).
    Session 16, round 2 (one H200 call, benches/results/h200-2026-11-30-s16/attention_decode_indexer_scores_r2.json):
    the score kernel with scalar block-table entries carried one box ahead (TMA_CARRY 1, `_indexer_scores`): batch 8 at
    128K 77.5 us vs 88.9 (the new default for 2..8 rows); batch 32 221.5 vs 222.4 (score pass alone 199.9 vs 171.8:
    not adopted there); other figures and the histogram atomics' cost in `_indexer_scores`. Batch 1 at 8K unchanged
    (SELECT 2, 12.47 us).
    Session 16, lead (one H200 call, benches/results/h200-2026-11-30-s16/attention_decode_indexer_priv.json, read 4.34
    TB/s): TMA_PRIV 1 (each score program counts into a private 2048-bin histogram and adds its nonzero bins to the
    row's once: no two programs' atomics on one address) with TMA_CARRY 1: batch 32 x 128K 197.7 us (64.6% of read;
    score pass alone 162.3) vs 229.3 for the default of the round above in the same call (PDL off 210.1; score pass
    170.6), PRIV alone 205.6, CARRY alone 236.3: the new default above 8 rows. Batch 8: 81.2 vs 81.1 (CARRY): not
    taken there (its private histograms would add 5.4 MB of workspace for nothing).
    Session 20 (benches/indexer_b1_paths.py, per input set): at batch 1 8K the score launch's last program scans the
    row for 5 of 64 random sets (the histograms leave the boundary bucket unresolved), which cost them 23.5 us against
    12.8; SELECT_SCAN 8192 (the row held in registers, the bucket's threshold by masked maxima / minima: SELECT_PICK)
    15.4-16.9 us on those sets, the others unchanged (numbers in `_topk_fused`'s docstring)."""
    L, K, T = max(1, key["L"]), key["K"], max(1, key["T"])
    if target == "cpu":
        bn = 32 if L <= 256 else 128
        return dict(BLOCK_N=bn, KT=default_kt(bn, K, L), SPLITS=1, num_warps=4, num_stages=1, MERGE_TILE=256,
                    CAND=0, DOT=0)
    bn = 128
    nt = -(-L // bn)
    if default_kt(bn, K, L) * 4 >= bn and L <= 8192 and T <= 1:
        return dict(BLOCK_N=bn, KT=bn, SPLITS=max(1, min(nt, round(8 * 132 / T))), num_warps=8, num_stages=1,
                    CAND=0, DOT=3, MERGE_TILE=2048, SELECT=2, SELECT_TILE=8192, SELECT_SCAN=8192, SELECT_WB=256,
                    SELECT_PARTS=64, SELECT_WARPS=8)
    if default_kt(bn, K, L) * 4 >= bn:
        return dict(BLOCK_N=bn, KT=bn, SPLITS=max(1, min(nt, round(8 * 132 / T))), num_warps=4, num_stages=1,
                    CAND=0, DOT=3, MERGE_TILE=2048, FILTER=int(nt * bn > 4 * 2048), FILTER_PARTS=16,
                    SELECT=1, SELECT_PARTS=16, SELECT_RES=2048)
    splits = max(1, min(max(1, nt // 4), round(8 * 132 / T)))
    if key.get("bi") or T * L * 4 <= SCORES_WORKSPACE:   # decode: materialised scores (batch invariant: any T)
        # TMA key tiles, 3 stages: 5 programs per SM (94 registers, 25 KB), one wave of them (>= 4 boxes each);
        # gathered tiles where the pool allows no descriptor: 8 programs per SM
        # BUCKET 1 with SURV (`_topk_slots`: 256 bucket slots a part) and ZERO (no memset), 16 parts of 1024-key tiles
        cfg = dict(BLOCK_N=bn, KT=bn, SPLITS=max(1, min(nt // 2, 5 * 132 // T)), num_warps=4, num_stages=1, TMA=3,
                   GATHER_SPLITS=max(1, min(nt // 2, round(8 * 132 / T))), CAND=0, DOT=3, MERGE_TILE=1024, SCORES=1,
                   SELECT=1, BUCKET=1, SURV=1, ZERO=1, SELECT_PARTS=16, SELECT_RES=4096, MERGE_WARPS=8)
        if T > 1:   # the score kernel's table entries carried one box ahead (timed at batch 8 and 32)
            cfg["TMA_CARRY"] = 1
        if T > 8:   # and its counts in per-program histograms, added to the row's once (batch 32; equal at 8)
            cfg["TMA_PRIV"] = 1
        if T <= 1:   # one row: BUCKET 3 (no threshold program, no memset), a part per 1024 positions (32..256)
            del cfg["SURV"]
            cfg.update(BUCKET=3, ZERO=1, SELECT_RES=2048, MERGE_WARPS=4, MERGE_TILE=2048,
                       SELECT_PARTS=min(256, max(32, _pow2(L // 1024))))
        return cfg
    return dict(BLOCK_N=bn, KT=default_kt_pairs(bn, K, L), SPLITS=splits, num_warps=4, num_stages=1, CAND=1, DOT=3,
                MERGE_TILE=2048, FILTER=1, FILTER_PARTS=16)


def indexer_topk(q, q_scale, w, keys, key_scale, token_pos, token_req, block_table, block_size: int, topk: int, *,
                 key_format: str = "fp8", output: str = "positions", config: dict | None = None,
                 max_context: int | None = None, stats: dict | None = None,
                 stop_after: str | None = None, scores_in: tuple | None = None) -> torch.Tensor:
    """Exact DSA top-k. q f8e4m3 [T, HI, DI], q_scale fp32 [T, HI], w [T, HI];
    key_format "fp8": keys f8e4m3 (or its uint8 view) [N, DI], key_scale fp32 [N];
    key_format "mxfp4": keys uint8 [N, DI/2] (low nibble = even element), key_scale uint8 E8M0 [N, DI/32].
    Either pool may also be a block view [NB, block_size, ...] whose block stride exceeds block_size rows
    (a page of a packed block pool): read in place through `_paging.pool_strides`, never copied.
    Keys of request r's position p are at pool row block_table[r, p // block_size] * block_size + p % block_size.
    Returns int64 [T, topk]: ascending positions (output="positions") or their pool rows
    (output="rows"), -1 padded. `max_context` (>= every token_pos + 1) bounds the context; without it the bound
    is the block table's width x block_size (a shape): the launcher never reads device data on the host, so
    it can be captured in a CUDA graph either way. Launches: one memset (histograms + overflow counts), the
    score kernel, the merge; with per-tile candidates (KT < BLOCK_N) also the rescore and the second merge;
    `stats` (a dict) receives overflowed_rows / overflowed_tiles (a host sync; tests and benches).
    `stop_after="score"` runs the score kernel only, "merge1" also the first selection (filter + merge 1, or
    SELECT's two kernels) but no rescore / merge 2: profiling aids for benches (`out` is then unfinished). SCORES 1
    bench hooks: with `stop_after="score"` and `stats`, stats["scores"] = (score rows, first-digit histogram);
    `scores_in` = that pair (same inputs and config, one workspace chunk) skips the score kernel: the select alone;
    with it, `stop_after` "memset" / "bucket" / "threshold" (BUCKET 1 / 3) stops after that launch of the select."""
    T, HI, DI = q.shape
    fmt = {"fp8": 0, "mxfp4": 1}.get(key_format)
    width = DI if fmt == 0 else DI // 2
    problems = [f"key_format must be 'fp8' or 'mxfp4', found {key_format!r}"] * (fmt is None) + \
        [f"output must be 'positions' or 'rows', found {output!r}"] * (output not in ("positions", "rows")) + \
        [f"topk must be positive, found {topk}"] * (topk < 1) + \
        [f"keys {tuple(keys.shape)} do not match q {tuple(q.shape)} (need [N, {width}] or [NB, {block_size}, "
         f"{width}], DI a power of two >= 32)"] * (fmt is not None and (keys.dim() not in (2, 3) or
                                                   keys.shape[-1] != width or DI % 32 or DI & (DI - 1)))
    if problems:
        raise ValueError("indexer_topk: " + "; ".join(problems))
    dev = q.device
    out = torch.empty(T, topk, dtype=torch.int64, device=dev)
    if T == 0:
        return out
    # the context bound sizes the workspace and the tile grid; without `max_context` it is the block table's
    # width (a shape: no host read of device data, so the launcher can be captured in a CUDA graph)
    L = int(max_context) if max_context is not None else int(block_table.shape[1]) * int(block_size)
    cfg = dict(config or heuristic({"T": T, "L": L, "K": topk, "HI": HI, "DI": DI},
                                   "cpu" if dev.type == "cpu" else "gpu"))
    bn, kt, scores = int(cfg["BLOCK_N"]), int(cfg["KT"]), int(cfg.get("SCORES", 0)) == 1
    if scores and (kt != bn or int(cfg.get("SELECT", 1)) != 1):
        raise ValueError(f"indexer_topk: config {cfg}: SCORES 1 needs every key a candidate (KT == BLOCK_N), SELECT 1")
    scores = scores and L > topk   # (shorter contexts: everything is selected, no scores needed)
    if kt > bn or kt & (kt - 1) or bn & (bn - 1) or bn < 16:
        raise ValueError(f"indexer_topk: config {cfg} needs powers of two KT <= BLOCK_N, BLOCK_N >= 16")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    q8 = (q.view(torch.uint8) if interp else q.view(torch.float8_e4m3fn)).contiguous()   # fp8 pointers: 16-byte async copies
    if fmt == 0:
        k8 = keys.view(torch.uint8) if interp else keys.view(torch.float8_e4m3fn)
        ks = key_scale if key_scale.dtype == torch.float32 else key_scale.to(torch.float32)
    else:
        k8, ks = keys.view(torch.uint8), key_scale.view(torch.uint8)
    k_sb, k_sr = pool_strides(k8, block_size, 1, "indexer keys")
    s_sb, s_sr = pool_strides(ks, block_size, 0 if fmt == 0 else 1, "indexer key scales")
    w, q_scale = w.contiguous(), q_scale.contiguous()   # w * q_scale is formed in the kernels
    pos = token_pos.to(device=dev, dtype=torch.int64).contiguous()
    tbl, req, MB, log_bs = paging_args(block_table, token_req, block_size, dev)
    NT = -(-L // bn)
    cand_mode, dot = int(cfg.get("CAND", 0)), int(cfg.get("DOT", 0))
    if cand_mode not in (0, 1) or dot not in (0, 1, 2, 3) or (cand_mode == 1 and kt < 2) or \
            int(cfg.get("PREFETCH", 0)) not in (0, 1):
        raise ValueError(f"indexer_topk: config {cfg} needs CAND in (0, 1), DOT in (0, 1, 2, 3), PREFETCH in (0, 1), "
                         f"KT >= 2 for CAND 1")
    max_ovf = max(1, topk // (kt if cand_mode == 0 else 2))   # an overflowed tile holds >= KT (CAND 1: 2) winners
    KP = _pow2(topk)
    KW = WORK_ROW_FACTOR * KP    # work row: top-k plus the survivors of rescored tiles (second merge)
    per_row = 8 * (2 * NT * kt + NT + max_ovf * bn + KW + 2) + 4 * (max_ovf + 1 + 2 * 2048 + 1024 + 1) - \
        4 * NT * kt * scores   # SCORES: the row is int32 (SURV's survivors: the second row, `src`)
    chunk = max(1, min(T, WORKSPACE_BYTES // per_row))
    # DOT 0 / 3: both sides exact in bf16 / fp16, fp32 accumulation (SPEC §5.6). DOT 1 / 2: FP8 keys x FP8 queries on
    # the tensor cores, which sum the products of one 32-deep MMA step with ~14-bit alignment (not exact
    # fp32): DOT 1 adds each step's partial into the fp32 accumulator exactly, DOT 2 lets the
    # imprecise sum run over all DI (the compiler's sm_90 default).
    fp8_dot = dot in (1, 2) and fmt == 0 and not interp
    f16_dot = dot == 3 and fmt == 0   # e4m3 codes are exact in fp16 too: DOT 0's numerics, one cvt per 2 codes
    dot_dt = tl.float32 if interp else (tl.float8e4nv if fp8_dot else tl.float16 if f16_dot else tl.bfloat16)
    imprecise = (32 if dot == 1 else DI) if fp8_dot else 0
    HP = max(16, _pow2(HI))
    mt = int(cfg.get("MERGE_TILE", 1024))
    sel_mode = (bool(cfg.get("SELECT", 0)) or scores) and L > topk
    filt, parts = bool(cfg.get("FILTER", 0)) and L > topk and not sel_mode, int(cfg.get("FILTER_PARTS", 16))
    sparts, res = int(cfg.get("SELECT_PARTS", 16)), int(cfg.get("SELECT_RES", 4096))
    bucket = int(cfg.get("BUCKET", 0)) if scores else 0   # 1: three-launch select (`_topk_bucket`), 3: two
    if bucket not in (0, 1, 3):
        raise ValueError(f"indexer_topk: config {cfg}: BUCKET must be 0, 1 or 3")
    # BUCKET 3 with ZERO 1: counts in a buffer the select leaves at zero (not with the bench / test hooks)
    # (BUCKET 1 with ZERO 1: the threshold program leaves the histograms and bucket counts at zero)
    zero_ws = bucket in (1, 3) and int(cfg.get("ZERO", 0)) == 1 and stats is None and stop_after is None and \
        scores_in is None
    if parts & (parts - 1) or not 1 <= parts <= 1024 or sparts & (sparts - 1) or not 1 <= sparts <= 1024 or \
            res & (res - 1) or res < 16:
        raise ValueError(f"indexer_topk: config {cfg}: FILTER_PARTS / SELECT_PARTS must be powers of two in 1..1024, "
                         f"SELECT_RES a power of two >= 16")
    pdl = launch_kwargs()
    fused = int(cfg.get("SELECT", 0)) == 2
    if fused and kt != bn:
        raise ValueError(f"indexer_topk: config {cfg}: SELECT 2 needs every key a candidate, KT == BLOCK_N")
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        n = r1 - r0
        if fused:   # score + threshold, then placement (`_topk_fused`): two launches, no memset
            fused_launch(q8[r0:r1], w[r0:r1], q_scale[r0:r1], (k8, ks, k_sb, k_sr, s_sb, s_sr), tbl, req[r0:r1], MB,
                          pos[r0:r1], out[r0:r1], NT, topk, cfg, output == "rows", stop_after == "score",
                          dict(HI=HI, DI=DI, HP=HP, BLOCK_N=bn, KEY_FMT=fmt, DOT_DT=dot_dt, LOG_BS=log_bs,
                               IMPRECISE=imprecise, **pdl))
            if stats is not None:
                stats["overflowed_rows"] = stats.get("overflowed_rows", 0)
                stats["overflowed_tiles"] = stats.get("overflowed_tiles", 0)
            continue
        tmin, ext, work, th = (torch.empty(n, m, dtype=torch.int64, device=dev) for m in (NT, max_ovf * bn, KW, 2))
        # candidate keys, or (SCORES) the materialised orderable scores (`_indexer_scores`)
        cand = torch.empty(n, NT * kt, dtype=torch.int32 if scores else torch.int64, device=dev)
        ovf = torch.empty(n, max_ovf, dtype=torch.int32, device=dev)
        # one memset: first-digit histograms (counted while scoring), overflow counts, second-digit histograms,
        # survivor counts and arrival counters (SELECT)
        if bucket == 3:   # BUCKET 3: its own workspace (`_topk_bucket_place`)
            ws = bucket_workspace(dev, n, zero_ws)
            views = [ws[0], ws[3].view(n, 1), ws[2].view(n, 1), ws[3].view(n, 1)]   # (no overflow: novf stays 0)
        elif bucket == 1 and zero_ws:   # hist, bucket counts, novf (never written: stays 0) from the zeroed set
            buf = tile_counters(dev, n * ROW_COUNTS)
            nb1, z1 = buf[n * 2048:n * 2049].view(n, 1), buf[n * 2049:n * ROW_COUNTS].view(n, 1)
            views = [buf[:n * 2048].view(n, 2048), z1, nb1, z1]
        else:
            seg = [2048, 1] + [2048] * (filt or (sel_mode and not bucket)) + [1, 1] * sel_mode
            zeroed = torch.zeros(n * sum(seg), dtype=torch.int32, device=dev)
            views = [zeroed[n * sum(seg[:i]):n * sum(seg[:i + 1])].view(n, w_) for i, w_ in enumerate(seg)]
        hist, novf = views[0], views[1].view(n)
        hist2 = views[2] if len(views) > 2 and not bucket else hist
        cnt, ncomp = (torch.empty(n, parts, dtype=torch.int32, device=dev),
                      torch.empty(n, dtype=torch.int32, device=dev)) if filt else (novf, novf)
        if sel_mode:
            ncomp, arrive = views[-2].view(n), views[-1].view(n)
        qc, wc, sc, rc, pc, oc = q8[r0:r1], w[r0:r1], q_scale[r0:r1], req[r0:r1], pos[r0:r1], out[r0:r1]
        common = dict(HI=HI, DI=DI, HP=HP, BLOCK_N=bn, KT=kt, KEY_FMT=fmt, DOT_DT=dot_dt, LOG_BS=log_bs,
                      IMPRECISE=imprecise, **pdl)
        pools = (k8, ks, k_sb, k_sr, s_sb, s_sr)
        splits = max(1, min(int(cfg["SPLITS"]), NT))
        if scores_in is not None:   # bench hook (see the docstring)
            if not scores or n != T:
                raise ValueError("indexer_topk: scores_in needs SCORES 1 and one workspace chunk")
            cand, hist = scores_in
        elif scores:
            scores_launch((qc, wc, sc, *pools, tbl, rc, MB, pc), cand, hist, n, NT, topk, cfg,
                          {k: v for k, v in common.items() if k != "KT"})
        else:
            _score_kernel[(n, splits)](qc, wc, sc, *pools, tbl, rc, MB, pc, cand, tmin, hist, NT, topk, splits,
                                       num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
                                       CAND=cand_mode, PREFETCH=int(cfg.get("PREFETCH", 0)),
                                       HIST=int(cfg.get("HIST", 0)), **common)
        if scores and stats is not None and stop_after == "score":
            stats["scores"] = (cand, hist)
        if stop_after in ("score", "memset"):
            continue
        merge = dict(BLOCK_N=bn, KT=kt, KP=KP, KW=KW, ROWS_OUT=output == "rows", TILE=mt, LOG_BS=log_bs,
                     COMPACT=filt or sel_mode, num_warps=int(cfg.get("MERGE_WARPS", 8 if mt >= 1024 else 4)), **pdl)
        src = cand
        if sel_mode:   # parallel threshold (last arriver) + parallel placement; PHASE 2 reads the survivors
            src = torch.empty(n, NT * kt, dtype=torch.int64, device=dev)
            poff = torch.empty(n, sparts, dtype=torch.int32, device=dev)
            if bucket == 3:   # two launches, the placement parts finishing the threshold themselves
                bucket_place_select(cand, (hist, *ws[1:]), src, oc, tbl, rc, MB, pc, NT, topk, cfg, bn, sparts,
                                    output == "rows", log_bs, pdl, zero_ws, stop_after)
            elif bucket and cfg.get("SURV"):   # the parts keep their survivors, no atomics (`_topk_slots`)
                slots_select(cand, hist, src, poff, th, oc, tbl, rc, MB, pc, NT, topk, cfg, bn, sparts,
                             output == "rows", log_bs, pdl, stop_after, zero_ws)
            elif bucket:
                bucket_select(cand, hist, ncomp, src, poff, th, oc, tbl, rc, MB, pc, NT, topk, cfg, bn, sparts,
                              output == "rows", log_bs, pdl, stop_after, zero_ws)
            else:
                _select_kernel[(n, sparts)](cand, tmin, hist, hist2, ncomp, arrive, src, poff, ovf, novf, th, oc, tbl,
                                            rc, MB, pc, NT, topk, max_ovf, BLOCK_N=bn, KT=kt, PARTS=sparts, TILE=mt,
                                            RES=res, ROWS_OUT=output == "rows", LOG_BS=log_bs, SRC32=scores,
                                            num_warps=int(cfg.get("MERGE_WARPS", 8)), **pdl)
            if bucket != 3 and stop_after not in ("bucket", "threshold") and not (bucket and cfg.get("SURV")):
                _place_kernel[(n, sparts)](cand, novf, th, poff, oc, tbl, rc, MB, pc, NT, topk, BLOCK_N=bn, KT=kt,
                                           PARTS=sparts, TILE=mt, ROWS_OUT=output == "rows", LOG_BS=log_bs,
                                           SRC32=scores, num_warps=4, **pdl)
        else:
            if filt:   # parallel pre-selection: the merges then run over the survivors only
                src = torch.empty_like(cand)
                for step in range(3):
                    _filter_kernel[(n, parts)](cand, hist, hist2, cnt, src, ncomp, pc, NT, topk, BLOCK_N=bn, KT=kt,
                                               PARTS=parts, TILE=mt, STEP=step, num_warps=4, **pdl)
            _merge_kernel[(n,)](src, tmin, hist, ext, ovf, novf, work, th, oc, tbl, rc, MB, pc, ncomp, NT, topk, max_ovf,
                                PHASE=1, RESIDENT=NT * kt <= mt, **merge)
        if stop_after == "merge1":
            continue
        if kt < bn and L > topk:
            _rescore_kernel[(n, min(max_ovf, RESCORE_PROGRAMS))](qc, wc, sc, *pools, tbl, rc, MB, pc, ovf, novf, ext,
                                                                  max_ovf, num_warps=int(cfg["num_warps"]),
                                                                  CAND=cand_mode, **common)
            _merge_kernel[(n,)](src, tmin, hist, ext, ovf, novf, work, th, oc, tbl, rc, MB, pc, ncomp, NT, topk, max_ovf,
                                PHASE=2, RESIDENT=False, **merge)
        if stats is not None:
            stats["overflowed_rows"] = stats.get("overflowed_rows", 0) + int((novf > 0).sum())
            stats["overflowed_tiles"] = stats.get("overflowed_tiles", 0) + int(novf.sum())
            if filt or sel_mode:   # candidates kept by the pre-selection, of those written (rows with context > topk)
                big = pc + 1 > topk
                stats["filter_kept"] = stats.get("filter_kept", 0) + int(ncomp[big].sum())
                stats["filter_candidates"] = stats.get("filter_candidates", 0) + \
                    int(((torch.div(pc[big], bn, rounding_mode="floor") + 1) * kt).sum())
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
                        output="rows" if rows else "positions", config=config, max_context=attrs.get("max_context"))


def _key(a, attrs) -> dict:
    a = _fused(a)
    L = context_bound(a.token_pos, attrs)
    T, HI, DI = (int(x) if hasattr(x, "__index__") else 0 for x in a.q.shape)
    return {"T": T, "HI": HI, "DI": DI, "L": L, "K": int(attrs["topk"]), "bi": int(bool(attrs.get("batch_invariant")))}


def _bucket(key: dict) -> dict:
    return dict(key, T=pow2_bucket(key["T"]), L=pow2_bucket(key["L"], 1024))


def _constraints(config: dict, key: dict, target: str) -> list[str]:
    bn, kt, smem = config["BLOCK_N"], config["KT"], config["BLOCK_N"] * key.get("DI", 128) * config["num_stages"]
    return [f"KT {kt} > BLOCK_N {bn}"] * (kt > bn) + \
        [f"SELECT 2 needs KT == BLOCK_N, found KT {kt}"] * (config.get("SELECT", 0) == 2 and kt != bn) + \
        [f"SCORES 1 needs KT == BLOCK_N and SELECT 1, found KT {kt}, SELECT {config.get('SELECT')}"] * \
        (config.get("SCORES", 0) == 1 and (kt != bn or config.get("SELECT", 1) != 1)) + \
        [f"key tiles BLOCK_N*DI*num_stages = {smem} B of shared memory"] * (target != "cpu" and smem > 200 * 1024)


def _supports(a, attrs, target) -> str | None:
    di = _fused(a).q.shape[2]
    ok = getattr(di, "is_Integer", isinstance(di, int)) and int(di) % 32 == 0 and int(di) & (int(di) - 1) == 0
    return None if ok else f"index_head_dim {di} is not a power of two >= 32"


TUNABLES = (Tunable("BLOCK_N", (64, 128, 256)), Tunable("KT", (4, 8, 16, 32, 64)),
            Tunable("SPLITS", (1, 2, 4, 8, 16, 24, 32, 48, 64, 128)), Tunable("num_warps", (4, 8)),
            Tunable("num_stages", (1, 2, 3, 4)), Tunable("MERGE_TILE", (1024, 2048, 4096)),
            Tunable("CAND", (0, 1)), Tunable("PREFETCH", (0, 1)), Tunable("FILTER", (0, 1)),
            Tunable("FILTER_PARTS", (16, 32)), Tunable("SELECT", (0, 1, 2)))
# DOT fixes the numerics (never searched); MERGE_WARPS, SELECT_PARTS / SELECT_RES / SELECT_TILE / SELECT_SCAN /
# SELECT_PICK / SELECT_WB / SELECT_WARPS (the space stays under the tuner's enumeration limit), HIST, SCORES, BUCKET and TMA / TMA_J only by an
# explicit config (also TMA_CARRY, TMA_PRIV, GATHER_SPLITS, ZERO, SURV and SLOT_FEW)

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
