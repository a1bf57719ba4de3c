"""The model's parameter table: canonical name, logical shape, storage format, sharding.

This is the single source of truth shared by the IR builder (`k31c/model/build.py`), the checkpoint
loader and `init-weights`. Canonical names are the checkpoint names of CHECKPOINT.md with the bare
`model.` / `lm_head.` prefix, except:
- routed experts are stacked per layer: `...block_sparse_moe.experts.w{1,2,3}.weight` with logical
  shape [E, out, in] (format `mxfp4` when the checkpoint stores `weight_packed`/`weight_scale`);
- the three KDA conv weights are [P, K] (the checkpoint may store [P, 1, K]);
- `A_log` is [H] (K3 pads to 128, Kimi-Linear stores [1, 1, H, 1]).

`shard` says how tensor/expert parallelism splits the tensor (materialised by the parallel passes):
`col` = output rows split, `row` = input columns split, `heads` = per-head vector split,
`expert` = leading expert axis split, `rep` = replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    format: str = "bf16"  # storage format: bf16 | f32 | mxfp4
    shard: str = "rep"
    init: str = "linear"  # how init-weights draws it: linear | embed | norm | zeros | small | a_log | dt_bias | conv


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d = cfg.hidden_size
    specs: list[ParamSpec] = [ParamSpec("model.embed_tokens.weight", (cfg.vocab_size, d), init="embed")]
    for i in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, i)
    specs.append(ParamSpec("model.norm.weight", (d,), init="norm"))
    if cfg.uses_attn_res:
        specs += [ParamSpec("model.output_attn_res_norm.weight", (d,), init="norm"),
                  ParamSpec("model.output_attn_res_proj.weight", (1, d), init="small")]
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (cfg.vocab_size, d), shard="col"))
    return specs


def _layer_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    d, p = cfg.hidden_size, layer_prefix(i)
    out = [ParamSpec(p + "input_layernorm.weight", (d,), init="norm"),
           ParamSpec(p + "post_attention_layernorm.weight", (d,), init="norm")]
    if cfg.uses_attn_res:
        out += [ParamSpec(p + "self_attention_res_norm.weight", (d,), init="norm"),
                ParamSpec(p + "mlp_res_norm.weight", (d,), init="norm"),
                ParamSpec(p + "self_attention_res_proj.weight", (1, d), init="small"),
                ParamSpec(p + "mlp_res_proj.weight", (1, d), init="small")]
    out += _kda_specs(cfg, p) if cfg.layer_kind(i) == "kda" else _mla_specs(cfg, p)
    out += _moe_specs(cfg, p) if cfg.is_moe_layer(i) else _dense_mlp_specs(cfg, p)
    return out


def _kda_specs(cfg: ModelConfig, p: str) -> list[ParamSpec]:
    d, P, H, D, K = cfg.hidden_size, cfg.kda_proj_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    a = p + "self_attn."
    out = [ParamSpec(a + f"{x}_proj.weight", (P, d), shard="col") for x in ("q", "k", "v")]
    out += [ParamSpec(a + f"{x}_conv1d.weight", (P, K), "f32", "col", init="conv") for x in ("q", "k", "v")]
    out += [ParamSpec(a + "f_a_proj.weight", (D, d)),
            ParamSpec(a + "f_b_proj.weight", (P, D), shard="col"),
            ParamSpec(a + "b_proj.weight", (H, d), shard="col"),
            ParamSpec(a + "A_log", (H,), "f32", "heads", init="a_log"),
            ParamSpec(a + "dt_bias", (P,), "f32", "heads", init="dt_bias"),
            ParamSpec(a + "o_norm.weight", (D,), "f32", init="norm")]
    if cfg.use_full_rank_gate:
        out.append(ParamSpec(a + "g_proj.weight", (P, d), shard="col"))
    else:
        out += [ParamSpec(a + "g_a_proj.weight", (D, d)), ParamSpec(a + "g_b_proj.weight", (P, D), shard="col")]
    out.append(ParamSpec(a + "o_proj.weight", (d, P), shard="row"))
    return out


def _mla_specs(cfg: ModelConfig, p: str) -> list[ParamSpec]:
    d, H, a = cfg.hidden_size, cfg.num_attention_heads, p + "self_attn."
    qk = cfg.qk_head_dim
    if cfg.q_lora_rank is None:
        out = [ParamSpec(a + "q_proj.weight", (H * qk, d), shard="col")]
    else:
        out = [ParamSpec(a + "q_a_proj.weight", (cfg.q_lora_rank, d)),
               ParamSpec(a + "q_a_layernorm.weight", (cfg.q_lora_rank,), init="norm"),
               ParamSpec(a + "q_b_proj.weight", (H * qk, cfg.q_lora_rank), shard="col")]
    out += [ParamSpec(a + "kv_a_proj_with_mqa.weight", (cfg.latent_cache_dim, d)),
            ParamSpec(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), init="norm"),
            ParamSpec(a + "kv_b_proj.weight", (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                      shard="col")]
    if cfg.mla_use_output_gate:
        out.append(ParamSpec(a + "g_proj.weight", (H * cfg.v_head_dim, d), shard="col"))
    out.append(ParamSpec(a + "o_proj.weight", (d, H * cfg.v_head_dim), shard="row"))
    if cfg.has_indexer:
        x, hi, di = a + "indexer.", cfg.index_n_heads, cfg.index_head_dim
        out += [ParamSpec(x + "wq_b.weight", (hi * di, cfg.q_lora_rank)),
                ParamSpec(x + "wk.weight", (di, d)),
                ParamSpec(x + "k_norm.weight", (di,), init="norm"),
                ParamSpec(x + "k_norm.bias", (di,), init="small"),
                ParamSpec(x + "weights_proj.weight", (hi, d))]
    return out


def _dense_mlp_specs(cfg: ModelConfig, p: str) -> list[ParamSpec]:
    d, inter = cfg.hidden_size, cfg.intermediate_size
    return [ParamSpec(p + "mlp.gate_proj.weight", (inter, d), shard="col"),
            ParamSpec(p + "mlp.up_proj.weight", (inter, d), shard="col"),
            ParamSpec(p + "mlp.down_proj.weight", (d, inter), shard="row")]


def _moe_specs(cfg: ModelConfig, p: str) -> list[ParamSpec]:
    d, E, ell, inter = cfg.hidden_size, cfg.num_experts, cfg.latent_dim, cfg.moe_intermediate_size
    m = p + "block_sparse_moe."
    fmt = cfg.experts_format
    out = [ParamSpec(m + "gate.weight", (E, d)),
           ParamSpec(m + "gate.e_score_correction_bias", (E,), "f32", init="small")]
    if cfg.has_latent_moe:
        out += [ParamSpec(m + "routed_expert_down_proj.weight", (ell, d)),
                ParamSpec(m + "routed_expert_up_proj.weight", (d, ell))]
        if cfg.latent_moe_use_norm:
            out.append(ParamSpec(m + "routed_expert_norm.weight", (ell,), init="norm"))
    out += [ParamSpec(m + "experts.w1.weight", (E, inter, ell), fmt, "expert"),
            ParamSpec(m + "experts.w2.weight", (E, ell, inter), fmt, "expert"),
            ParamSpec(m + "experts.w3.weight", (E, inter, ell), fmt, "expert")]
    if cfg.num_shared_experts:
        s = cfg.num_shared_experts * inter
        out += [ParamSpec(m + "shared_experts.gate_proj.weight", (s, d), shard="col"),
                ParamSpec(m + "shared_experts.up_proj.weight", (s, d), shard="col"),
                ParamSpec(m + "shared_experts.down_proj.weight", (d, s), shard="row")]
    return out
