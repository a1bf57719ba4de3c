"""`fused.indexer_front` (passes/indexer_front_fusion.py): the DSA indexer's query projection, Hadamard
rotation and FP8 power-of-two quantisation per (token, head), and the key path (LayerNorm + Hadamard + FP8
+ the paged cache writes of key codes and scales), with the row stages of `norm_quant` (whose docstring
has the rotation and quantisation math) and `_indexer_front_rows`.

Paths (chosen by the config): the query GEMM through `gemm_tile` then one norm/rotate/quantise pass per
head, with the key rows in the same grid; or SPLIT > 1 (decode): each head's output columns cut into SPLIT
parts, one program each writing fp32 values, the last part to arrive (an atomic counter, release/acquire)
rotating and quantising the head and resetting the counter, so results do not depend on arrival order:
tensor-core parts of 16 tokens (GEMV 0, `_indexer_front_split_kernel`), or at T = 1 the one-token kernel
(GEMV 2, _indexer_front_decode.py: the weights preloaded before the PDL wait). The session-6 GEMV 1 (the
split kernel's parts as dot-free GEMVs, weights loaded after the wait) was removed in session 12: 8.28 µs
alone / 7.96 in a PDL chain on the H200 against GEMV 2's 5.49 / 6.18.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton import _precision as precision
from codegen.triton._indexer_front_decode import MAX_KT, launch_gemv
from codegen.triton._indexer_front_rows import _indexer_key_rows
from codegen.triton._paging import paging_args, pool_strides
from codegen.triton._pdl import launch_kwargs, pdl_enter
from codegen.triton.gemm import dot_numerics, gemm_tile
from codegen.triton.norm_quant import AMAX_FLOOR, _hadamard_tile, _quantize_rows


@triton.jit
def _indexer_query_kernel(x_ptr, w_ptr, q_ptr, s_ptr, T, K, HEADS, stride_xm, stride_wn,
                          DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, X_SPLITS: tl.constexpr,
                          PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, DI: tl.constexpr, BLOCK_K: tl.constexpr, HPREC: tl.constexpr,
                          PDL: tl.constexpr):
    """Program (token block, head j): acc = c_q @ W_Iq[j]^T (one head = one DI-wide tile), then rotate
    and quantise each (token, head) row in registers: q8[t, j, :], q_scale[t, j]."""
    pdl_enter(PDL)
    head = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = head * DI + tl.arange(0, DI)
    m_ok = offs_m < T
    n_ok = offs_n < HEADS * DI
    acc = gemm_tile(x_ptr, w_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, 1, stride_wn, 1, 0, 0,
                    0, 1, 1, DOT_DTYPE, ACC_DTYPE, X_SPLITS, PRECISION, EVEN_K, BLOCK_M, DI, BLOCK_K)
    rot = _hadamard_tile(acc, DI, HPREC)
    code, scale = _quantize_rows(rot, n_ok[None, :], AMAX_FLOOR)
    cols = tl.arange(0, DI)
    rows64 = offs_m.to(tl.int64)
    tl.store(q_ptr + (rows64[:, None] * HEADS + head) * DI + cols[None, :], code.to(tl.uint8), mask=m_ok[:, None])
    tl.store(s_ptr + rows64 * HEADS + head, scale, mask=m_ok)


@triton.jit
def _indexer_key_kernel(ik_ptr, g_ptr, b_ptr, iw_ptr, w_ptr, kpool_ptr, spool_ptr, req_ptr, pos_ptr, tbl_ptr, MB,
                        T, HEADS, stride_ik, stride_iw, k_sblk, k_srow, s_sblk, s_srow, eps, weight_scale,
                        BLOCK_R: tl.constexpr, DI: tl.constexpr, BLOCK_H: tl.constexpr, LOG_BS: tl.constexpr,
                        HPREC: tl.constexpr, PDL: tl.constexpr):
    """One program per BLOCK_R token rows: `_indexer_key_rows`."""
    pdl_enter(PDL)
    _indexer_key_rows(tl.program_id(0), ik_ptr, g_ptr, b_ptr, iw_ptr, w_ptr, kpool_ptr, spool_ptr, req_ptr, pos_ptr,
                      tbl_ptr, MB, T, HEADS, stride_ik, stride_iw, k_sblk, k_srow, s_sblk, s_srow, eps, weight_scale,
                      BLOCK_R, DI, BLOCK_H, LOG_BS, HPREC)


@triton.jit
def _indexer_front_split_kernel(x_ptr, w_ptr, qbuf_ptr, cnt_ptr, q_ptr, s_ptr,
                                ik_ptr, g_ptr, b_ptr, iw_ptr, hw_ptr, kpool_ptr, spool_ptr, req_ptr, pos_ptr, tbl_ptr,
                                MB, T, K, HEADS, NQ, stride_xm, stride_wn, stride_ik, stride_iw,
                                k_sblk, k_srow, s_sblk, s_srow, eps, weight_scale,
                                DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, X_SPLITS: tl.constexpr,
                                PRECISION: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
                                BLOCK_M: tl.constexpr, DI: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, LOG_BS: tl.constexpr,
                                HPREC: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, NQ): (token block, head j, part p) computes the DI / SPLIT query columns
    [p * DI / SPLIT, +DI / SPLIT) of head j (a tensor-core tile of BLOCK_M >= 16 tokens) into the fp32
    scratch qbuf, then counts itself in cnt[token block, j]; the last of the SPLIT parts to arrive
    (release/acquire atomic) reads the whole head back, rotates and quantises it, and resets the counter.
    Every query value is produced by exactly one program, so the result does not depend on arrival order.
    Programs [NQ, ...): the key rows (`_indexer_key_rows`)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid < NQ:
        DP: tl.constexpr = DI // SPLIT
        part = pid % SPLIT
        head = (pid // SPLIT) % HEADS
        tb = pid // (SPLIT * HEADS)
        offs_m = tb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = head * DI + part * DP + tl.arange(0, DP)
        m_ok = offs_m < T
        n_ok = offs_n < HEADS * DI
        acc = gemm_tile(x_ptr, w_ptr, w_ptr, offs_m, offs_n, m_ok, n_ok, K, stride_xm, 1, stride_wn, 1, 0, 0,
                        0, 1, 1, DOT_DTYPE, ACC_DTYPE, X_SPLITS, PRECISION, EVEN_K, BLOCK_M, DP, BLOCK_K)
        rows64 = offs_m.to(tl.int64)
        qrow = qbuf_ptr + rows64[:, None] * (HEADS * DI)
        tl.store(qrow + offs_n[None, :], acc.to(tl.float32), mask=m_ok[:, None])
        tl.debug_barrier()  # every thread's partial stored before the (cumulative) release below
        arrived = tl.atomic_add(cnt_ptr + tb * HEADS + head, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.store(cnt_ptr + tb * HEADS + head, 0)  # ready for the next launch
            cols = tl.arange(0, DI)
            q = tl.load(qrow + head * DI + cols[None, :], mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
            rot = _hadamard_tile(q, DI, HPREC)
            code, scale = _quantize_rows(rot, cols[None, :] < DI, AMAX_FLOOR)
            tl.store(q_ptr + (rows64[:, None] * HEADS + head) * DI + cols[None, :], code.to(tl.uint8),
                     mask=m_ok[:, None])
            tl.store(s_ptr + rows64 * HEADS + head, scale, mask=m_ok)
    else:
        _indexer_key_rows(pid - NQ, ik_ptr, g_ptr, b_ptr, iw_ptr, hw_ptr, kpool_ptr, spool_ptr, req_ptr, pos_ptr,
                          tbl_ptr, MB, T, HEADS, stride_ik, stride_iw, k_sblk, k_srow, s_sblk, s_srow, eps,
                          weight_scale, BLOCK_R, DI, BLOCK_H, LOG_BS, HPREC)


_COUNTERS: dict = {}


def _counters(device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per (token block, head), kept per device: the split kernel's
    last arriving program sets its counter back to 0, so one allocation serves every launch (and every
    replay of a captured graph). Two split launches on one device must not overlap in time (they do not:
    the indexer fronts of a step are on one dependency chain); the first launch at a new size allocates,
    so it belongs to the warm-up before a graph capture."""
    have = _COUNTERS.get(str(device))
    if have is None or have.numel() < n:
        have = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[str(device)] = have
    return have


