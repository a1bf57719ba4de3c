"""Gluon grouped gate-up of the routed experts for the decode batch (T=64 top-16 of 112 experts; issue 5): config GG=1
in moe_grouped_gemm.expert_pair_outputs (MXFP4 weights, bf16 activations, CUDA sm_90+ only, unsplit K; the
heuristic's at T=64, _moe_configs.GLUON_T64). It reads the permutation of `permute_tokens` (ExpertSegments) and
writes h [T·k, I] in the same expert-sorted row order and with the same SiTU-GLU / SwiGLU epilogue as the Triton
gate-up kernel, so the Triton down kernel runs unchanged; with the Gluon down kernel (config GD, _moe_down_gluon.py)
h's columns are stored in that kernel's operand order instead (HP, `_hp_column`: store addresses only).

Program (expert e, block of M = 16·MT·W weight rows), the blocks of an expert back to back; an expert without
tokens exits at once. W warps each own MT 16-row MMA tiles (warp w: rows 16w + 16W·r), every warp the whole K.
The expert's tokens are the MMA's N side: BN (8 or 16) columns a tile, tiles looped (so one expert holding most of
the batch is still correct; its weights are then read again per N tile, from L2). MMA m16n8k16 (mma.sync, bf16
in, fp32 accumulate), A = the weights decoded in registers under `_moe_gemv_gluon`'s K permutation (lane t's NWT
consecutive int32 words a row, 16-byte loads for NWT 4; DEC 0: its `_a_operand` / WORD_ASM, DEC 1: `_a_mul`, the
same bits by masks and integer multiplies, below), B = the tokens' activation columns permuted alike (16-byte
loads, pairs re-packed in registers, PRMT). Step st+1's words, scale bytes and activation columns are loaded before
step st is decoded (registers, a runtime loop of l / (32·NWT) steps). No masks on the weights (the row blocks tile
I, the steps tile l: `usable`); token columns past the expert's count read row 0's activations and are not stored.
No shared memory at all (sm_90 SASS, Triton 3.6 and 3.7). Exactness as the Triton kernels: bf16 products exact in
fp32, fp32 summation (order differs), act in fp32; on the H200 every variant's relative error vs the fp32 reference
equals the Triton path's (0.00234), graph replay bitwise equal to eager, skewed routing (expert 0 in all 64 tokens:
4 N tiles) 0.00235 vs float64, wide scales 0.00175.

H200, session 15 (benches/results/h200-2026-11-30-s15/moe_t64_gluon_tiles.json, moe_t64_gluon_tuned.json; T=64
top-16, l=3584, I=3072, graph replay; the Triton TMA gate-up (DECODE_T64) in the same calls: alone 0.608 / 0.616 ms,
whole op 0.939 / 0.944), gate-up alone ms [whole op]:
  - DEC 0, NWT 4, BN 16: W4 x MT1 (128 registers, 16 warps an SM) 0.632 / 0.636 [0.971 / 0.978], W2 x MT1 0.637
    [0.979], W4 x MT2 (244) 0.646 [0.993], W8 x MT1 0.657 [0.992], NWT 2 (8-byte loads) 0.707 [1.039], BN 8 0.856
    [1.202]. The K loop is ~463 SASS a step for 16 rows x 128 columns x 2 matrices a warp (~29 a weight word, 3.6 a
    weight element: no fewer than the Triton kernel's), so the decode, not the operand path, sets the count.
  - DEC 1 (463 -> 431 SASS a step, ALU-pipe instructions 253 -> 214; 140 registers): W4 x MT1 0.646 [0.996], capped
    at 128 registers (GGR, 4 spilled) 0.613 [0.954; 0.956 again], W4 x MT2 (168) 0.617 [0.966], W2 x MT2 0.621
    [0.976], W2 x MT1 0.652 [0.996]. With the context's L2 fetch granularity at 128 bytes (_moe_t64.l2_fetch_check)
    W4 x MT1 / cap 128 made the whole op 0.906 ms (43.7% of read bandwidth): the fastest T=64 figure so far, but the
    Triton path was not timed at 128 bytes in that call (session 14: 1.0255 vs 0.9513 at the default 64, slower).
  - Removed, slower: the scale bytes and words two steps ahead in registers, one step an iteration (168 registers:
    the loop-carried sets copied each step) 0.713 [1.060]; the words
    through a ring of 3-6 shared-memory stages by cp.async (LDGSTS.128, then LDS.128 in the A layout; Gluon's
    barrier pass puts 2 bar.sync in each step) 0.619-0.754 [0.959-1.120], and with 1-2 warps graph replay != eager
    (the next N tile's prologue did not wait for the previous tile's last copy groups).
Session 16 (benches/results/h200-2026-11-30-s16/moe_t64_down_gluon_call2.json; GLUON_T64 of session 15 in the same
call: gate-up alone 0.641, whole op 0.988 / 0.995, 0.912 at 128-byte L2 fetches): GGU 1 (GU 2 in the kernel), two K
steps an iteration with each step's words and scale bytes loaded two steps ahead into the registers the step before
last used (no copies; carried over N tiles), z read as int32 words one step ahead and paired by one PRMT a register
(`_z_operand`; in bf16 the loop-carried halves cost ~57 PRMT + 16 moves a step): sm_90 SASS 387 a step vs 431,
W4 x MT1 capped at 128 registers (no spills on the H200's Triton 3.6) 0.573 [0.899], at a 168 cap (164) 0.590
[0.929], uncapped (167) 0.585 [0.930]; its first two steps' words before the PDL wait 0.589 at 168 (no gain,
removed). With the Gluon down kernel (GD): whole op 0.860 ms (47.0% of read bandwidth; PDL off 0.862, at 128-byte L2
fetches 0.864), now GLUON_T64.
Session 23 (benches/results/h200-2026-12-02-s23; benches/_moe_ablation.py rebuilds this kernel and the down kernel with
parts taken out): the gate-up is not bound by HBM. With its weights read from a two-step window (L1 / L2-resident, the
same loads and decode) it takes 0.501 of 0.590 ms uncapped (0.53 of 0.555 at the 128 cap); without the activation loads
0.518, without the decode 0.524, without all three 0.243 (the skeleton: mma.sync, the word loads, the loop). The time is
the instruction stream's: decode, activation path and skeleton share the issue slots. Measured and removed, both
slower: the words through a TMA ring in shared memory, one warp a program (0.68-1.21 ms: the ring's shared memory
comes out of the L1 that serves every warp's activation columns); the gate-up on wgmma with the decoded words as A in
registers and the activation columns as B in shared memory (about half the instructions a K step; 0.585 at best with
a TMA ring of words, 0.62-0.85 in other forms: a warpgroup serialises decode -> wgmma chain -> wait within a step, which
16 independent mma.sync warps hide better). Numbers in benches/_moe_t64.py's variant comments.
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from codegen.triton._moe_gemv_gluon import _a_operand, _barrier
from codegen.triton._moe_host import _int32_view, _wide_scales
from codegen.triton._moe_tiles import _glu
from codegen.triton._pdl import launch_kwargs, pdl_enter
from ir.packed import PackedMXFP4


def _word_mul_asm(wide: bool) -> str:
    """DEC 1: one int32 word ($4, pack=8 copies to $11) times its bf16x2 factor ($12 ..) -> code pairs (c, c + 4) as
    bf16x2 in $0..$3, as `_moe_gemv_gluon.WORD_ASM` gives them, by masks and integer multiplies: code c's nibble of
    both halves masked, then one multiply by 2^(6-4c) + 2^(12-4c) puts its e e m at bits 8..6 and its sign at 15 of
    each half (the two copies never overlap: no carries), a mask keeps those; codes 2, 3 from the word >> 8. Per
    word 1 SHF + 8 LOP3 (ALU pipe) and 4 IMAD + 4 HMUL2 (FMA pipe), vs WORD_ASM's ~13 ALU-pipe shifts and logic."""
    out = ["{", ".reg .b32 h, a, u;", "shr.b32 h, $4, 8;", "mov.b32 u, 0x7E807E80;"][:4 if wide else 3]
    for c in range(4):
        src, sh = ("$4", 4 * c) if c < 2 else ("h", 4 * (c - 2))
        out += [f"and.b32 a, {src}, {hex(0x000F000F << sh)};",
                f"mul.lo.u32 a, a, {hex((1 << 6 - sh) + (1 << 12 - sh))};",
                "and.b32 a, a, 0x81C081C0;"]
        if wide:        # E2M1 · 2^-126 · 2^126 first, then the factor 2^(s-127)
            out += ["mul.rn.bf16x2 a, a, u;"]
        out += [f"mul.rn.bf16x2 ${c}, a, $12;"]
    return "\n".join(out + ["}"])


