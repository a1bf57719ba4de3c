"""Whole-model parity: k31c on `kimi-linear-tiny` vs transformers' `KimiLinearForCausalLM` (fp32).

transformers' `kimi_linear` is an independent implementation of the Kimi-Linear variant (SPEC §1
"Variants"): Kimi-Linear forget gate -exp(A_log)·softplus(f + dt_bias), low-rank output gate
g_a/g_b, ordinary pre-norm residual stream, MoE on the full hidden state (no latent projections),
SwiGLU, single q_proj, no MLA output gate, sigmoid router with e_score_correction_bias and
renormalised, routed_scaling_factor-scaled weights.

The checkpoint is written by `init_weights` and read back through `load_checkpoint` (the loader is
part of what is tested); transformers is built from the same `config.json` and gets the loaded
canonical weights remapped to its names/layouts with `strict=True`. Compared (rel err
||a-b||/||b|| < 1e-4, fp32): one prefill; a ragged 2-request prefill (one request longer than a KDA
chunk of 64); prefill + decode steps; chunked prefill over a cache mixed with a new request, then
batched decode. Every k31c row is compared with transformers' full forward of that prompt alone.

transformers routes KDA / the short conv to fla's Triton kernels when `fla` imports, which fails on
CPU: the modeling module is (re)imported with `sys.modules["fla"] = None` (and `causal_conv1d`;
both restored afterwards, as is any previously imported modeling module) and the test checks that
the torch reference functions were picked (the choice is made once, at import).
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch

from k31c.model.build import BuildOptions, build_module
from k31c.model.checkpoint import load_checkpoint
from k31c.model.init_weights import init_weights
from k31c.model.presets import get_preset
from k31c.runtime.reference import ReferenceRuntime

try:
    from tests.helpers import assert_close_rel
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel

PRESET = "kimi-linear-tiny"
SEED = 11
TOL = 1e-4
HF_MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"
# transformers functions that dispatch to fla / causal_conv1d when those import
_DISPATCHED = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
               "causal_conv1d_update")
_BLOCKED = ("fla", "causal_conv1d")  # packages transformers would pick over its torch references


# ---------------------------------------------------------------------------------- transformers

class _Absent:
    pass


_ABSENT = _Absent()


def _restore(key: str, value):
    if value is _ABSENT:
        sys.modules.pop(key, None)
    else:
        sys.modules[key] = value


def _import_hf_torch_path():
    """transformers' kimi_linear modeling module, freshly imported with `fla` blocked, so that its KDA
    and short-conv functions resolve to the pure-torch references. sys.modules is restored."""
    saved = {k: sys.modules.get(k, _ABSENT) for k in _BLOCKED}
    saved_mod = sys.modules.pop(HF_MODELING, _ABSENT)
    for k in _BLOCKED:
        sys.modules[k] = None  # `import fla` raises ImportError -> transformers falls back to torch
    try:
        mod = importlib.import_module(HF_MODELING)
    finally:
        for k, v in saved.items():
            _restore(k, v)
        _restore(HF_MODELING, saved_mod)
    for name in _DISPATCHED:
        fn = getattr(mod, name)
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        impl = cells.get("implementation", fn)
        torch_fn = getattr(fn, "__wrapped__", fn)
        assert impl is torch_fn, f"transformers' {name} dispatches to {impl!r}, not its torch reference"
        assert cells.get("is_new_implementation", False) is False, name
    return mod


def _hf_config(mod, config_path, cfg):
    raw = json.loads(config_path.read_text())
    # Keys of our config.json that transformers does not read: it hard-codes their Kimi-Linear
    # values, so the comparison is only meaningful when our config has exactly those values.
    assert cfg.moe_layer_freq == 1  # HF: every layer >= first_k_dense_replace is MoE
    assert cfg.moe_router_activation_func == "sigmoid"  # HF: always sigmoid scores
    assert not cfg.mla_use_output_gate  # HF: no MLA output gate (mla_use_output_gate not read)
    assert cfg.gate_lower_bound is None  # HF: always -exp(A_log)*softplus(f + dt_bias)
    assert not cfg.use_full_rank_gate  # HF: always low-rank g_a_proj/g_b_proj
    assert cfg.routed_expert_hidden_size is None and not cfg.latent_moe_use_norm  # HF: no latent MoE
    assert cfg.attn_res_block_size is None  # HF: ordinary pre-norm residual
    assert cfg.hidden_act == "silu"  # HF also uses hidden_act as the KDA short-conv activation
    assert cfg.q_lora_rank is None and cfg.qk_rope_head_dim > 0 and not cfg.has_indexer
    hf = mod.KimiLinearConfig(
        **raw,
        # Not derived by KimiLinearConfig: its default num_key_value_heads is 32 (not None), so it is
        # not tied to num_attention_heads. MLA expands its latent to keys/values for every query head
        # (no GQA), and 4 // 32 = 0 key/value groups would break repeat_kv.
        num_key_value_heads=cfg.num_attention_heads,
        # The defaults are the 163840-token vocabulary's ids, outside our 512-token vocabulary
        # (pad_token_id becomes nn.Embedding's padding_idx).
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    hf._attn_implementation = "eager"
    hf._experts_implementation = "eager"
    return hf


def _to_hf_state_dict(weights: dict, cfg) -> dict:
    """Our canonical parameters -> transformers' KimiLinearForCausalLM state dict (fp32).
    Every canonical tensor must be consumed exactly once."""
    w = {k: v.to(torch.float32).clone() for k, v in weights.items()}  # never alias the loaded weights
    used: set[str] = set()

    def take(name):
        used.add(name)
        return w[name]

    sd = {}
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        sd[name] = take(name)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            sd[p + n] = take(p + n)
        a = p + "self_attn."
        if cfg.layer_kind(i) == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj", "o_norm"):
                sd[a + n + ".weight"] = take(a + n + ".weight")
            # three [P, K] depthwise convs -> one nn.Conv1d over concat(q, k, v) channels: [3P, 1, K]
            sd[a + "conv1d.weight"] = torch.cat([take(a + f"{x}_conv1d.weight") for x in "qkv"], 0)[:, None, :]
            fg = a + "forget_gate."
            sd[fg + "f_a_proj.weight"] = take(a + "f_a_proj.weight")
            sd[fg + "f_b_proj.weight"] = take(a + "f_b_proj.weight")
            sd[fg + "dt_bias"] = take(a + "dt_bias")  # [P]
            sd[fg + "A_log"] = take(a + "A_log").reshape(1, 1, cfg.kda_num_heads, 1)  # [H] -> [1, 1, H, 1]
        else:
            for n in ("q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
                sd[a + n + ".weight"] = take(a + n + ".weight")
        if cfg.is_moe_layer(i):
            m, h = p + "block_sparse_moe.", p + "mlp."  # transformers names the MoE block `mlp`
            sd[h + "gate.weight"] = take(m + "gate.weight")  # [E, d]
            sd[h + "gate.e_score_correction_bias"] = take(m + "gate.e_score_correction_bias")  # [E]
            # KimiLinearExperts: gate_up_proj [E, 2I, d] = [w1 (gate); w3 (up)] along dim 1 (chunk(2)
            # gives gate first); down_proj [E, d, I] = w2.
            sd[h + "experts.gate_up_proj"] = torch.cat([take(m + "experts.w1.weight"),
                                                        take(m + "experts.w3.weight")], dim=1)
            sd[h + "experts.down_proj"] = take(m + "experts.w2.weight")
            for n in ("gate_proj", "up_proj", "down_proj"):
                sd[h + f"shared_experts.{n}.weight"] = take(m + f"shared_experts.{n}.weight")
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                sd[p + f"mlp.{n}.weight"] = take(p + f"mlp.{n}.weight")
    left = sorted(set(w) - used)
    assert not left, f"canonical parameters not mapped to transformers: {left}"
    return sd


# ---------------------------------------------------------------------------------- fixture

class _Setup:
    def __init__(self, cfg, weights, module, hf_model):
        self.cfg, self.weights, self.module, self.hf = cfg, weights, module, hf_model
        self._hf_cache: dict[tuple, torch.Tensor] = {}

    def hf_logits(self, tokens) -> torch.Tensor:
        key = tuple(int(t) for t in tokens)
        if key not in self._hf_cache:
            with torch.no_grad():
                out = self.hf(input_ids=torch.tensor([key]), use_cache=False)
            self._hf_cache[key] = out.logits[0].float()
        return self._hf_cache[key]

    def runtime(self) -> ReferenceRuntime:
        return ReferenceRuntime(self.module, self.weights, max_rows=512, max_requests=4)

    def check(self, ours, tokens, what):
        """Our logits rows for `tokens` vs transformers' forward of that prompt alone."""
        err = assert_close_rel(ours, self.hf_logits(tokens), TOL, what)
        print(f"{what}: rel err {err:.2e}")
        return err


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = get_preset(PRESET)
    path = init_weights(cfg, tmp_path_factory.mktemp("kimi_linear") / "ckpt", seed=SEED)
    ck = load_checkpoint(path)
    assert ck.config.replace(name=cfg.name) == cfg, "config.json did not round-trip through the loader"
    cfg = ck.config

    mod = _import_hf_torch_path()
    hf_cfg = _hf_config(mod, path / "config.json", cfg)
    torch.manual_seed(0)
    model = mod.KimiLinearForCausalLM(hf_cfg).to(torch.float32).eval()
    model.load_state_dict(_to_hf_state_dict(ck.weights, cfg), strict=True)
    assert all(p.dtype == torch.float32 for p in model.state_dict().values())

    module = build_module(cfg, BuildOptions(act_dtype="f32", latent_cache_dtype="f32"))
    return _Setup(cfg, ck.weights, module, model)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------- tests