INDEXER_FRONT_OPERANDS = ("c_q", "wq_b", "ik", "k_norm_w", "k_norm_b", "iw", "key_pool", "scale_pool",
                          "token_req", "token_pos", "block_table")


def indexer_front(ops: list, attrs: dict, config: dict):
    """fused.indexer_front (operand order in passes/fused_indexer_front.py): returns
    (q8 [T,HI,DI], q_scale [T,HI], w [T,HI], key_pool, scale_pool); pools updated in place."""
    if len(ops) != len(INDEXER_FRONT_OPERANDS):
        raise ValueError(f"fused.indexer_front takes ({', '.join(INDEXER_FRONT_OPERANDS)}), got {len(ops)} operands")
    c_q, wq_b, ik, g, b, iw, key_pool, scale_pool, token_req, token_pos, block_table = ops
    hi, di = int(attrs["heads"]), int(attrs["head_dim"])
    if attrs.get("quant", "fp8_pow2") != "fp8_pow2":
        raise ValueError(f"fused.indexer_front: quant {attrs.get('quant')!r} is not supported (fp8_pow2 only)")
    if di & (di - 1) or wq_b.shape[0] != hi * di or key_pool.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fused.indexer_front: wq_b {tuple(wq_b.shape)} must be [{hi}*{di}, q_lora] with DI a power "
                         f"of two, key_pool float8_e4m3fn (found {key_pool.dtype})")
    T, K = c_q.shape
    dev = c_q.device
    q8 = torch.empty(T, hi, di, dtype=torch.uint8, device=dev)
    qs = torch.empty(T, hi, dtype=torch.float32, device=dev)
    w = torch.empty(T, hi, dtype=iw.dtype, device=dev)
    if T > 0 and config.get("SPLIT", 1) > 1:
        _indexer_front_split(c_q, wq_b, ik, g, b, iw, key_pool, scale_pool, token_req, token_pos, block_table,
                             q8, qs, w, attrs, config)
    elif T > 0:
        x = c_q if c_q.stride(-1) == 1 else c_q.contiguous()
        wq = wq_b if wq_b.stride(-1) == 1 else wq_b.contiguous()
        bm, bk = config["BLOCK_M"], config["BLOCK_K"]
        _indexer_query_kernel[(triton.cdiv(T, bm), hi)](
            x, wq, q8, qs, T, K, hi, x.stride(0), wq.stride(0), **dot_numerics(x.dtype, wq.dtype),
            EVEN_K=K % bk == 0, BLOCK_M=bm, DI=di, BLOCK_K=bk, HPREC=precision.precise_fp32(), num_warps=config["num_warps"],
            num_stages=config["num_stages"], **launch_kwargs())
        ikc = ik if ik.stride(-1) == 1 else ik.contiguous()
        iwc = iw if iw.stride(-1) == 1 else iw.contiguous()
        br = config["BLOCK_R"]
        bsz = int(attrs["block_size"])
        tbl, req, mb, log_bs = paging_args(block_table, token_req, bsz, dev)
        k_strides = pool_strides(key_pool, bsz, 1, "fused.indexer_front key_pool")
        s_strides = pool_strides(scale_pool, bsz, 0, "fused.indexer_front scale_pool")
        _indexer_key_kernel[(triton.cdiv(T, br),)](
            ikc, g, b, iwc, w, key_pool.view(torch.uint8), scale_pool, req, token_pos, tbl, mb,
            T, hi, ikc.stride(0), iwc.stride(0), *k_strides, *s_strides, float(attrs["eps"]), float(attrs["weight_scale"]),
            BLOCK_R=br, DI=di, BLOCK_H=pow2_bucket(hi), LOG_BS=log_bs, HPREC=precision.precise_fp32(),
            num_warps=config["num_warps"], **launch_kwargs())
    return q8.view(torch.float8_e4m3fn), qs, w, key_pool, scale_pool


