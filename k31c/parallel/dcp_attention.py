"""DCP (T4, issue 8): the references of `dcp_cache_write`, `dcp_mla`, `dcp_mla_dense`, `dcp_workspace_table`
and `dcp_gather_context` (declared in ir/ops/collective.py).

Layout. W ranks of a DCP group (a run of W consecutive TP ranks, k31c/parallel/groups.py), interleave B:
position p of a request is owned by rank (p // B) % W, which stores it at its *local* position
lp(p) = (p // (W·B))·B + p % B of the same request, addressed through the rank's own block table, which
covers only its local positions (~1/W of the rows, `k31c.parallel.serving.rows_per_rank`). Inverse:
local index i of rank r is global position (i // B)·W·B + r·B + i % B (`dcp_topk.global_positions`).

dcp_mla for query token t of request q at position p_t (context 0..p_t, k_t = min(topk, p_t + 1)):
1. indexer: this rank scores its own context tokens, I(t, s) = Σ_j w_j·relu(q_j·k_s) (SPEC §5, same
   formula and dtype as the reference), over its n_r(p_t + 1) local rows;
2. exact global top-k: `dcp_topk` (one round of ⌈1.5·k/W⌉ 32-bit keys per rank and row, re-sends only
   when a rank may hold more); this rank learns which of *its* tokens are selected;
3. absorbed queries q̃^h = [W_UK^hᵀ q_nope^h ; q_pe^h] of this rank's H/TP heads are all-gathered over the
   DCP group, so every rank holds the queries of the group's W·H/TP heads;
4. partial attention of those heads over this rank's selected tokens: lse_r = log Σ exp(scale·q̃·c),
   õ_r = Σ softmax_r · c[:kv] (an empty share gives lse = −inf, õ = 0);
5. `lse_combine` (all-reduce max + sum) gives õ over the whole selection; this rank keeps its heads and
   applies its W_UV: o^h = W_UV^h õ^h.
This equals SPEC §4 over Sel(t) (softmax is a convex combination; W_UV is linear). Dense MLA (K3,
`dcp_mla_dense`) skips 1–2: Sel(t) = every position 0..p_t, so each rank attends over all it stores.
Counters: MERGE_TRAFFIC accumulates dcp_topk's bytes per call (rows, first round, re-sent rows and bytes).

Memory. Steps 1 and 4 gather every scored / selected row of the context per query token, so a step runs in
chunks of query tokens whose temporaries stay under CHUNK_ELEMENTS elements (`row_chunk`; a short chunk
appended to a long context under DCP would otherwise need T x L x (DI + heads) at once). The chunk size
comes from the step's longest context, the same on every rank, so every rank runs the same collectives.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.distributed as dist

from ir.formats import dequantize_fp8, dequantize_latent_nvfp4
from ir.ops.attention import dequantize_index_keys
from ir.ref.paging import cache_rows, read_rows, write_rows

from .dcp_topk import dcp_topk, global_positions, local_count, static_topk_own_positions
from .lse_combine import lse_combine

MERGE_TRAFFIC: Counter = Counter()
CHUNK_ELEMENTS = 1 << 30  # per chunk of query tokens: ~2 GiB of bf16 temporaries (4 GiB in fp32)


def row_chunk(token_pos: torch.Tensor, world: int, per_position: int, per_selected: int, selected: int,
              local_rows: int | None = None) -> int:
    """Query tokens per chunk: each costs per_position elements for each of its (at most) ceil(ctx / W)
    local positions (read on the host; `local_rows` instead when given: the static bound) plus per_selected
    for each of `selected` attended rows."""
    if token_pos.numel() == 0:
        return 1
    local = local_rows if local_rows is not None else -(-(int(token_pos.max()) + 1) // world)
    per_row = local * per_position + selected * per_selected
    return max(1, CHUNK_ELEMENTS // max(1, per_row))


def local_rows(block_table: torch.Tensor, block_size: int) -> int:
    """L: the local rows a rank's block table addresses (the static bound of every context width)."""
    return int(block_table.shape[1]) * int(block_size)


def _chunked(fn, n_rows: int, rows: int, per_token: dict, **fixed):
    """fn over query-token chunks of `rows` (the per_token tensors sliced on dim 0), concatenated."""
    if n_rows <= rows:
        return fn(**per_token, **fixed)
    return torch.cat([fn(**{k: v[s:s + rows] for k, v in per_token.items()}, **fixed)
                      for s in range(0, n_rows, rows)])


