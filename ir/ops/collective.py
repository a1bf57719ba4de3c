"""Collective and parallel-layout ops (issue 8): what the sharding passes insert.

Every reference runs torch.distributed on a *named* group ("tp", "ep", "dcp", ...) registered with
`set_group(name, group)`; an unregistered name means the default (WORLD) group. When torch.distributed
is not initialised, or the group has one rank, every op is the single-process identity (all_gather of
one shard is the shard, the token shard of one rank is every token), so a sharded module still runs in
one process when it was sharded with `world=1`; a module sharded for W ranks refuses to run on a group
of another size (the error names the group).

The attribute `world` is the group size the pass sharded for; it fixes the result shapes statically
(the reference checks it against the live group). Costs: `bytes` is the payload one rank puts on the
link (ring all-reduce 2·(W−1)/W·|x|, all-gather and all-to-all (W−1)/W of what the rank holds); flops 0
except the reduction's adds.

Ops
- all_reduce(x) {group, world}            y = Σ_ranks x
- all_gather(x) {axis, group, world}      y = concat_ranks(x) along axis (rank order)
- token_shard_rows(cu_seqlens, like) {group, world}
      rows i64[B/W]: this rank's token rows under causal balance (request i's chunk of n_i tokens is cut
      into 2·W pieces at (j·n_i)//(2·W); rank r takes pieces r and 2·W−1−r; k31c/parallel/token_shard.py).
      Precondition checked at run time: every n_i is a multiple of 2·W (so each rank holds exactly B/W rows).
- take_rows(x, rows)                       y = x[rows]
- heads_to_tokens(x, cu_seqlens) {group, world}
      x [B, H/W, ...] (all tokens, this rank's heads) → [B/W, H, ...] (this rank's tokens, all heads)
- tokens_to_heads(y, cu_seqlens) {group, world}   the inverse: [B/W, H, ...] → [B, H/W, ...]
- ep_local_routing(weights, ids) {experts_per_rank, group, world}
      (weights_local f32[T,k], ids_local i64[T,k]): expert e lives on rank e // experts_per_rank as local
      expert e % experts_per_rank; entries routed elsewhere get weight 0 and local id 0, so
      moe_experts(z, weights_local, ids_local, local experts) is this rank's partial latent sum.
DCP pools are flat [N, *row] or block views [NB, block_size, *row]; block_table is the rank's *local* table
(under DCP it covers only the positions the rank stores).
- dcp_cache_write(pool, values, token_req, token_pos, block_table) {block_size, interleave, group, world}
      in place: store only this rank's positions ((p // interleave) % world == rank) at their local position
- dcp_mla(q_nope, q_pe, latent, kv_b, iq, iq_scale, iw, keys, key_scale, token_pos, token_req, block_table)
      {block_size, interleave, group, world, scale, topk, key_format, latent_format} -> this rank's heads
      [T, H/W, dv]: local indexer scores, exact one-round global top-k merge, partial attention of the
      group's heads, LSE combine
- dcp_mla_dense(q_nope, q_pe, latent, kv_b, token_pos, token_req, block_table) {block_size, interleave, group,
      world, scale, latent_format} -> [T, H/W, dv]: K3 dense MLA over a DCP group (every own causal
      position, LSE combine)
- dcp_workspace_table(block_table) {world} -> i32[R, MB*W]: the T5 workspace's table (q*MB*W + j)
- dcp_gather_context(pool, token_pos, token_req, block_table, ws_table) {block_size, interleave, row_rank,
      group, world} -> flat [R*MB*W*bs, *row]: merge-free DCP prefill, the step's whole context at
      ws_table's rows
The DCP math lives in k31c/parallel/dcp_attention.py (see its docstring).
"""

from __future__ import annotations

import sympy
import torch
import torch.distributed as dist

from ..core import TensorType
from ..dtypes import f32, i64
from ..shapes import shapes_equal
from .attention import CONTEXT, pool_fits, pool_row_shape
from .basic import expect
from .registry import attr, defop

_GROUPS: dict[str, object] = {}


def set_group(name: str, group) -> None:
    """Register the process group the ops with `group=name` run on (None: the default group)."""
    _GROUPS[name] = group


def clear_groups() -> None:
    _GROUPS.clear()


def get_group(name: str):
    return _GROUPS.get(name)


