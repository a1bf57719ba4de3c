"""Gluon kernels of the routed experts' per-pair decode path on the tensor cores (MXFP4 weights, bf16 activations,
CUDA sm_90+ only; `_moe_gemv.gemv_experts` dispatches by config GLUON): 1, the gate-up here and the down launch
`_moe_gemv_words`' GV=2 kernel, which reads h as this gate-up writes it then (fp32 words in HX=1 order); 2, both
here (h bf16 in column order). Measured configurations: GLUON_T1 / GLUON_T8 below.

Tile (16 rows of the weights, pair p), pair fastest; KS warps, warp w reduces K slice w (K/KS columns) of the same
16 rows, in steps of 32·NWT columns. MMA m16n8k16 (mma.sync, bf16 in, fp32 accumulate) with A = the weights and
B = the activation: the M rows 16w .. 16w+15 hold the 16 rows over K slice w and B's column n holds slice n % KS of
the activation, so C[16w + r, w] is row r's partial over slice w (C's other columns are never read); the KS
partials are summed once at the end (a cross-warp reduction of 16·KS values, the only shared memory).

The K permutation. A and B use DotOperandLayout(k_width=8): lane (g, t) holds logical k 8t .. 8t+7 of every 32,
registers (k, k+1) packed in one 32-bit register. Step-local logical k = 32j + 8t + i (j < NWT) is mapped to the
physical column 8(NWT·t + j) + π(i), π = [0, 4, 1, 5, 2, 6, 3, 7]: lane t's A values of a row over the step are
its NWT consecutive int32 words (one 16-byte load for NWT = 4), and register (i = 2c, 2c + 1) is the code pair
(c, c + 4) of word NWT·t + j, which is exactly what one instance of `_moe_decode16.E2M1_ASM16[c]` produces (sign
and e e m fields of both halves moved by one shift each, the bf16x2 times 2^(s-1); WIDE: E2M1_ASM16_WIDE and
2^(s-127)): 4-5 logic instructions and one multiply per two weights, no byte permute, no shared memory. The
words are broadcast over i (register copies) so that one inline-asm instance (pack=8) sees a word and emits its
8 values; the reshape to [M, 32·NWT] and the conversion to the operand layout only rename registers.
B is the same permutation of the activation: lane (g, t) loads its 8·NWT contiguous columns of slice g % KS with
16-byte loads and the pairs (c, c+4) are re-packed in registers (PRMT). No masks: 16-row blocks tile the rows and
the steps tile K (`usable`); a pair of another rank's expert reads expert 0's rows and computes nothing.
Exactness: bf16 · bf16 products are exact in the fp32 accumulators; the summation order differs from the FFMA
path (fp32 rounding only). Step st+1's words are loaded before step st is decoded (static unroll).
PDL: the gate-up waits before reading its expert id (the router's output); EARLY bit 1 (legal only when the router
ran two launches before, see _moe_gemv_words) reads the id and step 0's weights first; the down kernel's EARLY
bit 0 likewise (always legal). The down kernel combines the K slots in launch as _down_v2_kernel does.

H200 (benches/results/h200-2026-11-30-s14/moe_decode_gluon.json; l=3584, I=3072, 112 experts, graph replay of 8 /
2 distinct routings, PDL on, every variant's graph replay bitwise equal to eager, rel. error 0.0023 as GV=2's),
us, T=1 top-2 (floor 8.2) / T=8 top-2, GV=2 heuristic 24.45 / 149.84:
  - GLUON 1 (this gate-up, GV=2 down): KS 8 x NWT 2 23.77 (23.28 again) / 141.42, the gate-up alone 13.05-13.21 vs
    GV=2's 14.11 (sm_90 SASS: 64-76 registers, ~30 instructions a weight word incl. the tail, vs GV=2's ~42 and
    157 registers); KS 4 x 4 25.90 / 136.18 (gate-up alone 16.27; ~25.4 a word, 86-88 registers), KS 2 x 4 30.63 /
    131.74, KS 4 x 2 29.57 / 146.80; KS 4 x 4 with EARLY 3 24.46 / 133.86.
  - GLUON 2 (both here): down KS 2 x 4 24.52 / 105.79 (107.92 again; 1.42x GV=2 at T=8), KS 4 x 4 29.08 / 110.82
    (the down alone 8.82 vs GV=2's 11.0 at T=1, yet the whole op 4-7 us above the parts' sum: not understood),
    KS 8 x 4 25.97 / 123.20; gate-up KS 8 x 2 with down KS 8 x 4 25.96 / 134.53.
  - Two steps loaded ahead (removed): GLUON 1 26.14 / 133.62, GLUON 2 29.19 / 109.76 (no consistent gain).
"""
from __future__ import annotations

