"""Per-rank memory plan: weights by format, cache bytes per token, KDA state, activations, workspaces,
reserves, free memory for the cache and the capacity it buys (SPEC §7, DESIGN §5 T1/T4/T7).

Weights (from `param_specs`, no checkpoint needed): a param of n elements stores bf16 2n B, f32 4n B,
MXFP4 n/2 + n/32 B (E2M1 codes + one E8M0 scale per 32). Per rank: `col`/`row`/`heads` params / TP,
`expert` params / EP, `rep` params whole.

Cache per token and full-attention layer (SPEC §7): latent c = [c_KV (kv_lora); k_pe (rope)]
- bf16: 2·(kv+rope) = 1152 B; fp8: kv+rope = 576 B (per-layer scale held outside the token);
- nvfp4: kv/2 (E2M1) + kv/16 (E4M3 scale per 16) + rope (k_pe in FP8) = 256 + 32 + 64 = 352 B;
index key (K3.1 Pro): fp8 D_I + 4 (fp32 scale) = 132 B; mxfp4 D_I/2 + D_I/32 (E8M0 scales) = 68 B.
Over the 24 full-attention layers: 24·576 = 13,824 (K3), 24·708 = 16,992, 24·420 = 10,080.
Under DCP W each rank stores every W-th token: bytes per token per rank = per-token bytes / W.

KDA state per request and KDA layer: H·D·D state (fp32, or bf16 with --kda-state bf16) + conv tail
(K−1)·3P fp32; under TP each rank holds H/TP heads.

free = memory − weights − activations − workspaces − reserves; a stored token costs
`cache_per_token` on the rank that holds it; tokens = ⌊(free − max_requests·state)/cache_per_token⌋
rounded down to whole blocks, times DCP; contexts = ⌊free / (⌈C/DCP⌉·cache_per_token + state)⌋.
"""

from __future__ import annotations

import math

from ..model.config import ModelConfig
from ..model.params import param_specs

GiB = 2**30

# ---- reserves (per rank; assumptions, stated) ----------------------------------------------------
RUNTIME_RESERVE_BYTES = 2 * GiB  # CUDA/HIP context, cuBLAS + Triton module images, CUDA-graph pools
COMM_RESERVE_BYTES = 1 * GiB  # NCCL/RCCL communicators and channel buffers when the instance has > 1 rank
FRAGMENTATION_FRACTION = 0.03  # caching-allocator slack kept free, as a fraction of device memory
ROUTING_IMBALANCE = 2.0  # an EP rank may receive up to 2x its even share of routed tokens in one step
INDEXER_SCORE_TILE_ROWS = 64  # query rows whose full score row (fp32 over the context) the top-k holds at once
ACT_BYTES = 2  # activations are stored in bf16 between ops (BuildOptions.act_dtype)
VERIFY_TOKENS = 8  # speculative verification: up to 8 tokens per request per step (T9)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def param_bytes(numel: int, fmt: str) -> int:
    if fmt == "bf16":
        return 2 * numel
    if fmt == "f32":
        return 4 * numel
    if fmt == "mxfp4":
        return numel // 2 + numel // 32
    raise ValueError(f"no byte size for parameter format {fmt!r}")


def weight_bytes(cfg: ModelConfig, tp: int, ep: int) -> dict:
    """Per-rank and whole-model weight bytes by storage format and by shard kind."""
    per_rank_fmt: dict[str, int] = {}
    per_rank_shard: dict[str, int] = {}
    model_fmt: dict[str, int] = {}
    for s in param_specs(cfg):
        full = param_bytes(math.prod(s.shape), s.format)
        div = tp if s.shard in ("col", "row", "heads") else ep if s.shard == "expert" else 1
        mine = _ceil_div(full, div)
        per_rank_fmt[s.format] = per_rank_fmt.get(s.format, 0) + mine
        per_rank_shard[s.shard] = per_rank_shard.get(s.shard, 0) + mine
        model_fmt[s.format] = model_fmt.get(s.format, 0) + full
    return {"per_rank_bytes": sum(per_rank_fmt.values()), "per_rank_by_format": dict(sorted(per_rank_fmt.items())),
            "per_rank_by_shard": dict(sorted(per_rank_shard.items())), "model_bytes": sum(model_fmt.values()),
            "model_by_format": dict(sorted(model_fmt.items()))}


