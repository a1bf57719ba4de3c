import pytest
import torch

from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from ir.ref import kda
from ir.ref.basic import l2_norm

try:
    from tests.helpers import assert_close_rel
except ImportError:  # bare `pytest` without the repo root on sys.path
    from helpers import assert_close_rel


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)


def _kda_inputs(g, B, H, D, dtype=torch.float32):
    """Realistic KDA inputs: L2-normalised q/k, K3 lower-bound gate in (-5, 0), beta in (0, 1)."""
    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)
    q = l2_norm(r(B, H, D), 1e-6)
    k = l2_norm(r(B, H, D), 1e-6)
    v = r(B, H, D)
    # mostly mild decays (long memory) with some strong ones, as produced by the real gate
    gate = -5.0 * torch.sigmoid(r(B, H, D) * 2.0 - 4.0)
    beta = torch.sigmoid(r(B, H))
    return [t.to(dtype) for t in (q, k, v, gate, beta)]


# ---------------------------------------------------------------- gates


def test_kda_gate_vs_fla():
    g = _gen(0)
    B, H, D = 7, 4, 64
    f = torch.randn(B, H * D, generator=g) * 2
    A_log = torch.randn(H, generator=g) * 0.5
    dt_bias = torch.randn(H * D, generator=g)
    out = kda.kda_gate(f, A_log, dt_bias, -5.0)
    ref = naive_kda_lowerbound_gate(f.view(B, H, D), A_log, dt_bias, lower_bound=-5.0)
    assert out.shape == (B, H, D) and out.dtype == torch.float32
    assert_close_rel(out, ref, 1e-6, "lower-bound gate")
    assert bool((out < 0).all() and (out > -5).all())
    out = kda.kda_gate(f, A_log, dt_bias, None)
    ref = naive_kda_gate(f.view(B, H, D), A_log, dt_bias)
    assert_close_rel(out, ref, 1e-6, "kimi-linear gate")
    # fp64 against the formula
    f64, a64, b64 = f.double(), A_log.double(), dt_bias.double()
    x = f64.view(B, H, D) + b64.view(H, D)
    ref64 = -5.0 / (1 + torch.exp(-torch.exp(a64).view(H, 1) * x))
    out64 = kda.kda_gate(f64, a64, b64, -5.0)
    assert out64.dtype == torch.float64
    assert_close_rel(out64, ref64, 1e-13)


# ---------------------------------------------------------------- conv


