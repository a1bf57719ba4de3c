"""Row-wise normalisation, Hadamard rotation and FP8 power-of-two quantisation (one kernel, the stages
chosen by constexpr flags), for `rms_norm`, `layer_norm`, `hadamard`, `quantize_fp8_pow2` and the
norm/rotation/quantisation stages of `fused.indexer_front` (codegen/triton/indexer_front.py).

Per row x[0:D] (computed in fp32, or fp64 when x is fp64 under the interpreter):
  rms_norm    y = x / sqrt(mean(x^2) + eps) * w
  layer_norm  y = (x - mean) / sqrt(mean((x - mean)^2) + eps) * w + b
  hadamard    y = y @ H_D / sqrt(D),  H_D[i, j] = (-1)^popcount(i & j)  (generated in registers, fp32 dot)
  quantise    e = ceil(log2(max(amax(y), 1e-4) / 448)) taken from the bits of amax (no log2):
              amax = m * 2^E (m in [1, 2)), e = E - 8 + [m > 1.75];  scale = 2^e;
              q = e4m3(y / scale), rounded to nearest even by hand on the fp32 bits, so the byte is the
              same on a GPU and in the interpreter (SPEC §5.4, `ir.formats.quantize_fp8_pow2`).

GATHER (`fused.embedding_rms_norm`, passes/embedding_norm.py): row r is the table row ids[r] (a negative id
counts from the end), stored as loaded to e[r] before the stages run on it.

A program handles BLOCK_R rows of BLOCK_D >= D columns (one pass: the row stays in registers). Every
row is reduced on its own, in an order fixed by (BLOCK_R, BLOCK_D, num_warps): under
`batch_invariant` the key has no row count, so that order does not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codegen.kernel import KernelTemplate, Tunable, pow2_bucket
from codegen.triton import _precision as precision
from codegen.triton._pdl import launch_kwargs, pdl_enter

MAX_BLOCK_D = 32768
AMAX_FLOOR = tl.constexpr(1e-4)


@triton.jit
def hadamard_matrix(N: tl.constexpr):
    """H_N [N, N] in fp32, H[i, j] = (-1)^popcount(i & j) (the parity folded out of the bits of i & j)."""
    i = tl.arange(0, N)[:, None]
    j = tl.arange(0, N)[None, :]
    v = i & j
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return tl.where((v & 1) == 0, 1.0, -1.0).to(tl.float32)


@triton.jit
def _hadamard_tile(y, BLOCK_D: tl.constexpr, HPREC: tl.constexpr):
    """y [BR, BLOCK_D] @ H_BLOCK_D / sqrt(BLOCK_D) (fp32 dot at ~fp32 accuracy, HPREC =
    `_precision.precise_fp32()`)."""
    h = hadamard_matrix(BLOCK_D)
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
def _norm_rot_quant_kernel(x_ptr, w_ptr, b_ptr, y_ptr, q_ptr, s_ptr, ids_ptr, e_ptr, R, D, V, stride_x, stride_y,
                           stride_q, eps, NORM: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                           ROTATE: tl.constexpr, QUANT: tl.constexpr, STORE_Y: tl.constexpr, GATHER: tl.constexpr,
                           CDT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HPREC: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    col_ok = cols[None, :] < D
    ok = row_ok[:, None] & col_ok
    rows64 = rows.to(tl.int64)
    if GATHER:  # x is a table: row r is table row ids[r], kept as loaded in e
        src = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        src = tl.where(src < 0, src + V, src)
        x = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
        tl.store(e_ptr + rows64[:, None] * D + cols[None, :], x, mask=ok)
        y = x.to(CDT)
    else:
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
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return _run_rows(x2, x2.shape[0], x.shape[:-1], config, norm=norm, weight=weight, bias=bias, eps=eps,
                     rotate=rotate, quant=quant, store_y=store_y)[:3]


def embedding_rms_norm(table: torch.Tensor, ids: torch.Tensor, weight, eps: float, config: dict):
    """(e, h): e[..] = table[ids[..]] and h = rms_norm(e) * weight, one pass over each gathered row (GATHER)."""
    if table.dim() != 2 or table.stride(-1) != 1:
        raise ValueError(f"embedding_rms_norm: table must be 2-D with unit-stride rows, found {tuple(table.shape)} "
                         f"strides {table.stride()}")
    if ids.dtype.is_floating_point:
        raise ValueError(f"embedding_rms_norm: ids must be integers, found {ids.dtype}")
    flat = ids.reshape(-1).contiguous()
    y, _, _, e = _run_rows(table, flat.numel(), ids.shape, config, norm="rms", weight=weight, eps=eps, ids=flat)
    return e, y


def _run_rows(x2, R: int, lead, config: dict, *, norm=None, weight=None, bias=None, eps=0.0, rotate=False,
              quant=False, store_y=True, ids=None):
    """One launch over R rows of x2 [rows, D] (rows ids[r] of it when ids is given); (y, q, s, e), each None
    when not asked for, reshaped to lead + their trailing dims."""
    D = x2.shape[-1]
    bd = config["BLOCK_D"]
    if bd < D or (rotate and bd != D):
        raise ValueError(f"norm_rot_quant: BLOCK_D={bd} must be >= D={D} (== D for the Hadamard rotation)")
    if rotate and (D & (D - 1)) != 0:
        raise ValueError(f"hadamard needs a power-of-two last axis, found D={D}")
    dev = x2.device
    y = torch.empty(R, D, dtype=x2.dtype, device=dev) if store_y else None
    q = torch.empty(R, D, dtype=torch.uint8, device=dev) if quant else None
    s = torch.empty(R, dtype=torch.float32, device=dev) if quant else None
    e = torch.empty(R, D, dtype=x2.dtype, device=dev) if ids is not None else None
    if R > 0:
        pick = lambda t: x2 if t is None else t  # noqa: E731
        _norm_rot_quant_kernel[(triton.cdiv(R, config["BLOCK_R"]),)](
            x2, pick(weight), pick(bias), pick(y), pick(q), pick(s), pick(ids), pick(e), R, D, x2.shape[0],
            x2.stride(0), D, D, float(eps), NORM={None: 0, "rms": 1, "layer": 2}[norm], HAS_W=weight is not None,
            HAS_B=bias is not None, ROTATE=rotate, QUANT=quant, STORE_Y=store_y, GATHER=ids is not None,
            CDT=_cdt(x2), HPREC=precision.precise_fp32(), BLOCK_R=config["BLOCK_R"], BLOCK_D=bd,
            num_warps=config["num_warps"], **launch_kwargs())
    shp = lambda t: None if t is None else t.reshape(*lead, *t.shape[1:])  # noqa: E731
    return (shp(y), None if q is None else shp(q.view(torch.float8_e4m3fn)), shp(s), shp(e))


# ---- fused.indexer_front ----------------------------------------------------------------------------
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
    """BLOCK_D = next power of two >= D; about 2048 elements per program, one warp per 512 of them (H200,
    graph replay of one decode row: D = 7168 -> 1 row x 16 warps 2.36 us (8 warps 2.58); D = 1536 -> 1 row
    x 4 warps 1.67 us (2 rows 2.14)). With the rotation: 16 rows and 8 warps (the D x D Hadamard tile lives
    in registers: ptxas shows no spills at D = 128, spills with 4 warps or 64 rows). Independent of R
    (batch invariance)."""
    bd = pow2_bucket(key["D"])
    br = max(1, min(64, 2048 // bd))
    warps = max(1, min(16, (br * bd) // 512))
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


def _launch_embedding_rms(a, attrs, config):
    table, ids, weight = a.operands
    return embedding_rms_norm(table, ids, weight, attrs["eps"], config)


def _embedding_key(a, attrs) -> dict:
    table, ids, _ = a.operands
    key = row_key(table, attrs)
    key["R"] = 1
    for d in ids.shape:
        key["R"] *= int(d)
    return key


def _template(family, op, launch, rotate=False, doc=""):
    return KernelTemplate(
        family=family, backend="triton", ops=(op,), launch=launch,
        key_dims=lambda a, attrs: row_key(a.x, attrs, rotate), heuristic=row_heuristic, tunables=TUNABLES,
        bucket=row_bucket, constraints=row_constraints, supports=lambda a, attrs, target: row_supports(a.x, rotate),
        batch_invariant=True, doc=doc)


TEMPLATES = [
    _template("rms_norm", "rms_norm", _launch_rms, doc="x / sqrt(mean(x^2) + eps) * w, one pass per row"),
    _template("layer_norm", "layer_norm", _launch_layer, doc="(x - mean) / sqrt(var + eps) * w + b"),
    _template("hadamard", "hadamard", _launch_hadamard, rotate=True, doc="x @ H_D / sqrt(D), fp32 dot"),
    _template("quant_fp8_pow2", "quantize_fp8_pow2", _launch_quant,
              doc="per-row e4m3 with scale 2^ceil(log2(max(amax,1e-4)/448)), exact bit arithmetic"),
    KernelTemplate(
        family="embedding_rms_norm", backend="triton", ops=("fused.embedding_rms_norm",),
        launch=_launch_embedding_rms, key_dims=_embedding_key, heuristic=row_heuristic, tunables=TUNABLES,
        bucket=row_bucket, constraints=row_constraints,
        supports=lambda a, attrs, target: row_supports(a.operands[0]), batch_invariant=True,
        doc="table rows gathered by ids (kept) and RMS-normalised in the same pass"),
]