def group_rank_size(name: str) -> tuple[int, int]:
    """(rank, size) in the named group; (0, 1) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    g = get_group(name)
    return dist.get_rank(g), dist.get_world_size(g)


def _live(name: str, world: int, op: str) -> tuple[int, int]:
    rank, size = group_rank_size(name)
    if size != world:
        raise RuntimeError(f"{op}: module was sharded for {name} world={world}, but the live group "
                           f"{name!r} has {size} ranks")
    return rank, size


def _comm_dtype(t: torch.Tensor) -> torch.dtype:
    """gloo reduces only fp32/fp64 among the floats: 16-bit floats travel as fp32 there."""
    if t.is_floating_point() and t.element_size() < 4 and dist.get_backend() == "gloo":
        return torch.float32
    return t.dtype


_COMM = {"group": attr(str, default="tp"), "world": attr(int)}


# ---- all_reduce / all_gather --------------------------------------------------------------------------
def _all_reduce_ref(a, at):
    _, size = _live(at["group"], at["world"], "all_reduce")
    if size == 1:
        return a.x
    y = a.x.to(_comm_dtype(a.x)).contiguous().clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=get_group(at["group"]))
    return y.to(a.x.dtype)


defop("all_reduce", ["x"], ["y"], lambda a, at: [a.x], _all_reduce_ref, attrs=dict(_COMM),
      flops=lambda a, o, at: a.x.numel() * (at["world"] - 1),
      bytes=lambda a, o, at: 2 * a.x.nbytes() * sympy.Rational(at["world"] - 1, at["world"]),
      doc="y = sum over the group's ranks of x (row-parallel projections under TP, EP partial sums)")


def _all_gather_infer(a, at):
    ax = at["axis"] % a.x.rank
    shape = list(a.x.shape)
    shape[ax] = shape[ax] * at["world"]
    return [a.x.with_shape(shape)]


def _all_gather_ref(a, at):
    _, size = _live(at["group"], at["world"], "all_gather")
    if size == 1:
        return a.x
    x = a.x.to(_comm_dtype(a.x)).contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=get_group(at["group"]))
    return torch.cat(parts, dim=at["axis"]).to(a.x.dtype)


defop("all_gather", ["x"], ["y"], _all_gather_infer, _all_gather_ref,
      attrs={"axis": attr(int), **_COMM},
      bytes=lambda a, o, at: a.x.nbytes() * (at["world"] - 1),
      doc="y = concat over the group's ranks (rank order) of x along axis (column-parallel outputs)")


# ---- token-sharded layout (T3) -------------------------------------------------------------------------
def _seq_lens(cu: torch.Tensor) -> list[int]:
    return (cu[1:] - cu[:-1]).tolist()


def shard_rows(cu_seqlens: torch.Tensor, rank: int, world: int) -> list[torch.Tensor]:
    """Per rank, its causal-balanced token rows; checks the multiple-of-2·W precondition."""
    from k31c.parallel.token_shard import causal_balance_indices  # the layout lives with the collectives

    lens = _seq_lens(cu_seqlens)
    bad = [n for n in lens if n % (2 * world)]
    if bad:
        raise ValueError(f"token-sharded prefill over {world} ranks needs every request's chunk to be a "
                         f"multiple of 2·{world} = {2 * world} tokens, found chunk lengths {lens}; run this "
                         f"step head-sharded (k31c.parallel.prefill_choice.choose_prefill_function)")
    return [i.to(cu_seqlens.device) for i in causal_balance_indices(lens, world)]


def _shard_rows_infer(a, at):
    expect(a.cu_seqlens.dtype == i64 and a.like.rank >= 1, "token_shard_rows: cu_seqlens i64[R+1], like [B, ...]")
    return [TensorType(i64, (a.like.shape[0] / at["world"],))]


def _shard_rows_ref(a, at):
    rank, size = _live(at["group"], at["world"], "token_shard_rows")
    return shard_rows(a.cu_seqlens, rank, size)[rank]


defop("token_shard_rows", ["cu_seqlens", "like"], ["rows"], _shard_rows_infer, _shard_rows_ref, attrs=dict(_COMM),
      bytes=lambda a, o, at: o[0].nbytes(),
      doc="this rank's token rows under causal balance (pieces r and 2W-1-r of every request)")


def _take_rows_infer(a, at):
    expect(a.rows.dtype == i64 and a.rows.rank == 1, f"take_rows: rows {a.rows} must be i64[n]")
    return [a.x.with_shape((a.rows.shape[0], *a.x.shape[1:]))]


defop("take_rows", ["x", "rows"], ["y"], _take_rows_infer, lambda a, at: a.x[a.rows],
      doc="y = x[rows] (gather along the leading axis)")


def _h2t_infer(a, at):
    expect(a.x.rank >= 2, f"heads_to_tokens: x {a.x} must be [B, H/W, ...]")
    w = at["world"]
    return [a.x.with_shape((a.x.shape[0] / w, a.x.shape[1] * w, *a.x.shape[2:]))]


def _h2t_ref(a, at):
    from k31c.parallel.token_shard import heads_to_tokens

    rank, size = _live(at["group"], at["world"], "heads_to_tokens")
    shard_rows(a.cu_seqlens, rank, size)  # precondition check with a clear message
    if size == 1:
        return a.x
    return heads_to_tokens(a.x.contiguous(), _seq_lens(a.cu_seqlens), group=get_group(at["group"]))


def _t2h_infer(a, at):
    w = at["world"]
    expect(a.y.rank >= 2 and (not a.y.shape[1].is_number or int(a.y.shape[1]) % w == 0),
           f"tokens_to_heads: y {a.y} must be [B/W, H, ...] with H divisible by {w}")
    return [a.y.with_shape((a.y.shape[0] * w, a.y.shape[1] / w, *a.y.shape[2:]))]


def _t2h_ref(a, at):
    from k31c.parallel.token_shard import tokens_to_heads

    rank, size = _live(at["group"], at["world"], "tokens_to_heads")
    shard_rows(a.cu_seqlens, rank, size)
    if size == 1:
        return a.y
    return tokens_to_heads(a.y.contiguous(), _seq_lens(a.cu_seqlens), group=get_group(at["group"]))


_A2A_BYTES = lambda a, o, at: o[0].nbytes() * sympy.Rational(at["world"] - 1, at["world"])  # noqa: E731
defop("heads_to_tokens", ["x", "cu_seqlens"], ["y"], _h2t_infer, _h2t_ref, attrs=dict(_COMM), bytes=_A2A_BYTES,
      doc="all-to-all: [B, H/W, ...] (all tokens, own heads) -> [B/W, H, ...] (own tokens, all heads)")
defop("tokens_to_heads", ["y", "cu_seqlens"], ["x"], _t2h_infer, _t2h_ref, attrs=dict(_COMM), bytes=_A2A_BYTES,
      doc="all-to-all: [B/W, H, ...] (own tokens, all heads) -> [B, H/W, ...] (all tokens, own heads)")


# ---- expert parallelism ---------------------------------------------------------------------------------
def _ep_infer(a, at):
    expect(shapes_equal(a.weights.shape, a.ids.shape) and a.ids.dtype == i64,
           f"ep_local_routing: weights {a.weights} / ids {a.ids} must match, ids i64")
    expect(at["experts_per_rank"] > 0, "ep_local_routing: experts_per_rank must be positive")
    return [TensorType(f32, a.weights.shape), a.ids]


def _ep_ref(a, at):
    rank, size = _live(at["group"], at["world"], "ep_local_routing")
    n = at["experts_per_rank"]
    mine = (a.ids // n) == rank
    return torch.where(mine, a.weights, torch.zeros_like(a.weights)), torch.where(mine, a.ids - rank * n, 0)


defop("ep_local_routing", ["weights", "ids"], ["weights_local", "ids_local"], _ep_infer, _ep_ref,
      attrs={"experts_per_rank": attr(int), **_COMM},
      doc="keep the routing entries whose expert lives on this rank (ids made local), zero the rest")


# ---- DCP (T4): interleaved context shards, exact top-k merge, LSE combine ------------------------------------
_DCP = {"block_size": attr(int), "interleave": attr(int, default=1), **_COMM}
_ATTENTION = {"latent_format": attr(str, default="plain"), "form": attr(str, default="absorbed")}


# The DCP references take `static=True` under CUDA-graph capture (k31c/parallel/dcp_graph.py: no host read of
# device data, widths from the block table); the results are the same.
def _dcp_write_ref(a, at, static: bool = False):
    from k31c.parallel.dcp_attention import dcp_cache_write
    from k31c.parallel.dcp_graph import dcp_cache_write_static

    rank, size = _live(at["group"], at["world"], "dcp_cache_write")
    return (dcp_cache_write_static if static else dcp_cache_write)(a.pool, a.values, a.token_req, a.token_pos, a.block_table, block_size=at["block_size"],
                           interleave=at["interleave"], rank=rank, world=size)


def _dcp_write_infer(a, at):
    expect(a.values.rank >= 1 and pool_fits(a.pool, a.values.shape[1:], at["block_size"]),
           f"dcp_cache_write: values {a.values} do not fit pool rows {a.pool} (flat [N, *row] or [NB, bs, *row])")
    expect(at["interleave"] >= 1, "dcp_cache_write: interleave must be >= 1")
    return [a.pool]


defop("dcp_cache_write", ["pool", "values", "token_req", "token_pos", "block_table"], ["pool_out"],
      _dcp_write_infer, _dcp_write_ref, inplace={0: "pool"}, attrs=dict(_DCP),
      bytes=lambda a, o, at: 2 * a.values.nbytes() / at["world"] + 3 * a.token_pos.nbytes(),
      doc="store the tokens this rank owns ((p // interleave) % world == rank) at local position "
          "(p // (world*interleave))*interleave + p % interleave of their request (paged rows)")


def _dcp_attention_type(a, at, op: str) -> TensorType:
    """[T, H/W, dv] of dcp_mla / dcp_mla_dense (form "absorbed"), or o~ [T, H/W, kv] before W_UV (form
    "latent", the value_gate fusion's input), checking kv_b and the latent pool (flat or block view, plain
    [.., kv+dr] or NVFP4 u8 [.., kv/2+kv/16+dr])."""
    t, hl, dn = a.q_nope.shape
    kv, dr = sympy.sympify(a.kv_b.shape[1]), a.q_pe.shape[2]
    dv = sympy.simplify(a.kv_b.shape[0] / hl - dn)
    expect(dv.is_integer and dv > 0, f"{op}: kv_b {a.kv_b} is not [H/W*(dn+dv), kv] for {hl} local heads")
    expect(at["latent_format"] in ("plain", "nvfp4"), f"{op}: latent_format must be plain|nvfp4")
    row = (kv / 2 + kv / 16 + dr,) if at["latent_format"] == "nvfp4" else (kv + dr,)
    expect(pool_fits(a.latent, row, at["block_size"]), f"{op}: latent pool {a.latent} must hold rows {list(row)}")
    expect(at["form"] in ("absorbed", "latent"), f"{op}: form must be absorbed|latent, found {at['form']!r}")
    return TensorType(a.q_nope.dtype, (t, hl, kv if at["form"] == "latent" else dv))


def _dcp_mla_infer(a, at):
    t = a.q_nope.shape[0]
    expect(shapes_equal(a.iq.shape[:1], (t,)) and shapes_equal(a.iw.shape, a.iq.shape[:2]),
           f"dcp_mla: indexer q {a.iq} / w {a.iw} do not match {t} tokens")
    expect(at["topk"] > 0, "dcp_mla: topk must be positive")
    expect(at["key_format"] in ("fp8", "mxfp4"), f"dcp_mla: key_format must be fp8|mxfp4, found {at['key_format']!r}")
    return [_dcp_attention_type(a, at, "dcp_mla")]


def _dcp_mla_ref(a, at, static: bool = False):
    from k31c.parallel.dcp_attention import dcp_mla

    _live(at["group"], at["world"], "dcp_mla")
    return dcp_mla(a.q_nope, a.q_pe, a.latent, a.kv_b, a.iq, a.iq_scale, a.iw, a.keys, a.key_scale, a.token_pos,
                   a.token_req, a.block_table, block_size=at["block_size"], scale=at["scale"], topk=at["topk"],
                   interleave=at["interleave"], group=get_group(at["group"]), key_format=at["key_format"],
                   latent_format=at["latent_format"], form=at["form"], static=static)


def _dcp_mla_bytes(a, o, at):
    t, hl, _ = a.q_nope.shape
    w, k = at["world"], at["topk"]
    width = a.latent.shape[-1]
    gather = t * hl * (a.kv_b.shape[1] + a.q_pe.shape[2]) * 4 * (w - 1)  # absorbed queries, all-gathered
    merge = t * w * sympy.ceiling(sympy.Rational(3, 2) * k / w) * 4  # round 1 of the exact top-k
    combine = 2 * t * hl * w * (a.kv_b.shape[1] + 1) * 4        # LSE combine all-reduce
    latent = t * k * width * a.latent.dtype.bits / 8 / w        # own share of the selected latents
    return gather + merge + combine + latent


defop("dcp_mla", ["q_nope", "q_pe", "latent", "kv_b", "iq", "iq_scale", "iw", "keys", "key_scale", "token_pos",
                  "token_req", "block_table"], ["o"], _dcp_mla_infer, _dcp_mla_ref,
      attrs={**_DCP, **_ATTENTION, "scale": attr(float), "topk": attr(int), "key_format": attr(str, default="fp8")},
      bytes=_dcp_mla_bytes,
      doc="indexer top-k + sparse MLA over a DCP group: local scores, exact one-round global top-k "
          "(k31c.parallel.dcp_topk), partial attention of all heads over own selected tokens, LSE combine; "
          "returns this rank's heads [T, H/W, dv]")


def _dense_infer(a, at):
    return [_dcp_attention_type(a, at, "dcp_mla_dense")]


def _dense_ref(a, at, static: bool = False):
    from k31c.parallel.dcp_attention import dcp_mla_dense

    _live(at["group"], at["world"], "dcp_mla_dense")
    return dcp_mla_dense(a.q_nope, a.q_pe, a.latent, a.kv_b, a.token_pos, a.token_req, a.block_table,
                         block_size=at["block_size"], scale=at["scale"], interleave=at["interleave"],
                         group=get_group(at["group"]), latent_format=at["latent_format"], form=at["form"],
                         static=static)


def _dense_bytes(a, o, at):
    t, hl, _ = a.q_nope.shape
    w, width = at["world"], a.latent.shape[-1]
    gather = t * hl * (a.kv_b.shape[1] + a.q_pe.shape[2]) * 4 * (w - 1)
    combine = 2 * t * hl * w * (a.kv_b.shape[1] + 1) * 4
    return gather + combine + t * CONTEXT * width * a.latent.dtype.bits / 8 / w


defop("dcp_mla_dense", ["q_nope", "q_pe", "latent", "kv_b", "token_pos", "token_req", "block_table"], ["o"],
      _dense_infer, _dense_ref, attrs={**_DCP, **_ATTENTION, "scale": attr(float)}, bytes=_dense_bytes,
      doc="dense MLA (K3, no indexer) over a DCP group: partial attention of all heads over every causal "
          "context position this rank stores, LSE combine; returns this rank's heads [T, H/W, dv]")


def _ws_table_infer(a, at):
    expect(a.block_table.rank == 2 and a.block_table.dtype.kind == "int",
           f"dcp_workspace_table: block_table {a.block_table} must be an integer [R, MB] table")
    r, mb = a.block_table.shape
    return [TensorType(a.block_table.dtype, (r, mb * at["world"]))]


def _ws_table_ref(a, at):
    from k31c.parallel.dcp_attention import dcp_workspace_table

    return dcp_workspace_table(a.block_table, at["world"])


defop("dcp_workspace_table", ["block_table"], ["ws_table"], _ws_table_infer, _ws_table_ref,
      attrs={"world": attr(int)}, bytes=lambda a, o, at: o[0].nbytes(),
      doc="merge-free DCP prefill: the gathered-context workspace's block table, ws_table[q, j] = q*MB*W + j "
          "(request q's global positions at rows q*MB*W*bs + p), so a rank's own table stays local")


def _gather_ctx_infer(a, at):
    r, mbw = a.ws_table.shape
    row = pool_row_shape(a.pool, at["row_rank"])
    expect(pool_fits(a.pool, row, at["block_size"]),
           f"dcp_gather_context: pool {a.pool} is not [N, *row] or [NB, {at['block_size']}, *row] with rows of "
           f"{at['row_rank']} dims")
    return [a.pool.with_shape((r * mbw * at["block_size"], *row))]


def _gather_ctx_ref(a, at):
    from k31c.parallel.dcp_attention import dcp_gather_context

    _live(at["group"], at["world"], "dcp_gather_context")
    return dcp_gather_context(a.pool, a.token_pos, a.token_req, a.block_table, a.ws_table,
                              block_size=at["block_size"], interleave=at["interleave"], row_rank=at["row_rank"],
                              group=get_group(at["group"]))


defop("dcp_gather_context", ["pool", "token_pos", "token_req", "block_table", "ws_table"], ["workspace"],
      _gather_ctx_infer, _gather_ctx_ref, attrs={**_DCP, "row_rank": attr(int, default=1)},
      bytes=lambda a, o, at: o[0].nbytes() * sympy.Rational(at["world"] - 1, at["world"]),
      doc="merge-free DCP prefill (T5): a workspace holding every context position of the step's requests at "
          "its ws_table row, all-gathered from the interleaved owners' local rows (bytes exact)")