WORD_MUL_ASM = gl.constexpr(_word_mul_asm(False))
WORD_MUL_ASM_WIDE = gl.constexpr(_word_mul_asm(True))


def layouts(w: int, mt: int, nwt: int, bn: int) -> dict:
    """Constexpr layouts for W warps, MT 16-row tiles a warp, NWT words a lane a step, BN token columns."""
    lg = lambda v: v.bit_length() - 1      # noqa: E731
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[w, 1], instr_shape=[16, 8])
    # A side [M, NWT (j), 4 (t), 8 (i)]: i, j, row + 8 and the warp's MT tiles in registers; t and the row's low
    # bits in lanes; 16-row tiles over the warps (as the MMA's dot operand places them: no data movement)
    a4 = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]] + [[0, 1 << b, 0, 0] for b in range(lg(nwt))]
        + [[8, 0, 0, 0]] + [[(16 * w) << b, 0, 0, 0] for b in range(lg(mt))],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16 << b, 0, 0, 0] for b in range(lg(w))], block_bases=[], shape=[16 * mt * w, nwt, 4, 8])
    # B side [NWT (j), 4 (t), 8 (physical column in the word), BN (n)]: the 8 columns (16 bytes), j and n + 8 in
    # registers, t and n % 8 in lanes, every warp the same
    xl = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]] + [[1 << b, 0, 0, 0] for b in range(lg(nwt))]
        + ([[0, 0, 0, 8]] if bn == 16 else []),
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
        warp_bases=[[0, 0, 0, 0]] * lg(w), block_bases=[], shape=[nwt, 4, 8, bn])
    return dict(MMA=mma, A4=a4, XL=xl, DA=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8),
                DB=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8))


