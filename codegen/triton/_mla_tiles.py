"""Device code both MLA decode orientations share (mla_sparse.py: `_mla_heads_kernel`, ORIENT 1;
_mla_rows.py: `_mla_sparse_kernel`, ORIENT 0): the gather of a step's latent rows (`_rows_at`: selected
positions through the block table, `_paging.rows_of`, or pool rows, then `_paging.row_offsets` with the
pool's strides), their dequantisation in registers (`_sub_raw` / `_sub_deq` / `_sub_tile` for c_KV,
`_k_pe_raw` / `_k_pe` for k_pe), and `_combine_kernel`, which merges a token's chunk partials. Not a
kernel family (no TEMPLATES); the math and the host side are in mla_sparse.py.

Latent pool formats (FMT; dequantised in registers):
  0 "bf16" / "fp32"  rows [kv + dr] as stored (the IR's pool);
  1 "fp8"            e4m3 rows [kv + dr], value = code * latent_scale (one fp32 scale per layer);
  2 "nvfp4"          uint8 rows [kv/2 + kv/16 + dr] (SPEC §7, 352 B for kv=512, dr=64):
                     bytes [0, kv/2) E2M1 codes of c_KV (low nibble = even element),
                     [kv/2, kv/2 + kv/16) E4M3 block scales (16 values each),
                     [kv/2 + kv/16, +dr) k_pe in e4m3;
                     c_KV = e2m1 * block_scale * latent_scale (the fp32 per-tensor scale),
                     k_pe = code * pe_scale.
The per-layer scales (latent_scale, pe_scale) are applied by the kernels, not here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._paging import row_offsets, rows_of
from ._pdl import pdl_enter

_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _softmax_tail(m_i, l_i, v_scale):
    """(1 / denominator x v_scale, natural-log lse) of an online softmax kept in base 2 (running max m_i, sum l_i);
    a head that saw no row gets 0 and -inf."""
    has = l_i > 0.0
    inv = tl.where(has, v_scale / tl.where(has, l_i, 1.0), 0.0)
    return inv, tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * _LN2, float("-inf"))


@triton.jit
def e2m1_to_f32(code):
    """E2M1 codes (low 4 bits) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6, bit 3 = sign. Built from bits: a
    magnitude code m >= 2 is the float with bits (m + 252) << 22 (exponent m>>1 + 126, mantissa bit m&1),
    m = 1 is 0.5 (0x3F000000), m = 0 is 0."""
    c = code.to(tl.int32)
    m = c & 7
    bits = tl.where(m >= 2, (m + 252) << 22, tl.where(m == 1, 0x3F000000, 0)) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_f32(b):
    """E8M0 bytes -> 2^(b-127) in fp32 (b = 0 is the subnormal 2^-127)."""
    bi = b.to(tl.int32)
    return tl.where(bi == 0, tl.full(bi.shape, 0x00400000, tl.int32), bi << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_to(x, DT: tl.constexpr):
    """e4m3 values (loaded through an fp8 pointer, or raw uint8 bytes) -> DT."""
    if x.dtype == tl.uint8:
        x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(DT)


@triton.jit
def _load_idx(idx_ptr, t, KSEL, j, end, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr):
    """Context entries j .. j+BLOCK_N-1 of token t: selected positions/rows (-1 = skip) or positions."""
    jj = j + tl.arange(0, BLOCK_N)
    jm = jj < end
    if SPARSE:
        return tl.load(idx_ptr + t.to(tl.int64) * KSEL + jj, mask=jm, other=-1)
    else:
        return tl.where(jm, jj, -1).to(tl.int64)


@triton.jit
def _sub_raw(lat_ptr, ro, valid, kb: tl.constexpr, KV: tl.constexpr, KB: tl.constexpr,
             FMT: tl.constexpr, EVICT: tl.constexpr):
    """Stored bytes of c_KV values kb*KB .. (kb+1)*KB-1 of the rows starting at element offsets `ro`:
    (values, block scales); the scales are a [BLOCK_N, 1] placeholder unless FMT 2 (nvfp4). Invalid rows
    read as zeros (no traffic)."""
    rp = lat_ptr + ro[:, None]
    m = valid[:, None]
    if FMT == 2:
        x = tl.load(rp + kb * (KB // 2) + tl.arange(0, KB // 2)[None, :], mask=m, other=0, eviction_policy=EVICT)
        sc = tl.load(rp + KV // 2 + kb * (KB // 16) + tl.arange(0, KB // 16)[None, :], mask=m, other=0,
                     eviction_policy=EVICT)
    else:
        x = tl.load(rp + kb * KB + tl.arange(0, KB)[None, :], mask=m, other=0.0, eviction_policy=EVICT)
        sc = tl.zeros([x.shape[0], 1], dtype=tl.uint8)
    return x, sc


@triton.jit
def _sub_deq(x, sc, KB: tl.constexpr, FMT: tl.constexpr, DOT_DT: tl.constexpr):
    """`_sub_raw`'s bytes dequantised (natural order, without the per-layer scale) to DOT_DT [BLOCK_N, KB]."""
    if FMT == 0:
        return x.to(DOT_DT)
    elif FMT == 1:
        return _fp8_to(x, DOT_DT)
    else:
        BN: tl.constexpr = x.shape[0]
        v = tl.reshape(tl.join(e2m1_to_f32(x & 15), e2m1_to_f32(x >> 4)), [BN, KB // 16, 16])
        return tl.reshape(v * _fp8_to(sc, tl.float32)[:, :, None], [BN, KB]).to(DOT_DT)


@triton.jit
def _sub_tile(lat_ptr, ro, valid, kb: tl.constexpr, KV: tl.constexpr, KB: tl.constexpr,
              FMT: tl.constexpr, DOT_DT: tl.constexpr, EVICT: tl.constexpr):
    """c_KV values kb*KB .. (kb+1)*KB-1 of the rows, dequantised to DOT_DT: [BLOCK_N, KB]."""
    x, sc = _sub_raw(lat_ptr, ro, valid, kb, KV, KB, FMT, EVICT)
    return _sub_deq(x, sc, KB, FMT, DOT_DT)


@triton.jit
def _k_pe_raw(lat_ptr, ro, valid, KV: tl.constexpr, DR: tl.constexpr, FMT: tl.constexpr):
    r = tl.arange(0, DR)
    off = KV if FMT < 2 else KV // 2 + KV // 16
    if FMT == 2:
        return tl.load(lat_ptr + ro[:, None] + off + r[None, :], mask=valid[:, None], other=0)
    return tl.load(lat_ptr + ro[:, None] + off + r[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _k_pe(lat_ptr, ro, valid, KV: tl.constexpr, DR: tl.constexpr, FMT: tl.constexpr,
          DOT_DT: tl.constexpr):
    x = _k_pe_raw(lat_ptr, ro, valid, KV, DR, FMT)
    if FMT == 0:
        return x.to(DOT_DT)
    else:
        return _fp8_to(x, DOT_DT)


@triton.jit
def _rows_at(idx_ptr, t, KSEL, j, end, tblrow, sb, sr, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr,
             PAGED: tl.constexpr, LOG_BS: tl.constexpr):
    """(element offsets of the pool rows, valid) of context entries j .. j+BLOCK_N-1 (none valid when
    j >= end): positions through the block table (`rows_of`), rows through the pool's strides
    (`row_offsets`: a flat pool or a block view)."""
    idx = _load_idx(idx_ptr, t, KSEL, j, end, BLOCK_N, SPARSE)
    valid = idx >= 0
    if PAGED:
        rows = rows_of(tblrow, idx, valid, LOG_BS)
    else:
        rows = tl.where(valid, idx, 0).to(tl.int64)
    return row_offsets(rows, LOG_BS, sb, sr), valid


@triton.jit
def _combine_kernel(po_ptr, plse_ptr, o_ptr, lse_ptr, NSPLIT, KV: tl.constexpr, CB: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr):
    """o = sum_i e^(lse_i - lse) o_i, lse = log sum_i e^lse_i over one (token, head)'s chunks, for CB of its
    kv columns (grid: token x head, kv / CB); o stored in o_ptr's dtype. The partials are read SB chunks at
    a time as one [SB, CB] tile (all loads of a tile in flight together, not one chunk after another)."""
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * CB + tl.arange(0, CB)
    sp = tl.arange(0, SB)
    mx = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, NSPLIT, SB):
        ls = tl.load(plse_ptr + i * NSPLIT + s0 + sp, mask=s0 + sp < NSPLIT, other=float("-inf"))
        mx = tl.maximum(mx, tl.max(ls, 0))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros([CB], dtype=tl.float32)
    den = tl.zeros([], dtype=tl.float32)
    for s0 in range(0, NSPLIT, SB):
        m = s0 + sp < NSPLIT
        w = tl.exp(tl.load(plse_ptr + i * NSPLIT + s0 + sp, mask=m, other=float("-inf")) - mx)
        part = tl.load(po_ptr + (i * NSPLIT + s0 + sp)[:, None] * KV + k[None, :], mask=m[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
        den += tl.sum(w, 0)
    tl.store(o_ptr + i * KV + k, acc / tl.where(den > 0.0, den, 1.0))
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + i, tl.where(den > 0.0, mx + tl.log(den), float("-inf")))


@triton.jit
def _program_span(pos_ptr, tbl_ptr, req_ptr, MB, H, KSEL, CHUNK, BLOCK_H: tl.constexpr, SPARSE: tl.constexpr):
    """What a sparse-MLA program works on (grid: tokens, head blocks, context splits): token t, heads h
    [BLOCK_H] (hm: those that exist), th = t·H + h (the q / o row), split sp, the token's block-table row and
    its piece [start, end) of the context (the KSEL selected entries, or positions 0..pos)."""
    t = tl.program_id(0)  # tokens on grid axis 0 (up to 2**31 - 1; axes 1 and 2 stop at 65535)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sp = tl.program_id(2)
    tblrow = tbl_ptr + tl.load(req_ptr + t) * MB
    n_ctx = KSEL if SPARSE else tl.load(pos_ptr + t) + 1
    start = sp * CHUNK
    end = tl.minimum(start + CHUNK, n_ctx)
    return t, h, h < H, t.to(tl.int64) * H + h, sp, tblrow, start, end
