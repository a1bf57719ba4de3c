"""passes/shard_ep.py: Before/Expected (local routing, the rank's expert block, the all-reduce of the fp32
latent partial sum), the model-level counts, precondition errors, and — in one process — that the
ranks' partial sums add up to the unsharded expert sum (ep_local_routing evaluated as each rank).
Distributed logits vs one process: tests/test_parallel_model.py."""

from __future__ import annotations

import pytest
import torch

import ir.ops.collective as collective
from ir.ops import OPS
from ir.parser import parse_module
from ir.ref.moe import moe_experts
from ir.verifier import verify
from k31c.model.build import build_module
from k31c.model.presets import get_preset
from passes import shard_ep
from passes.base import PassContext, PassError
from tests.helpers import assert_close_rel
from tests.test_pass_pipeline import assert_ir

BEFORE = """module @ep {
  param @w1 : bf16[4,6,8] {shard="expert"}
  param @w2 : bf16[4,8,6] {shard="expert"}
  param @w3 : bf16[4,6,8] {shard="expert"}
  func @f(%z: bf16[T,8], %weights: f32[T,2], %ids: i64[T,2]) -> (f32[T,8]) attrs {kind="decode"} {
    %y = moe_experts(%z, %weights, %ids, @w1, @w2, @w3) {act="situ", beta1=4.0, beta2=25.0} : f32[T,8]
    return %y
  }
}"""
EXPECTED = """module @ep {
  attr ep = 2
  param @w1 : bf16[2,6,8] {shard="expert", ep_dim=0, ep_parts=2}
  param @w2 : bf16[2,8,6] {shard="expert", ep_dim=0, ep_parts=2}
  param @w3 : bf16[2,6,8] {shard="expert", ep_dim=0, ep_parts=2}
  func @f(%z: bf16[T,8], %weights: f32[T,2], %ids: i64[T,2]) -> (f32[T,8]) attrs {kind="decode"} {
    %weights.ep, %ids.ep = ep_local_routing(%weights, %ids) {experts_per_rank=2, group="ep", world=2}
        : f32[T,2], i64[T,2]
    %y.partial = moe_experts(%z, %weights.ep, %ids.ep, @w1, @w2, @w3) {act="situ", beta1=4.0, beta2=25.0}
        : f32[T,8]
    %y = all_reduce(%y.partial) {group="ep", world=2} : f32[T,8]
    return %y
  }
}"""


def test_before_expected():
    m = parse_module(BEFORE)
    ctx = PassContext(options={"ep": 2})
    assert shard_ep.run(m, ctx) == 1 and ctx.counters["shard_ep"] == 1
    verify(m)
    assert_ir(m, EXPECTED)


def test_model_counts_and_errors():
    cfg = get_preset("k31-tiny")
    m = build_module(cfg)
    ctx = PassContext(options={"ep": 4})
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert shard_ep.run(m, ctx) == 3 * moe_layers
    verify(m)
    assert int(m.params["model.layers.1.block_sparse_moe.experts.w2.weight"].type.shape[0]) == cfg.num_experts // 4
    with pytest.raises(PassError, match="not divisible by ep=3"):
        shard_ep.run(build_module(cfg), PassContext(options={"ep": 3}))


@pytest.mark.parametrize("ep", [2, 4])
def test_rank_partial_sums_add_up(monkeypatch, ep):
    g = torch.Generator().manual_seed(5)
    E, ell, inter, T, k = 8, 16, 12, 7, 3
    z = torch.randn(T, ell, generator=g)
    w1, w3 = torch.randn(E, inter, ell, generator=g) * 0.3, torch.randn(E, inter, ell, generator=g) * 0.3
    w2 = torch.randn(E, ell, inter, generator=g) * 0.3
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g) + 0.1
    full = moe_experts(z.double(), weights.double(), ids, w1.double(), w2.double(), w3.double(), "situ", 4.0, 25.0)
    op, n = OPS["ep_local_routing"], E // ep
    total = torch.zeros_like(full)
    for r in range(ep):
        monkeypatch.setattr(collective, "group_rank_size", lambda name, r=r: (r, ep))
        wl, il = op.reference(op.bind([weights, ids]), op.full_attrs({"experts_per_rank": n, "world": ep}))
        assert int(il.max()) < n and bool(((wl != 0) == (ids // n == r)).all())
        blk = slice(r * n, (r + 1) * n)
        total += moe_experts(z.double(), wl.double(), il, w1[blk].double(), w2[blk].double(), w3[blk].double(),
                             "situ", 4.0, 25.0)
    assert_close_rel(total, full, 1e-12, f"sum of {ep} ranks' latent partial sums")