def test_hf_config_matches(setup):
    """What KimiLinearConfig derives from our config.json equals our ModelConfig."""
    cfg, hf = setup.cfg, setup.hf.config
    kinds = {"full_attention": "mla", "linear_attention": "kda"}
    assert [kinds[t] for t in hf.layer_types] == [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    assert hf.mlp_layer_types == ["sparse" if cfg.is_moe_layer(i) else "dense"
                                  for i in range(cfg.num_hidden_layers)]
    assert hf.mlp_layer_types.index("sparse") == cfg.first_k_dense_replace
    assert (hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim) == \
        (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size)
    assert (hf.n_group, hf.topk_group) == (cfg.num_expert_group, cfg.topk_group)
    assert hf.routed_scaling_factor == cfg.routed_scaling_factor
    assert hf.norm_topk_prob is cfg.moe_renormalize is True
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.n_shared_experts) == \
        (cfg.num_experts, cfg.num_experts_per_token, cfg.num_shared_experts)
    assert (hf.moe_intermediate_size, hf.intermediate_size) == (cfg.moe_intermediate_size, cfg.intermediate_size)
    assert (hf.num_attention_heads, hf.num_key_value_heads) == (cfg.num_attention_heads, cfg.num_attention_heads)
    assert (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim) == \
        (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    assert (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers) == \
        (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers)
    assert hf.rms_norm_eps == cfg.rms_norm_eps and hf.hidden_act == cfg.hidden_act
    assert hf.tie_word_embeddings is cfg.tie_word_embeddings is False
    assert hf.max_position_embeddings == cfg.max_position_embeddings
    # the built modules really are the variant we mean
    layers = setup.hf.model.layers
    assert type(layers[cfg.full_attn_layers[0]].self_attn).__name__ == "KimiLinearAttention"
    assert type(layers[0].self_attn).__name__ == "KimiLinearDeltaAttention"
    assert type(layers[1].mlp).__name__ == "KimiLinearMoE" and type(layers[0].mlp).__name__ == "KimiLinearMLP"


def test_single_prefill(setup):
    tokens = _prompt(1, 40, setup.cfg.vocab_size)
    rt = setup.runtime()
    rt.add_request("a", 64)
    setup.check(rt.prefill({"a": tokens}), tokens, "prefill 40")


def test_ragged_batch_prefill(setup):
    """Two requests in one prefill step; the first spans two KDA chunks (72 > 64) and the packed batch
    crosses chunk boundaries mid-request, so any leakage between requests shows."""
    pa = _prompt(2, 72, setup.cfg.vocab_size)
    pb = _prompt(3, 29, setup.cfg.vocab_size)
    rt = setup.runtime()
    rt.add_request("a", 96)
    rt.add_request("b", 48)
    out = rt.prefill({"a": pa, "b": pb})
    assert out.shape == (len(pa) + len(pb), setup.cfg.vocab_size)
    setup.check(out[:len(pa)], pa, "ragged prefill, request a (72)")
    setup.check(out[len(pa):], pb, "ragged prefill, request b (29)")


def test_prefill_then_decode(setup):
    """Prefill the first N tokens, decode the rest one by one; rows vs transformers' full forward."""
    tokens, n = _prompt(4, 40, setup.cfg.vocab_size), 32
    rt = setup.runtime()
    rt.add_request("a", 64)
    rows = [rt.prefill({"a": tokens[:n]})]
    for t in tokens[n:]:
        rows.append(rt.decode({"a": t}))
    ref = setup.hf_logits(tokens)
    setup.check(rows[0], tokens[:n], "prefill 32 of 40")
    dec = torch.cat(rows[1:])
    err = assert_close_rel(dec, ref[n:], TOL, "decode steps 33..40")
    print(f"decode steps 33..40: rel err {err:.2e}")
    assert_close_rel(torch.cat(rows), ref, TOL, "prefill + decode, all rows")


def test_chunked_prefill_and_batched_decode(setup):
    """Request a: prefill in two chunks (the second over its cache, in the same step as request b's
    first chunk), then a and b decode together, then a alone."""
    V = setup.cfg.vocab_size
    pa, pb = _prompt(5, 44, V), _prompt(6, 21, V)
    rt = setup.runtime()
    rt.add_request("a", 64)
    rt.add_request("b", 64)
    ra = [rt.prefill({"a": pa[:17]})]
    out = rt.prefill({"a": pa[17:36], "b": pb[:15]})
    ra.append(out[:19])
    rb = [out[19:]]
    for ta, tb in zip(pa[36:], pb[15:]):
        out = rt.decode({"a": ta, "b": tb})
        ra.append(out[:1])
        rb.append(out[1:])
    for ta in pa[36 + len(pb) - 15:]:
        ra.append(rt.decode({"a": ta}))
    ra, rb = torch.cat(ra), torch.cat(rb)
    assert ra.shape[0] == len(pa) and rb.shape[0] == len(pb)
    setup.check(ra, pa, "chunked prefill 17+19 + decode, request a")
    setup.check(rb, pb, "prefill 15 + batched decode, request b")
