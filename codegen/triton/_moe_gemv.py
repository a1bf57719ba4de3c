"""Per-pair decode path of the routed experts (moe_grouped_gemm.py, config PATH="gemv"): no permutation,
two launches, programs only for routed pairs. Not a kernel family (no TEMPLATES). This module holds the
GV=1 kernels and the host entry `gemv_experts`; the GV=2 kernels (the heuristic's, MXFP4 words) and their
launches are in `_moe_gemv_words`.

    gate-up  h[p, n] = act(Σ_k W1_e[n,k] z_t[k], Σ_k W3_e[n,k] z_t[k])     p = t·K + j, e = ids[t,j]
    down     y[t, n] = Σ_j w[t,j] · rnd(Σ_i W2_{e_j}[n,i] h[t·K+j, i])      slots in order, fp32
rnd = rounding to z's dtype (the reference's per-pair outputs); pairs whose expert is outside [0, E) (another
EP rank's) compute nothing and add 0. MXFP4 weights (packed bytes [E, N, K/2] read as int32 words of 8 E2M1
codes: K columns 8q .. 8q+7, code c in bits 4c..4c+3; E8M0 bytes [E, N, K/32]): codes c and c+4 sit at the
same offset of the word's two 16-bit halves, so ONE shift and mask per field put both into fp16 fields (sign
-> bit 15, e e m -> bits 11..9), each exactly E2M1(code) · 2^-14 (_moe_tiles._codes; GASM: the same in PTX,
each register half converted straight to fp32), multiplied by activation column 8q + c (+ 4) in fp32; block
sums times 2^(s-127) (fp32 bits s << 23: exact for s in 1..254; s = 0 gives 0); the row sum times 2^14.

GV=2 (the heuristic's, MXFP4 only; `_moe_gemv_words`): tiles (pair, row block of GN rows), pair fastest, both
launches, K steps of 4-word groups (one scale block each), the next step's words loaded ahead, the down
kernel's K slots combined in launch by the last to arrive (see that module's doc).
GLUON (session 14; bf16 activations on CUDA sm_90+, else the GV=2 kernels run): the inner products on the tensor
cores, weights decoded straight into mma.sync's A registers (`_moe_gemv_gluon`: 1 the gate-up with GV=2's down, 2 both).
H200, T=1 / T=8 top-2: GV=2 24.45 / 149.84 us, GLUON_T1 (gate-up, 8 K slices) 23.28-23.77 / 141.4, GLUON_T8 (both,
down on 2 K slices) 24.52 / 105.8-107.9 (that module's doc has the sweep).
GV=1 (session 6, kept callable; dense weights always): gate-up grid (T·K, ceil(I/GN)) as GV=2 without the
groups, prefetch or word-major h; down grid (T, ceil(l/GN2)) looping over the K slots. Inner product GMMA=0:
FFMA on [GN, GK/8] words; GMMA=1: the grouped kernels' MMA step (_moe_tiles._mma_step_t, weights decoded as
the MMA's M side) against [activation row, 15 zero columns], packed tiles through cp.async stages. GPROG > 0
launches that many programs striding over the tiles. Every kernel keeps the PDL contract (_pdl.py): the
expert of a tile is the router's output, so each program waits before its first load.
The reduction order of an output element depends only on the config and K, not on the batch: a token's
result is batch-invariant for a fixed config.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.triton import _moe_gemv_gluon as _gluon, _moe_gemv_words as _gv2
from codegen.triton._moe_gemv_words import _cols8, _gemv_v2
from codegen.triton._moe_host import _TL, _gemv_weight, _int32_view, _step, gemv_supported  # noqa: F401
from codegen.triton._moe_tiles import (CODE_PAIR_PTX, UNBIAS, _code_pair, _codes, _glu, _load_bt,  # noqa: F401
                                      _mma_step_t)
from codegen.triton._pdl import launch_kwargs, pdl_enter


@triton.jit
def _x_cols(x_row, k0, K, MX: tl.constexpr, BQ: tl.constexpr):
    """Activation columns of one K step as fp32: MX: x[k0 + 8q + c] for c = 0..7 (eight [BQ] vectors,
    q over the step's words); dense: x[k0 .. k0+BQ] (one vector, the other seven unused)."""
    if MX:
        col = k0 + 8 * tl.arange(0, BQ)
        return _cols8(x_row + col, 1, col < K)
    else:
        col = k0 + tl.arange(0, BQ)
        x0 = tl.load(x_row + col, mask=col < K, other=0.0).to(tl.float32)
        return x0, x0, x0, x0, x0, x0, x0, x0


@triton.jit
def _gemv_step(acc, w_rows, s_rows, n_ok, k0, K, x0, x1, x2, x3, x4, x5, x6, x7, MX: tl.constexpr,
               BQ: tl.constexpr, ASM: tl.constexpr):
    """acc [GN, BQ] += this K step's products of the weight rows and the activation columns (MX: one
    scaled sum of 8 per word, see the module doc; dense: one product per element)."""
    if MX:
        q = k0 // 8 + tl.arange(0, BQ)
        ok = n_ok[:, None] & (q < K // 8)[None, :]
        w = tl.load(w_rows + q[None, :], mask=ok, other=0)
        s = tl.load(s_rows + (q // 4)[None, :], mask=ok, other=0).to(tl.int32)
        f = (s << 23).to(tl.float32, bitcast=True)
        c0, c4 = _codes(w, 0, ASM)
        c1, c5 = _codes(w, 1, ASM)
        c2, c6 = _codes(w, 2, ASM)
        c3, c7 = _codes(w, 3, ASM)
        part = (c0 * x0[None, :] + c1 * x1[None, :] + c2 * x2[None, :] + c3 * x3[None, :]
                + c4 * x4[None, :] + c5 * x5[None, :] + c6 * x6[None, :] + c7 * x7[None, :])
        return acc + f * part
    else:
        col = k0 + tl.arange(0, BQ)
        w = tl.load(w_rows + col[None, :], mask=n_ok[:, None] & (col < K)[None, :], other=0.0)
        return acc + w.to(tl.float32) * x0[None, :]


@triton.jit
def _gemv_gate_up_kernel(z_ptr, ids_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, E, ELL, INTER, stride_z,
                         stride_we, stride_wn, stride_se, stride_sn, stride_h, beta1, beta2, TOPK: tl.constexpr,
                         MX: tl.constexpr, ACT: tl.constexpr, HAS_BETA2: tl.constexpr, GN: tl.constexpr,
                         BQ: tl.constexpr, STEP: tl.constexpr, ASM: tl.constexpr, MMA: tl.constexpr,
                         W_FMT: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr, NP,
                         PDL: tl.constexpr):
    pdl_enter(PDL)      # the expert ids are the router's: no weight is known before the wait
    n_tiles = NP * tl.cdiv(INTER, GN)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):      # tiles (row block, pair), pair fastest
        _gate_up_tile(z_ptr, ids_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, E, ELL, INTER, stride_z, stride_we,
                      stride_wn, stride_se, stride_sn, stride_h, beta1, beta2, tile % NP, tile // NP, TOPK, MX, ACT,
                      HAS_BETA2, GN, BQ, STEP, ASM, MMA, W_FMT, DT, IEEE, WIDE)


@triton.jit
def _gate_up_tile(z_ptr, ids_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, E, ELL, INTER, stride_z, stride_we, stride_wn,
                  stride_se, stride_sn, stride_h, beta1, beta2, p, rb, TOPK: tl.constexpr, MX: tl.constexpr,
                  ACT: tl.constexpr, HAS_BETA2: tl.constexpr, GN: tl.constexpr, BQ: tl.constexpr, STEP: tl.constexpr,
                  ASM: tl.constexpr, MMA: tl.constexpr, W_FMT: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr,
                  WIDE: tl.constexpr):
    """h[p, rb·GN .. rb·GN+GN) (module doc); a pair whose expert is another rank's writes nothing."""
    e = tl.load(ids_ptr + p)
    if (e < 0) | (e >= E):          # another rank's expert: the row is never read
        return
    rn = rb * GN + tl.arange(0, GN)
    n_ok = rn < INTER
    x_row = z_ptr + (p // TOPK).to(tl.int64) * stride_z
    if MMA:     # weights x [activation row, 15 zero columns] on the tensor cores (_moe_tiles' MMA step)
        col_ok = tl.arange(0, 16) == 0
        cols_ptr = (x_row + tl.zeros([16], dtype=tl.int64))[:, None]
        wbase = e * stride_we
        sbase = e * stride_se
        acc1 = tl.zeros([GN, 16], dtype=tl.float32)
        acc3 = tl.zeros([GN, 16], dtype=tl.float32)
        for k0 in range(0, ELL, STEP):
            b0, b1, b2, b3 = _load_bt(cols_ptr, col_ok, k0, ELL, W_FMT, DT, STEP)
            acc1 = _mma_step_t(acc1, b0, b1, b2, b3, w1_ptr, s1_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn,
                               stride_sn, 0, GN, STEP, W_FMT, IEEE, DT, WIDE, 0, 0)
            acc3 = _mma_step_t(acc3, b0, b1, b2, b3, w3_ptr, s3_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn,
                               stride_sn, 0, GN, STEP, W_FMT, IEEE, DT, WIDE, 0, 0)
        a = tl.sum(acc1, 1)         # column 0 plus exact zeros
        u = tl.sum(acc3, 1)
    else:
        w_off = e * stride_we + rn[:, None].to(tl.int64) * stride_wn
        s_off = e * stride_se + rn[:, None].to(tl.int64) * stride_sn
        acc1 = tl.zeros([GN, BQ], dtype=tl.float32)
        acc3 = tl.zeros([GN, BQ], dtype=tl.float32)
        for k0 in range(0, ELL, STEP):
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_cols(x_row, k0, ELL, MX, BQ)
            acc1 = _gemv_step(acc1, w1_ptr + w_off, s1_ptr + s_off, n_ok, k0, ELL, x0, x1, x2, x3, x4, x5, x6, x7, MX,
                              BQ, ASM)
            acc3 = _gemv_step(acc3, w3_ptr + w_off, s3_ptr + s_off, n_ok, k0, ELL, x0, x1, x2, x3, x4, x5, x6, x7, MX,
                              BQ, ASM)
        a = tl.sum(acc1, 1)
        u = tl.sum(acc3, 1)
        if MX:
            a = a * UNBIAS
            u = u * UNBIAS
    h = _glu(a, u, beta1, beta2, ACT, HAS_BETA2)
    tl.store(h_ptr + p.to(tl.int64) * stride_h + rn, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_down_combine_kernel(h_ptr, wt_ptr, ids_ptr, w2_ptr, s2_ptr, y_ptr, E, ELL, INTER, stride_h, stride_we,
                              stride_wn, stride_se, stride_sn, stride_y, TOPK: tl.constexpr, MX: tl.constexpr,
                              DT: tl.constexpr, GN: tl.constexpr, BQ: tl.constexpr, STEP: tl.constexpr,
                              ASM: tl.constexpr, MMA: tl.constexpr, W_FMT: tl.constexpr, IEEE: tl.constexpr,
                              WIDE: tl.constexpr, NT, PDL: tl.constexpr):
    pdl_enter(PDL)
    n_tiles = NT * tl.cdiv(ELL, GN)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):      # tiles (row block, token), token fastest
        _down_combine_tile(h_ptr, wt_ptr, ids_ptr, w2_ptr, s2_ptr, y_ptr, E, ELL, INTER, stride_h, stride_we,
                           stride_wn, stride_se, stride_sn, stride_y, tile % NT, tile // NT, TOPK, MX, DT, GN, BQ,
                           STEP, ASM, MMA, W_FMT, IEEE, WIDE)


@triton.jit
def _down_combine_tile(h_ptr, wt_ptr, ids_ptr, w2_ptr, s2_ptr, y_ptr, E, ELL, INTER, stride_h, stride_we, stride_wn,
                       stride_se, stride_sn, stride_y, t, rb, TOPK: tl.constexpr, MX: tl.constexpr, DT: tl.constexpr,
                       GN: tl.constexpr, BQ: tl.constexpr, STEP: tl.constexpr, ASM: tl.constexpr, MMA: tl.constexpr,
                       W_FMT: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr):
    """y[t, rb·GN .. rb·GN+GN) (module doc)."""
    rn = rb * GN + tl.arange(0, GN)
    n_ok = rn < ELL
    y = tl.zeros([GN], dtype=tl.float32)
    for j in range(TOPK):           # slot order: the sum is deterministic
        p = t * TOPK + j
        e = tl.load(ids_ptr + p)
        if (e >= 0) & (e < E):
            wt = tl.load(wt_ptr + p).to(tl.float32)
            x_row = h_ptr + p.to(tl.int64) * stride_h
            if MMA:
                col_ok = tl.arange(0, 16) == 0
                cols_ptr = (x_row + tl.zeros([16], dtype=tl.int64))[:, None]
                acc = tl.zeros([GN, 16], dtype=tl.float32)
                for k0 in range(0, INTER, STEP):
                    b0, b1, b2, b3 = _load_bt(cols_ptr, col_ok, k0, INTER, W_FMT, DT, STEP)
                    acc = _mma_step_t(acc, b0, b1, b2, b3, w2_ptr, s2_ptr, e * stride_we, e * stride_se, rn, n_ok, k0,
                                      INTER, stride_wn, stride_sn, 0, GN, STEP, W_FMT, IEEE, DT, WIDE, 0, 0)
                o = tl.sum(acc, 1)
            else:
                w_rows = w2_ptr + e * stride_we + rn[:, None].to(tl.int64) * stride_wn
                s_rows = s2_ptr + e * stride_se + rn[:, None].to(tl.int64) * stride_sn
                acc = tl.zeros([GN, BQ], dtype=tl.float32)
                for k0 in range(0, INTER, STEP):
                    x0, x1, x2, x3, x4, x5, x6, x7 = _x_cols(x_row, k0, INTER, MX, BQ)
                    acc = _gemv_step(acc, w_rows, s_rows, n_ok, k0, INTER, x0, x1, x2, x3, x4, x5, x6, x7, MX, BQ, ASM)
                o = tl.sum(acc, 1)
                if MX:
                    o = o * UNBIAS
            y += wt * o.to(DT).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * stride_y + rn, y, mask=n_ok)


def gemv_experts(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1, w2, w3, act: str, beta1, beta2,
                 cfg: dict, kernels=("gate_up", "down")) -> torch.Tensor:
    """y f32 [T, l] of `ir.ref.moe.moe_experts` by the per-pair path (module doc); cfg: GN, GK (gate-up rows
    and K columns per program step), GN2, GK2 (down), GMMA (inner products on the tensor cores), GASM (the
    FFMA path's PTX decode, CUDA), GPROG (programs striding over the tiles; 0: one a tile), num_warps (GW2:
    the down kernel's, default the same), num_stages; GV=2 options: _moe_gemv_words._gemv_v2; GLUON (GKS, GNW,
    GKS2, GNW2): _moe_gemv_gluon. `kernels`: which GV=2 launches run (timing them apart, bench_moe.py)."""
    T, ell = z.shape
    K = ids.shape[1]
    E, inter = int(w1.shape[0]), int(w1.shape[1])
    # GMMA: the tensor cores take the inner product (PTX 16-bit-word decode on CUDA bf16, else Triton's)
    mma = ("asm16" if z.is_cuda and z.dtype == torch.bfloat16 else "bytes16") if cfg.get("GMMA") else None
    g1, g3, g2 = (_gemv_weight(w, n, s, mma, z.dtype) for w, n, s in (
        (w1, "w1", (E, inter, ell)), (w3, "w3", (E, inter, ell)), (w2, "w2", (E, ell, inter))))
    if g1 is None or g2 is None or g3 is None:
        raise ValueError("experts (gemv path): packed MXFP4 bytes must be 4-byte aligned along K")
    if g1[0] != g3[0] or g1[3] != g3[3] or g1[4] != g3[4]:
        raise ValueError("experts: w1 and w3 must share storage format and strides (read in one pass)")
    ids = ids if ids.is_contiguous() else ids.contiguous()
    weights = weights if weights.is_contiguous() else weights.contiguous()
    y = torch.empty(T, ell, dtype=torch.float32, device=z.device)
    P = T * K
    if P == 0 or ell == 0:
        return y.zero_()
    glu = dict(ACT=0 if act == "situ" else 1, HAS_BETA2=act == "situ" and beta2 is not None)
    betas = (1.0 if beta1 is None else float(beta1), 1.0 if beta2 is None else float(beta2))
    if int(cfg.get("GV", 1)) == 2 and g1[0] and g2[0] and mma is None:      # MXFP4 words: the GV=2 kernels
        act_kw = dict(betas=betas, **glu)
        mode = _gluon.usable(z, g1, g3, cfg, g2)
        if mode:        # GLUON: the gate-up (1) or both kernels (2) on the tensor cores (_moe_gemv_gluon)
            h = torch.empty(P, inter, dtype=torch.float32 if mode == 1 else z.dtype, device=z.device)
            if "gate_up" in kernels:
                late = cfg.get("LATE", 0) if _gv2._late_override is None else _gv2._late_override
                _gluon.gate_up(z, ids, g1, g3, h, act_kw, cfg, late=bool(late))
            if mode == 2 and "down" in kernels:
                _gluon.down(h, weights, ids, g2, y, cfg)
            elif mode == 1:
                _gemv_v2(z, weights, ids, g1, g3, g2, y, act_kw, {**cfg, "HX": 1},
                         tuple(k for k in kernels if k == "down"), h=h)
        else:
            _gemv_v2(z, weights, ids, g1, g3, g2, y, act_kw, cfg, kernels)
        return y
    h = torch.empty(P, inter, dtype=z.dtype, device=z.device)
    launch = dict(num_warps=int(cfg.get("num_warps", 4)), num_stages=int(cfg.get("num_stages", 1)),
                  ASM=bool(cfg.get("GASM", 0)) and z.is_cuda, MMA=mma is not None,   # inline PTX: CUDA only
                  IEEE=z.dtype == torch.float32, **launch_kwargs())
    least = 64 if mma else 8            # MMA: K quarters of >= 16 columns, rows >= 16
    gn, gn2 = int(cfg.get("GN", 16)), int(cfg.get("GN2", 16))
    if mma:
        gn, gn2 = max(16, gn), max(16, gn2)
    st1, st2 = _step(cfg.get("GK", 512), ell, least), _step(cfg.get("GK2", 512), inter, least)
    bq1, bq2 = (st1 // 8 if g1[0] else st1), (st2 // 8 if g2[0] else st2)
    dt = _TL[z.dtype]
    tiles1, tiles2 = P * triton.cdiv(inter, gn), T * triton.cdiv(ell, gn2)
    progs = int(cfg.get("GPROG") or 0)      # > 0: that many programs stride over the tiles (else one a tile)
    _gemv_gate_up_kernel[(min(tiles1, progs) if progs else tiles1,)](
        z, ids, g1[1], g3[1], g1[2], g3[2], h, E, ell, inter, z.stride(0), *g1[3], h.stride(0), *betas,
        TOPK=K, MX=g1[0], GN=gn, BQ=bq1, STEP=st1, W_FMT=g1[4], DT=dt, WIDE=g1[5] or g3[5], NP=P, **glu, **launch)
    launch["num_warps"] = int(cfg.get("GW2") or launch["num_warps"])
    _gemv_down_combine_kernel[(min(tiles2, progs) if progs else tiles2,)](
        h, weights, ids, g2[1], g2[2], y, E, ell, inter, h.stride(0), *g2[3], y.stride(0), TOPK=K, MX=g2[0],
        DT=dt, GN=gn2, BQ=bq2, STEP=st2, W_FMT=g2[4], WIDE=g2[5], NT=T, **launch)
    return y
