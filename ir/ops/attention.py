"""MLA attention, the DSA indexer and cache writes, SPEC §4–5.

Caches are pools of rows grouped in blocks of `block_size` rows; request r's position p lives at row
block_table[r, p // block_size] * block_size + p % block_size (paged addressing, `ir.ref.paging`).
A pool operand is flat, [N, *row], or a block view [NB, block_size, *row] (a page of every row of the
packed block pool, DESIGN §5 T1); both address the same physical rows.
"""

from __future__ import annotations

import sympy
import torch

from .. import formats
from ..core import TensorType
from ..dtypes import f32, f8e4m3, i64, u8
from ..ref import indexer as ref_indexer
from ..ref import mla as ref_mla
from ..ref.paging import cache_rows, check_block_size, write_rows
from ..shapes import numel, shapes_equal, sym
from .basic import expect
from .registry import attr, defop

CONTEXT = sym("L")  # average attended context per query token, used by costs only


def _block_table_ok(a, at, op: str):
    expect(a.block_table.rank == 2 and a.block_table.dtype.kind == "int",
           f"{op}: block_table {a.block_table} must be an integer [R, MB] table")
    try:
        check_block_size(at["block_size"])
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None


BLOCK_SIZE = {"block_size": attr(int)}


def pool_fits(pool, row_shape, block_size: int) -> bool:
    """Whether pool type `pool` holds rows of `row_shape`: flat [N, *row] or block view [NB, bs, *row]."""
    k = len(row_shape)
    if pool.rank == k + 1:
        return shapes_equal(pool.shape[1:], tuple(row_shape))
    return pool.rank == k + 2 and shapes_equal(pool.shape[1:], (block_size, *row_shape))


def pool_row_shape(pool, row_rank: int) -> tuple:
    """The row shape of a flat pool or block view type whose rows have `row_rank` dims."""
    return tuple(pool.shape[pool.rank - row_rank:])


def _pool_desc(row_shape, block_size) -> str:
    row = "".join(f", {d}" for d in row_shape)
    return f"[N{row}] or [NB, {block_size}{row}]"


def _cache_write_infer(a, at):
    _block_table_ok(a, at, "cache_write")
    expect(a.values.rank >= 1 and pool_fits(a.pool, a.values.shape[1:], at["block_size"]),
           f"cache_write: values {a.values} do not fit pool rows {a.pool} (expected "
           f"{_pool_desc(a.values.shape[1:], at['block_size'])})")
    expect(a.values.dtype == a.pool.dtype or (a.values.dtype.is_float and a.pool.dtype.is_float
                                               and f8e4m3 not in (a.values.dtype, a.pool.dtype)),
           f"cache_write: values {a.values} cannot be stored in pool {a.pool}")
    return [a.pool]


def _cache_write_ref(a, at):
    rows = cache_rows(a.block_table, at["block_size"], a.token_req, a.token_pos)
    return write_rows(a.pool, rows, a.values, at["block_size"], a.values.dim() - 1)


defop("cache_write", ["pool", "values", "token_req", "token_pos", "block_table"], ["pool_out"],
      _cache_write_infer, _cache_write_ref, inplace={0: "pool"}, attrs=BLOCK_SIZE,
      bytes=lambda a, o, at: 2 * a.values.nbytes() + 3 * a.token_pos.nbytes(),
      doc="pool[row(token_req[i], token_pos[i])] = values[i], row(r, p) = block_table[r, p // bs] * bs + p % bs "
          "(pool flat [N, *row] or a block view [NB, bs, *row])")


