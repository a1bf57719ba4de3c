"""The whole fusion pipeline on k31-tiny, k3-tiny and kimi-linear-tiny: the verifier passes after every
pass, the text IR round-trips, every pass fires as often as the config says, and prefill, decode and
verify give the unfused graph's logits and caches. Also the helpers the per-pass tests share (one
scenario through the reference runtime, Before/Expected text comparison)."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from ir.core import Module
from ir.parser import parse_module
from ir.printer import print_module
from ir.verifier import verify
from k31c.runtime.reference import ReferenceRuntime
from passes.base import PassContext
from passes.pipeline import pass_names, run_pipeline
from tests.conftest import tiny_model
from tests.helpers import assert_close_rel

ENTRY = ("prefill", "decode", "verify")


# ---- helpers shared by tests/test_pass_*.py ------------------------------------------------------
def copy_module(m: Module) -> Module:
    return parse_module(print_module(m))


def run_pass_on_text(name: str, text: str) -> tuple[Module, PassContext]:
    """Parse `text`, verify it, run pass `name`, verify again; returns (module, ctx)."""
    m = parse_module(text)
    verify(m)
    ctx = PassContext()
    importlib.import_module(f"passes.{name}").run(m, ctx)
    verify(m)
    return m, ctx


def assert_ir(m: Module, expected: str):
    """The module prints exactly as the Expected text (normalised by parse + print), and round-trips."""
    text = print_module(m)
    assert text == print_module(parse_module(expected)), f"IR after the pass:\n{text}"
    assert print_module(parse_module(text)) == text


def assert_rewrites(name: str, before: str, expected: str, count: int) -> Module:
    """Pass `name` on the Before text fires `count` times and leaves exactly the Expected text; the module."""
    m, ctx = run_pass_on_text(name, before)
    assert ctx.counters[name] == count
    assert_ir(m, expected)
    return m


def assert_equal_results(before_text: str, after: Module, weights: dict, inputs: dict, fn: str = "decode"):
    """The rewritten module gives the original text's results bit for bit in the reference interpreter."""
    from ir.interpreter import Interpreter

    before = Interpreter(parse_module(before_text), weights).run(fn, inputs)
    got = Interpreter(after, weights).run(fn, inputs)
    assert len(got) == len(before) and all(torch.equal(a, b) for a, b in zip(got, before))


