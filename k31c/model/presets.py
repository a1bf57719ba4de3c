"""Built-in model presets (SPEC §1): one table, every entry a `ModelConfig`.

`k31-pro` / `k3-pro` are the full-size models (plan and compile without weights); the `*-tiny`
presets exercise every mechanism at toy size for CPU tests and the demo.
"""

from __future__ import annotations

from .config import ConfigError, ModelConfig

_K31_PRO_FULL = tuple(range(3, 92, 4)) + (92,)  # 3,7,...,91 and 92: 24 MLA layers of 93

_TINY = ModelConfig(name="k31-tiny", index_n_heads=4, index_head_dim=32, index_topk=16)

PRESETS: dict[str, ModelConfig] = {
    "k31-tiny": _TINY,
    "k3-tiny": _TINY.replace(name="k3-tiny", index_n_heads=0, index_head_dim=0, index_topk=0),
    "k31-tiny-mxfp4": _TINY.replace(name="k31-tiny-mxfp4", experts_format="mxfp4"),
    "kimi-linear-tiny": ModelConfig(
        name="kimi-linear-tiny", gate_lower_bound=None, use_full_rank_gate=False, q_lora_rank=None,
        mla_use_output_gate=False, routed_expert_hidden_size=None, latent_moe_use_norm=False,
        routed_scaling_factor=2.446, hidden_act="silu", situ_beta1=1.0, situ_beta2=None,
        attn_res_block_size=None),
    "k31-pro": ModelConfig(
        name="k31-pro", vocab_size=163840, hidden_size=7168, intermediate_size=33792, num_hidden_layers=93,
        full_attn_layers=_K31_PRO_FULL, kda_num_heads=96, kda_head_dim=128, num_attention_heads=96,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_n_heads=32, index_head_dim=128, index_topk=2048, num_experts=896, num_experts_per_token=16,
        num_shared_experts=2, moe_intermediate_size=3072, routed_expert_hidden_size=3584,
        attn_res_block_size=12, max_position_embeddings=1048576, experts_format="mxfp4"),
}
PRESETS["k3-pro"] = PRESETS["k31-pro"].replace(name="k3-pro", index_n_heads=0, index_head_dim=0, index_topk=0)


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError([f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"], "--model")
    return PRESETS[name].validate(f"preset {name}")