def _mla_infer(a, at):
    _block_table_ok(a, at, "mla")
    t, h, dn = a.q_nope.shape
    dr = a.q_pe.shape[2]
    kv = a.kv_b.shape[1]
    if at["q_absorbed"]:  # operand q_nope holds q~ = W_UK^T q_nope [T, H, kv] (mla_absorb's result)
        expect(at["form"] in ("absorbed", "latent") and shapes_equal((dn,), (kv,)) and at["nope_dim"] > 0,
               f"mla: q_absorbed takes q~ {a.q_nope} of width kv = {kv} (form absorbed|latent, nope_dim > 0), "
               f"found form {at['form']!r}, nope_dim {at['nope_dim']}")
        dn = at["nope_dim"]
    expect(at["latent_format"] in ("plain", "nvfp4"),
           f"mla: latent_format must be plain|nvfp4, found {at['latent_format']!r}")
    bs = at["block_size"]
    if at["latent_format"] == "nvfp4":
        row = (sympy.sympify(kv) / 2 + sympy.sympify(kv) / 16 + dr,)
        expect(a.latent.dtype == u8 and pool_fits(a.latent, row, bs),
               f"mla: an nvfp4 latent pool must be u8 {_pool_desc(row, bs)}, found {a.latent}")
    else:
        expect(pool_fits(a.latent, (kv + dr,), bs),
               f"mla: latent pool {a.latent} must be {_pool_desc((kv + dr,), bs)}")
    dv = sympy.simplify(a.kv_b.shape[0] / h - dn)
    expect(dv.is_integer and dv > 0, f"mla: kv_b {a.kv_b} is not [H*(dn+dv), kv] for H={h}, dn={dn}")
    if a.selection is not None:
        expect(a.selection.dtype == i64 and shapes_equal(a.selection.shape[:1], (t,)),
               f"mla: selection {a.selection} must be i64[{t}, K]")
    expect(at["form"] in ("absorbed", "decompressed", "latent"),
           f"mla: form must be absorbed|decompressed|latent, found {at['form']!r}")
    expect(at["selection_kind"] in ("positions", "rows"),
           f"mla: selection_kind must be positions|rows, found {at['selection_kind']!r}")
    return [TensorType(a.q_nope.dtype, (t, h, kv if at["form"] == "latent" else dv))]


def _mla_ref(a, at):
    latent = a.latent
    if at["latent_format"] == "nvfp4":  # the reference reads the codes back to values (SPEC §7)
        latent = formats.dequantize_latent_nvfp4(latent, int(a.kv_b.shape[1])).to(a.q_nope.dtype)
    return ref_mla.mla_attention(a.q_nope, a.q_pe, latent, a.kv_b, a.token_pos, a.token_req, a.block_table,
                                 at["block_size"], at["scale"], a.selection, at["form"], at["selection_kind"],
                                 nope_dim=at["nope_dim"] if at["q_absorbed"] else None)


def _mla_ctx(a):
    return a.selection.shape[1] if a.selection is not None else CONTEXT


def _mla_flops(a, o, at):
    t, h, _ = a.q_nope.shape
    width = a.latent.shape[-1]
    return 2 * t * h * _mla_ctx(a) * (width + a.kv_b.shape[1])


def _mla_bytes(a, o, at):
    t = a.q_nope.shape[0]
    return a.q_nope.nbytes() + a.q_pe.nbytes() + o[0].nbytes() + a.kv_b.nbytes() + \
        t * _mla_ctx(a) * a.latent.shape[-1] * a.latent.dtype.bits / 8


defop("mla_attention", ["q_nope", "q_pe", "latent", "kv_b", "token_pos", "token_req", "block_table", "selection?"],
      ["o"], _mla_infer, _mla_ref, attrs={**BLOCK_SIZE, "scale": attr(float), "form": attr(str, default="absorbed"),
                                          "latent_format": attr(str, default="plain"),
                                          "selection_kind": attr(str, default="positions"),
                                          "q_absorbed": attr(bool, default=False), "nope_dim": attr(int, default=0)},
      flops=_mla_flops, bytes=_mla_bytes,
      doc="softmax(scale*(q_nope.k_nope + q_pe.k_pe)) v over the causal context (or the selected positions); "
          "absorbed: q~ = [W_UK^T q_nope; q_pe] against latent rows; decompressed: k_nope, v = W_UK c, W_UV c; "
          "latent: the absorbed form returning o~ = sum p c [T,H,kv] (W_UV applied by mla_value_proj); "
          "selection_kind: selection entries are request positions or physical pool rows; q_absorbed: operand "
          "q_nope already holds q~ = W_UK^T q_nope [T,H,kv] (mla_absorb), nope_dim its dn")


def _absorb_infer(a, at):
    t, h, dn = a.q_nope.shape
    kv = a.kv_b.shape[1]
    expect(a.kv_b.rank == 2, f"mla_absorb: kv_b {a.kv_b} must be [H*(dn+dv), kv]")
    dv = sympy.simplify(a.kv_b.shape[0] / h - dn)
    expect(dv.is_integer and dv > 0, f"mla_absorb: kv_b {a.kv_b} is not [H*(dn+dv), kv] for H={h}, dn={dn}")
    return [TensorType(a.q_nope.dtype, (t, h, kv))]


defop("mla_absorb", ["q_nope", "kv_b"], ["q_abs"], _absorb_infer,
      lambda a, at: ref_mla.mla_absorb(a.q_nope, a.kv_b),
      flops=lambda a, o, at: 2 * numel(o[0].shape) * a.q_nope.shape[2],
      doc="q~^h = W_UK^h^T q_nope^h, W_UK^h = rows 0..dn of head h of kv_b viewed [H, dn+dv, kv] (the absorbed "
          "MLA's query side, computed where mla_attention {q_absorbed} reads it)")


