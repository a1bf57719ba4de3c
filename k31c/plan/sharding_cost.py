"""Cost model: head- vs token-sharded attention for a prefill step under TP (DESIGN §5 T3, issue 8).

For one MLA layer and a prefill chunk of T new tokens after C cached ones (token t attends
L_t = C + t + 1 positions, the indexer selects K_t = min(L_t, top-k) of them), with W = TP ranks:

- head sharding: every rank runs the replicated indexer for all T tokens (the DSA indexer and the
  latent cache are replicated under plain TP) and sparse MLA for T tokens × H/W heads, gathering the
  selected latents of all T tokens;
- token sharding: an all-to-all turns (T tokens, H/W heads) into (T/W tokens, H heads) — causal
  balance by 2·W chunks makes the split even — each rank runs the indexer and MLA for its T/W tokens,
  and a second all-to-all returns the outputs to head layout.

FLOPs come from the IR's op costs (`indexer_topk`, `mla_attention` and the indexer's `linear`
projections, evaluated at the step's mean context and mean selection). Bytes: the indexer reads the
context's index keys once per query tile of `INDEXER_QUERY_TILE` tokens (a fused scorer shares them
across the tile); sparse MLA gathers K_t latents per token (no reuse); dense MLA (K3) reads the
context once per query tile. Weights (the indexer's projections) are read equally under both layouts
and are left out of the comparison. Time per op group = max(FLOPs / rate, bytes / bandwidth) with the
target's figures (measured where known); an all-to-all costs its bytes over the link bandwidth plus
`ALL_TO_ALL_LATENCY_S`. The crossover is the smallest T at which token sharding is faster.
"""

from __future__ import annotations

import sympy

from ir.core import TensorType
from ir.ops import get_op  # importing ir.ops registers every op
from ir.shapes import sym

from .memory import cache_bytes

INDEXER_QUERY_TILE = 64  # query tokens per tile of the fused scorer: index keys are read once per tile
ALL_TO_ALL_LATENCY_S = 20e-6  # estimate: one NCCL all-to-all inside a scale-up domain, launch + sync
PREFILL_SIZES = (64, 256, 1024, 4096, 16384, 65536)


def _ir_flops(op_name: str, in_types: list, attrs: dict, env: dict) -> float:
    op = get_op(op_name)
    outs = op.infer(op.bind(in_types), op.full_attrs(attrs))
    fl, _ = op.cost(in_types, outs, attrs)
    return float(sympy.sympify(fl).subs({sym(k): v for k, v in env.items()}))


def _context_sums(t: int, c: int, topk: int) -> tuple[float, float]:
    """Σ_t L_t and Σ_t min(L_t, topk) over the chunk (L_t = c + t + 1)."""
    sum_l = t * c + t * (t + 1) / 2
    if topk <= 0:
        return sum_l, sum_l
    below = max(0, min(t, topk - c))  # tokens whose whole context is selected
    sum_k = below * c + below * (below + 1) / 2 + (t - below) * topk
    return sum_l, sum_k


