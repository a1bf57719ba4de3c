"""DSA indexer scorer + exact top-k (IR op `indexer_topk`, SPEC §5 steps 6-7), decode and prefill.

Math. Token i (request r, position p_i) scores the positions s <= p_i at their paged pool rows (`_paging.rows_of`):
    I(i, s) = sum_j w_j ReLU(deq(q_j) . deq(k_s)) = ks_s * sum_j (w_j qs_j) ReLU(q8_j . k8_s)
(FP8: power-of-two fp32 scales per (token, head) and per key row; fp8 values are exact in bf16, the
tensor-core dot accumulates in fp32; DOT 1/2: the e4m3 codes straight into FP8 tensor-core dots, see
`indexer_topk`). MXFP4 keys (E2M1, one E8M0 scale per 32 values, SPEC §7) are
dequantised in registers (exact in bf16) and dotted with the even/odd halves of q. Sel(i) = top-k by
(score desc, position asc), ascending, -1 padded; a context of <= topk positions selects all of it.

The [rows x context] score matrix never exists in memory. Each score becomes a unique 64-bit key
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
 3. rescore  grid (rows, <= 16): overflowed tiles are rescored whole into `ext`, their candidates dropped.
 4. merge 2  rows that overflowed: the keys of candidates + ext at or above merge 1's threshold (a superset
             of the true top-k: adding keys only raises the topk-th largest) are gathered into a work row of
             2 pow2(topk) keys and selected there in registers, then one tl.sort (when they do not fit: radix
             select over all candidates + ext).
With KT = BLOCK_N (short contexts, see `heuristic`) every key is a candidate: no witness, steps 3-4 never run.
Workspace per row 8 B x (NT*(KT+1) + (topk/KT)*BLOCK_N + 2 pow2(topk) + 2); prefill runs in row chunks.
Pools: flat [N, ...] or block views [NB, block_size, ...] of a packed pool (`_paging.pool_strides`), read
in place through `row_offsets`.

API: `indexer_topk(...)` (positions: the IR op), `output="rows"` (the positions' pool rows, -1
padded: what attention kernels read), `key_format="mxfp4"`. Tunables: BLOCK_N, KT, SPLITS (programs
per row), CAND, DOT, num_warps / num_stages (score kernel), MERGE_TILE. Batch invariant (each row
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
from ._paging import context_bound, paging_args, pool_strides, row_offsets, rows_of
from ._topk_select import INVALID, _digit0, _low32, _merge_kernel, _rot32, _score_keys
from .mla_sparse import e2m1_to_f32, e8m0_to_f32

WORKSPACE_BYTES = 1 << 28
RESCORE_PROGRAMS = 16   # programs per row rescoring overflowed tiles
WORK_ROW_FACTOR = 2     # second merge: survivors of the first merge's threshold held in a work row of 2 pow2(topk) keys


@triton.jit
def _load_q(q_ptr, w_ptr, qs_ptr, row, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
            KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr):
    """q^T operands ([DI, HP], or even/odd halves [DI/2, HP] for MXFP4) and per-head weights w*qs (fp32,
    formed here: no separate launch). DOT_DT fp8 (FP8 keys only): the e4m3 codes as they are (an fp8 x fp8
    tensor-core dot)."""
    h = tl.arange(0, HP)
    hm = h < HI
    wq = tl.load(w_ptr + row * HI + h, mask=hm, other=0.0).to(tl.float32) * \
        tl.load(qs_ptr + row * HI + h, mask=hm, other=0.0).to(tl.float32)
    qrow = q_ptr + row * HI * DI
    if KEY_FMT == 0:
        d = tl.arange(0, DI)
        qa = _fp8_as(tl.load(qrow + h[None, :] * DI + d[:, None], mask=hm[None, :], other=0.0), DOT_DT)
        qb = qa
    else:
        d = tl.arange(0, DI // 2)
        qa = _fp8_as(tl.load(qrow + h[None, :] * DI + 2 * d[:, None], mask=hm[None, :], other=0.0), DOT_DT)
        qb = _fp8_as(tl.load(qrow + h[None, :] * DI + 2 * d[:, None] + 1, mask=hm[None, :], other=0.0), DOT_DT)
    return qa, qb, wq


@triton.jit
def _fp8_as(x, DT: tl.constexpr):
    """e4m3 codes (an fp8 load, or raw uint8 bytes in the interpreter) as DT (fp8 itself: no conversion)."""
    if x.dtype == tl.uint8:
        x = x.to(tl.float8e4nv, bitcast=True)
    if DT != tl.float8e4nv:
        x = x.to(DT)
    return x


@triton.jit
def _tile_keys(qa, qb, wq, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, start, DI: tl.constexpr,
               BLOCK_N: tl.constexpr, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr, LOG_BS: tl.constexpr,
               IMPRECISE: tl.constexpr):
    """Keys (`_score_keys`) of positions start .. start+BLOCK_N-1 (>= ctx are INVALID, read nothing).
    Pool rows through the block table (`rows_of`), element offsets through the pools' strides
    (`row_offsets`: flat pools or block views). FP8: codes [BLOCK_N, DI] (one contiguous DI-byte read per
    row) and fp32 scales; MXFP4: E2M1 pairs [BLOCK_N, DI/2] and E8M0 scale bytes broadcast to [BLOCK_N, DI/2].
    The loads stay in the loop body with nothing held across iterations: the compiler's software
    pipeliner (num_stages) streams them into shared memory ahead of the dot."""
    p = start + tl.arange(0, BLOCK_N)
    valid = p < ctx
    rows = rows_of(tblrow, p, valid, LOG_BS)
    ko = row_offsets(rows, LOG_BS, k_sb, k_sr)
    so = row_offsets(rows, LOG_BS, s_sb, s_sr)
    if KEY_FMT == 0:
        d = tl.arange(0, DI)
        kt = tl.load(k_ptr + ko[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        ks = tl.load(ks_ptr + so, mask=valid, other=0.0)
        if DOT_DT == tl.float8e4nv:   # FP8 tensor cores; IMPRECISE: K-steps summed before an exact fp32 add
            acc = tl.dot(_fp8_as(kt, DOT_DT), qa, max_num_imprecise_acc=IMPRECISE)          # [BLOCK_N, HP]
        else:
            acc = tl.dot(_fp8_as(kt, DOT_DT), qa)
        s = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], 1) * ks
    else:
        d = tl.arange(0, DI // 2)
        kt = tl.load(k_ptr + ko[:, None] + d[None, :], mask=valid[:, None], other=0)
        ks = tl.load(ks_ptr + so[:, None] + (d // 16)[None, :], mask=valid[:, None], other=127)
        sc = e8m0_to_f32(ks)
        lo = (e2m1_to_f32(kt & 15) * sc).to(DOT_DT)
        hi = (e2m1_to_f32(kt >> 4) * sc).to(DOT_DT)
        acc = tl.dot(lo, qa) + tl.dot(hi, qb)
        s = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], 1)
    return _score_keys(s, p, valid)


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
def _score_kernel(q_ptr, w_ptr, qs_ptr, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tbl_ptr, req_ptr, MB, pos_ptr, cand_ptr,
                  tmin_ptr, hist_ptr, NT, TOPK, SPLITS, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
                  BLOCK_N: tl.constexpr, KT: tl.constexpr, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr,
                  LOG_BS: tl.constexpr, CAND: tl.constexpr, IMPRECISE: tl.constexpr):
    """Program (row, split) scores tiles split, split + SPLITS, ... of its row's context, and counts its
    candidates by their top 11 key bits into the row's histogram (the merge's first radix digit)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    ctx = tl.load(pos_ptr + row) + 1
    if ctx > TOPK:
        tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
        qa, qb, wq = _load_q(q_ptr, w_ptr, qs_ptr, row, HI, DI, HP, KEY_FMT, DOT_DT)
        n_tiles = tl.cdiv(ctx, BLOCK_N)
        crow = cand_ptr + row.to(tl.int64) * NT * KT
        for tile in range(split, n_tiles, SPLITS):
            key = _tile_keys(qa, qb, wq, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, tile * BLOCK_N, DI,
                             BLOCK_N, KEY_FMT, DOT_DT, LOG_BS, IMPRECISE)
            if KT < BLOCK_N:
                key, witness = _candidates(key, BLOCK_N, KT, CAND)
                tl.store(tmin_ptr + row.to(tl.int64) * NT + tile, witness)
            tl.store(crow + tile * KT + tl.arange(0, KT), key)
            tl.atomic_add(hist_ptr + row * 2048 + _digit0(key), 1, mask=key != INVALID, sem="relaxed")


