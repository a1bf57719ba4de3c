"""Dense GEMM family: `linear` (y = x @ w^T) and `fused.packed_linear` (one GEMM over the concatenated
weights of linears that read the same input, results split by columns).

Math (per output row m, column n):   y[m, n] = sum_k x[m, k] * w[n, k]          (fp32 accumulation)
FP8 weights (`FP8Weight`, e4m3 values q with scales s):
    per output channel  (s: [N]):            y[m, n] = s[n] * sum_k x[m, k] * q[n, k]
    per block (gn x gk) (s: [N/gn, K/gk]):   y[m, n] = sum_b s[n//gn, b] * sum_{k in block b} x[m, k] q[n, k]
so the kernel reproduces `x @ w.dequantize().T` up to fp32 summation order (weight-only FP8: the
activations stay in their dtype, q is widened exactly to the dot dtype in registers).

Operand dtypes. bf16 x bf16 / fp8 (bf16 dot, fp32 accumulate); f32 x bf16 (the logits head: x split
into X_SPLITS bf16 terms hi+mid+lo so the result keeps ~fp32 accuracy on the bf16 tensor cores);
f32 x f32 (tf32x3 on a GPU). Under the Triton interpreter everything is computed in fp32 (fp64 when an
operand is fp64): the interpreter's bf16 arithmetic is wrong, see shared/TOOLCHAIN.md.

Tiling: one program per (BLOCK_M x BLOCK_N) output tile (GROUP_M launch order for L2 reuse) and per K
split. GEMV=0: `gemm_tile`, tensor-core dots over BLOCK_K steps pipelined `num_stages` deep; GEMV=1
(decode, BLOCK_M <= 16): `gemv_tile`, elementwise fp32 products summed once per tile, any BLOCK_N >= 1,
its K loop software-pipelined `num_stages` deep (`_gemv.py` has its math). SPLIT_K=1: each output element is
reduced over K in one fixed order (k = 0, BLOCK_K, 2 BLOCK_K, ...). SPLIT_K > 1 (decode GEMMs too narrow to
fill the GPU, e.g. the routers at M >= 8): split s reduces its K chunk into an fp32 partial and the partials
are added in split order, by the last split of the tile to finish (COMBINE=1, one launch: an atomic counter
only elects the adder) or by a second launch (COMBINE=0); the same bits either way (`_gemv.py`).

Batch invariance (`attrs["batch_invariant"]`): the key drops M (`bi=1`), so `heuristic` returns one
config for every batch size, GEMV=0 and SPLIT_K=1 (`constraints` refuses others, the launch too), and the
reduction order of a row, including the MMA instruction shape, is the same alone or inside any batch.
Otherwise M is bucketed by powers of two and decode batches get the GEMV / split-K paths.

`fused.packed_linear` operands: (x, w_1..w_n), attr `splits=[N_1..N_n]`, results y_1..y_n. The weights
are concatenated once (cached by weight identity and version) and y_i are column views of one
[M, sum N_i] output (row stride sum N_i).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
# gemm_tile, dot_numerics, interpreting: re-exported (kernels that fuse an epilogue onto a GEMM tile)
from codegen.triton._gemv import (combine_in_launch, decode_dot_config, decode_gemv_config, dot_numerics,  # noqa: F401
                                  gemm_tile, gemv_tile, interpreting, k_chunk, reduce_partials, tile_counters)
from codegen.triton._fp8_weight import FP8Weight  # noqa: F401  (re-exported: gemm.FP8Weight)
from codegen.triton._pdl import launch_kwargs, pdl_enter

# Shared memory a program may use, per target (bytes). Unknown GPU targets get the conservative value.
SMEM_BYTES = {"h100": 232448, "h200": 232448, "b200": 232448, "b300": 232448, "gb300": 232448, "rubin": 232448,
              "mi355x": 163840}
DEFAULT_SMEM = 101376
PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
EXACT_WIDENINGS = ((torch.float32, torch.bfloat16), (torch.float32, torch.float16))  # (read as, stored as)


# ---- the kernel ---------------------------------------------------------------------------------
@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, K_CHUNK,
                 stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, stride_sn, stride_sk,
                 SCALE_MODE: tl.constexpr, SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, X_SPLITS: tl.constexpr,
                 PRECISION: tl.constexpr, EVEN_K: tl.constexpr, GEMV: tl.constexpr, SPLIT_K: tl.constexpr,
                 COMBINE: tl.constexpr, LOOP_STAGES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 PDL: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if SPLIT_K > 1:  # this program reduces k in [k_lo, k_lo + K_CHUNK) (the last chunk may be shorter)
        k_lo = tl.program_id(1) * K_CHUNK
        K = tl.minimum(K - k_lo, K_CHUNK)
        x_ptr += k_lo * stride_xk
        w_ptr += k_lo * stride_wk
        if SCALE_MODE == 2:
            s_ptr += (k_lo // SCALE_GK) * stride_sk
    if GEMV:
        acc = gemv_tile(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                        stride_wk, stride_sn, stride_sk, SCALE_MODE, SCALE_GN, SCALE_GK, ACC_DTYPE, EVEN_K,
                        BLOCK_M, BLOCK_N, BLOCK_K, LOOP_STAGES, PDL)  # waits for the previous kernel itself
    else:
        pdl_enter(PDL)
        acc = gemm_tile(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, stride_xk, stride_wn,
                        stride_wk, stride_sn, stride_sk, SCALE_MODE, SCALE_GN, SCALE_GK, DOT_DTYPE, ACC_DTYPE,
                        X_SPLITS, PRECISION, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT_K > 1 and COMBINE:  # the last split of this tile to finish adds the partials in split order
        combine_in_launch(p_ptr, cnt_ptr, y_ptr, acc, pid, tl.program_id(1), M, N, offs_m, offs_n, m_ok, n_ok,
                          stride_ym, stride_yn, SPLIT_K)
    elif SPLIT_K > 1:  # fp32 partial of split program_id(1), reduced in fixed order by `reduce_partials`
        p_ptrs = p_ptr + (tl.program_id(1) * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def scale_args(w, config: dict, dummy: torch.Tensor) -> tuple:
    """(SCALE_MODE, SCALE_GN, SCALE_GK, scales, scale strides) of a weight for the GEMM tiles: 0 plain (the
    scales pointer is `dummy`), 1 FP8 per output channel, 2 FP8 per (gn x gk) block (BLOCK_K must divide gk)."""
    if not isinstance(w, FP8Weight):
        return 0, 1, 1, dummy, (0, 0)
    scale_mode, (gn, gk) = (1, (1, 1)) if w.block is None else (2, w.block)
    s = w.scale.to(torch.float32)
    s_strides = (s.stride(0), 0) if s.dim() == 1 else (s.stride(0), s.stride(1))
    if scale_mode == 2 and gk % config["BLOCK_K"]:
        raise ValueError(f"gemm: BLOCK_K={config['BLOCK_K']} must divide the FP8 scale block {gk} along K")
    return scale_mode, gn, gk, s, s_strides


def gemm(x: torch.Tensor, w, config: dict, out: torch.Tensor | None = None,
         as_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ w[N, K]^T with w a tensor or an FP8Weight; x may be strided (2-D). `as_dtype`:
    x is read as that wider dtype (bf16/f16 -> f32, exact), which fixes the numerics and y's dtype: the
    result equals casting x first, without the cast's round trip through memory."""
    if x.dim() != 2:
        raise ValueError(f"gemm: x must be 2-D [M, K], found {tuple(x.shape)}")
    fp8 = isinstance(w, FP8Weight)
    wq = w.q if fp8 else w
    M, K = x.shape
    N = wq.shape[0]
    if wq.dim() != 2 or wq.shape[1] != K:
        raise ValueError(f"gemm: weight {tuple(wq.shape)} does not match input {tuple(x.shape)} (in features {K})")
    if x.dtype not in PLAIN_DTYPES or (not fp8 and wq.dtype not in PLAIN_DTYPES):
        raise ValueError(f"gemm: unsupported dtypes x {x.dtype}, w {wq.dtype}")
    as_dtype = as_dtype or x.dtype
    if as_dtype != x.dtype and (as_dtype, x.dtype) not in EXACT_WIDENINGS:
        raise ValueError(f"gemm: x {x.dtype} cannot be read exactly as {as_dtype} (widenings: {EXACT_WIDENINGS})")
    out = torch.empty(M, N, dtype=as_dtype, device=x.device) if out is None else out
    if M == 0 or N == 0 or K == 0:
        return out.zero_()
    scale_mode, gn, gk, s, s_strides = scale_args(w, config, out)
    chunk, n_split = k_chunk(K, config["BLOCK_K"], int(config.get("SPLIT_K", 1)), gk if scale_mode == 2 else 0)
    numerics = dot_numerics(as_dtype, wq.dtype)
    p_dtype = torch.float64 if numerics["ACC_DTYPE"] == tl.float64 else torch.float32
    partials = torch.empty(n_split, M, N, dtype=p_dtype, device=x.device) if n_split > 1 else out
    grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"]), n_split)
    combine = int(config.get("COMBINE", 1)) if n_split > 1 else 0
    counters = tile_counters(x.device, grid[0]) if combine else partials
    _gemm_kernel[grid](
        x, wq, s, out, partials, counters, M, N, K, chunk, x.stride(0), x.stride(1), wq.stride(0), wq.stride(1),
        out.stride(0), out.stride(1), *s_strides, SCALE_MODE=scale_mode, SCALE_GN=gn, SCALE_GK=gk, **numerics,
        EVEN_K=K % config["BLOCK_K"] == 0, GEMV=int(config.get("GEMV", 0)), SPLIT_K=n_split, COMBINE=combine,
        LOOP_STAGES=max(1, int(config["num_stages"])),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"],
        num_warps=config["num_warps"], num_stages=config["num_stages"], **launch_kwargs())
    if n_split > 1 and not combine:
        reduce_partials(partials, out)
    return out