@gluon.jit
def _a_mul(w, s, A4: gl.constexpr, DA: gl.constexpr, M: gl.constexpr, NWT: gl.constexpr, WIDE: gl.constexpr):
    """`_moe_gemv_gluon._a_operand` (same factor, operand and K permutation) with the DEC 1 word decode."""
    f = (s.to(gl.int32) + (0 if WIDE else 126)) * 0x00800080       # bf16x2 2^(s-127) | 2^(s-1)
    shape = gl.zeros([M, NWT, 4, 8], gl.int32, A4)
    w4, shape = gl.broadcast(gl.expand_dims(w, 3), shape)
    f4, shape = gl.broadcast(gl.expand_dims(gl.expand_dims(f, 1), 3), shape)
    v = gl.inline_asm_elementwise(WORD_MUL_ASM_WIDE if WIDE else WORD_MUL_ASM, "=r,=r,=r,=r," + "r," * 15 + "r",
                                  [w4, f4], dtype=gl.bfloat16, is_pure=True, pack=8)
    return gl.convert_layout(gl.reshape(v, [M, 32 * NWT]), DA)


@gluon.jit
def _row_offsets(r0, stride_wn, stride_sn, A4: gl.constexpr, M: gl.constexpr, NWT: gl.constexpr):
    """Word offsets [M, NWT, 4] (row r0 + m, word NWT·t + j of step 0) and scale-byte offsets [M, 4]."""
    LW: gl.constexpr = gl.SliceLayout(3, A4)
    m = gl.arange(0, M, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW)))
    j = gl.arange(0, NWT, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    rw = gl.expand_dims(gl.expand_dims((r0 + m).to(gl.int64) * stride_wn, 1), 2)
    woff = rw + gl.expand_dims(gl.expand_dims(j, 0), 2) + NWT * gl.expand_dims(gl.expand_dims(t, 0), 1)
    LS: gl.constexpr = gl.SliceLayout(1, LW)
    ms = gl.arange(0, M, layout=gl.SliceLayout(1, LS))
    ts = gl.arange(0, 4, layout=gl.SliceLayout(0, LS))
    soff = gl.expand_dims((r0 + ms).to(gl.int64) * stride_sn, 1) + gl.expand_dims((NWT * ts) // 4, 0)
    return woff, soff


@gluon.jit
def _x_offsets(z_ptr, pair_ptr, pos0, n_live, stride_z, TOPK: gl.constexpr, XL: gl.constexpr, NWT: gl.constexpr,
               BN: gl.constexpr):
    """Pointers [NWT, 4, 8, BN] to step 0's activation columns of the tile's tokens (expert-sorted rows pos0 + n;
    n >= n_live: the first row's token, never stored): column 8(NWT·t + j) + q of token n."""
    j = gl.arange(0, NWT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    q = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, XL))))
    n = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XL))))
    tok = gl.load(pair_ptr + pos0 + gl.where(n < n_live, n, 0)) // TOPK
    j4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(j, 1), 2), 3)
    t4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 2), 3)
    q4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 3)
    n4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(tok.to(gl.int64) * stride_z, 0), 1), 2)
    return z_ptr + (n4 + 8 * (NWT * t4 + j4) + q4)


