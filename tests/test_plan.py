"""Full-size planning without weights (issue 9): the SPEC §7 byte figures, DSA vs dense traffic,
parameter counts, per-rank weights and capacity, the sharding cost model, determinism, and every
configuration error (alone and all together)."""

from __future__ import annotations

import functools
import json

import pytest

from k31c.model.presets import get_preset
from k31c.plan import PlanConfigError, make_plan, plan_json, plan_options
from k31c.plan.memory import cache_bytes, capacity, kda_state_bytes, param_counts, weight_bytes
from k31c.plan.sharding_cost import prefill_sharding
from k31c.plan.traffic import decode_traffic, ir_context_bytes_per_token


@functools.lru_cache(maxsize=None)
def pro_plan():
    opts = plan_options("k31-pro", target="gb300", tp=8, dcp=8)
    return opts, make_plan(opts)


def problems_of(model="k31-tiny", **flags) -> list[str]:
    with pytest.raises(PlanConfigError) as e:
        plan_options(model, **flags)
    return e.value.problems


# ---- SPEC §7 figures -------------------------------------------------------------------------------
def test_cache_bytes_per_token_reproduce_spec_exactly():
    k3, k31 = get_preset("k3-pro"), get_preset("k31-pro")
    assert cache_bytes(k3, "fp8", "fp8")["per_token"] == 13_824
    assert cache_bytes(k31, "fp8", "fp8")["per_token"] == 16_992
    assert cache_bytes(k31, "nvfp4", "mxfp4")["per_token"] == 10_080
    assert cache_bytes(k31, "fp8", "fp8")["full_attention_layers"] == 24
    per_layer = {f: cache_bytes(k31, f, "fp8")["latent_per_layer"] for f in ("bf16", "fp8", "nvfp4")}
    assert per_layer == {"bf16": 1152, "fp8": 576, "nvfp4": 352}
    assert [cache_bytes(k31, "fp8", k)["index_key_per_layer"] for k in ("fp8", "mxfp4")] == [132, 68]


def test_mxfp4_keys_shrink_the_key_cache_by_48_5_percent():
    _, plan = pro_plan()
    assert round(plan["cache"]["mxfp4_key_shrink"] * 100, 1) == 48.5
    assert plan["cache"]["per_token"] == 16_992 and plan["cache"]["per_token_per_rank"] == 16_992 / 8
    assert plan["cache"]["latent_only_per_token"] == 13_824


def test_ir_op_costs_read_the_same_bytes_per_context_token():
    assert ir_context_bytes_per_token(get_preset("k31-pro")) == {"mla_attention_dense": 576, "indexer_topk": 132}


def test_dsa_decode_reads_tend_to_132_over_576_of_dense():
    opts, plan = pro_plan()
    dt = plan["decode_traffic"]
    assert dt["dsa_over_dense_limit"] == 132 / 576 and dt["dsa_over_dense_limit_text"] == "132/576"
    ratios = [r["dsa_over_dense"] for r in dt["per_request_per_step"]]
    assert ratios == sorted(ratios, reverse=True) and ratios[0] > 1  # at L = top-k DSA reads more than dense
    assert all(r > 132 / 576 for r in ratios)
    far = decode_traffic(opts, [2**30])["per_request_per_step"][0]["dsa_over_dense"]
    assert abs(far - 132 / 576) < 1e-5
    row = dt["per_request_per_step"][-1]
    assert row["context"] == 1_048_576
    assert row["dense_mla_bytes"] == 24 * 1_048_576 * 576
    assert row["dsa_bytes"] == 24 * (1_048_576 * 132 + 2048 * 576)


def test_parameter_counts_match_k3():
    k3 = param_counts(get_preset("k3-pro"))
    assert abs(k3["total"] / 2.78e12 - 1) < 0.005, k3["total"]
    assert abs(k3["active"] / 104e9 - 1) < 0.01, k3["active"]
    assert k3["active_with_embedding"] - k3["active"] == 163840 * 7168
    k31 = param_counts(get_preset("k31-pro"))
    assert k31["total"] > k3["total"] and k31["routed_experts"] == k3["routed_experts"]


