"""Per-pair decode path of the routed experts (moe_grouped_gemm.py, config PATH="gemv"): no permutation,
two launches, programs only for routed (pair, row block) and (token, row block) pairs. Not a kernel
family (no TEMPLATES).

    gate-up      h[p, n] = act(Σ_k W1_e[n,k] z_t[k], Σ_k W3_e[n,k] z_t[k])     p = t·K + j, e = ids[t,j]
                 grid (T·K, ceil(I / GN)); pairs whose expert is outside [0, E) exit at once
    down+combine y[t, n] = Σ_j w[t,j] · rnd(Σ_i W2_{e_j}[n,i] h[t·K+j, i])      slots in order, fp32
                 grid (T, ceil(l / GN2)); rnd = rounding to z's dtype (the reference's per-pair
                 outputs); slots whose expert is outside [0, E) (another EP rank's) add 0

Each program reduces its GN rows over the whole K in steps of GK columns. Two inner products (GMMA):
  0, dot-free FFMA: a [GN, GK/8] tile of int32 words per weight (coalesced along K), the activation
     columns from L1/L2, products summed elementwise in a [GN, GK/8] fp32 accumulator, reduced across
     K once at the end. MXFP4 (packed bytes [E, N, K/2] as int32 words of 8 E2M1 codes: K columns
     8q .. 8q+7, code c in bits 4c..4c+3; E8M0 bytes [E, N, K/32]): codes c and c+4 sit at the same
     offset of the word's two 16-bit halves, so ONE shift and mask per field put both into fp16 fields
     (sign -> bit 15, e e m -> bits 11..9): each half is exactly E2M1(code) · 2^-14 as an fp16 (code 1
     a subnormal), converted to fp32 and multiplied by activation column 8q + c (+ 4); per word the 8
     products are summed, times the block factor 2^(s-127) (fp32 bits s << 23: exact for s in 1..254;
     s = 0, 2^-127, gives 0); the reduced sum times 2^14. GASM: the same placement as PTX that converts
     each register half directly (Triton's int16 route re-packs halves first). Dense weights: w · x.
  1, tensor cores: the grouped kernels' MMA step (_moe_tiles._mma_step_t: weights decoded in registers
     as the MMA's M side; PTX 16-bit-word decode for bf16 on CUDA) against [activation row, 15 zero
     columns]: column 0 is the product, the row sum adds exact zeros. The packed tiles pass through
     cp.async stages (num_stages), so the bytes in flight do not cost registers.
GPROG > 0 launches that many programs, each striding over the tiles (else one program a tile). The
reduction order of an output element depends only on the config and K, not on the batch: a token's
result is batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.triton._moe_host import _TL, _kernel_weight, _weight
from codegen.triton._moe_tiles import _glu, _load_bt, _mma_step_t

SIGN2 = tl.constexpr(0x80008000 - (1 << 32))     # bits 15 and 31 (as a signed int32)
MAG2 = tl.constexpr(0x0E000E00)                   # bits 9..11 and 25..27
UNBIAS = tl.constexpr(16384.0)                    # 2^14: the fp16 fields hold E2M1 · 2^-14


def _code_pair_ptx(c: int) -> tl.constexpr:
    """The same placement as _code_pair in PTX ($2 the word; $0, $1 codes c and c+4 as fp32): two shifts,
    and-or, then each 16-bit half converted straight from its register half (cvt.f32.f16), where
    Triton's int16 route re-packs halves of different words first (a PRMT per 2 codes)."""
    sa, sb = 12 - 4 * c, 9 - 4 * c
    sign = f"shl.b32 a, $2, {sa};\nand.b32 a, a, 0x80008000;" if sa else "and.b32 a, $2, 0x80008000;"
    mag = (f"shl.b32 b, $2, {sb};" if sb > 0 else f"shr.b32 b, $2, {-sb};") + "\nand.b32 b, b, 0x0E000E00;"
    return tl.constexpr("{\n.reg .b32 a, b;\n.reg .b16 l, h;\n" + sign + "\n" + mag + "\nor.b32 a, a, b;\n"
                        "mov.b32 {l, h}, a;\ncvt.f32.f16 $0, l;\ncvt.f32.f16 $1, h;\n}")


CODE_PAIR_PTX = (_PTX_0, _PTX_1, _PTX_2, _PTX_3) = tuple(_code_pair_ptx(c) for c in range(4))


