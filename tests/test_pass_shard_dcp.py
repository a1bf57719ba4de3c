"""passes/shard_dcp.py: on the TP-sharded model every MLA layer's cache writes become dcp_cache_write and
its indexer + attention one dcp_mla (a K3 layer without indexer: dcp_mla_dense) (verifies, round-trips,
counter), for a DCP group equal to or inside the TP group; the token-sharded prefill instead reads a
gathered context through its own workspace table (merge-free, T5); cache formats travel as attrs;
preconditions; the interleaved ownership / local-position map is the inverse of
dcp_topk.global_positions. Numerics (logits equal one process): tests/test_parallel_model.py (TP = DCP)
and tests/test_parallel_layouts.py (DCP / EP groups inside TP, local cache rows, dense K3)."""

from __future__ import annotations

import pytest
import torch

from ir.parser import parse_module
from ir.printer import print_module
from ir.verifier import verify
from k31c.model.build import BuildOptions, build_module
from k31c.model.presets import get_preset
from k31c.parallel.dcp_attention import owner_and_local
from k31c.parallel.dcp_topk import global_positions, local_count
from passes import shard_dcp, shard_tokens, shard_tp
from passes.base import PassContext, PassError
from tests.test_pass_shard_tp import PAR


def sharded(cfg=PAR, tp=2, build=BuildOptions(), **opts):
    m = build_module(cfg, build)
    ctx = PassContext(options={"tp": tp, "dcp": tp, **opts})
    shard_tp.run(m, ctx)
    return m, ctx


def test_rewrites_every_mla_layer():
    m, ctx = sharded(tp=4, dcp_interleave=2)
    n = shard_dcp.run(m, ctx)
    verify(m)
    assert n == 3 * len(PAR.full_attn_layers) == ctx.counters["shard_dcp"]
    for fn in m.functions:
        c = m.op_counts(fn)
        assert c["dcp_mla"] == 1 and c["dcp_cache_write"] == 3
        assert "indexer_topk" not in c and "mla_attention" not in c and "cache_write" not in c
    node = next(x for x in m.function("decode").nodes if x.op == "dcp_mla")
    assert node.attrs["interleave"] == 2 and node.attrs["world"] == 4 and node.attrs["topk"] == PAR.index_topk
    assert m.attrs["dcp"] == 4 and print_module(parse_module(print_module(m))) == print_module(m)


def test_token_sharded_prefill_reads_a_gathered_context():
    m, ctx = sharded(tp=2)
    shard_tokens.run(m, ctx)
    shard_dcp.run(m, ctx)
    verify(m)
    f = m.function(shard_tokens.TARGET)
    c = m.op_counts(shard_tokens.TARGET)
    assert c["dcp_gather_context"] == c["dcp_cache_write"] == 3 and "dcp_mla" not in c
    assert c["indexer_topk"] == c["mla_attention"] == 1 and c["dcp_workspace_table"] == 1  # no merge
    ws = {n.output.name for n in f.nodes if n.op == "dcp_gather_context"}
    table = next(n for n in f.nodes if n.op == "dcp_workspace_table").output
    mla = next(n for n in f.nodes if n.op == "mla_attention")
    ix = next(n for n in f.nodes if n.op == "indexer_topk")
    assert mla.inputs[2].name in ws and {ix.inputs[3].name, ix.inputs[4].name} <= ws
    assert mla.inputs[6] is table and ix.inputs[7] is table  # the workspace's own table, not the local one
    gather = next(n for n in f.nodes if n.op == "dcp_gather_context")
    assert gather.inputs[1].name == "token_pos"  # the step's tokens, not this rank's token shard
    assert gather.inputs[3].name == "block_table" and gather.inputs[4] is table
    assert {n.attrs["row_rank"] for n in f.nodes if n.op == "dcp_gather_context"} == {0, 1}  # scales, rows
    assert print_module(parse_module(print_module(m))) == print_module(m)


def test_dcp_group_inside_tp_and_dense_k3_and_formats():
    m, ctx = sharded(tp=4, dcp=2)
    assert shard_dcp.run(m, ctx) == 3 * len(PAR.full_attn_layers)
    node = next(x for x in m.function("decode").nodes if x.op == "dcp_mla")
    assert (node.attrs["world"], node.attrs["group"]) == (2, "dcp")
    assert node.output.type.shape[1] == PAR.num_attention_heads // 4  # this rank's heads of the TP split
    n = len(get_preset("k3-tiny").full_attn_layers)
    k3, ctx = sharded(cfg=get_preset("k3-tiny"), tp=2)
    assert shard_dcp.run(k3, ctx) == 3 * n
    verify(k3)
    for fn in k3.functions:
        c = k3.op_counts(fn)
        assert c["dcp_mla_dense"] == c["dcp_cache_write"] == n and "mla_attention" not in c
    q, ctx = sharded(tp=2, build=BuildOptions(latent_cache_dtype="nvfp4", key_cache="mxfp4"))
    shard_dcp.run(q, ctx)
    verify(q)
    node = next(x for x in q.function("decode").nodes if x.op == "dcp_mla")
    assert (node.attrs["latent_format"], node.attrs["key_format"]) == ("nvfp4", "mxfp4")
    assert print_module(parse_module(print_module(q))) == print_module(q)


def test_preconditions():
    with pytest.raises(PassError, match="needs shard_tp"):
        shard_dcp.run(build_module(PAR), PassContext(options={"dcp": 2}))
    m, ctx = sharded(tp=4)
    with pytest.raises(PassError, match=r"dcp = 3 divides first \(module attr tp = 4\).*dcp_interleave must be >= 1"):
        shard_dcp.run(m, PassContext(options={"dcp": 3, "dcp_interleave": 0}))
    assert shard_dcp.run(build_module(PAR), PassContext(options={"dcp": 1})) == 0


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 3), (8, 2)])
def test_owner_and_local_position_invert_global_positions(world, interleave):
    n = 100
    owner, lp = owner_and_local(torch.arange(n), world, interleave)
    for r in range(world):
        cnt = int(local_count(torch.tensor(n), r, world, interleave))
        gp = global_positions(r, cnt, world, interleave)
        assert torch.equal(owner[gp], torch.full((cnt,), r)) and torch.equal(lp[gp], torch.arange(cnt))
    assert int(sum(local_count(torch.tensor(n), r, world, interleave) for r in range(world))) == n