@gluon.jit
def _x_operand(x, DB: gl.constexpr, NWT: gl.constexpr, BN: gl.constexpr):
    """Activation columns [NWT, 4, 8, BN] -> B [32·NWT, BN]: physical column 4a + c of word NWT·t + j is logical
    k = 32j + 8t + 2c + a (the code pairs (c, c + 4) of _a_operand's words)."""
    x = gl.permute(gl.reshape(x, [NWT, 4, 2, 4, BN]), [0, 1, 3, 2, 4])
    return gl.convert_layout(gl.reshape(x, [32 * NWT, BN]), DB)


@gluon.jit
def _w_step(w1r, w3r, s1r, s3r, st, NWT: gl.constexpr):
    """Step st's words [M, NWT, 4] and scale bytes [M, 4] of w1 and w3."""
    return (gl.load(w1r + st * 4 * NWT), gl.load(w3r + st * 4 * NWT), gl.load(s1r + st * NWT),
            gl.load(s3r + st * NWT))


def zword_layout(nwt: int, bn: int, w: int) -> gl.DistributedLinearLayout:
    """GGU: z's int32 words [NWT (j), 4 (t), 4 (word q: columns 2q, 2q + 1 of the 8), 2 (copy), BN (n)]: the copy,
    the 4 words (one 16-byte load), j and n + 8 in registers; t and n % 8 in lanes; every warp the same."""
    lg = lambda v: v.bit_length() - 1      # noqa: E731
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0]] + [[1 << b, 0, 0, 0, 0] for b in range(lg(nwt))]
        + ([[0, 0, 0, 0, 8]] if bn == 16 else []),
        lane_bases=[[0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4]],
        warp_bases=[[0, 0, 0, 0, 0]] * lg(w), block_bases=[], shape=[nwt, 4, 4, 2, bn])