@triton.jit
def _rescore_kernel(q_ptr, w_ptr, qs_ptr, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tbl_ptr, req_ptr, MB, pos_ptr, cand_ptr,
                    ovf_ptr, novf_ptr, ext_ptr,
                    NT, MAX_OVF, HI: tl.constexpr, DI: tl.constexpr, HP: tl.constexpr,
                    BLOCK_N: tl.constexpr, KT: tl.constexpr, KEY_FMT: tl.constexpr, DOT_DT: tl.constexpr,
                    LOG_BS: tl.constexpr, IMPRECISE: tl.constexpr):
    """Program (row, i) rescores overflowed tiles i, i + P, ... of the row (P = programs per row)."""
    row = tl.program_id(0)
    n_ovf = tl.load(novf_ptr + row)
    if tl.program_id(1) < n_ovf:
        ctx = tl.load(pos_ptr + row) + 1
        tblrow = tbl_ptr + tl.load(req_ptr + row) * MB
        qa, qb, wq = _load_q(q_ptr, w_ptr, qs_ptr, row, HI, DI, HP, KEY_FMT, DOT_DT)
        for i in range(tl.program_id(1), n_ovf, tl.num_programs(1)):
            tile = tl.load(ovf_ptr + row * MAX_OVF + i)
            key = _tile_keys(qa, qb, wq, k_ptr, ks_ptr, k_sb, k_sr, s_sb, s_sr, tblrow, ctx, tile * BLOCK_N, DI,
                             BLOCK_N, KEY_FMT, DOT_DT, LOG_BS, IMPRECISE)
            tl.store(ext_ptr + (row.to(tl.int64) * MAX_OVF + i) * BLOCK_N + tl.arange(0, BLOCK_N), key)
            tl.store(cand_ptr + row.to(tl.int64) * NT * KT + tile * KT + tl.arange(0, KT),
                     tl.full([KT], INVALID, tl.int64))


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
    registers at BLOCK_N 128 / 4 warps, no tile held across iterations: the pipeliner streams FP8 codes into
    shared memory with 16-byte async copies) and many (SPLITS: ~8 programs per SM).
    Short contexts (L <= ~8 topk: a 128-key tile then holds >= 32 winners on average, so per-tile candidates
    would be a large share of the keys anyway): every key is a candidate (KT = BLOCK_N: no per-tile sort,
    no witness, never a rescore), one tile per program, the merge streams 2048 keys at a time.
    Long contexts: the best two of each group of consecutive positions (CAND 1, `default_kt_pairs`), a
    four-deep pipeline; the few tiles that hold more winners are rescored exactly.
    H200 2026-11-29 (benches/bench_attention_decode.py, FP8 keys, 32 x 128 heads, top-2048, rows out,
    graph replay): batch 1 at 8K: 25.7 us (MERGE_TILE 2048; 4096: 26.2, 8192 resident: 30.1 (spills); the
    previous KT 64 candidates + rescore path 43.8; the score kernel alone 6.8); batch 32 at 128K: 646 us
    (CAND 1, KT 32, num_stages 4; 30 of 32 rows rescore a few tiles; the score pass alone 417 us) vs 670 us
    for CAND 0 KT 16 (tl.topk per tile); every selection exact.
    DOT is numerics, not a tunable: SPEC §5.6 asks fp32 accumulation, which DOT 0 (e4m3 codes widened
    exactly to bf16, fp32-accumulating tensor-core dots) gives. DOT 1 (FP8 tensor-core dots, reduced-precision
    sums promoted to fp32 every 32-deep step) differs from the reference at near-ties within 1e-4; DOT 2 (no
    promotion) fails the check: both kept for an explicit config only."""
    L, K, T = max(1, key["L"]), key["K"], max(1, key["T"])
    if target == "cpu":
        bn = 32 if L <= 256 else 128
        return dict(BLOCK_N=bn, KT=default_kt(bn, K, L), SPLITS=1, num_warps=4, num_stages=1, MERGE_TILE=256,
                    CAND=0, DOT=0)
    bn = 128
    nt = -(-L // bn)
    if default_kt(bn, K, L) * 4 >= bn:
        return dict(BLOCK_N=bn, KT=bn, SPLITS=max(1, min(nt, round(8 * 132 / T))), num_warps=4, num_stages=3,
                    CAND=0, DOT=0, MERGE_TILE=2048)
    splits = max(1, min(max(1, nt // 4), round(8 * 132 / T)))
    return dict(BLOCK_N=bn, KT=default_kt_pairs(bn, K, L), SPLITS=splits, num_warps=4, num_stages=4, CAND=1, DOT=0,
                MERGE_TILE=2048)


def indexer_topk(q, q_scale, w, keys, key_scale, token_pos, token_req, block_table, block_size: int, topk: int, *,
                 key_format: str = "fp8", output: str = "positions", config: dict | None = None,
                 max_context: int | None = None, stats: dict | None = None,
                 stop_after: str | None = None) -> torch.Tensor:
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
    `stop_after="score"` runs the score kernel only (a profiling aid for benches: `out` is then garbage)."""
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
    bn, kt = int(cfg["BLOCK_N"]), int(cfg["KT"])
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
    if cand_mode not in (0, 1) or dot not in (0, 1, 2) or (cand_mode == 1 and kt < 2):
        raise ValueError(f"indexer_topk: config {cfg} needs CAND in (0, 1), DOT in (0, 1, 2), KT >= 2 for CAND 1")
    max_ovf = max(1, topk // (kt if cand_mode == 0 else 2))   # an overflowed tile holds >= KT (CAND 1: 2) winners
    KP = _pow2(topk)
    KW = WORK_ROW_FACTOR * KP    # work row: top-k plus the survivors of rescored tiles (second merge)
    per_row = 8 * (NT * kt + NT + max_ovf * bn + KW + 2) + 4 * (max_ovf + 1 + 2048)
    chunk = max(1, min(T, WORKSPACE_BYTES // per_row))
    # DOT 0: both sides exact in bf16, fp32 accumulation (SPEC §5.6). DOT 1 / 2: FP8 keys x FP8 queries on
    # the tensor cores, which sum the products of one 32-deep MMA step with ~14-bit alignment (not exact
    # fp32): DOT 1 adds each step's partial into the fp32 accumulator exactly, DOT 2 lets the
    # imprecise sum run over all DI (the compiler's sm_90 default).
    fp8_dot = dot > 0 and fmt == 0 and not interp
    dot_dt = tl.float32 if interp else (tl.float8e4nv if fp8_dot else tl.bfloat16)
    imprecise = (32 if dot == 1 else DI) if fp8_dot else 0
    HP = max(16, _pow2(HI))
    mt = int(cfg.get("MERGE_TILE", 1024))
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        n = r1 - r0
        cand, tmin, ext, work, th = (torch.empty(n, m, dtype=torch.int64, device=dev)
                                     for m in (NT * kt, NT, max_ovf * bn, KW, 2))
        ovf = torch.empty(n, max_ovf, dtype=torch.int32, device=dev)
        zeroed = torch.zeros(n * 2049, dtype=torch.int32, device=dev)   # one memset: histograms + overflow counts
        hist, novf = zeroed[:n * 2048].view(n, 2048), zeroed[n * 2048:]   # hist: first radix digit, counted while scoring
        qc, wc, sc, rc, pc, oc = q8[r0:r1], w[r0:r1], q_scale[r0:r1], req[r0:r1], pos[r0:r1], out[r0:r1]
        common = dict(HI=HI, DI=DI, HP=HP, BLOCK_N=bn, KT=kt, KEY_FMT=fmt, DOT_DT=dot_dt, LOG_BS=log_bs,
                      IMPRECISE=imprecise)
        pools = (k8, ks, k_sb, k_sr, s_sb, s_sr)
        splits = max(1, min(int(cfg["SPLITS"]), NT))
        _score_kernel[(n, splits)](qc, wc, sc, *pools, tbl, rc, MB, pc, cand, tmin, hist, NT, topk, splits,
                                   num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
                                   CAND=cand_mode, **common)
        if stop_after == "score":
            continue
        merge = dict(BLOCK_N=bn, KT=kt, KP=KP, KW=KW, ROWS_OUT=output == "rows", TILE=mt, LOG_BS=log_bs,
                     num_warps=8 if mt >= 1024 else 4)
        _merge_kernel[(n,)](cand, tmin, hist, ext, ovf, novf, work, th, oc, tbl, rc, MB, pc, NT, topk, max_ovf, PHASE=1,
                            RESIDENT=NT * kt <= mt, **merge)
        if kt < bn and L > topk:
            _rescore_kernel[(n, min(max_ovf, RESCORE_PROGRAMS))](qc, wc, sc, *pools, tbl, rc, MB, pc, cand, ovf, novf, ext,
                                                                  NT, max_ovf, num_warps=int(cfg["num_warps"]), **common)
            _merge_kernel[(n,)](cand, tmin, hist, ext, ovf, novf, work, th, oc, tbl, rc, MB, pc, NT, topk, max_ovf, PHASE=2,
                                RESIDENT=False, **merge)
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
                        output="rows" if rows else "positions", config=config, max_context=attrs.get("max_context"))


def _key(a, attrs) -> dict:
    a = _fused(a)
    L = context_bound(a.token_pos, attrs)
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
            Tunable("SPLITS", (1, 2, 4, 8, 16, 24, 32, 48, 64, 128)), Tunable("num_warps", (4, 8)),
            Tunable("num_stages", (1, 2, 3, 4)), Tunable("MERGE_TILE", (512, 1024, 2048, 4096, 8192)),
            Tunable("CAND", (0, 1)))  # DOT fixes the numerics (see `heuristic`): never searched

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