# ---- packed weights: concatenated once, cached by identity ---------------------------------------
_PACKED: dict[tuple, tuple] = {}


def packed_weight(ws: list):
    """The row-concatenation of ws (tensors or FP8Weights with equal scale layouts), built once per
    distinct list of weight objects (identity + in-place version); stale entries are dropped."""
    key = tuple(id(w) for w in ws)
    versions = tuple(getattr(w, "_version", 0) if not isinstance(w, FP8Weight) else w.q._version for w in ws)
    hit = _PACKED.get(key)
    if hit is not None and all(r() is w for r, w in zip(hit[0], ws)) and hit[1] == versions:
        return hit[2]
    for k in [k for k, v in _PACKED.items() if any(r() is None for r in v[0])]:
        del _PACKED[k]
    if all(isinstance(w, FP8Weight) for w in ws):
        blocks = {w.block for w in ws}
        if len(blocks) != 1:
            raise ValueError(f"packed_linear: FP8 weights have different scale blocks {sorted(map(str, blocks))}")
        block = blocks.pop()
        scales = [w.scale for w in ws]
        if block is not None and any(w.q.shape[0] % block[0] for w in ws[:-1]):
            # a split that ends inside a scale block: give every row its own copy of its block's scales
            scales = [sc.repeat_interleave(block[0], 0)[: w.q.shape[0]] for sc, w in zip(scales, ws)]
            block = (1, block[1])
        packed = FP8Weight(torch.cat([w.q for w in ws]), torch.cat(scales), block)
    elif any(isinstance(w, FP8Weight) for w in ws):
        raise ValueError("packed_linear: weights mix FP8 and plain dtypes")
    else:
        packed = torch.cat(list(ws), dim=0)
    _PACKED[key] = ([weakref.ref(w) for w in ws], versions, packed)
    return packed