def owner_and_local(pos: torch.Tensor, world: int, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(owning rank, local position) of global positions."""
    pos = pos.to(torch.int64)
    return (pos // interleave) % world, (pos // (world * interleave)) * interleave + pos % interleave


def dcp_cache_write(pool, values, token_req, token_pos, block_table, *, block_size: int, interleave: int,
                    rank: int, world: int):
    """pool[row(req, lp(p))] = values for the tokens this rank owns; other tokens are not stored here.
    `pool` is flat [N, *row] or a block view [NB, block_size, *row] (written in place either way)."""
    owner, lp = owner_and_local(token_pos, world, interleave)
    mine = owner == rank
    if bool(mine.any()):
        rows = cache_rows(block_table, block_size, token_req[mine], lp[mine])
        write_rows(pool, rows, values[mine], block_size, values.dim() - 1)
    return pool


def _local_scores(q, w, keys, key_scale, key_format, token_req, block_table, block_size, n_local, width=None,
                  validate=True):
    """scores [T, width] of this rank's local context rows (columns >= n_local[t] are −inf; width defaults
    to max n_local, read on the host); only the gathered rows' keys are dequantised (the pool is never
    widened whole). `validate=False`: no host-side check of the rows (CUDA-graph capture)."""
    T = q.shape[0]
    L = width if width is not None else (int(n_local.max()) if T else 0)
    li = torch.arange(L, device=q.device, dtype=torch.int64)
    valid = li[None, :] < n_local[:, None]
    if L == 0:
        return q.new_full((T, 0), float("-inf")), valid
    rows = cache_rows(block_table, block_size, token_req.to(torch.int64)[:, None], torch.where(valid, li, 0),
                      validate=validate)
    kk = dequantize_index_keys(read_rows(keys, rows, block_size),
                               read_rows(key_scale, rows, block_size, 0 if key_format == "fp8" else 1),
                               key_format).to(w.dtype)                  # [T, L, DI]
    logits = torch.relu(torch.einsum("bjd,bld->bjl", q, kk))
    sc = torch.einsum("bj,bjl->bl", w, logits)
    return sc.masked_fill(~valid, float("-inf")), valid


def dcp_mla(q_nope, q_pe, latent, kv_b, iq, iq_scale, iw, keys, key_scale, token_pos, token_req, block_table, *,
            block_size: int, scale: float, topk: int, interleave: int, group=None, key_format: str = "fp8",
            latent_format: str = "plain", form: str = "absorbed", static: bool = False):
    """o [T, H/W, dv] of this rank's heads (see the module docstring). Pools flat or block views; keys
    FP8 or MXFP4 (`key_format`), latents plain or NVFP4 (`latent_format`), read as the reference reads them.
    `static` (CUDA-graph capture, `k31c.parallel.dcp_graph`): widths are the block table's L local rows, the
    merge is `dcp_topk.static_topk_own_positions` and nothing reads device data on the host; same results."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    T = q_nope.shape[0]
    heads = q_nope.shape[1] * world
    L = local_rows(block_table, block_size) if static else None
    rows = row_chunk(token_pos, world, keys.shape[-1] + iq.shape[1], heads + latent.shape[-1], topk, local_rows=L)
    if T > rows:
        return _chunked(dcp_mla, T, rows, dict(q_nope=q_nope, q_pe=q_pe, iq=iq, iq_scale=iq_scale, iw=iw,
                                               token_pos=token_pos, token_req=token_req),
                        latent=latent, kv_b=kv_b, keys=keys, key_scale=key_scale, block_table=block_table,
                        block_size=block_size, scale=scale, topk=topk, interleave=interleave, group=group,
                        key_format=key_format, latent_format=latent_format, form=form, static=static)
    ctx_len = token_pos.to(device=q_nope.device, dtype=torch.int64) + 1

    # 1–2: local indexer scores, exact global top-k
    q = dequantize_fp8(iq, iq_scale).to(iw.dtype)
    n_local = local_count(ctx_len, rank, world, interleave)
    scores, valid = _local_scores(q, iw, keys, key_scale, key_format, token_req, block_table, block_size, n_local,
                                  width=L, validate=not static)
    if static:
        own = static_topk_own_positions(scores.float(), valid, topk, ctx_len, interleave, group)
    else:
        if scores.shape[1] == 0:  # no rank-local context in the whole step: one dummy column keeps shapes
            scores = scores.new_full((T, 1), float("-inf"))
        res = dcp_topk(scores.float(), topk, ctx_len=ctx_len, interleave=interleave, group=group)
        MERGE_TRAFFIC.update(calls=1, rows=T, first_round_bytes=res.first_round_bytes, resend_rows=res.resend_rows,
                             resend_bytes=res.resend_bytes)
        own = res.own_positions
    return _attend_own_and_combine(q_nope, q_pe, latent, kv_b, own, token_req, block_table,
                                   block_size=block_size, scale=scale, interleave=interleave, group=group,
                                   latent_format=latent_format, form=form, validate=not static)


