import math

import pytest
import torch

from ir.ref import moe

try:
    from tests.helpers import assert_close_rel
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel


def _router_loop(logits, bias, topk, activation, renormalize, scaling, n_group=1, topk_group=1):
    """Per-row python reference (float64)."""
    B, E = logits.shape
    per = E // n_group
    W, I = [], []
    for b in range(B):
        row = [float(x) for x in logits[b]]
        if activation == "sigmoid":
            s = [1 / (1 + math.exp(-x)) for x in row]
        else:
            m = max(row)
            ex = [math.exp(x - m) for x in row]
            s = [e / sum(ex) for e in ex]
        c = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        gs = [sum(sorted(c[gi * per:(gi + 1) * per], reverse=True)[:2]) for gi in range(n_group)]
        kept = sorted(range(n_group), key=lambda gi: (-gs[gi], gi))[:topk_group]
        cand = [e for e in range(E) if e // per in kept]
        ids = sorted(cand, key=lambda e: (-c[e], e))[:topk]
        w = [s[e] for e in ids]
        if renormalize:
            tot = sum(w) + 1e-20
            w = [x / tot for x in w]
        W.append([x * scaling for x in w])
        I.append(ids)
    return torch.tensor(W, dtype=torch.float64), torch.tensor(I, dtype=torch.int64)


CASES = [
    # activation, bias, renormalize, scaling, n_group, topk_group
    ("sigmoid", True, True, 1.0, 1, 1),
    ("sigmoid", True, False, 2.446, 1, 1),
    ("sigmoid", False, True, 1.0, 1, 1),
    ("softmax", False, False, 1.0, 1, 1),
    ("softmax", True, True, 1.5, 1, 1),
    ("sigmoid", True, True, 2.5, 4, 2),
    ("softmax", True, False, 1.0, 8, 3),
]


@pytest.mark.parametrize("case", CASES)
def test_router_vs_loop(case):
    act, use_bias, renorm, scaling, n_group, topk_group = case
    g = torch.Generator().manual_seed(100 + CASES.index(case))
    B, E, K = 9, 16, 4
    logits = torch.randn(B, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3 if use_bias else None
    w, ids = moe.moe_router(logits, bias, K, act, renorm, scaling, n_group, topk_group)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (B, K)
    rw, rids = _router_loop(logits.double(), bias, K, act, renorm, scaling, n_group, topk_group)
    assert torch.equal(ids, rids)
    assert_close_rel(w, rw, 1e-6, "router weights fp32")
    w64, ids64 = moe.moe_router(logits.double(), None if bias is None else bias.double(), K, act,
                                renorm, scaling, n_group, topk_group)
    assert w64.dtype == torch.float64 and torch.equal(ids64, rids)
    assert_close_rel(w64, rw, 1e-13, "router weights fp64")
    if renorm:
        assert_close_rel(w64.sum(-1), torch.full((B,), scaling, dtype=torch.float64), 1e-12)


def test_router_bias_only_selects_and_ties():
    E, K = 8, 3
    logits = torch.zeros(2, E, dtype=torch.float64)
    logits[0] = torch.tensor([0.5, 0.5, 0.5, 0.1, 0.5, 0.2, 0.3, 0.5])
    logits[1] = torch.linspace(-1, 1, E, dtype=torch.float64)
    bias = torch.zeros(E, dtype=torch.float64)
    bias[1] = 5.0                                  # pulls expert 1 first in row 1
    w, ids = moe.moe_router(logits, bias, K, "sigmoid", False, 1.0)
    # row 0: expert 1 first (bias), then tie among 0, 2, 4, 7 at 0.5 -> lower ids first
    assert ids[0].tolist() == [1, 0, 2]
    assert ids[1].tolist() == [1, 7, 6]
    # weights come from the unbiased scores
    assert_close_rel(w[1], torch.sigmoid(logits[1, [1, 7, 6]]), 1e-15)


def test_router_grouped_excludes_dropped_groups():
    # 4 groups of 4; group 0 holds the single best expert but its top-2 sum is poor.
    E = 16
    c = torch.full((1, E), -3.0, dtype=torch.float64)
    c[0, 0] = 3.0                                  # group 0: top2 = sig(3)+sig(-3) ~ 1.0
    c[0, 4:6] = 1.0                                # group 1: 2*sig(1) ~ 1.46
    c[0, 8:10] = 0.8                               # group 2: ~1.38
    w, ids = moe.moe_router(c, None, 4, "sigmoid", True, 1.0, n_group=4, topk_group=2)
    assert ids[0].tolist() == [4, 5, 8, 9]
    rw, rids = _router_loop(c, None, 4, "sigmoid", True, 1.0, 4, 2)
    assert torch.equal(ids, rids)
    assert_close_rel(w, rw, 1e-13)


def _situ(a, u, b1, b2):
    return b1 * torch.tanh(a / b1) * torch.sigmoid(a) * (b2 * torch.tanh(u / b2))


def _experts_loop(z, weights, ids, w1, w2, w3, act, b1, b2):
    z, weights = z.double(), weights.double()
    w1, w2, w3 = w1.double(), w2.double(), w3.double()
    y = torch.zeros_like(z)
    for t in range(z.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            a, u = w1[e] @ z[t], w3[e] @ z[t]
            h = _situ(a, u, b1, b2) if act == "situ" else torch.nn.functional.silu(a) * u
            y[t] += weights[t, j] * (w2[e] @ h)
    return y


def _expert_weights(g, E, I, L, dtype):
    w1 = torch.randn(E, I, L, generator=g, dtype=torch.float64) / math.sqrt(L) * 3
    w3 = torch.randn(E, I, L, generator=g, dtype=torch.float64) / math.sqrt(L) * 3
    w2 = torch.randn(E, L, I, generator=g, dtype=torch.float64) / math.sqrt(I)
    return w1.to(dtype), w2.to(dtype), w3.to(dtype)


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_experts_vs_loop(act, dtype, tol):
    g = torch.Generator().manual_seed(7)
    B, E, K, I, L = 11, 16, 4, 24, 32
    z = torch.randn(B, L, generator=g, dtype=torch.float64).to(dtype)
    logits = torch.randn(B, E, generator=g)
    weights, ids = moe.moe_router(logits, None, K, "sigmoid", True, 1.0)
    w1, w2, w3 = _expert_weights(g, E, I, L, dtype)
    y = moe.moe_experts(z, weights, ids, w1, w2, w3, act, 4.0, 25.0)
    assert y.dtype == dtype and y.shape == (B, L)
    assert_close_rel(y, _experts_loop(z, weights, ids, w1, w2, w3, act, 4.0, 25.0), tol)


def test_experts_skewed_and_empty():
    g = torch.Generator().manual_seed(8)
    B, E, K, I, L = 7, 8, 2, 16, 16
    z = torch.randn(B, L, generator=g, dtype=torch.float64)
    w1, w2, w3 = _expert_weights(g, E, I, L, torch.float64)
    # all tokens to expert 5 (slot 0) and expert 2 (slot 1); the other experts get nothing
    ids = torch.tensor([[5, 2]] * B)
    weights = torch.rand(B, K, generator=g, dtype=torch.float64) + 0.1
    ref = _experts_loop(z, weights, ids, w1, w2, w3, "situ", 4.0, 25.0)
    y = moe.moe_experts(z, weights, ids, w1, w2, w3, "situ", 4.0, 25.0)
    assert_close_rel(y, ref, 1e-12, "skewed")
    # NaN weights in experts that receive no tokens must not leak into the result
    w1n = w1.clone()
    w1n[[0, 1, 3, 4, 6, 7]] = float("nan")
    y = moe.moe_experts(z, weights, ids, w1n, w2, w3, "situ", 4.0, 25.0)
    assert_close_rel(y, ref, 1e-12, "empty experts skipped")
    # raw up branch (beta2 None)
    def situ_raw(a, u):
        return 4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a) * u
    ref_raw = torch.zeros_like(z)
    for t in range(B):
        for j in range(K):
            e = int(ids[t, j])
            ref_raw[t] += weights[t, j] * (w2[e] @ situ_raw(w1[e] @ z[t], w3[e] @ z[t]))
    y = moe.moe_experts(z, weights, ids, w1, w2, w3, "situ", 4.0, None)
    assert_close_rel(y, ref_raw, 1e-12, "beta2 None")
