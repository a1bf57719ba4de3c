"""MLA prefill (IR op `mla_attention`, form="decompressed", SPEC §4): flash attention over keys and
values decompressed from the latent pool, and sparse prefill when the indexer selects.

Dense (no selection), per request r with context positions 0 .. L_r - 1 (L_r = its largest token
position + 1, cached prefix included):
    c = the latent rows of positions [0, L_r) (paged: `ir.ref.paging`, from a flat pool or a block view
        of the packed pool; dequantised for fp8 / nvfp4 pools)
    k_nope^h = c W_UK^h^T,  v^h = c W_UV^h^T  (one batched matmul per request, [L_r, H, dn|dv])
    z_h(t, s) = scale (q_nope^h(t) . k_nope^h(s) + q_pe^h(t) . k_pe(s)),  s <= token_pos[t]
    o^h(t) = softmax_s(z) v^h,  lse = log sum_s e^z.
The kernel: one program per (block of BLOCK_M tokens of one request, head); online softmax in fp32
(exp2) over key blocks up to the block's largest position, causal mask by position (so tokens in any
order, prefixes already cached, and several prompts per batch all work). The shared k_pe is one
[L, dr] tensor read by every head.

Sparse (a selection is given): every token attends to its own selected rows, so nothing is shared
between the tokens of a prompt; decompressing each token's 2048 rows would cost (dn+dv)/1 more
FLOPs than attending in the latent space, so the absorbed sparse kernel of `mla_sparse` runs with
the prompt's tokens as its rows (same math, SPEC §4 says both forms must agree).
Tunables: BLOCK_M, BLOCK_N, num_warps, num_stages. Also here (torch, shared with tests and benches): the
quantised latent pool writers `quantize_latent_fp8` / `quantize_latent_nvfp4` and the reader
`dequantize_latent` (layouts: mla_sparse's docstring).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ir import formats
from ir.ref.paging import cache_rows, read_rows

from ..kernel import KernelTemplate, Tunable, pow2_bucket
from . import _precision as precision
from .mla_sparse import (_LN2, LATENT_FORMATS, LOG2E, mla_sparse_decode, pool_and_selection_problem, pool_format,
                         split_kv_b)
from .mla_sparse import heuristic as sparse_heuristic


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------- latent pool formats (layouts: see mla_sparse)
def quantize_latent_fp8(latent: torch.Tensor):
    """fp32/bf16 rows -> (e4m3 rows, per-layer scale amax/448 as a float)."""
    amax = float(latent.float().abs().max()) if latent.numel() else 0.0
    scale = amax / formats.FP8_E4M3_MAX if amax > 0 else 1.0
    return formats.encode_fp8_e4m3(latent.float() / scale), scale


def quantize_latent_nvfp4(latent: torch.Tensor, kv: int):
    """rows [N, kv + dr] -> (uint8 rows [N, kv/2 + kv/16 + dr], latent_scale, pe_scale), SPEC §7."""
    c, kpe = latent[:, :kv].float(), latent[:, kv:].float()
    packed, bs, ts = formats.quantize_nvfp4(c)
    kpe8, pe_scale = quantize_latent_fp8(kpe)
    rows = torch.cat([packed, bs.view(torch.uint8), kpe8.view(torch.uint8)], dim=1).contiguous()
    return rows, float(ts), pe_scale


def dequantize_latent(pool: torch.Tensor, latent_format: str, kv: int, latent_scale: float = 1.0,
                      pe_scale: float = 1.0) -> torch.Tensor:
    """Any pool format -> fp32 rows [N, kv + dr] (exactly what the kernels compute with)."""
    if latent_format in ("bf16", "fp32"):
        return pool.float()
    if latent_format == "fp8":
        return pool.view(torch.float8_e4m3fn).float() * latent_scale
    if latent_format == "nvfp4":
        return formats.dequantize_latent_nvfp4(pool, kv, latent_scale, pe_scale)
    raise ValueError(f"latent_format must be one of {LATENT_FORMATS}, found {latent_format!r}")


@triton.jit
def _mla_prefill_kernel(qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, order_ptr, pos_ptr, blk_ptr, o_ptr, lse_ptr,
                        H, qk_scale, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr):
    """blk[b] = (first entry in `order`, token count, first context row of the request)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(blk_ptr + 3 * b)
    nt = tl.load(blk_ptr + 3 * b + 1)
    c0 = tl.load(blk_ptr + 3 * b + 2)
    i = tl.arange(0, BLOCK_M)
    im = i < nt
    tok = tl.load(order_ptr + t0 + i, mask=im, other=0)
    qpos = tl.load(pos_ptr + tok, mask=im, other=-1)
    th = tok * H + h
    d = tl.arange(0, DN)
    r = tl.arange(0, DR)
    e = tl.arange(0, DV)
    qn = tl.load(qn_ptr + th[:, None] * DN + d[None, :], mask=im[:, None], other=0.0).to(DOT_DT)
    qp = tl.load(qp_ptr + th[:, None] * DR + r[None, :], mask=im[:, None], other=0.0).to(DOT_DT)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    hi = tl.max(qpos, 0) + 1
    for j in range(0, hi, BLOCK_N):
        s_ = j + tl.arange(0, BLOCK_N)
        sm = s_ < hi
        crow = (c0 + s_).to(tl.int64)
        kn = tl.load(kn_ptr + (crow * H + h)[:, None] * DN + d[None, :], mask=sm[:, None], other=0.0).to(DOT_DT)
        kp = tl.load(kp_ptr + crow[:, None] * DR + r[None, :], mask=sm[:, None], other=0.0).to(DOT_DT)
        v = tl.load(v_ptr + (crow * H + h)[:, None] * DV + e[None, :], mask=sm[:, None], other=0.0).to(DOT_DT)
        z = tl.dot(qn, tl.trans(kn), input_precision=PREC) + tl.dot(qp, tl.trans(kp), input_precision=PREC)
        z = tl.where((s_[None, :] <= qpos[:, None]) & sm[None, :], z * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(z - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DT), v, input_precision=PREC)
        m_i = m_new
    has = l_i > 0.0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(o_ptr + th[:, None] * DV + e[None, :], acc, mask=im[:, None])
    tl.store(lse_ptr + th, tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * _LN2, float("-inf")), mask=im)


