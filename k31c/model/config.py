"""Model configuration: one dataclass for Kimi K3, K3.1 Pro and Kimi-Linear (SPEC §1).

`ModelConfig.from_hf(dict)` reads a Hugging Face style `config.json` (keys nested under
`text_config` as in K3, or flat as in Kimi-Linear); `to_hf()` writes the K3-style dict back.
Every variant switch of SPEC §1 "Variants" is a field here, chosen exactly as Moonshot's
`modeling_kimi_linear.py` chooses it. `validate()` collects every inconsistency and raises
one `ConfigError` listing them all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A model configuration that cannot be built; the message lists every problem found."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512  # dense layer(s) before first_k_dense_replace
    num_hidden_layers: int = 8
    full_attn_layers: tuple[int, ...] = (3, 7)  # 0-indexed MLA layers; every other layer is KDA
    # KDA
    kda_num_heads: int = 4
    kda_head_dim: int = 64
    conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0  # None: Kimi-Linear gate -exp(A_log)*softplus(f + dt_bias)
    use_full_rank_gate: bool = True  # False: low-rank output gate g_a_proj / g_b_proj
    # MLA
    num_attention_heads: int = 4
    q_lora_rank: int | None = 96  # None: single q_proj
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mla_use_output_gate: bool = True
    # DSA indexer (K3.1 Pro); index_topk == 0 means K3 (dense MLA)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # MoE
    num_experts: int = 16
    num_experts_per_token: int = 4
    num_shared_experts: int = 1
    moe_intermediate_size: int = 64
    routed_expert_hidden_size: int | None = 128  # latent width; None: experts on the hidden state
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    num_expert_group: int = 1
    topk_group: int = 1
    # activations and residuals
    hidden_act: str = "situ"  # "situ" (SiTU-GLU) or "silu" (SwiGLU)
    situ_beta1: float = 4.0
    situ_beta2: float | None = 25.0  # None: no tanh on the up branch
    attn_res_block_size: int | None = 2  # None: ordinary pre-norm residual stream
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    experts_format: str = "bf16"  # storage of routed experts: "bf16" or "mxfp4"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def has_indexer(self) -> bool:
        return self.index_topk > 0

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def latent_dim(self) -> int:
        """Width the routed experts run at (ℓ), the hidden size when there is no latent path."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def has_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def kda_layers(self) -> tuple[int, ...]:
        full = set(self.full_attn_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in full)

    def layer_kind(self, i: int) -> str:
        return "mla" if i in self.full_attn_layers else "kda"

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and (i - self.first_k_dense_replace) % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def latent_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ---- checks ----------------------------------------------------------------------------
    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "num_experts", "num_experts_per_token", "moe_intermediate_size", "conv_kernel_size"):
            if getattr(self, name) <= 0:
                p.append(f"{name} must be positive, found {getattr(self, name)}")
        bad = [i for i in self.full_attn_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            p.append(f"full_attn_layers {bad} (0-indexed) outside 0..{self.num_hidden_layers - 1}")
        if len(set(self.full_attn_layers)) != len(self.full_attn_layers):
            p.append(f"full_attn_layers lists a layer twice: {list(self.full_attn_layers)}")
        if self.has_indexer:
            if self.q_lora_rank is None:
                p.append("index_topk > 0 needs q_lora_rank (the indexer projects the MLA query latent)")
            if self.index_n_heads <= 0 or self.index_head_dim <= 0:
                p.append(f"index_topk={self.index_topk} needs index_n_heads and index_head_dim > 0, "
                         f"found {self.index_n_heads} and {self.index_head_dim}")
            elif self.index_head_dim & (self.index_head_dim - 1):
                p.append(f"index_head_dim must be a power of two (Hadamard rotation), found {self.index_head_dim}")
        if self.num_experts_per_token > self.num_experts:
            p.append(f"num_experts_per_token={self.num_experts_per_token} exceeds num_experts={self.num_experts}")
        if self.num_expert_group <= 0 or self.num_experts % self.num_expert_group:
            p.append(f"num_experts={self.num_experts} not divisible by num_expert_group={self.num_expert_group}")
        if not 0 < self.topk_group <= max(self.num_expert_group, 1):
            p.append(f"topk_group={self.topk_group} must be in 1..num_expert_group={self.num_expert_group}")
        if self.hidden_act not in ("situ", "silu"):
            p.append(f"hidden_act must be 'situ' or 'silu', found {self.hidden_act!r}")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            p.append(f"moe_router_activation_func must be 'sigmoid' or 'softmax', "
                     f"found {self.moe_router_activation_func!r}")
        if self.experts_format not in ("bf16", "mxfp4"):
            p.append(f"experts_format must be 'bf16' or 'mxfp4', found {self.experts_format!r}")
        if self.experts_format == "mxfp4":
            for name, width in (("routed_expert_hidden_size (ℓ)", self.latent_dim),
                                ("moe_intermediate_size", self.moe_intermediate_size)):
                if width % 32:
                    p.append(f"MXFP4 experts need {name} divisible by 32, found {width}")
        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            p.append(f"attn_res_block_size must be positive, found {self.attn_res_block_size}")
        if self.first_k_dense_replace < 0 or self.moe_layer_freq <= 0:
            p.append("first_k_dense_replace must be >= 0 and moe_layer_freq > 0")
        if self.max_position_embeddings <= 0:
            p.append(f"max_position_embeddings must be positive, found {self.max_position_embeddings}")
        return p

    def validate(self, source: str = "config") -> "ModelConfig":
        p = self.problems()
        if p:
            raise ConfigError(p, source)
        return self

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def digest(self) -> str:
        """Stable hash of everything that changes the model (used by artifacts and caches)."""
        return hashlib.sha256(json.dumps(self.to_hf(), sort_keys=True).encode()).hexdigest()[:16]

    # ---- HF config.json --------------------------------------------------------------------
    def to_hf(self) -> dict:
        """K3-style flat `config.json` dict (layer lists 1-indexed as on disk)."""
        full = [i + 1 for i in self.full_attn_layers]
        d = {
            "model_type": "kimi_linear", "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in self.kda_layers], "full_attn_layers": full,
                "num_heads": self.kda_num_heads, "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv_kernel_size,
                "use_full_rank_gate": self.use_full_rank_gate,
            },
            "num_attention_heads": self.num_attention_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "mla_use_nope": True, "mla_use_output_gate": self.mla_use_output_gate,
            "num_experts": self.num_experts, "num_experts_per_token": self.num_experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size, "num_shared_experts": self.num_shared_experts,
            "latent_moe_use_norm": self.latent_moe_use_norm, "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq, "routed_scaling_factor": self.routed_scaling_factor,
            "moe_renormalize": self.moe_renormalize, "moe_router_activation_func": self.moe_router_activation_func,
            "use_grouped_topk": True, "num_expert_group": self.num_expert_group, "topk_group": self.topk_group,
            "hidden_act": self.hidden_act, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.gate_lower_bound is not None:
            d["linear_attn_config"]["gate_lower_bound"] = self.gate_lower_bound
        if self.routed_expert_hidden_size is not None:
            d["routed_expert_hidden_size"] = self.routed_expert_hidden_size
        if self.hidden_act == "situ":
            d["activation_situ_beta"] = self.situ_beta1
            if self.situ_beta2 is not None:
                d["activation_situ_linear_beta"] = self.situ_beta2
        if self.attn_res_block_size is not None:
            d["attn_res_block_size"] = self.attn_res_block_size
        if self.has_indexer:
            d.update(index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim,
                     index_topk=self.index_topk)
        if self.experts_format == "mxfp4":
            d["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
        return d

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json", name: str = "checkpoint") -> "ModelConfig":
        """Read K3 (`text_config` nested) or Kimi-Linear (flat) keys; collect every problem."""
        problems: list[str] = []
        d = _flatten_text_config(raw, problems)
        lin = d.get("linear_attn_config") or {}

        def get(key, default=None, aliases=()):
            found = {k: d[k] for k in (key, *aliases) if k in d}
            if len({json.dumps(v, sort_keys=True) for v in found.values()}) > 1:
                problems.append(f"keys {sorted(found)} contradict each other: {found}")
            return next(iter(found.values())) if found else default

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size"):
            if key not in d:
                problems.append(f"missing required key {key!r}")
        n_layers = int(d.get("num_hidden_layers", 0) or 0)
        full = _layer_lists(lin, n_layers, problems)
        quant = d.get("quantization_config") or {}
        fmt = str(quant.get("format", "")) if quant else ""
        act = d.get("hidden_act", "silu")
        num_experts = get("num_experts", 0, aliases=("n_routed_experts", "num_local_experts"))
        if problems:
            raise ConfigError(problems, source)
        cfg = cls(
            name=name,
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0), num_hidden_layers=n_layers,
            full_attn_layers=tuple(full),
            kda_num_heads=lin.get("num_heads", 0), kda_head_dim=lin.get("head_dim", 0),
            conv_kernel_size=lin.get("short_conv_kernel_size", 4),
            gate_lower_bound=lin.get("gate_lower_bound"),
            use_full_rank_gate=bool(lin.get("use_full_rank_gate", False)),
            num_attention_heads=d["num_attention_heads"], q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
            mla_use_output_gate=bool(d.get("mla_use_output_gate", False)),
            index_n_heads=d.get("index_n_heads", 0) or 0, index_head_dim=d.get("index_head_dim", 0) or 0,
            index_topk=d.get("index_topk", 0) or 0,
            num_experts=num_experts,
            num_experts_per_token=get("num_experts_per_token", 0, aliases=("num_experts_per_tok",)),
            num_shared_experts=get("num_shared_experts", 0, aliases=("n_shared_experts",)),
            moe_intermediate_size=d["moe_intermediate_size"],
            routed_expert_hidden_size=d.get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(d.get("latent_moe_use_norm", False)),
            first_k_dense_replace=d.get("first_k_dense_replace", 1), moe_layer_freq=d.get("moe_layer_freq", 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            moe_renormalize=bool(get("moe_renormalize", False, aliases=("norm_topk_prob",))),
            moe_router_activation_func=d.get("moe_router_activation_func", "sigmoid"),
            num_expert_group=get("num_expert_group", 1, aliases=("n_group",)) or 1,
            topk_group=d.get("topk_group", 1) or 1,
            hidden_act=act,
            situ_beta1=float(d.get("activation_situ_beta", 1.0)),
            situ_beta2=d.get("activation_situ_linear_beta"),
            attn_res_block_size=d.get("attn_res_block_size"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            experts_format="mxfp4" if "mxfp4" in fmt else "bf16",
        )
        return cfg.validate(source)


def _flatten_text_config(raw: dict, problems: list[str]) -> dict:
    """K3 nests the text model's keys under `text_config`; merge them, flagging contradictions."""
    if not isinstance(raw, dict):
        problems.append(f"config must be a JSON object, found {type(raw).__name__}")
        return {}
    nested = raw.get("text_config")
    if not isinstance(nested, dict):
        return dict(raw)
    merged = dict(nested)
    for key, value in raw.items():
        if key == "text_config":
            continue
        if key in nested and nested[key] != value and key not in ("model_type", "architectures", "torch_dtype"):
            problems.append(f"key {key!r} is {value!r} at top level but {nested[key]!r} in text_config")
        merged.setdefault(key, value)
    return merged


def _layer_lists(lin: dict, n_layers: int, problems: list[str]) -> list[int]:
    """0-indexed full-attention layers from the 1-indexed `kda_layers` / `full_attn_layers`."""
    kda = [int(i) for i in lin.get("kda_layers", [])]
    full = [int(i) for i in lin.get("full_attn_layers", [])]
    if not kda and not full:
        problems.append("linear_attn_config needs kda_layers and/or full_attn_layers (1-indexed)")
        return []
    both = sorted(set(kda) & set(full))
    if both:
        problems.append(f"layers {both} are listed in both kda_layers and full_attn_layers")
    out_of_range = sorted(i for i in kda + full if not 1 <= i <= n_layers)
    if out_of_range:
        problems.append(f"layer numbers {out_of_range} outside 1..num_hidden_layers={n_layers} (lists are 1-indexed)")
    if kda and full:
        missing = sorted(set(range(1, n_layers + 1)) - set(kda) - set(full))
        if missing:
            problems.append(f"layers {missing} are in neither kda_layers nor full_attn_layers")
    if not full:  # only kda_layers given: every other layer is MLA
        full = [i for i in range(1, n_layers + 1) if i not in set(kda)]
    return sorted(i - 1 for i in full)