def _conv_loop64(x, w, state0):
    """float64 per-channel loop: y[t,c] = silu(sum_j w[c,j] * ctx[t+j, c])."""
    x, w, s = x.double(), w.double(), state0.double()
    T, C = x.shape
    K = w.shape[1]
    ctx = torch.cat([s, x], 0)
    y = torch.empty(T, C, dtype=torch.float64)
    for t in range(T):
        for c in range(C):
            a = sum(float(w[c, j]) * float(ctx[t + j, c]) for j in range(K))
            y[t, c] = a / (1 + torch.exp(torch.tensor(-a, dtype=torch.float64)))
    return y, ctx[-(K - 1):]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_causal_conv1d_ragged(dtype, tol):
    g = _gen(1)
    C, K, S = 12, 4, 5
    lengths = [5, 1, 2, 7]
    slots = torch.tensor([3, 0, 4, 1])
    x = torch.randn(sum(lengths), C, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(C, K, generator=g, dtype=torch.float64).to(dtype)
    pool = torch.randn(S, K - 1, C, generator=g, dtype=torch.float64).to(dtype)
    pool[3] = 0                                         # request 0 is fresh
    before = pool.clone()
    y = kda.causal_conv1d(x, w, pool, slots, _cu(lengths))
    assert y.dtype == dtype
    cu = _cu(lengths)
    for r, L in enumerate(lengths):
        ref_y, ref_st = _conv_loop64(x[cu[r]:cu[r + 1]], w, before[slots[r]])
        assert_close_rel(y[cu[r]:cu[r + 1]], ref_y, tol, f"conv req {r}")
        assert_close_rel(pool[slots[r]], ref_st, 1e-15, f"conv state req {r}")
    assert torch.equal(pool[2], before[2]), "unlisted slot modified"


def test_causal_conv1d_continuation():
    g = _gen(2)
    C, K = 8, 4
    x = torch.randn(9, C, generator=g)
    w = torch.randn(C, K, generator=g)
    slot = torch.tensor([1])
    pool_a = torch.zeros(3, K - 1, C)
    pool_a[0] = torch.randn(K - 1, C, generator=g)
    pool_a[2] = torch.randn(K - 1, C, generator=g)
    pool_b = pool_a.clone()
    y_all = kda.causal_conv1d(x, w, pool_a, slot, _cu([9]))
    parts = [kda.causal_conv1d(x[s:e], w, pool_b, slot, _cu([e - s]))
             for s, e in ((0, 5), (5, 6), (6, 9))]
    assert_close_rel(torch.cat(parts), y_all, 1e-6, "conv 5+1+3 vs 9")
    assert_close_rel(pool_b, pool_a, 1e-7, "conv state after continuation")
    ref_y, ref_st = _conv_loop64(x, w, torch.zeros(K - 1, C))
    assert_close_rel(y_all, ref_y, 1e-6)
    assert_close_rel(pool_a[1], ref_st, 1e-7)
    # one token after 1 token: the state holds older inputs too (fewer than K-1 new ones)
    kda.causal_conv1d(x[:1], w, pool_b.zero_(), slot, _cu([1]))
    assert torch.equal(pool_b[1, :2], torch.zeros(2, C)) and torch.equal(pool_b[1, 2], x[0])


# ---------------------------------------------------------------- recurrence / chunked


def _fla_per_request(q, k, v, gate, beta, init, scale, fn, **kw):
    o, s = fn(q[None], k[None], v[None], gate[None], beta[None], scale=scale,
              initial_state=init[None].clone(), output_final_state=True, **kw)
    return o[0], s[0]


@pytest.mark.parametrize("impl", ["recurrence", "chunked"])
def test_kda_ragged_vs_fla_recurrent(impl):
    g = _gen(3)
    H, D = 3, 32
    lengths = [5, 64, 130]
    cu = _cu(lengths)
    q, k, v, gate, beta = _kda_inputs(g, sum(lengths), H, D)
    pool = torch.randn(6, H, D, D, generator=g) * 0.5
    slots = torch.tensor([4, 1, 3])
    before = pool.clone()
    scale = D ** -0.5
    if impl == "recurrence":
        o = kda.kda_recurrence(q, k, v, gate, beta, pool, slots, cu, scale)
    else:
        o = kda.kda_chunked(q, k, v, gate, beta, pool, slots, cu, scale, chunk_size=64)
    assert o.shape == (sum(lengths), H, D) and o.dtype == torch.float32
    for r in range(len(lengths)):
        s, e = cu[r], cu[r + 1]
        ref_o, ref_s = _fla_per_request(q[s:e], k[s:e], v[s:e], gate[s:e], beta[s:e],
                                        before[slots[r]], scale, naive_recurrent_kda)
        assert_close_rel(o[s:e], ref_o, 1e-5, f"{impl} o req {r}")
        assert_close_rel(pool[slots[r]], ref_s, 1e-5, f"{impl} state req {r}")
    for other in (0, 2, 5):
        assert torch.equal(pool[other], before[other]), f"slot {other} modified"


def test_kda_chunked_vs_fla_chunk():
    g = _gen(4)
    H, D, T = 2, 64, 128
    q, k, v, gate, beta = _kda_inputs(g, T, H, D)
    pool = torch.randn(2, H, D, D, generator=g) * 0.5
    init = pool[1].clone()
    scale = D ** -0.5
    o = kda.kda_chunked(q, k, v, gate, beta, pool, torch.tensor([1]), _cu([T]), scale)
    ref_o, ref_s = _fla_per_request(q, k, v, gate, beta, init, scale, naive_chunk_kda,
                                    chunk_size=64)
    assert_close_rel(o, ref_o, 1e-5, "chunked vs naive_chunk_kda o")
    assert_close_rel(pool[1], ref_s, 1e-5, "chunked vs naive_chunk_kda state")


def test_kda_chunked_equals_recurrence_fp64_odd_chunks():
    g = _gen(5)
    H, D = 2, 16
    lengths = [1, 17, 40, 3]
    cu = _cu(lengths)
    q, k, v, gate, beta = _kda_inputs(g, sum(lengths), H, D, dtype=torch.float64)
    pool = torch.randn(5, H, D, D, generator=g, dtype=torch.float64)
    slots = torch.tensor([2, 0, 4, 1])
    pa, pb = pool.clone(), pool.clone()
    oa = kda.kda_recurrence(q, k, v, gate, beta, pa, slots, cu, 0.3)
    for cs in (1, 7, 16, 64):
        pb = pool.clone()
        ob = kda.kda_chunked(q, k, v, gate, beta, pb, slots, cu, 0.3, chunk_size=cs)
        assert ob.dtype == torch.float64
        assert_close_rel(ob, oa, 1e-12, f"chunk {cs} o")
        assert_close_rel(pb, pa, 1e-12, f"chunk {cs} state")
    assert torch.equal(pa[3], pool[3])


def test_kda_keep_states_equals_prefix_runs():
    g = _gen(6)
    H, D = 2, 16
    lengths = [4, 7]
    cu = _cu(lengths)
    q, k, v, gate, beta = _kda_inputs(g, sum(lengths), H, D)
    pool = torch.randn(3, H, D, D, generator=g)
    slots = torch.tensor([2, 0])
    p0 = pool.clone()
    o, states = kda.kda_recurrence(q, k, v, gate, beta, p0, slots, cu, D ** -0.5,
                                   keep_states=True)
    assert states.shape == (sum(lengths), H, D, D)
    for r, L in enumerate(lengths):
        for t in range(1, L + 1):
            rows = slice(int(cu[r]), int(cu[r]) + t)
            p = pool.clone()
            ot = kda.kda_recurrence(q[rows], k[rows], v[rows], gate[rows], beta[rows], p,
                                    slots[r:r + 1], _cu([t]), D ** -0.5)
            assert_close_rel(states[int(cu[r]) + t - 1], p[slots[r]], 1e-6, f"req {r} t {t}")
            assert_close_rel(o[rows], ot, 1e-6)
        assert torch.equal(states[int(cu[r + 1]) - 1], p0[slots[r]])