def param_counts(cfg: ModelConfig) -> dict:
    """Total and active parameters. Active = everything a token's forward touches: all non-routed
    params except the input embedding table (a row lookup, no compute) + k/E of the routed experts."""
    total = routed = embed = 0
    for s in param_specs(cfg):
        n = math.prod(s.shape)
        total += n
        routed += n if s.shard == "expert" else 0
        embed += n if s.name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings else 0
    active_routed = routed * cfg.num_experts_per_token // cfg.num_experts
    active = total - routed - embed + active_routed
    return {"total": total, "routed_experts": routed, "active": active, "active_with_embedding": active + embed,
            "embedding": embed, "experts_per_token": cfg.num_experts_per_token, "experts": cfg.num_experts}


# ---- caches and state ----------------------------------------------------------------------------
def latent_bytes_per_token(cfg: ModelConfig, fmt: str) -> int:
    kv, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return {"bf16": 2 * (kv + rope), "fp8": kv + rope, "nvfp4": kv // 2 + kv // 16 + rope}[fmt]


def key_bytes_per_token(cfg: ModelConfig, fmt: str) -> int:
    if not cfg.has_indexer:
        return 0
    d = cfg.index_head_dim
    return {"fp8": d + 4, "mxfp4": d // 2 + d // 32}[fmt]


def cache_bytes(cfg: ModelConfig, latent: str, key: str) -> dict:
    """Bytes per token per full-attention layer and over all of them (SPEC §7)."""
    lat, k = latent_bytes_per_token(cfg, latent), key_bytes_per_token(cfg, key)
    n = len(cfg.full_attn_layers)
    return {"latent_per_layer": lat, "index_key_per_layer": k, "per_layer": lat + k, "full_attention_layers": n,
            "per_token": n * (lat + k)}


def kda_state_bytes(cfg: ModelConfig, tp: int, state_fmt: str = "f32") -> dict:
    """Per request: recurrent state H·D·D and conv tail (K−1)·3P (fp32) per KDA layer; per rank / TP heads."""
    h, d, p, k = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_proj_dim, cfg.conv_kernel_size
    sb = 4 if state_fmt == "f32" else 2
    n = len(cfg.kda_layers)
    state, conv = h * d * d * sb, (k - 1) * 3 * p * 4
    return {"kda_layers": n, "state_per_layer": state, "conv_per_layer": conv, "per_request": n * (state + conv),
            "per_request_per_rank": n * (_ceil_div(state, tp) + _ceil_div(conv, tp))}


# ---- activations, workspaces, reserves -----------------------------------------------------------
def activation_bytes_per_token(cfg: ModelConfig, tp: int, ep: int) -> dict:
    """Peak live activation bytes per token per rank: the residual / AttnRes state that lives across
    layers plus the largest transient working set of one sublayer (sublayers run one after another)."""
    a, d = ACT_BYTES, cfg.hidden_size
    if cfg.uses_attn_res:
        sources = _ceil_div(cfg.num_hidden_layers, cfg.attn_res_block_size) + 1  # completed blocks + prefix
        resid = (sources + 2) * d * a  # + mix output + normalised input
    else:
        resid = 3 * d * a
    p, h = _ceil_div(cfg.kda_proj_dim, tp), _ceil_div(cfg.kda_num_heads, tp)
    kda = 3 * p * a * 2 + p * 4 + p * a * 2 + h * 4  # qkv + conv out, gate g (fp32), out gate + o, beta
    hm = _ceil_div(cfg.num_attention_heads, tp)
    mla = (2 * (cfg.q_lora_rank or 0) * a + hm * cfg.qk_head_dim * a + hm * cfg.latent_cache_dim * 4
           + cfg.latent_cache_dim * a + 2 * hm * cfg.v_head_dim * a)
    if cfg.has_indexer:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        mla += hi * di * (a + 1) + hi * 8 + cfg.index_topk * 8  # q_I bf16 + fp8, scales + weights, selection i64
    dense = 3 * _ceil_div(cfg.intermediate_size, tp) * a
    inter, ell = cfg.moe_intermediate_size, cfg.latent_dim
    per_assignment = 3 * inter * a + ell * a + ell * 4  # w1/w3 outputs + act, gathered z, fp32 expert output
    moe = (2 * cfg.num_experts * 4 + ell * a + ell * 4
           + 3 * _ceil_div(cfg.num_shared_experts * inter, tp) * a
           + math.ceil(cfg.num_experts_per_token * ROUTING_IMBALANCE / ep * per_assignment))
    parts = {"kda": kda if cfg.kda_layers else 0, "mla": mla if cfg.full_attn_layers else 0,
             "dense_mlp": dense if cfg.first_k_dense_replace else 0, "moe": moe}
    peak = max(parts, key=parts.get)
    return {"residual_state": resid, "sublayers": parts, "largest_sublayer": peak, "per_token": resid + parts[peak]}


def workspace_bytes(cfg: ModelConfig, tp: int, dcp: int, ep: int, max_context: int, tokens: int,
                    max_requests: int, latent: str, key: str) -> dict:
    ws = {"logits": tokens * _ceil_div(cfg.vocab_size, tp) * 4}  # logits f32[T, vocab/TP] (build.py computes all rows)
    if cfg.has_indexer:
        ws["indexer_scores"] = INDEXER_SCORE_TILE_ROWS * max_context * 4  # one query tile's full score rows
    if dcp > 1:
        per_layer = cache_bytes(cfg, latent, key)["per_layer"]
        ws["dcp_gathered_context"] = max_context * per_layer  # T5: one layer's context gathered for prefill
        if cfg.has_indexer:
            rows = min(tokens, max_requests * VERIFY_TOKENS)
            ws["dcp_topk_merge"] = 2 * rows * dcp * math.ceil(1.5 * cfg.index_topk / dcp) * 4  # T4 send + receive
    if ep > 1:
        ws["moe_all_to_all"] = 2 * _ceil_div(tokens, tp) * cfg.num_experts_per_token * cfg.latent_dim * ACT_BYTES
    return ws


def reserve_bytes(memory: int, world: int) -> dict:
    r = {"runtime": RUNTIME_RESERVE_BYTES, "fragmentation": int(memory * FRAGMENTATION_FRACTION)}
    if world > 1:
        r["communicators"] = COMM_RESERVE_BYTES
    return r


# ---- the plan ------------------------------------------------------------------------------------
def memory_plan(opts, dcp: int | None = None) -> dict:
    """Per-rank memory for `opts` (or the same options with another DCP size)."""
    cfg, t = opts.cfg, opts.target
    dcp = opts.dcp if dcp is None else dcp
    w = weight_bytes(cfg, opts.tp, opts.ep)
    act = activation_bytes_per_token(cfg, opts.tp, opts.ep)
    ws = workspace_bytes(cfg, opts.tp, dcp, opts.ep, opts.max_context, opts.max_batched_tokens, opts.max_requests,
                         opts.latent_cache, opts.key_cache)
    res = reserve_bytes(t.memory_bytes, opts.world)
    activations = act["per_token"] * opts.max_batched_tokens
    used = w["per_rank_bytes"] + activations + sum(ws.values()) + sum(res.values())
    return {"capacity_bytes": t.memory_bytes, "weights_bytes": w["per_rank_bytes"],
            "activations_bytes": activations, "activations_per_token_bytes": act["per_token"],
            "activation_breakdown": act, "workspace_bytes": sum(ws.values()), "workspaces": ws,
            "reserve_bytes": sum(res.values()), "reserves": res, "free_for_cache_bytes": t.memory_bytes - used}


def capacity(opts, dcp: int | None = None) -> dict:
    """Tokens and concurrent max-context requests the free memory holds, for one DCP size."""
    dcp = opts.dcp if dcp is None else dcp
    mem = memory_plan(opts, dcp)
    free = mem["free_for_cache_bytes"]
    per_token = cache_bytes(opts.cfg, opts.latent_cache, opts.key_cache)["per_token"]
    state = kda_state_bytes(opts.cfg, opts.tp, opts.kda_state)["per_request_per_rank"]
    ctx = opts.max_context
    per_context = _ceil_div(ctx, dcp) * per_token + state
    if per_token:
        slots = max(0, free - opts.max_requests * state) // per_token // opts.block_size * opts.block_size
    else:
        slots = 0
    return {"tp": opts.tp, "dcp": dcp, "free_for_cache_bytes": free, "cache_bytes_per_token_per_rank": per_token / dcp,
            "tokens": slots * dcp, "state_slots_reserved": opts.max_requests, "context_tokens": ctx,
            "bytes_per_context_per_rank": per_context, "concurrent_contexts": max(0, free) // per_context}


def fit_problems(opts) -> list[str]:
    """'Does not fit' problems, naming the component and by how much."""
    mem = memory_plan(opts)
    cap, t = mem["capacity_bytes"], opts.target.name
    p = []
    fixed = {"weights": mem["weights_bytes"], "activations": mem["activations_bytes"],
             "workspaces": mem["workspace_bytes"], "reserves": mem["reserve_bytes"]}
    if mem["free_for_cache_bytes"] < 0:
        parts = " + ".join(f"{k} {gib(v)}" for k, v in fixed.items())
        big = max(fixed, key=fixed.get)
        p.append(f"does not fit on {t}: per rank {parts} = {gib(sum(fixed.values()))} exceeds the {gib(cap)} of "
                 f"device memory by {gib(-mem['free_for_cache_bytes'])} (largest: {big}); {_bigger_tp_hint(opts)}")
        return p
    c = capacity(opts)
    state = kda_state_bytes(opts.cfg, opts.tp, opts.kda_state)["per_request_per_rank"]
    need = c["bytes_per_context_per_rank"] + (opts.max_requests - 1) * state
    if need > mem["free_for_cache_bytes"]:
        better = [d for d in range(opts.dcp, opts.tp + 1) if opts.tp % d == 0 and d > opts.dcp
                  and capacity(opts, d)["concurrent_contexts"] >= 1]
        hint = f"try --dcp {better[0]}" if better else "raise --tp, lower --max-context"
        p.append(f"does not fit on {t}: one {opts.max_context:,}-token context needs "
                 f"{gib(c['bytes_per_context_per_rank'] - state)} of cache + {gib(state)} of KDA state per rank, "
                 f"plus {gib((opts.max_requests - 1) * state)} of KDA state for the other "
                 f"{opts.max_requests - 1} request slots, but only {gib(mem['free_for_cache_bytes'])} is free after "
                 f"weights, activations, workspaces and reserves: short by {gib(need - mem['free_for_cache_bytes'])} "
                 f"({hint}, or lower --max-requests)")
    return p


def _bigger_tp_hint(opts) -> str:
    """Name the smallest --tp (= --ep) inside the scale-up domain at which the fixed memory fits."""
    cfg, t = opts.cfg, opts.target
    heads = math.gcd(cfg.kda_num_heads, cfg.num_attention_heads)
    for tp in range(opts.tp + 1, t.scaleup_size + 1):
        if heads % tp or cfg.num_experts % tp:
            continue
        w = weight_bytes(cfg, tp, tp)["per_rank_bytes"]
        act = activation_bytes_per_token(cfg, tp, tp)["per_token"] * opts.max_batched_tokens
        ws = workspace_bytes(cfg, tp, opts.dcp, tp, opts.max_context, opts.max_batched_tokens, opts.max_requests,
                             opts.latent_cache, opts.key_cache)
        if w + act + sum(ws.values()) + sum(reserve_bytes(t.memory_bytes, tp).values()) < t.memory_bytes:
            return f"--tp {tp} --ep {tp} would fit"
    return (f"no --tp within {t.name}'s scale-up domain of {t.scaleup_size} devices fits: use a target with more "
            f"memory per device or a larger domain")


def gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"