# GGU: the four words of 8 columns ($4, $6, $8, $10; each twice, pack=8) -> the code-pair order of `_x_operand`:
# register c = columns (c, c + 4), one byte permute each
Z_PAIRS_ASM = gl.constexpr("prmt.b32 $0, $4, $8, 0x5410;\nprmt.b32 $1, $4, $8, 0x7632;\n"
                           "prmt.b32 $2, $6, $10, 0x5410;\nprmt.b32 $3, $6, $10, 0x7632;")


@gluon.jit
def _z_words(z_ptr, pair_ptr, pos0, n_live, stride_zw, TOPK: gl.constexpr, ZL: gl.constexpr, NWT: gl.constexpr,
             BN: gl.constexpr):
    """GGU: pointers [NWT, 4, 4, BN] to step 0's int32 words of the tile's tokens (as `_x_offsets`; z read as int32,
    stride_zw in words): word 4(NWT·t + j) + q of token n."""
    L4: gl.constexpr = gl.SliceLayout(3, ZL)
    j = gl.arange(0, NWT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
    n = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    tok = gl.load(pair_ptr + pos0 + gl.where(n < n_live, n, 0)) // TOPK
    col = 4 * (NWT * gl.expand_dims(gl.expand_dims(t, 0), 2) + gl.expand_dims(gl.expand_dims(j, 1), 2)) \
        + gl.expand_dims(gl.expand_dims(q, 0), 1)
    return z_ptr + (gl.expand_dims(col, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(
        tok.to(gl.int64) * stride_zw, 0), 1), 2))


@gluon.jit
def _z_operand(x, ZL: gl.constexpr, DB: gl.constexpr, NWT: gl.constexpr, BN: gl.constexpr):
    """GGU: int32 words [NWT, 4, 4, BN] -> B [32·NWT, BN] as `_x_operand` (one PRMT a register, no moves)."""
    shape = gl.zeros([NWT, 4, 4, 2, BN], gl.int32, ZL)
    x5, shape = gl.broadcast(gl.expand_dims(x, 3), shape)
    v = gl.inline_asm_elementwise(Z_PAIRS_ASM, "=r,=r,=r,=r," + "r," * 7 + "r", [x5], dtype=gl.bfloat16, is_pure=True,
                                  pack=8)
    return gl.convert_layout(gl.reshape(v, [32 * NWT, BN]), DB)


@gluon.jit
def _gu_step(acc1, acc3, w1, w3, s1, s3, x, DEC: gl.constexpr, WIDE: gl.constexpr, M: gl.constexpr,
             NWT: gl.constexpr, BN: gl.constexpr, A4: gl.constexpr, ZL: gl.constexpr, DA: gl.constexpr,
             DB: gl.constexpr):
    """GGU: one K step of both matrices on z's words x."""
    b = _z_operand(x, ZL, DB, NWT, BN)
    if DEC == 1:
        return (mma_v2(_a_mul(w1, s1, A4, DA, M, NWT, WIDE), b, acc1),
                mma_v2(_a_mul(w3, s3, A4, DA, M, NWT, WIDE), b, acc3))
    else:
        return (mma_v2(_a_operand(w1, s1, A4, DA, M, NWT, WIDE), b, acc1),
                mma_v2(_a_operand(w3, s3, A4, DA, M, NWT, WIDE), b, acc3))