def _value_proj_infer(a, at):
    t, h, kv = a.o_latent.shape
    dn = at["nope_dim"]
    expect(a.kv_b.rank == 2 and shapes_equal(a.kv_b.shape[1:], (kv,)),
           f"mla_value_proj: kv_b {a.kv_b} must be [H*(dn+dv), {kv}] for o_latent {a.o_latent}")
    dv = sympy.simplify(a.kv_b.shape[0] / h - dn)
    expect(dn >= 0 and dv.is_integer and dv > 0,
           f"mla_value_proj: kv_b {a.kv_b} is not [H*(dn+dv), kv] for H={h}, dn={dn}")
    return [TensorType(a.o_latent.dtype, (t, h, dv))]


defop("mla_value_proj", ["o_latent", "kv_b"], ["o"], _value_proj_infer,
      lambda a, at: ref_mla.mla_value_proj(a.o_latent, a.kv_b, at["nope_dim"]),
      attrs={"nope_dim": attr(int)},
      flops=lambda a, o, at: 2 * numel(o[0].shape) * a.o_latent.shape[2],
      doc="o^h = W_UV^h o~^h, W_UV^h = rows dn.. of head h of kv_b viewed [H, dn+dv, kv] "
          "(the absorbed MLA's value up-projection)")


def _selection_rows_infer(a, at):
    _block_table_ok(a, at, "selection_to_rows")
    expect(a.selection.dtype == i64 and a.selection.rank == 2,
           f"selection_to_rows: selection {a.selection} must be i64[T, K]")
    expect(shapes_equal(a.token_req.shape, a.selection.shape[:1]),
           f"selection_to_rows: token_req {a.token_req} does not match selection {a.selection}")
    return [a.selection]


defop("selection_to_rows", ["selection", "token_req", "block_table"], ["rows"], _selection_rows_infer,
      lambda a, at: ref_mla.selection_positions_to_rows(a.selection, a.token_req, a.block_table, at["block_size"]),
      attrs=BLOCK_SIZE,
      doc="rows[t, j] = row(token_req[t], selection[t, j]) where selection[t, j] >= 0, else -1 "
          "(request positions -> physical pool rows through the block table)")