@triton.jit
def _code_pair_asm(w, C: tl.constexpr):
    """_code_pair by CODE_PAIR_PTX[C] (CUDA only)."""
    if C == 0:
        return tl.inline_asm_elementwise(_PTX_0, "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    elif C == 1:
        return tl.inline_asm_elementwise(_PTX_1, "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    elif C == 2:
        return tl.inline_asm_elementwise(_PTX_2, "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_PTX_3, "=r,=r,r", [w], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _codes(w, C: tl.constexpr, ASM: tl.constexpr):
    if ASM:
        return _code_pair_asm(w, C)
    else:
        return _code_pair(w, C)


@triton.jit
def _code_pair(w, C: tl.constexpr):
    """Codes C and C+4 of int32 words w as fp32 (E2M1 value · 2^-14, exact): one shift per field."""
    SA: tl.constexpr = 12 - 4 * C       # sign bit 4C+3 -> 15 (and 4C+19 -> 31)
    SB: tl.constexpr = 9 - 4 * C        # e e m bits 4C..4C+2 -> 9..11 (and 25..27)
    if SA > 0:
        sgn = w << SA
    else:
        sgn = w
    if SB > 0:
        mag = w << SB
    else:
        mag = w >> (-SB)
    h = (sgn & SIGN2) | (mag & MAG2)
    lo = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _x_cols(x_row, k0, K, MX: tl.constexpr, BQ: tl.constexpr):
    """Activation columns of one K step as fp32: MX: x[k0 + 8q + c] for c = 0..7 (eight [BQ] vectors,
    q over the step's words); dense: x[k0 .. k0+BQ] (one vector, the other seven unused)."""
    if MX:
        col = k0 + 8 * tl.arange(0, BQ)
        ok = col < K
        x0 = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(x_row + col + 1, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + col + 2, mask=ok, other=0.0).to(tl.float32)
        x3 = tl.load(x_row + col + 3, mask=ok, other=0.0).to(tl.float32)
        x4 = tl.load(x_row + col + 4, mask=ok, other=0.0).to(tl.float32)
        x5 = tl.load(x_row + col + 5, mask=ok, other=0.0).to(tl.float32)
        x6 = tl.load(x_row + col + 6, mask=ok, other=0.0).to(tl.float32)
        x7 = tl.load(x_row + col + 7, mask=ok, other=0.0).to(tl.float32)
        return x0, x1, x2, x3, x4, x5, x6, x7
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
                         W_FMT: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr, NP):
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
                              WIDE: tl.constexpr, NT):
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


def _int32_view(q: torch.Tensor) -> torch.Tensor | None:
    """Packed MXFP4 bytes [E, N, K/2] as int32 words [E, N, K/8], or None when not 4-byte aligned."""
    try:
        return None if q.shape[-1] % 4 or q.data_ptr() % 4 else q.view(torch.int32)
    except RuntimeError:        # a stride or the storage offset is not a multiple of 4 bytes
        return None


def _gemv_weight(w, name: str, shape: tuple, mma: str | None, act_dtype):
    """(MX, weight arg, scale arg, (stride_e, stride_n, scale stride_e, scale stride_n), W_FMT, WIDE) or None
    when the packed bytes cannot be read as int32 words. mma: None (FFMA path: int32 words) or the DEQ
    mode of _moe_host._kernel_weight whose operands the MMA step reads."""
    fmt, q, s = _weight(w, name, shape)
    if mma is not None:
        code, qa, sa, st, wide = _kernel_weight(fmt, q, s, mma, act_dtype)
        return fmt == "mxfp4", qa, sa, st, code, wide
    if fmt == "dense":
        return False, q, q, (q.stride(0), q.stride(1), 0, 0), 0, False
    q32 = _int32_view(q)
    if q32 is None:
        return None
    return True, q32, s, (q32.stride(0), q32.stride(1), s.stride(0), s.stride(1)), 0, False


def gemv_supported(w1, w2, w3) -> bool:
    """The GEMV path reads MXFP4 bytes as int32 words: every packed weight must allow that view."""
    for w in (w1, w2, w3):
        q = getattr(w, "packed", None)
        if q is not None and (q.stride(-1) != 1 or _int32_view(q) is None):
            return False
    return True


def _step(gk: int, K: int, least: int) -> int:
    """K columns per step: GK (at least `least`), halved while a half still covers K."""
    gk = max(least, int(gk))
    while gk > least and gk // 2 >= K:
        gk //= 2
    return gk


def gemv_experts(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1, w2, w3, act: str, beta1, beta2,
                 cfg: dict) -> torch.Tensor:
    """y f32 [T, l] of `ir.ref.moe.moe_experts` by the per-pair path (module doc); cfg: GN, GK (gate-up rows
    and K columns per program step), GN2, GK2 (down), GMMA (inner products on the tensor cores), GASM (the
    FFMA path's PTX decode, CUDA), GPROG (programs striding over the tiles; 0: one a tile), num_warps (GW2:
    the down kernel's, default the same), num_stages."""
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
    h = torch.empty(P, inter, dtype=z.dtype, device=z.device)
    launch = dict(num_warps=int(cfg.get("num_warps", 4)), num_stages=int(cfg.get("num_stages", 1)),
                  ASM=bool(cfg.get("GASM", 0)) and z.is_cuda, MMA=mma is not None,   # inline PTX: CUDA only
                  IEEE=z.dtype == torch.float32)
    least = 64 if mma else 8            # MMA: K quarters of >= 16 columns, rows >= 16
    gn, gn2 = int(cfg.get("GN", 16)), int(cfg.get("GN2", 16))
    if mma:
        gn, gn2 = max(16, gn), max(16, gn2)
    st1, st2 = _step(cfg.get("GK", 512), ell, least), _step(cfg.get("GK2", 512), inter, least)
    bq1, bq2 = (st1 // 8 if g1[0] else st1), (st2 // 8 if g2[0] else st2)
    glu = dict(ACT=0 if act == "situ" else 1, HAS_BETA2=act == "situ" and beta2 is not None)
    betas = (1.0 if beta1 is None else float(beta1), 1.0 if beta2 is None else float(beta2))
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