def _indexer_front_split(c_q, wq_b, ik, g, b, iw, key_pool, scale_pool, token_req, token_pos, block_table,
                         q8, qs, w, attrs, config) -> None:
    """One launch of `_indexer_front_split_kernel` (config SPLIT > 1, GEMV 0: tensor-core parts) or of
    `_indexer_front_decode._indexer_front_gemv_kernel` (GEMV 2)."""
    hi, di = int(attrs["heads"]), int(attrs["head_dim"])
    split, bm, bk, br = config["SPLIT"], config["BLOCK_M"], config["BLOCK_K"], config["BLOCK_R"]
    gemv = config.get("GEMV", 0)
    if gemv not in (0, 2):
        raise ValueError(f"fused.indexer_front: GEMV={gemv} is not a path (0: tensor-core parts, 2: one-token GEMV)")
    if di % split or di // split < (1 if gemv else 16):
        raise ValueError(f"fused.indexer_front: SPLIT={split} does not cut head_dim {di} into parts of >= "
                         f"{1 if gemv else 16} columns")
    if gemv and bm != 1:
        raise ValueError(f"fused.indexer_front: the GEMV query path takes BLOCK_M = 1, found {bm}")
    T, K = c_q.shape
    dev = c_q.device
    x = c_q if c_q.stride(-1) == 1 else c_q.contiguous()
    wq = wq_b if wq_b.stride(-1) == 1 else wq_b.contiguous()
    ikc = ik if ik.stride(-1) == 1 else ik.contiguous()
    iwc = iw if iw.stride(-1) == 1 else iw.contiguous()
    bsz = int(attrs["block_size"])
    tbl, req, mb, log_bs = paging_args(block_table, token_req, bsz, dev)
    k_strides = pool_strides(key_pool, bsz, 1, "fused.indexer_front key_pool")
    s_strides = pool_strides(scale_pool, bsz, 0, "fused.indexer_front scale_pool")
    n_tb = triton.cdiv(T, bm)
    nq = n_tb * hi * split
    qbuf = torch.empty(T, hi * di, dtype=torch.float32, device=dev)
    head = (x, wq, qbuf, _counters(dev, n_tb * hi), q8, qs, ikc, g, b, iwc, w, key_pool.view(torch.uint8), scale_pool,
            req, token_pos, tbl, mb, T, K, hi)
    tail = (x.stride(0), wq.stride(0), ikc.stride(0), iwc.stride(0), *k_strides, *s_strides, float(attrs["eps"]),
            float(attrs["weight_scale"]))
    if gemv:
        launch_gemv(head, tail, T, K, hi, di, log_bs, config, precision.precise_fp32())
        return
    _indexer_front_split_kernel[(nq + triton.cdiv(T, br),)](
        *head, nq, *tail, **dot_numerics(x.dtype, wq.dtype), EVEN_K=K % bk == 0, SPLIT=split, BLOCK_M=bm, DI=di,
        BLOCK_K=bk, BLOCK_R=br, BLOCK_H=pow2_bucket(hi), LOG_BS=log_bs, HPREC=precision.precise_fp32(),
        num_warps=config["num_warps"], num_stages=config["num_stages"], **launch_kwargs())