import os
import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from codegen.triton._moe_decode16 import E2M1_ASM16, E2M1_ASM16_WIDE
from codegen.triton._gemv import tile_counters
from codegen.triton._moe_host import _wide_scales
from codegen.triton._moe_tiles import _glu
from codegen.triton._pdl import launch_kwargs, pdl_enter


def _word_asm(wide: bool) -> str:
    """One word ($4; $5..$11 the same word, pack=8) and its bf16x2 factor ($12, $13..$19 copies) -> the four code
    pairs (c, c + 4) as bf16x2 in $0..$3: the four E2M1_ASM16[c] texts with their operands renamed."""
    texts = E2M1_ASM16_WIDE if wide else E2M1_ASM16
    ren = lambda c: (lambda m: "$" + {"0": str(c), "1": "4", "2": "12"}[m.group(1)])     # noqa: E731
    return "\n".join(re.sub(r"\$(\d+)", ren(c), str(getattr(t, "value", t))) for c, t in enumerate(texts))


_barrier = getattr(gl, "barrier", None) or gl.thread_barrier      # Triton 3.7 / 3.6 name of the CTA barrier
WORD_ASM = gl.constexpr(_word_asm(False))
WORD_ASM_WIDE = gl.constexpr(_word_asm(True))


def layouts(ks: int, nwt: int) -> dict:
    """The kernel's layouts for KS K slices (warps) and NWT words a lane a step (constexpr arguments)."""
    m = 16 * ks
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[ks, 1], instr_shape=[16, 8])
    lw = lambda k: [[0, 1 << b, 0, 0] for b in range(k)]       # noqa: E731
    log_nwt, log_ks = nwt.bit_length() - 1, ks.bit_length() - 1
    # A side [M, NWT (j), 4 (t), 8 (i)]: i in registers (the word's 8 values), then j (consecutive words: a
    # vector load once i is sliced away), then row + 8; t and the row's low bits in lanes; the K slice in warps
    a4 = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]] + lw(log_nwt) + [[8, 0, 0, 0]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16 << b, 0, 0, 0] for b in range(log_ks)], block_bases=[], shape=[m, nwt, 4, 8])
    # B side [NWT (j), 4 (t), 8 (physical column 4a + c of word NWT t + j), 8 (n)]: the 8 columns in registers
    # (one 16-byte load), then j; t and n (the K slice) in lanes, every warp the same
    xl = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]] + [[1 << b, 0, 0, 0] for b in range(log_nwt)],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
        warp_bases=[[0, 0, 0, 0]] * log_ks, block_bases=[], shape=[nwt, 4, 8, 8])
    return dict(MMA=mma, A4=a4, XL=xl, DA=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8),
                DB=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8))


