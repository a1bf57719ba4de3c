"""Decode traffic per step: cache bytes one request's decode token reads, dense MLA vs DSA (T2).

Per full-attention layer and decode token at context L (SPEC §4–5, formats of SPEC §7):
- dense MLA (K3) reads every latent:          L · latent_B
- DSA (K3.1 Pro) scans every index key and gathers the selected latents:
                                               L · key_B + min(L, top-k) · latent_B
so DSA / dense → key_B / latent_B as L grows (132 / 576 = 22.9% with FP8 latents and FP8 keys).
Under DCP W each rank scans L/W keys and gathers about min(L, k)/W latents. Each KDA layer reads and
writes its state once per step (2 · state bytes per request), independent of L.

`ir_context_bytes_per_token(cfg)` derives the per-context-token read bytes from the IR's own op costs
(`mla_attention` / `indexer_topk` `bytes` as sympy in the context symbol L) for the FP8 formats the
IR types express; tests check that they agree with the format table used here.
"""

from __future__ import annotations

import sympy

from ir.core import TensorType
from ir.ops import get_op  # importing ir.ops registers every op
from ir.shapes import sym

from .memory import _ceil_div, cache_bytes, kda_state_bytes, latent_bytes_per_token


def default_contexts(cfg, max_context: int) -> list[int]:
    """top-k, 4·top-k, 16·top-k, ... up to the longest context (K3: 2K, 8K, ... 512K, 1M)."""
    start = cfg.index_topk if cfg.has_indexer else 2048
    out, c = [], start
    while c < max_context:
        out.append(c)
        c *= 4
    return out + [max_context]


def decode_traffic(opts, contexts: list[int] | None = None) -> dict:
    cfg = opts.cfg
    cb = cache_bytes(cfg, opts.latent_cache, opts.key_cache)
    lat, key, n = cb["latent_per_layer"], cb["index_key_per_layer"], cb["full_attention_layers"]
    dense_lat = latent_bytes_per_token(cfg, opts.latent_cache)
    state = kda_state_bytes(cfg, opts.tp, opts.kda_state)
    rows = []
    for ctx in contexts or default_contexts(cfg, opts.max_context):
        dense = n * ctx * dense_lat
        row = {"context": ctx, "dense_mla_bytes": dense}
        if cfg.has_indexer:
            sel = min(ctx, cfg.index_topk)
            dsa = n * (ctx * key + sel * lat)
            row.update(dsa_bytes=dsa, dsa_index_key_bytes=n * ctx * key, dsa_latent_bytes=n * sel * lat,
                       dsa_over_dense=dsa / dense,
                       dsa_bytes_per_rank=n * (_ceil_div(ctx, opts.dcp) * key + _ceil_div(sel, opts.dcp) * lat))
        rows.append(row)
    out = {"per_request_per_step": rows, "full_attention_layers": n,
           "latent_bytes_per_token_per_layer": lat, "index_key_bytes_per_token_per_layer": key,
           "kda_state_bytes_per_step": 2 * state["per_request"],
           "kda_state_bytes_per_step_per_rank": 2 * state["per_request_per_rank"]}
    if cfg.has_indexer:
        out["dsa_over_dense_limit"] = key / lat
        out["dsa_over_dense_limit_text"] = f"{key}/{lat}"
    return out


def ir_context_bytes_per_token(cfg) -> dict:
    """Bytes one decode token reads per context token, from the IR op costs (FP8 latent, FP8 keys)."""
    L, N, R = sym("L"), sym("N"), sym("R")
    h, dn, dr, dv, kv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                         cfg.kv_lora_rank)
    i64 = lambda *d: TensorType.of("i64", d)  # noqa: E731
    table = TensorType.of("i32", (R, sym("MB")))
    mla = [TensorType.of("bf16", (1, h, dn)), TensorType.of("bf16", (1, h, dr)),
           TensorType.of("f8e4m3", (N, kv + dr)), TensorType.of("bf16", (h * (dn + dv), kv)), i64(1), i64(1), table]
    op = get_op("mla_attention")
    attrs = {"scale": 1.0, "form": "absorbed", "block_size": 64}
    outs = op.infer(op.bind(mla), op.full_attrs(attrs))
    _, mla_bytes = op.cost(mla, outs, attrs)
    out = {"mla_attention_dense": int(sympy.diff(mla_bytes, L))}
    if cfg.has_indexer:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        ix = [TensorType.of("f8e4m3", (1, hi, di)), TensorType.of("f32", (1, hi)), TensorType.of("f32", (1, hi)),
              TensorType.of("f8e4m3", (N, di)), TensorType.of("f32", (N,)), i64(1), i64(1), table]
        op = get_op("indexer_topk")
        attrs = {"topk": cfg.index_topk, "block_size": 64}
        outs = op.infer(op.bind(ix), op.full_attrs(attrs))
        _, ix_bytes = op.cost(ix, outs, attrs)
        out["indexer_topk"] = int(sympy.diff(ix_bytes, L))
    return out