# ---- template plumbing ---------------------------------------------------------------------------
def dtype_name(t) -> str:
    """'f32' / 'bf16' / 'f16' / 'f64' / 'f8e4m3' of a tensor, an FP8Weight or an IR TensorType."""
    if isinstance(t, FP8Weight):
        return "f8e4m3"
    dt = getattr(t, "dtype", None)
    name = getattr(dt, "name", None)  # IR DType at compile time
    if isinstance(name, str):
        return name
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64",
            torch.float8_e4m3fn: "f8e4m3"}.get(dt, str(dt))


def _rows(x) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= int(d)
    return n


def gemm_key(x, ws, attrs) -> dict:
    """The tuning key of x @ concat(ws)^T (also the packed GLU GEMM's): M, N, K, dtypes, FP8 scale block, bi."""
    blk = ws[0].block[1] if isinstance(ws[0], FP8Weight) and ws[0].block else 0  # FP8 scale block along K
    return {"M": _rows(x), "N": sum(int(w.shape[0]) for w in ws), "K": int(x.shape[-1]), "x": dtype_name(x),
            "w": dtype_name(ws[0]), "gk": blk, "bi": int(bool(attrs.get("batch_invariant", False)))}


def gemm_bucket(key: dict) -> dict:
    """M by powers of two (decode configs differ per batch size); none when batch-invariant."""
    return {**key, "M": 0 if key["bi"] else pow2_bucket(key["M"])}