@gluon.jit
def _a_offsets(A4: gl.constexpr, M: gl.constexpr, NWT: gl.constexpr, KQW):
    """Word offsets [M, NWT, 4] of step 0 within a weight row block (row m % 16, K slice m // 16 of KQW words)
    and scale offsets [M, 4] (bytes), with the rows' indices [M] (in the scale tensor's layout)."""
    LW: gl.constexpr = gl.SliceLayout(3, A4)
    m = gl.arange(0, M, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW)))
    j = gl.arange(0, NWT, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    m3 = gl.expand_dims(gl.expand_dims(m, 1), 2)
    j3 = gl.expand_dims(gl.expand_dims(j, 0), 2)
    t3 = gl.expand_dims(gl.expand_dims(t, 0), 1)
    woff = (m3 // 16) * KQW + NWT * t3 + j3
    LS: gl.constexpr = gl.SliceLayout(1, LW)
    ms = gl.arange(0, M, layout=gl.SliceLayout(1, LS))
    ts = gl.arange(0, 4, layout=gl.SliceLayout(0, LS))
    soff = gl.expand_dims((ms // 16) * (KQW // 4), 1) + gl.expand_dims((NWT * ts) // 4, 0)
    return woff, soff, ms % 16


@gluon.jit
def _a_operand(w, s, A4: gl.constexpr, DA: gl.constexpr, M: gl.constexpr, NWT: gl.constexpr,
               WIDE: gl.constexpr):
    """Words [M, NWT, 4] and their E8M0 bytes [M, 4] -> the bf16 A operand [M, 32·NWT] (module doc)."""
    if WIDE:
        f = s.to(gl.int32) * 0x00800080                 # bf16x2 2^(s-127) (after the decode's 2^126)
    else:
        f = (s.to(gl.int32) + 126) * 0x00800080         # bf16x2 2^(s-1)
    shape = gl.zeros([M, NWT, 4, 8], gl.int32, A4)      # register copies: no instruction
    w4, shape = gl.broadcast(gl.expand_dims(w, 3), shape)
    f4, shape = gl.broadcast(gl.expand_dims(gl.expand_dims(f, 1), 3), shape)
    if WIDE:
        v = gl.inline_asm_elementwise(WORD_ASM_WIDE, "=r,=r,=r,=r," + "r," * 15 + "r", [w4, f4], dtype=gl.bfloat16,
                                      is_pure=True, pack=8)
    else:
        v = gl.inline_asm_elementwise(WORD_ASM, "=r,=r,=r,=r," + "r," * 15 + "r", [w4, f4], dtype=gl.bfloat16,
                                      is_pure=True, pack=8)
    return gl.convert_layout(gl.reshape(v, [M, 32 * NWT]), DA)      # logical k = 32j + 8t + i


@gluon.jit
def _b_load(x_ptr, k0, KQ, LP: gl.constexpr, NWT: gl.constexpr, KS: gl.constexpr):
    """z's columns of this step, [NWT (j), 4 (t), 8 (physical column in the word), 8 (n)] (16-byte loads); column n
    holds K slice n % KS (the columns n >= KS are never read)."""
    j = gl.arange(0, NWT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LP))))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LP))))
    q = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LP))))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LP))))
    j4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(j, 1), 2), 3)
    t4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 2), 3)
    q4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 3)
    n4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(n % KS, 0), 1), 2)
    return gl.load(x_ptr + (n4 * KQ + k0 + 8 * (NWT * t4 + j4) + q4))


@gluon.jit
def _b_operand(x, DB: gl.constexpr, NWT: gl.constexpr):
    """_b_load's columns as the B operand [32·NWT, 8]: physical column 4a + c of word NWT·t + j is logical
    k = 32j + 8t + 2c + a (the pairs (c, c + 4) re-packed in registers)."""
    x = gl.permute(gl.reshape(x, [NWT, 4, 2, 4, 8]), [0, 1, 3, 2, 4])
    return gl.convert_layout(gl.reshape(x, [32 * NWT, 8]), DB)


@gluon.jit
def _w_loads(w1_rows, w3_rows, s1_rows, s3_rows, st: gl.constexpr, NWT: gl.constexpr, TWO: gl.constexpr):
    """Step st's words [M, NWT, 4] and scale bytes [M, 4] of w1 and (TWO) w3 (no masks: the row blocks tile the
    rows, the steps tile K); one matrix: w1's twice."""
    w1 = gl.load(w1_rows + st * 4 * NWT)
    s1 = gl.load(s1_rows + st * NWT)
    if TWO:
        return w1, gl.load(w3_rows + st * 4 * NWT), s1, gl.load(s3_rows + st * NWT)
    else:
        return w1, w1, s1, s1