@gluon.jit
def _tile_dots(z_ptr, pair_ptr, pos0, n_live, stride_z, w1r, w3r, s1r, s3r, STEPS, TOPK: gl.constexpr,
               M: gl.constexpr, NWT: gl.constexpr, BN: gl.constexpr, DEC: gl.constexpr, WIDE: gl.constexpr,
               MMA: gl.constexpr, A4: gl.constexpr, XL: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr):
    """(W1 z, W3 z) [M, BN] of one N tile (tokens pos0 + n, n < n_live), one K step an iteration, the next step's
    words, scale bytes and activation columns loaded first."""
    xr = _x_offsets(z_ptr, pair_ptr, pos0, n_live, stride_z, TOPK, XL, NWT, BN)
    w1n, w3n, s1n, s3n = _w_step(w1r, w3r, s1r, s3r, 0, NWT)
    xn = gl.load(xr)
    acc1 = gl.zeros([M, BN], gl.float32, MMA)
    acc3 = gl.zeros([M, BN], gl.float32, MMA)
    for st in range(STEPS):
        w1, w3, s1, s3, x = w1n, w3n, s1n, s3n, xn
        nx = gl.minimum(st + 1, STEPS - 1)        # the last step reloads its own (cache hits)
        w1n, w3n, s1n, s3n = _w_step(w1r, w3r, s1r, s3r, nx, NWT)
        xn = gl.load(xr + nx * 32 * NWT)
        b = _x_operand(x, DB, NWT, BN)
        if DEC == 1:
            acc1 = mma_v2(_a_mul(w1, s1, A4, DA, M, NWT, WIDE), b, acc1)
            acc3 = mma_v2(_a_mul(w3, s3, A4, DA, M, NWT, WIDE), b, acc3)
        else:
            acc1 = mma_v2(_a_operand(w1, s1, A4, DA, M, NWT, WIDE), b, acc1)
            acc3 = mma_v2(_a_operand(w3, s3, A4, DA, M, NWT, WIDE), b, acc3)
    return acc1, acc3


