"""ORIENT 3 of the absorbed MLA decode (mla_sparse.py): `_mla_gluon_kernel`, a Gluon (Hopper) form of ORIENT 2
(_mla_rowsm.py) for FP8 latent pools and sparse selections, CUDA sm_90 only (Gluon does not run in the interpreter;
`usable` refuses it elsewhere and the launcher falls back to ORIENT 2). Math, grid and partial layout as in
mla_sparse's docstring; one warpgroup (4 warps) per program, context rows as the logits wgmma's M (BLOCK_N = 64),
heads as N. The heuristic's choice once the tokens fill the GPU.

Before the loop the piece's pool rows (CHUNK selection entries, through the block table for positions) go to a table
in shared memory, so that the loop issues no global load. Per step of BLOCK_N rows (row buffer b of STAGES):
  - the rows' e4m3 bytes (c_KV [BLOCK_N, kv], k_pe [BLOCK_N, dr]) arrive by cp.async (16 bytes a copy, gathered through
    the table: Hopper's TMA has no row gather) into NVMMA-swizzled buffers, STAGES - 1 steps ahead; -1 entries and
    entries past the piece are zero-filled (no traffic) and their logits masked to -inf;
  - logits x (qh; ql)^T + k_pe (qph; qpl)^T: two async fp8 wgmmas of N = 2 BLOCK_H, the query split exactly into two
    e4m3 parts after a per-head power-of-two scaling (`_mla_rowsm._split8`'s bits: ORIENT 2's numerics) and stored
    as one operand (hi rows, then lo rows), so that each row tile is read once; the two halves of the result are the
    same thread's registers and are summed in place (`_fold`);
  - online softmax over the rows in fp32 (exp2; the sums kept per element, summed once after the loop), P stored as
    fp16 [BLOCK_H, BLOCK_N];
  - acc [kv, BLOCK_H] += x^T P in four column groups of kv / 4, each its own accumulator: the group's bytes loaded from
    the row buffer into registers (4-byte loads: `_rows_layout` gives a thread 16 rows of 4 consecutive columns,
    exactly the rows the fp16 wgmma's A fragment wants as k), widened in registers (one cvt per e4m3 pair and one
    byte permute per register), relabelled (the M row m holds column `_sigma(m)`: no data moves; the epilogue stores
    through the same map) and fed as the wgmma's register A operand. Group g + 1 widens while group g runs; one wait
    at the end of the step frees the A registers. Nothing is widened into shared memory: the step's shared traffic
    is the gather, the logits' row tile once, 32 KB of loads and P.

ptxas (12.8, bundled with Triton 3.6 and 3.7; sm_90a) serialises every wgmma of the kernel (a wait after each: C7515 /
C7514) when any non-wgmma instruction defines or reads accumulator registers while a wgmma is in flight. Hence the
loop runs at least once, the logits dots overwrite the previous step's logits registers (use_acc=False), and every
wgmma is retired within its step (two waits a step). Built for sm_90a: 50 wgmmas a step (18 fp8 m64n32k32, 32 fp16
m64n16k16 with A in registers), 254 registers (no spill), 132 KB shared memory at 3 stages (one program per SM), 95
KB at 2 (two fit), ~746 SASS instructions a step per thread (round 1's form 780, ORIENT 2 966).

H200 2026-11-30 (session 15; benches/bench_mla_b64.py; batch 64, 12 heads, top-2048 FP8 rows of 8K contexts, the whole
launcher under graph replay; every config checked against float64 (o~ 2.3e-3, lse 1.4e-5; round 1's form 2.56e-3,
1.63e-5) also with -1 entries, short contexts, an empty token and positions through the block table, and graph
replay == eager over 50 replays):
  - round 2, call 2 (benches/results/h200-2026-11-30-s15/mla_b64_gluon_r2_call2.json): kept, CHUNK 1024 / 3 stages
    49.66 us (36.6% of read bandwidth), 4 stages 50.91 (L2-resident rows 43.65), 5 stages 53.34, CHUNK 512 / 2 stages
    (two programs per SM) 54.88; round 1's form (below, CHUNK 1024, 2 stages, XF2) 57.66, with the one-dot query
    53.76 (L2-resident 45.63; 3 stages, one widened buffer 57.28), ORIENT 2 67.81. Batch 32: CHUNK 256 / 2 stages
    34.56 (kept), CHUNK 512 / 4 stages 37.12; round 1's form at CHUNK 512 38.78, with the one-dot query 36.26.
    Batch 1, CHUNK 64 / 2 stages, round 1's form: 10.88, with the one-dot query 10.12 (ORIENT 1 11.31).
  - round 2, call 1 (mla_b64_gluon_r2_call1.json): round 1's form 54.82, with the one-dot query 51.36; the value dot's
    A in registers as ONE [kv, 64] operand (128 registers live, the whole step widened before the dot; removed): waited
    in its step, CHUNK 1024 69.63 (L2-resident rows 51.81), 3 stages 56.58, CHUNK 512 66.18, CHUNK 256 85.12;
    left in flight into the next step (30 spilled registers) CHUNK 512 72.77; without the one-dot query (34 spilled)
    77.95. Batch 32: 42.37 (CHUNK 512), 49.34 (256); batch 1 14.08.
  - round 1 (mla_b64_gluon_call{1,2}.json), the form then kept and now removed: the query's two parts as two dots
    each (36 fp8 m64n16k32 a step, the row tile read twice), the rows widened to fp16 in shared memory (XF2: two
    buffers, the widening overlapping the logits) and read back as the value dot's A: CHUNK 1024 / 2 stages 57.54 us
    (ORIENT 2 67.97), 3 stages with one widened buffer 57.82; the row offsets loaded from global memory inside the loop
    62.05 (the proxy fences, MEMBAR.ALL.CTA in SASS, presumably waited for the loads in flight; CHUNK 512 71.6-73.2,
    256 84.2); 8 warps (two warpgroups, 8 heads each, every A tile read twice) CHUNK 1024 65.4-65.9, 512 75.6-76.8,
    256 86.6, batch 1 10.87 (4 warps 11.16); the gathers issued after the logits dots, 8 warps: 67.39 / 77.70.
H200 2026-12-01 (session 21; Nsight Compute on the batch-64 launch, benches/mla_b64_profile.py, results in
benches/results/h200-2026-12-01-s21): one warp per scheduler, an instruction issued every 4.4 cycles; of the stall
samples the prologue took 23% (the row table loaded a step at a time, each step's entries stored and a barrier passed
before the next load was issued: ~8 dependent memory round trips; now one load, `_row_table`) and the epilogue 8.5% (the
partials stored 4 bytes a thread over four heads' rows; now relabelled to columns and stored 16 bytes a thread,
`_store_o`); the loop's 69%: issue (selected 30%), fixed-latency waits (28%), the wgmma waits (12%). Kernel 36.35 ->
32.86 us (ncu). MEMBAR.ALL.CTA (the proxy fences) shows ~1% of the samples: it does not wait for the cp.async copies in
flight. The combine launch (5.7 us at batch 64) is folded into the kernel where a token has 2-4 pieces (FOLD,
`_merge_pieces`: the last piece to arrive merges; a first form loading a piece at a time in a runtime loop added 7
us, dependent L2 round trips; a token's 32 pieces at batch 1: 453 us, a spilling layout, see session 22). Whole
launcher at batch 64 (bench_mla_b64.py, 4 input sets a graph): 37.2 us = 49.7% of read bandwidth (previous form and
split 39.5).
Measured and removed: `prefetch.global.L2` (CCTL.E.PF2) of the step one or two past the ring's last (4 a thread a
step: a line at every 128 bytes of the rows), to stand in for a deeper ring: batch 64 CHUNK 1024 / 3 stages 48.2-52.3
us vs 37.1-38.5, CHUNK 512 / 2 stages 51.1-52.4 (two ahead 61.0-63.6) vs 36.6-38.7; batch 32 34.5 vs 25.3; batch 8
20.7 vs 16.3 (benches/results/h200-2026-12-01-s21/mla_l2_prefetch.json).
H200 2026-12-01 (session 22; benches/mla_ablation.py: the kernel with parts taken out; bench_mla_b64.py --gather;
benches/results/h200-2026-12-01-s22): at batch 64 the loop runs at the access pattern's ceiling. Steps 2-16 take 1.49
us each with the rows in HBM and 1.48 with them L2-resident (4.72 MB a step over the GPU: 72% of read bandwidth),
and a kernel that only reads the same rows (`_gather_ceiling.py`) reaches 74.5% at best (65.7% to 74.5% over grid
shapes): compute and the gather are balanced, so neither alone shortens the loop (without the value dots: 34.1-34.4 us
from HBM vs 37.2-37.4, 25.3-25.9 L2-resident). What separates the launcher from 60% is fixed latency, ~14 us of its
37.3: the absorption launch (3.2-3.8 us; the runtime runs it on its side stream beside the indexer: the attention alone
is 34.5 us = 51.2%), the pieces' merge after the last piece's stores and arrival (1.9-2.3 us; three column tiles in
flight instead of one: no change), and the prologue (row table, first rows from HBM) with the epilogue and the launch
boundaries. Two programs an SM (CHUNK 512, 2 stages) run the no-gather, no-dot skeleton in the same time as one:
latency, not issue. FOLD's merge tile now takes its layout from its column count (`layouts`): 8-32 pieces no longer
spill (batch 1, 32 pieces: 42.3 us, was 453), but one program reading every partial stays slower than the combine
launch there (10.1 us), hence FOLD_PIECES 4.
Not tried: a producer warp for the gathers (warp specialisation), TMA gathers of single rows, the logits' A operand
from registers too (the rows would then leave shared memory once a step, by the loads the values already make); the two
pieces of a token as a cluster of two CTAs merging through distributed shared memory (no stores, fence and atomic
before the merge: the ~2 us the merge costs).
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from ._pdl import pdl_enter

_barrier = getattr(gl, "barrier", None) or gl.thread_barrier      # Triton 3.7 / 3.6 name of the CTA barrier
_LN2 = gl.constexpr(0.6931471805599453)


def merge_cols(kv: int, np_: int, bh: int) -> int:
    """FOLD's merge: the columns of a [np_ pieces, bh heads, CW] partial tile (64 fp32 registers a thread)."""
    return min(kv, 8192 // (np_ * bh))


def layouts(kv: int, dr: int, bh: int, bn: int = 64, np_: int = 1) -> dict:
    """The kernel's constexpr layouts (one warpgroup): the wgmma accumulators (MMA8C: fp8 logits [bn, 2 bh] of the
    concatenated query, MMA8: their folded [bn, bh], MMA: the fp16 value groups [kv / 4, bh]; the same registers per
    head, so per-head vectors move between them for free), the 16-byte copy layout (a thread's chunks in bn / 32 rows:
    few row offsets to hold), the value operand's register layout (LX, `_rows_layout`), the NVMMA shared layouts
    (the query as [2 bh, width], P as [bh, bn]: K-major B operands), and FOLD's merge tile [np_, bh, CW] (M3: a lane's
    4 columns, the lanes over CW / 4 columns and the rest over pieces, so that no lane holds a copy of another's
    elements; with the lanes over 128 columns whatever CW, 8 to 32 pieces held 2-8x the registers and spilled: a
    token's 32 pieces at batch 1 took 453 us, session 21)."""
    lc = min(32, merge_cols(kv, np_, bh) // 4)
    return dict(
        MMA=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, bh, 16]),
        MMA8=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, bh, 32]),
        MMA8C=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * bh, 32]),
        CP=gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]),
        QL=gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]),
        RT=gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0]),
        RS=gl.SwizzledSharedLayout(1, 1, 1, [0]),
        XK=gl.NVMMASharedLayout.get_default_for([bn, kv], gl.float8e4nv),
        XP=gl.NVMMASharedLayout.get_default_for([bn, dr], gl.float8e4nv),
        QK=gl.NVMMASharedLayout.get_default_for([2 * bh, kv], gl.float8e4nv),
        QP=gl.NVMMASharedLayout.get_default_for([2 * bh, dr], gl.float8e4nv),
        PS=gl.NVMMASharedLayout.get_default_for([bh, bn], gl.float16),
        LX=_rows_layout(kv // 4, bn),
        ML=gl.BlockedLayout([1, 1], [32, 1], [4, 1], [1, 0]),
        M3=gl.BlockedLayout([1, 1, 4], [32 // lc, 1, lc], [1, 4, 1], [2, 1, 0]))


def _rows_layout(kg: int, bn: int):
    """The register layout of a column group [bn, kg] (e4m3) of a row buffer: a thread holds kg / 32 consecutive
    bytes of 16 rows (rows 2 q, 2 q + 1, + 8, + 16 kb for lane % 4 = q: the k of the fp16 wgmma A fragment), so that
    the transposed group is that fragment after a relabelling of its columns alone (`_value_a`, `_sigma`)."""
    c = (kg // 32).bit_length() - 1
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(c)] + [[1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 1 << c], [0, 2 << c], [0, 4 << c]],
        warp_bases=[[0, 8 << c], [0, 16 << c]], block_bases=[], shape=[bn, kg])


@gluon.jit
def _pow2_scale(amax, TOP: gl.constexpr):
    """(2^n, 2^-n), n = TOP - floor(log2 amax) clamped to [-126, 126] (amax 0: n = 126): _mla_heads._pow2_scale."""
    e = ((amax.to(gl.int32, bitcast=True) >> 23) & 255) - 127
    n = gl.minimum(gl.maximum(TOP - e, -126), 126)
    return ((n + 127) << 23).to(gl.float32, bitcast=True), ((127 - n) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _split_store(q, hi_s, lo_s):
    """fp32 q (scaled below 448) -> e4m3 hi (q rounded to 4 significant bits, to nearest even on the bits) and
    lo = q - hi, stored: hi + lo = q exactly for bf16 queries (_mla_rowsm._split8)."""
    b = q.to(gl.int32, bitcast=True)
    hi = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).to(gl.float32, bitcast=True)
    hi_s.store(hi.to(gl.float8e4nv))
    lo_s.store((q - hi).to(gl.float8e4nv))


@gluon.jit
def _query(q_ptr, th, hm, W: gl.constexpr, QL: gl.constexpr, q_s, BLOCK_H: gl.constexpr):
    """The heads' query rows [BLOCK_H, W] scaled per head into [2^7, 2^8) and split into q_s's rows [0, BLOCK_H) (hi)
    and [BLOCK_H, 2 BLOCK_H) (lo); returns the per-head 2^-n (QL's row slice)."""
    d = gl.arange(0, W, layout=gl.SliceLayout(0, QL))
    q = gl.load(q_ptr + gl.expand_dims(th * W, 1) + gl.expand_dims(d, 0), mask=gl.expand_dims(hm, 1),
                other=0.0).to(gl.float32)
    up, down = _pow2_scale(gl.max(gl.abs(q), axis=1), 7)
    _split_store(q * gl.expand_dims(up, 1), q_s.slice(0, BLOCK_H, dim=0), q_s.slice(BLOCK_H, BLOCK_H, dim=0))
    return down


@gluon.jit
def _row_table(idx_ptr, tblrow, t, KSEL, start, end, rows_s, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
               RT: gl.constexpr, PAGED: gl.constexpr, LOG_BS: gl.constexpr):
    """The piece's pool rows (int32, -1: skip) into rows_s [ROWS, BLOCK_N] (ROWS: the steps rounded up to a power of
    two), read once before the loop by one load of every step's entries (one memory round trip, two through the block
    table; a load a step, each stored before the next was issued, cost ~8 round trips: ncu, module doc): the loop then
    issues no global load (a proxy fence would wait for one in flight). Entries at or past `end` and -1 entries are -1;
    positions go through the block table (`_paging.rows_of`), rows are taken as they are."""
    k = gl.arange(0, ROWS, layout=gl.SliceLayout(1, RT))
    jj = start + gl.expand_dims(k * BLOCK_N, 1) + gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, RT)), 0)
    idx = gl.load(idx_ptr + t.to(gl.int64) * KSEL + jj, mask=jj < end, other=-1)
    if PAGED:
        blk = gl.load(tblrow + (idx >> LOG_BS), mask=idx >= 0, other=0)
        idx = gl.where(idx >= 0, blk.to(gl.int64) * (1 << LOG_BS) + (idx & ((1 << LOG_BS) - 1)), -1)
    rows_s._reinterpret(gl.int32, [ROWS, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).store(idx.to(gl.int32))


@gluon.jit
def _gather(lat_ptr, rows, sb, sr, xk_s, xp_s, KV: gl.constexpr, DR: gl.constexpr, CP: gl.constexpr,
            LOG_BS: gl.constexpr):
    """cp.async of one step's rows (pool rows, -1: skip; CP's row slice) into the c_KV and k_pe buffers, through the
    pool's strides (`_paging.row_offsets`); skipped rows zero-filled; one commit group."""
    valid = rows >= 0
    r = gl.where(valid, rows, 0).to(gl.int64)
    ro = (r >> LOG_BS) * sb + (r & ((1 << LOG_BS) - 1)) * sr
    c = gl.arange(0, KV, layout=gl.SliceLayout(0, CP))
    cp.async_copy_global_to_shared(xk_s, lat_ptr + gl.expand_dims(ro, 1) + gl.expand_dims(c, 0),
                                   mask=gl.expand_dims(valid, 1))
    e = gl.arange(0, DR, layout=gl.SliceLayout(0, CP))
    cp.async_copy_global_to_shared(xp_s, lat_ptr + gl.expand_dims(ro, 1) + KV + gl.expand_dims(e, 0),
                                   mask=gl.expand_dims(valid, 1))
    cp.commit_group()


@gluon.jit
def _step_rows(rows_s, k, STEPS: gl.constexpr, L: gl.constexpr):
    """Step k's rows from the table in layout L's row slice (-1 for steps past the piece)."""
    r = rows_s.index(gl.minimum(k, STEPS - 1)).load(gl.SliceLayout(1, L))
    return gl.where(k < STEPS, r, -1)


@gluon.jit
def _fold(x2, L: gl.constexpr):
    """Logits [BLOCK_N, 2 BLOCK_H] of the concatenated query (hi; lo) -> hi + lo [BLOCK_N, BLOCK_H] in layout L (the
    two halves of a head are the same thread's registers: no data moves)."""
    BN: gl.constexpr = x2.shape[0]
    BH: gl.constexpr = x2.shape[1] // 2
    hi, lo = gl.split(gl.permute(gl.reshape(x2, [BN, 2, BH]), (0, 2, 1)))
    return gl.convert_layout(hi + lo, L)


@gluon.jit
def _value_a(x8, LX: gl.constexpr, MMA: gl.constexpr):
    """A column group of the row buffer (e4m3 [BLOCK_N, KG], shared) as the value wgmma's A operand in registers:
    fp16 [KG, BLOCK_N] whose M row m holds column _sigma(m) (4-byte shared loads, the e4m3 pairs widened in place,
    then only a relabelling: the thread already holds its fragment's elements)."""
    BN: gl.constexpr = x8.shape[0]
    KG: gl.constexpr = x8.shape[1]
    C: gl.constexpr = KG // 32
    x = gl.permute(x8.load(LX).to(gl.float16), (1, 0))             # [KG, BN]: column bits (w2 g3 i a) from the top
    x = gl.reshape(gl.permute(gl.reshape(x, [4, 8, C // 2, 2, BN]), (2, 0, 3, 1, 4)), [KG, BN])   # M bits (i w a g)
    return gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))


@gluon.jit
def _sigma(m, KG: gl.constexpr):
    """The column (in its group of KG) of a value accumulator's row m (`_value_a`)."""
    C: gl.constexpr = KG // 32
    return ((m >> 3) & 1) | ((m >> 6) << 1) | ((m & 7) * C) | (((m >> 4) & 3) * (8 * C))


@gluon.jit
def _value_dot(xb, g: gl.constexpr, pb, acc, al, LX: gl.constexpr, MMA: gl.constexpr):
    """acc x alpha += column group g of the row buffer (transposed, registers) x P (async)."""
    KG: gl.constexpr = xb.shape[1] // 4
    return warpgroup_mma(_value_a(xb.slice(g * KG, KG, dim=1), LX, MMA), pb, acc * al, is_async=True)


@gluon.jit
def _store_o(o_ptr, row, KV: gl.constexpr, g: gl.constexpr, acc, inv, hm, OL: gl.constexpr):
    """The partial o~ columns of group g of the heads' rows (acc [KG, BLOCK_H] x inv): the accumulator's rows relabelled
    to their columns (`_sigma`'s inverse: no data moves), then in OL (the query's layout QL: a warp stores 128
    consecutive fp32 of one head's row, 16 bytes a thread) instead of 4-byte stores scattered over four heads' rows
    (ncu: the epilogue's stores)."""
    KG: gl.constexpr = acc.shape[0]
    BH: gl.constexpr = acc.shape[1]
    C: gl.constexpr = KG // 32
    x = gl.reshape(acc * gl.expand_dims(inv, 0), [C // 2, 4, 2, 8, BH])          # M bits (i w a g) as in _value_a
    x = gl.convert_layout(gl.permute(gl.reshape(gl.permute(x, (1, 3, 0, 2, 4)), [KG, BH]), (1, 0)), OL)  # [BH, KG]
    c = gl.arange(0, KG, layout=gl.SliceLayout(0, OL))
    r = gl.expand_dims(gl.convert_layout(row, gl.SliceLayout(1, OL)) * KV + g * KG, 1)
    gl.store(o_ptr + r + gl.expand_dims(c, 0), x.to(o_ptr.dtype.element_ty),
             mask=gl.expand_dims(gl.convert_layout(hm, gl.SliceLayout(1, OL)), 1))


@gluon.jit
def _merge_pieces(po_ptr, plse_ptr, o_ptr, lse_ptr, t, H, NS: gl.constexpr, NP: gl.constexpr, KV: gl.constexpr,
                  BLOCK_H: gl.constexpr, ML: gl.constexpr, M3: gl.constexpr):
    """FOLD: the last of the NS pieces of (token t, this head block) to arrive merges every piece's partial (read
    through L2, .cg) with the combine's formula (`_mla_tiles._combine_kernel`; the sum over pieces a tree in a fixed
    order, whichever program arrives last): m = max_i lse_i, o~ = sum_i e^(lse_i - m) o~_i / sum_i e^(lse_i - m),
    lse = m + log sum_i e^(lse_i - m) (-inf, o~ 0 for a token with no rows); o~ stored in o_ptr's dtype. The pieces'
    lse in one load and their partials as [NS, BLOCK_H, CW] column tiles, every load independent of the others (a
    load a piece in a runtime loop made a chain of dependent L2 round trips: +7 us at NS 2, H200); the next tile in
    flight while one is summed (three in flight, session 22: batch 64 37.06-37.91 us vs 36.85-37.10, batch 32
    25.25-25.76 vs 25.62-26.01, 4 rounds each: not kept)."""
    HL: gl.constexpr = gl.SliceLayout(1, ML)
    CW: gl.constexpr = min(KV, 8192 // (NP * BLOCK_H))    # merge_cols: 64 registers of partials a thread
    h = gl.program_id(1) * BLOCK_H + gl.arange(0, BLOCK_H, layout=HL)
    hm = h < H
    row = t.to(gl.int64) * H + h
    S3: gl.constexpr = gl.SliceLayout(2, M3)
    OL: gl.constexpr = gl.SliceLayout(0, M3)
    r3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(row, gl.SliceLayout(0, S3)), 0), 2)
    s3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NP, layout=gl.SliceLayout(1, S3)), 1), 2)
    m3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(hm, gl.SliceLayout(0, S3)), 0), 2) & (s3 < NS)
    p3 = po_ptr + (r3 * NS + s3) * KV + gl.expand_dims(gl.expand_dims(
        gl.arange(0, CW, layout=gl.SliceLayout(0, OL)), 0), 0)
    part = gl.load(p3, mask=m3, other=0.0, cache_modifier=".cg")      # column tile 0, in flight with the lse
    s = gl.arange(0, NP, layout=gl.SliceLayout(0, ML))
    pm = gl.expand_dims(hm, 1) & gl.expand_dims(s < NS, 0)
    ls = gl.load(plse_ptr + gl.expand_dims(row * NS, 1) + gl.expand_dims(s, 0), mask=pm, other=float("-inf"),
                 cache_modifier=".cg")                                                       # [BLOCK_H, NP]
    mx = gl.max(ls, axis=1)
    mx = gl.where(mx == float("-inf"), 0.0, mx)
    w = gl.exp(ls - gl.expand_dims(mx, 1))
    den = gl.sum(w, axis=1)
    w3 = gl.expand_dims(gl.convert_layout(gl.permute(w, (1, 0)), S3), 2)                  # [NP, BLOCK_H, 1]
    ro = gl.expand_dims(gl.convert_layout(row, gl.SliceLayout(1, OL)) * KV, 1)
    om = gl.expand_dims(gl.convert_layout(hm, gl.SliceLayout(1, OL)), 1)
    dd = gl.expand_dims(gl.convert_layout(gl.where(den > 0.0, den, 1.0), gl.SliceLayout(1, OL)), 1)
    c = gl.expand_dims(gl.arange(0, CW, layout=gl.SliceLayout(0, OL)), 0)
    for cc in gl.static_range(KV // CW):
        if cc + 1 < KV // CW:    # the next column tile in flight while this one is summed
            nxt = gl.load(p3 + (cc + 1) * CW, mask=m3, other=0.0, cache_modifier=".cg")
        o = gl.sum(w3 * part, axis=0) / dd                                                    # [BLOCK_H, CW]
        gl.store(o_ptr + ro + cc * CW + c, o.to(o_ptr.dtype.element_ty), mask=om)
        if cc + 1 < KV // CW:
            part = nxt
    gl.store(lse_ptr + row, gl.where(den > 0.0, mx + gl.log(den), float("-inf")), mask=hm)


@gluon.jit
def _mla_gluon_kernel(qa_ptr, qp_ptr, lat_ptr, idx_ptr, tbl_ptr, req_ptr, MB, o_ptr, lse_ptr, fo_ptr, flse_ptr,
                      cnt_ptr, H, KSEL, NSPLIT, sb, sr, qk_scale, v_scale, pe_scale, FOLD: gl.constexpr,
                      NS: gl.constexpr, NP: gl.constexpr, ML: gl.constexpr, M3: gl.constexpr,
                      CHUNK: gl.constexpr, KV: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGED: gl.constexpr, LOG_BS: gl.constexpr,
                      PDL: gl.constexpr, MMA: gl.constexpr, MMA8: gl.constexpr, MMA8C: gl.constexpr,
                      ROWS: gl.constexpr, CP: gl.constexpr, QL: gl.constexpr, RT: gl.constexpr, RS: gl.constexpr,
                      XK: gl.constexpr,
                      XP: gl.constexpr, QK: gl.constexpr, QP: gl.constexpr, PS: gl.constexpr, LX: gl.constexpr):
    """ORIENT 3 (module doc): one program per (token, head block, piece of CHUNK selected entries); writes the
    piece's o~ partial [BLOCK_H, kv] (1 / denominator x v_scale applied) and its natural-log lse. FOLD: the piece then
    counts itself in at its (token, head block)'s counter (acq_rel, after a barrier: every thread's partial first); the
    last to arrive merges the pieces into fo / flse (`_merge_pieces`) and resets the counter for the next launch
    (the protocol of `_gemv.combine_in_launch`): no combine launch."""
    pdl_enter(PDL)
    t = gl.program_id(0)
    sp = gl.program_id(2)
    start = sp * CHUNK
    end = gl.minimum(start + CHUNK, KSEL)
    tblrow = tbl_ptr + gl.load(req_ptr + t) * MB
    xk = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, KV], XK)
    xp = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, DR], XP)
    qc = gl.allocate_shared_memory(gl.float8e4nv, [2 * BLOCK_H, KV], QK)    # (hi; lo): one N = 32 wgmma a K step
    qpc = gl.allocate_shared_memory(gl.float8e4nv, [2 * BLOCK_H, DR], QP)
    ps = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], PS)
    STEPS: gl.constexpr = CHUNK // BLOCK_N
    rows_s = gl.allocate_shared_memory(gl.int32, [ROWS, BLOCK_N], RS)
    _row_table(idx_ptr, tblrow, t, KSEL, start, end, rows_s, ROWS, BLOCK_N, RT, PAGED, LOG_BS)
    _barrier()
    # the first STAGES - 1 steps' rows in flight before the queries are read
    for st in gl.static_range(STAGES - 1):
        _gather(lat_ptr, _step_rows(rows_s, gl.to_tensor(st), STEPS, CP), sb, sr, xk.index(st), xp.index(st), KV, DR,
                CP, LOG_BS)
    hq = gl.program_id(1) * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QL))
    thq = t.to(gl.int64) * H + hq
    dk = _query(qa_ptr, thq, hq < H, KV, QL, qc, BLOCK_H)
    dp = _query(qp_ptr, thq, hq < H, DR, QL, qpc, BLOCK_H)
    HV: gl.constexpr = gl.SliceLayout(0, MMA)
    HS: gl.constexpr = gl.SliceLayout(0, MMA8)
    sa = gl.expand_dims(gl.convert_layout(dk * v_scale * qk_scale, HS), 0)
    spe = gl.expand_dims(gl.convert_layout(dp * pe_scale * qk_scale, HS), 0)
    m_i = gl.full([BLOCK_H], -1e30, gl.float32, HS)
    l_e = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA8)
    sc = gl.zeros([BLOCK_N, 2 * BLOCK_H], gl.float32, MMA8C)   # the logits' registers: the previous step's,
    se = gl.zeros([BLOCK_N, 2 * BLOCK_H], gl.float32, MMA8C)   # overwritten (use_acc=False)
    KG: gl.constexpr = KV // 4      # the value accumulator in four column groups (group g + 1 widens while g runs)
    a0 = gl.zeros([KG, BLOCK_H], gl.float32, MMA)
    a1 = gl.zeros([KG, BLOCK_H], gl.float32, MMA)
    a2 = gl.zeros([KG, BLOCK_H], gl.float32, MMA)
    a3 = gl.zeros([KG, BLOCK_H], gl.float32, MMA)
    fence_async_shared()   # the split queries (generic stores) before the wgmmas read them
    _barrier()
    n = gl.cdiv(end - start, BLOCK_N)
    for it in range(gl.maximum(n, 1)):   # >= 1 trip: no path around the loop (ptxas would serialize)
        b = it % STAGES
        valid = _step_rows(rows_s, it, STEPS, MMA8) >= 0
        cp.wait_group(STAGES - 2)
        fence_async_shared()
        _barrier()
        nb = (it + STAGES - 1) % STAGES
        _gather(lat_ptr, _step_rows(rows_s, it + STAGES - 1, STEPS, CP), sb, sr, xk.index(nb), xp.index(nb), KV, DR,
                CP, LOG_BS)
        xb = xk.index(b)
        sc = warpgroup_mma(xb, qc.permute((1, 0)), sc, use_acc=False, is_async=True)
        se = warpgroup_mma(xp.index(b), qpc.permute((1, 0)), se, use_acc=False, is_async=True)
        sc, se = warpgroup_mma_wait(0, deps=[sc, se])
        s = gl.where(gl.expand_dims(valid, 1), _fold(sc, MMA8) * sa + _fold(se, MMA8) * spe, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        l_e = l_e * gl.expand_dims(alpha, 0) + p
        m_i = m_new
        ps.store(gl.permute(p.to(gl.float16), (1, 0)))
        al = gl.expand_dims(gl.convert_layout(alpha, HV), 0)
        fence_async_shared()
        _barrier()
        pb = ps.permute((1, 0))
        a0 = _value_dot(xb, 0, pb, a0, al, LX, MMA)
        a1 = _value_dot(xb, 1, pb, a1, al, LX, MMA)
        a2 = _value_dot(xb, 2, pb, a2, al, LX, MMA)
        a3 = _value_dot(xb, 3, pb, a3, al, LX, MMA)
        a0, a1, a2, a3 = warpgroup_mma_wait(0, deps=[a0, a1, a2, a3])   # the A registers free before the next step
    cp.wait_group(0)
    l_i = gl.convert_layout(gl.sum(l_e, axis=0), HV)
    m_i = gl.convert_layout(m_i, HV)
    has = l_i > 0.0
    inv = gl.where(has, v_scale / gl.where(has, l_i, 1.0), 0.0)
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * _LN2, float("-inf"))
    h = gl.program_id(1) * BLOCK_H + gl.arange(0, BLOCK_H, layout=HV)
    row = (t.to(gl.int64) * H + h) * NSPLIT + sp
    _store_o(o_ptr, row, KV, 0, a0, inv, h < H, QL)
    _store_o(o_ptr, row, KV, 1, a1, inv, h < H, QL)
    _store_o(o_ptr, row, KV, 2, a2, inv, h < H, QL)
    _store_o(o_ptr, row, KV, 3, a3, inv, h < H, QL)
    gl.store(lse_ptr + row, lse, mask=h < H)
    if FOLD:
        _barrier()
        tile = cnt_ptr + gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
        if gl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == NSPLIT - 1:
            _merge_pieces(o_ptr, lse_ptr, fo_ptr, flse_ptr, gl.program_id(0), H, NS, NP, KV, BLOCK_H, ML, M3)
            gl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")