def heuristic(key: dict, target: str) -> dict:
    if key.get("sparse"):
        return sparse_heuristic(key, target)
    if target == "cpu":
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def _blocks(token_req: torch.Tensor, token_pos: torch.Tensor, block_m: int):
    """Tokens sorted by (request, position) and cut into blocks of <= block_m tokens of one request."""
    req = token_req.to("cpu", torch.int64)
    pos = token_pos.to("cpu", torch.int64)
    order = torch.argsort(req * (int(pos.max()) + 2) + pos, stable=True) if req.numel() else req
    reqs = req[order].tolist()
    blocks, runs = [], []
    i = 0
    while i < len(reqs):
        j = i
        while j < len(reqs) and reqs[j] == reqs[i]:
            j += 1
        runs.append((reqs[i], i, j))
        blocks += [(s, min(block_m, j - s), reqs[i]) for s in range(i, j, block_m)]
        i = j
    return order, blocks, runs


def mla_prefill(q_nope, q_pe, latent, kv_b, token_pos, token_req, block_table, block_size: int, scale: float,
                selection=None, *,
                latent_format: str = "bf16", latent_scale: float = 1.0, pe_scale: float = 1.0,
                selection_rows: bool = False, return_lse: bool = False, config: dict | None = None):
    """Decompressed-form MLA over each token's causal context (or its selection, via the sparse
    kernel). q_nope [T, H, dn], q_pe [T, H, dr], latent pool (flat [N, W] or a block view [NB, bs, W] of
    the packed pool: the context rows are gathered once per request), kv_b [H*(dn+dv), kv].
    Returns o [T, H, dv] in q_nope's dtype (and lse [T, H] fp32 when return_lse)."""
    if selection is not None:
        return mla_sparse_decode(q_nope, q_pe, latent, kv_b, token_pos, token_req, block_table, block_size, scale,
                                 selection,
                                 latent_format=latent_format, latent_scale=latent_scale, pe_scale=pe_scale,
                                 selection_rows=selection_rows, return_lse=return_lse,
                                 config=config if config and "BLOCK_H" in config else None)
    T, H, DN = q_nope.shape
    DR = q_pe.shape[2]
    KV = kv_b.shape[1]
    W_UK, W_UV = split_kv_b(kv_b, H, DN)
    DV = W_UV.shape[1]
    for name, n in (("qk_nope_head_dim", DN), ("qk_rope_head_dim", DR), ("v_head_dim", DV)):
        if n & (n - 1) or n < 16:
            raise ValueError(f"mla_prefill: {name} = {n} must be a power of two >= 16")
    dev, dt = q_nope.device, q_nope.dtype
    cfg = dict(config or heuristic({"sparse": 0}, "cpu" if dev.type == "cpu" else "gpu"))
    bm = int(cfg["BLOCK_M"])
    o = torch.empty(T, H, DV, dtype=torch.float32, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return (o.to(dt), lse) if return_lse else o.to(dt)
    order, blocks, runs = _blocks(token_req, token_pos, bm)
    pos_cpu = token_pos.to("cpu", torch.int64)
    ctx_start, kn, kp, vv, c0 = {}, [], [], [], 0
    for r, i, j in runs:                      # decompress each request's context once
        L = int(pos_cpu[order[i:j]].max()) + 1
        rows = cache_rows(block_table, block_size, torch.tensor(r), torch.arange(L, device=dev))
        c = dequantize_latent(read_rows(latent, rows, block_size), latent_format, KV, latent_scale, pe_scale).to(dt)
        kn.append(torch.einsum("lk,hnk->lhn", c[:, :KV], W_UK.to(dt)))
        vv.append(torch.einsum("lk,hvk->lhv", c[:, :KV], W_UV.to(dt)))
        kp.append(c[:, KV:])
        ctx_start[r] = c0
        c0 += L
    blk = torch.tensor([[s, n, ctx_start[r]] for s, n, r in blocks], dtype=torch.int64, device=dev)
    f32 = _interpreting() or dt == torch.float32
    _mla_prefill_kernel[(len(blocks), H)](
        q_nope.contiguous(), q_pe.to(dt).contiguous(), torch.cat(kn).contiguous(), torch.cat(kp).contiguous(),
        torch.cat(vv).contiguous(), order.to(dev), token_pos.to(device=dev, dtype=torch.int64).contiguous(), blk,
        o, lse, H, scale * LOG2E, DN=DN, DR=DR, DV=DV, BLOCK_M=bm, BLOCK_N=int(cfg["BLOCK_N"]),
        DOT_DT=tl.float32 if f32 else tl.bfloat16, PREC="ieee" if f32 else precision.low_bits(),
        num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]))
    return (o.to(dt), lse) if return_lse else o.to(dt)


