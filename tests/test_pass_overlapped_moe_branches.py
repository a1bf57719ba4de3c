"""passes/overlapped_moe_branches.py: on k31-tiny after the passes it follows, every latent MoE layer of the
decode and verify functions gets the router, the shared expert's GLU and its down projection put on the side
stream ahead of z's own linear (main stream: z -> experts -> tail); prefill is left alone; a layer whose z is
still packed (moe_expert_input_split disabled) keeps the earlier schedule (router beside the next node, shared
down beside the experts); numerics equal to the unfused model; the text round trip and the verifier (which
accepts `overlap` on any op, as a string only)."""

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
UPSTREAM = ("moe_expert_input_split", "widening_cast_fold", "router_epilogue", "glu_epilogue", "latent_moe_tail")


def _producer(fn, v):
    return next(n for n in fn.nodes if any(o is v for o in n.outputs))


def _reads(node, other) -> bool:
    return any(v is o for v in node.inputs for o in other.outputs)


def _check_layers(fn) -> int:
    """Asserts the split schedule on every MoE layer of `fn`; returns the number of layers checked."""
    layers = 0
    for experts in [n for n in fn.nodes if n.op == "moe_experts"]:
        i = fn.nodes.index(experts)
        z_linear = _producer(fn, experts.inputs[0])
        shared, down = fn.nodes[fn.nodes.index(z_linear) - 2:fn.nodes.index(z_linear)]
        router = _producer(fn, experts.inputs[2])
        assert z_linear.op == "linear" and "overlap" not in z_linear.attrs
        assert fn.nodes.index(router) < fn.nodes.index(shared) < fn.nodes.index(z_linear) < i
        assert router.op == "fused.routed_linear" and router.attrs["overlap"] == "moe_router"
        assert shared.op == "fused.packed_linear_glu" and shared.attrs["overlap"] == "moe_shared_expert"
        assert len(shared.attrs["splits"]) == 2 and shared.inputs[0] is z_linear.inputs[0]  # gate/up only, same x
        assert down.op == "linear" and down.attrs["overlap"] == "moe_shared_expert" and _reads(down, shared)
        tail = next(n for n in fn.nodes[i + 1:] if n.op == "fused.latent_moe_tail")
        assert tail.inputs[-1] is down.outputs[0]
        layers += 1
    return layers


def test_k31_tiny_decode_and_verify_layers_and_numerics():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", *UPSTREAM, NAME)
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 6 * layer_counts(cfg)["moe"]
    for fn in m.functions.values():
        marked = [n for n in fn.nodes if "overlap" in n.attrs]
        if fn.attrs["kind"] == "prefill":
            assert not marked, "prefill must keep one stream"
            packs = [n for n in fn.nodes if n.op == "fused.packed_linear_glu" and len(n.attrs["splits"]) == 3]
            assert len(packs) == layer_counts(cfg)["moe"], "prefill keeps z packed with the shared expert"
        else:
            assert _check_layers(fn) == layer_counts(cfg)["moe"] and len(marked) == 3 * layer_counts(cfg)["moe"]
    assert_same_numerics(m)


def test_running_twice_changes_nothing():
    m, _ = rewritten("k31-tiny", *UPSTREAM, NAME)
    before = [(n.op, [o.name for o in n.outputs]) for n in m.function("decode").nodes]
    ctx = PassContext()
    run_pipeline(m, ctx, disable=tuple(p for p in pass_names() if p != NAME))
    assert ctx.counters[NAME] == 0
    assert [(n.op, [o.name for o in n.outputs]) for n in m.function("decode").nodes] == before


def test_router_after_the_pack_moves_ahead_of_z():
    m, _ = rewritten("k31-tiny", *UPSTREAM)
    fn = m.function("decode")
    experts = next(n for n in fn.nodes if n.op == "moe_experts")
    router = _producer(fn, experts.inputs[2])
    fn.nodes.remove(router)
    fn.nodes.insert(fn.nodes.index(experts), router)   # the experts read the routing right after it
    verify(m)
    ctx = PassContext()
    run_pipeline(m, ctx, disable=tuple(p for p in pass_names() if p != NAME), verify_each=True)
    assert ctx.counters[NAME] == expected_counts(tiny_model("k31-tiny")[0])[NAME]
    assert _check_layers(fn) == layer_counts(tiny_model("k31-tiny")[0])["moe"]


def test_layer_without_the_split_keeps_the_earlier_schedule():
    """moe_expert_input_split disabled: z stays packed with the shared expert's GLU, the router goes beside the
    pack and the shared down beside the experts."""
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", *UPSTREAM[1:], NAME)
    assert ctx.counters[NAME] == 4 * layer_counts(cfg)["moe"]
    fn = m.function("decode")
    for experts in [n for n in fn.nodes if n.op == "moe_experts"]:
        i = fn.nodes.index(experts)
        router = _producer(fn, experts.inputs[2])
        assert router.attrs["overlap"] == "moe_router" and not _reads(fn.nodes[fn.nodes.index(router) + 1], router)
        assert fn.nodes[i - 1].op == "linear" and fn.nodes[i - 1].attrs["overlap"] == "moe_shared_expert"
        assert _producer(fn, experts.inputs[0]).op == "fused.packed_linear_glu"
    assert_same_numerics(m)


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