def usable(q_abs: torch.Tensor, latent: torch.Tensor, selection, fmt: int, bh: int, chunk: int) -> bool:
    """ORIENT 3 runs: the device Triton compiles for is CUDA sm_90 (Hopper's wgmma; the live GPU, or the build target
    while an AOT build records launches; never the interpreter), an FP8 pool, a selection, kv 256 or 512 (four column
    groups of at least 64, the value wgmma's M, in registers), dr a multiple of 32, BLOCK_H 16 (the wgmma N), CHUNK a
    multiple of 64 up to 1024 (the row table's shared memory)."""
    kv, dr = q_abs.shape[2], latent.shape[-1] - q_abs.shape[2]
    if not (fmt == 1 and selection is not None and bh == 16 and kv in (256, 512) and dr % 32 == 0
            and chunk % 64 == 0 and chunk <= 1024 and os.environ.get("TRITON_INTERPRET") != "1"):
        return False
    try:
        target = triton.runtime.driver.active.get_current_target()
    except RuntimeError:   # no GPU driver (a CPU machine that does not interpret)
        return False
    return target.backend == "cuda" and target.arch == 90     # wgmma: Hopper only (not sm_100 / sm_120)


def launch(grid, qa, qp, lat, sel, tbl, req, MB, po, plse, H, KSEL, NSPLIT, CHUNK, sb, sr, qk_scale, v_scale,
           pe_scale, *, KV, DR, BLOCK_H, STAGES, PAGED, LOG_BS, launch_kw, fold=None):
    """One launch of `_mla_gluon_kernel` (arguments as `_mla_rowsm_kernel`'s, less the positions: a selection is
    required); STAGES row buffers (>= 2), 4 warps. fold: (o, lse, counters) to merge the pieces in this launch
    (FOLD; counters int32, 0, one per (token, head block), `_gemv.tile_counters`), else po / plse are the output."""
    if STAGES < 2:
        raise ValueError(f"mla ORIENT 3: STAGES {STAGES} must be >= 2")
    fo, flse, cnt = fold if fold is not None else (po, plse, plse)
    np_ = triton.next_power_of_2(NSPLIT) if fold else 1
    _mla_gluon_kernel[grid](qa, qp, lat, sel, tbl, req, MB, po, plse, fo, flse, cnt, H, KSEL, NSPLIT, sb, sr,
                            qk_scale, v_scale, pe_scale, FOLD=fold is not None, NS=NSPLIT if fold else 1, NP=np_,
                            CHUNK=CHUNK, KV=KV, DR=DR, BLOCK_H=BLOCK_H, BLOCK_N=64, STAGES=STAGES, PAGED=PAGED,
                            LOG_BS=LOG_BS, ROWS=triton.next_power_of_2(CHUNK // 64), num_warps=4,
                            **layouts(KV, DR, BLOCK_H, np_=np_), **launch_kw)
