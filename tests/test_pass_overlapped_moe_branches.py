"""passes/overlapped_moe_branches.py: on k31-tiny after the fusions it follows, every latent MoE layer of the
decode and verify functions gets its router (fused.routed_linear) on the side stream beside the node after it,
and its shared-expert down projection moved just before the experts and put on the side stream; prefill is
left alone; a router whose next node reads it stays on the main stream; numerics equal to the unfused model;
the text round trip and the verifier (which accepts `overlap` on any op, as a string only)."""

from __future__ import annotations

import pytest

from ir.parser import parse_module
from ir.printer import print_module
from ir.verifier import VerifyError, verify
from passes.base import PassContext
from passes.pipeline import pass_names, run_pipeline
from tests.conftest import tiny_model
from tests.test_pass_pipeline import assert_same_numerics, copy_module, expected_counts, layer_counts, rewritten

NAME = "overlapped_moe_branches"
UPSTREAM = ("widening_cast_fold", "router_epilogue", "glu_epilogue", "latent_moe_tail")


def _producer(fn, v):
    return next(n for n in fn.nodes if any(o is v for o in n.outputs))


def _reads(node, other) -> bool:
    return any(v is o for v in node.inputs for o in other.outputs)


def _check_layers(fn) -> int:
    """Asserts the rewrite on every MoE layer of `fn`; returns the number of layers checked."""
    layers = 0
    for i, experts in enumerate(fn.nodes):
        if experts.op != "moe_experts":
            continue
        router = _producer(fn, experts.inputs[2])
        assert router.op == "fused.routed_linear" and router.attrs["overlap"] == "moe_latent_proj"
        assert not _reads(fn.nodes[fn.nodes.index(router) + 1], router)
        down = fn.nodes[i - 1]
        assert down.op == "linear" and down.attrs["overlap"] == "moe_experts" and not _reads(experts, down)
        tail = next(n for n in fn.nodes[i + 1:] if n.op == "fused.latent_moe_tail")
        assert tail.inputs[-1] is down.outputs[0]
        layers += 1
    return layers


def test_k31_tiny_decode_and_verify_layers_and_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", *UPSTREAM, NAME)
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 4 * layer_counts(cfg)["moe"]
    for fn in m.functions.values():
        marked = [n for n in fn.nodes if "overlap" in n.attrs]
        if fn.attrs["kind"] == "prefill":
            assert not marked, "prefill must keep one stream"
        else:
            assert _check_layers(fn) == layer_counts(cfg)["moe"] and len(marked) == 2 * layer_counts(cfg)["moe"]
    assert_same_numerics(m)


def test_running_twice_changes_nothing():
    m, _ = rewritten("k31-tiny", *UPSTREAM, NAME)
    before = [(n.op, [o.name for o in n.outputs]) for n in m.function("decode").nodes]
    ctx = PassContext()
    run_pipeline(m, ctx, disable=tuple(p for p in pass_names() if p != NAME))
    assert ctx.counters[NAME] == 0
    assert [(n.op, [o.name for o in n.outputs]) for n in m.function("decode").nodes] == before


def test_router_followed_by_its_reader_stays_on_the_main_stream():
    m, _ = rewritten("k31-tiny", *UPSTREAM)
    fn = m.function("decode")
    experts = next(n for n in fn.nodes if n.op == "moe_experts")
    router = _producer(fn, experts.inputs[2])
    fn.nodes.remove(router)
    fn.nodes.insert(fn.nodes.index(experts), router)   # now the experts read the routing right after it
    verify(m)
    ctx = PassContext()
    run_pipeline(m, ctx, disable=tuple(p for p in pass_names() if p != NAME))
    cfg = tiny_model("k31-tiny")[0]
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] - 1
    assert "overlap" not in router.attrs
    assert fn.nodes[fn.nodes.index(experts) - 1].attrs["overlap"] == "moe_experts"  # its down still moved


def test_kimi_linear_experts_read_right_after_the_router():
    assert rewritten("kimi-linear-tiny", *UPSTREAM, NAME)[1].counters[NAME] == 0


def test_overlap_is_a_string_scheduling_attribute_of_any_op():
    m = copy_module(tiny_model("k31-tiny")[1])
    node = next(n for n in m.function("decode").nodes if n.op == "linear")
    node.attrs["overlap"] = "moe_experts"
    verify(m)
    text_module = parse_module(print_module(m))
    assert next(n for n in text_module.function("decode").nodes if n.op == "linear").attrs["overlap"] == "moe_experts"
    node.attrs["overlap"] = 1
    with pytest.raises(VerifyError, match="overlap"):
        verify(m)
