"""The one-token decode kernel of `fused.indexer_front` (config GEMV = 2; the op, its other paths and the
heuristic are in indexer_front.py).

Programs [0, T): the key row of token t (`_indexer_key_rows`, BLOCK_R = 1, the rotation in Kronecker form: a
few registers, no tensor-core tile of 16 rows). Programs [T, T + T * HEADS * SPLIT): (token t, head j, part p)
computes the DP = DI / SPLIT query columns [p * DP, +DP) of head j as a dot-free GEMV over KT = ceil(K /
BLOCK_K) <= 4 weight tiles [DP, BLOCK_K]:
    P[n, c] = sum_i w[n, i * BLOCK_K + c] x[i * BLOCK_K + c]  (i = 0 .. KT - 1 in order, fp32),  q[n] = sum_c P[n, c]
All KT weight tiles are loaded before `pdl_wait` (`_pdl.py`: weights may be; the program's whole slice of wq_b
stays in registers), so the weight stream overlaps the previous kernel; after the wait the program loads the
KT activation tiles at once, each broadcast over the tile's rows (the tile's register layout: no shared-memory
exchange, no load waiting on another). The part rotates its own columns, y_p = q_p H_DP, stores y_p to the
fp32 scratch qbuf, counts itself in cnt[t, j] (release/acquire) and the last of the SPLIT parts to arrive
finishes the head and resets the counter; every value has one writer, so nothing depends on arrival order.

The rotation is split by the Kronecker form (_indexer_front_rows.py): with r = p * DP + i, c = a * DP + b,
H_DI[r, c] = H_SPLIT[p, a] H_DP[i, b], so (q H_DI)[a * DP + b] = sum_p H_SPLIT[p, a] y_p[b]: the last part adds
the SPLIT rows with signs (SPLIT * DI products, `_hadamard_outer`), scales by DI^-1/2 and quantises.

H200, session 12 (benches/results/h200-2026-11-30-s12/decode_fallbacks_front_value_gate.json; rank preset:
K 1536, 32 heads x 128, bf16; µs per launch in a graph, alone / in a PDL chain after an rms_norm producer,
marginal over the producer's 1.23 µs; byte floor 3.03 µs): the session-6 split kernel (GEMV 1: SPLIT 8, three
K steps loaded after the wait, 4 warps, 255 registers + 184 B of stack for its 16-row tensor-core key tile and
its DI x DI tail rotation) 8.28 / 7.96; this kernel SPLIT 8 x 4 warps (160 registers) 5.49 / 6.18, 8 x 8
warps 5.62 / 6.43, 16 x 4 5.70 / 6.35, 16 x 8 6.30 / 6.79, 32 x 2 6.21 / 6.15, 32 x 4 6.24 / 6.54. Removed
after that run: the last part rotating the whole head (q_p stored, DI x DI products there; SPLIT 16 x 4:
7.09 / 8.50) and the tensor-core key tile in this kernel (BLOCK_R 16, 255 registers: 7.04 / 7.31).
"""

from __future__ import annotations

import triton
import triton.language as tl

from codegen.triton._indexer_front_rows import _hadamard_outer, _indexer_key_rows
from codegen.triton._pdl import launch_kwargs, pdl_enter
from codegen.triton.norm_quant import AMAX_FLOOR, _quantize_rows, hadamard_matrix

MAX_KT = 4


