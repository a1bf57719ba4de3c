"""Fused KDA decode as a persistent Gluon kernel (Hopper TMA + mbarriers; config GLUON=1 of `kda_decode.py`, CUDA
sm_90+ with an fp32 state pool, no kept states): the same op, operands and math as `_kda_decode_kernel` (module
docstring of kda_decode.py), with the gate input f = f_a f_b^T given (the launcher's GEMM before the kernel).

Grid: G programs (one per SM), program c takes the (request, head) pairs p = c, c + G, c + 2G, ... (p = r H + h).
Each pair's [D, D] fp32 state (64 KB at D = 128) is one TMA box of a descriptor over the pool viewed as [S H D, D]
(unswizzled; int32 row coordinates (slot H + h) D), loaded into a ring of STAGES = 3 shared-memory buffers (one
mbarrier each) two pairs ahead of the pair being computed; the updated state goes back by a TMA store from the same
buffer, so HBM sees one read and one write per pair while the program computes. The loads of the first two pairs
(with the slots they need) are issued before the PDL wait (`_pdl.py`: the state is written only by this layer's
kda_decode, two launches back); activations, conv tails and cu_seqlens are read after it. The previous pair's buffer
is refilled once this pair's front is done (`store_wait` for that pair's store, issued at its end, to have read it).
No load sits on a pair's critical path: the metadata (cu_seqlens, slot) is loaded two pairs ahead, token 0's front
inputs (conv windows and taps, f, output gate, beta logit, A_log, dt_bias) one pair ahead.

Per pair and token: the front (conv with the conv tails, SiLU, L2 norms, gate, beta) in a [D] channel layout, its
k, q scale, e^g and e^g k written to shared memory; then the recurrence from the buffer in [RW, D] row chunks (CL:
a thread owns one state column and walks RC rows of each chunk, so the sums over the key dim stay in the thread,
one cross-warp sum per pass only when D / 32 < warps): pass 1 pred = S^T (e^g k); u = beta (v - pred); pass 2
S = e^g S + k u^T (written back to the buffer), o = S^T (q scale). Gated RMSNorm, then the new conv tails (one
token: rows 1 .. K-1 of its loaded window; else each row read before it is overwritten). Any token count per request
(tokens loop on the same buffer; a request with none writes its state back unchanged). 168 registers, no spills,
194 KB shared memory (Triton 3.6, sm_90).

H200, session 16 (benches/bench_kda.py; B=64 H=32 D=128 one token, bf16 activations, fp32 state, µs per launch in a
graph of launches on distinct pools, the gate GEMM included; every variant vs the unfused ops rel 0.0034 (out) /
0.0017 (state) / 0.00096 (conv tails), vs the Triton kernel 1e-5, ragged steps with empty and 3-token requests
exact on the untouched rows; PDL race check: 20 graph replays bitwise equal to PDL-off eager):
  - call 2 (benches/results/h200-2026-11-30-s16/kda_decode_gluon_call2.json; floor 63.58 at 4222 GB/s, state copy
    ceiling 68.38): kept, 86.78 (PDL off 86.15; race-check chain 85.72), f given 85.75, vs the Triton default 87.85
    (87.30) and fla 87.69 (+ its GEMM 90.89): 1.365x the floor (goal 1.3x not reached). Removed, slower: the refill
    at the pair's end (after its stores) 92.85; 2 stages 88.66; 4 columns a thread (4 warps down the rows, 16-byte
    shared loads; 168 registers) 88.67.
  - call 1 (kda_decode_gluon_call1.json; the metadata and A_log / dt_bias loaded on each pair's critical path, the
    refill at the pair's end): 3 stages 92.02, 2 stages 90.98, 4 columns a thread 98.91, 8 warps (2 down the rows,
    255 registers) 107.1 vs the default 88.28. B=1 (one pair a program: nothing to overlap) H=12 10.55 vs 6.26,
    H=32 11.36 vs 7.06: the heuristic keeps the Triton kernel there.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ._pdl import pdl_launch_dependents, pdl_wait

_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.7 / 3.6 name of the CTA barrier


STAGES = 3  # state buffers in the ring (module docstring: 2 measured slower)


def layouts(D: int, warps: int, rc: int, kwp: int = 4) -> dict:
    """CL: [WR * RC, D] state chunks, one column a thread, WC = D / 32 warps across the columns, WR = warps / WC warps
    down the rows; VL: [D] channel vectors; WL: token 0's conv windows [KWP, D]; SV: the small shared vectors; SS: the
    state ring (unswizzled NVMMA: TMA's box, read row-major by the chunks)."""
    wc = D // 32
    if wc < 1 or warps % wc:
        raise ValueError(f"kda gluon: D={D} and {warps} warps do not tile the state columns")
    return dict(CL=gl.BlockedLayout([rc, 1], [1, 32], [warps // wc, wc], [1, 0]),
                VL=gl.BlockedLayout([max(1, D // (32 * warps))], [32], [warps], [0]),
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
              WL: gl.constexpr):
    """Token 0's front inputs of the pair (h, bos, slot: `_meta`, loaded a pair earlier), issued now and used a pair
    later: the conv windows and taps, f, the output gate, the beta logit, A_log[h] and dt_bias."""
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
    return (qx, qs, qt, kx, ks, kt, vx, vs, vt, gl.load(f + bos * s_f + ch), gl.load(gate + bos * s_gt + ch),
            gl.load(bl + bos * s_bl + h), gl.load(alog + h), bias)


@gluon.jit
def _l2n(x, eps):
    return x / gl.sqrt(gl.sum(x * x, axis=0) + eps)


@gluon.jit
def _issue(desc, row, ok, D: gl.constexpr, bar, buf):
    """TMA load of the state rows row .. row + D of the [S H D, D] view into buf (nothing unless ok)."""
    mbarrier.expect(bar, D * D * 4, pred=ok)
    tma.async_copy_global_to_shared(desc, [row, 0], bar, buf, pred=ok)


@gluon.jit
def _state_row(slots, p, NP, H: gl.constexpr, D: gl.constexpr):
    pc = gl.minimum(p, NP - 1)
    return ((gl.load(slots + pc // H) * H + pc % H) * D).to(gl.int32)


@gluon.jit
def _pred(buf, vecs, RW: gl.constexpr, D: gl.constexpr, CL: gl.constexpr):
    """Pass 1: S^T (e^g * k) over [RW, D] row chunks, per-thread partial sums until one reduction."""
    RV: gl.constexpr = gl.SliceLayout(1, CL)
    acc = gl.zeros([RW, D], gl.float32, CL)
    for c in gl.static_range(D // RW):
        gk = vecs.slice(2 * D + c * RW, RW).load(RV)
        acc += buf.slice(c * RW, RW, dim=0).load(CL) * gl.expand_dims(gk, 1)
    return gl.sum(acc, axis=0)


@gluon.jit
def _update(buf, vecs, u, RW: gl.constexpr, D: gl.constexpr, CL: gl.constexpr):
    """Pass 2: S = e^g * S + k u^T written back in place; returns S^T (q scale)."""
    RV: gl.constexpr = gl.SliceLayout(1, CL)
    acc = gl.zeros([RW, D], gl.float32, CL)
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
def _front(vecs, xq, xk, fx, a_h, bias, scale, lower_bound, l2_eps, GATE: gl.constexpr, D: gl.constexpr):
    """One token's k, e^g, e^g k and q scale (L2-normalised conv outputs, the decay) to shared memory for the passes."""
    qn = _l2n(xq, l2_eps) * scale
    kn = _l2n(xk, l2_eps)
    eg = gl.exp(_gate(fx.to(gl.float32) + bias, a_h, lower_bound, GATE))
    vecs.slice(0, D).store(kn)
    vecs.slice(D, D).store(eg)
    vecs.slice(2 * D, D).store(eg * kn)
    vecs.slice(3 * D, D).store(qn)
    _barrier()


@gluon.jit
def _recur(buf, bar, phase, vecs, xv, z, bt, nw, out, orow, ch, norm_eps, RW: gl.constexpr, D: gl.constexpr,
           P: gl.constexpr, CL: gl.constexpr, VL: gl.constexpr):
    """The token's two passes over the state buffer (once its TMA load has landed) and its gated RMSNorm output."""
    mbarrier.wait(bar, phase)
    u = _sig(bt.to(gl.float32)) * (gl.convert_layout(xv, gl.SliceLayout(0, CL)) - _pred(buf, vecs, RW, D, CL))
    o = gl.convert_layout(_update(buf, vecs, u, RW, D, CL), VL)
    y = o / gl.sqrt(gl.sum(o * o, axis=0) / D + norm_eps) * _sig(z.to(gl.float32)) * nw
    gl.store(out + orow * P + ch, y.to(out.dtype.element_ty))
    _barrier()  # every read of vecs done before the next token writes them


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
def _kda_decode_gluon_kernel(q, k, v, s_q, s_k, s_v, qw, kw, vw, cstate, f, s_f, alog, dtb, bl, s_bl, desc, gate,
                             s_gt, onw, out, slots, cu, NP, scale, lower_bound, l2_eps, norm_eps,
                             H: gl.constexpr, D: gl.constexpr, KW: gl.constexpr, KWP: gl.constexpr,
                             GATE: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_NW: gl.constexpr, STAGES: gl.constexpr,
                             RW: gl.constexpr, PDL: gl.constexpr, CL: gl.constexpr, VL: gl.constexpr,
                             WL: gl.constexpr, SV: gl.constexpr, SS: gl.constexpr):
    P: gl.constexpr = H * D
    C3: gl.constexpr = 3 * H * D
    KM1: gl.constexpr = KW - 1
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.float32, [STAGES, D, D], SS)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    vecs = gl.allocate_shared_memory(gl.float32, [4 * D], SV)  # k, e^g, e^g k, q scale of the current token
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()
    _barrier()
    # the first STAGES - 1 pairs' states (and the slots they need) before the grid-dependency wait (_pdl.py)
    for st in gl.static_range(STAGES - 1):
        _issue(desc, _state_row(slots, pid + st * G, NP, H, D), pid + st * G < NP, D, bars.index(st),
               ring.index(st))
    dd = gl.arange(0, D, layout=VL)
    if HAS_NW:
        nw = gl.load(onw + dd).to(gl.float32)
    else:
        nw = gl.full([D], 1.0, gl.float32, VL)
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    # metadata two pairs ahead, token-0 inputs one pair ahead: no load on a pair's critical path
    h, bos, n, slot = _meta(slots, cu, pid, NP, H)
    h1, bos1, n1, slot1 = _meta(slots, cu, pid + G, NP, H)
    qx, qs, qt, kx, ks, kt, vx, vs, vt, fx, z, bt, al, bias = _prefetch(
        q, k, v, s_q, s_k, s_v, qw, kw, vw, cstate, f, s_f, alog, dtb, bl, s_bl, gate, s_gt, h, bos, slot, H, D, KW,
        KWP, HAS_BIAS, WL)
    for i in range(gl.cdiv(NP - pid, G)):
        sb = i % STAGES
        phase = (i // STAGES) & 1
        buf = ring.index(sb)
        nxt = i + STAGES - 1  # the pair whose state refills the previous pair's buffer at the end
        nrow = _state_row(slots, pid + nxt * G, NP, H, D)
        h2, bos2, n2, slot2 = _meta(slots, cu, pid + (i + 2) * G, NP, H)
        qx1, qs1, qt1, kx1, ks1, kt1, vx1, vs1, vt1, fx1, z1, bt1, al1, bias1 = _prefetch(
            q, k, v, s_q, s_k, s_v, qw, kw, vw, cstate, f, s_f, alog, dtb, bl, s_bl, gate, s_gt, h1, bos1, slot1, H, D,
            KW, KWP, HAS_BIAS, WL)
        cst = cstate + slot * (KM1 * C3)
        ch = h * D + dd
        a_h = gl.exp(al.to(gl.float32))
        bias_v = gl.convert_layout(bias.to(gl.float32), VL)
        _front(vecs, gl.convert_layout(_silu_w(qx, qs, qt), VL), gl.convert_layout(_silu_w(kx, ks, kt), VL),
               gl.convert_layout(fx, VL), a_h, bias_v, scale, lower_bound, l2_eps, GATE, D)
        # refill the previous pair's buffer now (its store, issued at that pair's end, drained during this front)
        tma.store_wait(0)
        _issue(desc, nrow, pid + nxt * G < NP, D, bars.index(nxt % STAGES), ring.index(nxt % STAGES))
        if n > 0:
            _recur(buf, bars.index(sb), phase, vecs, gl.convert_layout(_silu_w(vx, vs, vt), VL),
                   gl.convert_layout(z, VL), bt, nw, out, bos, ch, norm_eps, RW, D, P, CL, VL)
        for t in range(1, n):  # verification steps: later tokens with their loads inline
            row = bos + t
            _front(vecs, _conv_silu(q, s_q, cst, C3, qw, bos, t, ch, KW, VL),
                   _conv_silu(k, s_k, cst + P, C3, kw, bos, t, ch, KW, VL), gl.load(f + row * s_f + ch), a_h, bias_v,
                   scale, lower_bound, l2_eps, GATE, D)
            _recur(buf, bars.index(sb), phase, vecs, _conv_silu(v, s_v, cst + 2 * P, C3, vw, bos, t, ch, KW, VL),
                   gl.load(gate + row * s_gt + ch), gl.load(bl + row * s_bl + h), nw, out, row, ch, norm_eps, RW, D,
                   P, CL, VL)
        mbarrier.wait(bars.index(sb), phase)  # a request without tokens: its state, unchanged
        # the new conv tails: context rows n .. n + K - 2 (one token: rows 1 .. K - 1 of its window, loaded already)
        if n == 1:
            ch2 = gl.expand_dims(h * D + gl.arange(0, D, layout=gl.SliceLayout(0, WL)), 0)
            jj = gl.expand_dims(gl.arange(0, KWP, layout=gl.SliceLayout(1, WL)), 1)
            tp = cst + (jj - 1) * C3 + ch2
            tm = (jj >= 1) & (jj < KW) & (ch2 >= 0)
            CT: gl.constexpr = cstate.dtype.element_ty
            gl.store(tp, (qx.to(gl.float32) + qs.to(gl.float32)).to(CT), mask=tm)
            gl.store(tp + P, (kx.to(gl.float32) + ks.to(gl.float32)).to(CT), mask=tm)
            gl.store(tp + 2 * P, (vx.to(gl.float32) + vs.to(gl.float32)).to(CT), mask=tm)
        else:
            _tails(q, k, v, s_q, s_k, s_v, cst, C3, bos, n, ch, P, KM1)
        fence_async_shared()
        _barrier()
        tma.async_copy_shared_to_global(desc, [((slot * H + h) * D).to(gl.int32), 0], buf)
        h, bos, n, slot, h1, bos1, n1, slot1 = h1, bos1, n1, slot1, h2, bos2, n2, slot2
        qx, qs, qt, kx, ks, kt, vx, vs, vt, fx, z, bt, al, bias = \
            qx1, qs1, qt1, kx1, ks1, kt1, vx1, vs1, vt1, fx1, z1, bt1, al1, bias1
    tma.store_wait(0)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))


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
    whose STAGES [D, D] buffers fit in shared memory (D >= 32) and whose rows `rows_fit`, no kept per-token states."""
    D = state.shape[-1]
    if keep_states or state.dtype != torch.float32 or D < 32 or STAGES * D * D * 4 > 200 * 1024 or \
            not rows_fit(state.shape[0], state.shape[1], D) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        target = triton.runtime.driver.active.get_current_target()
    except RuntimeError:  # no GPU driver
        return False
    return target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90


def launch(q, k, v, convs, conv_state, f, A_log, dt_bias, b, state, gate, o_norm_w, out, state_slot, cu_seqlens,
           *, scale, lower_bound, l2_eps, norm_eps, warps=4, rc=16, launch_kw):
    """One launch over all (request, head) pairs (q, k, v, f, b, gate: row views; f the whole gate input [T, P])."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    S, H, D = state.shape[0], state.shape[1], state.shape[-1]
    NP = state_slot.numel() * H
    KW = convs[0].shape[-1]
    lay = layouts(D, warps, rc, triton.next_power_of_2(KW))
    desc = TensorDescriptor.from_tensor(state.view(S * H * D, D), [D, D], lay["SS"])
    wc = D // 32
    _kda_decode_gluon_kernel[(min(NP, _sm_count(q.device)),)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), *convs, conv_state, f, f.stride(0), A_log,
        dt_bias if dt_bias is not None else A_log, b, b.stride(0), desc, gate, gate.stride(0),
        o_norm_w if o_norm_w is not None else A_log, out, state_slot, cu_seqlens, NP, float(scale),
        float(lower_bound) if lower_bound is not None else 0.0, float(l2_eps), float(norm_eps),
        H=H, D=D, KW=KW, KWP=triton.next_power_of_2(KW), GATE=1 if lower_bound is not None else 2,
        HAS_BIAS=dt_bias is not None, HAS_NW=o_norm_w is not None, STAGES=STAGES, RW=rc * (warps // wc),
        num_warps=warps, **lay, **launch_kw)