@gluon.jit
def _hp_column(r, NWT: gl.constexpr):
    """Where h's column r is stored for the Gluon down kernel (_moe_down_gluon.py, config GD; NWT 2 or 4): in each
    block of 32·NWT columns, column 8·NWT·t + 8j + 4p + w (the down kernel's lane t, word NWT·t + j of W2's step,
    code pair w, half p) at 8·NWT·t + 16(j // 2) + 4w + 2(j % 2) + p, so that each lane's 16-byte loads hold the
    bf16 pairs of its mma.sync B registers in order."""
    rb = r % (32 * NWT)
    t, j, p, w = rb // (8 * NWT), (rb // 8) % NWT, (rb // 4) % 2, rb % 4
    return r - rb + 8 * NWT * t + 16 * (j // 2) + 4 * w + 2 * (j % 2) + p


@gluon.jit
def _grouped_gate_up_kernel(z_ptr, pair_ptr, counts_ptr, offsets_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
                            done_ptr, stride_z, stride_we, stride_wn, stride_se, stride_sn, stride_h, beta1, beta2, NRB, STEPS,
                            TOPK: gl.constexpr, ACT: gl.constexpr, HAS_BETA2: gl.constexpr, W: gl.constexpr,
                            MT: gl.constexpr, NWT: gl.constexpr, BN: gl.constexpr, DEC: gl.constexpr,
                            WIDE: gl.constexpr, PDL: gl.constexpr, MMA: gl.constexpr, A4: gl.constexpr,
                            XL: gl.constexpr, DA: gl.constexpr, DB: gl.constexpr, HP: gl.constexpr = 0,
                            GU: gl.constexpr = 0, ZL: gl.constexpr = None, DONE: gl.constexpr = 0):
    """h[pos, rows] = act(W1_e z_t, W3_e z_t) for expert e = pid // NRB's tokens (rows offsets[e] + n of the
    permutation, t = pair // TOPK) and its weight rows (pid % NRB)·M .. +M (module doc). HP > 0: h's columns stored
    in the order the Gluon down kernel with NWT = HP reads them (`_hp_column`). GU 2 (GGU): two K steps an
    iteration, each step's words loaded two steps ahead into the registers the step just used (carried over N tiles:
    the last steps load the next tile's first), z read as int32 words (stride_z in words) one step ahead, the code
    pairs formed by `_z_operand`. DONE (config GDO, with the Gluon down kernel in the same call): a program of an
    expert with tokens counts itself in at done_ptr[e] once its h rows are stored (`_moe_down_gluon`'s overlap)."""
    M: gl.constexpr = 16 * MT * W
    pdl_enter(PDL)          # counts, offsets, pair ids and z come from earlier launches
    e = gl.program_id(0) // NRB
    r0 = (gl.program_id(0) % NRB) * M
    woff, soff = _row_offsets(r0, stride_wn, stride_sn, A4, M, NWT)
    w1r = w1_ptr + e.to(gl.int64) * stride_we + woff
    w3r = w3_ptr + e.to(gl.int64) * stride_we + woff
    s1r = s1_ptr + e.to(gl.int64) * stride_se + soff
    s3r = s3_ptr + e.to(gl.int64) * stride_se + soff
    if GU:
        w1a, w3a, s1a, s3a = _w_step(w1r, w3r, s1r, s3r, 0, NWT)
        w1b, w3b, s1b, s3b = _w_step(w1r, w3r, s1r, s3r, 1, NWT)
    cnt = gl.load(counts_ptr + e)
    pos0 = gl.load(offsets_ptr + e)
    rm = r0 + gl.arange(0, M, layout=gl.SliceLayout(1, MMA))
    rn = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    for n0 in range(0, cnt, BN):
        if GU:
            xr = _z_words(z_ptr, pair_ptr, pos0 + n0, cnt - n0, stride_z, TOPK, ZL, NWT, BN)
            xa = gl.load(xr)
            acc1 = gl.zeros([M, BN], gl.float32, MMA)
            acc3 = gl.zeros([M, BN], gl.float32, MMA)
            for st in range(0, STEPS, 2):
                xb = gl.load(xr + (st + 1) * 16 * NWT)
                acc1, acc3 = _gu_step(acc1, acc3, w1a, w3a, s1a, s3a, xa, DEC, WIDE, M, NWT, BN, A4, ZL, DA, DB)
                w1a, w3a, s1a, s3a = _w_step(w1r, w3r, s1r, s3r, gl.where(st + 2 < STEPS, st + 2, st + 2 - STEPS), NWT)
                xa = gl.load(xr + gl.where(st + 2 < STEPS, st + 2, 0) * 16 * NWT)
                acc1, acc3 = _gu_step(acc1, acc3, w1b, w3b, s1b, s3b, xb, DEC, WIDE, M, NWT, BN, A4, ZL, DA, DB)
                w1b, w3b, s1b, s3b = _w_step(w1r, w3r, s1r, s3r, gl.where(st + 3 < STEPS, st + 3, st + 3 - STEPS), NWT)
        else:
            acc1, acc3 = _tile_dots(z_ptr, pair_ptr, pos0 + n0, cnt - n0, stride_z, w1r, w3r, s1r, s3r, STEPS, TOPK,
                                    M, NWT, BN, DEC, WIDE, MMA, A4, XL, DA, DB)
        h = _glu(acc1, acc3, beta1, beta2, ACT, HAS_BETA2).to(gl.bfloat16)
        col = n0 + rn
        rs = _hp_column(rm, HP) if HP else rm
        out = h_ptr + gl.expand_dims((pos0 + col).to(gl.int64) * stride_h, 0) + gl.expand_dims(rs, 1)
        gl.store(out, h, mask=gl.expand_dims(col < cnt, 0) & gl.expand_dims(rm >= 0, 1))
    if DONE:
        if cnt > 0:
            _barrier()      # every thread's h stores before the release
            gl.atomic_add(done_ptr + e, 1, sem="release", scope="gpu")


def tiles(cfg: dict) -> tuple[int, int, int, int]:
    """(W warps, MT 16-row tiles a warp, NWT words a lane a step, BN token columns): config GGW, GGM, GGN, GGB
    (default _moe_configs.GLUON_T64's); GGD picks the word decode (0 WORD_ASM, 1 WORD_MUL_ASM), GGR a register cap,
    GGU 1 two steps an iteration with the words two steps ahead (where l is a multiple of 64·NWT and z's rows of
    4-byte aligned pairs; module doc)."""
    return int(cfg.get("GGW", 4)), int(cfg.get("GGM", 1)), int(cfg.get("GGN", 4)), int(cfg.get("GGB", 16))


def row_blocks(w1, cfg: dict) -> int:
    """The gate-up's programs an expert (its row blocks of I)."""
    w, mt, _, _ = tiles(cfg)
    return int(w1.shape[1]) // (16 * mt * w)


def fits(ell: int, inter: int, t: tuple) -> bool:
    """The row blocks tile I and the steps tile l (no weight masks), and the tiling is one the layouts allow."""
    w, mt, nwt, bn = t
    return (w in (1, 2, 4, 8) and mt in (1, 2, 4) and nwt in (1, 2, 4) and bn in (8, 16)
            and inter % (16 * mt * w) == 0 and ell % (32 * nwt) == 0)


def _words(w):
    """(int32 words [E, N, K/8], scale bytes) of packed MXFP4 weights, or None (dense, or not 4-byte aligned)."""
    if not isinstance(w, PackedMXFP4) or w.scales.stride(-1) != 1:
        return None
    q = _int32_view(w.packed) if w.packed.stride(-1) == 1 else None
    return None if q is None else (q, w.scales)


def usable(z: torch.Tensor, w1, w3, cfg: dict, split: int) -> bool:
    """GG=1 and: CUDA sm_90+ (never the interpreter), bf16 z with unit column stride, MXFP4 weights readable as
    int32 words with the same strides, unsplit K, a tiling that covers l and I without masks."""
    if not (int(cfg.get("GG") or 0) and split == 1 and z.is_cuda and z.dtype == torch.bfloat16
            and z.stride(-1) == 1 and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(z.device)[0] >= 9):
        return False
    a, b = _words(w1), _words(w3)
    if a is None or b is None or a[0].stride() != b[0].stride() or a[1].stride() != b[1].stride():
        return False
    return fits(z.shape[1], int(w1.shape[1]), tiles(cfg))


def gate_up(z, seg, w1, w3, h, glu: dict, betas: tuple, cfg: dict, hp: int = 0, done=None) -> None:
    """h [T·k, I] (bf16, expert-sorted rows) = act(W1 z, W3 z) by the Gluon kernel (`usable` checked first); hp > 0:
    h's columns in the order the Gluon down kernel with NWT = hp reads them (`_hp_column`); done: int32 counters
    (0, 2 per expert, `_gemv.tile_counters`; the first E here) the programs count in at (DONE)."""
    (q1, s1), (q3, s3) = _words(w1), _words(w3)
    E, inter, ell = int(q1.shape[0]), int(q1.shape[1]), z.shape[1]
    w, mt, nwt, bn = tiles(cfg)
    nrb = row_blocks(w1, cfg)
    gu = 2 if int(cfg.get("GGU", 0)) and ell % (64 * nwt) == 0 and z.stride(0) % 2 == 0 and z.data_ptr() % 4 == 0 else 0
    zz = z.view(torch.int32) if gu else z       # GGU: z's bf16 pairs as int32 words
    _grouped_gate_up_kernel[(E * nrb,)](
        zz, seg.pair_ids, seg.counts, seg.offsets, q1, q3, s1, s3, h, done if done is not None else seg.counts,
        zz.stride(0), q1.stride(0), q1.stride(1),
        s1.stride(0), s1.stride(1), h.stride(0), *betas, nrb, ell // (32 * nwt), TOPK=seg.topk, W=w, MT=mt, NWT=nwt,
        BN=bn, DEC=int(cfg.get("GGD", 0)), WIDE=_wide_scales(s1) or _wide_scales(s3), num_warps=w,
        **({"maxnreg": int(cfg["GGR"])} if cfg.get("GGR") else {}), **glu, **layouts(w, mt, nwt, bn),
        **launch_kwargs(), **({"HP": int(hp)} if hp else {}),
        **({"GU": gu, "ZL": zword_layout(nwt, bn, w)} if gu else {}), DONE=int(done is not None))

