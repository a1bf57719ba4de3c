"""Fused KDA decode as a persistent Gluon kernel (Hopper TMA + mbarriers; config GLUON 1 / 2 of `kda_decode.py`, CUDA
sm_90+ with an fp32 state pool, no kept states): the same op, operands and math as `_kda_decode_kernel` (module
docstring of kda_decode.py), with the gate input f = f_a f_b^T given (the launcher's GEMM before the kernel), or
(RK > 0: GLUON 2 / 3 of kda_decode.py) computed here from f_a [T, r] and f_b [P, r] (16-bit, `lowrank_ok`).

Grid: G programs (one per SM, `grid`), program c takes the (request, head) pairs p = c, c + G, c + 2G, ... (p = r H +
h); GLUON 3's head-aligned grid makes G a multiple of H where that adds no pair to any program (FB_ONCE: every pair of
program c has head c % H).
Each pair's [D, D] fp32 state (64 KB at D = 128) moves as two column halves, [D, D/2] TMA boxes (32 KB) of a
descriptor over the pool viewed as [S H D, D] (unswizzled; int32 row coordinates (slot H + h) D, column 0 or D/2):
items m = 2 i + half of the program's i-th pair, through a ring of NBUF = 6 box buffers (192 KB, one mbarrier each)
NBUF - 1 items ahead. The columns are independent through both passes; only the gated RMSNorm needs the head's D
outputs, so the program walks both halves of its pair. One token: half 0's passes, then the buffer of the item
before it is refilled (`store_wait` for that item's store to have read it) and half 0 goes back by a TMA store; the
same for half 1; then the RMSNorm over both halves' outputs. Other token counts (verification steps, requests
without tokens): both halves' buffers token by token, stored after the last token. The first NBUF - 1 items (with
the slots they need) are loaded before the PDL wait (`_pdl.py`: the state is written only by this layer's
kda_decode, two launches back); activations, conv tails and cu_seqlens are read after it. The metadata (cu_seqlens,
slot) is loaded two pairs ahead, token 0's front inputs (conv windows and taps, f, output gate, beta logit, A_log,
dt_bias) one pair ahead.

Per token: the front (conv with the conv tails, SiLU, L2 norms, gate, beta) in a [D] channel layout, its k, e^g,
e^g k, q scale, v and sigmoid(z) * norm weight written to shared memory once for both halves; then per half the
recurrence from its buffer in [RW, D/2] row chunks (CL: a thread owns one state column, 2 warps across the 64
columns and 2 down the rows, RC = 16 rows of each chunk a thread): pass 1 pred = S^T (e^g k); u = beta (v - pred);
pass 2 S = e^g S + k u^T (written back to the buffer), o = S^T (q scale). Gated RMSNorm, then the new conv tails
(one token: rows 1 .. K-1 of its loaded window; else each row read before it is overwritten). 255 registers, no
spills, 196 KB shared memory (Triton 3.6, sm_90).

The gate in the kernel (RK = r > 0; s16 round 3): the ring is one box shorter (NBUF - 1 = 5: 160 KB) to make room for
the pair's f_b head rows [D, r] (32 KB at r = D = 128), moved by one TMA box of a descriptor over f_b viewed as [r/8, P,
8] into a [r/8, D, 8] buffer (one copy: Triton 3.6 wraps each TMA copy in CTA barriers, so 16 [D, 8] boxes cost 16 more
bar.sync a pair) behind its own mbarrier: the prologue's for pair 0 before the PDL wait (a weight), then each pair's for
the next pair once every thread has read the buffer (after the front's barrier; other token counts: after the pair's
last token); with FB_ONCE (the program's pairs share one head) only the prologue's, waited on (parity 0, completed)
before every pair's gate. f_a's row of token 0 is loaded a pair ahead with the other front inputs and stored (fp32, [r])
to shared memory before the previous pair's last barrier; then f[c] = sum_j f_b[h D + c, j] f_a[j], a thread per channel
c reading its 16-byte rows of the [D, 8] groups (conflict-free) and summing the fp32 products of the bf16 operands in
fp32, 8 ranks at a time, `UN` groups an iteration of a rolled loop (the whole rank unrolled spills: 17-26 local loads /
stores). Verification tokens compute theirs the same way from f_b's buffer. The GEMM's cuBLAS sums in another order: the
two differ by fp32 rounding (benches/bench_kda.py checks both against the kernel given f in float64). sm_90 builds (rank
128, both gates): Triton 3.6 255 registers, 3.7 248-249, no spills, 197 KB shared memory, 5 more bar.sync in the PTX
than the GEMM path's.

H200, session 17 (benches/results/h200-2026-12-01-s17/kda_decode_head_grid.json, the same bench and checks; floor
64.37 us, copy ceiling 69.47): GLUON 3, the gate in the kernel on the head-aligned grid (128 programs of 16 pairs at
B=64 H=32, f_b's head rows loaded once a program instead of 32 KB a pair: 64 MB less moved into shared memory a
step), the default: **80.60** (1.252x; PDL off 85.19; race-check chain 79.31, PDL off 84.54) vs GLUON 2 85.16, GLUON 1
87.81, the Triton kernel 87.64, fla 87.97 (+ its GEMM 91.01), f given 79.04; ragged steps (B=8: 256 pairs, also on
the head grid) and B=64 vs the unfused ops and vs f in float64 as GLUON 2's. A second call
(kda_decode_head_grid_call2.json): 80.93 (1.271x of 63.66) vs GLUON 2 85.83; below 2048 pairs vs the Triton kernel:
B=64 H=12 (768 pairs) 32.76 vs 36.35, B=32 H=32 43.06 vs 46.48.

H200, session 16 (benches/bench_kda.py; B=64 H=32 D=128 one token, bf16 activations, fp32 state, µs per launch in a
graph of launches on distinct pools, the gate GEMM included; every variant vs the unfused ops rel 0.0036 (out) /
0.0018 (state) / 0.00096 (conv tails), vs the Triton kernel <= 1.1e-5, ragged steps with empty and 3-token requests
exact on the untouched rows; PDL race check: 20 graph replays bitwise equal to PDL-off eager):
  - round 3 (kda_decode_gluon_r3.json, the lead's call; floor 64.69, copy ceiling 68.51): the gate in the kernel
    (GLUON 2, UN 8; f_b reloaded each pair), the default until s17: **84.98**
    (1.314x; PDL off 89.10; race-check chain 84.76, PDL off 89.26) vs the
    GEMM and this kernel (GLUON 1) 87.22, the Triton kernel 89.46, fla 89.08 (+ its GEMM 92.16), f given 81.17; vs
    the kernel given f in float64 out 1.6e-5, state 5.9e-8. Removed: UN 4 85.75, UN 16 (the rank unrolled, spills)
    112.8, the GEMM with the 5-box ring 88.25.
  - round 2 (benches/results/h200-2026-11-30-s16/kda_decode_gluon_r2.json; floor 64.69 at 4150 GB/s, state copy
    ceiling 68.54): kept, the column halves in a 6-box ring, 86.91 (PDL off 88.34; race-check chain 88.17, PDL off
    87.56), f given 81.37 (1.258x the floor: the gate GEMM launch costs 5.5 us here), vs the round-1 kernel below
    87.77 and the Triton default 87.43 (PDL off 87.55), fla 87.07 (+ its GEMM 90.71): 1.344x the floor (goal 1.3x
    reached only with f given); a 1 % gain, at the level of the call-to-call spread (the round-1 kernel 86.78 in
    call 2). Removed, slower: the round-1 kernel (whole [D, D] boxes in a 3-buffer ring two pairs ahead, one store
    a pair; 168 registers, 194 KB) 87.77; the halves in a 3-box ring (100 KB) with two programs per SM, 4 warps
    (255 registers) 87.01, 2 warps (one column a thread, 8 spills) 93.55.
  - round 1, call 2 (kda_decode_gluon_call2.json; floor 63.58 at 4222 GB/s, copy ceiling 68.38): the round-1 kernel
    86.78 (PDL off 86.15; race-check chain 85.72), f given 85.75, vs the Triton default 87.85 (87.30) and fla 87.69
    (+ its GEMM 90.89). Its variants, slower: the refill at the pair's end (after its stores) 92.85; 2 stages 88.66;
    4 columns a thread (4 warps down the rows, 16-byte shared loads; 168 registers) 88.67.
  - round 1, call 1 (kda_decode_gluon_call1.json; the metadata and A_log / dt_bias loaded on each pair's critical
    path, the refill at the pair's end): 3 stages 92.02, 2 stages 90.98, 4 columns a thread 98.91, 8 warps (2 down
    the rows, 255 registers) 107.1 vs the default 88.28. B=1 (one pair a program: nothing to overlap) H=12 10.55 vs
    6.26, H=32 11.36 vs 7.06: the heuristic keeps the Triton kernel there.
"""

