"""Full-size planning without weights: memory, capacity, traffic and layout choices for a model on a
target (issue 9; DESIGN §5 T1–T5, T7, T13). Input is a preset or a `config.json` alone.

    opts = plan_options("k31-pro", target="gb300", tp=8, dcp=8)   # or resolve_plan_options(argparse args)
    plan = make_plan(opts, kernel_list=None)                      # plain dict, JSON-serialisable
    plan_json(plan)                                               # deterministic text (plan.json)
    format_plan(plan)                                             # readable tables (k31c explain)

Plan keys (bytes are integers unless stated; "per rank" = one of the `tp` ranks of the instance):

- `schema`: "k31c-plan/1".
- `flags`: the resolved flags (model, target, tp, dcp, ep, latent_cache, key_cache, kda_state,
  max_context, max_batched_tokens, max_requests, block_size, emulate_formats) and `defaulted` (the
  flags the user did not give).
- `model`: name, source, config_digest (`ModelConfig.digest()`), layers, full_attention_layers,
  kda_layers, has_indexer, max_position_embeddings, experts_format.
- `target`: name, description, source, memory_bytes, hbm_bandwidth, peak_flops {format: FLOP/s},
  measured, native_formats, link_bandwidth (per direction), scaleup_size, topology, compute_units,
  compute_unit_kind, core_kinds, backends, plan_only, estimates.
- `layout`: tp, dcp, ep, world (= tp) and the rule enforced.
- `formats`: latent_cache, key_cache (null without indexer), kda_state, experts, emulated [str].
- `parameters`: total, routed_experts, active (non-routed params except the input embedding table +
  k/E of the routed experts), active_with_embedding, embedding, experts, experts_per_token.
- `weights`: per_rank_bytes, per_rank_by_format {bf16, f32, mxfp4}, per_rank_by_shard {col, row,
  heads, expert, rep}, model_bytes, model_by_format.
- `cache`: latent_per_layer, index_key_per_layer, per_layer, full_attention_layers, per_token (all
  full-attention layers), per_token_per_rank (/ dcp, float), latent_only_per_token, mxfp4_key_shrink
  (fraction, indexer only), table [{latent, key, per_layer, per_token, chosen, on_target: native |
  emulated | not native}].
- `kda_state`: kda_layers, state_per_layer, conv_per_layer, per_request, per_request_per_rank.
- `memory` (per rank): capacity_bytes, weights_bytes, activations_bytes, activations_per_token_bytes,
  activation_breakdown, workspace_bytes, workspaces {name: bytes}, reserve_bytes, reserves
  {name: bytes}, free_for_cache_bytes (the assumed reserves are named constants in `memory.py`).
- `capacity`: chosen and by_dcp [for every dcp dividing tp]: {tp, dcp, free_for_cache_bytes,
  cache_bytes_per_token_per_rank, tokens, state_slots_reserved, context_tokens,
  bytes_per_context_per_rank, concurrent_contexts}.
- `decode_traffic`: per_request_per_step [{context, dense_mla_bytes, dsa_bytes, dsa_index_key_bytes,
  dsa_latent_bytes, dsa_over_dense, dsa_bytes_per_rank}], full_attention_layers,
  latent_bytes_per_token_per_layer, index_key_bytes_per_token_per_layer, kda_state_bytes_per_step(,
  _per_rank), dsa_over_dense_limit (float) and dsa_over_dense_limit_text ("132/576").
- `prefill_sharding`: fresh_prompt (and after_context when max_context > 256K): {tp,
  context_before_chunk, rows [{tokens, head_ms, token_ms, choice, head_flops, head_bytes, token_flops,
  token_bytes, all_to_all_bytes} — per rank, all MLA layers],
  crossover_tokens (null: head sharding always wins), all_to_all_latency_s, indexer_query_tile}.
- `kernels`: {selected, note} and, when codegen passed its list, count, cache_hits, cache_misses,
  heuristic, fallbacks, kernels [{name, op, family, backend, config, cache}].
- `notes`: [str] — plan-only targets, emulated formats, estimates, sizing assumptions.
"""

from .memory import fit_problems
from .options import (PlanConfigError, PlanOptions, add_plan_args, load_model_config, plan_options,
                      resolve_plan_options)
from .report import PLAN_SCHEMA, format_plan, kernels_section, make_plan, plan_json

__all__ = ["PLAN_SCHEMA", "PlanConfigError", "PlanOptions", "add_plan_args", "fit_problems", "format_plan",
           "kernels_section", "load_model_config", "make_plan", "plan_json", "plan_options", "resolve_plan_options"]