# ------------------------------------------------------------------------------------ template
def _launch(a, attrs, config):
    fmt = pool_format(a.latent, attrs)  # an FP8 IR pool holds e4m3 codes with per-layer scale 1 (SPEC §7)
    return mla_prefill(a.q_nope, a.q_pe, a.latent, a.kv_b, a.token_pos, a.token_req, a.block_table,
                       int(attrs["block_size"]), float(attrs["scale"]), a.selection, latent_format=fmt, config=config,
                       selection_rows=attrs.get("selection_kind", "positions") == "rows")


def _key(a, attrs) -> dict:
    T, H = int(a.q_nope.shape[0]), int(a.q_nope.shape[1])
    sparse = int(a.selection is not None)
    L = int(a.selection.shape[1]) if sparse else 0
    return {"T": T, "H": H, "L": L, "sparse": sparse, "fmt": 0}


def _bucket(key: dict) -> dict:
    return dict(key, T=pow2_bucket(key["T"], 16), L=pow2_bucket(key["L"], 256) if key["sparse"] else 0)


def _supports(a, attrs, target) -> str | None:
    if attrs.get("form", "absorbed") != "decompressed":
        return "absorbed form runs in mla_sparse"
    try:
        dims = [int(a.q_nope.shape[2]), int(a.q_pe.shape[2]), int(a.kv_b.shape[1])]
    except TypeError:
        return "head dims are not concrete integers"
    if any(n & (n - 1) or n < 16 for n in dims):
        return f"head dims {dims} (dn, dr, kv) are not powers of two >= 16"
    return pool_and_selection_problem(a, attrs)


TUNABLES = (
    Tunable("BLOCK_M", (16, 32, 64, 128)),
    Tunable("BLOCK_N", (32, 64, 128)),
    Tunable("num_warps", (4, 8)),
    Tunable("num_stages", (1, 2, 3)),
)

TEMPLATES = [
    KernelTemplate(family="mla_prefill", backend="triton", ops=("mla_attention",), launch=_launch, key_dims=_key,
                   heuristic=heuristic, tunables=TUNABLES, bucket=_bucket, supports=_supports, batch_invariant=True,
                   doc="decompressed-form flash MLA prefill (dense); sparse prompts via the absorbed sparse kernel"),
]
