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
(or as `gemm_tile` does) into an fp32 partial P_s[M, N]; the partials are added in the fixed order
    y = (((P_0 + P_1) + P_2) + ... + P_{S-1})
and casts to the output dtype: in a second launch (`reduce_partials`, COMBINE=0) or in the same launch by
the last split of each output tile to finish (`combine_in_launch`, COMBINE=1: one atomic counter per tile
decides who adds, never what is added or in which order). Either way the result is bitwise identical run to
run and between the two combines, and depends only on (K, config), never on which program finished first.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from codegen.kernel import pow2_bucket
from codegen.triton import _precision as precision
from codegen.triton._pdl import launch_kwargs, pdl_enter


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
                  ACC_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  LOOP_STAGES: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_M == 1: a [BLOCK_N, BLOCK_K] elementwise accumulator, summed over its K lanes at the end. x is
    loaded as a 1-D row so that it takes the weight tile's layout (no shared-memory layout conversion).
    PDL: the first K step is peeled, its weight tile (and FP8 scales) loaded before `pdl_wait`, so the
    weights stream while the previous kernel finishes; x is loaded after (same products, same order)."""
    offs_k = tl.arange(0, BLOCK_K)
    row = tl.min(offs_m, axis=0).to(tl.int64)
    row_ok = tl.max(m_ok.to(tl.int32), axis=0) > 0
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk   # [BN, BK]
    x_ptrs = x_ptr + row * stride_xm + offs_k * stride_xk                                       # [BK]
    acc = tl.zeros((BLOCK_N, BLOCK_K), ACC_DTYPE)
    k_first = 0
    if PDL:
        k_ok = offs_k < K
        wt = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(ACC_DTYPE)
        if SCALE_MODE == 2:
            s = tl.load(s_ptr + (offs_n // SCALE_GN) * stride_sn, mask=n_ok, other=0.0)
            wt = wt * s.to(ACC_DTYPE)[:, None]
        pdl_enter(PDL)
        xt = tl.load(x_ptrs, mask=row_ok & k_ok, other=0.0).to(ACC_DTYPE)
        acc += wt * xt[None, :]
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
        k_first = BLOCK_K
    for k0 in tl.range(k_first, K, BLOCK_K, num_stages=LOOP_STAGES):
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
               BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """BLOCK_M > 1: a [BLOCK_M, BLOCK_N, BLOCK_K] elementwise accumulator (each weight element read once)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk   # [BN, BK]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk   # [BM, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), ACC_DTYPE)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
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
              BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr = 1, PDL: tl.constexpr = False):
    """acc[BLOCK_M, BLOCK_N] = x[offs_m, :K] @ w[offs_n, :K]^T without tl.dot (module docstring: the order);
    the same operands and scale conventions as `gemm.gemm_tile`. LOOP_STAGES > 1 software-pipelines the K
    loop (loads of the next LOOP_STAGES - 1 steps in flight; the arithmetic and its order are unchanged).
    PDL: the tile enters the programmatic-dependent-launch wait itself (`_pdl.py`), after its first weight
    tile is loaded when BLOCK_M == 1; the caller must not load activations or store before it."""
    if BLOCK_M == 1:
        acc = _gemv_one_row(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                            stride_wk, stride_sn, stride_sk, SCALE_MODE, SCALE_GN, SCALE_GK, ACC_DTYPE, EVEN_K,
                            BLOCK_N, BLOCK_K, LOOP_STAGES, PDL)
    else:
        pdl_enter(PDL)
        acc = _gemv_rows(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                         stride_wk, stride_sn, stride_sk, SCALE_MODE, SCALE_GN, SCALE_GK, ACC_DTYPE, EVEN_K,
                         BLOCK_M, BLOCK_N, BLOCK_K, LOOP_STAGES)
    if SCALE_MODE == 1:  # per-output-channel scales
        s = tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)
        acc = acc * s.to(ACC_DTYPE)[None, :]
    return acc