# ---- weights, state, memory, capacity ----------------------------------------------------------------
def test_weights_per_rank_follow_the_shard_annotations():
    cfg = get_preset("k31-pro")
    one, eight = weight_bytes(cfg, 1, 1), weight_bytes(cfg, 8, 8)
    assert one["per_rank_bytes"] == one["model_bytes"]
    assert eight["per_rank_by_shard"]["expert"] * 8 == one["per_rank_by_shard"]["expert"]
    for shard in ("col", "row", "heads"):
        assert eight["per_rank_by_shard"][shard] * 8 == one["per_rank_by_shard"][shard]
    assert eight["per_rank_by_shard"]["rep"] == one["per_rank_by_shard"]["rep"]
    n_expert = 3 * 92 * 896 * 3072 * 3584  # w1, w2, w3 over 92 MoE layers
    assert one["model_by_format"]["mxfp4"] == n_expert // 2 + n_expert // 32


def test_kda_state_per_request():
    k = kda_state_bytes(get_preset("k31-pro"), 8)
    assert k["kda_layers"] == 69 and k["state_per_layer"] == 96 * 128 * 128 * 4
    assert k["conv_per_layer"] == 3 * 3 * 96 * 128 * 4
    assert k["per_request_per_rank"] * 8 == k["per_request"]


def test_memory_and_capacity_for_gb300_tp8_dcp8():
    opts, plan = pro_plan()
    mem = plan["memory"]
    parts = mem["weights_bytes"] + mem["activations_bytes"] + mem["workspace_bytes"] + mem["reserve_bytes"]
    assert mem["free_for_cache_bytes"] == mem["capacity_bytes"] - parts > 0
    by = {r["dcp"]: r for r in plan["capacity"]["by_dcp"]}
    assert sorted(by) == [1, 2, 4, 8] and plan["capacity"]["chosen"] == by[8]
    assert by[8]["cache_bytes_per_token_per_rank"] == 16_992 / 8
    assert by[8]["tokens"] > 7 * by[1]["tokens"]  # each rank stores 1/8 of the tokens
    assert by[8]["concurrent_contexts"] >= 8 * by[1]["concurrent_contexts"] >= 8
    c = by[8]
    state = kda_state_bytes(opts.cfg, 8)["per_request_per_rank"]
    assert c["bytes_per_context_per_rank"] == 1_048_576 // 8 * 16_992 + state
    assert c["concurrent_contexts"] == c["free_for_cache_bytes"] // c["bytes_per_context_per_rank"]


def test_prefill_sharding_crossover():
    opts, plan = pro_plan()
    fresh = plan["prefill_sharding"]["fresh_prompt"]
    assert fresh["rows"][0]["choice"] == "head" and fresh["rows"][-1]["choice"] == "token"
    x = fresh["crossover_tokens"]
    assert 64 < x < 65536
    at = {r["tokens"]: r for r in prefill_sharding(opts, sizes=(x - 1, x))["rows"]}
    assert at[x - 1]["choice"] == "head" and at[x]["choice"] == "token"
    assert plan["prefill_sharding"]["after_context"]["crossover_tokens"] < x  # long context: indexer dominates
    k3 = prefill_sharding(plan_options("k3-pro", target="gb300", tp=8, dcp=8))
    assert k3["crossover_tokens"] is None  # dense MLA: nothing replicated to save
    assert prefill_sharding(plan_options("k31-tiny"))["note"].startswith("TP = 1")


# ---- plan dict: hooks, determinism, config.json ---------------------------------------------------
def test_kernel_section_hook():
    opts, plan = pro_plan()
    assert plan["kernels"] == {"selected": False, "note": "kernels: not selected (compile selects them)"}
    ks = [{"name": "b", "op": "linear", "cache": "hit"}, {"name": "a", "op": "kda", "cache": "miss"}]
    sec = make_plan(plan_options("k31-tiny"), kernel_list=ks)["kernels"]
    assert sec["selected"] and [k["name"] for k in sec["kernels"]] == ["a", "b"]
    assert sec["cache_hits"] == 1 and sec["cache_misses"] == 1
    tpu = make_plan(plan_options("k31-pro", target="tpu-v7x", tp=16, dcp=16), kernel_list=ks)
    assert tpu["kernels"] == {"selected": False, "note": "plan only: no kernel backend for tpu-v7x"}
    assert any("plan only" in n for n in tpu["notes"])
    assert any("routed experts MXFP4: tpu-v7x has no native MXFP4" in n for n in tpu["notes"])


def test_plan_json_is_deterministic_and_round_trips():
    opts, plan = pro_plan()
    text = plan_json(plan)
    assert plan_json(make_plan(plan_options("k31-pro", target="gb300", tp=8, dcp=8))) == text
    assert json.loads(text) == plan


def test_plan_from_config_json_alone(tmp_path):
    cfg = get_preset("k31-pro")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": cfg.to_hf(), "model_type": "kimi_k3"}))
    opts = plan_options(str(path), target="gb300", tp=8, dcp=8)
    assert opts.cfg.digest() == cfg.digest()
    assert plan_options(str(tmp_path), target="gb300", tp=8, dcp=8).cfg.digest() == cfg.digest()


def test_emulated_formats_are_stated():
    opts = plan_options("k31-tiny", target="cpu", latent_cache="nvfp4", key_cache="mxfp4")
    assert opts.emulated_formats() == ["latent cache nvfp4", "index-key cache mxfp4"]
    notes = make_plan(opts)["notes"]
    assert any("emulated exactly on cpu" in n for n in notes)
    h = make_plan(plan_options("k31-tiny", target="h200", latent_cache="nvfp4", emulate_formats=True))
    assert any("nvfp4: emulated on h200" in n and "--emulate-formats" in n for n in h["notes"])
    assert not any("routed experts" in n for n in h["notes"])  # k31-tiny experts are bf16


# ---- configuration errors ------------------------------------------------------------------------
def test_tp_must_divide_heads_and_experts():
    p = problems_of(tp=3)
    assert any("KDA heads" in x for x in p) and any("MLA heads" in x for x in p)
    assert any("--ep 3 does not divide the 16 routed experts" in x for x in p)


def test_layout_relations():
    assert any("--dcp 4 does not divide --tp 2" in x for x in problems_of(tp=2, dcp=4))
    assert any("--ep 4 does not divide --tp 2" in x for x in problems_of(tp=2, ep=4))
    assert any("exceeds h200's scale-up domain of 8" in x for x in problems_of("k31-pro", target="h200", tp=16))


def test_formats_the_target_cannot_run():
    p = problems_of(target="h200", latent_cache="nvfp4", key_cache="mxfp4")
    assert any("--latent-cache nvfp4: h200 has no native NVFP4" in x for x in p)
    assert any("--key-cache mxfp4: h200 has no native MXFP4" in x for x in p)
    assert any("--latent-cache 'int8' is not one of" in x for x in problems_of(latent_cache="int8"))
    plan_options("k31-tiny", target="b200", latent_cache="nvfp4", key_cache="mxfp4")  # native there


def test_plans_that_do_not_fit_name_the_component_and_amount():
    (w,) = problems_of("k31-pro", target="h200", tp=8)
    assert "does not fit on h200" in w and "weights 193.22 GiB" in w and "exceeds" in w and "by 63.80 GiB" in w
    (c,) = problems_of("k31-pro", target="gb300", tp=8, dcp=1, max_requests=1000)
    assert "1,048,576-token context" in c and "KDA state" in c and "short by" in c


def test_context_longer_than_the_model():
    assert any("longer than the model's max_position_embeddings 4096" in x for x in problems_of(max_context=5000))


def test_every_problem_is_reported_together():
    p = problems_of("k31-pro", target="h100", tp=5, dcp=3, ep=7, latent_cache="nvfp4", key_cache="mxfp4",
                    max_context=2_000_000, block_size=48)
    joined = "\n".join(p)
    for want in ("--dcp 3 does not divide --tp 5", "--ep 7 does not divide --tp 5", "power of two",
                 "KDA heads", "MLA heads", "no native NVFP4", "no native MXFP4", "longer than the model's",
                 "does not fit on h100"):
        assert want in joined, want
    assert len(p) == 9


def test_unknown_model_and_target_together():
    p = problems_of("k99", target="h300")
    assert any("presets:" in x and "k31-pro" in x for x in p)
    assert any("unknown target 'h300'" in x and "gb300" in x for x in p)
