"""ORIENT 3 of the absorbed MLA decode (mla_sparse.py): `_mla_gluon_kernel`, a Gluon (Hopper) form of ORIENT 2
(_mla_rowsm.py) for FP8 latent pools and sparse selections, CUDA sm_90 only (Gluon does not run in the interpreter;
`usable` refuses it elsewhere and the launcher falls back to ORIENT 2). Math, grid and partial layout as in
mla_sparse's docstring; one warpgroup (num_warps 4; 8: two, each taking 8 of the 16 heads) per program, context rows
as the wgmma M (BLOCK_N = 64), heads as N. The heuristic's choice once the tokens fill the GPU.

Before the loop the piece's pool rows (CHUNK selection entries, through the block table for positions) go to a table
in shared memory, so that the loop issues no global load. Per step of BLOCK_N rows (row buffer b of STAGES):
  - the rows' e4m3 bytes (c_KV [BLOCK_N, kv], k_pe [BLOCK_N, dr]) arrive by cp.async (16 bytes a copy, gathered through
    the table: Hopper's TMA has no row gather) into NVMMA-swizzled buffers, STAGES - 1 steps ahead; -1 entries and
    entries past the piece are zero-filled (no traffic) and their logits masked to -inf;
  - logits x (qh + ql)^T + k_pe (qph + qpl)^T: four async fp8 wgmmas, the query split exactly into two e4m3 parts after
    a per-head power-of-two scaling (`_mla_rowsm._split8`'s bits: ORIENT 2's numerics), both operands K-major;
  - the bytes widened to fp16 (the value dot's K is the rows, so it reads x^T, which only a 16-bit operand may be):
    XF2 1 into the buffer the previous value dot does not read, while the logits run; XF2 0 into the one buffer once
    that dot is done;
  - online softmax over the rows in fp32 (exp2; the sums kept per element, summed once after the loop), P stored as
    fp16 [BLOCK_H, BLOCK_N], then acc [kv, BLOCK_H] += x^T P by one async fp16 wgmma (A = the widened buffer read
    transposed), left in flight into the next step (waited with the next step's logits).

ptxas (12.8, bundled with Triton 3.6 and 3.7; sm_90a) serialises every wgmma of the kernel (a wait after each: C7515 /
C7514) when any non-wgmma instruction defines or reads accumulator registers while a wgmma is in flight. Hence: the
loop runs at least once (a zero-trip path that moves zeros into the value accumulator, joined after the loop, broke
the in-flight value dot across the back edge), the logits dots overwrite the previous step's logits registers
(use_acc=False) instead of zeros moved in while the value dot runs, and one wait(0) per step retires both the previous
value dot and the logits (a wait(4) for the value dot alone, then wait(0) for the logits, was serialised). Built for
sm_90a: 68 wgmmas a step (36 fp8 m64n16k32, 32 fp16 m64n16k16), one wgmma wait in the loop, 206 registers (4 warps),
224 KB shared memory at the default (1 program per SM), ~780 SASS instructions a step per thread (ORIENT 2: 966).

H200 2026-11-30 (session 15; benches/bench_mla_b64.py, two calls: benches/results/h200-2026-11-30-s15/
mla_b64_gluon_call{1,2}.json; batch 64, 12 heads, top-2048 FP8 rows of 8K contexts, the whole launcher under graph
replay; every config checked against float64 (o~ 2.5e-3, lse 1.6e-5, as ORIENT 2) also with -1 entries, short
contexts, an empty token and positions through the block table, and graph replay == eager over 50 replays):
  - kept (call 2): CHUNK 1024 (128 programs, one an SM), 2 stages, XF2 57.54 us (31.6% of read bandwidth); 3 stages,
    one widened buffer 57.82; ORIENT 2 (the previous default) 67.97 in the same call. Batch 1 (CHUNK 64, 2 stages)
    11.16 us, 8 warps 10.87 (ORIENT 1: 11.57; CHUNK 128 with XF2 and 8 warps 13.42).
  - call 1, the row offsets loaded from global memory a step ahead inside the loop: CHUNK 1024 / 2 stages / XF2 62.05
    us, 3 stages 63.55, CHUNK 512 71.6-73.2, CHUNK 256 84.2 (ORIENT 2: 65.06); every token reading token 0's rows (L2
    resident) 60.9 (ORIENT 2 60.0): the steps were not waiting for HBM. The proxy fences before the wgmmas
    (fence.proxy.async: MEMBAR.ALL.CTA in SASS) presumably waited for the index loads in flight (inferred, not
    measured alone); with the table in shared memory 62.05 -> 57.54 (ORIENT 2 65.06 -> 67.97 between the calls).
  - 8 warps (two warpgroups, 8 heads each: each reads every A tile, twice the shared-memory traffic of the dots; 116-124
    registers): CHUNK 1024 65.4-65.9, CHUNK 512 75.6-76.8, CHUNK 256 86.6; L2-resident rows 63.2. Kept as a tunable
    for the batch-1 lead above.
  - the gathers issued after the logits dots (one proxy fence fewer a step, one barrier more; removed): 8 warps,
    CHUNK 1024 / 3 stages 67.39 (65.89 without), CHUNK 512 / XF2 77.70 (75.58 without).
Not tried: two programs per SM (<= 113 KB of shared memory each: the values in column blocks through a smaller
widened buffer), a producer warp for the gathers (warp specialisation), TMA gathers of single rows.
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


def layouts(kv: int, dr: int, bh: int, bn: int = 64, nw: int = 4) -> dict:
    """The kernel's constexpr layouts for nw warps (4: one warpgroup; 8: two, each taking half of the heads as its
    wgmma N): the wgmma accumulators (MMA8: fp8 logits [bn, bh], MMA: fp16 values [kv, bh]; the same registers, so
    per-head vectors move between them for free), the 16-byte copy / widening layout (a thread's chunks in
    bn / (8 nw) rows: few row offsets to hold), and the NVMMA shared layouts (P stored as [bh, bn]: K-major B)."""
    wn = nw // 4
    return dict(
        MMA=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wn], instr_shape=[16, bh // wn, 16]),
        MMA8=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wn], instr_shape=[16, bh // wn, 32]),
        CP=gl.BlockedLayout([1, 16], [8, 4], [nw, 1], [1, 0]),
        QL=gl.BlockedLayout([1, 4], [1, 32], [nw, 1], [1, 0]),
        RL=gl.BlockedLayout([1], [32], [nw], [0]),
        RS=gl.SwizzledSharedLayout(1, 1, 1, [0]),
        XK=gl.NVMMASharedLayout.get_default_for([bn, kv], gl.float8e4nv),
        XP=gl.NVMMASharedLayout.get_default_for([bn, dr], gl.float8e4nv),
        QK=gl.NVMMASharedLayout.get_default_for([bh, kv], gl.float8e4nv),
        QP=gl.NVMMASharedLayout.get_default_for([bh, dr], gl.float8e4nv),
        XF=gl.NVMMASharedLayout.get_default_for([bn, kv], gl.float16),
        PS=gl.NVMMASharedLayout.get_default_for([bh, bn], gl.float16))


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
def _query(q_ptr, th, hm, W: gl.constexpr, QL: gl.constexpr, hi_s, lo_s):
    """The heads' query rows [BLOCK_H, W] scaled per head into [2^7, 2^8) and split into hi_s / lo_s; returns the
    per-head 2^-n (QL's row slice)."""
    d = gl.arange(0, W, layout=gl.SliceLayout(0, QL))
    q = gl.load(q_ptr + gl.expand_dims(th * W, 1) + gl.expand_dims(d, 0), mask=gl.expand_dims(hm, 1),
                other=0.0).to(gl.float32)
    up, down = _pow2_scale(gl.max(gl.abs(q), axis=1), 7)
    _split_store(q * gl.expand_dims(up, 1), hi_s, lo_s)
    return down


@gluon.jit
def _row_table(idx_ptr, tblrow, t, KSEL, start, end, rows_s, STEPS: gl.constexpr, BLOCK_N: gl.constexpr,
               RL: gl.constexpr, PAGED: gl.constexpr, LOG_BS: gl.constexpr):
    """The piece's pool rows (int32, -1: skip) into rows_s [STEPS, BLOCK_N], read once before the loop: the loop then
    issues no global load (a proxy fence would wait for one in flight). Entries at or past `end` and -1 entries are
    -1; positions go through the block table (`_paging.rows_of`), rows are taken as they are."""
    for k in gl.static_range(STEPS):
        jj = start + k * BLOCK_N + gl.arange(0, BLOCK_N, layout=RL)
        idx = gl.load(idx_ptr + t.to(gl.int64) * KSEL + jj, mask=jj < end, other=-1)
        if PAGED:
            blk = gl.load(tblrow + (idx >> LOG_BS), mask=idx >= 0, other=0)
            idx = gl.where(idx >= 0, blk.to(gl.int64) * (1 << LOG_BS) + (idx & ((1 << LOG_BS) - 1)), -1)
        rows_s.index(k).store(idx.to(gl.int32))


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
def _widen(x8, x16, KV: gl.constexpr, CP: gl.constexpr):
    """e4m3 [BLOCK_N, KV] (shared) -> fp16 (shared), 128 columns at a time (few registers live)."""
    WB: gl.constexpr = 128 if KV >= 128 else KV
    for c in gl.static_range(KV // WB):
        x16.slice(c * WB, WB, dim=1).store(x8.slice(c * WB, WB, dim=1).load(CP).to(gl.float16))


@gluon.jit
def _mla_gluon_kernel(qa_ptr, qp_ptr, lat_ptr, idx_ptr, tbl_ptr, req_ptr, MB, o_ptr, lse_ptr,
                      H, KSEL, NSPLIT, sb, sr, qk_scale, v_scale, pe_scale,
                      CHUNK: gl.constexpr, KV: gl.constexpr, DR: gl.constexpr, BLOCK_H: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, XF2: gl.constexpr, PAGED: gl.constexpr,
                      LOG_BS: gl.constexpr, PDL: gl.constexpr, MMA: gl.constexpr, MMA8: gl.constexpr,
                      CP: gl.constexpr, QL: gl.constexpr, RL: gl.constexpr, RS: gl.constexpr, XK: gl.constexpr,
                      XP: gl.constexpr, QK: gl.constexpr, QP: gl.constexpr, XF: gl.constexpr, PS: gl.constexpr):
    """ORIENT 3 (module doc): one program per (token, head block, piece of CHUNK selected entries); writes the
    piece's o~ partial [BLOCK_H, kv] (1 / denominator x v_scale applied) and its natural-log lse."""
    pdl_enter(PDL)
    t = gl.program_id(0)
    sp = gl.program_id(2)
    start = sp * CHUNK
    end = gl.minimum(start + CHUNK, KSEL)
    tblrow = tbl_ptr + gl.load(req_ptr + t) * MB
    xk = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, KV], XK)
    xp = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, DR], XP)
    qh = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, KV], QK)
    ql = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, KV], QK)
    qph = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, DR], QP)
    qpl = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, DR], QP)
    xf = gl.allocate_shared_memory(gl.float16, [1 + XF2, BLOCK_N, KV], XF)
    ps = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], PS)
    STEPS: gl.constexpr = CHUNK // BLOCK_N
    rows_s = gl.allocate_shared_memory(gl.int32, [STEPS, BLOCK_N], RS)
    _row_table(idx_ptr, tblrow, t, KSEL, start, end, rows_s, STEPS, BLOCK_N, RL, PAGED, LOG_BS)
    _barrier()
    # the first STAGES - 1 steps' rows in flight before the queries are read
    for st in gl.static_range(STAGES - 1):
        _gather(lat_ptr, _step_rows(rows_s, gl.to_tensor(st), STEPS, CP), sb, sr, xk.index(st), xp.index(st), KV, DR,
                CP, LOG_BS)
    hq = gl.program_id(1) * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QL))
    thq = t.to(gl.int64) * H + hq
    dk = _query(qa_ptr, thq, hq < H, KV, QL, qh, ql)
    dp = _query(qp_ptr, thq, hq < H, DR, QL, qph, qpl)
    HV: gl.constexpr = gl.SliceLayout(0, MMA)
    HS: gl.constexpr = gl.SliceLayout(0, MMA8)
    sa = gl.expand_dims(gl.convert_layout(dk * v_scale * qk_scale, HS), 0)
    spe = gl.expand_dims(gl.convert_layout(dp * pe_scale * qk_scale, HS), 0)
    m_i = gl.full([BLOCK_H], -1e30, gl.float32, HS)
    l_e = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA8)
    sc = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA8)   # the logits' registers: the previous step's, overwritten
    se = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, MMA8)   # (use_acc=False) so that no move defines them in flight
    acc = warpgroup_mma_init(gl.zeros([KV, BLOCK_H], gl.float32, MMA))
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
        sc = warpgroup_mma(xb, qh.permute((1, 0)), sc, use_acc=False, is_async=True)
        sc = warpgroup_mma(xb, ql.permute((1, 0)), sc, is_async=True)
        se = warpgroup_mma(xp.index(b), qph.permute((1, 0)), se, use_acc=False, is_async=True)
        se = warpgroup_mma(xp.index(b), qpl.permute((1, 0)), se, is_async=True)
        xw = xf.index((it % 2) * XF2)
        if XF2:   # widen while the logits run (the previous value dot reads the other buffer)
            _widen(xb, xw, KV, CP)
        acc_t, sc, se = warpgroup_mma_wait(0, deps=[acc, sc, se])
        if not XF2:   # one buffer: widen once the previous value dot is done
            _widen(xb, xw, KV, CP)
        s = gl.where(gl.expand_dims(valid, 1), sc * sa + se * spe, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        l_e = l_e * gl.expand_dims(alpha, 0) + p
        m_i = m_new
        ps.store(gl.permute(p.to(gl.float16), (1, 0)))
        acc_t = acc_t * gl.expand_dims(gl.convert_layout(alpha, HV), 0)
        fence_async_shared()
        _barrier()
        acc = warpgroup_mma(xw.permute((1, 0)), ps.permute((1, 0)), acc_t, is_async=True)
    cp.wait_group(0)
    acc_t = warpgroup_mma_wait(0, deps=[acc])
    l_i = gl.convert_layout(gl.sum(l_e, axis=0), HV)
    m_i = gl.convert_layout(m_i, HV)
    has = l_i > 0.0
    inv = gl.where(has, v_scale / gl.where(has, l_i, 1.0), 0.0)
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * _LN2, float("-inf"))
    h = gl.program_id(1) * BLOCK_H + gl.arange(0, BLOCK_H, layout=HV)
    row = (t.to(gl.int64) * H + h) * NSPLIT + sp
    k = gl.arange(0, KV, layout=gl.SliceLayout(1, MMA))
    gl.store(o_ptr + gl.expand_dims(row * KV, 0) + gl.expand_dims(k, 1),
             (acc_t * gl.expand_dims(inv, 0)).to(o_ptr.dtype.element_ty),
             mask=gl.expand_dims(h < H, 0))
    gl.store(lse_ptr + row, lse, mask=h < H)


