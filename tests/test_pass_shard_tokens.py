"""passes/shard_tokens.py: on the TP-sharded model it adds @prefill_token_sharded with the two
all-to-alls, the all-gathered kv_b and the indexer on this rank's rows per MLA layer, verifies and
round-trips; @prefill itself is untouched; preconditions; the per-step choice. Numerics (token-sharded
prefill logits equal one process at TP = 2, 4, 8): tests/test_parallel_model.py."""

from __future__ import annotations

import pytest

from ir.parser import parse_module
from ir.printer import print_function, print_module
from ir.verifier import verify
from k31c.model.build import build_module
from k31c.parallel.prefill_choice import choose_prefill_function, split_for_token_sharding
from passes import shard_tokens, shard_tp
from passes.base import PassContext, PassError
from tests.test_pass_shard_tp import PAR


def sharded(tp=2, **extra):
    m = build_module(PAR)
    ctx = PassContext(options={"tp": tp, **extra})
    shard_tp.run(m, ctx)
    before = print_function(m.function("prefill"))
    n = shard_tokens.run(m, ctx)
    verify(m)
    return m, ctx, n, before


def test_adds_token_sharded_prefill():
    m, ctx, n, before = sharded(tp=4, token_shard_min_tokens=96)
    assert n == len(PAR.full_attn_layers) == ctx.counters["shard_tokens"]
    assert print_function(m.function("prefill")) == before
    f = m.function(shard_tokens.TARGET)
    assert f.attrs["layout"] == "token_sharded" and f.attrs["token_multiple"] == 8
    counts = m.op_counts(shard_tokens.TARGET)
    assert counts["heads_to_tokens"] == 2 * n and counts["tokens_to_heads"] == n
    assert counts["token_shard_rows"] == 1 and counts["take_rows"] == 2 + 3 * n
    mla = next(x for x in f.nodes if x.op == "mla_attention")
    want = ["B/4", str(PAR.num_attention_heads), str(PAR.qk_nope_head_dim)]
    assert [str(d) for d in mla.inputs[0].type.shape] == want
    sel = next(x for x in f.nodes if x.op == "indexer_topk")
    assert str(sel.output.type.shape[0]) == "B/4"
    assert print_module(parse_module(print_module(m))) == print_module(m)


def test_choice_per_step():
    m, *_ = sharded(tp=2, token_shard_min_tokens=64)
    assert choose_prefill_function(m, [32, 32]) == shard_tokens.TARGET
    assert choose_prefill_function(m, [32, 28]) == "prefill"  # 28 is not a multiple of 2·TP = 4
    assert choose_prefill_function(m, [32]) == "prefill"      # below the crossover
    assert split_for_token_sharding(m, [33, 7, 4]) == [32, 4, 4]
    assert choose_prefill_function(build_module(PAR), [64]) == "prefill"  # no token-sharded entry


def test_preconditions():
    m = build_module(PAR)
    with pytest.raises(PassError, match="run shard_tp with tp=2 first"):
        shard_tokens.run(m, PassContext(options={"tp": 2}))
    assert shard_tokens.run(m, PassContext(options={"tp": 1})) == 0
