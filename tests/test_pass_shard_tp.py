"""passes/shard_tp.py: Before/Expected on a hand-written graph (col linear, head reshapes, row linear
with its all-reduce, col-parallel head with its all-gather, a KDA state pool retyped by head), the
whole k31-tiny module (verifies, round-trips, counts one all-reduce per row-parallel projection),
weight slicing, and the collected precondition errors. Numerics vs one process: tests/test_parallel_model.py."""

from __future__ import annotations

import pytest
import torch

from ir.parser import parse_module
from ir.printer import print_module
from ir.verifier import verify
from k31c.model.build import build_module
from k31c.model.presets import get_preset
from k31c.parallel.weights import shard_weights
from passes import shard_tp
from passes.base import PassContext, PassError
from tests.test_pass_pipeline import assert_ir, rewritten

BEFORE = """module @tp {
  param @wq : bf16[8,4] {shard="col"}
  param @wo : bf16[4,8] {shard="row"}
  param @head : bf16[6,4] {shard="col"}
  func @f(%x: bf16[T,4]) -> (bf16[T,6]) attrs {kind="prefill"} {
    %q = linear(%x, @wq) : bf16[T,8]
    %h = reshape(%q) {shape=[-1, 2, 4]} : bf16[T,2,4]
    %o = reshape(%h) {shape=[-1, 8]} : bf16[T,8]
    %y = linear(%o, @wo) : bf16[T,4]
    %z = linear(%y, @head) : bf16[T,6]
    return %z
  }
}"""
EXPECTED = """module @tp {
  attr tp = 2
  param @wq : bf16[4,4] {shard="col", tp_dim=0, tp_parts=2}
  param @wo : bf16[4,4] {shard="row", tp_dim=1, tp_parts=2}
  param @head : bf16[3,4] {shard="col", tp_dim=0, tp_parts=2}
  func @f(%x: bf16[T,4]) -> (bf16[T,6]) attrs {kind="prefill"} {
    %q = linear(%x, @wq) : bf16[T,4]
    %h = reshape(%q) {shape=[-1, 1, 4]} : bf16[T,1,4]
    %o = reshape(%h) {shape=[-1, 4]} : bf16[T,4]
    %y.partial = linear(%o, @wo) : bf16[T,4]
    %y = all_reduce(%y.partial) {group="tp", world=2} : bf16[T,4]
    %z.shard = linear(%y, @head) : bf16[T,3]
    %z = all_gather(%z.shard) {axis=1, group="tp", world=2} : bf16[T,6]
    return %z
  }
}"""

PAR = get_preset("k31-tiny").replace(name="k31-tiny-par8", num_hidden_layers=4, full_attn_layers=(3,),
                                    kda_num_heads=8, kda_head_dim=32, num_attention_heads=8).validate()


def run(module, **options):
    ctx = PassContext(options=options)
    n = shard_tp.run(module, ctx)
    verify(module)
    return n, ctx


def test_before_expected():
    m = parse_module(BEFORE)
    n, ctx = run(m, tp=2)
    assert n == 2 and ctx.counters["shard_tp"] == 2
    assert_ir(m, EXPECTED)


def test_tp1_is_a_no_op():
    m = parse_module(BEFORE)
    assert run(m, tp=1)[0] == 0
    assert_ir(m, BEFORE)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_model_is_sharded_by_head(tp):
    m = build_module(PAR)
    n, _ = run(m, tp=tp)
    rows = sum(1 for p in m.params.values() if p.shard == "row")
    assert n == 3 * (rows + 1)  # every row-parallel projection + the logits gather, in 3 entry functions
    assert print_module(parse_module(print_module(m))) == print_module(m)
    pre = m.function("prefill")
    assert pre.input("kda_state.1").type.shape[1] == PAR.kda_num_heads // tp
    assert int(pre.input("conv_state.1").type.shape[2]) == 3 * PAR.kda_proj_dim // tp
    assert int(pre.input("latent.3").type.shape[-1]) == PAR.latent_cache_dim  # replicated (flat pool or block view)
    for name in ("q_b_proj", "kv_b_proj", "g_proj"):
        p = m.params[f"model.layers.3.self_attn.{name}.weight"]
        assert p.attrs == {"tp_dim": 0, "tp_parts": tp}
    assert "tp_parts" not in m.params["model.layers.3.self_attn.indexer.wq_b.weight"].attrs  # indexer replicated
    assert m.op_counts("decode")["all_reduce"] == rows and m.op_counts("decode")["all_gather"] == 1


def test_weights_are_sliced_by_the_annotations():
    m = build_module(PAR)
    run(m, tp=4)
    full = {n: torch.randn([int(d) * (4 if p.attrs.get("tp_dim") == i else 1) for i, d in enumerate(p.type.shape)],
                           generator=torch.Generator().manual_seed(len(n)))
            for n, p in m.params.items()}
    w = shard_weights(m, full, tp_rank=2)
    o = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(w[o], full[o][:, 2 * full[o].shape[1] // 4:3 * full[o].shape[1] // 4])
    q = "model.layers.3.self_attn.q_b_proj.weight"
    assert torch.equal(w[q], full[q].view(4, -1, full[q].shape[1])[2])
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        shard_weights(m, {k: v for k, v in full.items() if k != o})


def test_preconditions_are_collected():
    with pytest.raises(PassError, match="not divisible by tp=3") as e:
        run(build_module(PAR), tp=3)
    msg = str(e.value)  # the head counts first, then every offending param counted (three named)
    assert "the 8 KDA heads are not divisible" in msg and "the 8 MLA heads" in msg
    assert " more" in msg and msg.count("@") == 3
    fused, _ = rewritten("k31-tiny")  # packed_projection fused the input projections
    with pytest.raises(PassError, match="before the fusion phase"):
        run(fused, tp=2)
