"""Paged cache addressing inside kernels (`ir.ref.paging`): position p of a request whose block-table
row starts at `tblrow` lives at pool row tblrow[p >> LOG_BS] * 2^LOG_BS + (p & (2^LOG_BS - 1)).

A pool is either 2-D [N, W] (rows contiguous, N = blocks * block_size) or a 3-D block view
[NB, block_size, W] whose block stride may exceed block_size * W (a page of a packed block row, T1).
Either way physical row r = blk * 2^LOG_BS + off starts at element offset
blk * stride_blk + off * stride_row (`row_offsets`); `pool_strides` gives the two strides.

Host side: `paging_args(block_table, token_req, block_size)` gives the int32 table, the per-token
request index and LOG_BS that the kernels take."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ir.ref.paging import check_block_size


@triton.jit
def rows_of(tblrow, p, valid, LOG_BS: tl.constexpr):
    """Physical pool rows (int64) of positions p (masked by valid; invalid lanes give row of block 0)."""
    blk = tl.load(tblrow + (p >> LOG_BS), mask=valid, other=0)
    return blk.to(tl.int64) * (1 << LOG_BS) + (p & ((1 << LOG_BS) - 1)).to(tl.int64)


@triton.jit
def row_offsets(rows, LOG_BS: tl.constexpr, stride_blk, stride_row):
    """Element offsets (int64) of the starts of physical pool rows `rows` (see module doc)."""
    r = rows.to(tl.int64)
    return (r >> LOG_BS) * stride_blk + (r & ((1 << LOG_BS) - 1)) * stride_row


def pool_strides(pool: torch.Tensor, block_size: int, row_rank: int = 1, what: str = "pool") -> tuple[int, int]:
    """(stride_blk, stride_row) in elements of a pool whose rows have `row_rank` dims (1: [W] rows,
    0: one scalar per row): flat [N, *row] with unit-stride rows, or a block view [NB, block_size, *row]
    with any block stride. Raises ValueError naming `what` otherwise."""
    check_block_size(int(block_size))
    flat = pool.dim() == row_rank + 1
    if not flat and pool.dim() != row_rank + 2:
        raise ValueError(f"{what} {tuple(pool.shape)}: expected rank {row_rank + 1} rows or a rank "
                         f"{row_rank + 2} block view [NB, {block_size}, ...]")
    inner_ok = row_rank == 0 or pool.stride(-1) == 1
    if flat and inner_ok:
        return pool.stride(0) * block_size, pool.stride(0)
    if not flat and pool.shape[1] == block_size and inner_ok:
        return pool.stride(0), pool.stride(1)
    raise ValueError(f"{what} {tuple(pool.shape)} strides {pool.stride()}: rows must be unit-stride and a "
                     f"block view [NB, {block_size}, ...] must have {block_size} rows per block")


def paging_args(block_table: torch.Tensor, token_req: torch.Tensor, block_size: int, device) -> tuple:
    """(table int32 [R, MB] contiguous, token_req int64 [T], MB, LOG_BS) for the kernels."""
    check_block_size(int(block_size))
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, MB], got {tuple(block_table.shape)}")
    tbl = block_table.to(device=device, dtype=torch.int32).contiguous()
    req = token_req.to(device=device, dtype=torch.int64).contiguous()
    return tbl, req, tbl.shape[1], int(block_size).bit_length() - 1


def context_bound(token_pos, attrs) -> int:
    """The step's context length for config keys: attrs["max_context"] when the runtime states a bound
    (CUDA-graph capture: no host sync), else max(token_pos) + 1 (0 for compile-time meta tensors)."""
    if attrs.get("max_context"):
        return int(attrs["max_context"])
    tp = token_pos
    return int(tp.max()) + 1 if isinstance(tp, torch.Tensor) and tp.numel() and tp.device.type != "meta" else 0