@gluon.jit
def _dots(w1_rows, w3_rows, s1_rows, s3_rows, x_row, KQ, w1a, w3a, s1a, s3a, TWO: gl.constexpr,
          STEPS: gl.constexpr, NWT: gl.constexpr, KS: gl.constexpr, WIDE: gl.constexpr, MMA: gl.constexpr,
          A4: gl.constexpr, XL: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr):
    """(W1 x, W3 x) on the tile's 16 rows (fp32 [16]; TWO=False: W1 x twice) over the KS slices of STEPS steps;
    step 0's words and scales (w1a .. s3a) come from the caller, step st+1's are loaded before step st's decode."""
    M: gl.constexpr = 16 * KS
    acc1 = gl.zeros([M, 8], gl.float32, MMA)
    acc3 = gl.zeros([M, 8], gl.float32, MMA)
    xa = _b_load(x_row, 0, KQ, XL, NWT, KS)
    for st in gl.static_range(STEPS):
        w1, w3, s1, s3, x = w1a, w3a, s1a, s3a, xa
        if st + 1 < STEPS:
            w1a, w3a, s1a, s3a = _w_loads(w1_rows, w3_rows, s1_rows, s3_rows, st + 1, NWT, TWO)
            xa = _b_load(x_row, (st + 1) * 32 * NWT, KQ, XL, NWT, KS)
        b = _b_operand(x, DB, NWT)
        acc1 = mma_v2(_a_operand(w1, s1, A4, DA, M, NWT, WIDE), b, acc1)
        if TWO:
            acc3 = mma_v2(_a_operand(w3, s3, A4, DA, M, NWT, WIDE), b, acc3)
    a = _slice_sum(acc1, MMA, M, KS)
    if TWO:
        return a, _slice_sum(acc3, MMA, M, KS)
    else:
        return a, a


@gluon.jit
def _tile_rows(ids_ptr, p, r0, E, stride_we, stride_wn, stride_se, stride_sn, KQV, A4: gl.constexpr,
               M: gl.constexpr, NWT: gl.constexpr):
    """Pair p's expert e and the word / scale offsets of its rows r0 .. r0+15 over the K slices (module doc);
    mine: e in [0, E) (another rank's expert: expert 0's offsets, never used)."""
    e = gl.load(ids_ptr + p)
    mine = (e >= 0) & (e < E)
    es = gl.where(mine, e, 0).to(gl.int64)
    woff, soff, rows = _a_offsets(A4, M, NWT, KQV * NWT)
    LW: gl.constexpr = gl.SliceLayout(3, A4)
    rw = gl.arange(0, M, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW))) % 16 + r0
    w_rows = gl.expand_dims(gl.expand_dims(rw.to(gl.int64) * stride_wn, 1), 2) + es * stride_we + woff
    s_rows = gl.expand_dims((rows + r0).to(gl.int64) * stride_sn, 1) + es * stride_se + soff
    return mine, w_rows, s_rows


