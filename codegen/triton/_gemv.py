"""Tiles of the GEMM family (gemm.py): the tensor-core tile `gemm_tile` (also used by the kernels that fuse an
epilogue onto a GEMM), the dot-free decode tile `gemv_tile`, the split-K arithmetic and the fixed-order
reduction of split-K partials.

Dot-free tile (`gemv_tile`, config GEMV=1). For the rows m of one BLOCK_M tile (BLOCK_M <= 16: decode
batches) and the columns n of one BLOCK_N tile, over k in [0, K):
    P[m, n, j] = sum_{i} x[m, k0_i + j] * w[n, k0_i + j]        (k0_i = 0, BLOCK_K, 2 BLOCK_K, ... in order)
    y[m, n]    = sum_j P[m, n, j]                                 (one tl.sum over the BLOCK_K lanes at the end)
Products and sums in fp32 (fp64 with an fp64 operand): every operand is widened exactly to fp32 right after
its load, so an fp32 x against bf16 / fp8 weights keeps fp32 accuracy with no tensor-core passes (the dot
path needs X_SPLITS=3 bf16 passes for that). FP8 weights: per-block scales multiply the widened weight
element (q * s, exactly the dequantised value) before the product; per-channel scales multiply y once.
No tensor cores: BLOCK_M FMAs per weight element. At BLOCK_M = 1 this streams the weights at the copy
bandwidth (H200: lm head 20480 x 7168 in 68 us, floor 70), and BLOCK_N can be as small as 1 row per
program, so a decode GEMV fills the GPU without splitting K. The BLOCK_M > 1 form (a [BLOCK_M, BLOCK_N,
BLOCK_K] accumulator) is correct but measured 3-5x slower than 16-row tensor-core tiles at M = 8.

Split-K (config SPLIT_K > 1, never under batch invariance). K is cut into chunks of
    K_CHUNK = ceil(ceil(K / SPLIT_K) / U) * U,      U = BLOCK_K (or the FP8 scale block gk when larger)
so every chunk but the last is a whole number of BLOCK_K steps and starts on a scale block; the launch
has S = ceil(K / K_CHUNK) <= SPLIT_K splits along grid axis 1. Split s reduces its chunk exactly as above
(or as `gemm_tile` does) into an fp32 partial P_s[M, N]; a second kernel then adds them in the fixed order
    y = (((P_0 + P_1) + P_2) + ... + P_{S-1})
and casts to the output dtype. No atomics: the result is bitwise identical run to run, and depends only on
(K, config), never on which program finished first.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from codegen.triton import _precision as precision


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---- numerics chosen from the operands ----------------------------------------------------------
def dot_numerics(x_dtype: torch.dtype, w_dtype: torch.dtype, interpret: bool | None = None,
                 backend: str | None = None) -> dict:
    """DOT_DTYPE / ACC_DTYPE / X_SPLITS / PRECISION for these operand dtypes (not tunables: they fix
    the numerics, the tuner must not trade them for speed). PRECISION is spelled for `backend`
    ('cuda' / 'hip'; default: the backend compiling the kernel, `_precision.backend`)."""
    interpret = interpreting() if interpret is None else interpret
    if torch.float64 in (x_dtype, w_dtype):
        return dict(DOT_DTYPE=tl.float64, ACC_DTYPE=tl.float64, X_SPLITS=1, PRECISION="ieee")
    if interpret:
        return dict(DOT_DTYPE=tl.float32, ACC_DTYPE=tl.float32, X_SPLITS=1, PRECISION="ieee")
    low = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    w_low = low.get(w_dtype) if w_dtype != torch.float8_e4m3fn else low.get(x_dtype, tl.bfloat16)
    if x_dtype in low and w_low is not None and (w_dtype == torch.float8_e4m3fn or w_dtype == x_dtype):
        return dict(DOT_DTYPE=low[x_dtype], ACC_DTYPE=tl.float32, X_SPLITS=1, PRECISION=precision.low_bits())
    if x_dtype == torch.float32 and w_low is not None:
        return dict(DOT_DTYPE=w_low, ACC_DTYPE=tl.float32, X_SPLITS=3, PRECISION=precision.low_bits())
    return dict(DOT_DTYPE=tl.float32, ACC_DTYPE=tl.float32, X_SPLITS=1, PRECISION=precision.precise_fp32(backend))


@triton.jit
def gemm_tile(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn, stride_wk,
              stride_sn, stride_sk, SCALE_MODE: tl.constexpr, SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr,
              DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, X_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
              EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] = x[offs_m, :] @ w[offs_n, :]^T (scales applied), K reduced in BLOCK_K steps
    in increasing k; shared with the kernels that fuse an epilogue onto a GEMM."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN] = w^T tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            wt = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = (offs_k + k0) < K
            xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        wt = wt.to(DOT_DTYPE)
        if SCALE_MODE == 2:  # per-block scales: each K block's partial product is scaled on its own
            part = tl.zeros((BLOCK_M, BLOCK_N), ACC_DTYPE)
        else:
            part = acc
        if X_SPLITS == 1:
            part = tl.dot(xt.to(DOT_DTYPE), wt, part, input_precision=PRECISION, out_dtype=ACC_DTYPE)
        else:  # fp32 x against low-precision w: x = hi + mid (+ lo), each term exact in DOT_DTYPE
            xf = xt.to(tl.float32)
            hi = xf.to(DOT_DTYPE)
            rest = xf - hi.to(tl.float32)
            mid = rest.to(DOT_DTYPE)
            part = tl.dot(hi, wt, part, out_dtype=ACC_DTYPE)
            part = tl.dot(mid, wt, part, out_dtype=ACC_DTYPE)
            if X_SPLITS == 3:
                lo = (rest - mid.to(tl.float32)).to(DOT_DTYPE)
                part = tl.dot(lo, wt, part, out_dtype=ACC_DTYPE)
        if SCALE_MODE == 2:
            s = tl.load(s_ptr + (offs_n // SCALE_GN) * stride_sn + (k0 // SCALE_GK) * stride_sk, mask=n_ok, other=0.0)
            acc += part * s.to(ACC_DTYPE)[None, :]
        else:
            acc = part
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if SCALE_MODE == 1:  # per-output-channel scales
        s = tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)
        acc = acc * s.to(ACC_DTYPE)[None, :]
    return acc


@triton.jit
def _gemv_one_row(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn, stride_wk,
                  stride_sn, stride_sk, SCALE_MODE: tl.constexpr, SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr,
                  ACC_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_M == 1: a [BLOCK_N, BLOCK_K] elementwise accumulator, summed over its K lanes at the end. x is
    loaded as a 1-D row so that it takes the weight tile's layout (no shared-memory layout conversion)."""
    offs_k = tl.arange(0, BLOCK_K)
    row = tl.min(offs_m, axis=0).to(tl.int64)
    row_ok = tl.max(m_ok.to(tl.int32), axis=0) > 0
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk   # [BN, BK]
    x_ptrs = x_ptr + row * stride_xm + offs_k * stride_xk                                       # [BK]
    acc = tl.zeros((BLOCK_N, BLOCK_K), ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0).to(ACC_DTYPE)
            xt = tl.load(x_ptrs, mask=row_ok, other=0.0).to(ACC_DTYPE)
        else:
            k_ok = (offs_k + k0) < K
            wt = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(ACC_DTYPE)
            xt = tl.load(x_ptrs, mask=row_ok & k_ok, other=0.0).to(ACC_DTYPE)
        if SCALE_MODE == 2:
            s = tl.load(s_ptr + (offs_n // SCALE_GN) * stride_sn + (k0 // SCALE_GK) * stride_sk, mask=n_ok, other=0.0)
            wt = wt * s.to(ACC_DTYPE)[:, None]
        acc += wt * xt[None, :]
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
    return tl.sum(acc, axis=1)[None, :]


@triton.jit
def _gemv_rows(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn, stride_wk,
               stride_sn, stride_sk, SCALE_MODE: tl.constexpr, SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr,
               ACC_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """BLOCK_M > 1: a [BLOCK_M, BLOCK_N, BLOCK_K] elementwise accumulator (each weight element read once)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk   # [BN, BK]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk   # [BM, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0).to(ACC_DTYPE)
            xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0).to(ACC_DTYPE)
        else:
            k_ok = (offs_k + k0) < K
            wt = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(ACC_DTYPE)
            xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(ACC_DTYPE)
        if SCALE_MODE == 2:
            s = tl.load(s_ptr + (offs_n // SCALE_GN) * stride_sn + (k0 // SCALE_GK) * stride_sk, mask=n_ok, other=0.0)
            wt = wt * s.to(ACC_DTYPE)[:, None]
        acc += xt[:, None, :] * wt[None, :, :]
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
    return tl.sum(acc, axis=2)


@triton.jit
def gemv_tile(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn, stride_wk,
              stride_sn, stride_sk, SCALE_MODE: tl.constexpr, SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr,
              ACC_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] = x[offs_m, :K] @ w[offs_n, :K]^T without tl.dot (module docstring: the order);
    the same operands and scale conventions as `gemm.gemm_tile`."""
    if BLOCK_M == 1:
        acc = _gemv_one_row(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                            stride_wk, stride_sn, stride_sk, SCALE_MODE, SCALE_GN, SCALE_GK, ACC_DTYPE, EVEN_K,
                            BLOCK_N, BLOCK_K)
    else:
        acc = _gemv_rows(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                         stride_wk, stride_sn, stride_sk, SCALE_MODE, SCALE_GN, SCALE_GK, ACC_DTYPE, EVEN_K,
                         BLOCK_M, BLOCK_N, BLOCK_K)
    if SCALE_MODE == 1:  # per-output-channel scales
        s = tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)
        acc = acc * s.to(ACC_DTYPE)[None, :]
    return acc


@triton.jit
def splitk_reduce_kernel(p_ptr, y_ptr, M, N, stride_ym, stride_yn, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, n] = (((P_0 + P_1) + P_2) + ...)[m, n] cast to y's dtype; partials P [SPLIT_K, M, N] contiguous."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mn = M * N
    ok = offs < mn
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * mn + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    tl.store(y_ptr + m * stride_ym + n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=ok)


def k_chunk(K: int, block_k: int, split_k: int, scale_gk: int = 0) -> tuple[int, int]:
    """(K_CHUNK, S): the chunk of K each split reduces (a multiple of BLOCK_K, and of the FP8 scale block
    gk when there is one) and the number of non-empty splits S <= SPLIT_K that cover [0, K)."""
    if split_k < 1 or block_k < 1:
        raise ValueError(f"split-K needs SPLIT_K >= 1 and BLOCK_K >= 1, found {split_k}, {block_k}")
    unit = max(block_k, scale_gk or 0)
    chunk = -(-(-(-K // split_k)) // unit) * unit
    return chunk, -(-K // chunk)


def reduce_partials(partials, out) -> None:
    """out[M, N] = sum of partials[S, M, N] over S in increasing order (one launch, fixed order)."""
    S, M, N = partials.shape
    block = 1024
    splitk_reduce_kernel[(triton.cdiv(M * N, block),)](partials, out, M, N, out.stride(0), out.stride(1),
                                                      SPLIT_K=S, BLOCK=block, num_warps=4)
