"""Paged cache addressing inside kernels (`ir.ref.paging`): position p of a request whose block-table
row starts at `tblrow` lives at pool row tblrow[p >> LOG_BS] * 2^LOG_BS + (p & (2^LOG_BS - 1)).

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


def paging_args(block_table: torch.Tensor, token_req: torch.Tensor, block_size: int, device) -> tuple:
    """(table int32 [R, MB] contiguous, token_req int64 [T], MB, LOG_BS) for the kernels."""
    check_block_size(int(block_size))
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, MB], got {tuple(block_table.shape)}")
    tbl = block_table.to(device=device, dtype=torch.int32).contiguous()
    req = token_req.to(device=device, dtype=torch.int64).contiguous()
    return tbl, req, tbl.shape[1], int(block_size).bit_length() - 1