TUNABLES = (
    Tunable("BLOCK_M", (1, 2, 4, 8, 16, 32, 64, 128)),
    Tunable("BLOCK_N", (1, 2, 4, 8, 16, 32, 64, 128, 256)),
    Tunable("BLOCK_K", (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)),
    Tunable("GROUP_M", (1, 8)),
    Tunable("SPLIT_K", (1, 2, 4, 8, 16, 32)),
    Tunable("GEMV", (0, 1)),
    Tunable("num_warps", (2, 4, 8)),
    Tunable("num_stages", (1, 2, 3, 4, 5)),
)
SMS = {"h100": 132, "h200": 132, "b200": 148, "b300": 148, "gb300": 152, "mi355x": 256}  # multiprocessors
GEMV_MAX_M = 1  # the [M, BLOCK_N, BLOCK_K] GEMV was 3-5x slower than 16-row dots at M=8 (H200)


def heuristic(key: dict, target: str) -> dict:
    """cpu (interpreter): big tiles, few programs. GPU decode batches: `decode_gemv_config` (M = 1) and
    `decode_dot_config` (M <= 64) in _gemv.py, whose docstrings carry the H200 measurements; split-K is always
    combined in the launch (COMBINE=1: one launch fewer, the same bits). Prefill 128 x 256 x 64, 3 stages.
    Batch-invariant: one config for every M, no split, no GEMV. Wide operands shed stages, then BLOCK_N, until
    shared memory fits."""
    sms = SMS.get(target, 132)
    if target == "cpu":
        bm = 64 if key["bi"] else min(64, pow2_bucket(key["M"], 16))
        cfg = dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1)
    elif key["bi"]:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    elif pow2_bucket(key["M"]) <= GEMV_MAX_M:
        cfg = decode_gemv_config(key, sms)
    elif key["M"] <= 64:
        cfg = decode_dot_config(key, sms)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
        if key["x"] == "f32":  # 3-term split / tf32x3: 128 x 128 keeps ptxas free of spills
            cfg.update(BLOCK_N=128, BLOCK_K=32 if key["w"] == "f32" else 64)
    cfg = {"SPLIT_K": 1, "GEMV": 0, **cfg}
    cfg["COMBINE"] = 1  # split-K partials added in the launch (0: a second launch; not searched, same bits)
    if key.get("gk"):
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], key["gk"])
    while constraints(cfg, key, target):
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["BLOCK_N"] > 32:
            cfg["BLOCK_N"] //= 2
        elif cfg["BLOCK_K"] > 32:
            cfg["BLOCK_K"] //= 2
        elif cfg["SPLIT_K"] > 1:
            cfg["SPLIT_K"] //= 2
        else:
            break
    return cfg


_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "f8e4m3": 1}


def constraints(config: dict, key: dict, target: str) -> list[str]:
    out = []
    gemv, split = config.get("GEMV", 0), config.get("SPLIT_K", 1)
    if key.get("gk") and key["gk"] % config["BLOCK_K"]:
        out.append(f"BLOCK_K={config['BLOCK_K']} does not divide the FP8 scale block {key['gk']} along K")
    if key["bi"] and (gemv or split > 1):
        out.append("batch-invariant: GEMV and SPLIT_K > 1 are decode paths chosen by batch size")
    if split > 1 and (split - 1) * config["BLOCK_K"] >= key["K"]:
        out.append(f"SPLIT_K={split} leaves splits with no BLOCK_K={config['BLOCK_K']} step of K={key['K']}")
    if gemv and config["BLOCK_M"] > 16:
        out.append(f"GEMV with BLOCK_M={config['BLOCK_M']} > 16: the dot-free path is for decode batches")
    if target != "cpu":
        if gemv and config["BLOCK_M"] * config["BLOCK_N"] * config["BLOCK_K"] > 128 * 32 * config["num_warps"]:
            out.append("GEMV accumulator BLOCK_M*BLOCK_N*BLOCK_K > 128 fp32 registers per thread")
        if not gemv and min(config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]) < 16:
            out.append("tl.dot needs BLOCK_M, BLOCK_N, BLOCK_K >= 16 (GEMV=1 takes smaller tiles)")
        xb, wb = _BYTES.get(key["x"], 4), _BYTES.get(key["w"], 2)
        smem = (config["BLOCK_M"] * config["BLOCK_K"] * xb + config["BLOCK_K"] * config["BLOCK_N"] * wb) \
            * max(1, config["num_stages"])
        limit = SMEM_BYTES.get(target, DEFAULT_SMEM)
        if smem > limit:
            out.append(f"shared memory {smem} B (BLOCK_M*BLOCK_K*{xb} + BLOCK_K*BLOCK_N*{wb}) * stages > {limit} B")
        if config["BLOCK_M"] * config["BLOCK_N"] > 128 * 256:
            out.append("accumulator tile BLOCK_M*BLOCK_N > 32768 fp32 values does not fit in registers")
    return out[:1]  # the first problem: one reason per illegal config (the tuner counts reasons)


