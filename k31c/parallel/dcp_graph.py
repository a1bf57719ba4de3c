"""Graph-safe DCP references: `dcp_cache_write`, `dcp_mla` and `dcp_mla_dense` of a decode step with static
shapes and no host read of device data, so a DCP decode step can be captured as a CUDA graph
(`k31c.runtime.cuda_graphs.GRAPH_SAFE_REFERENCE`; the Executor calls them while `static_context` is set).

Static bound. The rank's block table [R, MB] covers L = MB·block_size local rows: every width that the eager
references read from `token_pos.max()` on the host is L here (extra columns are masked).

Merge. The eager `dcp_topk` sends ⌈1.5k/W⌉ keys per rank and re-sends in a second, data-dependent round
when a rank may hold more; its sizes are read on the host. Here each rank sends its local top-k_loc,
k_loc = min(k, L), as int64 composites c = (key << 32) | (2³² − 1 − p) (key = the order-preserving int32 of
the fp32 score, p the global position), one all-gather of W·k_loc·8 bytes per row; every rank takes the
global top-k_eff (k_eff = min(k, p_t + 1)) of the union. The union holds the exact top-k (a rank's share of
it is a prefix of its local order, and at most k long), c orders by (score desc, position asc) exactly like
the eager merge, so the selection is identical: own_positions [T, k] (ascending, −1 padded) equal
`dcp_topk`'s. More bytes than the one-round merge (8·W·k vs 4·W·⌈1.5k/W⌉ per row), no host round trip:
at decode sizes the bytes are microseconds and the host round trip is what a step cannot afford.

Cache write. A decode step has one token per request (the graphs capture decode only) and DCP serving
shares no cached prefix between requests (`LeaderRuntime` refuses it), so no two tokens of a step map to
one row. Each token writes its row: the owner writes the new value; a token this rank does not own
rewrites local row 0 of its own request with that row's current bytes (a no-op write at a row no other
token of the step touches), which replaces the eager reference's masked, data-dependent write.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ir.formats import dequantize_fp8
from ir.ref.paging import cache_rows, read_rows, write_rows

from .dcp_attention import CHUNK_ELEMENTS, _attend_own_and_combine, _chunked, _local_scores, owner_and_local
from .dcp_topk import all_gather_concat, global_positions, local_count

INT64_MIN = -(2**63)
_LOW32 = (1 << 32) - 1


def local_rows(block_table: torch.Tensor, block_size: int) -> int:
    """L: the local rows a rank's block table can address (the static bound of every context width)."""
    return int(block_table.shape[1]) * int(block_size)


def _order_keys_unchecked(scores: torch.Tensor) -> torch.Tensor:
    """`dcp_topk.order_keys` without its host-side NaN check (masked columns are −inf, never NaN)."""
    bits = (scores + 0.0).contiguous().view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def static_topk_own_positions(scores: torch.Tensor, valid: torch.Tensor, k: int, ctx_len: torch.Tensor,
                              interleave: int, group=None) -> torch.Tensor:
    """This rank's share of the exact global top-k (module docstring): [T, k] global positions this rank
    stores, ascending, −1 padded. scores [T, L] fp32 over local rows (valid [T, L] marks real ones)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    T, L = scores.shape
    dev = scores.device
    pos = global_positions(rank, L, world, interleave, device=dev)
    comp = (_order_keys_unchecked(scores).to(torch.int64) << 32) + (_LOW32 - pos)[None, :]
    comp = torch.where(valid, comp, torch.full_like(comp, INT64_MIN))
    k_loc = min(k, L)
    sent = torch.topk(comp, k_loc, dim=1).values.contiguous()           # [T, k_loc], best first
    gathered = torch.empty((world * T, k_loc), dtype=torch.int64, device=dev)
    all_gather_concat(gathered, sent, group=group)
    union = gathered.view(world, T, k_loc).permute(1, 0, 2).reshape(T, world * k_loc)
    kk = min(k, world * k_loc)
    best = torch.topk(union, kk, dim=1).values                           # global order: (score desc, pos asc)
    k_eff = ctx_len.to(device=dev, dtype=torch.int64).clamp(max=k)
    chosen = (torch.arange(kk, device=dev)[None, :] < k_eff[:, None]) & (best > INT64_MIN)
    p = _LOW32 - (best & _LOW32)
    mine = chosen & (((p // interleave) % world) == rank)
    big = torch.iinfo(torch.int64).max
    own = torch.sort(torch.where(mine, p, big), dim=1).values
    own = torch.where(own < big, own, -1)
    if kk < k:
        own = torch.cat([own, own.new_full((T, k - kk), -1)], dim=1)
    return own


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


def dcp_mla_static(q_nope, q_pe, latent, kv_b, iq, iq_scale, iw, keys, key_scale, token_pos, token_req,
                   block_table, *, block_size: int, scale: float, topk: int, interleave: int, group=None,
                   key_format: str = "fp8", latent_format: str = "plain", form: str = "absorbed"):
    """`dcp_attention.dcp_mla` with static shapes: scores over the L local rows, the static merge; query
    tokens in chunks whose temporaries stay under CHUNK_ELEMENTS, sized from L (static)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    L = local_rows(block_table, block_size)
    T = q_nope.shape[0]
    rows = max(1, CHUNK_ELEMENTS // max(1, L * (keys.shape[-1] + iq.shape[1])
                                        + topk * (q_nope.shape[1] * world + latent.shape[-1])))
    if T > rows:
        return _chunked(dcp_mla_static, T, rows, dict(q_nope=q_nope, q_pe=q_pe, iq=iq, iq_scale=iq_scale, iw=iw,
                                                      token_pos=token_pos, token_req=token_req),
                        latent=latent, kv_b=kv_b, keys=keys, key_scale=key_scale, block_table=block_table,
                        block_size=block_size, scale=scale, topk=topk, interleave=interleave, group=group,
                        key_format=key_format, latent_format=latent_format, form=form)
    ctx_len = token_pos.to(device=q_nope.device, dtype=torch.int64) + 1
    q = dequantize_fp8(iq, iq_scale).to(iw.dtype)
    n_local = local_count(ctx_len, rank, world, interleave)
    scores, valid = _local_scores(q, iw, keys, key_scale, key_format, token_req, block_table, block_size, n_local,
                                  width=L, validate=False)
    own = static_topk_own_positions(scores.float(), valid, topk, ctx_len, interleave, group)
    return _attend_own_and_combine(q_nope, q_pe, latent, kv_b, own, token_req, block_table, block_size=block_size,
                                   scale=scale, interleave=interleave, group=group, latent_format=latent_format,
                                   form=form, validate=False)


