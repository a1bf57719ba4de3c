"""Graph-safe DCP references: `dcp_cache_write`, `dcp_mla` and `dcp_mla_dense` of a decode step with static
shapes and no host read of device data, so a DCP decode step can be captured as a CUDA graph
(`k31c.runtime.cuda_graphs.GRAPH_SAFE_REFERENCE`; the Executor calls them while `static_context` is set).

Static bound. The rank's block table [R, MB] covers L = MB·block_size local rows: every width that the eager
references read from `token_pos.max()` on the host is L here (extra columns are masked).

Attention. `dcp_mla` / `dcp_mla_dense` with `static=True` (k31c/parallel/dcp_attention.py): widths are
the L local rows, the merge is `dcp_topk.static_topk_own_positions` (one all-gather of int64 composites
instead of the one-round merge's host-sized second round: more bytes, no host round trip, the same
selection), rows are not validated on the host.

Cache write. A decode step has one token per request (the graphs capture decode only) and DCP serving
shares no cached prefix between requests (`LeaderRuntime` refuses it), so no two tokens of a step map to
one row. Each token writes its row: the owner writes the new value; a token this rank does not own
rewrites local row 0 of its own request with that row's current bytes (a no-op write at a row no other
token of the step touches), which replaces the eager reference's masked, data-dependent write.
"""

from __future__ import annotations

import functools

import torch

from ir.ref.paging import cache_rows, read_rows, write_rows

from .dcp_attention import owner_and_local


def dcp_cache_write_static(pool, values, token_req, token_pos, block_table, *, block_size: int, interleave: int,
                           rank: int, world: int):
    """`dcp_attention.dcp_cache_write` of a decode step without host reads (module docstring)."""
    owner, lp = owner_and_local(token_pos, world, interleave)
    mine = owner == rank
    lp = torch.where(mine, lp, torch.zeros_like(lp))
    rows = cache_rows(block_table, block_size, token_req, lp, validate=False)
    row_rank = values.dim() - 1
    old = read_rows(pool, rows, block_size, row_rank)
    new = values.to(pool.dtype)
    keep = mine.view(-1, *([1] * row_rank))
    if pool.element_size() == 1:  # torch.where has no float8 kernel: choose the bytes
        merged = torch.where(keep, new.view(torch.uint8), old.view(torch.uint8)).view(pool.dtype)
    else:
        merged = torch.where(keep, new, old)
    return write_rows(pool, rows, merged, block_size, row_rank)


def _graph_safe() -> dict:
    """The ops' references with static=True, keyed by op name (what GRAPH_SAFE_REFERENCE calls)."""
    from ir.ops import collective

    return {op: functools.partial(ref, static=True) for op, ref in
            (("dcp_cache_write", collective._dcp_write_ref), ("dcp_mla", collective._dcp_mla_ref),
             ("dcp_mla_dense", collective._dense_ref))}


GRAPH_SAFE = _graph_safe()
__all__ = ["GRAPH_SAFE", "dcp_cache_write_static"]
