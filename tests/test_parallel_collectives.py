"""gloo tests of the DCP / token-shard collectives (issue 8): exact top-k merge, LSE combine, all-to-all.

One forked gloo group per world size (2, 4, 8) runs every check in DIST_CHECKS (tests/dist_helpers.py);
the pytest functions below only read the results. Inputs are built from a seeded generator identically on
every rank; each rank takes its shard, and the references use the full inputs (float64 where numeric).
"""

from __future__ import annotations

import math

import pytest
import torch

from k31c.parallel import (causal_balance_indices, combine_partials, dcp_topk, global_positions,
                           local_count, lse_combine, shard_scores, heads_to_tokens, tokens_to_heads)
from k31c.parallel.dcp_topk import all_gather_concat
from tests.dist_helpers import check_result, results_per_world

WORLDS = (2, 4, 8)


# ---------------------------------------------------------------- references and shared helpers
def ref_topk(scores: torch.Tensor, k: int, ctx_len: torch.Tensor) -> list[list[int]]:
    """Top-min(k, L) positions per row over the first L columns, ties to the lower position (sorted)."""
    out = []
    for row in range(scores.shape[0]):
        n = int(ctx_len[row])
        s = scores[row, :n].to(torch.float64) + 0.0
        pos = torch.arange(n, dtype=torch.float64)
        order = sorted(range(n), key=lambda p: (-s[p].item(), pos[p].item()))
        out.append(sorted(order[: min(k, n)]))
    return out


def gathered_selection(res, world: int) -> list[list[int]]:
    """Union over ranks of every rank's own selected positions (test-side gather, not counted)."""
    rows, k = res.own_positions.shape
    buf = torch.empty((world * rows, k), dtype=torch.int64)
    all_gather_concat(buf, res.own_positions.contiguous())
    buf = buf.view(world, rows, k)
    sel = []
    for row in range(buf.shape[1]):
        p = buf[:, row].flatten()
        sel.append(sorted(p[p >= 0].tolist()))
    return sel


def run_merge(scores, k, ctx_len, rank, world, interleave):
    local = shard_scores(scores, rank, world, interleave)
    res = dcp_topk(local, k, ctx_len=ctx_len, interleave=interleave)
    got = gathered_selection(res, world)
    want = ref_topk(scores, k, ctx_len)
    for row, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"row {row} (ctx {int(ctx_len[row])}, k {k}, B {interleave}): {g} != {w}"
    return res


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- distributed checks
def check_topk_random(rank, world):
    g = _gen(1)
    rows, n, k = 6, 96, 12
    scores = torch.randn(rows, n, generator=g)
    ctx = torch.tensor([96, 95, 50, 13, 12, 7])
    for interleave in (1, 2, 5):
        res = run_merge(scores, k, ctx, rank, world, interleave)
    assert res.first_round_bytes == world * rows * res.candidates_per_rank * 4
    return {}


def check_topk_one_rank_holds_topk(rank, world):
    g = _gen(2)
    rows, n, k = 4, 128, 16
    scores = torch.randn(rows, n, generator=g) * 0.1
    hot = global_positions(1, int(local_count(torch.tensor(n), 1, world)), world)  # rank 1's tokens
    scores[:, hot[: k - 1]] += 10.0  # rank 1 holds k-1 of the top-k: far more than c = ceil(1.5k/W)
    ctx = torch.full((rows,), n)
    res = run_merge(scores, k, ctx, rank, world, 1)
    assert res.resend_rows == rows, f"re-send path must run for every row, ran for {res.resend_rows}"
    assert res.resend_bytes > 0
    return {"first_round_B_per_row": res.first_round_bytes / rows,
            "resend_B_per_row": res.resend_bytes / rows, "k": k, "c": res.candidates_per_rank,
            "issue_B_per_row": world * math.ceil(1.5 * k / world) * 4, "generic_B_per_row": world * k * 8}


