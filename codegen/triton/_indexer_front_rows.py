"""Row stages of `fused.indexer_front` shared by its kernels (indexer_front.py, _indexer_front_decode.py): the
key rows (LayerNorm + Hadamard + FP8 + the paged cache write, and the head weights) and the dot-free Hadamard
rotation of one row in Kronecker form. The math is in norm_quant.py's docstring.

Kronecker form (KRON = A > 1): with DI = A * B, r = a * B + b and c = a' * B + b' (b, b' < B),
popcount(r & c) = popcount(a & a') + popcount(b & b'), so H_DI[r, c] = H_A[a, a'] H_B[b, b'] and a row
x viewed as X [A, B] rotates as H_A^T X H_B: A * B * (A + B) products (DI = 128, A = 8: 3072) instead of
DI^2 (16384) or a tensor-core tile of 16 rows, in a few registers per thread."""

from __future__ import annotations

import triton
import triton.language as tl

from codegen.triton._paging import row_offsets, rows_of
from codegen.triton.norm_quant import AMAX_FLOOR, _hadamard_tile, _quantize_rows, hadamard_matrix


@triton.jit
def _indexer_key_rows(prog, ik_ptr, g_ptr, b_ptr, iw_ptr, w_ptr, kpool_ptr, spool_ptr, req_ptr, pos_ptr, tbl_ptr, MB,
                      T, HEADS, stride_ik, stride_iw, k_sblk, k_srow, s_sblk, s_srow, eps, weight_scale,
                      BLOCK_R: tl.constexpr, DI: tl.constexpr, BLOCK_H: tl.constexpr, LOG_BS: tl.constexpr,
                      HPREC: tl.constexpr, KRON: tl.constexpr = 0):
    """Token rows [prog * BLOCK_R, +BLOCK_R): key = fp8(H LayerNorm(ik)) written at the pool row of
    (token_req, token_pos) through the block table (bytes and scale; pools flat or block views: row r at
    (r >> LOG_BS) * s_blk + (r & (bs - 1)) * s_row elements, `_paging.row_offsets`), and w = weight_scale * iw.
    KRON = A > 1 (BLOCK_R = 1): the rotation in Kronecker form (module docstring), else a tensor-core tile."""
    rows = prog * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, DI)
    k = tl.load(ik_ptr + rows64[:, None] * stride_ik + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    mu = tl.sum(k, axis=1) / DI
    kc = k - mu[:, None]
    k = kc / tl.sqrt(tl.sum(kc * kc, axis=1) / DI + eps)[:, None]
    k = k * tl.load(g_ptr + cols).to(tl.float32)[None, :] + tl.load(b_ptr + cols).to(tl.float32)[None, :]
    if KRON > 1:
        rot = tl.reshape(_hadamard_outer(_hadamard_inner(tl.reshape(k, (DI,)), KRON, DI // KRON), KRON), (1, DI))
        rot = rot * (1.0 / tl.sqrt(DI * 1.0))
    else:
        rot = _hadamard_tile(k, DI, HPREC)
    code, scale = _quantize_rows(rot, cols[None, :] < DI, AMAX_FLOOR)
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


@triton.jit
def _hadamard_inner(x, A: tl.constexpr, B: tl.constexpr):
    """Z [A, B] = X H_B for the row x [A * B] viewed as X [A, B] (unscaled)."""
    return tl.sum(tl.reshape(x, (A, B))[:, :, None] * hadamard_matrix(B)[None, :, :], axis=1)


@triton.jit
def _hadamard_outer(z, A: tl.constexpr):
    """H_A^T Z for z [A, B]: row a' = sum_a H_A[a, a'] z[a, :] (unscaled; with `_hadamard_inner`, the row's
    rotation in Kronecker form, flattened a' * B + b')."""
    return tl.sum(hadamard_matrix(A)[:, :, None] * z[:, None, :], axis=0)
