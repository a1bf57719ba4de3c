"""ORIENT 2 of the absorbed MLA decode (mla_sparse.py): `_mla_rowsm_kernel`, context rows as the M of both dots (Hopper
wgmma wants M >= 64 per warpgroup), heads as N, for FP8 latent pools: the heuristic's choice once the tokens alone fill
the GPU (batch 64: 67.5 us against ORIENT 1's 77.0). The math, grid and partial layout are in mla_sparse's docstring;
row gathers and dequantisation are _mla_tiles.py's. Launched by `mla_sparse.sparse_latent_attention`.

H200 2026-11-30 (session 13; benches/bench_mla_b64.py, one call: benches/results/h200-2026-11-30-s13/
mla_b64_orient2.json; batch 64, 12 heads, top-2048 FP8 rows of 8K contexts, whole launcher under graph replay,
4.37 TB/s streaming read, every config checked against float64 and graph replay == eager over 50 replays): the kept
form (logits as fp8 dots, values widened once, KB 128, 3 stages, CHUNK 512) 67.5 us (26.9% of read bandwidth; every
token reading token 0's rows, L2 resident: 62.3 us, ORIENT 1 71.3), 2 stages 72.6, CHUNK 256 75.4; batch 1 (CHUNK 64,
2 stages) 11.60 us, KB 64 11.92, ORIENT 1 11.61. ptxas (Triton 3.7 AOT for sm_90a): 255 registers (16 B stack),
114.7 KB shared memory (2 programs of 4 warps per SM), 966 SASS instructions per thread per 64-row step (36 fp8 + 32
fp16 wgmma; ORIENT 1: ~670 per 32-row step).
Measured slower and removed (batch 64, CHUNK 512, 2 stages unless named):
  - fp16 logits (every column block widened by `_e4m3_to_f16`, then fp16 dots with register A operands: Triton keeps a
    computed A operand in registers, so each block goes st.shared + ldmatrix): 86.5 us, CHUNK 256 90.8, 8 warps 142.0,
    batch 1 12.54; ptxas 214 registers, 1034 SASS instructions per thread per 64-row step, 38 barriers.
  - the widened blocks' A operand forced into shared memory (each dot inside a one-trip loop whose block argument
    Triton takes from shared memory): 127.2 us (1 stage: the nested loop stops Triton's pipeliner).
  - fp8 logits with the value pass loading its blocks again (a second set of cp.async buffers: 127 KB of shared
    memory, 1 program per SM): 105.3 us, CHUNK 256 113.0, KB 128 100.8.
  - KB 64 (the loaded blocks reused): 78.8 us (255 registers, 32 spilled), 8 warps 118.0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._mla_heads import _e4m3_to_f16, _pow2_scale
from ._mla_tiles import _fp8_to, _k_pe_raw, _program_span, _rows_at, _softmax_tail, _sub_raw
from ._pdl import pdl_enter


@triton.jit
def _split8(q, DT: tl.constexpr):
    """fp32 q (scaled below 448) -> (hi, lo), hi = q rounded to 4 significant bits (to nearest even, on the bits) and
    lo = q - hi (exact), both e4m3 values: hi + lo = q for q of <= 8 significant bits (bf16 queries) whose lo is not
    below e4m3's subnormal step 2^-9. In DT: fp8 for the fp8 dots, fp32 where the interpreter emulates them (whose
    fp8 casts are not exact)."""
    b = q.to(tl.int32, bitcast=True)
    hi = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    return hi.to(DT), (q - hi).to(DT)


@triton.jit
def _q_parts(q_ptr, th, hm, up, lo: tl.constexpr, W: tl.constexpr, KB: tl.constexpr, DT: tl.constexpr):
    """Query columns lo .. lo+KB-1 of the program's heads (row width W), transposed, scaled per head by `up` and split
    into e4m3 parts: (hi, lo) [KB, BLOCK_H] each."""
    d = lo + tl.arange(0, KB)
    q = tl.load(q_ptr + th[None, :] * W + d[:, None], mask=hm[None, :], other=0.0).to(tl.float32)
    return _split8(q * up[None, :], DT)


@triton.jit
def _mla_rowsm_kernel(qa_ptr, qp_ptr, lat_ptr, idx_ptr, tbl_ptr, req_ptr, MB, pos_ptr, o_ptr, lse_ptr,
                      H, KSEL, NSPLIT, CHUNK, sb, sr, qk_scale, v_scale, pe_scale,
                      KV: tl.constexpr, DR: tl.constexpr, KB: tl.constexpr,             # row layout
                      BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,  # tiling
                      FMT: tl.constexpr, CVT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr,  # numerics
                      SPARSE: tl.constexpr, PAGED: tl.constexpr, LOG_BS: tl.constexpr, PDL: tl.constexpr):
    """ORIENT 2 (rows-major, FP8 pools): per step of BLOCK_N context rows, c_KV taken in KV / KB column blocks x_i
    (the stored e4m3 bytes, one gather each, software-pipelined by num_stages):
        S^T = sum_i x_i (qh_i + ql_i)^T + k_pe (qh_pe + ql_pe)^T   [BLOCK_N, BLOCK_H]   fp8 dots, A = the loaded bytes
        acc_i = alpha acc_i + widen(x_i)^T P^T                      [KB, BLOCK_H] each  fp16 dots (DOT_DT)
    Each query value, scaled per head by a power of two (`_mla_heads._pow2_scale` to [2^7, 2^8), below e4m3's 448), is split into two e4m3 parts
    (`_split8`, exact for bf16 queries) that are the fp8 dots' B operands (shared memory, loaded once); the logits
    are scaled back after the dots. The loaded bytes feed the fp8 dots as they are (no conversion) and are widened to
    fp16 once (`_e4m3_to_f16` when CVT, on the GPU) for the values. The accumulators are KV x BLOCK_H fp32 in all
    (64 registers per thread at 4 warps, 16 heads). Online softmax over the rows (axis 0) in fp32 (exp2); one piece
    per program as in the other orientations, merged by `_combine_kernel`. On the interpreter (DOT_DT fp32) the fp8
    dots run on the same values in fp32."""
    NKB: tl.constexpr = KV // KB
    Q8: tl.constexpr = tl.float8e4nv if DOT_DT != tl.float32 else tl.float32   # the logits dots' operands
    pdl_enter(PDL)
    t, h, hm, th, sp, tblrow, start, end = _program_span(pos_ptr, tbl_ptr, req_ptr, MB, H, KSEL, CHUNK, BLOCK_H,
                                                         SPARSE)
    k = tl.arange(0, KV)
    qa = tl.load(qa_ptr + th[None, :] * KV + k[:, None], mask=hm[None, :], other=0.0).to(tl.float32)  # [KV, BH]
    up, down = _pow2_scale(tl.max(tl.abs(qa), 0), 7)
    sa = v_scale * down[None, :]
    qhs = ()
    qls = ()
    accs = ()
    for i in tl.static_range(NKB):
        qh, ql = _q_parts(qa_ptr, th, hm, up, i * KB, KV, KB, Q8)
        qhs = qhs + (qh,)
        qls = qls + (ql,)
        accs = accs + (tl.zeros([KB, BLOCK_H], dtype=tl.float32),)
    qp = tl.load(qp_ptr + th[None, :] * DR + tl.arange(0, DR)[:, None], mask=hm[None, :], other=0.0).to(tl.float32)
    up, down = _pow2_scale(tl.max(tl.abs(qp), 0), 7)
    spe = pe_scale * down[None, :]
    qph, qpl = _split8(qp * up[None, :], Q8)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if PREFETCH:
        nro, nvalid = _rows_at(idx_ptr, t, KSEL, start, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED, LOG_BS)
    for j in range(start, end, BLOCK_N):
        if PREFETCH:   # this step's rows were resolved a step ago; request the next step's now
            ro, valid = nro, nvalid
            nro, nvalid = _rows_at(idx_ptr, t, KSEL, j + BLOCK_N, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED,
                                   LOG_BS)
        else:
            ro, valid = _rows_at(idx_ptr, t, KSEL, j, end, tblrow, sb, sr, BLOCK_N, SPARSE, PAGED, LOG_BS)
        sc = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
        kr = _k_pe_raw(lat_ptr, ro, valid, KV, DR, FMT)
        kr = kr if Q8 != tl.float32 else _fp8_to(kr, Q8)
        s = tl.dot(kr, qpl, tl.dot(kr, qph, sc, input_precision=PREC), input_precision=PREC) * spe
        xs = ()
        for i in tl.static_range(NKB):
            x = _sub_raw(lat_ptr, ro, valid, i, KV, KB, FMT, "")[0]                # [BLOCK_N, KB] e4m3
            x8 = x if Q8 != tl.float32 else _fp8_to(x, Q8)
            sc = tl.dot(x8, qls[i], tl.dot(x8, qhs[i], sc, input_precision=PREC), input_precision=PREC)
            xs = xs + (x,)
        s = tl.where(valid[:, None], (sc * sa + s) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        pd = p.to(DOT_DT)
        new = ()
        for i in tl.static_range(NKB):
            c = _e4m3_to_f16(xs[i]) if CVT else _fp8_to(xs[i], DOT_DT)
            new = new + (tl.dot(tl.trans(c), pd, accs[i] * alpha[None, :], input_precision=PREC),)
        accs = new
        m_i = m_new
    inv, lse = _softmax_tail(m_i, l_i, v_scale)
    ob = o_ptr + (th * NSPLIT + sp)[None, :] * KV
    for i in tl.static_range(NKB):
        tl.store(ob + i * KB + tl.arange(0, KB)[:, None], accs[i] * inv[None, :], mask=hm[None, :])
    tl.store(lse_ptr + th * NSPLIT + sp, lse, mask=hm)