def check_topk_ties(rank, world):
    g = _gen(3)
    rows, n, k = 8, 64, 10
    scores = torch.randint(0, 3, (rows, n), generator=g).float()  # massive ties across ranks
    scores[0] = 1.0                                              # one value everywhere
    scores[1, ::2] = -0.0                                         # −0.0 ties with +0.0
    scores[1, 1::2] = 0.0
    scores[2, 5:] = float("-inf")                                 # masked scores still rank
    ctx = torch.tensor([64, 64, 64, 40, 33, 9, 64, 17])
    total_resend = 0
    for interleave in (1, 3):
        res = run_merge(scores, k, ctx, rank, world, interleave)
        total_resend += res.resend_rows
    assert total_resend > 0, "ties across ranks must go through the second exchange"
    # Tie at the threshold with no saturated rank: every rank holds one high score, one score 5.0 and
    # lows; k = 2W-1 takes every high and W-1 of the W tied 5.0s, which only positions can decide.
    k = 2 * world - 1
    n = 4 * world
    scores = -torch.rand(2, n, generator=g) - 1.0
    scores[:, :world] = 10.0 + torch.rand(2, world, generator=g)  # positions 0..W-1: one per rank
    scores[0, world:2 * world] = 5.0                              # one tie per rank, lowest positions win
    scores[1, 2 * world:3 * world] = 5.0                          # rank W-1 holds the lowest tie (2W-1),
    scores[1, 2 * world - 1], scores[1, 3 * world - 1] = 5.0, -1.5  # so rank order is not position order
    res = run_merge(scores, k, torch.full((2,), n), rank, world, 1)
    assert res.resend_rows == 2, f"cross-rank tie at the threshold must be resolved, got {res.resend_rows}"
    return {}


def check_topk_empty_shards(rank, world):
    g = _gen(4)
    rows, k = world + 1, 4
    n = world  # shorter than or equal to W: ranks >= ctx_len hold nothing
    scores = torch.randn(rows, n, generator=g)
    ctx = torch.arange(rows).clamp(max=n)  # 0 .. W tokens
    res = run_merge(scores, k, ctx, rank, world, 1)
    assert int(res.own_count[0]) == 0
    return {}


def check_traffic_at_full_k(rank, world):
    g = _gen(5)
    rows, n, k = 4, 16384, 2048
    scores = torch.randn(rows, n, generator=g)
    res = run_merge(scores, k, torch.full((rows,), n), rank, world, 1)
    return {"first_round_B_per_row": res.first_round_bytes / rows,
            "resend_B_per_row": res.resend_bytes / rows, "resend_rows": res.resend_rows, "rows": rows,
            "issue_B_per_row": world * math.ceil(1.5 * k / world) * 4, "generic_B_per_row": world * k * 8}


def _attention_f64(q, kk, v, n):
    """Full-context softmax attention in float64 over the first n tokens: q [H, D], kk/v [N, H, D]."""
    s = torch.einsum("hd,nhd->hn", q.double(), kk[:n].double())
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[:n].double()), torch.logsumexp(s, -1)


def check_lse_combine(rank, world):
    g = _gen(6)
    rows, H, D, n = 5, 3, 8, 40
    q = torch.randn(rows, H, D, generator=g)
    kk = torch.randn(rows, n, H, D, generator=g)
    v = torch.randn(rows, n, H, D, generator=g)
    ctx = [40, 17, world - 1, 1, 0]  # short rows leave shards empty; the last row is empty everywhere
    out = torch.zeros(rows, H, D)
    lse = torch.full((rows, H), float("-inf"))
    for row, L in enumerate(ctx):
        mine = global_positions(rank, int(local_count(torch.tensor(L), rank, world)), world, 1)
        if mine.numel():
            s = torch.einsum("hd,nhd->hn", q[row], kk[row, mine])
            out[row] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[row, mine])
            lse[row] = torch.logsumexp(s, -1)
    o, l = lse_combine(out, lse)
    outs = torch.empty((world * rows, H, D))
    lses = torch.empty((world * rows, H))
    all_gather_concat(outs, out)
    all_gather_concat(lses, lse)
    outs, lses = outs.view(world, rows, H, D), lses.view(world, rows, H)
    o2, l2 = combine_partials(outs, lses)
    from tests.helpers import assert_close_rel
    for row, L in enumerate(ctx):
        if L == 0:
            for t in (o, o2):
                assert torch.equal(t[row], torch.zeros(H, D)), "empty context must give o = 0"
            for t in (l, l2):
                assert torch.isneginf(t[row]).all(), "empty context must give lse = -inf"
            continue
        want_o, want_l = _attention_f64(q[row], kk[row], v[row], L)
        assert_close_rel(o[row], want_o, 1e-5, f"lse_combine out row {row}")
        assert_close_rel(l[row], want_l, 1e-5, f"lse_combine lse row {row}")
        assert_close_rel(o2[row], want_o, 1e-5, f"combine_partials out row {row}")
    return {}