def dcp_mla_dense_static(q_nope, q_pe, latent, kv_b, token_pos, token_req, block_table, *, block_size: int,
                         scale: float, interleave: int, group=None, latent_format: str = "plain",
                         form: str = "absorbed"):
    """`dcp_attention.dcp_mla_dense` with static shapes: every one of the L local rows, masked past n_local."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    L = local_rows(block_table, block_size)
    n_local = local_count(token_pos.to(device=q_nope.device, dtype=torch.int64) + 1, rank, world, interleave)
    gp = global_positions(rank, L, world, interleave, device=q_nope.device)
    own = torch.where(torch.arange(L, device=q_nope.device)[None, :] < n_local[:, None], gp[None, :], -1)
    return _attend_own_and_combine(q_nope, q_pe, latent, kv_b, own, token_req, block_table, block_size=block_size,
                                   scale=scale, interleave=interleave, group=group, latent_format=latent_format,
                                   form=form, validate=False)


# ---- the ops' graph-safe references: (bound operands, attrs) -> results, as GRAPH_SAFE_REFERENCE calls them ----
def _write(a, at):
    from ir.ops.collective import _live

    rank, size = _live(at["group"], at["world"], "dcp_cache_write")
    return dcp_cache_write_static(a.pool, a.values, a.token_req, a.token_pos, a.block_table,
                                  block_size=at["block_size"], interleave=at["interleave"], rank=rank, world=size)


def _mla(a, at):
    from ir.ops.collective import _live, get_group

    _live(at["group"], at["world"], "dcp_mla")
    return dcp_mla_static(a.q_nope, a.q_pe, a.latent, a.kv_b, a.iq, a.iq_scale, a.iw, a.keys, a.key_scale,
                          a.token_pos, a.token_req, a.block_table, block_size=at["block_size"], scale=at["scale"],
                          topk=at["topk"], interleave=at["interleave"], group=get_group(at["group"]),
                          key_format=at["key_format"], latent_format=at["latent_format"], form=at["form"])


def _mla_dense(a, at):
    from ir.ops.collective import _live, get_group

    _live(at["group"], at["world"], "dcp_mla_dense")
    return dcp_mla_dense_static(a.q_nope, a.q_pe, a.latent, a.kv_b, a.token_pos, a.token_req, a.block_table,
                                block_size=at["block_size"], scale=at["scale"], interleave=at["interleave"],
                                group=get_group(at["group"]), latent_format=at["latent_format"], form=at["form"])


GRAPH_SAFE = {"dcp_cache_write": _write, "dcp_mla": _mla, "dcp_mla_dense": _mla_dense}
__all__ = ["GRAPH_SAFE", "dcp_cache_write_static", "dcp_mla_static", "dcp_mla_dense_static",
           "static_topk_own_positions", "local_rows"]