@triton.jit
def _w_tile(w_ptrs, k0, K, n_ok, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight tile [DP, BLOCK_K] at columns k0.., as stored (widened after the wait)."""
    if EVEN_K:
        t = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
    else:
        t = tl.load(w_ptrs + k0, mask=n_ok[:, None] & ((tl.arange(0, BLOCK_K) + k0) < K)[None, :], other=0.0)
    return t


@triton.jit
def _x_tile(x_ptrs, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[k0 .. k0 + BLOCK_K) broadcast over the DP rows of the weight tile: x_ptrs has the tile's shape (and so
    its register layout), every thread loads the columns it multiplies, no shared-memory exchange."""
    if EVEN_K:
        t = tl.load(x_ptrs + k0)
    else:
        t = tl.load(x_ptrs + k0, mask=(tl.arange(0, BLOCK_K) + k0 < K)[None, :], other=0.0)
    return t


@triton.jit
def _indexer_front_gemv_kernel(x_ptr, w_ptr, qbuf_ptr, cnt_ptr, q_ptr, s_ptr,
                               ik_ptr, g_ptr, b_ptr, iw_ptr, hw_ptr, kpool_ptr, spool_ptr, req_ptr, pos_ptr, tbl_ptr,
                               MB, T, K, HEADS, stride_xm, stride_wn, stride_ik, stride_iw,
                               k_sblk, k_srow, s_sblk, s_srow, eps, weight_scale,
                               EVEN_K: tl.constexpr, SPLIT: tl.constexpr, KT: tl.constexpr, DI: tl.constexpr,
                               BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                               LOG_BS: tl.constexpr, HPREC: tl.constexpr, KRON: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    if pid < T:
        pdl_enter(PDL)
        _indexer_key_rows(pid, ik_ptr, g_ptr, b_ptr, iw_ptr, hw_ptr, kpool_ptr, spool_ptr, req_ptr, pos_ptr,
                          tbl_ptr, MB, T, HEADS, stride_ik, stride_iw, k_sblk, k_srow, s_sblk, s_srow, eps,
                          weight_scale, 1, DI, BLOCK_H, LOG_BS, HPREC, KRON)
    else:
        DP: tl.constexpr = DI // SPLIT
        qp = pid - T
        part = qp % SPLIT
        head = (qp // SPLIT) % HEADS
        tok = qp // (SPLIT * HEADS)
        offs_n = head * DI + part * DP + tl.arange(0, DP)
        n_ok = offs_n < HEADS * DI
        rk = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        w0 = _w_tile(w_ptrs, 0, K, n_ok, EVEN_K, BLOCK_K)
        if KT > 1:
            w1 = _w_tile(w_ptrs, BLOCK_K, K, n_ok, EVEN_K, BLOCK_K)
        if KT > 2:
            w2 = _w_tile(w_ptrs, 2 * BLOCK_K, K, n_ok, EVEN_K, BLOCK_K)
        if KT > 3:
            w3 = _w_tile(w_ptrs, 3 * BLOCK_K, K, n_ok, EVEN_K, BLOCK_K)
        pdl_enter(PDL)
        x_ptrs = x_ptr + tok.to(tl.int64) * stride_xm + rk[None, :] + (offs_n * 0)[:, None]
        x0 = _x_tile(x_ptrs, 0, K, EVEN_K, BLOCK_K)  # the KT activation loads first, all in flight at once
        if KT > 1:
            x1 = _x_tile(x_ptrs, BLOCK_K, K, EVEN_K, BLOCK_K)
        if KT > 2:
            x2 = _x_tile(x_ptrs, 2 * BLOCK_K, K, EVEN_K, BLOCK_K)
        if KT > 3:
            x3 = _x_tile(x_ptrs, 3 * BLOCK_K, K, EVEN_K, BLOCK_K)
        acc = w0.to(tl.float32) * x0.to(tl.float32)
        if KT > 1:
            acc += w1.to(tl.float32) * x1.to(tl.float32)
        if KT > 2:
            acc += w2.to(tl.float32) * x2.to(tl.float32)
        if KT > 3:
            acc += w3.to(tl.float32) * x3.to(tl.float32)
        y = tl.sum(tl.sum(acc, axis=1)[:, None] * hadamard_matrix(DP), axis=0)  # y_p = q_p H_DP
        head_buf = qbuf_ptr + tok.to(tl.int64) * (HEADS * DI) + head * DI
        tl.store(head_buf + part * DP + tl.arange(0, DP), y)
        tl.debug_barrier()  # every thread's values stored before the (cumulative) release below
        arrived = tl.atomic_add(cnt_ptr + tok * HEADS + head, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.store(cnt_ptr + tok * HEADS + head, 0)  # ready for the next launch
            cols = tl.arange(0, DI)
            parts = tl.load(head_buf + tl.arange(0, SPLIT)[:, None] * DP + tl.arange(0, DP)[None, :],
                            cache_modifier=".cg")
            rot = tl.reshape(_hadamard_outer(parts, SPLIT), (1, DI)) * (1.0 / tl.sqrt(DI * 1.0))
            code, scale = _quantize_rows(rot, cols[None, :] < DI, AMAX_FLOOR)
            out = tok.to(tl.int64) * HEADS + head
            tl.store(q_ptr + out * DI + cols[None, :], code.to(tl.uint8))
            tl.store(s_ptr + out + tl.zeros([1], tl.int64), scale)


def launch_gemv(head: tuple, tail: tuple, T: int, K: int, hi: int, di: int, log_bs: int, config: dict,
                hprec: str) -> None:
    """One launch of `_indexer_front_gemv_kernel`; head = its arguments x_ptr .. HEADS, tail = stride_xm ..
    weight_scale (indexer_front._indexer_front_split builds them for this kernel and the split one)."""
    split, bk = config["SPLIT"], config["BLOCK_K"]
    kt = triton.cdiv(K, bk)
    if kt > MAX_KT:
        raise ValueError(f"fused.indexer_front: GEMV=2 holds at most {MAX_KT} weight tiles, K={K} BLOCK_K={bk}")
    _indexer_front_gemv_kernel[(T + T * hi * split,)](
        *head, *tail, EVEN_K=K % bk == 0, SPLIT=split, KT=kt, DI=di, BLOCK_K=bk,
        BLOCK_H=triton.next_power_of_2(hi), LOG_BS=log_bs, HPREC=hprec, KRON=kron_factor(di),
        num_warps=config["num_warps"], num_stages=1, **launch_kwargs())


def kron_factor(di: int) -> int:
    """A of the key rotation's Kronecker form DI = A * B (`_indexer_front_rows`): 2^floor(log2(DI) / 2), so the
    [A, B, B] and [A, A, B] product tiles stay small (DI 128: 8 x 16)."""
    return 1 << ((di.bit_length() - 1) // 2)
