"""Row-wise normalisation, Hadamard rotation and FP8 power-of-two quantisation (one kernel, the stages
chosen by constexpr flags), for `rms_norm`, `layer_norm`, `hadamard`, `quantize_fp8_pow2` and the
norm/rotation/quantisation stages of `fused.indexer_front`.

Per row x[0:D] (computed in fp32, or fp64 when x is fp64 under the interpreter):
  rms_norm    y = x / sqrt(mean(x^2) + eps) * w
  layer_norm  y = (x - mean) / sqrt(mean((x - mean)^2) + eps) * w + b
  hadamard    y = y @ H_D / sqrt(D),  H_D[i, j] = (-1)^popcount(i & j)  (generated in registers, fp32 dot)
  quantise    e = ceil(log2(max(amax(y), 1e-4) / 448)) taken from the bits of amax (no log2):
              amax = m * 2^E (m in [1, 2)), e = E - 8 + [m > 1.75];  scale = 2^e;
              q = e4m3(y / scale), rounded to nearest even by hand on the fp32 bits, so the byte is the
              same on a GPU and in the interpreter (SPEC §5.4, `ir.formats.quantize_fp8_pow2`).

A program handles BLOCK_R rows of BLOCK_D >= D columns (one pass: the row stays in registers). Every
row is reduced on its own, in an order fixed by (BLOCK_R, BLOCK_D, num_warps): under
`batch_invariant` the key has no row count, so that order does not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton.gemm import dot_numerics, gemm_tile
from codegen.triton import _precision as precision
from codegen.triton._paging import paging_args, pool_strides, row_offsets, rows_of

MAX_BLOCK_D = 32768
AMAX_FLOOR = tl.constexpr(1e-4)


@triton.jit
def _hadamard_tile(y, BLOCK_D: tl.constexpr, HPREC: tl.constexpr):
    """y [BR, BLOCK_D] @ H_BLOCK_D / sqrt(BLOCK_D) (fp32 dot at ~fp32 accuracy, HPREC =
    `_precision.precise_fp32()`; H from the parity of i & j)."""
    i = tl.arange(0, BLOCK_D)[:, None]
    j = tl.arange(0, BLOCK_D)[None, :]
    v = i & j
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    h = tl.where((v & 1) == 0, 1.0, -1.0).to(tl.float32)
    return tl.dot(y.to(tl.float32), h, input_precision=HPREC) * (1.0 / tl.sqrt(BLOCK_D * 1.0))


@triton.jit
def _pow2_from_exponent(e):
    """Exact fp32 2^e for int32 e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_code(v):
    """int32 e4m3fn bit patterns (0..255) of fp32 v, |v| <= 448: round half to even, exact on the fp32 bits
    (the same byte on a GPU and in the interpreter)."""
    a = tl.abs(v)
    ex = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals share 2^-6's step
    steps = a * _pow2_from_exponent(3 - ex)  # a / 2^(ex-3), exact, < 16
    r = (steps + 8388608.0) - 8388608.0  # round half to even at integer resolution
    code = r.to(tl.int32) + (ex + 6) * 8  # r in 0..16; r == 16 carries into the next exponent
    return code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)  # sign bit


