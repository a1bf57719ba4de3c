"""Fused KDA decode / verification step in one kernel: conv-state update + causal conv + SiLU + L2 norm
of q, k + forget gate (its low-rank up-projection included) + beta sigmoid + delta-rule recurrence +
gated RMSNorm, 1-8 tokens per request (any count works), optionally keeping the per-token states that
speculative verification rolls back to.

Implements `fused.kda_decode` exactly as `passes/kda_decode_fusion.py` creates it from one KDA layer
(`k31c/model/build.py::_ModelWriter._kda`, SPEC §3 steps 2-7 between the projections). Operands, in
order (`a.operands`):
    0-2  q, k, v [T, P]               projections before the conv (P = H*D; row strides free)
    3-5  q_conv, k_conv, v_conv [P, K] depthwise conv weights (tap K-1 = current token)
    6    conv_state [S, K-1, 3P]      conv tails (q | k | v channels), updated in place
    7-8  f_a [T, r], f_b [P, r]       forget gate f = f_a f_b^T (low rank r)
    9-10 A_log [H], dt_bias [P] (or None)
    11   b [T, H]                     beta logits (sigmoid applied here)
    12   state [S, H, D, D]           KDA state pool (fp32 or bf16), updated in place
    13   gate [T, P]                  output-gate projection (sigmoid applied here)
    14   o_norm_w [D] (or None)
    15-16 state_slot [R] (distinct), cu_seqlens [R+1]
Attrs: heads, head_dim, scale, lower_bound (None: Kimi-Linear softplus gate), l2_eps, norm_eps, and
keep_states (default False). Results: (out [T, P], conv_state, state); with keep_states also states
[T, H, D, D] fp32 (state after each token) and conv_states [T, K-1, 3P] (conv tail after each token).
Per token and head: S' = diag(e^g) S; S = S' + beta k (v - S'^T k)^T; o = S^T (q*scale);
out = rmsnorm(o) * o_norm_w * sigmoid(gate).

Programs: (request, head, column split). Each computes its tokens' front (conv, L2, gate, beta) for
groups of MAXT tokens at once as [MAXT, D] tiles (MAXT = min(8, pow2(T/R)): 1 in decode, 8 in 8-token
verification; f_a f_b^T as 16-row tensor-core dots over RB rank columns at a time, with GEMV (one token) as
f_c = sum_j f_b[c, j] f_a[j] over [D, RB] tiles, or with GATE_MM one GEMM before the kernel), then walks
its D/SPLIT state columns in [D, BV] blocks (independent; with PREFETCH the next block's load is issued
before the current block's update; one token's k, q and decay broadcasts over the block's columns are made
once, before the walk), so the state is read and written once per step. Every other load (the
v conv inputs, the output gate, o_norm_w, the new conv tails) is issued before the recurrence, so no load
waits at the end. SPLIT > 1 (small batches) shares a head's columns among SPLIT programs: each stores its
slice of o (fp32 workspace) and counts itself on a per-(request, head) atomic counter (acq_rel); the last
to arrive applies the gated RMSNorm over the head's D outputs, writes the q/k conv tails (all programs have
read them by then) and resets the counter. Per-token states: every program. MAXNREG caps the registers.

PDL (`_pdl.py`): A_log and o_norm_w are loaded before the grid-dependency wait. With EARLY (one [D, BV] block
per program; small batches) so are the other weights (conv taps, dt_bias, f_b when the rank fits one RB block),
the step metadata and the program's state block: neither of the last two is written by the kernel launched
right before this one (the metadata comes first in the step; the state pool is written only by this layer's
kda_decode, and restored / rolled back by copies before a step), and a PDL kernel's programs start only once
every program of the previous kernel has passed its own wait, i.e. after the kernel two launches back has
completed. Activations, conv tails and split counters / partials are read after the wait. benches/bench_kda.py
checks this: graph replays of a chain reading the state written two launches back equal PDL-off eager runs.

GLUON (CUDA sm_90+, fp32 pool, no kept states; the heuristic's choice for one-token steps from 768 (request, head)
pairs): the persistent Gluon kernel of `_kda_decode_gluon.py` instead (one program per SM looping over the pairs,
the states streamed as [D, D/2] column halves through a 6-box shared-memory ring by TMA), the gate GEMM before it
(GLUON 1); GLUON 2 computes the gate in it, GLUON 3 (the default there) too, on a grid of programs that each keep
one head (`_kda_decode_gluon.grid`; `_GLUON_VARIANTS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel import KernelTemplate, Tunable, pow2_bucket
from ._kda_common import (FUSED_OP, OPERANDS, _conv_silu, _conv_silu_w, _conv_weights, _counters, _gate_gemm,
                          _gated_rms_store, _put_tail, _row, _rows, _tail, fused_operands, kda_gate_math,
                          supports)
from codegen.triton import _kda_decode_gluon as _glu, _precision as precision
from codegen.triton._pdl import launch_kwargs, pdl_enter


@triton.jit
def _kda_decode_kernel(q, k, v, s_q, s_k, s_v, qw, kw, vw, cstate, fa, s_fa, fb, alog, dtb, bl, s_bl, st, gate,
                       s_gt, onw, out, slots, cu, st_keep, cs_keep, ows, ctr, scale, lower_bound, l2_eps, norm_eps,
                       H: tl.constexpr, D: tl.constexpr, KW: tl.constexpr, KWP: tl.constexpr, RL: tl.constexpr,
                       RB: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr, GATE: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_NW: tl.constexpr, KEEP: tl.constexpr, LOWRANK: tl.constexpr,
                       MAXT: tl.constexpr, PREFETCH: tl.constexpr, PREC: tl.constexpr, GEMV: tl.constexpr,
                       EARLY: tl.constexpr, PDL: tl.constexpr):
    r, h, vs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    P: tl.constexpr = H * D
    C3: tl.constexpr = 3 * H * D
    DVP: tl.constexpr = D // SPLIT  # state columns of this program
    NV: tl.constexpr = DVP // BV
    FB1: tl.constexpr = EARLY and LOWRANK and RL <= RB  # the whole rank in one block: f_b's tile before the wait
    c0 = vs * DVP
    offs = tl.arange(0, D)[:, None] * D + tl.arange(0, BV)[None, :]  # one [D, BV] state block's element offsets
    dd = tl.arange(0, D)
    tt = tl.arange(0, MAXT)
    ch = h * D + dd
    cvp = h * D + c0 + tl.arange(0, DVP)  # this program's v / output channels
    tg = tl.arange(0, 16)
    # ---- weights (never written while steps run): issued before the grid-dependency wait (PDL); without
    # EARLY (many programs per SM: fewer live registers) the conv taps and f_b are loaded where they are used
    a_h = tl.exp(tl.load(alog + h).to(tl.float32))
    if HAS_NW:
        nw = tl.load(onw + dd).to(tl.float32)
    else:
        nw = tl.full([D], 1.0, tl.float32)
    if EARLY:
        wq, wk, wv = _conv_weights(qw, ch, KW, KWP), _conv_weights(kw, ch, KW, KWP), _conv_weights(vw, cvp, KW, KWP)
        if HAS_BIAS:
            bias = tl.load(dtb + ch).to(tl.float32)
        else:
            bias = tl.zeros([D], dtype=tl.float32)
    jr = tl.arange(0, RB)
    if FB1 and GEMV and MAXT == 1:  # [D, RB] for the dot-free one-token gate
        fb1 = tl.load(fb + ch[:, None] * RL + jr[None, :], mask=(jr < RL)[None, :], other=0.0)
    elif FB1:                       # [RB, D] for the tensor-core dots
        fb1 = tl.load(fb + ch[None, :] * RL + jr[:, None], mask=(jr < RL)[:, None], other=0.0)
    else:
        fb1 = tl.zeros([16, 16], dtype=tl.float32)  # unused
    # ---- EARLY: the step metadata and this program's state block before the wait too (module docstring: why)
    if EARLY:
        bos = tl.load(cu + r).to(tl.int64)
        n = tl.load(cu + r + 1).to(tl.int64) - bos
        slot = tl.load(slots + r).to(tl.int64)
        st_h = st + (slot * H + h) * D * D
        sp0 = st_h + c0 + offs
        s_next = tl.load(sp0, eviction_policy="evict_first")
        pdl_enter(PDL)
    else:
        pdl_enter(PDL)
        bos = tl.load(cu + r).to(tl.int64)
        n = tl.load(cu + r + 1).to(tl.int64) - bos
        slot = tl.load(slots + r).to(tl.int64)
        st_h = st + (slot * H + h) * D * D
        sp0 = st_h + c0 + offs
    cst = cstate + slot * (KW - 1) * C3
    # the new conv tails (last K-1 context rows) are loaded up front, so the kernel's end waits on no load;
    # they are stored at the end, after every read of the old tails (all programs of the head read q/k)
    tv = _tail(v, s_v, cst + 2 * P, C3, bos, n + 1 - KW, cvp, KW, KWP)
    tq = _tail(q, s_q, cst, C3, bos, n + 1 - KW, ch, KW, KWP)
    tk = _tail(k, s_k, cst + P, C3, bos, n + 1 - KW, ch, KW, KWP)
    for t0 in range(0, n, MAXT):  # token groups of MAXT (a power of two <= 16; verification: 1-8)
        nt = n - t0
        rows = bos + t0 + tt
        rm = (tt < nt)[:, None]
        if PREFETCH and not EARLY:  # the first state block, issued before the front so its latency hides behind it
            s_next = tl.load(sp0, eviction_policy="evict_first")
        # token-parallel front: conv + SiLU + L2 of q, k; gate from f_a f_b^T; beta  -> [MAXT, D] tiles
        if EARLY:
            xq = _conv_silu_w(q, s_q, cst, C3, wq, bos, t0, nt, ch, KW, MAXT)
            xk = _conv_silu_w(k, s_k, cst + P, C3, wk, bos, t0, nt, ch, KW, MAXT)
        else:
            xq = _conv_silu(q, s_q, cst, C3, qw, bos, t0, nt, ch, KW, MAXT)
            xk = _conv_silu(k, s_k, cst + P, C3, kw, bos, t0, nt, ch, KW, MAXT)
        qn = xq / tl.sqrt(tl.sum(xq * xq, axis=1) + l2_eps)[:, None] * scale
        kn = xk / tl.sqrt(tl.sum(xk * xk, axis=1) + l2_eps)[:, None]
        if LOWRANK and GEMV and MAXT == 1:  # one token: f = f_b f_a, dot-free (no staging through shared memory)
            f1 = tl.zeros([D], dtype=tl.float32)
            for jb in tl.static_range(0, RL, RB):
                jj = jb + jr
                fa_v = tl.load(fa + (bos + t0) * s_fa + jj, mask=jj < RL, other=0.0).to(tl.float32)
                if FB1:
                    fb_t = fb1
                else:
                    fb_t = tl.load(fb + ch[:, None] * RL + jj[None, :], mask=(jj < RL)[None, :], other=0.0,
                                   eviction_policy="evict_last")
                f1 += tl.sum(fb_t.to(tl.float32) * fa_v[None, :], axis=1)
            fx = f1[None, :]
        elif LOWRANK:
            fx = tl.zeros([16, D], dtype=tl.float32)  # f_a f_b^T on tensor cores (16 rows, >= MAXT used)
            for jb in tl.static_range(0, RL, RB):
                jj = jb + jr
                fm = ((tg < nt) & (tg < MAXT))[:, None] & (jj < RL)[None, :]
                fa_t = tl.load(fa + (bos + t0 + tg)[:, None] * s_fa + jj[None, :], mask=fm, other=0.0)
                if FB1:
                    fb_t = fb1
                else:
                    fb_t = tl.load(fb + ch[None, :] * RL + jj[:, None], mask=(jj < RL)[:, None], other=0.0,
                                   eviction_policy="evict_last")
                fx = tl.dot(fa_t.to(fb_t.dtype), fb_t, fx, input_precision=PREC)
            fx = tl.sum(tl.reshape(fx, [16 // MAXT, MAXT, D]), axis=0)  # rows >= MAXT are zero
        else:  # f given whole [T, P]
            fx = tl.load(fa + rows[:, None] * s_fa + ch[None, :], mask=rm, other=0.0).to(tl.float32)
        if EARLY:
            fx += bias[None, :]
        elif HAS_BIAS:
            fx += tl.load(dtb + ch).to(tl.float32)[None, :]
        eg = tl.exp(kda_gate_math(fx, a_h, lower_bound, GATE))
        bt = tl.sigmoid(tl.load(bl + rows * s_bl + h, mask=tt < nt, other=0.0).to(tl.float32))
        if SPLIT == 1:  # the output gate, loaded before the recurrence
            z = tl.load(gate + rows[:, None] * s_gt + ch[None, :], mask=rm, other=0.0).to(tl.float32)
        if EARLY:
            xv2 = _conv_silu_w(v, s_v, cst + 2 * P, C3, wv, bos, t0, nt, cvp, KW, MAXT)
        else:
            xv2 = _conv_silu(v, s_v, cst + 2 * P, C3, vw, bos, t0, nt, cvp, KW, MAXT)
        xv3 = tl.reshape(xv2, [MAXT, NV, BV])
        o3 = tl.zeros([MAXT, NV, BV], dtype=tl.float32)
        if MAXT == 1 and NV > 1:  # one token: its k, q, decay broadcasts, the same for every block, made once
            k1, q1, g1 = _row(kn, 0)[:, None], _row(qn, 0)[:, None], _row(eg, 0)[:, None]
        # the recurrence, one [D, BV] column block of the state at a time
        for vb in range(NV):
            sp = sp0 + vb * BV
            if PREFETCH or EARLY:  # block vb was loaded one step ahead; issue block vb+1 before computing on vb
                S = s_next.to(tl.float32)
                if NV > 1:
                    s_next = tl.load(sp + BV, mask=(vb + 1 < NV) & (offs >= 0), other=0.0,
                                     eviction_policy="evict_first")
            else:
                S = tl.load(sp, eviction_policy="evict_first").to(tl.float32)
            if NV == 1:
                xv = tl.reshape(xv3, [MAXT, BV])
            else:
                xv = tl.sum(tl.where((tl.arange(0, NV) == vb)[None, :, None], xv3, 0.0), axis=1)
            for t in range(0, tl.minimum(nt, MAXT)):
                if MAXT == 1 and NV > 1:
                    S = S * g1
                    pred = tl.sum(S * k1, axis=0)
                    beta_t = tl.sum(tl.where(tt == t, bt, 0.0), axis=0)
                    S = S + k1 * (beta_t * (_row(xv, t) - pred))[None, :]
                    o = tl.sum(S * q1, axis=0)
                else:
                    kt = _row(kn, t)
                    S = S * _row(eg, t)[:, None]
                    pred = tl.sum(S * kt[:, None], axis=0)                   # S'^T k
                    beta_t = tl.sum(tl.where(tt == t, bt, 0.0), axis=0)
                    S = S + kt[:, None] * (beta_t * (_row(xv, t) - pred))[None, :]
                    o = tl.sum(S * _row(qn, t)[:, None], axis=0)             # S^T (q scale)
                put = (tt == t)[:, None] & (tl.arange(0, NV) == vb)[None, :]
                o3 += tl.where(put[:, :, None], o[None, None, :], 0.0)
                if KEEP:
                    tl.store(st_keep + ((bos + t0 + t) * H + h) * D * D + c0 + vb * BV + offs,
                             S.to(st_keep.dtype.element_ty))
            tl.store(sp, S.to(st.dtype.element_ty), eviction_policy="evict_first")
        if t0 + MAXT < n:  # another group follows: its loads come after this group's stores
            tl.debug_barrier()
            if EARLY:  # the next group's state (one block: EARLY needs NV == 1)
                s_next = tl.load(sp0, eviction_policy="evict_first")
        o2 = tl.reshape(o3, [MAXT, DVP])
        if SPLIT == 1:  # gated RMSNorm over the head's D outputs of each token
            _gated_rms_store(o2, rows, rm, z, nw, out, ch, norm_eps, D, P)
        else:  # the head's last program to finish normalises (below)
            tl.store(ows + rows[:, None] * P + cvp[None, :], o2, mask=rm)
    if KEEP:  # conv tail after each token (q, k channels by the head's first program)
        for t in range(0, n):
            dst = cs_keep + (bos + t) * (KW - 1) * C3
            if vs == 0:
                _put_tail(dst, C3, ch, _tail(q, s_q, cst, C3, bos, t + 2 - KW, ch, KW, KWP), KW, KWP)
                _put_tail(dst + P, C3, ch, _tail(k, s_k, cst + P, C3, bos, t + 2 - KW, ch, KW, KWP), KW, KWP)
            _put_tail(dst + 2 * P, C3, cvp, _tail(v, s_v, cst + 2 * P, C3, bos, t + 2 - KW, cvp, KW, KWP), KW, KWP)
    # new conv tails (loaded above, old state included) stored now that every read of the old ones is done;
    # v channels belong to this program alone, q/k channels are read by every program of the head
    if SPLIT == 1:
        tl.debug_barrier()
        _put_tail(cst, C3, ch, tq, KW, KWP)
        _put_tail(cst + P, C3, ch, tk, KW, KWP)
        _put_tail(cst + 2 * P, C3, cvp, tv, KW, KWP)
    else:
        tl.debug_barrier()
        _put_tail(cst + 2 * P, C3, cvp, tv, KW, KWP)
        tl.debug_barrier()  # every thread's output slices are stored before the (releasing) count
        done = tl.atomic_add(ctr + r * H + h, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:  # last of the head's programs: the others' slices and conv reads are complete
            tl.debug_barrier()
            for t0 in range(0, n, MAXT):
                rows = bos + t0 + tt
                rm = (tt < n - t0)[:, None]
                o2 = tl.load(ows + rows[:, None] * P + ch[None, :], mask=rm, other=0.0, cache_modifier=".cg")
                z = tl.load(gate + rows[:, None] * s_gt + ch[None, :], mask=rm, other=0.0).to(tl.float32)
                _gated_rms_store(o2, rows, rm, z, nw, out, ch, norm_eps, D, P)
            _put_tail(cst, C3, ch, tq, KW, KWP)
            _put_tail(cst + P, C3, ch, tk, KW, KWP)
            tl.atomic_xchg(ctr + r * H + h, 0)  # ready for the next launch


def kda_decode(q, k, v, q_conv, k_conv, v_conv, conv_state, f_a, f_b, A_log, dt_bias, b, state, gate, o_norm_w,
               state_slot, cu_seqlens, *, scale: float, lower_bound, norm_eps: float, l2_eps: float = 1e-6,
               keep_states: bool = False, block_v: int = 64, num_warps: int = 4, split: int = 1,
               prefetch: bool = True, group: int | None = None, gate_mm: bool = False, rank_block: int = 32,
               max_regs: int = 0, gemv: bool = False, early: bool = False, gluon: int = 0):
    """The fused op `fused.kda_decode` (operands and results: see the module docstring).

    `f_b=None` takes `f_a` as the whole gate input f [T, P] (already up-projected). `split` programs share
    one head's state columns (D/split each; the head's last program to finish normalises its outputs).
    `group` (tokens per front tile, a power of two <= 16) defaults to min(8, pow2(T/R)); fix it (8) for
    batch-invariant results, since the tile shape sets the order of the L2 / RMS reductions. `gate_mm` computes
    f = f_a f_b^T (fp32 out) as one GEMM before the kernel instead of per program (large batches); else
    each program does it in steps of `rank_block` rank columns: as 16-row tensor-core dots, or with `gemv` (one
    token per request) as a dot-free multiply-and-sum over [D, rank_block] tiles. `max_regs` (CUDA, 0: none)
    caps the registers per thread so that more programs share an SM (large batches: more state in flight).
    `early` (one [D, BV] block per program, BV = D/split) loads the weights, the step metadata and the program's
    state block before the PDL wait (the same results; the loads move only with PDL on). `gluon` runs the
    persistent TMA-ring kernel of `_kda_decode_gluon.py` where it is usable (CUDA sm_90+, fp32 pool, no kept states;
    `gluon` 2 computes f = f_a f_b^T inside it (an f_b `_glu.lowrank_ok` takes; else by the GEMM), 3 the same on
    the head-aligned grid (`_glu.grid`), 1 by one GEMM before it (`_GLUON_VARIANTS`); `num_warps` its warps), else
    this kernel (with its own `gate_mm`)."""
    if gluon and _glu.usable(state, keep_states):
        return _gluon(q, k, v, q_conv, k_conv, v_conv, conv_state, f_a, f_b, A_log, dt_bias, b, state, gate,
                      o_norm_w, state_slot, cu_seqlens, scale, lower_bound, norm_eps, l2_eps, num_warps, int(gluon))
    if gate_mm and f_b is not None:
        f_a, f_b = _gate_gemm(f_a, f_b), None
    T, P = q.shape
    H = A_log.numel()
    D = P // H
    KW = q_conv.shape[-1]
    RL = f_b.shape[-1] if f_b is not None else P
    R = state_slot.numel()
    conv_ws = [w if w.is_contiguous() else w.contiguous() for w in (q_conv, k_conv, v_conv)]
    if P != H * D or conv_state.shape[1:] != (KW - 1, 3 * P) or KW < 2 or \
            any(w.numel() != P * KW for w in conv_ws) or (f_b is not None and f_b.shape != (P, RL)):
        raise ValueError(f"kda_decode: q {tuple(q.shape)}, conv weights [{P}, {KW}], conv_state "
                         f"{tuple(conv_state.shape)}, f_b {None if f_b is None else tuple(f_b.shape)} do not fit "
                         f"H={H} heads of D={D}")
    if state.shape[1:] != (H, D, D) or not (state.is_contiguous() and conv_state.is_contiguous()):
        raise ValueError(f"kda_decode: state pool {tuple(state.shape)} must be contiguous [S, {H}, {D}, {D}]")
    bv_ = min(block_v, D // split)
    if split < 1 or D % split or (D // split) % bv_:
        raise ValueError(f"kda_decode: split={split} and block_v={block_v} must divide head dim {D} into blocks")
    if early and bv_ != D // split:
        raise ValueError(f"kda_decode: early state loads need one block per program (block_v={block_v} >= "
                         f"D/split = {D // split})")
    qv, kv_, vv = _rows(q, T, P, "q"), _rows(k, T, P, "k"), _rows(v, T, P, "v")
    fav, bv, gv = _rows(f_a, T, RL, "f_a" if f_b is not None else "f"), _rows(b, T, H, "b"), _rows(gate, T, P, "gate")
    fbc = (f_b if f_b.is_contiguous() else f_b.contiguous()) if f_b is not None else fav
    dev = q.device
    out = torch.empty(T, P, device=dev, dtype=q.dtype)
    group = group or (min(8, triton.next_power_of_2(-(-T // R))) if R and T else 1)
    if group & (group - 1) or not 1 <= group <= 16:
        raise ValueError(f"kda_decode: group must be a power of two in 1..16, got {group}")
    if keep_states:
        keep_s = torch.empty(T, H, D, D, device=dev, dtype=torch.float32)
        keep_c = torch.empty(T, KW - 1, 3 * P, device=dev, dtype=conv_state.dtype)
    else:
        keep_s = keep_c = out  # never written
    ows = torch.empty(T, P, device=dev, dtype=torch.float32) if split > 1 else out
    ctr = _counters(dev, R * H) if split > 1 else state_slot
    low = fbc.dtype in (torch.bfloat16, torch.float16)
    cap = {"maxnreg": int(max_regs)} if max_regs and q.is_cuda else {}
    if R > 0:
        try:
            _kda_decode_kernel[(R, H, split)](
                qv, kv_, vv, qv.stride(0), kv_.stride(0), vv.stride(0), *conv_ws, conv_state, fav, fav.stride(0), fbc,
                A_log, dt_bias if dt_bias is not None else A_log, bv, bv.stride(0), state, gv, gv.stride(0),
                o_norm_w if o_norm_w is not None else A_log, out, state_slot, cu_seqlens, keep_s, keep_c, ows, ctr,
                float(scale), float(lower_bound) if lower_bound is not None else 0.0, float(l2_eps), float(norm_eps),
                H=H, D=D, KW=KW, KWP=triton.next_power_of_2(KW), RL=RL, BV=bv_, SPLIT=split,
                RB=max(16, min(rank_block, triton.next_power_of_2(RL))), GATE=1 if lower_bound is not None else 2,
                HAS_BIAS=dt_bias is not None, HAS_NW=o_norm_w is not None, KEEP=bool(keep_states),
                LOWRANK=f_b is not None, MAXT=group, PREFETCH=bool(prefetch),
                PREC=precision.fast_fp32() if low else "ieee", GEMV=bool(gemv), EARLY=bool(early),
                num_warps=num_warps, **cap, **launch_kwargs())
        except BaseException:
            if split > 1:  # an interrupted launch (time-out, error) must not leave arrivals counted
                ctr.zero_()
            raise
    res = (out, conv_state, state)
    return res + (keep_s, keep_c) if keep_states else res


def _gluon(q, k, v, q_conv, k_conv, v_conv, conv_state, f_a, f_b, A_log, dt_bias, b, state, gate, o_norm_w,
           state_slot, cu_seqlens, scale, lower_bound, norm_eps, l2_eps, warps, variant=1):
    """The persistent Gluon kernel (its module docstring) on the same operands; f = f_a f_b^T in the kernel, or by
    one GEMM first (GLUON 1, or an f_b the kernel does not take: `_glu.lowrank_ok`)."""
    T, P = q.shape
    H = A_log.numel()
    D = P // H
    if variant not in _GLUON_VARIANTS:
        raise ValueError(f"kda_decode: GLUON {variant} is not a Gluon variant (1: the gate GEMM first, 2: the gate in "
                         f"the kernel, 3: the gate in the kernel on a head-aligned grid)")
    var = _GLUON_VARIANTS[variant]
    inner = var["inner"] and f_b is not None and _glu.lowrank_ok(f_b, D)
    f = _gate_gemm(f_a, f_b) if f_b is not None and not inner else f_a
    warps = max(warps, D // 64)  # one column of a state half a thread
    if state.shape[1:] != (H, D, D) or not (state.is_contiguous() and conv_state.is_contiguous()):
        raise ValueError(f"kda_decode: state pool {tuple(state.shape)} must be contiguous [S, {H}, {D}, {D}]")
    convs = [w if w.is_contiguous() else w.contiguous() for w in (q_conv, k_conv, v_conv)]
    out = torch.empty(T, P, device=q.device, dtype=q.dtype)
    if state_slot.numel() > 0:
        _glu.launch(_rows(q, T, P, "q"), _rows(k, T, P, "k"), _rows(v, T, P, "v"), convs, conv_state,
                    _rows(f, T, f_b.shape[1] if inner else P, "f_a" if inner else "f"), A_log, dt_bias,
                    _rows(b, T, H, "b"), state, _rows(gate, T, P, "gate"), o_norm_w, out, state_slot, cu_seqlens,
                    scale=scale, lower_bound=lower_bound, l2_eps=l2_eps, norm_eps=norm_eps, warps=warps,
                    launch_kw=launch_kwargs(), f_b=f_b if inner else None, head_grid=var["head_grid"])
    return out, conv_state, state


# GLUON values: 1 the gate GEMM before the kernel; 2 the gate in the kernel (an f_b `_glu.lowrank_ok` takes; else
# the GEMM). s16 round 3 (H200, benches/results/h200-2026-11-30-s16/kda_decode_gluon_r3.json, B=64 H=32,
# floor 64.69 us): 2 84.98 us vs 1 87.22; removed: the rank loop 4 / 16 groups an iteration (2: `_glu.UN`) 85.75 /
# 112.8 (spills), the GEMM with the in-kernel gate's 5-box ring 88.25; 3 the gate in the kernel on the head-aligned
# grid (`_glu.grid`), s17 (h200-2026-12-01-s17/kda_decode_head_grid.json, floor 64.37): 80.60 vs 2 85.16, 1 87.81
_GLUON_VARIANTS = {1: dict(inner=False, head_grid=False), 2: dict(inner=True, head_grid=False),
                   3: dict(inner=True, head_grid=True)}


# ---------------------------------------------------------------------------------- template
def _launch(a, attrs, config):
    o = fused_operands(a)
    group = None
    if attrs.get("batch_invariant"):  # fixed tiles and config, no cuBLAS gate GEMM: batch-independent sums
        key = key_dims(a, attrs)
        group, config = 8, dict(heuristic({**key, "R": 1 << 20}, "cuda" if o["q"].is_cuda else "cpu"), GATE_MM=0,
                                GLUON=0)
    return kda_decode(*(o[n] for n in OPERANDS), scale=attrs["scale"], lower_bound=attrs.get("lower_bound"),
                      norm_eps=attrs["norm_eps"], l2_eps=attrs.get("l2_eps", 1e-6),
                      keep_states=attrs.get("keep_states", False), block_v=config["BV"], num_warps=config["WARPS"],
                      split=config.get("SPLIT", 1), prefetch=bool(config.get("PREFETCH", 1)), group=group,
                      gate_mm=bool(config.get("GATE_MM", 0)), rank_block=config.get("RB", 32),
                      max_regs=config.get("MAXNREG", 0), gemv=bool(config.get("GEMV", 0)),
                      early=bool(config.get("EARLY", 0)), gluon=int(config.get("GLUON", 0)))


def key_dims(a, attrs):
    o = fused_operands(a)
    H = int(o["A_log"].shape[0])
    return {"H": H, "D": int(o["q"].shape[1]) // H, "T": int(o["q"].shape[0]), "R": int(o["state_slot"].shape[0])}


_MIN_PROGRAMS = 128  # a split grid aims at up to ~one program per SM (H200: 132 SMs) ...
_MAX_SPLIT = 4       # ... with at most 4 programs per head (each repeats the head's conv, L2 norms and gate)
_GLUON_PAIRS = 768  # (request, head) pairs from which one-token steps take the Gluon kernel (768, 1024, 2048 measured)


def heuristic(key, target):
    """GPU: the head's D state columns split over SPLIT programs while the grid has fewer than ~one program
    per SM (R*H*SPLIT < 128), up to SPLIT 4; BV = min(64, D/SPLIT), 4 warps; split programs hold their one
    block (EARLY: loaded with the metadata before the PDL wait) and take the rank in one tensor-core step
    (RB 128); one program per (request, head) from 128 (request, head) pairs on (BV 64, the next block
    loaded ahead), with f = f_a f_b^T as one GEMM before the kernel for single-token steps. CPU: one block.
    H200, benches/bench_kda.py, µs per launch in a CUDA graph of launches on distinct (L2-cold) pools, D=128, bf16,
    PDL on (off); results in benches/results/h200-2026-11-30-s8/kda_helper.json and -s11/ (kda_helper.json, and
    kda_stream.json, "s11b" below):
      B=1 H=12 (the rank preset): split 4 BV 32 EARLY 6.30 (8.74) s8, 6.44 s11, 6.34 (8.97) s11b; split 8 EARLY
        6.76, without EARLY 7.40; split 16 7.58; GEMV gate 6.78; one program per head 8.07-11.2 (8 / 16 warps),
        split 2 x 8 warps 8.09. fla (f given) 4.77-5.55, + its f GEMM 8.54-8.69; ours with f given 5.00-5.22.
      B=1 H=32: split 4 BV 32 EARLY 6.99 (9.96) s8, 6.94 (9.77) s11b; split 2 7.22-7.31, split 8 9.12, GEMV 7.54,
        one program per head 8.71-11.9. fla (f given) 6.00-6.07, + GEMM 9.04-9.09; ours with f given 5.67-6.06.
      B=64 H=32: split 1 BV 64 GEMM 87.96-88.2 (s6, s11, s11b; PDL off 89.30; f given 83.9-85.0; fla 88.4-94.7,
        + its GEMM 91.5-91.6); the grid reading and writing only the state (`state_copy_ceiling`) 70.8-73.4.
        Slower: MAXNREG 168 106.7, GEMV gate 91.0-91.7 (147 in s8), one [D, 128] block EARLY 175, BV 32 97.8,
        8+ warps 122-189; the state staged in shared memory by the loop pipeliner under register caps
        108.9-150.8 (s11, removed); a streaming kernel ([BK, BV] chunks in two passes, o = S'^T q + v_new (k.q);
        s11b, removed) 127.6-328 (best BV 32 BK 32 x 2 warps; pipelined chunk loops 169-175; at B=1 11.5-20.6):
        even its bare two-pass state copy takes 85.9-106 vs 70.8 one-pass (the second read is no free L1 / L2
        hit). B=64 x 8 tokens (states kept): 850-875.
    s12, measured and removed (H200; floors 63.25-63.79 at 4208-4244 GB/s):
      RPP (benches/results/h200-2026-11-30-s12/kda_rpp_helper.json), one program per 8 requests of a head (their
      fronts as [8, D] tiles, the gate f_a f_b^T one in-kernel dot reading the head's f_b once, the next state block
      always in flight across requests, per-request vectors through an fp32 workspace; 255 registers, no spills):
      86.56 / 87.19 at B=64 H=32 vs this default's 87.87 in the same run, PDL off 89.62 vs 87.50: ~1%, for a second
      kernel valid only when every request has exactly one token (T == R alone does not say so). Slower: its BV 32
      98.2, 4 requests a program 95.3 (two waves), 16 107.0, + gate GEMM 91.85. Its bare state walk takes 70.84 vs
      69.46-70.63 for one program per (request, head). B=1 H=12: split 4 x 8 warps 7.12, x 2 warps 8.06, one
      program per head 8.12 vs 6.24 (fla f given 5.48, + GEMM 8.64; ours f given 5.18).
      FRONT (kda_front_split.json): the fronts (conv, L2, gate, beta, conv tails) in a launch of their own into an
      fp32 workspace, then the recurrence with its first state block loaded before the PDL wait (bitwise equal to
      the fused launch): 90.86 with the gate GEMM, 96.36 with the dot-free gate in the front launch, 141.8 with a
      whole-row block on 8 warps, vs 88.38 fused (copy ceiling 70.9 in the same run). So the fronts are not what
      keeps the kernel above the copy ceiling: the recurrence alone stays ~15 us above it (probably its per-block
      reductions over D run across warps, through shared memory).
    s13 (benches/results/h200-2026-11-30-s13/kda_decode_wk_helper.json; floor 64.71 at 4148 GB/s; the copy ceiling
    70.83, 69.65 with streaming stores, 71.62 written to a second pool; ptxas registers / spills from Triton 3.6):
      B=64 H=32: 88.70 (PDL off 87.89; 254 registers, 0 spills) with one token's k, q, decay broadcasts made once
        before the block walk (13 instead of 19 bar.sync per block in the PTX) vs 88.97 (89.05; 246 / 0) without:
        kept, a gain at the noise level. fla 88.83, + its GEMM 92.30; ours with f given 85.22.
      Measured and removed: WK, each warp owning BV/warps whole columns of the block (a [D/KL, warps, KL, BV/warps]
        tile, KL lanes along k) so that reductions over k stay in the warp (2-7 bar.sync per block left): its state
        walk alone takes 98.4-101.8 (a warp reads 8 rows x 64 bytes instead of 2 x 256; BV 32: 132.6) and Triton
        3.6 spilled (n_spills 0-118): 148.2, 141.8 without the hoist, 178.1 with v and o in the tile layout too
        (wrong outputs, rel 0.06, on the GPU at BV 32 x 4 warps and 16 warps: not investigated), BV 32 x 2 warps
        117.5, BV 16 x 1 warp 374.6, BV 128 x 8 warps 198.0, EARLY 164.7; 8-token verification 1467 vs 871.1; B=1
        split 4 6.70 / 7.10 (H=12; WK / with v, o) and 7.56 / 7.99 (H=32) vs 6.21 / 7.27, x 2 warps 10.31 / 11.28,
        split 8 x 2 warps 8.22, split 2 x 8 warps 7.83, one program x 8 warps 10.16 (H=12). Streaming state stores
        (.cs) 88.81. EARLY with two blocks a program (the first loaded before the PDL wait) 108.0 (255 / 6).
      B=1 H=12 6.21 (fla 5.55, + its GEMM 8.65; ours with f given 5.03), H=32 7.26-7.27 (fla 6.08, + GEMM 9.09).
    s16 (benches/results/h200-2026-11-30-s16/kda_decode_gluon_call{1,2}.json; floor 63.58 at 4222 GB/s, copy ceiling
    68.38): GLUON, the persistent TMA-ring Gluon kernel (`_kda_decode_gluon.py`: one program per SM looping over the
    pairs, each [D, D] state loaded by TMA two pairs ahead into a 3-buffer ring and stored back by TMA), taken from
    R*H >= 2048 one-token pairs (where it was measured): B=64 H=32 86.78 (PDL off 86.15) vs this kernel's 87.85
    (87.30) in the same call, 1.365x the floor; its variants' numbers in its module docstring. B=1 (one pair a
    program) H=12 10.55 vs 6.26, H=32 11.36 vs 7.06: not taken. Round 2 (kda_decode_gluon_r2.json; floor 64.69 at
    4150 GB/s, copy ceiling 68.54): the Gluon kernel with [D, D/2] column-half boxes in a 6-box ring 86.91 (PDL off
    88.34; f given 81.37) vs round 1's Gluon kernel 87.77 (removed) and this kernel's 87.43 (87.55) in the same
    call: 1.344x the floor, a gain within the call-to-call spread (~1 us), kept. Round 3 (kda_decode_gluon_r3.json,
    floor 64.69, copy ceiling 68.51): GLUON 2, f = f_a f_b^T inside the Gluon kernel (f_b's head rows one TMA copy
    into shared memory, a 5-box state ring), GATE_MM 0: 84.98 us (1.314x; PDL off 89.10) vs GLUON 1 (the GEMM, then
    the kernel) 87.22, this kernel 89.46, fla 89.08 (+ its GEMM 92.16), f given 81.17. s17 (benches/results/
    h200-2026-12-01-s17/kda_decode_head_grid.json; floor 64.37, copy ceiling 69.47): GLUON 3, GLUON 2 on a
    head-aligned grid (128 programs at B=64 H=32, each loading its head's f_b rows once instead of 32 KB a pair):
    80.60 us (1.252x; PDL off 85.19) vs GLUON 2 85.16, GLUON 1 87.81, this kernel 87.64, fla 87.97 (+ its GEMM
    91.01), f given 79.04; below 2048 pairs (kda_decode_head_grid_call2.json, the heuristic's Triton kernel in
    parentheses): the rank preset's B=64 H=12 (768 pairs, 132 programs of one head) 32.76 (36.35; fla 37.38),
    B=32 H=32 (1024 pairs, 128 programs) 43.06 (46.48; fla 46.82): the default from 768 pairs."""
    D = key["D"]
    if str(target).startswith("cpu"):
        return {"BV": D, "WARPS": 4, "SPLIT": 1, "PREFETCH": 1, "GATE_MM": 0, "RB": 32, "MAXNREG": 0, "GEMV": 0,
                "EARLY": 0, "GLUON": 0}
    split = 1
    while key["R"] * key["H"] * split < _MIN_PROGRAMS and split < _MAX_SPLIT and D // (2 * split) >= 16:
        split *= 2
    one_token = key.get("T", key["R"]) <= key["R"]  # verification (8 tokens): per-program 8-row dots win
    bv = min(64, D // split)
    pairs = key["R"] * key["H"]
    gluon = one_token and pairs >= _GLUON_PAIRS   # the Gluon kernel computing the gate itself
    # 8 warps for a one-token step of a few (request, head) pairs: inside the rank decode graph at batch 1 (H=12,
    # session 18, benches/bench_runtime_gpu.py --sections graph_configs, medians of 6-8 captures) 532.1 / 532.6 vs
    # 534.0 / 535.9 us a step with 4 (alone 7.12 vs 6.24 us, session 12: its latency hides behind its neighbours')
    warps = 8 if one_token and pairs <= 16 else 4   # (verification steps: not measured, unchanged)
    return {"BV": bv, "WARPS": warps, "SPLIT": split, "PREFETCH": 1, "RB": 128 if split > 1 else 32,
            "GATE_MM": int(split == 1 and one_token), "MAXNREG": 0, "GEMV": 0, "EARLY": int(bv == D // split),
            "GLUON": 3 if gluon else 0}   # (GATE_MM: the Triton kernel's, where the Gluon kernel is not usable)


def constraints(config, key, target):
    cols = key["D"] // config.get("SPLIT", 1)
    if key["D"] % config.get("SPLIT", 1) or cols % config["BV"] or config["BV"] > cols:
        return [f"SPLIT={config.get('SPLIT', 1)} and BV={config['BV']} must cut D={key['D']} into blocks"]
    if config.get("EARLY", 0) and config["BV"] != cols:
        return [f"EARLY=1 loads one state block per program: BV={config['BV']} must be D/SPLIT={cols}"]
    return []


TEMPLATES = [
    KernelTemplate(
        family="kda_decode", backend="triton", ops=(FUSED_OP,), launch=_launch, key_dims=key_dims,
        heuristic=heuristic, bucket=lambda key: {**key, "T": pow2_bucket(key["T"]), "R": pow2_bucket(key["R"])},
        constraints=constraints, supports=supports, batch_invariant=True,
        tunables=(Tunable("BV", (8, 16, 32, 64)), Tunable("WARPS", (2, 4, 8)), Tunable("SPLIT", (1, 2, 4, 8, 16)),
                  Tunable("PREFETCH", (0, 1)), Tunable("GATE_MM", (0, 1)), Tunable("RB", (32, 64, 128)),
                  Tunable("MAXNREG", (0, 128, 168)), Tunable("GEMV", (0, 1)), Tunable("EARLY", (0, 1)),
                  Tunable("GLUON", (0, 1, 2, 3))),
        doc="fused KDA decode/verify: conv + SiLU + L2 + gate + recurrence + gated RMSNorm, per-token states"),
]
