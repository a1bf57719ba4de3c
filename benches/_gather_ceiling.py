"""The bandwidth a sparse MLA decode's row gather can reach on its own (bench_mla_b64.py's `gather` section): a kernel
that reads exactly the bytes the attention kernel must read from the latent pool (every selected row's kv + dr bytes,
through the same pool row indices) and does nothing with them but a xor, so that the
loads cannot be removed. Its time over the same rows is the ceiling the access pattern (random 576-byte rows, a
quarter of each 64-row block) allows, next to the sequential-read bandwidth the bench's fractions are taken against.
Not product code: a measuring stick. Grid (tokens, pieces); a program reads its piece's rows R at a time, the rows'
first 512 bytes as one [R, 128] int32 tile and the remaining row bytes as one [R, TAIL] tile (16-byte loads)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_xor_kernel(pool_ptr, rows_ptr, out_ptr, KSEL, PIECE, ROW_WORDS: tl.constexpr, TAIL: tl.constexpr,
                       R: tl.constexpr, STAGES: tl.constexpr):
    t = tl.program_id(0)
    p = tl.program_id(1)
    head = tl.arange(0, 128)
    tail = 128 + tl.arange(0, TAIL)
    acc = tl.zeros([R, 128], tl.int32)
    acc2 = tl.zeros([R, TAIL], tl.int32)
    for j in tl.range(p * PIECE, p * PIECE + PIECE, R, num_stages=STAGES):
        r = tl.load(rows_ptr + t.to(tl.int64) * KSEL + j + tl.arange(0, R)).to(tl.int64) * ROW_WORDS
        acc ^= tl.load(pool_ptr + r[:, None] + head[None, :])
        acc2 ^= tl.load(pool_ptr + r[:, None] + tail[None, :])
    x = tl.xor_sum(tl.xor_sum(acc, 1), 0) ^ tl.xor_sum(tl.xor_sum(acc2, 1), 0)
    tl.store(out_ptr + t * tl.num_programs(1) + p, x)


def gather_xor(pool: torch.Tensor, rows: torch.Tensor, *, pieces: int = 4, R: int = 32, warps: int = 4,
               stages: int = 3):
    """A callable reading every row of `rows` [T, K] (pool row indices) of `pool` [N, W] (uint8 / e4m3 bytes, W a
    multiple of 16 over 512, rows contiguous): the xor of each (token, piece)'s int32 words [T, pieces]."""
    T, K = rows.shape
    W = pool.shape[-1]
    if pool.stride(-1) != 1 or pool.stride(-2) != W or W % 16 or W <= 512 or K % (pieces * R):
        raise ValueError(f"gather_xor: pool [{tuple(pool.shape)}] strides {pool.stride()} and K {K} / pieces "
                         f"{pieces} x R {R}: contiguous rows of 16-byte multiples over 512 and K a multiple needed")
    words = pool.view(torch.int32)
    out = torch.empty(T, pieces, dtype=torch.int32, device=pool.device)
    tail = (W - 512) // 4
    if tail & (tail - 1):
        raise ValueError(f"gather_xor: row width {W}: the {tail} words past 512 bytes must be a power of two")

    def call():
        _gather_xor_kernel[(T, pieces)](words, rows, out, K, K // pieces, ROW_WORDS=W // 4, TAIL=tail, R=R,
                                        STAGES=stages, num_warps=warps)
        return out
    return call


def reference_xor(pool: torch.Tensor, rows: torch.Tensor, pieces: int) -> torch.Tensor:
    """gather_xor's result computed by numpy on the host: the kernel's check."""
    import numpy as np
    w = pool.view(torch.int32)[rows.long()].cpu().numpy()            # [T, K, W / 4]
    x = np.bitwise_xor.reduce(w.reshape(rows.shape[0], pieces, -1), axis=-1)
    return torch.from_numpy(x).to(pool.device)