def dcp_mla_dense(q_nope, q_pe, latent, kv_b, token_pos, token_req, block_table, *, block_size: int, scale: float,
                  interleave: int, group=None, latent_format: str = "plain", form: str = "absorbed",
                  static: bool = False):
    """Dense MLA (K3, no indexer) over a DCP group: token t attends over every position <= p_t; this rank
    takes the n_r(p_t + 1) of them it stores (steps 3–5 of the module docstring with Sel(t) = 0..p_t).
    Returns o [T, H/W, dv] of this rank's heads. `static`: every one of the table's L local rows, masked
    past n_local (CUDA-graph capture, as for dcp_mla)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    L = local_rows(block_table, block_size) if static else None
    rows = row_chunk(token_pos, world, q_nope.shape[1] * world + latent.shape[-1], 0, 0, local_rows=L)
    if q_nope.shape[0] > rows:
        return _chunked(dcp_mla_dense, q_nope.shape[0], rows,
                        dict(q_nope=q_nope, q_pe=q_pe, token_pos=token_pos, token_req=token_req),
                        latent=latent, kv_b=kv_b, block_table=block_table, block_size=block_size, scale=scale,
                        interleave=interleave, group=group, latent_format=latent_format, form=form, static=static)
    n_local = local_count(token_pos.to(device=q_nope.device, dtype=torch.int64) + 1, rank, world, interleave)
    if L is None:
        L = int(n_local.max()) if n_local.numel() else 0
    gp = global_positions(rank, L, world, interleave, device=q_nope.device)
    own = torch.where(torch.arange(L, device=q_nope.device)[None, :] < n_local[:, None], gp[None, :], -1)
    return _attend_own_and_combine(q_nope, q_pe, latent, kv_b, own, token_req, block_table,
                                   block_size=block_size, scale=scale, interleave=interleave, group=group,
                                   latent_format=latent_format, form=form, validate=not static)


def _attend_own_and_combine(q_nope, q_pe, latent, kv_b, own_positions, token_req, block_table, *, block_size: int,
                            scale: float, interleave: int, group=None, latent_format: str = "plain",
                            form: str = "absorbed", validate: bool = True):
    """Steps 3–5: all heads' absorbed queries gathered, partial attention over `own_positions` [T, K]
    (global positions this rank stores, -1 padding), LSE combine, this rank's heads' value projection
    (form "absorbed"; form "latent" returns o~ [T, H/W, kv] before it, for the fused value gate).
    `validate=False`: rows are not checked on the host (CUDA-graph capture)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    T, hl, dn = q_nope.shape
    dt = q_nope.dtype
    kv = kv_b.shape[1]
    dv = kv_b.shape[0] // hl - dn
    wkv = kv_b.to(dt).view(hl, dn + dv, kv)
    w_uk, w_uv = wkv[:, :dn], wkv[:, dn:]

    # 3: absorbed queries of every head of the group
    q_abs = torch.cat([torch.einsum("bhn,hnk->bhk", q_nope, w_uk), q_pe.to(dt)], dim=-1).contiguous()
    comm = torch.float32 if dist.get_backend(group) == "gloo" and q_abs.element_size() < 4 else q_abs.dtype
    parts = [torch.empty_like(q_abs, dtype=comm) for _ in range(world)]
    dist.all_gather(parts, q_abs.to(comm), group=group)
    q_all = torch.cat(parts, dim=1).to(dt)                              # [T, H_group, kv+dr]

    # 4: partial attention over this rank's share
    sel = own_positions
    valid = sel >= 0
    _, lp = owner_and_local(torch.where(valid, sel, 0), world, interleave)
    rows = cache_rows(block_table, block_size, token_req.to(torch.int64)[:, None], lp, validate=validate)
    ctx = read_rows(latent, rows, block_size)
    ctx = (dequantize_latent_nvfp4(ctx, kv) if latent_format == "nvfp4" else ctx).to(dt)  # [T, K, kv+dr]
    logits = scale * torch.einsum("bhk,blk->bhl", q_all, ctx)
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)                               # −inf for an empty share
    p = torch.where(valid[:, None, :], torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0)[..., None]),
                    torch.zeros_like(logits))
    o_lat = torch.einsum("bhl,blk->bhk", p, ctx[..., :kv])

    # 5: combine over the group, keep this rank's heads, value projection
    o_lat, _ = lse_combine(o_lat, lse, group=group)
    mine = o_lat[:, rank * hl:(rank + 1) * hl].to(dt)
    return mine.contiguous() if form == "latent" else torch.einsum("bhk,hvk->bhv", mine, w_uv)