@triton.jit
def _quantize_rows(y, col_ok, AMAX_FLOOR: tl.constexpr):
    """(bytes int32 [BR, BD] in 0..255 (e4m3fn bit patterns), scale fp32 [BR]) per row of y."""
    y = tl.where(col_ok, y.to(tl.float32), 0.0)
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), AMAX_FLOOR)
    ab = amax.to(tl.int32, bitcast=True)
    e = ((ab >> 23) & 0xFF) - 127 - 8 + ((ab & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale = _pow2_from_exponent(e)
    v = y * _pow2_from_exponent(-e)[:, None]  # exact: multiplication by a power of two
    return e4m3_code(v), scale


@triton.jit
def _norm_rot_quant_kernel(x_ptr, w_ptr, b_ptr, y_ptr, q_ptr, s_ptr, R, D, stride_x, stride_y, stride_q, eps,
                           NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROTATE: tl.constexpr,
                           QUANT: tl.constexpr, STORE_Y: tl.constexpr, CDT: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HPREC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    col_ok = cols[None, :] < D
    ok = row_ok[:, None] & col_ok
    rows64 = rows.to(tl.int64)
    y = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(CDT)
    if NORM == 1:  # RMSNorm
        ms = tl.sum(y * y, axis=1) / D
        y = y / tl.sqrt(ms + eps)[:, None]
    if NORM == 2:  # LayerNorm, biased variance
        mu = tl.sum(y, axis=1) / D
        yc = tl.where(col_ok, y - mu[:, None], 0.0)
        var = tl.sum(yc * yc, axis=1) / D
        y = yc / tl.sqrt(var + eps)[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(CDT)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(CDT)[None, :]
    if ROTATE:
        y = _hadamard_tile(y, BLOCK_D, HPREC).to(CDT)
    if STORE_Y:
        tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)
    if QUANT:
        code, scale = _quantize_rows(y, col_ok, AMAX_FLOOR)
        tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], code.to(tl.uint8), mask=ok)
        tl.store(s_ptr + rows, scale, mask=row_ok)


def _cdt(x: torch.Tensor):
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def norm_rot_quant(x: torch.Tensor, config: dict, *, norm: str | None = None, weight=None, bias=None,
                   eps: float = 0.0, rotate: bool = False, quant: bool = False, store_y: bool = True):
    """Run the stages on x [..., D]; returns (y or None, q f8e4m3 or None, scale f32 or None)."""
    D = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    bd = config["BLOCK_D"]
    if bd < D or (rotate and bd != D):
        raise ValueError(f"norm_rot_quant: BLOCK_D={bd} must be >= D={D} (== D for the Hadamard rotation)")
    if rotate and (D & (D - 1)) != 0:
        raise ValueError(f"hadamard needs a power-of-two last axis, found D={D}")
    dev = x.device
    y = torch.empty(R, D, dtype=x.dtype, device=dev) if store_y else None
    q = torch.empty(R, D, dtype=torch.uint8, device=dev) if quant else None
    s = torch.empty(R, dtype=torch.float32, device=dev) if quant else None
    if R > 0:
        dummy = x2
        grid = (triton.cdiv(R, config["BLOCK_R"]),)
        _norm_rot_quant_kernel[grid](
            x2, weight if weight is not None else dummy, bias if bias is not None else dummy,
            y if y is not None else dummy, q if q is not None else dummy, s if s is not None else dummy,
            R, D, x2.stride(0), D, D, float(eps),
            NORM={None: 0, "rms": 1, "layer": 2}[norm], HAS_W=weight is not None, HAS_B=bias is not None,
            ROTATE=rotate, QUANT=quant, STORE_Y=store_y, CDT=_cdt(x), HPREC=precision.precise_fp32(),
            BLOCK_R=config["BLOCK_R"], BLOCK_D=bd, num_warps=config["num_warps"])
    return (None if y is None else y.reshape(*lead, D),
            None if q is None else q.view(torch.float8_e4m3fn).reshape(*lead, D),
            None if s is None else s.reshape(lead))


# ---- fused.indexer_front ----------------------------------------------------------------------------
@triton.jit
def _indexer_query_kernel(x_ptr, w_ptr, q_ptr, s_ptr, T, K, HEADS, stride_xm, stride_wn,
                          DOT_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr, X_SPLITS: tl.constexpr,
                          PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, DI: tl.constexpr, BLOCK_K: tl.constexpr, HPREC: tl.constexpr):
    """Program (token block, head j): acc = c_q @ W_Iq[j]^T (one head = one DI-wide tile), then rotate
    and quantise each (token, head) row in registers: q8[t, j, :], q_scale[t, j]."""
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
                        HPREC: tl.constexpr):
    """Per token: key = fp8(H LayerNorm(ik)) written at the pool row of (token_req, token_pos) through
    the block table (bytes and scale; pools flat or block views: row r at (r >> LOG_BS) * s_blk +
    (r & (bs - 1)) * s_row elements, `_paging.row_offsets`), and w = weight_scale * iw."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, DI)
    k = tl.load(ik_ptr + rows64[:, None] * stride_ik + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    mu = tl.sum(k, axis=1) / DI
    kc = k - mu[:, None]
    k = kc / tl.sqrt(tl.sum(kc * kc, axis=1) / DI + eps)[:, None]
    k = k * tl.load(g_ptr + cols).to(tl.float32)[None, :] + tl.load(b_ptr + cols).to(tl.float32)[None, :]
    code, scale = _quantize_rows(_hadamard_tile(k, DI, HPREC), cols[None, :] < DI, AMAX_FLOOR)
    req = tl.load(req_ptr + rows, mask=row_ok, other=0)
    dest = rows_of(tbl_ptr + req * MB, tl.load(pos_ptr + rows, mask=row_ok, other=0), row_ok, LOG_BS)
    kdst = row_offsets(dest, LOG_BS, k_sblk, k_srow)
    tl.store(kpool_ptr + kdst[:, None] + cols[None, :], code.to(tl.uint8), mask=row_ok[:, None])
    tl.store(spool_ptr + row_offsets(dest, LOG_BS, s_sblk, s_srow), scale, mask=row_ok)
    hs = tl.arange(0, BLOCK_H)
    h_ok = row_ok[:, None] & (hs[None, :] < HEADS)
    iw = tl.load(iw_ptr + rows64[:, None] * stride_iw + hs[None, :], mask=h_ok, other=0.0)
    tl.store(w_ptr + rows64[:, None] * HEADS + hs[None, :], (iw.to(tl.float32) * weight_scale).to(w_ptr.dtype.element_ty),
             mask=h_ok)


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
    if T > 0:
        x = c_q if c_q.stride(-1) == 1 else c_q.contiguous()
        wq = wq_b if wq_b.stride(-1) == 1 else wq_b.contiguous()
        bm, bk = config["BLOCK_M"], config["BLOCK_K"]
        _indexer_query_kernel[(triton.cdiv(T, bm), hi)](
            x, wq, q8, qs, T, K, hi, x.stride(0), wq.stride(0), **dot_numerics(x.dtype, wq.dtype),
            EVEN_K=K % bk == 0, BLOCK_M=bm, DI=di, BLOCK_K=bk, HPREC=precision.precise_fp32(), num_warps=config["num_warps"],
            num_stages=config["num_stages"])
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
            num_warps=config["num_warps"])
    return q8.view(torch.float8_e4m3fn), qs, w, key_pool, scale_pool


def _front_key(a, attrs) -> dict:
    c_q, wq_b = a.operands[0], a.operands[1]
    return {"T": int(c_q.shape[0]), "K": int(c_q.shape[1]), "HI": int(attrs["heads"]), "DI": int(attrs["head_dim"]),
            "bi": int(bool(attrs.get("batch_invariant", False)))}


def _front_bucket(key: dict) -> dict:
    b = dict(key)
    b["T"] = 0 if b["bi"] else pow2_bucket(b["T"], 16)
    return b


def _front_heuristic(key: dict, target: str) -> dict:
    """Query GEMM: 32 tokens x one head per program, BLOCK_K 128, 8 warps (accumulator + Hadamard tile
    without spills; 64 tokens or 4 warps spill); key rows: 16 tokens per program. No dependence on T."""
    if target == "cpu":
        return {"BLOCK_M": 64, "BLOCK_K": 64, "BLOCK_R": 16, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M": 32, "BLOCK_K": 128, "BLOCK_R": 16, "num_warps": 8, "num_stages": 3}


def _front_constraints(config: dict, key: dict, target: str) -> list[str]:
    out = []
    if config["BLOCK_M"] < 16 or config["BLOCK_R"] < 16:
        out.append("the Hadamard dot needs BLOCK_M >= 16 and BLOCK_R >= 16")
    smem = (config["BLOCK_M"] + key["DI"]) * config["BLOCK_K"] * 2 * config["num_stages"] + key["DI"] ** 2 * 4
    if target != "cpu" and smem > 232448:
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
def row_key(x, attrs, rotate=False) -> dict:
    rows = 1
    for d in x.shape[:-1]:
        rows *= int(d)
    return {"R": rows, "D": int(x.shape[-1]), "rot": int(rotate),
            "bi": int(bool(attrs.get("batch_invariant", False)))}


def row_bucket(key: dict) -> dict:
    b = dict(key)
    b["R"] = 0 if b["bi"] else pow2_bucket(b["R"])
    return b


TUNABLES = (Tunable("BLOCK_R", (1, 2, 4, 8, 16, 32, 64)), Tunable("num_warps", (1, 2, 4, 8, 16)))


def row_heuristic(key: dict, target: str) -> dict:
    """BLOCK_D = next power of two >= D; about 4096 elements per program; warps scale with the tile.
    With the rotation: 16 rows and 8 warps (the D x D Hadamard tile lives in registers: ptxas shows no
    spills at D = 128, spills with 4 warps or 64 rows). Independent of R (batch invariance)."""
    bd = pow2_bucket(key["D"])
    br = max(1, min(64, 4096 // bd))
    warps = max(1, min(16, (br * bd) // 1024))
    if key.get("rot"):
        br, warps = 16, 8
    if target == "cpu":
        br = max(br, min(64, 32768 // bd))  # the interpreter pays per program: fewer, larger ones
    return {"BLOCK_R": br, "BLOCK_D": bd, "num_warps": warps}


def row_constraints(config: dict, key: dict, target: str) -> list[str]:
    out = []
    if config["BLOCK_D"] < key["D"]:
        out.append(f"BLOCK_D={config['BLOCK_D']} < D={key['D']}")
    if key.get("rot") and config["BLOCK_R"] < 16:
        out.append("the Hadamard dot needs BLOCK_R >= 16")
    if config["BLOCK_R"] * config["BLOCK_D"] > 65536:
        out.append("tile BLOCK_R*BLOCK_D > 65536 values does not fit in registers")
    return out


def row_supports(x, rotate=False) -> str | None:
    d = x.shape[-1]
    if not getattr(d, "is_number", True):
        return f"last axis {d} is symbolic"
    d = int(d)
    if d > MAX_BLOCK_D:
        return f"last axis {d} > {MAX_BLOCK_D} (one-pass rows only)"
    if rotate and d & (d - 1):
        return f"hadamard needs a power-of-two last axis, found {d}"
    name = getattr(x.dtype, "name", None) or str(x.dtype)
    if name not in ("f32", "bf16", "f16", "f64") and x.dtype not in (torch.float32, torch.bfloat16, torch.float16,
                                                                     torch.float64):
        return f"dtype {name} is not a plain float"
    return None


def _launch_rms(a, attrs, config):
    return norm_rot_quant(a.x, config, norm="rms", weight=a.weight, eps=attrs["eps"])[0]


def _launch_layer(a, attrs, config):
    return norm_rot_quant(a.x, config, norm="layer", weight=a.weight, bias=a.bias, eps=attrs["eps"])[0]


def _launch_hadamard(a, attrs, config):
    return norm_rot_quant(a.x, config, rotate=True)[0]


def _launch_quant(a, attrs, config):
    _, q, s = norm_rot_quant(a.x, config, quant=True, store_y=False)
    return q, s


def _template(family, op, launch, rotate=False, doc=""):
    return KernelTemplate(
        family=family, backend="triton", ops=(op,), launch=launch,
        key_dims=lambda a, attrs: row_key(a.x, attrs, rotate), heuristic=row_heuristic, tunables=TUNABLES,
        bucket=row_bucket, constraints=row_constraints, supports=lambda a, attrs, target: row_supports(a.x, rotate),
        batch_invariant=True, doc=doc)


TEMPLATES = [
    KernelTemplate(
        family="indexer_front", backend="triton", ops=("fused.indexer_front",),
        launch=lambda a, attrs, config: indexer_front(a.operands, attrs, config), key_dims=_front_key,
        heuristic=_front_heuristic, tunables=(Tunable("BLOCK_M", (16, 32, 64)), Tunable("BLOCK_K", (64, 128, 256)),
                                              Tunable("BLOCK_R", (16, 32, 64)), Tunable("num_warps", (4, 8)),
                                              Tunable("num_stages", (2, 3, 4))),
        bucket=_front_bucket, constraints=_front_constraints, supports=_front_supports, batch_invariant=True,
        doc="indexer query GEMM + Hadamard + FP8 per (token, head); key LayerNorm + Hadamard + FP8 + cache write"),
    _template("rms_norm", "rms_norm", _launch_rms, doc="x / sqrt(mean(x^2) + eps) * w, one pass per row"),
    _template("layer_norm", "layer_norm", _launch_layer, doc="(x - mean) / sqrt(var + eps) * w + b"),
    _template("hadamard", "hadamard", _launch_hadamard, rotate=True, doc="x @ H_D / sqrt(D), fp32 dot"),
    _template("quant_fp8_pow2", "quantize_fp8_pow2", _launch_quant,
              doc="per-row e4m3 with scale 2^ceil(log2(max(amax,1e-4)/448)), exact bit arithmetic"),
]
