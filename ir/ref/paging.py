"""Paged cache addressing (DESIGN §5 T1): where a request's position lives in a cache pool.

A pool is a table of rows; rows are grouped in blocks of `block_size` consecutive rows (a power of
two). Request r owns the blocks listed in `block_table[r]` (int32 [R, MB], logical block j of the
request first; entries past the request's last block are ignored and may be -1). Position p of
request r lives at the physical row

    row(r, p) = block_table[r, p // block_size] * block_size + p % block_size

Blocks may be shared between requests (a cached prefix) and need not be contiguous or ordered.

A pool is held either flat, [N, *row] with N = blocks * block_size, or as a block view
[NB, block_size, *row] (DESIGN §5 T1: one page of every block row of the packed cache pool, so its
block stride may exceed block_size * row elements). `read_rows` / `write_rows` address physical rows in
either form (row r is element [r] of a flat pool, [r // block_size, r % block_size] of a block view),
reading and writing the given tensor itself: a write through a view of the packed pool lands in it.
"""

from __future__ import annotations

import torch

__all__ = ["cache_rows", "rows_to_positions", "check_block_size", "is_block_view", "read_rows", "write_rows"]


def check_block_size(block_size: int) -> int:
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size!r}")
    return block_size


def cache_rows(block_table: torch.Tensor, block_size: int, req: torch.Tensor, pos: torch.Tensor,
               validate: bool = True) -> torch.Tensor:
    """Physical rows (int64, pos's shape) of positions `pos` of requests `req` (broadcast together).

    Raises ValueError when a position lies past its request's block table or in a block numbered < 0.
    `validate=False` skips those checks, which read device data on the host (CUDA-graph capture: the
    runtime validated every position when it built the step)."""
    check_block_size(block_size)
    dev = pos.device
    tbl = block_table.to(device=dev, dtype=torch.int64)
    req = req.to(device=dev, dtype=torch.int64)
    pos = pos.to(torch.int64)
    req, pos = torch.broadcast_tensors(req, pos)
    logical = pos // block_size
    if validate and pos.numel() and int(logical.max()) >= tbl.shape[1]:
        raise ValueError(f"position {int(pos.max())} is past the block table's {tbl.shape[1]} blocks of "
                         f"{block_size} rows")
    blk = tbl[req, logical]
    if validate and bool((blk < 0).any()):
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


def is_block_view(pool: torch.Tensor, row_rank: int, block_size: int | None = None) -> bool:
    """True for a block view [NB, bs, *row], False for a flat pool [N, *row] (`row_rank` = len(row)).
    Raises ValueError for any other rank, or a block view whose second dim is not `block_size`."""
    if pool.dim() == row_rank + 1:
        return False
    if pool.dim() != row_rank + 2:
        raise ValueError(f"pool {tuple(pool.shape)}: expected [N{', row' * row_rank}] or a block view "
                         f"[NB, block_size{', row' * row_rank}] (rows of rank {row_rank})")
    if block_size is not None and pool.shape[1] != block_size:
        raise ValueError(f"block view {tuple(pool.shape)} holds {pool.shape[1]} rows per block, the block "
                         f"table's blocks hold {block_size}")
    return True


def _index(pool: torch.Tensor, rows: torch.Tensor, block_size: int, row_rank: int):
    rows = rows.to(device=pool.device, dtype=torch.int64)
    if not is_block_view(pool, row_rank, check_block_size(block_size)):
        return (rows,)
    return rows // block_size, rows % block_size


def read_rows(pool: torch.Tensor, rows: torch.Tensor, block_size: int, row_rank: int = 1) -> torch.Tensor:
    """pool rows `rows` (any shape S of int) -> [*S, *row], from a flat pool or a block view."""
    return pool[_index(pool, rows, block_size, row_rank)]


def write_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, block_size: int,
               row_rank: int = 1) -> torch.Tensor:
    """pool[rows] = values (cast to the pool dtype), in place in `pool` itself (flat or block view)."""
    pool[_index(pool, rows, block_size, row_rank)] = values.to(pool.dtype)
    return pool