def _scenario(module: Module, weights) -> dict[str, torch.Tensor]:
    """Two requests: prefill of 20 and 6 tokens (request a's context exceeds the tiny index_topk 16, so
    the indexer selects), one decode step, one verify step of 4 and 2 drafts. Logits of every step and
    the final pools. Runs single-threaded: the tiny model's ops are far too small for a thread pool, which
    on a shared 2-core CI machine costs ~10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_scenario(module, weights)
    finally:
        torch.set_num_threads(threads)


def _run_scenario(module: Module, weights) -> dict[str, torch.Tensor]:
    vocab = int(module.function("prefill").outputs[0].type.shape[1])
    g = torch.Generator().manual_seed(1234)
    a, b = torch.randint(0, vocab, (25,), generator=g).tolist(), torch.randint(0, vocab, (9,), generator=g).tolist()
    rt = ReferenceRuntime(module, weights, max_rows=64, max_requests=2)
    rt.add_request("a", 32)
    rt.add_request("b", 16)
    out = {"prefill": rt.prefill({"a": a[:20], "b": b[:6]}),
           "decode": rt.decode({"a": a[20], "b": b[6]}),
           "verify": rt.verify({"a": a[21:25], "b": b[7:9]})}
    out.update({f"pool {k}": v for k, v in rt.pools.items()})
    return out


@functools.lru_cache(maxsize=None)
def reference_scenario(preset: str) -> dict[str, torch.Tensor]:
    _, module, weights = tiny_model(preset)
    return _scenario(module, weights)


def assert_same_numerics(module: Module, preset: str = "k31-tiny"):
    """prefill/decode/verify logits and final pools of `module` equal the unfused model's (bitwise, or
    rel < 1e-6 for floats)."""
    expected = reference_scenario(preset)
    actual = _scenario(module, tiny_model(preset)[2])
    for key, exp in expected.items():
        got = actual[key]
        if torch.equal(got, exp):
            continue
        assert got.is_floating_point(), f"{preset} {key}: integer/FP8 results differ"
        assert_close_rel(got.double(), exp.double(), 1e-6, f"{preset} {key}")


def rewritten(preset: str, *names: str, verify_each: bool = True) -> tuple[Module, PassContext]:
    """A copy of the preset's module after packed_projection and the passes `names` (pipeline order),
    verified after every pass; returned as parsed back from its text form, which must round-trip."""
    module = copy_module(tiny_model(preset)[1])
    ctx = PassContext()
    keep = {"packed_projection", *names}
    run_pipeline(module, ctx, disable=tuple(p for p in pass_names() if p not in keep), verify_each=verify_each)
    text = print_module(module)
    parsed = parse_module(text)
    assert print_module(parsed) == text, "the rewritten module's text does not round-trip"
    return parsed, ctx


def layer_counts(cfg) -> dict[str, int]:
    layers = range(cfg.num_hidden_layers)
    return {"mla": sum(cfg.layer_kind(i) == "mla" for i in layers),
            "kda": sum(cfg.layer_kind(i) == "kda" for i in layers),
            "moe": sum(cfg.is_moe_layer(i) for i in layers)}


def expected_counts(cfg) -> dict[str, int]:
    """How often each fusion fires on a built model (three entry functions; decode-only passes two)."""
    n = layer_counts(cfg)
    indexed = 3 * n["mla"] if cfg.has_indexer else 0
    mixes = 2 * cfg.num_hidden_layers if cfg.uses_attn_res else 0  # layer 0 has no attn_in mix; + output mix
    tail = cfg.has_latent_moe and cfg.latent_moe_use_norm and cfg.num_shared_experts > 0
    return {"fused_indexer_front": indexed, "overlapped_mla_query": indexed, "fused_indexer_select": indexed,
            "value_gate": 2 * n["mla"] if cfg.mla_use_output_gate else 0,
            "query_absorption": 2 * n["mla"] if cfg.has_indexer else 0,  # decode, verify: beside the indexer
            "latent_moe_tail": 3 * n["moe"] if tail else 0,
            "attn_res_fusion": 3 * mixes,
            "embedding_norm": 3,  # the embedding and layer 0's input norm, every entry
            "kda_decode_fusion": 2 * n["kda"],
            "widening_cast_fold": 3 * (n["moe"] + 1),  # bf16 activations: each router's logits + the LM head
            "router_epilogue": 3 * n["moe"],
            "glu_epilogue": 3 * sum(not cfg.is_moe_layer(i) or cfg.num_shared_experts > 0
                                    for i in range(cfg.num_hidden_layers)),  # dense MLP or shared expert
            # decode and verify: each latent MoE layer's z out of its pack; its router, shared GLU and down
            "moe_expert_input_split": 2 * n["moe"] if cfg.has_latent_moe and cfg.num_shared_experts > 0 else 0,
            "overlapped_moe_branches": 2 * n["moe"] * 3 if cfg.has_latent_moe and tail else 0}


# ---- the whole pipeline --------------------------------------------------------------------------
FUSED_OPS = {"fused_indexer_front": "fused.indexer_front", "overlapped_mla_query": "fused.mla_query",
             "fused_indexer_select": "fused.indexer_select", "value_gate": "fused.value_gate",
             "latent_moe_tail": "fused.latent_moe_tail", "attn_res_fusion": "fused.attn_res_mix_norm",
             "kda_decode_fusion": "fused.kda_decode", "glu_epilogue": "fused.packed_linear_glu",
             "widening_cast_fold": "fused.widened_linear", "router_epilogue": "fused.routed_linear",
             "embedding_norm": "fused.embedding_rms_norm"}
ABSORBED_BY = {"widening_cast_fold": "router_epilogue"}  # a later fusion nests these nodes in its own


@pytest.mark.parametrize("preset", ["k31-tiny", "k3-tiny", "kimi-linear-tiny"])
def test_whole_pipeline(preset):
    cfg = tiny_model(preset)[0]
    module = copy_module(tiny_model(preset)[1])
    ctx = PassContext()
    result = run_pipeline(module, ctx, verify_each=True)
    assert [r.name for r in result.records] == pass_names()
    verify(module)
    counts = expected_counts(cfg)
    for name, count in counts.items():
        assert ctx.counters[name] == count, f"{preset}: {name} fired {ctx.counters[name]} times, expected {count}"
        if name not in FUSED_OPS:
            continue  # a scheduling pass: annotations, no fused op
        top_level = sum(n.op == FUSED_OPS[name] for f in module.functions.values() for n in f.nodes)
        left = count - counts.get(ABSORBED_BY.get(name), 0)
        assert top_level == left, f"{preset}: {top_level} top-level {FUSED_OPS[name]} nodes, expected {left}"
    text = print_module(module)
    parsed = parse_module(text)
    assert print_module(parsed) == text
    assert_same_numerics(parsed, preset)  # the text form runs, and gives the unfused model's numbers


def test_pipeline_order_is_documented():
    """The parallel-layout passes come first (fusions then see per-rank shapes); every fusion pass is in the
    pipeline once, after packed_projection, and has the documented module-level interface (NAME, FUSED_OP,
    run, a docstring with pattern/preconditions/postconditions)."""
    names = pass_names()
    assert names[:4] == ["shard_tp", "shard_ep", "shard_tokens", "shard_dcp"] and len(set(names)) == len(names)
    for name, op in FUSED_OPS.items():
        assert names.index("packed_projection") < names.index(name)
        mod = importlib.import_module(f"passes.{name}")
        assert mod.NAME == name and mod.FUSED_OP == op and callable(mod.run)
        for word in ("Pattern", "Precondition", "Postcondition", "a.operands"):
            assert word in mod.__doc__, f"passes/{name}.py docstring lacks {word!r}"