from __future__ import annotations

import math
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ._pdl import pdl_launch_dependents, pdl_wait

_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.7 / 3.6 name of the CTA barrier


NBUF = 6  # [D, D/2] boxes in the ring (module docstring: 3 boxes with two programs per SM measured slower)
UN = 8  # [D, 8] f_b boxes an iteration of the in-kernel gate's rank loop


def layouts(D: int, warps: int, rc: int, kwp: int = 4) -> dict:
    """CL: [WR * RC, D/2] chunks of a half, one column a thread, WC = D / 64 warps across the columns, WR = warps / WC
    down the rows; WL: token 0's conv windows [KWP, D] (its column slice: the [D] channel vectors); SV: the small
    shared vectors; SS: the ring (unswizzled NVMMA: TMA's box, read row-major by the chunks)."""
    wc = D // 64
    if wc < 1 or warps % wc:
        raise ValueError(f"kda gluon: D={D} and {warps} warps do not tile the state columns of a half")
    return dict(CL=gl.BlockedLayout([rc, 1], [1, 32], [warps // wc, wc], [1, 0]),
                WL=gl.BlockedLayout([kwp, max(1, D // (32 * warps))], [1, 32], [1, warps], [1, 0]),
                SV=gl.SwizzledSharedLayout(1, 1, 1, [0]),
                SS=gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


@gluon.jit
def _sig(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _gate(x, a, lower_bound, GATE: gl.constexpr):
    """`_kda_common.kda_gate_math` in Gluon (x = f + dt_bias, a = exp(A_log[h])): the log decay."""
    if GATE == 1:
        return lower_bound * _sig(a * x)
    else:
        e = gl.exp(-gl.abs(x))
        l1p = gl.where(e < 1e-3, e * (1.0 - e * (0.5 - e / 3.0)), gl.log(1.0 + e))
        return -a * gl.where(x > 20.0, x, gl.maximum(x, 0.0) + l1p)


@gluon.jit
def _ctx(x, s_x, cst, C3, bos, c, ch, KM1: gl.constexpr):
    """Context row c of channels ch (fp32): conv-state row c for c < K - 1, else token c - (K - 1) of the request."""
    xv = gl.load(x + (bos + gl.maximum(c - KM1, 0)) * s_x + ch, mask=(ch >= 0) & (c >= KM1), other=0.0)
    sv = gl.load(cst + gl.minimum(c, KM1 - 1) * C3 + ch, mask=(ch >= 0) & (c < KM1), other=0.0)
    return xv.to(gl.float32) + sv.to(gl.float32)


@gluon.jit
def _conv_silu(x, s_x, cst, C3, w, bos, t, ch, KW: gl.constexpr, VL: gl.constexpr):
    """silu(causal depthwise conv) of token t of the request for channels ch (taps from `w` [P, K])."""
    acc = gl.zeros(ch.shape, gl.float32, VL)
    for j in gl.static_range(KW):
        acc += _ctx(x, s_x, cst, C3, bos, t + j, ch, KW - 1) * gl.load(w + ch * KW + j).to(gl.float32)
    return acc * _sig(acc)


@gluon.jit
def _window(x, s_x, cst, C3, w, bos, ch2, jj, KW: gl.constexpr):
    """Token 0's conv window [KWP, D] (context rows 0 .. K-1: the K-1 conv-state rows, then the token; rows >= K
    zero) and its taps [KWP, D], as loaded (no arithmetic: the loads stay in flight until the front uses them)."""
    on = (ch2 >= 0) & (jj < KW)
    xv = gl.load(x + bos * s_x + ch2 + jj * 0, mask=on & (jj == KW - 1), other=0.0)
    sv = gl.load(cst + gl.minimum(jj, KW - 2) * C3 + ch2, mask=on & (jj < KW - 1), other=0.0)
    return xv, sv, gl.load(w + ch2 * KW + jj, mask=on, other=0.0)


@gluon.jit
def _silu_w(xv, sv, wt):
    acc = gl.sum((xv.to(gl.float32) + sv.to(gl.float32)) * wt.to(gl.float32), axis=0)
    return acc * _sig(acc)


@gluon.jit
def _meta(slots, cu, p, NP, H: gl.constexpr):
    """Pair p's (clamped to NP - 1) head, first token row, token count and state slot."""
    pc = gl.minimum(p, NP - 1)
    r = pc // H
    bos = gl.load(cu + r).to(gl.int64)
    return pc % H, bos, gl.load(cu + r + 1).to(gl.int64) - bos, gl.load(slots + r).to(gl.int64)


@gluon.jit
def _prefetch(q, k, v, s_q, s_k, s_v, qw, kw, vw, cstate, f, s_f, alog, dtb, bl, s_bl, gate, s_gt, h, bos, slot,
              H: gl.constexpr, D: gl.constexpr, KW: gl.constexpr, KWP: gl.constexpr, HAS_BIAS: gl.constexpr,
              WL: gl.constexpr, RK: gl.constexpr, FA: gl.constexpr):
    """Token 0's front inputs of the pair (h, bos, slot: `_meta`, loaded a pair earlier), issued now and used a pair
    later: the conv windows and taps, f (RK > 0: the gate's low-rank input row f_a[bos] instead), the output gate,
    the beta logit, A_log[h] and dt_bias."""
    P: gl.constexpr = H * D
    C3: gl.constexpr = 3 * H * D
    cst = cstate + slot * ((KW - 1) * C3)
    ch = h * D + gl.arange(0, D, layout=gl.SliceLayout(0, WL))
    ch2 = gl.expand_dims(ch, 0)
    jj = gl.expand_dims(gl.arange(0, KWP, layout=gl.SliceLayout(1, WL)), 1)
    qx, qs, qt = _window(q, s_q, cst, C3, qw, bos, ch2, jj, KW)
    kx, ks, kt = _window(k, s_k, cst + P, C3, kw, bos, ch2, jj, KW)
    vx, vs, vt = _window(v, s_v, cst + 2 * P, C3, vw, bos, ch2, jj, KW)
    if HAS_BIAS:
        bias = gl.load(dtb + ch)
    else:
        bias = gl.zeros([D], gl.float32, gl.SliceLayout(0, WL))
    if RK > 0:
        fx = gl.load(f + bos * s_f + gl.arange(0, RK, layout=FA))
    else:
        fx = gl.load(f + bos * s_f + ch)
    return (qx, qs, qt, kx, ks, kt, vx, vs, vt, fx, gl.load(gate + bos * s_gt + ch),
            gl.load(bl + bos * s_bl + h), gl.load(alog + h), bias)


@gluon.jit
def _fb_load(fb_desc, fbuf, fbar, h, ok, D: gl.constexpr, RK: gl.constexpr):
    """The head's gate up-projection rows f_b[h D : (h + 1) D, :] into `fbuf` [RK / 8, D, 8] by one TMA box of the
    descriptor over f_b viewed as [RK / 8, P, 8] (rank groups of 8 outermost: a warp's 32 rows of one group are 512
    contiguous bytes, read without bank conflicts; one copy: Triton 3.6 puts a CTA barrier around each)."""
    mbarrier.expect(fbar, D * RK * 2, pred=ok)
    tma.async_copy_global_to_shared(fb_desc, [0, (h * D).to(gl.int32), 0], fbar, fbuf, pred=ok)


@gluon.jit
def _lowrank_f(fbuf, fas, D: gl.constexpr, RK: gl.constexpr, FL: gl.constexpr, VW: gl.constexpr, UN: gl.constexpr,
               FS2: gl.constexpr):
    """f[c] = sum_j f_b[h D + c, j] f_a[j] (fp32 products of the bf16 operands, summed in fp32 8 ranks at a time; f_a
    from fas [RK / 8, 8]): a thread per channel c, its [D, 8] box rows, into the channel layout; UN boxes an
    iteration (a short loop: fewer registers than the whole rank unrolled)."""
    acc = gl.zeros([D], gl.float32, gl.SliceLayout(1, FL))
    fa8 = fas._reinterpret(gl.float32, [RK // 8, 8], fas.layout)
    fb8 = fbuf._reinterpret(fbuf.dtype, [RK // 8, D, 8], FS2)
    for b0 in range(0, RK // 8, UN):
        for u in gl.static_range(UN):
            fa = fa8.index(b0 + u).load(gl.SliceLayout(0, FL))
            acc += gl.sum(fb8.index(b0 + u).load(FL).to(gl.float32) * gl.expand_dims(fa, 0), axis=1)
    return gl.convert_layout(acc, VW)


@gluon.jit
def _l2n(x, eps):
    return x / gl.sqrt(gl.sum(x * x, axis=0) + eps)


@gluon.jit
def _state_row(slots, p, NP, H: gl.constexpr, D: gl.constexpr):
    pc = gl.minimum(p, NP - 1)
    return ((gl.load(slots + pc // H) * H + pc % H) * D).to(gl.int32)


@gluon.jit
def _tails(q, k, v, s_q, s_k, s_v, cst, C3, bos, n, ch, P: gl.constexpr, KM1: gl.constexpr):
    """The new conv tails after n tokens (context rows n .. n + K - 2; each row read before it is overwritten)."""
    for m in gl.static_range(KM1):
        tq = _ctx(q, s_q, cst, C3, bos, n + m, ch, KM1)
        tk = _ctx(k, s_k, cst + P, C3, bos, n + m, ch, KM1)
        tv = _ctx(v, s_v, cst + 2 * P, C3, bos, n + m, ch, KM1)
        gl.store(cst + m * C3 + ch, tq.to(cst.dtype.element_ty))
        gl.store(cst + P + m * C3 + ch, tk.to(cst.dtype.element_ty))
        gl.store(cst + 2 * P + m * C3 + ch, tv.to(cst.dtype.element_ty))


@gluon.jit
def _front(vecs, xq, xk, xv, zg, fx, a_h, bias, scale, lower_bound, l2_eps, GATE: gl.constexpr, D: gl.constexpr):
    """One token's k, e^g, e^g k, q scale, v and output gate factor to shared memory (both halves read them)."""
    qn = _l2n(xq, l2_eps) * scale
    kn = _l2n(xk, l2_eps)
    eg = gl.exp(_gate(fx.to(gl.float32) + bias, a_h, lower_bound, GATE))
    vecs.slice(0, D).store(kn)
    vecs.slice(D, D).store(eg)
    vecs.slice(2 * D, D).store(eg * kn)
    vecs.slice(3 * D, D).store(qn)
    vecs.slice(4 * D, D).store(xv)
    vecs.slice(5 * D, D).store(zg)
    _barrier()


@gluon.jit
def _passes(buf, vecs, beta, HF: gl.constexpr, RW: gl.constexpr, D: gl.constexpr, DC: gl.constexpr,
            CL: gl.constexpr):
    """Both passes on the half's [D, DC] buffer: u = beta (v - S^T (e^g k)); S = e^g S + k u^T; returns S^T q."""
    RV: gl.constexpr = gl.SliceLayout(1, CL)
    acc = gl.zeros([RW, DC], gl.float32, CL)
    for c in gl.static_range(D // RW):
        gk = vecs.slice(2 * D + c * RW, RW).load(RV)
        acc += buf.slice(c * RW, RW, dim=0).load(CL) * gl.expand_dims(gk, 1)
    u = beta * (vecs.slice(4 * D + HF * DC, DC).load(gl.SliceLayout(0, CL)) - gl.sum(acc, axis=0))
    acc = gl.zeros([RW, DC], gl.float32, CL)
    u2 = gl.expand_dims(u, 0)
    for c in gl.static_range(D // RW):
        kk = gl.expand_dims(vecs.slice(c * RW, RW).load(RV), 1)
        eg = gl.expand_dims(vecs.slice(D + c * RW, RW).load(RV), 1)
        qq = gl.expand_dims(vecs.slice(3 * D + c * RW, RW).load(RV), 1)
        blk = buf.slice(c * RW, RW, dim=0)
        s = blk.load(CL) * eg + kk * u2
        blk.store(s)
        acc += s * qq
    return gl.sum(acc, axis=0)


@gluon.jit
def _refill(desc, ring, bars, slots, pid, G, NP, m, H: gl.constexpr, D: gl.constexpr, DC: gl.constexpr,
            NBUF: gl.constexpr):
    """Item m - 1 + NBUF into the buffer of item m - 1 once that buffer's store has read it (nothing past the
    program's pairs)."""
    nm = m - 1 + NBUF
    p = pid + (nm // 2) * G
    row = _state_row(slots, p, NP, H, D)
    tma.store_wait(0)
    b = nm % NBUF
    ok = p < NP
    mbarrier.expect(bars.index(b), D * DC * 4, pred=ok)
    tma.async_copy_global_to_shared(desc, [row, (nm % 2) * DC], bars.index(b), ring.index(b), pred=ok)


@gluon.jit
def _wait(bars, m, NBUF: gl.constexpr):
    mbarrier.wait(bars.index(m % NBUF), (m // NBUF) & 1)


@gluon.jit
def _out(vecs, o0, o1, out, orow, h, norm_eps, D: gl.constexpr, DC: gl.constexpr, P: gl.constexpr,
         CL: gl.constexpr):
    """Gated RMSNorm over the two halves' outputs, stored; then a barrier (vecs free for the next token)."""
    CV: gl.constexpr = gl.SliceLayout(0, CL)
    rs = 1.0 / gl.sqrt((gl.sum(o0 * o0, axis=0) + gl.sum(o1 * o1, axis=0)) / D + norm_eps)
    cols = h * D + gl.arange(0, DC, layout=CV)
    y0 = o0 * rs * vecs.slice(5 * D, DC).load(CV)
    y1 = o1 * rs * vecs.slice(5 * D + DC, DC).load(CV)
    gl.store(out + orow * P + cols, y0.to(out.dtype.element_ty))
    gl.store(out + orow * P + DC + cols, y1.to(out.dtype.element_ty))
    _barrier()


@gluon.jit
def _kda_decode_gluon_kernel(q, k, v, s_q, s_k, s_v, qw, kw, vw, cstate, f, s_f, fb_desc, alog, dtb, bl, s_bl, desc,
                             gate, s_gt, onw, out, slots, cu, NP, scale, lower_bound, l2_eps, norm_eps,
                             H: gl.constexpr, D: gl.constexpr, KW: gl.constexpr, KWP: gl.constexpr,
                             GATE: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_NW: gl.constexpr,
                             NBUF: gl.constexpr, RW: gl.constexpr, PDL: gl.constexpr, CL: gl.constexpr,
                             WL: gl.constexpr, SV: gl.constexpr, SS: gl.constexpr, RK: gl.constexpr,
                             FA: gl.constexpr, FL: gl.constexpr, FS: gl.constexpr,
                             FS2: gl.constexpr, FAS: gl.constexpr, UN: gl.constexpr, FB_ONCE: gl.constexpr):
    P: gl.constexpr = H * D
    C3: gl.constexpr = 3 * H * D
    KM1: gl.constexpr = KW - 1
    DC: gl.constexpr = D // 2
    VW: gl.constexpr = gl.SliceLayout(0, WL)
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.float32, [NBUF, D, DC], SS)
    bars = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    vecs = gl.allocate_shared_memory(gl.float32, [8 * D], SV)  # 6 vectors used (a power of 2)
    for st in gl.static_range(NBUF):
        mbarrier.init(bars.index(st), count=1)
    if RK > 0:  # the in-kernel gate: the pair's f_b rows (a weight: loaded before the PDL wait), a pair ahead
        fbuf = gl.allocate_shared_memory(fb_desc.dtype, [RK // 8, D, 8], FS)
        fbar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(fbar.index(0), count=1)
        fas = gl.allocate_shared_memory(gl.float32, [RK], FAS)
    fence_async_shared()
    _barrier()
    for it in gl.static_range(NBUF - 1):  # the first NBUF - 1 items before the grid-dependency wait
        p0 = pid + (it // 2) * G
        mbarrier.expect(bars.index(it), D * DC * 4, pred=p0 < NP)
        tma.async_copy_global_to_shared(desc, [_state_row(slots, p0, NP, H, D), (it % 2) * DC], bars.index(it),
                                   ring.index(it), pred=p0 < NP)
    if RK > 0:
        _fb_load(fb_desc, fbuf, fbar.index(0), pid % H, pid < NP, D, RK)
    dd = gl.arange(0, D, layout=VW)
    if HAS_NW:
        nw = gl.load(onw + dd).to(gl.float32)
    else:
        nw = gl.full([D], 1.0, gl.float32, VW)
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    h, bos, n, slot = _meta(slots, cu, pid, NP, H)
    h1, bos1, n1, slot1 = _meta(slots, cu, pid + G, NP, H)
    qx, qs, qt, kx, ks, kt, vx, vs, vt, fx, z, bt, al, bias = _prefetch(
        q, k, v, s_q, s_k, s_v, qw, kw, vw, cstate, f, s_f, alog, dtb, bl, s_bl, gate, s_gt, h, bos, slot, H, D, KW,
        KWP, HAS_BIAS, WL, RK, FA)
    if RK > 0:  # f_a's row of the pair's token 0 in `fas` (stored a pair ahead, before a barrier)
        fas.store(fx.to(gl.float32))
        _barrier()
    for i in range(gl.cdiv(NP - pid, G)):
        m = 2 * i
        h2, bos2, n2, slot2 = _meta(slots, cu, pid + (i + 2) * G, NP, H)
        qx1, qs1, qt1, kx1, ks1, kt1, vx1, vs1, vt1, fx1, z1, bt1, al1, bias1 = _prefetch(
            q, k, v, s_q, s_k, s_v, qw, kw, vw, cstate, f, s_f, alog, dtb, bl, s_bl, gate, s_gt, h1, bos1, slot1, H, D,
            KW, KWP, HAS_BIAS, WL, RK, FA)
        cst = cstate + slot * (KM1 * C3)
        ch = h * D + dd
        a_h = gl.exp(al.to(gl.float32))
        bias_v = bias.to(gl.float32)
        srow = ((slot * H + h) * D).to(gl.int32)
        if n == 1:
            if RK > 0:
                mbarrier.wait(fbar.index(0), 0 if FB_ONCE else i & 1)
                f0 = _lowrank_f(fbuf, fas, D, RK, FL, VW, UN, FS2)
            else:
                f0 = fx
            _front(vecs, _silu_w(qx, qs, qt), _silu_w(kx, ks, kt), _silu_w(vx, vs, vt), _sig(z.to(gl.float32)) * nw,
                   f0, a_h, bias_v, scale, lower_bound, l2_eps, GATE, D)
            if RK > 0 and not FB_ONCE:  # fbuf read by every thread (the front's barrier): the next pair's rows
                _fb_load(fb_desc, fbuf, fbar.index(0), h1, pid + (i + 1) * G < NP, D, RK)
            beta = _sig(bt.to(gl.float32))
            _wait(bars, m, NBUF)
            o0 = _passes(ring.index(m % NBUF), vecs, beta, 0, RW, D, DC, CL)
            fence_async_shared()
            _barrier()
            _refill(desc, ring, bars, slots, pid, G, NP, m, H, D, DC, NBUF)
            tma.async_copy_shared_to_global(desc, [srow, 0], ring.index(m % NBUF))
            _wait(bars, m + 1, NBUF)
            o1 = _passes(ring.index((m + 1) % NBUF), vecs, beta, 1, RW, D, DC, CL)
            fence_async_shared()
            _barrier()
            _refill(desc, ring, bars, slots, pid, G, NP, m + 1, H, D, DC, NBUF)
            tma.async_copy_shared_to_global(desc, [srow, DC], ring.index((m + 1) % NBUF))
            if RK > 0:  # the next pair's f_a row (this pair's was read before the front's barrier)
                fas.store(fx1.to(gl.float32))
            _out(vecs, o0, o1, out, bos, h, norm_eps, D, DC, P, CL)
            ch2 = gl.expand_dims(h * D + gl.arange(0, D, layout=VW), 0)
            jj = gl.expand_dims(gl.arange(0, KWP, layout=gl.SliceLayout(1, WL)), 1)
            tp = cst + (jj - 1) * C3 + ch2
            tm = (jj >= 1) & (jj < KW) & (ch2 >= 0)
            CT: gl.constexpr = cstate.dtype.element_ty
            gl.store(tp, (qx.to(gl.float32) + qs.to(gl.float32)).to(CT), mask=tm)
            gl.store(tp + P, (kx.to(gl.float32) + ks.to(gl.float32)).to(CT), mask=tm)
            gl.store(tp + 2 * P, (vx.to(gl.float32) + vs.to(gl.float32)).to(CT), mask=tm)
        else:  # no token or verification steps: the whole pair on both buffers, token by token
            _refill(desc, ring, bars, slots, pid, G, NP, m, H, D, DC, NBUF)
            _wait(bars, m, NBUF)
            _wait(bars, m + 1, NBUF)
            if RK > 0:
                mbarrier.wait(fbar.index(0), 0 if FB_ONCE else i & 1)
            for t in range(n):
                row = bos + t
                if RK > 0:  # token t's f_a row into `fas` (token t - 1's read before its front's barrier)
                    fas.store(gl.load(f + row * s_f + gl.arange(0, RK, layout=FA)).to(gl.float32))
                    _barrier()
                    ft = _lowrank_f(fbuf, fas, D, RK, FL, VW, UN, FS2)
                else:
                    ft = gl.load(f + row * s_f + ch)
                _front(vecs, _conv_silu(q, s_q, cst, C3, qw, bos, t, ch, KW, VW),
                       _conv_silu(k, s_k, cst + P, C3, kw, bos, t, ch, KW, VW),
                       _conv_silu(v, s_v, cst + 2 * P, C3, vw, bos, t, ch, KW, VW),
                       _sig(gl.load(gate + row * s_gt + ch).to(gl.float32)) * nw, ft, a_h,
                       bias_v, scale, lower_bound, l2_eps, GATE, D)
                beta = _sig(gl.load(bl + row * s_bl + h).to(gl.float32))
                o0 = _passes(ring.index(m % NBUF), vecs, beta, 0, RW, D, DC, CL)
                o1 = _passes(ring.index((m + 1) % NBUF), vecs, beta, 1, RW, D, DC, CL)
                _out(vecs, o0, o1, out, row, h, norm_eps, D, DC, P, CL)
            _tails(q, k, v, s_q, s_k, s_v, cst, C3, bos, n, ch, P, KM1)
            if RK > 0:  # the next pair's f_a row; its f_b rows once every thread has passed the barrier below
                fas.store(fx1.to(gl.float32))
            fence_async_shared()
            _barrier()
            if RK > 0 and not FB_ONCE:
                _fb_load(fb_desc, fbuf, fbar.index(0), h1, pid + (i + 1) * G < NP, D, RK)
            tma.async_copy_shared_to_global(desc, [srow, 0], ring.index(m % NBUF))
            tma.async_copy_shared_to_global(desc, [srow, DC], ring.index((m + 1) % NBUF))
            _refill(desc, ring, bars, slots, pid, G, NP, m + 1, H, D, DC, NBUF)
        h, bos, n, slot, h1, bos1, n1, slot1 = h1, bos1, n1, slot1, h2, bos2, n2, slot2
        qx, qs, qt, kx, ks, kt, vx, vs, vt, fx, z, bt, al, bias = \
            qx1, qs1, qt1, kx1, ks1, kt1, vx1, vs1, vt1, fx1, z1, bt1, al1, bias1
    tma.store_wait(0)
    for st in gl.static_range(NBUF):
        mbarrier.invalidate(bars.index(st))
    if RK > 0:
        mbarrier.invalidate(fbar.index(0))


_SMS: dict = {}


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 132  # an AOT recording (CPU tensors stand in): the H200's
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def rows_fit(S: int, H: int, D: int) -> bool:
    """The pool's rows as [S H D, D] stay within TMA's int32 coordinates."""
    return S * H * D < 2 ** 31


def usable(state: torch.Tensor, keep_states: bool) -> bool:
    """The Gluon path runs: the device Triton compiles for is CUDA sm_90+ (never the interpreter), an fp32 state pool
    whose NBUF [D, D/2] buffers fit in shared memory (D >= 64: halves of whole warps) and whose rows `rows_fit`, no
    kept per-token states."""
    D = state.shape[-1]
    if keep_states or state.dtype != torch.float32 or D < 64 or NBUF * D * (D // 2) * 4 > 200 * 1024 or \
            not rows_fit(state.shape[0], state.shape[1], D) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        target = triton.runtime.driver.active.get_current_target()
    except RuntimeError:  # no GPU driver
        return False
    return target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90


def lowrank_ok(f_b, D: int) -> bool:
    """The in-kernel gate takes f_b [P, r] (16-bit, contiguous, 16-byte aligned, r a multiple of 8 up to 2 D) whose
    head rows [D, r] fit in shared memory beside the NBUF - 1 box ring."""
    if f_b is None or f_b.dtype not in (torch.bfloat16, torch.float16) or f_b.dim() != 2 or not f_b.is_contiguous():
        return False
    rk = f_b.shape[1]
    return rk % 8 == 0 and 8 <= rk <= 2 * D and f_b.data_ptr() % 16 == 0 and \
        (NBUF - 1) * D * (D // 2) * 4 + D * rk * 2 <= 200 * 1024


def grid(NP: int, H: int, sms: int, head_grid: bool) -> tuple[int, bool]:
    """(programs, every program's pairs share one head). One program per SM, at most NP; with `head_grid` the largest
    multiple of H below that where it takes no more pairs a program (ceil(NP / G) unchanged: B=64 H=32 on 132 SMs,
    128 programs of 16 pairs): program c's pairs c + i G then all have head c % H, so the in-kernel gate loads f_b's
    head rows once, before the loop, instead of 32 KB a pair."""
    g = min(NP, sms)
    if NP <= g:
        return g, True
    gh = (g // H) * H
    if head_grid and gh > 0 and -(-NP // gh) == -(-NP // g):
        return gh, True
    return g, g % H == 0


def launch(q, k, v, convs, conv_state, f, A_log, dt_bias, b, state, gate, o_norm_w, out, state_slot, cu_seqlens,
           *, scale, lower_bound, l2_eps, norm_eps, warps=4, rc=16, launch_kw, f_b=None, head_grid=False):
    """One launch over all (request, head) pairs (q, k, v, f, b, gate: row views; f the whole gate input [T, P], or
    with f_b ([P, r], `lowrank_ok`) f_a [T, r]: the gate computed in the kernel, the ring one box shorter;
    `head_grid`: `grid`'s head-aligned program count, f_b's rows loaded once a program)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    S, H, D = state.shape[0], state.shape[1], state.shape[-1]
    NP = state_slot.numel() * H
    KW = convs[0].shape[-1]
    lay = layouts(D, warps, rc, triton.next_power_of_2(KW))
    desc = TensorDescriptor.from_tensor(state.view(S * H * D, D), [D, D // 2], lay["SS"])
    rk = f_b.shape[1] if f_b is not None else 0
    nbuf = NBUF - 1 if f_b is not None else NBUF
    fs = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
    fb_desc = TensorDescriptor(f_b, [rk // 8, f_b.shape[0], 8], [8, rk, 1], [rk // 8, D, 8], fs) if rk else desc
    G, fb_once = grid(NP, H, _sm_count(q.device), head_grid)
    _kda_decode_gluon_kernel[(G,)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), *convs, conv_state, f, f.stride(0), fb_desc, A_log,
        dt_bias if dt_bias is not None else A_log, b, b.stride(0), desc, gate, gate.stride(0),
        o_norm_w if o_norm_w is not None else A_log, out, state_slot, cu_seqlens, NP, float(scale),
        float(lower_bound) if lower_bound is not None else 0.0, float(l2_eps), float(norm_eps),
        H=H, D=D, KW=KW, KWP=triton.next_power_of_2(KW), GATE=1 if lower_bound is not None else 2,
        HAS_BIAS=dt_bias is not None, HAS_NW=o_norm_w is not None, NBUF=nbuf, RW=rc * (warps // (D // 64)),
        num_warps=warps, RK=rk, FA=gl.BlockedLayout([1], [32], [warps], [0]),
        FAS=gl.SwizzledSharedLayout(1, 1, 1, [0]), UN=max(1, math.gcd(UN, rk // 8)),
        FL=gl.BlockedLayout([1, 8], [32, 1], [warps, 1], [1, 0]), FS=fs,
        FS2=gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2), FB_ONCE=fb_once and rk > 0,
        **lay, **launch_kw)
