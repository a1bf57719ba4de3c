"""passes/moe_expert_input_split.py: in the decode and verify functions of k31-tiny every latent MoE layer's
expert input z becomes its own linear (the shared expert's gate/up stay packed, and glu_epilogue still fuses
them with the GLU); prefill keeps z packed; Kimi-Linear (experts read the normed hidden state, no pack) is left
alone; running twice changes nothing; numerics equal to the unfused model and the text round trip."""

from __future__ import annotations

from passes.base import PassContext
from passes.pipeline import pass_names, run_pipeline
from tests.conftest import tiny_model
from tests.test_pass_pipeline import assert_same_numerics, expected_counts, layer_counts, rewritten

NAME = "moe_expert_input_split"


def _z_producers(fn):
    prod = {id(o): n for n in fn.nodes for o in n.outputs}
    return [prod[id(n.inputs[0])] for n in fn.nodes if n.op == "moe_experts"]


def test_k31_tiny_decode_and_verify_split_prefill_packed():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", NAME, "glu_epilogue")
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 2 * layer_counts(cfg)["moe"]
    for fn in m.functions.values():
        zs = _z_producers(fn)
        assert len(zs) == layer_counts(cfg)["moe"]
        if fn.attrs["kind"] == "prefill":
            assert all(z.op == "fused.packed_linear_glu" and len(z.attrs["splits"]) == 3 for z in zs)
            continue
        for z in zs:
            assert z.op == "linear" and z.inputs[1].name.endswith("routed_expert_down_proj.weight")
            shared = [n for n in fn.nodes if n.op == "fused.packed_linear_glu" and n.inputs[0] is z.inputs[0]]
            assert len(shared) == 1 and shared[0].attrs["splits"] == [shared[0].attrs["splits"][0]] * 2
            assert all("shared_experts" in w.name for w in shared[0].inputs[1:])
    assert_same_numerics(m)


def test_running_twice_changes_nothing():
    m, _ = rewritten("k31-tiny", NAME)
    ctx = PassContext()
    run_pipeline(m, ctx, disable=tuple(p for p in pass_names() if p != NAME))
    assert ctx.counters[NAME] == 0


def test_kimi_linear_has_no_pack_to_split():
    assert rewritten("kimi-linear-tiny", NAME)[1].counters[NAME] == 0