def check_token_shard(rank, world):
    g = _gen(7)
    H, D = 2 * world, 3
    seq_lens = [5, 1, 0, 17, 4 * world, 2 * world + 3]
    N = sum(seq_lens)
    x_full = torch.randn(N, H, D, generator=g)
    hl = H // world
    x = x_full[:, rank * hl:(rank + 1) * hl].contiguous()
    idx = causal_balance_indices(seq_lens, world)
    assert torch.equal(torch.sort(torch.cat(idx)).values, torch.arange(N)), "split is not a permutation"
    # The rule, spelled out: request cut at (j·L)//(2W); rank r takes pieces r and 2W−1−r, in that order.
    want, off = [], 0
    for L in seq_lens:
        b = [(j * L) // (2 * world) for j in range(2 * world + 1)]
        for j in (rank, 2 * world - 1 - rank):
            want += list(range(off + b[j], off + b[j + 1]))
        off += L
    assert idx[rank].tolist() == want
    y = heads_to_tokens(x, seq_lens)
    assert torch.equal(y, x_full[idx[rank]]), "rank does not hold its tokens with every head"
    back = tokens_to_heads(y, seq_lens)
    assert torch.equal(back, x), "round trip is not the identity"
    # Balance: with L = 4W every rank gets exactly 2 pieces of 2 tokens of that request.
    assert sum(1 for i in idx[rank].tolist() if sum(seq_lens[:4]) <= i < sum(seq_lens[:5])) == 4
    return {}


DIST_CHECKS = [check_topk_random, check_topk_one_rank_holds_topk, check_topk_ties,
               check_topk_empty_shards, check_traffic_at_full_k, check_lse_combine, check_token_shard]


# ---------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def results():
    return results_per_world(__name__)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", [f.__name__ for f in DIST_CHECKS])
def test_collective(results, world, check):
    check_result(results(world), check, world)


@pytest.mark.parametrize("world", WORLDS)
def test_merge_traffic_report(results, world, capsys):
    res = results(world)
    with capsys.disabled():
        for name in ("check_topk_one_rank_holds_topk", "check_traffic_at_full_k"):
            info = res.get(name, {}).get("info")
            assert info, f"{name} gave no traffic figures at W={world}"
            print(f"\n[merge traffic W={world} {name}] first round {info['first_round_B_per_row']:.0f} B/row "
                  f"(issue W*ceil(1.5k/W)*4 = {info['issue_B_per_row']}), re-send "
                  f"{info['resend_B_per_row']:.1f} B/row, generic W*k*8 = {info['generic_B_per_row']} B/row")
            assert info["first_round_B_per_row"] == info["issue_B_per_row"]
            if name == "check_traffic_at_full_k":  # random scores at k = 2048: re-sends are rare
                assert info["first_round_B_per_row"] + info["resend_B_per_row"] < info["generic_B_per_row"]


def test_order_keys_preserve_float_order():
    g = _gen(8)
    x = torch.cat([torch.randn(200, generator=g) * 1e3, torch.randn(50, generator=g) * 1e-30,
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45])])
    from k31c.parallel import order_keys
    kx = order_keys(x)
    a, b = x[:, None], x[None, :]
    ka, kb = kx[:, None].to(torch.int64), kx[None, :].to(torch.int64)
    assert torch.equal(ka < kb, a < b) and torch.equal(ka == kb, a == b)
    with pytest.raises(ValueError, match="NaN"):
        order_keys(torch.tensor([1.0, float("nan")]))


def test_combine_partials_all_empty_is_zero_not_nan():
    outs = torch.zeros(3, 2, 4, 5)
    lses = torch.full((3, 2, 4), float("-inf"))
    lses[1, 0] = 0.5  # row 0 has one non-empty shard; row 1 has none
    outs[1, 0] = torch.arange(20.0).view(4, 5) + 1
    o, l = combine_partials(outs, lses)
    assert torch.equal(o[0], outs[1, 0]) and torch.equal(l[0], lses[1, 0])
    assert torch.equal(o[1], torch.zeros(4, 5)) and torch.isneginf(l[1]).all()
