"""Grouped expert GEMMs for IR op `moe_experts` (SPEC §6), MXFP4 weights read exactly as loaded.

    y[t] = Σ_j w[t,j] · W2_e act(W1_e z_t, W3_e z_t),   e = ids[t,j]
    act = SiTU-GLU  β1·tanh(a/β1)·sigmoid(a) · β2·tanh(u/β2)   (β2 absent: · u)   | SwiGLU silu(a)·u

Pipeline (no host sync, deterministic, no atomics):
  1. `permute_tokens` (moe_router.py): routed pairs p = t·k + j grouped by expert.
  2. gate-up kernel: a tile = BM consecutive pairs of one expert × BN columns of I; w1 and w3 tiles are
     read in the same K loop (two accumulators) and act(a, u) is applied in the epilogue;
     h [T·k, I] is written in expert-sorted row order.
  3. down kernel: the same tiling over h and W2_e; per-pair outputs o [T·k, ℓ] stored at row p.
  4. combine kernel: y[t] = Σ_j w[t,j]·o[t·k+j] in slot order, fp32 (pairs whose id is outside
     [0, E), i.e. held by another EP rank, contribute 0).
Tiles exist only for experts with tokens: program `tid` finds its expert from the per-expert tile
counts ceil(count_e / BM) (a cumsum over E in registers); programs past the last tile exit at once,
so experts with no tokens launch no work. No split-K: every output element's reduction runs over
K in BK steps in one program, so with a config fixed independently of T (`batch_invariant`) a
token's result does not depend on the batch.

Weights (w1, w3 [E, I, ℓ]; w2 [E, ℓ, I]) are either float tensors (bf16/fp16/fp32, cast to z's
dtype per tile) or `PackedMXFP4` (packed u8 [E, N, K/2], low nibble = even element; scales u8
E8M0 [E, N, K/32]). MXFP4 is dequantised in registers:
  - DEQ "arith" (any target, the interpreter too): byte b -> the E2M1 code's sign and 3 magnitude bits
    placed as fp16 bits (sign -> bit 15, magnitude -> bits 9..11: fp16 value = E2M1 value · 2^-14, exact,
    subnormal for code 1), then · 2^(s-127+14) with the factor built from the scale's bits (exact for
    s ≤ 240), then cast to z's dtype (exact in bf16) and fed to tl.dot;
  - DEQ "dot_scaled": `tl.dot_scaled(z, None, "bf16", packed, scales, "e2m1")` — Triton lowers it to its
    own fp4->bf16 upcast on sm_90 and sm_100 with bf16 activations (native block-scaled MMA would need
    fp8/fp4 activations, which would change the numerics). Not executable by the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton.moe_router import ExpertSegments, permute_tokens
from ir.packed import PackedMXFP4

DENSE, MX_ARITH, MX_DOT_SCALED = 0, 1, 2


# ------------------------------------------------------------------------------------ jit helpers
@triton.jit
def _locate_tile(counts_ptr, offsets_ptr, tid, E, E_PAD: tl.constexpr, BM: tl.constexpr):
    """Tile `tid` of the expert-sorted pairs -> (tiles in all, expert, first row of expert, m0, rows)."""
    ev = tl.arange(0, E_PAD)
    cnt = tl.load(counts_ptr + ev, mask=ev < E, other=0)
    tiles = (cnt + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)
    e = tl.minimum(tl.sum((cum <= tid).to(tl.int32), 0), E - 1)
    sel = ev == e
    first = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    rows = tl.sum(tl.where(sel, cnt, 0), 0)
    return tl.sum(tiles, 0), e, tl.load(offsets_ptr + e), (tid - first) * BM, rows


@triton.jit
def _swizzle(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """Program id -> (m tile, n block), GROUP_M m tiles sweeping all n blocks together, so the
    activation rows of a group stay in L2 while every weight column block passes over them."""
    width = GROUP_M * n_n
    first = (pid // width) * GROUP_M
    rows = tl.minimum(n_m - first, GROUP_M)
    return first + (pid % width) % rows, (pid % width) // rows


@triton.jit
def _mxfp4_halves_t(q_ptr, s_ptr, qbase, sbase, rn, n_ok, k0, K, stride_qn, stride_sn,
                    BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """Dequantised even and odd K columns ([BK/2, BN] each) of an MXFP4 matrix stored [N, K/2] (+ scales
    [N, K/32]) for K columns k0 .. k0+BK: byte j holds column 2j (low nibble) and 2j+1 (high nibble).
    Splitting by parity spares the interleave: the caller dots them with z's even and odd columns."""
    G: tl.constexpr = BK // 32
    gi = k0 // 32 + tl.arange(0, G)
    g_ok = n_ok[:, None] & (gi < K // 32)[None, :]
    q = tl.load(q_ptr + qbase + rn[:, None, None].to(tl.int64) * stride_qn + gi[None, :, None] * 16
                + tl.arange(0, 16)[None, None, :], mask=g_ok[:, :, None], other=0).to(tl.int32)   # [BN, G, 16]
    s = tl.load(s_ptr + sbase + rn[:, None].to(tl.int64) * stride_sn + gi[None, :], mask=g_ok, other=0).to(tl.int32)
    if DT == tl.bfloat16:
        # sign -> bit 15, magnitude e e m -> bits 8..6: bf16 value = E2M1 value · 2^-126 (code 1 subnormal);
        # times 2^126, then times 2^(s-127) built from the scale's bits (exact for 1 <= s <= 254)
        f = (s << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)[:, :, None]
        lo = (((q << 28) >> 22) & 0x81C0).to(tl.int16).to(tl.bfloat16, bitcast=True) * 8.507059e37 * f
        hi = (((q << 24) >> 22) & 0x81C0).to(tl.int16).to(tl.bfloat16, bitcast=True) * 8.507059e37 * f
    else:
        # sign -> bit 15, magnitude -> bits 11..9 of an fp16: value · 2^-14 (exact), times 2^(s-127+14)
        f = ((s + 14) << 23).to(tl.float32, bitcast=True)[:, :, None]
        lo = ((((q << 28) >> 19) & 0x8E00).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * f).to(DT)
        hi = ((((q << 24) >> 19) & 0x8E00).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * f).to(DT)
    return tl.trans(tl.reshape(lo, (BN, BK // 2))), tl.trans(tl.reshape(hi, (BN, BK // 2)))


@triton.jit
def _weight_tile_t(w_ptr, s_ptr, wbase, sbase, rn, n_ok, k0, K, stride_wn, stride_sn,
                   BN: tl.constexpr, BK: tl.constexpr, W_FMT: tl.constexpr, DT: tl.constexpr):
    if W_FMT == 0:
        rk = k0 + tl.arange(0, BK)
        return tl.load(w_ptr + wbase + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                       mask=n_ok[None, :] & (rk < K)[:, None], other=0.0).to(DT)
    else:
        return _mxfp4_tile_t(w_ptr, s_ptr, wbase, sbase, rn, n_ok, k0, K, stride_wn, stride_sn, BN, BK, DT)


@triton.jit
def _scaled_dot(a, q_ptr, s_ptr, qbase, sbase, rn, n_ok, k0, K, stride_qn, stride_sn, acc, BK: tl.constexpr):
    """acc += a @ dequant(W[rn, k0:k0+BK])^T through tl.dot_scaled (bf16 a, e2m1 W)."""
    kb = k0 // 2 + tl.arange(0, BK // 2)
    q = tl.load(q_ptr + qbase + rn[None, :].to(tl.int64) * stride_qn + kb[:, None],
                mask=n_ok[None, :] & (kb < K // 2)[:, None], other=0)
    gi = k0 // 32 + tl.arange(0, BK // 32)
    s = tl.load(s_ptr + sbase + rn[:, None].to(tl.int64) * stride_sn + gi[None, :],
                mask=n_ok[:, None] & (gi < K // 32)[None, :], other=0)
    return tl.dot_scaled(a, None, "bf16", q, s, "e2m1", acc, fast_math=True)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _glu(a, u, beta1, beta2, ACT: tl.constexpr, HAS_BETA2: tl.constexpr):
    """ACT 0: SiTU-GLU β1·tanh(a/β1)·sigmoid(a) · (β2·tanh(u/β2) | u);  ACT 1: SwiGLU silu(a)·u."""
    if ACT == 0:
        gate = beta1 * _tanh(a / beta1) * tl.sigmoid(a)
        if HAS_BETA2:
            u = beta2 * _tanh(u / beta2)
    else:
        gate = a * tl.sigmoid(a)
    return gate * u


# ---------------------------------------------------------------------------------------- kernels
@triton.jit
def _moe_gate_up_kernel(z_ptr, pair_ptr, counts_ptr, offsets_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
                        E, ELL, INTER, stride_z, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                        beta1, beta2, N_TILES, TOPK: tl.constexpr, E_PAD: tl.constexpr, W_FMT: tl.constexpr,
                        ACT: tl.constexpr, HAS_BETA2: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    tid, nb = _swizzle(tl.program_id(0), N_TILES, tl.cdiv(INTER, BN), GROUP_M)
    total, e, row0, m0, rows = _locate_tile(counts_ptr, offsets_ptr, tid, E, E_PAD, BM)
    if tid >= total:
        return
    rm = m0 + tl.arange(0, BM)
    row_ok = rm < rows
    pos = row0 + rm
    tok = tl.load(pair_ptr + pos, mask=row_ok, other=0) // TOPK
    rn = nb * BN + tl.arange(0, BN)
    n_ok = rn < INTER
    rk = tl.arange(0, BK)
    a_ptrs = z_ptr + tok.to(tl.int64)[:, None] * stride_z + rk[None, :]
    wbase = e.to(tl.int64) * stride_we
    sbase = e.to(tl.int64) * stride_se
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, ELL, BK):
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & (k0 + rk < ELL)[None, :], other=0.0).to(DT)
        if W_FMT == 2:
            acc1 = _scaled_dot(a, w1_ptr, s1_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn, stride_sn, acc1, BK)
            acc3 = _scaled_dot(a, w3_ptr, s3_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn, stride_sn, acc3, BK)
        else:
            b1 = _weight_tile_t(w1_ptr, s1_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn, stride_sn, BN, BK, W_FMT, DT)
            acc1 = _dot(a, b1, acc1, IEEE)
            b3 = _weight_tile_t(w3_ptr, s3_ptr, wbase, sbase, rn, n_ok, k0, ELL, stride_wn, stride_sn, BN, BK, W_FMT, DT)
            acc3 = _dot(a, b3, acc3, IEEE)
    h = _glu(acc1, acc3, beta1, beta2, ACT, HAS_BETA2)
    tl.store(h_ptr + pos.to(tl.int64)[:, None] * stride_h + rn[None, :], h.to(DT),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, pair_ptr, counts_ptr, offsets_ptr, w2_ptr, s2_ptr, o_ptr,
                     E, ELL, INTER, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o, N_TILES,
                     E_PAD: tl.constexpr, W_FMT: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    tid, nb = _swizzle(tl.program_id(0), N_TILES, tl.cdiv(ELL, BN), GROUP_M)
    total, e, row0, m0, rows = _locate_tile(counts_ptr, offsets_ptr, tid, E, E_PAD, BM)
    if tid >= total:
        return
    rm = m0 + tl.arange(0, BM)
    row_ok = rm < rows
    pos = row0 + rm
    pair = tl.load(pair_ptr + pos, mask=row_ok, other=0)
    rn = nb * BN + tl.arange(0, BN)
    n_ok = rn < ELL
    rk = tl.arange(0, BK)
    a_ptrs = h_ptr + pos.to(tl.int64)[:, None] * stride_h + rk[None, :]
    wbase = e.to(tl.int64) * stride_we
    sbase = e.to(tl.int64) * stride_se
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & (k0 + rk < INTER)[None, :], other=0.0).to(DT)
        if W_FMT == 2:
            acc = _scaled_dot(a, w2_ptr, s2_ptr, wbase, sbase, rn, n_ok, k0, INTER, stride_wn, stride_sn, acc, BK)
        else:
            b = _weight_tile_t(w2_ptr, s2_ptr, wbase, sbase, rn, n_ok, k0, INTER, stride_wn, stride_sn, BN, BK, W_FMT, DT)
            acc = _dot(a, b, acc, IEEE)
    tl.store(o_ptr + pair.to(tl.int64)[:, None] * stride_o + rn[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_combine_kernel(o_ptr, w_ptr, ids_ptr, gain_ptr, y_ptr, T, E, ELL, stride_o, stride_y, eps,
                        TOPK: tl.constexpr, BT: tl.constexpr, BL: tl.constexpr, NORM: tl.constexpr,
                        HAS_GAIN: tl.constexpr):
    """y = Σ_j w[t,j]·o[t·k+j] (fp32, slot order); NORM: y / sqrt(mean(y²) + eps) · gain (BL ≥ ℓ)."""
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rl = tl.program_id(1) * BL + tl.arange(0, BL)
    t_ok = rt < T
    l_ok = rl < ELL
    y = tl.zeros([BT, BL], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pj = rt.to(tl.int64) * TOPK + j
        ej = tl.load(ids_ptr + pj, mask=t_ok, other=-1)
        wj = tl.load(w_ptr + pj, mask=t_ok, other=0.0).to(tl.float32)
        ok = t_ok & (ej >= 0) & (ej < E)
        oj = tl.load(o_ptr + pj[:, None] * stride_o + rl[None, :], mask=ok[:, None] & l_ok[None, :], other=0.0)
        y += wj[:, None] * oj.to(tl.float32)
    if NORM:
        y = y / tl.sqrt(tl.sum(y * y, 1) / ELL + eps)[:, None]
        if HAS_GAIN:
            y = y * tl.load(gain_ptr + rl, mask=l_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rt.to(tl.int64)[:, None] * stride_y + rl[None, :], y.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & l_ok[None, :])


# ------------------------------------------------------------------------------------------ host
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _weight(w, name: str, shape: tuple) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """('mxfp4', packed, scales) | ('dense', tensor, None), checking the logical shape [E, N, K]."""
    if isinstance(w, PackedMXFP4):
        fmt, q, s = "mxfp4", w.packed, w.scales
        if q.stride(-1) != 1 or s.stride(-1) != 1:
            raise ValueError(f"{name}: MXFP4 packed/scales must be contiguous along K")
    elif isinstance(w, torch.Tensor) and w.is_floating_point():
        fmt, q, s = "dense", (w if w.stride(-1) == 1 else w.contiguous()), None
    else:
        raise TypeError(f"{name}: expected a float tensor or PackedMXFP4, found {type(w).__name__}"
                        f"{'' if not isinstance(w, torch.Tensor) else ' of ' + str(w.dtype)}")
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name}: expected logical shape {list(shape)}, found {list(w.shape)}")
    return fmt, q, s


def _fmt_code(fmt: str, deq: str, act_dtype: torch.dtype) -> int:
    if fmt == "dense":
        return DENSE
    if deq == "dot_scaled":
        if act_dtype != torch.bfloat16:
            raise ValueError(f"DEQ=dot_scaled needs bf16 activations, found {act_dtype}")
        return MX_DOT_SCALED
    if deq != "arith":
        raise ValueError(f"DEQ must be 'arith' or 'dot_scaled', found {deq!r}")
    return MX_ARITH


def expert_pair_outputs(z: torch.Tensor, ids: torch.Tensor, w1, w2, w3, act: str, beta1: float | None = None,
                        beta2: float | None = None, config: dict | None = None,
                        segments: ExpertSegments | None = None) -> tuple[torch.Tensor, ExpertSegments]:
    """o [T·k, ℓ] (z's dtype): o[t·k+j] = W2_e act(W1_e z_t, W3_e z_t), e = ids[t,j]; rows of pairs
    whose expert is outside [0, E) are left unwritten (the combine skips them)."""
    if act not in ("situ", "silu"):
        raise ValueError(f"expert activation must be 'situ' or 'silu', found {act!r}")
    if z.dim() != 2 or ids.dim() != 2 or ids.shape[0] != z.shape[0]:
        raise ValueError(f"experts: z must be [T, l] and ids [T, k], found {tuple(z.shape)} and {tuple(ids.shape)}")
    if z.dtype not in _TL:
        raise ValueError(f"experts: z dtype {z.dtype} is not bf16/fp16/fp32")
    T, ell = z.shape
    E, inter = int(w1.shape[0]), int(w1.shape[1])
    f1, q1, s1 = _weight(w1, "w1", (E, inter, ell))
    f3, q3, s3 = _weight(w3, "w3", (E, inter, ell))
    f2, q2, s2 = _weight(w2, "w2", (E, ell, inter))
    if f1 != f3 or (s1 is None and q1.stride() != q3.stride()) or (s1 is not None and (
            q1.stride() != q3.stride() or s1.stride() != s3.stride())):
        raise ValueError("experts: w1 and w3 must share storage format and strides (read in one pass)")
    K = ids.shape[1]
    cfg = {**heuristic(_key(T, E, K, ell, inter, f1 == "mxfp4", z.dtype, config or {}), None), **(config or {})}
    z = z if z.stride(-1) == 1 else z.contiguous()
    seg = segments or permute_tokens(ids, E)
    P = T * K
    dt = _TL[z.dtype]
    h = torch.empty(max(P, 1), inter, dtype=z.dtype, device=z.device)
    o = torch.empty(max(P, 1), ell, dtype=z.dtype, device=z.device)
    if P == 0:
        return o[:0], seg
    e_pad = triton.next_power_of_2(E)
    bm = cfg["BM"]
    max_tiles = triton.cdiv(P, bm) + min(E, P)
    ieee = z.dtype == torch.float32
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    wf1 = _fmt_code(f1, cfg["DEQ"], z.dtype)
    _moe_gate_up_kernel[(max_tiles * triton.cdiv(inter, cfg["BN"]),)](
        z, seg.pair_ids, seg.counts, seg.offsets, q1, q3, s1 if s1 is not None else q1, s3 if s3 is not None else q3, h,
        E, ell, inter, z.stride(0), q1.stride(0), q1.stride(1), s1.stride(0) if s1 is not None else 0,
        s1.stride(1) if s1 is not None else 0, h.stride(0),
        1.0 if beta1 is None else float(beta1), 1.0 if beta2 is None else float(beta2), max_tiles,
        TOPK=K, E_PAD=e_pad, W_FMT=wf1, ACT=0 if act == "situ" else 1, HAS_BETA2=act == "situ" and beta2 is not None,
        IEEE=ieee, DT=dt, BM=bm, BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"], **launch)
    _moe_down_kernel[(max_tiles * triton.cdiv(ell, cfg["BN2"]),)](
        h, seg.pair_ids, seg.counts, seg.offsets, q2, s2 if s2 is not None else q2, o,
        E, ell, inter, h.stride(0), q2.stride(0), q2.stride(1), s2.stride(0) if s2 is not None else 0,
        s2.stride(1) if s2 is not None else 0, o.stride(0), max_tiles,
        E_PAD=e_pad, W_FMT=_fmt_code(f2, cfg["DEQ"], z.dtype), IEEE=ieee, DT=dt, BM=bm, BN=cfg["BN2"],
        BK=cfg["BK2"], GROUP_M=cfg["GROUP_M"], **launch)
    return o, seg


def combine(o: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
            gain: torch.Tensor | None = None, eps: float | None = None, out_dtype=torch.float32,
            block_t: int | None = None) -> torch.Tensor:
    """Σ_j weights[t,j]·o[t·k+j] in fp32 (slot order); with eps: RMS-normalised over ℓ, times gain."""
    T, K = weights.shape
    ell = o.shape[1]
    y = torch.empty(T, ell, dtype=out_dtype, device=o.device)
    if T == 0:
        return y
    norm = eps is not None
    bl = triton.next_power_of_2(ell) if norm else min(1024, triton.next_power_of_2(ell))
    bt = block_t or max(1, min(16, 4096 // bl))
    w = weights if weights.is_contiguous() else weights.contiguous()
    i = ids if ids.is_contiguous() else ids.contiguous()
    _moe_combine_kernel[(triton.cdiv(T, bt), triton.cdiv(ell, bl))](
        o, w, i, gain if gain is not None else o, y, T, num_experts, ell, o.stride(0), y.stride(0),
        float(eps) if norm else 0.0, TOPK=K, BT=bt, BL=bl, NORM=norm, HAS_GAIN=gain is not None, num_warps=4)
    return y


def moe_experts(z, weights, ids, w1, w2, w3, act: str, beta1=None, beta2=None, config: dict | None = None):
    """Drop-in for `ir.ref.moe.moe_experts`: y f32 [T, ℓ]."""
    o, seg = expert_pair_outputs(z, ids, w1, w2, w3, act, beta1, beta2, config)
    return combine(o, weights, ids, seg.num_experts)


# --------------------------------------------------------------------------------------- template
BATCH_INVARIANT_CONFIG = {"BM": 64, "BN": 64, "BK": 64, "BN2": 64, "BK2": 64, "num_warps": 4, "num_stages": 3,
                          "GROUP_M": 8, "DEQ": "arith"}


def target_cc(target) -> int | None:
    """Compute capability as major·10 + minor from a target (attr/dict `compute_capability`) or the live GPU."""
    cc = target.get("compute_capability") if isinstance(target, dict) else getattr(target, "compute_capability", None)
    if cc is None:
        if target is None and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor
        return None
    if isinstance(cc, (tuple, list)):
        return int(cc[0]) * 10 + int(cc[1])
    return int(round(float(cc) * 10)) if float(cc) < 20 else int(cc)


def _key(T, E, K, ell, inter, mx: bool, dtype, attrs) -> dict:
    return {"T": int(T), "E": int(E), "K": int(K), "L": int(ell), "I": int(inter), "MX": int(mx),
            "BF16": int(dtype == torch.bfloat16), "BI": int(bool(attrs.get("batch_invariant", False)))}


def key_dims(a, attrs) -> dict:
    T, ell = a.z.shape
    E, inter = a.w1.shape[0], a.w1.shape[1]
    return _key(T, E, a.ids.shape[1], ell, inter, isinstance(a.w1, PackedMXFP4), a.z.dtype, attrs)


def bucket(key: dict) -> dict:
    """T to a power of two; in batch-invariant mode T is dropped: one config serves every batch."""
    return {**key, "T": 0 if key.get("BI") else pow2_bucket(key["T"])}


def _fit_bk(bk: int, K: int, mx: bool) -> int:
    while bk > (32 if mx else 16) and bk > K:
        bk //= 2
    return bk


def heuristic(key: dict, target=None) -> dict:
    if key.get("BI"):
        cfg = dict(BATCH_INVARIANT_CONFIG)
    else:
        per_expert = key["T"] * key["K"] / max(1, key["E"])
        if per_expert <= 16:    # decode: weight-bandwidth bound, one tile of tokens per expert
            cfg = {"BM": 16, "BN": 64, "BK": 128, "BN2": 64, "BK2": 128, "num_warps": 4, "num_stages": 3}
        elif per_expert <= 96:
            cfg = {"BM": 64, "BN": 64, "BK": 64, "BN2": 128, "BK2": 64, "num_warps": 4, "num_stages": 3}
        else:                   # prefill: tensor-core bound
            cfg = {"BM": 128, "BN": 64, "BK": 64, "BN2": 128, "BK2": 64, "num_warps": 8, "num_stages": 3}
        cfg["GROUP_M"] = 8
        cc = target_cc(target)
        cfg["DEQ"] = "dot_scaled" if key["MX"] and key["BF16"] and cc is not None and cc >= 100 else "arith"
    cfg["BK"] = _fit_bk(cfg["BK"], key["L"], key["MX"])
    cfg["BK2"] = _fit_bk(cfg["BK2"], key["I"], key["MX"])
    return cfg


def constraints(config: dict, key: dict, target=None) -> list[str]:
    out = []
    mx = key["MX"]
    for bk in ("BK", "BK2"):
        if mx and config[bk] % 32:
            out.append(f"{bk}={config[bk]} must be a multiple of the MXFP4 block (32)")
    if config["DEQ"] == "dot_scaled":
        cc = target_cc(target)
        if not (mx and key["BF16"]):
            out.append("DEQ=dot_scaled needs MXFP4 weights and bf16 activations")
        if cc is None or cc < 90:
            out.append(f"DEQ=dot_scaled needs a CUDA target of compute capability >= 9.0, found {cc}")
    if key.get("BI") and any(config[k] != v for k, v in BATCH_INVARIANT_CONFIG.items() if k != "DEQ"):
        out.append("batch_invariant: tiles are fixed to BATCH_INVARIANT_CONFIG")
    smem = config["num_stages"] * (config["BM"] * config["BK"] * 2 + 2 * config["BN"] * config["BK"] * 2)
    if smem > 220 * 1024:
        out.append(f"gate-up pipeline needs ~{smem // 1024} KiB of shared memory (> 220)")
    return out


def supports(a, attrs, target=None):
    if attrs.get("act") not in ("situ", "silu"):
        return f"activation {attrs.get('act')!r} is not situ|silu"
    for n in ("w1", "w2", "w3"):
        w = getattr(a, n)
        if not isinstance(w, PackedMXFP4) and not (isinstance(w, torch.Tensor) and w.is_floating_point()):
            return f"{n} is {type(w).__name__}, not a float tensor or PackedMXFP4"
    if isinstance(a.w1, PackedMXFP4) != isinstance(a.w3, PackedMXFP4):
        return "w1 and w3 must share a storage format (they are read in one pass)"
    return None


def launch(a, attrs, config=None):
    cfg = dict(config or {})
    if attrs.get("batch_invariant"):
        cfg.setdefault("batch_invariant", True)
    cfg = {**heuristic(key_dims(a, {**attrs, **cfg}), None), **{k: v for k, v in cfg.items() if k != "batch_invariant"}}
    return moe_experts(a.z, a.weights, a.ids, a.w1, a.w2, a.w3, attrs["act"], attrs.get("beta1"), attrs.get("beta2"), cfg)


TEMPLATES = [KernelTemplate(
    family="moe_grouped_gemm", backend="triton", ops=("moe_experts",), launch=launch, key_dims=key_dims,
    heuristic=heuristic, bucket=bucket, constraints=constraints, supports=supports, batch_invariant=True,
    tunables=(Tunable("BM", (16, 32, 64, 128)), Tunable("BN", (32, 64, 128)), Tunable("BK", (32, 64, 128, 256)),
              Tunable("BN2", (32, 64, 128, 256)), Tunable("BK2", (32, 64, 128, 256)), Tunable("num_warps", (4, 8)),
              Tunable("num_stages", (2, 3, 4, 5)), Tunable("GROUP_M", (1, 4, 8, 16)),
              Tunable("DEQ", ("arith", "dot_scaled"))),
    doc="grouped expert GEMMs: permutation, gate+up with fused SiTU-GLU/SwiGLU, down, fp32 slot-order combine; "
        "MXFP4 dequantised in registers (or tl.dot_scaled)")]
