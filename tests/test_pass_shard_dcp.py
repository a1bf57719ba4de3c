"""passes/shard_dcp.py: on the TP-sharded model every MLA layer's cache writes become dcp_cache_write and
its indexer + attention one dcp_mla (verifies, round-trips, counter); the token-sharded prefill instead
reads a gathered context (merge-free, T5); preconditions; the interleaved
ownership / local-position map is the inverse of dcp_topk.global_positions. Numerics (logits equal one
process at TP = DCP = 2, 4, 8, interleave 1 and 3, merge traffic W·⌈1.5k/W⌉·4 B/row):
tests/test_parallel_model.py."""

from __future__ import annotations

import pytest
import torch

from ir.parser import parse_module
from ir.printer import print_module
from ir.verifier import verify
from k31c.model.build import build_module
from k31c.model.presets import get_preset
from k31c.parallel.dcp_attention import owner_and_local
from k31c.parallel.dcp_topk import global_positions, local_count
from passes import shard_dcp, shard_tokens, shard_tp
from passes.base import PassContext, PassError
from tests.test_pass_shard_tp import PAR


def sharded(cfg=PAR, tp=2, **opts):
    m = build_module(cfg)
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
    assert c["indexer_topk"] == c["mla_attention"] == 1  # token-sharded attention, no merge
    ws = {n.output.name for n in f.nodes if n.op == "dcp_gather_context"}
    mla = next(n for n in f.nodes if n.op == "mla_attention")
    ix = next(n for n in f.nodes if n.op == "indexer_topk")
    assert mla.inputs[2].name in ws and {ix.inputs[3].name, ix.inputs[4].name} <= ws
    gather = next(n for n in f.nodes if n.op == "dcp_gather_context")
    assert gather.inputs[1].name == "token_pos"  # the step's tokens, not this rank's token shard


def test_preconditions():
    with pytest.raises(PassError, match="needs shard_tp"):
        shard_dcp.run(build_module(PAR), PassContext(options={"dcp": 2}))
    k3 = get_preset("k3-tiny")
    m, ctx = sharded(cfg=k3)
    with pytest.raises(PassError, match="no indexer selection"):
        shard_dcp.run(m, ctx)
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
