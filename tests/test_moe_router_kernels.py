"""MoE router and token permutation (codegen/triton/moe_router.py) vs the references, in the Triton
interpreter, fp32, tiny shapes.

Router vs ir.ref (ids exact, incl. ties, negative biased scores and grouped top-k; the T=1 decode row;
the moe_router template as a drop-in for the IR op); permutation (count/scan/scatter kernels or the one
program of decode sizes) vs a stable argsort, with empty experts and ids held by other ranks dropped.
The expert GEMMs and the fused tail are checked in test_moe_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from codegen.registry import templates_for
from codegen.triton import moe_router as mr
from ir.ops import OPS
from ir.ref import moe as ref
from tests.helpers import assert_close_rel
from tests.test_moe_kernels import _gen


# ------------------------------------------------------------------------------------------ router
ROUTER_CASES = [  # activation, bias, renormalize, scaling, n_group, topk_group, topk, E
    ("sigmoid", True, True, 2.5, 1, 1, 4, 16),
    ("sigmoid", False, False, 1.0, 1, 1, 3, 12),
    ("softmax", True, True, 1.0, 1, 1, 8, 24),
    ("sigmoid", True, True, 1.0, 4, 2, 4, 16),
    ("softmax", False, False, 1.5, 8, 3, 6, 24),
    ("sigmoid", True, True, 1.0, 16, 4, 2, 16),   # one expert per group
]


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_matches_reference(case):
    act, use_bias, renorm, scaling, ng, tg, k, ne = case
    g = _gen(ROUTER_CASES.index(case))
    T = 11
    logits = torch.randn(T, ne, generator=g) * 2
    logits[3] = logits[3].round()                      # many exact ties in one row
    logits[4, : ne // 2] = logits[4, ne // 2:]         # ties across groups
    bias = torch.randn(ne, generator=g) * 0.3 if use_bias else None
    w, ids = mr.router(logits, bias, k, act, renorm, scaling, ng, tg)
    rw, rids = ref.moe_router(logits, bias, k, act, renorm, scaling, ng, tg)
    assert ids.dtype == torch.int64 and torch.equal(ids, rids), (ids, rids)
    assert_close_rel(w, rw, 1e-6, "router weights")


def test_router_decode_row_negative_scores_and_ties():
    """T=1 (the decode step: one row, one warp) and T=3, 112 experts, top-2 and top-16: biased scores of
    both signs (the packed selection key flips a negative float's bits) and exact ties (lower id first)."""
    g = _gen(31)
    for T, k in ((1, 2), (3, 16)):
        logits = torch.randn(T, 112, generator=g) * 3
        logits[:, 40:60] = logits[:, 60:80]
        bias = torch.randn(112, generator=g) - 0.7                          # many c = s + bias < 0
        bias[40:60] = bias[60:80]
        w, ids = mr.router(logits, bias, k, "sigmoid", True, 1.0)
        rw, rids = ref.moe_router(logits, bias, k, "sigmoid", True, 1.0)
        assert torch.equal(ids, rids), (T, k, ids, rids)
        assert_close_rel(w, rw, 1e-6, f"router weights T={T} k={k}")
    assert mr._heuristic({"T": 1, "E": 112, "K": 2, "G": 1}) == {"BLOCK_T": 1, "num_warps": 1}


def test_router_template_drop_in():
    (t,) = templates_for("moe_router")
    op = OPS["moe_router"]
    g = _gen(7)
    logits, bias = torch.randn(5, 16, generator=g), torch.randn(16, generator=g) * 0.1
    attrs = op.full_attrs({"topk": 4})
    got = t.launch(op.bind([logits, bias]), attrs, t.heuristic(t.bucket(t.key_dims(op.bind([logits, bias]), attrs))))
    exp = op.reference(op.bind([logits, bias]), attrs)
    assert torch.equal(got[1], exp[1])
    assert_close_rel(got[0], exp[0], 1e-6, "template router")
    assert t.supports(op.bind([logits, bias]), op.full_attrs({"topk": 8, "n_group": 4, "topk_group": 1})) is not None


# ------------------------------------------------------------------------------------- permutation
@pytest.mark.parametrize("fused", [False, True])
def test_permutation_segments(fused):
    """Three kernels (count/scan/scatter) or one program (decode sizes): the same segments."""
    g = _gen(11)
    T, k, ne = 45, 3, 12
    ids = torch.argsort(torch.rand(T, ne, generator=g), dim=1)[:, :k]
    ids[ids == 5] = 4                                   # expert 5 empty, 4 doubly popular
    ids[2, 1], ids[9, 0], ids[11, 2] = -1, ne, 15       # ids held by other ranks (15: a padded lane): dropped
    seg = mr.permute_tokens(ids, ne, chunk=16, fused=fused)     # several chunks
    flat = ids.reshape(-1)
    exp_counts = torch.stack([(flat == e).sum() for e in range(ne)]).to(torch.int32)
    assert torch.equal(seg.counts, exp_counts)
    assert seg.counts[5] == 0 and int(seg.offsets[-1]) == T * k - 3
    assert torch.equal(seg.offsets, torch.cat([torch.zeros(1, dtype=torch.int32), exp_counts.cumsum(0).to(torch.int32)]))
    keep = (flat >= 0) & (flat < ne)
    order = torch.nonzero(keep).flatten()[torch.argsort(flat[keep], stable=True)]
    assert torch.equal(seg.pair_ids[: int(seg.offsets[-1])], order.to(torch.int32))


def test_permutation_picks_one_program_at_decode_sizes():
    ids = torch.tensor([[3, 1]])
    seg = mr.permute_tokens(ids, 4)
    assert seg.counts.tolist() == [0, 1, 0, 1] and seg.offsets.tolist() == [0, 0, 1, 1, 2]
    assert seg.pair_ids.tolist() == [1, 0]
    empty = mr.permute_tokens(torch.zeros(0, 2, dtype=torch.int64), 4)        # no tokens: no pairs
    assert empty.counts.tolist() == [0] * 4 and empty.offsets.tolist() == [0] * 5