def _tile_reads(t: int, c: int) -> float:
    """Context positions read when each query tile reads the context up to its last token."""
    tiles = -(-t // INDEXER_QUERY_TILE)
    return sum(c + min(t, (j + 1) * INDEXER_QUERY_TILE) for j in range(tiles))


def attention_step_cost(opts, tokens: int, heads: int, context: int = 0) -> dict:
    """FLOPs and bytes of one MLA layer's indexer + attention for `tokens` query tokens of a prefill
    chunk after `context` cached tokens, `heads` attention heads (on one rank)."""
    cfg = opts.cfg
    t = max(1, tokens)
    sum_l, sum_k = _context_sums(t, context, cfg.index_topk if cfg.has_indexer else 0)
    env = {"L": sum_l / t, "K": sum_k / t, "N": context + t, "R": 1}
    dn, dr, dv, kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    cb = cache_bytes(cfg, opts.latent_cache, opts.key_cache)
    i64 = lambda *d: TensorType.of("i64", d)  # noqa: E731
    mla_in = [TensorType.of("bf16", (t, heads, dn)), TensorType.of("bf16", (t, heads, dr)),
              TensorType.of("bf16", ("N", kv + dr)), TensorType.of("bf16", (heads * (dn + dv), kv)),
              i64(t), i64(t), TensorType.of("i32", ("R", "MB"))]
    if cfg.has_indexer:
        mla_in.append(i64(t, "K"))
    mla_flops = _ir_flops("mla_attention", mla_in, {"scale": 1.0, "form": "absorbed", "block_size": opts.block_size}, env)
    act = t * heads * (dn + dr + dv) * 2
    if cfg.has_indexer:
        mla_bytes = sum_k * cb["latent_per_layer"] + act
    else:
        mla_bytes = _tile_reads(t, context) * cb["latent_per_layer"] + act
    out = {"mla_flops": mla_flops, "mla_bytes": mla_bytes, "indexer_flops": 0.0, "indexer_bytes": 0.0}
    if cfg.has_indexer:
        hi, di, d, q = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size, cfg.q_lora_rank
        ix_in = [TensorType.of("f8e4m3", (t, hi, di)), TensorType.of("f32", (t, hi)), TensorType.of("f32", (t, hi)),
                 TensorType.of("f8e4m3", ("N", di)), TensorType.of("f32", ("N",)), i64(t), i64(t),
                 TensorType.of("i32", ("R", "MB"))]
        fl = _ir_flops("indexer_topk", ix_in, {"topk": cfg.index_topk, "block_size": opts.block_size}, env)
        for w_shape, x_dim in (((hi * di, q), q), ((di, d), d), ((hi, d), d)):  # wq_b, wk, weights_proj
            fl += _ir_flops("linear", [TensorType.of("bf16", (t, x_dim)), TensorType.of("bf16", w_shape)], {}, env)
        out["indexer_flops"] = fl
        out["indexer_bytes"] = (_tile_reads(t, context) * cb["index_key_per_layer"]
                                + t * (hi * (di + 8) + cfg.index_topk * 8))
    return out


def _roof(flops: float, nbytes: float, rate: float, bw: float) -> float:
    return max(flops / rate, nbytes / bw)


def step_times(opts, tokens: int, context: int = 0) -> dict:
    """Seconds, FLOPs and bytes per prefill step (all MLA layers, one rank) for head and token sharding."""
    cfg, tgt, w = opts.cfg, opts.target, opts.tp
    n = len(cfg.full_attn_layers)
    h = cfg.num_attention_heads
    bw, r_mla, r_ix = tgt.bandwidth, tgt.rate("bf16"), tgt.rate("fp8")
    full = attention_step_cost(opts, tokens, h // w, context)  # all tokens, H/W heads
    ix, mla = (full["indexer_flops"], full["indexer_bytes"]), (full["mla_flops"], full["mla_bytes"])
    head = _roof(*ix, r_ix, bw) + _roof(*mla, r_mla, bw)
    # token sharding: 1/W of everything (balanced causal chunks), H heads on T/W tokens = same MLA FLOPs
    tok_ix, tok_mla = (ix[0] / w, ix[1] / w), (mla[0], mla[1] / w)
    tok = _roof(*tok_ix, r_ix, bw) + _roof(*tok_mla, r_mla, bw)
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    a2a_bytes = tokens * (h // w) * (dn + dr + dv) * 2 * (w - 1) / w  # q there, o back (bf16)
    comm = a2a_bytes / tgt.link_bandwidth + 2 * ALL_TO_ALL_LATENCY_S
    return {"tokens": tokens, "head_s": n * head, "token_s": n * (tok + comm), "all_to_all_bytes": n * a2a_bytes,
            "head_flops": n * (ix[0] + mla[0]), "head_bytes": n * (ix[1] + mla[1]),
            "token_flops": n * (tok_ix[0] + tok_mla[0]), "token_bytes": n * (tok_ix[1] + tok_mla[1])}


def prefill_sharding(opts, sizes=PREFILL_SIZES, context: int = 0) -> dict:
    """Choice per prefill size and the crossover (smallest T where token sharding wins)."""
    base = {"tp": opts.tp, "context_before_chunk": context, "all_to_all_latency_s": ALL_TO_ALL_LATENCY_S,
            "indexer_query_tile": INDEXER_QUERY_TILE}
    if opts.tp == 1:
        return {**base, "rows": [], "crossover_tokens": None, "note": "TP = 1: one rank holds every head; no choice"}
    if opts.cfg.num_attention_heads % opts.tp:
        return {**base, "rows": [], "crossover_tokens": None, "note": "TP does not divide the MLA heads"}
    limit = max(1, opts.max_context - context)
    rows = []
    for t in [s for s in sizes if s <= limit]:
        st = step_times(opts, t, context)
        rows.append({"tokens": t, "head_ms": st["head_s"] * 1e3, "token_ms": st["token_s"] * 1e3,
                     "choice": "token" if st["token_s"] < st["head_s"] else "head",
                     **{k: st[k] for k in ("all_to_all_bytes", "head_flops", "head_bytes", "token_flops",
                                           "token_bytes")}})
    return {**base, "rows": rows, "crossover_tokens": crossover(opts, limit, context)}


def crossover(opts, limit: int, context: int = 0) -> int | None:
    def wins(t: int) -> bool:
        st = step_times(opts, t, context)
        return st["token_s"] < st["head_s"]

    lo, hi = 0, 1
    while hi <= limit and not wins(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return limit if wins(limit) else None
    while hi - lo > 1:  # invariant: head wins at lo (or lo = 0), token wins at hi
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi
