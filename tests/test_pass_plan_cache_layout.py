"""passes/plan_cache_layout.py: the packed cache row planned from the per-rank IR pools and recorded as the
module attribute `cache_layout` (plan.json's section), against the memory planner's layout
(`plan_block_layout` from the config) at TP 1 and 2, for every cache format; the graph is unchanged;
flat pools get no plan; pools that disagree between entry functions are refused by name; the text form
keeps the plan; the runtime allocates the planned row, honouring a non-default alignment."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ir.parser import parse_module
from ir.printer import print_module
from k31c.model.build import BuildOptions, build_module
from k31c.model.presets import get_preset
from k31c.runtime.block_layout import BlockLayout, plan_block_layout
from k31c.runtime.reference import ReferenceRuntime
from passes import plan_cache_layout, shard_tp
from passes.base import PassContext, PassError

CFG = get_preset("k31-tiny")
PLAN_LATENT = {"f8e4m3": "fp8", "nvfp4": "nvfp4", "bf16": "bf16"}


def _module(latent="f8e4m3", key="fp8", view="blocks", block=4, cfg=CFG):
    return build_module(cfg, BuildOptions(block_size=block, latent_cache_dtype=latent, key_cache=key, pool_view=view))


def _without_plan(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("  attr cache_layout"))


@pytest.mark.parametrize("latent,key", [("f8e4m3", "fp8"), ("nvfp4", "mxfp4"), ("bf16", "fp8")])
def test_plan_equals_memory_planner_and_graph_is_unchanged(latent, key):
    m = _module(latent, key)
    before = print_module(m)
    ctx = PassContext()
    assert plan_cache_layout.run(m, ctx) == 1 and ctx.counters["plan_cache_layout"] == 1
    assert _without_plan(print_module(m)) == _without_plan(before)
    planned = json.loads(m.attrs["cache_layout"])
    assert planned == plan_block_layout(CFG, 4, PLAN_LATENT[latent], key).to_json()
    assert planned["block_size"] == 4 and planned["row_bytes"] % 128 == 0
    assert planned["bytes_per_token"] == sum(p["bytes_per_token"] for p in planned["pages"])


def test_plan_is_per_rank_after_tensor_parallel_sharding():
    m = _module()
    ctx = PassContext(options={"tp": 2})
    shard_tp.run(m, ctx)
    plan_cache_layout.run(m, ctx)
    planned = json.loads(m.attrs["cache_layout"])
    assert planned == plan_block_layout(CFG, 4, "fp8", "fp8", tp=2).to_json()
    assert planned["kda_state"]["heads_per_rank"] == CFG.kda_num_heads // 2 and planned["tp"] == 2


def test_flat_pools_get_no_plan():
    m = _module(view="flat")
    assert plan_cache_layout.run(m, PassContext()) == 0 and "cache_layout" not in m.attrs


def test_entry_functions_with_different_pools_are_refused():
    m = _module()
    fn = m.function("decode")
    v = fn.input("latent.3")
    v.type = dataclasses.replace(v.type, shape=(v.type.shape[0], v.type.shape[1], v.type.shape[2] + 1))
    with pytest.raises(PassError, match=r"@decode and @\w+ take different cache pools: %latent.3"):
        plan_cache_layout.run(m, PassContext())


def test_plan_survives_the_text_form_and_json():
    m = _module()
    plan_cache_layout.run(m, PassContext())
    parsed = parse_module(print_module(m))
    assert parsed.attrs["cache_layout"] == m.attrs["cache_layout"]
    d = json.loads(parsed.attrs["cache_layout"])
    assert BlockLayout.from_json(d).to_json() == d


def test_runtime_allocates_the_planned_row_with_its_alignment():
    from k31c.model.init_weights import random_weights

    w = random_weights(CFG, 0)
    m = _module()
    plan_cache_layout.run(m, PassContext(options={"cache_alignment": 256}))
    planned = json.loads(m.attrs["cache_layout"])
    assert planned["alignment"] == 256 and planned["row_bytes"] % 256 == 0
    assert planned["row_bytes"] != plan_block_layout(CFG, 4, "fp8", "fp8").row_bytes  # 128-B pages pack tighter
    rt = ReferenceRuntime(m, w, max_rows=32, max_requests=2)
    assert rt.layout_source == "the module's planned cache_layout (plan.json)"
    assert rt.block_pool.layout.to_json() == planned and rt.block_pool.rows.shape[1] == planned["row_bytes"]
    # a module without a plan: the runtime lays out its pools itself, and says so
    rt2 = ReferenceRuntime(_module(), w, max_rows=32, max_requests=2)
    assert rt2.layout_source.startswith("derived from the IR pools")