def dcp_workspace_table(block_table: torch.Tensor, world: int) -> torch.Tensor:
    """ws_table [R, MB·W] with ws_table[q, j] = q·MB·W + j: request q's global position p at workspace row
    q·MB·W·bs + p. A rank's local table of MB blocks covers MB·bs·W global positions (`rows_per_rank`)."""
    R, MB = block_table.shape
    j = torch.arange(MB * world, dtype=block_table.dtype, device=block_table.device)
    return (torch.arange(R, dtype=block_table.dtype, device=block_table.device)[:, None] * (MB * world) + j).contiguous()


def dcp_gather_context(pool, token_pos, token_req, block_table, ws_table, *, block_size: int, interleave: int,
                       row_rank: int = 1, group=None):
    """Merge-free DCP prefill (T5): a workspace of ws_table's R·MB·W·bs rows whose row(q, p) under
    `ws_table` holds position p of request q for every p in the step's context of q (0 .. its last step
    position), gathered from the owners' local rows (`block_table`, the rank's local table; `pool` flat
    [N, *row] or a block view [NB, bs, *row], rows of `row_rank` dims). The workspace is flat [n, *row].
    Rows move as raw bytes (exact for any dtype); other rows are zero. Every rank can compute every rank's
    share sizes, so one padded all-gather suffices."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    req, pos = token_req.to(torch.int64), token_pos.to(torch.int64)
    reqs = torch.unique(req)
    ctx = torch.stack([pos[req == q].max() + 1 for q in reqs.tolist()]) if reqs.numel() else pos[:0]
    counts = [local_count(ctx, r, world, interleave) for r in range(world)]           # [W] x [n_req]
    sizes = [int(c.sum()) for c in counts]
    row_shape = tuple(pool.shape[pool.dim() - row_rank:])
    width = pool.element_size() * math.prod(row_shape)                 # bytes per row

    def share(r):  # (request, local index, global position) of rank r's context rows
        qs, li, gp = [], [], []
        for q, n in zip(reqs.tolist(), counts[r].tolist()):
            qs.append(torch.full((n,), q, dtype=torch.int64))
            li.append(torch.arange(n, dtype=torch.int64))
            gp.append(global_positions(r, n, world, interleave))
        cat = lambda xs: torch.cat(xs).to(pool.device) if xs else torch.empty(0, dtype=torch.int64)  # noqa: E731
        return cat(qs), cat(li), cat(gp)

    q_own, li_own, _ = share(rank)
    rows = cache_rows(block_table, block_size, q_own, li_own)
    mine = read_rows(pool, rows, block_size, row_rank).contiguous().view(torch.uint8).reshape(len(rows), width)
    pad = max(sizes) if sizes else 0
    send = torch.zeros((pad, width), dtype=torch.uint8, device=pool.device)
    send[:len(rows)] = mine
    recv = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(recv, send, group=group)
    n_ws = ws_table.shape[0] * ws_table.shape[1] * block_size
    ws = pool.new_zeros((n_ws, *row_shape))
    flat = ws.view(n_ws, -1).view(torch.uint8).view(n_ws, width)
    for r in range(world):
        q_r, _, gp_r = share(r)
        dest = cache_rows(ws_table, block_size, q_r, gp_r)
        flat[dest] = recv[r][:sizes[r]]
    return ws
