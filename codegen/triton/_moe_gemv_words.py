"""GV=2 kernels of the routed experts' per-pair decode path (the heuristic's, MXFP4 only) and their launches
(`_gemv_v2`), called by `_moe_gemv.gemv_experts` (which holds the path's overview, the MXFP4 word layout and
the GV=1 kernels).

Tiles (pair, row block of GN rows), pair fastest, both launches.
  - a K step is BQ4 = GK/32 groups of 4 words (one scale block each): words [GN, BQ4, 4] (16-byte loads;
    EVEN: the steps tile K, one mask per step), scales [GN, BQ4]; per group Σ_4 words Σ_c code_c · x_c,
    then ONE fma by the block factor into acc [GN, BQ4];
  - PREF: step i+1's words and scales are loaded before step i is decoded (two tiles in registers), so the
    HBM latency overlaps the arithmetic (T=1 on the H200: 30.7 vs 33.7 us without);
  - activations: XV=1 one 16-byte load a word, split into the 8 columns (gate-up: z bf16); HX=1: the gate-up
    kernel stores h as fp32 values of z's dtype in word-major order (h_c[q] = h[8q + c]), which the down
    kernel reads with 16-byte loads and no conversion (XV=2);
  - down: tile (pair, row block) stores w[t,j] · rnd(o) to an fp32 workspace, counts itself in on the
    (token, row block) counter (acq_rel), and the last of the K slots to arrive adds the K rows in slot order
    and resets the counter (_gemv.combine_in_launch's protocol): the sum never depends on arrival order.
  - EARLY (PDL, _pdl.py; passed to the kernels as PREF=2): a program reads its pair's expert id and step 0's
    weight words and scales before `pdl_wait`, everything else (z, h, w[t, j], the workspace, the counters)
    after it. Bit 0, the down kernel: always legal, since the gate-up launch sits between it and the ids' writer
    and triggers only after its own wait (the two-launches-back rule). Bit 1, the gate-up kernel: legal only
    where the router ran at least two launches before (the rank graph: router -> packed_linear -> experts),
    which the op cannot check, so the heuristic sets bit 0 alone. H200, T=1 top-2, session 8's tiles:
    27.6 -> 26.2 us (bit 0), 25.2 (both); PDL off, no gain.
  - LATE=1: the gate-up kernel is launched without the programmatic edge (its PDL instructions stay: the wait
    returns at once), so its programs become resident only once the kernel before it (z's GEMV) has completed,
    instead of holding SM slots while they wait for it: in the rank decode step the shared expert's GEMVs on the
    side stream (passes/overlapped_moe_branches.py) find those slots. `set_late_override` forces it (benches).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.triton._gemv import tile_counters
from codegen.triton._moe_host import _TL, _step
from codegen.triton._moe_tiles import UNBIAS, _codes, _glu
from codegen.triton._pdl import launch_kwargs, pdl_enter


_late_override: int | None = None


def set_late_override(late: int | None) -> int | None:
    """Force config LATE for every launch (None: each config's own); returns the previous override."""
    global _late_override
    before, _late_override = _late_override, late
    return before


@triton.jit
def _cols8(ptr, step, ok):
    """ptr[c·step] for c = 0..7 as eight fp32 tensors (masked by ok, 0 elsewhere)."""
    return (tl.load(ptr, mask=ok, other=0.0).to(tl.float32), tl.load(ptr + step, mask=ok, other=0.0).to(tl.float32),
            tl.load(ptr + 2 * step, mask=ok, other=0.0).to(tl.float32),
            tl.load(ptr + 3 * step, mask=ok, other=0.0).to(tl.float32),
            tl.load(ptr + 4 * step, mask=ok, other=0.0).to(tl.float32),
            tl.load(ptr + 5 * step, mask=ok, other=0.0).to(tl.float32),
            tl.load(ptr + 6 * step, mask=ok, other=0.0).to(tl.float32),
            tl.load(ptr + 7 * step, mask=ok, other=0.0).to(tl.float32))


# ---- GV=2: K steps of 4-word groups (one scale block), next step's weights loaded ahead, slots split ----
@triton.jit
def _word_cols(x_row, q, NQ, XV: tl.constexpr, BQ4: tl.constexpr, EVEN: tl.constexpr):
    """x[8q + c], c = 0..7, for the words q [BQ4, 4] as eight fp32 [BQ4, 4] tensors. XV=2: x stored fp32
    column-major in words (x_c[q] at x_row + c·NQ + q, the gate-up kernel's h for the down kernel): eight
    16-byte loads per 4 words, no conversion; XV=1: one 16-byte load a word ([BQ4, 4, 8] with c = 4a + 2b + d,
    split on d, b, a); XV=0: eight 2-byte strided loads. EVEN: every word of the step exists (no mask)."""
    if EVEN:
        ok = q >= 0
    else:
        ok = q < NQ
    if XV == 2:
        return _cols8(x_row + q, NQ, ok)
    elif XV == 1:
        x = tl.load(x_row + 8 * q[:, :, None] + tl.arange(0, 8)[None, None, :], mask=ok[:, :, None], other=0.0)
        xd0, xd1 = tl.split(tl.reshape(x.to(tl.float32), [BQ4, 4, 2, 2, 2]))
        x00, x01 = tl.split(xd0)
        x10, x11 = tl.split(xd1)
        x0, x4 = tl.split(x00)
        x2, x6 = tl.split(x01)
        x1, x5 = tl.split(x10)
        x3, x7 = tl.split(x11)
        return x0, x1, x2, x3, x4, x5, x6, x7
    else:
        return _cols8(x_row + 8 * q, 1, ok)


@triton.jit
def _group_loads(w_rows, s_rows, n_ok, q, q0, NQ, BQ4: tl.constexpr, EVEN: tl.constexpr):
    """One K step's int32 words [GN, BQ4, 4] (words q0 + q) and their E8M0 bytes [GN, BQ4] (a group of 4 words is
    one 32-column scale block). EVEN (the steps tile K): one mask for the whole step, the loads stay 16-byte."""
    g = q0 // 4 + tl.arange(0, BQ4)
    if EVEN:
        live = q0 < NQ
        w = tl.load(w_rows + (q0 + q)[None, :, :], mask=n_ok[:, None, None] & live, other=0)
        s = tl.load(s_rows + g[None, :], mask=n_ok[:, None] & live, other=0)
    else:
        w = tl.load(w_rows + (q0 + q)[None, :, :], mask=n_ok[:, None, None] & ((q0 + q) < NQ)[None, :, :], other=0)
        s = tl.load(s_rows + g[None, :], mask=n_ok[:, None] & (g < NQ // 4)[None, :], other=0)
    return w, s


@triton.jit
def _ffma_groups(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """acc [GN, BQ4] += 2^(s-127) · Σ_{4 words} Σ_c code_c · x_c (codes as E2M1 · 2^-14, see the module doc)."""
    c0, c4 = _codes(w, 0, ASM)
    c1, c5 = _codes(w, 1, ASM)
    c2, c6 = _codes(w, 2, ASM)
    c3, c7 = _codes(w, 3, ASM)
    part = (c0 * x0[None, :, :] + c1 * x1[None, :, :] + c2 * x2[None, :, :] + c3 * x3[None, :, :]
            + c4 * x4[None, :, :] + c5 * x5[None, :, :] + c6 * x6[None, :, :] + c7 * x7[None, :, :])
    return acc + (s.to(tl.int32) << 23).to(tl.float32, bitcast=True) * tl.sum(part, 2)


@triton.jit
def _rows_dot(x_row, w_rows, s_rows, n_ok, NQ, wn, sn, GN: tl.constexpr, BQ4: tl.constexpr, ASM: tl.constexpr,
              PREF: tl.constexpr, XV: tl.constexpr, EVEN: tl.constexpr):
    """Σ_k W[n, k] x[k] for the GN rows (fp32): steps of 4·BQ4 words; PREF: step i+1's words are loaded before
    step i is decoded (two tiles in registers: the loads overlap the arithmetic), step 0's (wn, sn) by the
    caller (before the PDL wait in the down kernel: its weights and ids are known there, see _down_v2_kernel)."""
    q = 4 * tl.arange(0, BQ4)[:, None] + tl.arange(0, 4)[None, :]
    acc = tl.zeros([GN, BQ4], dtype=tl.float32)
    for q0 in range(0, NQ, 4 * BQ4):
        if PREF:
            w, s = wn, sn
            wn, sn = _group_loads(w_rows, s_rows, n_ok, q, q0 + 4 * BQ4, NQ, BQ4, EVEN)
        else:
            w, s = _group_loads(w_rows, s_rows, n_ok, q, q0, NQ, BQ4, EVEN)
        x0, x1, x2, x3, x4, x5, x6, x7 = _word_cols(x_row, q0 + q, NQ, XV, BQ4, EVEN)
        acc = _ffma_groups(acc, w, s, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
    return tl.sum(acc, 1) * UNBIAS


@triton.jit
def _pair_rows(ids_ptr, p, E, rn, n_ok, stride_we, stride_wn, stride_se, stride_sn):
    """Pair p's expert e (the router's output) and the offsets of its weight rows rn (words [GN, 1, 1]) and
    scale rows ([GN, 1]); live: the rows that exist, none for an expert of another rank (e outside [0, E))."""
    e = tl.load(ids_ptr + p)
    mine = (e >= 0) & (e < E)
    es = tl.where(mine, e, 0).to(tl.int64)
    w_off = es * stride_we + rn[:, None, None].to(tl.int64) * stride_wn
    s_off = es * stride_se + rn[:, None].to(tl.int64) * stride_sn
    return e, w_off, s_off, n_ok & mine


@triton.jit
def _gate_up_v2_kernel(z_ptr, ids_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, E, INTER, NQ, stride_z, stride_we,
                       stride_wn, stride_se, stride_sn, stride_h, beta1, beta2, NP, TOPK: tl.constexpr,
                       ACT: tl.constexpr, HAS_BETA2: tl.constexpr, GN: tl.constexpr, BQ4: tl.constexpr,
                       ASM: tl.constexpr, PREF: tl.constexpr, XV: tl.constexpr, EVEN: tl.constexpr,
                       HX: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr):
    """h[p, rows] = act(W1_e z_t, W3_e z_t) for tile (row block rb, pair p), pair fastest; w1 and w3 are read
    in one pass per step (x loaded once); a pair of another rank (e outside [0, E)) writes nothing. HX: h is
    stored as fp32 values of DT (rounded as the reference's h) in _word_cols' XV=2 order, n -> (n % 8)·I/8 + n // 8.
    PREF=2 (EARLY): the expert id and step 0's weights are read before the PDL wait: legal only when the ids'
    writer (the router) is at least two launches back (module doc); else the wait comes first."""
    EARLY: tl.constexpr = PREF == 2
    if not EARLY:
        pdl_enter(PDL)      # which expert to read is the router's output: no weight is known before the wait
    p = tl.program_id(0) % NP
    rn = (tl.program_id(0) // NP) * GN + tl.arange(0, GN)
    n_ok = rn < INTER
    e, w_off, s_off, live = _pair_rows(ids_ptr, p, E, rn, n_ok, stride_we, stride_wn, stride_se, stride_sn)
    w1_rows, s1_rows, w3_rows, s3_rows = w1_ptr + w_off, s1_ptr + s_off, w3_ptr + w_off, s3_ptr + s_off
    q = 4 * tl.arange(0, BQ4)[:, None] + tl.arange(0, 4)[None, :]
    w1n, s1n = _group_loads(w1_rows, s1_rows, live, q, 0, NQ, BQ4, EVEN)     # step 0 (PREF)
    w3n, s3n = _group_loads(w3_rows, s3_rows, live, q, 0, NQ, BQ4, EVEN)
    if EARLY:
        pdl_enter(PDL)      # z (the previous kernel's output) and h are touched only after it
    if (e >= 0) & (e < E):
        x_row = z_ptr + (p // TOPK).to(tl.int64) * stride_z
        acc1 = tl.zeros([GN, BQ4], dtype=tl.float32)
        acc3 = tl.zeros([GN, BQ4], dtype=tl.float32)
        for q0 in range(0, NQ, 4 * BQ4):
            if PREF:
                w1, s1, w3, s3 = w1n, s1n, w3n, s3n
                w1n, s1n = _group_loads(w1_rows, s1_rows, n_ok, q, q0 + 4 * BQ4, NQ, BQ4, EVEN)
                w3n, s3n = _group_loads(w3_rows, s3_rows, n_ok, q, q0 + 4 * BQ4, NQ, BQ4, EVEN)
            else:
                w1, s1 = _group_loads(w1_rows, s1_rows, n_ok, q, q0, NQ, BQ4, EVEN)
                w3, s3 = _group_loads(w3_rows, s3_rows, n_ok, q, q0, NQ, BQ4, EVEN)
            x0, x1, x2, x3, x4, x5, x6, x7 = _word_cols(x_row, q0 + q, NQ, XV, BQ4, EVEN)
            acc1 = _ffma_groups(acc1, w1, s1, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
            acc3 = _ffma_groups(acc3, w3, s3, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        h = _glu(tl.sum(acc1, 1) * UNBIAS, tl.sum(acc3, 1) * UNBIAS, beta1, beta2, ACT, HAS_BETA2).to(DT)
        if HX:
            tl.store(h_ptr + p.to(tl.int64) * stride_h + (rn % 8) * (INTER // 8) + rn // 8, h.to(tl.float32), mask=n_ok)
        else:
            tl.store(h_ptr + p.to(tl.int64) * stride_h + rn, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_v2_kernel(h_ptr, wt_ptr, ids_ptr, w2_ptr, s2_ptr, o_ptr, cnt_ptr, y_ptr, E, ELL, NQ, stride_h, stride_we,
                    stride_wn, stride_se, stride_sn, stride_y, NP, TOPK: tl.constexpr, DT: tl.constexpr,
                    GN: tl.constexpr, BQ4: tl.constexpr, ASM: tl.constexpr, PREF: tl.constexpr, XV: tl.constexpr,
                    EVEN: tl.constexpr, PDL: tl.constexpr):
    """Tile (row block rb, pair p = t·K + j), pair fastest: o = rnd(W2_e h_p) on the rows (fp32 workspace o [P, ℓ]);
    then the tile counts itself in on counter (t, rb) (acq_rel); the last of token t's K slots to arrive adds
    y[t, rows] = Σ_j w[t,j] · o[t·K+j, rows] in slot order (slots of another rank's experts add 0), whichever
    program that is, and resets the counter. K = 1: y = w · o directly.
    PREF=2 (EARLY): the expert id and step 0's weights are read before the PDL wait. Always legal here: the
    gate-up launch sits between this kernel and the ids' writer, and it triggers only after its own wait (module
    doc); h, the weights w[t, j], the workspace and the counters are read after the wait."""
    EARLY: tl.constexpr = PREF == 2
    if not EARLY:
        pdl_enter(PDL)
    p = tl.program_id(0) % NP
    rb = tl.program_id(0) // NP
    t = p // TOPK
    rn = rb * GN + tl.arange(0, GN)
    n_ok = rn < ELL
    e, w_off, s_off, live = _pair_rows(ids_ptr, p, E, rn, n_ok, stride_we, stride_wn, stride_se, stride_sn)
    q = 4 * tl.arange(0, BQ4)[:, None] + tl.arange(0, 4)[None, :]
    wn, sn = _group_loads(w2_ptr + w_off, s2_ptr + s_off, live, q, 0, NQ, BQ4, EVEN)      # step 0 (PREF)
    if EARLY:
        pdl_enter(PDL)
    o = tl.zeros([GN], dtype=tl.float32)
    if (e >= 0) & (e < E):
        o = _rows_dot(h_ptr + p.to(tl.int64) * stride_h, w2_ptr + w_off, s2_ptr + s_off, n_ok, NQ, wn, sn, GN, BQ4,
                      ASM, PREF, XV, EVEN)
        o = tl.load(wt_ptr + p).to(tl.float32) * o.to(DT).to(tl.float32)
    if TOPK == 1:
        tl.store(y_ptr + t.to(tl.int64) * stride_y + rn, o, mask=n_ok)
    else:
        tl.store(o_ptr + p.to(tl.int64) * ELL + rn, o, mask=n_ok)
        tl.debug_barrier()      # every thread's row stored before the release
        arrived = tl.atomic_add(cnt_ptr + rb * (NP // TOPK) + t, 1, sem="acq_rel", scope="gpu")
        if arrived == TOPK - 1:
            y = tl.zeros([GN], dtype=tl.float32)
            for j in tl.static_range(TOPK):
                y += tl.load(o_ptr + (t * TOPK + j).to(tl.int64) * ELL + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + t.to(tl.int64) * stride_y + rn, y, mask=n_ok)
            tl.atomic_xchg(cnt_ptr + rb * (NP // TOPK) + t, 0, sem="relaxed", scope="gpu")


def _gemv_v2(z, weights, ids, g1, g3, g2, y, act_kw: dict, cfg: dict, kernels=("gate_up", "down"), h=None) -> None:
    """The GV=2 launches (module doc) for MXFP4 int32-word operands g1, g3, g2 (_gemv_weight); cfg: GN, GK,
    num_warps (gate-up), GN2, GK2, GW2 (down), PREF, XV (gate-up's activation loads), HX (h as fp32 words),
    EARLY (with PREF: bit 0, the down kernel reads ids and its first weight step before the PDL wait, always
    legal; bit 1, the gate-up kernel too, legal only where the router ran at least two launches before it;
    passed to the kernel as PREF=2), GREG (a register cap, CUDA; 0: none). `kernels`: which launches run
    (timing them apart; either alone leaves y meaningless). h: the gate-up output written by another kernel
    (fp32 [T·K, I] in HX=1 order: _moe_gemv_gluon's), None: allocated here."""
    T, ell = z.shape
    K = ids.shape[1]
    P, inter = T * K, int(g1[1].shape[1])
    gn, gn2 = int(cfg.get("GN", 8)), int(cfg.get("GN2", cfg.get("GN", 8)))
    bq1, bq2 = _step(cfg.get("GK", 512), ell, 32) // 32, _step(cfg.get("GK2", 512), inter, 32) // 32
    nq1, nq2 = ell // 8, inter // 8
    hx, xv, early = int(cfg.get("HX", 1)), int(cfg.get("XV", 0)), int(cfg.get("EARLY", 0))
    late = int(cfg.get("LATE", 0) if _late_override is None else _late_override)
    if h is None:
        h = torch.empty(P, inter, dtype=torch.float32 if hx else z.dtype, device=z.device)
    opt = dict(ASM=bool(cfg.get("GASM", 0)) and z.is_cuda, PREF=int(cfg.get("PREF", 1)), num_stages=1,
               **launch_kwargs())
    if cfg.get("GREG") and z.is_cuda:       # a register cap: more programs resident per SM
        opt["maxnreg"] = int(cfg["GREG"])
    gate_opt = {**opt, "PREF": 2 if opt["PREF"] and early & 2 and not late else opt["PREF"]}
    if late:  # no programmatic edge: resident only once the kernel before has completed (module doc)
        gate_opt.pop("launch_pdl", None)
    if "gate_up" in kernels:
        _gate_up_v2_kernel[(P * triton.cdiv(inter, gn),)](
            z, ids, g1[1], g3[1], g1[2], g3[2], h, g1[1].shape[0], inter, nq1, z.stride(0), *g1[3], h.stride(0),
            *act_kw["betas"], P, TOPK=K, ACT=act_kw["ACT"], HAS_BETA2=act_kw["HAS_BETA2"], GN=gn, BQ4=bq1, XV=xv,
            EVEN=nq1 % (4 * bq1) == 0, HX=hx, DT=_TL[z.dtype], num_warps=int(cfg.get("num_warps", 4)),
            **gate_opt)
    nrb = triton.cdiv(ell, gn2)
    o = torch.empty(P if K > 1 else 1, ell, dtype=torch.float32, device=z.device)
    cnt = tile_counters(z.device, nrb * T) if K > 1 else o
    if "down" in kernels:
        _down_v2_kernel[(P * nrb,)](
            h, weights, ids, g2[1], g2[2], o, cnt, y, g2[1].shape[0], ell, nq2, h.stride(0), *g2[3], y.stride(0), P,
            TOPK=K, DT=_TL[z.dtype], GN=gn2, BQ4=bq2, XV=2 if hx else xv, EVEN=nq2 % (4 * bq2) == 0,
            num_warps=int(cfg.get("GW2") or cfg.get("num_warps", 4)),
            **{**opt, "PREF": 2 if opt["PREF"] and early & 1 else opt["PREF"]})