def _latent_nvfp4_infer(a, at):
    kv = at["kv_lora_rank"]
    dr = sympy.simplify(a.x.shape[1] - kv)
    expect(a.x.rank == 2 and kv % 16 == 0 and dr.is_integer and dr > 0,
           f"quantize_latent_nvfp4: x {a.x} must be [T, {kv}+dr] with kv_lora_rank a multiple of 16")
    return [TensorType(u8, (a.x.shape[0], kv // 2 + kv // 16 + dr))]


defop("quantize_latent_nvfp4", ["x"], ["codes"], _latent_nvfp4_infer,
      lambda a, at: formats.quantize_latent_nvfp4(a.x, at["kv_lora_rank"]), attrs={"kv_lora_rank": attr(int)},
      flops=lambda a, o, at: 4 * a.x.numel(),
      doc="MLA latent row [c_KV; k_pe] -> NVFP4 codes of c_KV | their E4M3 block scales | k_pe in FP8 "
          "(per-layer scales 1, held outside the token; SPEC §7: 352 B at kv=512, dr=64)")


def _quant_infer(a, at):
    return [a.x.with_dtype(f8e4m3), TensorType(f32, a.x.shape[:-1])]


defop("quantize_fp8_pow2", ["x"], ["q", "scale"], _quant_infer, lambda a, at: formats.quantize_fp8_pow2(a.x),
      flops=lambda a, o, at: 3 * a.x.numel(),
      doc="FP8 e4m3 per row (last axis) with scale 2^ceil(log2(max(amax,1e-4)/448)) (SPEC §5.4)")


def _quant_mxfp4_infer(a, at):
    d = a.x.shape[-1]
    expect(a.x.dtype.is_float and a.x.rank >= 1 and (sympy.sympify(d) % formats.MXFP4_BLOCK) == 0,
           f"quantize_mxfp4: x {a.x} must be float with a last dim that is a multiple of {formats.MXFP4_BLOCK}")
    d = sympy.sympify(d)
    return [TensorType(u8, (*a.x.shape[:-1], d / 2)), TensorType(u8, (*a.x.shape[:-1], d / formats.MXFP4_BLOCK))]


defop("quantize_mxfp4", ["x"], ["q", "scale"], _quant_mxfp4_infer, lambda a, at: formats.quantize_mxfp4(a.x),
      flops=lambda a, o, at: 4 * a.x.numel(),
      doc="MXFP4 along the last axis (SPEC §5.4 key option, §7): E2M1 codes packed two per byte (low nibble = "
          "even element) and one E8M0 scale 2^ceil(log2(amax/6)) per 32 values")


KEY_FORMATS = ("fp8", "mxfp4")


def _indexer_infer(a, at):
    _block_table_ok(a, at, "indexer")
    t, hi, di = a.q.shape
    fmt = at["key_format"]
    expect(fmt in KEY_FORMATS, f"indexer: key_format must be one of {KEY_FORMATS}, found {fmt!r}")
    expect(a.q.dtype == f8e4m3, f"indexer: q {a.q} must be f8e4m3")
    expect(shapes_equal(a.q_scale.shape, (t, hi)) and shapes_equal(a.w.shape, (t, hi)),
           f"indexer: q_scale {a.q_scale} and w {a.w} must be [{t},{hi}]")
    bs, di = at["block_size"], sympy.sympify(di)
    if fmt == "fp8":
        expect(a.keys.dtype == f8e4m3, f"indexer: key_format fp8 needs f8e4m3 keys, found {a.keys}")
        key_row, scale_row = (di,), ()
    else:
        expect(a.keys.dtype == u8 and a.key_scale.dtype == u8,
               f"indexer: key_format mxfp4 needs u8 keys (E2M1 pairs) and u8 E8M0 scales, found {a.keys} / "
               f"{a.key_scale}")
        key_row, scale_row = (di / 2,), (di / formats.MXFP4_BLOCK,)
    expect(pool_fits(a.keys, key_row, bs) and pool_fits(a.key_scale, scale_row, bs)
           and shapes_equal(a.key_scale.shape[:a.keys.rank - 1], a.keys.shape[:-1]),
           f"indexer: {fmt} keys {a.keys} / key_scale {a.key_scale} must be {_pool_desc(key_row, bs)} / "
           f"{_pool_desc(scale_row, bs)}, both flat or both block views of the same blocks")
    expect(at["topk"] > 0, "indexer: topk must be positive")
    return [TensorType(i64, (t, at["topk"]))]


def dequantize_index_keys(keys, key_scale, key_format: str):
    """Index-key pool rows -> fp32 [N, DI]: FP8 codes * per-row scale, or MXFP4 (E2M1 pairs, E8M0 per 32)."""
    if key_format == "fp8":
        return formats.dequantize_fp8(keys, key_scale)
    if key_format == "mxfp4":
        return formats.dequantize_mxfp4(keys.view(torch.uint8), key_scale.view(torch.uint8))
    raise ValueError(f"indexer: key_format must be one of {KEY_FORMATS}, found {key_format!r}")


def _indexer_ref(a, at):
    q = formats.dequantize_fp8(a.q, a.q_scale).to(a.w.dtype)
    k = dequantize_index_keys(a.keys, a.key_scale, at["key_format"]).to(a.w.dtype)
    sel, _ = ref_indexer.indexer_topk(q, a.w, k, a.token_pos, a.token_req, a.block_table, at["block_size"], at["topk"])
    return sel


def _key_bytes(a):
    """Bytes of one cached index key: FP8 DI + 4 (fp32 scale); MXFP4 DI/2 + DI/32 (E8M0 scales)."""
    di = a.q.shape[2]
    return di + 4 if a.keys.dtype == f8e4m3 else di / 2 + di / formats.MXFP4_BLOCK


defop("indexer_topk", ["q", "q_scale", "w", "keys", "key_scale", "token_pos", "token_req", "block_table"], ["selection"],
      _indexer_infer, _indexer_ref, attrs={**BLOCK_SIZE, "topk": attr(int), "key_format": attr(str, default="fp8")},
      flops=lambda a, o, at: 2 * a.q.shape[0] * a.q.shape[1] * CONTEXT * (a.q.shape[2] + 1),
      bytes=lambda a, o, at: a.q.nbytes() + a.w.nbytes() + o[0].nbytes()
      + a.q.shape[0] * CONTEXT * _key_bytes(a),
      doc="I(t,s) = sum_j w_j relu(deq(q_j) . deq(k_s)) over s <= t; top-k positions (ties to the lower "
          "position) ascending, -1 padded when the context is shorter than topk; key_format fp8: keys f8e4m3 [N, DI] + "
          "f32 scale [N]; mxfp4: keys u8 [N, DI/2] (low nibble = even element) + E8M0 u8 [N, DI/32] "
          "(or block views [NB, bs, ...] of both)")
