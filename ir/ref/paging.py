"""Paged cache addressing (DESIGN §5 T1): where a request's position lives in a cache pool.

A pool is a table of rows; rows are grouped in blocks of `block_size` consecutive rows (a power of
two). Request r owns the blocks listed in `block_table[r]` (int32 [R, MB], logical block j of the
request first; entries past the request's last block are ignored and may be -1). Position p of
request r lives at the physical row

    row(r, p) = block_table[r, p // block_size] * block_size + p % block_size

Blocks may be shared between requests (a cached prefix) and need not be contiguous or ordered.
"""

from __future__ import annotations

import torch

__all__ = ["cache_rows", "rows_to_positions", "check_block_size"]


def check_block_size(block_size: int) -> int:
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size!r}")
    return block_size


def cache_rows(block_table: torch.Tensor, block_size: int, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Physical rows (int64, pos's shape) of positions `pos` of requests `req` (broadcast together).

    Raises ValueError when a position lies past its request's block table or in a block numbered < 0."""
    check_block_size(block_size)
    dev = pos.device
    tbl = block_table.to(device=dev, dtype=torch.int64)
    req = req.to(device=dev, dtype=torch.int64)
    pos = pos.to(torch.int64)
    req, pos = torch.broadcast_tensors(req, pos)
    logical = pos // block_size
    if pos.numel() and int(logical.max()) >= tbl.shape[1]:
        raise ValueError(f"position {int(pos.max())} is past the block table's {tbl.shape[1]} blocks of "
                         f"{block_size} rows")
    blk = tbl[req, logical]
    if bool((blk < 0).any()):
        bad = (blk < 0).nonzero()[0].tolist()
        raise ValueError(f"position {int(pos[tuple(bad)])} of request {int(req[tuple(bad)])} maps to an "
                         f"unassigned block (block table entry -1)")
    return blk * block_size + pos % block_size


def rows_to_positions(rows: torch.Tensor, block_table: torch.Tensor, block_size: int,
                      token_req: torch.Tensor) -> torch.Tensor:
    """Inverse of `cache_rows` for selections: rows [T, K] (-1 = padding) of token t's request
    token_req[t] -> positions [T, K] (-1 kept). Raises ValueError for a row in a block its request
    does not own."""
    check_block_size(block_size)
    dev = rows.device
    rows = rows.to(torch.int64)
    tbl = block_table.to(device=dev, dtype=torch.int64)[token_req.to(device=dev, dtype=torch.int64)]  # [T, MB]
    valid = rows >= 0
    blk = torch.where(valid, rows // block_size, -2)
    hit = blk.unsqueeze(-1) == tbl.unsqueeze(1)                      # [T, K, MB]
    owned = hit.any(-1)
    if bool((valid & ~owned).any()):
        t, k = (valid & ~owned).nonzero()[0].tolist()
        raise ValueError(f"selection row {int(rows[t, k])} of token {t} is in a block its request does not own")
    logical = hit.to(torch.int8).argmax(-1)
    pos = logical * block_size + rows % block_size
    return torch.where(valid, pos, torch.full_like(rows, -1))