def usable(q_abs: torch.Tensor, latent: torch.Tensor, selection, fmt: int, bh: int, chunk: int) -> bool:
    """ORIENT 3 runs: the device Triton compiles for is CUDA sm_90 (Hopper's wgmma; the live GPU, or the build target
    while an AOT build records launches; never the interpreter), an FP8 pool, a selection, kv a multiple of 128 up to
    512, dr a multiple of 32, BLOCK_H 16 (the wgmma N), CHUNK a multiple of 64 up to 1024 (the row table's shared
    memory)."""
    kv, dr = q_abs.shape[2], latent.shape[-1] - q_abs.shape[2]
    if not (fmt == 1 and selection is not None and bh == 16 and kv % 128 == 0 and kv <= 512 and dr % 32 == 0
            and chunk % 64 == 0 and chunk <= 1024 and os.environ.get("TRITON_INTERPRET") != "1"):
        return False
    try:
        target = triton.runtime.driver.active.get_current_target()
    except RuntimeError:   # no GPU driver (a CPU machine that does not interpret)
        return False
    return target.backend == "cuda" and target.arch == 90     # wgmma: Hopper only (not sm_100 / sm_120)


def launch(grid, qa, qp, lat, sel, tbl, req, MB, po, plse, H, KSEL, NSPLIT, CHUNK, sb, sr, qk_scale, v_scale,
           pe_scale, *, KV, DR, BLOCK_H, STAGES, XF2, PAGED, LOG_BS, launch_kw, num_warps=4):
    """One launch of `_mla_gluon_kernel` (arguments as `_mla_rowsm_kernel`'s, less the positions: a selection is
    required); STAGES row buffers (>= 2), XF2 1: two widened buffers (the widening overlaps the logits dots)."""
    if STAGES < 2 or XF2 not in (0, 1) or num_warps not in (4, 8):
        raise ValueError(f"mla ORIENT 3: STAGES {STAGES} must be >= 2, XF2 0 or 1, num_warps 4 or 8")
    _mla_gluon_kernel[grid](qa, qp, lat, sel, tbl, req, MB, po, plse, H, KSEL, NSPLIT, sb, sr, qk_scale,
                            v_scale, pe_scale, CHUNK=CHUNK, KV=KV, DR=DR, BLOCK_H=BLOCK_H, BLOCK_N=64,
                            STAGES=STAGES, XF2=XF2, PAGED=PAGED, LOG_BS=LOG_BS, num_warps=num_warps,
                            **layouts(KV, DR, BLOCK_H, nw=num_warps), **launch_kw)
