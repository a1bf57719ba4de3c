"""`fused.mla_query` (passes/overlapped_mla_query.py) in one kernel launch: the q_b projection and the
latent cache write.

Operands (in the pass's order): c_q [T, q_lora], q_b [H*(dn+dr), q_lora], kv_a [T, kv+dr] (may be a
column view of a packed projection's output), kv_norm_w [kv], latent_pool (flat [N, kv+dr] or a block
view [NB, bs, kv+dr], any block stride; updated in place), token_req [T], token_pos [T],
block_table [R, MB]. Attrs: heads, nope_dim, rope_dim, kv_lora_rank, eps, block_size.
Results: q_nope [T, H, dn], q_pe [T, H, dr] (both contiguous: the attention reads them without a copy; two
regions of one buffer), latent_pool.

Math, per token t (fp32 in registers):
    q[t, n]   = sum_k c_q[t, k] * q_b[n, k]                      (`gemm.gemm_tile`, no split-K)
    c         = kv_a[t, :kv] / sqrt(mean(kv_a[t, :kv]^2) + eps) * kv_norm_w
    latent    = [c ; kv_a[t, kv:]], rounded to kv_a's dtype (the body's concat is held in it), then
                stored in the pool's dtype at row(token_req[t], token_pos[t]) =
                block_table[req, pos // bs] * bs + pos % bs (`_paging`).
FP8 pools (f8e4m3, the plan's per-layer scale 1): saturate to +-448, then `norm_quant.e4m3_code` (round to
nearest even on the fp32 bits, the same byte on a GPU and in the interpreter; the body's `cast`).
NVFP4 latent pools never reach this op (the pass only fuses a plain or cast latent; the NVFP4 graph
quantises with `quantize_latent_nvfp4` and stays unfused); `supports` declines any other pool dtype.

One launch: programs [0, ceil(T/BLOCK_R)) write BLOCK_R latent rows each; the rest compute one
BLOCK_M x BLOCK_N tile of q each, with the tensor-core tile (`gemm_tile`, GEMV=0) or, for decode
batches (BLOCK_M <= 16), the dot-free tile (`gemv_tile`, GEMV=1: fp32 products, one sum per tile, any
BLOCK_N, so q_b streams through enough programs to fill the GPU). Every row is reduced in an order fixed
by the config; the batch-invariant bucket drops T and takes GEMV=0, so a token's results do not depend
on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton._paging import paging_args, pool_strides, row_offsets, rows_of
from codegen.triton._pdl import launch_kwargs, pdl_enter
from codegen.triton.gemm import dot_numerics, gemm_tile, gemv_tile
from codegen.triton.norm_quant import e4m3_code

OPERANDS = ("c_q", "q_b", "kv_a", "kv_norm_w", "latent_pool", "token_req", "token_pos", "block_table")
FLOAT_POOLS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}
IR_POOL_DTYPES = ("f32", "bf16", "f16", "f64", "f8e4m3")
PLAIN = ("f32", "bf16", "f16", "f64")


@triton.jit
def _store_latent(dst, vals, mask, FP8: tl.constexpr):
    if FP8:
        tl.store(dst, e4m3_code(tl.minimum(tl.maximum(vals, -448.0), 448.0)).to(tl.uint8), mask=mask)  # saturate
    else:
        tl.store(dst, vals.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _mla_query_kernel(cq_ptr, w_ptr, q_ptr, kva_ptr, g_ptr, pool_ptr, req_ptr, pos_ptr, tbl_ptr,
                      T, N, K, MB, stride_cq, stride_w, stride_kva, stride_blk, stride_row, eps,
                      DN: tl.constexpr, KV: tl.constexpr, DR: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_DR: tl.constexpr,
                      BLOCK_R: tl.constexpr, LOG_BS: tl.constexpr, FP8: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, X_SPLITS: tl.constexpr,
                      PRECISION: tl.constexpr, EVEN_K: tl.constexpr, GEMV: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    n_lat = tl.cdiv(T, BLOCK_R)
    if pid < n_lat:  # latent rows: RMSNorm | k_pe -> pool dtype -> paged row
        pdl_enter(PDL)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < T
        src = kva_ptr + rows.to(tl.int64)[:, None] * stride_kva
        cols = tl.arange(0, BLOCK_KV)
        c_ok = row_ok[:, None] & (cols[None, :] < KV)
        x = tl.load(src + cols[None, :], mask=c_ok, other=0.0).to(tl.float32)
        rms = tl.sqrt(tl.sum(x * x, axis=1) / KV + eps)
        g = tl.load(g_ptr + cols, mask=cols < KV, other=0.0).to(tl.float32)
        c = (x / rms[:, None] * g[None, :]).to(kva_ptr.dtype.element_ty).to(tl.float32)
        pe_cols = tl.arange(0, BLOCK_DR)
        pe_ok = row_ok[:, None] & (pe_cols[None, :] < DR)
        pe = tl.load(src + KV + pe_cols[None, :], mask=pe_ok, other=0.0).to(tl.float32)
        req = tl.load(req_ptr + rows, mask=row_ok, other=0)
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
        dest = row_offsets(rows_of(tbl_ptr + req * MB, pos, row_ok, LOG_BS), LOG_BS, stride_blk, stride_row)
        _store_latent(pool_ptr + dest[:, None] + cols[None, :], c, c_ok, FP8)
        _store_latent(pool_ptr + dest[:, None] + KV + pe_cols[None, :], pe, pe_ok, FP8)
    else:  # one tile of q = c_q @ q_b^T
        tile = pid - n_lat
        num_n = tl.cdiv(N, BLOCK_N)
        offs_m = (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < T
        n_ok = offs_n < N
        if GEMV:  # waits for the previous kernel itself, after loading its first weight tile
            acc = gemv_tile(cq_ptr, w_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_cq, 1, stride_w, 1, 0, 0,
                            0, 1, 1, ACC_DTYPE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, 1, PDL)
        else:
            pdl_enter(PDL)
            acc = gemm_tile(cq_ptr, w_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_cq, 1, stride_w, 1, 0, 0,
                            0, 1, 1, DOT_DTYPE, ACC_DTYPE, X_SPLITS, PRECISION, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
        # column n = head h, dim j: q_nope[t, h, j] (j < DN) in the first T*H*DN elements, q_pe[t, h, j-DN] after
        h = offs_n // (DN + DR)
        j = offs_n - h * (DN + DR)
        n_heads = N // (DN + DR)
        t64 = offs_m.to(tl.int64)[:, None]
        q_at = tl.where(j[None, :] < DN, t64 * (n_heads * DN) + (h * DN + j)[None, :],
                        T * n_heads * DN + t64 * (n_heads * DR) + (h * DR + j - DN)[None, :])
        tl.store(q_ptr + q_at, acc.to(q_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def mla_query(ops: list, attrs: dict, config: dict):
    """fused.mla_query: returns (q_nope [T, H, dn], q_pe [T, H, dr], latent_pool), the pool written in place."""
    if len(ops) != len(OPERANDS):
        raise ValueError(f"fused.mla_query takes ({', '.join(OPERANDS)}), got {len(ops)} operands")
    c_q, q_b, kv_a, kv_norm_w, pool, token_req, token_pos, block_table = ops
    H, dn, dr, kv = (int(attrs[k]) for k in ("heads", "nope_dim", "rope_dim", "kv_lora_rank"))
    T, K = c_q.shape
    N = H * (dn + dr)
    if tuple(q_b.shape) != (N, K):
        raise ValueError(f"fused.mla_query: q_b {tuple(q_b.shape)} must be [heads*(nope+rope) = {N}, q_lora = {K}]")
    if tuple(kv_a.shape) != (T, kv + dr) or tuple(kv_norm_w.shape) != (kv,):
        raise ValueError(f"fused.mla_query: kv_a {tuple(kv_a.shape)} must be [{T}, {kv}+{dr}] and kv_norm_w "
                         f"{tuple(kv_norm_w.shape)} [{kv}]")
    fp8 = pool.dtype == torch.float8_e4m3fn
    if not fp8 and pool.dtype not in FLOAT_POOLS:
        raise ValueError(f"fused.mla_query: latent pool dtype {pool.dtype} has no kernel path (plain floats or "
                         f"float8_e4m3fn)")
    bs = int(attrs["block_size"])
    stride_blk, stride_row = pool_strides(pool, bs, 1, "fused.mla_query latent_pool")
    if pool.shape[-1] != kv + dr:
        raise ValueError(f"fused.mla_query: latent pool rows {tuple(pool.shape)} must hold {kv}+{dr} values")
    dev = c_q.device
    q = torch.empty(T * N, dtype=c_q.dtype, device=dev)
    if T > 0:
        x, w, kva, g = (_unit_stride(t) for t in (c_q, q_b, kv_a, kv_norm_w))
        tbl, req, mb, log_bs = paging_args(block_table, token_req, bs, dev)
        bm, bn, bk, br = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["BLOCK_R"]
        grid = (triton.cdiv(T, br) + triton.cdiv(T, bm) * triton.cdiv(N, bn),)
        _mla_query_kernel[grid](
            x, w, q, kva, g, pool.view(torch.uint8) if fp8 else pool, req, token_pos, tbl,
            T, N, K, mb, x.stride(0), w.stride(0), kva.stride(0), stride_blk, stride_row,
            float(attrs["eps"]), DN=dn, KV=kv, DR=dr, BLOCK_KV=pow2_bucket(kv), BLOCK_DR=pow2_bucket(dr), BLOCK_R=br,
            LOG_BS=log_bs, FP8=fp8, **dot_numerics(x.dtype, w.dtype), EVEN_K=K % bk == 0, GEMV=config["GEMV"],
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=config["num_warps"], num_stages=config["num_stages"],
            **launch_kwargs())
    return q[:T * H * dn].view(T, H, dn), q[T * H * dn:].view(T, H, dr), pool


# ---- template plumbing ---------------------------------------------------------------------------
def _name(t) -> str:
    dt = getattr(t, "dtype", None)
    name = getattr(dt, "name", None)  # an IR DType at compile time
    if isinstance(name, str):
        return name
    return {**FLOAT_POOLS, torch.float8_e4m3fn: "f8e4m3"}.get(dt, str(dt))


def _key(a, attrs) -> dict:
    c_q, q_b, kv_a, _, pool = a.operands[:5]
    return {"T": int(c_q.shape[0]), "N": int(q_b.shape[0]), "K": int(c_q.shape[1]),
            "KV": int(attrs["kv_lora_rank"]), "DR": int(attrs["rope_dim"]), "x": _name(c_q), "w": _name(q_b),
            "pool": _name(pool), "bi": int(bool(attrs.get("batch_invariant", False)))}


def _bucket(key: dict) -> dict:
    b = dict(key)
    b["T"] = 0 if b["bi"] else pow2_bucket(b["T"])  # T = 1 (dot-free tile) and 8 (tensor cores) differ
    return b


TUNABLES = (Tunable("GEMV", (0, 1)), Tunable("BLOCK_M", (1, 2, 4, 8, 16, 32, 64, 128)),
            Tunable("BLOCK_N", (4, 8, 16, 32, 64, 128, 256)), Tunable("BLOCK_K", (64, 128, 256, 512)),
            Tunable("BLOCK_R", (1, 2, 4, 8, 16, 64)), Tunable("num_warps", (2, 4, 8)),
            Tunable("num_stages", (1, 2, 3, 4)))


def _heuristic(key: dict, target: str) -> dict:
    """Measured on the H200 (benches/bench_decode_fallbacks.py, rank preset: N = 2304, K = 1536, bf16,
    in a CUDA graph; unfused body 32.6 / 36.3 µs): T = 1 takes the dot-free tile with 4-row N tiles and
    BLOCK_K = 512 (576 programs stream q_b; 3.1 µs, 1.8x the byte floor; BLOCK_N = 8 / BLOCK_K = 256:
    3.5 µs); T = 8 the 16 x 32 x 128 tensor-core tile, 3 stages (4.9 µs; the dot-free tile 9.5 µs).
    T in 2..16 takes the latter, 17..64 the same with 64-row tiles; prefill 128 x 128 x 64 tiles.
    Batch-invariant: one tensor-core config for every T. cpu (interpreter): few, large programs."""
    if target == "cpu":
        return {"GEMV": 0, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_R": 64 if key["KV"] <= 512 else 16,
                "num_warps": 4, "num_stages": 1}
    if key["bi"]:
        return {"GEMV": 0, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_R": 4, "num_warps": 4,
                "num_stages": 3}
    if key["T"] == 1:
        return {"GEMV": 1, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "BLOCK_R": 4, "num_warps": 4, "num_stages": 1}
    if key["T"] <= 64:
        return {"GEMV": 0, "BLOCK_M": 16 if key["T"] <= 16 else 64, "BLOCK_N": 32, "BLOCK_K": 128, "BLOCK_R": 4,
                "num_warps": 4, "num_stages": 3}
    return {"GEMV": 0, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "BLOCK_R": 8, "num_warps": 8, "num_stages": 3}


_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8}


def _constraints(config: dict, key: dict, target: str) -> list[str]:
    out = []
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if config["BLOCK_R"] * pow2_bucket(key["KV"]) > 32768:
        out.append(f"latent tile BLOCK_R*pow2(kv) = {config['BLOCK_R'] * pow2_bucket(key['KV'])} > 32768 values")
    if config["GEMV"]:
        if key["bi"]:
            out.append("batch invariance takes the tensor-core tile (GEMV=0) for every T")
        if bm > 16:
            out.append(f"the dot-free tile (GEMV=1) takes BLOCK_M <= 16, not {bm}")
        if bm * bn * bk > 16384:
            out.append(f"dot-free accumulator BLOCK_M*BLOCK_N*BLOCK_K = {bm * bn * bk} > 16384 fp32 values")
        return out
    if min(bm, bn, bk) < 16:
        out.append("tl.dot needs BLOCK_M, BLOCK_N, BLOCK_K >= 16 (GEMV=1 takes smaller tiles)")
    if target != "cpu":
        smem = (bm * _BYTES.get(key["x"], 4) + bn * _BYTES.get(key["w"], 2)) * bk * max(1, config["num_stages"])
        if smem > 232448:
            out.append(f"shared memory (BLOCK_M*x + BLOCK_N*w bytes)*BLOCK_K*stages = {smem} B > 232448 B")
        if bm * bn > 128 * 256:
            out.append("accumulator tile BLOCK_M*BLOCK_N > 32768 fp32 values")
    return out


def _supports(a, attrs, target) -> str | None:
    ops = a.operands
    if len(ops) != len(OPERANDS):
        return f"expects {len(OPERANDS)} operands ({', '.join(OPERANDS)}), found {len(ops)}"
    c_q, q_b, kv_a, kv_norm_w, pool = ops[:5]
    for what, t in (("c_q", c_q), ("q_b", q_b), ("kv_a", kv_a), ("kv_norm_w", kv_norm_w)):
        if getattr(t.dtype, "is_packed", False) or _name(t) not in PLAIN:
            return f"{what} dtype {_name(t)} is not a plain float"
    if _name(pool) not in IR_POOL_DTYPES:
        return (f"latent pool dtype {_name(pool)} (the kernel writes plain-float or f8e4m3 latents; an NVFP4 "
                f"latent is quantised by quantize_latent_nvfp4, which this fused op never contains)")
    dims = [q_b.shape[0], c_q.shape[1], kv_a.shape[1], pool.shape[-1]]
    if not all(getattr(d, "is_number", True) for d in dims):
        return "q_b / c_q / kv_a / pool row widths must be static"
    if pow2_bucket(int(attrs["kv_lora_rank"])) > 4096:
        return f"kv_lora_rank {attrs['kv_lora_rank']} > 4096 (one-pass RMSNorm rows only)"
    return None


TEMPLATES = [
    KernelTemplate(
        family="mla_query", backend="triton", ops=("fused.mla_query",),
        launch=lambda a, attrs, config: mla_query(a.operands, attrs, config), key_dims=_key,
        heuristic=_heuristic, tunables=TUNABLES, bucket=_bucket, constraints=_constraints, supports=_supports,
        batch_invariant=True,
        doc="q = c_q @ q_b^T (q_nope, q_pe contiguous) + latent RMSNorm | k_pe -> pool dtype (fp8 by hand) -> paged "
            "row, one launch"),
]