def _front_key(a, attrs) -> dict:
    c_q = a.operands[0]
    return {"T": int(c_q.shape[0]), "K": int(c_q.shape[1]), "HI": int(attrs["heads"]), "DI": int(attrs["head_dim"]),
            "bi": int(bool(attrs.get("batch_invariant", False)))}


def _front_bucket(key: dict) -> dict:
    b = dict(key)
    b["T"] = 0 if b["bi"] else pow2_bucket(b["T"])
    return b


def _front_heuristic(key: dict, target: str) -> dict:
    """Decode (not batch-invariant), one launch: T = 1: `_gemv_config` (the one-token kernel,
    _indexer_front_decode.py); T <= 16 (or T = 1 when wq_b is too wide to preload): every head cut into
    SPLIT = 4 parts, 16-token tensor-core tiles (`_indexer_front_split_kernel`). Otherwise (and always
    under batch invariance: no dependence on T) the two-kernel path: query GEMM with 32 tokens x one head per
    program, BLOCK_K 128, 8 warps (accumulator + Hadamard tile without spills; 64 tokens or 4 warps spill);
    key rows: 16 tokens per program."""
    di, T, bi = key.get("DI", 0), key.get("T", 0), key.get("bi", 1)  # no key: the T-independent path
    if not bi and T == 1 and key.get("K"):
        cfg = _gemv_config(di, key["K"], target)
        if cfg is not None:
            return cfg
    if not bi and 1 <= T <= 16 and di >= 32:
        return {"SPLIT": min(4, di // 16), "GEMV": 0, "BLOCK_M": 16, "BLOCK_K": 128 if target != "cpu" else 64,
                "BLOCK_R": 16, "num_warps": 4, "num_stages": 3 if target != "cpu" else 1}
    if target == "cpu":
        return {"SPLIT": 1, "GEMV": 0, "BLOCK_M": 64, "BLOCK_K": 64, "BLOCK_R": 16, "num_warps": 4, "num_stages": 1}
    return {"SPLIT": 1, "GEMV": 0, "BLOCK_M": 32, "BLOCK_K": 128, "BLOCK_R": 16, "num_warps": 8, "num_stages": 3}


PRELOAD_MAX = 192  # weight values a thread of the one-token kernel holds (the H200's best config: 160 registers)


def _gemv_config(di: int, K: int, target: str) -> dict | None:
    """T = 1: SPLIT 8 parts of DI / 8 columns, 4 warps, K in at most MAX_KT tiles of BLOCK_K >= 512 (K 1536: three
    of 512), all preloaded before the PDL wait (H200, rank preset: 5.49 µs alone, 6.18 in a PDL chain, against
    8.28 / 7.96 for the session-6 split GEMV; the sweep is in _indexer_front_decode.py's docstring). Wider K: more
    parts until a thread holds <= PRELOAD_MAX weight values; None when even one column per part does not fit."""
    bk = max(512 if target != "cpu" else 64, pow2_bucket(-(-K // MAX_KT)))
    kt, split, warps = -(-K // bk), min(8, di), 4
    while (di // split) * bk * kt > PRELOAD_MAX * 32 * warps and split < di:
        split *= 2
    if (di // split) * bk * kt > PRELOAD_MAX * 32 * warps:
        return None
    return {"SPLIT": split, "GEMV": 2, "BLOCK_M": 1, "BLOCK_K": bk, "BLOCK_R": 16, "num_warps": warps, "num_stages": 1}


def _front_constraints(config: dict, key: dict, target: str) -> list[str]:
    out = []
    gemv, split, bk = config.get("GEMV", 0), config.get("SPLIT", 1), config["BLOCK_K"]
    if gemv not in (0, 2):
        out.append(f"GEMV={gemv}: 0 (tensor-core tiles) or 2 (the one-token kernel)")
    if not gemv and (config["BLOCK_R"] < 16 or config["BLOCK_M"] < 16):
        out.append("the Hadamard dot needs BLOCK_R >= 16 and (tensor-core query tiles) BLOCK_M >= 16")
    if gemv and (config["BLOCK_M"] != 1 or split < 2):
        out.append("the GEMV query path takes BLOCK_M = 1 and SPLIT >= 2")
    if key["DI"] % split or (split > 1 and not gemv and key["DI"] // split < 16):
        out.append(f"SPLIT={split} does not cut head_dim {key['DI']} into tensor-core parts of >= 16 columns")
    if gemv and (key["DI"] // split) * bk > 64 * 32 * config["num_warps"]:
        out.append("GEMV tile (DI/SPLIT) x BLOCK_K > 64 fp32 accumulator values a thread spills")
    if gemv and -(-key["K"] // bk) > MAX_KT:
        out.append(f"the one-token kernel holds at most {MAX_KT} weight tiles of BLOCK_K")
    elif gemv and (key["DI"] // split) * bk * -(-key["K"] // bk) > PRELOAD_MAX * 32 * config["num_warps"]:
        out.append(f"the one-token kernel's preloaded weights > {PRELOAD_MAX} values a thread")
    smem = (config["BLOCK_M"] + key["DI"]) * bk * 2 * config["num_stages"] + key["DI"] ** 2 * 4
    if target != "cpu" and not gemv and smem > 232448:
        out.append(f"shared memory {smem} B > 232448 B")
    return out


def _front_supports(a, attrs, target) -> str | None:
    di = int(attrs.get("head_dim", 0))
    if attrs.get("quant", "fp8_pow2") != "fp8_pow2":
        return f"quant {attrs.get('quant')!r} (only fp8_pow2 has a kernel)"
    if di < 16 or di > 256 or di & (di - 1):
        return f"head_dim {di} is not a power of two in 16..256"
    return None


# ---- template plumbing ---------------------------------------------------------------------------


TEMPLATES = [
    KernelTemplate(
        family="indexer_front", backend="triton", ops=("fused.indexer_front",),
        launch=lambda a, attrs, config: indexer_front(a.operands, attrs, config), key_dims=_front_key,
        heuristic=_front_heuristic, tunables=(Tunable("SPLIT", (1, 2, 4, 8, 16)), Tunable("GEMV", (0, 2)),
                                              Tunable("BLOCK_M", (1, 16, 32, 64)),
                                              Tunable("BLOCK_K", (64, 128, 256, 512)),
                                              Tunable("BLOCK_R", (16, 32, 64)), Tunable("num_warps", (4, 8)),
                                              Tunable("num_stages", (1, 2, 3, 4))),
        bucket=_front_bucket, constraints=_front_constraints, supports=_front_supports, batch_invariant=True,
        doc="indexer query GEMM + Hadamard + FP8 per (token, head); key LayerNorm + Hadamard + FP8 + cache write"),
]
