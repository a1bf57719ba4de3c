"""passes/query_absorption.py: in the decode and verify functions of k31-tiny every indexed MLA layer's query
absorption becomes an `mla_absorb` node on the query path's stream, right after fused.mla_query, and the attention
reads q~ (q_absorbed, nope_dim = dn); prefill is left alone; without overlapped_mla_query (no node to sit beside)
and on k3-tiny (no indexer) nothing changes; running twice changes nothing; numerics equal to the unfused model and
the text round trip. The op's reference equals the absorbed attention's own query side."""

from __future__ import annotations

import pytest
import torch

from ir.ref import mla as ref_mla
from passes.base import PassContext
from passes.pipeline import pass_names, run_pipeline
from tests.conftest import tiny_model
from tests.test_pass_pipeline import assert_same_numerics, expected_counts, layer_counts, rewritten

NAME = "query_absorption"
BEFORE = ("fused_indexer_front", "overlapped_mla_query", "fused_indexer_select", "value_gate")


def test_k31_tiny_absorbs_beside_the_indexer_in_decode_and_verify():
    cfg = tiny_model("k31-tiny")[0]
    m, ctx = rewritten("k31-tiny", *BEFORE, NAME)
    assert ctx.counters[NAME] == expected_counts(cfg)[NAME] == 2 * layer_counts(cfg)["mla"]
    for fn in m.functions.values():
        mlas = [n for n in fn.nodes if n.op == "mla_attention"]
        absorbs = [n for n in fn.nodes if n.op == "mla_absorb"]
        if fn.attrs["kind"] == "prefill":
            assert not absorbs and not any(n.attrs.get("q_absorbed") for n in mlas)
            continue
        assert len(absorbs) == len(mlas) == layer_counts(cfg)["mla"]
        for mla in mlas:
            absorb = next(n for n in absorbs if n.outputs[0] is mla.inputs[0])
            query = fn.nodes[fn.nodes.index(absorb) - 1]
            assert query.op == "fused.mla_query" and absorb.inputs[0] is query.outputs[0]
            assert absorb.attrs["overlap"] == query.attrs["overlap"] and absorb.inputs[1].name == mla.inputs[3].name
            assert mla.attrs["q_absorbed"] and mla.attrs["nope_dim"] == cfg.qk_nope_head_dim
            assert tuple(int(d) for d in absorb.outputs[0].type.shape[1:]) == (cfg.num_attention_heads,
                                                                                 cfg.kv_lora_rank)
            between = fn.nodes[fn.nodes.index(absorb) + 1:fn.nodes.index(mla)]
            assert any(n.op == "fused.indexer_select" for n in between), "the absorption must come before the indexer"
    assert_same_numerics(m)


def test_nothing_to_sit_beside_without_the_overlapped_query_or_an_indexer():
    assert rewritten("k31-tiny", "value_gate", NAME)[1].counters[NAME] == 0
    assert rewritten("k3-tiny", *BEFORE, NAME)[1].counters[NAME] == 0


def test_running_twice_changes_nothing():
    m, _ = rewritten("k31-tiny", *BEFORE, NAME)
    ctx = PassContext()
    run_pipeline(m, ctx, disable=tuple(p for p in pass_names() if p != NAME))
    assert ctx.counters[NAME] == 0


@pytest.mark.parametrize("form", ["absorbed", "latent"])
def test_reference_with_an_absorbed_query_equals_the_plain_one(form):
    """mla_attention(q~ = mla_absorb(q_nope), nope_dim=dn) == mla_attention(q_nope) in float64; a q~ of the wrong
    width or the decompressed form is refused."""
    g = torch.Generator().manual_seed(5)
    B, H, dn, dr, dv, kv, bs = 3, 2, 8, 4, 6, 16, 4
    q_nope, q_pe = torch.randn(B, H, dn, generator=g).double(), torch.randn(B, H, dr, generator=g).double()
    kv_b = torch.randn(H * (dn + dv), kv, generator=g).double()
    pool = torch.randn(12, kv + dr, generator=g).double()
    pos, req, tbl = torch.tensor([2, 5, 7]), torch.tensor([0, 1, 1]), torch.tensor([[0, 1], [1, 2]])
    args = (pool, kv_b, pos, req, tbl, bs, 0.3)
    want = ref_mla.mla_attention(q_nope, q_pe, *args, form=form)
    q_abs = ref_mla.mla_absorb(q_nope, kv_b)
    assert q_abs.shape == (B, H, kv)
    got = ref_mla.mla_attention(q_abs, q_pe, *args, form=form, nope_dim=dn)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="absorbed query"):
        ref_mla.mla_attention(q_nope, q_pe, *args, form=form, nope_dim=dn)
    with pytest.raises(ValueError, match="absorbed query"):
        ref_mla.mla_attention(q_abs, q_pe, *args, form="decompressed", nope_dim=dn)