def supported_types(x, ws, target) -> str | None:
    """Why this GEMM cannot take x and ws (None when it can): dtypes, weight rank, mixed packs."""
    if getattr(x.dtype, "is_packed", False) or dtype_name(x) not in ("f32", "bf16", "f16", "f64"):
        return f"activation dtype {dtype_name(x)} is not f32/bf16/f16/f64"
    for w in ws:
        name = dtype_name(w)
        if name not in ("f32", "bf16", "f16", "f64", "f8e4m3"):
            return f"weight dtype {name} (packed formats run in the MoE kernels)"
        if len(w.shape) != 2:
            return f"weight of rank {len(w.shape)} (needs [out, in])"
    return "packed weights of different dtypes" if len({dtype_name(w) for w in ws}) != 1 else None


def check_invariance(attrs, config):
    """Refuse a decode config (GEMV / split-K) in a batch-invariant launch: its order depends on M."""
    if attrs.get("batch_invariant") and (config.get("GEMV", 0) or config.get("SPLIT_K", 1) > 1):
        raise ValueError(f"gemm: batch-invariant launch with a decode config (GEMV={config.get('GEMV', 0)}, "
                         f"SPLIT_K={config.get('SPLIT_K', 1)}): the reduction order would depend on the batch")


def _launch_linear(a, attrs, config):
    check_invariance(attrs, config)
    y = gemm(a.x.reshape(-1, a.x.shape[-1]), a.w, config)
    return y.reshape(*a.x.shape[:-1], y.shape[-1])


def _launch_packed(a, attrs, config):
    x, ws = a.operands[0], list(a.operands[1:])
    check_invariance(attrs, config)
    splits = list(attrs["splits"])
    if len(splits) != len(ws) or any(int(w.shape[0]) != s for w, s in zip(ws, splits)):
        raise ValueError(f"packed_linear: splits {splits} do not match weights "
                         f"{[tuple(w.shape) for w in ws]}")
    y = gemm(x.reshape(-1, x.shape[-1]), packed_weight(ws), config)
    return tuple(part.reshape(*x.shape[:-1], part.shape[-1]) for part in torch.split(y, splits, dim=1))


TEMPLATES = [
    KernelTemplate(
        family="gemm", backend="triton", ops=("linear",), launch=_launch_linear,
        key_dims=lambda a, attrs: gemm_key(a.x, [a.w], attrs), heuristic=heuristic, tunables=TUNABLES,
        bucket=gemm_bucket, constraints=constraints,
        supports=lambda a, attrs, target: supported_types(a.x, [a.w], target),
        batch_invariant=True, doc="y = x @ w^T, bf16/fp8(+scales)/fp32 weights; decode: GEMV / deterministic split-K"),
    KernelTemplate(
        family="packed_gemm", backend="triton", ops=("fused.packed_linear",), launch=_launch_packed,
        key_dims=lambda a, attrs: gemm_key(a.operands[0], a.operands[1:], attrs), heuristic=heuristic,
        tunables=TUNABLES, bucket=gemm_bucket, constraints=constraints,
        supports=lambda a, attrs, target: supported_types(a.operands[0], a.operands[1:], target),
        batch_invariant=True, doc="[y_1..y_n] = split(x @ concat(w_1..w_n)^T): one GEMM, weights packed once"),
]
