"""The model, written once: builds the IR module of a K3 / K3.1 Pro / Kimi-Linear config (SPEC §2–6).

Entry functions (one body, three shape regimes):
- `prefill`: B new tokens from R requests (a chunk per request over its cached context);
- `decode`:  one token per request (B = R);
- `verify`:  1–8 tokens per request (speculative verification).

Inputs, in order: `tokens i64[T]`, `token_pos i64[T]` (position in the request), `token_req i64[T]`
(request index), `cu_seqlens i64[R+1]` (request r's tokens are rows cu[r]:cu[r+1]), `block_table i32[R, MB]`
(the request's cache blocks: position p lives at pool row block_table[r, p // bs] * bs + p % bs, bs the
module's `block_size`), `state_slot i64[R]` (row in the KDA state pools), then the cache
pools of every layer. MLA pools are block views `[NB, bs, *row]` (NB blocks of bs rows: the pages of one
layer in every row of the packed block pool, DESIGN §5 T1, `k31c.runtime.block_layout`): `latent.{i}
[NB, bs, kv_lora+rope]` (u8 [NB, bs, kv/2+kv/16+rope] for NVFP4), indexer `index_keys.{i} f8e4m3[NB, bs, D_I]`
and `index_scales.{i} f32[NB, bs]` (MXFP4: u8 [NB, bs, D_I/2] and u8 [NB, bs, D_I/32]); with
`pool_view="flat"` they are flat `[N, *row]` instead (N = NB·bs, one tensor per pool). KDA pools are
per-request slots: `conv_state.{i} f32[S, K-1, 3P]`, `kda_state.{i} f32[S, H, D, D]`.
Outputs: `logits f32[T, vocab]`, then every pool (updated in place) in input order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ir.builder import FunctionBuilder
from ir.core import Module, Param, TensorType, Value

from .config import ModelConfig
from .params import layer_prefix, param_specs

ENTRY_FUNCTIONS = {  # name -> (token-count symbol, MLA form, KDA form, max tokens per request)
    "prefill": ("B", "decompressed", "chunked", None),
    "decode": ("R", "absorbed", "recurrent", 1),
    "verify": ("B", "absorbed", "recurrent", 8),
}
METADATA_INPUTS = ("tokens", "token_pos", "token_req", "cu_seqlens", "block_table", "state_slot")


@dataclass(frozen=True)
class BuildOptions:
    act_dtype: str = "bf16"  # storage dtype of activations between ops at run time
    # defaults = the plan's defaults (k31c/plan/options.py), so `--model` runs and default compiles agree
    latent_cache_dtype: str = "f8e4m3"  # the plan's --latent-cache fp8 (per-layer scale 1); "nvfp4", "bf16", "f32"
    block_size: int = 64  # cache rows per block (a power of two); the plan's --block-size
    key_cache: str = "fp8"  # index-key cache format: "fp8" | "mxfp4" (the plan's --key-cache)
    pool_view: str = "blocks"  # MLA pool inputs: "blocks" [NB, bs, *row] (packed pool pages) | "flat" [N, *row]

    def to_attrs(self) -> dict:
        return {"act_dtype": self.act_dtype, "latent_cache_dtype": self.latent_cache_dtype,
                "block_size": self.block_size, "key_cache": self.key_cache, "pool_view": self.pool_view}


POOL_VIEWS = ("blocks", "flat")


def pool_inputs(cfg: ModelConfig, opts: BuildOptions = BuildOptions()) -> list[tuple[str, str, tuple]]:
    """(name, dtype, dims) of every cache/state pool input, in function-input order."""
    if opts.pool_view not in POOL_VIEWS:
        raise ValueError(f"pool_view must be one of {POOL_VIEWS}, found {opts.pool_view!r}")
    rows = ("NB", opts.block_size) if opts.pool_view == "blocks" else ("N",)
    out = []
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_kind(i) == "mla":
            if opts.latent_cache_dtype == "nvfp4":  # c_KV E2M1 pairs | E4M3 block scales | k_pe e4m3 (SPEC §7)
                kv = cfg.kv_lora_rank
                out.append((f"latent.{i}", "u8", (*rows, kv // 2 + kv // 16 + cfg.qk_rope_head_dim)))
            else:
                out.append((f"latent.{i}", opts.latent_cache_dtype, (*rows, cfg.latent_cache_dim)))
            if cfg.has_indexer and opts.key_cache == "mxfp4":   # E2M1 pairs + one E8M0 byte per 32 values
                out.append((f"index_keys.{i}", "u8", (*rows, cfg.index_head_dim // 2)))
                out.append((f"index_scales.{i}", "u8", (*rows, cfg.index_head_dim // 32)))
            elif cfg.has_indexer:
                out.append((f"index_keys.{i}", "f8e4m3", (*rows, cfg.index_head_dim)))
                out.append((f"index_scales.{i}", "f32", rows))
        else:
            k, p = cfg.conv_kernel_size, cfg.kda_proj_dim
            out.append((f"conv_state.{i}", "f32", ("S", k - 1, 3 * p)))
            out.append((f"kda_state.{i}", "f32", ("S", cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)))
    return out


def build_module(cfg: ModelConfig, opts: BuildOptions = BuildOptions()) -> Module:
    cfg.validate(f"model {cfg.name}")
    m = Module(cfg.name, attrs={"config": json.dumps(cfg.to_hf(), sort_keys=True), **opts.to_attrs()})
    for s in param_specs(cfg):
        m.add_param(Param(s.name, TensorType.of(s.format, s.shape), s.shard))
    for name in ENTRY_FUNCTIONS:
        m.add_function(_ModelWriter(m, cfg, opts, name).build())
    return m


class _ModelWriter:
    def __init__(self, m: Module, cfg: ModelConfig, opts: BuildOptions, fn: str):
        tsym, self.mla_form, self.kda_form, max_q = ENTRY_FUNCTIONS[fn]
        attrs = {"kind": fn} if max_q is None else {"kind": fn, "max_tokens_per_request": max_q}
        self.b, self.cfg, self.opts = FunctionBuilder(m, fn, attrs), cfg, opts
        self.act = opts.act_dtype
        b = self.b
        self.tokens = b.input("tokens", "i64", (tsym,))
        self.token_pos = b.input("token_pos", "i64", (tsym,))
        self.token_req = b.input("token_req", "i64", (tsym,))
        self.cu_seqlens = b.input("cu_seqlens", "i64", ("R+1",))
        self.block_table = b.input("block_table", "i32", ("R", "MB"))
        self.state_slot = b.input("state_slot", "i64", ("R",))
        self.pools = {name: b.input(name, dt, dims) for name, dt, dims in pool_inputs(cfg, opts)}

    def p(self, name: str) -> Value:
        return self.b.param(name)

    def op(self, *a, **k):
        return self.b.op(*a, **k)

    # ---- decoder stack (SPEC §2) -------------------------------------------------------------
    def build(self):
        cfg = self.cfg
        x = self.op("embedding", self.p("model.embed_tokens.weight"), self.tokens, name="embed")
        if cfg.uses_attn_res:
            h = self._attn_res_stack(x)
        else:
            h = x
            for i in range(cfg.num_hidden_layers):
                with self.b.scope(f"l{i}"):
                    h = self.op("add", h, self._attention(i, self._norm(h, i, "input_layernorm")), name="resid")
                    h = self.op("add", h, self._ffn(i, self._norm(h, i, "post_attention_layernorm")), name="resid")
        h = self.op("rms_norm", h, self.p("model.norm.weight"), eps=cfg.rms_norm_eps, name="final_norm")
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        logits = self.op("linear", self.op("cast", h, dtype="f32"), self.p(head), name="logits")
        return self.b.ret(logits, *self.pools.values())

    def _attn_res_stack(self, x: Value) -> Value:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        prefix, bank = x, []

        def mix(src, what):
            return self.op("attn_res_mix", self.p(src + "_proj.weight"), self.p(src + "_norm.weight"),
                           *bank, prefix, eps=eps, name=what)

        for i in range(cfg.num_hidden_layers):
            pre = layer_prefix(i)
            with self.b.scope(f"l{i}"):
                h = mix(pre + "self_attention_res", "attn_in") if bank else prefix
                start_block = i % cfg.attn_res_block_size == 0
                if start_block:
                    bank.append(prefix)
                a = self._attention(i, self._norm(h, i, "input_layernorm"))
                prefix = a if start_block else self.op("add", prefix, a, name="prefix")
                h = mix(pre + "mlp_res", "mlp_in")
                prefix = self.op("add", prefix, self._ffn(i, self._norm(h, i, "post_attention_layernorm")),
                                 name="prefix")
        return self.op("attn_res_mix", self.p("model.output_attn_res_proj.weight"),
                       self.p("model.output_attn_res_norm.weight"), *bank, prefix, eps=eps, name="out_mix")

    def _norm(self, x: Value, i: int, which: str) -> Value:
        return self.op("rms_norm", x, self.p(layer_prefix(i) + which + ".weight"), eps=self.cfg.rms_norm_eps,
                       name=which.split("_")[0] + "_norm")

    def _attention(self, i: int, h: Value) -> Value:
        return self._mla(i, h) if self.cfg.layer_kind(i) == "mla" else self._kda(i, h)

    def _linear(self, x: Value, w: str, name: str) -> Value:
        return self.op("linear", x, self.p(w), name=name)

    def _pool_update(self, name: str, new: Value):
        self.pools[name] = new

    # ---- KDA (SPEC §3) -----------------------------------------------------------------------
    def _kda(self, i: int, h: Value) -> Value:
        cfg, a = self.cfg, layer_prefix(i) + "self_attn."
        H, D, P = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_proj_dim
        qkv = self.op("concat", *(self._linear(h, a + f"{x}_proj.weight", x) for x in "qkv"), axis=1, name="qkv")
        conv_w = self.op("concat", *(self.p(a + f"{x}_conv1d.weight") for x in "qkv"), axis=0, name="conv_w")
        y, conv = self.op("causal_conv1d", qkv, conv_w, self.pools[f"conv_state.{i}"], self.state_slot,
                          self.cu_seqlens, name="conv")
        self._pool_update(f"conv_state.{i}", conv)

        def heads(lo, nm, l2):
            t = self.op("reshape", self.op("slice", y, axis=1, start=lo, stop=lo + P, name=nm), shape=[-1, H, D], name=nm)
            return self.op("l2_norm", t, eps=1e-6, name=nm) if l2 else t

        q, k, v = heads(0, "q", True), heads(P, "k", True), heads(2 * P, "v", False)
        f = self._linear(self._linear(h, a + "f_a_proj.weight", "f_a"), a + "f_b_proj.weight", "f")
        g = self.op("kda_gate", f, self.p(a + "A_log"), self.p(a + "dt_bias"), lower_bound=cfg.gate_lower_bound, name="g")
        beta = self.op("sigmoid", self._linear(h, a + "b_proj.weight", "beta"), name="beta")
        o, state = self.op("kda", q, k, v, g, beta, self.pools[f"kda_state.{i}"], self.state_slot, self.cu_seqlens,
                           scale=D ** -0.5, form=self.kda_form, name="kda")
        self._pool_update(f"kda_state.{i}", state)
        if cfg.use_full_rank_gate:
            gate = self._linear(h, a + "g_proj.weight", "gate")
        else:
            gate = self._linear(self._linear(h, a + "g_a_proj.weight", "g_a"), a + "g_b_proj.weight", "gate")
        gate = self.op("reshape", gate, shape=[-1, H, D], name="gate")
        o = self.op("gated_rms_norm", o, gate, self.p(a + "o_norm.weight"), eps=cfg.rms_norm_eps, name="o_norm")
        return self._linear(self.op("reshape", o, shape=[-1, P], name="o"), a + "o_proj.weight", "attn_out")

    # ---- MLA + indexer (SPEC §4–5) -----------------------------------------------------------
    def _mla(self, i: int, h: Value) -> Value:
        cfg, a = self.cfg, layer_prefix(i) + "self_attn."
        H, dn, dr, kv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        meta = (self.token_pos, self.token_req, self.block_table)
        cq = None
        if cfg.q_lora_rank is None:
            q = self._linear(h, a + "q_proj.weight", "q")
        else:
            cq = self.op("rms_norm", self._linear(h, a + "q_a_proj.weight", "q_a"), self.p(a + "q_a_layernorm.weight"),
                         eps=1e-6, name="c_q")
            q = self._linear(cq, a + "q_b_proj.weight", "q")
        q = self.op("reshape", q, shape=[-1, H, dn + dr], name="q")
        q_nope = self.op("slice", q, axis=2, start=0, stop=dn, name="q_nope")
        q_pe = self.op("slice", q, axis=2, start=dn, stop=dn + dr, name="q_pe")
        ckv = self._linear(h, a + "kv_a_proj_with_mqa.weight", "kv_a")
        c = self.op("rms_norm", self.op("slice", ckv, axis=1, start=0, stop=kv, name="c_kv"),
                    self.p(a + "kv_a_layernorm.weight"), eps=1e-6, name="c_kv")
        k_pe = self.op("slice", ckv, axis=1, start=kv, stop=kv + dr, name="k_pe")
        latent = self.op("concat", c, k_pe, axis=1, name="latent")
        nvfp4 = self.opts.latent_cache_dtype == "nvfp4"
        if nvfp4:
            latent = self.op("quantize_latent_nvfp4", latent, kv_lora_rank=kv, name="latent4")
        elif self.opts.latent_cache_dtype != latent.type.dtype.name:
            latent = self.op("cast", latent, dtype=self.opts.latent_cache_dtype, name="latent")
        pool = self.op("cache_write", self.pools[f"latent.{i}"], latent, self.token_req, self.token_pos, self.block_table,
                       block_size=self.opts.block_size, name="latent_cache")
        self._pool_update(f"latent.{i}", pool)
        selection = self._indexer(i, h, cq) if cfg.has_indexer else None
        extra = [selection] if selection is not None else []
        o = self.op("mla_attention", q_nope, q_pe, pool, self.p(a + "kv_b_proj.weight"), *meta, *extra,
                    block_size=self.opts.block_size, scale=(dn + dr) ** -0.5, form=self.mla_form,
                    **({"latent_format": "nvfp4"} if nvfp4 else {}), name="mla")
        o = self.op("reshape", o, shape=[-1, H * cfg.v_head_dim], name="o")
        if cfg.mla_use_output_gate:
            o = self.op("mul", o, self.op("sigmoid", self._linear(h, a + "g_proj.weight", "gate"), name="gate"),
                        name="o_gated")
        return self._linear(o, a + "o_proj.weight", "attn_out")

    def _indexer(self, i: int, h: Value, cq: Value) -> Value:
        cfg, a = self.cfg, layer_prefix(i) + "self_attn.indexer."
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        qi = self.op("reshape", self._linear(cq, a + "wq_b.weight", "iq"), shape=[-1, hi, di], name="iq")
        q8, qs = self.op("quantize_fp8_pow2", self.op("hadamard", qi, name="iq_rot"), name="iq8")
        ki = self.op("layer_norm", self._linear(h, a + "wk.weight", "ik"), self.p(a + "k_norm.weight"),
                     self.p(a + "k_norm.bias"), eps=1e-6, name="ik")
        k_rot = self.op("hadamard", ki, name="ik_rot")
        if self.opts.key_cache == "mxfp4":
            k8, ks = self.op("quantize_mxfp4", k_rot, name="ik4")
        else:
            k8, ks = self.op("quantize_fp8_pow2", k_rot, name="ik8")
        meta = (self.token_req, self.token_pos, self.block_table)
        bs = self.opts.block_size
        keys = self.op("cache_write", self.pools[f"index_keys.{i}"], k8, *meta, block_size=bs, name="index_keys")
        scales = self.op("cache_write", self.pools[f"index_scales.{i}"], ks, *meta, block_size=bs, name="index_scales")
        self._pool_update(f"index_keys.{i}", keys)
        self._pool_update(f"index_scales.{i}", scales)
        w = self.op("scale", self._linear(h, a + "weights_proj.weight", "iw"), factor=(hi ** -0.5) * (di ** -0.5),
                    name="iw")
        return self.op("indexer_topk", q8, qs, w, keys, scales, self.token_pos, self.token_req, self.block_table,
                       block_size=bs, topk=cfg.index_topk, key_format=self.opts.key_cache, name="selection")

    # ---- FFN (SPEC §6) -----------------------------------------------------------------------
    def _glu(self, a: Value, u: Value) -> Value:
        cfg = self.cfg
        if cfg.hidden_act == "silu":
            return self.op("swiglu", a, u, name="act")
        return self.op("situ_glu", a, u, beta1=cfg.situ_beta1, beta2=cfg.situ_beta2, name="act")

    def _mlp(self, h: Value, pre: str) -> Value:
        act = self._glu(self._linear(h, pre + "gate_proj.weight", "gate"), self._linear(h, pre + "up_proj.weight", "up"))
        return self._linear(act, pre + "down_proj.weight", "down")

    def _ffn(self, i: int, h: Value) -> Value:
        if not self.cfg.is_moe_layer(i):
            return self._mlp(h, layer_prefix(i) + "mlp.")
        cfg, m = self.cfg, layer_prefix(i) + "block_sparse_moe."
        logits = self._linear(self.op("cast", h, dtype="f32", name="h32"), m + "gate.weight", "router_logits")
        weights, ids = self.op("moe_router", logits, self.p(m + "gate.e_score_correction_bias"),
                               topk=cfg.num_experts_per_token, activation=cfg.moe_router_activation_func,
                               renormalize=cfg.moe_renormalize, scaling=float(cfg.routed_scaling_factor),
                               n_group=cfg.num_expert_group, topk_group=cfg.topk_group, name="router")
        z = self._linear(h, m + "routed_expert_down_proj.weight", "z") if cfg.has_latent_moe else h
        y = self.op("moe_experts", z, weights, ids, *(self.p(m + f"experts.w{n}.weight") for n in (1, 2, 3)),
                    act=cfg.hidden_act, beta1=cfg.situ_beta1, beta2=cfg.situ_beta2, name="experts")
        if cfg.has_latent_moe and cfg.latent_moe_use_norm:
            y = self.op("rms_norm", y, self.p(m + "routed_expert_norm.weight"), eps=cfg.rms_norm_eps, name="latent_norm")
        y = self.op("cast", y, dtype=self.act, name="routed")
        if cfg.has_latent_moe:
            y = self._linear(y, m + "routed_expert_up_proj.weight", "routed_up")
        if cfg.num_shared_experts:
            y = self.op("add", y, self._mlp(h, m + "shared_experts."), name="moe_out")
        return y