@triton.jit
def splitk_reduce_kernel(p_ptr, y_ptr, M, N, stride_ym, stride_yn, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """y[m, n] = (((P_0 + P_1) + P_2) + ...)[m, n] cast to y's dtype; partials P [SPLIT_K, M, N] contiguous."""
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mn = M * N
    ok = offs < mn
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * mn + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    tl.store(y_ptr + m * stride_ym + n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def combine_in_launch(p_ptr, cnt_ptr, y_ptr, acc, tile, split, M, N, offs_m, offs_n, m_ok, n_ok, stride_ym, stride_yn,
                      SPLIT_K: tl.constexpr):
    """Split-K without a second launch (config COMBINE=1). Split `split` of output tile `tile` stores its fp32
    partial P_split, then counts itself in with one acq_rel atomic on the tile's counter; the program that
    arrives last (count SPLIT_K - 1: every partial of the tile is written) computes
        y = (((P_0 + P_1) + P_2) + ... + P_{SPLIT_K-1})
    in split order, whichever program that is, so the bits equal `reduce_partials`', and resets the counter
    to 0 for the next launch. The barrier makes every thread's partial store precede the release; partials
    are read through L2 (.cg), never a stale L1 line."""
    mask = m_ok[:, None] & n_ok[None, :]
    rows = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mn = tl.cast(M, tl.int64) * N  # M (or N) may be the constexpr 1 the JIT specialises
    tl.store(p_ptr + split * mn + rows, acc, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.load(p_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(p_ptr + s * mn + rows, mask=mask, other=0.0, cache_modifier=".cg")
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # replaced counter sets: a captured CUDA graph may still point at them


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 arrival counters (all 0 between launches) for `combine_in_launch`, one set per (device, stream):
    kernels on one stream run one after another, so they can share a set; kernels that may overlap (graph
    branches captured from other streams) get their own. Zeroed once when made: each launch leaves its
    counters at 0. A set first made inside a graph capture has its zeroing captured too (correct, but a fill
    kernel on every replay): k31c/runtime/cuda_graphs.py warms up on the stream it captures on, so the set
    exists before. A set outgrown by a launch with more tiles is replaced but kept alive, since a graph
    captured earlier may still use it."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    cnt = _COUNTERS.get(key)
    if cnt is None or cnt.numel() < tiles:
        if cnt is not None:
            _RETIRED.append(cnt)
        cnt = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = cnt
    return cnt


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
                                                      SPLIT_K=S, BLOCK=block, num_warps=4, **launch_kwargs())


# ---- decode configs: the declared heuristic's M <= 64 branches (gemm.heuristic), measured on the H200 ----
def _fill(cfg: dict, key: dict, want: int, min_n: int) -> dict:
    """Halve BLOCK_N (to min_n), then double SPLIT_K (to 32, no empty split) until >= `want` programs: a decode
    GEMM is one pass over the weights, and only enough programs in flight reach the HBM bandwidth."""
    tiles = lambda: -(-key["M"] // cfg["BLOCK_M"]) * -(-key["N"] // cfg["BLOCK_N"]) * cfg["SPLIT_K"]  # noqa: E731
    while tiles() < want and cfg["BLOCK_N"] > min_n:
        cfg["BLOCK_N"] //= 2
    while tiles() < want and cfg["SPLIT_K"] < 32 and 2 * cfg["SPLIT_K"] * cfg["BLOCK_K"] <= key["K"]:
        cfg["SPLIT_K"] *= 2
    return cfg


def decode_gemv_config(key: dict, sms: int) -> dict:
    """M = 1 (bench_gemm_decode.py, H200, 2026-11-29 s6; us, x byte floor at 4.12 TB/s). N < SMs (routers
    112 x 7168): one program per row, the whole K in one masked tile, 8 warps: 3.1 us (split 8 + a combine
    launch: 5.0). N >= 16384 (lm head): 4 rows x 512, no pipelining: 70.4 (0.99x). K >= 6144 (packed
    projections): 8 x 512, the K loop pipelined 3 deep: 16.5 / 24.6 / 33.2 / 37.2 us at N = 3808 / 6284 / 8448
    / 9728 (1.25 / 1.12 / 1.13 / 1.10x; unpipelined 16.7 / 25.2 / 36.1 / 38.0). Shorter K (o_proj 1536, down
    3072 / 4224): 8 x 256, 3 stages: 8.1 / 13.8 / 17.6 us (1.52 / 1.29 / 1.20x; before 8.4 / 14.6 / 19.1,
    cuBLAS 8.8 / 16.4 / 20.5). Too few row tiles are refilled by halving BLOCK_N, then splitting K.
    Session 13 (bench_gemm_decode.py --isolated, benches/results/h200-2026-11-30-s13/gemm_decode_isolated.json):
    launched back to back (each the next one's PDL predecessor) vs alone behind one small kernel, this
    heuristic's configs: z 3584 x 7168 16.1 vs 13.2 us (floor 12.3), down 3072 14.0 vs 11.8, down 4224 18.4 vs
    15.5, o_proj 1536 7.6 vs 8.0; 14-19 other configs a shape (BLOCK_N 2-32, BLOCK_K 256-1024, 2-8 warps, 1-6
    stages, split 2) within 5% of these or slower: a GEMV alone is near its floor, what it loses in the decode
    step comes from what runs beside it."""
    if key["N"] < sms and key["K"] <= 8192:
        return dict(BLOCK_M=1, BLOCK_N=1, BLOCK_K=max(32, pow2_bucket(key["K"])), GROUP_M=1, SPLIT_K=1, GEMV=1,
                    num_warps=8, num_stages=1)
    if key["N"] >= 16384:
        bn, bk, stages = 4, 512, 1
    else:
        bn, bk, stages = 8, (512 if key["K"] >= 6144 else 256), 3
    cfg = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=min(bk, max(32, pow2_bucket(key["K"]))), GROUP_M=1, SPLIT_K=1,
               GEMV=1, num_warps=4, num_stages=stages)
    return _fill(cfg, key, 2 * sms, 1)



def decode_dot_config(key: dict, sms: int) -> dict:
    """1 < M <= 64: 16..64-row tensor-core tiles (the [M, BLOCK_N, BLOCK_K] GEMV was 3-5x slower at M = 8).
    Measured (H200, s6), M = 8: 16 x 32 x 128, 5 stages (o_proj / down 8.5 / 14.3 / 18.5 us vs 4 stages 8.7 /
    14.7 / 19.0); K split in 2 (combined in the launch) when the tiles do not fill the SMs and K >= 4096
    (packed 3808 / 6284: 18.5 / 26.5 vs 22.3 / 28.5; at M = 64 only below SMs tiles: 3808 21.6 vs 23.6); f32 x
    at N >= 12800 (lm head, 3 bf16 passes): 16 x 128 x 64, split 2 (114.5 vs 131.6). M = 64: 64 x 32 x 128,
    4 stages; 64 x 128 x 64 (8 warps) once the 64 x 32 tiles exceed two per SM (packed 9728: 51.3 vs 59.1).
    Fewer tiles than SMs / 2 are refilled: BLOCK_N down to 16, then K splits (routers: M = 8 8.2 us vs 9.8
    with a second combine launch; M = 64 9.8 vs 79.7)."""
    mb = pow2_bucket(key["M"])
    cfg = dict(BLOCK_M=max(16, mb), BLOCK_N=32, BLOCK_K=128, GROUP_M=1, SPLIT_K=1, GEMV=0, num_warps=4,
               num_stages=5 if mb <= 16 else 4)
    tiles = -(-key["N"] // 32)
    if key["N"] >= 200 * 64 and key["x"] == "f32" and mb <= 16:
        cfg.update(BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, num_stages=4)
    elif key["N"] >= 200 * 64:
        cfg.update(BLOCK_N=64, num_stages=4)
    elif mb > 16 and tiles > 2 * sms:
        cfg.update(BLOCK_N=128, BLOCK_K=64, num_warps=8)
    elif key["K"] >= 4096 and sms // 2 <= tiles < (3 * sms // 2 if mb <= 16 else sms):
        cfg.update(SPLIT_K=2, num_stages=4)
    cfg = _fill(cfg, key, sms // 2, 16)
    if cfg["SPLIT_K"] > 1:  # measured with 4 stages
        cfg["num_stages"] = 4
    return cfg