@gluon.jit
def _slice_sum(acc, MMA: gl.constexpr, M: gl.constexpr, KS: gl.constexpr):
    """Row r's sum over the K slices: Σ_w acc[16w + r, w] -> [16] (fp32, slice order fixed by the reduction)."""
    m = gl.arange(0, M, layout=gl.SliceLayout(1, MMA))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    mine = gl.expand_dims(m // 16, 1) == gl.expand_dims(n, 0)
    part = gl.sum(gl.where(mine, acc, 0.0), axis=1)
    return gl.sum(gl.reshape(part, [KS, 16]), axis=0)


@gluon.jit
def _gate_up_gluon_kernel(z_ptr, ids_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, E, INTER, ELL, stride_z, stride_we,
                          stride_wn, stride_se, stride_sn, stride_h, beta1, beta2, NP, KQ8, KQV, TOPK: gl.constexpr,
                          ACT: gl.constexpr, HAS_BETA2: gl.constexpr, KS: gl.constexpr, NWT: gl.constexpr,
                          STEPS: gl.constexpr, WIDE: gl.constexpr, HX: gl.constexpr,
                          EARLY: gl.constexpr,
                          PDL: gl.constexpr, MMA: gl.constexpr, A4: gl.constexpr, XL: gl.constexpr,
                          DA: gl.constexpr, DB: gl.constexpr):
    """h[p, 16 rows] = act(W1_e z_t, W3_e z_t) for tile (row block, pair p), pair fastest (module doc); a pair of
    another rank (e outside [0, E)) writes nothing. K = ELL = KS slices of STEPS steps of 32·NWT columns."""
    M: gl.constexpr = 16 * KS
    if not EARLY:
        pdl_enter(PDL)
    p = gl.program_id(0) % NP
    r0 = (gl.program_id(0) // NP) * 16
    mine, w_rows, s_rows = _tile_rows(ids_ptr, p, r0, E, stride_we, stride_wn, stride_se, stride_sn, KQV, A4, M, NWT)
    w1a, w3a, s1a, s3a = _w_loads(w1_ptr + w_rows, w3_ptr + w_rows, s1_ptr + s_rows, s3_ptr + s_rows, 0, NWT, True)
    if EARLY:
        pdl_enter(PDL)
    if mine:
        a, u = _dots(w1_ptr + w_rows, w3_ptr + w_rows, s1_ptr + s_rows, s3_ptr + s_rows,
                     z_ptr + (p // TOPK).to(gl.int64) * stride_z, KQ8 * 8, w1a, w3a, s1a, s3a, True, STEPS, NWT,
                     KS, WIDE, MMA, A4, XL, DA, DB)
        h = _glu(a, u, beta1, beta2, ACT, HAS_BETA2).to(gl.bfloat16)
        rn = r0 + gl.arange(0, 16, layout=a.type.layout)
        if HX:
            gl.store(h_ptr + p.to(gl.int64) * stride_h + (rn % 8) * (INTER // 8) + rn // 8, h.to(gl.float32))
        else:
            gl.store(h_ptr + p.to(gl.int64) * stride_h + rn, h)


@gluon.jit
def _down_gluon_kernel(h_ptr, wt_ptr, ids_ptr, w2_ptr, s2_ptr, o_ptr, cnt_ptr, y_ptr, E, ELL, stride_h, stride_we,
                       stride_wn, stride_se, stride_sn, stride_y, NP, KQ8, KQV, TOPK: gl.constexpr, KS: gl.constexpr,
                       NWT: gl.constexpr, STEPS: gl.constexpr, WIDE: gl.constexpr,
                       EARLY: gl.constexpr, PDL: gl.constexpr, MMA: gl.constexpr, A4: gl.constexpr,
                       XL: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr):
    """Tile (16 rows of y, pair p = t·K + j), pair fastest: o = w[t, j] · rnd(W2_e h_p) (h bf16 [P, I] as the gate-up
    wrote it with HX=0), then _moe_gemv_words._down_v2_kernel's in-launch combine: the tile stores o to the fp32
    workspace, counts itself in on counter (t, row block) (acq_rel), and the last of the K slots to arrive adds
    the K rows in slot order and resets the counter (K = 1: y = o directly). EARLY: the expert id and step 0's
    weights are read before the PDL wait (legal: see _down_v2_kernel)."""
    M: gl.constexpr = 16 * KS
    if not EARLY:
        pdl_enter(PDL)
    p = gl.program_id(0) % NP
    rb = gl.program_id(0) // NP
    t = p // TOPK
    mine, w_rows, s_rows = _tile_rows(ids_ptr, p, rb * 16, E, stride_we, stride_wn, stride_se, stride_sn, KQV, A4, M,
                                      NWT)
    wa, _w, sa, _s = _w_loads(w2_ptr + w_rows, w2_ptr + w_rows, s2_ptr + s_rows, s2_ptr + s_rows, 0, NWT, False)
    if EARLY:
        pdl_enter(PDL)
    LO: gl.constexpr = gl.BlockedLayout([1], [32], [KS], [0])
    if mine:
        o, _o = _dots(w2_ptr + w_rows, w2_ptr + w_rows, s2_ptr + s_rows, s2_ptr + s_rows,
                      h_ptr + p.to(gl.int64) * stride_h, KQ8 * 8, wa, wa, sa, sa, False, STEPS, NWT, KS, WIDE,
                      MMA, A4, XL, DA, DB)
        o = gl.load(wt_ptr + p).to(gl.float32) * o.to(gl.bfloat16).to(gl.float32)
        rn = rb * 16 + gl.arange(0, 16, layout=o.type.layout)
        if TOPK == 1:
            gl.store(y_ptr + t.to(gl.int64) * stride_y + rn, o)
        else:
            gl.store(o_ptr + p.to(gl.int64) * ELL + rn, o)
    else:       # another rank's expert: the slot adds 0
        rz = rb * 16 + gl.arange(0, 16, layout=LO)
        if TOPK == 1:
            gl.store(y_ptr + t.to(gl.int64) * stride_y + rz, gl.zeros([16], gl.float32, LO))
        else:
            gl.store(o_ptr + p.to(gl.int64) * ELL + rz, gl.zeros([16], gl.float32, LO))
    if TOPK > 1:
        _barrier()      # every thread's rows stored before the release
        arrived = gl.atomic_add(cnt_ptr + rb * (NP // TOPK) + t, 1, sem="acq_rel", scope="gpu")
        if arrived == TOPK - 1:
            rn = rb * 16 + gl.arange(0, 16, layout=LO)
            y = gl.zeros([16], gl.float32, LO)
            for j in gl.static_range(TOPK):
                y += gl.load(o_ptr + (t * TOPK + j).to(gl.int64) * ELL + rn, cache_modifier=".cg")
            gl.store(y_ptr + t.to(gl.int64) * stride_y + rn, y)
            gl.atomic_xchg(cnt_ptr + rb * (NP // TOPK) + t, 0, sem="relaxed", scope="gpu")


# the measured best (module doc), for the heuristic to set on CUDA sm_90+ (off it, `usable` refuses them anyway):
# T=1 top-2, the op alone (session 14): KS 8 x NWT 2 23.28-23.77 us vs GV=2 24.45. Inside the rank decode graph
# (session 18, benches/bench_runtime_gpu.py --sections graph_configs, batch 1, medians of 6-8 captures): KS 4 x NWT 4
# with the GV=2 down kernel on 4-row x 512-column steps (GLUON_T1_DOWN) is what the step runs fastest: the
# moe_grouped_gemm part of the -20 us below (KS 4 x NWT 4 alone 545.0 vs 554.0 us; KS 2 x 4 549.8, KS 4 x 2 549.0).
GLUON_T1 = {"GLUON": 1, "GKS": 4, "GNW": 4}
GLUON_T1_DOWN = {"GN2": 4, "GK2": 512}  # the down kernel (_moe_gemv_words GV=2) beside GLUON_T1: 549.0 vs 554.3 us
GLUON_T8 = {"GLUON": 2, "GKS": 4, "GNW": 4, "GKS2": 2, "GNW2": 4}  # T=8 top-2: 105.8-107.9 vs 149.8 us


def tiles(cfg: dict, down: bool = False) -> tuple[int, int]:
    """(KS K slices = warps, NWT words a lane a step): GKS, GNW (the down kernel's: GKS2, GNW2, default the
    gate-up's)."""
    ks, nwt = int(cfg.get("GKS", 4)), int(cfg.get("GNW", 4))
    if down:
        return int(cfg.get("GKS2", ks)), int(cfg.get("GNW2", nwt))
    return ks, nwt


def _fits(k: int, rows: int, t: tuple) -> bool:
    ks, nwt = t
    return ks in (1, 2, 4, 8) and nwt in (1, 2, 4) and rows % 16 == 0 and k % (ks * 32 * nwt) == 0


def usable(z: torch.Tensor, g1, g3, cfg: dict, g2=None) -> int:
    """Which Gluon kernels run: 0 none, 1 the gate-up (GLUON=1), 2 both (GLUON=2; g2 given): CUDA sm_90+ (never
    the interpreter), bf16 z with unit column stride, MXFP4 int32 words, 16-row blocks tiling the rows and the K
    slices' steps tiling K (no masks in the kernels)."""
    mode = int(cfg.get("GLUON") or 0)
    if not (mode and z.is_cuda and z.dtype == torch.bfloat16 and g1[0] and g3[0] and z.stride(1) == 1
            and os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.get_device_capability(z.device)[0] >= 9):
        return 0
    ell, inter = z.shape[1], int(g1[1].shape[1])
    if not _fits(ell, inter, tiles(cfg)):
        return 0
    if mode == 2 and g2 is not None and g2[0] and _fits(inter, ell, tiles(cfg, True)):
        return 2
    return 1


def _launch(late: bool = False) -> dict:
    out = dict(launch_kwargs())
    if late:        # no programmatic edge (_moe_gemv_words' LATE)
        out.pop("launch_pdl", None)
    return out


def gate_up(z, ids, g1, g3, h, act_kw: dict, cfg: dict, late: bool = False) -> None:
    """h [T·K, I] by the Gluon kernel: fp32 values of bf16 in HX=1 order (h fp32: _moe_gemv_words' down kernel
    reads it) or bf16 in column order (h bf16: `down`'s); g1, g3: _moe_host._gemv_weight's MXFP4 words; cfg as
    `tiles`, EARLY bit 1 (module doc); late: no programmatic edge (the config's LATE, _moe_gemv_words)."""
    T, ell = z.shape
    K = ids.shape[1]
    P, inter = T * K, int(g1[1].shape[1])
    ks, nwt = tiles(cfg)
    kq = ell // ks
    _gate_up_gluon_kernel[(P * (inter // 16),)](
        z, ids, g1[1], g3[1], g1[2], g3[2], h, g1[1].shape[0], inter, ell, z.stride(0), *g1[3], h.stride(0),
        *act_kw["betas"], P, kq // 8, kq // 8 // nwt, TOPK=K, ACT=act_kw["ACT"], HAS_BETA2=act_kw["HAS_BETA2"], KS=ks,
        NWT=nwt, STEPS=kq // (32 * nwt), WIDE=_wide_scales(g1[2]) or _wide_scales(g3[2]),
        HX=int(h.dtype == torch.float32), EARLY=bool(int(cfg.get("EARLY", 0)) & 2) and not late,
        num_warps=ks, **layouts(ks, nwt), **_launch(late))


def down(h, weights, ids, g2, y, cfg: dict) -> None:
    """y [T, l] from h (bf16 [T·K, I], `gate_up`'s with h bf16) by the Gluon down kernel with the in-launch slot
    combine (counters: _gemv.tile_counters); EARLY bit 0 (always legal, _moe_gemv_words)."""
    T, K = ids.shape
    P, ell, inter = T * K, int(g2[1].shape[1]), h.shape[1]
    ks, nwt = tiles(cfg, True)
    kq = inter // ks
    nrb = ell // 16
    o = torch.empty(P if K > 1 else 1, ell, dtype=torch.float32, device=h.device)
    cnt = tile_counters(h.device, nrb * T) if K > 1 else o
    _down_gluon_kernel[(P * nrb,)](
        h, weights, ids, g2[1], g2[2], o, cnt, y, g2[1].shape[0], ell, h.stride(0), *g2[3], y.stride(0), P, kq // 8,
        kq // 8 // nwt, TOPK=K, KS=ks, NWT=nwt, STEPS=kq // (32 * nwt), WIDE=_wide_scales(g2[2]),
        EARLY=bool(int(cfg.get("EARLY", 0)) & 1), num_warps=ks, **layouts(ks, nwt), **_launch())
